"""Fused activations: bias-GELU, SwiGLU, GEGLU, Quick-GEGLU, squared ReLU and their
per-token-weighted (MoE) forms, forward and backward, with optional float8 or CPU storage
of the input kept for backward."""

from .mlp import FusedMLP
from .ops import (bias_gelu, geglu, quick_geglu, squared_relu, swiglu, weighted_quick_geglu,
                  weighted_squared_relu, weighted_swiglu)

__all__ = ["FusedMLP", "bias_gelu", "geglu", "quick_geglu", "squared_relu", "swiglu",
           "weighted_quick_geglu", "weighted_squared_relu", "weighted_swiglu"]
