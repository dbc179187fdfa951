"""``activation_reference`` against Megatron-Core's formulas, written out here in float64.

The reference is the oracle of every activation test, so it is checked against an
independent construction: the forward formulas with Megatron-Core's constants (tanh-GELU
``0.79788456`` / ``0.044715``, Quick-GELU ``1.702``) and Megatron's *hand-written*
backward formulas (the tanh-GELU derivative with ``0.1070322243``, SiLU's and Quick-GELU's
sigmoid forms, ``2 relu``), including the order of clamp and bias (clamp first) and
torch.clamp's gradient at the clamp's edges. The reference's gradients come from autograd.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, megatron_act, megatron_act_grad, randn

from lmfuse.activations.reference import activation_reference

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16


# --- Megatron-Core's formulas, float64 ---------------------------------------------------


@dataclass
class Spec:
    activation: str
    gated: bool
    linear_offset: float = 0.0
    clamp_value: float | None = None


def mc_forward_backward(spec: Spec, x, bias, weights, g):
    """Megatron's output and its (x, bias, weights) gradients for upstream gradient ``g``.

    Everything float64; ``weights`` is ``[tokens, 1]``. With a clamp, the clamp's mask
    (torch.clamp's: zero strictly outside, passed at the boundary) applies to x's gradient
    only: the bias is added after the clamp, so its gradient is not masked.
    """
    K = x.shape[-1]
    x2d = x.reshape(-1, K).to(F64)
    g2d = g.reshape(x2d.shape[0], -1).to(F64)
    w = torch.ones(x2d.shape[0], 1, dtype=F64) if weights is None else weights.to(F64)
    b = torch.zeros(K, dtype=F64) if bias is None else bias.to(F64)
    if spec.gated:
        f = K // 2
        v1, v2 = x2d[:, :f], x2d[:, f:]
        m1 = torch.ones_like(v1)
        m2 = torch.ones_like(v2)
        if spec.clamp_value is not None:
            c = spec.clamp_value
            m1 = (v1 <= c).to(F64)
            m2 = ((v2 >= -c) & (v2 <= c)).to(F64)
            v1, v2 = v1.clamp(max=c), v2.clamp(min=-c, max=c)
        a1 = v1 + b[:f]
        a2 = v2 + b[f:] + spec.linear_offset
        act = megatron_act(spec.activation, a1) * a2
        gw = g2d * w
        da1 = gw * megatron_act_grad(spec.activation, a1) * a2
        da2 = gw * megatron_act(spec.activation, a1)
        d_pre_clamp = torch.cat([da1, da2], dim=-1)  # gradient of (clamped x + bias)
        dx = torch.cat([da1 * m1, da2 * m2], dim=-1)
    else:
        a = x2d + b
        act = megatron_act(spec.activation, a)
        d_pre_clamp = dx = g2d * w * megatron_act_grad(spec.activation, a)
    out = act * w
    dw = (act * g2d).sum(dim=-1, keepdim=True)
    out_shape = x.shape[:-1] + (out.shape[-1],)
    return out.reshape(out_shape), dx.reshape(x.shape), d_pre_clamp.sum(dim=0), dw


def ref_forward_backward(spec: Spec, x, bias, weights, g):
    """The reference's output and autograd gradients, on fresh leaves."""
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None
              for t in (x, bias, weights)]
    out = activation_reference(leaves[0], leaves[1], leaves[2], activation=spec.activation,
                               gated=spec.gated, linear_offset=spec.linear_offset,
                               clamp_value=spec.clamp_value)
    need = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(out, need, g))
    return out, *[next(grads) if t is not None else None for t in leaves]


SPECS = [
    pytest.param(Spec("gelu", False), id="bias_gelu"),
    pytest.param(Spec("squared_relu", False), id="squared_relu"),
    pytest.param(Spec("silu", True), id="swiglu"),
    pytest.param(Spec("gelu", True), id="geglu"),
    pytest.param(Spec("quick_gelu", True), id="quick_geglu"),
    pytest.param(Spec("quick_gelu", True, linear_offset=1.0), id="quick_geglu-offset1"),
    pytest.param(Spec("quick_gelu", True, linear_offset=-0.5, clamp_value=1.5),
                 id="quick_geglu-offset-0.5-clamp1.5"),
    pytest.param(Spec("silu", True, clamp_value=0.75), id="swiglu-clamp0.75"),
    pytest.param(Spec("squared_relu", True), id="gated-squared_relu"),
]


