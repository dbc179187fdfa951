"""The Generator with its KV cache split by context over a process group (``cp_group``).

Every rank of the group runs the same model on the same requests, in lockstep (the
scheduler is the same code on the same inputs, so it decides the same on every rank);
only the cache is split: rank ``r`` stores the tokens of the round-robin blocks ``r, r +
N, r + 2N, ...`` of every sequence (``block_len`` tokens a block, lmfuse.distributed's CP
layout with ``cp_block = block_len``). A decode step appends each new token on its owner
(:func:`~lmfuse.distributed.cp_cache_append`) and attends with
:func:`~lmfuse.distributed.cp_decode_attention` (each rank over its share, the partials
merged exactly, one all-gather per layer); a prefill computes every token on every rank
(the prompt's keys are all at hand) and each rank stores the ones it owns.

Accounting: the scheduler runs over a *virtual* pool of the per-rank block count whose
blocks are ``N * block_len`` tokens long. A sequence of ``L`` tokens takes
``ceil(L / (N * block_len))`` virtual blocks, which is what its busiest rank (rank 0)
holds, so whatever the scheduler admits fits every rank's real pool: the ranks never run
out at different times, and no collective is spent on agreeing. Prefix sharing is off
(a shared prefix would be placed by another sequence's positions) and so every prefill
starts from position 0.
"""

from __future__ import annotations

from typing import Any

import torch

from ..attention.kv_cache import KVCacheFullError, PagedKVCache
from .._collectives import group_rank, group_size
from .request import OP, Request


