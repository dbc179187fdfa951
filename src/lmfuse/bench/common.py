"""Shared benchmark harness: timing, the copy-bandwidth ceiling, memory, tables, JSON, plots.

Each family's harness (``lmfuse/bench/<family>.py``, run by ``lmfuse bench <family>`` or
``python -m lmfuse.bench.<family>``) builds a list of cases; every case times
lmfuse and its peers in the same process, so the ratios compare like with like.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import platform
import sys
import time
from pathlib import Path
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from lmfuse._dispatch import interpreter_active
from lmfuse._cli_args import (ArgumentParser, missing_package, output_file, plot_file,
                              plot_format_error)


@dataclass
class Result:
    case: str
    impl: str
    ms: float | None  # median; None when the implementation could not run the case
    tbps: float | None = None  # achieved TB/s over the case's minimal bytes
    ratio: float | None = None  # impl time / lmfuse time (> 1: lmfuse is faster)
    peak_extra_mib: float | None = None
    note: str = ""


@dataclass
class Case:
    """One benchmark case: a name, the minimal bytes it must move, and impl -> thunk.

    ``overhead`` maps an impl to a thunk that its own thunk runs first and that is timed
    alone and subtracted: the copy restoring an input that an in-place op overwrites.
    """

    name: str
    nbytes: int
    impls: dict[str, Callable[[], object]] = field(default_factory=dict)
    # A callable note is called after the run.
    notes: dict[str, str | Callable[[], str]] = field(default_factory=dict)
    overhead: dict[str, Callable[[], object]] = field(default_factory=dict)
    # Calls each thunk makes (a CUDA graph of several back to back): its time is divided by
    # them (run_cases refuses overhead thunks with more than one).
    calls: int = 1


def compile_per_shape(fn: Callable, limit: int = 256, fullgraph: bool = True) -> Callable:
    """``torch.compile(fn, dynamic=False)`` for a harness's torch.compile row. Every case is a
    new specialisation of the same function: dynamo is let keep ``limit`` of them rather
    than fall back to eager after its default of 8."""
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, limit)
    return torch.compile(fn, fullgraph=fullgraph, dynamic=False)


def timed_call(fn: Callable[..., object], args: tuple, backward: bool, wrt=(), grad=None
               ) -> Callable[[], object]:
    """The thunk a case times: ``fn(*args)`` under ``torch.no_grad()``, or with ``backward``
    the forward and ``torch.autograd.grad`` of its output w.r.t. ``wrt`` under ``grad``."""
    if backward:
        return lambda: torch.autograd.grad(fn(*args), wrt, grad)

    def forward():
        with torch.no_grad():
            return fn(*args)

    return forward


def bench_ms(fn: Callable[[], object], device: torch.device, warmup: int = 50,
             rep: int = 200) -> float:
    """Median milliseconds of ``fn`` (CUDA events via triton's do_bench on GPU, which runs
    it for about ``warmup`` then ``rep`` milliseconds; on the CPU one call then the median
    of five, or of one in Triton's interpreter, whose figures are a smoke run's)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    fn()
    times = []
    for _ in range(1 if interpreter_active() else 5):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def peak_extra_mib(fn: Callable[[], object], device: torch.device) -> float | None:
    """Peak memory allocated during ``fn`` beyond what was allocated before it, in MiB."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize(device)
    del out
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def wall_ms(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """Wall-clock ms of ``fn()`` between device synchronisations, and its result."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e3, out


