"""``FusedScaleMaskSoftmax``: Megatron-Core's module, constructor and forward, on
``fused_softmax``."""

from __future__ import annotations

import enum
from typing import Any, Callable, Optional

import torch
from torch import nn

from .ops import check_inputs, fused_softmax


class AttnMaskType(enum.Enum):
    """Megatron-Core's attention mask types (``megatron.core.transformer.enums``: every
    member, same names and values)."""

    padding = 1
    causal = 2
    no_mask = 3
    padding_causal = 4
    arbitrary = 5
    causal_bottom_right = 6


# The types that add the causal band (lmfuse's causal band is bottom-right aligned always).
_CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right)


def as_mask_type(value: Any) -> AttnMaskType:
    """Accept lmfuse's enum, Megatron-Core's own enum (matched by name) or a name string."""
    if isinstance(value, AttnMaskType):
        return value
    name = value.name if isinstance(value, enum.Enum) else value
    if isinstance(name, str) and name in AttnMaskType.__members__:
        return AttnMaskType[name]
    raise ValueError(
        f"FusedScaleMaskSoftmax: attn_mask_type must be one of "
        f"{list(AttnMaskType.__members__)} (an AttnMaskType, Megatron's enum or a name), "
        f"got {value!r}"
    )


class FusedScaleMaskSoftmax(nn.Module):
    """Scale → mask → softmax with Megatron-Core's constructor and ``forward``.

    Differences from Megatron-Core, all in the user's favour: every shape and dtype runs
    the fused kernel (no ``sk <= 4096``, no multiples of 4, fp32 too); masked positions
    are excluded exactly (as ``-inf``), so fully masked rows give zeros where Megatron's
    ``mask_func`` fill of -10000 gives a uniform row; ``softmax_offset`` and
    ``window_size`` are fused too; causal alignment is bottom-right, so ``sq < sk`` works.
    One difference that changes results: ``padding_causal`` and ``causal_bottom_right`` add
    the causal band here (as their names say, and as Transformer Engine does), where
    Megatron-Core's own softmax adds it for ``causal`` alone and uses only the given mask
    for every other type. NaN and inf propagate as in :func:`lmfuse.fused_softmax`, which is
    PyTorch's softmax of the masked scores: a NaN or ``+inf`` visible score makes its whole
    row NaN, masked keys included, with zero gradient at the masked keys; masked scores are
    never read.

    Args:
        input_in_fp16, input_in_bf16: Megatron's flags; kept for compatibility (the dtype
            is read from the input).
        attn_mask_type: ``AttnMaskType`` (or Megatron's enum / a name). ``causal``,
            ``padding_causal`` and ``causal_bottom_right`` add the causal band (bottom-right
            aligned for all three); a given ``mask`` is applied for every type.
        scaled_masked_softmax_fusion: ``True`` runs ``impl="auto"`` (Triton on GPU);
            ``False`` runs the plain-PyTorch reference, as Megatron's flag does.
        mask_func: accepted for compatibility and not called; masking is exact.
        softmax_in_fp32: accepted; the math is always float32.
        scale: multiplies the scores first (``None`` = 1).
        window_size: ``(left, right)`` sliding window, ``-1`` = unbounded side, or an int.
    """

    def __init__(
        self,
        input_in_fp16: bool,
        input_in_bf16: bool,
        attn_mask_type: Any,
        scaled_masked_softmax_fusion: bool,
        mask_func: Optional[Callable],
        softmax_in_fp32: bool,
        scale: Optional[float],
        window_size: Optional[tuple[int, int] | int] = None,
    ) -> None:
        super().__init__()
        if input_in_fp16 and input_in_bf16:
            raise ValueError(
                "FusedScaleMaskSoftmax: input_in_fp16 and input_in_bf16 cannot both be True"
            )
        self.input_in_fp16 = input_in_fp16
        self.input_in_bf16 = input_in_bf16
        self.input_in_float16 = input_in_fp16 or input_in_bf16
        self.attn_mask_type = as_mask_type(attn_mask_type)
        self.scaled_masked_softmax_fusion = scaled_masked_softmax_fusion
        self.mask_func = mask_func
        self.softmax_in_fp32 = softmax_in_fp32
        self.scale = scale
        self.window_size = tuple(window_size) if isinstance(window_size, list) else window_size

    @property
    def impl(self) -> str:
        return "auto" if self.scaled_masked_softmax_fusion else "torch"

    def is_kernel_available(self, mask: Optional[torch.Tensor], b: int, np: int, sq: int,
                            sk: int) -> bool:
        """Megatron-Core's question: will ``forward`` run the fused kernel for scores
        ``[b, np, sq, sk]``? Megatron's CUDA kernel needs fp16/bf16, ``16 < sk <= 4096`` and
        multiples of 4; lmfuse's Triton kernel takes every shape and dtype, so the answer is
        whether fusion is asked for (``scaled_masked_softmax_fusion``) and Triton can run
        here (a CUDA device, or Triton's interpreter), whatever the shape."""
        from .._dispatch import interpreter_active, triton_available

        if not self.scaled_masked_softmax_fusion or not triton_available():
            return False
        on_gpu = mask.is_cuda if isinstance(mask, torch.Tensor) else torch.cuda.is_available()
        return on_gpu or interpreter_active()

    def forward(
        self,
        input: torch.Tensor,
        mask: Optional[torch.Tensor],
        softmax_offset: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``input [b, np, sq, sk]``, ``mask`` broadcastable to it (True = masked) or None,
        ``softmax_offset [np]`` or None. Bad input raises naming ``input``, ``mask`` or
        ``softmax_offset``, with the shape or dtype seen and the one expected."""
        check_inputs(input, mask, softmax_offset, op="FusedScaleMaskSoftmax",
                     scores_name="input")
        causal = self.attn_mask_type in _CAUSAL
        if causal and input.shape[2] > input.shape[3]:
            raise ValueError(
                f"FusedScaleMaskSoftmax: attn_mask_type={self.attn_mask_type.name} needs input "
                f"[b, np, sq, sk] with sq <= sk (queries are the last sq of the sk keys), got "
                f"{list(input.shape)}"
            )
        return fused_softmax(
            input, scale=self.scale, mask=mask, causal=causal, window_size=self.window_size,
            softmax_offset=softmax_offset, softmax_in_fp32=self.softmax_in_fp32, impl=self.impl,
        )

    def extra_repr(self) -> str:
        return (f"attn_mask_type={self.attn_mask_type.name}, scale={self.scale}, "
                f"window_size={self.window_size}, impl={self.impl}")
