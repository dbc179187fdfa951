"""The input contract and NaN/inf behaviour of decode attention, the merge, the cache append,
``PagedKVCache`` and ``DecodeAttentionBlock``, on both paths.

* Bad values (lengths, block ids, fp8 scales) raise one ``ValueError``, word for word the
  same on ``impl="torch"`` and ``impl="triton"`` (and through ``explain`` and
  ``decode_attention_partials``), before anything is written.
* With the value checks off (what an unchecked CUDA call does: ``ops.value_checks``
  patched to False) the kernels stay in bounds: the caches are views into larger buffers
  whose extra rows hold NaN (a read there shows up in the output) or a sentinel (a write
  there shows up in the buffer).
* NaN and inf propagate as PyTorch's ``softmax(q k^T * scale + mask) v`` would (the rules in
  ``attention/reference.py``'s docstring); the oracle is the float64 reference, whose
  pattern of NaN / inf each case also asserts by hand.

The interpreter computes ``inf - inf`` (and ``x / 0``) in numpy, which warns: the cases
that feed ``+inf`` (or a zero scale) on purpose ignore that ``RuntimeWarning``.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Optional

import pytest
import torch
import triton
import triton.language as tl
from helpers import assert_close, randn

import lmfuse
from lmfuse import PagedKVCache
from lmfuse.attention import ops
from lmfuse.attention.block import (DecodeAttentionBlock, qk_norm_rope_append,
                                    qk_norm_rope_append_reference)
from lmfuse._fp8 import saturate_fp8 as _saturate_fp8
from lmfuse.attention.reference import (decode_attention_reference,
                                        merge_attention_states_reference)

F32, F16, F64 = torch.float32, torch.float16, torch.float64
FP8 = torch.float8_e4m3fn
I32 = torch.int32
NAN, INF = math.nan, math.inf
IMPLS = ("torch", "triton")
# The interpreter computes in numpy, which warns where a +inf input makes inf - inf (the NaN
# the rules ask for) or a zero scale divides: the cases that do so on purpose ignore it.
INF_MINUS_INF = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def checks_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "value_checks", lambda t: False)


def same_error(call: Callable[[str], Any], message: str) -> str:
    """``call(impl)`` raises a ValueError matching ``message`` on both paths, the same one."""
    errors = []
    for impl in IMPLS:
        with pytest.raises(ValueError, match=message) as info:
            call(impl)
        errors.append(str(info.value))
    assert errors[0] == errors[1], f"the paths disagree: {errors}"
    return errors[0]


# --- the input contract: decode_attention ------------------------------------------------------


def decode_inputs(paged: bool, fp8: bool = False) -> dict[str, Any]:
    """q [2, 2, 4, 16]; lengths [3, 8]; contiguous [2, 8, 2, 16] caches or a pool of 5
    blocks of 4 with table [[0, 1], [2, 3]] (capacity 8 either way)."""
    kw: dict[str, Any] = dict(q=randn((2, 2, 4, 16)), cache_seqlens=torch.tensor([3, 8], dtype=I32))
    shape = (5, 4, 2, 16) if paged else (2, 8, 2, 16)
    kw["k_cache"], kw["v_cache"] = randn(shape), randn(shape)
    if paged:
        kw["block_table"] = torch.tensor([[0, 1], [2, 3]], dtype=I32)
    if fp8:
        kw["k_cache"], kw["v_cache"] = kw["k_cache"].to(FP8), kw["v_cache"].to(FP8)
        kw["k_scale"], kw["v_scale"] = torch.tensor([0.5, 1.5]), torch.tensor([2.0, 0.25])
    return kw


def _lens(*values: int) -> Callable[[dict], None]:
    def apply(kw: dict) -> None:
        kw["cache_seqlens"] = torch.tensor(values, dtype=I32)
    return apply


def _entry(b: int, j: int, value: int) -> Callable[[dict], None]:
    def apply(kw: dict) -> None:
        kw["block_table"] = kw["block_table"].clone()
        kw["block_table"][b, j] = value
    return apply


def _scale(name: str, h: int, value: float) -> Callable[[dict], None]:
    def apply(kw: dict) -> None:
        kw[name] = kw[name].clone()
        kw[name][h] = value
    return apply


CAPACITY_CONTIG = r"8 rows per sequence: the caches' S_max"
CAPACITY_PAGED = r"8 rows per sequence: max_blocks \* block_len = 2 \* 4"
DECODE_CONTRACT = [  # id, paged, fp8, change, message
    ("seqlens-negative", False, False, _lens(-1, 8),
     rf"cache_seqlens must be in \[0, 8\] \({CAPACITY_CONTIG}\), got cache_seqlens\[0\] = -1"),
    ("seqlens-past-S_max", False, False, _lens(3, 9),
     rf"cache_seqlens must be in \[0, 8\] \({CAPACITY_CONTIG}\), got cache_seqlens\[1\] = 9"),
    ("seqlens-past-blocks", True, False, _lens(3, 9),
     rf"cache_seqlens must be in \[0, 8\] \({CAPACITY_PAGED}\), got cache_seqlens\[1\] = 9"),
    ("seqlens-negative-paged", True, False, _lens(3, -4), r"got cache_seqlens\[1\] = -4"),
    ("block--1-in-use", True, False, _entry(1, 1, -1),
     r"block_table\[1, 1\] = -1, but sequence 1's 8 tokens lie in its first 2 blocks: their "
     r"ids must be blocks of the pool, in \[0, num_blocks=5\)"),
    ("block-past-pool", True, False, _entry(0, 0, 5), r"block_table\[0, 0\] = 5, but sequence 0"),
    ("block--2", True, False, _entry(1, 0, -2), r"block_table\[1, 0\] = -2"),
    ("k_scale-zero", False, True, _scale("k_scale", 1, 0.0),
     r"k_scale must be finite and > 0 \(an fp8 cache's dequantisation scale per KV head\), "
     r"got k_scale\[1\] = 0.0"),
    ("v_scale-negative", True, True, _scale("v_scale", 0, -2.0), r"got v_scale\[0\] = -2.0"),
    ("k_scale-nan", False, True, _scale("k_scale", 0, NAN), r"got k_scale\[0\] = nan"),
    ("v_scale-inf", False, True, _scale("v_scale", 1, INF), r"got v_scale\[1\] = inf"),
]


@pytest.mark.parametrize("paged, fp8, change, message",
                         [pytest.param(*c[1:], id=c[0]) for c in DECODE_CONTRACT])
def test_decode_contract(paged: bool, fp8: bool, change, message: str) -> None:
    """One error on both paths, through explain and decode_attention_partials too."""
    kw = decode_inputs(paged, fp8)
    change(kw)
    args = [kw.pop(n) for n in ("q", "k_cache", "v_cache", "cache_seqlens")]
    full = f"^decode_attention: .*{message}"
    error = same_error(lambda impl: lmfuse.decode_attention(*args, **kw, impl=impl), full)
    with pytest.raises(ValueError) as info:
        lmfuse.explain(lmfuse.decode_attention, *args, **kw)
    assert str(info.value) == error
    with pytest.raises(ValueError) as info:
        ops.decode_attention_partials(*args, **kw, impl="triton")
    assert str(info.value) == error


def test_decode_contract_reads_only_the_blocks_in_use() -> None:
    """Entries past the blocks a sequence's length needs are never read, so any value there
    is fine (-1 by convention): the result is the reference's."""
    kw = decode_inputs(True)
    kw["block_table"] = torch.tensor([[0, 99], [2, 3]], dtype=I32)  # sequence 0: 3 tokens
    args = [kw.pop(n) for n in ("q", "k_cache", "v_cache", "cache_seqlens")]
    want = decode_attention_reference(args[0].double(), *args[1:], **kw)
    for impl in IMPLS:
        assert_close(lmfuse.decode_attention(*args, **kw, impl=impl), want, F32, impl)


