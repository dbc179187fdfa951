"""KV-data-parallel and context-parallel decode attention (``lmfuse.distributed``) on gloo
ranks.

Every rank builds the same full problem from one seed: queries ``[B, s_active, Hq, D]``,
contiguous caches ``[B, S_max, Hkv, D]`` (NaN past each sequence's length, so a read past
it shows), lengths, sinks, fp8 scales; and the single-rank answer,
``decode_attention(..., impl="torch")`` on the unsharded caches (the oracle). Then it cuts
its own share out of the full problem with the layouts written out here independently of
the ops (KVDP: ``torch.tensor_split`` of the batch and rank-major heads; CP: global position
``p`` on rank ``(p // cp_block) % W``, in order), contiguous or as a paged pool (shuffled
block ids, NaN spare blocks, -1 padding), and checks the parallel op's result against the
oracle's, and the number of collectives it issued.

Lengths: a CP rank passes its own token counts (``seqlens_shard``; for KVDP x CP,
``seqlens_local``), counted here from the layout, and in some cases the global lengths as
``cache_seqlens=`` too: without them the op issues exactly one all-reduce more (the counts'
sum), with them none.

Covered: ragged lengths (active tokens straddling CP ranks in every way), s_active 1, 3,
8, GQA and MQA, fp8 caches with scales, sinks, LSEs, uneven batches (a KVDP rank with no
sequence), the Triton path (interpreter) and the reference path, a 2 x 2 KVDP x CP grid,
appends (each token on the right rank and position, equal to the single-rank append), and
bad inputs (wrong-shaped or inconsistent lengths among them) raising on every rank without
hanging, on a 2 x 2 grid too.

Each spawn costs seconds, so one spawn runs a whole sweep and reports every failing case.
``tests/gpu/sharded_decode_nccl.py`` runs these checks on NCCL ranks (GPU tensors, realistic
head dims), importing the helpers here (``device=`` / ``head_dim=`` arguments).
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from helpers import assert_close, to_paged
from spawn import Failures, count_collectives, spawn_gloo

import lmfuse
from lmfuse.distributed import (cp_cache_append, cp_decode_attention, cp_shard_seqlens,
                                kvdp_batch_range, kvdp_cache_append, kvdp_decode_attention)

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
FP8 = torch.float8_e4m3fn
I32 = torch.int32
NAN = float("nan")
ALL_GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_single", "allgather",
               "_allgather_base")
ALL_REDUCES = ("all_reduce", "allreduce")
ALL_TO_ALLS = ("all_to_all", "all_to_all_single", "alltoall", "alltoall_base")
D = 16


# --- the full problem and its oracle ---------------------------------------------------------


def full_problem(seed: int, lens: list[int], s_active: int, hq: int, hkv: int, s_max: int,
                 dtype: torch.dtype, fp8: bool = False, sinks: bool = False, *,
                 head_dim: int = D, device: Any = "cpu") -> dict[str, Any]:
    """Identical on every rank for one seed (drawn on the CPU, then moved to ``device``,
    where the oracle is computed)."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    q = torch.randn((B, s_active, hq, head_dim), generator=g).to(dtype)
    caches = []
    for _ in range(2):
        x = torch.randn((B, s_max, hkv, head_dim), generator=g) * (2.0 if fp8 else 1.0)
        for b, length in enumerate(lens):
            x[b, length:] = NAN
        caches.append(x.to(FP8 if fp8 else dtype))
    p = dict(q=q, k=caches[0], v=caches[1], lens=torch.tensor(lens, dtype=I32),
             sinks=torch.randn((hq,), generator=g) * 2.0 if sinks else None,
             k_scale=torch.rand((hkv,), generator=g) * 1.5 + 0.25 if fp8 else None,
             v_scale=torch.rand((hkv,), generator=g) * 1.5 + 0.25 if fp8 else None)
    p = {name: None if t is None else t.to(device) for name, t in p.items()}
    p["want"], p["want_lse"] = lmfuse.decode_attention(
        p["q"], p["k"], p["v"], p["lens"], sinks=p["sinks"], k_scale=p["k_scale"],
        v_scale=p["v_scale"], return_lse=True, impl="torch")
    return p


