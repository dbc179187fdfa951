"""``lmfuse.rms_norm`` on both paths (``impl="torch"`` and ``impl="triton"`` in the
interpreter) against ``rms_norm_reference`` evaluated in float64.

Every case runs forward and backward from the same inputs (rounded to the dtype under
test) and compares the output and the gradients of x and weight with the float64
reference, within the tolerance of each result's dtype (``helpers.TOL``). Cases:
fp32/fp16/bf16, odd H, rows streamed in column tiles (a lowered tile limit, and a real
65536-wide row), 3-D and non-contiguous x / weight / upstream gradient, no weight,
``weight_offset``, empty inputs, the backward's row groups, deterministic weight gradients,
a float64 gradcheck of the torch path, NVTX ranges, bad input, ``explain``.
"""

from __future__ import annotations

import inspect

import helpers
import pytest
import torch
from helpers import assert_close, randn

import lmfuse
from lmfuse import _nvtx
from lmfuse.norm import ops as norm_ops
from lmfuse.norm.reference import rms_norm_reference, rms_norm_rstd_reference

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
IMPLS = ["torch", "triton"]
DTYPES = [pytest.param(d, id=str(d).replace("torch.", "")) for d in (F32, F16, BF16)]


def check(what: str, x: torch.Tensor, weight: torch.Tensor | None, g: torch.Tensor, impl: str,
          **kw) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Run ``rms_norm`` on leaves with ``x``'s and ``weight``'s values, dtypes and strides;
    compare output and gradients with the float64 reference on the same values."""
    leaves = [t.detach().requires_grad_(True) for t in (x, weight) if t is not None]
    out = lmfuse.rms_norm(leaves[0], leaves[1] if weight is not None else None, impl=impl, **kw)
    grads = torch.autograd.grad(out, leaves, g)
    ref_leaves = [t.detach().to(F64).requires_grad_(True) for t in leaves]
    ref = rms_norm_reference(ref_leaves[0], ref_leaves[1] if weight is not None else None,
                             **kw)
    ref_grads = torch.autograd.grad(ref, ref_leaves, g.to(F64))
    assert out.dtype == x.dtype and out.shape == x.shape, what
    assert out.is_contiguous() or impl == "torch", what
    assert_close(out, ref, x.dtype, f"{what}: forward")
    for name, leaf, got, want in zip(("x", "weight"), leaves, grads, ref_grads):
        assert got.dtype == leaf.dtype, f"{what}: d {name} dtype {got.dtype}"
        assert_close(got, want, leaf.dtype, f"{what}: d {name}")
    return out, list(grads)


# --- forward and backward against the reference ----------------------------------------------


CASES = [  # (id, x shape, weight offset, with a weight)
    pytest.param((5, 7), 0.0, True, id="2d-H7"),
    pytest.param((2, 3, 100), 1.0, True, id="3d-H100-gemma"),
    pytest.param((19, 333), 0.0, True, id="2d-H333-19rows"),
    pytest.param((3, 2, 48), -0.5, False, id="3d-H48-noweight"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, offset, with_weight", CASES)
def test_matches_reference(shape, offset: float, with_weight: bool, dtype: torch.dtype,
                           impl: str) -> None:
    x = randn(shape, dtype, scale=2.0)
    w = randn((shape[-1],), dtype) if with_weight else None
    check(f"{shape} {dtype} {impl}", x, w, randn(shape, dtype), impl, weight_offset=offset,
          eps=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_hidden_size_one(dtype: torch.dtype, impl: str) -> None:
    """H = 1: y = x / sqrt(x**2 + eps) * w, and dx = dy * w * eps * rstd**3 is tiny, the
    difference of two nearly equal terms: compared in absolute terms, against the size of
    those terms (dy * w * rstd)."""
    x, w, g = randn((6, 1), dtype, scale=2.0), randn((1,), dtype), randn((6, 1), dtype)
    leaves = [x.clone().requires_grad_(True), w.clone().requires_grad_(True)]
    y = lmfuse.rms_norm(*leaves, eps=1e-5, impl=impl)
    dx, dw = torch.autograd.grad(y, leaves, g)
    ref_leaves = [t.double().requires_grad_(True) for t in (x, w)]
    ref = rms_norm_reference(*ref_leaves, eps=1e-5)
    ref_dx, ref_dw = torch.autograd.grad(ref, ref_leaves, g.double())
    assert_close(y, ref, dtype, "H=1 forward")
    assert_close(dw, ref_dw, dtype, "H=1 dweight")
    terms = (g.double() * w.double() * rms_norm_rstd_reference(x, 1e-5)[:, None]).abs()
    assert ((dx.double() - ref_dx).abs() <= helpers.tol(dtype) * terms).all()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_float32_weight_with_half_x(dtype: torch.dtype, impl: str) -> None:
    """Mixed precision: the weight's gradient comes in float32, x's in the half dtype."""
    x = randn((6, 50), dtype)
    check(f"{dtype} x, fp32 weight", x, randn((50,), F32), randn((6, 50), dtype), impl)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("shape, offset, with_weight", [
    pytest.param((7, 100), 0.0, True, id="H100"),
    pytest.param((2, 3, 70), 1.0, True, id="3d-H70-gemma"),
    pytest.param((5, 33), 0.0, False, id="H33-noweight"),
])
def test_streamed_rows(small_tiles: list, shape, offset: float, with_weight: bool,
                       dtype: torch.dtype) -> None:
    """Rows wider than the (lowered) tile limit: both kernels stream column tiles."""
    x = randn(shape, dtype)
    w = randn((shape[-1],), dtype) if with_weight else None
    check(f"streamed {shape}", x, w, randn(shape, dtype), "triton", weight_offset=offset)
    assert small_tiles and all(not single for *_, single in small_tiles)


def test_streamed_row_of_65536() -> None:
    """A real wide row with the default table: past the single-tile limit, so streamed."""
    assert not norm_ops._config(65536, torch.device("cpu"))[0].single
    x = randn((2, 65536), F32)
    check("H 65536", x, randn((65536,), F32), randn((2, 65536), F32), "triton")


@pytest.mark.parametrize("streamed", [False, True], ids=["tile", "streamed"])
def test_backward_row_groups(small_tiles: list, streamed: bool) -> None:
    """Several backward programs, each walking several row tiles with a partial last one:
    the weight gradient is the sum of their partials."""
    H = 40 if streamed else 24  # tiles: 2 x 16 streamed, 2 rows x 32 columns otherwise
    x = randn((23, H), F32)
    check("row groups", x, randn((H,), F32), randn((23, H), F32), "triton")
    programs, rows_per_program = small_tiles[-1][:2]
    assert programs > 1 and rows_per_program > 2 and 23 % rows_per_program


@pytest.mark.parametrize("impl", IMPLS)
def test_weight_gradient_is_deterministic(small_tiles: list, impl: str) -> None:
    x, w, g = randn((37, 40), BF16), randn((40,), F32), randn((37, 40), BF16)
    runs = []
    for _ in range(3):
        leaves = [x.clone().requires_grad_(True), w.clone().requires_grad_(True)]
        runs.append(torch.autograd.grad(lmfuse.rms_norm(*leaves, impl=impl), leaves, g))
    for dx, dw in runs[1:]:
        assert torch.equal(dx, runs[0][0]) and torch.equal(dw, runs[0][1])


# --- layouts and shapes ------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", ["row-strided", "transposed", "permuted-3d", "expanded"])
def test_non_contiguous_x(layout: str, impl: str) -> None:
    if layout == "row-strided":  # rows 60 apart: read in place
        x = randn((6, 60), F16)[:, 5:45]
    elif layout == "transposed":  # columns not at stride 1: copied once
        x = randn((40, 6), F16).t()
    elif layout == "permuted-3d":
        x = randn((40, 3, 2), F16).permute(1, 2, 0)
    else:  # every row the same memory (row stride 0)
        x = randn((1, 40), F16).expand(6, 40)
    assert not x.is_contiguous()
    g = randn((6, 40) if x.dim() == 2 else (3, 2, 40), F16).transpose(-1, -2).contiguous()
    g = g.transpose(-1, -2)  # a non-contiguous upstream gradient too
    check(f"{layout} {impl}", x, randn((40,), F16), g, impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_non_contiguous_weight_and_expanded_grad(impl: str) -> None:
    x = randn((3, 2, 24), F32, requires_grad=True)
    base = randn((48,), F32)
    w = base[::2].detach().requires_grad_(True)
    y = lmfuse.rms_norm(x, w, impl=impl)
    y.sum().backward()  # an upstream gradient of stride 0
    xr, wr = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    rms_norm_reference(xr, wr).sum().backward()
    assert_close(x.grad, xr.grad, F32, "dx")
    assert_close(w.grad, wr.grad, F32, "dweight")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8), (3, 0)], ids=["0x8", "2x0x8", "3x0"])
def test_empty(shape, impl: str) -> None:
    x = torch.zeros(shape, dtype=BF16, requires_grad=True)
    w = torch.ones(shape[-1], requires_grad=True)
    y = lmfuse.rms_norm(x, w, impl=impl)
    assert y.shape == shape and y.dtype == BF16
    dx, dw = torch.autograd.grad(y, [x, w], torch.zeros(shape, dtype=BF16))
    assert dx.shape == shape and dw.shape == (shape[-1],) and not dw.any()


@pytest.mark.parametrize("impl", IMPLS)
def test_partial_requires_grad_and_no_grad(impl: str) -> None:
    x, w, g = randn((5, 24), F32), randn((24,), F32), randn((5, 24), F32)
    xr = x.double().requires_grad_(True)
    wr = w.double().requires_grad_(True)
    ref = rms_norm_reference(xr, wr)
    want_dx, want_dw = torch.autograd.grad(ref, [xr, wr], g.double())
    wl = w.clone().requires_grad_(True)
    (dw,) = torch.autograd.grad(lmfuse.rms_norm(x, wl, impl=impl), [wl], g)
    assert_close(dw, want_dw, F32, "dweight alone")
    xl = x.clone().requires_grad_(True)
    (dx,) = torch.autograd.grad(lmfuse.rms_norm(xl, w, impl=impl), [xl], g)
    assert_close(dx, want_dx, F32, "dx alone")
    with torch.no_grad():
        y = lmfuse.rms_norm(x, w, impl=impl)
    assert not y.requires_grad
    assert_close(y, ref, F32, "no_grad forward")


def test_float64_on_the_torch_path() -> None:
    x = randn((3, 10), F64)
    y = lmfuse.rms_norm(x, randn((10,), F64), impl="auto")
    assert y.dtype == F64
    with pytest.raises(TypeError, match="rms_norm: .*float64.*impl='torch'"):
        lmfuse.rms_norm(x, impl="triton")
    assert lmfuse.explain(lmfuse.rms_norm, x).impl == "torch"


def test_gradcheck_float64_torch_path() -> None:
    x = randn((3, 6), F64, requires_grad=True)
    w = randn((6,), F64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, w: lmfuse.rms_norm(x, w, eps=1e-3, weight_offset=1.0, impl="torch"), (x, w))


def test_triton_forward_saves_the_reference_rstd() -> None:
    x = randn((4, 3, 50), BF16)
    y, rstd = norm_ops.launch_rms_norm(x.reshape(12, 50), None, 1e-5, 0.0)
    assert rstd.dtype == F32 and rstd.shape == (12,)
    assert torch.allclose(rstd, rms_norm_rstd_reference(x, 1e-5).reshape(12), rtol=1e-6)


def test_auto_is_triton_under_the_interpreter() -> None:
    x, w = randn((3, 20), F32), randn((20,), F32)
    assert lmfuse.explain(lmfuse.rms_norm, x, w).impl == "triton"
    assert torch.equal(lmfuse.rms_norm(x, w), lmfuse.rms_norm(x, w, impl="triton"))


def test_saved_input_goes_through_autograd() -> None:
    """x is saved with save_for_backward: changing it in place after the forward raises
    instead of giving a wrong gradient."""
    x = randn((4, 8), F32, requires_grad=True)
    h = x * 1.0
    y = lmfuse.rms_norm(h, impl="triton")
    h.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("impl", IMPLS)
def test_nvtx_ranges(impl: str) -> None:
    before = (_nvtx._ENABLED, _nvtx._record)
    names: list[str] = []
    _nvtx.enable(True, record=names)
    try:
        x = randn((3, 8), F32, requires_grad=True)
        lmfuse.rms_norm(x, randn((8,), F32), impl=impl).sum().backward()
    finally:
        _nvtx._ENABLED, _nvtx._record = before
    # The reference's backward is plain autograd, outside any range.
    assert names == ["lmfuse.rms_norm.fwd"] + (["lmfuse.rms_norm.bwd"] if impl == "triton"
                                               else [])


# --- bad input ---------------------------------------------------------------------------------


BAD = [  # (id, changed arguments, error, words the message must contain)
    ("weight-length", dict(weight=randn((9,))), ValueError, r"weight \[8\] \(9,\)"),
    ("weight-2d", dict(weight=randn((1, 8))), ValueError, r"weight 1-D 2-D"),
    ("weight-int", dict(weight=torch.ones(8, dtype=torch.int64)), TypeError, r"weight int64"),
    ("weight-list", dict(weight=[1.0] * 8), TypeError, r"weight list"),
    ("x-int", dict(x=torch.ones(4, 8, dtype=torch.int32)), TypeError, r"\bx\b int32"),
    ("x-list", dict(x=[[1.0] * 8]), TypeError, r"\bx\b list"),
    ("x-0d", dict(x=torch.tensor(1.0), weight=None), ValueError, r"\bx\b 0-D"),
    ("eps-negative", dict(eps=-1e-6), ValueError, r"eps >= 0"),
    ("eps-nan", dict(eps=float("nan")), ValueError, r"eps finite nan"),
    ("eps-inf", dict(eps=float("inf")), ValueError, r"eps finite inf"),
    ("eps-str", dict(eps="1e-6"), TypeError, r"eps str"),
    ("eps-none", dict(eps=None), TypeError, r"eps NoneType"),
    ("offset-nan", dict(weight_offset=float("nan")), ValueError, r"weight_offset finite"),
    ("weight-device", dict(weight=torch.ones(8, device="meta")), ValueError,
     r"weight meta cpu"),
    ("impl", dict(impl="cuda"), ValueError, r"impl 'cuda'"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("change, error, message", [pytest.param(*b[1:], id=b[0]) for b in BAD])
def test_bad_input_raises(change: dict, error, message: str, impl: str) -> None:
    args = dict(x=randn((4, 8)), weight=randn((8,)), impl=impl)
    args.update(change)
    x, weight = args.pop("x"), args.pop("weight")
    pattern = r"(?s)^rms_norm: " + "".join(f"(?=.*{word})" for word in message.split())
    with pytest.raises(error, match=pattern):
        lmfuse.rms_norm(x, weight, **args)
    with pytest.raises(error, match=pattern):
        lmfuse.explain(lmfuse.rms_norm, x, weight, **args)


# --- explain, signature ------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["triton", "torch", "auto"])
def test_explain(impl: str) -> None:
    x, w = randn((2, 3, 100), BF16), randn((100,), F32)
    plan = lmfuse.explain(lmfuse.rms_norm, x, w, weight_offset=1.0, impl=impl)
    assert isinstance(plan, lmfuse.Plan)
    assert plan.op == "rms_norm"
    assert plan.impl == ("triton" if impl == "auto" else impl), str(plan)
    assert lmfuse.explain("rms_norm", x, w, weight_offset=1.0, impl=impl).impl == plan.impl
    assert plan.details["x"] == "[2, 3, 100] bfloat16: 6 rows of 100"
    assert plan.details["scale"] == "weight + 1" and plan.details["weight"] == "[100] float32"
    if plan.impl == "triton":
        assert plan.details["forward"].startswith("one pass,")
        assert "weight gradient" in plan.details["backward"]
    plain = lmfuse.explain(lmfuse.rms_norm, x, impl=impl)
    assert plain.details["scale"] == "none (no weight)" and "weight" not in plain.details


def test_explain_streamed_rows() -> None:
    plan = lmfuse.explain(lmfuse.rms_norm, torch.empty(2, 65536))
    assert plan.details["forward"].startswith("streamed in 2048-column tiles")
    assert "streamed" in plan.details["backward"]


def test_signature_and_exports() -> None:
    import lmfuse.norm

    assert lmfuse.norm.rms_norm is lmfuse.rms_norm and lmfuse.norm.RMSNorm is lmfuse.RMSNorm
    assert "rms_norm" in lmfuse.__all__ and "RMSNorm" in lmfuse.__all__
    sig = inspect.signature(lmfuse.rms_norm).replace(return_annotation=inspect.Signature.empty)
    plain = sig.replace(parameters=[p.replace(annotation=inspect.Parameter.empty)
                                    for p in sig.parameters.values()])
    assert str(plain) == "(x, weight=None, *, eps=1e-06, weight_offset=0.0, impl='auto')"
    assert lmfuse.rms_norm.__doc__


@pytest.mark.parametrize("weighted,offset", [(True, 0.0), (True, 1.0), (False, 0.0)])
@pytest.mark.parametrize("poison", [None, "nan", "inf"])
def test_default_cpu_path_is_torch_rms_norm_with_the_reference_results(
        monkeypatch: pytest.MonkeyPatch, weighted: bool, offset: float, poison) -> None:
    """On CPU float32 without Triton (what a CPU machine without the interpreter picks) the
    default path is PyTorch's RMSNorm (``_cpu_rms_norm``: its gradient by ``_RMSNormCPU``);
    outputs and gradients equal the reference's, NaN and inf included."""
    from lmfuse._dispatch import select_impl

    monkeypatch.setattr(norm_ops, "select_impl", lambda op, impl, device: (
        ("torch", "test: no Triton") if impl == "auto" else select_impl(op, impl, device)))
    calls = []
    real = norm_ops._cpu_rms_norm
    monkeypatch.setattr(norm_ops, "_cpu_rms_norm",
                        lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 24, generator=g) * 2
    if poison == "nan":
        x[1, 2, 7] = float("nan")
    elif poison == "inf":
        x[0, 4, 3] = float("inf")
    w = torch.randn(24, generator=g) if weighted else None
    dy = torch.randn(3, 5, 24, generator=g)
    out = {}
    for impl in ("auto", "torch"):
        xi = x.clone().requires_grad_(True)
        wi = w.clone().requires_grad_(True) if weighted else None
        y = lmfuse.rms_norm(xi, wi, eps=1e-5, weight_offset=offset, impl=impl)
        grads = torch.autograd.grad(y, [t for t in (xi, wi) if t is not None], dy)
        out[impl] = (y, *grads)
    assert calls == [1]  # the auto call ran PyTorch's op, the torch call the reference
    for got, want in zip(out["auto"], out["torch"], strict=True):
        assert torch.equal(got.isnan(), want.isnan())
        fin = ~want.isnan()
        assert torch.allclose(got[fin], want[fin], rtol=1e-5, atol=1e-6)
