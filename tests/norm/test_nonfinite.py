"""NaN and inf through ``rms_norm`` and ``RMSNorm``, on both paths, against the reference
evaluated in float64.

``rms_norm_reference`` is the PyTorch formula ``x * rsqrt(mean(x ** 2) + eps) * (weight +
offset)``: a NaN in a row makes the row NaN, an inf makes its ``rstd`` 0 and the row 0
except NaN (``inf * 0``) at the inf, a NaN weight element makes its column NaN; the
gradients follow from autograd. Results must have NaN, ``+inf`` and ``-inf`` exactly where
the oracle (rounded to the result's dtype) has them, and their finite values within
``helpers.TOL``.

The property test draws shapes (0, 1, primes, rows streamed over several column tiles of a
shrunken launch table), dtypes, strided views, weight dtypes and offsets, eps (0 too), the
module or the function, with NaN / inf injected into x and weight. ``LMFUSE_TEST_SCALE=n``
multiplies the drawn sizes (with ``LMFUSE_GPU_TESTS=1`` the tensors go to CUDA). Under
Triton's interpreter, numpy must raise no floating-point warning, except the invalid
operations of an injected ``+-inf``.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import numpy as np
import pytest
import torch
from helpers import SCALE, assert_matches
from helpers import inject as _inject
from helpers import TEST_DEVICE as DEVICE
from hypothesis import given, settings
from hypothesis import strategies as st

import lmfuse
from lmfuse import tuning
from lmfuse.norm.reference import rms_norm_reference

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
NAN, INF = math.nan, math.inf
IMPLS = ["torch", "triton"]


# Rows wider than 32 are streamed in 16-column tiles, 2 rows at a time; one backward
# program per (interpreter) SM, so its row loop runs several times.
SMALL_TILES = dict(max_single_block=32, tile_elems=64, chunk_block=16, chunk_rows=2,
                   bwd_programs_per_sm=1, chunk_bwd_programs_per_sm=1)


# --- comparison --------------------------------------------------------------------------------


def numpy_errors(inf_injected: bool):
    """The interpreter computes in numpy: any overflow, division by zero or invalid
    operation is an error, except invalid operations when the test injected +-inf."""
    return np.errstate(over="raise", divide="raise",
                       invalid="ignore" if inf_injected else "raise")


def check(what: str, x: torch.Tensor, weight: torch.Tensor | None, grad: torch.Tensor,
          impl: str, *, module: bool = False, inf_injected: bool, **kw) -> None:
    """``rms_norm`` (or ``RMSNorm``) on leaves with x's and weight's values, dtypes and
    strides, against the float64 reference: output and gradients."""
    leaves = {"x": x.detach().requires_grad_(True)}
    if weight is not None:
        leaves["weight"] = weight.detach().requires_grad_(True)
    with numpy_errors(inf_injected):
        if module:
            norm = lmfuse.RMSNorm(x.shape[-1], kw["eps"], weight_offset=kw["weight_offset"],
                                  elementwise_affine=weight is not None, impl=impl,
                                  device=DEVICE, dtype=None if weight is None else weight.dtype)
            if weight is not None:
                with torch.no_grad():
                    norm.weight.copy_(weight)
                leaves["weight"] = norm.weight
            out = norm(leaves["x"])
        else:
            out = lmfuse.rms_norm(leaves["x"], leaves.get("weight"), impl=impl, **kw)
        grads = dict(zip(leaves, torch.autograd.grad(out, list(leaves.values()), grad)))
    ref_leaves = {k: t.detach().to(F64).requires_grad_(True) for k, t in leaves.items()}
    ref = rms_norm_reference(ref_leaves["x"], ref_leaves.get("weight"), **kw)
    ref_grads = dict(zip(ref_leaves, torch.autograd.grad(ref, list(ref_leaves.values()),
                                                         grad.to(F64))))
    tag = f"{what} [{impl}{' module' if module else ''}]"
    assert out.dtype == x.dtype and out.shape == x.shape, tag
    assert_matches(out, ref, f"{tag}: forward")
    for name, g in grads.items():
        assert g.dtype == leaves[name].dtype, f"{tag}: d {name} dtype {g.dtype}"
        # H = 1: dx = dy * w * eps * rstd**3, the difference of two nearly equal terms, is
        # no float32 value to compare with float64 (test_ops.py's test_hidden_size_one
        # bounds it against the terms' size); its NaN / inf pattern still is.
        assert_matches(g, ref_grads[name], f"{tag}: d {name}",
                       pattern_only=name == "x" and x.shape[-1] == 1)


def _x(shape, dtype=F32, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape) * scale).to(DEVICE, dtype)


@pytest.fixture
def small_tiles() -> Iterator[None]:
    with tuning.overlay("rms_norm", SMALL_TILES):
        yield


# --- NaN and inf, case by case -----------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("streamed", [False, True], ids=["tile", "streamed"])
@pytest.mark.parametrize("with_weight", [False, True], ids=["no-weight", "weight"])
def test_nan_and_inf_rows_and_columns(request: pytest.FixtureRequest, impl: str,
                                      streamed: bool, with_weight: bool) -> None:
    if streamed:
        request.getfixturevalue("small_tiles")
    H = 50 if streamed else 7
    x = _x((6, H), scale=2.0)
    x[0, 3], x[1, 2], x[2, 1], x[3, 0], x[3, 4] = NAN, INF, -INF, INF, -INF
    weight = _x((H,)) if with_weight else None
    if weight is not None:
        weight[5] = NAN
    check(f"H={H}", x, weight, _x((6, H)), impl, inf_injected=True, eps=1e-6,
          weight_offset=0.0)
    with np.errstate(invalid="ignore"):  # inf * 0 is how the NaN arises
        y = lmfuse.rms_norm(x, weight, impl=impl)
    assert y[0].isnan().all(), "a NaN makes its row NaN"
    assert y[1, 2].isnan() and (y[1, [0, 1, 3, 4]] == 0).all(), "inf: rstd 0, inf * 0 NaN"
    if weight is not None:
        assert y[:, 5].isnan().all(), "a NaN weight makes its column NaN"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("streamed", [False, True], ids=["tile", "streamed"])
def test_eps_zero_tail_rows_raise_no_floating_point_warning(
        request: pytest.FixtureRequest, impl: str, streamed: bool) -> None:
    """eps = 0: the rows past M in the last tile (all zeros) took rsqrt(0), an interpreter
    division-by-zero warning; they now take 1. A real zero row is NaN (0 * inf), as the
    PyTorch formula gives."""
    if streamed:
        request.getfixturevalue("small_tiles")
    H = 40 if streamed else 7
    x = _x((5, H), scale=3.0)
    check("eps=0", x, _x((H,)), _x((5, H)), impl, inf_injected=False, eps=0.0,
          weight_offset=1.0)
    x[2] = 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        y = lmfuse.rms_norm(x, None, eps=0.0, impl=impl)
    assert y[2].isnan().all() and torch.isfinite(y[[0, 1, 3, 4]]).all()


# --- properties ------------------------------------------------------------------------------


SIZES = [1, 2, 3, 5, 7, 13, 16, 17, 31, 37]
SPECIALS = [NAN, INF, -INF]
LAYOUTS = ["contiguous", "transposed", "row-slice", "every-other-column", "3-d-permuted"]


def make_x(layout: str, rows: int, H: int, dtype, scale: float) -> torch.Tensor:
    if layout == "transposed":
        return _x((H, rows), dtype, scale).t()
    if layout == "row-slice":
        return _x((rows, H + 5), dtype, scale)[:, 2:H + 2]
    if layout == "every-other-column":
        return _x((rows, 2 * H), dtype, scale)[:, ::2]
    if layout == "3-d-permuted":
        return _x((2, rows, H), dtype, scale).transpose(0, 1)
    return _x((rows, H), dtype, scale)


@st.composite
def problems(draw: st.DrawFn) -> dict[str, Any]:
    dtype = draw(st.sampled_from([F32, F16, BF16]))
    return dict(dtype=dtype, impl=draw(st.sampled_from(IMPLS)),
                module=draw(st.booleans()),
                rows=draw(st.sampled_from([0] + SIZES)) * SCALE,
                H=draw(st.sampled_from(SIZES)) * SCALE,
                layout=draw(st.sampled_from(LAYOUTS)),
                weight=draw(st.sampled_from([None, "same", "float32"])),
                weight_offset=draw(st.sampled_from([0.0, 1.0, -0.5])),
                eps=draw(st.sampled_from([1e-6, 1e-5, 0.0])),
                small_tiles=draw(st.booleans()),
                magnitude=draw(st.sampled_from([1.0, 30.0])),
                inject=draw(st.lists(st.tuples(st.sampled_from(["x", "x", "weight"]),
                                               st.integers(0, 10**6),
                                               st.sampled_from(SPECIALS)), max_size=4)),
                seed=draw(st.integers(0, 2**31 - 1)))


# Twice the profile's examples (ci: 50, same ones every run; dev: 600).
@settings(max_examples=2 * settings.default.max_examples)
@given(p=problems())
def test_property_both_paths_match_the_float64_reference(p: dict[str, Any]) -> None:
    torch.manual_seed(p["seed"])
    dtype, H = p["dtype"], p["H"]
    x = make_x(p["layout"], p["rows"], H, dtype, p["magnitude"])
    weight = None
    if p["weight"] is not None:
        weight = (1.0 - p["weight_offset"] + 0.3 * torch.randn(H)).to(
            DEVICE, dtype if p["weight"] == "same" else F32)
    inf_injected = False
    for target, position, value in p["inject"]:
        t = x if target == "x" else weight
        if t is not None:
            _inject(t, position, value)
            inf_injected |= math.isinf(value)
    grad = _x(x.shape, dtype)
    with tuning.overlay("rms_norm", SMALL_TILES if p["small_tiles"] else {}):
        check(f"{p}", x, weight, grad, p["impl"], module=p["module"],
              inf_injected=inf_injected, eps=p["eps"], weight_offset=p["weight_offset"])


# --- the oracle is PyTorch's own RMSNorm -------------------------------------------------------


@given(rows=st.integers(0, 6), H=st.sampled_from(SIZES), offset=st.sampled_from([0.0, 1.0]),
       inject=st.lists(st.tuples(st.sampled_from(["x", "x", "weight"]),
                                 st.integers(0, 10**6), st.sampled_from(SPECIALS)),
                       max_size=3),
       seed=st.integers(0, 2**31 - 1))
def test_reference_is_torch_rms_norm(rows: int, H: int, offset: float, inject, seed: int) -> None:
    """``rms_norm_reference`` in float64 equals ``F.rms_norm`` (with ``weight + offset``),
    NaN and inf included, forward and gradients."""
    torch.manual_seed(seed)
    x, weight = torch.randn(rows, H, dtype=F64), torch.randn(H, dtype=F64)
    for target, position, value in inject:
        _inject(x if target == "x" else weight, position, value)
    grad = torch.randn(rows, H, dtype=F64)
    results = []
    for fn in (lambda a, w: rms_norm_reference(a, w, eps=1e-5, weight_offset=offset),
               lambda a, w: torch.nn.functional.rms_norm(a, (H,), w + offset, eps=1e-5)):
        leaves = [x.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
        out = fn(*leaves)
        results.append((out, *torch.autograd.grad(out, leaves, grad)))
    for name, got, want in zip(("forward", "d x", "d weight"), *results):
        assert_matches(got, want, name)


# --- a finite row whose mean square overflows -------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("streamed", [False, True], ids=["tile", "streamed"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_overflowing_row_gradients(request: pytest.FixtureRequest, impl: str, streamed: bool,
                                   dtype: torch.dtype) -> None:
    """A finite 3e38 makes the row's mean square inf and rstd 0 (the row's output 0). The
    formula's gradient (the reference's autograd, float32 math) is NaN across the row
    where its ``sum(dy * w * x)`` overflows too, and otherwise NaN only where ``2 x``
    overflows (``inf * 0`` both), 0 elsewhere: every path must give the same (the kernels
    and the CPU path once gave 0 throughout)."""
    if streamed:
        request.getfixturevalue("small_tiles")
    H = 50 if streamed else 4
    x = torch.zeros(2, H, dtype=dtype, device=DEVICE)
    x[:, :4] = torch.tensor([3e38, 1.0, 2.0, -1.0], dtype=dtype)
    weight = torch.ones(H, dtype=dtype, device=DEVICE)
    weight[0] = 2.0  # row 0's 2 * 3e38 overflows; row 1's upstream gradient keeps it finite
    dy = torch.ones(2, H, dtype=dtype, device=DEVICE)
    dy[1, 0] = 0.5
    leaves = [x.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
    with np.errstate(over="ignore", invalid="ignore"):  # how the formula's NaN arises
        out = lmfuse.rms_norm(*leaves, eps=1e-6, impl=impl)
        dx, dw = torch.autograd.grad(out, leaves, dy)
    ref_leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    # The formula through autograd (F.rms_norm's fused CUDA backward gives 0 at row 1's
    # 3e38, where its CPU backward and the formula give NaN).
    ref = rms_norm_reference(ref_leaves[0], ref_leaves[1], eps=1e-6)
    ref_dx, ref_dw = torch.autograd.grad(ref, ref_leaves, dy)
    assert ref_dx[0].isnan().all(), "the oracle's premise: its sum overflows"
    assert ref_dx[1, 0].isnan() and (ref_dx[1, 1:] == 0).all(), "2 x overflows at 3e38 only"
    assert (out == 0).all()
    torch.testing.assert_close(dx, ref_dx, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(dw, ref_dw, equal_nan=True)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_a_row_whose_mean_square_underflows_with_eps_0(impl) -> None:
    """eps = 0 and a row whose mean square underflows to 0 (rstd inf): autograd through
    the formula gives a NaN gradient row; the Triton backward gave -inf."""
    x = torch.tensor([[1e-30, 2e-30, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]], requires_grad=True)
    w = torch.ones(4)
    y = lmfuse.rms_norm(x, w, eps=0.0, impl=impl)
    (dx,) = torch.autograd.grad(y.sum(), [x])
    xr = x.detach().clone().requires_grad_(True)
    yr = xr * torch.rsqrt(xr.square().mean(-1, keepdim=True)) * w
    (want,) = torch.autograd.grad(yr.sum(), [xr])
    assert torch.isnan(dx[0]).all() and torch.isnan(want[0]).all()
    assert torch.allclose(dx[1], want[1], atol=1e-6)


@pytest.mark.parametrize("impl", ["auto", "triton", "torch"])
def test_scalars_beyond_float32_are_refused(impl) -> None:
    # (float32 arguments of the kernels: 1e39 would be inf there)
    x = torch.randn(2, 8)
    for kw in (dict(eps=1e39), dict(weight_offset=1e39)):
        with pytest.raises(ValueError, match=r"^rms_norm: \w+ must be within float32's range"):
            lmfuse.rms_norm(x, torch.ones(8), impl=impl, **kw)
