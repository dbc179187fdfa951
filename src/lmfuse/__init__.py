"""lmfuse: fused GPU kernels for training and serving large language models.

Every op takes ``impl="auto" | "triton" | "torch"``; :func:`explain` says which path a
call takes and why. See ``DESIGN.md`` for the full API.
"""

from __future__ import annotations

__version__ = "0.1.0"

from ._dispatch import Plan, explain
from .activations import (FusedMLP, bias_gelu, geglu, quick_geglu, squared_relu, swiglu,
                          weighted_quick_geglu, weighted_squared_relu, weighted_swiglu)
from .cross_entropy import cross_entropy, linear_cross_entropy
from .softmax import AttnMaskType, FusedScaleMaskSoftmax, fused_softmax

__all__ = [
    "AttnMaskType",
    "FusedMLP",
    "FusedScaleMaskSoftmax",
    "Plan",
    "__version__",
    "bias_gelu",
    "cross_entropy",
    "explain",
    "fused_softmax",
    "geglu",
    "linear_cross_entropy",
    "quick_geglu",
    "squared_relu",
    "swiglu",
    "weighted_quick_geglu",
    "weighted_squared_relu",
    "weighted_swiglu",
]
