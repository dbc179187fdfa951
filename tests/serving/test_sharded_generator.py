"""The Generator with its KV cache split over gloo ranks, by context (``cp_group``) or by
batch (``kvdp_group``): every rank must give the single-process tokens
(``model.generate``'s greedy ones), on both kernel paths, also when requests are
preempted in small per-rank pools; seeded sampling gives the same tokens as one process;
only the sharded attention's all-gathers are issued."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import hf_greedy, tiny_causal_lm
from spawn import count_collectives, spawn_gloo

from lmfuse.serving import Generator

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3], list(range(20, 40)), [90, 2, 2, 2, 41]]
NEW = 8


def _cp_rank(rank: int, world: int, family: str, impl: str, num_blocks: int, new: int,
             expected: list[list[int]], sampled: list[list[int]], split: str = "cp",
             prompts: list[list[int]] = PROMPTS, pad: bool = False) -> None:
    model = tiny_causal_lm(family)
    gen = Generator(model, block_len=4, num_blocks=num_blocks, impl=impl,
                    **{f"{split}_group": dist.group.WORLD})
    gen.runner.pad_sharded = pad
    with count_collectives() as calls:
        got = gen.generate(prompts, max_new_tokens=new, eos_token_id=[])
    assert got == expected, (rank, got, expected)
    assert calls, "no collective: the attention did not run context-parallel"
    assert set(calls) <= {"all_gather_into_tensor", "all_gather_single"}, set(calls)
    if num_blocks < 16:
        assert gen.scheduler.preemptions > 0
    assert gen.cache.num_free_blocks == num_blocks and not gen.has_unfinished()
    if sampled:
        got = gen.generate(PROMPTS, max_new_tokens=new, eos_token_id=[], temperature=1.0,
                           seed=3)
        assert got == sampled, (rank, got, sampled)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, family, impl", [(2, "llama", "triton"), (2, "qwen3", "torch"),
                                                 (4, "gemma", "torch")])
def test_cp_generator_gives_the_single_process_tokens(world: int, family: str,
                                                      impl: str) -> None:
    model = tiny_causal_lm(family)
    expected = [hf_greedy(model, p, NEW) for p in PROMPTS]
    sampled = Generator(model, block_len=4, num_blocks=64, impl="torch").generate(
        PROMPTS, max_new_tokens=NEW, eos_token_id=[], temperature=1.0, seed=3)
    spawn_gloo(world, _cp_rank, family, impl, 64, NEW, expected, sampled, timeout=240)


@pytest.mark.timeout(300)
def test_cp_generator_preempts_within_the_per_rank_pool() -> None:
    """Per rank 6 blocks of 4 tokens over 2 ranks (a virtual pool of 6 blocks of 8): the
    four requests (up to 34 tokens, 5 virtual blocks) cannot all run at full length."""
    model = tiny_causal_lm("llama")
    new = 14
    expected = [hf_greedy(model, p, new) for p in PROMPTS]
    spawn_gloo(2, _cp_rank, "llama", "torch", 6, new, expected, [], timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, family, impl", [(2, "llama", "triton"),
                                                 (2, "gemma2", "torch"),
                                                 (4, "gpt_oss", "torch")])
def test_kvdp_generator_gives_the_single_process_tokens(world: int, family: str,
                                                        impl: str) -> None:
    """Sliding windows, Gemma 2's soft-caps and GPT-OSS's sinks run batch-split too."""
    model = tiny_causal_lm(family)
    expected = [hf_greedy(model, p, NEW) for p in PROMPTS]
    spawn_gloo(world, _cp_rank, family, impl, 64, NEW, expected, [], "kvdp", timeout=240)


@pytest.mark.timeout(300)
def test_kvdp_generator_preempts_within_the_per_rank_pools() -> None:
    """10 blocks of 4 tokens a rank: the requests at full length need 5 + 4 + 9 + 5."""
    model = tiny_causal_lm("llama")
    new = 14
    expected = [hf_greedy(model, p, new) for p in PROMPTS]
    spawn_gloo(2, _cp_rank, "llama", "torch", 10, new, expected, [], "kvdp", timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, split", [(2, "cp"), (2, "kvdp"), (4, "kvdp")])
def test_sharded_steps_padded_as_their_cuda_graphs_are(world: int, split: str) -> None:
    """The layout a captured step replays, run eagerly: 5 requests padded to the batch
    bucket 8 (the padding rows write and read nothing), batch-split each rank's rows padded
    to their bucket, power-of-two table widths; on 2 ranks the small pools preempt, so the
    batch shrinks and grows across buckets. The tokens stay the single process's."""
    model = tiny_causal_lm("llama")
    prompts = PROMPTS + [[11, 12]]
    new = 14
    expected = [hf_greedy(model, p, new) for p in prompts]
    blocks = 8 if split == "cp" else 12 if world == 2 else 16  # 16: no preemption
    spawn_gloo(world, _cp_rank, "llama", "triton", blocks, new, expected, [], split, prompts,
               True, timeout=240)


def _eos_rank(rank: int, world: int, split: str, eos: int,
              expected: list[list[int]]) -> None:
    model = tiny_causal_lm("llama")
    for lookahead in (True, False):
        gen = Generator(model, block_len=4, num_blocks=64, impl="triton",
                        **{f"{split}_group": dist.group.WORLD})
        gen.lookahead = lookahead
        got = gen.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=eos)
        assert got == expected, (rank, lookahead, got, expected)
        assert gen.cache.num_free_blocks == 64 and not gen.has_unfinished()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("split", ["cp", "kvdp"])
