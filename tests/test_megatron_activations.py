"""``lmfuse.megatron``'s activation drop-ins against Megatron-Core's formulas, written out.

Each function is called with Megatron-Core's positional argument order and compared, output
and gradients, with Megatron's fused functions written out here in float64: the forward
formulas with its constants, its hand-written backward formulas, the input saved for
backward rounded to ``float8_e4m3fn`` under ``fp8_input_store`` (before the bias is added),
and the clamp applied to the input outside the fused function (so the clamp's gradient
mask comes from the unrounded input). The drop-ins run the Triton kernels (``impl="auto"``,
the interpreter here).
"""

from __future__ import annotations

import inspect
import math
from typing import Callable

import pytest
import torch
from helpers import assert_close, megatron_act, megatron_act_grad, randn

from lmfuse import megatron

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
FP8 = torch.float8_e4m3fn
DTYPES = [pytest.param(F32, id="float32"), pytest.param(BF16, id="bfloat16")]
SHAPES = [pytest.param((6,), id="2d"), pytest.param((3, 2), id="3d")]  # leading dims


def megatron_formulas(activation: str, gated: bool, x, bias, weights, g, *, fp8: bool = False,
                      linear_offset: float = 0.0, clamp_value: float | None = None):
    """Megatron's output and (x, bias, weights) gradients, float64, for x [..., K]."""
    K = x.shape[-1]
    x2 = x.detach().reshape(-1, K)
    mask = torch.ones(x2.shape, dtype=F64)
    if clamp_value is not None:  # outside the fused function, on the input as given
        c = clamp_value
        f = K // 2
        mask = torch.cat([x2[:, :f] <= c, (x2[:, f:] >= -c) & (x2[:, f:] <= c)], -1).to(F64)
        x2 = torch.cat([x2[:, :f].clamp(max=c), x2[:, f:].clamp(min=-c, max=c)], -1)
    saved = x2.to(FP8).to(x.dtype) if fp8 else x2  # what the backward sees
    b = torch.zeros(K, dtype=F64) if bias is None else bias.detach().to(F64)
    w = torch.ones(x2.shape[0], 1, dtype=F64) if weights is None else weights.detach().to(F64)
    gw = g.reshape(x2.shape[0], -1).to(F64)

    def forward(v: torch.Tensor) -> torch.Tensor:  # megatron_act(v), unweighted
        if not gated:
            return megatron_act(activation, v)
        f = K // 2
        return megatron_act(activation, v[:, :f]) * (v[:, f:] + linear_offset)

    out = forward(x2.to(F64) + b) * w
    v = saved.to(F64) + b
    if gated:
        f = K // 2
        v1, v2 = v[:, :f], v[:, f:] + linear_offset
        dv = torch.cat([gw * w * megatron_act_grad(activation, v1) * v2,
                        gw * w * megatron_act(activation, v1)], -1)
    else:
        dv = gw * w * megatron_act_grad(activation, v)
    dw = (forward(v) * gw).sum(dim=-1, keepdim=True)
    out_shape = x.shape[:-1] + (out.shape[-1],)
    return out.reshape(out_shape), (dv * mask).reshape(x.shape), dv.sum(dim=0), dw


def check(what: str, fn: Callable, activation: str, gated: bool, lead: tuple[int, ...], f: int,
          dtype: torch.dtype, *, bias: bool, weighted: bool, fp8: bool = False,
          linear_offset: float = 0.0, clamp_value: float | None = None) -> None:
    """``fn(x, b, w)`` forward and backward against the formulas."""
    K = 2 * f if gated else f
    tokens = math.prod(lead)
    x = randn(lead + (K,), dtype, scale=2.0)
    if clamp_value is not None and fp8:
        # Keep x out of (c, c + 1/16]: fp8 rounds those to c, where the clamp's mask taken
        # before the rounding (Megatron) and after it would differ.
        a = x.abs().to(F32)
        x = torch.where((a > clamp_value) & (a < clamp_value + 0.1), x * 1.2, x)
    x.requires_grad_(True)
    b = randn((K,), dtype, requires_grad=True) if bias else None
    w = randn((tokens, 1), F32, requires_grad=True) if weighted else None
    y = fn(x, b, w)
    g = randn(lead + (f,), dtype)
    names = [n for n, t in zip(("x", "bias", "weights"), (x, b, w)) if t is not None]
    grads = dict(zip(names, torch.autograd.grad(y, [t for t in (x, b, w) if t is not None], g)))
    e_out, e_dx, e_db, e_dw = megatron_formulas(activation, gated, x, b, w, g, fp8=fp8,
                                                linear_offset=linear_offset,
                                                clamp_value=clamp_value)
    assert y.dtype == dtype and y.shape == lead + (f,), f"{what}: {y.dtype} {tuple(y.shape)}"
    assert_close(y, e_out, dtype, f"{what}: forward")
    assert grads["x"].dtype == dtype
    assert_close(grads["x"], e_dx, dtype, f"{what}: d input")
    if b is not None:
        assert grads["bias"].dtype == dtype
        assert_close(grads["bias"], e_db, dtype, f"{what}: d bias")
    if w is not None:
        assert grads["weights"].dtype == F32 and grads["weights"].shape == (tokens, 1)
        assert_close(grads["weights"], e_dw, F32, f"{what}: d weights")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("lead", SHAPES)
