"""lmfuse's own host overhead per eager call: the Python around the kernel launches, with
the launches themselves replaced by no-op stubs (issue 22, "host time")::

    python bench/probe_host_overhead.py                        # this checkout's src
    python bench/probe_host_overhead.py --tree old=/tmp/old/src --tree new=src
    python bench/probe_host_overhead.py --profile swiglu:fwd+bwd   # cProfile of one row
    python bench/probe_host_overhead.py --device cuda --real   # a GPU: real launches

(``git archive HEAD src | tar -x -C /tmp/old`` gives an old tree.) With ``--tree`` the
trees run as child processes (``PYTHONPATH=<tree>``), taking turns ``--alternations``
times, so drift on a noisy machine hits them alike; each row's figure is the median of
the children's medians.

What runs: every op on the inputs of ``lmfuse bench host`` (``[8, 64]`` activations and
norms, a vocabulary of 128; bfloat16), ``impl="auto"``, in its three modes as that
harness times them: ``fwd`` (``torch.no_grad()``, inputs not requiring grad), ``fwd
(grad)`` (the inputs require grad, the output dropped) and ``fwd+bwd`` (``.backward()`` of
a fixed upstream gradient, or of the scalar loss, then the inputs' ``.grad`` reset). On the
CPU, ``TRITON_INTERPRET=1`` is set so the ops take their Triton path; every family's lazy
kernel loader (``_kernels``, see ``lmfuse._launch.lazy_kernels``) is replaced by an
object whose ``kernel[grid](*args, **kw)`` returns at once, so a row's time is lmfuse's
Python, autograd's and the small torch ops' (output buffers, views, reductions): what a
GPU host pays beyond the launches themselves (whose own cost grows with the arguments
they pass: see the launches column). The value checks a CPU tensor always gets (targets
in range: a host sync, skipped on CUDA by default) are turned off, as on CUDA. Not seen
on the CPU: host work only CUDA tensors take (a CUDA device's properties, its name), and
the GEMMs of ``linear_cross_entropy``, which the CPU computes (the same in every tree).
``--real`` keeps the kernels (on the CPU: the interpreter, so the times say nothing then).

Per row it prints the median microseconds per call (``--rounds`` rounds of ``--calls``
calls, the modes of an op taking turns round by round, the garbage collector off; ``--stat
min`` for the fastest round, where other work shares the machine), and,
counted on one call: the aten ops dispatched (``TorchDispatchMode``), the Python function
calls (``sys.setprofile``: a deterministic proxy for host time on a noisy machine), and
the kernel launches with the number of arguments each passes (runtime + constant: a
constexpr, an option or a None; Triton's launcher specialises and passes each runtime
argument on every call), those of the last tree. ``--json PATH`` writes the rows.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from collections import Counter
from typing import Any, Callable

MODES = ("fwd", "fwd (grad)", "fwd+bwd")
OPS = ("rms_norm", "swiglu", "geglu", "cross_entropy", "linear_cross_entropy")
ROWS, HIDDEN, VOCAB = 8, 64, 128
IGNORE = -100


# --- the stubs -------------------------------------------------------------------------------


class StubKernel:
    """``kernel[grid](*args, **kw)`` that launches nothing; with ``log`` set, records the
    launch's kernel name and its argument counts (runtime, constexpr/options)."""

    log: list | None = None

    def __init__(self, name: str, real: Any) -> None:
        self.name = name
        self.constexprs = _constexpr_names(real)

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args, **kw):
        if StubKernel.log is not None:  # (None binds as a constant, as a constexpr does)
            runtime = sum(a is not None for a in args) + sum(
                1 for k, v in kw.items()
                if k not in self.constexprs and k not in _OPTIONS and v is not None)
            StubKernel.log.append((self.name, runtime, len(args) + len(kw) - runtime))
        return None


_OPTIONS = {"num_warps", "num_stages", "num_ctas", "launch_pdl", "maxnreg"}


def _constexpr_names(kernel: Any) -> set[str]:
    import inspect

    fn = getattr(kernel, "fn", kernel)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return set()
    return {n for n, p in params.items() if "constexpr" in str(p.annotation)}


