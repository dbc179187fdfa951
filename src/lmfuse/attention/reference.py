"""Reference decode attention: the specification of ``lmfuse.decode_attention`` and
``lmfuse.merge_attention_states``, in plain PyTorch (float32 math, float64 for float64).

Decode attention reads a KV cache: contiguous ``[B, S_max, Hkv, D]``, or paged ``[num_blocks,
block_len, Hkv, D]`` with ``block_table [B, max_blocks]`` (int32, padded with -1, which is
never read). Sequence ``b`` holds ``cache_seqlens[b]`` tokens; its ``s_active`` query tokens
are the last ones of the cache (positions ``L - s_active + i``) and token ``i`` sees the keys
at positions ``<= L - s_active + i`` (and ``>= that - w`` with ``window_size=w``). Query head
``h`` reads KV head ``h // (Hq // Hkv)`` (GQA).

The log-sum-exp returned is the log of the output's softmax denominator, sink included:
``out = sum_j exp(s_j - lse) v_j``. That makes partial results over disjoint key sets
mergeable exactly (:func:`merge_attention_states_reference`), with the sink counted in one
of them. A token that sees no key (and has no sink) gets zeros and ``lse = -inf``.

NaN and inf stay visible, as in ``softmax(q k^T * scale + mask) v`` computed by PyTorch:

* ``lse`` is :func:`logsumexp` of the token's logits (the scores of the keys it sees, and
  its sink): NaN if one is NaN, ``+inf`` if one is ``+inf`` (even beside a NaN: the
  kernels' running maximum skips NaNs), ``-inf`` if all are ``-inf`` (-inf scores and
  sinks are legitimate: they add nothing).
* ``out`` is NaN where ``lse`` is NaN or ``+inf`` (the softmax is undefined there), zeros
  where it is ``-inf``; elsewhere a NaN or inf in a value row the token sees reaches it.
* Keys and values a token does not see (past the length, outside its window, after its
  own position) never reach it, whatever they hold.
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def gather_cache(cache: torch.Tensor, block_table: Optional[torch.Tensor],
                 length: int, b: int) -> torch.Tensor:
    """Sequence ``b``'s first ``length`` cache rows, ``[length, Hkv, D]``, from a contiguous or
    a paged cache (only the blocks those rows lie in are read)."""
    if block_table is None:
        return cache[b, :length]
    block_len = cache.shape[1]
    blocks = -(-length // block_len)
    ids = block_table[b, :blocks].long()
    if blocks and int(ids.min()) < 0:
        raise ValueError(f"block_table[{b}] has -1 among its first {blocks} blocks, which "
                         f"hold its {length} tokens")
    return cache[ids].reshape(blocks * block_len, *cache.shape[2:])[:length]


def logsumexp(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.logsumexp`` over ``dim``, except that a ``+inf`` entry gives ``+inf`` even
    beside a NaN (the kernels keep a running maximum, which skips NaNs)."""
    return torch.where((x == math.inf).any(dim=dim), math.inf, torch.logsumexp(x, dim=dim))


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    block_table: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    window_size: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    softcap: Optional[float] = None,
):
    """Attention of ``q [B, s_active, Hq, D]`` over the cached keys and values.

    Args:
        k_cache, v_cache: ``[B, S_max, Hkv, D]``, or ``[num_blocks, block_len, Hkv, D]`` with
            ``block_table``; float, or ``float8_e4m3fn`` with ``k_scale``/``v_scale [Hkv]``
            (value = stored * scale).
        cache_seqlens: ``[B]`` tokens in each sequence's cache, the active ones included.
        scale: of ``q . k``; default ``1 / sqrt(D)``.
        window_size: ``w``: a token at position ``p`` sees keys ``p - w .. p``.
        sinks: ``[Hq]`` sink logits, added to the softmax denominator.
        softcap: ``c``: each score ``x = scale * q . k`` becomes ``c * tanh(x / c)``
            (Gemma 2's attention-logit soft-capping); sinks are not capped.
    Returns:
        ``out [B, s_active, Hq, D]`` in q's dtype, and with ``return_lse`` the float32
        (float64) ``lse [B, s_active, Hq]``.
    """
    B, s_active, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    group = Hq // Hkv
    out = torch.zeros((B, s_active, Hq, D), dtype=compute, device=q.device)
    lse = torch.full((B, s_active, Hq), -math.inf, dtype=compute, device=q.device)
    for b in range(B):
        L = int(cache_seqlens[b])
        k = gather_cache(k_cache, block_table, L, b).to(compute)  # [L, Hkv, D]
        v = gather_cache(v_cache, block_table, L, b).to(compute)
        if k_scale is not None:
            k = k * k_scale.to(compute)[None, :, None]
        if v_scale is not None:
            v = v * v_scale.to(compute)[None, :, None]
        k = k.repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        pos = torch.arange(L, device=q.device)
        for i in range(s_active):
            p = L - s_active + i
            seen = pos <= p
            if window_size is not None:
                seen &= pos >= p - window_size
            s = torch.einsum("hd,lhd->hl", q[b, i].to(compute), k) * scale  # [Hq, L]
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            s = s.masked_fill(~seen[None, :], -math.inf)
            if sinks is not None:
                s = torch.cat([s, sinks.to(compute)[:, None]], dim=1)
            row_lse = logsumexp(s, dim=1) if s.shape[1] else lse[b, i]
            finite = torch.isfinite(row_lse)
            prob = torch.exp(s - torch.where(finite, row_lse, 0.0)[:, None])
            prob = torch.where(finite[:, None], prob, 0.0)[:, :L]
            # 0 * NaN is NaN: the values of keys this token does not see are left out.
            row = torch.einsum("hl,lhd->hd", prob, torch.where(seen[:, None, None], v, 0.0))
            undefined = torch.isnan(row_lse) | (row_lse == math.inf)
            out[b, i] = torch.where(undefined[:, None], math.nan, row)
            lse[b, i] = row_lse
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def merge_attention_states_reference(outs: torch.Tensor, lses: torch.Tensor):
    """Merge ``P`` partial results over disjoint key sets: ``outs [P, ..., D]``, ``lses [P,
    ...]`` -> ``(out [..., D] in outs' dtype, lse [...])``, ``lse = logsumexp(lses)``
    (:func:`logsumexp`) and ``out = sum_p exp(lse_p - lse) out_p``. A partial with ``lse_p
    = -inf`` saw no key and contributes nothing, whatever its output holds; if all are
    such, the result is zeros and ``-inf``. A NaN or ``+inf`` partial LSE makes the output
    NaN (and the LSE NaN or ``+inf``); a NaN in another partial's output stays visible."""
    compute = (torch.float64 if torch.float64 in (outs.dtype, lses.dtype) else torch.float32)
    lses = lses.to(compute)
    lse = logsumexp(lses, dim=0)
    finite = torch.isfinite(lse)
    w = torch.exp(lses - torch.where(finite, lse, 0.0)[None])
    terms = torch.where((lses == -math.inf)[..., None], 0.0, w[..., None] * outs.to(compute))
    out = torch.where(finite[..., None], terms.sum(dim=0),
                      torch.where(lse[..., None] == -math.inf, 0.0, math.nan))
    return out.to(outs.dtype), lse


