"""Running a Hugging Face causal LM over the paged cache: packed prefill forwards, decode
forwards, and the decode step captured in CUDA graphs.

The model is the user's, used in place: its weights are not copied, and its own forward
runs every layer (see ``attention.py`` for how its attention reaches the cache). While a
forward of the Generator runs, the model's ``config._attn_implementation`` is lmfuse's;
it is restored afterwards, so the model behaves as before between steps.

CUDA graphs (``cuda_graphs=True`` on a CUDA device): a decode forward is captured once per
(batch bucket, block-table width) pair, on first use, and replayed: batch buckets 1, 2, 4,
8, 16, then multiples of 16 up to ``max_batch``; widths are powers of two of blocks, so a
capture's split-KV layout suits the lengths it serves. A step copies its token ids,
positions, block table and lengths into the graph's static buffers (rows past the batch
get block -1 and length 0: they write nothing and attend over nothing), replays, and reads
the logits of its rows (every graph writes them into one buffer of the largest bucket's
rows, valid until the next replay). A greedy step of the fused decode layers run ahead in
a full batch bucket whose graph is captured moves its inputs and its tokens through pinned
host memory by small Triton copies on the compute queue (:func:`bus_copy`), its input
tokens being the last replay's own output: the GPU idles about 9 us between steps instead
of 13-28 with copy-engine transfers (H100, B64: steps 0.979 -> 0.970 ms). Other steps
copy as before.
In the captured forward the RMSNorms and gated MLPs of the families ``apply_lmfuse``
supports run lmfuse's fused kernels (``fused_norms_and_mlps``; the model is as before
afterwards), mixture-of-experts experts ``lmfuse.moe_experts`` where
``apply_lmfuse`` takes them (Mixtral, Qwen2/3-MoE, OLMoE, Granite-MoE, GPT-OSS), and other
experts transformers' capturable ``batched_mm`` implementation.
A model whose decode forward cannot be captured (a host sync in it) falls back to eager
decode steps, with a warning.

Prefill of the families with fused decode layers, on the Triton path, runs those layers
too (``FusedDecoder.forward`` with a :class:`~.fused.Prefill`): a row per prompt token
over its sequence's block table (the K/V rows written by the rotary kernel), the queries
through the decode kernel in chunks of consecutive positions of one sequence (64 query
rows a program), the LM head over each prompt's last row only. With CUDA graphs it is
captured per (tokens, sequences, chunks, table width) bucket, powers of two, on first use
(up to 8192 tokens, 16 sequences and 64 graphs; beyond, eagerly and unpadded; a failed
capture turns off the prefills' graphs only, with a warning). H100, the benchmark
model, one prompt, against the model's forward (host-bound: about 40 launches a layer):
64 tokens 8.2 -> 1.2 ms, 1024 tokens 9.4 -> 3.9 ms, 4096 tokens 18.1 -> 14.3 ms.
Otherwise the model's forward prefills (its own code for every family; the CPU path too).

Over a split cache (``sharded.py``) on an NCCL group the decode step is captured as well,
its collectives inside: per (batch bucket, rows per rank for KVDP, table width) key, the
step's inputs packed in one int64 buffer (one host-to-device copy a step). The keys come
from the block bookkeeping every rank keeps alike, so every rank captures and replays the
same graphs in the same order, as the collectives in them require.
"""

from __future__ import annotations

import array
import contextlib
import math
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .._dispatch import interpreter_active, triton_available
from .._launch import cdiv, lazy_kernels, next_pow2
from ..attention.kv_cache import DecodeStep, PagedKVCache
from ..integrations.transformers import fused_norms_and_mlps
from .attention import ATTENTION_NAME, Segment, StepContext, register
from .fused import FusedDecoder, Prefill, unsupported
from .sampling import greedy
from .request import Request
from .sharded import BatchShards, ContextShards, pad_table

_kernels = lazy_kernels("kernels", __package__)
# Prefills captured in CUDA graphs: at most this many token rows and sequences (longer
# ones run eagerly: the host's launches are small beside their GPU time), and at most this
# many graphs.
_PREFILL_GRAPH_TOKENS = 8192
_PREFILL_GRAPH_SEQS = 16
_PREFILL_GRAPHS = 64


