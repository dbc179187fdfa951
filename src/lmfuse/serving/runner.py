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
the logits of its rows. In the captured forward the RMSNorms and gated MLPs of the families
``apply_lmfuse`` supports run lmfuse's fused kernels (``fused_norms_and_mlps``; the model
is as before afterwards) and mixture-of-experts layers a capturable experts implementation.
A model whose decode forward cannot be captured (a host sync in it) falls back to eager
decode steps, with a warning.
"""

from __future__ import annotations

import contextlib
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from .._launch import cdiv
from ..attention.kv_cache import DecodeStep, PagedKVCache
from ..integrations.transformers import fused_norms_and_mlps
from .attention import ATTENTION_NAME, Segment, StepContext, register
from .fused import FusedDecoder, unsupported
from .sampling import greedy
from .request import Request
from .sharded import BatchShards, ContextShards


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
        self.graphs_on = (bool(cuda_graphs) and self.device.type == "cuda"
                          and shards is None and batch_shards is None)
        self.max_batch = max_batch
        self._graphs: dict[tuple[int, int], _DecodeGraph] = {}
        self._pool = None
        self.graph_failures = 0
        self.graph_failure: str | None = None  # the last capture failure, where it arose
        # The fused decode layers (fused.py) where the model's family has them and the
        # cache is not split; otherwise the model's own forward decodes.
        self.fused: FusedDecoder | None = None
        sharded = shards is not None or batch_shards is not None
        if decode_path == "fused" and sharded:
            raise ValueError("Generator: decode_path='fused' does not run over a split KV "
                             "cache (kvdp_group / cp_group) yet; use 'auto' or 'model'")
        if decode_path == "fused" or (decode_path == "auto" and not sharded
                                      and unsupported(model) is None):
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

    def prefill(self, requests: list[Request], new: list[list[int]]) -> torch.Tensor:
        """Compute ``new[i]`` (the tokens of request ``i`` from position
        ``num_cached``) for every request in one packed forward, writing their K/V into
        the requests' blocks; the logits ``[n, V]`` at each request's last token."""
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
            for i, t in enumerate(toks):
                p = req.num_cached + i
                ids.append(t)
                pos.append(p)
                if self.shards is None:
                    blocks.append(table[p // bl] if table else -1)
                    offsets.append(p % bl)
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

    # --- decode ---------------------------------------------------------------------------

    def decode(self, requests: list[Request], step: DecodeStep) -> torch.Tensor:
        """One token of every request (its last, at position ``length - 1``), the step's
        blocks reserved: the logits ``[n, V]``."""
        n = len(requests)
        host = self._host_inputs(requests)
        if self.shards is not None:
            return self._decode_cp(requests, host)
        if self.batch_shards is not None:
            return self._decode_kvdp(requests, host)
        width = step.block_table.shape[1]
        if self.graphs_on and n <= self.max_batch:
            graph = self._graph(_bucket(n, self.max_batch), width)
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
        captured, else eagerly."""
        if self.shards is not None or self.batch_shards is not None:
            return None
        n = len(requests)
        width = step.block_table.shape[1]
        if self.graphs_on and n <= self.max_batch:
            graph = self._graph(_bucket(n, self.max_batch), width)
            if graph is not None:
                graph.run(None if ids is not None else self._host_inputs(requests), step, n,
                          ids=ids)
                return self.take_greedy()
        if ids is None:
            ids = self._host_inputs(requests)[0].to(self.device, non_blocking=True)
        if self.fused is not None:
            with torch.inference_mode():
                logits = self.fused.forward(ids, step.block_table, step.seqlens_before,
                                            step.seqlens)
        else:
            ctx = StepContext(self.cache, "decode", self.impl, block_table=step.block_table,
                              seqlens_before=step.seqlens_before, seqlens=step.seqlens)
            pos = step.seqlens_before.to(torch.int64)
            logits = self._forward(ids.to(torch.int64)[:, None], pos[:, None], ctx, 1)[:, -1]
        return greedy(logits)

    @staticmethod
    def _host_inputs(requests: list[Request]) -> torch.Tensor:
        """``[2, n]`` int64: each request's last token and its position (pinned memory on a
        CUDA host, so the copy to the device does not wait for the stream)."""
        host = torch.tensor([[r.last_token for r in requests], [r.length - 1 for r in requests]],
                            dtype=torch.int64)
        return host.pin_memory() if torch.cuda.is_available() else host

    def _decode_cp(self, requests: list[Request], host: torch.Tensor) -> torch.Tensor:
        """A decode step over the CP-split cache: this rank's shard grows where it owns the
        new token; the global lengths place the tokens."""
        self.shards.sync(set(self.scheduled.sequences))
        local = self.shards.grow(requests)
        lens = torch.tensor([[r.length - 1 for r in requests], [r.length for r in requests]],
                            dtype=torch.int32).to(self.device, non_blocking=True)
        host = host.to(self.device, non_blocking=True)
        ctx = StepContext(self.cache, "decode", self.impl, block_table=local.block_table,
                          seqlens_before=local.seqlens_before, seqlens=local.seqlens,
                          cp_group=self.shards.group, cp_block=self.shards.block_len,
                          global_before=lens[0], global_after=lens[1])
        return self._forward(host[0][:, None], host[1][:, None], ctx, 1)[:, -1]

    def _decode_kvdp(self, requests: list[Request], host: torch.Tensor) -> torch.Tensor:
        """A decode step over the batch-split cache (its blocks reserved on the owners)."""
        bs = self.batch_shards
        padded, mine, m = bs.layout(requests)
        locals_ = [bs.local(requests[i].seq_id) for i in mine]
        tables = [self.cache.block_ids(s) for s in locals_]
        width = max([1] + [len(t) for t in tables])
        table = [t + [-1] * (width - len(t)) for t in tables] + [[-1] * width] * (m - len(mine))
        after = [self.cache.seqlen(s) for s in locals_] + [0] * (m - len(mine))
        before = [max(a - 1, 0) for a in after]
        place = {row: i for i, row in enumerate(padded) if row >= 0}
        dev = self.device
        ints = torch.tensor([before, after], dtype=torch.int32).to(dev, non_blocking=True)
        index = [torch.tensor(x, dtype=torch.int64).to(dev, non_blocking=True) for x in (
            mine, [max(r, 0) for r in padded], [place[i] for i in range(len(requests))])]
        ctx = StepContext(self.cache, "decode", self.impl,
                          block_table=torch.tensor(table, dtype=torch.int32).to(dev),
                          seqlens_before=ints[0], seqlens=ints[1], kvdp_group=bs.group,
                          own_rows=index[0], pad_src=index[1], out_index=index[2])
        host = host.to(dev, non_blocking=True)
        return self._forward(host[0][:, None], host[1][:, None], ctx, 1)[:, -1]

    def _graph(self, batch: int, width: int) -> _DecodeGraph | None:
        key = (batch, width)
        if key not in self._graphs:
            try:
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                self._graphs[key] = _DecodeGraph(self, batch, width, self._pool)
            except Exception as e:  # noqa: BLE001 - any capture failure: run eagerly
                self.graph_failures += 1
                self.graphs_on = False
                frames = traceback.extract_tb(e.__traceback__)
                where = (f" at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}"
                         if frames else "")
                self.graph_failure = f"{type(e).__name__}: {e}{where}"
                warnings.warn(f"lmfuse.serving: the decode step could not be captured in a "
                              f"CUDA graph ({self.graph_failure}); decoding eagerly",
                              RuntimeWarning, stacklevel=3)
                return None
        return self._graphs[key]


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
        self.table = torch.full((batch, width), -1, dtype=torch.int32, device=dev)
        self.before = torch.zeros(batch, dtype=torch.int32, device=dev)
        self.after = torch.zeros(batch, dtype=torch.int32, device=dev)
        ctx = StepContext(runner.cache, "decode", runner.impl, block_table=self.table,
                          seqlens_before=self.before, seqlens=self.after)

        def forward() -> torch.Tensor:
            if runner.fused is not None:
                with torch.inference_mode():
                    return runner.fused.forward(self.ids[:, 0], self.table, self.before,
                                                self.after)
            return runner._forward(self.ids, self.pos, ctx, 1)[:, -1]

        # Warm up on a side stream (lazy initialisations, Triton compilations), then
        # capture. The padding rows write nothing (block -1) and read nothing (length 0).
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        # In the graph the norms and gated MLPs run lmfuse's fused kernels (fewer launches;
        # a launch costs no host time there), the experts a capturable implementation.
        with _capturable_experts(runner.config), fused_norms_and_mlps(runner.model,
                                                                      runner.impl):
            with torch.cuda.stream(stream):
                greedy(forward())
                greedy(forward())
            torch.cuda.current_stream(dev).wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.logits = forward()
                self.tokens = greedy(self.logits)  # greedy rows need nothing more
        self.runner = runner

    def run(self, host: torch.Tensor | None, step: DecodeStep, n: int,
            ids: torch.Tensor | None = None) -> torch.Tensor:
        if ids is not None:  # the tokens are on the device already; positions from the step
            self.ids[:n, 0].copy_(ids)
            self.pos[:n, 0].copy_(step.seqlens_before)
        else:
            host = host.to(self.ids.device, non_blocking=True)
            self.ids[:n, 0].copy_(host[0])
            self.pos[:n, 0].copy_(host[1])
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
