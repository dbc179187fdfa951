"""The public activations on both paths (``impl="torch"`` and ``impl="triton"`` in the
interpreter) against ``activation_reference`` evaluated in float64.

Every case runs forward and backward from the same inputs (rounded to the dtype under
test) and compares the output and the gradients of x, bias and weights with the float64
reference, within the tolerance of each result's dtype (``helpers.TOL``, relative to the
largest reference magnitude and in norm). Cases: fp32/fp16/bf16, 2-D and 3-D, f not a
power of two (1, 7, 100, 333), non-contiguous x and upstream gradient, fp32 weights with
half-precision x, the clamp's edges, linear offsets, 0 tokens, fp8 storage of the saved
input, CPU offload, bad input, ``explain``.
"""

from __future__ import annotations

import gc
import inspect
import math
import re
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import pytest
import torch
import triton
import triton.language as tl
from helpers import assert_close, randn, rel_err
from hypothesis import given
from hypothesis import strategies as st

import lmfuse
from lmfuse.activations.reference import activation_reference
from lmfuse._fp8 import saturate_e4m3 as _saturate_e4m3

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
FP8 = torch.float8_e4m3fn
IMPLS = ["torch", "triton"]
DTYPES = [pytest.param(d, id=str(d).replace("torch.", "")) for d in (F32, F16, BF16)]
HALF_DTYPES = [pytest.param(F16, id="float16"), pytest.param(BF16, id="bfloat16")]


@dataclass(frozen=True)
class Op:
    """One public function and the reference arguments that define it."""

    name: str
    activation: str
    gated: bool
    has_bias: bool = True
    weighted: bool = False
    fp8: bool = False  # takes fp8_input_store and cpu_offload_input
    clamp: bool = False  # takes linear_offset and clamp_value

    @property
    def fn(self) -> Callable[..., torch.Tensor]:
        return getattr(lmfuse, self.name)

    def width(self, f: int) -> int:
        """x's last dim K for output width f."""
        return 2 * f if self.gated else f


OPS = [
    Op("bias_gelu", "gelu", gated=False),
    Op("swiglu", "silu", gated=True, fp8=True),
    Op("geglu", "gelu", gated=True, fp8=True),
    Op("quick_geglu", "quick_gelu", gated=True, fp8=True, clamp=True),
    Op("weighted_swiglu", "silu", gated=True, weighted=True, fp8=True),
    Op("weighted_quick_geglu", "quick_gelu", gated=True, weighted=True, fp8=True, clamp=True),
    Op("squared_relu", "squared_relu", gated=False, has_bias=False),
    Op("weighted_squared_relu", "squared_relu", gated=False, has_bias=False, weighted=True),
]
BY_NAME = {op.name: op for op in OPS}


def ops_where(pred: Callable[[Op], bool]) -> list[Any]:
    return [pytest.param(op, id=op.name) for op in OPS if pred(op)]


ALL_OPS = ops_where(lambda op: True)
FP8_OPS = ops_where(lambda op: op.fp8)
CLAMP_OPS = ops_where(lambda op: op.clamp)
WEIGHTED_OPS = ops_where(lambda op: op.weighted)
BIAS_OPS = ops_where(lambda op: op.has_bias)


@dataclass
class Inputs:
    x: torch.Tensor
    bias: torch.Tensor | None
    weights: torch.Tensor | None
    grad_out: torch.Tensor


def make_inputs(op: Op, lead: tuple[int, ...], f: int, dtype: torch.dtype, *, bias: bool = True,
                weights_dtype: torch.dtype | None = None, scale: float = 2.0) -> Inputs:
    K = op.width(f)
    tokens = math.prod(lead)
    return Inputs(
        x=randn(lead + (K,), dtype, scale=scale),
        bias=randn((K,), dtype) if bias and op.has_bias else None,
        weights=randn((tokens, 1), weights_dtype or dtype) if op.weighted else None,
        grad_out=randn(lead + (f,), dtype),
    )


def call(op: Op, x, bias=None, weights=None, **kwargs) -> torch.Tensor:
    args = (x, weights) if op.weighted else (x,)
    if op.has_bias:
        kwargs["bias"] = bias
    return op.fn(*args, **kwargs)


def leaves(inp: Inputs, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Fresh leaves requiring grad: ``inp``'s tensors as they are (strides kept: a detached
    view stays a view), or cast to ``dtype``."""
    out = {}
    for name in ("x", "bias", "weights"):
        t = getattr(inp, name)
        if t is not None:
            t = t.detach() if dtype is None else t.detach().to(dtype)
            out[name] = t.requires_grad_(True)
    return out


def run(op: Op, inp: Inputs, impl: str, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Output and gradients of the op on leaves with ``inp``'s values, dtypes and strides."""
    lv = leaves(inp)
    out = call(op, lv["x"], lv.get("bias"), lv.get("weights"), impl=impl, **kwargs)
    grads = torch.autograd.grad(out, list(lv.values()), inp.grad_out)
    return out, dict(zip(lv, grads))


def reference(op: Op, inp: Inputs, *, x: torch.Tensor | None = None, linear_offset: float = 0.0,
              clamp_value: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The float64 reference's output and autograd gradients (at ``x`` when given)."""
    lv = leaves(Inputs(inp.x if x is None else x, inp.bias, inp.weights, inp.grad_out), F64)
    out = activation_reference(lv["x"], lv.get("bias"), lv.get("weights"),
                               activation=op.activation, gated=op.gated,
                               linear_offset=linear_offset, clamp_value=clamp_value)
    grads = torch.autograd.grad(out, list(lv.values()), inp.grad_out.to(F64))
    return out, dict(zip(lv, grads))


def ref_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k in ("linear_offset", "clamp_value")}


def fp8_copy(x: torch.Tensor, clamp_value: Optional[float]) -> torch.Tensor:
    """The float8 copy ``fp8_input_store`` keeps, in x's dtype: x rounded, saturated at
    +-448 and, with a clamp, each value kept on its side of the clamp."""
    from lmfuse.activations.ops import _e4m3_keeping_clamp

    x8 = (x.clamp(-448.0, 448.0).to(FP8) if clamp_value is None
          else _e4m3_keeping_clamp(x, clamp_value))
    return x8.to(x.dtype)


