"""Reference decode attention: the specification of ``lmfuse.decode_attention``,
``lmfuse.merge_attention_states``, the cache append and the decode-attention block
(``DecodeAttentionBlock``: rotary, qk-norm, append, attention; at the end of this file), in
plain PyTorch (float32 math, float64 for float64).

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
import torch.nn.functional as F

from ..norm.reference import rms_norm_reference, rms_norm_unrounded


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


def _key_weights(s: torch.Tensor, sinks: Optional[torch.Tensor]):
    """The softmax of scores ``s [..., Hq, keys]`` (masked keys at -inf) with the sinks
    ``[Hq]`` in its denominator: ``(weights [..., Hq, keys], lse [..., Hq], undefined)``,
    the weights 0 where the LSE is not finite, ``undefined`` where it is NaN or +inf (the
    output is NaN there)."""
    keys = s.shape[-1]
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype)[:, None].expand(*s.shape[:-1], 1)], dim=-1)
    lse = logsumexp(s, dim=-1)
    finite = torch.isfinite(lse)
    prob = torch.exp(s - torch.where(finite, lse, 0.0)[..., None])
    prob = torch.where(finite[..., None], prob, 0.0)[..., :keys]
    return prob, lse, torch.isnan(lse) | (lse == math.inf)


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
            # The keys this token does not see are zeroed before the product, not only
            # masked after it: a NaN among them would reach the gradients (0 * NaN).
            s = torch.einsum("hd,lhd->hl", q[b, i].to(compute),
                             torch.where(seen[:, None, None], k, 0.0)) * scale  # [Hq, L]
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            s = s.masked_fill(~seen[None, :], -math.inf)
            prob, row_lse, undefined = _key_weights(s, sinks)
            # 0 * NaN is NaN: the values of keys this token does not see are left out.
            row = torch.einsum("hl,lhd->hd", prob, torch.where(seen[:, None, None], v, 0.0))
            out[b, i] = torch.where(undefined[:, None], math.nan, row)
            lse[b, i] = row_lse
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def decode_attention_traceable(
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
    """:func:`decode_attention_reference` without reading a length on the host, for
    ``torch.compile`` to trace (with autograd: the reference's loops read each sequence's
    length and so break a full graph): the whole batch over every row the cache holds per
    sequence (``S_max``, or the block table's width in blocks), the rows a token does not
    see masked, as the reference masks them (zeroed before both products, so a NaN there
    reaches neither the result nor a gradient). The same values within a rounding; memory
    ``[B, s_active, rows, Hq, D]`` (the keys each token sees), where the reference takes
    one sequence's rows at a time. Block ids are not checked (a -1 among the blocks a
    sequence's length covers is read as block 0: the eager call checks them first)."""
    B, s_active, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    _assert_reads("decode_attention", cache_seqlens.long(), k_cache, block_table, k_scale,
                  v_scale)
    if block_table is None:
        k, v = k_cache, v_cache
    else:
        ids = block_table.long().clamp(0, k_cache.shape[0] - 1)
        k, v = k_cache[ids].flatten(1, 2), v_cache[ids].flatten(1, 2)
    k, v = k.to(compute), v.to(compute)  # [B, rows, Hkv, D]
    if k_scale is not None:
        k = k * k_scale.to(compute)[:, None]
    if v_scale is not None:
        v = v * v_scale.to(compute)[:, None]
    group = Hq // Hkv
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    rows = k.shape[1]
    pos = torch.arange(rows, device=q.device)
    token = (cache_seqlens.long()[:, None] - s_active
             + torch.arange(s_active, device=q.device)[None, :])  # [B, s_active]
    seen = pos[None, None, :] <= token[:, :, None]  # [B, s_active, rows]
    if window_size is not None:
        seen &= pos[None, None, :] >= token[:, :, None] - window_size
    mask = seen[..., None, None]  # [B, s_active, rows, 1, 1]
    s = torch.einsum("bihd,bilhd->bihl", q.to(compute),
                     torch.where(mask, k[:, None], 0.0)) * scale  # [B, s_active, Hq, rows]
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~seen[:, :, None, :], -math.inf)
    prob, lse, undefined = _key_weights(s, sinks)  # lse [B, s_active, Hq]
    out = torch.einsum("bihl,bilhd->bihd", prob, torch.where(mask, v[:, None], 0.0))
    out = torch.where(undefined[..., None], math.nan, out).to(q.dtype)
    return (out, lse) if return_lse else out


