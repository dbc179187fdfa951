"""Triton kernel of the MoE routing for small problems: the stable sort of the ``T * k``
(token, slot) pairs by expert, its inverse, the experts' row offsets, the row-tile table and
the router weights in sorted order, in one program (see ``routing.py`` for the launch, the
size limits and the torch ops it equals).

``moe_route_kernel`` holds every pair in registers. Pair ``i``'s one-hot row over the
(padded) experts, ``hot [ROWS, EP]``, summed down the pairs (``tl.cumsum`` along axis 0)
gives at ``(i, id_i)`` the pair's rank among its expert's pairs (1-based, in pair order:
that is what makes the sort stable), and its last row the experts' counts; the exclusive
cumsum of the counts is the offsets, and ``offsets[id_i] + rank_i - 1`` the pair's sorted
row. A register vector cannot be indexed by a register value, so "``x[id_i]``" is a
select-and-sum over the pair's one-hot row.

The tile table comes from the pairs too, so no ``[slots, E]`` tensor is needed: expert
``e``'s tiles are the slots ``last[e] - per[e] .. last[e] - 1`` (``per`` the experts' tile
counts ``cdiv(count, block_m)``, ``last`` their inclusive cumsum), and tile ``q`` of it
starts at its pair of rank ``q block_m + 1``, which writes the slot's (expert, first row,
end row). The slots from ``last[E - 1]`` on are written with zeros.

Integers are int32 in registers (``routing.route_small_ok`` keeps every count far below
2^31); ``perm`` and ``inv`` are stored as int64, as ``torch.argsort`` gives them.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def moe_route_kernel(
    IDS, ids_s0, ids_s1, RW, rw_s0, rw_s1,
    PERM, TOKEN, OFFSETS, INV, TILES, WEIGHTS,
    rows, k, E, slots, block_m,
    ROWS: tl.constexpr, EP: tl.constexpr, SLOTS: tl.constexpr,
):
    """One program. ``IDS``, ``RW``: ``[T, k]`` at strides ``(ids_s0, ids_s1)``, ``(rw_s0,
    rw_s1)``; ``rows = T k``; ``ROWS``, ``EP``, ``SLOTS``: powers of two covering ``rows``,
    ``E`` and ``slots``. Writes ``PERM``, ``INV`` (int64 ``[rows]``), ``TOKEN`` (int32
    ``[rows]``), ``WEIGHTS`` (float32 ``[rows]``), ``OFFSETS`` (int32 ``[E + 1]``), ``TILES``
    (int32 ``[slots, 3]``). A pair whose id is outside ``[0, E)`` belongs to no expert:
    it takes one of the rows after the experts' (in pair order), so ``perm``, ``inv``,
    ``token`` and ``weights`` are a whole permutation whatever the ids (the torch ops
    give such pairs rows outside every expert's range too); no tile covers it."""
    i = tl.arange(0, ROWS)
    pair = i < rows
    t = i // k
    j = i - t * k
    ids = tl.load(IDS + t * ids_s0 + j * ids_s1, mask=pair, other=0)
    # Checked in the ids' own dtype: an int64 id cast to int32 first could alias a valid one.
    placed = pair & (ids >= 0) & (ids < E)
    ids = tl.where(placed, ids.to(tl.int32), -1)
    e = tl.arange(0, EP)
    hot = ids[:, None] == e[None, :]
    below = tl.cumsum(hot.to(tl.int32), axis=0)
    counts = tl.sum(hot.to(tl.int32), axis=0)
    end = tl.cumsum(counts, axis=0)
    start = end - counts
    per = (counts + block_m - 1) // block_m
    last = tl.cumsum(per, axis=0)
    # "x[id_i]" of the pair's expert; 0 for a pair with no expert (rank 0).
    rank = tl.sum(tl.where(hot, below, 0), axis=1)
    first = tl.sum(tl.where(hot, start[None, :], 0), axis=1)
    stop = tl.sum(tl.where(hot, end[None, :], 0), axis=1)
    first_tile = tl.sum(tl.where(hot, (last - per)[None, :], 0), axis=1)
    ok = rank > 0
    # Pairs with no expert: the rows after the placed ones, in pair order.
    spill = tl.cumsum((pair & ~placed).to(tl.int32), axis=0)
    row = tl.where(ok, first + rank - 1, tl.sum(counts, axis=0) + spill - 1)
    tl.store(PERM + row, i.to(tl.int64), mask=pair)
    tl.store(TOKEN + row, t, mask=pair)
    w = tl.load(RW + t * rw_s0 + j * rw_s1, mask=pair, other=0.0)
    tl.store(WEIGHTS + row, w.to(tl.float32), mask=pair)
    tl.store(INV + i, row.to(tl.int64), mask=pair)
    tl.store(OFFSETS + e, start, mask=e < E)
    tl.store(OFFSETS + E, tl.sum(counts, axis=0))

    # Each tile's first pair writes its slot; the slots past the last tile get zeros.
    lead = ok & ((rank - 1) % block_m == 0)
    slot = first_tile + (rank - 1) // block_m
    tl.store(TILES + slot * 3, ids, mask=lead)
    tl.store(TILES + slot * 3 + 1, row, mask=lead)
    tl.store(TILES + slot * 3 + 2, tl.minimum(row + block_m, stop), mask=lead)
    s = tl.arange(0, SLOTS)
    unused = (s >= tl.sum(per, axis=0)) & (s < slots)
    zero = tl.zeros([SLOTS], dtype=tl.int32)
    tl.store(TILES + s * 3, zero, mask=unused)
    tl.store(TILES + s * 3 + 1, zero, mask=unused)
    tl.store(TILES + s * 3 + 2, zero, mask=unused)