# --- the input contract: kv_cache_append ------------------------------------------------------


def append_inputs(paged: bool, fp8: bool = False, s_new: int = 1) -> dict[str, Any]:
    kw = decode_inputs(paged, fp8)
    kw.pop("q")
    kw["cache_seqlens"] = torch.tensor([3, 7], dtype=I32)
    kw["k_new"], kw["v_new"] = randn((2, s_new, 2, 16)), randn((2, s_new, 2, 16))
    return kw


def _new_tokens(s_new: int) -> Callable[[dict], None]:
    def apply(kw: dict) -> None:
        kw["k_new"], kw["v_new"] = randn((2, s_new, 2, 16)), randn((2, s_new, 2, 16))
    return apply


def _both(*changes: Callable[[dict], None]) -> Callable[[dict], None]:
    def apply(kw: dict) -> None:
        for change in changes:
            change(kw)
    return apply


APPEND_CONTRACT = [  # id, paged, fp8, change, message
    ("negative", False, False, _lens(3, -1),
     r"cache_seqlens must be >= 0, got cache_seqlens\[1\] = -1"),
    ("negative-padding-row", True, False, _both(_lens(3, -1), _entry(1, 0, -1), _entry(1, 1, -1)),
     r"cache_seqlens must be >= 0, got cache_seqlens\[1\] = -1"),
    ("past-S_max", False, False, _lens(3, 8),
     rf"sequence 1 holds cache_seqlens\[1\] = 8 tokens; its 1 new one\(s\) go up to position "
     rf"8, past the capacity of {CAPACITY_CONTIG}; reserve space first"),
    ("past-capacity-s_new-3", False, False, _both(_lens(6, 2), _new_tokens(3)),
     r"sequence 0 holds cache_seqlens\[0\] = 6 tokens; its 3 new one\(s\) go up to position 8"),
    ("past-blocks", True, False, _lens(8, 2), rf"past the capacity of {CAPACITY_PAGED}"),
    ("block--1-written", True, False, _both(_lens(3, 4), _entry(1, 1, -1)),
     r"block_table\[1, 1\] = -1, but sequence 1's new tokens go to positions 4..4, in its "
     r"blocks 1..1 \(reserve them first; a row of only -1 is a padding row, written nowhere\)"
     r": their ids must be blocks of the pool, in \[0, num_blocks=5\)"),
    ("block-past-pool", True, False, _entry(0, 0, 5), r"block_table\[0, 0\] = 5, but sequence 0"),
    ("k_scale-zero", False, True, _scale("k_scale", 0, 0.0), r"got k_scale\[0\] = 0.0"),
    ("v_scale-negative", True, True, _scale("v_scale", 1, -1.0), r"got v_scale\[1\] = -1.0"),
    ("k_scale-nan", True, True, _scale("k_scale", 1, NAN), r"got k_scale\[1\] = nan"),
    ("v_scale-inf", False, True, _scale("v_scale", 0, INF), r"got v_scale\[0\] = inf"),
]