def cp_positions(rank: int, world: int, cp_block: int, s_max: int) -> list[int]:
    """The global positions rank ``rank`` holds, in local order."""
    return [p for p in range(s_max) if (p // cp_block) % world == rank]


def cp_local_lens(lens: list[int], rank: int, world: int, cp_block: int) -> list[int]:
    """How many tokens of each sequence rank ``rank`` holds (counted position by position)."""
    return [sum(1 for p in range(n) if (p // cp_block) % world == rank) for n in lens]


def cp_counts(lens: Any, rank: int, world: int, cp_block: int,
              dtype: torch.dtype = I32) -> torch.Tensor:
    """:func:`cp_local_lens` as the ``[B]`` tensor a rank passes as ``seqlens_shard`` (on
    ``lens``' device when it is a tensor)."""
    device = lens.device if isinstance(lens, torch.Tensor) else None
    lens = lens.tolist() if isinstance(lens, torch.Tensor) else lens
    return torch.tensor(cp_local_lens(lens, rank, world, cp_block), dtype=dtype, device=device)


def layout(k: torch.Tensor, v: torch.Tensor, lens: list[int], block_len: Optional[int],
           seed: int) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    if block_len is None:
        return k, v, None
    (pk, pv), table = to_paged((k.cpu(), v.cpu()), lens, block_len,
                               generator=torch.Generator().manual_seed(seed))
    return pk.to(k.device), pv.to(k.device), table.to(k.device)


def cp_shard(p: dict[str, Any], rank: int, world: int, cp_block: int,
             block_len: Optional[int], seed: int):
    """This rank's CP shard of the full caches: ``(k, v, table)``."""
    own = cp_positions(rank, world, cp_block, p["k"].shape[1])
    local = cp_local_lens(p["lens"].tolist(), rank, world, cp_block)
    return layout(p["k"][:, own], p["v"][:, own], local, block_len, seed + rank)


def lens_reduces(given: Any, q: torch.Tensor) -> int:
    """All-reduces of the lengths a CP decode issues: one when the global lengths are not
    ``given`` and ``q`` has several active tokens (one token needs only the counts)."""
    return 0 if given or q.shape[1] == 1 else 1


def assert_collectives(calls: list[str], n_gathers: int, n_reduces: int = 0,
                       n_all_to_alls: int = 0) -> None:
    gathers = sum(c in ALL_GATHERS for c in calls)
    reduces = sum(c in ALL_REDUCES for c in calls)
    a2as = sum(c in ALL_TO_ALLS for c in calls)
    want = (n_gathers, n_reduces, n_all_to_alls, n_gathers + n_reduces + n_all_to_alls)
    assert (gathers, reduces, a2as, len(calls)) == want, (
        f"issued {calls}, expected {n_gathers} all-gather(s), {n_reduces} all-reduce(s)"
        + (f" and {n_all_to_alls} all-to-all(s)" if n_all_to_alls else ""))


def check_result(f: Failures, what: str, got: Any, want: torch.Tensor, want_lse: torch.Tensor,
                 calls: list[str], n_gathers: int, dtype: torch.dtype,
                 n_reduces: int = 0) -> None:
    def compare() -> None:
        assert_collectives(calls, n_gathers, n_reduces)
        out, lse = got
        assert out.dtype == dtype and lse.dtype == want_lse.dtype, (out.dtype, lse.dtype)
        assert_close(out, want, dtype, f"{what}: out")
        assert_close(lse, want_lse, want_lse.dtype, f"{what}: lse")

    f.check(what, compare)


# --- context parallelism ---------------------------------------------------------------------

# (lens, s_active, hq, hkv, cp_block, block_len, dtype, fp8, sinks, impl)
CP_CASES = [
    ([9, 14, 3], 1, 4, 2, 1, None, F32, False, True, "triton"),
    ([8, 13, 21], 3, 4, 2, 1, 4, F32, False, False, "triton"),
    ([8, 17, 23], 8, 4, 2, 3, None, F32, True, True, "triton"),
    ([8, 10, 22], 8, 4, 1, 1, 3, F16, False, True, "torch"),
    ([5, 12, 19], 3, 4, 2, 4, 4, F16, True, False, "torch"),
    ([3, 16, 11], 3, 8, 2, 2, None, F32, False, True, "torch"),
    ([24, 9, 8], 8, 4, 2, 5, 5, F32, True, True, "torch"),
    ([1, 2, 7], 1, 4, 4, 1, 2, F32, False, False, "torch"),
    ([10, 4, 15], 3, 4, 2, 2, None, BF16, False, True, "torch"),
    ([6, 18, 9], 3, 4, 2, 1, 4, F64, False, True, "auto"),
]


def _cp_rank(rank: int, world_size: int) -> None:
    f = Failures(rank)
    group = dist.group.WORLD
    for i, (lens, s, hq, hkv, blk, bl, dtype, fp8, sinks, impl) in enumerate(CP_CASES):
        if world_size == 4 and impl == "triton" and i > 0:
            impl = "torch"  # four ranks share two cores: the interpreter once is enough
        what = (f"cp{world_size} lens={lens} s={s} hq={hq} hkv={hkv} cp_block={blk} "
                f"{'contig' if bl is None else f'paged{bl}'} {str(dtype)[6:]} "
                f"{'fp8 ' if fp8 else ''}{'sinks ' if sinks else ''}{impl}")
        seed = 100 + i
        p = full_problem(seed, lens, s, hq, hkv, 24, dtype, fp8, sinks)
        k, v, table = cp_shard(p, rank, world_size, blk, bl, seed)
        local = cp_counts(lens, rank, world_size, blk, I32 if i % 3 else torch.int64)
        # Every other case passes the global lengths: no all-reduce of the counts then.
        given = dict(cache_seqlens=p["lens"]) if i % 2 == 0 else {}
        what += " cache_seqlens" if given else " counts only"
        with count_collectives() as calls:
            got = cp_decode_attention(p["q"], k, v, local, group=group,
                                      block_table_shard=table, cp_block=blk, sinks=p["sinks"],
                                      k_scale=p["k_scale"], v_scale=p["v_scale"],
                                      return_lse=True, impl=impl, **given)
        check_result(f, what, got, p["want"], p["want_lse"], calls, 1, dtype,
                     n_reduces=lens_reduces(given, p["q"]))
        counts = cp_shard_seqlens(p["lens"], group=group, cp_block=blk)
        f.check(f"{what}: cp_shard_seqlens", lambda counts=counts, lens=lens, blk=blk: (
            assert_equal(counts.tolist(), cp_local_lens(lens, rank, world_size, blk))))

    # Without return_lse: the output alone; and split keys.
    p = full_problem(7, [11, 6], 3, 4, 2, 16, F32)
    k, v, table = cp_shard(p, rank, world_size, 2, None, 7)
    out = cp_decode_attention(p["q"], k, v, cp_counts(p["lens"], rank, world_size, 2),
                              group=group, cp_block=2, num_splits=2, impl="torch")
    f.check(f"cp{world_size} out only", lambda: assert_close(out, p["want"], F32, "out only"))

    check_cp_appends(f, group, rank, world_size)
    f.raise_if_any()


def assert_equal(a: Any, b: Any) -> None:
    assert a == b, f"{a} != {b}"


def check_cp_appends(f: Failures, group: Any, rank: int, world: int) -> None:
    """Decoding steps: each appends ``s`` tokens (cp_cache_append) then attends
    (cp_decode_attention), against the same on the unsharded cache; the shards must equal
    the full cache's positions cut by the layout, bit for bit."""
    cases = [(3, 1, None, F32, False, "triton"), (3, 3, 4, F32, True, "triton"),
             (1, 2, 3, F16, True, "torch"), (8, 3, None, F32, False, "torch")]
    for i, (s, blk, bl, dtype, fp8, impl) in enumerate(cases):
        if world == 4 and impl == "triton" and i > 0:
            impl = "torch"
        what = (f"cp{world} append+decode s={s} cp_block={blk} "
                f"{'contig' if bl is None else f'paged{bl}'} {str(dtype)[6:]} "
                f"{'fp8 ' if fp8 else ''}{impl}")
        start = [5, 9, 12]
        steps = 2
        s_max = max(start) + s * steps + 3
        p = full_problem(300 + i, start, s, 4, 2, s_max, dtype, fp8)
        g = torch.Generator().manual_seed(400 + i)
        new_k = torch.randn((steps, len(start), s, 2, D), generator=g).to(dtype)
        new_v = torch.randn((steps, len(start), s, 2, D), generator=g).to(dtype)
        full_k, full_v = p["k"].clone(), p["v"].clone()
        own = cp_positions(rank, world, blk, s_max)
        final = [n + s * steps for n in start]
        # The shard's capacity covers the final lengths; paged: blocks reserved for them.
        k, v = full_k[:, own].clone(), full_v[:, own].clone()
        table = None
        if bl is not None:
            (k, v, table) = layout(k, v, cp_local_lens(final, rank, world, blk), bl, 500 + i)
        lens = p["lens"].clone()
        for step in range(steps):
            kw = dict(k_scale=p["k_scale"], v_scale=p["v_scale"])
            lmfuse.kv_cache_append(full_k, full_v, new_k[step], new_v[step], lens, impl=impl,
                                   **kw)
            with count_collectives() as calls:
                cp_cache_append(k, v, new_k[step], new_v[step], lens, group=group,
                                block_table_shard=table, cp_block=blk, impl=impl, **kw)
            lens = lens + s
            want, want_lse = lmfuse.decode_attention(p["q"], full_k, full_v, lens,
                                                     return_lse=True, impl="torch", **kw)
            given = dict(cache_seqlens=lens) if step == 1 else {}
            with count_collectives() as dcalls:
                got = cp_decode_attention(p["q"], k, v, cp_counts(lens, rank, world, blk),
                                          group=group, block_table_shard=table, cp_block=blk,
                                          return_lse=True, impl=impl, **given, **kw)
            check_result(f, f"{what} step {step}", got, want, want_lse, dcalls, 1, dtype,
                         n_reduces=lens_reduces(given, p["q"]))

            def placed(k=k, v=v, table=table, calls=calls, lens=lens, full_k=full_k.clone(),
                       full_v=full_v.clone()) -> None:
                assert calls == [], f"the append issued {calls}"
                local = cp_local_lens(lens.tolist(), rank, world, blk)
                for b, n in enumerate(local):
                    for got_c, full in ((k, full_k), (v, full_v)):
                        if table is None:
                            rows = got_c[b, :n]
                        else:
                            ids = table[b, :-(-n // bl)].long()
                            rows = got_c[ids].reshape(-1, 2, D)[:n]
                        want_rows = full[b, own[:n]]
                        assert torch.equal(rows.view(torch.uint8), want_rows.view(torch.uint8)), (
                            f"sequence {b}: the shard's first {n} rows differ")

            f.check(f"{what} step {step}: placement", placed)


# --- KV data parallelism -----------------------------------------------------------------

# (B, lens seed, s_active, hq_local, hkv, block_len, dtype, fp8, sinks, impl)
KVDP_CASES = [
    (3, 1, 2, 2, None, F32, False, True, "triton"),
    (5, 3, 2, 2, 4, F32, True, False, "triton"),
    (4, 8, 1, 1, 3, F16, False, True, "torch"),
    (6, 3, 2, 4, None, F16, True, True, "torch"),
    (3, 8, 2, 2, 5, F32, False, False, "torch"),
    (5, 3, 2, 2, None, BF16, False, True, "torch"),
]


def kvdp_share(p: dict[str, Any], B: int, rank: int, world: int, hq_local: int,
               block_len: Optional[int], seed: int):
    """This rank's q heads, its sequences' caches and lengths, and its slice of the oracle."""
    rows = torch.tensor_split(torch.arange(B), world)[rank].tolist()
    lens = p["lens"][rows]
    k, v, table = layout(p["k"][rows], p["v"][rows], lens.tolist(), block_len, seed + rank)
    heads = slice(rank * hq_local, (rank + 1) * hq_local)
    return p["q"][:, :, heads], k, v, lens, table, heads, rows


def _kvdp_rank(rank: int, world_size: int) -> None:
    f = Failures(rank)
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(11)
    for i, (B, s, hq_local, hkv, bl, dtype, fp8, sinks, impl) in enumerate(KVDP_CASES):
        if world_size == 4 and impl == "triton" and i > 0:
            impl = "torch"
        hq = hq_local * world_size
        lens = torch.randint(s, 20, (B,), generator=g).tolist()
        what = (f"kvdp{world_size} B={B} lens={lens} s={s} hq={hq_local}x{world_size} "
                f"hkv={hkv} {'contig' if bl is None else f'paged{bl}'} {str(dtype)[6:]} "
                f"{'fp8 ' if fp8 else ''}{'sinks ' if sinks else ''}{impl}")
        seed = 200 + i
        p = full_problem(seed, lens, s, hq, hkv, 20, dtype, fp8, sinks)
        q, k, v, local_lens, table, heads, rows = kvdp_share(p, B, rank, world_size, hq_local,
                                                             bl, seed)
        f.check(f"{what}: kvdp_batch_range", lambda rows=rows, B=B: assert_equal(
            list(range(*kvdp_batch_range(B, group))), rows))
        with count_collectives() as calls:
            got = kvdp_decode_attention(q, k, v, local_lens, group=group, block_table_local=table,
                                        sinks=p["sinks"], k_scale=p["k_scale"],
                                        v_scale=p["v_scale"], return_lse=True, impl=impl)
        check_result(f, what, got, p["want"][:, :, heads], p["want_lse"][:, :, heads], calls, 2,
                     dtype)
        with count_collectives() as calls:  # cache_seqlens: unused without cp_group
            out = kvdp_decode_attention(q, k, v, local_lens, group=group, block_table_local=table,
                                        sinks=p["sinks"], k_scale=p["k_scale"],
                                        v_scale=p["v_scale"], impl="torch",
                                        cache_seqlens=local_lens)
        f.check(f"{what}: out only", lambda out=out, p=p, heads=heads, dtype=dtype, calls=calls: (
            assert_equal(len(calls), 2), assert_close(out, p["want"][:, :, heads], dtype, "out")))

    # Appends: each rank gives its KV heads for every sequence; its own sequences' caches
    # must come out as the single-rank append's rows, bit for bit.
    for i, (B, s, bl, fp8) in enumerate([(3, 3, None, False), (5, 2, 4, True)]):
        what = f"kvdp{world_size} append B={B} s={s} {'paged' if bl else 'contig'} fp8={fp8}"
        hkv_local, hkv = 1, world_size
        lens = torch.randint(1, 9, (B,), generator=g)
        p = full_problem(600 + i, lens.tolist(), 1, hkv, hkv, 12, F32, fp8)
        new_k = torch.randn((B, s, hkv, D), generator=g)
        new_v = torch.randn((B, s, hkv, D), generator=g)
        full_k, full_v = p["k"].clone(), p["v"].clone()
        kw = dict(k_scale=p["k_scale"], v_scale=p["v_scale"], impl="torch")
        lmfuse.kv_cache_append(full_k, full_v, new_k, new_v, p["lens"], **kw)
        rows = torch.tensor_split(torch.arange(B), world_size)[rank].tolist()
        after = (p["lens"][rows] + s).tolist()
        k, v, table = layout(p["k"][rows], p["v"][rows], after, bl, 700 + rank)
        mine = slice(rank * hkv_local, (rank + 1) * hkv_local)
        with count_collectives() as calls:
            kvdp_cache_append(k, v, new_k[:, :, mine], new_v[:, :, mine], p["lens"][rows],
                              group=group, block_table_local=table, **kw)
        want_k, want_v, _ = layout(full_k[rows], full_v[rows], after, bl, 700 + rank)

        def same(k=k, v=v, want_k=want_k, want_v=want_v, calls=calls) -> None:
            assert len(calls) == 1 and calls[0] in ALL_GATHERS, calls
            for a, b in ((k, want_k), (v, want_v)):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "caches differ"

        f.check(what, same)
    f.raise_if_any()


# --- KVDP x CP grid ----------------------------------------------------------------------


def _grid_rank(rank: int, world_size: int) -> None:
    """Ranks ``2 * i + j``: KVDP rank ``i`` (groups {0, 2} and {1, 3}), CP rank ``j`` (groups
    {0, 1} and {2, 3}). Heads split over KVDP, sequences over KVDP, context over CP."""
    f = Failures(rank)
    # new_group is collective over the world: every rank creates every group, in one order.
    kvdp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    cp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    i, j = rank // 2, rank % 2
    kvdp, cp = kvdp_groups[j], cp_groups[i]
    cases = [(3, 3, 2, 2, None, F32, False, True, "triton"),
             (5, 8, 2, 2, 4, F32, True, True, "torch"),
             (4, 1, 1, 2, 3, F16, False, False, "torch")]
    g = torch.Generator().manual_seed(5)
    for n, (B, s, hq_local, blk, bl, dtype, fp8, sinks, impl) in enumerate(cases):
        lens = torch.randint(s, 22, (B,), generator=g).tolist()
        what = (f"grid B={B} lens={lens} s={s} cp_block={blk} "
                f"{'contig' if bl is None else f'paged{bl}'} {str(dtype)[6:]} "
                f"{'fp8 ' if fp8 else ''}{impl}")
        p = full_problem(800 + n, lens, s, hq_local * 2, 2, 22, dtype, fp8, sinks)
        rows = torch.tensor_split(torch.arange(B), 2)[i].tolist()
        sub = dict(k=p["k"][rows], v=p["v"][rows], lens=p["lens"][rows])
        k, v, table = cp_shard(sub, j, 2, blk, bl, 900 + n + 10 * i)
        heads = slice(i * hq_local, (i + 1) * hq_local)
        # seqlens_local: this rank's CP-shard counts of its sequences; the global lengths
        # of its sequences as cache_seqlens in every other case.
        local = cp_counts(sub["lens"], j, 2, blk)
        given = dict(cache_seqlens=sub["lens"]) if n % 2 == 0 else {}
        with count_collectives() as calls:
            got = kvdp_decode_attention(p["q"][:, :, heads], k, v, local, group=kvdp,
                                        block_table_local=table, cp_group=cp, cp_block=blk,
                                        sinks=p["sinks"], k_scale=p["k_scale"],
                                        v_scale=p["v_scale"], return_lse=True, impl=impl,
                                        **given)
        check_result(f, f"{what}{' cache_seqlens' if given else ''}", got, p["want"][:, :, heads],
                     p["want_lse"][:, :, heads], calls, 3, dtype,
                     n_reduces=lens_reduces(given, p["q"]))

    # Two decoding steps on the grid: append (kvdp_cache_append with cp_group), then attend;
    # the global lengths given to the append in step 1, to the attention in step 0.
    B, s, blk = 3, 3, 2
    lens = torch.tensor([6, 9, 4], dtype=I32)
    p = full_problem(950, lens.tolist(), s, 4, 2, 16, F32)
    full_k, full_v = p["k"].clone(), p["v"].clone()
    rows = torch.tensor_split(torch.arange(B), 2)[i].tolist()
    k, v, _ = cp_shard(dict(k=p["k"][rows], v=p["v"][rows], lens=lens[rows]), j, 2, blk, None, 0)
    kv_heads, heads = slice(i, i + 1), slice(2 * i, 2 * i + 2)
    for step in range(2):
        new_k = torch.randn((B, s, 2, D), generator=g)
        new_v = torch.randn((B, s, 2, D), generator=g)
        lmfuse.kv_cache_append(full_k, full_v, new_k, new_v, lens, impl="torch")
        given = dict(cache_seqlens=lens[rows]) if step == 1 else {}
        with count_collectives() as acalls:
            kvdp_cache_append(k, v, new_k[:, :, kv_heads], new_v[:, :, kv_heads],
                              cp_counts(lens[rows], j, 2, blk), group=kvdp, cp_group=cp,
                              cp_block=blk, impl="torch", **given)
        f.check(f"grid append step {step}", lambda acalls=acalls, step=step: (
            assert_collectives(acalls, 1, 1 - step)))
        lens = lens + s
        want, want_lse = lmfuse.decode_attention(p["q"], full_k, full_v, lens, return_lse=True,
                                                 impl="torch")
        given = dict(cache_seqlens=lens[rows]) if step == 0 else {}
        with count_collectives() as calls:
            got = kvdp_decode_attention(p["q"][:, :, heads], k, v,
                                        cp_counts(lens[rows], j, 2, blk), group=kvdp,
                                        cp_group=cp, cp_block=blk, return_lse=True,
                                        impl="torch", **given)
        check_result(f, f"grid append+decode step {step}", got, want[:, :, heads],
                     want_lse[:, :, heads], calls, 3, F32, n_reduces=step)

    # Bad input on one rank of the grid, with check_ranks: all four ranks raise (the bad
    # rank's KVDP column over KVDP, then every row over CP), none waits.
    q, good = p["q"][:, :, heads], cp_counts(lens[rows], j, 2, blk)
    bad = good[:0] if rank == 0 else good
    raises(f, "grid seqlens_local bad on rank 0", lambda: kvdp_decode_attention(
        q, k, v, bad, group=kvdp, cp_group=cp, cp_block=blk, check_ranks=True),
        ValueError, r"seqlens_local must be \[B_r=2\]" if rank == 0 else
        r"rank 0 of the group rejected its inputs.*seqlens_local must be", 2)
    # The global lengths passed as seqlens_local (not this rank's share): caught by the
    # value checks of check_ranks when cache_seqlens is given.
    raises(f, "grid global lengths as seqlens_local", lambda: kvdp_decode_attention(
        q, k, v, lens[rows], group=kvdp, cp_group=cp, cp_block=blk, cache_seqlens=lens[rows],
        check_ranks=True), ValueError, rf"seqlens_local\[0\] = \d+ is not rank {j}'s share", 2)
    f.raise_if_any()


# --- bad inputs ----------------------------------------------------------------------------


def raises(f: Failures, what: str, fn, kind: type, match: str, n_calls: int) -> None:
    def check() -> None:
        with count_collectives() as calls:
            with pytest.raises(kind, match=match):
                fn()
        assert len(calls) == n_calls, f"issued {calls}, expected {n_calls} collective(s)"

    f.check(what, check)


def _errors_rank(rank: int, world_size: int) -> None:
    f = Failures(rank)
    check_bad_inputs(f, dist.group.WORLD)
    f.raise_if_any()


def check_bad_inputs(f: Any, group: Any, device: Any = "cpu") -> None:
    """Every rank of ``group`` (two ranks) must raise (and none hang): the same bad input
    everywhere raises before any collective; input bad on one rank, or differing across
    ranks, raises on all of them with ``check_ranks=True`` (after one small all-gather).
    ``f.check(what, fn)`` runs each case (a :class:`Failures`)."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    p = full_problem(1, [9, 12], 3, 4, 2, 16, F32, device=device)
    k, v, table = cp_shard(p, rank, world_size, 1, None, 1)
    q, lens = p["q"], p["lens"]
    local = cp_counts(lens, rank, world_size, 1)

    # The same bad input on every rank: raises at once, no collective.
    raises(f, "cp window", lambda: cp_decode_attention(q, k, v, local, group=group,
                                                       window_size=4),
           ValueError, "window_size is not supported", 0)
    raises(f, "cp short seqlens_shard", lambda: cp_decode_attention(q, k, v, local[:1],
                                                                    group=group),
           ValueError, r"cp_decode_attention: seqlens_shard must be \[B=2\], got \(1,\)", 0)
    raises(f, "cp 2-D seqlens_shard", lambda: cp_decode_attention(q, k, v, local[None],
                                                                  group=group),
           ValueError, "seqlens_shard must be 1-D", 0)
    raises(f, "cp float seqlens_shard", lambda: cp_decode_attention(q, k, v, local.float(),
                                                                    group=group),
           TypeError, "seqlens_shard must have dtype", 0)
    raises(f, "cp short cache_seqlens", lambda: cp_decode_attention(
        q, k, v, local, group=group, cache_seqlens=lens[:1]),
        ValueError, r"cp_decode_attention: cache_seqlens must be \[B=2\], got \(1,\)", 0)
    raises(f, "cp cp_block 0", lambda: cp_decode_attention(q, k, v, local, group=group,
                                                           cp_block=0),
           ValueError, "cp_block must be >= 1", 0)
    raises(f, "cp sinks shape", lambda: cp_decode_attention(q, k, v, local, group=group,
                                                            sinks=q.new_zeros(3)),
           ValueError, r"sinks must be \[Hq=4\]", 0)
    with torch.enable_grad():
        qg = q.clone().requires_grad_(True)
        raises(f, "cp grad", lambda: cp_decode_attention(qg, k, v, local, group=group),
               ValueError, "no backward", 0)
    raises(f, "cp append heads", lambda: cp_cache_append(
        k, v, q.new_zeros(2, 1, 3, D), q.new_zeros(2, 1, 3, D), lens, group=group),
        ValueError, r"\[Hkv, D\]", 0)
    # A token this rank owns whose block is -1 in a row that is not all padding: refused on
    # both paths (it was dropped), as kv_cache_append refuses it; nothing is written.
    # (Unchecked CUDA calls skip such a token instead: only the reference path there.)
    pool = q.new_zeros(4, 2, 2, D)
    holey = torch.tensor([[0, -1], [1, 2]], dtype=I32, device=q.device)
    for impl in ("torch", "triton") if q.is_cpu else ("torch",):
        raises(f, f"cp append into block -1 ({impl})", lambda: cp_cache_append(
            pool, pool.clone(), q.new_ones(2, 2, 2, D), q.new_ones(2, 2, 2, D),
            torch.tensor([4, 0], device=q.device), group=group, block_table_shard=holey,
            impl=impl),
            ValueError, rf"new token {rank} of sequence 0 goes to this rank \(rank {rank}\) "
            r"at local position 2, in block_table_shard\[0, 1\] = -1", 0)

        def untouched() -> None:
            assert bool((pool == 0).all())
        f.check(f"cp append into block -1 ({impl}) wrote nothing", untouched)
    # A table of no column is no padding (every row of it was taken for one): refused.
    raises(f, "cp append into a table of no column", lambda: cp_cache_append(
        pool, pool.clone(), q.new_ones(2, 2, 2, D), q.new_ones(2, 2, 2, D),
        torch.tensor([4, 0], device=q.device), group=group,
        block_table_shard=torch.zeros(2, 0, dtype=I32, device=q.device), impl="torch"),
        ValueError, "past the shard's capacity of 0", 0)
    for name, call in (
            ("cp_decode_attention", lambda: cp_decode_attention(q, k, v, local, group="g")),
            ("cp_cache_append", lambda: cp_cache_append(k, v, k[:, :1], v[:, :1], lens,
                                                        group=3)),
            ("cp_shard_seqlens", lambda: cp_shard_seqlens(lens, group=object())),
            ("kvdp_batch_range", lambda: kvdp_batch_range(2, "g")),
            ("kvdp_decode_attention", lambda: kvdp_decode_attention(q, k, v, lens, group=group,
                                                                    cp_group="g"))):
        raises(f, f"{name} group of the wrong type", call, TypeError,
               rf"{name}: (cp_)?group must be a torch.distributed.ProcessGroup or None, got", 0)

    kq = q[:, :, 2 * rank:2 * rank + 2]
    rows = torch.tensor_split(torch.arange(2), world_size)[rank].tolist()
    lk, lv = p["k"][rows], p["v"][rows]
    raises(f, "kvdp whole cache", lambda: kvdp_decode_attention(kq, p["k"], p["v"], lens,
                                                                group=group),
           ValueError, r"holds sequences \[\d, \d\) of B=2", 0)
    lk3, lv3 = torch.cat([lk, lk[:, :, :1]], dim=2), torch.cat([lv, lv[:, :, :1]], dim=2)
    raises(f, "kvdp GQA", lambda: kvdp_decode_attention(kq, lk3, lv3, lens[rows], group=group),
           ValueError, "multiple of the caches' KV heads", 0)
    raises(f, "kvdp sinks of own heads only", lambda: kvdp_decode_attention(
        kq, lk, lv, lens[rows], group=group, sinks=q.new_zeros(2)),
        ValueError, r"sinks must be \[Hq=4\]", 0)
    raises(f, "kvdp whole-batch cache_seqlens", lambda: kvdp_decode_attention(
        kq, lk, lv, lens[rows], group=group, cache_seqlens=lens),
        ValueError, r"cache_seqlens must be \[B_r=1\] \(this rank holds sequences", 0)
    raises(f, "kvdp append heads", lambda: kvdp_cache_append(
        lk, lv, q.new_zeros(2, 1, 2, D), q.new_zeros(2, 1, 2, D), lens[rows], group=group),
        ValueError, "KV heads", 0)
    raises(f, "kvdp append short cache_seqlens", lambda: kvdp_cache_append(
        lk, lv, q.new_zeros(2, 1, 1, D), q.new_zeros(2, 1, 1, D), lens[rows], group=group,
        cp_group=group, cache_seqlens=lens[:0]),
        ValueError, r"cache_seqlens must be \[B_r=1\]", 0)

    # Bad on rank 1 only, or disagreeing: every rank raises after one small all-gather.
    bad_local = local[:1] if rank == 1 else local
    raises(f, "cp seqlens_shard bad on rank 1", lambda: cp_decode_attention(
        q, k, v, bad_local, group=group, check_ranks=True),
        ValueError, "seqlens_shard must be" if rank == 1 else
        "rank 1 of the group rejected its inputs.*seqlens_shard must be", 1)
    bad_lens = lens[:1] if rank == 0 else lens
    raises(f, "cp cache_seqlens bad on rank 0", lambda: cp_decode_attention(
        q, k, v, local, group=group, cache_seqlens=bad_lens, check_ranks=True),
        ValueError, "cache_seqlens must be" if rank == 0 else
        "rank 0 of the group rejected its inputs.*cache_seqlens must be", 1)
    only_0 = dict(cache_seqlens=lens) if rank == 0 else {}
    raises(f, "cp cache_seqlens on one rank", lambda: cp_decode_attention(
        q, k, v, local, group=group, check_ranks=True, **only_0),
        ValueError, r"disagree on cache_seqlens \(given or not\): \[1, 0\]", 1)
    # The global lengths where the rank's counts belong: every rank rejects its own.
    raises(f, "cp global lengths as seqlens_shard", lambda: cp_decode_attention(
        q, k, v, lens, group=group, cache_seqlens=lens, check_ranks=True),
        ValueError, rf"seqlens_shard\[0\] = 9 is not rank {rank}'s share of "
        r"cache_seqlens\[0\] = 9", 1)
    # KVDP over one rank composed with CP over the group: the CP check still reaches all.
    raises(f, "kvdp x cp seqlens_local bad on rank 1", lambda: kvdp_decode_attention(
        q, k, v, bad_local, group=None, cp_group=group, check_ranks=True),
        ValueError, r"seqlens_local must be \[B_r=2\]" if rank == 1 else
        "over cp_group: rank 1 of the group rejected its inputs.*seqlens_local must be", 1)
    q16 = q.half() if rank == 1 else q
    raises(f, "cp dtype bad on rank 1", lambda: cp_decode_attention(
        q16, k, v, local, group=group, check_ranks=True), TypeError, "dtype", 1)
    q_s = q[:, 1:] if rank == 0 else q
    raises(f, "cp s_active differs", lambda: cp_decode_attention(
        q_s, k, v, local, group=group, check_ranks=True),
        ValueError, r"disagree on s_active: \[2, 3\]", 1)
    half = (q.half(), k.half(), v.half()) if rank == 1 else (q, k, v)
    raises(f, "cp dtype differs", lambda: cp_decode_attention(
        *half, local, group=group, check_ranks=True),
        ValueError, r"disagree on query dtype: \['float32', 'float16'\]", 1)
    sinks = q.new_zeros(4) if rank == 0 else None
    raises(f, "cp sinks on one rank", lambda: cp_decode_attention(
        q, k, v, local, group=group, sinks=sinks, check_ranks=True),
        ValueError, "disagree on sinks", 1)
    # Options the ranks must share (each rank alone would accept its own): refused on every
    # rank, the differing values shown.
    raises(f, "cp softcap on one rank", lambda: cp_decode_attention(
        q, k, v, local, group=group, check_ranks=True, softcap=0.5 if rank == 0 else None),
        ValueError, r"disagree on softcap: \[0.5, None\]", 1)
    raises(f, "cp scale differs", lambda: cp_decode_attention(
        q, k, v, local, group=group, check_ranks=True, scale=0.3 if rank == 1 else None),
        ValueError, r"disagree on scale: \[0.25, 0.3\]", 1)
    raises(f, "kvdp softcap differs", lambda: kvdp_decode_attention(
        kq, lk, lv, lens[rows], group=group, check_ranks=True, softcap=2.0 + rank),
        ValueError, r"disagree on softcap: \[2.0, 3.0\]", 1)
    raises(f, "kvdp window on one rank", lambda: kvdp_decode_attention(
        kq, lk, lv, lens[rows], group=group, check_ranks=True,
        window_size=4 if rank == 1 else None),
        ValueError, r"disagree on window_size: \[-1, 4\]", 1)
    kq_wide = q if rank == 1 else kq  # rank 1 passes every head: a different Hq_local
    lk_w = torch.cat([lk] * 2, dim=2) if rank == 1 else lk
    lv_w = torch.cat([lv] * 2, dim=2) if rank == 1 else lv
    raises(f, "kvdp heads differ", lambda: kvdp_decode_attention(
        kq_wide, lk_w, lv_w, lens[rows], group=group, check_ranks=True),
        ValueError, r"disagree on local query heads Hq_local: \[2, 4\]", 1)
    bad_rows = lens[rows][:0] if rank == 0 else lens[rows]
    raises(f, "kvdp lens bad on rank 0", lambda: kvdp_decode_attention(
        kq, lk, lv, bad_rows, group=group, check_ranks=True),
        ValueError, r"seqlens_local must be \[B_r=1\]" if rank == 0 else
        "rank 0 of the group rejected.*seqlens_local must be", 1)

    # And good input with check_ranks=True still gives the right answer: the check's
    # all-gather, then the op's (and the counts' all-reduce without cache_seqlens).
    for given in ({}, dict(cache_seqlens=lens)):
        with count_collectives() as calls:
            out = cp_decode_attention(q, k, v, local, group=group, check_ranks=True,
                                      impl="torch", **given)
        f.check(f"cp check_ranks ok {list(given)}", lambda calls=calls, out=out, given=given: (
            assert_collectives(calls, 2, lens_reduces(given, q)),
            assert_close(out, p["want"], F32, "out")))


# --- tests ---------------------------------------------------------------------------------


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", [2, 4])
def test_cp_decode_and_append_match_single_rank(world_size: int) -> None:
    spawn_gloo(world_size, _cp_rank, timeout=120)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", [2, 4])
def test_kvdp_decode_and_append_match_single_rank(world_size: int) -> None:
    spawn_gloo(world_size, _kvdp_rank, timeout=120)


@pytest.mark.timeout(150)
def test_kvdp_by_cp_grid_matches_single_rank() -> None:
    spawn_gloo(4, _grid_rank, timeout=120)


def _cp_unseen_values_rank(rank: int, world_size: int) -> None:
    """s_active = 4 over 2 ranks (cp_block 1): an inf or NaN in the value of the last
    active token, which the earlier ones do not see, reaches none of them (a 0 * inf in
    the rank's tail of active positions made them NaN); both paths, as the oracle."""
    f = Failures(rank)
    gen = torch.Generator().manual_seed(0)
    B, S, Hq, Hkv, L = 2, 4, 4, 2, 9
    q = torch.randn(B, S, Hq, D, generator=gen)
    k, v = torch.randn(B, L, Hkv, D, generator=gen), torch.randn(B, L, Hkv, D, generator=gen)
    v[0, L - 1] = float("inf")
    v[1, L - 2, 1] = NAN  # sequence 1 is one shorter: its last active token's value
    lens = torch.tensor([L, L - 1])
    want = lmfuse.decode_attention(q, k, v, lens, impl="torch")
    assert not want[:, :S - 1].isnan().any() and want[:, S - 1].isnan().any()
    own = [p for p in range(L) if p % world_size == rank]
    local = torch.tensor([sum(1 for p in own if p < n) for n in lens.tolist()])
    for impl in ("torch", "triton"):
        for given in ({}, dict(cache_seqlens=lens)):
            got = cp_decode_attention(q, k[:, own], v[:, own], local, group=dist.group.WORLD,
                                      cp_block=1, impl=impl, **given)
            f.check(f"{impl} {list(given)}", lambda got=got: torch.testing.assert_close(
                got, want, rtol=1e-5, atol=1e-5, equal_nan=True))  # inf and NaN where want's
    f.raise_if_any()


def _softcap_rank(rank: int, world_size: int) -> None:
    """Attention-logit softcapping (Gemma 2) through CP (1 and 3 active tokens, contiguous
    and paged, with and without cache_seqlens, sinks) and KVDP (both exchanges): the
    single-rank answer with the same softcap, on both paths."""
    f = Failures(rank)
    group = dist.group.WORLD
    cap = 0.7  # small against these logits: most of them are capped
    for s_active, bl, impl in [(1, None, "triton"), (3, 4, "triton"), (3, None, "torch")]:
        lens = [13, 4, 9]
        p = full_problem(31 + s_active, lens, s_active, 4, 2, 14, F32, sinks=True)
        want, want_lse = lmfuse.decode_attention(p["q"], p["k"], p["v"], p["lens"],
                                                 sinks=p["sinks"], softcap=cap,
                                                 return_lse=True, impl="torch")
        plain = p["want"]
        assert (want - plain).abs().max() > 1e-2  # the cap changes the answer
        k, v, table = cp_shard(p, rank, world_size, 2, bl, 7)
        local = cp_counts(lens, rank, world_size, 2)
        for given in ({}, dict(cache_seqlens=p["lens"])):
            got, lse = cp_decode_attention(p["q"], k, v, local, group=group, cp_block=2,
                                           block_table_shard=table, sinks=p["sinks"],
                                           softcap=cap, return_lse=True, impl=impl, **given)
            f.check(f"cp s={s_active} {bl} {impl} {list(given)}", lambda got=got, lse=lse,
                    want=want, want_lse=want_lse: (assert_close(got, want, F32, "out"),
                                                   assert_close(lse, want_lse, F32, "lse")))
        q, kk, vv, local_lens, table, heads, _ = kvdp_share(p, 3, rank, world_size, 2, bl, 9)
        for exchange in ("all_gather", "all_to_all"):
            got = kvdp_decode_attention(q, kk, vv, local_lens, group=group,
                                        block_table_local=table, sinks=p["sinks"],
                                        softcap=cap, exchange=exchange, impl=impl)
            f.check(f"kvdp s={s_active} {bl} {impl} {exchange}", lambda got=got, want=want,
                    heads=heads: assert_close(got, want[:, :, heads], F32, "out"))
    f.raise_if_any()


@pytest.mark.timeout(150)
def test_softcap_through_cp_and_kvdp_matches_single_rank() -> None:
    spawn_gloo(2, _softcap_rank, timeout=120)


def _cp_short_shard_rank(rank: int, world_size: int) -> None:
    """s_active = 3 with cache_seqlens: a shard one row shorter than the rank's share (on
    every rank, so none waits in the merge's all-gather) raises as decode_attention on it
    would, on both paths, instead of reading its last row in place of the missing ones."""
    f = Failures(rank)
    gen = torch.Generator().manual_seed(1)
    B, S, Hq, Hkv, L = 1, 3, 2, 1, 11
    q = torch.randn(B, S, Hq, D, generator=gen)
    k, v = torch.randn(B, L, Hkv, D, generator=gen), torch.randn(B, L, Hkv, D, generator=gen)
    own = [p for p in range(L) if p % world_size == rank]
    ks, vs = k[:, own][:, :-1], v[:, own][:, :-1]
    cnt, lens = torch.tensor([len(own)]), torch.tensor([L])
    for impl in ("torch", "triton"):
        f.check(impl, lambda impl=impl: _raises(
            lambda: cp_decode_attention(q, ks, vs, cnt, group=dist.group.WORLD, cp_block=1,
                                        cache_seqlens=lens, impl=impl),
            rf"rank {rank}'s share of cache_seqlens must be in \[0, {len(own) - 1}\]"))
    f.raise_if_any()


def _raises(fn, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fn()


@pytest.mark.timeout(120)
def test_cp_shard_shorter_than_its_share_raises() -> None:
    spawn_gloo(2, _cp_short_shard_rank, timeout=90)


@pytest.mark.timeout(120)
def test_cp_unseen_nonfinite_values_reach_no_earlier_token() -> None:
    spawn_gloo(2, _cp_unseen_values_rank, timeout=90)


@pytest.mark.timeout(120)
def test_bad_inputs_raise_on_every_rank_without_hanging() -> None:
    spawn_gloo(2, _errors_rank, timeout=60)


@pytest.mark.parametrize("op", ["cp", "kvdp"])
def test_group_none_is_decode_attention(op: str) -> None:
    """``group=None``: one rank holding everything, plain decode_attention (windows too)."""
    p = full_problem(3, [7, 12], 3, 4, 2, 14, F32, sinks=True)
    kw = dict(sinks=p["sinks"], window_size=4, return_lse=True, impl="torch")
    want = lmfuse.decode_attention(p["q"], p["k"], p["v"], p["lens"], **kw)
    with count_collectives() as calls:
        # One rank: the counts are the global lengths, and cache_seqlens changes nothing.
        if op == "cp":
            got = cp_decode_attention(p["q"], p["k"], p["v"], p["lens"], group=None, **kw)
            also = cp_decode_attention(p["q"], p["k"], p["v"], p["lens"], group=None,
                                       cache_seqlens=p["lens"], **kw)
        else:
            got = kvdp_decode_attention(p["q"], p["k"], p["v"], p["lens"], group=None, **kw)
            also = kvdp_decode_attention(p["q"], p["k"], p["v"], p["lens"], group=None,
                                         cache_seqlens=p["lens"], **kw)
    assert calls == []
    for res in (got, also):
        assert torch.equal(res[0], want[0]) and torch.equal(res[1], want[1])
    name = "seqlens_shard" if op == "cp" else "seqlens_local"
    fn = cp_decode_attention if op == "cp" else kvdp_decode_attention
    with pytest.raises(ValueError, match=rf"{name} must be \[B(_r)?=2\]"):
        fn(p["q"], p["k"], p["v"], p["lens"][:1], group=None, **kw)
    with pytest.raises(ValueError, match=r"cache_seqlens must be \[B(_r)?=2\]"):
        fn(p["q"], p["k"], p["v"], p["lens"], group=None, cache_seqlens=p["lens"][:1], **kw)
    assert cp_shard_seqlens(p["lens"], group=None).tolist() == [7, 12]
    assert kvdp_batch_range(5, None) == (0, 5)

