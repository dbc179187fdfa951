"""lmfuse: fused GPU kernels for training and serving large language models.

Every op takes ``impl="auto" | "triton" | "torch"``; :func:`explain` says which path a
call takes and why. See ``DESIGN.md`` for the full API.
"""

from __future__ import annotations

__version__ = "0.1.0"

from ._dispatch import Plan, explain
from .cross_entropy import cross_entropy, linear_cross_entropy
from .softmax import AttnMaskType, FusedScaleMaskSoftmax, fused_softmax

__all__ = [
    "AttnMaskType",
    "FusedScaleMaskSoftmax",
    "Plan",
    "__version__",
    "cross_entropy",
    "explain",
    "fused_softmax",
    "linear_cross_entropy",
]