@pytest.mark.parametrize("paged, fp8, change, message",
                         [pytest.param(*c[1:], id=c[0]) for c in APPEND_CONTRACT])
def test_append_contract(paged: bool, fp8: bool, change, message: str) -> None:
    """One error on both paths, and nothing written."""
    kw = append_inputs(paged, fp8)
    change(kw)
    before = kw["k_cache"].view(torch.uint8).clone() if fp8 else kw["k_cache"].clone()
    args = [kw.pop(n) for n in ("k_cache", "v_cache", "k_new", "v_new", "cache_seqlens")]
    same_error(lambda impl: lmfuse.kv_cache_append(*args, **kw, impl=impl),
               f"^kv_cache_append: .*{message}")
    after = args[0].view(torch.uint8) if fp8 else args[0]
    assert torch.equal(after, before), "a refused append wrote into the cache"


def test_append_with_no_new_token_checks_lengths_only() -> None:
    """s_new = 0 writes nothing: a length up to the capacity is fine, past it is not."""
    kw = append_inputs(True, s_new=0)
    args = [kw.pop(n) for n in ("k_cache", "v_cache", "k_new", "v_new", "cache_seqlens")]
    for impl in IMPLS:
        lmfuse.kv_cache_append(*args[:4], torch.tensor([8, 0], dtype=I32), **kw, impl=impl)
    same_error(lambda impl: lmfuse.kv_cache_append(*args[:4], torch.tensor([9, 0], dtype=I32),
                                                   **kw, impl=impl),
               r"cache_seqlens\[0\] = 9 tokens; its 0 new one\(s\) go up to position 8")


# --- the input contract: PagedKVCache and DecodeAttentionBlock --------------------------------


def test_paged_kv_cache_surfaces_the_same_errors() -> None:
    """A step whose values break the contract (here: tampered with) gives the ops' errors,
    the same through both paths, from append and attention alike."""
    cache = PagedKVCache(6, 4, 2, 16, torch.float32, "cpu")
    a, b = cache.add_sequence(), cache.add_sequence()
    step = cache.reserve([a, b], 5)  # two blocks each (a row of only -1 is padding)
    k_new = randn((2, 5, 2, 16))
    q = randn((2, 1, 4, 16))

    def tampered(step):
        bad_table = step.block_table.clone()
        bad_table[1, 0] = -1
        return step._replace(block_table=bad_table)

    same_error(lambda impl: cache.append([a, b], k_new, k_new, step=tampered(step), impl=impl),
               r"^kv_cache_append: block_table\[1, 0\] = -1, but sequence 1's new tokens go "
               r"to positions 0..4")
    cache.truncate(a, 3)
    cache.extend([b], 1)
    step = cache.reserve([a, b], 0)  # lengths 3 and 6
    bad = tampered(step)
    same_error(lambda impl: cache.attention(q, bad, impl=impl),
               r"^decode_attention: block_table\[1, 0\] = -1, but sequence 1's 6 tokens")
    long = step._replace(seqlens=torch.tensor([3, 9], dtype=I32))
    same_error(lambda impl: cache.attention(q, long, impl=impl),
               r"^decode_attention: cache_seqlens must be in \[0, 8\] \(8 rows per sequence: "
               r"max_blocks \* block_len = 2 \* 4\), got cache_seqlens\[1\] = 9")


HIDDEN, HQ, HKV, D = 32, 4, 2, 16


def block_inputs(paged: bool, fp8: bool = False) -> dict[str, Any]:
    """Two sequences of 2 and 3 tokens, one new token each; capacity 4 (contiguous) or two
    blocks of 2 per sequence in a pool of 5."""
    dtype = FP8 if fp8 else F32
    kw: dict[str, Any] = dict(x=randn((2, 1, HIDDEN)),
                              cache_seqlens=torch.tensor([2, 3], dtype=I32))
    shape = (5, 2, HKV, D) if paged else (2, 4, HKV, D)
    kw["k_cache"], kw["v_cache"] = randn(shape).to(dtype), randn(shape).to(dtype)
    if paged:
        kw["block_table"] = torch.tensor([[0, 1], [2, 3]], dtype=I32)
    if fp8:
        kw["k_scale"], kw["v_scale"] = torch.tensor([0.5, 1.5]), torch.tensor([2.0, 0.25])
    return kw


