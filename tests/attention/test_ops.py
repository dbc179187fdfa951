"""``lmfuse.decode_attention``, ``merge_attention_states`` and ``kv_cache_append``: the Triton
kernels (under the interpreter) against an explicit float64 reference.

The oracle of every decode case is ``decode_attention_reference`` called with float64
queries (so it gathers, masks, softmaxes and multiplies in float64) on the *same* caches the
kernel reads (fp8 ones included: the reference dequantises them itself). Cache rows a
sequence does not hold, spare pool blocks and the rows of a block past the sequence's end
are NaN, so a kernel that reads anything it must not read gives NaN, not a small error.

Each dimension is covered by a few parametrized tests (layouts, active tokens and GQA,
windows, sinks, fp8, split counts, head dims, dtypes, strides, index dtypes, empty batch)
plus a seeded random combination of all of them; the interpreter is slow, so the shapes
are tiny and the split counts are kept where the merge (one program per row) stays cheap.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pytest
import torch
import triton
import triton.language as tl
from helpers import assert_close, max_rel_err, randn, to_paged

import lmfuse
from lmfuse.attention import ops
from lmfuse.attention.decode_kernels import _split_keys
from lmfuse.attention.reference import (decode_attention_reference,
                                        merge_attention_states_reference)

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
FP8 = torch.float8_e4m3fn
I32, I64 = torch.int32, torch.int64
NAN, INF = float("nan"), float("inf")
DTYPES = [pytest.param(d, id=str(d).replace("torch.", "")) for d in (F32, F16, BF16)]

# Split-count independence: splits=k against splits=1, both from the kernel. In float32 the
# two differ by float32 rounding only. In the half types the single-split program rounds
# its normalised output to the dtype once, the split path rounds the float32 merge once:
# at most one ulp of the output apart (2^-10 / 2^-7 of |value| <= max|out|), plus, for
# fp16, the probabilities fed to the PV dot rounded to fp16 against different maxima.
SPLIT_TOL = {F32: 2e-6, F16: 1.5e-3, BF16: 8e-3}
LSE_SPLIT_TOL = 2e-6  # the LSE is float32 on every path


# --- decode cases -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One decode_attention call. ``block_len=None``: a contiguous ``[B, s_max, Hkv, D]`` cache;
    otherwise a paged pool with shuffled block ids, spare (NaN) blocks and ``extra_blocks``
    columns of -1 after the blocks each sequence needs."""

    lens: tuple[int, ...]
    s_max: int = 24
    s_active: int = 2
    hq: int = 4
    hkv: int = 1
    d: int = 32
    dtype: torch.dtype = F32
    block_len: Optional[int] = None
    extra_blocks: int = 1
    window: Optional[int] = None
    sinks: bool = False
    fp8: bool = False  # float8_e4m3fn caches with per-KV-head k_scale / v_scale
    scales: str = "kv"  # with fp8: "kv" both scales, "k" k_scale only, "" none
    scale: Optional[float] = None
    splits: Optional[int] = None
    index_dtype: torch.dtype = I32
    softcap: Optional[float] = None

    def __post_init__(self) -> None:
        assert max(self.lens, default=0) <= self.s_max

    def describe(self) -> str:
        layout = "contig" if self.block_len is None else f"paged{self.block_len}"
        parts = [str(self.dtype).replace("torch.", ""), layout, f"lens{list(self.lens)}",
                 f"S{self.s_max}", f"s{self.s_active}", f"h{self.hq}/{self.hkv}", f"d{self.d}"]
        parts += [f"w{self.window}"] if self.window is not None else []
        parts += ["sinks"] if self.sinks else []
        parts += [f"fp8[{self.scales}]"] if self.fp8 else []
        parts += [f"scale{self.scale:.3g}"] if self.scale is not None else []
        parts += [f"splits{self.splits}"] if self.splits is not None else []
        parts += ["int64"] if self.index_dtype == I64 else []
        parts += [f"softcap{self.softcap}"] if self.softcap is not None else []
        return "-".join(parts)


@dataclass
class Inputs:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cache_seqlens: torch.Tensor
    block_table: Optional[torch.Tensor]
    sinks: Optional[torch.Tensor]
    k_scale: Optional[torch.Tensor]
    v_scale: Optional[torch.Tensor]

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k_cache, self.v_cache, self.cache_seqlens

    def kwargs(self, case: Case) -> dict[str, Any]:
        return dict(block_table=self.block_table, scale=case.scale, window_size=case.window,
                    sinks=self.sinks, k_scale=self.k_scale, v_scale=self.v_scale,
                    softcap=case.softcap)


