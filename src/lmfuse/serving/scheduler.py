"""Which requests run in the next step, and where their tokens live in the block pool.

Each step is a **prefill** of waiting requests or a **decode** of the running ones:

* If requests wait and the batch has room, the oldest ones are admitted (in arrival
  order, up to ``max_prefill_tokens`` new tokens; a longer first one is prefilled in
  chunks of that many, one a step, a decode step of the running requests between two
  chunks, where ``chunk_prefill``; else whole), unless ``max_prefill_streak`` prefill
  steps in a row have run while requests were running: then the running ones decode a
  step first (a stream of arrivals never stalls them; a burst admitted in several steps
  costs a decode step per ``max_prefill_streak`` of them): each
  gets a sequence in the :class:`~lmfuse.PagedKVCache`, sharing the full blocks of the
  longest prefix another live sequence already holds (``fork`` then ``truncate``: the
  shared blocks are reference-counted, never copied), and room for the rest of its
  tokens. A request is admitted only if, after it, every running request could still
  grow by one block; otherwise it waits.
* Otherwise every running request grows by one token (``reserve``, all or nothing). When
  the pool cannot give that, the most recently admitted request is **preempted**: its
  blocks are freed and it goes back to the front of the queue, to be prefilled again
  from its prompt and the tokens it already produced. A request's rows (``len(prompt) +
  max_new_tokens - 1``: its last token is never fed) always fit the pool (checked when
  it is added), so
  the oldest request alone can always run: ``KVCacheFullError`` never escapes.

Prefix sharing keys each full block by a hash of the tokens up to its end, for the live
sequences that hold it; a block's key leaves the index when its sequence is freed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .._launch import cdiv, next_pow2
from ..attention.kv_cache import KVCacheFullError, PagedKVCache
from .request import Request, Status


@dataclass
class Batch:
    """A step's work: ``kind`` "prefill" (each request's ``new[i]`` tokens from position
    ``request.num_cached``) or "decode" (one token each, from ``step``)."""

    kind: str
    requests: list[Request]
    new: list[list[int]] = field(default_factory=list)  # prefill: the tokens to compute
    step: object = None  # decode: the DecodeStep from PagedKVCache.reserve
    partial: bool = False  # prefill: a chunk before the prompt's last (no token comes)


class Scheduler:
    def __init__(self, cache: PagedKVCache, *, max_batch: int, max_prefill_tokens: int,
                 prefix_sharing: bool = True, max_blocks: int | None = None,
                 chunk_prefill: bool = True, max_prefill_streak: int = 4) -> None:
        self.cache = cache
        self.max_prefill_streak = max_prefill_streak
        self._streak = 0  # prefill steps since the last decode step (> 0: the last was one)
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.prefix_sharing = prefix_sharing
        self.chunk_prefill = chunk_prefill
        # A request admitted whose prompt is prefilled in chunks (its blocks all reserved;
        # not in ``running`` until its last chunk).
        self.prefilling: Request | None = None
        self.max_blocks = max_blocks  # pad decode block tables to this width (None: as needed)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # chain hash of a full block -> the requests whose sequences hold it, in the order
        # they registered (the first shares; when it leaves, the next, if any, takes over)
        self._prefix: dict[int, list[Request]] = {}
        self._hashes: dict[int, list[int]] = {}  # seq id -> its registered chain hashes
        self.preemptions = 0
        self.shared_tokens = 0  # prompt tokens whose K/V came from another sequence

    # --- queue --------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    def finish(self, request: Request) -> None:
        request.status = Status.FINISHED
        self.running.remove(request)
        self._release(request)

    def abort(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
            self._release(request)
        elif request is self.prefilling:
            self.prefilling = None
            self._release(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = Status.FINISHED
        request.finish_reason = request.finish_reason or "aborted"

    def _release(self, request: Request) -> None:
        if request.seq_id is not None:
            for h in self._hashes.pop(request.seq_id, []):
                holders = self._prefix.get(h)
                if holders is not None and request in holders:
                    holders.remove(request)
                    if not holders:
                        del self._prefix[h]
            self.cache.free(request.seq_id)
            request.seq_id = None
        request.num_cached = 0

    # --- scheduling -----------------------------------------------------------------------

    def schedule(self) -> Batch | None:
        """The next step's batch (its blocks reserved), or None when nothing is left."""
        batch = None
        if self.prefilling is not None:  # its next chunk, a decode step between two
            if not (self.running and self._streak):
                batch = self._next_chunk()
        elif self.waiting and not (self.running
                                   and self._streak >= self.max_prefill_streak):
            batch = self._admit()
        if batch is None and self.running:
            batch = self._grow()
        if batch is not None:
            self._streak = self._streak + 1 if batch.kind == "prefill" else 0
        return batch

    def _admit(self) -> Batch | None:
        admitted: list[Request] = []
        new: list[list[int]] = []
        budget = self.max_prefill_tokens
        while self.waiting and len(self.running) + len(admitted) < self.max_batch:
            req = self.waiting[0]
            tokens = req.tokens
            seq, cached = self._place(tokens)
            todo = len(tokens) - cached
            if admitted and todo > budget:
                self.cache.free(seq)
                break
            chunked = not admitted and todo > budget and self.chunk_prefill
            try:
                self.cache.reserve(seq, todo)
            except KVCacheFullError:
                self.cache.free(seq)
                break
            # Keep a block of growth for every running request (and this one).
            if self.cache.num_free_blocks < len(self.running) + len(admitted) + 1 and (
                    self.running or admitted):
                self.cache.free(seq)
                break
            self.waiting.popleft()
            req.seq_id, req.num_cached, req.status = seq, cached, Status.RUNNING
            self.shared_tokens += cached
            if chunked:  # its first chunk alone
                self.prefilling = req
                return self._next_chunk()
            admitted.append(req)
            new.append(tokens[cached:])
            budget -= todo
        if not admitted:
            return None
        self.running.extend(admitted)
        return Batch("prefill", admitted, new)

    def _next_chunk(self) -> Batch:
        """The prefilling request's next ``max_prefill_tokens`` tokens (the caller adds
        them to its ``num_cached`` once computed); with its last it joins ``running``."""
        req = self.prefilling
        start = req.num_cached
        stop = min(req.length, start + self.max_prefill_tokens)
        partial = stop < req.length
        if not partial:
            self.prefilling = None
            self.running.append(req)
        return Batch("prefill", [req], [req.tokens[start:stop]], partial=partial)

    def _grow(self) -> Batch:
        while True:
            ids = [r.seq_id for r in self.running]
            try:
                step = self.cache.reserve(ids, 1, max_blocks=self.width())
                return Batch("decode", list(self.running), step=step)
            except KVCacheFullError:
                if self.prefilling is not None:  # the latest admitted: back to the queue
                    req, self.prefilling = self.prefilling, None
                    self._requeue(req)
                    continue
                if len(self.running) == 1:  # cannot happen: a request's length fits the pool
                    raise
                self._requeue(self.running.pop())

    def width(self, ahead: int = 0) -> int | None:
        """The block-table width of the running requests' next decode step (a power of two,
        at most ``max_blocks``; None: as needed); ``ahead``: of the step that many after it
        (each request a token longer)."""
        if self.max_blocks is None:
            return None
        bl = self.cache.block_len
        widest = max(cdiv(r.num_cached + 1 + ahead, bl) for r in self.running)
        return min(next_pow2(widest), self.max_blocks) if widest <= self.max_blocks else None

    def requeue_all(self) -> None:
        """Every running request, and the one prefilling, back to the front of the queue in
        their order, blocks freed, computed again from their tokens when admitted (the
        engine's recovery from a step that raised). A request that had reached its end
        before the step broke off finishes instead."""
        held = list(self.running) + ([self.prefilling] if self.prefilling is not None else [])
        self.running, self.prefilling = [], None
        for req in reversed(held):
            if req.finish_reason is not None:
                req.status = Status.FINISHED
                self._release(req)
            else:
                self._requeue(req)
        self._streak = 0

    def _requeue(self, request: Request) -> None:
        self._release(request)
        request.status = Status.WAITING
        request.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)

    # --- prefix sharing ---------------------------------------------------------------------

    def _chain(self, tokens: list[int], blocks: int) -> list[int]:
        bl = self.cache.block_len
        out, h = [], 0
        for i in range(blocks):
            h = hash((h, tuple(tokens[i * bl:(i + 1) * bl])))
            out.append(h)
        return out

    def _place(self, tokens: list[int]) -> tuple[int, int]:
        """A new sequence for ``tokens``, sharing the longest run of full blocks a live
        sequence holds (at least one token is left to compute, for its logits); (seq id,
        tokens already cached)."""
        bl = self.cache.block_len
        if not self.prefix_sharing:
            return self.cache.add_sequence(), 0
        usable = (len(tokens) - 1) // bl
        owner, shared = None, 0
        for i, h in enumerate(self._chain(tokens, usable)):
            holders = self._prefix.get(h)
            holder = holders[0] if holders else None
            if holder is None or holder.seq_id is None:
                break
            end = (i + 1) * bl
            # The hash picked it; the tokens decide (a collision must not share blocks).
            if holder.num_cached < end or holder.tokens[:end] != tokens[:end]:
                break
            owner, shared = holder.seq_id, i + 1
        if owner is None:
            return self.cache.add_sequence(), 0
        seq = self.cache.fork(owner)
        self.cache.truncate(seq, shared * bl)
        return seq, shared * bl

    def register_prefix(self, request: Request) -> None:
        """After its prefill: index the full blocks of ``request``'s sequence."""
        if not self.prefix_sharing or request.seq_id is None:
            return
        full = request.num_cached // self.cache.block_len
        hashes = self._chain(request.tokens, full)
        for h in hashes:
            self._prefix.setdefault(h, []).append(request)
        self._hashes[request.seq_id] = hashes