BLOCK_CONTRACT = [  # id, paged, fp8, change, message
    ("past-capacity", False, False, _lens(2, 4),
     r"sequence 1 holds cache_seqlens\[1\] = 4 tokens; its 1 new one\(s\) go up to position 4,"
     r" past the capacity of 4 rows per sequence"),
    ("negative", True, False, _lens(-1, 3), r"cache_seqlens must be >= 0"),
    ("block--1-written", True, False, _entry(1, 1, -1),
     r"block_table\[1, 1\] = -1, but sequence 1's new tokens go to positions 3..3"),
    ("block--1-read", True, False, _entry(1, 0, -1),
     r"block_table\[1, 0\] = -1, but sequence 1's 4 tokens lie in its first 2 blocks"),
    ("padding-row", True, False, _both(_entry(1, 0, -1), _entry(1, 1, -1)),
     r"block_table\[1, 0\] = -1, but sequence 1's 4 tokens"),
    ("k_scale-zero", True, True, _scale("k_scale", 1, 0.0), r"got k_scale\[1\] = 0.0"),
]


@pytest.mark.parametrize("paged, fp8, change, message",
                         [pytest.param(*c[1:], id=c[0]) for c in BLOCK_CONTRACT])
def test_block_contract(paged: bool, fp8: bool, change, message: str) -> None:
    """The block raises the ops' errors on both paths, before the cache is written."""
    kw = block_inputs(paged, fp8)
    change(kw)
    torch.manual_seed(0)
    blocks = {impl: DecodeAttentionBlock(HIDDEN, HQ, HKV, D, impl=impl) for impl in IMPLS}
    blocks["triton"].load_state_dict(blocks["torch"].state_dict())
    before = kw["k_cache"].float().nan_to_num(7.0)
    x = kw.pop("x")
    args = [kw.pop(n) for n in ("k_cache", "v_cache", "cache_seqlens")]

    def call(impl: str) -> None:
        with torch.no_grad():
            blocks[impl](x, *args, **kw)

    same_error(call, f"^DecodeAttentionBlock: .*{message}")
    assert torch.equal(args[0].float().nan_to_num(7.0), before), "the refused step wrote"


