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

from ..attention.kv_cache import DecodeStep, PagedKVCache
from ..distributed.collectives import group_rank, group_size
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

    def grow(self, requests: list[Request], width: int | None = None) -> DecodeStep:
        """Room on this rank for each request's next token (the rank owns it or not): the
        shard's step (its block table, its lengths before and after)."""
        ids, counts = [], []
        for r in requests:
            seq = self.local_seq(r.seq_id)
            held = self.cache.seqlen(seq)
            ids.append(seq)
            counts.append(self.local_len(r.length) - held)
        return self.cache.reserve(ids, counts, max_blocks=width)

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
