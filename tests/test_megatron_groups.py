"""``lmfuse.megatron``'s vocabulary-parallel cross-entropy with the group omitted: what
Megatron-Core does (its parallel_state's tensor-parallel group) when Megatron is
initialised, one rank without torch.distributed, and a clear error when the default is
ambiguous (several ranks, no Megatron state)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.distributed as dist
from spawn import spawn_gloo

from lmfuse import megatron


def test_default_is_parallel_state_group_when_megatron_is_initialised(monkeypatch) -> None:
    group = object()
    state = types.SimpleNamespace(model_parallel_is_initialized=lambda: True,
                                  get_tensor_model_parallel_group=lambda: group)
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", state)
    assert megatron.default_tp_group("op") is group
    state.model_parallel_is_initialized = lambda: False
    assert megatron.default_tp_group("op") is None  # no torch.distributed: one rank


def _one_rank_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [3, 2, 7], targets and F.cross_entropy's per-token loss (one rank)."""
    logits = torch.randn(3, 2, 7)
    target = torch.randint(0, 7, (3, 2))
    want = torch.nn.functional.cross_entropy(logits.view(-1, 7), target.view(-1),
                                             reduction="none").view(3, 2)
    return logits, target, want


def test_one_process_without_megatron_is_one_rank() -> None:
    logits, target, want = _one_rank_case()
    for fn in (megatron.fused_vocab_parallel_cross_entropy,
               megatron.vocab_parallel_cross_entropy):
        assert torch.allclose(fn(logits, target), want, atol=1e-6)


class _OneRank:
    """A group object that is not a ProcessGroup (Megatron's own tests pass such objects)."""

    def __init__(self, size: int = 1) -> None:
        self._size = size

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return self._size


def test_a_one_rank_group_object_need_not_be_a_process_group() -> None:
    logits, target, want = _one_rank_case()
    for fn in (megatron.fused_vocab_parallel_cross_entropy,
               megatron.vocab_parallel_cross_entropy):
        assert torch.allclose(fn(logits, target, tp_group=_OneRank()), want, atol=1e-6)
        with pytest.raises(TypeError, match="tp_group must be a torch.distributed"):
            fn(logits, target, tp_group=_OneRank(2))
        with pytest.raises(TypeError, match="tp_group must be a torch.distributed"):
            fn(logits, target, tp_group="tp")


def _ambiguous_rank(rank: int, world: int) -> None:
    logits = torch.randn(3, 2, 7)
    target = torch.randint(0, 7, (3, 2))
    for fn in (megatron.fused_vocab_parallel_cross_entropy,
               megatron.vocab_parallel_cross_entropy):
        with pytest.raises(ValueError, match="tp_group was omitted with 2 ranks"):
            fn(logits, target)
    # A group of one rank is explicit: each rank its whole vocabulary.
    mine = dist.new_group([0])
    other = dist.new_group([1])
    one = mine if rank == 0 else other
    out = megatron.fused_vocab_parallel_cross_entropy(logits, target, one)
    assert out.shape == (3, 2)


@pytest.mark.timeout(120)
def test_several_ranks_without_megatron_state_raise() -> None:
    spawn_gloo(2, _ambiguous_rank, timeout=90)
