"""Benchmark sharded decode attention (KVDP and CP) against ``decode_attention`` on one GPU.

Launch it with torchrun, one process a GPU, NVLink multicast off::

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 8 bench/decode_sharded.py \\
        [--sizes 2,4,8] [--mode kvdp|cp|both] [--exchange all_gather,all_to_all] [--graphs]
        [--json PATH] [--quick]

NCCL on CUDA; gloo on the CPU when there is no GPU, where ``--quick`` (then the default)
runs tiny float32 shapes, through Triton's interpreter with ``TRITON_INTERPRET=1``::

    TRITON_INTERPRET=1 torchrun --nproc_per_node 2 bench/decode_sharded.py --quick

``NCCL_NVLS_ENABLE=0`` belongs on the command line (the shared multi-GPU hosts can be put
out of service by a program using NVLink multicast); the script also sets it, with its
PyTorch and NVSHMEM counterparts, before importing torch, in case it was forgotten.

Cases (bf16, every sequence full: length = capacity = S, one active token):

  kvdp B64 Hq64 Hkv8 S8192 D128   the batch's caches split over the N ranks of the KVDP
        group (``kvdp_batch_range``: B/N sequences a rank, all 8 KV heads), each rank
        projecting its Hq/N query heads for all B sequences (Megatron's tensor-parallel
        head layout: rank w has heads [w Hq/N, (w+1) Hq/N)); one step is
        ``kvdp_decode_attention``: all-gather of q, attention of the rank's sequences with
        all Hq heads, all-gather of the outputs over the batch. With ``--exchange`` (default
        both, one row each) also (or only) ``exchange="all_to_all"``: the two all-gathers
        replaced by two all-to-alls that move only what each rank keeps (row
        ``kvdp_decode_attention a2a xN``).
  cp B1 Hq64 Hkv8 S131072 D128    one sequence's context split over the N ranks of the CP
  cp B1 Hq64 Hkv8 S262144 D128    group (round-robin blocks of ``CP_BLOCK`` = 64 tokens,
        filled by ``cp_cache_append``); one step is ``cp_decode_attention`` given the
        global lengths (``cache_seqlens=``, no all-reduce): local attention, one all-gather
        of the packed output and LSE, the exact merge.

Each case first runs ``lmfuse.decode_attention`` on the whole cache on rank 0 alone (the
other ranks wait): the 1-GPU row, whose output, broadcast to every rank, is what each
rank's sharded output is checked against (``max|a - b| / max|b|``, the worst rank's in the
table, flagged over 2e-2, 1e-4 in float32). A case that does not fit in every rank's free
memory is skipped. Then, for each group size N of ``--sizes`` (default: the world size;
ranks 0 .. N-1 form the group, the others wait), the rows:

  ms          per step: each step is a ``torch.cuda.synchronize``, a barrier of the group,
              a 256 MiB write that flushes L2, then the call between two CUDA events
              (perf_counter on the CPU); the median over ``--steps`` steps (after
              ``--warmup``) of the slowest rank's time in that step
  TB/s        bytes of K and V read across all ranks (B S Hkv D x 2 x element size, the
              same for every N) / ms: aggregate bandwidth
  x copy      TB/s / (N x rank 0's device-to-device copy TB/s): the share of N GPUs'
              bandwidth ceiling reached
  speed-up    1-GPU ms / ms
  local ms    the rank's local ``decode_attention`` alone (same shapes, no collective),
              timed the same way
  coll ms     the op's all-gathers (all-to-alls for the a2a rows) alone, on buffers of the
              same shapes and dtypes, timed
              the same way ("collective time (isolated)"); coll % = coll ms / ms. The rest
              (ms - local - coll) is the glue: head reshuffles, the merge, host time
  collectives the ``torch.distributed`` calls one step issues (counted with
              ``tests/distributed/spawn.py``'s counter)

Calls are eager by default, so host time counts where it exceeds the GPU's (at N = 8 a
rank's share of the work is small and a step can be launch-bound). ``--graphs`` (CUDA
only) times every call, the collectives included, as the replay of a CUDA graph holding it
(``lmfuse.bench.decode_attention``'s ``as_graph``), as a server capturing its decode step sees
it. The JSON (rank 0's ``--json``) holds every row with the per-rank medians and
differences, the isolated collective times, the environment (device, versions, date,
world size, NCCL version, the command) and the copy.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

# Before torch is imported (NCCL reads them when it creates a communicator).
os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                   "NVSHMEM_DISABLE_NVLS": "1"})

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cross_entropy_tp import _collective_counter, _fmt, _summary, all_agree, write_json

from lmfuse.bench.common import Result, environment, measure_copy, peak_extra_mib
from lmfuse.bench.decode_attention import _tolerance, as_graph, max_rel_diff

import lmfuse
from lmfuse.distributed import (
    cp_cache_append,
    cp_decode_attention,
    cp_shard_seqlens,
    kvdp_batch_range,
    kvdp_decode_attention,
)
from lmfuse.distributed.collectives import all_gather_stacked, all_to_all_stacked

CP_BLOCK = 64  # tokens per round-robin block of the CP layout (a paged pool's block length)
QUICK_CP_BLOCK = 16
FLUSH_BYTES = 256 * 2**20  # written before every timed step: more than any L2
EXCHANGES = ("all_gather", "all_to_all")  # kvdp_decode_attention's exchange= values


class Shape(NamedTuple):
    mode: str  # "kvdp" or "cp"
    B: int
    Hq: int
    S: int
    Hkv: int = 8
    D: int = 128

    def name(self) -> str:
        return f"{self.mode} B{self.B} Hq{self.Hq} Hkv{self.Hkv} S{self.S} D{self.D}"


FULL = [Shape("kvdp", B=64, Hq=64, S=8192), Shape("cp", B=1, Hq=64, S=131072),
        Shape("cp", B=1, Hq=64, S=262144)]
# The seed's cache-bound example (q heads 64, kv heads 8, 128K context) at B = 1 .. 16, every
# split of the group: KVDP (each exchange) where B >= N, CP, and KVDP x CP on 4 ranks.
SEED = [Shape("splits", B=b, Hq=64, S=131072) for b in (1, 2, 4, 8, 16)]
QUICK_SEED = [Shape("splits", B=b, Hq=8, S=512, Hkv=2, D=32) for b in (1, 2, 4)]
# Per-rank bytes of the collectives swept by --calibrate, and the 1-GPU decode contexts.
CALIBRATE_BYTES = [2**k for k in range(10, 25, 2)]
# Each collective is timed as this many back-to-back calls in one step (the time divided by
# it): a step's fixed cost (the graph's launch, the timing) is paid once, as in a decode step
# that holds several collectives, not once per collective. (Timed one a step, on 4 H200s the
# 2-rank all-gather of 1 KiB took 15-28 us, against 10 us inside a KVDP step, and the model
# over-predicted the rows with 3 or 4 collectives by up to 39%.)
CALIBRATE_REPEATS = 8
CALIBRATE_CONTEXTS = (8192, 16384, 32768, 65536, 131072)
TARGET_SPEEDUP = {2: 1.8, 4: 3.4}  # where a rank's share of the cache takes >= 0.15 ms
SHORT_STEP_MS = 0.15
OVERHEAD_OVER_COLLECTIVES = 1.5  # shorter steps: ms - local ms <= 1.5 x coll ms
# The same roles at shapes Triton's interpreter runs in seconds (the CP shards still split
# their keys over a few ranks).
QUICK = [Shape("kvdp", B=4, Hq=8, S=128, Hkv=2, D=32), Shape("cp", B=1, Hq=8, S=512, Hkv=2, D=32)]


# --- timing in lockstep -----------------------------------------------------------------------


def comm_device(group: Any, device: torch.device) -> torch.device:
    return device if "nccl" in str(dist.get_backend(group)) else torch.device("cpu")


def step_times(fn: Callable[[], object], device: torch.device, group: Any, warmup: int,
               steps: int) -> list[float]:
    """This rank's ms for each of ``steps`` calls of ``fn`` (after ``warmup``), every step
    started together: device synchronised, a barrier of ``group`` (``None``: a lone rank),
    then (CUDA) an L2-flushing write and the call between two events."""
    for _ in range(warmup):
        fn()
    cuda = device.type == "cuda"
    if cuda:
        flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(steps)]
    times = []
    for i in range(steps):
        if cuda:
            torch.cuda.synchronize(device)
        if group is not None:
            dist.barrier(group=group)
        if cuda:
            flush.zero_()  # also lets the host queue the call before the GPU reaches it
            events[i][0].record()
            fn()
            events[i][1].record()
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    if cuda:
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) for start, end in events]
    return times


def gathered(values: list[float], group: Any, device: torch.device) -> list[list[float]]:
    """Every rank's ``values`` (all of one length), in group-rank order."""
    t = torch.tensor(values, dtype=torch.float64, device=comm_device(group, device))
    return all_gather_stacked(t, group).tolist()


