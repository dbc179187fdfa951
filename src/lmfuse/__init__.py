"""lmfuse: fused GPU kernels for training and serving large language models.

Every op takes ``impl="auto" | "triton" | "torch"``; :func:`explain` says which path a
call takes and why. See ``DESIGN.md`` for the full API.
"""

from __future__ import annotations

__version__ = "0.1.0"

from ._dispatch import Plan, explain, set_checks
from .activations import (FusedMLP, bias_gelu, geglu, quick_geglu, squared_relu, swiglu,
                          weighted_quick_geglu, weighted_squared_relu, weighted_swiglu)
from .attention import (DecodeAttentionBlock, KVCacheFullError, PagedKVCache, decode_attention,
                        kv_cache_append, merge_attention_states)
from .cross_entropy import cross_entropy, linear_cross_entropy
from .distributed.planner import plan_sharding
from .moe import moe_experts
from .norm import LayerNorm, RMSNorm, layer_norm, rms_norm
from .rope import apply_rotary_pos_emb
from .softmax import AttnMaskType, FusedScaleMaskSoftmax, fused_softmax

__all__ = [
    "AttnMaskType",
    "DecodeAttentionBlock",
    "FusedMLP",
    "FusedScaleMaskSoftmax",
    "KVCacheFullError",
    "LayerNorm",
    "PagedKVCache",
    "Plan",
    "RMSNorm",
    "__version__",
    "apply_rotary_pos_emb",
    "bias_gelu",
    "cross_entropy",
    "decode_attention",
    "explain",
    "fused_softmax",
    "geglu",
    "kv_cache_append",
    "layer_norm",
    "linear_cross_entropy",
    "merge_attention_states",
    "moe_experts",
    "plan_sharding",
    "set_checks",
    "quick_geglu",
    "rms_norm",
    "squared_relu",
    "swiglu",
    "weighted_quick_geglu",
    "weighted_squared_relu",
    "weighted_swiglu",
]
