"""Sweep ``moe_experts``' launch tiles at issue 26's shapes (feeds ``tuning/*.json``'s
``moe_experts`` section); prints each candidate's times, the best per shape and kernel
group, and a suggested section as JSON.

    python bench/sweep_moe_experts.py [--json PATH] [--shapes mixtral,qwen3_moe,gptoss]
                                      [--budget-s N] [--quick] [--jobs N] [--top N]

Shapes (``lmfuse bench moe_experts``'s: bf16, weights scaled by ``fan_in ** -0.5``, routing
the top k of random router logits):

  mixtral    T 8192, H 4096, F 14336, E 8, k 2, SwiGLU halves: forward and backward (the
             gradients of hidden, router weights and both weights); floor: the dense cuBLAS
             GEMMs of the same flops, timed here (forward 2, backward 4); target <= 1.2x
  qwen3_moe  T 8192, H 2048, F 768, E 128, k 8, the same; target <= 1.5x the floor
  gptoss     decode T 1, 16, 64: H 2880, F 2880, E 32, k 4, Quick-GEGLU interleaved, offset 1,
             clamp 7, biases; the forward without grad as a CUDA graph replay; floor: a device
             copy of the selected experts' bytes; target: copy ms / ms >= 0.8

A candidate is a set of values for the table keys ``ops._config`` reads, laid over the
device's section with ``lmfuse.tuning.overlay``. The forward and the backward each read
the table when they launch, so each phase runs the values set for it. Every candidate's
output and gradients are compared with the table's (tiles change the accumulation order
only: ``rel`` = ||a - b|| / ||b||, the largest over the tensors, <= 1e-2 in bf16, else
WRONG; ``max_abs`` recorded); one that cannot compile or launch is a row with its error.
Staged, each stage with the others at the best so far:

1. rows (training): ``block_m/n/k``, ``warps``, ``stages`` of the row-tiled kernels (up,
   down, act_bwd share them), {64,128} x {64,128,256} x {32,64} x {4,8} x {3,4}: forward +
   backward once checked, once under torch.profiler (each kernel's GPU time: up, down,
   combine; act_bwd, wgrad, down_dx = the hidden gradient's down GEMM), ranked by the total;
   the ``--top`` best and the table's then timed by do_bench (CUDA events), the forward
   alone and the backward alone (``autograd.grad`` of one retained forward); the fastest
   sum is kept. Where up's best tiles differ from down's (or act_bwd's from down_dx's) a
   note says what separate table keys would save.
2. wgrad (training), rows at their best: ``wgrad_block_m/n`` {64,128}, ``wgrad_block_k``
   {32,64,128}, ``wgrad_warps`` {4,8}, ``wgrad_stages`` {3,4}, the backward ranked the same
   way; then the pick's forward+backward against the floor.
3. decode (each T), coordinate descent (the table's ``decode_tiles`` entries set aside, so
   that the candidates' tiles run): (block_m {16,32,64,128} x block_n {32,64,128,256}) at
   block_k 64, 4 warps, 3 stages, and the training pick; then block_k {32,64,128} x stages
   {3,4,5}; then warps {2,4,8}. Values resolving to a launch already run (block sizes are
   capped by the problem: block_m by T k) are not run again.

Compiles: a row candidate is 4 kernels, a wgrad or decode one 2: about 390 in a full run, at
2-4 s each. A pool of ``--jobs`` spawned processes first runs each candidate once at a small
T (the same kernel specializations), leaving its kernels in Triton's on-disk cache for the
sweep's first call (timings wait for the pool); ``--jobs 0``: compiled on first call. A full
run is about 3-4 minutes on an H100 with 16 cores (~70 s compiling, ~60 s mixtral, ~30 s
qwen3_moe, ~40 s gptoss). ``--budget-s`` (default 270) is split between shapes (0.45, 0.25,
0.3 of what is left as each starts) and stages; one out of time stops, says so, and the JSON
(rewritten after every stage) keeps every record, the table's and the best times against
the floors, the best values per kernel group and kernel, and the suggested section (the keys
``_config`` reads, in the table's order; rows and wgrad at the smallest geometric mean over
the training shapes of time / that shape's best, else over the decode T) with each decode
T's best as a ``decode_tiles`` entry ``[T k, block_m, block_n, block_k, warps, stages]``
(``ops._config`` takes the first entry whose rows cover a call's). Without CUDA
(``--quick``): 1-2 candidates at tiny float32 shapes in Triton's interpreter, a smoke test.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before lmfuse defines its kernels

import lmfuse  # noqa: E402
from lmfuse import tuning  # noqa: E402
from lmfuse.bench.common import environment  # noqa: E402
from lmfuse.bench.decode_attention import as_graph  # noqa: E402
from lmfuse.bench.moe_experts import (DECODE, DECODE_QUICK, DECODE_TOKENS,  # noqa: E402
                                      DECODE_TOKENS_QUICK, TRAIN, TRAIN_QUICK, Shape,
                                      Weights, decode_bytes, gemm_flops, route)
from lmfuse.moe import ops  # noqa: E402

# The tiles swept are the row-tiled kernels'; bf16 training sizes on a Hopper GPU run their
# GEMMs on the grouped-GEMM engine (torch._grouped_mm), which reads none of them. The sweep
# keeps the fused kernels (what fp16/fp32 and smaller calls run), in this process and in
# its compile pool (which imports this module).
ops._grouped_engine = lambda *args, **kwargs: False

FAMILY = "moe_experts"
ROW_KEYS = ("block_m", "block_n", "block_k", "warps", "stages")
WGRAD_KEYS = ("wgrad_block_m", "wgrad_block_n", "wgrad_block_k", "wgrad_warps",
              "wgrad_stages")
MODELS = {"mixtral": "mixtral", "qwen3_moe": "qwen3-moe", "gptoss": "gpt-oss"}
SHARES = {"mixtral": 0.45, "qwen3_moe": 0.25, "gptoss": 0.3}  # of the budget left
TARGETS = {"mixtral": 1.2, "qwen3_moe": 1.5, "gptoss": 0.8}
# Profiled kernels by name; a moe_down / moe_combine after moe_act_bwd is the backward's.
KERNELS = (("moe_up_kernel", "up"), ("moe_act_bwd_kernel", "act_bwd"),
           ("moe_down_kernel", "down"), ("moe_wgrad_kernel", "wgrad"),
           ("moe_combine_kernel", "combine"))
WARM_T = 256  # tokens of the compile processes' runs (T k >= 256: no block size capped)


class Grid:
    """The values swept (``quick``: one tiny candidate per group, for the interpreter)."""

    def __init__(self, quick: bool):
        if quick:
            tiny = dict(block_m=16, block_n=16, block_k=16, warps=4, stages=2)
            self.rows, self.decode_tiles = [tiny], [tiny]
            self.wgrad = [dict(zip(WGRAD_KEYS, (16, 16, 16, 4, 2)))]
            self.decode_k_stages: list[tuple[int, int]] = []
            self.decode_warps: list[int] = []
            return
        self.rows = [dict(zip(ROW_KEYS, v)) for v in itertools.product(
            (128, 64), (128, 256, 64), (64, 32), (8, 4), (3, 4))]
        self.wgrad = [dict(zip(WGRAD_KEYS, v)) for v in itertools.product(
            (128, 64), (128, 64), (64, 128, 32), (8, 4), (3, 4))]
        self.decode_tiles = [dict(block_m=m, block_n=n, block_k=64, warps=4, stages=3)
                             for m, n in itertools.product((16, 32, 64, 128), (32, 64, 128, 256))]
        self.decode_k_stages = list(itertools.product((32, 64, 128), (3, 4, 5)))
        self.decode_warps = [2, 4, 8]


class Table:
    """The current candidate's values laid over the device's ``moe_experts`` section
    (``lmfuse.tuning.overlay``, replaced at each :meth:`set`); ``ops._config`` reads it at
    every launch."""

    def __init__(self, device: torch.device):
        self.device = device
        self.base = dict(tuning.table(FAMILY, device))
        # The section's keys _config reads (MoELaunch's fields), in the table's order.
        fields = {f.name for f in dataclasses.fields(ops.MoELaunch)}
        self.reads = [k for k in self.base if k in fields]
        self._overlay = contextlib.ExitStack()

    def set(self, values: dict) -> None:
        self._overlay.close()
        self._overlay = contextlib.ExitStack()
        # A candidate's tiles are the section's own: the table's decode entries (which the
        # baseline's values carry) would take a decode step's rows past them.
        self._overlay.enter_context(tuning.overlay(FAMILY, {"decode_tiles": [], **values}))

    def restore(self) -> None:
        self._overlay.close()

    def launch(self, values: dict, rows: int, H: int, F: int) -> dict:
        """What ``ops._config`` resolves ``values`` to for ``rows = T k`` (block sizes
        capped by the problem): two candidates with one launch are timed once."""
        self.set(values)
        return dataclasses.asdict(ops._config(self.device, rows, H, F))


# --- inputs, calls, measurements -----------------------------------------------------------


@dataclass
class Inputs:
    args: tuple  # hidden, expert_ids, router_weights, w_gate_up, w_down
    kwargs: dict  # biases, activation settings, impl
    wrt: list  # the tensors the backward differentiates (training)
    dout: Optional[torch.Tensor]  # the upstream gradient (training), else None


def make_inputs(s: Shape, dtype: torch.dtype, device: torch.device, train: bool, seed: int,
                weight_grads: bool = True) -> Inputs:
    w = Weights(s, dtype, device, seed=seed, requires_grad=train and weight_grads)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + 1)
    hidden = torch.randn(s.T, s.H, generator=gen, dtype=dtype, device=device)
    expert_ids, router_weights = route(s.T, s.E, s.k, dtype, device, gen)
    dout = None
    if train:
        hidden.requires_grad_(True)
        router_weights.requires_grad_(True)
        dout = torch.randn(s.T, s.H, generator=gen, dtype=dtype, device=device)
    wrt = [t for t in (hidden, router_weights, *w.tensors()) if t.requires_grad]
    kwargs = dict(gate_up_bias=w.gate_up_bias, down_bias=w.down_bias, impl="triton",
                  **s.settings())
    return Inputs((hidden, expert_ids, router_weights, w.w_gate_up, w.w_down), kwargs, wrt,
                  dout)


def call(inp: Inputs) -> torch.Tensor:
    return lmfuse.moe_experts(*inp.args, **inp.kwargs)


def run_once(table: Table, inp: Inputs, fwd: dict, bwd: Optional[dict] = None) -> list:
    """``[out, *grads]``: the forward under ``fwd``'s values, the backward under ``bwd``'s."""
    table.set(fwd)
    if inp.dout is None:
        with torch.no_grad():
            return [call(inp)]
    out = call(inp)
    table.set(bwd if bwd is not None else fwd)
    return [out, *torch.autograd.grad(out, inp.wrt, inp.dout)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:240]


def compare(got: list, ref: list) -> tuple[float, float]:
    """(largest |a - b|, largest ||a - b|| / ||b||) over the tensors, in float32 chunks."""
    worst_abs, worst_rel = 0.0, 0.0
    for a, b in zip(got, ref):
        fa, fb = a.detach().reshape(-1), b.reshape(-1)
        num = fa.new_zeros((), dtype=torch.float32)
        den, mx = num.clone(), num.clone()
        for i in range(0, fa.numel(), 1 << 25):
            d = fa[i:i + (1 << 25)].float() - fb[i:i + (1 << 25)].float()
            num += d.square().sum()
            den += fb[i:i + (1 << 25)].float().square().sum()
            mx = torch.maximum(mx, d.abs().max())
        worst_abs = max(worst_abs, float(mx))
        worst_rel = max(worst_rel, float(num.sqrt() / den.sqrt().clamp_min(1e-30)))
    return worst_abs, worst_rel


def bench(fn: Callable[[], object], device: torch.device, expect_ms: float = 1.0) -> float:
    """Median ms of ``fn``: do_bench (CUDA events) over about 4 calls' worth of time (at
    least 40 ms) after about one; on the CPU one timed call after one untimed."""
    if device.type != "cuda":
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=max(10.0, expect_ms), rep=max(40.0, 4 * expect_ms),
                          return_mode="median"))


class Profiler:
    """Each kernel's GPU time in one call of ``fn`` (torch.profiler, CUDA activity), by label
    (``KERNELS``; the rest summed as ``other``). Off on the CPU, and after one failure."""

    def __init__(self, device: torch.device):
        self.on = device.type == "cuda"

    def __call__(self, fn: Callable[[], object]) -> Optional[dict[str, float]]:
        if not self.on:
            return None
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        try:
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            events = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                            key=lambda e: e.time_range.start)
        except Exception as exc:  # noqa: BLE001 - no CUPTI here: rank by do_bench instead
            print(f"# torch.profiler failed ({short(exc)}); ranking by do_bench instead",
                  flush=True)
            self.on = False
            return None
        out: dict[str, float] = {}
        backward = False
        for e in events:
            label = next((lab for name, lab in KERNELS if name in e.name), "other")
            backward = backward or label == "act_bwd"
            if backward and label in ("down", "combine"):
                label += "_dx"
            out[label] = out.get(label, 0.0) + e.time_range.elapsed_us() / 1e3
        return out or None


# --- compiling ahead -----------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _warm(task: tuple) -> tuple[int, Optional[str]]:
    """Pool process: one candidate's calls at a small T, which compiles its kernels into
    Triton's on-disk cache. ``(task id, error or None)``."""
    tid, device, s, dtype, train, weight_grads, fwd, bwd = task
    try:
        table = _WORKER.get("table") or _WORKER.setdefault("table", Table(device))
        key = (s, dtype, train, weight_grads)
        if _WORKER.get("key") != key:  # one shape's inputs at a time
            _WORKER.pop("inputs", None)
            _WORKER["inputs"] = make_inputs(s, dtype, device, train, 7, weight_grads)
            _WORKER["key"] = key
        run_once(table, _WORKER["inputs"], fwd, bwd)
        sync(device)
        return tid, None
    except Exception as exc:  # noqa: BLE001 - recorded again when the sweep runs it
        return tid, short(exc)


