"""Context parallelism (CP) for decode attention: every rank of a group holds a slice of
every sequence's context, and one all-gather merges the ranks' partial results exactly.

Layout: round-robin blocks of ``cp_block`` tokens. Global position ``p`` of a sequence
lives on rank ``(p // cp_block) % W`` at local position ``(p // (cp_block * W)) * cp_block
+ p % cp_block``. A rank's local positions are dense and in global order, so its shard is
an ordinary cache (contiguous ``[B, S_local, Hkv, D]``, or its own block pool with its own
``[B, max_blocks]`` table) holding :func:`cp_shard_seqlens` tokens of each sequence. Round
robin (rather than one contiguous range per rank) keeps the ranks' memory and work even
whatever the sequences' lengths, and spreads the appends.

Exactness. Active token ``i`` of a sequence of ``L`` tokens sits at global position ``P_i
= L - s_active + i`` and sees the keys at positions ``<= P_i``. On a rank, the local keys
of global position ``<= P_0`` (the first active token's) form a prefix ``[0, len0)`` that
every active token sees: one ``decode_attention`` call with ``s_active = 1`` covers it for
all active tokens at once (they are folded into the head dim, so each KV tile is still read
once for all of them). The rank's other local keys are its share of the positions ``P_0 +
1 .. L - 1`` -- at most ``s_active - 1`` of them, which are visible to some active tokens
and not others (the active tokens may straddle ranks in any way); they are attended to
exactly, with a per-token causal mask, in a tiny float32 step (``s_active - 1`` keys). The
two partials are merged locally, then the ranks' partials (output and LSE, packed in one
float32 tensor) with one all-gather and :func:`~lmfuse.merge_attention_states`. Sinks are
counted on rank 0 only. Sliding windows are not supported with more than one rank (a
window's start maps to no fixed local window under round robin; a sliding-window layer's
context is bounded and needs no CP).

Lengths. :func:`cp_decode_attention` takes, like ``decode_attention`` on the shard, the
shard's own token counts ``seqlens_shard [B]`` (:func:`cp_shard_seqlens` of the global
lengths). Those alone cannot say where the active tokens are: that needs the global
lengths, which the caller passes as ``cache_seqlens=`` (the same on every rank; a scheduler
knows them) or the op derives with one all-reduce (sum) of the counts over the group, every
token being held by exactly one rank. With one active token the counts are enough (the
token sees every key its rank holds): no all-reduce, and ``cache_seqlens`` goes unused
beyond ``check_ranks``' checks. :func:`cp_cache_append` places new tokens by their
global positions, so it takes the global lengths and issues no collective.

Neither op has a backward (the collectives are not differentiable).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from .._dispatch import check_int, check_tensor, select_impl, value_checks
from .._launch import INDEX_DTYPES, KERNEL_DTYPES
from ..attention.ops import (check_cache, check_decode_values, check_seqlens, decode_attention,
                             decode_attention_partials, kv_cache_append, merge_attention_states,
                             plan_decode_attention)
from .checks import (check_lengths, check_no_grad, check_on_all_ranks, dtype_code, float_code,
                     meta_device, wrap_errors)
from .._collectives import (all_gather_stacked, all_reduce_sum, check_group, group_rank,
                            group_size)

# --- layout ---------------------------------------------------------------------------------


def _local_count(positions: torch.Tensor, rank: int, world: int, cp_block: int) -> torch.Tensor:
    """How many of the global positions ``0 .. x - 1`` rank ``rank`` holds, for each ``x`` of
    ``positions`` (int64, clamped at 0)."""
    x = positions.clamp(min=0)
    cycle = cp_block * world
    return (x // cycle) * cp_block + (x % cycle - rank * cp_block).clamp(0, cp_block)


def cp_shard_seqlens(cache_seqlens: torch.Tensor, *, group: Any,
                     cp_block: int = 1) -> torch.Tensor:
    """``[B]`` int64: how many tokens of each sequence this rank's shard holds, for global
    lengths ``cache_seqlens [B]`` (what a rank reserves in its own pool, and the
    ``seqlens_shard`` that :func:`cp_decode_attention` takes)."""
    op = "cp_shard_seqlens"
    check_group(op, "group", group)
    check_tensor(op, "cache_seqlens", cache_seqlens, ndim=1, dtypes=INDEX_DTYPES)
    check_int(op, "cp_block", cp_block, minimum=1)
    return _local_count(cache_seqlens.long(), group_rank(group), group_size(group), cp_block)


# --- append ---------------------------------------------------------------------------------


def cp_cache_append(
    k_cache_shard: torch.Tensor,
    v_cache_shard: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    group: Any,
    block_table_shard: Optional[torch.Tensor] = None,
    cp_block: int = 1,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    impl: str = "auto",
) -> None:
    """Write the new tokens that this rank owns into its shard, in place (no collective).

    Args:
        k_cache_shard, v_cache_shard: this rank's shard: ``[B, S_local, Hkv, D]``, or its pool
            ``[num_blocks, block_len, Hkv, D]`` with ``block_table_shard [B, max_blocks]``
            (its own block ids); the new rows' dtype or float8 (quantised as by
            :func:`~lmfuse.kv_cache_append`, with ``k_scale``/``v_scale [Hkv]``).
        k_new, v_new: ``[B, s_new, Hkv, D]``, the same on every rank of the group; token ``i``
            of sequence ``b`` takes global position ``cache_seqlens[b] + i``.
        cache_seqlens: ``[B]`` global lengths *before* the append (not updated here).
        group: the CP process group (``None``: one rank holding everything).
        cp_block: tokens per round-robin block; the value given to
            :func:`cp_decode_attention`.
    The owned tokens land at local positions ``cp_shard_seqlens(cache_seqlens)`` onwards,
    in order. As with ``kv_cache_append``, an owned position past the shard's capacity, or
    in a block whose id is outside ``[0, num_blocks)`` (-1 included), raises where values
    are checked (the reference path, CPU tensors, ``lmfuse.set_checks``) and is not written
    otherwise; a table row of only -1 is a padding row (nothing written, nothing checked).
    """
    op = "cp_cache_append"
    check_group(op, "group", group)
    check_tensor(op, "k_new", k_new, ndim=4)
    check_tensor(op, "v_new", v_new, ndim=4)
    if k_new.shape != v_new.shape:
        raise ValueError(f"{op}: k_new {tuple(k_new.shape)} and v_new {tuple(v_new.shape)} "
                         "must have one shape")
    B, s_new, Hkv, D = k_new.shape
    check_seqlens(op, cache_seqlens, B)
    check_int(op, "cp_block", cp_block, minimum=1)
    shard_hkv, _ = check_cache(op, k_new.dtype, k_cache_shard, v_cache_shard,
                               block_table_shard, B, None, D,
                               names=("k_cache_shard", "v_cache_shard", "block_table_shard"),
                               dtype_of="k_new's")
    if shard_hkv != Hkv:
        raise ValueError(f"{op}: the shard's [Hkv, D] is {list(k_cache_shard.shape[2:])} but "
                         f"k_new's is {[Hkv, D]}")
    world, rank = group_size(group), group_rank(group)
    if world == 1:
        kv_cache_append(k_cache_shard, v_cache_shard, k_new, v_new, cache_seqlens,
                        block_table=block_table_shard, k_scale=k_scale, v_scale=v_scale,
                        impl=impl)
        return None
    if B * s_new == 0:
        return None

    # Each new token is appended as a sequence of its own, one token long, through a
    # one-column block table: its block (the sequence's row of a contiguous shard, which is
    # then a pool of B blocks of S_local rows) and its offset in it. A token another rank
    # owns gets block -1, which the Triton append skips; the reference drops those rows.
    device = k_new.device
    pos = cache_seqlens.long()[:, None] + torch.arange(s_new, device=device)  # [B, s_new]
    mine = (pos // cp_block) % world == rank
    dest = (pos // (cp_block * world)) * cp_block + pos % cp_block
    if block_table_shard is None:
        block_len = k_cache_shard.shape[1]
        capacity = block_len
        blocks = torch.arange(B, device=device)[:, None].expand(B, s_new)
    else:
        block_len, cols = k_cache_shard.shape[1], block_table_shard.shape[1]
        capacity = cols * block_len
        col = (dest // max(block_len, 1)).clamp(min=0, max=max(cols - 1, 0))
        blocks = (block_table_shard.long().gather(1, col) if cols
                  else torch.full_like(dest, -1))
    fits = (dest >= 0) & (dest < capacity)  # a negative length puts tokens nowhere
    # A table row of only -1 is a padding row (a captured graph's padded batch), as for
    # kv_cache_append: nothing of it is written, and nothing is checked of it.
    padding = (torch.zeros(B, 1, dtype=torch.bool, device=device)
               if block_table_shard is None or block_table_shard.shape[1] == 0
               else (block_table_shard == -1).all(1, keepdim=True))
    table = torch.where(mine & fits, blocks, -1).reshape(B * s_new, 1).to(torch.int32)
    offset = (dest % max(block_len, 1)).reshape(B * s_new).to(torch.int32)
    rows = (B * s_new, 1, Hkv, D)
    k_rows, v_rows = k_new.reshape(rows), v_new.reshape(rows)
    path, _ = select_impl(op, impl, device)
    if path == "triton" and k_new.dtype not in KERNEL_DTYPES and impl != "triton":
        path = "torch"
    if path == "torch" or value_checks(cache_seqlens):
        if int(pos.min()) < 0:
            raise ValueError(f"{op}: cache_seqlens must be >= 0, got "
                             f"{int(cache_seqlens.min())}")
        late = mine & ~fits & ~padding
        if bool(late.any()):
            b, i = (int(x) for x in late.nonzero()[0])
            raise ValueError(f"{op}: new token {i} of sequence {b} goes to this rank (rank "
                             f"{rank}) at local position {int(dest[b, i])}, past the shard's "
                             f"capacity of {capacity}; reserve space first")
        nowhere = mine & fits & ~padding & ((blocks < 0) | (blocks >= k_cache_shard.shape[0]))
        if block_table_shard is not None and bool(nowhere.any()):
            b, i = (int(x) for x in nowhere.nonzero()[0])
            col = int(dest[b, i]) // block_len
            raise ValueError(f"{op}: new token {i} of sequence {b} goes to this rank (rank "
                             f"{rank}) at local position {int(dest[b, i])}, in "
                             f"block_table_shard[{b}, {col}] = {int(blocks[b, i])}, not a "
                             f"block of the pool [0, {k_cache_shard.shape[0]}); reserve "
                             "space first")
    if path == "torch":
        keep = mine.reshape(-1).nonzero()[:, 0]
        k_rows, v_rows, table, offset = k_rows[keep], v_rows[keep], table[keep], offset[keep]
    kv_cache_append(k_cache_shard, v_cache_shard, k_rows, v_rows, offset,
                    block_table=table, k_scale=k_scale, v_scale=v_scale, impl=path)
    return None


# --- attention ------------------------------------------------------------------------------


def _tail_partial(q, k_cache, v_cache, cache_seqlens, len0, count, block_table, scale,
                  k_scale, v_scale, rank: int, world: int, cp_block: int, compute,
                  softcap=None):
    """Attention of every active token over the rank's local keys ``[len0, count)`` (at most
    ``s_active - 1`` of them, the rank's share of positions ``P_0 + 1 .. L - 1``), each token
    seeing those at global positions ``<=`` its own. ``(out, lse)`` in ``compute``."""
    B, S, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    device = q.device
    T = S - 1
    local = len0[:, None] + torch.arange(T, device=device)  # [B, T]
    rows = k_cache.shape[1]
    if rows == 0 or (block_table is not None and 0 in (block_table.shape[1], k_cache.shape[0])):
        out = torch.zeros((B, S, Hq, D), dtype=compute, device=device)
        return out, torch.full((B, S, Hq), -math.inf, dtype=compute, device=device)
    # An unchecked call whose counts exceed the shard reads nothing past it, nor through a
    # bad block id (as the kernels do not): such rows are read clamped and never seen.
    if block_table is None:
        valid = (local < count[:, None]) & (local < rows)
        at = (torch.arange(B, device=device)[:, None], local.clamp(max=rows - 1))
    else:
        cols = block_table.shape[1]
        block = block_table.long().gather(1, (local // rows).clamp(max=cols - 1))
        valid = ((local < count[:, None]) & (local < cols * rows) & (block >= 0)
                 & (block < k_cache.shape[0]))
        at = (block.clamp(0, k_cache.shape[0] - 1), local % rows)
    token_pos = cache_seqlens.long()[:, None] - S + torch.arange(S, device=device)  # [B, S]
    key_pos = (local // cp_block) * (cp_block * world) + rank * cp_block + local % cp_block
    seen = valid[:, None, :] & (key_pos[:, None, :] <= token_pos[:, :, None])  # [B, S, T]
    k = k_cache[at].to(compute)  # [B, T, Hkv, D]; rows not seen are masked below
    v = v_cache[at].to(compute)
    if k_scale is not None:
        k = k * k_scale.to(compute)[:, None]
    if v_scale is not None:
        v = v * v_scale.to(compute)[:, None]
    # Each token's values: only the rows it sees (a NaN or inf in a row it does not see, a
    # later active token's or an unwritten row's, must not reach it through 0 * inf).
    v = torch.where(seen[:, :, :, None, None], v[:, None], 0.0)  # [B, S, T, Hkv, D]
    scores = torch.einsum("bshgd,bthd->bshgt", q.to(compute).view(B, S, Hkv, G, D), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~seen[:, :, None, None, :], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # -inf where a token sees none of these keys
    prob = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    out = torch.einsum("bshgt,bsthd->bshgd", prob, v)
    return out.reshape(B, S, Hq, D), lse.reshape(B, S, Hq)


def _partial(q, k_cache, v_cache, cache_seqlens, block_table, scale, sinks, k_scale, v_scale,
             num_splits, impl, rank: int, world: int, cp_block: int, compute, softcap=None):
    """This rank's exact partial ``(out, lse)`` over its local keys, in ``compute``, for
    ``s_active > 1`` (one active token takes ``decode_attention_partials``)."""
    B, S, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    lengths = cache_seqlens.long()
    len0 = _local_count(lengths - S + 1, rank, world, cp_block)
    # The keys every active token sees, in one s_active = 1 call: the tokens go into the
    # head dim ordered [Hkv, s_active, G], so head h' still reads KV head h' // (s_active * G).
    # Its partial in `compute` (not rounded to q's dtype before the merges).
    folded = q.view(B, S, Hkv, G, D).transpose(1, 2).reshape(B, 1, Hkv * S * G, D)
    if sinks is not None:
        sinks = sinks.view(Hkv, 1, G).expand(Hkv, S, G).reshape(-1)
    flat = decode_attention_partials(folded, k_cache, v_cache, len0, block_table=block_table,
                                     scale=scale, sinks=sinks, k_scale=k_scale,
                                     v_scale=v_scale, num_splits=num_splits, impl=impl,
                                     softcap=softcap)
    R = B * Hq * S
    out, lse = flat[:R * D], flat[R * D:]
    out = out.view(B, Hkv, S, G, D).transpose(1, 2).reshape(B, S, Hq, D)
    lse = lse.view(B, Hkv, S, G).transpose(1, 2).reshape(B, S, Hq)
    count = _local_count(lengths, rank, world, cp_block)
    # The tail reads the shard's rows up to `count` (its share of the global lengths), past
    # what the folded call checked: the same value checks for them (a shard shorter than
    # its share raises, as decode_attention on it would).
    rows = k_cache.shape[1]
    capacity = rows if block_table is None else block_table.shape[1] * rows
    check_decode_values("cp_decode_attention", count, k_cache, block_table, capacity, None,
                        None, name=f"rank {rank}'s share of cache_seqlens", force=impl == "torch")
    out_t, lse_t = _tail_partial(q, k_cache, v_cache, cache_seqlens, len0, count, block_table,
                                 scale, k_scale, v_scale, rank, world, cp_block, compute,
                                 softcap)
    merge_impl = impl if compute != torch.float64 else "torch"
    out, lse = merge_attention_states(torch.stack([out.to(compute), out_t]),
                                      torch.stack([lse.to(compute), lse_t]), impl=merge_impl)
    return out.to(compute), lse.to(compute)


def _check_share(op: str, name: str, seqlens_shard: torch.Tensor,
                 cache_seqlens: Optional[torch.Tensor], rank: int, world: int,
                 cp_block: int) -> None:
    """The value checks of ``check_ranks`` (host syncs): counts ``>= 0``, and with
    ``cache_seqlens`` exactly this rank's share of them."""
    counts = seqlens_shard.long()
    if bool((counts < 0).any()):
        b = int((counts < 0).nonzero()[0, 0])
        raise ValueError(f"{op}: {name} must be >= 0, got {name}[{b}] = {int(counts[b])}")
    if cache_seqlens is None:
        return
    want = _local_count(cache_seqlens.long(), rank, world, cp_block)
    bad = (counts != want).nonzero()
    if bad.numel():
        b = int(bad[0, 0])
        raise ValueError(f"{op}: {name}[{b}] = {int(counts[b])} is not rank {rank}'s share of "
                         f"cache_seqlens[{b}] = {int(cache_seqlens[b])} ({int(want[b])} over "
                         f"{world} ranks, cp_block={cp_block}); pass "
                         "cp_shard_seqlens(cache_seqlens)")