# --- with the checks off, the kernels stay in bounds -------------------------------------------


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [Hq, D]`` over ``k``/``v [n, Hkv, D]`` (GQA), float64."""
    group = q.shape[0] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    s = torch.einsum("hd,nhd->hn", q.double(), k) * scale
    return torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v)


@pytest.mark.parametrize("splits", [None, 3])
def test_unchecked_contiguous_lengths_stay_in_bounds(monkeypatch: pytest.MonkeyPatch,
                                                     splits: Optional[int]) -> None:
    """A length past S_max reads S_max keys (no more: the rows after them are NaN), a negative
    one reads none (zeros, lse -inf)."""
    checks_off(monkeypatch)
    S = 40
    buf_k, buf_v = torch.full((2, S + 8, 2, 16), NAN), torch.full((2, S + 8, 2, 16), NAN)
    buf_k[:, :S], buf_v[:, :S] = randn((2, S, 2, 16)), randn((2, S, 2, 16))
    k, v = buf_k[:, :S], buf_v[:, :S]
    q = randn((2, 2, 4, 16))
    out, lse = lmfuse.decode_attention(q, k, v, torch.tensor([S + 5, -3]), return_lse=True,
                                       num_splits=splits, impl="triton")
    want, want_lse = decode_attention_reference(q.double(), k, v, torch.tensor([S, 0]),
                                                return_lse=True)
    assert_close(out, want, F32, "clamped lengths")
    assert torch.equal(lse[1], torch.full_like(lse[1], -INF))
    assert_close(lse[0], want_lse[0], F32, "lse")


@pytest.mark.parametrize("splits", [None, 2])
def test_unchecked_block_ids_are_skipped(monkeypatch: pytest.MonkeyPatch,
                                         splits: Optional[int]) -> None:
    """Keys in a block whose id is -1, below it or past the pool are skipped (the blocks
    around the pool hold NaN); the rest is attention over the keys left."""
    checks_off(monkeypatch)
    N, bl = 6, 4
    buf_k, buf_v = torch.full((N + 2, bl, 2, 16), NAN), torch.full((N + 2, bl, 2, 16), NAN)
    buf_k[1:N + 1], buf_v[1:N + 1] = randn((N, bl, 2, 16)), randn((N, bl, 2, 16))
    k, v = buf_k[1:N + 1], buf_v[1:N + 1]  # ids -1 and N would land on the NaN blocks
    table = torch.tensor([[0, -1, 1, N], [2, 3, -7, 4]], dtype=I32)
    lens = torch.tensor([16, 14])
    q = randn((2, 1, 4, 16))
    out = lmfuse.decode_attention(q, k, v, lens, block_table=table, num_splits=splits,
                                  impl="triton")
    for b in range(2):
        at = [(int(table[b, p // bl]), p % bl) for p in range(int(lens[b]))]
        at = [(blk, r) for blk, r in at if 0 <= blk < N]
        want = naive(q[b, 0], torch.stack([k[a] for a in at]), torch.stack([v[a] for a in at]),
                     16 ** -0.5)
        assert_close(out[b, 0], want, F32, f"sequence {b} over its {len(at)} keys left")


def test_unchecked_append_writes_nothing_outside(monkeypatch: pytest.MonkeyPatch) -> None:
    """Block ids -1, below -1 and past the pool, and positions past the capacity: the rows
    around the pool (a sentinel) and the rows not addressed stay as they were."""
    checks_off(monkeypatch)
    N, bl = 4, 2
    buf = torch.full((N + 2, bl, 2, 16), 5.0)
    pool = buf[1:N + 1]
    pool.zero_()
    table = torch.tensor([[0, -1], [N, 1], [-3, 2], [-1, 3]], dtype=I32)
    lens = torch.tensor([1, 0, 2, 3], dtype=I32)  # 2 new tokens each
    new = torch.ones(4, 2, 2, 16)
    lmfuse.kv_cache_append(pool, pool.clone(), new, new, lens, block_table=table, impl="triton")
    assert torch.equal(buf[0], torch.full_like(buf[0], 5.0))
    assert torch.equal(buf[N + 1], torch.full_like(buf[N + 1], 5.0))
    written = pool.abs().sum((2, 3)) > 0
    want = torch.zeros(N, bl, dtype=torch.bool)
    want[0, 1] = True  # sequence 0: position 1 (block 0); position 2 in block -1: skipped
    want[1, 0] = want[1, 1] = False  # sequence 1: block N is outside the pool
    want[2, 0] = True  # sequence 2: positions 2, 3 in block 2 (block -3 holds 0, 1)
    want[2, 1] = True
    want[3, 1] = True  # sequence 3: position 3 in block 3; position 4 past the capacity
    assert torch.equal(written, want), written


@pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")
def test_unchecked_zero_scale_saturates(monkeypatch: pytest.MonkeyPatch) -> None:
    """The documented unchecked behaviour of an fp8 scale of 0: x / 0 saturates to +-448."""
    checks_off(monkeypatch)
    k = torch.zeros(1, 4, 2, 16, dtype=FP8)
    new = randn((1, 1, 2, 16))
    lmfuse.kv_cache_append(k, k.clone(), new, new, torch.tensor([0]),
                           k_scale=torch.tensor([0.0, 1.0]), impl="triton")
    assert torch.equal(k[0, 0, 0].float(), 448.0 * new[0, 0, 0].sign())


# --- NaN and inf: decode_attention -------------------------------------------------------------


def nan_problem(paged: bool, lens=(40, 23), window=None, sinks=None, q_positive=False):
    S = 40
    k, v = randn((2, S, 2, 16)), randn((2, S, 2, 16))
    for b, n in enumerate(lens):
        k[b, n:], v[b, n:] = NAN, NAN
    q = randn((2, 2, 4, 16))
    if q_positive:
        q = q.abs()
    return dict(q=q, k=k, v=v, lens=torch.tensor(lens, dtype=I32), paged=paged,
                window=window, sinks=sinks)


def run_problem(p: dict[str, Any], impl: str, splits: Optional[int]):
    from helpers import to_paged

    k, v, table = p["k"], p["v"], None
    if p["paged"]:
        (k, v), table = to_paged((k, v), p["lens"].tolist(), 8)
    kw = dict(block_table=table, window_size=p["window"], sinks=p["sinks"], return_lse=True)
    got = lmfuse.decode_attention(p["q"], k, v, p["lens"], **kw, impl=impl,
                                  **({} if impl == "torch" else dict(num_splits=splits)))
    sinks = None if p["sinks"] is None else p["sinks"].double()
    want = decode_attention_reference(p["q"].double(), k, v, p["lens"], block_table=table,
                                      window_size=p["window"], sinks=sinks, return_lse=True)
    return got, want


def same_nonfinite(out, lse, want, want_lse, dtype, what: str) -> None:
    """Equal NaN / +inf / -inf patterns, and the finite values within tolerance."""
    assert torch.equal(out.isnan(), want.isnan()), f"{what}: NaN pattern of out"
    assert torch.equal(lse.isnan(), want_lse.isnan()), f"{what}: NaN pattern of lse"
    for sign in (INF, -INF):
        assert torch.equal(lse == sign, want_lse == sign), f"{what}: lse == {sign} pattern"
    fin = ~want.isnan()
    assert_close(out[fin], want[fin], dtype, f"{what}: finite out")
    fin = torch.isfinite(want_lse)
    assert_close(lse[fin], want_lse[fin], F32, f"{what}: finite lse")


def _nan_q(p):
    p["q"][1, 0, 3] = NAN
    return [(1, 0, 3)]


def _nan_key_seen(p):
    p["k"][0, 10, 1, 5] = NAN  # seen by both active tokens of sequence 0: heads 2, 3
    return [(0, i, h) for i in range(2) for h in (2, 3)]


def _nan_value_seen(p):
    p["v"][1, 5, 0, 0] = NAN
    return [(1, i, h) for i in range(2) for h in (0, 1)]


def _nan_key_after_token(p):
    p["k"][0, 39, 0, 0] = NAN  # the second active token's own key; the first one's is 38
    return [(0, 1, 0), (0, 1, 1)]


def _nan_before_window(p):
    p["window"] = 5  # sequence 0's tokens see 33.. and 34..; sequence 1's 16.. and 17..
    p["k"][0, :33], p["v"][0, :33] = NAN, NAN
    p["k"][1, :16], p["v"][1, :16] = NAN, NAN
    return []


def _nan_sink(p):
    p["sinks"] = randn((4,))
    p["sinks"][2] = NAN
    return [(b, i, 2) for b in range(2) for i in range(2)]


def _minus_inf_sinks(p):
    p["sinks"] = torch.full((4,), -INF)
    return []


NAN_CASES = {"nan-query-head": _nan_q, "nan-key-seen": _nan_key_seen,
             "nan-value-seen": _nan_value_seen, "nan-key-after-token": _nan_key_after_token,
             "nan-before-window": _nan_before_window, "nan-sink": _nan_sink,
             "minus-inf-sinks": _minus_inf_sinks}


@pytest.mark.parametrize("impl, splits", [("torch", None), ("triton", None), ("triton", 3)],
                         ids=["torch", "triton", "triton-3-splits"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("case", list(NAN_CASES))

def test_nan_propagates_exactly_where_seen(case: str, paged: bool, impl: str,
                                           splits: Optional[int]) -> None:
    """NaN reaches exactly the (sequence, token, head) rows that see it, out and lse, on both
    paths; the other rows equal the reference; rows past the lengths are NaN throughout."""
    p = nan_problem(paged)
    rows = NAN_CASES[case](p)
    (out, lse), (want, want_lse) = run_problem(p, impl, splits)
    nan_rows = torch.zeros(2, 2, 4, dtype=torch.bool)
    for r in rows:
        nan_rows[r] = True
    assert torch.equal(want.isnan().any(-1), nan_rows), "the reference's own pattern"
    same_nonfinite(out, lse, want, want_lse, F32, f"{case} {impl} splits={splits}")
    if case == "minus-inf-sinks":  # -inf sinks add nothing
        p["sinks"] = None
        plain, _ = run_problem(p, impl, splits)
        assert_close(out, plain[0], F32, "-inf sinks = no sinks")


INF_CASES = {  # name: (lens, sinks, q_positive, +inf key position of sequence 0 head 0)
    "inf-key": ((40, 23), None, True, 3),
    "inf-sink": ((40, 23), [0.0, INF, 0.0, 0.0], False, None),
    "inf-sink-empty-sequence": ((40, 0), [0.0, INF, 0.0, NAN], False, None),
    "inf-key-and-nan-sink": ((40, 23), [NAN, 0.0, 0.0, 0.0], True, 3),
}


@pytest.mark.parametrize("impl, splits", [("torch", None), ("triton", None), ("triton", 3)],
                         ids=["torch", "triton", "triton-3-splits"])
@pytest.mark.parametrize("case", list(INF_CASES))


@INF_MINUS_INF
def test_plus_inf_logits(case: str, impl: str, splits: Optional[int]) -> None:
    """A +inf logit (score or sink) gives lse = +inf (even beside a NaN) and out = NaN; a
    NaN sink alone gives NaN for both, also for a sequence with no key."""
    lens, sinks, q_positive, inf_at = INF_CASES[case]
    p = nan_problem(False, lens=lens, sinks=None if sinks is None else torch.tensor(sinks),
                    q_positive=q_positive)
    if inf_at is not None:
        p["k"][0, inf_at, 0] = INF  # scores of heads 0, 1 (positive queries): +inf
    (out, lse), (want, want_lse) = run_problem(p, impl, splits)
    if case == "inf-key":
        assert (want_lse[0, :, :2] == INF).all() and want[0, :, :2].isnan().all()
        assert torch.isfinite(want[0, :, 2:]).all() and torch.isfinite(want[1]).all()
    if case == "inf-sink":
        assert (want_lse[:, :, 1] == INF).all() and want[:, :, 1].isnan().all()
    if case == "inf-sink-empty-sequence":
        assert (want_lse[1, :, 1] == INF).all() and want_lse[1, :, 3].isnan().all()
        assert want[1, :, 1].isnan().all() and want[1, :, 3].isnan().all()
        assert (want[1, :, (0, 2)] == 0).all()
    if case == "inf-key-and-nan-sink":
        assert (want_lse[0, :, :2] == INF).all() and want_lse[1, :, 0].isnan().all()
    same_nonfinite(out, lse, want, want_lse, F32, f"{case} {impl} splits={splits}")


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@INF_MINUS_INF
@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("fp8", [False, True], ids=["float32-cache", "fp8-cache"])
def test_scores_that_overflow_once_scaled(fp8: bool, splits: Optional[int]) -> None:
    """Scores finite as dot products whose scaled value overflows float32: a row whose
    largest one overflows to +inf is NaN with lse = +inf, one whose every score overflows to
    -inf gives zeros and -inf, as the float32 reference computes them; the other rows match
    it. fp8: a large k_scale does it, through the bf16 queries' float16 dots."""
    torch.manual_seed(0)
    S, Hkv, D = 24, 2, 16
    k = randn((2, S, Hkv, D)).abs() + 0.5
    v = randn((2, S, Hkv, D))
    q = randn((2, 1, 4, D))
    q[0, 0, 0] = 4.0  # head 0 (KV head 0): every score huge and positive
    q[0, 0, 1] = -4.0  # head 1: every score huge and negative
    lens = torch.tensor([S, 17], dtype=I32)
    if fp8:
        k, v, q = (k * 100).to(FP8), v.to(FP8), q.to(torch.bfloat16)
        args = dict(k_scale=torch.tensor([1e35, 1.0]), v_scale=torch.ones(Hkv))
    else:
        k[0, :, 0] *= 1e36  # dots up to ~3e38: finite; times 1.44 * 10 they overflow
        args = {}
    out, lse = lmfuse.decode_attention(q, k, v, lens, scale=10.0, return_lse=True,
                                       num_splits=splits, impl="triton", **args)
    want, want_lse = decode_attention_reference(q, k, v, lens, scale=10.0, return_lse=True,
                                                **args)  # float32 math for these queries
    assert want_lse[0, 0, 0] == INF and want[0, 0, 0].isnan().all()
    assert want_lse[0, 0, 1] == -INF and (want[0, 0, 1] == 0).all()
    same_nonfinite(out.float(), lse, want.float(), want_lse, q.dtype,
                   f"fp8={fp8} splits={splits}")


