"""Attention of a Hugging Face model's layers over lmfuse's paged KV cache.

The Generator runs the model's own forward (its embeddings, rotary variants, norms, MLPs
and mixtures of experts stay the model's code) with ``config._attn_implementation`` set
to :data:`ATTENTION_NAME`, registered in ``transformers``' ``AttentionInterface``. Every
attention layer then calls :func:`paged_attention` with its rotated queries and new keys
and values, and the :class:`StepContext` of the forward (passed down as the
``lmfuse_step`` keyword) says where they go:

* a **decode** forward (``[n, 1]`` tokens): the new K/V rows are appended to the layer's
  pool (:func:`lmfuse.kv_cache_append`) and the queries attend over the paged cache with
  :func:`lmfuse.decode_attention` (GQA, sliding windows, sinks, logit softcap, fp8);
* a **prefill** forward (the prompts packed into one ``[1, T]`` row, each a segment):
  every token's K/V row is written to its block, then each segment's queries attend
  causally over its sequence (the fresh keys, or the cached prefix plus them when the
  prompt shares blocks with another sequence), through :func:`prefill_attention`.

The layer's options arrive as ``transformers`` passes them: ``scaling``,
``sliding_window`` (a window of ``w`` keys, the query's own included: lmfuse's
``window_size = w - 1``), ``softcap`` (Gemma 2) and ``s_aux`` (GPT-OSS's sinks).
No mask is built: the interface's mask function is absent, so ``transformers`` passes
``attention_mask=None``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ..attention.kv_cache import PagedKVCache
from ..attention.ops import decode_attention, kv_cache_append
from .._collectives import all_gather_stacked, group_rank, group_size
from ..distributed.cp import cp_cache_append, cp_decode_attention
from ..distributed.kvdp import kvdp_decode_attention

ATTENTION_NAME = "lmfuse_paged"
# Query rows of one prefill attention chunk: bounds the float32 scores it holds
# ([Hq, rows, context]) on the general path.
_PREFILL_SCORES = 1 << 26


@dataclass
class Segment:
    """One sequence of a packed prefill: its tokens ``[start, stop)`` of the row, the
    ``cached`` tokens of its sequence before them, and its block ids (a ``[blocks]`` int64
    tensor on the cache's device)."""

    start: int
    stop: int
    cached: int
    blocks: torch.Tensor


@dataclass
class StepContext:
    """What :func:`paged_attention` needs for one forward of the model."""

    cache: PagedKVCache
    kind: str  # "decode" or "prefill"
    impl: str = "auto"
    # decode: [n, width] block table, lengths before and after this step's token
    block_table: torch.Tensor | None = None
    seqlens_before: torch.Tensor | None = None
    seqlens: torch.Tensor | None = None
    # prefill: per token of the packed row, its block (a one-column table) and offset
    token_blocks: torch.Tensor | None = None
    token_offsets: torch.Tensor | None = None
    token_rows: torch.Tensor | None = None  # the rows stored here (None: all of them)
    segments: list[Segment] = field(default_factory=list)
    # context parallel (decode): the CP group, its round-robin block, and the global
    # lengths before and after the step (block_table / seqlens are this rank's shard's)
    cp_group: Any = None
    cp_block: int = 1
    global_before: torch.Tensor | None = None
    global_after: torch.Tensor | None = None
    # KV data parallel (decode): the group; block_table / seqlens are this rank's m padded
    # rows; own_rows: the model rows of its sequences (its first rows); pad_src: the model
    # row of each of the N * m rank-major rows (padding: 0); out_index: each model row's
    # place among them
    kvdp_group: Any = None
    own_rows: torch.Tensor | None = None
    pad_src: torch.Tensor | None = None
    out_index: torch.Tensor | None = None


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: Any, scaling: float | None = None,
                    dropout: float = 0.0, sliding_window: int | None = None,
                    softcap: float | None = None, s_aux: torch.Tensor | None = None,
                    lmfuse_step: StepContext | None = None,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` function: ``query [B, Hq, S, D]``, ``key``/``value [B,
    Hkv, S, D]`` (after rotary) -> ``[B, S, Hq, D]``."""
    if lmfuse_step is None:
        raise RuntimeError(f"attention implementation {ATTENTION_NAME!r} runs inside "
                           "lmfuse.serving.Generator steps only")
    layer = module.layer_idx
    window = None if sliding_window is None else max(int(sliding_window) - 1, 0)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    ctx = lmfuse_step
    cache = ctx.cache
    kc, vc = cache.k_caches[layer], cache.v_caches[layer]
    ks, vs = cache.k_scales[layer], cache.v_scales[layer]
    opts = dict(scale=scaling, window_size=window, sinks=s_aux, softcap=softcap)
    if ctx.kind == "decode" and ctx.kvdp_group is not None:
        return _kvdp_decode(ctx, q, k, v, kc, vc, ks, vs, opts), None
    if ctx.kind == "decode" and ctx.cp_group is not None:
        # The rank writes the new tokens it owns and attends over its share of every
        # sequence; the partials are merged across the group (one all-gather).
        cp_cache_append(kc, vc, k, v, ctx.global_before, group=ctx.cp_group,
                        block_table_shard=ctx.block_table, cp_block=ctx.cp_block,
                        k_scale=ks, v_scale=vs, impl=ctx.impl)
        out = cp_decode_attention(q, kc, vc, ctx.seqlens, group=ctx.cp_group,
                                  block_table_shard=ctx.block_table, cp_block=ctx.cp_block,
                                  cache_seqlens=ctx.global_after, k_scale=ks, v_scale=vs,
                                  impl=ctx.impl, **opts)
        return out, None
    if ctx.kind == "decode":
        kv_cache_append(kc, vc, k, v, ctx.seqlens_before, block_table=ctx.block_table,
                        k_scale=ks, v_scale=vs, impl=ctx.impl)
        out = decode_attention(q, kc, vc, ctx.seqlens, block_table=ctx.block_table,
                               k_scale=ks, v_scale=vs, impl=ctx.impl, **opts)
        return out, None
    # Prefill: one row of T packed tokens; each token's K/V row is a one-token "sequence"
    # of a one-column block table (its block), written at its offset in that block.
    k_rows, v_rows = k[0].contiguous(), v[0].contiguous()  # [T, Hkv, D]
    k_w, v_w = k_rows, v_rows
    if ctx.token_rows is not None:  # a CP rank stores the tokens it owns
        k_w, v_w = k_rows.index_select(0, ctx.token_rows), v_rows.index_select(0, ctx.token_rows)
    kv_cache_append(kc, vc, k_w[:, None], v_w[:, None], ctx.token_offsets,
                    block_table=ctx.token_blocks, k_scale=ks, v_scale=vs, impl=ctx.impl)
    out = torch.empty_like(q[0])
    for seg in ctx.segments:
        if seg.cached:
            keys = _gather(kc, ks, seg.blocks, seg.stop - seg.start + seg.cached, q.dtype)
            values = _gather(vc, vs, seg.blocks, seg.stop - seg.start + seg.cached, q.dtype)
        else:  # the whole sequence is in this forward
            keys, values = k_rows[seg.start:seg.stop], v_rows[seg.start:seg.stop]
        out[seg.start:seg.stop] = prefill_attention(q[0, seg.start:seg.stop], keys, values,
                                                    **opts)
    return out[None], None


def _kvdp_decode(ctx: StepContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kc: torch.Tensor, vc: torch.Tensor, ks: Any, vs: Any,
                 opts: dict[str, Any]) -> torch.Tensor:
    """A decode layer over a cache split by batch: the owner appends each new token; the
    rows go rank-major into ``kvdp_decode_attention`` with this rank's query heads; the
    heads of every rank are gathered back and the rows put in the model's order."""
    group = ctx.kvdp_group
    world, rank = group_size(group), group_rank(group)
    c = ctx.own_rows.shape[0]
    if c:
        kv_cache_append(kc, vc, k.index_select(0, ctx.own_rows), v.index_select(0, ctx.own_rows),
                        ctx.seqlens_before[:c], block_table=ctx.block_table[:c], k_scale=ks,
                        v_scale=vs, impl=ctx.impl)
    n, S, Hq, D = q.shape
    heads = Hq // world
    rows = q.index_select(0, ctx.pad_src)[:, :, rank * heads:(rank + 1) * heads]
    mine = kvdp_decode_attention(rows, kc, vc, ctx.seqlens, group=group,
                                 block_table_local=ctx.block_table, k_scale=ks, v_scale=vs,
                                 impl=ctx.impl, **opts)  # [N m, S, Hq / N, D]
    every = all_gather_stacked(mine, group)  # [N, N m, S, Hq / N, D]
    full = every.permute(1, 2, 0, 3, 4).reshape(-1, S, Hq, D)
    return full.index_select(0, ctx.out_index)


def _gather(pool: torch.Tensor, scale: torch.Tensor | None, blocks: torch.Tensor,
            length: int, dtype: torch.dtype) -> torch.Tensor:
    """The first ``length`` rows ``[length, Hkv, D]`` of a sequence, from its blocks of a
    layer's pool, dequantised to ``dtype``."""
    rows = pool.index_select(0, blocks).flatten(0, 1)[:length]
    if scale is not None:
        return (rows.float() * scale.float()[:, None]).to(dtype)
    return rows.to(dtype)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      scale: float | None = None, window_size: int | None = None,
                      sinks: torch.Tensor | None = None,
                      softcap: float | None = None) -> torch.Tensor:
    """Causal attention of ``n`` new tokens over their sequence's ``L >= n`` keys (the new
    ones last): ``q [n, Hq, D]``, ``k``/``v [L, Hkv, D]`` -> ``[n, Hq, D]`` in q's dtype.
    Query ``i`` is at position ``L - n + i`` and sees keys ``<=`` it (and ``>= pos -
    window_size``); ``sinks [Hq]`` join each denominator; ``softcap`` caps the scores.
    ``decode_attention``'s semantics for many active tokens. On CUDA without sinks or
    softcap, PyTorch's SDPA with a boolean mask; otherwise float32 scores, a chunk of
    queries at a time."""
    n, Hq, D = q.shape
    L, Hkv = k.shape[0], k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    pos = torch.arange(L - n, L, device=q.device)[:, None]
    keys = torch.arange(L, device=q.device)[None, :]
    if q.is_cuda and sinks is None and softcap is None:
        seen = keys <= pos
        if window_size is not None:
            seen = seen & (keys >= pos - window_size)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None].to(q.dtype),
            v.transpose(0, 1)[None].to(q.dtype), attn_mask=seen, scale=scale,
            enable_gqa=Hq != Hkv)
        return out[0].transpose(0, 1)
    G = Hq // Hkv
    kf = k.float().transpose(0, 1)  # [Hkv, L, D]
    vf = v.float().transpose(0, 1)
    out = torch.empty((n, Hq, D), dtype=q.dtype, device=q.device)
    rows = max(1, _PREFILL_SCORES // max(1, Hq * L))
    for a in range(0, n, rows):
        b = min(n, a + rows)
        qf = q[a:b].float().transpose(0, 1).reshape(Hkv, G * (b - a), D)
        s = torch.bmm(qf, kf.transpose(1, 2)).view(Hkv, G, b - a, L) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        seen = keys <= pos[a:b]
        if window_size is not None:
            seen = seen & (keys >= pos[a:b] - window_size)
        s = s.masked_fill(~seen, float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(Hkv, G, 1, 1).expand(Hkv, G, b - a, 1)
            s = torch.cat([s, sink], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :L]
        o = torch.bmm(p.reshape(Hkv, G * (b - a), L), vf).view(Hkv, G, b - a, D)
        out[a:b] = o.permute(2, 0, 1, 3).reshape(b - a, Hq, D).to(q.dtype)
    return out


@functools.cache
def register() -> None:
    """Add :func:`paged_attention` to ``transformers``' ``AttentionInterface`` (once)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
