"""Drop-in names with Megatron-Core's signatures, backed by lmfuse's fused ops.

    from lmfuse.megatron import FusedScaleMaskSoftmax, AttnMaskType

Each function keeps Megatron-Core's argument order; the semantics are Megatron's except
where lmfuse is exact and Megatron is not (masked positions are excluded as ``-inf``, so
a fully masked row is zeros rather than uniform).
"""

from __future__ import annotations

import torch

from .softmax import AttnMaskType, FusedScaleMaskSoftmax, fused_softmax

__all__ = [
    "AttnMaskType",
    "FusedScaleMaskSoftmax",
    "scaled_masked_softmax",
    "scaled_softmax",
    "scaled_upper_triang_masked_softmax",
]


def _as_4d(name: str, x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: inputs must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in (3, 4):
        shape = tuple(x.shape)
        raise ValueError(f"{name}: inputs must be [b, np, sq, sk] or [attn_batches, sq, sk], "
                         f"got {shape}")
    return x.unsqueeze(0) if x.dim() == 3 else x


def scaled_upper_triang_masked_softmax(inputs: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax of ``scale * inputs`` for ``inputs [attn_batches, sq, sk]``.

    Megatron requires ``sq == sk``; here ``sq <= sk`` works (bottom-right aligned).
    """
    if not isinstance(inputs, torch.Tensor):
        raise TypeError("scaled_upper_triang_masked_softmax: inputs must be a torch.Tensor, "
                        f"got {type(inputs).__name__}")
    if inputs.dim() != 3:
        shape = tuple(inputs.shape)
        raise ValueError(
            f"scaled_upper_triang_masked_softmax: inputs must be [attn_batches, sq, sk], got {shape}"
        )
    return fused_softmax(inputs.unsqueeze(0), scale=scale, causal=True).squeeze(0)


def scaled_masked_softmax(inputs: torch.Tensor, mask: torch.Tensor | None,
                          scale: float) -> torch.Tensor:
    """Softmax of ``scale * inputs`` with ``mask`` (bool, True = masked), ``inputs [b, np, sq, sk]``."""
    x = _as_4d("scaled_masked_softmax", inputs)
    return fused_softmax(x, scale=scale, mask=mask).view(inputs.shape)


def scaled_softmax(inputs: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax of ``scale * inputs`` over the last dim, ``inputs [b, np, sq, sk]`` (or 3-D)."""
    x = _as_4d("scaled_softmax", inputs)
    return fused_softmax(x, scale=scale).view(inputs.shape)