def contiguous_caches(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[B, s_max, Hkv, D]`` in the cache dtype, NaN past each sequence's length."""
    B = len(case.lens)
    caches = []
    for _ in range(2):
        x = randn((B, case.s_max, case.hkv, case.d), F32, scale=2.0 if case.fp8 else 1.0)
        for b, length in enumerate(case.lens):
            x[b, length:] = NAN
        caches.append(x.to(FP8 if case.fp8 else case.dtype))
    return caches[0], caches[1]


def build(case: Case) -> Inputs:
    B = len(case.lens)
    q = randn((B, case.s_active, case.hq, case.d), case.dtype)
    k, v = contiguous_caches(case)
    table = None
    if case.block_len is not None:
        (k, v), table = to_paged((k, v), case.lens, case.block_len,
                                 extra_columns=case.extra_blocks,
                                 index_dtype=case.index_dtype)
    sinks = randn((case.hq,), F32, scale=2.0) if case.sinks else None
    k_scale = v_scale = None
    if case.fp8 and "k" in case.scales:
        k_scale = torch.rand(case.hkv) * 1.5 + 0.25
    if case.fp8 and "v" in case.scales:
        v_scale = torch.rand(case.hkv) * 1.5 + 0.25
    lens = torch.tensor(case.lens, dtype=case.index_dtype)
    return Inputs(q, k, v, lens, table, sinks, k_scale, v_scale)


def reference(inp: Inputs, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 out and lse: float64 queries, sinks and scales; the caches the kernel reads."""
    def f64(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else t.to(F64)

    return decode_attention_reference(
        f64(inp.q), inp.k_cache, inp.v_cache, inp.cache_seqlens, block_table=inp.block_table,
        scale=case.scale, window_size=case.window, sinks=f64(inp.sinks),
        k_scale=f64(inp.k_scale), v_scale=f64(inp.v_scale), return_lse=True,
        softcap=case.softcap)


def run(inp: Inputs, case: Case, splits: Optional[int] = -1, impl: str = "triton"):
    splits = case.splits if splits == -1 else splits
    return lmfuse.decode_attention(*inp.args(), **inp.kwargs(case), return_lse=True,
                                   num_splits=splits, impl=impl)


def check(out: torch.Tensor, lse: torch.Tensor, want: torch.Tensor, want_lse: torch.Tensor,
          dtype: torch.dtype, what: str) -> None:
    """out and lse against the float64 reference; rows that see nothing (no key, no sink) are
    exactly zeros and exactly -inf. The LSE is float32 on every path, from scores that are
    exact products of the inputs summed in float32: float32's tolerance whatever the dtype."""
    assert out.dtype == dtype, f"{what}: out dtype {out.dtype} != {dtype}"
    assert lse.dtype == F32, f"{what}: lse dtype {lse.dtype} != float32"
    assert lse.shape == want_lse.shape, f"{what}: lse shape {tuple(lse.shape)}"
    assert_close(out, want, dtype, f"{what}: out")
    empty = want_lse == -INF
    assert torch.equal(lse == -INF, empty), f"{what}: lse is -inf on other rows than expected"
    assert not torch.isnan(lse).any(), f"{what}: lse has NaN"
    assert torch.equal(out[empty], torch.zeros_like(out[empty])), (
        f"{what}: a row that sees nothing is not zeros")
    assert_close(lse, want_lse, F32, f"{what}: lse")


def check_case(case: Case, inp: Optional[Inputs] = None) -> tuple[Inputs, torch.Tensor,
                                                                   torch.Tensor]:
    inp = build(case) if inp is None else inp
    out, lse = run(inp, case)
    want, want_lse = reference(inp, case)
    check(out, lse, want, want_lse, case.dtype, case.describe())
    return inp, out, lse


# --- decode_attention: one dimension at a time -----------------------------------------------

LAYOUTS = {
    "contiguous": dict(),
    "paged-block1": dict(block_len=1),
    "paged-block3": dict(block_len=3),
    "paged-block16": dict(block_len=16),
    "paged-block7-not-dividing": dict(block_len=7),
    "paged-block64-longer-than-context": dict(block_len=64, extra_blocks=2),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("s_max, lens", [(24, (0, 1, 2, 24)), (150, (150, 17, 129))],
                         ids=["S24", "S150-several-key-tiles"])
def test_cache_layouts(layout: str, s_max: int, lens: tuple[int, ...]) -> None:
    """Contiguous and paged caches (shuffled pools, -1 padding) over ragged lengths, the
    empty one, one shorter than and one equal to s_active among them."""
    check_case(Case(lens=lens, s_max=s_max, s_active=2, hq=4, hkv=2, d=32, **LAYOUTS[layout]))


GQA_CASES = [  # (s_active, hq, hkv): s_active 1..8, groups 1/4/8, a group of 16 (two row blocks)
    (1, 8, 1), (2, 4, 1), (3, 2, 2), (3, 8, 2), (4, 8, 1), (5, 4, 1), (6, 1, 1), (7, 8, 1),
    (8, 8, 1), (8, 4, 4), (8, 16, 1),
]


@pytest.mark.parametrize("s_active, hq, hkv", GQA_CASES,
                         ids=[f"s{s}-h{q}/{k}" for s, q, k in GQA_CASES])
def test_active_tokens_and_gqa(s_active: int, hq: int, hkv: int) -> None:
    """Every s_active with query groups 1, 4, 8 (and 16); lengths 0 or 1, s_active and full;
    every other case paged."""
    lens = (s_active % 2, s_active, 19)
    check_case(Case(lens=lens, s_max=19, s_active=s_active, hq=hq, hkv=hkv, d=16,
                    block_len=3 if s_active % 2 == 0 else None))


@pytest.mark.parametrize("s_active, splits, fp8", [(2, None, False), (4, 3, False),
                                                   (5, None, True)],
                         ids=["s2", "s4-splits3", "s5-fp8"])
def test_active_tokens_at_every_tile_boundary(s_active: int, splits: Optional[int], fp8: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Several active tokens over 16-key tiles: lengths on both sides of the tiles' edges
    (and shorter than s_active) put the rows' positions, and the first key only some rows
    see, in every place of a tile; the caches hold NaN past each length, so a key taken on
    the wrong side of a row's position shows."""
    from lmfuse import tuning

    tiles = {"block_n_by_head_dim": [[1048576, 16]], "few_programs": {}}
    table = dict(tuning.table("decode_attention", torch.device("cpu")), **tiles, paged=tiles,
                 fp8=tiles, fp8_paged=tiles)
    real = tuning.table
    monkeypatch.setattr(tuning, "table", lambda family, device: dict(table)
                        if family == "decode_attention" else real(family, device))
    lens = (1, 3, 15, 16, 17, 18, 19, 20, 21, 31, 32, 33, 34, 35, 36, 37, 47, 48, 49)
    case = Case(lens=lens, s_max=49, s_active=s_active, hq=4, hkv=1, d=16, fp8=fp8,
                block_len=4, splits=splits)
    inp, _, _ = check_case(case)
    plan = lmfuse.explain(lmfuse.decode_attention, *inp.args(), **inp.kwargs(case),
                          num_splits=splits)
    assert plan.call.launch.BLOCK_N == 16


@pytest.mark.parametrize("window", [0, 1, 5, 70, 500])
@pytest.mark.parametrize("layout", ["contiguous", "paged5"])
def test_sliding_window(window: int, layout: str) -> None:
    """Window 0 (each token sees itself), small ones (on length 80 the walk starts past the
    first key tile of 64), 70 (starting near 0) and one larger than any context."""
    check_case(Case(lens=(0, 2, 37, 80), s_max=80, s_active=3, hq=4, hkv=1, d=16,
                    window=window, block_len=5 if layout == "paged5" else None))


@pytest.mark.parametrize("window, splits", [(5, 3), (70, 4), (0, 7), (2, 2)])
def test_sliding_window_with_splits(window: int, splits: int) -> None:
    """The splits cut [window start rounded down to a key tile, L), not [0, L)."""
    case = Case(lens=(80, 2, 41), s_max=80, s_active=2, hq=2, hkv=1, d=16, window=window,
                block_len=16, splits=splits)
    inp, out, lse = check_case(case)
    one, one_lse = run(inp, case, splits=1)
    assert max_rel_err(out, one) <= SPLIT_TOL[F32]
    assert torch.equal(lse == -INF, one_lse == -INF)


@pytest.mark.parametrize("window, splits", [(None, None), (2, None), (None, 3), (3, 4)],
                         ids=["plain", "window2", "splits3", "window3-splits4"])
def test_sinks(window: Optional[int], splits: Optional[int]) -> None:
    """Sinks join each head's denominator once (in one split); a sequence of length 0 gives
    zeros and lse = the sink's logit (the logsumexp of the sink alone)."""
    case = Case(lens=(0, 1, 5, 30), s_max=30, s_active=2, hq=4, hkv=1, d=16, sinks=True,
                window=window, splits=splits, block_len=4)
    inp, out, lse = check_case(case)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    sink = inp.sinks.expand(case.s_active, case.hq)
    assert max_rel_err(lse[0], sink) <= 1e-6, "length 0 with sinks: lse != sink logit"
    # length 1 with s_active 2: the first token sees nothing but its sink
    assert torch.equal(out[1, 0], torch.zeros_like(out[1, 0]))
    assert max_rel_err(lse[1, 0], inp.sinks) <= 1e-6
    assert torch.isfinite(lse).all(), "with sinks no row is empty"


SOFTCAP_CASES = [
    Case(lens=(0, 1, 5, 30), s_max=30, s_active=2, hq=4, hkv=2, d=16, softcap=2.0),
    Case(lens=(9, 30), s_max=30, s_active=1, hq=4, hkv=1, d=32, softcap=0.5, scale=1.5,
         block_len=4, splits=3),
    Case(lens=(7, 20), s_max=20, s_active=3, hq=2, hkv=1, d=16, softcap=50.0, window=4,
         sinks=True, dtype=F16),
    Case(lens=(12, 3), s_max=16, s_active=1, hq=4, hkv=2, d=16, softcap=1.0, fp8=True,
         block_len=8, dtype=BF16),
]


@pytest.mark.parametrize("case", SOFTCAP_CASES, ids=[c.describe() for c in SOFTCAP_CASES])
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_softcap(case: Case, impl: str) -> None:
    """Gemma 2's ``softcap * tanh(scores / softcap)`` before the softmax (sinks not capped),
    against the float64 reference: a tight cap (0.5: every score capped hard), a loose one
    (50: nearly the plain scores), with splits, windows, sinks, paged and fp8 caches."""
    inp = build(case)
    out, lse = run(inp, case, impl=impl)
    want, want_lse = reference(inp, case)
    check(out, lse, want, want_lse, case.dtype, f"{impl} {case.describe()}")
    if case.softcap <= 2.0:  # a real cap changes the answer
        plain = decode_attention_reference(*inp.args(), **{**inp.kwargs(case), "softcap": None})
        assert max_rel_err(out, plain) > 1e-3


@pytest.mark.parametrize("softcap, error", [(0.0, ValueError), (-1.0, ValueError),
                                            (float("nan"), ValueError), ("2", TypeError)])
def test_softcap_bad_values(softcap, error) -> None:
    case = Case(lens=(3,), s_max=4, s_active=1)
    inp = build(case)
    with pytest.raises(error, match="softcap"):
        lmfuse.decode_attention(*inp.args(), softcap=softcap)


FP8_CASES = [(d, "contiguous", "kv", None) for d in (F32, F16, BF16)] + [
    (d, "paged4", "kv", None) for d in (F32, F16, BF16)] + [
    (F32, "paged4", "k", 3), (F16, "paged4", "k", 2), (BF16, "contiguous", "", None),
    (F16, "contiguous", "", None)]


@pytest.mark.parametrize("dtype, layout, scales, splits", FP8_CASES,
                         ids=[f"{str(d)[6:]}-{lay}-scales[{sc}]" + (f"-splits{k}" if k else "")
                              for d, lay, sc, k in FP8_CASES])
def test_fp8_cache(dtype: torch.dtype, layout: str, scales: str, splits: Optional[int]) -> None:
    """float8_e4m3fn caches with per-KV-head scales, against the reference on the same fp8
    tensors."""
    check_case(Case(lens=(0, 7, 21), s_max=21, s_active=2, hq=4, hkv=2, d=32, dtype=dtype,
                    fp8=True, scales=scales, splits=splits, sinks=splits is not None,
                    block_len=4 if layout == "paged4" else None))


SPLIT_CASES = [(F32, 2), (F32, 3), (F32, 5), (F32, 8), (F32, 16), (F16, 4), (F16, 7),
               (BF16, 3)]


@pytest.mark.parametrize("dtype, splits", SPLIT_CASES,
                         ids=[f"{str(d)[6:]}-splits{k}" for d, k in SPLIT_CASES])
def test_forced_splits(dtype: torch.dtype, splits: int) -> None:
    """The result does not depend on the split count beyond rounding: splits=k against
    splits=1 (tightly) and both against the reference. Lengths 0 and 1 leave most splits
    empty (-inf partials)."""
    case = Case(lens=(0, 1, 29), s_max=29, s_active=2, hq=4, hkv=1, d=16, dtype=dtype,
                sinks=True, block_len=4, splits=splits)
    inp, out, lse = check_case(case)
    plan = lmfuse.explain(lmfuse.decode_attention, *inp.args(), **inp.kwargs(case),
                          num_splits=splits)
    assert plan.call.launch.splits == splits and plan.call.launch.forced_splits
    one, one_lse = run(inp, case, splits=1)
    check(one, one_lse, *reference(inp, case), dtype, "splits=1")
    err = max_rel_err(out, one)
    assert err <= SPLIT_TOL[dtype], f"splits={splits} vs 1: out differs by {err:.2e}"
    assert torch.equal(lse == -INF, one_lse == -INF)
    fin = torch.isfinite(one_lse)
    err = max_rel_err(lse[fin], one_lse[fin])
    assert err <= LSE_SPLIT_TOL, f"splits={splits} vs 1: lse differs by {err:.2e}"


@pytest.mark.parametrize("d, layout, splits", [(80, "paged16", None), (48, "contiguous", 2),
                                               (16, "contiguous", None)],
                         ids=["d80-paged", "d48-splits2", "d16"])
def test_head_dims(d: int, layout: str, splits: Optional[int]) -> None:
    """Head dims that are not powers of two (masked to the next one in the kernel)."""
    check_case(Case(lens=(9, 33), s_max=33, s_active=2, hq=4, hkv=2, d=d, splits=splits,
                    block_len=16 if layout == "paged16" else None))


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes(dtype: torch.dtype) -> None:
    """fp32 / fp16 / bf16 (bf16 dots in fp32 in the interpreter) on a paged GQA case with
    sinks, an explicit scale and ragged lengths."""
    check_case(Case(lens=(0, 1, 3, 45), s_max=45, s_active=3, hq=8, hkv=2, d=32, dtype=dtype,
                    block_len=5, sinks=True, scale=0.3))


def test_torch_path_matches_float64_reference() -> None:
    """impl='torch' (the float32 reference) on the same inputs as the kernels."""
    case = Case(lens=(0, 5, 20), s_max=20, s_active=3, hq=4, hkv=2, d=16, block_len=3,
                sinks=True, window=4)
    inp = build(case)
    out, lse = run(inp, case, impl="torch")
    check(out, lse, *reference(inp, case), F32, "impl=torch")


@pytest.mark.parametrize("view", ["transposed-q", "strided-last-dim-q", "packed-kv-cache",
                                  "k-and-v-strides-differ", "transposed-block-table"])
def test_non_contiguous_inputs(view: str) -> None:
    """Views: q from [B, Hq, s, D] transposed, q with a last-dim stride of 2, K/V as halves of
    one packed [B, S, 2, Hkv, D] tensor with strided sinks, V head-major ([B, Hkv, S, D]
    transposed) beside a contiguous K, a column-major block table."""
    case = Case(lens=(3, 17, 11), s_max=17, s_active=3, hq=4, hkv=2, d=16, sinks=True,
                block_len=4 if view == "transposed-block-table" else None)
    inp = build(case)
    want, want_lse = reference(inp, case)
    if view == "transposed-q":
        inp.q = inp.q.transpose(1, 2).contiguous().transpose(1, 2)
    elif view == "strided-last-dim-q":
        wide = torch.stack([inp.q, torch.full_like(inp.q, NAN)], dim=-1)
        inp.q = wide.flatten(-2)[..., ::2]
        assert inp.q.stride(-1) == 2
    elif view == "packed-kv-cache":
        kv = torch.stack([inp.k_cache, inp.v_cache], dim=2)
        inp.k_cache, inp.v_cache = kv[:, :, 0], kv[:, :, 1]
        inp.sinks = torch.stack([inp.sinks, torch.full_like(inp.sinks, NAN)], 1)[:, 0]
    elif view == "k-and-v-strides-differ":
        inp.v_cache = inp.v_cache.transpose(1, 2).contiguous().transpose(1, 2)
    else:
        inp.block_table = inp.block_table.t().contiguous().t()
    viewed = {"transposed-q": inp.q, "strided-last-dim-q": inp.q,
              "packed-kv-cache": inp.k_cache, "k-and-v-strides-differ": inp.v_cache,
              "transposed-block-table": inp.block_table}[view]
    assert not viewed.is_contiguous(), view
    out, lse = run(inp, case)
    check(out, lse, want, want_lse, F32, view)


@pytest.mark.parametrize("layout", ["contiguous", "paged3"])
def test_int64_index_tensors(layout: str) -> None:
    """int64 cache_seqlens (and an int64 block table)."""
    check_case(Case(lens=(0, 6, 13), s_max=13, s_active=2, hq=2, hkv=1, d=16,
                    index_dtype=I64, block_len=3 if layout == "paged3" else None))


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("splits", [None, 4])
def test_empty_batch(layout: str, splits: Optional[int]) -> None:
    """B = 0: an empty output and lse of the right shapes and dtypes, on both paths."""
    q = randn((0, 2, 4, 16), F16)
    if layout == "contiguous":
        k, v, table = torch.zeros(0, 8, 2, 16, dtype=F16), torch.zeros(0, 8, 2, 16, dtype=F16), None
    else:
        k, v = torch.zeros(5, 4, 2, 16, dtype=F16), torch.zeros(5, 4, 2, 16, dtype=F16)
        table = torch.zeros(0, 3, dtype=I32)
    lens = torch.zeros(0, dtype=I32)
    for impl in ("triton", "torch"):
        out, lse = lmfuse.decode_attention(q, k, v, lens, block_table=table, return_lse=True,
                                           num_splits=splits if impl == "triton" else None,
                                           impl=impl)
        assert out.shape == (0, 2, 4, 16) and out.dtype == F16, impl
        assert lse.shape == (0, 2, 4) and lse.dtype == F32, impl
        assert lmfuse.decode_attention(q, k, v, lens, block_table=table,
                                       impl=impl).shape == (0, 2, 4, 16)


# --- decode_attention: random combinations ---------------------------------------------------


def random_case(seed: int) -> Case:
    r = random.Random(seed)
    s_active = r.randint(1, 8)
    group = r.choice([1, 4, 8])
    hkv = r.choice([1, 2]) if group < 8 else 1
    s_max = r.randint(max(s_active, 4), 80)
    B = r.randint(1, 3)
    lens = tuple(r.choice([0, 1, s_active, r.randint(0, s_max), s_max]) for _ in range(B))
    splits = r.choice([None, 1, r.randint(2, 16)])
    # The interpreter runs one program per (sequence, KV head, split) and one merge step per
    # (row, split): keep both small.
    while splits is not None and splits > 1 and (B * s_active * group * hkv * splits > 256
                                                 or B * hkv * splits > 24):
        splits //= 2
    fp8 = r.random() < 0.25
    return Case(lens=lens, s_max=s_max, s_active=s_active, hq=group * hkv, hkv=hkv,
                d=r.choice([16, 32, 32, 48]), dtype=r.choice([F32, F32, F16, BF16]),
                block_len=r.choice([None, None, 1, 3, 5, 16, 128]),
                extra_blocks=r.randint(0, 2),
                window=r.choice([None, None, 0, r.randint(1, 20), 1000]),
                sinks=r.random() < 0.4, fp8=fp8, scales=r.choice(["kv", "k", ""]) if fp8 else "kv",
                scale=r.choice([None, None, round(r.uniform(0.05, 0.5), 3)]), splits=splits,
                index_dtype=r.choice([I32, I64]))


RANDOM_CASES = [random_case(seed) for seed in range(20)]


@pytest.mark.parametrize("case", RANDOM_CASES, ids=[c.describe() for c in RANDOM_CASES])
def test_random_combinations(case: Case) -> None:
    """Seeded random combinations of every dimension; with several splits, also against the
    single-split result."""
    inp, out, lse = check_case(case)
    if case.splits is not None and case.splits > 1:
        one, one_lse = run(inp, case, splits=1)
        assert max_rel_err(out, one) <= SPLIT_TOL[case.dtype]
        assert torch.equal(lse == -INF, one_lse == -INF)


def test_random_combinations_cover_every_dimension() -> None:
    """The 20 seeded cases do reach each value the issue lists (so the random test is not
    quietly narrower than it looks)."""
    seen = lambda f: {f(c) for c in RANDOM_CASES}  # noqa: E731
    assert seen(lambda c: c.dtype) == {F32, F16, BF16}
    assert {None, 1, 3, 16} <= seen(lambda c: c.block_len)
    assert {True, False} == seen(lambda c: c.fp8) == seen(lambda c: c.sinks)
    assert {None, 0, 1000} <= seen(lambda c: c.window)
    assert {1, 4, 8} == seen(lambda c: c.hq // c.hkv)
    assert any(c.splits and c.splits > 1 for c in RANDOM_CASES)
    assert any(0 in c.lens for c in RANDOM_CASES) and any(1 in c.lens for c in RANDOM_CASES)
    assert {I32, I64} == seen(lambda c: c.index_dtype)


# --- explain --------------------------------------------------------------------------------


class _SplitSpy:
    """Stands in for ``decode_kernels`` and records the split dimension of every launch of
    ``decode_kernel`` (grid ``(sequence x KV head, split, row block)``)."""

    def __init__(self, real: Any) -> None:
        self.real, self.splits = real, []

    def __getattr__(self, name: str) -> Any:
        kernel = getattr(self.real, name)
        if name != "decode_kernel":
            return kernel
        spy = self

        class Launcher:
            def __getitem__(self, grid):
                spy.splits.append(grid[1])
                return kernel[grid]

        return Launcher()


def test_split_chooser_counts_whole_key_tiles() -> None:
    """The heuristic's splits hold whole key tiles: a cache's last, partial tile may be a
    split of its own (656 keys in 128-key tiles: 6 splits of one tile, where splitting the
    keys themselves allowed 5 and rounded each to 2 tiles, 3 splits); never fewer than
    ``min_keys_per_split`` keys a split, nor more splits than tiles or ``max_splits``."""
    choose = ops._choose_splits
    assert choose(4, 656, 128, 264, 128, 128, 128) == 6
    assert choose(4, 1024, 128, 264, 128, 128, 128) == 8  # whole tiles: as before
    assert choose(4, 656, 128, 264, 256, 128, 128) == 3  # 2 tiles (256 keys) a split
    assert choose(4, 656, 128, 264, 128, 128, 4) == 3  # 4 would leave one empty
    assert choose(4, 100, 128, 264, 128, 128, 128) == 1  # one tile
    assert choose(4, 0, 128, 264, 128, 128, 128) == 1
    assert choose(4096, 656, 128, 264, 128, 128, 128) == 1  # programs fill the GPU


@triton.jit
def _split_keys_probe(BASE, LEN, OUT, num_splits, keys_per_split, BLOCK_N: tl.constexpr,
                      EVEN_TILES: tl.constexpr):
    i, split = tl.program_id(0), tl.program_id(1)
    start, end = _split_keys(tl.load(BASE + i), tl.load(LEN + i), split, num_splits,
                             keys_per_split, BLOCK_N, EVEN_TILES)
    tl.store(OUT + (i * num_splits + split) * 2, start)
    tl.store(OUT + (i * num_splits + split) * 2 + 1, end)


@pytest.mark.parametrize("splits", [1, 2, 3, 4, 7])
def test_split_keys_deal_a_sequences_own_tiles(splits: int) -> None:
    """The heuristic's splits (EVEN_TILES) cut each sequence's own keys ``[base, L)``: the
    ranges follow one another from ``base`` to ``L``, each whole tiles but the last, their
    tile counts within one of each other, so a sequence shorter than the capacity leaves no
    split empty while it has a tile for each; a forced count's ranges are consecutive
    ``keys_per_split`` pieces, cut at ``L``."""
    bn = 16
    cases = [(0, 0), (0, 1), (0, 16), (0, 17), (0, 100), (0, 160), (32, 33), (48, 250),
             (0, 656), (64, 64)]
    base = torch.tensor([b for b, _ in cases], dtype=torch.int32)
    lens = torch.tensor([n for _, n in cases], dtype=torch.int32)
    for even, kps in ((True, 0), (False, 21)):
        out = torch.zeros((len(cases), splits, 2), dtype=torch.int32)
        _split_keys_probe[(len(cases), splits)](base, lens, out, splits, kps, BLOCK_N=bn,
                                                EVEN_TILES=even)
        for (b, n), got in zip(cases, out.tolist()):
            if not even:
                want = [(min(b + s * kps, n), min(b + (s + 1) * kps, n)) for s in range(splits)]
                got = [(min(st, n), en) for st, en in got]  # an empty range's start: unused
                assert [(st, max(en, st)) for st, en in got] == [
                    (st, max(en, st)) for st, en in want], (b, n, got)
                continue
            assert got[0][0] == b and got[-1][1] == n, (b, n, got)
            assert all(got[s][1] == got[s + 1][0] for s in range(splits - 1)), (b, n, got)
            tiles = [-(-(en - st) // bn) for st, en in got]
            assert all(st % bn == 0 for st, _ in got), (b, n, got)
            assert max(tiles) - min(tiles) <= 1 and sum(tiles) == -(-(n - b) // bn), (b, n, got)


@pytest.mark.parametrize("block_len", [None, 8])
def test_heuristic_splits_of_sequences_shorter_than_the_cache(block_len) -> None:
    """Sequences far shorter than the capacity, split by the heuristic: every split holds
    some of each sequence's keys; the result is the reference's."""
    case = Case(lens=(300, 77), s_max=1024, s_active=1, hq=4, hkv=1, d=16,
                block_len=block_len)
    inp = build(case)
    plan = lmfuse.explain(lmfuse.decode_attention, *inp.args(), **inp.kwargs(case))
    assert plan.call.launch.splits > 1 and not plan.call.launch.forced_splits
    out, lse = run(inp, case, splits=None)
    check(out, lse, *reference(inp, case), F32, "heuristic splits, short sequences")


def test_explain_reports_path_and_split_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """explain names the Triton path and the split count, forced or heuristic, and that is
    the count the call runs."""
    spy = _SplitSpy(ops._kernels())
    monkeypatch.setattr(ops, "_kernels", lambda: spy)

    case = Case(lens=(5, 12), s_max=12, s_active=1, hq=4, hkv=2, d=16)
    inp = build(case)
    plan = lmfuse.explain(lmfuse.decode_attention, *inp.args(), num_splits=3)
    assert plan.impl == "triton" and "triton" in str(plan)
    assert "3 split(s) (forced" in plan.details["grid"], plan.details
    assert "merge" in plan.details
    lmfuse.decode_attention(*inp.args(), num_splits=3)
    assert spy.splits == [3]

    plan = lmfuse.explain(lmfuse.decode_attention, *inp.args())
    assert "1 split(s) (heuristic" in plan.details["grid"] and "merge" not in plan.details
    lmfuse.decode_attention(*inp.args())
    assert spy.splits == [3, 1]

    # A long cache and few (sequence, KV head) programs: the heuristic splits it.
    long = Case(lens=(512,), s_max=512, s_active=1, hq=4, hkv=1, d=16)
    inp = build(long)
    plan = lmfuse.explain(lmfuse.decode_attention, *inp.args())
    splits = plan.call.launch.splits
    assert splits > 1 and not plan.call.launch.forced_splits
    assert f"{splits} split(s) (heuristic" in plan.details["grid"]
    out, lse = run(inp, long, splits=None)
    assert spy.splits == [3, 1, splits]
    check(out, lse, *reference(inp, long), F32, "heuristic splits")

    plan = lmfuse.explain(lmfuse.decode_attention, *inp.args(), impl="torch")
    assert plan.impl == "torch" and "grid" not in plan.details
    plan = lmfuse.explain(lmfuse.decode_attention, inp.q.double(), inp.k_cache.double(),
                          inp.v_cache.double(), inp.cache_seqlens)
    assert plan.impl == "torch" and "float64" in plan.reason


# --- merge_attention_states -----------------------------------------------------------------


def merge_direct(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge written out in float64: lse = log sum exp(lse_p), out = sum exp(lse_p - lse)
    out_p; a row with no finite partial gives zeros and -inf."""
    lses, outs = lses.to(F64), outs.to(F64)
    lse = torch.logsumexp(lses, dim=0)
    w = torch.exp(lses - torch.where(torch.isfinite(lse), lse, 0.0))
    w = torch.where(torch.isfinite(lse), w, 0.0)
    return (w[..., None] * outs).sum(0), lse


def merge_inputs(shape: tuple[int, ...], dtype: torch.dtype):
    """Random partials [P, ...] with some empty ones (-inf, their out left as junk) and one
    row where every partial is empty."""
    outs = randn(shape, dtype)
    lses = randn(shape[:-1], F32, scale=3.0)
    lses[torch.rand(lses.shape) < 0.3] = -INF
    lses.view(shape[0], -1)[:, 0] = -INF
    return outs, lses


MERGE_CASES = [((1, 2, 3, 4, 16), F32), ((2, 2, 1, 4, 16), F32), ((5, 1, 3, 2, 80), F32),
               ((3, 3, 2, 2, 48), F32), ((2, 2, 1, 4, 16), F16), ((5, 1, 3, 2, 80), F16),
               ((3, 3, 2, 2, 48), BF16), ((4, 2, 2, 2, 16), BF16),
               # several column blocks (32 columns each), and more partials than the kernel
               # reads in one step (128 at 32 columns)
               ((37, 2, 1, 2, 256), F32), ((130, 1, 1, 3, 64), BF16)]


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("shape, dtype", MERGE_CASES,
                         ids=[f"{'x'.join(map(str, s))}-{str(d)[6:]}" for s, d in MERGE_CASES])
def test_merge_matches_direct(impl: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """[P, B, S, H, D] partials (fp16/bf16 outs too) against the float64 formula, -inf
    partials adding nothing and all -inf rows giving zeros and -inf."""
    outs, lses = merge_inputs(shape, dtype)
    out, lse = lmfuse.merge_attention_states(outs, lses, impl=impl)
    want, want_lse = merge_direct(outs, lses)
    assert out.dtype == dtype and lse.dtype == F32
    assert out.shape == shape[1:] and lse.shape == shape[1:-1]
    assert_close(out, want, dtype, f"merge {impl}: out")
    empty = want_lse == -INF
    assert empty.any() and torch.equal(lse == -INF, empty)
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert_close(lse, want_lse, F32, f"merge {impl}: lse")


@pytest.mark.parametrize("P", [1, 130])
def test_merge_every_partial_counts(P: int) -> None:
    """Each partial alone (the others empty) gives exactly its own output: the merge reads
    all of them, the last of several steps and every 32-column block included."""
    outs = randn((P, 2, 3, 80), F32)
    for only in sorted({0, P // 2, P - 1}):
        lses = torch.full((P, 2, 3), -INF)
        lses[only] = randn((2, 3), F32)
        out, lse = lmfuse.merge_attention_states(outs, lses, impl="triton")
        assert torch.allclose(out, outs[only], rtol=1e-6, atol=0), only
        assert torch.allclose(lse, lses[only], rtol=1e-6, atol=1e-6), only


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_merge_all_empty_and_non_contiguous(impl: str) -> None:
    """Every partial empty: zeros and -inf (fp16 outs). A transposed view of the partials
    merges like its contiguous copy."""
    outs = randn((3, 2, 5, 16), F16)
    out, lse = lmfuse.merge_attention_states(outs, torch.full((3, 2, 5), -INF), impl=impl)
    assert torch.equal(out, torch.zeros(2, 5, 16, dtype=F16))
    assert torch.equal(lse, torch.full((2, 5), -INF))
    outs, lses = merge_inputs((3, 4, 2, 16), F32)
    out, lse = lmfuse.merge_attention_states(outs.transpose(1, 2), lses.transpose(1, 2),
                                             impl=impl)
    want, want_lse = merge_direct(outs, lses)
    assert_close(out, want.transpose(0, 1), F32, "transposed partials: out")
    assert_close(lse, want_lse.transpose(0, 1), F32, "transposed partials: lse")


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_merge_empty_rows_tensor(impl: str) -> None:
    """No rows at all: empty results of the right shapes."""
    out, lse = lmfuse.merge_attention_states(randn((2, 0, 3, 16), F32), torch.zeros(2, 0, 3),
                                             impl=impl)
    assert out.shape == (0, 3, 16) and lse.shape == (0, 3) and lse.dtype == F32


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("out_dtype", [F16, BF16, F32])
def test_merge_out_dtype_is_written_directly(impl: str, out_dtype: torch.dtype) -> None:
    """``out_dtype``: float32 partials merged into another dtype: the float32 merge rounded
    to it (the kernel stores the dtype; Triton's interpreter may round bf16 differently from
    torch, so within the dtype's tolerance), the LSE unchanged."""
    outs, lses = merge_inputs((3, 2, 3, 2, 48), F32)
    out, lse = lmfuse.merge_attention_states(outs, lses, out_dtype=out_dtype, impl=impl)
    full, full_lse = lmfuse.merge_attention_states(outs, lses, impl=impl)
    assert out.dtype == out_dtype and lse.dtype == F32
    assert_close(out, full, out_dtype, f"merge {impl} into {out_dtype}")
    assert torch.equal(lse, full_lse)


@pytest.mark.parametrize("impl", ["triton", "torch", "auto"])
def test_merge_half_partials_into_float32_keep_float32_accuracy(
        monkeypatch: pytest.MonkeyPatch, impl: str) -> None:
    """bfloat16 partials merged with ``out_dtype=float32``: the float32 merge written as it
    is on every path (``auto``: the default CPU path, interpreter off), never rounded to
    bfloat16 on the way (the float64 merge of the same partials within float32's
    tolerance)."""
    if impl == "auto":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert lmfuse.explain(lmfuse.merge_attention_states, randn((2, 3, 8)),
                              torch.zeros(2, 3)).impl == "torch"
    outs, lses = merge_inputs((2, 64, 64), BF16)
    out, _ = lmfuse.merge_attention_states(outs, lses, out_dtype=F32, impl=impl)
    want, _ = merge_attention_states_reference(outs.double(), lses.double())
    assert out.dtype == F32
    assert_close(out, want, F32, f"merge {impl} bf16 -> float32")


def test_merge_out_dtype_must_be_a_float_dtype() -> None:
    outs, lses = merge_inputs((2, 3, 16), F32)
    with pytest.raises(TypeError, match="out_dtype must be a floating torch.dtype"):
        lmfuse.merge_attention_states(outs, lses, out_dtype=torch.int32)


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [F32, F16])
def test_decode_attention_partials_pack_out_and_lse(impl: str, splits: int,
                                                   dtype: torch.dtype) -> None:
    """``ops.decode_attention_partials``: the flat float32 [outputs | LSEs] of
    ``decode_attention(return_lse=True)`` (with and without split keys, a paged cache and
    sinks), written by the kernels themselves on the Triton path; every value written. The
    outputs are the float32 partials themselves, not values rounded to q's dtype first (the
    reference path's float32 close to the reference run on q widened; the kernels' within
    q's dtype's tolerance: their P @ V multiplies P in the cache's dtype)."""
    case = Case(lens=(0, 9, 30), s_max=30, s_active=1, hq=4, hkv=2, d=48, dtype=dtype,
                block_len=8, sinks=True)
    inp = build(case)
    kw = dict(block_table=inp.block_table, sinks=inp.sinks, num_splits=splits, impl=impl)
    states = ops.decode_attention_partials(inp.q, inp.k_cache, inp.v_cache,
                                           inp.cache_seqlens, **kw)
    R, D = 3 * case.hq, case.d
    assert states.shape == (R * (D + 1),) and states.dtype == F32
    want, want_lse = decode_attention_reference(
        inp.q.float(), inp.k_cache, inp.v_cache, inp.cache_seqlens, block_table=inp.block_table,
        sinks=inp.sinks, return_lse=True)
    out = states[:R * D].view(3, 1, case.hq, D)
    assert_close(out, want, F32 if impl == "torch" else dtype, f"partials {impl}: out")
    if dtype != F32:
        assert not torch.equal(out, out.to(dtype).float()), "outputs rounded to q's dtype"
    assert_close(states[R * D:].view(3, 1, case.hq), want_lse, F32, f"partials {impl}: lse")


def test_merge_float64_lses_give_float64_lse() -> None:
    """The docstring: lse float32, float64 for float64 lses."""
    outs = randn((2, 3, 16), F32)
    lses = randn((2, 3), F64)
    out, lse = lmfuse.merge_attention_states(outs, lses)
    assert lse.dtype == F64, f"float64 lses gave a {lse.dtype} lse"
    want, want_lse = merge_direct(outs, lses)
    assert_close(out, want, F32, "float64 lses: out")
    assert_close(lse, want_lse, F32, "float64 lses: lse")


@pytest.mark.parametrize("merge_impl", ["triton", "torch"])
def test_merge_equals_attention_over_the_union(merge_impl: str) -> None:
    """Cut each cache along S into disjoint pieces (one of a single key, some empty for the
    short sequences), run the kernel with return_lse on each (s_active = 1: the token sees its
    whole piece; the sink goes with piece 0), merge: attention over the whole cache."""
    case = Case(lens=(0, 9, 30), s_max=30, s_active=1, hq=4, hkv=2, d=16)
    inp = build(case)
    lens = inp.cache_seqlens
    bounds = [0, 7, 8, 20, 30]
    for sinks in (None, randn((case.hq,), F32, scale=2.0)):
        outs, lses = [], []
        for n, (lo, hi) in enumerate(itertools.pairwise(bounds)):
            piece_lens = (lens - lo).clamp(0, hi - lo).to(I32)
            o, lse_p = lmfuse.decode_attention(
                inp.q, inp.k_cache[:, lo:hi], inp.v_cache[:, lo:hi], piece_lens,
                sinks=sinks if n == 0 else None, return_lse=True, impl="triton")
            outs.append(o)
            lses.append(lse_p)
        assert (torch.stack(lses)[:, 1] == -INF).any(), "no empty partial: the case is too easy"
        out, lse = lmfuse.merge_attention_states(torch.stack(outs), torch.stack(lses),
                                                 impl=merge_impl)
        want, want_lse = decode_attention_reference(
            inp.q.double(), inp.k_cache, inp.v_cache, lens,
            sinks=None if sinks is None else sinks.double(), return_lse=True)
        check(out, lse, want, want_lse, F32, f"union of pieces, sinks={sinks is not None}")


# --- kv_cache_append ------------------------------------------------------------------------


def append_setup(layout: str, s_new: int, dtype: torch.dtype, *, fp8: bool = False,
                 B: int = 3, s_max: int = 12, hkv: int = 2, d: int = 16):
    """Caches full of random rows (fp8 or ``dtype``), lengths before the append that leave room
    for ``s_new`` tokens (0, 5, s_max - s_new), new rows in ``dtype``."""
    lens = (0, 5, s_max - s_new)[:B]
    cache_dtype = FP8 if fp8 else dtype
    k = randn((B, s_max, hkv, d), F32).to(cache_dtype)
    v = randn((B, s_max, hkv, d), F32).to(cache_dtype)
    table = None
    if layout.startswith("paged"):
        block_len = int(layout[5:])
        (k, v), table = to_paged((k, v), (s_max,) * B, block_len)
        k, v = (torch.where(torch.isnan(c.float()), 0.0, c.float()).to(cache_dtype)
                for c in (k, v))
    k_new = randn((B, s_new, hkv, d), dtype, scale=2.0)
    v_new = randn((B, s_new, hkv, d), dtype, scale=2.0)
    return k, v, k_new, v_new, torch.tensor(lens, dtype=I32), table


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit-for-bit equality (fp8 compared as bytes), naming the first few differences."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    diff = bits(got) != bits(want)
    if got.element_size() > 1:
        diff &= ~(torch.isnan(got) & torch.isnan(want))
    if diff.any():
        where = diff.nonzero()[:4].tolist()
        shown = ", ".join(f"{tuple(i)}: {float(got[tuple(i)])} != {float(want[tuple(i)])}"
                          for i in where)
        raise AssertionError(f"{what}: {int(diff.sum())} of {diff.numel()} elements differ "
                             f"(got != expected at {shown})")


def cache_rows(cache: torch.Tensor, table: Optional[torch.Tensor], b: int, lo: int,
               hi: int) -> torch.Tensor:
    """Rows ``lo .. hi - 1`` of sequence ``b``, read through the block table if paged."""
    if table is None:
        return cache[b, lo:hi]
    bl = cache.shape[1]
    return torch.stack([cache[int(table[b, p // bl]), p % bl] for p in range(lo, hi)])


APPEND_CASES = [("contiguous", 1, F32), ("contiguous", 3, F16), ("paged3", 1, BF16),
                ("paged3", 3, F32), ("paged1", 3, F16), ("paged16", 3, BF16)]


@pytest.mark.parametrize("layout, s_new, dtype", APPEND_CASES,
                         ids=[f"{lay}-s{s}-{str(d)[6:]}" for lay, s, d in APPEND_CASES])
def test_append_matches_reference(layout: str, s_new: int, dtype: torch.dtype) -> None:
    """The Triton append writes exactly what the reference writes (bit for bit), and only
    the new positions."""
    k, v, k_new, v_new, lens, table = append_setup(layout, s_new, dtype)
    k_ref, v_ref = k.clone(), v.clone()
    lmfuse.kv_cache_append(k, v, k_new, v_new, lens, block_table=table, impl="triton")
    lmfuse.kv_cache_append(k_ref, v_ref, k_new, v_new, lens, block_table=table, impl="torch")
    assert_same_bits(k, k_ref, "k_cache")
    assert_same_bits(v, v_ref, "v_cache")
    for b in range(3):  # the new rows read back through the layout
        L = int(lens[b])
        got = cache_rows(k, table, b, L, L + s_new)
        assert torch.equal(got, k_new[b]), f"sequence {b}: new keys not at {L}..{L + s_new}"


def heads_major(c: torch.Tensor, how: str) -> torch.Tensor:
    """``c``'s values in another memory layout, same shape ``[B, S, Hkv, D]``: "heads"
    (a ``[B, Hkv, S, D]`` tensor transposed, Hugging Face's cache layout) or "padded"
    (each head's D dims inside a wider row, heads at stride 2 * D)."""
    if how == "heads":
        return c.transpose(1, 2).contiguous().transpose(1, 2)
    wide = torch.zeros(*c.shape[:3], 2 * c.shape[3], dtype=c.dtype)
    wide[..., :c.shape[3]] = c
    return wide[..., :c.shape[3]]


@pytest.mark.parametrize("layout, s_new, fp8", [("contiguous", 3, False), ("paged4", 2, False),
                                                ("contiguous", 2, True), ("paged4", 1, True)])
@pytest.mark.parametrize("how", ["heads", "padded"])
def test_append_heads_at_any_stride(layout: str, s_new: int, fp8: bool, how: str) -> None:
    """Caches whose heads are not contiguous in a row (heads-major, or padded rows): the
    Triton append writes each head's run where the strides say, bit for bit what the
    reference writes into a token-major cache, and the padding untouched; decode then reads
    them as it reads the token-major ones."""
    k, v, k_new, v_new, lens, table = append_setup(layout, s_new, F16, fp8=fp8)
    scales = dict(k_scale=torch.tensor([0.5, 2.0]), v_scale=torch.tensor([0.25, 1.5])) \
        if fp8 else {}
    ks, vs = heads_major(k, how), heads_major(v, how)
    assert ks.stride(2) != k.shape[3] and torch.equal(bits(ks), bits(k))
    lmfuse.kv_cache_append(ks, vs, k_new, v_new, lens, block_table=table, impl="triton",
                           **scales)
    lmfuse.kv_cache_append(k, v, k_new, v_new, lens, block_table=table, impl="torch", **scales)
    assert_same_bits(ks.contiguous(), k, "k_cache")
    assert_same_bits(vs.contiguous(), v, "v_cache")
    if how == "padded":
        assert not bits(ks._base[..., k.shape[3]:]).any(), "the append wrote into the padding"
    q = randn((3, 1, 4, 16), F16)
    want = lmfuse.decode_attention(q, k, v, lens + s_new, block_table=table, impl="triton",
                                   **scales)
    got = lmfuse.decode_attention(q, ks, vs, lens + s_new, block_table=table, impl="triton",
                                  **scales)
    assert torch.equal(got, want)


@pytest.mark.parametrize("layout, s_new", [("contiguous", 3), ("paged4", 1)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_append_fp8_saturates(layout: str, s_new: int, dtype: torch.dtype) -> None:
    """fp8 caches: stored = x / scale rounded to e4m3 (per KV head), saturating at +-448,
    never NaN; bit for bit what the reference stores."""
    k, v, k_new, v_new, lens, table = append_setup(layout, s_new, dtype, fp8=True)
    k_new[0, 0, 0, :4] = torch.tensor([1e4, -1e4, 500.0, -460.0], dtype=F32).to(dtype)
    k_scale, v_scale = torch.tensor([0.5, 2.0]), torch.tensor([0.25, 1.5])
    k_ref, v_ref = k.clone(), v.clone()
    lmfuse.kv_cache_append(k, v, k_new, v_new, lens, block_table=table, k_scale=k_scale,
                           v_scale=v_scale, impl="triton")
    lmfuse.kv_cache_append(k_ref, v_ref, k_new, v_new, lens, block_table=table,
                           k_scale=k_scale, v_scale=v_scale, impl="torch")
    assert_same_bits(k, k_ref, "fp8 k_cache")
    assert_same_bits(v, v_ref, "fp8 v_cache")
    assert not torch.isnan(k.float()).any() and not torch.isnan(v.float()).any()
    assert k.float().abs().max() <= 448.0
    stored = cache_rows(k, table, 0, 0, s_new).float()
    assert stored[0, 0, :4].tolist() == [448.0, -448.0, 448.0, -448.0]
    want = (k_new[0].float() / k_scale[:, None]).clamp(-448, 448)
    # e4m3 keeps 3 mantissa bits: rounding moves a value by at most 1/16 of it (2^-10 below
    # the smallest normal)
    assert ((stored - want).abs() <= want.abs() / 16 + 2.0 ** -10).all(), "stored != x / scale"


def checks_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """What an unchecked CUDA call does (``lmfuse.set_checks`` off): no value checks, the
    kernels alone stand between bad values and memory."""
    monkeypatch.setattr(ops, "value_checks", lambda t: False)


def same_error(call: Callable[[str], Any], message: str) -> str:
    """``call(impl)`` raises one ValueError, matching ``message``, on both paths; returns it."""
    errors = []
    for impl in ("torch", "triton"):
        with pytest.raises(ValueError, match=message) as info:
            call(impl)
        errors.append(str(info.value))
    assert errors[0] == errors[1], f"the paths disagree: {errors}"
    return errors[0]


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_append_fp8_stores_nan_as_nan(impl: str) -> None:
    """A NaN appended to a float8_e4m3fn cache reads back as NaN (0x7F) on both paths,
    under Triton's interpreter too (whose own conversion gives 0x7C = 384)."""
    x = torch.ones(1, 1, 1, 4)
    x[0, 0, 0, 1] = NAN
    k, v = (torch.zeros(1, 2, 1, 4, dtype=FP8) for _ in range(2))
    lmfuse.kv_cache_append(k, v, x, -x, torch.tensor([0]), impl=impl)
    for cache in (k, v):
        assert cache[0, 0, 0].float().isnan().tolist() == [False, True, False, False]
        assert (cache.view(torch.uint8)[0, 0, 0, 1] & 0x7F) == 0x7F


def test_append_past_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Contiguous: positions past S_max raise the same error on both paths, before anything
    is written; with the checks off the kernel writes the rows that fit and nothing else."""
    k, v, k_new, v_new, _, _ = append_setup("contiguous", 3, F32, B=2, s_max=6)
    lens = torch.tensor([4, 6], dtype=I32)  # sequence 0: 4, 5 fit, 6 does not; sequence 1: none
    before_k, before_v = k.clone(), v.clone()
    same_error(lambda impl: lmfuse.kv_cache_append(k, v, k_new, v_new, lens, impl=impl),
               r"kv_cache_append: sequence 0 holds cache_seqlens\[0\] = 4 tokens; its 3 new "
               r"one\(s\) go up to position 6, past the capacity of 6 rows per sequence")
    assert_same_bits(k, before_k, "k_cache after a refused append")
    checks_off(monkeypatch)
    lmfuse.kv_cache_append(k, v, k_new, v_new, lens, impl="triton")
    want_k, want_v = before_k.clone(), before_v.clone()
    want_k[0, 4:6], want_v[0, 4:6] = k_new[0, :2], v_new[0, :2]
    assert_same_bits(k, want_k, "k_cache")
    assert_same_bits(v, want_v, "v_cache")


def test_append_paged_past_capacity_and_unmapped_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Paged: a token past max_blocks * block_len, or in a block whose id is -1 (after a
    sequence's blocks) or outside the pool, raises the same error on both paths; with the
    checks off the kernel skips exactly those rows (nothing else in the pool changes)."""
    k, v, k_new, v_new, _, table = append_setup("paged4", 3, F32, B=2, s_max=8)
    table = table[:, :2].contiguous()  # capacity 8
    table[1, 1] = -1  # sequence 1's positions 4.. are unmapped
    lens = torch.tensor([6, 3], dtype=I32)  # seq 0: 6, 7 fit, 8 past; seq 1: 3 fits, 4, 5 -1
    before_k = k.clone()

    def append(impl: str, kc=k, table=table, lens=lens, rows=slice(None)) -> None:
        lmfuse.kv_cache_append(kc, v, k_new[rows], v_new[rows], lens, block_table=table,
                               impl=impl)

    same_error(append, r"past the capacity of 8 rows per sequence: max_blocks \* block_len = 2 "
                       r"\* 4")
    same_error(lambda impl: append(impl, table=table[1:], lens=lens[1:], rows=slice(1, 2)),
               r"block_table\[0, 1\] = -1, but sequence 0's new tokens go to positions 3..5, "
               r"in its blocks 0..1")
    outside = table.clone()
    outside[1, 1] = k.shape[0]
    same_error(lambda impl: append(impl, table=outside[1:], lens=lens[1:], rows=slice(1, 2)),
               rf"block_table\[0, 1\] = {k.shape[0]}, .* in \[0, num_blocks={k.shape[0]}\)")
    assert_same_bits(k, before_k, "k pool after refused appends")
    checks_off(monkeypatch)
    append("triton")
    want = before_k.clone()
    bl = 4
    for b, positions in ((0, (6, 7)), (1, (3,))):
        for i, p in enumerate(positions):
            want[int(table[b, p // bl]), p % bl] = k_new[b, i]
    assert_same_bits(k, want, "k pool")
    kc = before_k.clone()
    append("triton", kc=kc, table=outside)
    # The same rows: sequence 1's positions 4, 5 fall in block num_blocks, skipped.
    assert_same_bits(kc, want, "k pool, block id past the pool")


def test_append_padding_rows_write_nothing() -> None:
    """A paged row of only -1 is a padding row (a captured graph's spare rows, tokens another
    CP rank owns): nothing is written for it, on both paths, with no error."""
    k, v, k_new, v_new, lens, table = append_setup("paged4", 2, F32, B=3, s_max=8)
    table[1] = -1
    for impl in ("torch", "triton"):
        kc, vc = k.clone(), v.clone()
        lmfuse.kv_cache_append(kc, vc, k_new, v_new, lens, block_table=table, impl=impl)
        want = k.clone()
        for b in (0, 2):
            L = int(lens[b])
            for i in range(2):
                p = L + i
                want[int(table[b, p // 4]), p % 4] = k_new[b, i]
        assert_same_bits(kc, want, f"{impl}: k pool")


def test_append_then_decode() -> None:
    """Append the active tokens with the kernel into a paged fp8 cache, then decode them: the
    same as the reference over the reference-appended cache."""
    k, v, k_new, v_new, lens, table = append_setup("paged3", 2, F16, fp8=True)
    k_scale, v_scale = torch.tensor([0.5, 1.5]), torch.tensor([1.25, 0.75])
    lmfuse.kv_cache_append(k, v, k_new, v_new, lens, block_table=table, k_scale=k_scale,
                           v_scale=v_scale)
    q = randn((3, 2, 4, 16), F16)
    after = lens + 2
    out, lse = lmfuse.decode_attention(q, k, v, after, block_table=table, k_scale=k_scale,
                                       v_scale=v_scale, return_lse=True)
    want, want_lse = decode_attention_reference(q.double(), k, v, after, block_table=table,
                                                k_scale=k_scale.double(),
                                                v_scale=v_scale.double(), return_lse=True)
    check(out, lse, want, want_lse, F16, "append then decode")


# --- errors --------------------------------------------------------------------------------


def base_inputs(paged: bool = False) -> dict[str, Any]:
    """A valid call: q [2, 1, 4, 16], two KV heads, contiguous [2, 8, 2, 16] or paged pool
    [4, 4, 2, 16] with a [2, 2] table."""
    kw: dict[str, Any] = dict(q=randn((2, 1, 4, 16)), cache_seqlens=torch.tensor([3, 8], dtype=I32))
    shape = (4, 4, 2, 16) if paged else (2, 8, 2, 16)
    kw.update(k_cache=randn(shape), v_cache=randn(shape))
    if paged:
        kw["block_table"] = torch.tensor([[0, 1], [2, 3]], dtype=I32)
    return kw


def _set(**changes: Callable[[dict], Any]) -> Callable[[dict], dict]:
    def apply(kw: dict) -> dict:
        for name, make in changes.items():
            kw[name] = make(kw)
        return kw
    return apply


def _fp8(name: str, dtype: torch.dtype = FP8) -> Callable[[dict], torch.Tensor]:
    return lambda kw: kw[name].to(dtype)


DECODE_ERRORS = [
    ("q-3d", False, _set(q=lambda kw: kw["q"][:, 0]), ValueError, "q must be 4-D"),
    ("q-int", False, _set(q=lambda kw: kw["q"].int()), TypeError, "q must have dtype in"),
    ("s_active-0", False, _set(q=lambda kw: kw["q"][:, :0]), ValueError, "s_active >= 1"),
    ("head-dim-0", False, _set(q=lambda kw: kw["q"][..., :0],
                               k_cache=lambda kw: kw["k_cache"][..., :0],
                               v_cache=lambda kw: kw["v_cache"][..., :0]),
     ValueError, "head dim D must be >= 1"),
    ("k_cache-3d", False, _set(k_cache=lambda kw: kw["k_cache"][0]), ValueError,
     "k_cache must be 4-D"),
    ("k_cache-dtype", False, _set(k_cache=lambda kw: kw["k_cache"].half()), TypeError,
     "k_cache must have the queries' dtype float32"),
    ("v_cache-dtype", False, _set(v_cache=lambda kw: kw["v_cache"].bfloat16()), TypeError,
     "v_cache must have the queries' dtype"),
    ("kv-shapes-differ", False, _set(v_cache=lambda kw: kw["v_cache"][:, :4]), ValueError,
     "must have one shape"),
    ("cache-head-dim", False, _set(k_cache=lambda kw: kw["k_cache"][..., :8],
                                   v_cache=lambda kw: kw["v_cache"][..., :8]),
     ValueError, "the caches' head dim is 8"),
    ("hq-not-multiple-of-hkv", False, _set(q=lambda kw: kw["q"][:, :, :3]), ValueError,
     r"query heads \(3\) must be a multiple of the caches' KV heads \(2\)"),
    ("cache-no-kv-heads", False, _set(k_cache=lambda kw: kw["k_cache"][:, :, :0],
                                      v_cache=lambda kw: kw["v_cache"][:, :, :0]),
     ValueError, "the caches must have at least one KV head"),
    ("contiguous-batch", False, _set(k_cache=lambda kw: kw["k_cache"][:1],
                                     v_cache=lambda kw: kw["v_cache"][:1]),
     ValueError, r"contiguous cache \[B, S_max, Hkv, D\] must have B = 2"),
    ("block_table-1d", True, _set(block_table=lambda kw: kw["block_table"][0]), ValueError,
     "block_table must be 2-D"),
    ("block_table-float", True, _set(block_table=lambda kw: kw["block_table"].float()),
     TypeError, "block_table must have dtype in"),
    ("block_table-int16", True, _set(block_table=lambda kw: kw["block_table"].short()),
     TypeError, "block_table must have dtype in"),
    ("block_table-rows", True, _set(block_table=lambda kw: kw["block_table"][:1]), ValueError,
     r"block_table must be \[B=2, max_blocks\]"),
    ("block_len-0", True, _set(k_cache=lambda kw: kw["k_cache"][:, :0],
                               v_cache=lambda kw: kw["v_cache"][:, :0]),
     ValueError, r"block_len \(dim 1\) must be >= 1"),
    ("seqlens-2d", False, _set(cache_seqlens=lambda kw: kw["cache_seqlens"][None]), ValueError,
     "cache_seqlens must be 1-D"),
    ("seqlens-length", False, _set(cache_seqlens=lambda kw: kw["cache_seqlens"][:1]),
     ValueError, r"cache_seqlens must be \[B=2\]"),
    ("seqlens-float", False, _set(cache_seqlens=lambda kw: kw["cache_seqlens"].float()),
     TypeError, "cache_seqlens must have dtype in"),
    ("scale-str", False, _set(scale=lambda kw: "0.5"), TypeError, "scale must be a float"),
    ("scale-inf", False, _set(scale=lambda kw: INF), ValueError, "scale must be finite"),
    ("window--1", False, _set(window_size=lambda kw: -1), ValueError,
     "window_size must be >= 0, got -1"),
    ("window-float", False, _set(window_size=lambda kw: 2.0), TypeError,
     "window_size must be an int"),
    ("sinks-length", False, _set(sinks=lambda kw: torch.zeros(2)), ValueError,
     r"sinks must be \[Hq=4\]"),
    ("sinks-2d", False, _set(sinks=lambda kw: torch.zeros(1, 4)), ValueError,
     "sinks must be 1-D"),
    ("k_scale-length", False, _set(k_cache=_fp8("k_cache"), v_cache=_fp8("v_cache"),
                                   k_scale=lambda kw: torch.ones(4)),
     ValueError, r"k_scale must be \[Hkv=2\]"),
    ("v_scale-length", True, _set(k_cache=_fp8("k_cache"), v_cache=_fp8("v_cache"),
                                  v_scale=lambda kw: torch.ones(1)),
     ValueError, r"v_scale must be \[Hkv=2\]"),
    ("k_scale-float-cache", False, _set(k_scale=lambda kw: torch.ones(2)), ValueError,
     "k_scale is for float8_e4m3fn caches"),
    ("cache-e5m2", False, _set(k_cache=_fp8("k_cache", torch.float8_e5m2),
                               v_cache=_fp8("v_cache", torch.float8_e5m2)),
     TypeError, "or be float8_e4m3fn, got float8_e5m2"),
    ("num_splits-0", False, _set(num_splits=lambda kw: 0), ValueError,
     "num_splits must be >= 1, got 0"),
    ("num_splits-float", False, _set(num_splits=lambda kw: 2.0), TypeError,
     "num_splits must be an int"),
    ("return_lse-int", False, _set(return_lse=lambda kw: 1), TypeError,
     "return_lse must be a bool"),
    ("impl-unknown", False, _set(impl=lambda kw: "cuda"), ValueError, "impl must be one of"),
    ("device-mismatch", False, _set(sinks=lambda kw: torch.zeros(4, device="meta")),
     ValueError, "sinks is on meta but q is on cpu"),
    ("triton-float64", False, _set(q=lambda kw: kw["q"].double(),
                                   k_cache=lambda kw: kw["k_cache"].double(),
                                   v_cache=lambda kw: kw["v_cache"].double(),
                                   impl=lambda kw: "triton"),
     TypeError, "impl='triton' runs float32/float16/bfloat16 queries"),
    ("requires-grad", False, _set(q=lambda kw: kw["q"].requires_grad_()), ValueError,
     "the Triton path has no backward"),
]


@pytest.mark.parametrize("paged, make, error, message",
                         [pytest.param(p, m, e, msg, id=i) for i, p, m, e, msg in DECODE_ERRORS])
def test_decode_bad_input_raises(paged: bool, make, error: type[Exception], message: str) -> None:
    """Every validation of decode_attention, through the op and through explain (one planner)."""
    kw = make(base_inputs(paged))
    args = [kw.pop(n) for n in ("q", "k_cache", "v_cache", "cache_seqlens")]
    with pytest.raises(error, match=message):
        lmfuse.decode_attention(*args, **kw)
    with pytest.raises(error, match=message):
        lmfuse.explain(lmfuse.decode_attention, *args, **kw)


def test_requires_grad_only_refused_under_grad_mode() -> None:
    """The Triton path refuses q.requires_grad under grad mode only; under no_grad it runs,
    and impl='torch' differentiates through the reference."""
    kw = base_inputs()
    q = kw.pop("q").requires_grad_()
    with torch.no_grad():
        out = lmfuse.decode_attention(q, **kw, impl="triton")
    want = decode_attention_reference(q.detach().double(), kw["k_cache"], kw["v_cache"],
                                      kw["cache_seqlens"])
    assert_close(out, want, F32, "no_grad triton")
    out = lmfuse.decode_attention(q, **kw, impl="torch")
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0


MERGE_ERRORS = [
    ("lses-shape", lambda: (randn((2, 3, 16)), torch.zeros(2, 4)), {}, ValueError,
     "lses must be outs' shape without its last dim"),
    ("no-partials", lambda: (randn((0, 3, 16)), torch.zeros(0, 3)), {}, ValueError,
     "need at least one partial state"),
    ("outs-1d", lambda: (randn((16,)), torch.zeros(())), {}, ValueError,
     "outs must be at least 2-D, got 1-D"),
    ("outs-16d", lambda: (randn((1,) * 16), torch.zeros((1,) * 15)), {}, ValueError,
     "outs must be at most 15-D, got 16-D"),
    ("outs-int", lambda: (torch.zeros(2, 3, 16, dtype=I32), torch.zeros(2, 3)), {}, TypeError,
     "outs must have dtype in"),
    ("triton-float64", lambda: (randn((2, 3, 16), F64), torch.zeros(2, 3, dtype=F64)),
     dict(impl="triton"), TypeError, "impl='triton' merges float32/float16/bfloat16 states"),
    ("impl-unknown", lambda: (randn((2, 3, 16)), torch.zeros(2, 3)), dict(impl="gpu"),
     ValueError, "impl must be one of"),
]


@pytest.mark.parametrize("make, kwargs, error, message",
                         [pytest.param(m, k, e, msg, id=i) for i, m, k, e, msg in MERGE_ERRORS])
def test_merge_bad_input_raises(make, kwargs, error: type[Exception], message: str) -> None:
    outs, lses = make()
    with pytest.raises(error, match=message):
        lmfuse.merge_attention_states(outs, lses, **kwargs)


def append_base(paged: bool = False) -> dict[str, Any]:
    kw = base_inputs(paged)
    kw.pop("q")
    kw["cache_seqlens"] = torch.tensor([3, 7], dtype=I32)  # room for one more token each
    kw.update(k_new=randn((2, 1, 2, 16)), v_new=randn((2, 1, 2, 16)))
    return kw


APPEND_ERRORS = [
    ("k_new-3d", False, _set(k_new=lambda kw: kw["k_new"][0]), ValueError, "k_new must be 4-D"),
    ("new-shapes-differ", False, _set(v_new=lambda kw: randn((2, 2, 2, 16))), ValueError,
     "must have one shape"),
    ("new-dtypes-differ", False, _set(v_new=lambda kw: kw["v_new"].half()), TypeError,
     "k_new is float32 but v_new is float16"),
    ("cache-dtype", False, _set(k_cache=lambda kw: kw["k_cache"].half()), TypeError,
     "k_cache must have k_new's dtype float32 or be float8_e4m3fn, got float16"),
    ("cache-no-kv-heads", False, _set(**{n: (lambda kw, n=n: kw[n][:, :, :0])
                                         for n in ("k_cache", "v_cache", "k_new", "v_new")}),
     ValueError, r"the caches must have at least one KV head \(dim 2\), got \(2, 8, 0, 16\)"),
    ("kv-heads", False, _set(k_new=lambda kw: randn((2, 1, 1, 16)),
                             v_new=lambda kw: randn((2, 1, 1, 16))),
     ValueError, "k_new has 1 KV heads but the caches have 2"),
    ("head-dim", False, _set(k_new=lambda kw: randn((2, 1, 2, 8)),
                             v_new=lambda kw: randn((2, 1, 2, 8))),
     ValueError, "the caches' head dim is 16"),
    ("contiguous-batch", False, _set(k_cache=lambda kw: kw["k_cache"][:1],
                                     v_cache=lambda kw: kw["v_cache"][:1]),
     ValueError, "must have B = 2"),
    ("block_table-float", True, _set(block_table=lambda kw: kw["block_table"].float()),
     TypeError, "block_table must have dtype in"),
    ("seqlens-length", False, _set(cache_seqlens=lambda kw: kw["cache_seqlens"][:1]),
     ValueError, r"cache_seqlens must be \[B=2\]"),
    ("k_scale-length", False, _set(k_cache=_fp8("k_cache"), v_cache=_fp8("v_cache"),
                                   k_scale=lambda kw: torch.ones(3)),
     ValueError, r"k_scale must be \[Hkv=2\]"),
    ("v_scale-float-cache", False, _set(v_scale=lambda kw: torch.ones(2)), ValueError,
     "v_scale is for float8_e4m3fn caches"),
    ("cache-e5m2", False, _set(k_cache=_fp8("k_cache", torch.float8_e5m2),
                               v_cache=_fp8("v_cache", torch.float8_e5m2)),
     TypeError, "or be float8_e4m3fn, got float8_e5m2"),
    ("triton-float64", False, _set(k_new=lambda kw: kw["k_new"].double(),
                                   v_new=lambda kw: kw["v_new"].double(),
                                   k_cache=lambda kw: kw["k_cache"].double(),
                                   v_cache=lambda kw: kw["v_cache"].double(),
                                   impl=lambda kw: "triton"),
     TypeError, "impl='triton' appends float32/float16/bfloat16 rows"),
    ("strided-head-dim", False, _set(k_cache=lambda kw: randn((2, 8, 2, 16, 2))[..., 0],
                                     v_cache=lambda kw: randn((2, 8, 2, 16, 2))[..., 0],
                                     impl=lambda kw: "triton"),
     ValueError, r"k_cache's head dim must be contiguous \(stride 1\), got strides "
                 r"\(512, 64, 32, 2\)"),
]


@pytest.mark.parametrize("paged, make, error, message",
                         [pytest.param(p, m, e, msg, id=i) for i, p, m, e, msg in APPEND_ERRORS])
def test_append_bad_input_raises(paged: bool, make, error: type[Exception], message: str) -> None:
    kw = make(append_base(paged))
    before = kw["k_cache"].clone()
    args = [kw.pop(n) for n in ("k_cache", "v_cache", "k_new", "v_new", "cache_seqlens")]
    with pytest.raises(error, match=message):
        lmfuse.kv_cache_append(*args, **kw)
    if args[0].shape == before.shape and args[0].dtype == before.dtype:
        assert torch.equal(args[0], before), "a refused append wrote into the cache"


GRAD_INPUTS = ([("decode_attention", n) for n in ("q", "k_cache", "v_cache", "sinks",
                                                  "k_scale", "v_scale")]
               + [("merge_attention_states", n) for n in ("outs", "lses")]
               + [("kv_cache_append", n) for n in ("k_cache", "v_cache", "k_new", "v_new",
                                                 "k_scale", "v_scale")])


@pytest.mark.parametrize("op, name", GRAD_INPUTS)
def test_triton_path_refuses_every_input_that_requires_grad(op: str, name: str) -> None:
    """The Triton paths have no backward: under grad mode any tensor input that requires
    grad is refused, by name (its gradient would be dropped silently); under no_grad the
    call runs; impl='torch' differentiates decode attention and the merge."""
    fn = getattr(lmfuse, op)
    if op == "merge_attention_states":
        kw: dict[str, Any] = dict(outs=randn((2, 3, 16)), lses=randn((2, 3)))
    else:
        kw = base_inputs() if op == "decode_attention" else append_base()
        if name in ("k_scale", "v_scale"):
            kw.update(k_cache=kw["k_cache"].to(FP8), v_cache=kw["v_cache"].to(FP8),
                      k_scale=torch.rand(2) + 0.5, v_scale=torch.rand(2) + 0.5)
        if name == "sinks":
            kw["sinks"] = randn((4,))
    kw[name].requires_grad_()
    with pytest.raises(ValueError, match=rf"{op}: the Triton path has no backward .* but "
                                         rf"{name} requires grad; .* impl='torch'"):
        fn(**kw, impl="triton")
    with torch.no_grad():
        fn(**kw, impl="triton")
    if op != "kv_cache_append":
        out = fn(**kw, impl="torch")
        (out[0] if isinstance(out, tuple) else out).sum().backward()
        assert kw[name].grad is not None and torch.isfinite(kw[name].grad).all()


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_compile_fullgraph_decode_and_append(impl: str) -> None:
    """torch.compile traces decode_attention and kv_cache_append as opaque custom ops (no
    graph break) and gives the eager results; on the reference path too (it read the
    lengths on the host while tracing), whose compiled calls still check the values."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 2, 8, 32), torch.randn(2, 40, 2, 32), torch.randn(2, 40, 2, 32)
    lens = torch.tensor([40, 7], dtype=torch.int32)

    def attend(q, k, v, lens):
        out, lse = lmfuse.decode_attention(q, k, v, lens, return_lse=True, window_size=10,
                                           impl=impl)
        return out * 2, lse

    with torch.no_grad():
        got = torch.compile(attend, fullgraph=True)(q, k, v, lens)
        want = attend(q, k, v, lens)
    assert torch.allclose(got[0], want[0]) and torch.allclose(got[1], want[1])

    def append(kc, vc, kn, vn, lens):
        lmfuse.kv_cache_append(kc, vc, kn, vn, lens, impl=impl)
        return kc.sum()

    kc, vc, kn = torch.zeros(2, 8, 2, 32), torch.zeros(2, 8, 2, 32), torch.randn(2, 1, 2, 32)
    compiled = torch.compile(append, fullgraph=True)
    compiled(kc, vc, kn, -kn, torch.tensor([1, 3]))
    assert torch.equal(kc[0, 1], kn[0, 0]) and torch.equal(vc[1, 3], -kn[1, 0])
    assert kc[0, 0].abs().sum() == 0 and kc[1, 2].abs().sum() == 0
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 8 tokens; its 1 new one"):
        compiled(kc, vc, kn, -kn, torch.tensor([1, 8]))
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 41"):
        torch.compile(attend, fullgraph=True)(q, k, v, torch.tensor([40, 41]))


def test_reference_ops_of_compiled_graphs_match_their_fakes_and_keep_gradients() -> None:
    """The reference path's custom ops (compiled graphs): their fakes give the real outputs'
    dtypes and strides (a float32 fake LSE for float64 queries made Inductor read garbage),
    and a call that needs a gradient keeps the reference itself (the ops have no autograd:
    a compiled append dropped k_new's gradient, a compiled decode raised)."""
    q = torch.randn(2, 1, 4, 8, dtype=torch.float64)
    k, v = torch.randn(2, 6, 2, 8, dtype=torch.float64), torch.randn(2, 6, 2, 8,
                                                                     dtype=torch.float64)
    lens = torch.tensor([6, 3])
    torch.library.opcheck(torch.ops.lmfuse.decode_attention_reference.default,
                          (q, k, v, lens, None, None, None, None, 0.35, None, None, True),
                          test_utils=("test_schema", "test_faketensor"))

    qg = q.clone().requires_grad_(True)

    def attend(q):
        return lmfuse.decode_attention(q, k, v, lens, impl="torch").square().sum()

    want = torch.autograd.grad(attend(qg), qg)[0]
    got = torch.autograd.grad(torch.compile(attend, backend="aot_eager")(qg), qg)[0]
    assert torch.allclose(got, want)

    kn = torch.randn(2, 1, 2, 8, requires_grad=True)

    def append(kn):
        kc, vc = torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8)
        lmfuse.kv_cache_append(kc, vc, kn, kn * 2, torch.tensor([1, 2]), impl="torch")
        return (kc * vc).sum()

    want = torch.autograd.grad(append(kn), kn)[0]
    got = torch.autograd.grad(torch.compile(append, backend="aot_eager")(kn), kn)[0]
    assert torch.count_nonzero(want) and torch.allclose(got, want)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("s_active", [1, 3])
@pytest.mark.parametrize("options", [
    {}, {"window_size": 3}, {"sinks": True}, {"softcap": 4.0}, {"fp8": True},
    {"window_size": 2, "sinks": True, "softcap": 3.0}])
def test_traceable_reference_matches_the_reference(paged, s_active, options) -> None:
    """``decode_attention_traceable`` (the torch path while torch.compile traces, reading no
    length on the host) gives the reference's output and LSE: NaN, inf and -inf where it
    does (a NaN key a token does not see, a NaN key it sees, a +inf score, a sequence
    that sees nothing), and the same gradients."""
    from lmfuse.attention.reference import (decode_attention_reference,
                                            decode_attention_traceable)

    torch.manual_seed(0)
    B, Hq, Hkv, D = 4, 4, 2, 8
    lens = torch.tensor([s_active, 7, 13, 0 if s_active == 1 else 9])
    q = torch.randn(B, s_active, Hq, D)
    q[2, 0, 1] = math.inf  # +inf scores for that head of sequence 2's first token
    k, v = torch.randn(B, 16, Hkv, D), torch.randn(B, 16, Hkv, D)
    k[1, 10] = math.nan  # past sequence 1's length: never seen
    v[2, 12, 0, 3] = math.nan  # seen by sequence 2's last token (in every window here)
    kw: dict = {}
    if options.get("window_size") is not None:
        kw["window_size"] = options["window_size"]
    if options.get("sinks"):
        kw["sinks"] = torch.randn(Hq)
    if options.get("softcap"):
        kw["softcap"] = options["softcap"]
    if options.get("fp8"):
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        kw.update(k_scale=torch.rand(Hkv) + 0.5, v_scale=torch.rand(Hkv) + 0.5)
    if paged:
        (k, v), kw["block_table"] = to_paged((k, v), lens, 4)
    leaves = [q.clone().requires_grad_(True) for _ in range(2)]
    results = []
    for fn, qq in zip((decode_attention_reference, decode_attention_traceable), leaves):
        out, lse = fn(qq, k, v, lens, return_lse=True, **kw)
        grad = torch.autograd.grad(out.nan_to_num().square().sum(), qq)[0]
        results.append((out, lse, grad))
    (o1, l1, g1), (o2, l2, g2) = results
    for a, b in ((o1, o2), (l1, l2), (g1, g2)):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf())
        assert torch.allclose(a.nan_to_num(0.0, 0.0, 0.0), b.nan_to_num(0.0, 0.0, 0.0),
                              atol=1e-5, rtol=1e-5)
    assert o1.isnan().any() and (l1 == -math.inf).any() == (s_active == 1 and "sinks" not in kw)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("s_new", [1, 3])
@pytest.mark.parametrize("fp8", [False, True])
def test_traceable_append_matches_the_reference(paged, s_new, fp8) -> None:
    """``kv_cache_append_traceable`` (the torch path while torch.compile traces with
    autograd) writes what the reference writes, a padding sequence (block-table row all -1)
    nothing, float8 saturated and scaled as there; its gradient to the new rows is the
    reference's; a position outside the cache fails its run-time assertion."""
    from lmfuse.attention.reference import kv_cache_append_reference, kv_cache_append_traceable

    torch.manual_seed(0)
    B, Hkv, D = 3, 2, 8
    dtype = torch.float8_e4m3fn if fp8 else torch.float32
    shape = (8, 4, Hkv, D) if paged else (B, 10, Hkv, D)
    table = (torch.tensor([[5, 2, 7], [-1, -1, -1], [0, 1, 3]], dtype=torch.int32) if paged
             else None)
    lens = torch.tensor([4, 0, 7])
    scales = dict(k_scale=torch.rand(Hkv) + 0.5, v_scale=torch.rand(Hkv) + 0.5) if fp8 else {}
    k_new = (torch.randn(B, s_new, Hkv, D) * 100).requires_grad_(True)
    v_new = torch.randn(B, s_new, Hkv, D).requires_grad_(True)
    base = torch.randn(shape).to(dtype)
    written = []
    for fn in (kv_cache_append_reference, kv_cache_append_traceable):
        kc, vc = base.clone(), base.clone()
        fn(kc, vc, k_new, v_new, lens, block_table=table, **scales)
        grads = (torch.autograd.grad((kc.float().square().sum() + vc.float().sum()),
                                     (k_new, v_new)) if not fp8 else ())
        written.append((kc.float(), vc.float(), grads))
    (k1, v1, g1), (k2, v2, g2) = written
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert not torch.equal(k1, base.float())
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError):
        kc = base.clone()
        kv_cache_append_traceable(kc, kc.clone(), k_new.detach(), v_new.detach(),
                                  torch.tensor([4, 0, 10 if not paged else 12]),
                                  block_table=table, **scales)


@pytest.mark.parametrize("bad", ["long", "negative", "unmapped block", "zero scale"])
def test_traceable_forms_assert_what_the_eager_call_checks(bad: str) -> None:
    """What the eager call refuses (a length outside [0, capacity], a -1 block among those a
    sequence's tokens lie in, an fp8 scale of 0), the traceable forms refuse too, at run
    time (``torch._assert_async``: a RuntimeError); the eager call's ValueError on the
    same inputs. Nothing is written into a block outside the sequence's own (a -1 block id
    indexed the pool from its end)."""
    from lmfuse.attention.reference import decode_attention_traceable, kv_cache_append_traceable

    Hkv, D = 2, 8
    k = torch.zeros(6, 4, Hkv, D, dtype=torch.float8_e4m3fn)
    v = torch.zeros_like(k)
    table = torch.tensor([[0, 1, -1], [2, 3, 4]], dtype=torch.int32)
    lens = {"long": [13, 3], "negative": [-2, 3], "unmapped block": [9, 3],
            "zero scale": [5, 3]}[bad]
    scale = torch.tensor([1.0, 0.0 if bad == "zero scale" else 2.0])
    q = torch.randn(2, 1, 4, D)
    with pytest.raises(RuntimeError):
        decode_attention_traceable(q, k, v, torch.tensor(lens), block_table=table,
                                   k_scale=scale, v_scale=scale)
    with pytest.raises(ValueError):
        lmfuse.decode_attention(q, k, v, torch.tensor(lens), block_table=table,
                                k_scale=scale, v_scale=scale, impl="torch")
    append_lens = {"long": [11, 3], "negative": [-2, 3], "unmapped block": [7, 3],
                   "zero scale": [5, 3]}[bad]
    before = k.float().clone()
    with pytest.raises(RuntimeError):
        kv_cache_append_traceable(k, v, torch.ones(2, 2, Hkv, D), torch.ones(2, 2, Hkv, D),
                                  torch.tensor(append_lens), block_table=table,
                                  k_scale=scale, v_scale=scale)
    with pytest.raises(ValueError):
        lmfuse.kv_cache_append(k, v, torch.ones(2, 2, Hkv, D), torch.ones(2, 2, Hkv, D),
                               torch.tensor(append_lens), block_table=table, k_scale=scale,
                               v_scale=scale, impl="torch")
    assert torch.equal(k.float()[5], before[5])  # the pool's last block: nobody's


def test_compile_fullgraph_decode_with_gradients() -> None:
    """With gradients the torch path cannot be an opaque op (no autograd): under
    torch.compile it traces ``decode_attention_traceable`` in one graph, the eager outputs
    and gradients; other lengths run the same graph; no warning from Dynamo."""
    import warnings

    torch.manual_seed(0)
    q = torch.randn(2, 2, 4, 16, requires_grad=True)
    k = torch.randn(2, 24, 2, 16, requires_grad=True)
    v = torch.randn(2, 24, 2, 16, requires_grad=True)

    def attend(q, k, v, lens):
        out, lse = lmfuse.decode_attention(q, k, v, lens, window_size=5, return_lse=True,
                                           impl="torch")
        return out.square().sum() + lse.sum()

    compiled = torch.compile(attend, fullgraph=True)
    for lens in (torch.tensor([5, 20]), torch.tensor([24, 2])):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = torch.autograd.grad(compiled(q, k, v, lens), (q, k, v))
        want = torch.autograd.grad(attend(q, k, v, lens), (q, k, v))
        for a, b in zip(got, want):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
        assert not [w for w in caught if "Dynamo" in str(w.message)], caught


@pytest.mark.parametrize("paged", [False, True])
def test_append_negative_length_never_writes(paged: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A negative cache_seqlens raises the same error on both paths; with the checks off the
    kernel writes nothing for it (no neighbouring sequence's rows)."""
    k = torch.zeros(2, 4, 1, 16)
    table = torch.tensor([[1], [0]], dtype=torch.int32) if paged else None
    new = torch.ones(2, 1, 1, 16)
    lens = torch.tensor([0, -1], dtype=torch.int32)
    same_error(lambda impl: lmfuse.kv_cache_append(k.clone(), k.clone(), new, new, lens,
                                                   block_table=table, impl=impl),
               r"kv_cache_append: cache_seqlens must be >= 0, got cache_seqlens\[1\] = -1")
    checks_off(monkeypatch)
    kc, vc = k.clone(), k.clone()
    lmfuse.kv_cache_append(kc, vc, new, new, lens, block_table=table, impl="triton")
    written = (kc != 0).any(dim=(2, 3))
    row0 = (1, 0) if paged else (0, 0)  # sequence 0's position 0
    assert written[row0] and int(written.sum()) == 1


def test_mixed_kv_cache_dtypes_are_refused() -> None:
    q = torch.randn(1, 1, 2, 16, dtype=torch.float16)
    k = torch.randn(1, 8, 1, 16, dtype=torch.float16)
    v8 = torch.randn(1, 8, 1, 16).to(torch.float8_e4m3fn)
    lens = torch.tensor([8])
    with pytest.raises(TypeError, match="k_cache is float16 but v_cache is float8_e4m3fn"):
        lmfuse.decode_attention(q, k, v8, lens)
    with pytest.raises(TypeError, match="k_cache is float16 but v_cache is float8_e4m3fn"):
        lmfuse.kv_cache_append(k, v8, q[:, :, :1], q[:, :, :1], lens)


def test_huge_window_and_forced_splits_are_harmless() -> None:
    """A window near 2**31 (longer than the cache) and more forced splits than keys give the
    plain result (no int32 wrap, no empty-grid or oversized launches)."""
    torch.manual_seed(0)
    q = torch.randn(2, 3, 4, 16)
    k, v = torch.randn(2, 6, 2, 16), torch.randn(2, 6, 2, 16)
    lens = torch.tensor([1, 2], dtype=torch.int32)  # shorter than s_active
    want = decode_attention_reference(q.double(), k.double(), v.double(), lens)
    got = lmfuse.decode_attention(q, k, v, lens, window_size=2**31 - 1, impl="triton")
    assert_close(got, want, torch.float32, "window 2**31-1")
    got = lmfuse.decode_attention(q, k, v, lens, num_splits=10**6, impl="triton")
    assert_close(got, want, torch.float32, "num_splits 10**6")
    plan = lmfuse.explain(lmfuse.decode_attention, q, k, v, lens, num_splits=10**6)
    assert plan.call.launch.splits == 6


def test_few_programs_take_their_own_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fewer (sequence, KV head) programs than SMs (4 under the interpreter) take the table's
    ``few_programs`` tiles (and stages, from an entry's third element); a paged cache's own
    section (no ``few_programs``) keeps its tiles; the result is the same either way."""
    from lmfuse import tuning

    table = dict(tuning.table("decode_attention", torch.device("cpu")),
                 block_n_by_head_dim=[[1048576, 16]],
                 few_programs={"block_n_by_head_dim": [[1048576, 32, 4]], "programs_per_sm": 1},
                 paged={"block_n_by_head_dim": [[1048576, 64]], "few_programs": {}})
    real = tuning.table
    monkeypatch.setattr(tuning, "table", lambda family, device: dict(table)
                        if family == "decode_attention" else real(family, device))
    torch.manual_seed(0)
    for B, want_n in ((1, 32), (2, 16)):
        q = torch.randn(B, 1, 4, 16)
        k, v = torch.randn(B, 40, 2, 16), torch.randn(B, 40, 2, 16)
        lens = torch.full((B,), 40, dtype=torch.int32)
        plan = lmfuse.explain(lmfuse.decode_attention, q, k, v, lens)
        assert plan.call.launch.BLOCK_N == want_n, (B, plan.call.launch.BLOCK_N)
        # A third entry element sets the pipeline stages; else the table's num_stages.
        assert plan.call.launch.num_stages == (4 if B == 1 else table["num_stages"])
        got = lmfuse.decode_attention(q, k, v, lens, impl="triton")
        want = decode_attention_reference(q.double(), k.double(), v.double(), lens)
        assert_close(got, want, torch.float32, f"B{B} BLOCK_N {want_n}")
    (kp, vp), block_table = to_paged((k, v), [40, 40], 8)
    plan = lmfuse.explain(lmfuse.decode_attention, q[:1], kp, vp, lens[:1],
                          block_table=block_table[:1])
    assert plan.call.launch.BLOCK_N == 64


def test_table_entries_set_warps_and_fp8_paged_section(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tile entry's fourth element sets the warps (raised to one per 16 query rows); fp8
    caches take the ``fp8`` section, paged fp8 caches the ``fp8_paged`` one after it; each
    launch equal to the reference."""
    from lmfuse import tuning

    table = dict(tuning.table("decode_attention", torch.device("cpu")),
                 block_n_by_head_dim=[[1048576, 16]], num_warps=4, few_programs={},
                 fp8={"block_n_by_head_dim": [[1048576, 32, 3, 1]], "few_programs": {}},
                 fp8_paged={"block_n_by_head_dim": [[1048576, 64, 2, 2]], "few_programs": {}})
    real = tuning.table
    monkeypatch.setattr(tuning, "table", lambda family, device: dict(table)
                        if family == "decode_attention" else real(family, device))
    torch.manual_seed(0)
    B, S, Hkv, D = 2, 70, 2, 16
    lens = torch.tensor([70, 33], dtype=torch.int32)
    k, v = torch.randn(B, S, Hkv, D), torch.randn(B, S, Hkv, D)
    ks, vs = k.abs().amax(dim=(0, 1, 3)) / 448.0, v.abs().amax(dim=(0, 1, 3)) / 448.0
    k8, v8 = (k / ks[:, None]).to(FP8), (v / vs[:, None]).to(FP8)
    (kp, vp), table_ = to_paged((k8, v8), [70, 33], 8)
    for name, s_active, caches, kw, want_n, want_stages, want_warps in (
            ("float32", 1, (k, v), {}, 16, table["num_stages"], 4),
            ("fp8, 4 rows", 1, (k8, v8), {}, 32, 3, 1),
            ("fp8, 32 rows", 8, (k8, v8), {}, 32, 3, 2),
            ("fp8 paged", 1, (kp, vp), {"block_table": table_}, 64, 2, 2)):
        q = torch.randn(B, s_active, 4 * Hkv, D)
        if caches[0].dtype == FP8:
            kw = dict(kw, k_scale=ks, v_scale=vs)
        c = lmfuse.explain(lmfuse.decode_attention, q, *caches, lens, **kw).call.launch
        got_cfg = (c.BLOCK_N, c.num_stages, c.num_warps)
        assert got_cfg == (want_n, want_stages, want_warps), (name, got_cfg)
        got = lmfuse.decode_attention(q, *caches, lens, impl="triton", **kw)
        ref_kw = {key: (val.double() if key.endswith("scale") else val)
                  for key, val in kw.items()}
        want = decode_attention_reference(q.double(), caches[0], caches[1], lens, **ref_kw)
        assert_close(got, want, torch.float32, name)


def test_tiles_fit_the_devices_shared_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the table's tile and stages would need more shared memory than a program may
    have (float32 caches in tiles measured for 2-byte ones), the launch drops stages, then
    halves the key tile, until it fits; the result equals the reference."""
    from lmfuse import tuning

    table = dict(tuning.table("decode_attention", torch.device("cpu")),
                 block_n_by_head_dim=[[1048576, 64, 3, 4]], few_programs={},
                 many_programs=None, paged={}, fp8={}, fp8_paged={})
    real = tuning.table
    monkeypatch.setattr(tuning, "table", lambda family, device: dict(table)
                        if family == "decode_attention" else real(family, device))
    torch.manual_seed(0)
    q = torch.randn(2, 1, 4, 16)
    k, v = torch.randn(2, 150, 2, 16), torch.randn(2, 150, 2, 16)
    lens = torch.tensor([150, 77], dtype=torch.int32)
    want = decode_attention_reference(q.double(), k.double(), v.double(), lens)
    (kp, vp), table_ = to_paged((k, v), [150, 77], 8)
    # K and V tiles of 64 keys x 16 x 4 bytes (4 KiB; stages - 1 of each, a paged cache's
    # stages), the probabilities' (16 rows x 64 keys x 4 bytes) and the query's (1 KiB).
    for limit, tile, paged_tile in ((None, (64, 3), (64, 3)), (21_504, (64, 3), (64, 2)),
                                    (14_000, (64, 2), (32, 2)), (10_000, (32, 2), (16, 2)),
                                    (5_000, (16, 2), (16, 2))):
        monkeypatch.setattr(tuning, "shared_memory", lambda device, limit=limit: limit)
        for name, caches, kw, want_tile in (("contiguous", (k, v), {}, tile),
                                            ("paged", (kp, vp), {"block_table": table_},
                                             paged_tile)):
            c = lmfuse.explain(lmfuse.decode_attention, q, *caches, lens, **kw).call.launch
            assert (c.BLOCK_N, c.num_stages) == want_tile, (name, limit)
            got = lmfuse.decode_attention(q, *caches, lens, impl="triton", **kw)
            assert_close(got, want, torch.float32, f"{name}, shared memory {limit}")


def test_table_many_programs_and_short_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """``many_programs`` applies from ``min_programs_per_sm`` programs an SM (Triton's
    interpreter counts 4 SMs), ``short_context`` to caches of at most ``max_keys`` keys;
    the launch they choose equals the reference."""
    from lmfuse import tuning

    table = dict(tuning.table("decode_attention", torch.device("cpu")),
                 block_n_by_head_dim=[[1048576, 16, 3, 4]], few_programs={},
                 paged={"short_context": {"max_keys": 64, "num_stages": 1}},
                 fp8={}, fp8_paged={},
                 many_programs={"min_programs_per_sm": 1,
                                "block_n_by_head_dim": [[1048576, 32, 2, 1]]})
    real = tuning.table
    monkeypatch.setattr(tuning, "table", lambda family, device: dict(table)
                        if family == "decode_attention" else real(family, device))
    torch.manual_seed(0)
    Hkv, D = 2, 16
    k, v = torch.randn(2, 96, Hkv, D), torch.randn(2, 96, Hkv, D)
    lens = torch.tensor([96, 50], dtype=torch.int32)
    for B, want in ((2, (32, 2, 1)), (1, (16, 3, 4))):  # 4 programs: many; 2: not
        q = torch.randn(B, 1, 2 * Hkv, D)
        c = lmfuse.explain(lmfuse.decode_attention, q, k[:B], v[:B], lens[:B]).call.launch
        assert (c.BLOCK_N, c.num_stages, c.num_warps) == want, B
        got = lmfuse.decode_attention(q, k[:B], v[:B], lens[:B], impl="triton")
        assert_close(got, decode_attention_reference(q.double(), k[:B].double(),
                                                     v[:B].double(), lens[:B]),
                     torch.float32, f"B{B}")
    (kp, vp), bt = to_paged((k, v), [96, 50], 16)  # capacity 96 keys > 64: not short
    q = torch.randn(1, 1, 2 * Hkv, D)
    plan = lmfuse.explain(lmfuse.decode_attention, q, kp, vp, lens[:1], block_table=bt[:1])
    assert plan.call.launch.num_stages == 3
    plan = lmfuse.explain(lmfuse.decode_attention, q, kp, vp, lens[:1].clamp(max=48),
                          block_table=bt[:1, :4])  # 4 blocks of 16: 64 keys
    assert plan.call.launch.num_stages == 1


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("s_active,window", [(1, None), (3, None), (2, 5)])
@pytest.mark.parametrize("poison", [None, "nan_value_of_a_later_token", "inf_query",
                                    "nan_key"])
def test_default_cpu_path_is_one_sdpa_with_the_reference_results(
        monkeypatch: pytest.MonkeyPatch, paged: bool, s_active: int, window, poison) -> None:
    """On CPU float32 without Triton (a CPU machine without the interpreter) the default
    path is one ``scaled_dot_product_attention`` over the batch's gathered keys (GQA,
    windows, several active tokens, paged pools whose unused rows hold NaN); where its
    output has a NaN the reference runs instead, so the results are the reference's, NaN and
    inf included."""
    from lmfuse._dispatch import select_impl

    monkeypatch.setattr(ops, "select_impl", lambda op, impl, device: (
        ("torch", "test: no Triton") if impl == "auto" else select_impl(op, impl, device)))
    calls = []
    real = ops.native_decode
    monkeypatch.setattr(ops, "native_decode",
                        lambda *a: (lambda out: (calls.append(out is not None), out)[1])(
                            real(*a)))
    g = torch.Generator().manual_seed(s_active)
    B, S, Hq, Hkv, D = 3, 24, 8, 2, 16
    q = torch.randn(B, s_active, Hq, D, generator=g)
    k, v = torch.randn(B, S, Hkv, D, generator=g), torch.randn(B, S, Hkv, D, generator=g)
    lens = torch.tensor([24, 7, 13], dtype=torch.int32)
    if poison == "nan_value_of_a_later_token":  # token 0 of sequence 2 does not see it
        v[2, 12, 1, 3] = float("nan")
    elif poison == "inf_query":
        q[1, 0, 5, 2] = float("inf")
    elif poison == "nan_key":
        k[0, 3, 0, 0] = float("nan")
    kw: dict[str, Any] = dict(window_size=window)
    caches = (k, v)
    if paged:
        caches, kw["block_table"] = to_paged((k, v), lens.tolist(), 4, generator=g)
    got = lmfuse.decode_attention(q, *caches, lens, **kw)
    want = lmfuse.decode_attention(q, *caches, lens, impl="torch", **kw)
    # Finite inputs: the native path's answer; poisoned ones may fall back (a NaN value
    # that only later tokens see, a NaN key outside a window: the product or the mask can
    # still carry the NaN into SDPA's output).
    assert calls == [True] if poison is None else len(calls) == 1, calls
    assert torch.equal(got.isnan(), want.isnan())
    fin = ~want.isnan()
    assert torch.allclose(got[fin], want[fin], rtol=1e-5, atol=1e-6)


def test_default_cpu_path_never_reads_unused_block_table_entries(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The default CPU path (interpreter off) gathers every row's table up to the longest
    sequence's blocks: a shorter sequence's unused entries may hold any id (-1, or one past
    the pool, as the contract allows) and must not index the pool."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    calls = []
    real = ops.native_decode
    monkeypatch.setattr(ops, "native_decode",
                        lambda *a: (lambda out: (calls.append(out is not None), out)[1])(
                            real(*a)))
    g = torch.Generator().manual_seed(0)
    num_blocks, block_len, Hkv, D = 4, 4, 1, 8
    k = torch.randn(num_blocks, block_len, Hkv, D, generator=g)
    v = torch.randn(num_blocks, block_len, Hkv, D, generator=g)
    q = torch.randn(3, 1, 2, D, generator=g)
    lens = torch.tensor([2, 8, 3], dtype=torch.int32)  # 1, 2 and 1 blocks
    table = torch.tensor([[0, 99], [1, 2], [3, -7]], dtype=torch.int32)
    got = lmfuse.decode_attention(q, k, v, lens, block_table=table)
    want = decode_attention_reference(q.double(), k.double(), v.double(), lens,
                                      block_table=table)
    assert calls == [True]
    assert_close(got, want, torch.float32, "unused table entries past the pool")


@pytest.mark.parametrize("layout", ["contiguous", "paged-block7-not-dividing", "paged4"])
def test_row_offsets_in_32_and_64_bits_agree(layout: str) -> None:
    """Caches whose element offsets fit in int32 are addressed in 32 bits (unsigned block
    arithmetic), larger ones in 64 (forced here by the table); the two give the same bits;
    a cache whose largest offset passes 2**31 (a meta tensor's strides) takes 64 bits."""
    from lmfuse import tuning

    torch.manual_seed(0)
    B, S, Hkv, D = 2, 30, 2, 16
    lens = torch.tensor([30, 11], dtype=torch.int32)
    q = torch.randn(B, 1, 4, D)
    k, v = torch.randn(B, S, Hkv, D), torch.randn(B, S, Hkv, D)
    kw = {}
    if layout != "contiguous":
        block_len = 7 if "7" in layout else 4
        (k, v), kw["block_table"] = to_paged((k, v), lens.tolist(), block_len)
    plan = lmfuse.explain(lmfuse.decode_attention, q, k, v, lens, **kw)
    assert plan.call.launch.rows_i32
    got32 = lmfuse.decode_attention(q, k, v, lens, impl="triton", **kw)
    with tuning.overlay("decode_attention", {"rows_i32": False}):
        plan = lmfuse.explain(lmfuse.decode_attention, q, k, v, lens, **kw)
        assert not plan.call.launch.rows_i32
        got64 = lmfuse.decode_attention(q, k, v, lens, impl="triton", **kw)
    assert torch.equal(got32, got64)
    want = decode_attention_reference(q.double(), k.double(), v.double(), lens, **kw)
    assert_close(got32, want, torch.float32, layout)
    huge = torch.empty_strided(k.shape, (2**31 // (k.shape[0] - 1), *k.stride()[1:]),
                               device="meta")
    assert not ops._offsets_fit_i32(huge) and ops._offsets_fit_i32(k)


# --- edges found by an audit (2026-11-29) ----------------------------------------------------


@pytest.mark.parametrize("cap", [30.0, 1e4, 1e6, 1e8])
def test_softcap_keeps_float32_accuracy_for_large_caps(cap: float) -> None:
    """The kernel's tanh, (1 - t) / (1 + t) with t = e^(-2|z|), cancels for small |z|,
    which a large cap makes of every score: its error grew with the cap (1e-4 at 1e4,
    uniform attention at 1e8) until small arguments took tanh's series."""
    g = torch.Generator().manual_seed(0)
    S, D = 64, 32
    q = torch.randn(1, 1, 4, D, generator=g) * 2
    k = torch.randn(1, S, 1, D, generator=g) * 2
    v = torch.randn(1, S, 1, D, generator=g)
    lens = torch.tensor([S], dtype=torch.int32)
    s = torch.einsum("hd,ld->hl", q[0, 0].double(), k[0, :, 0].double()) / math.sqrt(D)
    want = torch.softmax(cap * torch.tanh(s / cap), -1) @ v[0, :, 0].double()
    for impl in ("triton", "torch"):
        got = lmfuse.decode_attention(q, k, v, lens, softcap=cap, impl=impl)[0, 0].double()
        assert (got - want).abs().max() < 5e-6, impl


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_an_inf_query_over_an_fp8_cache_gives_the_references_lse(dtype) -> None:
    """Half-precision queries over an fp8 cache scale each query row by a power of two for
    the float16 dot; a row holding +inf kept a scale of inf, and inf / inf made the lse NaN
    where the reference's is +inf."""
    g = torch.Generator().manual_seed(0)
    k = (torch.rand(1, 6, 1, 8, generator=g) + 0.1).to(torch.float8_e4m3fn)  # every key > 0
    v = torch.randn(1, 6, 1, 8, generator=g).to(torch.float8_e4m3fn)
    lens = torch.tensor([6], dtype=torch.int32)
    q = torch.randn(1, 1, 1, 8, generator=g).to(dtype)
    q[0, 0, 0, 3] = float("inf")
    lses = [lmfuse.decode_attention(q, k, v, lens, impl=impl, return_lse=True)[1]
            for impl in ("triton", "torch")]
    assert lses[0].item() == lses[1].item() == float("inf")


def test_scale_and_softcap_beyond_float32_are_refused() -> None:
    q, k = torch.randn(1, 1, 2, 8), torch.randn(1, 4, 1, 8)
    lens = torch.tensor([4], dtype=torch.int32)
    for name in ("scale", "softcap"):
        with pytest.raises(ValueError, match=rf"^decode_attention: {name} must be within "
                                             r"float32's range .*got 1e\+39"):
            lmfuse.decode_attention(q, k, k, lens, **{name: 1e39})
    with pytest.raises(ValueError, match=r"scale must be within float32's range"):
        lmfuse.DecodeAttentionBlock(16, 2, 1, 8, scale=-1e39)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_merging_empty_head_dims(impl: str) -> None:
    """Head dim 0 on the Triton path: its reshape could not infer the rows (-1 with D = 0)."""
    lses = torch.randn(2, 3)
    out, lse = lmfuse.merge_attention_states(torch.zeros(2, 3, 0), lses, impl=impl)
    assert out.shape == (3, 0)
    assert torch.allclose(lse, torch.logsumexp(lses, 0))