def validate_cp(op: str, q, k_cache_shard, v_cache_shard, seqlens_shard, cache_seqlens,
                block_table_shard, cp_block, scale, window_size, sinks, k_scale, v_scale,
                return_lse, num_splits, impl, group: Any, check_values: bool,
                seqlens_name: str = "seqlens_shard", softcap: Any = None) -> list[int]:
    """Every local check of :func:`cp_decode_attention` (raises); returns the facts the ranks
    must agree on (see :data:`CP_FIELDS`). ``check_values`` adds the checks that read the
    lengths' values (a host sync). ``seqlens_name`` names ``seqlens_shard`` in messages."""
    check_tensor(op, "q", q, ndim=4)
    check_int(op, "cp_block", cp_block, minimum=1)
    world, rank = group_size(group), group_rank(group)
    if world > 1 and window_size is not None:
        raise ValueError(f"{op}: window_size is not supported over {world} CP ranks (round-"
                         "robin shards have no fixed local window); a sliding-window layer's "
                         "context is bounded: run it with decode_attention or KVDP")
    check_no_grad(op, q, sinks)
    B, S, Hq, D = q.shape
    check_lengths(op, seqlens_name, seqlens_shard, B, q)
    if cache_seqlens is not None:
        check_lengths(op, "cache_seqlens", cache_seqlens, B, q)
    # With check_values, then the counts against cache_seqlens and the lengths, block ids
    # and scales against the shard (decode_attention's value checks), here so that a bad
    # rank's error reaches every rank.
    for values in (False, True) if check_values else (False,):
        if values:
            _check_share(op, seqlens_name, seqlens_shard, cache_seqlens, rank, world, cp_block)
        wrap_errors(op, lambda: plan_decode_attention(
            q, k_cache_shard, v_cache_shard, seqlens_shard, block_table=block_table_shard,
            scale=scale, window_size=window_size, sinks=sinks, k_scale=k_scale,
            v_scale=v_scale, return_lse=return_lse, num_splits=num_splits, impl=impl,
            softcap=softcap, check_values=values))
    return [world, B, S, Hq, D, k_cache_shard.shape[2], dtype_code(q.dtype), cp_block,
            sinks is not None, cache_seqlens is not None, return_lse,
            float_code(1.0 / math.sqrt(D) if scale is None else scale), float_code(softcap),
            k_scale is not None, v_scale is not None]