def test_sharded_lookahead_stops_at_eos(split: str) -> None:
    """Split caches run greedy steps one ahead too: a request ending on its end-of-sequence
    token while the next step is already launched gives the single process's tokens (the
    extra token dropped), with lookahead on and off, and frees every block."""
    model = tiny_causal_lm("llama")
    full = [hf_greedy(model, p, NEW) for p in PROMPTS]
    eos = full[0][2]  # ends the first request early; maybe others too
    expected = [f[:f.index(eos) + 1] if eos in f else f for f in full]
    assert len(expected[0]) == 3 < NEW
    spawn_gloo(2, _eos_rank, split, eos, expected, timeout=240)


def test_sharded_generators_need_a_process_group() -> None:
    for name in ("cp_group", "kvdp_group"):
        with pytest.raises(ValueError, match=f"{name} needs torch.distributed initialised"):
            Generator(tiny_causal_lm("llama"), num_blocks=8, **{name: object()})
    with pytest.raises(ValueError, match="not both"):
        Generator(tiny_causal_lm("llama"), num_blocks=8, cp_group=object(),
                  kvdp_group=object())


def _sliding_rank(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match="sliding-window attention layers"):
        Generator(tiny_causal_lm("gemma2"), num_blocks=8, cp_group=dist.group.WORLD)


@pytest.mark.timeout(120)
def test_cp_refuses_models_with_sliding_windows() -> None:
    spawn_gloo(2, _sliding_rank, timeout=90)


def test_cp_layout_of_a_rank() -> None:
    from lmfuse import PagedKVCache
    from lmfuse.serving.sharded import ContextShards

    shards = ContextShards.__new__(ContextShards)
    shards.world, shards.rank, shards.block_len = 3, 1, 4
    shards.cache = PagedKVCache(4, 4, 1, 1, torch.float32, "cpu")
    # Rank 1 of 3 holds positions 4..7, 16..19, ...
    assert [shards.local_position(p) for p in (0, 3, 4, 7, 8, 16, 19, 20)] == [
        None, None, 0, 3, None, 4, 7, None]
    assert [shards.local_len(n) for n in (0, 4, 5, 8, 12, 17, 25)] == [0, 0, 1, 4, 4, 5, 8]
    assert shards.virtual_cache().block_len == 12


def _unseeded_rank(rank: int, world: int, split: str) -> None:
    model = tiny_causal_lm("llama")
    gen = Generator(model, block_len=4, num_blocks=64, impl="torch",
                    **{f"{split}_group": dist.group.WORLD})
    # No seed: every rank must still draw the same tokens (each drew its own seed, so the
    # ranks sampled apart, and with end tokens finished requests at different steps and
    # left one another inside a collective).
    for eos in ([], list(range(15))):
        got = gen.generate(PROMPTS, max_new_tokens=20, eos_token_id=eos, temperature=1.0)
        every: list[Any] = [None] * world
        dist.all_gather_object(every, got)
        assert all(g == every[0] for g in every), (rank, every)
    rid = gen.add_request([4, 5, 6], max_new_tokens=6, temperature=1.0, eos_token_id=[])
    out: list[int] = []
    while gen.has_unfinished():
        out += [t for r, toks, _ in gen.step() if r == rid for t in toks]
    every = [None] * world
    dist.all_gather_object(every, out)
    assert all(g == every[0] for g in every) and len(out) == 6, (rank, every)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("split", ["cp", "kvdp"])
def test_sharded_unseeded_sampling_agrees_across_ranks(split: str) -> None:
    spawn_gloo(2, _unseeded_rank, split, timeout=240)


def _disagreeing_rank(rank: int, world: int) -> None:
    model = tiny_causal_lm("llama")
    grp = dist.group.WORLD
    cases = [
        (dict(num_blocks=64 if rank == 0 else 9), r"the same num_blocks, or none does.*"
         r"rank 0: 64, rank 1: 9"),
        (dict(num_blocks=64 if rank == 0 else None), r"rank 0: 64, rank 1: none"),
        (dict(num_blocks=64, block_len=4 if rank == 0 else 8), r"the same block_len.*"
         r"rank 0: 4, rank 1: 8"),
        (dict(num_blocks=64, max_batch=8 if rank == 0 else 16), r"the same max_batch"),
        (dict(num_blocks=64, kv_dtype=None if rank == 0 else "fp8"),
         r"the same kv_dtype .*rank 0: float32, rank 1: float8_e4m3fn"),
        # A rank refusing its own arguments before the agreement still joins it.
        (dict(num_blocks=64, block_len=4 if rank == 0 else 0),
         r"rank\(s\) \[1\] .* refused their arguments" if rank == 0
         else r"block_len must be >= 1"),
        (dict(num_blocks=64 if rank == 0 else 0), r"rank\(s\) \[1\] .* refused their "
         "arguments" if rank == 0 else r"num_blocks must be >= 1"),
    ]
    for split in ("kvdp", "cp"):
        for kwargs, match in cases:
            # Every rank raises (none is left waiting in a collective).
            with pytest.raises(ValueError, match=match):
                Generator(model, impl="torch", **kwargs, **{f"{split}_group": grp})
        with pytest.raises(TypeError, match=f"{split}_group must be a torch.distributed."
                                            "ProcessGroup or None, got str"):
            Generator(model, num_blocks=8, **{f"{split}_group": "world"})
    # Defaults agree: the smallest of the ranks' default pools.
    gen = Generator(model, impl="torch", kvdp_group=grp)
    assert gen.cache.num_blocks == 4096


@pytest.mark.timeout(300)
def test_sharded_generators_refuse_disagreeing_settings_on_every_rank() -> None:
    spawn_gloo(2, _disagreeing_rank, timeout=240)
