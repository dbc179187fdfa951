"""Benchmark vocabulary-parallel ``lmfuse.cross_entropy`` against Megatron-Core on 2 or 4 GPUs.

Run it as ``python3 bench/cross_entropy_tp.py --world 2 [--json PATH]``: it spawns
``--world`` ranks itself (``torch.multiprocessing``, one GPU a rank, NCCL, rendezvous on
127.0.0.1 at a free port; no torchrun). ``--cpu`` runs the same on gloo ranks with tiny
shapes and lmfuse's kernels in Triton's interpreter, to smoke-test the script on a machine
without GPUs (its figures are not GPU performance).

Every rank holds bf16 logits ``[N, V / world]`` (its columns of a ``V``-class vocabulary)
and the same global targets ``[N]``, about 5% of them ignored (-100), for N = 8192 and
V = 128256 and 262144 (``--cpu``: N = 64, V = 1000 x world). Each implementation runs
forward only (no grad) and forward+backward (``torch.autograd.grad(loss, logits)``):

* ``lmfuse``: ``lmfuse.cross_entropy(logits, target, tp_group=group, reduction="mean")``;
* ``lmfuse.megatron``: lmfuse's drop-in ``lmfuse.megatron.vocab_parallel_cross_entropy``
  on ``[s, b, v] = [N, 1, V / world]``, per-token loss then averaged;
* ``megatron-core fused``: ``megatron.core.fusions.fused_cross_entropy.
  fused_vocab_parallel_cross_entropy(logits [N, 1, V / world], target [N, 1], group)``;
* ``megatron-core``: ``megatron.core.tensor_parallel.cross_entropy.
  vocab_parallel_cross_entropy(logits, target, label_smoothing=0.0, tp_group=group)``.

Megatron has no ignore_index, so every per-token loss is averaged over the valid tokens
(``(loss * valid).sum() / valid.sum()``), as Megatron's loss function does; that is
``lmfuse``'s ``reduction="mean"``. Both Megatron-Core functions copy bf16 logits to
float32 first, so they leave the inputs intact and need no restore between calls.

Timing is per rank and the same on every rank, in lockstep (a collective waits for the
slowest rank): a fixed number of warm-up calls, a ``torch.distributed.barrier()``, then a
fixed number of timed calls (a time budget, as ``triton.testing.do_bench`` uses, could
give the ranks different counts and deadlock them), each between two CUDA events after a
256 MiB write that flushes L2, as ``do_bench`` does. Reported: rank 0's median ms (the
JSON also holds every rank's), TB/s over the rank's minimal bytes (forward: one read of
its logits; forward+backward: that plus one write of their gradient), the time as a
multiple of lmfuse's (> 1: lmfuse is faster), the peak memory allocated beyond the
inputs, and the ``torch.distributed`` collectives one call issues (counted by wrapping
them, with ``tests/distributed/spawn.py``'s ``count_collectives``): lmfuse one
all-gather of ``[3, N]`` float32 stats, Megatron-Core all-reduces. The collectives alone,
with no compute, are timed too. Each row's loss is checked against lmfuse's once (a
relative difference over 1e-4 is noted), and, forward+backward, the gradient of its first
rows (a relative error over 1e-2 is noted). A peer that is not installed or fails is a
row with a note; the ranks agree on each row's success, so a failure on one rank is a
failure on all. (A rank that fails inside a call, between collectives, leaves the others
waiting in one: ``--timeout`` then kills the ranks.)

NVLink multicast stays off (``NCCL_NVLS_ENABLE=0`` and its PyTorch and NVSHMEM
counterparts, set below before torch is imported, and so inherited by the ranks): on the
shared multi-GPU hosts a program using it can put the host's GPUs out of service.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import socket
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

# Before torch is imported, here and in every spawned rank (which re-imports this file).
os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                   "NVSHMEM_DISABLE_NVLS": "1"})

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

BENCH = Path(__file__).resolve().parent
from lmfuse.bench.common import (PeerUnavailable, Result, copy_tbps,  # noqa: E402
                                 dist_version, environment, peak_extra_mib, unavailable)

IGNORE = -100
GRAD_ROWS = 256  # rows of each gradient compared with lmfuse's

# loss_fn(logits [N, V_local], target [N], group) -> scalar float32 loss
LossFn = Callable[[torch.Tensor, torch.Tensor, dist.ProcessGroup], torch.Tensor]


# --- implementations -----------------------------------------------------------------------


def _valid_mean(per_token: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean of per-token losses over the tokens that are not ignored (Megatron's loss)."""
    valid = target != IGNORE
    return (per_token.reshape(-1) * valid).sum() / valid.sum().clamp(min=1)


