"""lmfuse.FusedMLP against the same module unfused (plain torch): outputs and gradients of
the input, every parameter and the MoE weights, on the torch and Triton paths."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close

import lmfuse

F32 = torch.float32
CASES = [
    pytest.param("swiglu", True, {}, id="swiglu"),
    pytest.param("geglu", True, {}, id="geglu"),
    pytest.param("gelu", True, {}, id="gelu"),
    pytest.param("quick_geglu", True, dict(linear_offset=1.0, clamp_value=1.5), id="quick"),
    pytest.param("squared_relu", True, {}, id="sqrelu"),
    pytest.param("swiglu", False, {}, id="swiglu-nobias"),
    pytest.param("swiglu", True, dict(gate_multiplier=0.5, down_multiplier=2.0),
                 id="swiglu-multipliers"),
]


def grads(module, out, x, w, g):
    leaves = [x] + ([w] if w is not None else []) + list(module.parameters())
    return torch.autograd.grad(out, leaves, g)


# MoE weights only where a weighted kernel exists (test_weights_need_a_weighted_activation).
WEIGHTED = [pytest.param(c.values[0], c.values[1], c.values[2], True, id=f"{c.id}-moe")
            for c in CASES if c.values[0] not in ("gelu", "geglu")]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("activation, bias, opts, weighted",
                         [pytest.param(*c.values, False, id=c.id) for c in CASES] + WEIGHTED)
def test_equals_unfused(activation: str, bias: bool, opts: dict, weighted: bool,
                        impl: str) -> None:
    torch.manual_seed(0)
    mlp = lmfuse.FusedMLP(12, 7, activation, bias, impl=impl, **opts)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0.0, 0.5)
    x = torch.randn(3, 2, 12, requires_grad=True)
    w = torch.rand(6, 1, requires_grad=True) if weighted else None
    out = mlp(x, w)
    ref = mlp.reference_forward(x, w)
    assert out.shape == (3, 2, 12)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    for a, b in zip(grads(mlp, out, x, w, g), grads(mlp, ref, x, w, g)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_layout_and_fused_bias() -> None:
    mlp = lmfuse.FusedMLP(16, 10, "swiglu")
    assert mlp.fc1.weight.shape == (20, 16) and mlp.fc1.bias is None
    assert mlp.bias1.shape == (20,) and mlp.fc2.weight.shape == (16, 10)
    sq = lmfuse.FusedMLP(16, 10, "squared_relu")
    assert sq.fc1.weight.shape == (10, 16) and sq.fc1.bias is not None and sq.bias1 is None
    plain = lmfuse.FusedMLP(16, 10, "gelu", bias=False)
    assert plain.bias1 is None and plain.fc2.bias is None


def test_weights_need_a_weighted_activation() -> None:
    mlp = lmfuse.FusedMLP(8, 4, "geglu")
    with pytest.raises(ValueError, match="per-token weights need a weighted activation"):
        mlp(torch.randn(5, 8), torch.rand(5, 1))


@pytest.mark.parametrize("kw, match", [
    (dict(activation="relu"), "activation must be one of"),
    (dict(ffn_hidden_size=0), "ffn_hidden_size must be a positive int"),
    (dict(activation="swiglu", clamp_value=1.0), "Quick-GEGLU's options"),
    (dict(activation="gelu", fp8_input_store=True), "fp8_input_store is for the gated"),
    (dict(activation="geglu", gate_multiplier=0.5), "SwiGLU's options"),
    (dict(activation="swiglu", down_multiplier=float("nan")), "down_multiplier must be finite"),
])
def test_bad_config(kw: dict, match: str) -> None:
    args = dict(hidden_size=8, ffn_hidden_size=4)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        lmfuse.FusedMLP(**args)


# --- the input against the module's parameters ---------------------------------------------


@pytest.mark.parametrize("make, error, message", [
    pytest.param(lambda: (torch.randn(3, 7), None), ValueError,
                 r"x must be \[..., hidden_size\] = \[..., 8\], got shape \(3, 7\)",
                 id="width"),
    pytest.param(lambda: (torch.tensor(1.0), None), ValueError,
                 r"x must be \[..., hidden_size\] = \[..., 8\], got shape \(\)", id="0-d"),
    pytest.param(lambda: (torch.randn(3, 8, dtype=torch.float64), None), TypeError,
                 r"x has dtype torch.float64 but the module's parameters are torch.float32",
                 id="dtype"),
    pytest.param(lambda: (torch.randn(3, 8).half(), None), TypeError,
                 r"x has dtype torch.float16 but the module's parameters are torch.float32",
                 id="half"),
    pytest.param(lambda: (torch.ones(3, 8, dtype=torch.int64), None), TypeError,
                 r"x must have dtype in \(.*\), got torch.int64", id="int"),
    pytest.param(lambda: ([[1.0] * 8], None), TypeError, r"x must be a torch.Tensor, got list",
                 id="list"),
    pytest.param(lambda: (torch.randn(3, 8), torch.rand(4, 1)), ValueError,
                 r"weights must be \[tokens, 1\] = \[3, 1\] \(one per token of x \(3, 8\)\), "
                 r"got \(4, 1\)", id="weights-tokens"),
    pytest.param(lambda: (torch.randn(3, 8), torch.ones(3, 1, dtype=torch.int64)), TypeError,
                 r"weights must have dtype in", id="weights-int"),
])
def test_bad_input_names_the_argument(make, error, message: str) -> None:
    """Instead of torch's "mat1 and mat2 shapes cannot be multiplied" or "expected m1 and
    m2 to have the same dtype" from inside fc1."""
    mlp = lmfuse.FusedMLP(8, 6, "swiglu")
    x, weights = make()
    with pytest.raises(error, match=f"^FusedMLP: {message}"):
        mlp(x, weights)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("activation", ["swiglu", "gelu", "squared_relu"])
def test_autocast_takes_any_input_dtype(activation: str, impl: str) -> None:
    """Under torch.autocast the linears cast x, and the fused bias is cast to theirs."""
    torch.manual_seed(0)
    mlp = lmfuse.FusedMLP(8, 6, activation, impl=impl)
    x = torch.randn(3, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mlp(x)
        ref = mlp.reference_forward(x.bfloat16())
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == F32 for p in mlp.parameters())
    assert_close(out, ref, torch.bfloat16, f"{activation} {impl} under autocast")
