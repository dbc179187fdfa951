"""Property tests (hypothesis) of ``decode_attention``, ``merge_attention_states`` and
``kv_cache_append``: random shapes (0, 1, primes, longer than a key tile), contiguous and
paged caches, GQA, 1..8 active tokens, windows, sinks, softcap, fp8 caches, forced splits,
strided queries, NaN injected where a token sees it and where it must not; the Triton path
against the float64 reference, within the tolerances of ``tests/helpers.py``.

Under the interpreter (the default) the tensors are CPU ones and the sizes small.
``LMFUSE_TEST_SCALE=n`` multiplies the lengths (and the merge's partial counts) by ``n``;
with ``LMFUSE_GPU_TESTS=1`` on a CUDA machine the same properties run on the GPU::

    LMFUSE_GPU_TESTS=1 LMFUSE_TEST_SCALE=16 HYPOTHESIS_PROFILE=dev \\
        python -m pytest -q tests/attention/test_properties.py

Under the interpreter fp8 caches stay out of the NaN property: Triton 3.9's interpreter
widens the e4m3 NaN byte to 480 (the GPU's conversion gives NaN).
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch
from helpers import assert_close, to_paged
from hypothesis import given
from hypothesis import strategies as st

import lmfuse
from lmfuse.attention.reference import (decode_attention_reference,
                                        kv_cache_append_reference,
                                        merge_attention_states_reference)

SCALE = max(1, int(os.environ.get("LMFUSE_TEST_SCALE", "1")))
DEV = torch.device("cuda" if os.environ.get("LMFUSE_GPU_TESTS") == "1"
                   and torch.cuda.is_available() else "cpu")
F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
FP8 = torch.float8_e4m3fn
NAN, INF = math.nan, math.inf
# Lengths worth hitting: empty, one, primes, a key tile and one more, several tiles.
LENGTHS = [0, 1, 2, 3, 5, 7, 13, 31, 32, 33, 67, 131]

# numpy's warnings where the injected NaN / +inf make the interpreter compute inf - inf, or
# tl.max (numpy's nanmax) reduce a row of NaNs only: the values the rules ask for.
INPUT_WARNINGS = pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning",
    "ignore:All-NaN slice encountered:RuntimeWarning")

pytestmark = pytest.mark.skipif(
    DEV.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton path needs a GPU or the interpreter")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape, dtype, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Standard normal values (never exactly 0), drawn on the CPU from ``g``, on DEV."""
    t = torch.randn(tuple(shape), generator=g) * scale
    return torch.where(t == 0, 1e-3, t).to(dtype).to(DEV)


