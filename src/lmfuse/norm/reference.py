"""Reference RMSNorm and LayerNorm: the specifications of ``lmfuse.rms_norm`` and
``lmfuse.layer_norm`` (``layer_norm_reference``, at the end), in plain PyTorch.

RMSNorm:

For each row ``x`` of the last dimension (``H`` values)::

    y = x / sqrt(mean(x ** 2) + eps) * (weight + weight_offset)

The math runs in float32 (float64 for float64 input) and the result is rounded once, to
x's dtype. ``weight_offset=1.0`` is Gemma's ``(1 + weight)`` convention; Llama, Mistral and
Qwen use 0. Without a weight there is no affine step (the normalised x is the output,
whatever ``weight_offset``). The function is plain differentiable torch code: autograd
gives the reference gradients of x and weight. It is ``F.rms_norm``'s computation, NaN and
inf included: a NaN in a row makes the row NaN; an inf makes its rstd 0, so the row is 0
except NaN (``inf * 0``) at the inf; a NaN weight element makes its column NaN.
"""

from __future__ import annotations

from typing import Optional

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 input, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm_unrounded(
    x: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    *,
    eps: float = 1e-6,
    weight_offset: float = 0.0,
) -> torch.Tensor:
    """RMSNorm over the last dim, left in the compute dtype (float32, float64 for float64):
    for callers that go on computing before they round (the attention block's q/k norm
    feeds the rotary embedding in float32)."""
    compute = compute_dtype(x.dtype)
    xf = x.to(compute)
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        w = weight.to(compute)
        y = y * (w + weight_offset if weight_offset else w)
    return y


def rms_norm_reference(
    x: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    *,
    eps: float = 1e-6,
    weight_offset: float = 0.0,
) -> torch.Tensor:
    """RMSNorm over the last dim, rounded once to x's dtype.

    Args:
        x: ``[..., H]`` floating-point input.
        weight: optional ``[H]`` scale (any float dtype); ``None``: no affine step.
        eps: added to the mean square before the square root.
        weight_offset: added to ``weight`` before it scales (Gemma: 1.0).
    Returns:
        ``[..., H]`` in x's dtype.
    """
    return rms_norm_unrounded(x, weight, eps=eps, weight_offset=weight_offset).to(x.dtype)


def rms_norm_rstd_reference(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``1 / sqrt(mean(x ** 2, -1) + eps)`` per row, ``[...]`` in the compute dtype: what the
    Triton forward saves for its backward."""
    xf = x.to(compute_dtype(x.dtype))
    return torch.rsqrt(xf.square().mean(-1) + eps)


def layer_norm_reference(
    x: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    *,
    eps: float = 1e-5,
    weight_offset: float = 0.0,
) -> torch.Tensor:
    """LayerNorm over the last dim, rounded once to x's dtype: the specification of
    ``lmfuse.layer_norm``.

    For each row ``x`` of the last dimension (``H`` values)::

        xc = x - mean(x)
        y = xc / sqrt(mean(xc ** 2) + eps) * (weight + weight_offset) + bias

    (the biased variance, as ``torch.nn.LayerNorm``'s). The math runs in float32 (float64
    for float64 input). ``weight_offset=1.0`` is the zero-centred scale of Megatron's
    ``layernorm_zero_centered_gamma`` and Nemotron's LayerNorm1P. Without a weight or a
    bias that step is left out. A NaN or an inf in a row makes the whole row NaN (its mean
    is NaN or inf, and ``inf - inf`` is NaN), as ``F.layer_norm`` gives; a NaN weight or
    bias element makes its column NaN. A finite row whose variance overflows float32
    (values past about 1e19) gives the bias (``1 / std`` is 0), or NaN where its
    differences from its first value overflow too (values near float32's largest);
    ``F.layer_norm``'s Welford statistics give the one or the other by their own order.

    Args:
        x: ``[..., H]`` floating-point input.
        weight: optional ``[H]`` scale (any float dtype); ``None``: no scale.
        bias: optional ``[H]`` shift (any float dtype); ``None``: no shift.
        eps: added to the variance before the square root.
        weight_offset: added to ``weight`` before it scales.
    Returns:
        ``[..., H]`` in x's dtype.
    """
    compute = compute_dtype(x.dtype)
    xf = x.to(compute)
    # The mean summed from the row's first value: a sum of the spread, not the magnitude,
    # so a constant row's mean is exact and its output the bias (as PyTorch's Welford
    # statistics give), where sum(x) / H would round and leave centred values of one ulp.
    shift = xf[..., :1]
    xc = xf - (shift + (xf - shift).mean(-1, keepdim=True))
    # xc / std rather than xc * rsqrt(var): rsqrt's derivative cubes 1 / std, which
    # overflows for a row of spread 1e-14 with eps = 0, where this form's does not.
    y = xc / torch.sqrt(xc.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        w = weight.to(compute)
        y = y * (w + weight_offset if weight_offset else w)
    if bias is not None:
        y = y + bias.to(compute)
    return y.to(x.dtype)
