"""Decode attention over contiguous and paged KV caches: ``reference.py`` (the spec),
``decode_kernels.py`` (Triton), ``ops.py`` (validation, dispatch, launches), ``kv_cache.py``
(the paged cache: block pool, block tables, copy-on-write), ``block.py`` with
``block_kernels.py`` (the whole attention block of a decoding step)."""

from .block import DecodeAttentionBlock
from .kv_cache import DecodeStep, KVCacheFullError, PagedKVCache
from .ops import decode_attention, kv_cache_append, merge_attention_states

__all__ = ["DecodeAttentionBlock", "DecodeStep", "KVCacheFullError", "PagedKVCache",
           "decode_attention", "kv_cache_append", "merge_attention_states"]