@pytest.mark.parametrize("with_weights", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("spec", SPECS)
def test_matches_megatron_formulas_float64(spec: Spec, with_bias: bool,
                                          with_weights: bool) -> None:
    """Output and every gradient, float64, [2, 3, K] with K = 14 (f = 7) or 7 (not gated)."""
    K = 14 if spec.gated else 7
    x = randn((2, 3, K), F64, scale=2.0)
    bias = randn((K,), F64) if with_bias else None
    weights = randn((6, 1), F64) if with_weights else None
    out_k = K // 2 if spec.gated else K
    g = randn((2, 3, out_k), F64)
    out, dx, dbias, dw = ref_forward_backward(spec, x, bias, weights, g)
    e_out, e_dx, e_dbias, e_dw = mc_forward_backward(spec, x, bias, weights, g)
    what = f"{spec} bias={with_bias} weights={with_weights}"
    assert out.dtype == F64 and out.shape == (2, 3, out_k)
    assert_close(out, e_out, F64, f"{what}: forward")
    assert_close(dx, e_dx, F64, f"{what}: d x")
    if with_bias:
        assert_close(dbias, e_dbias, F64, f"{what}: d bias")
    if with_weights:
        assert_close(dw, e_dw, F64, f"{what}: d weights")


def test_constants_are_megatrons() -> None:
    """tanh-GELU uses 0.79788456, not sqrt(2/pi): the float64 reference follows the
    truncated constant to 1e-14, which torch's own tanh-GELU does not."""
    x = torch.linspace(-4.0, 4.0, 401, dtype=F64)
    spec = Spec("gelu", False)
    y = activation_reference(x, activation="gelu", gated=False)
    expected = megatron_act("gelu", x)
    assert (y - expected).abs().max().item() <= 1e-14
    assert (F.gelu(x, approximate="tanh") - expected).abs().max().item() > 1e-12
    y_q = activation_reference(x, activation="quick_gelu", gated=False)
    assert (y_q - x * torch.sigmoid(1.702 * x)).abs().max().item() <= 1e-14
    # The derivative of the forward formula is Megatron's 0.1070322243 form.
    xg = x.clone().requires_grad_(True)
    (d,) = torch.autograd.grad(activation_reference(xg, activation=spec.activation,
                                                    gated=False).sum(), xg)
    assert (d - megatron_act_grad("gelu", x)).abs().max().item() <= 1e-10


def test_gated_split_first_half_is_activated() -> None:
    """x = [x1 | x2]: the first half goes through the activation, the second is linear."""
    x = torch.tensor([[1.0, 2.0], [-1.0, 3.0]], dtype=F64)
    y = activation_reference(x, activation="silu", gated=True)
    s1 = 1.0 / (1.0 + torch.exp(torch.tensor(-1.0, dtype=F64)))  # sigmoid(1)
    expected = torch.tensor([[1.0 * s1 * 2.0], [-1.0 * (1.0 - s1) * 3.0]], dtype=F64)
    assert y.shape == (2, 1)
    assert (y - expected).abs().max().item() <= 1e-15


def test_squared_relu_values() -> None:
    x = torch.tensor([-2.0, -0.5, 0.0, 0.5, 3.0], dtype=F64, requires_grad=True)
    y = activation_reference(x, activation="squared_relu", gated=False)
    assert torch.equal(y.detach(), torch.tensor([0.0, 0.0, 0.0, 0.25, 9.0], dtype=F64))
    (d,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(d, torch.tensor([0.0, 0.0, 0.0, 1.0, 6.0], dtype=F64))


def test_clamp_comes_before_bias() -> None:
    """c = 1, bias 0.5: x1 = 3 -> act(1 + 0.5) (clamp, then bias), not act(min(3.5, 1))."""
    c, b = 1.0, 0.5
    x = torch.tensor([[3.0, 0.25], [0.25, -3.0]], dtype=F64)  # [x1 | x2], f = 1
    bias = torch.tensor([b, b], dtype=F64)
    y = activation_reference(x, bias, activation="quick_gelu", gated=True, clamp_value=c)
    qg = lambda a: a * torch.sigmoid(torch.tensor(1.702 * a, dtype=F64))  # noqa: E731
    expected = torch.stack([qg(c + b) * (0.25 + b), qg(0.25 + b) * (-c + b)]).view(2, 1)
    assert (y - expected).abs().max().item() <= 1e-15


@pytest.mark.parametrize("dtype", [F64, F32, BF16], ids=["float64", "float32", "bf16"])
def test_clamp_edges_gradient_is_torch_clamps(dtype: torch.dtype) -> None:
    """x1 clamped from above only, x2 on both sides; at exactly +-c the gradient passes,
    strictly outside it is zero; the bias's gradient is not masked."""
    c = 1.5
    x1 = torch.tensor([c, c + 0.5, -c, -c - 0.5, 0.25, 3 * c])
    x2 = torch.tensor([-c, c + 0.5, c, -c - 0.5, 0.5, -3 * c])
    x = torch.stack([torch.cat([x1, x2]), torch.cat([x2, x1])]).to(dtype)  # [2, 12], f = 6
    bias = randn((12,), dtype, scale=0.25)
    weights = torch.tensor([[0.7], [-1.3]], dtype=dtype)
    g = randn((2, 6), dtype)
    spec = Spec("quick_gelu", True, linear_offset=0.5, clamp_value=c)
    out, dx, dbias, dw = ref_forward_backward(spec, x, bias, weights, g)
    e_out, e_dx, e_dbias, e_dw = mc_forward_backward(spec, x, bias, weights, g)
    assert_close(out, e_out.to(dtype), dtype, "clamp edges: forward")
    assert_close(dx, e_dx.to(dtype), dtype, "clamp edges: d x")
    assert_close(dbias, e_dbias.to(dtype), dtype, "clamp edges: d bias")
    assert_close(dw, e_dw.to(dtype), dtype, "clamp edges: d weights")
    xf = x.to(F64)
    outside = torch.cat([xf[:, :6] > c, xf[:, 6:].abs() > c], dim=-1)
    assert outside.sum() == 9 and torch.all(dx[outside] == 0), "d x != 0 strictly outside"
    assert torch.all(dx[~outside] != 0), "d x must pass inside and at the boundary"
    assert torch.all(dbias != 0), "d bias is not masked by the clamp"


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["float32", "fp16", "bf16"])
@pytest.mark.parametrize("spec", SPECS[:6])
def test_float32_math_output_in_x_dtype(spec: Spec, dtype: torch.dtype) -> None:
    """Half-precision x: computed in float32 and rounded once (bitwise what float32 inputs
    give, cast), and within the dtype's tolerance of the float64 formulas. fp32 weights."""
    K = 10 if spec.gated else 5
    x = randn((4, K), dtype, scale=2.0)
    bias = randn((K,), dtype)
    weights = randn((4, 1), F32)
    y = activation_reference(x, bias, weights, activation=spec.activation, gated=spec.gated,
                             linear_offset=spec.linear_offset, clamp_value=spec.clamp_value)
    y32 = activation_reference(x.float(), bias.float(), weights, activation=spec.activation,
                               gated=spec.gated, linear_offset=spec.linear_offset,
                               clamp_value=spec.clamp_value)
    assert y.dtype == dtype
    assert torch.equal(y, y32.to(dtype))
    g = torch.zeros(y.shape, dtype=F64)
    expected = mc_forward_backward(spec, x, bias, weights, g)[0]
    assert_close(y, expected.to(dtype), dtype, f"{spec} {dtype}")


def test_weights_token_shape_and_leading_shape_agree() -> None:
    """weights [tokens, 1] and x.shape[:-1] + (1,) give the same result for 3-D x."""
    x = randn((2, 3, 8), F64)
    w = randn((6, 1), F64)
    a = activation_reference(x, weights=w, activation="silu", gated=True)
    b = activation_reference(x, weights=w.view(2, 3, 1), activation="silu", gated=True)
    assert a.shape == (2, 3, 4)
    assert torch.equal(a, b)
    plain = activation_reference(x, activation="silu", gated=True)
    assert torch.equal(a, plain * w.view(2, 3, 1))


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_empty_input(gated: bool) -> None:
    x = torch.zeros(0, 6, dtype=F32, requires_grad=True)
    bias = randn((6,), F32, requires_grad=True)
    w = torch.zeros(0, 1, dtype=F32, requires_grad=True)
    y = activation_reference(x, bias, w, activation="gelu", gated=gated)
    assert y.shape == (0, 3 if gated else 6)
    y.sum().backward()
    assert x.grad.shape == (0, 6) and w.grad.shape == (0, 1)
    assert torch.equal(bias.grad, torch.zeros(6))


GRADCHECK_SPECS = [
    pytest.param(Spec("gelu", False), id="gelu"),
    pytest.param(Spec("squared_relu", False), id="squared_relu"),
    pytest.param(Spec("silu", True), id="swiglu"),
    pytest.param(Spec("gelu", True), id="geglu"),
    pytest.param(Spec("quick_gelu", True, linear_offset=0.5, clamp_value=1.0),
                 id="quick_geglu-offset-clamp"),
]


@pytest.mark.parametrize("spec", GRADCHECK_SPECS)
def test_gradcheck_float64(spec: Spec) -> None:
    K = 6 if spec.gated else 5
    x = randn((3, K), F64, scale=1.5, requires_grad=True)
    if spec.clamp_value is not None:  # keep finite differences away from the clamp's kinks
        with torch.no_grad():
            near = (x.abs() - spec.clamp_value).abs() < 1e-3
            x[near] += 0.1
    bias = randn((K,), F64, requires_grad=True)
    w = randn((3, 1), F64, requires_grad=True)

    def f(x, bias, w):
        return activation_reference(x, bias, w, activation=spec.activation, gated=spec.gated,
                                    linear_offset=spec.linear_offset,
                                    clamp_value=spec.clamp_value)

    assert torch.autograd.gradcheck(f, (x, bias, w))
    assert torch.autograd.gradgradcheck(f, (x, bias, w))


# --- multipliers (Falcon-H1's gate_multiplier / down_multiplier) -----------------------------


@pytest.mark.parametrize("g, d", [(0.5, 2.0), (-1.25, 0.3), (0.0, -3.0), (1, 1)],
                         ids=["0.5-2", "-1.25-0.3", "0--3", "int-1-1"])
@pytest.mark.parametrize("clamp_value", [None, 0.75], ids=["noclamp", "clamp0.75"])
def test_multipliers_are_the_plain_formula_float64(g: float, d: float,
                                                  clamp_value: float | None) -> None:
    """``silu((clamp(x1) + b1) * g) * (clamp(x2) + b2) * d * weights``, written with
    ``F.silu`` and differentiated by autograd: the multiplier scales the gated half after
    the clamp and the bias (Falcon-H1's ``act_fn(gate_proj(x) * gate_multiplier)``)."""
    x = randn((2, 3, 10), F64, scale=2.0)
    bias = randn((10,), F64)
    weights = randn((6, 1), F64)
    dy = randn((2, 3, 5), F64)
    leaves = [t.clone().requires_grad_(True) for t in (x, bias, weights)]
    out = activation_reference(*leaves, activation="silu", gated=True,
                               clamp_value=clamp_value, gate_multiplier=g, down_multiplier=d)
    grads = torch.autograd.grad(out, leaves, dy)
    xs, bs, ws = [t.clone().requires_grad_(True) for t in (x, bias, weights)]
    x1, x2 = xs[..., :5], xs[..., 5:]
    if clamp_value is not None:
        x1, x2 = x1.clamp(max=clamp_value), x2.clamp(min=-clamp_value, max=clamp_value)
    want = F.silu((x1 + bs[:5]) * g) * (x2 + bs[5:]) * d * ws.view(2, 3, 1)
    want_grads = torch.autograd.grad(want, [xs, bs, ws], dy)
    assert_close(out, want, F64, f"g={g} d={d}: forward")
    for name, a, b in zip(("x", "bias", "weights"), grads, want_grads):
        assert_close(a, b, F64, f"g={g} d={d}: d {name}")
    if g == 0:  # silu(0) = 0: a zero output, and no gradient reaches the gated half
        assert torch.count_nonzero(grads[0][..., :5]) == 0 and torch.count_nonzero(out) == 0


def test_multipliers_of_one_change_nothing_and_apply_to_plain_activations() -> None:
    """g = d = 1 gives bit for bit the result without them (forward and gradients); on an
    ungated activation ``act((x + b) * g) * d``."""
    x = randn((4, 6), F32, scale=2.0, requires_grad=True)
    bias = randn((6,), F32, requires_grad=True)
    dy = randn((4, 3), F32)
    plain = activation_reference(x, bias, activation="silu", gated=True)
    ones = activation_reference(x, bias, activation="silu", gated=True, gate_multiplier=1.0,
                                down_multiplier=1.0)
    assert torch.equal(plain, ones)
    for a, b in zip(torch.autograd.grad(plain, [x, bias], dy),
                    torch.autograd.grad(ones, [x, bias], dy)):
        assert torch.equal(a, b)
    x64, b64 = x.detach().double(), bias.detach().double()
    y = activation_reference(x64, b64, activation="gelu", gated=False, gate_multiplier=-0.7,
                             down_multiplier=1.5)
    want = megatron_act("gelu", (x64 + b64) * -0.7) * 1.5
    assert_close(y, want, F64, "ungated gelu with multipliers")