def merge_attention_states_reference(outs: torch.Tensor, lses: torch.Tensor,
                                     out_dtype: Optional[torch.dtype] = None):
    """Merge ``P`` partial results over disjoint key sets: ``outs [P, ..., D]``, ``lses [P,
    ...]`` -> ``(out [..., D] in out_dtype (default outs' dtype; the float32 merge rounded
    once to it), lse [...])``, ``lse = logsumexp(lses)``
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
    return out.to(outs.dtype if out_dtype is None else out_dtype), lse


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
    capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
    if int(pos.max()) >= capacity:
        raise ValueError(f"kv_cache_append: positions up to {int(pos.max())} do not fit the "
                         f"cache's {capacity} rows per sequence")
    if block_table is None:
        index = (torch.arange(B, device=k_new.device)[:, None].expand(B, s_new), pos)
    else:
        block_len = k_cache.shape[1]
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


def _scales_ok(*scales: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Whether every given fp8 scale is finite and > 0 (a bool tensor), None for none."""
    ok = None
    for sc in scales:
        if sc is not None:
            good = (torch.isfinite(sc) & (sc > 0)).all()
            ok = good if ok is None else ok & good
    return ok


def _assert_reads(op: str, lengths: torch.Tensor, k_cache: torch.Tensor,
                  block_table: Optional[torch.Tensor], k_scale, v_scale) -> None:
    """The eager call's value checks of what a traced decode reads, as one run-time
    assertion (``torch._assert_async``; a RuntimeError, not lmfuse's ValueError):
    ``0 <= lengths[b] <= capacity``, the blocks holding each sequence's tokens in the
    pool, fp8 scales finite and > 0."""
    if block_table is None:
        capacity = k_cache.shape[1]
        ok = ((lengths >= 0) & (lengths <= capacity)).all()
    else:
        block_len, columns = k_cache.shape[1], block_table.shape[1]
        capacity = block_len * columns
        ok = ((lengths >= 0) & (lengths <= capacity)).all()
        stop = (lengths.clamp(0, capacity) + block_len - 1) // block_len
        covered = torch.arange(columns, device=lengths.device)[None, :] < stop[:, None]
        ids = block_table.long()
        ok &= ~(covered & ((ids < 0) | (ids >= k_cache.shape[0]))).any()
    scales = _scales_ok(k_scale, v_scale)
    if scales is not None:
        ok &= scales
    torch._assert_async(ok, f"{op}: a length outside [0, {capacity}], a block id outside the "
                            f"pool among a sequence's blocks, or an fp8 scale not finite and "
                            f"> 0 (the eager call names which)")