# --- NaN and inf: merge_attention_states -------------------------------------------------------


@INF_MINUS_INF
@pytest.mark.parametrize("impl", IMPLS)

def test_merge_nan_and_inf(impl: str) -> None:
    """Row by row: a NaN LSE; a +inf LSE; both (+inf wins); all -inf with NaN outputs (zeros,
    -inf); one -inf partial with a NaN output (left out); a NaN output whose weight
    underflows to 0 (still NaN); a plain row."""
    P, R, Dm = 3, 7, 8
    outs, lses = randn((P, R, Dm)), randn((P, R), scale=2.0)
    lses[1, 0] = NAN
    lses[2, 1] = INF
    lses[0, 2], lses[1, 2] = NAN, INF
    lses[:, 3], outs[:, 3] = -INF, NAN
    lses[0, 4], outs[0, 4] = -INF, NAN
    lses[:, 5] = torch.tensor([0.0, -300.0, 1.0])
    outs[1, 5, 2] = NAN
    out, lse = lmfuse.merge_attention_states(outs, lses, impl=impl)
    want, want_lse = merge_attention_states_reference(outs.double(), lses.double())
    assert want[:3].isnan().all() and not want[4].isnan().any()
    assert want[5, 2].isnan() and int(want[5].isnan().sum()) == 1
    assert want_lse[0].isnan() and want_lse[1] == INF and want_lse[2] == INF
    assert want_lse[3] == -INF and (want[3] == 0).all()
    assert torch.equal(out.isnan(), want.isnan()), "NaN pattern of out"
    assert torch.equal(lse.isnan(), want_lse.isnan()) and torch.equal(lse == INF, want_lse == INF)
    fin = ~want.isnan()
    assert_close(out[fin], want[fin], F32, f"{impl}: finite rows")
    fin = torch.isfinite(want_lse)
    assert_close(lse[fin], want_lse[fin], F32, f"{impl}: finite lse")