def load_impls() -> dict[str, tuple[LossFn, str]]:
    """Implementation name -> (loss function, version or why it is unavailable)."""
    import lmfuse
    import lmfuse.megatron

    def ours(x, t, group):
        return lmfuse.cross_entropy(x, t, tp_group=group, reduction="mean")

    def ours_megatron(x, t, group):
        n, v = x.shape
        per_token = lmfuse.megatron.vocab_parallel_cross_entropy(x.view(n, 1, v), t.view(n, 1),
                                                                 tp_group=group)
        return _valid_mean(per_token, t)

    impls = {"lmfuse": (ours, lmfuse.__version__),
             "lmfuse.megatron": (ours_megatron, lmfuse.__version__)}

    try:
        # Without Transformer Engine or Apex its import warns, once per rank: not our news.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.fusions.fused_cross_entropy import (
                fused_vocab_parallel_cross_entropy,
            )

        def fused(x, t, group):
            n, v = x.shape
            return _valid_mean(fused_vocab_parallel_cross_entropy(x.view(n, 1, v), t.view(n, 1),
                                                                  group), t)

        impls["megatron-core fused"] = (fused, dist_version("megatron-core"))
    except Exception as exc:  # not installed, or its import needs what is missing here
        impls["megatron-core fused"] = (unavailable(exc), f"unavailable ({type(exc).__name__})")

    try:
        from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

        def unfused(x, t, group):
            n, v = x.shape
            per_token = vocab_parallel_cross_entropy(x.view(n, 1, v), t.view(n, 1),
                                                     label_smoothing=0.0, tp_group=group)
            return _valid_mean(per_token, t)

        impls["megatron-core"] = (unfused, dist_version("megatron-core"))
    except Exception as exc:
        impls["megatron-core"] = (unavailable(exc), f"unavailable ({type(exc).__name__})")
    return impls