class StubKernels:
    """Stands in for a family's kernels module: every attribute a :class:`StubKernel`."""

    def __init__(self, real_module: Callable[[], Any]) -> None:
        self._real, self._cache = real_module, {}

    def __getattr__(self, name: str) -> StubKernel:
        if name.startswith("__"):
            raise AttributeError(name)
        cache = self.__dict__["_cache"]
        if name not in cache:
            cache[name] = StubKernel(name, getattr(self.__dict__["_real"](), name))
        return cache[name]


def install_stubs() -> None:
    import importlib

    for name in ("lmfuse.norm.ops", "lmfuse.activations.ops", "lmfuse.cross_entropy.ops",
                 "lmfuse.cross_entropy.vocab_parallel"):
        mod = importlib.import_module(name)
        stub = StubKernels(mod._kernels)
        mod._kernels = (lambda s: (lambda: s))(stub)


def checks_as_on_cuda() -> None:
    """No value checks (host syncs) on CPU tensors: what a CUDA call does by default."""
    import lmfuse._dispatch as d

    real = d.value_checks
    for name, mod in list(sys.modules.items()):
        if name.startswith("lmfuse") and getattr(mod, "value_checks", None) is real:
            mod.value_checks = lambda t: False


# --- the calls -------------------------------------------------------------------------------


def cases(device, dtype) -> dict[str, dict[str, Callable[[], Any]]]:
    """op -> mode -> a thunk making one call as ``lmfuse bench host`` times it."""
    import torch

    import lmfuse

    g = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape, grad=False, scale=1.0):
        t = (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)
        return t.requires_grad_(grad)

    out: dict[str, dict[str, Callable[[], Any]]] = {}

    def modes(fn, args, dy):
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)

        def fwd():
            with torch.no_grad():
                return fn(*detached)

        def fwd_grad():
            return fn(*args)

        def fwd_bwd():
            y = fn(*args)
            y.backward(dy) if dy is not None else y.backward()
            for t in leaves:
                t.grad = None

        return {"fwd": fwd, "fwd (grad)": fwd_grad, "fwd+bwd": fwd_bwd}

    x = randn(ROWS, HIDDEN, grad=True)
    w = (1.0 + 0.1 * torch.randn(HIDDEN, generator=g)).to(device=device, dtype=dtype)
    out["rms_norm"] = modes(lambda x, w: lmfuse.rms_norm(x, w, eps=1e-6),
                            (x, w.requires_grad_(True)), randn(ROWS, HIDDEN))
    for op in ("swiglu", "geglu"):
        fn = getattr(lmfuse, op)
        out[op] = modes(fn, (randn(ROWS, 2 * HIDDEN, grad=True),), randn(ROWS, HIDDEN))
    t = torch.randint(0, VOCAB, (ROWS,), generator=g).to(device)
    out["cross_entropy"] = modes(lambda x, t: lmfuse.cross_entropy(x, t),
                                 (randn(ROWS, VOCAB, grad=True), t), None)
    out["linear_cross_entropy"] = modes(
        lambda h, w, t: lmfuse.linear_cross_entropy(h, w, t),
        (randn(ROWS, HIDDEN, grad=True), randn(VOCAB, HIDDEN, grad=True, scale=HIDDEN ** -0.5),
         t), None)
    return out


def count_aten(fn: Callable[[], Any]) -> Counter:
    from torch.utils._python_dispatch import TorchDispatchMode

    ops: Counter = Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops[str(func.overloadpacket.__name__)] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return ops


def count_python_calls(fn: Callable[[], Any]) -> int:
    n = 0

    def prof(frame, event, arg):
        nonlocal n
        if event in ("call", "c_call"):
            n += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n


def time_rows(rows: dict[tuple[str, str], Callable[[], Any]], calls: int, rounds: int,
              stat: Callable[[list[float]], float] = statistics.median
              ) -> dict[tuple[str, str], float]:
    """Microseconds per call of each row (``stat`` of its rounds: the median, or the
    minimum on a machine other work shares, which only ever adds time); rows take turns
    round by round."""
    for fn in rows.values():  # warm-up: caches, compiled kernels, autograd's first graph
        for _ in range(3):
            fn()
    samples: dict[tuple[str, str], list[float]] = {k: [] for k in rows}
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(rounds):
            for key, fn in rows.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                samples[key].append((time.perf_counter() - t0) / calls * 1e6)
    finally:
        if gc_was:
            gc.enable()
    return {k: stat(v) for k, v in samples.items()}