# --- NaN and inf: the cache append and the block -----------------------------------------------


INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


def fp8_nan(bits: torch.Tensor) -> torch.Tensor:
    """Where fp8 bytes hold NaN (0x7f / 0xff). Triton 3.9's interpreter converts a float32
    NaN to e4m3 as +-384 (0x7c / 0xfc; the GPU's cvt gives NaN): accepted under it only."""
    nan = (bits & 0x7F) == 0x7F
    return nan | ((bits & 0x7F) == 0x7C) if INTERPRETER else nan


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("fp8", [False, True], ids=["float32-cache", "fp8-cache"])
def test_append_stores_nan_and_saturates_inf(paged: bool, fp8: bool) -> None:
    """Into an fp8 cache NaN stays NaN and +-inf saturates to +-448; into a float cache both
    are stored as they are; the rest bit for bit the same on both paths."""
    kw = append_inputs(paged, fp8, s_new=2)
    kw["cache_seqlens"] = torch.tensor([3, 5], dtype=I32)
    kw["k_new"][0, 0, 0, :3] = torch.tensor([NAN, INF, -INF])
    kw["v_new"][1, 1, 1, 5] = NAN
    results = []
    for impl in IMPLS:
        k, v = kw["k_cache"].clone(), kw["v_cache"].clone()
        lmfuse.kv_cache_append(k, v, kw["k_new"], kw["v_new"], kw["cache_seqlens"],
                               block_table=kw.get("block_table"), k_scale=kw.get("k_scale"),
                               v_scale=kw.get("v_scale"), impl=impl)
        results.append((k, v))
    for (a, b), name in zip(zip(*results), ("k", "v")):
        if fp8:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
            assert torch.equal(fp8_nan(b), (a & 0x7F) == 0x7F), f"{name}: NaN not stored as NaN"
            same = fp8_nan(b) | (a == b)
        else:
            assert torch.equal(a.isnan(), b.isnan()), f"{name}: NaN not stored as NaN"
            same = a.isnan() | (a == b)
        assert same.all(), f"{name}: the paths store different values"
    for k, v in results:
        slot = (int(kw["block_table"][0, 0]), 3) if paged else (0, 3)
        row = k[slot][0, 1:3].float()
        assert row.tolist() == ([448.0, -448.0] if fp8 else [INF, -INF])


