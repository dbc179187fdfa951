"""``RMSNorm``: the module form of :func:`lmfuse.rms_norm`, with a learnable ``weight [H]``."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from .._dispatch import IMPLS, check_choice, check_int, check_number, check_tensor
from .ops import math_eps, rms_norm


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, ``x / sqrt(mean(x ** 2) + eps) * (weight + weight_offset)``.

    Args:
        hidden_size: H, the size of the normalised last dim; ``[H]`` (``nn.RMSNorm``'s
            ``normalized_shape`` of one dim) too.
        eps: added to the mean square (finite, >= 0); ``None``, as ``nn.RMSNorm``'s: the
            epsilon of the type the math runs in (float32's, float64's for float64 x).
        weight_offset: added to ``weight`` before it scales; 1.0 is Gemma's ``(1 + weight)``.
        elementwise_affine: learn ``weight [H]``; ``False``: no weight (no affine step).
        impl: ``"auto"``, ``"triton"`` or ``"torch"``, as :func:`lmfuse.rms_norm` takes.
        device, dtype: of ``weight``.

    ``weight`` starts at ``1 - weight_offset`` (ones for Llama's convention, zeros for
    Gemma's), so a fresh module scales by exactly 1. NaN and inf propagate as in
    :func:`lmfuse.rms_norm`; an input whose last dim is not ``hidden_size`` raises a
    ``ValueError`` naming ``x``.
    """

    def __init__(self, hidden_size: int | Sequence[int], eps: Optional[float] = 1e-6, *,
                 weight_offset: float = 0.0,
                 elementwise_affine: bool = True, impl: str = "auto",
                 device: Optional[torch.device | str] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        op = "RMSNorm"
        if isinstance(hidden_size, (list, tuple)):  # (torch.Size is a tuple)
            if len(hidden_size) != 1:
                raise ValueError(f"{op}: hidden_size must be an int or [H] (the last dim is "
                                 f"normalised), got {list(hidden_size)}")
            hidden_size = hidden_size[0]
        self.hidden_size = check_int(op, "hidden_size", hidden_size, minimum=1)
        self.normalized_shape = (self.hidden_size,)  # nn.RMSNorm's name
        self.eps = check_number(op, "eps", eps)
        if self.eps is not None and self.eps < 0:
            raise ValueError(f"{op}: eps must be >= 0, got {self.eps}")
        self.weight_offset = check_number(op, "weight_offset", weight_offset, allow_none=False)
        if not isinstance(elementwise_affine, bool):
            raise TypeError(f"{op}: elementwise_affine must be a bool, got "
                            f"{elementwise_affine!r}")
        check_choice(op, "impl", impl, IMPLS)
        self.elementwise_affine = elementwise_affine
        self.impl = impl
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``weight`` back to ``1 - weight_offset`` (an effective scale of 1)."""
        if self.weight is not None:
            with torch.no_grad():
                self.weight.fill_(1.0 - self.weight_offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., H]`` -> ``[..., H]`` in x's dtype (any float dtype: the weight's may
        differ). NaN and inf propagate as in :func:`lmfuse.rms_norm`."""
        op, H = "RMSNorm", self.hidden_size
        check_tensor(op, "x", x)
        if x.dim() < 1 or x.shape[-1] != H:
            raise ValueError(f"{op}: x must be [..., hidden_size] = [..., {H}], got shape "
                             f"{tuple(x.shape)}")
        if self.weight is not None and x.device != self.weight.device:
            raise ValueError(f"{op}: x is on {x.device} but the module's weight is on "
                             f"{self.weight.device}; move one of them")
        eps = self.eps if self.eps is not None else math_eps(x.dtype)
        return rms_norm(x, self.weight, eps=eps, weight_offset=self.weight_offset,
                        impl=self.impl)

    def extra_repr(self) -> str:
        extra = f", weight_offset={self.weight_offset}" if self.weight_offset else ""
        affine = "" if self.elementwise_affine else ", elementwise_affine=False"
        return f"{self.hidden_size}, eps={self.eps}{extra}{affine}, impl={self.impl!r}"