def warm_shape(s: Shape) -> Shape:
    """The shape the compile processes run: few tokens and experts, the same H and F (the
    same block caps and kernel specializations: H, F, T k all multiples of 16)."""
    return s._replace(T=min(s.T, WARM_T), E=s.k)


class Warmer:
    """``jobs`` spawned processes compiling candidates ahead (none: ``jobs`` 0)."""

    def __init__(self, jobs: int, table: Table):
        self.jobs, self.table, self.pool, self.compiles = jobs, table, None, 0
        self.pending: list = []
        self.seen: set = set()
        if jobs > 0:
            try:
                self.pool = multiprocessing.get_context("spawn").Pool(jobs)
            except Exception as exc:  # noqa: BLE001 - compile on first call instead
                print(f"# no compile pool ({short(exc)}): each candidate compiles when run")

    def submit(self, s: Shape, dtype: torch.dtype, train: bool, weight_grads: bool,
               fwd: dict, bwd: Optional[dict] = None, kernels: int = 2) -> None:
        w = warm_shape(s)
        launch = self.table.launch(bwd or fwd, w.T * w.k, w.H, w.F)
        if bwd is not None:
            launch.update({f"fwd_{k}": v for k, v in
                           self.table.launch(fwd, w.T * w.k, w.H, w.F).items()})
        variant = (w.activation, w.layout, w.bias, w.clamp_value is not None, dtype, train,
                   weight_grads)
        key = (variant, tuple(sorted(launch.items())))
        if key in self.seen:
            return
        self.seen.add(key)
        self.compiles += kernels
        if self.pool is not None:
            task = (len(self.seen), self.table.device, w, dtype, train, weight_grads,
                    fwd, bwd)
            self.pending.append(self.pool.apply_async(_warm, (task,)))

    def wait(self, deadline: float, what: str) -> None:
        """Until the submitted runs are done (the GPU timings must not overlap them); at
        ``deadline`` the pool is stopped and the rest compile when the sweep runs them."""
        if not self.pending:
            return
        n, t0 = len(self.pending), time.perf_counter()
        last = t0
        while (done := sum(r.ready() for r in self.pending)) < n:
            if (now := time.perf_counter()) >= deadline:
                print(f"# {what}: out of time, {done}/{n} compiled ahead; stopping the compile "
                      f"processes", flush=True)
                self.close()
                break
            if now - last >= 10:
                print(f"# {what}: {done}/{n} compiled ahead, {now - t0:.0f} s", flush=True)
                last = now
            time.sleep(0.2)
        failed = sum(1 for r in self.pending if r.ready() and r.get()[1])
        print(f"# {what}: {done} candidates compiled ahead in {time.perf_counter() - t0:.0f} s"
              f" by {self.jobs} processes ({failed} could not compile or launch: recorded "
              f"when run)", flush=True)
        self.pending = []

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()  # this script's own children
            self.pool.join()
            self.pool = None


