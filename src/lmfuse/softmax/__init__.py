"""Fused scale → mask → softmax: ``fused_softmax`` and Megatron's ``FusedScaleMaskSoftmax``."""

from .module import AttnMaskType, FusedScaleMaskSoftmax
from .ops import fused_softmax
from .reference import fused_softmax_reference

__all__ = ["AttnMaskType", "FusedScaleMaskSoftmax", "fused_softmax", "fused_softmax_reference"]
