"""Decode attention over contiguous and paged KV caches: ``reference.py`` (the spec),
``decode_kernels.py`` (Triton), ``ops.py`` (validation, dispatch, launches)."""

from .ops import decode_attention, kv_cache_append, merge_attention_states

__all__ = ["decode_attention", "kv_cache_append", "merge_attention_states"]
