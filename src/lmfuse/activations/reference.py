"""Reference activations: the specification of every fused activation, in plain PyTorch.

One function covers the family: an elementwise activation (tanh-approximated GELU, SiLU,
Quick-GELU, squared ReLU), optionally gated (the last dim split in two halves, the
activation of the first times the second), with an optional bias, linear offset, clamp,
input and output multipliers (Falcon-H1's) and per-token weights. The formulas and constants
are Megatron-Core's. Math is float32 (float64 for float64 inputs); the output has the
input's dtype. The functions are differentiable torch code: autograd gives the reference
gradients.

Each activation's gradient is ``grad * act'(a)`` with the derivative written out (Megatron's
hand-written backward formulas, the same as ``F.silu``'s and ``torch.relu``'s native
backward): one product, as PyTorch's own activations compute it. (Autograd through the
forward formula ``a * sigmoid(a)`` would instead add ``grad * sigmoid(a)`` and ``grad * a *
sigmoid'(a)``, which for an infinite ``grad``, from an inf linear half or weight, is ``inf
- inf`` = NaN where ``F.silu`` gives +-inf.) NaN and inf otherwise follow the formulas:
``silu(-inf)`` and ``gelu(-inf)`` are NaN (``-inf * 0``), ``squared_relu(NaN)`` is NaN and
its gradient is exactly 0 wherever ``a <= 0`` (``torch.relu``'s backward is a select), the
clamp is ``torch.clamp`` (NaN kept, with zero gradient).
"""

from __future__ import annotations

from typing import Optional

import torch

ACTIVATIONS = ("gelu", "silu", "quick_gelu", "squared_relu")

# tanh-approximated GELU: sqrt(2 / pi), the cubic coefficient, and 3 * their product
# (the derivative's constant), as Megatron-Core writes them.
GELU_A = 0.79788456
GELU_B = 0.044715
GELU_DA = 0.1070322243
QUICK_GELU_K = 1.702


def gelu_tanh(a: torch.Tensor) -> torch.Tensor:
    return a * 0.5 * (1.0 + torch.tanh(GELU_A * a * (1.0 + GELU_B * a * a)))


def silu(a: torch.Tensor) -> torch.Tensor:
    return a * torch.sigmoid(a)


def quick_gelu(a: torch.Tensor) -> torch.Tensor:
    return a * torch.sigmoid(QUICK_GELU_K * a)


def squared_relu(a: torch.Tensor) -> torch.Tensor:
    return torch.relu(a) ** 2


_FN = {"gelu": gelu_tanh, "silu": silu, "quick_gelu": quick_gelu,
       "squared_relu": squared_relu}


def activation_grad(name: str, a: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad * act'(a)``, the derivatives written out (Megatron-Core's formulas)."""
    if name == "gelu":
        t = torch.tanh(GELU_A * a * (1.0 + GELU_B * a * a))
        return grad * (0.5 * a * ((1.0 - t * t) * (GELU_A + GELU_DA * a * a)) + 0.5 * (1.0 + t))
    if name == "silu":
        s = torch.sigmoid(a)
        return grad * (s * (1.0 + a * (1.0 - s)))
    if name == "quick_gelu":
        s = torch.sigmoid(QUICK_GELU_K * a)
        # the factor first: k a overflows where s (1 - s) is already 0 (no inf * 0)
        return grad * (s + (QUICK_GELU_K * s * (1.0 - s)) * a)
    # relu's gradient is a select: exactly 0 where a <= 0, whatever grad is.
    return torch.where(a <= 0, torch.zeros_like(grad), grad * (2.0 * torch.relu(a)))


class _Activation(torch.autograd.Function):
    """``act(a)`` with gradient :func:`activation_grad` (itself differentiable, so second
    derivatives work too)."""

    @staticmethod
    def forward(a: torch.Tensor, name: str) -> torch.Tensor:
        return _FN[name](a)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # (apart: torch.func transforms it)
        a, name = inputs
        ctx.save_for_backward(a)
        ctx.name = name

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (a,) = ctx.saved_tensors
        return activation_grad(ctx.name, a, grad), None


def activate(a: torch.Tensor, name: str) -> torch.Tensor:
    """``act(a)`` for an activation ``name`` of ``_FN``, differentiable (twice too) with the
    gradient of :func:`activation_grad`."""
    return _Activation.apply(a, name)


def activation_reference(
    x: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    weights: Optional[torch.Tensor] = None,
    *,
    activation: str,
    gated: bool,
    linear_offset: float = 0.0,
    clamp_value: Optional[float] = None,
    gate_multiplier: float = 1.0,
    down_multiplier: float = 1.0,
) -> torch.Tensor:
    """``act(x + bias)``, or gated ``act(x1 + b1) * (x2 + b2 + linear_offset)``, times
    ``weights``; with multipliers ``g``, ``d``: ``act(g (x + bias)) d``, or gated
    ``act(g (x1 + b1)) * (x2 + b2 + linear_offset) * d``.

    Args:
        x: ``[..., K]``; gated: ``K = 2 f``, ``x1 = x[..., :f]`` (activated),
            ``x2 = x[..., f:]`` (linear).
        bias: optional ``[K]``.
        weights: optional per-token weights, ``[tokens, 1]`` (tokens = ``x.numel() // K``) or
            ``x.shape[:-1] + (1,)``; any float dtype.
        activation: ``"gelu"`` (tanh approximation), ``"silu"``, ``"quick_gelu"``
            (``a * sigmoid(1.702 a)``) or ``"squared_relu"``.
        clamp_value: gated only: before the bias (Megatron's order), ``x1`` is clamped from
            above at ``c`` and ``x2`` to ``[-c, c]``, with torch.clamp's gradient.
        gate_multiplier: ``g``, scales the activation's input after the clamp and the bias
            (Falcon-H1's ``act_fn(gate_proj(x) * gate_multiplier)``, the bias being
            ``gate_proj``'s).
        down_multiplier: ``d``, scales the output before the weights (Falcon-H1 applies it
            after ``down_proj``, which is linear: the same product where ``down_proj`` has
            no bias).
    Returns:
        ``[..., K]`` (``[..., f]`` gated) in ``x``'s dtype.
    """
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32

    def fn(a: torch.Tensor) -> torch.Tensor:
        return activate(a, activation)

    v = x.to(compute)
    if gated:
        f = x.shape[-1] // 2
        v1, v2 = v[..., :f], v[..., f:]
        if clamp_value is not None:
            v1, v2 = v1.clamp(max=clamp_value), v2.clamp(min=-clamp_value, max=clamp_value)
        if bias is not None:
            b = bias.to(compute)
            v1, v2 = v1 + b[:f], v2 + b[f:]
        if gate_multiplier != 1:
            v1 = v1 * gate_multiplier
        out = fn(v1) * (v2 + linear_offset)
    else:
        v = v + bias.to(compute) if bias is not None else v
        out = fn(v * gate_multiplier if gate_multiplier != 1 else v)
    if down_multiplier != 1:
        out = out * down_multiplier
    if weights is not None:
        out = out * weights.to(compute).reshape(*out.shape[:-1], 1)
    return out.to(x.dtype)
