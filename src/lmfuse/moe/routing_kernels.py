"""Triton kernels of the MoE routing: the stable sort of the ``T * k`` (token, slot) pairs by
expert, its inverse, the experts' row offsets, the row-tile table and the router weights in
sorted order, in one program for small problems (``moe_route_kernel``), in three launches
for larger ones (the counting sort at the end of this file; see ``routing.py`` for the
launches, the size limits and the torch ops they equal).

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


# --- training sizes: a counting sort in three launches -----------------------------------------
# Past the one-program kernel's limits, the pairs are cut into blocks of ``BLOCK`` (a power of
# two). ``moe_count_kernel`` counts each block's pairs by expert key (``E`` for a pair with no
# expert), ``moe_base_kernel`` turns the counts into each (block, key)'s first sorted row, and
# ``moe_place_kernel`` sorts each block's pairs by (key, pair) and writes every pair at its
# block's base for its key plus its rank there: a stable sort by expert, as ``torch.sort``'s.


@triton.jit
def _keys(IDS, ids_s0, ids_s1, i, pair, k, E):
    """Each pair's sort key: its expert, ``E`` for an id outside ``[0, E)`` (checked in the
    ids' own dtype) and for the padding past the last pair."""
    t = i // k
    ids = tl.load(IDS + t * ids_s0 + (i - t * k) * ids_s1, mask=pair, other=0)
    return tl.where(pair & (ids >= 0) & (ids < E), ids, E).to(tl.int32)


@triton.jit
def moe_count_kernel(IDS, ids_s0, ids_s1, COUNTS, rows, k, E, EP: tl.constexpr,
                     BLOCK: tl.constexpr):
    """``COUNTS [blocks, EP]`` int32: block ``b``'s pairs of each key (``EP``: a power of two
    above ``E``; the padding past ``rows`` not counted)."""
    b = tl.program_id(0)
    i = b * BLOCK + tl.arange(0, BLOCK)
    pair = i < rows
    key = _keys(IDS, ids_s0, ids_s1, i, pair, k, E)
    counts = tl.histogram(key, EP)
    e = tl.arange(0, EP)
    pad = tl.sum((~pair).to(tl.int32), axis=0)
    counts = counts - tl.where(e == E, pad, 0)
    tl.store(COUNTS + b * EP + e, counts)


@triton.jit
def moe_base_kernel(COUNTS, DELTA, OFFSETS, blocks, E, EP: tl.constexpr,
                    CHUNK: tl.constexpr):
    """One program. ``DELTA [blocks, EP]`` int32: the sorted row of block ``b``'s first pair of
    key ``e``, less the pairs of smaller keys in that block (so the pair at position ``p`` of
    the block's key order goes to row ``DELTA[b, e] + p``); ``OFFSETS [E + 1]``: each
    expert's first row, then the pairs with an expert."""
    e = tl.arange(0, EP)
    total = tl.zeros([EP], dtype=tl.int32)
    for b0 in range(0, blocks, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        c = tl.load(COUNTS + b[:, None] * EP + e[None, :], mask=(b < blocks)[:, None], other=0)
        total += tl.sum(c, axis=0)
    start = tl.cumsum(total, axis=0) - total
    tl.store(OFFSETS + e, start, mask=e <= E)
    run = start
    for b0 in range(0, blocks, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        m = (b < blocks)[:, None]
        c = tl.load(COUNTS + b[:, None] * EP + e[None, :], mask=m, other=0)
        base = run[None, :] + tl.cumsum(c, axis=0) - c
        local = tl.cumsum(c, axis=1) - c
        tl.store(DELTA + b[:, None] * EP + e[None, :], base - local, mask=m)
        run += tl.sum(c, axis=0)


@triton.jit
def moe_place_kernel(IDS, ids_s0, ids_s1, RW, rw_s0, rw_s1, DELTA, PERM, TOKEN, INV, WEIGHTS,
                     rows, k, E, EP: tl.constexpr, BLOCK: tl.constexpr,
                     LOG_BLOCK: tl.constexpr):
    """Block ``b``'s pairs sorted by ``key * BLOCK + position`` (the padding last): the pair at
    position ``p`` of that order goes to sorted row ``DELTA[b, key] + p``. Writes ``PERM``,
    ``INV`` (int64), ``TOKEN`` (int32) and ``WEIGHTS`` (float32) as ``moe_route_kernel``."""
    b = tl.program_id(0)
    pos = tl.arange(0, BLOCK)
    i = b * BLOCK + pos
    pair = i < rows
    key = _keys(IDS, ids_s0, ids_s1, i, pair, k, E)
    order = tl.sort(tl.where(pair, key * BLOCK + pos, EP * BLOCK + pos))
    p_key = order >> LOG_BLOCK
    src = b * BLOCK + (order & (BLOCK - 1))
    ok = src < rows
    row = tl.load(DELTA + b * EP + p_key, mask=ok, other=0) + pos
    t = src // k
    tl.store(PERM + row, src.to(tl.int64), mask=ok)
    tl.store(TOKEN + row, t, mask=ok)
    tl.store(INV + src, row.to(tl.int64), mask=ok)
    w = tl.load(RW + t * rw_s0 + (src - t * k) * rw_s1, mask=ok, other=0.0)
    tl.store(WEIGHTS + row, w.to(tl.float32), mask=ok)
