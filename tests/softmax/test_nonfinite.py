"""NaN and inf through the softmax family, on both paths, against the float64 reference.

The oracle is ``fused_softmax_reference`` evaluated in float64 (``impl="torch"`` on float64
inputs), whose semantics are PyTorch's ``softmax(z.masked_fill(hidden, -inf))`` exactly
(checked below against PyTorch itself): a NaN or ``+inf`` visible logit (or sink) makes every
output of the row NaN, hidden keys (band, boolean mask) included, with a NaN gradient at the
row's visible keys and exactly 0 at its hidden keys (``masked_fill``'s backward); ``-inf`` is
probability 0; a NaN under the boolean mask or outside the band is never read; an additive
mask hides nothing (``NaN + -inf`` is NaN); a row whose keys are all hidden or ``-inf`` is
zeros whatever the sink (PyTorch: NaN). Results must have NaN, ``+inf`` and ``-inf`` exactly where
the oracle (rounded to the result's dtype) has them, and the finite values within
``helpers.TOL``. Gradients in float32 are compared with float64 autograd; in float16 /
bfloat16 the Triton backward reads the output it stored, so its values are compared with
the softmax-backward formula on that output (as ``test_ops.py`` does), its non-finite
pattern still with float64 autograd.

The property test draws shapes (0, 1, primes, rows longer than one chunk of a forced
small-chunk launch), dtypes, strided views, every option, NaN / inf injected into scores,
mask and sink, and the entry point (``fused_softmax``, ``FusedScaleMaskSoftmax``, the
Megatron functions). ``LMFUSE_TEST_SCALE=n`` multiplies the drawn sizes (for a GPU run,
``LMFUSE_GPU_TESTS=1``, where the tensors go to CUDA). Under Triton's interpreter its
numpy arithmetic must raise no floating-point warning, except the invalid operations of an
injected ``+-inf`` (``inf - inf`` is how the NaN arises).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import pytest
import torch
from helpers import SCALE, assert_matches, randn
from helpers import TEST_DEVICE as DEVICE
from hypothesis import given, settings
from hypothesis import strategies as st

import lmfuse
from lmfuse import megatron
from lmfuse._dispatch import interpreter_active
from lmfuse.softmax import ops
from lmfuse.tuning import RowTiles
from lmfuse.softmax.reference import fused_softmax_backward_reference, visible_keys

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
NAN, INF = math.nan, math.inf


CHUNKED = RowTiles(block_m=1, block_n=16, single=False, num_warps=4)
CHUNKED_TILE4 = RowTiles(block_m=4, block_n=16, single=False, num_warps=4)
TILE4 = RowTiles(block_m=4, block_n=64, single=True, num_warps=4)


def rnd(shape, dtype: torch.dtype = F32, *, scale: float = 1.0,
        requires_grad: bool = False) -> torch.Tensor:
    """``helpers.randn`` (never zeros) on the test device."""
    return randn(shape, dtype, scale=scale).to(DEVICE).requires_grad_(requires_grad)


# --- comparison --------------------------------------------------------------------------


def numpy_errors(inf_injected: bool):
    """The interpreter computes in numpy: any overflow, division by zero or invalid
    operation is an error, except invalid operations when the test injected +-inf."""
    return np.errstate(over="raise", divide="raise",
                       invalid="ignore" if inf_injected else "raise")


# --- running the op and its oracle -------------------------------------------------------


LAYOUTS: dict[str, Callable[[tuple[int, ...]], tuple[tuple[int, ...], Callable]]] = {
    # name -> shape -> (base shape, base -> scores view)
    "contiguous": lambda s: (s, lambda t: t),
    "transposed": lambda s: ((*s[:2], s[3], s[2]), lambda t: t.transpose(-1, -2)),
    "offset-slice": lambda s: ((*s[:3], s[3] + 3), lambda t: t[..., 2:-1]),
    "every-other-key": lambda s: ((*s[:3], 2 * s[3]), lambda t: t[..., ::2]),
    "heads-permuted": lambda s: ((s[0], s[2], s[1], s[3]), lambda t: t.transpose(1, 2)),
}


def run(entry: str, impl: str, base: torch.Tensor, view: Callable, mask, offset,
        grad: torch.Tensor, kw: dict[str, Any], *, f64: bool = False):
    """Output and gradients (of the scores' base tensor, a learnable mask, the sink) of one
    call on fresh leaves (cast to float64 with ``f64``)."""
    cast = (lambda t: t.detach().to(F64)) if f64 else (lambda t: t.detach())
    leaves = {"scores": cast(base).requires_grad_(True)}
    m = mask
    if mask is not None and mask.is_floating_point():
        m = cast(mask).requires_grad_(mask.requires_grad)
        if mask.requires_grad:
            leaves["mask"] = m
    o = None
    if offset is not None:
        o = leaves["offset"] = cast(offset).requires_grad_(True)
    x = view(leaves["scores"])
    scale = kw.get("scale")
    if entry == "fused_softmax":
        y = lmfuse.fused_softmax(x, mask=m, softmax_offset=o, impl=impl, **kw)
    elif entry == "module":
        mask_type = "causal" if kw.get("causal") else "padding"
        module = lmfuse.FusedScaleMaskSoftmax(False, False, mask_type, impl != "torch", None,
                                              True, scale, window_size=kw.get("window_size"))
        y = module(x, m, o)
    elif entry == "scaled_upper_triang_masked_softmax":
        y = megatron.scaled_upper_triang_masked_softmax(x[0], scale).unsqueeze(0)
    elif entry == "scaled_masked_softmax":
        y = megatron.scaled_masked_softmax(x, m, scale)
    else:
        assert entry == "scaled_softmax"
        y = megatron.scaled_softmax(x, scale)
    grads = torch.autograd.grad(y, list(leaves.values()), cast(grad))
    return y, dict(zip(leaves, grads))


def grads_from_output(y, base, view, mask, offset, grad, kw) -> dict[str, torch.Tensor]:
    """The gradients a fused backward computes from its stored output ``y`` (float64)."""
    call = lmfuse.explain(lmfuse.fused_softmax, view(base), mask=mask, softmax_offset=offset,
                          impl="torch", **{k: v for k, v in kw.items()}).call
    b, h, q, k = y.shape
    hidden = ~visible_keys(q, k, call.left, call.right, y.device)
    if mask is not None and mask.dtype == torch.bool:
        hidden = hidden | mask
    g = fused_softmax_backward_reference(y.detach().double(), grad, hidden)
    b64 = base.detach().double().requires_grad_(True)
    out = {"scores": torch.autograd.grad(view(b64), b64, call.scale * g)[0]}
    if mask is not None and mask.requires_grad:
        out["mask"] = g.sum_to_size(mask.shape)
    if offset is not None:
        z = view(base.detach().double()) * call.scale
        if mask is not None and mask.dtype != torch.bool:
            z = z + mask.detach().double()
        z = z.masked_fill(hidden, -INF)
        sink = offset.detach().double().view(1, h, 1, 1).expand(b, h, q, 1)
        lse = torch.logsumexp(torch.cat([z, sink], dim=-1), dim=-1, keepdim=True)
        dot = (y.double() * grad.double()).sum(dim=-1, keepdim=True)
        # Nothing visible and a -inf sink: no probability anywhere, p_sink is 0.
        p_sink = torch.where(lse == -INF, 0.0, torch.exp(sink - lse))
        out["offset"] = (-p_sink * dot).sum(dim=(0, 2, 3))
    return out


def check(entry: str, base, view, mask, offset, grad, kw, what: str, *,
          inf_injected: bool, config=None) -> None:
    """Every path of ``entry`` against the float64 oracle. ``base``, ``grad`` (and ``mask``,
    ``offset``) are already in the dtypes under test.

    Outputs: NaN / inf pattern and values against the oracle. Gradients: the pattern
    against float64 autograd; the Triton path's values against the backward formula on its
    own stored output (float64 math), as a fused backward is specified (``test_ops.py``);
    the torch path's gradients are the reference's own autograd (pattern only: in float32
    their cancellation in ``grad - sum(grad * y)`` is not float64's).
    """
    ref_kw = dict(kw, causal=True) if entry == "scaled_upper_triang_masked_softmax" else kw
    y_ref, g_ref = run("fused_softmax", "torch", base, view, mask, offset, grad, ref_kw,
                       f64=True)
    # The Megatron functions have no impl argument: they run impl="auto" (Triton here).
    impls = ("torch", "triton") if entry in ("fused_softmax", "module") else ("auto",)
    for impl in impls:
        with pytest.MonkeyPatch.context() as mp:
            if config is not None:
                mp.setattr(ops, "_config", lambda sk, device: config)
            with numpy_errors(inf_injected):
                y, g = run(entry, impl, base, view, mask, offset, grad, kw)
        tag = f"{what} [{impl}]"
        assert y.dtype == base.dtype, f"{tag}: output dtype {y.dtype}"
        assert_matches(y, y_ref, f"{tag}: forward")
        assert g.keys() == g_ref.keys()
        values = None
        if impl != "torch":
            values = grads_from_output(y, base, view, mask, offset, grad, ref_kw)
        for name in g_ref:
            assert g[name].dtype == {"scores": base, "mask": mask, "offset": offset}[name].dtype
            assert_matches(g[name], g_ref[name], f"{tag}: d {name}",
                           None if values is None else values[name], pattern_only=values is None)


# --- the reported bugs, one by one ---------------------------------------------------------


PATHS = [pytest.param("torch", None, id="torch"),
         pytest.param("triton", None, id="triton-tile"),
         pytest.param("triton", CHUNKED, id="triton-chunked")]


def softmax(x, impl, config=None, **kw):
    with pytest.MonkeyPatch.context() as mp:
        if config is not None:
            mp.setattr(ops, "_config", lambda sk, device: config)
        return lmfuse.fused_softmax(x, impl=impl, **kw)


@pytest.mark.parametrize("impl, config", PATHS)
def test_one_nan_score_makes_its_whole_row_nan(impl: str, config) -> None:
    """The reported bug: the NaN entry alone was NaN and the rest of its row finite."""
    x = rnd((1, 2, 3, 37), requires_grad=True)
    with torch.no_grad():
        x[0, 1, 2, 5] = NAN
    y = softmax(x, impl, config)
    assert y[0, 1, 2].isnan().all()
    others = torch.ones_like(y, dtype=torch.bool)
    others[0, 1, 2] = False
    assert torch.isfinite(y[others]).all()
    assert torch.allclose(y[0, 0], torch.softmax(x[0, 0].detach(), -1), rtol=1e-5, atol=1e-7)
    y.backward(rnd(y.shape))
    assert x.grad[0, 1, 2].isnan().all() and torch.isfinite(x.grad[others]).all()


@pytest.mark.parametrize("impl, config", PATHS)
def test_plus_inf_score_makes_its_row_nan_and_minus_inf_is_zero(impl: str, config) -> None:
    x = rnd((1, 1, 3, 37))
    x[0, 0, 0, 3] = INF
    x[0, 0, 1, 4] = -INF
    with np.errstate(invalid="ignore"):
        y = softmax(x, impl, config)
    assert y[0, 0, 0].isnan().all(), "torch.softmax of a row holding +inf is all NaN"
    assert y[0, 0, 1, 4] == 0 and torch.isfinite(y[0, 0, 1:]).all()


@pytest.mark.parametrize("impl, config", PATHS)
@pytest.mark.parametrize("hide", ["bool-mask", "causal", "window", "window-tuple"])
def test_nan_in_a_hidden_position_changes_nothing(impl: str, config, hide: str) -> None:
    """masked_fill replaces a hidden score by -inf before the softmax: it never poisons."""
    x = rnd((1, 2, 4, 37))
    hidden = torch.zeros(4, 37, dtype=torch.bool, device=DEVICE)
    kw: dict[str, Any] = {}
    if hide == "bool-mask":
        hidden[:, 10:20] = True
        kw["mask"] = hidden.view(1, 1, 4, 37)
    elif hide == "causal":
        kw["causal"] = True
        hidden = ~visible_keys(4, 37, ops.UNBOUNDED, 0, DEVICE)
    elif hide == "window":
        kw["window_size"] = 3
        hidden = ~visible_keys(4, 37, 3, 0, DEVICE)
    else:
        kw["window_size"] = (2, 1)
        hidden = ~visible_keys(4, 37, 2, 1, DEVICE)
    clean = softmax(x, impl, config, **kw)
    poisoned = x.clone()
    poisoned[:, :, hidden] = NAN
    y = softmax(poisoned.requires_grad_(True), impl, config, **kw)
    assert torch.equal(y, clean)
    y.backward(rnd(y.shape))
    assert torch.isfinite(poisoned.grad).all()
    assert (poisoned.grad[:, :, hidden] == 0).all()


@pytest.mark.parametrize("impl, config", PATHS)
def test_nan_row_is_nan_at_hidden_keys_with_zero_gradient_there(impl: str, config) -> None:
    """As torch.softmax of the masked scores: a NaN row is NaN at every key, hidden ones
    too; masked_fill's backward gives the hidden keys a zero gradient all the same."""
    x = rnd((1, 1, 2, 37), requires_grad=True)
    mask = torch.zeros(1, 1, 2, 37, dtype=torch.bool, device=DEVICE)
    mask[..., 30:] = True
    with torch.no_grad():
        x[0, 0, 1, 7] = NAN
    y = softmax(x, impl, config, mask=mask, causal=True)
    hidden = (mask | ~visible_keys(2, 37, ops.UNBOUNDED, 0, DEVICE))[0, 0]
    assert y[0, 0, 1].isnan().all() and torch.isfinite(y[0, 0, 0]).all()
    assert (y[0, 0, 0][hidden[0]] == 0).all()
    y.backward(rnd(y.shape))
    assert x.grad[0, 0, 1][~hidden[1]].isnan().all()
    assert (x.grad[0, 0, 1][hidden[1]] == 0).all() and torch.isfinite(x.grad[0, 0, 0]).all()


@pytest.mark.parametrize("impl, config", PATHS)
def test_additive_mask_does_not_hide_nan(impl: str, config) -> None:
    """z = x + mask as in PyTorch: NaN + (-inf) is NaN, so the row is NaN."""
    x = rnd((1, 1, 2, 37))
    x[0, 0, 0, 3] = NAN
    mask = torch.zeros(1, 1, 2, 37, device=DEVICE)
    mask[..., 3] = -INF
    y = softmax(x, impl, config, mask=mask)
    assert y[0, 0, 0].isnan().all() and torch.isfinite(y[0, 0, 1]).all()


@pytest.mark.parametrize("impl, config", PATHS)
@pytest.mark.parametrize("sink, row", [
    pytest.param(NAN, "nan", id="nan-sink"), pytest.param(INF, "nan", id="inf-sink"),
    pytest.param(-INF, "finite", id="neg-inf-sink")])
def test_sink_nan_and_inf(impl: str, config, sink: float, row: str) -> None:
    x = rnd((1, 2, 3, 37))
    mask = torch.zeros(1, 1, 3, 37, dtype=torch.bool, device=DEVICE)
    mask[..., 2, :] = True  # a fully masked row stays zeros whatever the sink
    offset = torch.tensor([0.5, sink], device=DEVICE, requires_grad=True)
    with np.errstate(invalid="ignore"):
        y = softmax(x, impl, config, mask=mask, softmax_offset=offset)
        y.backward(rnd(y.shape))
    assert torch.isfinite(y[0, 0]).all() and torch.isfinite(offset.grad[0])
    assert (y[:, :, 2] == 0).all()
    if row == "nan":
        assert y[0, 1, :2].isnan().all() and offset.grad[1].isnan()
    else:
        plain = softmax(x, impl, config, mask=mask)
        assert torch.allclose(y[0, 1], plain[0, 1]) and offset.grad[1] == 0


@pytest.mark.parametrize("impl, config", PATHS)
@pytest.mark.parametrize("with_offset", [False, True], ids=["no-sink", "sink"])
def test_finite_inputs_raise_no_floating_point_warning(impl: str, config,
                                                       with_offset: bool) -> None:
    """Saturating magnitudes, fully masked rows, tail rows: no numpy warning in the
    interpreter (masked lanes compute nothing invalid)."""
    x = rnd((2, 2, 5, 37), scale=300.0, requires_grad=True)
    mask = torch.rand(2, 1, 5, 37, device=DEVICE) < 0.3
    mask[0, :, 1] = True
    offset = rnd((2,), requires_grad=True) if with_offset else None
    with numpy_errors(inf_injected=False):
        y = softmax(x, impl, config, mask=mask, window_size=(4, 2), softmax_offset=offset)
        y.backward(rnd(y.shape))
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()


# --- against PyTorch's own expression, case by case --------------------------------------


def pytorch_softmax(x, scale: float, hidden, additive, sink) -> torch.Tensor:
    """``torch.softmax(z.masked_fill(hidden, -inf), -1)`` in float32, ``z = scale * x (+
    additive)``, the sink one more logit (dropped from the output): the spec, verbatim."""
    z = x.float() * scale
    if additive is not None:
        z = z + additive.float()
    z = z.masked_fill(hidden, -INF)
    if sink is not None:
        b, h, q, _ = z.shape
        z = torch.cat([z, sink.float().view(1, h, 1, 1).expand(b, h, q, 1)], dim=-1)
    return torch.softmax(z, dim=-1)[..., :x.shape[-1]]


# name -> what hides keys (sq = 6 rows of sk = 40 keys; the window's band sits in the third
# 16-key chunk, its 16-aligned load reaching keys outside it on both sides).
HIDES = {
    "causal": dict(causal=True),
    "window-both-sides": dict(window_size=(3, 2)),
    "bool-mask": dict(mask="bool"),
    "bool-mask+window": dict(mask="bool", window_size=(3, 2)),
    "additive-mask": dict(mask="additive"),
    "causal+sink": dict(causal=True, sink=True),
}
# The table's launch for 40 keys is one 64-key tile of 32 rows (a NaN row and finite rows
# in one program); the chunked ones stream 16-key chunks, one row or four per program.
PYTORCH_PATHS = [
    *(pytest.param("torch", None, dt, id=f"torch-{n}") for n, dt in (("f32", F32),
                                                                    ("bf16", BF16))),
    *(pytest.param("triton", None, dt, id=f"triton-tile-{n}")
      for n, dt in (("f32", F32), ("f16", F16), ("bf16", BF16))),
    *(pytest.param("triton", CHUNKED, dt, id=f"triton-chunked-{n}")
      for n, dt in (("f32", F32), ("bf16", BF16))),
    pytest.param("triton", CHUNKED_TILE4, F16, id="triton-chunked-tile4-f16"),
]


@pytest.mark.parametrize("impl, config, dtype", PYTORCH_PATHS)
@pytest.mark.parametrize("hide", list(HIDES))
def test_nan_and_inf_rows_match_pytorch(hide: str, impl: str, config, dtype) -> None:
    """NaN and +inf at a visible key make their rows NaN at every key, hidden ones included;
    the gradient is NaN at those rows' visible keys and exactly 0 at their hidden keys
    (masked_fill's backward); NaN at every hidden key of every row is never read. Against
    :func:`pytorch_softmax` and its autograd in float32: NaN / inf patterns exactly, finite
    values within the dtype's tolerance (half types: the gradient's values against the
    backward formula on the stored output, which is what a fused backward reads)."""
    b, h, sq, sk = 1, 2, 6, 40
    opts = HIDES[hide]
    torch.manual_seed(0)
    x = rnd((b, h, sq, sk), dtype)
    kw: dict[str, Any] = dict(scale=0.5)
    hidden = torch.zeros(1, 1, sq, sk, dtype=torch.bool, device=DEVICE)
    if opts.get("causal"):
        kw["causal"] = True
        hidden = hidden | ~visible_keys(sq, sk, ops.UNBOUNDED, 0, DEVICE)
    if "window_size" in opts:
        kw["window_size"] = opts["window_size"]
        hidden = hidden | ~visible_keys(sq, sk, *opts["window_size"], DEVICE)
    diag = torch.arange(sq, device=DEVICE) + (sk - sq)  # each row's own key: always in band
    mask = additive = sink = None
    if opts.get("mask") == "bool":
        mask = torch.rand(1, 1, sq, sk, device=DEVICE) < 0.3
        mask[0, 0, torch.arange(sq), diag] = False
        hidden = hidden | mask
    elif opts.get("mask") == "additive":
        additive = mask = torch.randn(1, 1, sq, sk, device=DEVICE)
        mask[..., ::5] = -INF
    if opts.get("sink"):
        sink = rnd((h,), dtype)
    # Head 0: row 1 gets a NaN, row 3 a +inf, at their own key (under the additive mask,
    # row 1's NaN sits on a -inf of the mask: NaN + -inf is NaN). Head 1 stays finite.
    with torch.no_grad():
        x[0, 0, 1, 35 if additive is None else 30] = NAN
        x[0, 0, 3, diag[3]] = INF
        x[:, :, hidden[0, 0]] = NAN
    grad = (0.5 + torch.rand(b, h, sq, sk)).to(DEVICE, dtype)

    xg = x.clone().requires_grad_(True)
    sg = sink.clone().requires_grad_(True) if sink is not None else None
    with numpy_errors(inf_injected=True):
        y = softmax(xg, impl, config, mask=mask, softmax_offset=sg, **kw)
        y.backward(grad)
    xe = x.float().requires_grad_(True)
    se = sink.float().requires_grad_(True) if sink is not None else None
    ye = pytorch_softmax(xe, 0.5, hidden, additive, se)
    ye.backward(grad.float())

    assert y.dtype == dtype and xg.grad.dtype == dtype
    assert_matches(y, ye, "forward")
    nan_rows = ye.isnan().any(dim=-1, keepdim=True).expand_as(ye)
    assert nan_rows[0, 0, [1, 3]].all() and not nan_rows[0, 0, [0, 2, 4, 5]].any()
    assert not nan_rows[0, 1].any()
    hid = hidden.expand_as(ye)
    assert y[nan_rows].isnan().all() and (y[hid & ~nan_rows] == 0).all()
    values = None
    if impl == "triton" and dtype != F32:
        values = 0.5 * fused_softmax_backward_reference(y.detach().double(), grad, hidden)
    assert_matches(xg.grad, xe.grad, "d scores", values)
    assert (xg.grad[hid] == 0).all(), "hidden keys get no gradient, NaN rows included"
    assert xg.grad[nan_rows & ~hid].isnan().all()
    assert torch.isfinite(xg.grad[~nan_rows]).all()
    if sink is not None:
        assert sg.grad[0].isnan() and torch.isfinite(sg.grad[1])
        if dtype == F32:
            assert_matches(sg.grad, se.grad, "d sink")


@pytest.mark.parametrize("impl, config", PATHS)
@pytest.mark.parametrize("sink", [None, 0.5, 200.0, NAN, INF, -INF])
def test_row_of_only_hidden_or_minus_inf_keys_is_zeros_whatever_the_sink(impl: str, config,
                                                                         sink) -> None:
    """lmfuse's one deviation from PyTorch (whose softmax is NaN there): a row whose keys are
    all hidden (row 0) or all -inf logits (row 1: scores, additive mask) is zeros, with zero
    gradient to its scores, whatever the sink; the sink's own gradient from such a row is 0,
    or NaN for a NaN or +inf sink (0 * exp(NaN)), as the reference's autograd gives it."""
    x = rnd((1, 1, 3, 37), requires_grad=True)
    mask = torch.zeros(1, 1, 3, 37, device=DEVICE)
    mask[0, 0, 0] = -INF
    with torch.no_grad():
        x[0, 0, 1] = -INF
        x[0, 0, 2, 5] = NAN  # row 2 is a NaN row (so the tile holds one)
    offset = None if sink is None else torch.tensor([sink], device=DEVICE, requires_grad=True)
    with numpy_errors(inf_injected=True):
        y = softmax(x, impl, config, mask=mask, softmax_offset=offset, window_size=(40, 40))
        y.backward(rnd(y.shape))
    assert (y[0, 0, :2] == 0).all() and (x.grad[0, 0, :2] == 0).all()
    assert y[0, 0, 2].isnan().all() and x.grad[0, 0, 2].isnan().all()
    if offset is not None:
        assert offset.grad.isnan().all()  # row 2 is NaN: so is the sink's gradient
        x2 = x.detach()[:, :, :2]
        o2 = offset.detach().clone().requires_grad_(True)
        with numpy_errors(inf_injected=True):
            y2 = softmax(x2, impl, config, mask=mask[:, :, :2], softmax_offset=o2)
            y2.backward(rnd(y2.shape))
        assert (y2 == 0).all()
        assert bool(o2.grad.isnan()) == (math.isnan(sink) or sink == INF)
        assert not torch.isinf(o2.grad).any()


# --- properties --------------------------------------------------------------------------


SIZES = [1, 2, 3, 5, 7, 13, 16, 17, 31, 37]
SPECIALS = [NAN, INF, -INF]


@st.composite
def problems(draw: st.DrawFn) -> dict[str, Any]:
    entry = draw(st.sampled_from(["fused_softmax"] * 4 + [
        "module", "scaled_upper_triang_masked_softmax", "scaled_masked_softmax",
        "scaled_softmax"]))
    dtype = draw(st.sampled_from([F32, F32, F16, BF16]))
    empty = draw(st.sampled_from([None] * 9 + ["b", "sq", "sk"]))
    b = 0 if empty == "b" else draw(st.integers(1, 2))
    h = draw(st.integers(1, 3))
    sq = 0 if empty == "sq" else draw(st.sampled_from(SIZES[:6])) * SCALE
    sk = 0 if empty == "sk" else draw(st.sampled_from(SIZES)) * SCALE
    causal = draw(st.booleans()) and sq <= sk
    window = draw(st.one_of(st.none(), st.integers(0, 8 * SCALE),
                            st.tuples(st.integers(-1, 8 * SCALE), st.integers(-1, 8 * SCALE))))
    mask = draw(st.sampled_from([None, "bool", "additive", "learned"]))
    mask_shape = draw(st.sampled_from(["b1qk", "b11k", "1h1k", "qk", "bhqk"]))
    offset = draw(st.sampled_from([None, None, "same", "float32"]))
    scale = draw(st.sampled_from([None, 0.5, 2.0]))
    if entry == "scaled_upper_triang_masked_softmax":
        b, causal, window, mask, offset = 1, True, None, None, None
        sq = min(sq, sk)
    if entry == "scaled_masked_softmax":
        causal, window, offset = False, None, None
        mask = "bool" if mask == "learned" else mask
    if entry == "scaled_softmax":
        causal, window, mask, offset = False, None, None, None
    if entry != "fused_softmax":
        scale = 1.0 if scale is None else scale
    inject = draw(st.lists(st.tuples(st.sampled_from(["scores", "scores", "mask", "sink"]),
                                     st.integers(0, 10**6), st.sampled_from(SPECIALS)),
                           max_size=4))
    return dict(entry=entry, dtype=dtype, shape=(b, h, sq, sk), causal=causal,
                window=window, mask=mask, mask_shape=mask_shape, offset=offset, scale=scale,
                layout=draw(st.sampled_from(sorted(LAYOUTS))),
                config=draw(st.sampled_from([None, CHUNKED, CHUNKED_TILE4, TILE4])),
                # Moderate logits: a softmax saturated to 1 - 1e-6 leaves float32 no digits
                # in grad - sum(grad * y), which float64's oracle still has.
                magnitude=draw(st.sampled_from([0.5, 1.0])), inject=inject,
                seed=draw(st.integers(0, 2**31 - 1)))


MASK_SHAPES = {"b1qk": lambda b, h, q, k: (b, 1, q, k), "b11k": lambda b, h, q, k: (b, 1, 1, k),
               "1h1k": lambda b, h, q, k: (1, h, 1, k), "qk": lambda b, h, q, k: (q, k),
               "bhqk": lambda b, h, q, k: (b, h, q, k)}


def _put(t: torch.Tensor, position: int, value: float) -> None:
    if t.numel():
        with torch.no_grad():
            t.view(-1)[position % t.numel()] = value


# Twice the profile's examples (ci: 50, same ones every run; dev: 600): many options.
@settings(max_examples=2 * settings.default.max_examples)
@given(p=problems())
def test_property_both_paths_match_the_float64_reference(p: dict[str, Any]) -> None:
    torch.manual_seed(p["seed"])
    b, h, q, k = p["shape"]
    dtype = p["dtype"]
    base_shape, view = LAYOUTS[p["layout"]](p["shape"])
    base = (torch.randn(base_shape) * p["magnitude"]).to(DEVICE, dtype)
    mask = None
    if p["mask"] == "bool":
        mask = (torch.rand(MASK_SHAPES[p["mask_shape"]](b, h, q, k)) < 0.3).to(DEVICE)
    elif p["mask"] is not None:
        mask = torch.randn(MASK_SHAPES[p["mask_shape"]](b, h, q, k)).to(DEVICE)
    offset = None
    if p["offset"] is not None:
        offset = torch.randn(h).to(DEVICE, F32 if p["offset"] == "float32" else dtype)
    # Scores go in through the base tensor: where a view skips it, nothing changes.
    inf_injected = False
    for target, position, value in p["inject"]:
        t = {"scores": base, "mask": mask, "sink": offset}[target]
        if t is None or not t.is_floating_point():
            continue
        _put(t, position, value)
        inf_injected |= math.isinf(value)
    if p["mask"] == "learned":
        mask.requires_grad_(True)
    # Upstream gradients of one sign: the sink's gradient sums one term per row,
    # -p_sink * sum(grad * y), which then never cancel into noise float32 cannot resolve.
    grad = (0.5 + torch.rand(p["shape"])).to(DEVICE, dtype)
    kw: dict[str, Any] = dict(scale=p["scale"])
    if p["entry"] in ("fused_softmax", "module"):
        kw.update(causal=p["causal"], window_size=p["window"])
    check(p["entry"], base, view, mask, offset, grad, kw, f"{p}", inf_injected=inf_injected,
          config=p["config"])


# --- float64 -------------------------------------------------------------------------------


def test_float64_triton_matches_reference_with_nan_and_inf() -> None:
    base = rnd((2, 2, 3, 17), F64)
    base[0, 0, 1, 4], base[1, 1, 2, 0], base[0, 1, 0, 16] = NAN, INF, -INF
    mask = torch.rand(2, 1, 3, 17, device=DEVICE) < 0.2
    check("fused_softmax", base, lambda t: t, mask, rnd((2,), F64), rnd((2, 2, 3, 17), F64),
          dict(scale=0.7, causal=True), "float64", inf_injected=True)


def test_interpreter_is_what_runs_here() -> None:
    if DEVICE.type == "cpu":
        assert interpreter_active()


# --- the oracle is PyTorch's own softmax -----------------------------------------------------


@given(sk=st.sampled_from(SIZES), causal=st.booleans(),
       mask=st.sampled_from([None, "bool", "additive"]), sink=st.booleans(),
       inject=st.lists(st.tuples(st.sampled_from(["scores", "scores", "mask", "sink"]),
                                 st.integers(0, 10**6), st.sampled_from(SPECIALS)),
                       max_size=4),
       seed=st.integers(0, 2**31 - 1))
def test_reference_is_torch_softmax_of_the_masked_scores(sk: int, causal: bool, mask, sink,
                                                         inject, seed: int) -> None:
    """``fused_softmax_reference`` in float64 equals ``torch.softmax(z.masked_fill(hidden,
    -inf))`` with the sink as one more logit, NaN rows included (NaN at hidden keys too,
    zero gradient there), except where lmfuse's contract differs on purpose: a row whose
    keys are all hidden or -inf is all zeros with zero gradient, whatever the sink
    (torch.softmax: NaN). Forward and the scores' gradient, every row."""
    torch.manual_seed(seed)
    b, h, q = 2, 2, 3
    causal = causal and q <= sk
    scores = torch.randn(b, h, q, sk, dtype=F64)
    m = None
    if mask == "bool":
        m = torch.rand(b, 1, q, sk) < 0.3
    elif mask == "additive":
        m = torch.randn(b, 1, 1, sk, dtype=F64)
    offset = torch.randn(h, dtype=F64) if sink else None
    for target, position, value in inject:
        t = {"scores": scores, "mask": m, "sink": offset}[target]
        if t is not None and t.is_floating_point():
            _put(t, position, value)
    grad = torch.randn(b, h, q, sk, dtype=F64)
    hidden = ~visible_keys(q, sk, ops.UNBOUNDED, 0 if causal else ops.UNBOUNDED, scores.device)
    if m is not None and m.dtype == torch.bool:
        hidden = hidden | m

    def plain(x, o):
        z = x * 0.7 + (m if m is not None and m.is_floating_point() else 0.0)
        z = z.masked_fill(hidden, -INF)
        # The dead rows' logits are replaced before the softmax too, so that the branch
        # masked_fill drops gives no NaN gradient (0 * NaN) either.
        dead = (z == -INF).all(dim=-1, keepdim=True)
        z = z.masked_fill(dead, 0.0)
        if o is not None:
            z = torch.cat([z, o.view(1, h, 1, 1).expand(b, h, q, 1)], dim=-1)
        return torch.softmax(z, dim=-1)[..., :sk].masked_fill(dead, 0.0)

    def ref(x, o):
        return lmfuse.fused_softmax(x, scale=0.7, mask=m, causal=causal, softmax_offset=o,
                                    impl="torch")

    results = []
    for fn in (ref, plain):
        x = scores.clone().requires_grad_(True)
        o = offset.clone().requires_grad_(True) if offset is not None else None
        y = fn(x, o)
        results.append((y, torch.autograd.grad(y, x, grad)[0]))
    (y_ref, g_ref), (y_plain, g_plain) = results
    assert_matches(y_ref, y_plain, "forward")
    assert_matches(g_ref, g_plain, "d scores")