def bus_copy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` by a Triton kernel on the current stream, for contiguous tensors
    of one dtype and size, each on the current CUDA device or in pinned host memory: the
    copy stays on the GPU's compute queue (nothing tells PyTorch's pinned-memory allocator
    of it: the caller keeps the host side alive until the stream has passed the copy). A
    copy-engine transfer between a decode step's kernels costs a hand-over each way (H100,
    B64 steps profiled: the tokens' device-to-host copy began 2-9 us after the step's last
    kernel, the next step's inputs' host-to-device copy 2-10 us after that, its first
    kernel 2-6 us after that: 13-28 us idle a step)."""
    if (dst.dtype != src.dtype or dst.numel() != src.numel() or not dst.is_contiguous()
            or not src.is_contiguous()):
        raise ValueError(f"bus_copy: contiguous tensors of one dtype and size, got {dst.dtype} "
                         f"{tuple(dst.shape)} and {src.dtype} {tuple(src.shape)}")
    if any(t.is_cuda and t.device.index != torch.cuda.current_device() for t in (dst, src)):
        raise ValueError(f"bus_copy: CUDA tensors on the current device "
                         f"(cuda:{torch.cuda.current_device()}), got {dst.device} and "
                         f"{src.device}")
    n = dst.numel()
    if n:
        _kernels().copy_kernel[(cdiv(n, 1024),)](src, dst, n, BLOCK=1024, num_warps=4)
    return dst


_bus_warm: set[int] = set()


def _warm_bus_copies(device: torch.device) -> None:
    """Compile :func:`bus_copy`'s kernel for the decode steps' int32 inputs and int64 tokens
    (once a process and device, beside a graph's capture): else the first steps run ahead
    pay Triton's compilations (the GPU demo's timed decode: about 0.1 s)."""
    if not bus_copies(device):
        return
    index = torch.cuda.current_device() if device.index is None else device.index
    if index in _bus_warm:
        return
    for dtype in (torch.int32, torch.int64):
        host = torch.zeros(16, dtype=dtype, pin_memory=True)
        dev = torch.empty(16, dtype=dtype, device=device)
        bus_copy(dev, host)
        bus_copy(host, dev)
    torch.cuda.current_stream(device).synchronize()
    _bus_warm.add(index)


def bus_copies(device: torch.device) -> bool:
    """Whether copies between ``device`` and pinned host memory around decode steps go
    through :func:`bus_copy` (a CUDA device, the current one, and the Triton compiler)."""
    return (device.type == "cuda" and triton_available() and not interpreter_active()
            and device.index in (None, torch.cuda.current_device()))


class ModelRunner:
    def __init__(self, model: Any, cache: PagedKVCache, *, impl: str = "auto",
                 cuda_graphs: bool = True, max_batch: int = 256,
                 shards: ContextShards | None = None,
                 batch_shards: BatchShards | None = None,
                 scheduled: Any = None, decode_path: str = "auto") -> None:
        register()
        self.model = model
        self.config = model.config
        self.cache = cache
        self.impl = impl
        self.device = cache.device
        # With a CP-split cache: this rank's side, and the scheduler's (virtual) pool.
        self.shards, self.scheduled = shards, scheduled
        # With a cache split by batch: the pools' owners (it is also the scheduler's pool).
        self.batch_shards = batch_shards
        self.sharded = shards is not None or batch_shards is not None
        group = (shards.group if shards is not None else batch_shards.group
                 if batch_shards is not None else None)
        # Graphs need the Triton kernels (the torch path checks values on the host) and,
        # over a split cache, NCCL (its collectives are captured with the step).
        self.graphs_on = (bool(cuda_graphs) and self.device.type == "cuda" and impl != "torch"
                          and (group is None or "nccl" in str(dist.get_backend(group))))
        #: Sharded decode steps padded to the batch buckets of the CUDA graphs even when
        #: they run eagerly (the padded layout is then exercised without a GPU: tests).
        self.pad_sharded = self.graphs_on
        #: Fused prefills padded to the buckets of their CUDA graphs even when they run
        #: eagerly (likewise; tests).
        self.pad_prefill = False
        # Prefills in CUDA graphs: off after a failed capture (decode graphs stay on).
        self.prefill_graphs_on = True
        self.max_batch = max_batch
        self._graphs: dict[tuple, _DecodeGraph | _ShardedGraph] = {}
        self._pool = None
        self._logits_buf: torch.Tensor | None = None  # the graphs' logits (_logits_out)
        self.graph_failures = 0
        self.graph_retries = 0  # captures that failed once and were tried again
        self.graph_retry_error: str | None = None  # what the last retried capture raised
        self.graph_failure: str | None = None  # the last capture failure, where it arose
        # The fused decode layers (fused.py) where the model's family has them and the
        # cache is not split; otherwise the model's own forward decodes.
        self.fused: FusedDecoder | None = None
        if decode_path == "fused" and self.sharded:
            raise ValueError("Generator: decode_path='fused' does not run over a split KV "
                             "cache (kvdp_group / cp_group) yet; use 'auto' or 'model'")
        # Triton's interpreter has no bfloat16 tl.dot (it gives wrong products): the fused
        # layers' GEMVs cannot run a bfloat16 model there.
        bf16_interpreted = (impl != "torch" and self.device.type == "cpu"
                            and interpreter_active()
                            and next(model.parameters()).dtype == torch.bfloat16)
        if decode_path == "fused" and bf16_interpreted:
            raise ValueError("Generator: decode_path='fused' cannot run a bfloat16 model in "
                             "Triton's interpreter (no bfloat16 tl.dot there); use 'auto', "
                             "'model', impl='torch' or a float16 / float32 model")
        if decode_path == "fused" or (decode_path == "auto" and not self.sharded
                                      and not bf16_interpreted and unsupported(model) is None):
            self.fused = FusedDecoder(model, cache, impl)
        self.decode_path = "fused" if self.fused is not None else "model"
        self._greedy: torch.Tensor | None = None  # the last replay's argmax tokens

    def take_greedy(self) -> torch.Tensor | None:
        """The argmax tokens ``[n]`` the last decode computed in its CUDA graph (None if it
        ran eagerly); cleared by the call."""
        out, self._greedy = self._greedy, None
        return out

    @contextlib.contextmanager
    def _lmfuse_attention(self) -> Iterator[None]:
        saved = self.config._attn_implementation
        self.config._attn_implementation = ATTENTION_NAME
        try:
            yield
        finally:
            self.config._attn_implementation = saved

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 ctx: StepContext, logits_to_keep: Any) -> torch.Tensor:
        with self._lmfuse_attention(), torch.inference_mode():
            out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                             logits_to_keep=logits_to_keep, lmfuse_step=ctx)
        return out.logits

    # --- prefill ------------------------------------------------------------------------

    def prefill(self, requests: list[Request], new: list[list[int]],
                model: bool = False) -> torch.Tensor:
        """Compute ``new[i]`` (the tokens of request ``i`` from position
        ``num_cached``) for every request in one packed forward, writing their K/V into
        the requests' blocks; the logits ``[n, V]`` at each request's last token. Through
        the fused layers where they decode (``model``: the model's own forward)."""
        if self.fused is not None and self.fused.triton and not model:
            return self._prefill_fused(requests, new)
        bl = self.cache.block_len
        if self.shards is not None:
            self.shards.sync(set(self.scheduled.sequences))
        ids, pos, blocks, offsets, segments, last = [], [], [], [], [], []
        for req, toks in zip(requests, new):
            start = len(ids)
            if self.shards is not None:  # this rank's share of the tokens, -1 elsewhere
                rows, offs = self.shards.prefill_rows(req, toks)
                blocks += rows
                offsets += offs
                table = []
            elif self.batch_shards is not None:  # the owner stores them
                bs = self.batch_shards
                table = ([] if bs.owner(req.seq_id) != bs.rank
                         else self.cache.block_ids(bs.local(req.seq_id)))
            else:
                table = self.cache.block_ids(req.seq_id)
            positions = range(req.num_cached, req.num_cached + len(toks))
            ids += toks
            pos += positions
            if self.shards is None:
                blocks += [table[p // bl] if table else -1 for p in positions]
                offsets += [p % bl for p in positions]
            segments.append(Segment(start, len(ids), req.num_cached,
                                    torch.tensor(table, dtype=torch.int64)))
            last.append(len(ids) - 1)
        dev = self.device
        host = torch.tensor([ids, pos], dtype=torch.int64).to(dev, non_blocking=True)
        for seg in segments:
            seg.blocks = seg.blocks.to(dev, non_blocking=True)
        rows = None
        if self.shards is not None or self.batch_shards is not None:  # only what it owns
            mine = [i for i, b in enumerate(blocks) if b >= 0]
            blocks = [blocks[i] for i in mine]
            offsets = [offsets[i] for i in mine]
            rows = torch.tensor(mine, dtype=torch.int64).to(dev, non_blocking=True)
        where = torch.tensor([blocks, offsets], dtype=torch.int32).to(dev, non_blocking=True)
        ctx = StepContext(self.cache, "prefill", self.impl, token_blocks=where[0][:, None],
                          token_offsets=where[1], token_rows=rows, segments=segments)
        keep = torch.tensor(last, dtype=torch.int64).to(dev, non_blocking=True)
        logits = self._forward(host[0][None], host[1][None], ctx, keep)
        return logits[0]

    def _prefill_fused(self, requests: list[Request], new: list[list[int]]) -> torch.Tensor:
        """:meth:`prefill` through the fused layers (``FusedDecoder.forward``, a row per
        token over its sequence's block table, the queries in chunks), in a CUDA graph per
        (tokens, sequences, chunks, table width) bucket where graphs are on: the model's
        forward (about 40 launches a layer) bound a prefill on the host (H100, the
        benchmark model: 8-11 ms for a 64-token prompt), and the fused layers' eager
        launches still do (about 5 ms; 1.2 ms in a graph)."""
        n, chunk = len(requests), self.fused.chunk
        tables = [self.cache.block_ids(r.seq_id) for r in requests]
        shape = _prefill_shape(new, tables, chunk, True)
        key = ("prefill", *shape)
        graphs = (self.graphs_on and self.prefill_graphs_on
                  and shape[0] <= _PREFILL_GRAPH_TOKENS and shape[1] <= _PREFILL_GRAPH_SEQS
                  and (key in self._graphs  # a new one while fewer than the cap exist
                       or sum(k[0] == "prefill" for k in self._graphs) < _PREFILL_GRAPHS))
        if not (graphs or self.pad_prefill):  # padding is wasted work without a graph
            shape = _prefill_shape(new, tables, chunk, False)
        buf = _prefill_inputs(requests, new, tables, chunk, shape)
        if self.device.type == "cuda":  # from pinned memory the copy does not wait
            buf = buf.pin_memory()
        if graphs:
            graph = self._graph(key, lambda pool: _PrefillGraph(self, shape, pool))
            if graph is not None:
                return graph.run(buf, n)
        return self._prefill_forward(buf.to(self.device, non_blocking=True), shape)[:n]

    def _prefill_forward(self, buf: torch.Tensor, shape: tuple[int, int, int, int],
                         out: torch.Tensor | None = None) -> torch.Tensor:
        """The fused prefill over a :func:`_prefill_inputs` buffer on the device: the logits
        ``[seqs, V]`` of each sequence's last token (padding sequences: any row's), in
        ``out`` where given."""
        tokens, seqs, chunks, width = shape
        c = self.fused.chunk
        ids, pos, seq = buf[:3 * tokens].view(3, tokens)
        at = 3 * tokens
        keep, rows = buf[at:at + seqs], buf[at + seqs:at + seqs + tokens]
        at += seqs + tokens
        slots = buf[at:at + chunks * c]
        ends, owner = buf[at + chunks * c:at + chunks * (c + 2)].view(2, chunks)
        tables = buf[at + chunks * (c + 2):].view(seqs + 1, width).to(torch.int32)
        prefill = Prefill(slots, tables.index_select(0, owner), ends.to(torch.int32), rows,
                          keep)
        with torch.inference_mode():
            return self.fused.forward(ids, tables.index_select(0, seq), pos.to(torch.int32),
                                      None, prefill=prefill, out=out)

    # --- decode ---------------------------------------------------------------------------

    def decode(self, requests: list[Request], step: DecodeStep) -> torch.Tensor:
        """One token of every request (its last, at position ``length - 1``), the step's
        blocks reserved: the logits ``[n, V]``."""
        n = len(requests)
        if self.sharded:
            return self._decode_sharded(requests)
        host = self._host_inputs(requests)
        width = step.block_table.shape[1]
        if self.graphs_on and n <= self.max_batch:
            graph = self._graph((_bucket(n, self.max_batch), width))
            if graph is not None:
                return graph.run(host, step, n)
        host = host.to(self.device, non_blocking=True)
        if self.fused is not None:
            with torch.inference_mode():
                return self.fused.forward(host[0], step.block_table, step.seqlens_before,
                                          step.seqlens)
        ctx = StepContext(self.cache, "decode", self.impl, block_table=step.block_table,
                          seqlens_before=step.seqlens_before, seqlens=step.seqlens)
        return self._forward(host[0][:, None], host[1][:, None], ctx, 1)[:, -1]

    def decode_ahead(self, requests: list[Request], step: DecodeStep,
                     ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """Launch a greedy decode step and return its argmax tokens ``[n]`` on the device,
        without reading them (None where the step cannot run this way: a split cache).
        ``ids``: the step's input tokens on the device (the previous step's output, not yet
        read by the host); default each request's last token. In a CUDA graph where one is
        captured, else eagerly. Over a split cache ``step`` is unused (the step's inputs come
        from the pools' bookkeeping)."""
        if self.sharded:
            logits = self._decode_sharded(requests, ids)
            tokens = self.take_greedy()
            return greedy(logits) if tokens is None else tokens
        n = len(requests)
        width = step.block_table.shape[1]
        if self.graphs_on and n <= self.max_batch:
            graph = self._graph((_bucket(n, self.max_batch), width))
            if graph is not None:
                graph.run(None if ids is not None else self._host_inputs(requests), step, n,
                          ids=ids)
                return self.take_greedy()
        if ids is None:
            ids = self._host_inputs(requests)[0].to(self.device, non_blocking=True)
        if self.fused is not None:
            with torch.inference_mode():
                return self.fused.forward(ids, step.block_table, step.seqlens_before,
                                          step.seqlens, argmax=True)[1]
        ctx = StepContext(self.cache, "decode", self.impl, block_table=step.block_table,
                          seqlens_before=step.seqlens_before, seqlens=step.seqlens)
        pos = step.seqlens_before.to(torch.int64)
        logits = self._forward(ids.to(torch.int64)[:, None], pos[:, None], ctx, 1)[:, -1]
        return greedy(logits)

    def step_buffer(self, n: int, width: int | None) -> torch.Tensor | None:
        """Where :meth:`PagedKVCache.reserve` (its ``out``) puts a step of ``n`` rows and
        ``width`` blocks that a captured decode graph will replay: the graph's input buffer
        where it holds exactly such a step (a full batch bucket, the graph captured
        already); on a CUDA device with the Triton compiler a new pinned host buffer
        instead for the fused decode layers, which the replay copies in on the compute
        queue (:func:`bus_copy`; keep it alive until the step has been read). None
        otherwise."""
        if (self.sharded or not self.graphs_on or width is None or n > self.max_batch
                or _bucket(n, self.max_batch) != n):
            return None
        graph = self._graphs.get((n, width))
        if not isinstance(graph, _DecodeGraph):
            return None
        # (the fused layers only: the model's own forward also copies the positions, which
        # from host memory would wait for the stream)
        if self.fused is not None and bus_copies(self.device):
            return torch.empty(graph.packed.shape, dtype=torch.int32, pin_memory=True)
        return graph.packed

    @staticmethod
    def _host_inputs(requests: list[Request]) -> torch.Tensor:
        """``[2, n]`` int64: each request's last token and its position (pinned memory on a
        CUDA host, so the copy to the device does not wait for the stream)."""
        host = torch.tensor([[r.last_token for r in requests], [r.length - 1 for r in requests]],
                            dtype=torch.int64)
        return host.pin_memory() if torch.cuda.is_available() else host

    # --- decode over a split cache ----------------------------------------------------------

    def _decode_sharded(self, requests: list[Request],
                        ids: torch.Tensor | None = None) -> torch.Tensor:
        """A decode step over a cache split by context or by batch (its blocks reserved in
        the scheduler's pool): the logits ``[n, V]``; ``ids``: the input tokens on the
        device (else each request's last token). Every input of the step travels in one
        int64 buffer (one host-to-device copy) at the static sizes of its CUDA graph: the
        batch padded to its bucket (rows with no blocks and no length: they write and read
        nothing) and, batch-split, each rank's rows too."""
        n = len(requests)
        graphs = self.graphs_on and n <= self.max_batch
        rows = _bucket(n, self.max_batch) if graphs or self.pad_sharded else n
        if self.shards is not None:
            key, fields = self._cp_fields(requests, rows)
        else:
            key, fields = self._kvdp_fields(requests, rows, graphs or self.pad_sharded)
        host, where = _pack(fields)
        if graphs:
            graph = self._graph(key, lambda pool: _ShardedGraph(self, where, host.numel(),
                                                                pool))
            if graph is not None:
                return graph.run(host, n, ids)
        views = _unpack(host.to(self.device, non_blocking=True), where)
        if ids is not None:
            views["ids"][:n].copy_(ids)
        return self._sharded_forward(views)[:n]

    def _cp_fields(self, requests: list[Request], rows: int) -> tuple[tuple, dict[str, Any]]:
        """The step's inputs over a CP-split cache: the tokens, their global positions and
        lengths after, and this rank's block tables and lengths (its share of each
        sequence, grown where the rank owns the new token). The table width is a power of
        two of the virtual pool's blocks (what rank 0, the busiest, holds): the same on
        every rank, so all ranks replay the same graph."""
        shards = self.shards
        shards.sync(set(self.scheduled.sequences))
        after = [self.scheduled.seqlen(r.seq_id) for r in requests]
        width = self._table_width(max(cdiv(a, self.scheduled.block_len) for a in after))
        tables, before_l, after_l = shards.grow(requests, after, width)
        pad = rows - len(requests)
        fields = {
            "ids": [r.last_token for r in requests] + [0] * pad,
            "pos": [a - 1 for a in after] + [0] * pad,
            "after": after + [0] * pad,
            "table": tables + [[-1] * width] * pad,
            "local_before": before_l + [0] * pad,
            "local_after": after_l + [0] * pad,
        }
        return ("cp", rows, width), fields

    def _kvdp_fields(self, requests: list[Request], rows: int,
                     bucketed: bool) -> tuple[tuple, dict[str, Any]]:
        """The step's inputs over a batch-split cache: the tokens and positions of every
        row; this rank's ``m`` rows of the rank-major layout (their tables and lengths,
        padding rows with none), ``own`` (the model rows of its sequences, padded with row
        0), ``pad_src`` (the model row of each of the ``N * m`` rank-major rows) and
        ``out_index`` (each model row's place among them). Bucketed, ``m`` is the bucket of
        the busiest rank's rows and the table width a power of two of the longest
        sequence's blocks: from the pools' shared bookkeeping, the same on every rank."""
        bs = self.batch_shards
        padded, mine, m = bs.layout(requests)
        per_rank = min(_bucket(m, self.max_batch), rows) if bucketed else m
        if per_rank != m:  # each rank's rows padded to their bucket too
            padded, mine, m = bs.layout(requests, per_rank)
        lengths = [bs.seqlen(r.seq_id) for r in requests]
        locals_ = [bs.local(requests[i].seq_id) for i in mine]
        tables = [self.cache.block_ids(s) for s in locals_]
        width = (self._table_width(max(cdiv(a, self.cache.block_len) for a in lengths))
                 if bucketed else max([1] + [len(t) for t in tables]))
        after = [self.cache.seqlen(s) for s in locals_] + [0] * (m - len(mine))
        place = {row: i for i, row in enumerate(padded) if row >= 0}
        pad = rows - len(requests)
        fields = {
            "ids": [r.last_token for r in requests] + [0] * pad,
            "pos": [a - 1 for a in lengths] + [0] * pad,
            "table": [pad_table(t, width) for t in tables] + [[-1] * width] * (m - len(mine)),
            "local_before": [max(a - 1, 0) for a in after],
            "local_after": after,
            "own": mine + [0] * (m - len(mine)),
            "pad_src": [max(r, 0) for r in padded],
            "out_index": [place[i] for i in range(len(requests))] + [0] * pad,
        }
        return ("kvdp", rows, m, width), fields

    def _table_width(self, widest: int) -> int:
        """A split step's block-table width for ``widest`` blocks: the next power of two
        (few graph keys), at most the pool, at least ``widest``."""
        return max(min(next_pow2(widest), self.cache.num_blocks), widest)

    def _sharded_forward(self, views: dict[str, torch.Tensor]) -> torch.Tensor:
        """The model's decode forward over the split cache, from the step's input views
        (``_cp_fields`` / ``_kvdp_fields``, on the device): logits ``[rows, V]``."""
        i32 = {k: views[k].to(torch.int32) for k in ("table", "local_before", "local_after")}
        common = dict(block_table=i32["table"], seqlens_before=i32["local_before"],
                      seqlens=i32["local_after"])
        if self.shards is not None:
            ctx = StepContext(self.cache, "decode", self.impl, cp_group=self.shards.group,
                              cp_block=self.shards.block_len,
                              global_before=views["pos"].to(torch.int32),
                              global_after=views["after"].to(torch.int32), **common)
        else:
            ctx = StepContext(self.cache, "decode", self.impl,
                              kvdp_group=self.batch_shards.group, own_rows=views["own"],
                              pad_src=views["pad_src"], out_index=views["out_index"], **common)
        return self._forward(views["ids"][:, None], views["pos"][:, None], ctx, 1)[:, -1]

    def _logits_out(self, like: torch.Tensor) -> torch.Tensor:
        """The first ``len(like)`` rows of the buffer every captured graph writes its
        logits into (replays run one at a time on one stream, and each step's logits are
        read before the next step's replay), shaped and typed as ``like``: allocated for
        the largest batch bucket (or prefill sequences) on first use, again only for a
        larger or other shape."""
        rows, cols = like.shape
        buf = self._logits_buf
        if buf is None or buf.shape[0] < rows or buf.shape[1] != cols or buf.dtype != like.dtype:
            most = max(rows, _bucket(self.max_batch, self.max_batch), _PREFILL_GRAPH_SEQS,
                       0 if buf is None or buf.shape[1] != cols else buf.shape[0])
            self._logits_buf = buf = torch.empty((most, cols), dtype=like.dtype,
                                                 device=like.device)
        return buf[:rows]

    def _graph(self, key: tuple, make: Any = None) -> _DecodeGraph | _ShardedGraph | None:
        """The graph of ``key`` (captured now if new: ``make(pool)``, by default a
        ``_DecodeGraph`` of ``key = (batch, width)``); None once a capture failed. Over a
        split cache every rank captures the same keys in the same order (the keys come
        from bookkeeping all ranks share), as the collectives in them need."""
        if key not in self._graphs:
            try:
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                capture = make or (lambda pool: _DecodeGraph(self, *key, pool))
                try:
                    graph = capture(self._pool)
                except Exception as first:  # noqa: BLE001
                    if self.sharded:
                        raise
                    # Once more before going eager for good (a new graph on new static
                    # buffers): on freshly started H200s the first capture of the one-row
                    # step (its L2-prefetch branch) was invalidated in two first runs of
                    # three (cudaErrorStreamCaptureInvalidated), never in later runs.
                    # Into a new memory pool: torch 2.11 refuses any later capture into
                    # the pool of an invalidated one ("beginAllocateToPool: already
                    # recording to mempool_id", H200), even once its recording is ended.
                    self.graph_retries += 1
                    self.graph_retry_error = f"{type(first).__name__}: {first}"
                    self._pool = torch.cuda.graph_pool_handle()
                    graph = capture(self._pool)
                self._graphs[key] = graph
            except Exception as e:  # noqa: BLE001 - any capture failure: run eagerly
                self.graph_failures += 1
                self._pool = None  # (the later captures, if any, into a new pool: above)
                prefill = key[0] == "prefill"
                if prefill:
                    self.prefill_graphs_on = False
                else:
                    self.graphs_on = False
                frames = traceback.extract_tb(e.__traceback__)
                where = (f" at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}"
                         if frames else "")
                self.graph_failure = f"{type(e).__name__}: {e}{where}"
                what, how = ("a prefill", "prefilling") if prefill else ("the decode step",
                                                                           "decoding")
                if self.sharded:  # (decode steps: the fused prefills do not run sharded)
                    # Over a split cache a rank cannot go eager alone: its next steps would
                    # issue other collectives than its peers' warm-ups and replays (a hang,
                    # or partials paired with padding). Raise on this rank.
                    raise RuntimeError(
                        f"lmfuse.serving: {what} could not be captured in a CUDA graph "
                        f"({self.graph_failure}); over a split cache every rank must "
                        "capture alike: pass cuda_graphs=False to decode eagerly") from e
                warnings.warn(f"lmfuse.serving: {what} could not be captured in a CUDA graph "
                              f"({self.graph_failure}); {how} eagerly", RuntimeWarning,
                              stacklevel=3)
                return None
        return self._graphs[key]


def _prefill_shape(new: list[list[int]], tables: list[list[int]], chunk: int,
                   pad: bool) -> tuple[int, int, int, int]:
    """(tokens, sequences, chunks, table width) of a fused prefill of ``new[i]`` tokens
    over the block tables ``tables[i]`` in chunks of ``chunk`` positions; ``pad``: the
    bucket of its CUDA graph: tokens (at least 16), sequences and width rounded up to powers
    of two, chunks ``tokens / chunk + sequences`` (enough for any split)."""
    count, seqs, width = sum(map(len, new)), len(new), max(map(len, tables))
    if not pad:
        return count, seqs, sum(cdiv(len(t), chunk) for t in new), width
    tokens, seqs = next_pow2(max(count, 16)), next_pow2(seqs)
    return tokens, seqs, tokens // chunk + seqs, next_pow2(width)


def _prefill_inputs(requests: list[Request], new: list[list[int]], tables: list[list[int]],
                    chunk: int, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """A fused prefill's inputs at ``shape`` (:func:`_prefill_shape`) in one int64 host
    buffer, in order: per token row its id, position and sequence; each sequence's last
    row; each token row's chunk slot; per chunk of ``chunk`` positions
    (:class:`~.fused.Prefill`) the token row of each slot, then its last position + 1 and
    its sequence; the sequences' block tables ``[sequences + 1, width]`` (-1 padded, the
    last row blank). Padding rows and chunks sit in the blank sequence at position 0 with
    length 0 (they write and read nothing); no requests: a buffer of padding alone."""
    tokens, seqs, chunks, width = shape
    q = "q"
    ids, pos, seq, last = array.array(q), array.array(q), array.array(q), array.array(q)
    slots, ends, owner = array.array(q), array.array(q), array.array(q)
    where = array.array(q)  # each token row's slot
    for i, (req, toks) in enumerate(zip(requests, new)):
        first, k, row = req.num_cached, len(toks), len(ids)
        ids.extend(toks)
        pos.extend(range(first, first + k))
        seq.extend(array.array(q, [i]) * k)
        last.append(row + k - 1)
        # chunks end at the last token and step back; the first may start before the
        # sequence's new tokens (those slots hold row 0): the sequence's slots are its
        # rows after that many zeros (filled by ranges: a Python loop a token took 0.7 ms
        # of host time for 4096 tokens)
        n_chunks = cdiv(k, chunk)
        base = len(ends)
        slots += _zeros(n_chunks * chunk - k)
        slots.extend(range(row, row + k))
        ends.extend(range(first + k - (n_chunks - 1) * chunk, first + k + 1, chunk))
        owner += array.array(q, [i]) * n_chunks
        start = (base + n_chunks) * chunk - k  # the slot of the first new token
        where.extend(range(start, start + k))
    count = len(ids)
    blank = _zeros(tokens - count)
    flat = ids + blank + pos + blank + seq + array.array(q, [seqs]) * (tokens - count)
    flat += last + _zeros(seqs - len(last)) + where + blank
    flat += slots + _zeros((chunks - len(ends)) * chunk)
    flat += ends + _zeros(chunks - len(ends))
    flat += owner + array.array(q, [seqs]) * (chunks - len(ends))
    for t in tables:
        flat.extend(t)
        flat += array.array(q, [-1]) * (width - len(t))
    flat += array.array(q, [-1]) * (width * (seqs + 1 - len(tables)))
    return torch.frombuffer(flat, dtype=torch.int64)


def _zeros(k: int) -> array.array:
    """``k`` int64 zeros."""
    return array.array("q", bytes(8 * k))


def _bucket(n: int, max_batch: int) -> int:
    """The captured batch size that serves ``n`` rows: 1, 2, 4, 8, 16, 32, 48, ..."""
    for b in (1, 2, 4, 8, 16):
        if n <= b:
            return min(b, max(max_batch, n))
    return min(cdiv(n, 16) * 16, max(max_batch, n))


@contextlib.contextmanager
def _capturable_experts(config: Any) -> Iterator[None]:
    """Mixture-of-experts layers run, while a graph is captured, transformers'
    ``"batched_mm"`` experts implementation (every token's chosen experts gathered and
    multiplied in one batched product), where the installed ``transformers`` has it: its
    default loop over the experts hit by the batch syncs with the host (``nonzero``), and
    its ``"grouped_mm"`` copies the group offsets to the host; neither can be captured."""
    saved = getattr(config, "_experts_implementation", None)
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        usable = saved != "batched_mm" and "batched_mm" in ALL_EXPERTS_FUNCTIONS
    except ImportError:
        usable = False
    usable = usable and hasattr(config, "_experts_implementation")
    if usable:
        config._experts_implementation = "batched_mm"
    try:
        yield
    finally:
        if usable:
            config._experts_implementation = saved


class _DecodeGraph:
    """A decode forward of ``batch`` rows and ``width``-block tables, captured."""

    def __init__(self, runner: ModelRunner, batch: int, width: int, pool: Any) -> None:
        dev = runner.device
        self.batch, self.width = batch, width
        self.ids = torch.zeros((batch, 1), dtype=torch.int64, device=dev)
        self.pos = torch.zeros((batch, 1), dtype=torch.int64, device=dev)
        # table | before | after in one buffer, laid out as PagedKVCache.reserve packs a
        # step's: a full batch's step comes in with one copy.
        self.packed = torch.zeros(batch * (width + 2), dtype=torch.int32, device=dev)
        self.table = self.packed[:batch * width].view(batch, width)
        self.table.fill_(-1)
        self.before = self.packed[batch * width:batch * (width + 1)]
        self.after = self.packed[batch * (width + 1):]
        ctx = StepContext(runner.cache, "decode", runner.impl, block_table=self.table,
                          seqlens_before=self.before, seqlens=self.after)

        def forward(out: torch.Tensor | None = None) -> Any:
            if runner.fused is not None:  # (logits, greedy tokens)
                with torch.inference_mode():
                    # the tokens written over the ids (read first): a step run ahead on
                    # the last one's tokens (ids=) needs no copy before its replay. Not
                    # where the LM head has more rows than the embedding table: the
                    # padding rows' tokens are gathered by the next replay too.
                    fused = runner.fused
                    alias = fused.lm_head.shape[0] <= fused.embed.shape[0]
                    return fused.forward(self.ids[:, 0], self.table, self.before,
                                         self.after, argmax=True,
                                         tokens=self.ids[:, 0] if alias else None, out=out)
            return runner._forward(self.ids, self.pos, ctx, 1)[:, -1]

        # The padding rows write nothing (block -1) and read nothing (length 0).
        self.graph, self.logits, self.tokens = _capture(runner, forward, pool)
        self.runner = runner

    def run(self, host: torch.Tensor | None, step: DecodeStep, n: int,
            ids: torch.Tensor | None = None) -> torch.Tensor:
        # Each copy here is a launch on the stream before the replay: as few as may be (the
        # fused layers read no positions but ``before``).
        positions = self.runner.fused is None
        if ids is not None:  # the tokens are on the device already; positions from the step
            if ids.data_ptr() != self.ids.data_ptr():  # else this graph's last output
                self.ids[:n, 0].copy_(ids)
            if positions:
                self.pos[:n, 0].copy_(step.seqlens_before)
        else:
            host = host.to(self.ids.device, non_blocking=True)
            self.ids[:n, 0].copy_(host[0])
            if positions:
                self.pos[:n, 0].copy_(host[1])
        packed = _packed(step) if n == self.batch else None
        if packed is not None and packed.device.type == "cpu":  # step_buffer's pinned one
            bus_copy(self.packed, packed)
        elif packed is not None:
            if packed.data_ptr() != self.packed.data_ptr():  # else reserve wrote it here
                self.packed.copy_(packed)
        else:
            self.table[:n].copy_(step.block_table)
            self.before[:n].copy_(step.seqlens_before)
            self.after[:n].copy_(step.seqlens)
        if n < self.batch:  # rows of an earlier, larger batch: blank them
            self.table[n:].fill_(-1)
            self.before[n:].zero_()
            self.after[n:].zero_()
        self.graph.replay()
        self.runner._greedy = self.tokens[:n]
        return self.logits[:n]


class _PrefillGraph:
    """A fused prefill of ``tokens`` rows, ``seqs`` sequences and ``width``-block tables,
    captured: its inputs one static int64 buffer (:func:`_prefill_inputs`' layout)."""

    def __init__(self, runner: ModelRunner, shape: tuple[int, int, int, int],
                 pool: Any) -> None:
        self.shape = shape
        # captured over padding alone
        self.buf = _prefill_inputs([], [], [], runner.fused.chunk, shape).to(runner.device)
        self.graph, self.logits, self.tokens = _capture(
            runner, lambda out=None: runner._prefill_forward(self.buf, self.shape, out), pool)
        self.runner = runner

    def run(self, host: torch.Tensor, n: int) -> torch.Tensor:
        self.buf.copy_(host, non_blocking=True)
        self.graph.replay()
        self.runner._greedy = self.tokens[:n]
        return self.logits[:n]


def _packed(step: DecodeStep) -> torch.Tensor | None:
    """The step's ``block_table | seqlens_before | seqlens`` as one int32 vector where they
    lie so in one buffer (as :meth:`PagedKVCache.reserve` makes them), else None."""
    table, before, after = step.block_table, step.seqlens_before, step.seqlens
    n, size = table.numel(), table.element_size()
    if not (table.dtype == before.dtype == after.dtype == torch.int32
            and table.is_contiguous() and before.is_contiguous() and after.is_contiguous()
            and before.data_ptr() == table.data_ptr() + n * size
            and after.data_ptr() == before.data_ptr() + before.numel() * size
            and before.untyped_storage().data_ptr() == table.untyped_storage().data_ptr()
            and after.untyped_storage().data_ptr() == table.untyped_storage().data_ptr()):
        return None
    return table.as_strided((n + before.numel() + after.numel(),), (1,),
                            table.storage_offset())


def _capture(runner: ModelRunner, forward: Any, pool: Any) -> tuple[Any, torch.Tensor,
                                                                    torch.Tensor]:
    """``forward(out=None)`` (a decode forward over static buffers) and its argmax
    captured in a CUDA graph: (graph, logits, tokens). Warmed up first on a side stream
    (lazy initialisations, Triton compilations, communicators). In the graph the norms and
    gated MLPs run lmfuse's fused kernels (fewer launches; a launch costs no host time
    there), the experts a capturable implementation. The logits land in the runner's one
    logits buffer (:meth:`ModelRunner._logits_out`: written there by ``forward(out)`` where
    it can, else copied), so that the graphs' outputs take ``[rows, V]`` once, not once a
    graph (B256 over the benchmark's 128K vocabulary: 64 MB a graph, and a graph per batch
    bucket and table width)."""
    dev = runner.device
    _warm_bus_copies(dev)
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with _capturable_experts(runner.config), fused_norms_and_mlps(runner.model, runner.impl):
        with torch.cuda.stream(stream):
            for _ in range(2):
                logits, _ = _with_tokens(forward())
        out = runner._logits_out(logits)
        del logits
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with _capturing(graph, pool, dev):
            logits, tokens = _with_tokens(forward(out))  # greedy rows need nothing more
            if logits.data_ptr() != out.data_ptr():
                logits = out.copy_(logits)
    return graph, logits, tokens


@contextlib.contextmanager
def _capturing(graph: Any, pool: Any, dev: torch.device) -> Iterator[None]:
    """``torch.cuda.graph(graph, pool=pool)``, with the caller's stream current again
    after a failed capture: where the capture is invalidated, torch's ``capture_end``
    raises before the context restores it, and the later work would run on the capture's
    side stream. (The pool takes no later capture: :meth:`ModelRunner._graph` moves to a
    new one.)"""
    stream = torch.cuda.current_stream(dev)
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    except BaseException:
        torch.cuda.set_stream(stream)
        raise


def _with_tokens(out: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode forward's ``(logits, greedy tokens)``: as it returned them, or its logits
    and their argmax."""
    return out if isinstance(out, tuple) else (out, greedy(out))


def _pack(fields: dict[str, Any]) -> tuple[torch.Tensor, dict[str, tuple[int, tuple]]]:
    """Int lists (flat, or a list of equal rows) in one int64 host buffer (pinned on a CUDA
    host): the buffer, and each field's (offset, shape) in it."""
    flat = array.array("q")  # filled at C speed (torch.tensor of a long list is ~4x slower)
    where: dict[str, tuple[int, tuple]] = {}
    for name, values in fields.items():
        start = len(flat)
        if values and isinstance(values[0], list):
            for row in values:
                flat.extend(row)
            shape: tuple = (len(values), len(values[0]))
        else:
            flat.extend(values)
            shape = (len(values),)
        where[name] = (start, shape)
    host = torch.frombuffer(flat, dtype=torch.int64)
    return (host.pin_memory() if torch.cuda.is_available() else host), where


def _unpack(buf: torch.Tensor, where: dict[str, tuple[int, tuple]]) -> dict[str, torch.Tensor]:
    """The fields of a :func:`_pack` buffer (on any device), as views."""
    out = {}
    for name, (start, shape) in where.items():
        out[name] = buf[start:start + math.prod(shape)].view(shape)
    return out


class _ShardedGraph:
    """A decode forward over a split cache captured for one key of
    :meth:`ModelRunner._decode_sharded` (batch bucket, rows per rank, table width): its
    inputs are views of one static int64 buffer, its collectives inside the graph."""

    def __init__(self, runner: ModelRunner, where: dict[str, tuple[int, tuple]], size: int,
                 pool: Any) -> None:
        self.buf = torch.zeros(size, dtype=torch.int64, device=runner.device)
        views = _unpack(self.buf, where)
        views["table"].fill_(-1)  # the warm-up and capture write and read nothing
        self.ids = views["ids"]
        self.graph, self.logits, self.tokens = _capture(
            runner, lambda out=None: runner._sharded_forward(views), pool)
        self.runner = runner

    def run(self, host: torch.Tensor, n: int, ids: torch.Tensor | None = None
            ) -> torch.Tensor:
        self.buf.copy_(host, non_blocking=True)
        if ids is not None:
            self.ids[:n].copy_(ids)
        self.graph.replay()
        self.runner._greedy = self.tokens[:n]
        return self.logits[:n]