def test_bias_gelu_impl(lead, bias: bool, dtype: torch.dtype) -> None:
    check("bias_gelu_impl", lambda x, b, w: megatron.bias_gelu_impl(x, b), "gelu", False, lead,
          9, dtype, bias=bias, weighted=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8", [False, True], ids=["", "fp8"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("lead", SHAPES)
def test_bias_swiglu_impl(lead, bias: bool, fp8: bool, dtype: torch.dtype) -> None:
    check("bias_swiglu_impl", lambda x, b, w: megatron.bias_swiglu_impl(x, b, fp8, False),
          "silu", True, lead, 7, dtype, bias=bias, weighted=False, fp8=fp8)


@pytest.mark.parametrize("lead", SHAPES)
def test_bias_swiglu_impl_cpu_offload(lead) -> None:
    check("bias_swiglu_impl offload",
          lambda x, b, w: megatron.bias_swiglu_impl(x, b, True, True), "silu", True, lead, 5,
          BF16, bias=True, weighted=False, fp8=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("lead", SHAPES)
def test_bias_geglu_impl(lead, bias: bool, dtype: torch.dtype) -> None:
    check("bias_geglu_impl", lambda x, b, w: megatron.bias_geglu_impl(x, b), "gelu", True, lead,
          10, dtype, bias=bias, weighted=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8", [False, True], ids=["", "fp8"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("lead", SHAPES)
def test_weighted_bias_swiglu_impl(lead, bias: bool, fp8: bool, dtype: torch.dtype) -> None:
    check("weighted_bias_swiglu_impl",
          lambda x, b, w: megatron.weighted_bias_swiglu_impl(x, b, w, fp8), "silu", True, lead,
          6, dtype, bias=bias, weighted=True, fp8=fp8)


QUICK_GEGLU_OPTIONS = [
    pytest.param(False, False, 0.0, None, id="plain"),
    pytest.param(True, False, 1.0, None, id="bias-offset1"),
    pytest.param(False, False, 0.0, 1.5, id="clamp1.5"),
    pytest.param(True, False, -0.5, 1.5, id="bias-offset-0.5-clamp1.5"),
    pytest.param(False, True, 1.0, None, id="fp8-offset1"),
    pytest.param(True, True, 0.5, 1.5, id="bias-fp8-offset0.5-clamp1.5"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias, fp8, linear_offset, clamp_value", QUICK_GEGLU_OPTIONS)
@pytest.mark.parametrize("lead", SHAPES)
def test_weighted_bias_quick_geglu_impl(lead, bias: bool, fp8: bool, linear_offset: float,
                                        clamp_value: float | None, dtype: torch.dtype) -> None:
    def fn(x, b, w):
        return megatron.weighted_bias_quick_geglu_impl(x, b, w, fp8, linear_offset, clamp_value)

    check("weighted_bias_quick_geglu_impl", fn, "quick_gelu", True, lead, 8, dtype, bias=bias,
          weighted=True, fp8=fp8, linear_offset=linear_offset, clamp_value=clamp_value)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead", SHAPES)
def test_weighted_squared_relu_impl(lead, dtype: torch.dtype) -> None:
    check("weighted_squared_relu_impl",
          lambda x, b, w: megatron.weighted_squared_relu_impl(x, w), "squared_relu", False, lead,
          11, dtype, bias=False, weighted=True)


def test_clamp_edges_follow_torch_clamp() -> None:
    """Values exactly at +-c pass the gradient; strictly outside, d input is exactly 0."""
    c = 1.5
    x1 = torch.tensor([c, c + 0.5, -c, -c - 0.5, 0.25])
    x2 = torch.tensor([-c, c + 0.5, c, -c - 0.5, 0.5])
    x = torch.stack([torch.cat([x1, x2]), torch.cat([x2, x1])]).requires_grad_(True)
    w = torch.tensor([[0.5], [2.0]], requires_grad=True)
    g = randn((2, 5))
    y = megatron.weighted_bias_quick_geglu_impl(x, None, w, False, 0.5, c)
    (dx,) = torch.autograd.grad(y, [x], g)
    e_out, e_dx, _, _ = megatron_formulas("quick_gelu", True, x, None, w, g, linear_offset=0.5,
                                          clamp_value=c)
    assert_close(y, e_out, F32, "clamp edges: forward")
    assert_close(dx, e_dx, F32, "clamp edges: d input")
    outside = torch.cat([x[:, :5] > c, x[:, 5:].abs() > c], -1).detach()
    assert torch.all(dx[outside] == 0) and torch.all(dx[~outside] != 0)


BAD_RANK = [
    pytest.param(lambda x, w: megatron.bias_swiglu_impl(x, None), id="bias_swiglu_impl"),
    pytest.param(lambda x, w: megatron.bias_geglu_impl(x, None), id="bias_geglu_impl"),
    pytest.param(lambda x, w: megatron.weighted_bias_swiglu_impl(x, None, w),
                 id="weighted_bias_swiglu_impl"),
    pytest.param(lambda x, w: megatron.weighted_bias_quick_geglu_impl(x, None, w),
                 id="weighted_bias_quick_geglu_impl"),
    pytest.param(lambda x, w: megatron.weighted_squared_relu_impl(x, w),
                 id="weighted_squared_relu_impl"),
]


@pytest.mark.parametrize("shape", [(2, 2, 2, 6), (6,)], ids=["4d", "1d"])
@pytest.mark.parametrize("fn", BAD_RANK)
def test_input_not_2d_or_3d_raises(fn, shape: tuple[int, ...]) -> None:
    x = randn(shape)
    tokens = x.numel() // shape[-1]
    with pytest.raises(ValueError, match=r"\binput\b"):
        fn(x, randn((tokens, 1)))


@pytest.mark.parametrize("shape", [(2, 2, 2, 6), (6,)], ids=["4d", "1d"])
def test_bias_gelu_impl_takes_any_rank(shape: tuple[int, ...]) -> None:
    """Megatron-Core's ``bias_gelu_impl`` (``GeLUFunction.apply``) checks no rank."""
    x, b = randn(shape), randn(shape[-1:])
    torch.testing.assert_close(megatron.bias_gelu_impl(x, b),
                               torch.nn.functional.gelu(x + b, approximate="tanh"))


@pytest.mark.parametrize("clamp", [0.0, -1.0, 0])
def test_weighted_bias_quick_geglu_impl_names_itself_on_a_bad_clamp(clamp) -> None:
    x = randn((4, 6))
    with pytest.raises(ValueError, match="weighted_bias_quick_geglu_impl: clamp_value"):
        megatron.weighted_bias_quick_geglu_impl(x, None, randn((4, 1)), clamp_value=clamp)


# Megatron-LM main (2026-08): bias_swiglu_impl and weighted_bias_swiglu_impl take clamp_value.
MEGATRON_SIGNATURES = {
    "bias_gelu_impl": ["input", "bias"],
    "bias_swiglu_impl": ["input", "bias", "fp8_input_store=False", "cpu_offload_input=False",
                         "clamp_value=None"],
    "bias_geglu_impl": ["input", "bias"],
    "weighted_bias_swiglu_impl": ["input", "bias", "weights", "fp8_input_store=False",
                                  "clamp_value=None"],
    "weighted_bias_quick_geglu_impl": ["input", "bias", "weights", "fp8_input_store=False",
                                       "linear_offset=0.0", "clamp_value=None"],
    "weighted_squared_relu_impl": ["input", "weights"],
}


@pytest.mark.parametrize("name", sorted(MEGATRON_SIGNATURES))
def test_megatron_argument_order(name: str) -> None:
    fn = getattr(megatron, name)
    assert name in megatron.__all__
    params = inspect.signature(fn).parameters.values()
    got = [p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
           for p in params]
    assert got == MEGATRON_SIGNATURES[name]


@pytest.mark.parametrize("name, module", [
    ("bias_swiglu_impl", "fused_bias_swiglu"), ("weighted_bias_swiglu_impl", "fused_bias_swiglu"),
    ("bias_geglu_impl", "fused_bias_geglu"), ("weighted_bias_quick_geglu_impl", "fused_bias_geglu"),
    ("weighted_squared_relu_impl", "fused_weighted_squared_relu")])
def test_signatures_extend_the_installed_megatron_core(name: str, module: str) -> None:
    """The installed megatron-core's parameters (a test dependency: 0.16.1 here, 0.19.2 on
    the GPU machines) are a prefix of lmfuse's, with the same defaults."""
    mod = pytest.importorskip(f"megatron.core.fusions.{module}")
    def params(fn):
        return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]

    theirs = params(getattr(mod, name))
    assert params(getattr(megatron, name))[:len(theirs)] == theirs


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("clamp", [None, 0.0, -1.0, 0.7])
def test_swiglu_clamp_value_as_megatron(with_bias: bool, clamp) -> None:
    """Megatron's clamped SwiGLU: the bias first, then gate <= c and -c <= linear <= c;
    clamp_value None or <= 0 means no clamp. Weighted form too; forward and gradients."""
    x = (randn((6, 16)) * 2).requires_grad_()
    bias = randn((16,)) if with_bias else None
    w = torch.rand(6, 1)

    def ref(v, weights=None):
        v = v + bias if bias is not None else v
        a, b = v.chunk(2, -1)
        if clamp is not None and clamp > 0:
            a, b = a.clamp(max=clamp), b.clamp(-clamp, clamp)
        y = torch.nn.functional.silu(a) * b
        return y if weights is None else y * weights

    for got_fn, want_fn in (
            (lambda v: megatron.bias_swiglu_impl(v, bias, clamp_value=clamp), ref),
            (lambda v: megatron.weighted_bias_swiglu_impl(v, bias, w, clamp_value=clamp),
             lambda v: ref(v, w))):
        got, want = got_fn(x), want_fn(x)
        assert_close(got, want, torch.float32, "forward")
        g1, = torch.autograd.grad(got.sum(), x)
        g2, = torch.autograd.grad(want.sum(), x)
        assert_close(g1, g2, torch.float32, "gradient")


def test_swiglu_clamp_adds_the_bias_unrounded() -> None:
    """bf16 input and bias with a clamp: the bias is added in float32 before the clamp, as
    in Megatron. 1 + 2**-8 is past a clamp of 1 (the gate's gradient 0 there), but rounds
    to 1 in bf16, where the clamp would let the gradient through."""
    x = torch.cat([torch.ones(4, 8), torch.full((4, 8), 0.5)], -1).bfloat16().requires_grad_()
    bias = torch.full((16,), 2.0 ** -8).bfloat16()
    w = torch.rand(4, 1)
    for fn in (lambda v: megatron.bias_swiglu_impl(v, bias, clamp_value=1.0),
               lambda v: megatron.weighted_bias_swiglu_impl(v, bias, w, clamp_value=1.0)):
        y = fn(x)
        assert y.dtype == torch.bfloat16
        g, = torch.autograd.grad(y.float().sum(), x)
        assert g.dtype == torch.bfloat16
        assert torch.all(g[:, :8] == 0)  # the gate half, past the clamp
        assert torch.all(g[:, 8:] != 0)  # the linear half, inside it


@pytest.mark.parametrize("name", ["bias_swiglu_impl", "weighted_bias_swiglu_impl"])
def test_the_clamp_paths_check_bias_and_clamp_value(name) -> None:
    """With a clamp and a bias the bias is added in float32 first: it was used there
    unchecked (a [4, 1] bias broadcast, a list an AttributeError); clamp_value was not
    checked (a str a bare TypeError, NaN and True taken as no clamp)."""
    fn = getattr(megatron, name)
    x = torch.randn(4, 8)
    args = (torch.rand(4, 1),) if name.startswith("weighted") else ()
    with pytest.raises(ValueError, match=rf"^{name}: bias must be 1-D, got 2-D"):
        fn(x, torch.zeros(4, 1), *args, clamp_value=5.0)
    with pytest.raises(TypeError, match=rf"^{name}: bias must be a torch.Tensor"):
        fn(x, [0.0] * 8, *args, clamp_value=5.0)
    for bad, error in (("5", TypeError), (True, TypeError), (float("nan"), ValueError)):
        with pytest.raises(error, match=rf"^{name}: clamp_value must be"):
            fn(x, torch.zeros(8), *args, clamp_value=bad)


@pytest.mark.parametrize("name", ["bias_swiglu_impl", "bias_geglu_impl", "bias_gelu_impl"])
def test_a_float32_bias_on_bf16_input_promotes_as_megatron_does(name) -> None:
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    b = torch.randn(8)
    out = getattr(megatron, name)(x, b)
    assert out.dtype == torch.float32
    want = getattr(megatron, name)(x.float(), b)
    assert torch.allclose(out, want)