def check(what: str, op: Op, inp: Inputs, impl: str,
          **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run the op and compare output and gradients with the float64 reference (the
    gradients at the fp8-rounded x under ``fp8_input_store=True``)."""
    out, grads = run(op, inp, impl, **kwargs)
    ref_out, ref_grads = reference(op, inp, **ref_kwargs(kwargs))
    if kwargs.get("fp8_input_store"):
        x8 = fp8_copy(inp.x, kwargs.get("clamp_value"))
        _, ref_grads = reference(op, inp, x=x8, **ref_kwargs(kwargs))
    dtype = inp.x.dtype
    assert out.dtype == dtype, f"{what}: output dtype {out.dtype} != {dtype}"
    assert out.shape == ref_out.shape, f"{what}: output shape {tuple(out.shape)}"
    assert_close(out, ref_out, dtype, f"{what}: forward")
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        leaf_dtype = getattr(inp, name).dtype
        assert g.dtype == leaf_dtype, f"{what}: d {name} dtype {g.dtype} != {leaf_dtype}"
        assert_close(g, ref_grads[name], leaf_dtype, f"{what}: d {name}")
    return out, grads


# --- forward and backward against the reference --------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    lead: tuple[int, ...]
    f: int
    bias: bool = True
    linear_offset: float = 0.0
    clamp_value: float | None = None
    dtypes: tuple[torch.dtype, ...] = (F32, F16, BF16)

    def kwargs(self, op: Op) -> dict[str, Any]:
        if not op.clamp:
            return {}
        return dict(linear_offset=self.linear_offset, clamp_value=self.clamp_value)


CASES = [
    Case("2d-f7-bias", (5,), 7),
    Case("3d-f100-nobias", (2, 3), 100, bias=False),
    Case("2d-f1-16tokens-bias", (16,), 1),
    Case("3d-f333-bias-offset0.5-clamp1.5", (2, 2), 333, linear_offset=0.5, clamp_value=1.5),
    # Enough rows for the backward to split them into groups of several row tiles (the last
    # group and tile partial), and columns past one block; the blocking does not depend on
    # the dtype, so two of them.
    Case("2d-f333-19tokens-bias-clamp2", (19,), 333, clamp_value=2.0, dtypes=(F32, BF16)),
    Case("3d-f1100-bias-offset-1", (1, 3), 1100, linear_offset=-1.0, dtypes=(F32, BF16)),
]
CASE_DTYPES = [pytest.param(case, dtype, id=f"{case.id}-{str(dtype).replace('torch.', '')}")
               for case in CASES for dtype in case.dtypes]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case, dtype", CASE_DTYPES)
@pytest.mark.parametrize("op", ALL_OPS)
def test_matches_reference(op: Op, case: Case, dtype: torch.dtype, impl: str) -> None:
    inp = make_inputs(op, case.lead, case.f, dtype, bias=case.bias)
    out, _ = check(f"{op.name} {case.id} {impl} {dtype}", op, inp, impl, **case.kwargs(op))
    assert out.shape == case.lead + (case.f,)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", WEIGHTED_OPS)
def test_float32_weights_with_half_x(op: Op, impl: str, dtype: torch.dtype) -> None:
    """MoE routing weights kept in fp32: output and d x in x's dtype, d weights in fp32
    (to float32 accuracy)."""
    inp = make_inputs(op, (6,), 13, dtype, weights_dtype=F32)
    kwargs = dict(linear_offset=0.25, clamp_value=2.0) if op.clamp else {}
    _, grads = check(f"{op.name} fp32 weights {dtype} {impl}", op, inp, impl, **kwargs)
    assert grads["weights"].dtype == F32 and grads["x"].dtype == dtype


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", WEIGHTED_OPS)
def test_weights_with_leading_shape(op: Op, impl: str) -> None:
    """weights x.shape[:-1] + (1,) (here [2, 3, 1]) as well as [tokens, 1]."""
    inp = make_inputs(op, (2, 3), 5, F32)
    inp.weights = inp.weights.view(2, 3, 1)
    _, grads = check(f"{op.name} weights [2, 3, 1] {impl}", op, inp, impl)
    assert grads["weights"].shape == (2, 3, 1)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", ALL_OPS)
def test_output_shape_follows_leading_dims(op: Op, impl: str) -> None:
    """1-D and 4-D x (lmfuse takes any number of leading dims)."""
    for lead in [(), (2, 1, 3)]:
        inp = make_inputs(op, lead, 3, F32)
        out, _ = check(f"{op.name} lead={lead} {impl}", op, inp, impl)
        assert out.shape == lead + (3,)


# --- layouts --------------------------------------------------------------------------------


def strided_x(layout: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A non-contiguous x of ``shape`` [T, K]."""
    T, K = shape
    if layout == "transposed":  # [K, T].t(): the last dim has stride T
        return randn((K, T), dtype, scale=2.0).t()
    if layout == "row-slice":  # rows of a wider tensor: the last dim is contiguous
        return randn((T, K + 5), dtype, scale=2.0)[:, 2:K + 2]
    assert layout == "every-other-column"
    return randn((T, 2 * K), dtype, scale=2.0)[:, ::2]


@pytest.mark.parametrize("dtype", [pytest.param(F32, id="float32"),
                                   pytest.param(BF16, id="bfloat16")])
@pytest.mark.parametrize("layout", ["transposed", "row-slice", "every-other-column"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", ALL_OPS)
def test_non_contiguous_x_and_grad(op: Op, impl: str, layout: str, dtype: torch.dtype) -> None:
    inp = make_inputs(op, (6,), 5, dtype)
    inp.x = strided_x(layout, tuple(inp.x.shape), dtype)
    assert not inp.x.is_contiguous()
    inp.grad_out = randn((5, 6), dtype).t()  # a transposed upstream gradient
    kwargs = dict(linear_offset=-0.5, clamp_value=1.5) if op.clamp else {}
    check(f"{op.name} {layout} {impl} {dtype}", op, inp, impl, **kwargs)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op, which", [
    *[pytest.param(op, "bias", id=f"{op.name}-bias") for op in OPS if op.has_bias],
    *[pytest.param(op, "weights", id=f"{op.name}-weights") for op in OPS if op.weighted],
])
def test_non_contiguous_bias_or_weights(op: Op, which: str, impl: str) -> None:
    """bias: every other element of a longer vector; weights: a column of a [T, 2] tensor."""
    inp = make_inputs(op, (5,), 6, F32)
    if which == "bias":
        inp.bias = randn((2 * op.width(6),), F32)[::2]
    else:
        inp.weights = randn((5, 2), F32)[:, 1:]
    assert not getattr(inp, which).is_contiguous()
    kwargs = dict(linear_offset=0.5, clamp_value=2.0) if op.clamp else {}
    check(f"{op.name} strided {which} {impl}", op, inp, impl, **kwargs)


@pytest.mark.parametrize("impl", IMPLS)
def test_non_contiguous_3d(impl: str) -> None:
    """x [s, b, K] as a permuted [b, s, K] tensor (Megatron's sequence-first layout)."""
    op = BY_NAME["weighted_quick_geglu"]
    inp = make_inputs(op, (3, 2), 7, F32)
    inp.x = randn((2, 3, 14), F32, scale=2.0).transpose(0, 1)
    assert not inp.x.is_contiguous()
    check(f"permuted 3-D {impl}", op, inp, impl, linear_offset=1.0, clamp_value=2.5)


# --- clamp, linear offset ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", CLAMP_OPS)
def test_clamp_edges(op: Op, impl: str, dtype: torch.dtype) -> None:
    """x1 clamped from above at c, x2 to [-c, c], before the bias. Values exactly at +-c
    (gradient passes, as torch.clamp's), strictly outside (gradient exactly 0), inside."""
    c = 1.5
    v1 = torch.tensor([c, c + 0.5, -c, -c - 0.5, 0.25, 3 * c, -3 * c])
    v2 = torch.tensor([-c, c + 0.5, c, -c - 0.5, 0.5, -3 * c, 3 * c])
    inp = make_inputs(op, (4,), 7, dtype)
    rows = [torch.cat([v1, v2]), torch.cat([v2, v1]), torch.cat([v1.flip(0), v2]),
            torch.cat([v2, v2.flip(0)])]
    inp.x = torch.stack(rows).to(dtype)
    inp.bias = randn((14,), dtype, scale=0.25)
    what = f"{op.name} clamp edges {impl} {dtype}"
    _, grads = check(what, op, inp, impl, linear_offset=0.5, clamp_value=c)
    x = inp.x.to(F64)
    outside = torch.cat([x[:, :7] > c, x[:, 7:].abs() > c], dim=-1)
    dx = grads["x"]
    assert torch.all(dx[outside] == 0), f"{what}: d x != 0 strictly outside the clamp"
    assert torch.all(dx[~outside] != 0), f"{what}: d x == 0 inside or at the clamp's edge"
    assert torch.all(grads["bias"] != 0), f"{what}: d bias must not be masked by the clamp"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", CLAMP_OPS)
@pytest.mark.parametrize("linear_offset", [-1.25, 2.0])
def test_linear_offset(op: Op, impl: str, linear_offset: float) -> None:
    inp = make_inputs(op, (2, 3), 9, F32)
    check(f"{op.name} linear_offset={linear_offset} {impl}", op, inp, impl,
          linear_offset=linear_offset)
    with_offset, _ = run(op, inp, impl, linear_offset=linear_offset)
    without, _ = run(op, inp, impl)
    assert not torch.allclose(with_offset, without), "linear_offset changed nothing"


# --- empty, fp8 storage, offload ---------------------------------------------------------


@pytest.mark.parametrize("lead", [(0,), (2, 0)], ids=["0x", "2x0x"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", ALL_OPS)
def test_empty(op: Op, impl: str, lead: tuple[int, ...]) -> None:
    """0 tokens: an empty output; gradients are zeros of the inputs' shapes."""
    inp = make_inputs(op, lead, 5, BF16)
    out, grads = run(op, inp, impl)
    assert out.shape == lead + (5,) and out.dtype == BF16
    for name, g in grads.items():
        leaf = getattr(inp, name)
        assert g is not None and g.shape == leaf.shape and g.dtype == leaf.dtype, name
        assert torch.count_nonzero(g) == 0, f"d {name} of an empty input is not zero"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", ALL_OPS)
def test_zero_width_x(op: Op, impl: str) -> None:
    """x [4, 0]: an empty [4, 0] result with empty gradients, or a ValueError naming x;
    never an internal error."""
    inp = make_inputs(op, (4,), 0, F32)
    try:
        out, grads = run(op, inp, impl)
    except ValueError as e:
        assert re.match(rf"{op.name}: .*\bx\b", str(e)), str(e)
        return
    assert out.shape == (4, 0)
    assert grads["x"].shape == (4, 0)
    if "weights" in grads:
        assert torch.count_nonzero(grads["weights"]) == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", FP8_OPS)
def test_fp8_input_store(op: Op, impl: str, dtype: torch.dtype) -> None:
    """The forward is unchanged; the gradients are the reference's at the fp8-rounded x."""
    inp = make_inputs(op, (3, 2), 11, dtype)
    kwargs = dict(linear_offset=0.5, clamp_value=1.5) if op.clamp else {}
    what = f"{op.name} fp8_input_store {impl} {dtype}"
    out8, grads8 = check(what, op, inp, impl, fp8_input_store=True, **kwargs)
    out, _ = run(op, inp, impl, **kwargs)
    assert torch.equal(out8, out), f"{what}: forward differs from fp8_input_store=False"
    x8 = fp8_copy(inp.x, kwargs.get("clamp_value"))
    assert not torch.equal(x8, inp.x)
    _, ref8 = reference(op, inp, x=x8, **kwargs)
    _, ref = reference(op, inp, **kwargs)
    assert rel_err(grads8["x"], ref8["x"]) < rel_err(grads8["x"], ref["x"]), (
        f"{what}: d x is closer to the full-precision gradient than to the fp8 one"
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
def test_forward_kernel_writes_a_saturated_fp8_copy(gated: bool, dtype: torch.dtype) -> None:
    """The float8 copy the forward kernel writes for ``fp8_input_store`` is bit for bit
    ``x.clamp(-448, 448).to(float8_e4m3fn)``: saturated, ties rounded to even, subnormals
    kept. (NaN: see the next test; Triton 3.9's interpreter stores a float32 NaN as fp8
    384, where the GPU's conversion keeps it NaN.)"""
    from lmfuse.activations.ops import _launch_fwd_x8

    x = (randn((37, 48), F32) * torch.logspace(-4, 3, 48)).to(dtype)
    # Saturation, ties between neighbours (3.375: 3.25 | 3.5; 0.06640625: two fp8
    # neighbours apart by 2**-7 in the subnormal-adjacent range), an exact value, -0.
    x[0, :6] = torch.tensor([500.0, -1e4, 3.375, 0.06640625, 448.0, -0.0]).to(dtype)
    x8 = torch.empty(x.shape, dtype=FP8)
    _launch_fwd_x8(x, None, None, "silu" if gated else "gelu", gated, 0.0, None, 1.0, 1.0, x8)
    want = x.clamp(-448.0, 448.0).to(FP8)
    assert torch.equal(x8.view(torch.uint8), want.view(torch.uint8)), (
        f"{dtype}: {(x8.float() - want.float()).abs().max()}")


@triton.jit
def _saturate_kernel(X, Y, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(Y + i, _saturate_e4m3(tl.load(X + i)))


def test_saturate_e4m3_keeps_nan() -> None:
    """The value the fp8 stores convert: saturated at +-448, e4m3-rounded, NaN kept (a
    clamp by min / max alone would turn NaN into -448)."""
    x = torch.tensor([math.nan, 500.0, -1e4, 3.375, 1.0, -math.inf, math.inf, 0.0])
    y = torch.empty_like(x)
    _saturate_kernel[(1,)](x, y, N=8)
    want = torch.tensor([math.nan, 448.0, -448.0, 3.5, 1.0, -448.0, 448.0, 0.0])
    assert torch.equal(y.isnan(), want.isnan()) and torch.equal(y.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", FP8_OPS)
def test_fp8_input_store_backward_sees_the_saturated_copy(op: Op, impl: str) -> None:
    """With ``fp8_input_store`` the backward works on x rounded to float8 and saturated at
    +-448 (torch's CUDA cast would make magnitudes above 464 NaN, and the gradients with
    them): its gradients equal, bit for bit, those of a run on that rounded x itself."""
    inp = make_inputs(op, (5,), 12, F16)
    inp.x[0, :3] = torch.tensor([1000.0, -600.0, 470.0])
    kwargs = dict(linear_offset=0.5, clamp_value=1.5) if op.clamp else {}
    _, grads8 = run(op, inp, impl, fp8_input_store=True, **kwargs)
    rounded = replace(inp, x=fp8_copy(inp.x, kwargs.get("clamp_value")))
    _, grads = run(op, rounded, impl, **kwargs)
    for name in grads:
        assert torch.equal(grads8[name], grads[name]), name


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", FP8_OPS[:1])
def test_fp8_copy_is_held_by_autograd_alone(op: Op, impl: str) -> None:
    """A saved-tensor hook that moves what autograd saves elsewhere frees the float8 copy:
    the op keeps no reference of its own (the gradients still come out right)."""
    inp = make_inputs(op, (4,), 6, BF16)
    refs = []

    def pack(t: torch.Tensor):
        if t.dtype == FP8:
            refs.append(weakref.ref(t))
            return ("moved", t.clone())
        return t

    def unpack(packed):
        return packed[1] if isinstance(packed, tuple) else packed

    lv = leaves(inp)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = call(op, lv["x"], lv.get("bias"), lv.get("weights"), impl=impl,
                   fp8_input_store=True)
    gc.collect()
    assert refs and all(r() is None for r in refs), "the float8 copy outlived its packing"
    grads = torch.autograd.grad(out, list(lv.values()), inp.grad_out)
    _, want = run(op, inp, impl, fp8_input_store=True)
    for name, g in zip(lv, grads):
        assert torch.equal(g, want[name]), name


@pytest.mark.parametrize("fp8", [False, True], ids=["plain", "fp8"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", FP8_OPS)
def test_cpu_offload_input_identical(op: Op, impl: str, fp8: bool) -> None:
    inp = make_inputs(op, (4,), 6, BF16)
    kwargs = dict(linear_offset=0.5, clamp_value=1.5) if op.clamp else {}
    out_off, grads_off = run(op, inp, impl, cpu_offload_input=True, fp8_input_store=fp8, **kwargs)
    out, grads = run(op, inp, impl, fp8_input_store=fp8, **kwargs)
    assert torch.equal(out_off, out)
    assert grads_off.keys() == grads.keys()
    for name in grads:
        assert torch.equal(grads_off[name], grads[name]), name


# --- requires_grad combinations, float64, auto ------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", ops_where(lambda op: op.has_bias or op.weighted))
def test_partial_requires_grad_and_no_grad(op: Op, impl: str) -> None:
    """Frozen x with a trainable bias / weights, trainable x with frozen ones, no_grad."""
    inp = make_inputs(op, (4,), 6, F32)
    ref_out, ref = reference(op, inp)
    names = ["x", "bias", "weights"]
    trainables = ["x"] + ["bias"] * op.has_bias + ["weights"] * op.weighted
    for trainable in trainables:
        args = {n: getattr(inp, n) for n in names}
        args = {n: (t.detach().clone().requires_grad_(n == trainable) if t is not None else None)
                for n, t in args.items()}
        out = call(op, args["x"], args["bias"], args["weights"], impl=impl)
        (g,) = torch.autograd.grad(out, [args[trainable]], inp.grad_out)
        assert_close(g, ref[trainable], F32, f"{op.name} only {trainable} trainable {impl}")
    with torch.no_grad():
        out = call(op, inp.x, inp.bias, inp.weights, impl=impl)
    assert not out.requires_grad
    assert_close(out, ref_out, F32, f"{op.name} no_grad {impl}")


@pytest.mark.parametrize("op", ALL_OPS)
def test_float64_on_torch_path(op: Op) -> None:
    """float64 runs on impl="torch" (to float64 accuracy); the Triton path refuses it."""
    inp = make_inputs(op, (3,), 4, F64)
    kwargs = dict(linear_offset=0.5, clamp_value=1.5) if op.clamp else {}
    check(f"{op.name} float64 torch", op, inp, "torch", **kwargs)
    with pytest.raises((TypeError, ValueError), match=r"float64"):
        call(op, inp.x, inp.bias, inp.weights, impl="triton")


@pytest.mark.parametrize("op", ALL_OPS)
def test_auto_is_triton_under_the_interpreter(op: Op) -> None:
    inp = make_inputs(op, (3,), 5, F32)
    auto = call(op, inp.x, inp.bias, inp.weights, impl="auto")
    triton = call(op, inp.x, inp.bias, inp.weights, impl="triton")
    assert torch.equal(auto, triton)
    assert call(op, inp.x, inp.bias, inp.weights).shape == auto.shape  # impl defaults to auto


# --- properties -------------------------------------------------------------------------------


@st.composite
def problems(draw: st.DrawFn) -> dict[str, Any]:
    op = draw(st.sampled_from(OPS))
    return dict(
        op=op, tokens=draw(st.integers(0, 24)), f=draw(st.integers(1, 200)),
        three_d=draw(st.booleans()), bias=draw(st.booleans()),
        dtype=draw(st.sampled_from([F32, BF16])),
        layout=draw(st.sampled_from(["contiguous", "transposed", "row-slice",
                                     "every-other-column"])),
        kwargs=dict(
            **(dict(linear_offset=draw(st.sampled_from([0.0, 0.75, -2.0])),
                    clamp_value=draw(st.sampled_from([None, 0.5, 2.0]))) if op.clamp else {}),
            **(dict(fp8_input_store=draw(st.booleans())) if op.fp8 else {})),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@given(problem=problems())
def test_property_triton_matches_reference(problem: dict[str, Any]) -> None:
    torch.manual_seed(problem["seed"])
    op, tokens, f, dtype = problem["op"], problem["tokens"], problem["f"], problem["dtype"]
    lead = (tokens // 3, 3) if problem["three_d"] else (tokens,)
    inp = make_inputs(op, lead, f, dtype, bias=problem["bias"])
    if problem["layout"] != "contiguous" and not problem["three_d"]:
        inp.x = strided_x(problem["layout"], tuple(inp.x.shape), dtype)
    check(f"{problem}", op, inp, "triton", **problem["kwargs"])


# --- explain, signatures --------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["triton", "torch", "auto"])
@pytest.mark.parametrize("op", ALL_OPS)
def test_explain(op: Op, impl: str) -> None:
    inp = make_inputs(op, (2, 3), 4, BF16)
    args = (inp.x, inp.weights) if op.weighted else (inp.x,)
    plan = lmfuse.explain(op.fn, *args, impl=impl)
    assert isinstance(plan, lmfuse.Plan)
    assert plan.impl == ("triton" if impl == "auto" else impl), str(plan)
    assert lmfuse.explain(op.name, *args, impl=impl).impl == plan.impl


SIGNATURES = {
    "bias_gelu": "(x, bias=None, *, impl='auto')",
    "swiglu": "(x, bias=None, *, fp8_input_store=False, cpu_offload_input=False, "
              "clamp_value=None, gate_multiplier=1.0, down_multiplier=1.0, impl='auto')",
    "geglu": "(x, bias=None, *, fp8_input_store=False, cpu_offload_input=False, impl='auto')",
    "quick_geglu": "(x, bias=None, *, linear_offset=0.0, clamp_value=None, "
                   "fp8_input_store=False, cpu_offload_input=False, impl='auto')",
    "weighted_swiglu": "(x, weights, bias=None, *, fp8_input_store=False, "
                       "cpu_offload_input=False, clamp_value=None, gate_multiplier=1.0, "
                       "down_multiplier=1.0, impl='auto')",
    "weighted_quick_geglu": "(x, weights, bias=None, *, linear_offset=0.0, clamp_value=None, "
                            "fp8_input_store=False, cpu_offload_input=False, impl='auto')",
    "squared_relu": "(x, *, impl='auto')",
    "weighted_squared_relu": "(x, weights, *, impl='auto')",
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signature_and_exports(name: str) -> None:
    import lmfuse.activations

    fn = getattr(lmfuse, name)
    assert getattr(lmfuse.activations, name) is fn
    assert name in lmfuse.__all__
    sig = inspect.signature(fn).replace(return_annotation=inspect.Signature.empty)
    plain = sig.replace(parameters=[p.replace(annotation=inspect.Parameter.empty)
                                    for p in sig.parameters.values()])
    assert str(plain) == SIGNATURES[name]
    assert fn.__doc__, f"{name} has no docstring"


# --- bad input ------------------------------------------------------------------------------


def _bad(op_filter: Callable[[Op], bool], id: str, change: Callable[[Op], dict[str, Any]],
         error: Any, message: str) -> list[Any]:
    return [pytest.param(op, change, error, message, id=f"{op.name}-{id}")
            for op in OPS if op_filter(op)]


T, F = 4, 3  # the good inputs: x [4, K], weights [4, 1]
BAD_INPUTS = [
    *_bad(lambda op: op.gated, "odd-K", lambda op: dict(x=randn((T, 7))), ValueError,
          r"\bx\b \beven\b"),
    *_bad(lambda op: op.has_bias, "bias-length",
          lambda op: dict(bias=randn((op.width(F) + 2,))), ValueError, r"\bbias\b"),
    *_bad(lambda op: op.has_bias, "bias-2d", lambda op: dict(bias=randn((1, op.width(F)))),
          ValueError, r"\bbias\b"),
    *_bad(lambda op: op.has_bias, "bias-dtype",
          lambda op: dict(bias=randn((op.width(F),), F16)), (TypeError, ValueError), r"\bbias\b"),
    *_bad(lambda op: op.weighted, "weights-1d", lambda op: dict(weights=randn((T,))),
          ValueError, r"\bweights\b"),
    *_bad(lambda op: op.weighted, "weights-tokens", lambda op: dict(weights=randn((T + 1, 1))),
          ValueError, r"\bweights\b"),
    *_bad(lambda op: op.weighted, "weights-2cols", lambda op: dict(weights=randn((T, 2))),
          ValueError, r"\bweights\b"),
    *_bad(lambda op: op.weighted, "weights-none", lambda op: dict(weights=None), TypeError,
          r"\bweights\b None"),
    *_bad(lambda op: op.weighted, "weights-int",
          lambda op: dict(weights=torch.ones(T, 1, dtype=torch.int64)), (TypeError, ValueError),
          r"\bweights\b"),
    *_bad(lambda op: True, "x-int",
          lambda op: dict(x=torch.ones(T, op.width(F), dtype=torch.int32)), TypeError, r"\bx\b"),
    *_bad(lambda op: True, "x-list", lambda op: dict(x=[[1.0, 2.0]]), TypeError, r"\bx\b"),
    *_bad(lambda op: op.clamp, "clamp-0", lambda op: dict(clamp_value=0.0), ValueError,
          r"\bclamp_value\b"),
    *_bad(lambda op: op.clamp, "clamp-neg", lambda op: dict(clamp_value=-1.0), ValueError,
          r"\bclamp_value\b"),
    *_bad(lambda op: True, "impl", lambda op: dict(impl="cuda"), ValueError, r"\bimpl\b"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op, change, error, message", BAD_INPUTS)
def test_bad_input_raises(op: Op, change, error, message: str, impl: str) -> None:
    args: dict[str, Any] = dict(x=randn((T, op.width(F))), impl=impl)
    if op.has_bias:
        args["bias"] = randn((op.width(F),))
    if op.weighted:
        args["weights"] = randn((T, 1))
    args.update(change(op))
    x, weights = args.pop("x"), args.pop("weights", None)
    pos = (x, weights) if op.weighted else (x,)
    pattern = rf"(?s)^{op.name}: " + "".join(f"(?=.*{word})" for word in message.split())
    with pytest.raises(error, match=pattern):
        op.fn(*pos, **args)
    with pytest.raises(error, match=pattern):
        lmfuse.explain(op.fn, *pos, **args)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_saved_input_goes_through_autograd(impl: str) -> None:
    """The input kept for backward is saved with save_for_backward: an in-place change after
    the forward raises (instead of a silently wrong gradient), saved-tensor hooks (offload,
    checkpointing) see it, and a double backward of an input stored in fp8 is refused."""
    x = torch.randn(4, 8, requires_grad=True)
    h = x * 1.0
    y = lmfuse.swiglu(h, impl=impl)
    h.mul_(0.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (seen.append(t.dtype), t)[1],
                                                  lambda t: t):
        y = lmfuse.swiglu(torch.randn(4, 8, requires_grad=True), impl=impl,
                          fp8_input_store=True)
    assert torch.float8_e4m3fn in seen
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="swiglu: second derivatives .*fp8_input_store"):
        torch.autograd.grad(lmfuse.swiglu(x, impl=impl, fp8_input_store=True).pow(2).sum(),
                            x, create_graph=True)


def test_explain_refuses_what_the_op_refuses() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(TypeError, match="bias_gelu: .*clamp_value"):
        lmfuse.explain(lmfuse.bias_gelu, x, clamp_value=1.0)
    with pytest.raises(TypeError, match="squared_relu: too many positional"):
        lmfuse.explain(lmfuse.squared_relu, x, torch.randn(8))
    plan = lmfuse.explain(lmfuse.weighted_quick_geglu, x, torch.rand(4, 1), None,
                          clamp_value=2.0)
    assert "clamp" in plan.details and "weights" in plan.details


def test_backward_row_groups_loop_over_several_tiles(monkeypatch) -> None:
    """Small tiles and few programs: each backward program walks several row tiles of its
    group (bias sums carried across them) and several groups' partials are summed."""
    from lmfuse import tuning
    from lmfuse.activations import ops as act_ops

    small = dict(tuning.table("activations", torch.device("cpu")), bwd_tile=32,
                 bwd_max_block_n=16, bwd_programs_per_sm=1)
    real = tuning.table
    monkeypatch.setattr(tuning, "table", lambda family, device: small
                        if family == "activations" else real(family, device))
    launches = []  # each backward launch's grid: (column blocks, row groups)
    kernels = act_ops._kernels()

    class Recorded:  # the kernels module, its backward kernel's launches recorded
        def __getattr__(self, name):
            kernel = getattr(kernels, name)
            if name != "act_bwd_kernel":
                return kernel

            class Launch:
                def __getitem__(self, grid):
                    launches.append(grid)
                    return kernel[grid]

            return Launch()

    monkeypatch.setattr(act_ops, "_kernels", Recorded)
    M, f = 19, 20  # tiles of 2 rows x 16 columns: 10 row tiles, 2 column blocks
    x = torch.randn(M, 2 * f, dtype=torch.float64)
    b = torch.randn(2 * f, dtype=torch.float64)
    w = torch.rand(M, 1, dtype=torch.float64)
    g = torch.randn(M, f, dtype=torch.float64)
    leaves = [t.float().requires_grad_(True) for t in (x, w, b)]
    got = torch.autograd.grad(lmfuse.weighted_swiglu(*leaves, impl="triton"), leaves, g.float())
    ref_leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    want = torch.autograd.grad(activation_reference(ref_leaves[0], ref_leaves[2], ref_leaves[1],
                                                    activation="silu", gated=True),
                               ref_leaves, g)
    # 4 programs over 2 column blocks: 2 row groups of 10 rows, 5 tiles each
    assert launches == [(2, 2)]
    for a, r in zip(got, want):
        torch.testing.assert_close(a.double(), r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_default_cpu_swiglu_is_pytorchs_ops_with_the_reference_results(monkeypatch,
                                                                       bias: bool) -> None:
    """On CPU float32 tensors without Triton (what a CPU machine without the interpreter
    picks) swiglu runs ``F.silu(x1 + b1) * (x2 + b2)`` (the plain formula's speed): the
    reference's output and gradients, NaN and inf as F.silu's."""
    from lmfuse._dispatch import select_impl
    from lmfuse.activations import ops as act_ops

    calls = []
    real_silu = act_ops.F.silu
    monkeypatch.setattr(act_ops, "select_impl", lambda op, impl, device: (
        ("torch", "test: no Triton") if impl == "auto" else select_impl(op, impl, device)))
    monkeypatch.setattr(act_ops.F, "silu", lambda t: (calls.append(1), real_silu(t))[1])
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 16, generator=g) * 4)
    x[0, 0, 1], x[0, 1, 2], x[1, 2, 9] = float("nan"), float("-inf"), float("inf")
    b = torch.randn(16, generator=g) if bias else None
    dy = torch.randn(3, 5, 8, generator=g)
    out = {}
    for impl in ("auto", "torch"):
        xi = x.clone().requires_grad_(True)
        bi = b.clone().requires_grad_(True) if bias else None
        calls.clear()
        y = lmfuse.swiglu(xi, bi, impl=impl)
        assert bool(calls) == (impl == "auto")
        grads = torch.autograd.grad(y, [xi] + ([bi] if bias else []), dy)
        out[impl] = (y, *grads)
    for got, want in zip(out["auto"], out["torch"]):
        assert torch.equal(got.isnan(), want.isnan())
        fin = ~want.isnan()
        assert torch.allclose(got[fin], want[fin], rtol=1e-5, atol=1e-6)


_NATIVE_CASES = [
    ("bias_gelu", dict(bias=True)), ("swiglu", dict(bias=True)),
    ("swiglu", dict(clamp_value=0.7, gate_multiplier=1.5, down_multiplier=0.5)),
    ("geglu", dict(bias=True)), ("quick_geglu", dict(bias=True, linear_offset=1.0,
                                                     clamp_value=0.7)),
    ("quick_geglu", dict(linear_offset=1.0)), ("weighted_quick_geglu", {}),
    ("squared_relu", {}), ("weighted_swiglu", dict(bias=True)),
    ("weighted_quick_geglu", dict(linear_offset=1.0, clamp_value=7.0)),
    ("weighted_squared_relu", {}),
]


@pytest.mark.parametrize("poison", [None, "nan", "inf", "-inf"])
@pytest.mark.parametrize("op, options", _NATIVE_CASES)
def test_default_cpu_path_is_pytorchs_ops_with_the_reference_results(
        monkeypatch: pytest.MonkeyPatch, op: str, options: dict, poison) -> None:
    """On CPU float32 without Triton (what a CPU machine without the interpreter picks)
    every activation runs PyTorch's own ops with autograd (no reference call); outputs and
    the gradients of x, bias and weights equal the reference's, NaN and inf included."""
    import lmfuse.activations.ops as act_ops
    import lmfuse.activations.reference as act_ref
    from lmfuse._dispatch import select_impl

    monkeypatch.setattr(act_ops, "select_impl", lambda o, impl, device: (
        ("torch", "test: no Triton") if impl == "auto" else select_impl(o, impl, device)))
    calls = []
    real = act_ref.activation_reference
    monkeypatch.setattr(act_ref, "activation_reference",
                        lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, 24, generator=g) * 2
    if poison is not None:
        x[1, 2, 7] = float(poison)  # in the activated half of the gated ops
        x[0, 4, 20] = float(poison)  # in the linear half
    options = dict(options)
    bias = torch.randn(24, generator=g) if options.pop("bias", False) else None
    weights = torch.rand(15, 1, generator=g) if op.startswith("weighted") else None
    fn = getattr(lmfuse, op)
    out = {}
    for impl in ("auto", "torch"):
        leaves = [x.clone().requires_grad_(True)]
        args = [leaves[0]]
        if weights is not None:
            leaves.append(weights.clone().requires_grad_(True))
            args.append(leaves[-1])
        kw = dict(options, impl=impl)
        if bias is not None:
            leaves.append(bias.clone().requires_grad_(True))
            kw["bias"] = leaves[-1]
        calls.clear()
        y = fn(*args, **kw)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(4))
        out[impl] = (y, *torch.autograd.grad(y, leaves, dy))
        assert bool(calls) == (impl == "torch"), impl  # auto: no reference call
    for got, want in zip(out["auto"], out["torch"], strict=True):
        assert torch.equal(got.isnan(), want.isnan()), (op, poison)
        fin = ~want.isnan()
        assert torch.equal(got[fin].isinf(), want[fin].isinf())
        fin = fin & ~want.isinf()
        assert torch.allclose(got[fin], want[fin], rtol=1e-5, atol=1e-5), (op, poison)


@pytest.mark.parametrize("impl", ["native", "torch", "triton"])
def test_quick_gelu_past_the_overflow_of_its_scaled_input(monkeypatch: pytest.MonkeyPatch,
                                                          impl: str) -> None:
    """|gate| > 2e38 in float32 (1.702 gate overflows): the plain formula's finite values,
    a gate gradient of 1 and 0 (not inf * 0 = NaN), on every path ("native": the default
    CPU path without Triton)."""
    import lmfuse.activations.ops as act_ops
    from lmfuse._dispatch import select_impl

    if impl == "native":
        monkeypatch.setattr(act_ops, "select_impl", lambda o, i, device: (
            ("torch", "test: no Triton") if i == "auto" else select_impl(o, i, device)))
    x = torch.tensor([[3e38, -3e38, 1.0, 1.0]], requires_grad=True)
    y = lmfuse.quick_geglu(x, impl="auto" if impl == "native" else impl)
    y.sum().backward()
    assert torch.equal(y.detach(), torch.tensor([[3e38, 0.0]]))
    assert x.grad[0, :2].tolist() == [1.0, 0.0] and x.grad[0, 2] == torch.tensor(3e38)


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("op, c", [("swiglu", 7.0), ("quick_geglu", 7.0), ("swiglu", 1.7)])
def test_fp8_input_store_keeps_each_value_on_its_side_of_the_clamp(impl, op, c) -> None:
    """The backward reads the clamp's gradient mask from the float8 copy: rounding alone
    carried 7.2 to 7.0 at c = 7 (a clamped element's gradient let through, as Megatron-Core
    does not) and 1.69 to 1.75 past c = 1.7 (a free one's gradient zeroed). The copy now
    keeps every value on its side, so the mask is the float32 input's."""
    near = [c + 0.2, -(c + 0.2), c - 0.01, -(c - 0.01), c + 0.01, 0.5, -0.5, c]
    x = torch.tensor([near + near[::-1]], dtype=torch.float32)  # gate half, linear half
    fn = getattr(lmfuse, op)
    grads = {}
    for fp8 in (False, True):
        leaf = x.clone().requires_grad_(True)
        fn(leaf, clamp_value=c, fp8_input_store=fp8, impl=impl).sum().backward()
        grads[fp8] = leaf.grad
    assert torch.equal(grads[True] == 0, grads[False] == 0), (grads[True], grads[False])
    assert (grads[False] == 0).sum() >= 4  # the clamped elements: a zero gradient each


def test_fp8_copy_keeping_the_clamp_sides() -> None:
    from lmfuse.activations.ops import _e4m3_around, _e4m3_keeping_clamp

    assert _e4m3_around(7.0) == (7.0, 7.5) and _e4m3_around(1.7) == (1.625, 1.75)
    assert _e4m3_around(500.0)[1] is None  # nothing above 448: x kept as it is
    x = torch.tensor([[7.2, 1.0, -7.2, 7.0]])
    assert torch.equal(_e4m3_keeping_clamp(x, 7.0).float(), torch.tensor([[7.5, 1.0, -7.5, 7.0]]))
    assert _e4m3_keeping_clamp(x, 500.0) is x


@pytest.mark.parametrize("op, name", [("quick_geglu", "linear_offset"),
                                      ("swiglu", "gate_multiplier"),
                                      ("swiglu", "down_multiplier"), ("swiglu", "clamp_value")])
def test_scalars_beyond_float32_are_refused(op, name) -> None:
    # (float32 arguments of the kernels: 1e39 would be inf there)
    with pytest.raises(ValueError, match=rf"^{op}: {name} must be within float32's range"):
        getattr(lmfuse, op)(torch.randn(2, 8), **{name: 1e39})


def test_backward_stages_of_the_non_gated_activations(monkeypatch) -> None:
    """The table's ``plain_bwd_stages`` pipelines the backward's row loop of the non-gated
    activations only (the gated ones keep Triton's default: None), with the same
    gradients (the interpreter runs the loop as written)."""
    from lmfuse import tuning
    from lmfuse.activations import ops as act_ops

    kernels = act_ops._kernels()
    real = kernels.act_bwd_kernel
    stages: list = []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                stages.append((kw["GATED"], kw["STAGES"]))
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(kernels, "act_bwd_kernel", Spy())
    x = randn((7, 12), requires_grad=True)
    g = randn((7, 12))
    with tuning.overlay("activations", {"plain_bwd_stages": 3}):
        for fn, gated in ((lmfuse.bias_gelu, False), (lmfuse.squared_relu, False),
                          (lmfuse.swiglu, True)):
            y = fn(x, impl="triton")
            got, = torch.autograd.grad(y, x, g[:, :y.shape[1]])
            want, = torch.autograd.grad(fn(x, impl="torch"), x, g[:, :y.shape[1]])
            assert_close(got, want, torch.float32, fn.__name__)
            assert stages[-1] == (gated, None if gated else 3)


def _spy_kernel(monkeypatch, name: str) -> list:
    """Record each launch of the activations' kernel ``name``: (grid, its keyword args)."""
    from lmfuse.activations import ops as act_ops

    kernels = act_ops._kernels()
    real = getattr(kernels, name)
    launches: list = []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append((grid, kw))
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(kernels, name, Spy())
    return launches


@pytest.mark.parametrize("op,gated,weighted", [
    ("squared_relu", False, False), ("weighted_squared_relu", False, True),
    ("weighted_swiglu", True, True), ("bias_gelu", False, False), ("swiglu", True, False)])
@pytest.mark.parametrize("bias_grad", [False, True])
def test_backward_flat_tiles_without_a_bias_gradient(monkeypatch, op, gated, weighted,
                                                     bias_grad) -> None:
    """With the table's ``bwd_flat``, a backward with no bias gradient to sum launches one
    program a tile (2 x 8 here: 10 row tiles of 19 rows, 3 column blocks of 20 columns) in
    the forward's order, with the reference's gradients (x's, the weights'); one with a bias
    gradient keeps the grouped launch (1 program an SM: one row group). The flat grid is
    one-dimensional: a grid's second axis holds 65535 at most, and a row tile a program
    passes that at 65536 tokens."""
    from lmfuse import tuning

    launches = _spy_kernel(monkeypatch, "act_bwd_kernel")
    M, N = 19, 20
    takes_bias = op in ("bias_gelu", "swiglu")
    x = randn((M, 2 * N if gated else N))
    w = torch.rand(M, 1)
    b = randn((x.shape[1],))
    g = randn((M, N))

    def call(impl, x, w, b):
        args = (x, w) if weighted else (x,)
        kw = {"bias": b} if takes_bias else {}
        return getattr(lmfuse, op)(*args, impl=impl, **kw)

    def grads(impl):
        leaves = [x.clone().requires_grad_(True), w.clone().requires_grad_(weighted),
                  b.clone().requires_grad_(bias_grad and takes_bias)]
        wanted = [t for t in leaves if t.requires_grad]
        return torch.autograd.grad(call(impl, *leaves), wanted, g)

    with tuning.overlay("activations", {"bwd_flat": {"tile": 16, "max_block_n": 8,
                                                     "warps": 1},
                                        "bwd_programs_per_sm": 1}):
        got = grads("triton")
    want = grads("torch")
    (grid, kw), = launches
    if bias_grad and takes_bias:
        assert not kw["FLAT"] and kw["BLOCK_M"] * kw["BLOCK_N"] == tuning.table(
            "activations", x.device)["bwd_tile"] and grid[1] == 1
    else:
        assert grid == (30,) and kw["FLAT"]
        assert (kw["BLOCK_M"], kw["BLOCK_N"], kw["STAGES"]) == (2, 8, None)
    assert len(got) == len(want)
    for a, r in zip(got, want):
        assert_close(a, r, torch.float32, op)


def test_flat_backward_grid_holds_any_number_of_row_tiles(monkeypatch) -> None:
    """70000 row tiles of one program each: the flat launch's grid is one axis of 70000
    (a grid's second axis holds 65535 at most); the grouped launch's row groups stay a few."""
    from lmfuse import tuning
    from lmfuse.activations import ops as act_ops

    grids = []

    class NoLaunch:  # records the grid; runs nothing (70000 programs in the interpreter)
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *args, **kwargs: None

    monkeypatch.setattr(act_ops._kernels(), "act_bwd_kernel", NoLaunch())
    x, g = torch.zeros(70000, 2), torch.zeros(70000, 2)
    with tuning.overlay("activations", {"bwd_flat": {"tile": 2, "max_block_n": 2,
                                                     "warps": 1}}):
        for bias_grad in (False, True):
            act_ops._launch_bwd(x, g, torch.zeros(2) if bias_grad else None, None,
                                "squared_relu", False, 0.0, None, 1.0, 1.0, torch.float32,
                                bias_grad)
    assert grids[0] == (70000,)
    assert len(grids[1]) == 2 and grids[1][1] <= 65535


@pytest.mark.parametrize("op,options,scalars", [
    ("quick_geglu", {}, False), ("quick_geglu", {"linear_offset": 1.0}, True),
    ("swiglu", {"gate_multiplier": 0.5}, True), ("swiglu", {"down_multiplier": 2.0}, True),
    ("quick_geglu", {"linear_offset": -0.0}, False), ("swiglu", {}, False)])
def test_kernels_skip_the_identity_offset_and_multipliers(monkeypatch, op, options,
                                                          scalars) -> None:
    """The kernels' ``SCALARS`` flag: off at offset 0 and multipliers 1 (three instructions
    an element fewer), on otherwise; the reference's values and gradients either way."""
    fwd = _spy_kernel(monkeypatch, "act_fwd_kernel")
    bwd = _spy_kernel(monkeypatch, "act_bwd_kernel")
    x = randn((5, 24))
    g = randn((5, 12))
    outs = []
    for impl in ("triton", "torch"):
        xi = x.clone().requires_grad_(True)
        y = getattr(lmfuse, op)(xi, impl=impl, **options)
        outs.append((y, *torch.autograd.grad(y, xi, g)))
    assert fwd[0][1]["SCALARS"] is scalars and bwd[0][1]["SCALARS"] is scalars
    for a, r in zip(*outs):
        assert_close(a, r, torch.float32, str(options))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # -inf * 0
@pytest.mark.parametrize("gated", [False, True], ids=["bias_gelu", "geglu"])
def test_tanh_gelu_forward_accurate_where_one_plus_tanh_cancels(gated: bool) -> None:
    """The Triton forward's tanh-GELU is ``a sigmoid(2u)`` = ``a / (1 + 2^z)``: relative
    accuracy of a few float32 ulps down to a = -5.16, where ``0.5 a (1 + tanh(u))`` cancels
    (the tanh form was off by 3.8e-5 at a = -3 and by tens of percent below -4); below
    about -5.16, where float32's tanh(u) is -1, exactly PyTorch's -0 (so an inf up half
    gives NaN, as there); NaN at -inf, inf and NaN through."""
    a = torch.cat([torch.linspace(-12.0, 12.0, 961), torch.tensor(
        [-1e4, -30.0, 30.0, 1e4, float("inf"), float("-inf"), float("nan")])])
    ad = a.double()
    # a sigmoid(2u) in float64: its own tanh form cancels too, past a = -4
    exact = ad * torch.sigmoid(2 * 0.7978845608028654 * (ad + 0.044715 * ad ** 3))
    if gated:  # the up half at 1: the product is the activation itself
        y = lmfuse.geglu(torch.cat([a, torch.ones_like(a)]).view(1, -1), impl="triton")
    else:
        y = lmfuse.bias_gelu(a.view(1, -1), torch.zeros_like(a), impl="triton")
    y = y.view(-1).double()
    torch_formula = 0.5 * a * (1.0 + torch.tanh(0.79788456 * a * (1.0 + 0.044715 * a * a)))
    far = torch.isfinite(a) & (torch_formula == 0) & (a < 0)  # float32's tanh(u) is -1
    near = torch.isfinite(a) & ~far & (exact != 0)
    rel = ((y - exact).abs() / exact.abs())[near]
    assert rel.max().item() < 2e-6, rel.max().item()
    assert torch.equal(y[far], torch_formula[far].double())  # -0 as in float32's formula
    assert torch.signbit(y[far]).all() and (y[far] == 0).all()
    torch.testing.assert_close(y[-3:], exact[-3:], equal_nan=True, rtol=0, atol=0)


def test_tanh_gelu_inf_up_half_gives_nan_where_pytorchs_formula_does() -> None:
    """geglu with an inf up half: NaN where float32's ``1 + tanh(u)`` is exactly 0
    (gates past about -5.16), as ``impl="torch"`` and ``F.gelu(approximate="tanh")``
    give; +-inf where the activation is not 0; the gradients alike."""
    gate = torch.tensor([-10.0, -8.0, -6.0, -5.3, -4.0, -1.0, 2.0])
    up = torch.full_like(gate, float("inf"))
    x = torch.cat([gate, up]).view(1, -1)
    want = lmfuse.geglu(x, impl="torch")
    got = lmfuse.geglu(x, impl="triton")
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    assert torch.isnan(got[0, :4]).all() and torch.isinf(got[0, 4:]).all()
    plain = torch.nn.functional.gelu(gate, approximate="tanh") * up
    assert torch.equal(torch.isnan(got[0]), torch.isnan(plain))
    xg = x.clone().requires_grad_(True)
    xt = x.clone().requires_grad_(True)
    (gg,) = torch.autograd.grad(lmfuse.geglu(xg, impl="triton"), xg, torch.ones(1, 7))
    (gt,) = torch.autograd.grad(lmfuse.geglu(xt, impl="torch"), xt, torch.ones(1, 7))
    assert torch.equal(torch.isnan(gg), torch.isnan(gt)), (gg, gt)
    assert torch.equal(torch.isinf(gg), torch.isinf(gt)), (gg, gt)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf * 0
def test_tanh_gelu_gradient_accurate_and_nan_as_megatrons_formula() -> None:
    """The Triton backward's tanh-GELU derivative, ``s + a s (1 - s) 2u'`` with ``s =
    sigmoid(2u)`` and ``1 - s`` formed without cancellation: a few float32 ulps against
    float64 over [-5.2, 12] (the tanh form's ``1 - tanh^2`` was off by 5e-7, 2e-4 relative
    at |d| > 1e-3), exactly 0 below (as the formula in float32, where tanh(u) is -1), and
    NaN exactly where Megatron's formula gives NaN
    (+-inf, and |a| past 1.8e19, where a^2 overflows)."""
    a = torch.cat([torch.linspace(-12.0, 12.0, 961), torch.tensor(
        [-1e20, -1e4, 1e4, 1e20, float("inf"), float("-inf"), float("nan")])])
    x = a.view(1, -1).clone().requires_grad_(True)
    y = lmfuse.bias_gelu(x, torch.zeros_like(a), impl="triton")
    (d,) = torch.autograd.grad(y, x, torch.ones_like(y))
    d = d.view(-1).double()
    ad = a.double().requires_grad_(True)
    (exact,) = torch.autograd.grad(
        (ad * torch.sigmoid(2 * 0.7978845608028654 * (ad + 0.044715 * ad ** 3))).sum(), ad)
    dc, ec, ac = d[:961], exact[:961], a[:961]
    # where float32's tanh(u) is -1 (a below about -5.16) the formula's derivative is 0
    far = torch.tanh(0.79788456 * ac * (1.0 + 0.044715 * ac * ac)) == -1.0
    assert (dc[far] == 0).all()
    dc, ec = dc[~far], ec[~far]
    err = (dc - ec).abs()
    # (near its zero, at a = -0.75, the two terms cancel: relative error past |d| > 0.05)
    rel = (err / ec.abs())[ec.abs() > 0.05]
    assert rel.max().item() < 1e-6, rel.max().item()  # Megatron's formula in float32: 2.1e-6
    assert err.max().item() < 3e-7, err.max().item()  # and 5.1e-7
    from lmfuse.activations.reference import activation_grad

    megatron = activation_grad("gelu", a, torch.ones_like(a))
    assert torch.equal(torch.isnan(d[961:]), torch.isnan(megatron[961:].double()))
    assert torch.isnan(d[961:]).tolist() == [True, False, False, True, True, True, True]
