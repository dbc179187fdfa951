"""``RMSNorm`` and ``LayerNorm``: the module forms of :func:`lmfuse.rms_norm` and
:func:`lmfuse.layer_norm`, with a learnable ``weight [H]`` (and ``bias [H]``)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from .._dispatch import IMPLS, check_choice, check_int, check_number, check_tensor
from .ops import layer_norm, math_eps, rms_norm


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


class LayerNorm(nn.Module):
    """LayerNorm over the trailing ``normalized_shape`` dims, ``torch.nn.LayerNorm``'s
    constructor and forward, run by :func:`lmfuse.layer_norm`: ``(x - mean) / sqrt(var +
    eps) * (weight + weight_offset) + bias``.

    Args:
        normalized_shape: H, or the trailing dims normalised together (``[H]``,
            ``[D1, D2]``, a ``torch.Size``): they are flattened into one row.
        eps: added to the variance (finite, >= 0).
        elementwise_affine: learn ``weight`` (and ``bias``, unless ``bias=False``) of
            ``normalized_shape``; ``False``: neither.
        bias: learn ``bias`` (with ``elementwise_affine``).
        weight_offset: added to ``weight`` before it scales; 1.0 is the zero-centred scale
            of Megatron's ``layernorm_zero_centered_gamma`` and Nemotron's LayerNorm1P.
        impl: ``"auto"``, ``"triton"`` or ``"torch"``, as :func:`lmfuse.layer_norm` takes.
        device, dtype: of the parameters.

    ``weight`` starts at ``1 - weight_offset`` and ``bias`` at 0, so a fresh module scales
    by exactly 1 and shifts by nothing. An input whose trailing dims are not
    ``normalized_shape`` raises a ``ValueError`` naming ``x``.
    """

    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, device=None, dtype=None,
                 *, weight_offset: float = 0.0, impl: str = "auto") -> None:
        super().__init__()
        op = "LayerNorm"
        dims = ((normalized_shape,) if not isinstance(normalized_shape, (list, tuple))
                else tuple(normalized_shape))
        if not dims:
            raise ValueError(f"{op}: normalized_shape must name at least one dim, got "
                             f"{list(dims)}")
        self.normalized_shape = tuple(check_int(op, "normalized_shape", d, minimum=0)
                                      for d in dims)
        eps = check_number(op, "eps", eps, allow_none=False)
        if eps < 0:
            raise ValueError(f"{op}: eps must be >= 0, got {eps}")
        self.eps = eps
        self.weight_offset = check_number(op, "weight_offset", weight_offset, allow_none=False)
        for name, flag in (("elementwise_affine", elementwise_affine), ("bias", bias)):
            if not isinstance(flag, bool):
                raise TypeError(f"{op}: {name} must be a bool, got {flag!r}")
        check_choice(op, "impl", impl, IMPLS)
        self.elementwise_affine = elementwise_affine
        self.impl = impl
        kw = {"device": device, "dtype": dtype}
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, **kw))
            if bias:
                self.bias = nn.Parameter(torch.empty(self.normalized_shape, **kw))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``weight`` back to ``1 - weight_offset`` (an effective scale of 1), ``bias`` to 0."""
        with torch.no_grad():
            if self.weight is not None:
                self.weight.fill_(1.0 - self.weight_offset)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., *normalized_shape]`` -> the same shape, in x's dtype (any float dtype:
        the parameters' may differ); float32 for a 16-bit x under CUDA autocast, as
        ``torch.nn.LayerNorm``."""
        op, shape = "LayerNorm", self.normalized_shape
        check_tensor(op, "x", x)
        k = len(shape)
        if x.dim() < k or tuple(x.shape[x.dim() - k:]) != shape:
            raise ValueError(f"{op}: x must be [..., *normalized_shape] = [..., "
                             f"{', '.join(map(str, shape))}], got shape {tuple(x.shape)}")
        for name in ("weight", "bias"):
            t = getattr(self, name)
            if t is not None and x.device != t.device:
                raise ValueError(f"{op}: x is on {x.device} but the module's {name} is on "
                                 f"{t.device}; move one of them")
        w, b = self.weight, self.bias
        if k > 1:  # the trailing dims as one row
            x = x.flatten(-k)
            w = w.reshape(-1) if w is not None else None
            b = b.reshape(-1) if b is not None else None
            y = layer_norm(x, w, b, eps=self.eps, weight_offset=self.weight_offset,
                           impl=self.impl)
            return y.view(*y.shape[:-1], *shape) if y.numel() else y.reshape(
                *y.shape[:-1], *shape)
        return layer_norm(x, w, b, eps=self.eps, weight_offset=self.weight_offset,
                          impl=self.impl)

    def extra_repr(self) -> str:
        shape = self.normalized_shape
        extra = f", weight_offset={self.weight_offset}" if self.weight_offset else ""
        affine = ("" if self.elementwise_affine else ", elementwise_affine=False")
        if self.elementwise_affine and self.bias is None:
            affine += ", bias=False"
        return (f"{shape if len(shape) > 1 else shape[0]}, eps={self.eps}{extra}{affine}, "
                f"impl={self.impl!r}")
