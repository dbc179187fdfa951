"""Fused RMSNorm, forward and backward: ``rms_norm`` and the ``RMSNorm`` module (Llama's
``weight`` or Gemma's ``1 + weight`` scale)."""

from .module import RMSNorm
from .ops import rms_norm

__all__ = ["RMSNorm", "rms_norm"]