class Memory:
    """The most memory allocated since ``start()`` beyond what was allocated then, in MiB
    (CUDA; None elsewhere). ``start()`` also frees what is garbage."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.base = device, 0

    def start(self) -> None:
        free(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)

    def peak_mib(self) -> float | None:
        if self.device.type != "cuda":
            return None
        return (torch.cuda.max_memory_allocated(self.device) - self.base) / 2**20


def free(device: torch.device) -> None:
    """Collect garbage and give the allocator's cached blocks back (before a peer sizes its
    cache from the free memory)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def copy_tbps(nbytes: int, device: torch.device) -> tuple[float, float]:
    """A device-to-device copy of ``nbytes``: (ms, TB/s counting bytes read and written)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device)
    src = dst = None  # free them before the caller's own tensors are made
    return ms, 2 * nbytes / ms / 1e9


def run_cases(cases: list[Case], device: torch.device, reference_impl: str = "lmfuse"
              ) -> list[Result]:
    results = []
    for case in cases:
        if case.calls != 1 and case.overhead:
            raise ValueError(f"{case.name}: overhead thunks are timed a call at a time; the "
                             f"case's thunks make {case.calls}")
        rows = []
        for impl, fn in case.impls.items():
            try:
                ms = bench_ms(fn, device) / case.calls
                # (a graph's replay allocates nothing: its memory is not measured)
                mem = None if getattr(fn, "graph_replay", False) else peak_extra_mib(fn, device)
                note = case.notes.get(impl, "")
                note = note() if callable(note) else note  # a note known after the run
                if impl in case.overhead:
                    extra = bench_ms(case.overhead[impl], device)
                    note = f"{note}; {extra:.3f} ms overhead subtracted".lstrip("; ")
                    ms = ms - extra if ms > extra else None  # None: lost in the noise
            except Exception as exc:  # a peer that cannot run a case is reported, not fatal
                ms, mem, note = None, None, failure(exc)
            tbps = case.nbytes / ms / 1e9 if ms else None
            rows.append(Result(case.name, impl, ms, tbps, None, mem, note))
            if device.type == "cuda":
                torch.cuda.empty_cache()
        base = next((r.ms for r in rows if r.impl == reference_impl), None)
        for r in rows:
            r.ratio = r.ms / base if (r.ms and base) else None
        results.extend(rows)
        print_table(rows, header=case is cases[0])
    return results


def failure(exc: BaseException, limit: int = 160) -> str:
    """A row's note for ``exc``: its type and text on one line, at most ``limit`` characters."""
    why = " ".join(str(exc).split())  # one line, whatever the exception's text
    return f"failed: {type(exc).__name__}: {why}"[:limit]


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def cell(v: float | None, spec: str) -> str:
    """``v`` in ``spec``; None as a ``-`` as wide as ``spec`` makes a number."""
    return "-".rjust(len(format(0.0, spec))) if v is None else format(v, spec)


def print_table(rows: list[Result], header: bool = True) -> None:
    if header:
        print(f"{'case':<44} {'impl':<20} {'ms':>9} {'TB/s':>6} {'x lmfuse':>8} "
              f"{'peak MiB':>9}  note")
    for r in rows:
        print(f"{r.case:<44} {r.impl:<20} {_fmt(r.ms, '9.4f')} {_fmt(r.tbps, '6.2f')} "
              f"{_fmt(r.ratio, '8.2f')} {_fmt(r.peak_extra_mib, '9.1f')}  {r.note}", flush=True)


def _command() -> str:
    """The command line that ran this benchmark, as the user typed it (``sys.orig_argv``:
    the interpreter's own arguments, ``-m module`` or ``-c code``, included)."""
    prog = Path(sys.argv[0]).name if sys.argv else ""
    if prog == "lmfuse":
        return " ".join(["lmfuse"] + sys.argv[1:])
    argv = getattr(sys, "orig_argv", None)
    if argv:
        return " ".join(["python"] + argv[1:])
    return " ".join(["python"] + sys.argv)


