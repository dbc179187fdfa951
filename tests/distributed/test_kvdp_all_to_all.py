"""``kvdp_decode_attention(..., exchange="all_to_all")`` and ``kvdp_cache_append(...,
exchange="all_to_all")`` on gloo ranks: the all-to-all exchange against the all-gather one.

The attention sees the same inputs either way, so every result must equal the all-gather
path's bit for bit (``torch.equal``), and the single-rank oracle of
``test_sharded_decode.py`` within tolerance; each call must issue exactly two all-to-alls
over the KVDP group (one for an append) and nothing else over it. Covered: 2 and 4 ranks,
even and uneven batches (``B < W`` too: a rank with no sequence), contiguous and paged
caches, ``return_lse`` or not, s_active 1 and 3, the reference path and the Triton one
(interpreter), ``check_ranks``, a 2 x 2 KVDP x CP grid, appends, and a bad or differing
``exchange`` raising on every rank without hanging. One spawn runs a whole sweep.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import assert_close
from spawn import Failures, count_collectives, spawn_gloo
from test_sharded_decode import (D, F16, F32, I32, assert_collectives, cp_counts, cp_shard,
                                 lens_reduces,
                                 full_problem, kvdp_share, layout, raises)

import lmfuse
from lmfuse.distributed import kvdp_cache_append, kvdp_decode_attention
from lmfuse.distributed.collectives import all_to_all_stacked

BF16 = torch.bfloat16

# (B, s_active, hq_local, hkv, block_len, dtype, fp8, sinks, return_lse, impl): B 1 and 3
# are uneven on 2 and 4 ranks (1 < W), 4 even on both, 5 uneven on both.
CASES = [
    (3, 1, 2, 2, None, F32, False, True, True, "triton"),
    (1, 3, 2, 2, 4, F32, False, False, True, "torch"),
    (4, 3, 1, 2, None, F16, True, True, True, "torch"),
    (5, 1, 2, 4, 3, BF16, False, False, False, "torch"),
    (4, 1, 2, 1, 5, F32, False, True, False, "torch"),
    (5, 3, 1, 2, None, F32, True, False, True, "torch"),
]


def both_exchanges(fn) -> dict[str, tuple[Any, list[str]]]:
    """``fn(exchange)`` for each exchange: ``{exchange: (result, collectives issued)}``."""
    res = {}
    for exchange in ("all_gather", "all_to_all"):
        with count_collectives() as calls:
            res[exchange] = fn(exchange), calls
    return res


def as_tuple(got: Any) -> tuple[torch.Tensor, ...]:
    return tuple(got) if isinstance(got, tuple) else (got,)


def check_exchanges(f: Failures, what: str, res: dict, want: torch.Tensor,
                    want_lse: torch.Tensor, dtype: torch.dtype, n_gathers: int = 0,
                    n_reduces: int = 0) -> None:
    """All-to-all result == all-gather result (bits), both close to the oracle; the
    all-to-all call issued 2 all-to-alls (plus ``n_gathers``/``n_reduces`` elsewhere)."""
    (gather, gather_calls), (a2a, a2a_calls) = res["all_gather"], res["all_to_all"]

    def compare() -> None:
        assert_collectives(gather_calls, n_gathers + 2, n_reduces)
        assert_collectives(a2a_calls, n_gathers, n_reduces, n_all_to_alls=2)
        a, b = as_tuple(a2a), as_tuple(gather)
        assert len(a) == len(b)
        for name, x, y in zip(("out", "lse"), a, b):
            assert x.shape == y.shape and x.dtype == y.dtype, (name, x.shape, y.shape)
            assert torch.equal(x, y), f"{name}: all_to_all differs from all_gather"
        assert_close(a[0], want, dtype, f"{what}: out")
        if len(a) > 1:
            assert_close(a[1], want_lse, want_lse.dtype, f"{what}: lse")

    f.check(what, compare)


def _sweep_rank(rank: int, world: int) -> None:
    f = Failures(rank)
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(21)

    # The helper itself: row w goes to rank w, row w of the result came from rank w.
    sent = torch.arange(world * 3, dtype=torch.float32).view(world, 3) + 100 * rank
    got = all_to_all_stacked(sent, group)
    want = torch.stack([torch.arange(3.0) + 3 * rank + 100 * w for w in range(world)])
    f.check("all_to_all_stacked", lambda: torch.testing.assert_close(got, want, rtol=0, atol=0))

    for i, (B, s, hq_local, hkv, bl, dtype, fp8, sinks, lse, impl) in enumerate(CASES):
        if world == 4 and impl == "triton":
            impl = "torch"  # four ranks on two cores: the interpreter on 2 ranks is enough
        lens = torch.randint(s, 18, (B,), generator=g).tolist()
        what = (f"kvdp{world} B={B} lens={lens} s={s} hq={hq_local}x{world} hkv={hkv} "
                f"{'contig' if bl is None else f'paged{bl}'} {str(dtype)[6:]} "
                f"{'fp8 ' if fp8 else ''}{'sinks ' if sinks else ''}"
                f"{'lse ' if lse else ''}{impl}")
        seed = 1200 + i
        p = full_problem(seed, lens, s, hq_local * world, hkv, 18, dtype, fp8, sinks)
        q, k, v, local_lens, table, heads, _ = kvdp_share(p, B, rank, world, hq_local, bl, seed)
        kw = dict(group=group, block_table_local=table, sinks=p["sinks"],
                  k_scale=p["k_scale"], v_scale=p["v_scale"], return_lse=lse, impl=impl)
        res = both_exchanges(lambda exchange: kvdp_decode_attention(
            q, k, v, local_lens, exchange=exchange, **kw))
        check_exchanges(f, what, res, p["want"][:, :, heads], p["want_lse"][:, :, heads], dtype)
        if i % 3 == 1:  # check_ranks: its one small all-gather first, then the exchange
            res = both_exchanges(lambda exchange: kvdp_decode_attention(
                q, k, v, local_lens, exchange=exchange, check_ranks=True, **kw))
            check_exchanges(f, f"{what} check_ranks", res, p["want"][:, :, heads],
                            p["want_lse"][:, :, heads], dtype, n_gathers=1)

    check_appends(f, group, rank, world, g)
    check_bad_exchange(f, group, rank, world)
    f.raise_if_any()


def check_appends(f: Failures, group: Any, rank: int, world: int, g: torch.Generator) -> None:
    """``kvdp_cache_append`` with each exchange on copies of one cache: equal bit for bit,
    and to the single-rank append cut to this rank's sequences; one collective each."""
    for i, (B, s, bl, fp8) in enumerate([(3, 2, None, False), (1, 1, 4, True),
                                         (4, 3, 3, False)]):
        what = f"kvdp{world} append B={B} s={s} {'paged' if bl else 'contig'} fp8={fp8}"
        lens = torch.randint(1, 9, (B,), generator=g)
        p = full_problem(1300 + i, lens.tolist(), 1, world, world, 12, F32, fp8)
        new_k = torch.randn((B, s, world, D), generator=g)
        new_v = torch.randn((B, s, world, D), generator=g)
        full_k, full_v = p["k"].clone(), p["v"].clone()
        kw = dict(k_scale=p["k_scale"], v_scale=p["v_scale"], impl="torch")
        lmfuse.kv_cache_append(full_k, full_v, new_k, new_v, p["lens"], **kw)
        rows = torch.tensor_split(torch.arange(B), world)[rank].tolist()
        after = (p["lens"][rows] + s).tolist()
        caches = {}
        for exchange in ("all_gather", "all_to_all"):
            k, v, table = layout(p["k"][rows], p["v"][rows], after, bl, 1400 + rank)
            with count_collectives() as calls:
                kvdp_cache_append(k, v, new_k[:, :, rank:rank + 1], new_v[:, :, rank:rank + 1],
                                  p["lens"][rows], group=group, block_table_local=table,
                                  exchange=exchange, **kw)
            caches[exchange] = k, v, calls
        want_k, want_v, _ = layout(full_k[rows], full_v[rows], after, bl, 1400 + rank)

        def same(caches=caches, want_k=want_k, want_v=want_v) -> None:
            assert_collectives(caches["all_gather"][2], 1)
            assert_collectives(caches["all_to_all"][2], 0, n_all_to_alls=1)
            for got in (caches["all_to_all"][:2], caches["all_gather"][:2]):
                for a, b in zip(got, (want_k, want_v)):
                    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "caches differ"

        f.check(what, same)