class ContextShards:
    """This rank's side of a CP-split cache: the real pool, and its sequences keyed by the
    scheduler's (virtual) sequence ids."""

    def __init__(self, group: Any, cache: PagedKVCache) -> None:
        self.group = group
        self.world, self.rank = group_size(group), group_rank(group)
        self.cache = cache
        self.block_len = cache.block_len
        self._local: dict[int, int] = {}  # virtual seq id -> this rank's seq id

    def virtual_cache(self) -> PagedKVCache:
        """The scheduler's pool: as many blocks as a rank has, ``N * block_len`` tokens
        each (tiny tensors: it only counts)."""
        return PagedKVCache(self.cache.num_blocks, self.block_len * self.world, 1, 1,
                            torch.float32, "cpu")

    def local_len(self, length: int) -> int:
        """Tokens of a sequence of ``length`` this rank holds."""
        cycle = self.block_len * self.world
        rest = length % cycle - self.rank * self.block_len
        return (length // cycle) * self.block_len + min(max(rest, 0), self.block_len)

    def local_position(self, position: int) -> int | None:
        """Where global ``position`` lies in this rank's share, or None if another rank
        holds it."""
        block = position // self.block_len
        if block % self.world != self.rank:
            return None
        return (block // self.world) * self.block_len + position % self.block_len

    def sync(self, alive: set[int]) -> None:
        """Free this rank's sequences whose virtual sequence is gone (finished, preempted)."""
        for v in [v for v in self._local if v not in alive]:
            self.cache.free(self._local.pop(v))

    def local_seq(self, virtual: int) -> int:
        if virtual not in self._local:
            self._local[virtual] = self.cache.add_sequence()
        return self._local[virtual]

    def grow(self, requests: list[Request], lengths: list[int], width: int
             ) -> tuple[list[list[int]], list[int], list[int]]:
        """Room on this rank for each request's tokens up to its global length ``lengths[i]``
        (the rank owns the newest token or not): this rank's block tables (padded with -1
        to ``width`` blocks) and its lengths before and after the newest token."""
        ids, counts, before, after = [], [], [], []
        for r, length in zip(requests, lengths):
            seq = self.local_seq(r.seq_id)
            ids.append(seq)
            after.append(self.local_len(length))
            before.append(self.local_len(length - 1))
            counts.append(after[-1] - self.cache.seqlen(seq))
        if any(counts):
            self.cache.extend(ids, counts)
        return [pad_table(self.cache.block_ids(s), width) for s in ids], before, after

    def prefill_rows(self, request: Request, new: list[int]) -> tuple[list[int], list[int]]:
        """Reserve this rank's share of ``request``'s tokens; each new token's block
        (-1 where another rank holds it) and offset."""
        if request.num_cached:
            raise RuntimeError(f"{OP}: a context-parallel prefill starts from position 0")
        seq = self.local_seq(request.seq_id)
        total = request.num_cached + len(new)
        self.cache.reserve(seq, self.local_len(total) - self.cache.seqlen(seq))
        table = self.cache.block_ids(seq)
        blocks, offsets = [], []
        for i in range(len(new)):
            lp = self.local_position(request.num_cached + i)
            blocks.append(-1 if lp is None else table[lp // self.block_len])
            offsets.append(0 if lp is None else lp % self.block_len)
        return blocks, offsets


class BatchShards:
    """The Generator with its KV cache split by batch over a process group
    (``kvdp_group``): each sequence's cache lives on one rank, chosen when it is admitted
    (the rank with the most free blocks, the lowest on a tie). Every rank runs the model
    on every request and keeps the block accounting of every rank's pool (the others' as
    tensor-less mirrors), so all ranks schedule alike; this object is the scheduler's pool
    (it has the ``PagedKVCache`` methods the scheduler calls, routed to the owner's pool).

    A decode step appends each new token on its owner and attends with
    :func:`~lmfuse.distributed.kvdp_decode_attention`: the rows are laid out rank-major,
    ``m`` per rank (padded with empty rows), each rank passing its ``Hq / N`` query heads
    as Megatron's tensor-parallel layout has them; the heads are then all-gathered back
    (three collectives a layer). A prefill computes every token on every rank and the
    owner stores its sequences. Prefix sharing is off.
    """

    def __init__(self, group: Any, cache: PagedKVCache) -> None:
        self.group = group
        self.world, self.rank = group_size(group), group_rank(group)
        self.cache = cache
        self.block_len, self.num_blocks = cache.block_len, cache.num_blocks
        self.pools = [cache if r == self.rank else
                      PagedKVCache(cache.num_blocks, cache.block_len, 1, 1, torch.float32,
                                   "cpu") for r in range(self.world)]
        self._where: dict[int, tuple[int, int]] = {}  # seq id -> (owner rank, its seq id)
        self._next = 0

    # --- the pool the scheduler sees ------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return sum(p.num_free_blocks for p in self.pools)

    @property
    def sequences(self) -> list[int]:
        return list(self._where)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._where

    def add_sequence(self) -> int:
        owner = max(range(self.world), key=lambda r: (self.pools[r].num_free_blocks, -r))
        seq = self._next
        self._next += 1
        self._where[seq] = (owner, self.pools[owner].add_sequence())
        return seq

    def free(self, seq_id: int) -> None:
        owner, local = self._where.pop(seq_id)
        self.pools[owner].free(local)

    def seqlen(self, seq_id: int) -> int:
        owner, local = self._where[seq_id]
        return self.pools[owner].seqlen(local)

    def block_ids(self, seq_id: int) -> list[int]:
        owner, local = self._where[seq_id]
        return self.pools[owner].block_ids(local)

    def owner(self, seq_id: int) -> int:
        return self._where[seq_id][0]

    def local(self, seq_id: int) -> int:
        return self._where[seq_id][1]

    def reserve(self, seq_ids: Any, num_tokens: Any = 1, *, max_blocks: int | None = None
                ) -> None:
        """Room for ``num_tokens`` more in each sequence, on its owner; all or nothing over
        every pool (``KVCacheFullError`` when one pool lacks blocks)."""
        ids = [seq_ids] if isinstance(seq_ids, int) else list(seq_ids)
        counts = (list(num_tokens) if isinstance(num_tokens, (list, tuple))
                  else [num_tokens] * len(ids))
        by_pool: dict[int, tuple[list[int], list[int]]] = {}
        for s, n in zip(ids, counts):
            owner, local = self._where[s]
            locs, ns = by_pool.setdefault(owner, ([], []))
            locs.append(local)
            ns.append(n)
        for owner, (locs, ns) in by_pool.items():
            need = self.pools[owner].blocks_needed(locs, ns)
            if need > self.pools[owner].num_free_blocks:
                raise KVCacheFullError(f"{OP}: rank {owner}'s pool needs {need} blocks, "
                                       f"{self.pools[owner].num_free_blocks} are free")
        for owner, (locs, ns) in by_pool.items():
            self.pools[owner].extend(locs, ns)  # the runner builds the step's inputs

    def fork(self, seq_id: int) -> int:
        raise RuntimeError(f"{OP}: no prefix sharing with kvdp_group")

    def truncate(self, seq_id: int, length: int) -> None:
        raise RuntimeError(f"{OP}: no prefix sharing with kvdp_group")

    # --- the runner's side ------------------------------------------------------------------

    def layout(self, requests: list[Request], per_rank: int | None = None
               ) -> tuple[list[int], list[int], int]:
        """The rank-major padded layout of a decode batch: for each padded row the model
        row it holds (-1: padding), this rank's rows (model rows of its sequences, in
        order), and ``m``, the rows per rank (``per_rank`` if given, else the most any rank
        holds)."""
        per: list[list[int]] = [[] for _ in range(self.world)]
        for i, r in enumerate(requests):
            per[self.owner(r.seq_id)].append(i)
        m = max(1, max(len(rows) for rows in per))
        if per_rank is not None:
            if per_rank < m:
                raise ValueError(f"{OP}: per_rank={per_rank} is less than the {m} rows a "
                                 "rank holds")
            m = per_rank
        padded = []
        for rows in per:
            padded += rows + [-1] * (m - len(rows))
        return padded, per[self.rank], m


def pad_table(table: list[int], width: int) -> list[int]:
    """A block table padded with -1 (no block) to ``width`` columns."""
    return table + [-1] * (width - len(table))