def lockstep_ms(fn: Callable[[], object], device: torch.device, group: Any, warmup: int,
                steps: int) -> tuple[float, list[float]]:
    """(the median over steps of the slowest rank's step time, each rank's median)."""
    times = step_times(fn, device, group, warmup, steps)
    if group is None:
        return statistics.median(times), [statistics.median(times)]
    every = gathered(times, group, device)
    slowest = [max(step) for step in zip(*every)]
    return statistics.median(slowest), [statistics.median(r) for r in every]


# --- cases --------------------------------------------------------------------------------------


class Sharded(NamedTuple):
    """One rank's part of a sharded case: the op's call, its expected output, the local
    attention alone, and the op's collectives alone."""

    impl: str
    call: Callable[[], torch.Tensor]
    expected: torch.Tensor
    local: Callable[[], object]
    collectives: Callable[[], object]
    what: str  # the collectives timed alone, in words
    exchange: str | None = None  # kvdp_decode_attention's exchange= (None for CP)
    kvdp: int = 1  # the split: KVDP x CP ranks
    cp: int = 1


def kvdp_part(q, k, v, lengths, ref, group, exchange: str = "all_gather") -> Sharded:
    """This rank's KVDP shard of the whole-batch ``q``/``k``/``v``: its query heads for all
    sequences, the caches of its sequences (all KV heads); steps 1 and 3 by ``exchange``."""
    B, _, Hq, D = q.shape
    n, w = dist.get_world_size(group), dist.get_rank(group)
    start, stop = kvdp_batch_range(B, group)
    heads = slice(w * (Hq // n), (w + 1) * (Hq // n))
    q_mine = q[:, :, heads].contiguous()
    k_mine, v_mine = k[start:stop].contiguous(), v[start:stop].contiguous()
    lens_mine = lengths[start:stop].contiguous()
    # What the local attention sees after the q all-gather: its sequences, every head (the
    # gathered rank-major order is the global head order).
    q_gathered = q[start:stop].contiguous()
    most = -(-B // n)
    if exchange == "all_gather":
        bufs = [torch.empty_like(q_mine), q.new_empty((most, 1, Hq, D))]
        exchange_fn, impl, what = all_gather_stacked, "kvdp_decode_attention", "all-gather"
    else:  # each rank's rows of q for every rank's sequences; its heads of the outputs
        bufs = [q.new_empty((n, most, 1, Hq // n, D)) for _ in range(2)]
        exchange_fn, impl, what = all_to_all_stacked, "kvdp_decode_attention a2a", "all-to-all"

    def collectives():
        for buf in bufs:
            exchange_fn(buf, group)

    return Sharded(
        impl,
        lambda: kvdp_decode_attention(q_mine, k_mine, v_mine, lens_mine, group=group,
                                      exchange=exchange),
        ref[:, :, heads],
        lambda: lmfuse.decode_attention(q_gathered, k_mine, v_mine, lens_mine),
        collectives,
        f"{what} {list(bufs[0].shape)} + {what} {list(bufs[1].shape)} {_dt(q)}",
        exchange, kvdp=n)


def cp_part(q, k, v, lengths, ref, group, cp_block: int) -> Sharded:
    """This rank's CP shard of ``k``/``v``, written by ``cp_cache_append``."""
    B, S, Hkv, D = k.shape
    n = dist.get_world_size(group)
    capacity = -(-S // (cp_block * n)) * cp_block
    k_shard, v_shard = k.new_zeros((B, capacity, Hkv, D)), v.new_zeros((B, capacity, Hkv, D))
    cp_cache_append(k_shard, v_shard, k, v, torch.zeros_like(lengths), group=group,
                    cp_block=cp_block)
    lens_shard = cp_shard_seqlens(lengths, group=group, cp_block=cp_block)
    states = torch.empty((*q.shape[:3], D + 1), dtype=torch.float32, device=q.device)
    return Sharded(
        "cp_decode_attention",
        lambda: cp_decode_attention(q, k_shard, v_shard, lens_shard, group=group,
                                    cache_seqlens=lengths, cp_block=cp_block),
        ref,
        lambda: lmfuse.decode_attention(q, k_shard, v_shard, lens_shard, return_lse=True),
        lambda: all_gather_stacked(states, group),
        f"all-gather {list(states.shape)} float32", cp=n)


def grid_part(q, k, v, lengths, ref, kvdp_group, cp_group, cp_block: int) -> Sharded:
    """This rank's share of a KVDP x CP grid: the sequences of its KVDP rank (its column of
    the grid: ``kvdp_batch_range`` over ``kvdp_group``), their context cut over ``cp_group``
    (round-robin blocks, by ``cp_cache_append``); its query heads ``Hq / KVDP`` (those of its
    KVDP rank, the same on the CP ranks of a row); one step is ``kvdp_decode_attention`` with
    ``cp_group``: all-gather of q over KVDP, local attention, all-gather of the packed partials
    over CP and their merge, all-gather of the outputs over KVDP."""
    B, S, Hkv, D = k.shape
    Hq = q.shape[2]
    a, c = dist.get_world_size(kvdp_group), dist.get_world_size(cp_group)
    i = dist.get_rank(kvdp_group)
    start, stop = kvdp_batch_range(B, kvdp_group)
    heads = slice(i * (Hq // a), (i + 1) * (Hq // a))
    q_mine = q[:, :, heads].contiguous()
    rows = stop - start
    capacity = -(-S // (cp_block * c)) * cp_block
    k_shard = k.new_zeros((rows, capacity, Hkv, D))
    v_shard = v.new_zeros((rows, capacity, Hkv, D))
    lens_rows = lengths[start:stop].contiguous()
    cp_cache_append(k_shard, v_shard, k[start:stop], v[start:stop], torch.zeros_like(lens_rows),
                    group=cp_group, cp_block=cp_block)
    lens_shard = cp_shard_seqlens(lens_rows, group=cp_group, cp_block=cp_block)
    q_rows = q[start:stop].contiguous()
    most = -(-B // a)
    bufs = [(torch.empty_like(q_mine), kvdp_group),
            (torch.empty((most, 1, Hq, D + 1), dtype=torch.float32, device=q.device), cp_group),
            (q.new_empty((most, 1, Hq, D)), kvdp_group)]

    def collectives():
        for buf, group in bufs:
            all_gather_stacked(buf, group)

    return Sharded(
        "kvdp x cp",
        lambda: kvdp_decode_attention(q_mine, k_shard, v_shard, lens_shard, group=kvdp_group,
                                      cp_group=cp_group, cp_block=cp_block,
                                      cache_seqlens=lens_rows),
        ref[:, :, heads],
        lambda: lmfuse.decode_attention(q_rows, k_shard, v_shard, lens_shard, return_lse=True),
        collectives,
        "all-gathers " + " + ".join(str(list(b.shape)) for b, _ in bufs),
        "all_gather", kvdp=a, cp=c)


def split_name(kvdp: int, cp: int) -> str:
    return " x ".join([f"KVDP{kvdp}"] * (kvdp > 1) + [f"CP{cp}"] * (cp > 1)) or "1 GPU"


def recommended(shape: Shape, n: int) -> tuple[int, int]:
    """(KVDP, CP) that ``lmfuse.plan_sharding`` recommends for the shape on a group of ``n``
    ranks that all hold every KV head (``tp=1``)."""
    plan = lmfuse.plan_sharding(shape.B, shape.Hq, shape.Hkv, n, shape.S, shape.D, 1,
                                "bf16", 1e9, tp=1)
    return plan.kvdp, plan.cp


def target(n: int, share_ms: float, ms: float, local_ms: float, coll_ms: float
           ) -> tuple[str, bool | None]:
    """The issue's target for a row and whether it holds: at least ``TARGET_SPEEDUP[n]``
    where a rank's share of the cache takes ``SHORT_STEP_MS`` or more to read at the copy
    rate, else the time beyond the local attention at most 1.5x the collectives alone."""
    if share_ms >= SHORT_STEP_MS and n in TARGET_SPEEDUP:
        return f"speed-up >= {TARGET_SPEEDUP[n]}", None
    limit = OVERHEAD_OVER_COLLECTIVES * coll_ms
    return (f"ms - local <= {OVERHEAD_OVER_COLLECTIVES} x coll = {limit:.4f}",
            ms - local_ms <= limit)


def _dt(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def run_sharded(shape: Shape, part: Sharded, group: Any, device: torch.device, opts: dict,
                counter, kv_bytes: int, single_ms: float | None, copy_tbps: float
                ) -> tuple[Result, dict]:
    """One group size of a case, on the ranks of ``group`` (every rank of the split); the
    row (complete on rank 0)."""
    n = dist.get_world_size(group)
    with counter() as calls:
        out = part.call()
    diff = max_rel_diff(out, part.expected)
    del out
    fns = [part.call, part.local, part.collectives]
    if opts["graphs"]:
        fns = [as_graph(fn) for fn in fns]
    mem = peak_extra_mib(fns[0], device)
    warmup, steps = opts["warmup"], opts["steps"]
    ms, per_rank = lockstep_ms(fns[0], device, group, warmup, steps)
    local_ms, _ = lockstep_ms(fns[1], device, group, warmup, steps)
    coll_ms, _ = lockstep_ms(fns[2], device, group, warmup, steps)
    diffs = [d[0] for d in gathered([diff], group, device)]
    worst = max(diffs)
    tol = _tolerance(part.expected.dtype)
    tbps = kv_bytes / ms / 1e9
    note = f"max rel diff vs 1 GPU {worst:.1e} (worst of {n} ranks)"
    if not worst <= tol:
        note += f" > {tol:.0e}, CHECK"
    share_ms = kv_bytes / n / copy_tbps / 1e9 if copy_tbps else None
    goal, met = (None, None) if share_ms is None else target(n, share_ms, ms, local_ms, coll_ms)
    speedup = single_ms / ms if single_ms else None
    if goal is not None and met is None:
        met = speedup is not None and speedup >= TARGET_SPEEDUP[n]
    best = recommended(shape, n) if shape.mode == "splits" else None
    extras = {
        "split": split_name(part.kvdp, part.cp), "kvdp": part.kvdp, "cp": part.cp,
        "recommended": None if best is None else best == (part.kvdp, part.cp),
        "share_read_ms": share_ms, "target": goal, "target_met": met,
        "beyond_local_ms": ms - local_ms,
        "mode": shape.mode, "n": n, "speedup": speedup,
        "exchange": part.exchange,
        "x_copy": tbps / (n * copy_tbps) if copy_tbps else None,
        "local_ms": local_ms, "collective_ms": coll_ms, "collective_share": coll_ms / ms,
        "collectives_isolated": part.what, "collectives": _summary(calls),
        "collectives_count": None if calls is None else len(calls),
        "ms_per_rank": per_rank, "max_rel_diff": worst, "max_rel_diff_per_rank": diffs,
        "kv_bytes": kv_bytes}
    return Result(shape.name(), f"{part.impl} x{n}", ms, tbps, None, mem, note), extras


def run_shape(shape: Shape, groups: dict[int, Any], device: torch.device, opts: dict,
              counter, copy_tbps: float) -> list[tuple[Result, dict]]:
    """The 1-GPU row (rank 0) and one row per group size; every rank of the world calls."""
    rank = dist.get_rank()
    B, Hq, S, Hkv, D = shape.B, shape.Hq, shape.S, shape.Hkv, shape.D
    dtype = opts["dtype"]
    elt = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * B * S * Hkv * D * elt
    # The whole cache on every rank (each cuts its shard from it), a shard, temporaries.
    fits = (device.type != "cuda"
            or torch.cuda.mem_get_info(device)[0] > 1.6 * kv_bytes + 2 * FLUSH_BYTES + 2**30)
    if not all_agree(fits, device):
        if rank == 0:
            print(f"{shape.name():<38} skipped: does not fit in every rank's free memory")
        return []
    torch.manual_seed(0)  # the same q, k, v on every rank
    q = torch.randn(B, 1, Hq, D, dtype=dtype, device=device)
    k = torch.randn(B, S, Hkv, D, dtype=dtype, device=device)
    v = torch.randn(B, S, Hkv, D, dtype=dtype, device=device)
    lengths = torch.full((B,), S, dtype=torch.int32, device=device)
    ref = torch.empty_like(q)
    rows: list[tuple[Result, dict]] = []
    single_ms = None
    if rank == 0:
        def call():
            return lmfuse.decode_attention(q, k, v, lengths)

        ref.copy_(call())
        fn = as_graph(call) if opts["graphs"] else call
        mem = peak_extra_mib(fn, device)
        single_ms, _ = lockstep_ms(fn, device, None, opts["warmup"], opts["steps"])
        tbps = kv_bytes / single_ms / 1e9
        rows.append((Result(shape.name(), "decode_attention x1", single_ms, tbps, None, mem,
                            "one GPU, the whole cache; the reference of the rows below"),
                     {"mode": shape.mode, "n": 1, "speedup": 1.0,
                      "x_copy": tbps / copy_tbps if copy_tbps else None, "kv_bytes": kv_bytes}))
        print_rows(rows[-1:])
    dist.broadcast(ref, src=0)  # every rank checks against rank 0's output
    for n, group in groups.items():
        for make in splits(shape, n, group, opts, rank):
            row = None
            if rank < n:
                part = make(q, k, v, lengths, ref)
                row = run_sharded(shape, part, group, device, opts, counter, kv_bytes,
                                  single_ms, copy_tbps)
                del part
            if device.type == "cuda":
                torch.cuda.empty_cache()
            dist.barrier()
            if rank == 0:
                rows.append(row)
                print_rows([row])
    return rows


def splits(shape: Shape, n: int, group: Any, opts: dict, rank: int) -> list[Callable]:
    """The rows of a shape on a group of ``n`` ranks: for each, ``make(q, k, v, lengths,
    ref)`` builds the rank's :class:`Sharded` part."""
    B, Hq = shape.B, shape.Hq
    makers: list[Callable] = []
    if shape.mode in ("kvdp", "splits"):
        if Hq % n or B < n:
            if rank == 0 and shape.mode == "kvdp":
                print(f"{shape.name():<38} x{n}: skipped (needs Hq and B divisible by N)")
        else:
            makers += [functools.partial(_kvdp, group=group, exchange=e)
                       for e in opts["exchanges"]]
    if shape.mode in ("cp", "splits"):
        makers.append(functools.partial(_cp, group=group, cp_block=opts["cp_block"]))
    grid = opts["grids"].get(n)
    if shape.mode == "splits" and grid is not None and B >= 2 and Hq % 2 == 0:
        makers.append(functools.partial(_grid, groups=grid, cp_block=opts["cp_block"]))
    return makers


def _kvdp(q, k, v, lengths, ref, *, group, exchange):
    return kvdp_part(q, k, v, lengths, ref, group, exchange)


def _cp(q, k, v, lengths, ref, *, group, cp_block):
    return cp_part(q, k, v, lengths, ref, group, cp_block)


def _grid(q, k, v, lengths, ref, *, groups, cp_block):
    return grid_part(q, k, v, lengths, ref, groups[0], groups[1], cp_block)


# --- output ---------------------------------------------------------------------------------------


def print_rows(rows: list[tuple[Result, dict]], header: bool = False) -> None:
    if header:
        print(f"{'case':<38} {'impl':<28} {'split':<14} {'ms':>8} {'TB/s':>6} {'x copy':>6} "
              f"{'speed-up':>8} {'local ms':>8} {'coll ms':>8} {'coll %':>6} {'target':>6}  "
              f"{'collectives / step':<24} note")
    for r, x in rows:
        share = x.get("collective_share")
        split = x.get("split", "1 GPU") + ("*" if x.get("recommended") else "")
        met = {True: "met", False: "MISSED", None: "-"}[x.get("target_met")]
        print(f"{r.case:<38} {r.impl:<28} {split:<14} {_fmt(r.ms, '8.4f')} "
              f"{_fmt(r.tbps, '6.2f')} {_fmt(x.get('x_copy'), '6.2f')} "
              f"{_fmt(x.get('speedup'), '8.2f')} "
              f"{_fmt(x.get('local_ms'), '8.4f')} {_fmt(x.get('collective_ms'), '8.4f')} "
              f"{_fmt(None if share is None else 100 * share, '6.1f')} {met:>6}  "
              f"{x.get('collectives', '-'):<24} {r.note}", flush=True)


# --- calibration of lmfuse plan's cost model ---------------------------------------------------


def calibrate(groups: dict[int, Any], device: torch.device, opts: dict, rank: int
              ) -> dict:
    """What ``lmfuse plan --calibrate`` fits its cost model to (complete on rank 0): the
    1-GPU ``decode_attention`` over caches of several sizes (the seed's heads), each
    group size's all-gather and all-to-all alone over ``CALIBRATE_BYTES`` per rank, and
    ``merge_attention_states`` of N float32 partials; every call timed as the shapes are."""
    out: dict = {"decode": [], "collectives": [], "merge": []}
    warmup, steps = opts["warmup"], opts["steps"]
    wrap = as_graph if opts["graphs"] else (lambda fn: fn)
    quick = opts["dtype"] == torch.float32
    Hq, Hkv, D = (8, 2, 32) if quick else (64, 8, 128)
    if rank == 0:
        for S in ((128, 512) if quick else CALIBRATE_CONTEXTS):
            q = torch.randn(1, 1, Hq, D, dtype=opts["dtype"], device=device)
            k = torch.randn(1, S, Hkv, D, dtype=opts["dtype"], device=device)
            v = torch.randn_like(k)
            lens = torch.full((1,), S, dtype=torch.int32, device=device)
            ms, _ = lockstep_ms(wrap(lambda q=q, k=k, v=v, lens=lens: lmfuse.decode_attention(
                q, k, v, lens)), device, None, warmup, steps)
            out["decode"].append({"B": 1, "S": S, "Hq": Hq, "Hkv": Hkv, "D": D,
                                  "bytes": 2 * k.numel() * k.element_size(), "ms": ms})
            del q, k, v
        for n in sorted(groups):
            for rows in ((8, 64) if quick else (64, 512, 4096)):
                outs = torch.randn(n, rows, D, device=device)
                lses = torch.randn(n, rows, device=device)
                ms, _ = lockstep_ms(wrap(lambda o=outs, lse=lses: lmfuse.merge_attention_states(
                    o, lse)), device, None, warmup, steps)
                out["merge"].append({"P": n, "rows": rows, "D": D, "ms": ms})
    dist.barrier()
    for n, group in groups.items():
        for nbytes in ((2**10, 2**14) if quick else CALIBRATE_BYTES):
            for kind in ("all_gather", "all_to_all"):
                ms = None
                if rank < n:
                    elems = max(n, nbytes // 2) // n * n
                    buf = torch.randn(elems, device=device).to(torch.bfloat16)
                    one = (functools.partial(all_gather_stacked, buf, group)
                           if kind == "all_gather"
                           else functools.partial(all_to_all_stacked, buf.view(n, -1), group))

                    def fn(one=one) -> None:
                        for _ in range(CALIBRATE_REPEATS):
                            one()

                    ms, _ = lockstep_ms(wrap(fn), device, group, warmup, steps)
                    ms /= CALIBRATE_REPEATS
                    del buf, fn, one
                dist.barrier()
                if rank == 0:
                    out["collectives"].append({"kind": kind, "n": n, "bytes_per_rank": nbytes,
                                               "ms": ms})
                    print(f"# calibrate: {kind} x{n} {nbytes} B per rank: {ms:.4f} ms",
                          flush=True)
    return out


def _command(world: int) -> str:
    """The launch command, as the docstring gives it."""
    pre = "TRITON_INTERPRET=1 " if os.environ.get("TRITON_INTERPRET") == "1" else ""
    return (f"{pre}NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node {world} "
            + " ".join(sys.argv))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/decode_sharded.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("kvdp", "cp", "both"), default="both")
    p.add_argument("--sizes", help="group sizes N to run, comma-separated, each 2 .. world "
                   "size (default: the world size)")
    p.add_argument("--exchange", default=",".join(EXCHANGES),
                   help="the KVDP rows' exchange(s), comma-separated, one row each: "
                   "all_gather, all_to_all (default: both)")
    p.add_argument("--shapes", choices=("table", "seed", "all"), default="table",
                   help="table: the KVDP B64 and CP B1 rows (default); seed: Hq64 Hkv8 "
                   "S131072 at B = 1, 2, 4, 8, 16, every split; all: both")
    p.add_argument("--calibrate", action="store_true",
                   help="also time what `lmfuse plan --calibrate` fits (the JSON's "
                   "'calibration'): 1-GPU decode sizes, collectives alone, the merge")
    p.add_argument("--quick", action="store_true", help="tiny shapes (the default on CPU)")
    p.add_argument("--graphs", action="store_true", help="time CUDA-graph replays (CUDA only)")
    p.add_argument("--json", help="write the results as JSON here (from rank 0)")
    p.add_argument("--warmup", type=int, help="untimed calls per row (default 10; quick 1)")
    p.add_argument("--steps", type=int, help="timed steps per row (default 50; quick 3)")
    args = p.parse_args(argv)
    args.exchange = [e.strip() for e in args.exchange.split(",") if e.strip()]
    if not args.exchange or any(e not in EXCHANGES for e in args.exchange):
        p.error(f"--exchange: comma-separated values of {', '.join(EXCHANGES)}")
    if "RANK" not in os.environ:
        p.error("launch it with torchrun: NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node N "
                "bench/decode_sharded.py ...")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        return bench(args, device)
    finally:
        dist.destroy_process_group()


def bench(args: argparse.Namespace, device: torch.device) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    quick = args.quick or device.type != "cuda"
    sizes = sorted({int(s) for s in args.sizes.split(",")}) if args.sizes else [world]
    if world < 2 or any(not 2 <= n <= world for n in sizes):
        if rank == 0:
            print(f"group sizes {sizes} must lie in 2 .. {world} (the world size)",
                  file=sys.stderr)
        return 2
    # Every rank creates every group, in the same order; ranks 0 .. n-1 form group n.
    groups = {n: dist.group.WORLD if n == world else dist.new_group(list(range(n)))
              for n in sizes}
    # KVDP x CP on 4 ranks (rank 2 i + j: KVDP rank i of column {j, j + 2}, CP rank j of
    # row {2 i, 2 i + 1}); every rank of the world creates every group.
    grids: dict[int, tuple[Any, Any]] = {}
    if 4 in sizes and args.shapes != "table":
        columns = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        if rank < 4:
            grids[4] = (columns[rank % 2], pairs[rank // 2])
    graphs = args.graphs and device.type == "cuda"
    opts = {"dtype": torch.float32 if quick else torch.bfloat16, "graphs": graphs,
            "warmup": args.warmup if args.warmup is not None else (1 if quick else 10),
            "steps": args.steps if args.steps is not None else (3 if quick else 50),
            "cp_block": QUICK_CP_BLOCK if quick else CP_BLOCK,
            "exchanges": list(dict.fromkeys(args.exchange)), "grids": grids}
    table = (QUICK if quick else FULL) if args.shapes in ("table", "all") else []
    seed = (QUICK_SEED if quick else SEED) if args.shapes in ("seed", "all") else []
    shapes = [s for s in table if args.mode in ("both", s.mode)] + seed
    counter = _collective_counter()
    env: dict = {}
    copy: dict = {}
    if rank == 0:
        env = environment(device)
        env.update(world_size=world, backend=dist.get_backend(), sizes=sizes,
                   command=_command(world), dtype=_dt(torch.empty((), dtype=opts["dtype"])),
                   cp_block=opts["cp_block"], warmup=opts["warmup"], steps=opts["steps"],
                   exchanges=opts["exchanges"],
                   nccl=(".".join(map(str, torch.cuda.nccl.version()))
                         if device.type == "cuda" else None),
                   timing=("CUDA-graph replay of each call" if graphs else "eager calls"))
        print(f"# {env['device']} x{world} ({env['backend']}) | torch {env['torch']} | "
              f"triton {env['triton']} | lmfuse {env['lmfuse']} | {env['date']}")
        if device.type != "cuda":
            print("# no CUDA device: tiny float32 shapes on gloo ranks; lmfuse runs its "
                  "reference path or Triton's interpreter (figures are not GPU performance)")
        copy = measure_copy((2**20 if quick else 512 * 2**20), device)
        print(f"# per step: median over {opts['steps']} steps (after {opts['warmup']}) of the "
              f"slowest rank's time, {env['timing']}; TB/s: K and V bytes of all ranks / ms; "
              "x copy: TB/s / (N x the copy's); coll ms: the op's collectives alone",
              flush=True)
        print_rows([], header=True)
    dist.barrier()
    results: list[tuple[Result, dict]] = []
    with torch.no_grad():
        for shape in shapes:
            results += run_shape(shape, groups, device, opts, counter,
                                 copy.get("tbps", 0.0) if rank == 0 else 0.0)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        cal = calibrate(groups, device, opts, rank) if args.calibrate else None
    if rank == 0:
        bad = [r.impl for r, _ in results if "CHECK" in r.note]
        print(f"# correctness: {len(results) - len(bad)} of {len(results)} rows within "
              "tolerance" + (f"; CHECK {bad}" if bad else ""))
        judged = [x for _, x in results if x.get("target_met") is not None]
        rec = [x for x in judged if x.get("recommended")]
        if judged:
            print(f"# targets: {sum(x['target_met'] for x in judged)} of {len(judged)} rows met; "
                  f"recommended splits (*): {sum(x['target_met'] for x in rec)} of {len(rec)}")
        if args.json:
            isolated = {f"{r.case} {r.impl}": x["collective_ms"] for r, x in results
                        if "collective_ms" in x}
            write_json(args.json, env, copy, isolated, results)
            if cal is not None:
                with open(args.json) as f:
                    payload = json.load(f)
                payload["calibration"] = {"copy_tbps": copy.get("tbps"), **cal}
                with open(args.json, "w") as f:
                    json.dump(payload, f, indent=1)
    dist.barrier()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