CP_FIELDS = ("group size", "batch B", "s_active", "query heads Hq", "head dim D",
             "KV heads of the shard", "query dtype", "cp_block", "sinks (given or not)",
             "cache_seqlens (given or not)", "return_lse", "scale", "softcap",
             "k_scale (given or not)", "v_scale (given or not)")


def cp_decode_attention(
    q: torch.Tensor,
    k_cache_shard: torch.Tensor,
    v_cache_shard: torch.Tensor,
    seqlens_shard: torch.Tensor,
    *,
    group: Any,
    block_table_shard: Optional[torch.Tensor] = None,
    cp_block: int = 1,
    cache_seqlens: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    window_size: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    num_splits: Optional[int] = None,
    impl: str = "auto",
    check_ranks: bool = False,
    softcap: Optional[float] = None,
):
    """Decode attention over a context split across the ranks of ``group`` (see the module
    docstring for the layout); every rank returns the whole result, equal to
    ``decode_attention`` on the unsharded cache.

    Args:
        q: ``[B, s_active, Hq, D]``, the same on every rank.
        k_cache_shard, v_cache_shard: this rank's shard, ``[B, S_local, Hkv, D]`` or a paged
            pool ``[num_blocks, block_len, Hkv, D]`` with ``block_table_shard [B,
            max_blocks]`` (this rank's own block ids); q's dtype or ``float8_e4m3fn`` with
            ``k_scale``/``v_scale [Hkv]``. Filled by :func:`cp_cache_append`.
        seqlens_shard: ``[B]`` int32/int64, this rank's own token counts: how many tokens
            of each sequence (active ones included) its shard holds, i.e.
            ``cp_shard_seqlens(global_lengths, group=group, cp_block=cp_block)``. With
            ``group=None`` (or one rank) these are the global lengths.
        group: the CP process group; ``None`` (or one rank): plain ``decode_attention``.
        cp_block: tokens per round-robin block (the value given to ``cp_cache_append``).
        cache_seqlens: optional ``[B]`` *global* lengths (active tokens included), the same
            on every rank. Given, they place the active tokens and no collective is spent
            on lengths; ``seqlens_shard`` must then be exactly this rank's share of them
            (checked only with ``check_ranks``). Not given, the op sums ``seqlens_shard``
            over the group (one all-reduce of ``[B]`` int64) when ``s_active > 1``; one active
            token needs only the counts. Every rank must pass them or none
            (``check_ranks`` checks that too).
        scale, sinks, k_scale, v_scale, return_lse, num_splits, impl: as for
            ``decode_attention`` (``impl`` picks the path of the local attention and merges).
            ``sinks [Hq]`` are counted once (on rank 0). ``softcap``: as for
            ``decode_attention`` (every rank caps its own scores).
        window_size: only with one rank (raises otherwise).
        check_ranks: first check that every rank's inputs are valid and agree (one small
            extra all-gather and a host sync; the lengths' values are checked too): bad
            input on any rank then raises on all of them. Without it, local checks (shapes,
            dtypes, devices) raise before any collective on the rank that fails, and inputs
            that differ across ranks are not detected.
    Returns:
        ``out [B, s_active, Hq, D]`` in q's dtype (and ``lse [B, s_active, Hq]`` float32
        with ``return_lse``). Collectives over ``group``: one all-gather of ``[B, s_active,
        Hq, D + 1]`` float32 values, plus, when ``s_active > 1`` and ``cache_seqlens`` is
        not given, one all-reduce of ``[B]`` int64 (plus the all-gather of
        ``check_ranks``); none with one rank.
    """
    op = "cp_decode_attention"
    check_group(op, "group", group)
    world = group_size(group)
    if world == 1:
        check_int(op, "cp_block", cp_block, minimum=1)
        check_tensor(op, "q", q, ndim=4)
        check_lengths(op, "seqlens_shard", seqlens_shard, q.shape[0], q)
        if cache_seqlens is not None:
            check_lengths(op, "cache_seqlens", cache_seqlens, q.shape[0], q)
        return decode_attention(q, k_cache_shard, v_cache_shard, seqlens_shard,
                                block_table=block_table_shard, scale=scale,
                                window_size=window_size, sinks=sinks, k_scale=k_scale,
                                v_scale=v_scale, return_lse=return_lse, num_splits=num_splits,
                                impl=impl, softcap=softcap)
    check_on_all_ranks(op, group, check_ranks, meta_device(group, q), CP_FIELDS, lambda: (
        validate_cp(op, q, k_cache_shard, v_cache_shard, seqlens_shard, cache_seqlens,
                    block_table_shard, cp_block, scale, window_size, sinks, k_scale, v_scale,
                    return_lse, num_splits, impl, group, check_values=check_ranks,
                    softcap=softcap)))
    return cp_attention_local(q, k_cache_shard, v_cache_shard, seqlens_shard, cache_seqlens,
                         block_table_shard, cp_block, scale, sinks, k_scale, v_scale,
                         return_lse, num_splits, impl, group, softcap)