def check_bad_exchange(f: Failures, group: Any, rank: int, world: int) -> None:
    """A bad ``exchange`` everywhere raises at once (no collective) on every rank; bad on one
    rank, or differing, raises on every rank with ``check_ranks`` (after its all-gather)."""
    p = full_problem(5, [7, 9, 4, 6], 1, 2 * world, 2, 10, F32)
    q, k, v, lens, _, _, _ = kvdp_share(p, 4, rank, world, 2, None, 5)
    accepted = r"exchange must be one of \('all_gather', 'all_to_all'\), got "
    for bad in ("alltoall", None):
        raises(f, f"decode exchange={bad!r}", lambda bad=bad: kvdp_decode_attention(
            q, k, v, lens, group=group, exchange=bad), ValueError, accepted + repr(bad), 0)
    raises(f, "decode exchange bad, group None", lambda: kvdp_decode_attention(
        p["q"], p["k"], p["v"], p["lens"], group=None, exchange="gather"),
        ValueError, accepted + "'gather'", 0)
    raises(f, "append exchange bad", lambda: kvdp_cache_append(
        k, v, q[:, :, :1], q[:, :, :1], lens, group=group, exchange="a2a"),
        ValueError, r"kvdp_cache_append: " + accepted + "'a2a'", 0)
    raises(f, "decode exchange bad on rank 1, check_ranks", lambda: kvdp_decode_attention(
        q, k, v, lens, group=group, exchange="nope" if rank == 1 else "all_to_all",
        check_ranks=True), ValueError, accepted if rank == 1 else
        r"rank 1 of the group rejected its inputs.*exchange must be one of", 1)
    raises(f, "decode exchange differs, check_ranks", lambda: kvdp_decode_attention(
        q, k, v, lens, group=group, exchange="all_to_all" if rank == 0 else "all_gather",
        check_ranks=True), ValueError,
        r"disagree on exchange: \[1, " + ", ".join(["0"] * (world - 1)) + r"\]", 1)