def environment(device: torch.device) -> dict:
    env = {
        "date": _dt.date.today().isoformat(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "command": _command(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    import lmfuse

    env["lmfuse"] = lmfuse.__version__
    return env


def write_json(path: str, env: dict, copy: dict, results: list[Result]) -> None:
    payload = {"environment": env, "copy": copy, "results": [asdict(r) for r in results]}
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    print(f"wrote {path}")


def plot(path: str, results: list[Result], title: str, *,
         value: Callable[[Result], float | None] = lambda r: r.tbps,
         ylabel: str = "achieved TB/s (minimal bytes)", impls: list[str] | None = None,
         case_width: float = 1.6, log: bool = False) -> None:
    """Bars of ``value`` per case and implementation (default: every implementation's
    achieved TB/s; ``log``: on a log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r.case for r in results))
    impls = impls or list(dict.fromkeys(r.impl for r in results))
    fig, ax = plt.subplots(figsize=(max(8, case_width * len(cases)), 5))
    width = 0.8 / max(len(impls), 1)
    for i, impl in enumerate(impls):
        vals = [next((value(r) or 0 for r in results if r.case == c and r.impl == impl), 0)
                for c in cases]
        ax.bar([k + i * width for k in range(len(cases))], vals, width, label=impl)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(cases))])
    ax.set_xticklabels(cases, rotation=30 if case_width > 1 else 60, ha="right",
                       fontsize=7 if case_width > 1 else 6)
    ax.set(ylabel=ylabel, title=title, yscale="log" if log else "linear")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = plot_file(path)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


class PeerUnavailable(RuntimeError):
    """A peer library that cannot run here (not installed, or its import fails)."""


def unavailable(why: Exception | str) -> Callable[..., object]:
    """A stand-in for a peer or row that cannot run here: every call raises (before any
    collective, on every rank alike), and the result row notes why (the exception's type and
    text, or the sentence ``why``)."""
    message = why if isinstance(why, str) else f"{type(why).__name__}: {why}"

    def fail(*args, **kwargs):
        raise PeerUnavailable(message)

    return fail


def print_peers(env: dict, versions: dict[str, str]) -> None:
    """The peers' versions into ``env`` and onto the ``# peers:`` line."""
    env.update(versions)
    print("# peers: " + ", ".join(f"{name} {v}" for name, v in versions.items()))


def dist_version(dist: str) -> str:
    """The installed version of distribution ``dist``, or "(version unknown)"."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "(version unknown)"


def parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """A harness's option parser: ``lmfuse``'s one-line errors (exit status 2)."""
    return ArgumentParser(prog=prog, description=doc,
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def check_plot(p: argparse.ArgumentParser, path: str | None) -> None:
    """``--plot`` needs matplotlib and a format it writes: said before any timing, not
    after it."""
    missing = path and missing_package("matplotlib", "--plot",
                                       "'lmfuse[bench]' (or matplotlib)")
    if missing:
        p.error(missing)
    bad = path and plot_format_error(path)
    if bad:
        p.error(f"argument --plot: {bad}")


def start(prog: str, doc: str, argv: list[str] | None, plot_what: str = "achieved TB/s",
          options: Callable[[argparse.ArgumentParser], None] | None = None
          ) -> tuple[argparse.Namespace, torch.device, bool, dict]:
    """The start every benchmark shares: ``--json``, ``--plot``, ``--quick`` parsed (and what
    ``options`` adds to the parser); the best device (small shapes on CPU, said so); torch
    seeded; the environment header printed. Returns ``(args, device, quick, environment)``."""
    p = parser(prog, doc)
    if options is not None:
        options(p)
    p.add_argument("--json", type=output_file, help="write the results as JSON here")
    p.add_argument("--plot", type=output_file,
                   help=f"write a PNG bar chart of {plot_what} here (needs matplotlib)")
    p.add_argument("--quick", action="store_true", help="small shapes (the default on CPU)")
    args = p.parse_args(argv)
    check_plot(p, args.plot)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quick = args.quick or device.type != "cuda"
    if device.type != "cuda":
        print("no CUDA device: running small CPU shapes in float32; lmfuse runs its reference "
              "path or Triton's interpreter (figures are not GPU performance)")
    torch.manual_seed(0)
    env = environment(device)
    print(f"# {env['device']} | torch {env['torch']} | triton {env['triton']} | {env['date']}")
    return args, device, quick, env


def measure_copy(nbytes: int, device: torch.device) -> dict:
    """The device-to-device copy of ``nbytes`` a bandwidth-bound benchmark compares with,
    printed; ``{"bytes", "ms", "tbps"}`` for :func:`finish`."""
    ms, tbps = copy_tbps(nbytes, device)
    print(f"# device-to-device copy of {nbytes / 2**20:.1f} MiB: {ms:.4f} ms, "
          f"{tbps:.2f} TB/s (read + write)")
    return {"bytes": nbytes, "ms": ms, "tbps": tbps}


def finish(args: argparse.Namespace, env: dict, copy: dict, results: list[Result],
           title: str, **plot_options) -> int:
    """Write the ``--json`` and ``--plot`` outputs asked for (``plot_options``: what
    :func:`plot` draws); the exit code."""
    if args.json:
        write_json(args.json, env, copy, results)
    if args.plot:
        plot(args.plot, results, title, **plot_options)
    return 0


def dtype_label(dtype: torch.dtype) -> str:
    """A case name's dtype: bf16, fp16 or fp32."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def copy_case(name: str, nbytes: int, impls: dict, notes: dict, device: torch.device) -> Case:
    """The case, with a row copying its minimal bytes (:func:`run_against_copy`'s floor)."""
    case = Case(name, nbytes, impls, notes)
    add_copy_rows([case], device, note="device-to-device copy of the minimal bytes")
    return case


def add_copy_rows(cases: list[Case], device: torch.device, impl: str = "copy",
                  note: str = "device-to-device, same bytes (half read, half written)") -> None:
    """A row ``impl`` in each case copying its bytes (half read, half written), from buffers
    shared by all of them (sized for the largest)."""
    if not cases:
        return
    elems = max(case.nbytes for case in cases) // 4  # bf16 elements: half of the bytes
    src = torch.empty(elems, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    for case in cases:
        n = case.nbytes // 4
        case.impls[impl] = lambda n=n: dst[:n].copy_(src[:n])
        case.notes[impl] = note


def report_against_copy(results: list[Result]) -> None:
    """Prints lmfuse's TB/s as a share of its case's ``copy`` row (see :func:`add_copy_rows`),
    case by case."""
    print("\n# lmfuse against the copy of the same bytes (x copy = lmfuse TB/s / copy TB/s)")
    for ours in (r for r in results if r.impl == "lmfuse"):
        copy = next((r for r in results if r.case == ours.case and r.impl == "copy"), None)
        if ours.tbps and copy is not None and copy.tbps:
            print(f"{ours.case:<44} {ours.tbps:6.2f} TB/s  {ours.tbps / copy.tbps:5.2f}x copy")
        else:
            print(f"{ours.case:<44} not measured")


class LossCheck:
    """Notes, on each row's first call, how far its loss is from lmfuse's (which runs first)
    when over 1e-4; with ``reference`` (the loss lmfuse should give, computed apart),
    lmfuse's distance from it, always. ``run_cases`` reads a case's notes after timing it,
    so the note is printed."""

    def __init__(self, notes: dict[str, str], reference: Callable[[], float] | None = None):
        self.notes, self.reference = notes, reference
        self.lmfuse: float | None = None
        self.seen: set[str] = set()

    def __call__(self, impl: str, loss: torch.Tensor) -> None:
        if impl in self.seen:
            return
        self.seen.add(impl)
        value = float(loss.detach())
        if impl == "lmfuse":
            self.lmfuse = value
            if self.reference is not None:
                self._note(impl, f"loss vs torch: rel. diff {_rel(value, self.reference()):.0e}")
        elif self.lmfuse is not None and (rel := _rel(value, self.lmfuse)) > 1e-4:
            self._note(impl, f"loss rel. diff {rel:.0e}")

    def _note(self, impl: str, text: str) -> None:
        self.notes[impl] = "; ".join(p for p in (self.notes.get(impl, ""), text) if p)


def _rel(value: float, reference: float) -> float:
    return abs(value - reference) / max(abs(reference), 1e-30)


def relative_differences(impls: dict[str, Callable[[], object]], dtype: torch.dtype,
                         reference: str = "lmfuse", notes: dict[str, str] | None = None
                         ) -> dict[str, str]:
    """Runs each impl once and notes ``||a - b|| / ||b||`` against ``reference``'s result
    (over several tensors, the largest); flags one above the dtype's tolerance. An impl
    that fails here gets no note: its timing fails the same way and notes why. With
    ``notes``, each note is appended to the impl's there (after a ``; ``), and ``notes`` is
    returned."""
    tol = 1e-5 if dtype == torch.float32 else 1e-2

    def as_list(result) -> list[torch.Tensor]:
        return list(result) if isinstance(result, (tuple, list)) else [result]

    notes = {} if notes is None else notes
    try:
        expected = as_list(impls[reference]())
    except Exception:
        return notes
    for impl, fn in impls.items():
        if impl == reference:
            continue
        try:
            got = as_list(fn())
        except Exception:
            continue
        rel = max(float(torch.linalg.vector_norm(a.float() - b.float()) /
                        torch.linalg.vector_norm(b.float()).clamp(min=1e-30))
                  for a, b in zip(got, expected, strict=True))
        diff = f"rel. diff {rel:.1e}" + (f" > {tol:.0e}, CHECK" if rel > tol else "")
        notes[impl] = "; ".join(p for p in (notes.get(impl, ""), diff) if p)
        del got
    return notes


def as_graph(fn: Callable[[], object], calls: int = 1) -> Callable[[], object]:
    """``fn`` captured ``calls`` times in a CUDA graph (after two warm-up calls on a side
    stream), returned as the graph's replay: what a server that captures its decode step
    pays per call (``calls`` of them, back to back)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()

    def replay(fn=fn):  # keeps fn, and the tensors it holds that the graph reads, alive
        graph.replay()

    # (A replay allocates nothing, its buffers live in the graph's pool: no peak memory.)
    replay.graph_replay = True
    return replay


def capture_graphs(cases: list[Case], skip: tuple[str, ...] = ()) -> None:
    """Each row's call (but those named in ``skip``) replaced by the replay of a CUDA graph
    holding it: the device time, without the host's; a call that cannot be captured (a peer
    that cannot run, a host synchronisation inside) keeps a row saying why."""
    for case in cases:
        for impl, fn in list(case.impls.items()):
            if impl in skip:
                continue
            try:
                case.impls[impl] = as_graph(fn)
            except PeerUnavailable:
                pass
            except Exception as exc:
                torch.cuda.synchronize()
                case.impls[impl] = unavailable(f"CUDA graph capture failed: "
                                               f"{type(exc).__name__}: {exc}")


def graphs_option(p: argparse.ArgumentParser) -> None:
    """``--graphs``: time CUDA graph replays of every row (the device time; eager calls of a
    small op on a slow host measure the host instead)."""
    p.add_argument("--graphs", action="store_true",
                   help="time CUDA graph replays (device time, no host time; GPU only)")


def time_as_asked(args: argparse.Namespace, device: torch.device, env: dict,
                  cases: list[Case]) -> None:
    """What ``--graphs`` (:func:`graphs_option`) asks: on CUDA, every row captured
    (:func:`capture_graphs`); ``env["timing"]`` says which way the rows were timed."""
    graphs = getattr(args, "graphs", False) and device.type == "cuda"
    env["timing"] = ("CUDA graph replays (device time, no host time; the copy rows eager: "
                     "one launch, the floor)" if graphs else
                     "eager calls (GPU time or host time, whichever is longer)")
    if graphs:
        # (a copy captured in a graph ran at 2.7 TB/s against 4.1 eager on the H200)
        capture_graphs(cases, skip=("copy",))


def run_against_copy(args: argparse.Namespace, device: torch.device, env: dict,
                     cases: list[Case], copy_bytes: int, legend: str, title: str) -> int:
    """What the harnesses with ``copy`` rows do once their cases are built: time them as
    ``--graphs`` asks, measure a copy of ``copy_bytes``, print ``legend``, run the cases,
    set lmfuse against its copy rows and write the results (``title`` on the plot)."""
    time_as_asked(args, device, env, cases)
    copy = measure_copy(copy_bytes, device)
    print(legend)
    results = run_cases(cases, device)
    report_against_copy(results)
    return finish(args, env, copy, results,
                  f"{title} on {env['device']} (copy: {copy['tbps']:.2f} TB/s)")
