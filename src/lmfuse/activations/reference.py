"""Reference activations: the specification of every fused activation, in plain PyTorch.

One function covers the family: an elementwise activation (tanh-approximated GELU, SiLU,
Quick-GELU, squared ReLU), optionally gated (the last dim split in two halves, the
activation of the first times the second), with an optional bias, linear offset, clamp and
per-token weights. The formulas and constants are Megatron-Core's. Math is float32
(float64 for float64 inputs); the output has the input's dtype. The functions are plain
differentiable torch code: autograd gives the reference gradients.
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


def activation_reference(
    x: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    weights: Optional[torch.Tensor] = None,
    *,
    activation: str,
    gated: bool,
    linear_offset: float = 0.0,
    clamp_value: Optional[float] = None,
) -> torch.Tensor:
    """``act(x + bias)``, or gated ``act(x1 + b1) * (x2 + b2 + linear_offset)``, times
    ``weights``.

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
    Returns:
        ``[..., K]`` (``[..., f]`` gated) in ``x``'s dtype.
    """
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    fn = _FN[activation]
    v = x.to(compute)
    if gated:
        f = x.shape[-1] // 2
        v1, v2 = v[..., :f], v[..., f:]
        if clamp_value is not None:
            v1, v2 = v1.clamp(max=clamp_value), v2.clamp(min=-clamp_value, max=clamp_value)
        if bias is not None:
            b = bias.to(compute)
            v1, v2 = v1 + b[:f], v2 + b[f:]
        out = fn(v1) * (v2 + linear_offset)
    else:
        out = fn(v + bias.to(compute) if bias is not None else v)
    if weights is not None:
        out = out * weights.to(compute).reshape(*out.shape[:-1], 1)
    return out.to(x.dtype)