def _grid_rank(rank: int, world: int) -> None:
    """Ranks ``2 * i + j``: KVDP rank ``i`` (groups {0, 2} and {1, 3}), CP rank ``j``
    (groups {0, 1} and {2, 3}), as in ``test_sharded_decode.py``."""
    f = Failures(rank)
    kvdp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    cp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    i, j = rank // 2, rank % 2
    kvdp, cp = kvdp_groups[j], cp_groups[i]
    # (B, s, hq_local, cp_block, block_len, dtype, lse, given)
    cases = [(3, 3, 2, 2, None, F32, True, True), (5, 1, 2, 1, 4, F32, False, False),
             (4, 3, 1, 3, 3, F16, True, False), (3, 1, 2, 2, 4, BF16, True, True)]
    g = torch.Generator().manual_seed(31)
    for n, (B, s, hq_local, blk, bl, dtype, lse, given) in enumerate(cases):
        lens = torch.randint(s, 20, (B,), generator=g).tolist()
        what = (f"grid B={B} lens={lens} s={s} cp_block={blk} "
                f"{'contig' if bl is None else f'paged{bl}'} {str(dtype)[6:]}"
                f"{' lse' if lse else ''}{' cache_seqlens' if given else ''}")
        p = full_problem(1500 + n, lens, s, hq_local * 2, 2, 20, dtype, sinks=True)
        rows = torch.tensor_split(torch.arange(B), 2)[i].tolist()
        sub = dict(k=p["k"][rows], v=p["v"][rows], lens=p["lens"][rows])
        k, v, table = cp_shard(sub, j, 2, blk, bl, 1600 + n + 10 * i)
        heads = slice(i * hq_local, (i + 1) * hq_local)
        local = cp_counts(sub["lens"], j, 2, blk, I32)
        extra = dict(cache_seqlens=sub["lens"]) if given else {}
        res = both_exchanges(lambda exchange: kvdp_decode_attention(
            p["q"][:, :, heads], k, v, local, group=kvdp, block_table_local=table,
            cp_group=cp, cp_block=blk, sinks=p["sinks"], return_lse=lse, impl="torch",
            exchange=exchange, **extra))
        # Over cp_group: the CP merge's all-gather, and the counts' all-reduce unless given.
        check_exchanges(f, what, res, p["want"][:, :, heads], p["want_lse"][:, :, heads],
                        dtype, n_gathers=1, n_reduces=lens_reduces(given, p["q"]))
    f.raise_if_any()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", [2, 4])
def test_kvdp_all_to_all_equals_all_gather(world_size: int) -> None:
    spawn_gloo(world_size, _sweep_rank, timeout=120)


@pytest.mark.timeout(150)
def test_kvdp_all_to_all_on_kvdp_by_cp_grid() -> None:
    spawn_gloo(4, _grid_rank, timeout=120)
