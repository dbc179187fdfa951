"""Decode attention over contiguous and paged KV caches (issue in progress: so far the
reference, ``reference.py``, which specifies ``decode_attention`` and
``merge_attention_states``; the kernels, the public functions, the cache allocator and the
attention block follow)."""