# --- the training shapes -------------------------------------------------------------------


def fmt(values: dict) -> str:
    short_names = dict(block_m="m", block_n="n", block_k="k", warps="w", stages="s",
                       wgrad_block_m="m", wgrad_block_n="n", wgrad_block_k="k",
                       wgrad_warps="w", wgrad_stages="s")
    return " ".join(f"{short_names.get(k, k)}{v}" for k, v in values.items())


def fmt_kernels(kernels: Optional[dict]) -> str:
    if not kernels:
        return ""
    order = ("up", "down", "combine", "act_bwd", "wgrad", "down_dx", "combine_dx", "other")
    return " ".join(f"{k} {kernels[k]:.3f}" for k in order if k in kernels)


class Clock:
    """The budget: ``until(end, f)`` is when fraction ``f`` of the time from now to ``end``
    will have gone; ``out(end)``: past ``end`` or the budget's end."""

    def __init__(self, seconds: float):
        self.start = time.perf_counter()
        self.end = self.start + seconds

    @staticmethod
    def until(end: float, fraction: float) -> float:
        now = time.perf_counter()
        return now + max(0.0, end - now) * fraction

    def out(self, end: float) -> bool:
        return time.perf_counter() >= min(end, self.end)


class TrainCase:
    """One training shape: inputs, the table's results (the reference) and timings."""

    def __init__(self, s: Shape, table: Table, device: torch.device, dtype: torch.dtype,
                 profiler: Profiler, seed: int):
        self.s, self.table, self.device, self.profiler = s, table, device, profiler
        self.inp = make_inputs(s, dtype, device, True, seed)
        self.tol = 1e-4 if dtype == torch.float32 else 1e-2
        self.base_rows = {k: table.base[k] for k in ROW_KEYS}
        self.base_wgrad = {k: table.base[k] for k in WGRAD_KEYS}
        self.ref = [t.detach() for t in run_once(table, self.inp, table.base)]
        self.seen: dict[tuple, dict] = {}
        self.expect = {"fwd": 1.0, "bwd": 1.0, "total": 1.0}

    def fwd_fn(self, fwd: dict) -> Callable[[], object]:
        def fn():
            self.table.set(fwd)
            return call(self.inp)
        return fn

    def bwd_fn(self, out: torch.Tensor, bwd: dict) -> Callable[[], object]:
        def fn():
            self.table.set(bwd)
            return torch.autograd.grad(out, self.inp.wrt, self.inp.dout, retain_graph=True)
        return fn

    def step_fn(self, fwd: dict, bwd: dict) -> Callable[[], object]:
        def fn():
            out = self.fwd_fn(fwd)()
            self.table.set(bwd)
            return torch.autograd.grad(out, self.inp.wrt, self.inp.dout)
        return fn

    def baseline(self) -> dict:
        """The table's fwd, bwd and fwd+bwd ms, and the dense GEMM floors'."""
        s, base = self.s, self.table.base
        out: dict = {"flops": gemm_flops(s, True)}
        sync(self.device)
        t0 = time.perf_counter()
        self.fwd_fn(base)()
        sync(self.device)  # a rough time, for do_bench's number of calls
        out["fwd_ms"] = bench(self.fwd_fn(base), self.device, (time.perf_counter() - t0) * 1e3)
        keep = self.fwd_fn(base)()
        out["bwd_ms"] = bench(self.bwd_fn(keep, base), self.device, out["fwd_ms"])
        del keep
        out["total_ms"] = bench(self.step_fn(base, base), self.device, 3 * out["fwd_ms"])
        self.expect = {"fwd": out["fwd_ms"], "bwd": out["bwd_ms"], "total": out["total_ms"]}
        # The floor: expert 0's weights, random activations of the case's sizes.
        rows, like = s.T * s.k, self.inp.args[0]
        x, a, dy, dh = (torch.randn(rows, n, dtype=like.dtype, device=self.device)
                        for n in (s.H, s.F, s.H, s.K2))
        w1, w2 = self.inp.args[3][0].detach(), self.inp.args[4][0].detach()
        out["floor_fwd_ms"] = bench(lambda: (x @ w1.T, a @ w2.T), self.device)
        out["floor_bwd_ms"] = bench(lambda: (dy @ w2, dy.T @ a, dh @ w1, dh.T @ x),
                                    self.device)
        out["floor_ms"] = out["floor_fwd_ms"] + out["floor_bwd_ms"]
        out["x_floor"] = out["total_ms"] / out["floor_ms"]
        return out

    def screen(self, stage: str, fwd: dict, bwd: dict, keep: Optional[torch.Tensor] = None,
               values: Optional[dict] = None) -> Optional[dict]:
        """Checks ``(fwd, bwd)`` once and ranks it: the profiled kernels' total (forward and
        backward; with ``keep``, a retained forward, the backward only), else do_bench's.
        None: it resolves to a launch already run."""
        s = self.s
        launch = {**self.table.launch(fwd, s.T * s.k, s.H, s.F),
                  **{f"bwd_{k}": v for k, v in
                     self.table.launch(bwd, s.T * s.k, s.H, s.F).items()}}
        key = (stage, tuple(sorted(launch.items())))
        if key in self.seen:
            self.seen[key].setdefault("aliases", []).append(values)
            return None
        rec: dict = dict(stage=stage, values=values, fwd=fwd, bwd=bwd, ok=False)
        self.seen[key] = rec
        t0 = time.perf_counter()
        try:
            if keep is None:
                got, ref = run_once(self.table, self.inp, fwd, bwd), self.ref
                fn = self.step_fn(fwd, bwd)
            else:
                fn = self.bwd_fn(keep, bwd)
                got, ref = list(fn()), self.ref[1:]
            sync(self.device)
            rec["first_s"] = time.perf_counter() - t0
            rec["max_abs"], rec["rel"] = compare(got, ref)
            rec["ok"] = rec["rel"] <= self.tol
            del got
            kernels = rec["kernels"] = self.profiler(fn)
            ms = rec["screen_ms"] = (sum(kernels.values()) if kernels else bench(
                fn, self.device, self.expect["bwd" if keep is not None else "total"]))
            # What the stage's keys change: the wgrad launches, or all but them.
            wgrad = (kernels or {}).get("wgrad", 0.0)
            rec["group_ms"] = ms if not kernels else wgrad if keep is not None else ms - wgrad
        except Exception as exc:  # noqa: BLE001 - a config that cannot compile or launch
            rec["error"] = short(exc)
            rec.setdefault("first_s", time.perf_counter() - t0)
        return rec

    def confirm(self, recs: list[dict], tag: str, clock: Clock, end: float,
                keep: Optional[torch.Tensor] = None) -> None:
        """do_bench of each one's forward alone (not with ``keep``, a retained forward) and
        backward alone, until ``end``."""
        for rec in recs:
            if clock.out(end):
                print(f"{tag}] out of time confirming", flush=True)
                return
            try:
                out = keep
                if keep is None:
                    rec["fwd_ms"] = bench(self.fwd_fn(rec["fwd"]), self.device,
                                          self.expect["fwd"])
                    out = self.fwd_fn(rec["fwd"])()
                rec["bwd_ms"] = bench(self.bwd_fn(out, rec["bwd"]), self.device,
                                      self.expect["bwd"])
                out = None
            except Exception as exc:  # noqa: BLE001
                rec.update(error=short(exc), ok=False)
                continue
            fwd = ""
            if "fwd_ms" in rec:
                rec["fwd_bwd_ms"] = rec["fwd_ms"] + rec["bwd_ms"]
                fwd = f"fwd {rec['fwd_ms']:.3f} + "
            print(f"{tag} do_bench] {fmt(rec['values']):<22} {fwd}bwd {rec['bwd_ms']:.3f} ms"
                  + (f" = {rec['fwd_bwd_ms']:.3f} ms" if fwd else ""), flush=True)