def kv_cache_append_reference(k_cache, v_cache, k_new, v_new, cache_seqlens, *,
                              block_table=None, k_scale=None, v_scale=None) -> None:
    """Write ``k_new``/``v_new [B, s_new, Hkv, D]`` at positions ``cache_seqlens[b] + i`` of a
    contiguous or paged cache, in place. A float8 cache stores ``clamp(x / scale, +-448)``
    rounded to e4m3 (scale 1 when none is given; NaN stays NaN). A paged sequence whose
    block-table row is all -1 is a padding row: nothing is written for it. Raises if a
    position is past the capacity or falls in a block whose id is -1."""
    B, s_new = k_new.shape[:2]
    if block_table is not None and block_table.shape[1]:
        live = (block_table != -1).any(dim=1)
        if not bool(live.all()):
            rows = live.nonzero()[:, 0]
            k_new, v_new = k_new[rows], v_new[rows]
            cache_seqlens, block_table = cache_seqlens[rows], block_table[rows]
            B = k_new.shape[0]
    if B * s_new == 0:
        return
    pos = cache_seqlens.long()[:, None] + torch.arange(s_new, device=k_new.device)[None, :]
    if int(pos.min()) < 0:
        raise ValueError(f"kv_cache_append: cache_seqlens must be >= 0, got "
                         f"{int(cache_seqlens.min())}")
    if block_table is None:
        capacity = k_cache.shape[1]
        if int(pos.max()) >= capacity:
            raise ValueError(f"kv_cache_append: positions up to {int(pos.max())} do not fit a "
                             f"cache of {capacity} rows per sequence")
        index = (torch.arange(B, device=k_new.device)[:, None].expand(B, s_new), pos)
    else:
        block_len = k_cache.shape[1]
        capacity = block_table.shape[1] * block_len
        if int(pos.max()) >= capacity:
            raise ValueError(f"kv_cache_append: positions up to {int(pos.max())} do not fit "
                             f"{block_table.shape[1]} blocks of {block_len} per sequence")
        blk = block_table.long().gather(1, pos // block_len)
        if int(blk.min()) < 0 or int(blk.max()) >= k_cache.shape[0]:
            raise ValueError("kv_cache_append: a new token falls in a block whose id is -1 "
                             f"or outside the pool of {k_cache.shape[0]} blocks")
        index = (blk, pos % block_len)
    for cache, new, s in ((k_cache, k_new, k_scale), (v_cache, v_new, v_scale)):
        x = new.to(torch.float32)
        if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            if s is not None:
                x = x / s.to(torch.float32)[:, None]
            limit = torch.finfo(cache.dtype).max
            x = x.clamp(-limit, limit)
        cache[index] = x.to(cache.dtype)