def _collective_counter() -> Callable[[], contextlib.AbstractContextManager]:
    """``tests/distributed/spawn.py``'s ``count_collectives`` (one definition of what a
    collective is), or a counter that counts nothing where the tests are not here."""
    path = BENCH.parent / "tests" / "distributed" / "spawn.py"
    try:
        spec = importlib.util.spec_from_file_location("lmfuse_tests_spawn", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.count_collectives
    except Exception:  # no source checkout's tests: collectives are not counted
        @contextlib.contextmanager
        def nothing():
            yield None

        return nothing


# --- timing in lockstep ---------------------------------------------------------------------


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, rep: int
            ) -> float:
    """Median ms of ``rep`` calls of ``fn`` after ``warmup`` calls and a barrier; every rank
    makes the same number of calls. On CUDA each call lies between two events, after a
    write of 256 MiB that flushes L2 (as ``triton.testing.do_bench`` does)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(rep)]
        torch.cuda.synchronize(device)
        dist.barrier()
        for start, end in events:
            flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        times = sorted(start.elapsed_time(end) for start, end in events)
    else:
        dist.barrier()
        times = []
        for _ in range(rep):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
    return times[len(times) // 2]


def _comm_device(device: torch.device) -> torch.device:
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


def all_agree(ok: bool, device: torch.device) -> bool:
    """True when ``ok`` on every rank."""
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=_comm_device(device))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def every_rank(value: float | None, device: torch.device) -> list[float | None]:
    """``value`` of each rank, in rank order (None where a rank has none)."""
    x = torch.tensor([math.nan if value is None else value], dtype=torch.float64,
                     device=_comm_device(device))
    out = torch.empty(dist.get_world_size(), dtype=torch.float64, device=x.device)
    # torch >= 2.12 names the single-tensor all-gather all_gather_single.
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x)
    return [None if math.isnan(v) else v for v in out.tolist()]


# --- cases ---------------------------------------------------------------------------------


class Inputs:
    """This rank's logits ``[n, V / world]`` (bf16, requires grad) and the global targets
    ``[n]`` (the same on every rank, about 5% ignored)."""

    def __init__(self, n: int, V: int, rank: int, world: int, device: torch.device):
        self.n, self.V, self.V_local = n, V, V // world
        g = torch.Generator().manual_seed(0)
        target = torch.randint(0, V, (n,), generator=g)
        target[torch.rand(n, generator=g) < 0.05] = IGNORE
        self.target = target.to(device)
        torch.manual_seed(1 + rank)
        self.logits = torch.randn(n, self.V_local, dtype=torch.bfloat16,
                                  device=device).requires_grad_(True)


def _summary(calls: list[str] | None) -> str:
    if calls is None:
        return "(not counted)"
    if not calls:
        return "none"
    return ", ".join(f"{name} x{k}" for name, k in Counter(calls).items())


def _one_line(exc: Exception) -> str:
    """The exception as a one-line note (whatever its text)."""
    why = " ".join(str(exc).split())
    if isinstance(exc, PeerUnavailable):
        return f"unavailable: {why}"[:160]
    return f"failed: {type(exc).__name__}: {why}"[:160]


def run_case(name: str, nbytes: int | None, inputs: tuple[torch.Tensor, ...],
             target: torch.Tensor, backward: bool, impls: dict[str, tuple[Callable, str]],
             device: torch.device, warmup: int, rep: int, counter, extras: dict
             ) -> list[tuple[Result, dict]]:
    """Every implementation ``loss_fn(*inputs, target, group)`` on one case, in the same
    order on every rank: one counted and checked call, one for peak memory, then the timed
    calls (forward+backward: ``torch.autograd.grad(loss, inputs)``). TB/s counts
    ``nbytes``; ``extras`` go into every row's JSON. Rows as (Result, extras)."""
    group = dist.group.WORLD
    xs = inputs if backward else tuple(x.detach() for x in inputs)
    world = dist.get_world_size()
    reference: dict[str, object] = {}
    rows = []
    for impl, (loss_fn, _) in impls.items():
        def call(loss_fn=loss_fn):
            if backward:
                loss = loss_fn(*xs, target, group)
                return loss, torch.autograd.grad(loss, xs)[0]
            with torch.no_grad():
                return loss_fn(*xs, target, group), None

        ms = mem = None
        notes, calls = [], None
        ok = True
        try:
            with counter() as calls:
                loss, grad = call()
            loss_value = float(loss.detach())
            head = None if grad is None else grad[:GRAD_ROWS].float()
            del loss, grad
            if impl == "lmfuse":
                reference.update(loss=loss_value, grad=head)
            elif "loss" in reference:
                rel = abs(loss_value - reference["loss"]) / max(abs(reference["loss"]), 1e-30)
                if rel > 1e-4:
                    notes.append(f"loss rel. diff {rel:.0e}")
                if head is not None and reference.get("grad") is not None:
                    ref = reference["grad"]
                    err = float((head - ref).norm() / ref.norm().clamp(min=1e-30))
                    if err > 1e-2:
                        notes.append(f"grad rel. err {err:.0e}")
        except Exception as exc:  # a peer that cannot run the case is a row, not a crash
            ok, notes = False, [_one_line(exc)]
        # A call that failed on one rank only would leave the others in a collective that
        # never completes: agree before going on.
        if all_agree(ok, device) and ok:
            try:
                mem = peak_extra_mib(call, device)
                ms = time_ms(call, device, warmup, rep)
            except Exception as exc:
                ok, ms, mem, notes = False, None, None, [_one_line(exc)]
            if not all_agree(ok, device):
                ms = mem = None
        elif ok:
            notes = ["failed on another rank"]
        if device.type == "cuda":
            torch.cuda.empty_cache()
        per_rank = every_rank(ms, device)
        tbps = nbytes / ms / 1e9 if (ms and nbytes) else None
        row = {"collectives": _summary(calls) if ok else "-",
               "collectives_count": len(calls) if (ok and calls is not None) else None,
               "ms_per_rank": per_rank, "world_size": world, **extras}
        rows.append((Result(name, impl, ms, tbps, None, mem, "; ".join(notes)), row))
    base = next((r.ms for r, _ in rows if r.impl == "lmfuse"), None)
    for r, _ in rows:
        r.ratio = r.ms / base if (r.ms and base) else None
    return rows