@triton.jit
def _saturate_kernel(X, Y):
    i = tl.arange(0, 8)
    tl.store(Y + i, _saturate_fp8(tl.load(X + i), 448.0, 3, -6))


def test_fp8_saturation_keeps_nan() -> None:
    """The fused stage's (and the append's) rounding to e4m3 before the store: NaN stays NaN
    (a bare clamp turns it into -448: max.f32 skips NaNs), inf saturates."""
    x = torch.tensor([NAN, -NAN, INF, -INF, 500.0, -0.3, 0.0, 1.0])
    y = torch.empty(8)
    _saturate_kernel[(1,)](x, y)
    assert y[:2].isnan().all()
    assert y[2:].tolist() == [448.0, -448.0, 448.0, -0.3125, 0.0, 1.0]


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_fused_stage_keeps_nan_in_an_fp8_cache(paged: bool) -> None:
    """NaN in a k or v head of the projection is stored as NaN in an fp8 cache by the fused
    stage, as the reference does (the clamp alone stored -448); the rest alike."""
    kw = block_inputs(paged, fp8=True)
    qkv = randn((2, 1, (HQ + 2 * HKV) * D))
    qkv[0, 0, (HQ + 1) * D + 3] = NAN  # k head 1 of sequence 0: the whole normed row
    qkv[1, 0, (HQ + HKV) * D + 2] = NAN  # v head 0 of sequence 1: one element
    stored = []
    for impl in IMPLS:
        k, v = kw["k_cache"].clone(), kw["v_cache"].clone()
        fn = qk_norm_rope_append if impl == "triton" else qk_norm_rope_append_reference
        fn(qkv, k, v, kw["cache_seqlens"], num_heads=HQ, num_kv_heads=HKV,
           q_norm_weight=torch.ones(D), k_norm_weight=torch.ones(D),
           block_table=kw.get("block_table"), k_scale=kw["k_scale"], v_scale=kw["v_scale"])
        stored.append((k.view(torch.uint8), v.view(torch.uint8)))
    (k_ref, v_ref), (k, v) = stored
    s0 = (1, 0) if paged else (0, 2)  # sequence 0's new position 2
    s1 = (3, 1) if paged else (1, 3)  # sequence 1's new position 3
    assert fp8_nan(k_ref[s0][1]).all() and not fp8_nan(k_ref[s0][0]).any()
    assert fp8_nan(v_ref[s1][0, 2]) and int(fp8_nan(v_ref[s1]).sum()) == 1
    for got, want in ((k, k_ref), (v, v_ref)):
        nan = (want & 0x7F) == 0x7F
        assert torch.equal(fp8_nan(got), nan), "NaN not stored as NaN"
        # One e4m3 step apart at most elsewhere (a value near a rounding boundary).
        diff = (got[~nan].view(FP8).float() - want[~nan].view(FP8).float()).abs()
        assert (diff <= want[~nan].view(FP8).float().abs() / 8 + 2.0 ** -9).all()


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])

def test_block_nan_input_reaches_its_token_only(paged: bool) -> None:
    """A NaN in one sequence's input gives NaN for that sequence only, on both paths (its
    keys are in its own cache rows)."""
    torch.manual_seed(0)
    blocks = {impl: DecodeAttentionBlock(HIDDEN, HQ, HKV, D, impl=impl) for impl in IMPLS}
    blocks["triton"].load_state_dict(blocks["torch"].state_dict())
    kw = block_inputs(paged)
    kw["x"][1, 0, 7] = NAN
    ys = []
    for impl in IMPLS:
        k, v = kw["k_cache"].clone(), kw["v_cache"].clone()
        with torch.no_grad():
            ys.append(blocks[impl](kw["x"], k, v, kw["cache_seqlens"],
                                   block_table=kw.get("block_table")))
    for y, impl in zip(ys, IMPLS):
        assert y[1].isnan().all() and not y[0].isnan().any(), impl
    assert_close(ys[1][0], ys[0][0], F32, "the other sequence")
