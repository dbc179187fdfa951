"""``lmfuse.megatron.linear_cross_entropy``: Megatron-Core's fused linear cross-entropy
signature and semantics (flat ``[N]`` loss with ``reduction="none"``, float32 results,
``tp_group=None`` = one rank), single-rank and on gloo ranks with the vocabulary split
(TP) and the tokens split too (sequence parallel), against F.cross_entropy on float32
logits, forward and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import assert_close
from spawn import spawn_gloo

from lmfuse import megatron

N, H, V = (2, 6), 16, 37 * 4  # tokens as [b, s]; V splits over 2 and 4 ranks


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn((*N, H), generator=g) * 0.5
    weight = torch.randn((V, H), generator=g) * 0.5
    labels = torch.randint(0, V, N, generator=g)
    labels[0, 1] = -100
    labels[1, 4] = 7
    return hidden, weight, labels


def reference(hidden, weight, labels, reduction, ignore_index=-100):
    logits = hidden.reshape(-1, H).float() @ weight.float().T
    return F.cross_entropy(logits, labels.reshape(-1), reduction=reduction,
                           ignore_index=ignore_index)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("ignore_index", [-100, 7])
def test_single_rank_matches_float32_logits(reduction: str, ignore_index: int) -> None:
    hidden, weight, labels = inputs()
    labels = labels.masked_fill(labels == -100, ignore_index)  # label 7 is there too
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    got = megatron.linear_cross_entropy(h1, w1, labels, reduction=reduction,
                                        ignore_index=ignore_index)
    want = reference(h2, w2, labels, reduction, ignore_index)
    assert got.dtype == torch.float32 and got.shape == want.shape  # flat [12] for "none"
    assert_close(got, want, torch.float32, "loss")
    g = torch.randn_like(want)
    (got * g).sum().backward()
    (want * g).sum().backward()
    assert_close(h1.grad, h2.grad, torch.float32, "hidden grad")
    assert_close(w1.grad, w2.grad, torch.float32, "weight grad")


@pytest.mark.parametrize("kw, error, match", [
    ({"reduction": "avg"}, ValueError, "reduction must be"),
    ({"sequence_parallel": 1}, TypeError, "sequence_parallel must be a bool"),
    ({"sequence_parallel": True}, ValueError, "needs the tensor-parallel tp_group"),
])
def test_bad_arguments(kw, error, match) -> None:
    hidden, weight, labels = inputs()
    with pytest.raises(error, match=match):
        megatron.linear_cross_entropy(hidden, weight, labels, **kw)


def _tp_rank(rank: int, world: int, sequence_parallel: bool) -> None:
    hidden, weight, labels = inputs(1)
    shard = V // world
    w = weight[rank * shard:(rank + 1) * shard].clone().requires_grad_()
    rows = hidden.reshape(-1, H)
    per = rows.shape[0] // world
    h = (rows[rank * per:(rank + 1) * per] if sequence_parallel else hidden).clone()
    h.requires_grad_()
    for reduction in ("none", "mean", "sum"):
        h.grad, w.grad = None, None
        got = megatron.linear_cross_entropy(h, w, labels, tp_group=dist.group.WORLD,
                                            reduction=reduction,
                                            sequence_parallel=sequence_parallel)
        h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        want = reference(h_ref, w_ref, labels, reduction)
        assert got.shape == want.shape, (got.shape, want.shape)
        assert_close(got, want, torch.float32, f"{reduction} loss")
        g = torch.linspace(0.5, 1.5, want.numel()).reshape(want.shape)
        (got * g).sum().backward()
        (want * g).sum().backward()
        want_h = h_ref.grad.reshape(-1, H)
        if sequence_parallel:
            want_h = want_h[rank * per:(rank + 1) * per]
        assert_close(h.grad.reshape(want_h.shape), want_h, torch.float32, f"{reduction} dh")
        assert_close(w.grad, w_ref.grad[rank * shard:(rank + 1) * shard], torch.float32,
                     f"{reduction} dW")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world, sequence_parallel", [(2, False), (2, True), (4, True)])
def test_tensor_and_sequence_parallel_match_one_rank(world: int,
                                                     sequence_parallel: bool) -> None:
    spawn_gloo(world, _tp_rank, sequence_parallel, timeout=120)