def child(args) -> dict:
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    torch.set_num_threads(1)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    import lmfuse  # noqa: F401 (the families' modules, before the stubs replace their loaders)

    if not args.real:
        install_stubs()
    if device.type == "cpu":
        checks_as_on_cuda()
    all_cases = cases(device, dtype)
    ops = [o for o in OPS if not args.ops or o in args.ops.split(",")]
    rows = {(op, mode): all_cases[op][mode] for op in ops for mode in MODES}
    if args.profile:
        op, mode = args.profile.split(":")
        fn = all_cases[op][mode]
        for _ in range(5):
            fn()
        prof = cProfile.Profile()
        gc.disable()  # as while timing: a collection would land on whichever line allocates
        prof.enable()
        for _ in range(args.calls * 10):
            fn()
        prof.disable()
        gc.enable()
        pstats.Stats(prof).sort_stats(args.sort).print_stats(args.top)
        return {}
    result = {}
    for key, fn in rows.items():
        fn()
        StubKernel.log = []
        aten = count_aten(fn)
        launches = StubKernel.log
        StubKernel.log = None
        result[" | ".join(key)] = dict(
            aten=sum(aten.values()), aten_ops=dict(aten), py_calls=count_python_calls(fn),
            launches=[list(x) for x in launches])
    stat = min if args.stat == "min" else statistics.median
    for key, us in time_rows(rows, args.calls, args.rounds, stat).items():
        result[" | ".join(key)]["us"] = us
    return result


def table(results: dict[str, dict], names: list[str]) -> str:
    head = f"{'op':<21} {'mode':<11}" + "".join(
        f" {n + ' us':>9} {'aten':>4} {'pycalls':>7}" for n in names)
    head += "  launches (runtime+const args)"
    lines = [head]
    for key in results[names[0]]:
        op, mode = key.split(" | ")
        cells = ""
        for n in names:
            r = results[n][key]
            cells += f" {r['us']:>9.1f} {r['aten']:>4} {r['py_calls']:>7}"
        launches = ", ".join(f"{k}({a}+{c})" for k, a, c in results[names[-1]][key]["launches"])
        lines.append(f"{op:<21} {mode:<11}{cells}  {launches}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", default=[],
                   help="NAME=PATH of a source tree (its src/); repeat to compare")
    p.add_argument("--alternations", type=int, default=5)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--stat", choices=("median", "min"), default="median",
                   help="of each row's rounds (min: on a shared, noisy machine)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--ops", default="", help="comma-separated subset of " + ",".join(OPS))
    p.add_argument("--real", action="store_true", help="keep the real kernel launches")
    p.add_argument("--profile", default="", help="OP:MODE: print a cProfile of that row")
    p.add_argument("--sort", default="tottime")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--json", default="")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child or (not args.tree and args.profile):
        res = child(args)
        if args.child:
            print("RESULT " + json.dumps(res))
        return 0
    trees = [t.split("=", 1) for t in args.tree] or [["src", os.environ.get("PYTHONPATH", "")]]
    runs: dict[str, list[dict]] = {name: [] for name, _ in trees}
    forward = _strip(sys.argv[1:], ("--tree", "--json", "--alternations"))
    for i in range(args.alternations if args.tree else 1):
        for name, path in (trees if i % 2 == 0 else trees[::-1]):
            env = dict(os.environ)
            if path:
                env["PYTHONPATH"] = os.path.abspath(path)
            out = subprocess.run([sys.executable, __file__, "--child", *forward], env=env,
                                 capture_output=True, text=True, check=False)
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.stderr.write(out.stdout + out.stderr)
                return 1
            runs[name].append(json.loads(line[7:]))
    merged = {}
    for name, rs in runs.items():
        merged[name] = rs[0]
        for key in rs[0]:
            merged[name][key]["us"] = statistics.median(r[key]["us"] for r in rs)
    print(table(merged, list(runs)))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(merged, fh, indent=1)
    return 0


def _strip(argv: list[str], names: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in names:
            skip = True
            continue
        if any(a.startswith(n + "=") for n in names):
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