def time_collectives_alone(n: int, device: torch.device, warmup: int, rep: int
                           ) -> dict[str, float]:
    """Each implementation's collectives with no compute: lmfuse's all-gather of ``[3, n]``
    float32 stats; Megatron-Core's all-reduces (max of ``[n]``, then sums of ``[2n]``
    fused or ``[n]`` twice unfused)."""
    from lmfuse.distributed.collectives import all_gather_stacked

    group = dist.group.WORLD
    stats = torch.randn(3, n, device=device)
    one, two = torch.randn(n, device=device), torch.randn(2 * n, device=device)

    def fused():
        dist.all_reduce(one, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(two, group=group)

    def unfused():
        dist.all_reduce(one, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(one, group=group)
        dist.all_reduce(one, group=group)

    return {
        f"lmfuse: all-gather [3, {n}] f32": time_ms(lambda: all_gather_stacked(stats, group),
                                                    device, warmup, rep),
        f"megatron-core fused: all-reduce [{n}] + [{2 * n}] f32": time_ms(fused, device,
                                                                         warmup, rep),
        f"megatron-core: all-reduce [{n}] x3 f32": time_ms(unfused, device, warmup, rep),
    }


# --- output --------------------------------------------------------------------------------


def _fmt(v: float | None, spec: str) -> str:
    """``v`` formatted by ``spec``, or a dash as wide."""
    return format(v, spec) if v is not None else format("-", f">{spec.split('.')[0]}")


def print_rows(rows: list[tuple[Result, dict]], header: bool) -> None:
    if header:
        print(f"{'case':<30} {'impl':<20} {'ms':>9} {'TB/s':>6} {'x lmfuse':>8} "
              f"{'peak MiB':>9}  {'collectives / call':<36} note")
    for r, extra in rows:
        print(f"{r.case:<30} {r.impl:<20} {_fmt(r.ms, '9.4f')} {_fmt(r.tbps, '6.2f')} "
              f"{_fmt(r.ratio, '8.2f')} {_fmt(r.peak_extra_mib, '9.1f')}  "
              f"{extra['collectives']:<36} {r.note}", flush=True)


def write_json(path: str, env: dict, copy: dict, comm: dict,
               rows: list[tuple[Result, dict]], comm_key: str = "collectives_alone_ms"
               ) -> None:
    payload = {"environment": env, "copy": copy, comm_key: comm,
               "results": [{**asdict(r), **extra} for r, extra in rows]}
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    print(f"wrote {path}")


# --- the ranks -----------------------------------------------------------------------------


def bench_rank(rank: int, world: int, device: torch.device, opts: dict) -> None:
    n, vocabs = (64, (1000 * world,)) if opts["cpu"] else (8192, (128256, 262144))
    warmup, rep = (1, 3) if opts["cpu"] else (opts["warmup"], opts["rep"])
    impls = load_impls()
    counter = _collective_counter()
    env: dict = {}
    copy: dict = {}
    if rank == 0:
        env = environment(device)
        env.update(world_size=world, backend=dist.get_backend())
        env.update({k: v for k, (_, v) in impls.items() if not k.startswith("lmfuse")})
        print(f"# {env['device']} x{world} ({env['backend']}) | torch {env['torch']} | triton "
              f"{env['triton']} | lmfuse {env['lmfuse']} | {env['date']}")
        print("# peers: " + ", ".join(f"{k} {v}" for k, (_, v) in impls.items()
                                      if not k.startswith("lmfuse")))
        copy_bytes = n * (max(vocabs) // world) * 2
        copy_ms, copy_bw = copy_tbps(copy_bytes, device)
        copy = {"bytes": copy_bytes, "ms": copy_ms, "tbps": copy_bw}
        print(f"# device-to-device copy of {copy_bytes / 2**20:.1f} MiB on rank 0: "
              f"{copy_ms:.4f} ms, {copy_bw:.2f} TB/s (read + write)")
        print(f"# per rank: median of {rep} calls after {warmup}; TB/s over the rank's minimal "
              "bytes (fwd: read logits; fwd+bwd: + write gradient); x lmfuse = ms / lmfuse ms "
              "(> 1: lmfuse is faster); peak MiB beyond the inputs (lmfuse's target: the "
              "gradient, 0 forward only)", flush=True)
    comm = time_collectives_alone(n, device, warmup, rep)
    if rank == 0:
        print("# collectives alone: " + "; ".join(f"{k}: {v:.4f} ms" for k, v in comm.items()),
              flush=True)
    results: list[tuple[Result, dict]] = []
    for V in vocabs:
        if V % world:
            raise ValueError(f"V = {V} does not split evenly over {world} ranks")
        data = Inputs(n, V, rank, world, device)
        for backward in (False, True):
            mode = "fwd+bwd" if backward else "fwd"
            rows = run_case(f"{mode} [{n}, {data.V_local}] x{world} bf16",
                            n * data.V_local * 2 * (2 if backward else 1), (data.logits,),
                            data.target, backward, impls, device, warmup, rep, counter,
                            {"V": V})
            if rank == 0:
                print_rows(rows, header=not results)
            results += rows
        del data
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0 and opts["json"]:
        write_json(opts["json"], env, copy, comm, results)


def _rank_main(rank: int, bench: Callable, world: int, port: int, opts: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if opts["cpu"]:
        torch.set_num_threads(1)  # several ranks share a few cores
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    try:
        bench(rank, world, device, opts)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None, bench: Callable = bench_rank,
         prog: str = "bench/cross_entropy_tp.py", doc: str | None = __doc__,
         rep: int = 100) -> int:
    """Parse the options and run ``bench(rank, world, device, opts)`` on every rank."""
    p = argparse.ArgumentParser(prog=prog, description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="ranks (GPUs), 2 or 4 (default 2)")
    p.add_argument("--cpu", action="store_true",
                   help="gloo ranks on the CPU, tiny shapes, Triton's interpreter (a smoke test)")
    p.add_argument("--json", help="write the results as JSON here (from rank 0)")
    p.add_argument("--warmup", type=int, default=10, help="untimed calls per row (GPU)")
    p.add_argument("--rep", type=int, default=rep, help="timed calls per row (GPU)")
    p.add_argument("--timeout", type=float, default=480.0,
                   help="seconds before hung ranks are killed (default 480)")
    args = p.parse_args(argv)
    if args.world < 2:
        p.error("--world must be at least 2")
    if args.cpu:
        # Triton reads it when lmfuse defines its kernels; the ranks import lmfuse later.
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["OMP_NUM_THREADS"] = "1"
    elif torch.cuda.device_count() < args.world:
        p.error(f"--world {args.world} needs {args.world} GPUs, found "
                f"{torch.cuda.device_count()} (use --cpu for the gloo smoke test)")
    opts = {"cpu": args.cpu, "json": args.json, "warmup": args.warmup, "rep": args.rep}
    ctx = mp.start_processes(_rank_main, args=(bench, args.world, _free_port(), opts),
                             nprocs=args.world, join=False, start_method="spawn")
    deadline = time.monotonic() + args.timeout
    while not ctx.join(timeout=1.0):  # raises, after stopping the others, if a rank fails
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
            print(f"ranks still running after {args.timeout:.0f} s: killed", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
