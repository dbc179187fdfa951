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
hold none when ``B < W``). Step 3 pads every rank's rows to ``ceil(B / W)`` (and step 1
too with ``exchange="all_to_all"``, below).

With ``cp_group`` the local attention is itself context parallel
(:func:`~lmfuse.distributed.cp_decode_attention` over ``cp_group``): a KVDP x CP grid, the
local cache then being this rank's CP shard of its sequences. ``seqlens_local`` always
counts the tokens the local cache holds: the sequences' lengths, or with ``cp_group`` their
CP-shard counts (``cp_shard_seqlens`` over ``cp_group``), CP's ``seqlens_shard``. The
global lengths of the rank's sequences, which CP needs to place the active (or new) tokens,
come as ``cache_seqlens=`` or from one all-reduce of the counts over ``cp_group`` (attention
with one active token needs neither).

Two collectives per call over ``group``; with ``cp_group``, the CP step's all-gather over
it, and, with several active tokens, its all-reduce of the ``[B_r]`` counts unless
``cache_seqlens`` is given. No
backward. ``exchange`` picks the two over ``group``: ``"all_gather"`` (the default) as
above, each moving ``W`` times the bytes a rank keeps; or ``"all_to_all"``
(:func:`~lmfuse._collectives.all_to_all_stacked`), each moving only those: step 1
sends rank ``r`` the rows of ``q`` for ``r``'s sequences (padded to ``ceil(B / W)`` rows),
step 3 sends rank ``w`` its heads of this rank's output rows (and the LSE column). The
attention sees the same inputs either way, so the results are equal bit for bit; which is
faster depends on the sizes and the interconnect (``bench/decode_sharded.py --exchange``
times both).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from .._dispatch import check_choice, check_int, check_tensor
from .._launch import cdiv
from ..attention.ops import decode_attention, kv_cache_append, plan_decode_attention
from .._collectives import (all_gather_stacked, all_reduce_sum, all_to_all_stacked, check_group,
                            group_rank, group_size)
from .checks import (check_lengths, check_no_grad, check_on_all_ranks, dtype_code, float_code,
                     meta_device, wrap_errors)
from .cp import CP_FIELDS, cp_attention_local, cp_cache_append, validate_cp

_FIELDS = ("group size", "batch B", "s_active", "local query heads Hq_local", "head dim D",
           "KV heads of the local cache", "query dtype", "sinks (given or not)", "return_lse",
           "cp_group (given or not)", "cache_seqlens (given or not)", "exchange", "scale",
           "softcap", "window_size", "k_scale (given or not)", "v_scale (given or not)")

EXCHANGES = ("all_gather", "all_to_all")