def show(tag: str, rec: dict, values: dict) -> None:
    """One candidate's line: its rank time (decode: us and x the copy rate), kernels."""
    if rec.get("error"):
        result = f"failed: {rec['error'][:110]}"
    else:
        result = (f"{rec['screen_ms']:9.3f} ms" if "x_copy" not in rec else
                  f"{rec['ms'] * 1e3:8.1f} us {rec['x_copy']:.2f}x copy")
        result += (("" if rec["ok"] else f"  WRONG (rel {rec['rel']:.1e})")
                   + (f"  [{fmt_kernels(rec['kernels'])}]" if rec.get("kernels") else ""))
    first = rec.get("first_s", 0.0)
    print(f"{tag} {fmt(values):<22} {result}" + (f"  (first call {first:.1f} s)"
                                                 if first > 1 else ""), flush=True)


def good(recs: list[dict], metric: str) -> list[dict]:
    return sorted((r for r in recs if r.get("ok") and r.get(metric) is not None),
                  key=lambda r: r[metric])


def kernel_notes(recs: list[dict], chosen: dict, pairs: tuple) -> dict:
    """Per kernel label: the fastest candidate's values and ms; and for each pair of kernels
    sharing table keys, a note where their fastest values differ."""
    bests: dict[str, dict] = {}
    for r in recs:
        if not r.get("ok") or not r.get("kernels"):
            continue
        for label, ms in r["kernels"].items():
            if label != "other" and (label not in bests or ms < bests[label]["ms"]):
                bests[label] = dict(values=r["values"], ms=ms)
    notes = []
    for a, b in pairs:
        if a in bests and b in bests and bests[a]["values"] != bests[b]["values"]:
            at = chosen.get("kernels") or {}
            cost = sum(at.get(k, bests[k]["ms"]) - bests[k]["ms"] for k in (a, b))
            notes.append(f"{a} is fastest at {fmt(bests[a]['values'])} ({bests[a]['ms']:.3f} "
                         f"ms), {b} at {fmt(bests[b]['values'])} ({bests[b]['ms']:.3f} ms): "
                         f"separate table keys would save {cost:.3f} ms over the pick "
                         f"{fmt(chosen['values'])}")
    return {"per_kernel": bests, "notes": notes}


