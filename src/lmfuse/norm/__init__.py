"""Fused RMSNorm and LayerNorm, forward and backward: ``rms_norm`` and the ``RMSNorm``
module (Llama's ``weight`` or Gemma's ``1 + weight`` scale), ``layer_norm`` and the
``LayerNorm`` module (``torch.nn.LayerNorm``'s, with an optional zero-centred scale)."""

from .module import LayerNorm, RMSNorm
from .ops import layer_norm, rms_norm

__all__ = ["LayerNorm", "RMSNorm", "layer_norm", "rms_norm"]