def kv_cache_append_traceable(k_cache, v_cache, k_new, v_new, cache_seqlens, *,
                              block_table=None, k_scale=None, v_scale=None) -> None:
    """:func:`kv_cache_append_reference` without reading a length or an id on the host, for
    ``torch.compile`` to trace (with autograd, where the reference's checks break a full
    graph): the new rows scattered into each cache through a copy with one spare row, which
    a padding sequence's rows (block-table row all -1) are written to, then copied back in
    place (two copies of each cache a call: for the compiled reference path, not for
    serving). What the eager call checks (a negative length, a position past the
    capacity, a new row in a block outside the pool, an fp8 scale not finite and > 0)
    fails one assertion at run time (``torch._assert_async``: a RuntimeError, not
    lmfuse's ``ValueError``)."""
    B, s_new = k_new.shape[:2]
    if B * s_new == 0:
        return
    dev = k_new.device
    lengths = cache_seqlens.long()
    pos = lengths[:, None] + torch.arange(s_new, device=dev)[None, :]
    rows = k_cache.shape[0] * k_cache.shape[1]
    ok = (lengths >= 0).all()
    # A row the assertion refuses goes to the spare row too, whenever the assertion runs.
    if block_table is None:
        capacity = k_cache.shape[1]
        fits = (pos >= 0) & (pos < capacity)
        ok &= fits.all()
        flat = torch.where(fits, torch.arange(B, device=dev)[:, None] * capacity + pos, rows)
    else:
        block_len, columns = k_cache.shape[1], block_table.shape[1]
        capacity = block_len * columns
        live = ((block_table != -1).any(dim=1) if columns
                else torch.zeros(B, dtype=torch.bool, device=dev))[:, None]
        blk = block_table.long().gather(1, (pos // block_len).clamp(0, max(columns - 1, 0)))
        fits = (pos >= 0) & (pos < capacity) & (blk >= 0) & (blk < k_cache.shape[0])
        ok &= (~live | fits).all()
        flat = torch.where(live & fits, blk * block_len + pos % block_len, rows)
    scales = _scales_ok(k_scale, v_scale)
    if scales is not None:
        ok &= scales
    torch._assert_async(ok, f"kv_cache_append: a negative length, a new row past the capacity "
                            f"of {capacity} or in a block outside the pool, or an fp8 scale "
                            f"not finite and > 0 (the eager call names which)")
    for cache, new, s in ((k_cache, k_new, k_scale), (v_cache, v_new, v_scale)):
        x = new.to(torch.float32)
        if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            if s is not None:
                x = x / s.to(torch.float32)[:, None]
            limit = torch.finfo(cache.dtype).max
            x = x.clamp(-limit, limit)
        spare = torch.cat([cache.flatten(0, 1), cache.new_zeros((1, *cache.shape[2:]))])
        spare = spare.index_put((flat.reshape(-1),), x.to(cache.dtype).flatten(0, 1))
        cache.copy_(spare[:rows].view(cache.shape))


# --- the decode-attention block (attention/block.py): its specification -------------------


def rope_inv_freq(rotary_dim: int, theta: float = 10000.0,
                  device: Optional[torch.device] = None) -> torch.Tensor:
    """The rotary embedding's frequencies ``inv_freq[j] = theta ** (-2j / rotary_dim)``,
    ``[rotary_dim // 2]`` float32, formed as Hugging Face's Llama forms them (in float32, on
    the CPU, so every device gets the same bits)."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (theta ** exponent)
    return inv_freq if device is None else inv_freq.to(device)


def rope_reference(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                   interleaved: bool = False) -> torch.Tensor:
    """Rotary embedding of ``x [B, s, H, D]`` at ``positions [B, s]``, returned in x's
    dtype, computed in float32 (float64 for float64 x).

    The angle of pair ``j`` is the float32 product ``float(position) * inv_freq[j]``; its
    cosine and sine are taken of that float32 angle (rounding the angle to a half dtype
    first would move it by up to half a radian at position 256). Pair ``j`` is ``(j, j +
    R/2)`` ("rotate half", GPT-NeoX / Llama) or ``(2j, 2j + 1)`` (``interleaved``, GPT-J),
    for ``R = 2 * len(inv_freq)`` rotary dims; ``(a, b) -> (a cos - b sin, b cos + a
    sin)``; dims past ``R`` pass through."""
    R = 2 * inv_freq.numel()
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    angle = positions.to(torch.float32)[:, :, None, None] * inv_freq.float()  # [B,s,1,R/2]
    c, s = angle.to(compute).cos(), angle.to(compute).sin()
    xc = x.to(compute)
    if interleaved:
        x1, x2 = xc[..., 0:R:2], xc[..., 1:R:2]
    else:
        x1, x2 = xc[..., :R // 2], xc[..., R // 2:R]
    y1, y2 = x1 * c - x2 * s, x2 * c + x1 * s
    rot = torch.stack((y1, y2), -1).flatten(-2) if interleaved else torch.cat((y1, y2), -1)
    return torch.cat((rot, xc[..., R:]), -1).to(x.dtype)


def default_positions(cache_seqlens: torch.Tensor, s_active: int) -> torch.Tensor:
    """``[B, s_active]``: token ``i`` of sequence ``b`` is at ``cache_seqlens[b] + i``."""
    return (cache_seqlens.long()[:, None]
            + torch.arange(s_active, device=cache_seqlens.device)[None, :])


def qk_norm_rope_append_reference(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    q_norm_weight: Optional[torch.Tensor] = None,
    k_norm_weight: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    inv_freq: Optional[torch.Tensor] = None,
    rope_interleaved: bool = False,
    positions: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The fused stage's specification (see :func:`qk_norm_rope_append`): returns ``q [B,
    s_active, Hq, D]`` in qkv's dtype and writes k (float32, rounded once into the cache)
    and v at positions ``cache_seqlens[b] + i``. Raises where the cache has no room (the
    Triton path skips such rows instead)."""
    B, s_active, width = qkv.shape
    Hq, Hkv = num_heads, num_kv_heads
    D = width // (Hq + 2 * Hkv)
    compute = torch.float64 if qkv.dtype == torch.float64 else torch.float32
    x = qkv.to(compute).view(B, s_active, Hq + 2 * Hkv, D)
    q, k, v = x[:, :, :Hq], x[:, :, Hq:Hq + Hkv], x[:, :, Hq + Hkv:]
    if q_norm_weight is not None:
        q = rms_norm_unrounded(q, q_norm_weight, eps=eps)
    if k_norm_weight is not None:
        k = rms_norm_unrounded(k, k_norm_weight, eps=eps)
    if inv_freq is not None:
        pos = default_positions(cache_seqlens, s_active) if positions is None else positions
        q = rope_reference(q, pos, inv_freq, rope_interleaved)
        k = rope_reference(k, pos, inv_freq, rope_interleaved)
    append = (kv_cache_append_traceable if torch.compiler.is_compiling()
              else kv_cache_append_reference)
    append(k_cache, v_cache, k, v, cache_seqlens, block_table=block_table, k_scale=k_scale,
           v_scale=v_scale)
    return q.to(qkv.dtype)


def decode_attention_block_reference(
    x: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    qkv_weight: torch.Tensor,
    out_weight: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    qkv_bias: Optional[torch.Tensor] = None,
    out_bias: Optional[torch.Tensor] = None,
    input_norm_weight: Optional[torch.Tensor] = None,
    q_norm_weight: Optional[torch.Tensor] = None,
    k_norm_weight: Optional[torch.Tensor] = None,
    norm_eps: float = 1e-6,
    rope: bool = True,
    rotary_dim: Optional[int] = None,
    rope_theta: float = 10000.0,
    rope_interleaved: bool = False,
    scale: Optional[float] = None,
    window_size: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
    positions: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The decode-attention block in plain PyTorch (float32 math): the specification of
    :class:`DecodeAttentionBlock` and its ``impl="torch"`` path.

    ``x [B, s_active, hidden]``; ``qkv_weight [(Hq + 2 Hkv) * D, hidden]`` (q heads, then k
    heads, then v heads); ``out_weight [hidden, Hq * D]``; a norm weight of ``None`` leaves
    that norm out. The caches hold ``cache_seqlens[b]`` tokens *before* the step; the
    ``s_active`` new keys and values are written at ``cache_seqlens[b] + i`` (in place) and
    the attention runs over ``cache_seqlens + s_active`` tokens. ``positions [B, s_active]``
    are the rotary positions (default ``cache_seqlens[b] + i``). Returns ``y [B, s_active,
    hidden]`` in x's dtype.
    """
    B, s_active, _ = x.shape
    Hq, Hkv = num_heads, num_kv_heads
    D = qkv_weight.shape[0] // (Hq + 2 * Hkv)
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32

    def linear(t, w, b):
        return F.linear(t.to(compute), w.to(compute),
                        None if b is None else b.to(compute)).to(x.dtype)

    h = x
    if input_norm_weight is not None:
        h = rms_norm_reference(x, input_norm_weight, eps=norm_eps)
    qkv = linear(h, qkv_weight, qkv_bias)
    inv_freq = rope_inv_freq(D if rotary_dim is None else rotary_dim, rope_theta,
                             x.device) if rope else None
    q = qk_norm_rope_append_reference(
        qkv, k_cache, v_cache, cache_seqlens, num_heads=Hq, num_kv_heads=Hkv,
        q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, eps=norm_eps,
        inv_freq=inv_freq, rope_interleaved=rope_interleaved, positions=positions,
        block_table=block_table, k_scale=k_scale, v_scale=v_scale)
    attend = (decode_attention_traceable if torch.compiler.is_compiling()
              else decode_attention_reference)
    attn = attend(q, k_cache, v_cache, cache_seqlens + s_active, block_table=block_table,
                  scale=scale, window_size=window_size, sinks=sinks, k_scale=k_scale,
                  v_scale=v_scale)
    return linear(attn.reshape(B, s_active, Hq * D), out_weight, out_bias)