def kvdp_batch_range(batch: int, group: Any) -> tuple[int, int]:
    """``(start, stop)``: the sequences ``[start, stop)`` of a batch of ``batch`` that this
    rank of ``group`` holds (``torch.tensor_split``'s split: the first ``batch % W`` ranks
    hold ``ceil(batch / W)``, the others ``batch // W``)."""
    check_int("kvdp_batch_range", "batch", batch, minimum=0)
    check_group("kvdp_batch_range", "group", group)
    world, rank = group_size(group), group_rank(group)
    base, extra = divmod(batch, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def _own_rows(gathered: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """``gathered [W, B, s, H, D]`` -> ``[B_r, s, W * H, D]``: sequences ``[start, stop)``,
    the ranks' heads side by side, rank-major."""
    W, _, S, H, D = gathered.shape
    return gathered[:, start:stop].permute(1, 2, 0, 3, 4).reshape(stop - start, S, W * H, D)


def _rows_by_rank(x: torch.Tensor, world: int) -> torch.Tensor:
    """``x [batch, ...]`` -> ``[W, ceil(batch / W), ...]``: row ``w`` holds the sequences
    rank ``w`` holds (:func:`kvdp_batch_range`), zero-padded at the end."""
    batch, rest = x.shape[0], x.shape[1:]
    most = cdiv(batch, world)
    base, extra = divmod(batch, world)
    if extra == 0:
        return x.reshape(world, most, *rest)
    out = x.new_zeros((world, most, *rest))
    out[:extra] = x[:extra * most].reshape(extra, most, *rest)
    out[extra:, :base] = x[extra * most:].reshape(world - extra, base, *rest)
    return out


def _batch_from_ranks(y: torch.Tensor, batch: int) -> torch.Tensor:
    """The inverse of :func:`_rows_by_rank`: ``y [W, ceil(batch / W), ...]`` -> ``[batch,
    ...]``, the padding dropped."""
    world, most, rest = y.shape[0], y.shape[1], y.shape[2:]
    base, extra = divmod(batch, world)
    if extra == 0:
        return y.reshape(batch, *rest)
    return torch.cat([y[:extra].reshape(extra * most, *rest),
                      y[extra:, :base].reshape((world - extra) * base, *rest)])


def _exchange_queries(q: torch.Tensor, group: Any, exchange: str, world: int, start: int,
                      stop: int) -> torch.Tensor:
    """Step 1: ``q [B, s, H, D]`` (this rank's heads, every sequence) -> ``[B_r, s, W * H,
    D]`` (this rank's sequences ``[start, stop)``, every rank's heads, rank-major)."""
    if exchange == "all_gather":
        return _own_rows(all_gather_stacked(q, group), start, stop)
    # Row r of the send buffer: rank r's sequences; row w received: rank w's heads of ours.
    received = all_to_all_stacked(_rows_by_rank(q, world), group)
    return _own_rows(received, 0, stop - start)


def _exchange_outputs(local: torch.Tensor, batch: int, group: Any,
                      exchange: str) -> torch.Tensor:
    """Step 3: ``local [B_r, s, W * H, E]`` (this rank's sequences, every rank's heads) ->
    ``[batch, s, H, E]`` (every sequence, this rank's heads)."""
    world, rank = group_size(group), group_rank(group)
    _, S, WH, E = local.shape
    H = WH // world
    most = cdiv(batch, world)
    padded = local if local.shape[0] == most else torch.cat(  # zero rows up to most
        [local, local.new_zeros((most - local.shape[0], *local.shape[1:]))])
    if exchange == "all_gather":  # every rank's rows, in sequence order; this rank's heads
        every = _batch_from_ranks(all_gather_stacked(padded, group), batch)
        return every[:, :, rank * H:(rank + 1) * H]
    # Row w of the send buffer: rank w's heads of our (padded) rows; row w received: our
    # heads of rank w's rows.
    send = padded.reshape(most, S, world, H, E).permute(2, 0, 1, 3, 4)
    return _batch_from_ranks(all_to_all_stacked(send, group), batch)


def _check_local_lengths(op: str, seqlens_local: Any, cache_seqlens: Any, batch: int,
                         group: Any, ref: torch.Tensor, ref_name: str) -> None:
    """``seqlens_local`` (and ``cache_seqlens`` when given) must be ``[B_r]``, the rank's
    share of a batch of ``batch``."""
    start, stop = kvdp_batch_range(batch, group)
    note = f" (this rank holds sequences [{start}, {stop}) of B={batch})"
    for name, t in (("seqlens_local", seqlens_local), ("cache_seqlens", cache_seqlens)):
        if t is not None:
            check_lengths(op, name, t, stop - start, ref, ref_name=ref_name, label="B_r",
                          note=note)


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
    cache_seqlens: Optional[torch.Tensor] = None,
    check_ranks: bool = False,
    exchange: str = "all_gather",
    softcap: Optional[float] = None,
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
        seqlens_local: ``[B_r]`` int32/int64, the tokens the local cache holds of each of
            this rank's sequences (active ones included): their lengths; with ``cp_group``,
            this rank's CP-shard counts of them (``cp_shard_seqlens(lengths,
            group=cp_group, cp_block=cp_block)``, ``cp_decode_attention``'s
            ``seqlens_shard``).
        group: the KVDP process group; ``None`` (or one rank): no KVDP.
        sinks: ``[W * Hq_local]``, the sinks of the *gathered* heads (rank-major; with the
            Megatron layout the global ``[Hq]`` sinks), the same on every rank.
        scale, window_size, return_lse, num_splits, impl, softcap: as for
            ``decode_attention`` (``window_size`` only without ``cp_group``, or with a
            one-rank one).
        cp_group, cp_block: a CP group over which the local caches are further sharded
            (see :func:`~lmfuse.distributed.cp_decode_attention`).
        cache_seqlens: optional ``[B_r]`` *global* lengths of this rank's sequences (the
            same on the ranks of ``cp_group``): with ``cp_group`` they save the all-reduce
            of ``seqlens_local`` over it (``seqlens_local`` must then be this rank's share
            of them, checked only with ``check_ranks``). Without ``cp_group`` the lengths
            are ``seqlens_local`` and these go unused. Every rank passes them or none.
        check_ranks: first check that every rank's inputs are valid and agree (one small
            extra all-gather and a host sync; with ``cp_group``, one more over it), so that
            bad input on any rank raises on all of them. Without it, local checks still
            raise before any collective on the rank that fails; inputs that differ across
            ranks (``exchange`` among them) are not detected.
        exchange: how steps 1 and 3 move data over ``group``, the same on every rank:
            ``"all_gather"`` (the default): all-gather, then keep this rank's part (each
            moves ``W`` times what a rank keeps); ``"all_to_all"``: one all-to-all that
            sends each rank only its part (``q``'s rows of its sequences, padded to
            ``ceil(B / W)``; its heads of this rank's output rows, with the LSE column when
            ``return_lse``). The results are equal bit for bit.
    Returns:
        ``out [B, s_active, Hq_local, D]`` in q's dtype (and ``lse [B, s_active, Hq_local]``
        float32 with ``return_lse``). Collectives: two all-gathers (or with
        ``exchange="all_to_all"`` two all-to-alls) over ``group`` (none with one rank);
        with a ``cp_group`` of several ranks, one all-gather over it and, when ``s_active >
        1`` and ``cache_seqlens`` is not given, one all-reduce of ``[B_r]`` int64 over it.
    """
    op = "kvdp_decode_attention"
    check_group(op, "group", group)
    check_group(op, "cp_group", cp_group)
    world = group_size(group)
    kw = dict(scale=scale, window_size=window_size, sinks=sinks, k_scale=k_scale,
              v_scale=v_scale, return_lse=return_lse, num_splits=num_splits, impl=impl,
              softcap=softcap)
    if world == 1 and cp_group is None:
        check_choice(op, "exchange", exchange, EXCHANGES)
        check_tensor(op, "q", q, ndim=4)
        _check_local_lengths(op, seqlens_local, cache_seqlens, q.shape[0], group, q, "q")
        return decode_attention(q, k_cache_local, v_cache_local, seqlens_local,
                                block_table=block_table_local, **kw)
    rank = group_rank(group)
    cp_world = group_size(cp_group)
    cp_facts: list[list[int]] = []  # validate_cp's, for the check over cp_group

    def validate() -> list[int]:
        exchange_code = EXCHANGES.index(check_choice(op, "exchange", exchange, EXCHANGES))
        check_tensor(op, "q", q, ndim=4)
        check_no_grad(op, q, sinks)
        B, S, Hq_local, D = q.shape
        start, stop = kvdp_batch_range(B, group)
        _check_local_lengths(op, seqlens_local, cache_seqlens, B, group, q, "q")
        # What the local attention will see: this rank's sequences, all gathered heads.
        q_local = q.new_empty((1, 1, 1, 1)).expand(stop - start, S, world * Hq_local, D)
        where = (f"{op} (rank {rank} of {world} holds sequences [{start}, {stop}) of B={B}, "
                 f"with {world} x {Hq_local} gathered query heads)")
        if cp_group is None:
            wrap_errors(where, lambda: plan_decode_attention(
                q_local, k_cache_local, v_cache_local, seqlens_local,
                block_table=block_table_local, check_values=check_ranks, **kw))
        else:
            cp_facts.append(wrap_errors(where, lambda: validate_cp(
                "cp_decode_attention", q_local, k_cache_local, v_cache_local, seqlens_local,
                cache_seqlens, block_table_local, cp_block, scale, window_size, sinks, k_scale,
                v_scale, return_lse, num_splits, impl, cp_group, check_values=check_ranks,
                seqlens_name="seqlens_local", softcap=softcap)))
        return [world, B, S, Hq_local, D, k_cache_local.shape[2], dtype_code(q.dtype),
                sinks is not None, return_lse, cp_group is not None, cache_seqlens is not None,
                exchange_code, float_code(1.0 / math.sqrt(D) if scale is None else scale),
                float_code(softcap), -1 if window_size is None else int(window_size),
                k_scale is not None, v_scale is not None]

    device = meta_device(group, q) if world > 1 else torch.device("cpu")
    if not (check_ranks and cp_world > 1):
        check_on_all_ranks(op, group, check_ranks, device, _FIELDS, validate)
    else:
        # On a KVDP x CP grid, a rank whose KVDP check failed still joins the check over
        # cp_group (as a failure): the column of the bad rank hears of it over KVDP, then
        # every row over CP, so every rank raises and none waits in a collective.
        failed: Optional[Exception] = None
        try:
            check_on_all_ranks(op, group, True, device, _FIELDS, validate)
        except Exception as e:  # re-raised by the check over cp_group
            failed = e

        def validate_over_cp() -> list[int]:
            if failed is not None:
                raise failed
            return cp_facts[0]

        check_on_all_ranks(f"{op} over cp_group", cp_group, True, meta_device(cp_group, q),
                           CP_FIELDS, validate_over_cp)
    B, S, Hq_local, D = q.shape
    q_local = (_exchange_queries(q, group, exchange, world, *kvdp_batch_range(B, group))
               if world > 1 else q)
    if cp_world == 1:  # no cp_group, or a one-rank one: the local cache holds everything
        res = decode_attention(q_local, k_cache_local, v_cache_local, seqlens_local,
                               block_table=block_table_local, **kw)
    else:
        res = cp_attention_local(q_local, k_cache_local, v_cache_local, seqlens_local,
                                 cache_seqlens, block_table_local, cp_block, scale, sinks,
                                 k_scale, v_scale, return_lse, num_splits, impl, cp_group,
                                 softcap)
    if world == 1:
        return res
    if not return_lse:
        return _exchange_outputs(res, B, group, exchange)
    # The LSE rides along in the output's exchange, as one more float32 column.
    out, lse = res
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    both = _exchange_outputs(torch.cat([out.to(compute), lse.to(compute)[..., None]], dim=-1),
                             B, group, exchange)
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
    cache_seqlens: Optional[torch.Tensor] = None,
    exchange: str = "all_gather",
) -> None:
    """Append this step's keys and values to the local caches, in place: one all-gather of
    the ranks' KV heads (or one all-to-all, sending each rank its sequences' rows only),
    then each rank writes its own sequences.

    Args:
        k_cache_local, v_cache_local, block_table_local: as for
            :func:`kvdp_decode_attention` (``Hkv = W * Hkv_local``: the gathered KV heads,
            rank-major).
        k_new, v_new: ``[B, s_new, Hkv_local, D]``: this rank's KV heads for all ``B``
            sequences (``B``, ``s_new``, ``Hkv_local``, ``D`` equal on every rank).
        seqlens_local: ``[B_r]`` tokens the local cache holds of each of this rank's
            sequences before the append: their lengths, or with ``cp_group`` this rank's
            CP-shard counts of them (as for :func:`kvdp_decode_attention`).
        cp_group, cp_block: the CP group over which the local caches are sharded; each new
            token goes to the CP rank that owns its global position, as by
            :func:`~lmfuse.distributed.cp_cache_append`.
        cache_seqlens: optional ``[B_r]`` global lengths of this rank's sequences before the
            append (the same on the ranks of ``cp_group``): with ``cp_group`` they save the
            all-reduce of ``seqlens_local`` over it; unused without it.
        k_scale, v_scale, impl: as for ``kv_cache_append``.
        exchange: ``"all_gather"`` (the default) or ``"all_to_all"``, as for
            :func:`kvdp_decode_attention`: all-gather every rank's ``k_new``/``v_new`` and
            keep this rank's sequences, or receive only those (rows padded to ``ceil(B /
            W)``). The caches come out the same bit for bit.
    Collectives: one all-gather (or all-to-all) over ``group`` (none with one rank), and with a
    ``cp_group`` of several ranks and no ``cache_seqlens``, one all-reduce of ``[B_r]``
    int64 over ``cp_group``. When every rank already has all KV heads of its sequences (KV
    heads replicated over the group, as with fewer KV heads than ranks), no all-gather is
    needed: call ``kv_cache_append`` (or ``cp_cache_append``) with the rows
    ``kvdp_batch_range(B, group)`` of ``k_new``/``v_new``.
    """
    op = "kvdp_cache_append"
    check_group(op, "group", group)
    check_group(op, "cp_group", cp_group)
    check_choice(op, "exchange", exchange, EXCHANGES)
    check_tensor(op, "k_new", k_new, ndim=4)
    check_tensor(op, "v_new", v_new, ndim=4)
    if k_new.shape != v_new.shape or k_new.dtype != v_new.dtype:
        raise ValueError(f"{op}: k_new {tuple(k_new.shape)} {k_new.dtype} and v_new "
                         f"{tuple(v_new.shape)} {v_new.dtype} must have one shape and dtype")
    world = group_size(group)
    B, s_new, Hkv_local, D = k_new.shape
    start, stop = kvdp_batch_range(B, group)
    _check_local_lengths(op, seqlens_local, cache_seqlens, B, group, k_new, "k_new")
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
    if world > 1:  # K and V side by side as 2 * Hkv_local heads: the queries' one exchange
        both = _exchange_queries(torch.cat([k_new, v_new], dim=2), group, exchange, world,
                                 start, stop).view(stop - start, s_new, world, 2, Hkv_local, D)
        k_new = both[:, :, :, 0].reshape(stop - start, s_new, world * Hkv_local, D)
        v_new = both[:, :, :, 1].reshape(stop - start, s_new, world * Hkv_local, D)
    if group_size(cp_group) == 1:  # no cp_group, or a one-rank one: whole sequences here
        kv_cache_append(k_cache_local, v_cache_local, k_new, v_new, seqlens_local,
                        block_table=block_table_local, **kw)
        return None
    if cache_seqlens is None:
        # Every token is held by exactly one CP rank: the counts sum to the lengths.
        cache_seqlens = all_reduce_sum(seqlens_local.long(), cp_group)
    cp_cache_append(k_cache_local, v_cache_local, k_new, v_new, cache_seqlens,
                    group=cp_group, block_table_shard=block_table_local, cp_block=cp_block,
                    **kw)
    return None