def same_nonfinite(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Equal NaN / +inf / -inf patterns, the finite values within ``TOL[dtype]``."""
    got, want = got.cpu(), want.cpu()
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN pattern"
    for sign in (INF, -INF):
        assert torch.equal(got == sign, want == sign), f"{what}: {sign} pattern"
    fin = torch.isfinite(want)
    assert_close(got[fin], want[fin], dtype, what)


# --- decode_attention ------------------------------------------------------------------------


@st.composite
def decode_problems(draw: st.DrawFn, nan: bool = False) -> dict[str, Any]:
    B = draw(st.sampled_from([1, 2, 3] if nan else [0, 1, 1, 2, 2, 3]))
    s_active = draw(st.integers(1, 8))
    hkv = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 3, 4]))
    lens = [SCALE * draw(st.one_of(st.sampled_from(LENGTHS), st.integers(0, 140)))
            for _ in range(B)]
    if nan:
        lens[0] = max(lens[0], s_active + 2)  # a sequence with keys to inject into
    s_max = max(lens, default=0) + draw(st.integers(0, 5))
    fp8 = draw(st.booleans()) if not nan or DEV.type == "cuda" else False
    splits = draw(st.one_of(st.none(), st.integers(1, 5)))
    if DEV.type == "cpu" and splits and splits > 1 and B * s_active * group * hkv > 24:
        splits = 2  # the interpreter merges one row per program: keep the rows few
    return dict(
        lens=lens, s_max=s_max, s_active=s_active, hkv=hkv, hq=hkv * group,
        d=draw(st.sampled_from([16, 24, 32, 40, 64])),
        dtype=draw(st.sampled_from([F32, F32, F16, BF16])),
        block_len=draw(st.sampled_from([None, None, 1, 2, 3, 7, 16, 17, 64])),
        extra_blocks=draw(st.integers(0, 2)),
        window=draw(st.one_of(st.none(), st.integers(0, 40 * SCALE))),
        sinks=draw(st.booleans()), softcap=draw(st.sampled_from([None, None, 3.0, 30.0])),
        fp8=fp8, scales=draw(st.sampled_from(["kv", "k", ""])) if fp8 else "",
        splits=splits, strided_q=draw(st.booleans()),
        index_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        seed=draw(st.integers(0, 2**31 - 1)))


def decode_inputs(p: dict[str, Any]) -> dict[str, Any]:
    """Caches NaN past every length (paged: spare blocks and the rows after a sequence's
    end too), q as a strided view when asked."""
    g = gen(p["seed"])
    B, S = len(p["lens"]), p["s_max"]
    cdt = FP8 if p["fp8"] else p["dtype"]
    caches = []
    for _ in range(2):
        x = randn((B, S, p["hkv"], p["d"]), F32, g, 2.0 if p["fp8"] else 1.0).cpu()
        for b, n in enumerate(p["lens"]):
            x[b, n:] = NAN
        caches.append(x.to(cdt))
    table = None
    if p["block_len"] is not None:
        caches, table = to_paged(caches, p["lens"], p["block_len"],
                                 extra_columns=p["extra_blocks"], index_dtype=p["index_dtype"],
                                 generator=g)
        table = table.to(DEV)
    if p["strided_q"]:  # [B, Hq, s_active, D] storage, viewed as [B, s_active, Hq, D]
        q = randn((B, p["hq"], p["s_active"], p["d"]), p["dtype"], g).transpose(1, 2)
    else:
        q = randn((B, p["s_active"], p["hq"], p["d"]), p["dtype"], g)
    kw: dict[str, Any] = dict(block_table=table, window_size=p["window"], softcap=p["softcap"])
    kw["sinks"] = randn((p["hq"],), F32, g, 2.0) if p["sinks"] else None
    kw["k_scale"] = (torch.rand(p["hkv"], generator=g) + 0.25).to(DEV) if "k" in p["scales"] \
        else None
    kw["v_scale"] = (torch.rand(p["hkv"], generator=g) + 0.25).to(DEV) if "v" in p["scales"] \
        else None
    lens = torch.tensor(p["lens"], dtype=p["index_dtype"], device=DEV)
    return dict(q=q, k=caches[0].to(DEV), v=caches[1].to(DEV), lens=lens, kw=kw)


def decode_both(p: dict[str, Any], x: dict[str, Any]):
    got = lmfuse.decode_attention(x["q"], x["k"], x["v"], x["lens"], **x["kw"], return_lse=True,
                                  num_splits=p["splits"], impl="triton")
    ref_kw = {k: (v.double() if k in ("sinks", "k_scale", "v_scale") and v is not None else v)
              for k, v in x["kw"].items()}
    want = decode_attention_reference(x["q"].double(), x["k"], x["v"], x["lens"], **ref_kw,
                                      return_lse=True)
    return got, want


@given(p=decode_problems())
def test_decode_matches_reference(p: dict[str, Any]) -> None:
    """Any combination, no NaN in what is read: within the dtype's tolerance of the float64
    reference (the LSE within float32's), rows that see nothing exactly zeros and -inf."""
    x = decode_inputs(p)
    (out, lse), (want, want_lse) = decode_both(p, x)
    assert out.dtype == p["dtype"] and out.shape == x["q"].shape
    assert_close(out.cpu(), want.cpu(), p["dtype"], f"{p}: out")
    empty = (want_lse == -INF).cpu()
    assert torch.equal((lse == -INF).cpu(), empty), f"{p}: -inf rows"
    assert (out.cpu()[empty] == 0).all(), f"{p}: a row that sees nothing is not zeros"
    assert_close(lse.cpu(), want_lse.cpu(), F32, f"{p}: lse")


@INPUT_WARNINGS
@given(p=decode_problems(nan=True), where=st.sampled_from(
    ["query", "key", "value", "past-length", "before-window", "sink"]),
    at=st.integers(0, 2**31 - 1))
def test_decode_nan_injection(p: dict[str, Any], where: str, at: int) -> None:
    """NaN in a query head, in a key any active token of sequence 0 sees, in a value every
    one of them sees (both ends of the rule the kernel keeps exactly), past the length,
    before every window, in a sink: the NaN pattern (out and lse) is the reference's, the
    rest within tolerance."""
    x = decode_inputs(p)
    L, S = p["lens"][0], p["s_active"]
    w = p["window"]
    group = p["hq"] // p["hkv"]
    h = at % p["hq"]

    def set_row(cache: torch.Tensor, pos: int) -> None:
        table = x["kw"]["block_table"]
        if table is None:
            where_ = (0, pos)
        else:
            bl = cache.shape[1]
            where_ = (int(table[0, pos // bl]), pos % bl)
        row = cache[where_].float()
        row[h // group, at % p["d"]] = NAN
        cache[where_] = row.to(cache.dtype)

    if where == "query":
        q = x["q"]
        q[0, at % S, h, at % p["d"]] = NAN
    elif where == "key":
        lo = 0 if w is None else max(0, L - S - w)
        set_row(x["k"], lo + at % (L - lo))
    elif where == "value":
        lo = 0 if w is None else max(0, L - 1 - w)  # the last token's window start
        hi = L - S  # the first token's own position
        if lo <= hi:
            set_row(x["v"], lo + at % (hi - lo + 1))
    elif where == "past-length":
        pass  # the caches already hold NaN there
    elif where == "before-window":
        if w is not None and L - S - w > 0:
            for pos in range(L - S - w):
                set_row(x["k"], pos)
                set_row(x["v"], pos)
    elif where == "sink":
        sinks = x["kw"]["sinks"]
        if sinks is None:
            sinks = x["kw"]["sinks"] = randn((p["hq"],), F32, gen(at))
        sinks[h] = NAN
    (out, lse), (want, want_lse) = decode_both(p, x)
    what = f"{where} {p}"
    same_nonfinite(out, want, p["dtype"], f"{what}: out")
    same_nonfinite(lse, want_lse, F32, f"{what}: lse")
    if where in ("query", "key", "sink"):
        assert want.isnan().any(), f"{what}: the injected NaN reaches no row of the reference"


# --- merge_attention_states ------------------------------------------------------------------


@st.composite
def merge_problems(draw: st.DrawFn) -> dict[str, Any]:
    return dict(P=draw(st.sampled_from([1, 2, 3, 5, 8, 13, 33, 130])) * SCALE,
                rows=draw(st.sampled_from([0, 1, 2, 3, 7, 17])),
                d=draw(st.sampled_from([1, 3, 8, 16, 33, 64, 100])),
                dtype=draw(st.sampled_from([F32, F16, BF16])),
                out_dtype=draw(st.sampled_from([None, F32, BF16])),
                strided=draw(st.booleans()), empty=draw(st.floats(0.0, 0.9)),
                inject=draw(st.lists(st.sampled_from(["nan-lse", "inf-lse", "nan-out",
                                                      "nan-out-empty", "nan-out-tiny"]),
                                     max_size=3)),
                seed=draw(st.integers(0, 2**31 - 1)))


@INPUT_WARNINGS
@given(p=merge_problems())
def test_merge_matches_reference(p: dict[str, Any]) -> None:
    """Random partials, some empty (-inf, their outputs junk), NaN / +inf LSEs and NaN
    outputs injected: the reference's NaN and inf patterns, the rest within tolerance."""
    g = gen(p["seed"])
    P, R, D = p["P"], p["rows"], p["d"]
    if p["strided"]:  # [R, P, D] storage viewed as [P, R, D]
        outs = randn((R, P, D), p["dtype"], g).transpose(0, 1)
    else:
        outs = randn((P, R, D), p["dtype"], g)
    lses = randn((P, R), F32, g, 3.0)
    lses[(torch.rand((P, R), generator=g) < p["empty"]).to(DEV)] = -INF
    for i, kind in enumerate(p["inject"]):
        if R == 0:
            break
        r, part = (p["seed"] + 7 * i) % R, (p["seed"] // 3 + i) % P
        if kind == "nan-lse":
            lses[part, r] = NAN
        elif kind == "inf-lse":
            lses[part, r] = INF
        elif kind == "nan-out":
            outs[part, r, i % D] = NAN
        elif kind == "nan-out-empty":  # left out with its partial
            lses[part, r], outs[part, r, i % D] = -INF, NAN
        else:  # its weight underflows to 0: the NaN stays visible all the same
            lses[part, r], outs[part, r, i % D] = -200.0, NAN
            lses[(part + 1) % P, r] = 0.0
    out, lse = lmfuse.merge_attention_states(outs, lses, out_dtype=p["out_dtype"],
                                             impl="triton")
    want, want_lse = merge_attention_states_reference(outs.double(), lses.double())
    dtype = p["out_dtype"] or p["dtype"]
    assert out.dtype == dtype and lse.dtype == F32 and out.shape == (R, D)
    # The partials are exact in their dtype: the output is rounded once, to its own.
    same_nonfinite(out, want, dtype, f"{p}: out")
    same_nonfinite(lse, want_lse, F32, f"{p}: lse")


# --- kv_cache_append ---------------------------------------------------------------------------


@st.composite
def append_problems(draw: st.DrawFn) -> dict[str, Any]:
    B = draw(st.integers(0, 4))
    s_new = draw(st.integers(0, 5))
    capacity = SCALE * draw(st.sampled_from([1, 2, 5, 7, 13, 40]))
    s_new = min(s_new, capacity)
    return dict(B=B, s_new=s_new, capacity=capacity,
                lens=[draw(st.integers(0, capacity - s_new)) for _ in range(B)],
                hkv=draw(st.sampled_from([1, 2, 3])), d=draw(st.sampled_from([1, 5, 16, 40])),
                dtype=draw(st.sampled_from([F32, F16, BF16])), fp8=draw(st.booleans()),
                scales=draw(st.booleans()),
                block_len=draw(st.sampled_from([None, 1, 2, 3, 7, 16])),
                padding=draw(st.lists(st.booleans(), min_size=B, max_size=B)),
                nan=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)))


@given(p=append_problems())
def test_append_matches_reference(p: dict[str, Any]) -> None:
    """Bit for bit the reference's writes (padding rows of a paged table: none), NaN in the
    new rows of a float cache stored as NaN."""
    g = gen(p["seed"])
    B, s_new, hkv, d = p["B"], p["s_new"], p["hkv"], p["d"]
    cdt = FP8 if p["fp8"] else p["dtype"]
    k = randn((B, p["capacity"], hkv, d), F32, g).to(cdt)
    v = randn((B, p["capacity"], hkv, d), F32, g).to(cdt)
    table = None
    if p["block_len"] is not None:
        (k, v), table = to_paged((k.cpu(), v.cpu()), [p["capacity"]] * B, p["block_len"],
                                 extra_columns=0, fill=0.0, generator=g)
        if B and table.shape[1]:
            for b, pad in enumerate(p["padding"]):
                if pad:
                    table[b] = -1
        k, v, table = k.to(DEV), v.to(DEV), table.to(DEV)
    k_new = randn((B, s_new, hkv, d), p["dtype"], g, 3.0)
    v_new = randn((B, s_new, hkv, d), p["dtype"], g, 3.0)
    if p["nan"] and not p["fp8"] and B * s_new:
        k_new[p["seed"] % B, p["seed"] % s_new, 0, 0] = NAN
    lens = torch.tensor(p["lens"], dtype=torch.int32, device=DEV)
    scales = {}
    if p["fp8"] and p["scales"]:
        scales = dict(k_scale=(torch.rand(hkv, generator=g) + 0.1).to(DEV),
                      v_scale=(torch.rand(hkv, generator=g) * 3 + 0.1).to(DEV))
    got_k, got_v = k.clone(), v.clone()
    lmfuse.kv_cache_append(got_k, got_v, k_new, v_new, lens, block_table=table, **scales,
                           impl="triton")
    kv_cache_append_reference(k, v, k_new, v_new, lens, block_table=table, **scales)
    for got, want, name in ((got_k, k, "k"), (got_v, v, "v")):
        if p["fp8"]:
            got, want = got.view(torch.uint8), want.view(torch.uint8)
        same = (got == want) | (got.isnan() & want.isnan() if not p["fp8"] else False)
        assert bool(same.all()), f"{p}: {name} differs at {(~same).nonzero()[:4].tolist()}"