def cp_attention_local(q, k_cache_shard, v_cache_shard, seqlens_shard, cache_seqlens,
                       block_table_shard, cp_block, scale, sinks, k_scale, v_scale,
                       return_lse, num_splits, impl, group, softcap=None):
    """:func:`cp_decode_attention` on validated inputs, over a group of several ranks (also
    the CP half of ``kvdp_decode_attention``'s KVDP x CP grid)."""
    world, rank = group_size(group), group_rank(group)
    B, S, Hq, D = q.shape
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    merge_impl = impl if compute != torch.float64 else "torch"
    if S == 1:
        # One active token sees every key its rank holds: the shard's own counts are all
        # the partial needs (no global lengths, no all-reduce). The kernels write the packed
        # partial [outputs | LSEs] that the all-gather sends, and the merge writes q's dtype.
        states = decode_attention_partials(
            q, k_cache_shard, v_cache_shard, seqlens_shard, block_table=block_table_shard,
            scale=scale, sinks=sinks if rank == 0 else None, k_scale=k_scale, v_scale=v_scale,
            num_splits=num_splits, impl=impl, softcap=softcap)
        every = all_gather_stacked(states, group)  # [world, R * (D + 1)]
        R = B * Hq
        out, lse = merge_attention_states(every[:, :R * D].view(world, B, S, Hq, D),
                                          every[:, R * D:].view(world, B, S, Hq),
                                          out_dtype=q.dtype, impl=merge_impl)
        return (out, lse) if return_lse else out
    if cache_seqlens is None:
        # Every token is held by exactly one rank, so the shards' counts sum to the lengths.
        cache_seqlens = all_reduce_sum(seqlens_shard.long(), group)
    out, lse = _partial(q, k_cache_shard, v_cache_shard, cache_seqlens, block_table_shard,
                        scale, sinks if rank == 0 else None, k_scale, v_scale, num_splits,
                        impl, rank, world, cp_block, compute, softcap)
    states = all_gather_stacked(torch.cat([out, lse[..., None]], dim=-1), group)
    out, lse = merge_attention_states(states[..., :D], states[..., D], out_dtype=q.dtype,
                                      impl=merge_impl)
    return (out, lse) if return_lse else out