def run_stage(tag: str, cands: list[dict], clock: Clock, end: float,
              measure: Callable[[dict], Optional[dict]]) -> list[dict]:
    """``measure`` each candidate until ``end``; the records of those run."""
    recs = []
    for i, values in enumerate(cands):
        if clock.out(end):
            print(f"{tag}] out of time: {i} of {len(cands)} candidates run", flush=True)
            break
        rec = measure(values)
        if rec is not None:
            recs.append(rec)
            show(f"{tag} {i + 1}/{len(cands)}]", rec, values)
    return recs


def run_training(name: str, case: TrainCase, grid: Grid, clock: Clock, end: float,
                 top: int, result: dict, dump: Callable[[], None]) -> None:
    tag = f"[{name}"
    base = result["baseline"] = case.baseline()
    print(f"{name}: table {base['total_ms']:.3f} ms fwd+bwd (fwd {base['fwd_ms']:.3f}, bwd "
          f"{base['bwd_ms']:.3f}); dense GEMM floor {base['floor_ms']:.3f} ms (fwd "
          f"{base['floor_fwd_ms']:.3f}, bwd {base['floor_bwd_ms']:.3f}): "
          f"{base['x_floor']:.2f}x the floor", flush=True)
    dump()
    # 1. rows: forward and backward at each candidate (wgrad at the table's).
    rows = [case.base_rows] + [v for v in grid.rows if v != case.base_rows]
    recs = result["rows"] = run_stage(
        f"{tag} rows", rows, clock, clock.until(end, 0.45), lambda v: case.screen(
            "rows", {**v, **case.base_wgrad}, {**v, **case.base_wgrad}, values=v))
    ranked = good(recs, "screen_ms")
    if not ranked:
        print(f"{tag}] no row candidate ran correctly" if recs else f"{tag}] stopped", flush=True)
        return
    confirm = ranked[:top] + [r for r in ranked[top:] if r["values"] == case.base_rows]
    case.confirm(confirm, f"{tag} rows", clock, clock.until(end, 0.25))
    timed = good(confirm, "fwd_bwd_ms")
    best_rows = (timed or ranked)[0]
    result["rows_best"] = best_rows["values"]
    result["rows_kernels"] = kernel_notes(recs, best_rows, (("up", "down"),
                                                            ("act_bwd", "down_dx")))
    for note in result["rows_kernels"]["notes"]:
        print(f"{tag} rows] note: {note}", flush=True)
    fwd_f = good(confirm, "fwd_ms")
    if fwd_f and timed and fwd_f[0] is not timed[0]:
        bwd_f = good(confirm, "bwd_ms")[0]
        print(f"{tag} rows] note: the forward is fastest at {fmt(fwd_f[0]['values'])}, the "
              f"backward at {fmt(bwd_f['values'])}; the pick {fmt(timed[0]['values'])} is "
              f"fastest for both together", flush=True)
    dump()
    # 2. wgrad: the backward at each candidate, rows at the best.
    rows_v = result["rows_best"]
    fwd = {**rows_v, **case.base_wgrad}
    keep = case.fwd_fn(fwd)()
    wgrads = [case.base_wgrad] + [v for v in grid.wgrad if v != case.base_wgrad]
    wrecs = result["wgrad"] = run_stage(
        f"{tag} wgrad", wgrads, clock, clock.until(end, 0.75), lambda v: case.screen(
            "wgrad", fwd, {**rows_v, **v}, keep=keep, values=v))
    wranked = good(wrecs, "screen_ms")
    case.confirm(wranked[:top], f"{tag} wgrad", clock, clock.until(end, 0.6), keep)
    keep = None  # the retained forward's memory
    wtimed = good(wranked[:top], "bwd_ms")
    best_w = (wtimed or wranked or [dict(values=case.base_wgrad)])[0]
    result["wgrad_best"] = best_w["values"]
    result["wgrad_kernels"] = kernel_notes(wrecs, best_w, ())["per_kernel"]
    dump()
    # The pick, forward+backward, against the floor and the table's.
    if clock.out(clock.end):
        print(f"{tag}] out of time before timing the pick", flush=True)
        return
    pick = {**rows_v, **result["wgrad_best"]}
    try:
        ms = bench(case.step_fn(pick, pick), case.device, base["total_ms"])
    except Exception as exc:  # noqa: BLE001
        print(f"{tag}] the pick failed: {short(exc)}", flush=True)
        return
    result["best"] = dict(values=pick, total_ms=ms, x_floor=ms / base["floor_ms"],
                          speedup=base["total_ms"] / ms)
    print(f"{name}: best {fmt(rows_v)} | wgrad {fmt(result['wgrad_best'])}: {ms:.3f} ms "
          f"fwd+bwd, {ms / base['floor_ms']:.2f}x the floor (target <= {TARGETS[name]}x), "
          f"{base['total_ms'] / ms:.2f}x the table's speed", flush=True)


