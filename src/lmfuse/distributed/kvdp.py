"""KV data parallelism (KVDP) for decode attention: the batch's KV caches are split over the
ranks of a group, and each rank attends over its own sequences for all of the group's heads.

Each rank projected its own (tensor-parallel) query heads ``q [B, s_active, Hq_local, D]``
for all ``B`` sequences, but holds the cache of only its share of the sequences. One step:

1. all-gather the query heads over the group and keep this rank's sequences: ``[B_r,
   s_active, W * Hq_local, D]``, heads in **rank-major** order (gathered head ``w *
   Hq_local + h`` is head ``h`` of group rank ``w``);
2. decode attention on the local cache, whose KV heads serve the gathered heads with the
   usual GQA grouping (gathered head ``j`` reads local KV head ``j // (W * Hq_local /
   Hkv)``). With Megatron's tensor-parallel layout (rank ``w`` has query heads ``[w *
   Hq_local, (w + 1) * Hq_local)`` and KV heads ``[w * Hkv_local, ...)``) the gathered
   order is the global head order and the local cache holds all ``Hkv`` heads in order;
3. all-gather the outputs over the batch and keep this rank's heads: ``[B, s_active,
   Hq_local, D]``.

Uneven batches: rank ``r`` holds the contiguous sequences :func:`kvdp_batch_range` gives,
``torch.tensor_split``'s split (the first ``B % W`` ranks hold one sequence more; a rank may
hold none when ``B < W``). The output all-gather pads every rank's rows to ``ceil(B / W)``.

With ``cp_group`` the local attention is itself context parallel
(:func:`~lmfuse.distributed.cp_decode_attention` over ``cp_group``): a KVDP x CP grid, the
local cache then being this rank's CP shard of its sequences.

Two all-gathers per call (one more inside the CP step); no backward. (Each all-gather
moves ``W`` times the bytes a rank keeps; an all-to-all exchange would move only those, and
needs an all-to-all helper in ``collectives.py``.)
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .._dispatch import check_int, check_tensor
from ..attention.ops import decode_attention, kv_cache_append, plan_decode_attention
from .collectives import all_gather_stacked, group_rank, group_size
from .cp import (CP_FIELDS, _cp_attention, check_no_grad, check_on_all_ranks, cp_cache_append,
                 cp_decode_attention, dtype_code, meta_device, validate_cp, wrap_errors)

_FIELDS = ("group size", "batch B", "s_active", "local query heads Hq_local", "head dim D",
           "KV heads of the local cache", "query dtype", "sinks (given or not)", "return_lse",
           "cp_group (given or not)")


def kvdp_batch_range(batch: int, group: Any) -> tuple[int, int]:
    """``(start, stop)``: the sequences ``[start, stop)`` of a batch of ``batch`` that this
    rank of ``group`` holds (``torch.tensor_split``'s split: the first ``batch % W`` ranks
    hold ``ceil(batch / W)``, the others ``batch // W``)."""
    check_int("kvdp_batch_range", "batch", batch, minimum=0)
    world, rank = group_size(group), group_rank(group)
    base, extra = divmod(batch, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def _own_rows(gathered: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """``gathered [W, B, s, H, D]`` -> ``[B_r, s, W * H, D]``: sequences ``[start, stop)``,
    the ranks' heads side by side, rank-major."""
    W, _, S, H, D = gathered.shape
    return gathered[:, start:stop].permute(1, 2, 0, 3, 4).reshape(stop - start, S, W * H, D)


def _gather_batch(local: torch.Tensor, batch: int, group: Any) -> torch.Tensor:
    """Every rank's ``local [B_w, ...]`` rows (the split of :func:`kvdp_batch_range`), in
    sequence order: ``[batch, ...]``, from one all-gather of rows padded to ``ceil(B/W)``."""
    world = group_size(group)
    most = -(-batch // world)
    if local.shape[0] < most:
        pad = local.new_zeros((most - local.shape[0], *local.shape[1:]))
        local = torch.cat([local, pad])
    gathered = all_gather_stacked(local, group)  # [W, most, ...]
    base, extra = divmod(batch, world)
    if extra == 0:
        return gathered.reshape(batch, *local.shape[1:])
    return torch.cat([gathered[w, :base + (w < extra)] for w in range(world)])


def kvdp_decode_attention(
    q: torch.Tensor,
    k_cache_local: torch.Tensor,
    v_cache_local: torch.Tensor,
    seqlens_local: torch.Tensor,
    *,
    group: Any,
    block_table_local: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    window_size: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    num_splits: Optional[int] = None,
    impl: str = "auto",
    cp_group: Any = None,
    cp_block: int = 1,
    check_ranks: bool = False,
):
    """Decode attention with the batch's caches split over ``group`` (see the module
    docstring); each rank gets its own heads for the whole batch, equal to
    ``decode_attention`` on the unsplit caches.

    Args:
        q: ``[B, s_active, Hq_local, D]``: this rank's query heads for all ``B`` sequences
            (``B``, ``s_active``, ``Hq_local``, ``D`` and the dtype equal on every rank).
        k_cache_local, v_cache_local: the cache of this rank's ``B_r`` sequences
            (:func:`kvdp_batch_range`), ``[B_r, S_max, Hkv, D]`` or a pool ``[num_blocks,
            block_len, Hkv, D]`` with ``block_table_local [B_r, max_blocks]`` (ids into this
            rank's pool); ``W * Hq_local`` must be a multiple of ``Hkv`` (GQA over the
            gathered heads). q's dtype or ``float8_e4m3fn`` with ``k_scale``/``v_scale
            [Hkv]``.
        seqlens_local: ``[B_r]`` lengths of this rank's sequences (active tokens included);
            with ``cp_group``, their global lengths (as for ``cp_decode_attention``).
        group: the KVDP process group; ``None`` (or one rank): no KVDP.
        sinks: ``[W * Hq_local]``, the sinks of the *gathered* heads (rank-major; with the
            Megatron layout the global ``[Hq]`` sinks), the same on every rank.
        scale, window_size, return_lse, num_splits, impl: as for ``decode_attention``
            (``window_size`` only without ``cp_group``).
        cp_group, cp_block: a CP group over which the local caches are further sharded
            (see :func:`~lmfuse.distributed.cp_decode_attention`).
        check_ranks: first check that every rank's inputs are valid and agree (one small
            extra all-gather and a host sync), so that bad input on any rank raises on all
            of them. Without it, local checks still raise before any collective on the rank
            that fails; inputs that differ across ranks are not detected.
    Returns:
        ``out [B, s_active, Hq_local, D]`` in q's dtype (and ``lse [B, s_active, Hq_local]``
        float32 with ``return_lse``).
    """
    op = "kvdp_decode_attention"
    world = group_size(group)
    kw = dict(scale=scale, window_size=window_size, sinks=sinks, k_scale=k_scale,
              v_scale=v_scale, return_lse=return_lse, num_splits=num_splits, impl=impl)
    if world == 1:
        if cp_group is None:
            return decode_attention(q, k_cache_local, v_cache_local, seqlens_local,
                                    block_table=block_table_local, **kw)
        return cp_decode_attention(q, k_cache_local, v_cache_local, seqlens_local,
                                   group=cp_group, block_table_shard=block_table_local,
                                   cp_block=cp_block, check_ranks=check_ranks, **kw)
    rank = group_rank(group)

    def validate() -> list[int]:
        check_tensor(op, "q", q, ndim=4)
        check_no_grad(op, q, sinks)
        B, S, Hq_local, D = q.shape
        start, stop = kvdp_batch_range(B, group)
        # What the local attention will see: this rank's sequences, all gathered heads.
        q_local = q.new_empty((1, 1, 1, 1)).expand(stop - start, S, world * Hq_local, D)
        where = (f"{op} (rank {rank} of {world} holds sequences [{start}, {stop}) of B={B}, "
                 f"with {world} x {Hq_local} gathered query heads)")
        if cp_group is None:
            wrap_errors(where, lambda: plan_decode_attention(
                q_local, k_cache_local, v_cache_local, seqlens_local,
                block_table=block_table_local, **kw))
        else:
            wrap_errors(where, lambda: validate_cp(
                "cp_decode_attention", q_local, k_cache_local, v_cache_local, seqlens_local,
                block_table_local, cp_block, scale, window_size, sinks, k_scale, v_scale,
                return_lse, num_splits, impl, group_size(cp_group)))
        return [world, B, S, Hq_local, D, k_cache_local.shape[2], dtype_code(q.dtype),
                sinks is not None, return_lse, cp_group is not None]

    check_on_all_ranks(op, group, check_ranks, meta_device(group, q), _FIELDS, validate)
    B, S, Hq_local, D = q.shape
    start, stop = kvdp_batch_range(B, group)
    q_local = _own_rows(all_gather_stacked(q, group), start, stop)
    if cp_group is None:
        res = decode_attention(q_local, k_cache_local, v_cache_local, seqlens_local,
                               block_table=block_table_local, **kw)
    else:
        if check_ranks and group_size(cp_group) > 1:
            check_on_all_ranks("cp_decode_attention", cp_group, True,
                               meta_device(cp_group, q), CP_FIELDS, lambda: validate_cp(
                                   "cp_decode_attention", q_local, k_cache_local,
                                   v_cache_local, seqlens_local, block_table_local, cp_block,
                                   scale, window_size, sinks, k_scale, v_scale, return_lse,
                                   num_splits, impl, group_size(cp_group)))
        res = (_cp_attention(q_local, k_cache_local, v_cache_local, seqlens_local,
                             block_table_local, cp_block, scale, sinks, k_scale, v_scale,
                             return_lse, num_splits, impl, cp_group)
               if group_size(cp_group) > 1 else
               decode_attention(q_local, k_cache_local, v_cache_local, seqlens_local,
                                block_table=block_table_local, **kw))
    heads = slice(rank * Hq_local, (rank + 1) * Hq_local)
    if not return_lse:
        return _gather_batch(res, B, group)[:, :, heads]
    # The LSE rides along in the output's all-gather, as one more float32 column.
    out, lse = res
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    both = _gather_batch(torch.cat([out.to(compute), lse.to(compute)[..., None]], dim=-1), B,
                         group)[:, :, heads]
    return both[..., :D].to(q.dtype), both[..., D].to(lse.dtype)


def kvdp_cache_append(
    k_cache_local: torch.Tensor,
    v_cache_local: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    seqlens_local: torch.Tensor,
    *,
    group: Any,
    block_table_local: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    impl: str = "auto",
    cp_group: Any = None,
    cp_block: int = 1,
) -> None:
    """Append this step's keys and values to the local caches, in place: one all-gather of
    the ranks' KV heads, then each rank writes its own sequences.

    Args:
        k_cache_local, v_cache_local, block_table_local: as for
            :func:`kvdp_decode_attention` (``Hkv = W * Hkv_local``: the gathered KV heads,
            rank-major).
        k_new, v_new: ``[B, s_new, Hkv_local, D]``: this rank's KV heads for all ``B``
            sequences (``B``, ``s_new``, ``Hkv_local``, ``D`` equal on every rank).
        seqlens_local: ``[B_r]`` lengths of this rank's sequences before the append (with
            ``cp_group``: their global lengths, the new tokens going to the CP rank that owns
            each position, as by :func:`~lmfuse.distributed.cp_cache_append`).
        k_scale, v_scale, impl: as for ``kv_cache_append``.
    When every rank already has all KV heads of its sequences (KV heads replicated over the
    group, as with fewer KV heads than ranks), no collective is needed: call
    ``kv_cache_append`` with the rows ``kvdp_batch_range(B, group)`` of ``k_new``/``v_new``.
    """
    op = "kvdp_cache_append"
    check_tensor(op, "k_new", k_new, ndim=4)
    check_tensor(op, "v_new", v_new, ndim=4)
    if k_new.shape != v_new.shape or k_new.dtype != v_new.dtype:
        raise ValueError(f"{op}: k_new {tuple(k_new.shape)} {k_new.dtype} and v_new "
                         f"{tuple(v_new.shape)} {v_new.dtype} must have one shape and dtype")
    world = group_size(group)
    B, s_new, Hkv_local, D = k_new.shape
    start, stop = kvdp_batch_range(B, group)
    check_tensor(op, "seqlens_local", seqlens_local, ndim=1, dtypes=(torch.int32, torch.int64))
    if seqlens_local.shape[0] != stop - start:
        raise ValueError(f"{op}: seqlens_local must be [B_r={stop - start}] (this rank holds "
                         f"sequences [{start}, {stop}) of B={B}), got "
                         f"{tuple(seqlens_local.shape)}")
    kw = dict(k_scale=k_scale, v_scale=v_scale, impl=impl)
    # Every check of the local append, before the all-gather: the same append with no new
    # token (it validates and writes nothing).
    none_new = k_new.new_empty((1, 1, 1, 1)).expand(stop - start, 0, world * Hkv_local, D)
    wrap_errors(f"{op} (rank {group_rank(group)} of {world} holds sequences [{start}, {stop}) "
                f"of B={B}, with {world} x {Hkv_local} gathered KV heads)",
                lambda: kv_cache_append(k_cache_local, v_cache_local, none_new, none_new,
                                        seqlens_local, block_table=block_table_local, **kw))
    if cp_group is not None:
        check_int(op, "cp_block", cp_block, minimum=1)
    if world > 1:
        both = all_gather_stacked(torch.stack([k_new, v_new]), group)  # [W, 2, B, s, H, D]
        both = both.transpose(0, 1)
        k_new, v_new = _own_rows(both[0], start, stop), _own_rows(both[1], start, stop)
    if cp_group is None:
        kv_cache_append(k_cache_local, v_cache_local, k_new, v_new, seqlens_local,
                        block_table=block_table_local, **kw)
    else:
        cp_cache_append(k_cache_local, v_cache_local, k_new, v_new, seqlens_local,
                        group=cp_group, block_table_shard=block_table_local,
                        cp_block=cp_block, **kw)
    return None