# --- decode --------------------------------------------------------------------------------


class DecodeCase:
    """One decode T: inputs, the table's output, the copy floor; candidates timed as graph
    replays."""

    def __init__(self, s: Shape, table: Table, device: torch.device, dtype: torch.dtype,
                 profiler: Profiler, weights_seed: int):
        self.s, self.table, self.device, self.profiler = s, table, device, profiler
        self.inp = make_inputs(s, dtype, device, False, weights_seed)
        self.tol = 1e-4 if dtype == torch.float32 else 1e-2
        self.ref = run_once(table, self.inp, table.base)
        self.nbytes = decode_bytes(s, self.inp.args[1], self.inp.args[0].element_size())
        self.recs: list[dict] = []
        self.seen: dict[tuple, dict] = {}
        self.expect = 0.1

    def fn(self, values: dict) -> Callable[[], object]:
        def forward():
            self.table.set(values)
            with torch.no_grad():
                return call(self.inp)
        return forward

    def timed(self, values: dict) -> float:
        fn = self.fn(values)
        if self.device.type == "cuda":
            fn = as_graph(fn)
        return bench(fn, self.device, self.expect)

    def baseline(self) -> dict:
        """The table's time and the floor: a copy of the bytes (half read, half written)."""
        src = torch.randn(self.nbytes // 4, device=self.device).to(torch.bfloat16)
        dst = torch.empty_like(src)
        self.copy_ms = bench(lambda: dst.copy_(src), self.device)
        src = dst = None  # noqa: F841 - freed before the candidates run
        ms = self.expect = self.timed(self.table.base)
        return dict(bytes=self.nbytes, copy_ms=self.copy_ms, ms=ms, x_copy=self.copy_ms / ms)

    def measure(self, values: dict) -> Optional[dict]:
        """``values``' record (None: it resolves to a launch already timed)."""
        s = self.s
        launch = self.table.launch(values, s.T * s.k, s.H, s.F)
        key = tuple(sorted(launch.items()))
        if key in self.seen:
            self.seen[key].setdefault("aliases", []).append(values)
            return None
        rec: dict = dict(values=values, ok=False)
        self.seen[key] = rec
        self.recs.append(rec)
        t0 = time.perf_counter()
        try:
            got = [self.fn(values)()]
            sync(self.device)
            rec["first_s"] = time.perf_counter() - t0
            rec["max_abs"], rec["rel"] = compare(got, self.ref)
            rec["ok"] = rec["rel"] <= self.tol
            rec["kernels"] = self.profiler(self.fn(values))
            rec["ms"] = rec["screen_ms"] = self.timed(values)
            rec["x_copy"] = self.copy_ms / rec["ms"]
        except Exception as exc:  # noqa: BLE001 - a config that cannot compile or launch
            rec["error"] = short(exc)
            rec.setdefault("first_s", time.perf_counter() - t0)
        return rec

    def best(self) -> Optional[dict]:
        return next(iter(good(self.recs, "ms")), None)


def run_decode(cases: list[DecodeCase], grid: Grid, clock: Clock, end: float,
               warmer: Warmer, extra: list[dict], results: dict,
               dump: Callable[[], None]) -> None:
    for case in cases:
        name = f"gptoss T{case.s.T}"
        base = results[name] = {"baseline": case.baseline(), "records": case.recs}
        print(f"{name}: table {base['baseline']['ms'] * 1e3:.1f} us, copy of the selected "
              f"experts' {case.nbytes / 2**20:.0f} MiB {case.copy_ms * 1e3:.1f} us: "
              f"{base['baseline']['x_copy']:.2f}x the copy rate", flush=True)
    dump()

    def stage(label: str, make: Callable[[DecodeCase], list[dict]], fraction: float) -> None:
        stage_end = clock.until(end, fraction)
        lists = [(case, make(case)) for case in cases]
        for case, cands in lists:
            for values in cands:
                warmer.submit(case.s, case.inp.args[0].dtype, False, False, values)
        warmer.wait(min(stage_end, clock.end), f"decode {label}")
        for j, (case, cands) in enumerate(lists):
            for rec in run_stage(f"[gptoss T{case.s.T} {label}", cands, clock,
                                 clock.until(stage_end, 1 / (len(lists) - j)), case.measure):
                rec["stage"] = label
        dump()

    def from_best(case: DecodeCase, change: Callable[[dict], list[dict]]) -> list[dict]:
        best = case.best()
        return change(best["values"]) if best else []

    base_rows = {k: cases[0].table.base[k] for k in ROW_KEYS}
    stage("tiles", lambda c: [base_rows] + grid.decode_tiles + extra, 0.45)
    stage("block_k x stages", lambda c: from_best(c, lambda v: [
        dict(v, block_k=bk, stages=st) for bk, st in grid.decode_k_stages]), 0.65)
    stage("warps", lambda c: from_best(c, lambda v: [
        dict(v, warps=w) for w in grid.decode_warps]), 1.0)
    for case in cases:
        name = f"gptoss T{case.s.T}"
        out, best = results[name], case.best()
        if best is None:
            continue
        out["best"] = dict(values=best["values"], ms=best["ms"], x_copy=best["x_copy"],
                           rows=case.s.T * case.s.k)
        kn = kernel_notes(case.recs, best, (("up", "down"),))
        out["per_kernel"], out["notes"] = kn["per_kernel"], kn["notes"]
        for values in extra:
            rec = next((r for r in case.recs if r["values"] == values
                        or values in r.get("aliases", [])), None)
            if rec and rec.get("ms"):
                out["training_pick"] = dict(values=values, ms=rec["ms"], x_copy=rec["x_copy"])
        print(f"{name}: best {fmt(best['values'])}: {best['ms'] * 1e3:.1f} us, "
              f"{best['x_copy']:.2f}x the copy rate (target >= {TARGETS['gptoss']}x)"
              + (f"; the training pick {out['training_pick']['x_copy']:.2f}x"
                 if "training_pick" in out else ""), flush=True)
        for note in kn["notes"]:
            print(f"{name}: note: {note}", flush=True)
    dump()


# --- summary -------------------------------------------------------------------------------


def pick_common(per_shape: list[list[dict]], keys: tuple, metric: str) -> Optional[dict]:
    """The values (over ``keys``) that ran correctly in every list, with the smallest
    geometric mean of ``metric`` / that list's best."""
    scores: dict[tuple, list[float]] = {}
    for recs in per_shape:
        ok = good(recs, metric)
        if not ok:
            return None
        here: dict[tuple, float] = {}
        for r in ok:
            for v in [r["values"]] + r.get("aliases", []):
                here.setdefault(tuple(v[k] for k in keys), r[metric] / ok[0][metric])
        for key, x in here.items():
            scores.setdefault(key, []).append(x)
    common = [(math.exp(sum(map(math.log, v)) / len(v)), k) for k, v in scores.items()
              if len(v) == len(per_shape)]
    if not common:
        return None
    score, key = min(common)
    return dict(values=dict(zip(keys, key)), geomean_x_best=score)


def suggest(table: Table, shapes: dict) -> dict:
    """The section to paste: rows and wgrad values at the smallest geometric mean over the
    training shapes (else the decode T, largest first) of time / that shape's best; where no
    values ran correctly everywhere, the first shape's best."""
    section = {k: table.base[k] for k in table.reads if k in table.base}
    train = [v for v in shapes.values() if v.get("rows")]
    runs = train or [v for v in reversed(shapes.values()) if v.get("records")]
    groups = ((("rows", ROW_KEYS, "group_ms"), ("wgrad", WGRAD_KEYS, "group_ms")) if train
              else (("records", ROW_KEYS, "ms"),))
    why = {}
    for group, keys, metric in groups:
        pick = pick_common([v.get(group) or [] for v in runs], keys, metric)
        if pick is None:
            first = next((v.get(f"{group}_best") or v.get("best", {}).get("values")
                          for v in runs if v.get(f"{group}_best") or v.get("best")), None)
            pick = dict(values=first, geomean_x_best=None) if first else None
        if pick:
            section.update({k: pick["values"][k] for k in keys})
            why[group] = pick
    return {"moe_experts": section, "chosen_by": why}


def submit_ahead(warmer: Warmer, table: Table, grid: Grid, train: list[Shape],
                 decode: Optional[Shape], tokens: tuple, dtype: torch.dtype) -> None:
    """Everything that does not depend on a result, to compile ahead at once: the training
    rows candidates, the decode tiles stage, then the wgrad candidates (by which time the
    table's row kernels are on disk). The training shapes share their kernels: the smallest
    one's runs compile them."""
    base_r = {k: table.base[k] for k in ROW_KEYS}
    base_w = {k: table.base[k] for k in WGRAD_KEYS}
    for s in train:
        for values in grid.rows:
            both = {**values, **base_w}
            warmer.submit(s, dtype, True, False, both, both, kernels=4)
    for t in tokens if decode else ():
        for values in [base_r] + grid.decode_tiles:
            warmer.submit(decode._replace(T=t), dtype, False, False, values)
    for s in train:
        for values in grid.wgrad:
            warmer.submit(s, dtype, True, True, base_r, {**base_r, **values})


def report(table: Table, shapes: dict, elapsed: float) -> dict:
    """The summary: each shape's table and best against its floor, the suggested section."""
    flat = {}
    for name, v in shapes.items():
        flat.update(v.get("cases", {}) if name == "gptoss" else {name: v})
    summary = suggest(table, flat)
    here = sum(1 for v in flat.values() for r in v.get("rows", []) + v.get("wgrad", [])
               + v.get("records", []) if r.get("first_s", 0) > 1)
    summary.update(first_calls_over_1s=here, elapsed_s=elapsed)
    print(f"\n# {elapsed:.0f} s; {here} candidates took > 1 s on their first call here "
          f"(compiled here, not ahead)")
    for name, v in flat.items():
        b = v.get("best")
        if b and "x_floor" in b:
            print(f"# {name:<12} table {v['baseline']['x_floor']:.2f}x -> best {b['x_floor']:.2f}"
                  f"x the GEMM floor (target <= {TARGETS[name]}x): rows {fmt(v['rows_best'])},"
                  f" wgrad {fmt(v['wgrad_best'])}")
        elif b:
            print(f"# {name:<12} table {v['baseline']['x_copy']:.2f}x -> best {b['x_copy']:.2f}"
                  f"x the copy rate (target >= {TARGETS['gptoss']}x): {fmt(b['values'])}")
    # Each decode T's best as a decode_tiles entry (T k rows and below, smallest first).
    summary["decode_tiles"] = sorted(
        [v["best"]["rows"], *(v["best"]["values"][k] for k in ROW_KEYS)]
        for v in flat.values() if (v.get("best") or {}).get("rows"))
    print(f"\n# suggested for tuning/{tuning.device_key(table.device)}.json (rows, wgrad: the "
          "smallest geometric mean over the training shapes of time / that shape's best)" + (
              ":" if summary["chosen_by"] else ": nothing measured, the table as it is"))
    print(json.dumps({"moe_experts": summary["moe_experts"]}, indent=2))
    if summary["decode_tiles"]:
        print("# and the decode T's bests as the section's decode_tiles ([max rows, "
              + ", ".join(ROW_KEYS) + "]):")
        print(json.dumps({"decode_tiles": summary["decode_tiles"]}))
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every measurement and the summary here")
    parser.add_argument("--shapes", default="mixtral,qwen3_moe,gptoss",
                        help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--budget-s", type=float, default=270.0,
                        help="stop cleanly after about this many seconds (default 270)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny float32 shapes, 1-2 candidates (the default without CUDA)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="processes compiling candidates ahead (default: CPUs - 2, at "
                             "most 14, on CUDA; 0: compile on first call)")
    parser.add_argument("--top", type=int, default=4,
                        help="candidates per stage timed by do_bench after the profiled "
                             "ranking (default 4)")
    args = parser.parse_args(argv)
    names = [n for n in args.shapes.split(",") if n]
    if not names or any(n not in MODELS for n in names):
        parser.error(f"--shapes takes names among {', '.join(MODELS)}; got {args.shapes!r}")
    names = [n for n in MODELS if n in names]  # training first: decode times their pick
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quick = args.quick or device.type != "cuda"
    dtype = torch.float32 if quick else torch.bfloat16
    train_shapes = {s.model: s for s in (TRAIN_QUICK if quick else TRAIN)}
    decode_shape = DECODE_QUICK if quick else DECODE
    tokens = DECODE_TOKENS_QUICK if quick else DECODE_TOKENS
    grid = Grid(quick)
    torch.manual_seed(0)
    table = Table(device)
    if [table.launch({"block_m": m}, 4096, 1024, 1024)["block_m"] for m in (16, 32)] != [16, 32]:
        print("sweep_moe_experts: ops._config no longer follows lmfuse.tuning.table at each "
              "call; this script must learn its new way", file=sys.stderr)
        table.restore()
        return 2
    env = environment(device)
    env.update(table=table.base, keys_read=table.reads, dtype=str(dtype).replace("torch.", ""))
    print(f"# {env['device']} | torch {env['torch']} | triton {env['triton']} | {env['date']}"
          f" | {env['dtype']}" + (" | quick: tiny shapes, Triton's interpreter" if
                                  device.type != "cuda" else " | quick" if quick else ""))
    print(f"# moe_experts table here: {json.dumps(table.base)}")
    clock = Clock(args.budget_s)
    jobs = args.jobs if args.jobs is not None else max(0, min(14, (os.cpu_count() or 2) - 2))
    warmer = Warmer(jobs if device.type == "cuda" else 0, table)
    train = sorted((train_shapes[MODELS[n]] for n in names if n != "gptoss"),
                   key=lambda s: s.E * s.K2 * s.H)
    submit_ahead(warmer, table, grid, train, decode_shape if "gptoss" in names else None,
                 tokens, dtype)
    later = (len(tokens) * 2 * (len(grid.decode_k_stages) + len(grid.decode_warps))
             if "gptoss" in names else 0)
    plan = dict(rows=len(grid.rows), wgrad=len(grid.wgrad), decode=[
        len(grid.decode_tiles), len(grid.decode_k_stages), len(grid.decode_warps)],
        compiles_ahead=warmer.compiles, compiles_later_at_most=later,
        jobs=warmer.jobs if warmer.pool else 0, budget_s=args.budget_s)
    print(f"# plan: {', '.join(names)}; candidates: rows {plan['rows']}, wgrad {plan['wgrad']}"
          f", decode {' + '.join(map(str, plan['decode']))} per T; about "
          f"{warmer.compiles + later} kernel compiles ({warmer.compiles} ahead, "
          + (f"in {plan['jobs']} processes" if plan["jobs"] else "on first call")
          + f"); budget {args.budget_s:.0f} s", flush=True)
    results: dict = {"environment": env, "plan": plan, "shapes": {}}

    def dump() -> None:
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(results, fh, indent=1, default=str)

    dump()
    profiler = Profiler(device)
    shapes = results["shapes"]
    try:
        for i, name in enumerate(names):
            if clock.out(clock.end - 0.05 * args.budget_s):
                print(f"{name}: not run, out of time", flush=True)
                shapes[name] = {"skipped": "budget"}
                continue
            share = SHARES[name] / sum(SHARES[n] for n in names[i:])
            if name != "gptoss":
                s = train_shapes[MODELS[name]]
                case = TrainCase(s, table, device, dtype, profiler, seed=1000 + i)
                warmer.wait(clock.start + 0.45 * args.budget_s, "compiling ahead")
                shapes[name] = {"shape": s._asdict(), "kind": "train"}
                run_training(name, case, grid, clock, clock.until(clock.end, share), args.top,
                             shapes[name], dump)
            else:
                cases = [DecodeCase(decode_shape._replace(T=t), table, device, dtype,
                                    profiler, weights_seed=3000) for t in tokens]
                warmer.wait(clock.start + 0.45 * args.budget_s, "compiling ahead")
                picks = []
                if any(v.get("rows") for v in shapes.values()):
                    section = suggest(table, shapes)["moe_experts"]
                    picks = [{k: section[k] for k in ROW_KEYS}]
                shapes[name] = {"shape": decode_shape._asdict(), "kind": "decode",
                                "tokens": list(tokens), "cases": {}}
                run_decode(cases, grid, clock, clock.until(clock.end, share), warmer, picks,
                           shapes[name]["cases"], dump)
            case = cases = None  # free the shape's tensors before the next one's
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        warmer.close()
        table.restore()
    results["summary"] = report(table, shapes, time.perf_counter() - clock.start)
    dump()
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
