"""Gloo ranks for the parallel ops' tests: a spawner and a collective counter.

``spawn_gloo(world_size, fn, *args)`` runs ``fn(rank, world_size, *args)`` in
``world_size`` fresh processes joined in a gloo process group on localhost. The ranks are
not forked from the test process (a child would inherit its threads and Triton state) but
from a fork server: a clean process, started at the first call, that has imported torch,
transformers and lmfuse once (``_PRELOAD``), so a rank starts in a fraction of a second
where importing them took it about 2 s of a CPU (2-core CI: about 10 s a 4-rank test).
Each rank finds ``fn`` by importing its module by name (a child starts with the parent's
``sys.path``, which ``multiprocessing`` sends over and ``conftest.py`` has put the test
folders on), or, where that name is not importable, from the module's file.

The children's environment is the parent's ``os.environ`` when the fork server started
(the first call) plus ``_CHILD_ENV``: ``TRITON_INTERPRET=1`` so the Triton path runs in
the interpreter (it has to be in the environment before ``lmfuse`` is imported), and one
OpenMP thread per rank, since several ranks share a few cores. Variables set later in the
test process do not reach the ranks.

``count_collectives()`` records every ``torch.distributed`` collective issued inside a
``with`` block, so a test can check how many collectives an op needs.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import socket
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_CHILD_ENV = {"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}

# What the ranks import, imported once by the fork server (a module that fails to import
# there is imported by the rank that needs it, as before).
_PRELOAD = ["torch", "torch.distributed", "numpy", "pytest", "transformers", "helpers", "spawn",
            "fast_interpreter", "triton.runtime.interpreter",
            "lmfuse", "lmfuse.serving", "lmfuse.distributed", "lmfuse.megatron",
            "transformers.models.llama.modeling_llama",
            "transformers.models.qwen3.modeling_qwen3",
            "transformers.models.gemma.modeling_gemma",
            "transformers.models.gemma2.modeling_gemma2",
            "transformers.models.gpt_oss.modeling_gpt_oss"]


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_rank(rank: int, world_size: int, port: int, fn_ref: tuple[str, str, str],
               args: tuple[Any, ...], errors: Any) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        import fast_interpreter

        fast_interpreter.install()  # as conftest.py does in the test process
        fast_interpreter.install_bf16_rounding()  # a GPU's bfloat16 rounding
        fn = _load_function(*fn_ref)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # Every rank joined before any leaves: a rank whose fn returns at once (rank 0 of a
        # test where only rank 1 fails) would otherwise exit, taking the store it hosts
        # with it, while a peer is still connecting ("Connection closed by peer": 1 run in
        # a few hundred).
        dist.barrier()
        try:
            fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:  # report every failure, assertion errors included, to the parent
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1)
    # Done and checked: leave without the interpreter's teardown. Destroying torch's and
    # gloo's C++ state at exit sometimes aborted a rank that had passed every check
    # ("terminate called without an active exception", no Python frame left; seen in about
    # 1 of 10 runs of a sweep that ends in validation errors), which no test should report.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _function_ref(fn: Callable[..., Any]) -> tuple[str, str, str]:
    """``(module name, module file, qualified name)`` of a module-level function."""
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    name = getattr(fn, "__qualname__", "")
    path = getattr(module, "__file__", None)
    if path is None or "<" in name or getattr(module, name, None) is not fn:
        raise TypeError("spawn_gloo: fn must be a module-level function of a module with a "
                        f"file, got {getattr(fn, '__module__', None)}.{name}")
    return module.__name__, path, name


def _load_function(module_name: str, path: str, name: str) -> Callable[..., Any]:
    """The function, imported by module name, or from the module's file where that name
    is not importable here or names another file (pytest's ``--import-mode=importlib``
    names test modules after their path from the root folder, which is only importable
    when it is the working directory)."""
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        module = None
    found = getattr(module, "__file__", None)
    if found is None or os.path.realpath(found) != os.path.realpath(path):
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return getattr(module, name)


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set for the duration of the block, then restored."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def spawn_gloo(world_size: int, fn: Callable[..., Any], *args: Any,
               timeout: float = 60.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks on localhost.

    ``fn`` must be a module-level function, which each rank imports by its module's name
    (or loads from its module's file); ``args`` must pickle. Raises ``RuntimeError`` with
    each failed rank's traceback, or ``TimeoutError`` (after killing the ranks) when they
    are not all done in ``timeout`` seconds.
    """
    fn_ref = _function_ref(fn)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_gloo_rank, args=(rank, world_size, port, fn_ref, args, errors),
                    daemon=True)
        for rank in range(world_size)
    ]
    with _environ(_CHILD_ENV):  # a spawned child's environment is os.environ at start
        for p in procs:
            p.start()
    failures: dict[int, str] = {}

    def collect() -> None:
        while not errors.empty():
            rank, tb = errors.get()
            failures[rank] = tb

    # Read reports while the ranks run: one larger than the pipe's buffer would otherwise
    # block its rank in put() until the deadline, and the failure would read as a hang.
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        collect()
        time.sleep(0.05)
    collect()
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)
    for rank, p in enumerate(procs):
        if rank not in hung and p.exitcode != 0 and rank not in failures:
            failures[rank] = f"exit code {p.exitcode}"
    if failures:
        report = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        killed = f" (rank(s) {hung} hung and were killed after {timeout}s)" if hung else ""
        raise RuntimeError(f"spawn_gloo: {len(failures)} of {world_size} rank(s) failed"
                           f"{killed}:\n{report}")
    if hung:
        raise TimeoutError(f"spawn_gloo: rank(s) {hung} still running after {timeout}s; killed")


class ForkedProcess:
    """A process forked from the fork server (:func:`fork_main`), with the parts of
    ``subprocess.Popen``'s interface a launcher of rank processes uses."""

    def __init__(self, process: Any):
        self._p = process

    @property
    def pid(self) -> int:
        return self._p.pid

    @property
    def returncode(self) -> int | None:
        return self._p.exitcode

    def poll(self) -> int | None:
        return None if self._p.is_alive() else self._p.exitcode

    def kill(self) -> None:
        self._p.kill()

    def wait(self, timeout: float | None = None) -> int:
        self._p.join(timeout)
        if self._p.exitcode is None:
            raise subprocess.TimeoutExpired("forked process", timeout)
        return self._p.exitcode


def _forked_main(fn_ref: tuple[str, str, str], argv: list[str], env: dict[str, str],
                 log: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    code = 1
    try:
        import fast_interpreter

        fast_interpreter.install()
        fast_interpreter.install_bf16_rounding()  # a GPU's bfloat16 rounding
        code = _load_function(*fn_ref)(argv) or 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def fork_main(main: Callable[[list[str]], int], argv: list[str], env: dict[str, str],
              log: str) -> ForkedProcess:
    """``main(argv)`` (a module-level function) in a process forked from the fork server
    (its modules preloaded, as :func:`spawn_gloo`'s ranks), with ``env`` as its whole
    environment and its output in the file ``log``: what ``subprocess.Popen`` of the
    script with ``argv`` would run, without the new interpreter's imports (seconds a rank
    on 2 cores). The exit code is ``main``'s (1 if it raises)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    p = ctx.Process(target=_forked_main, args=(_function_ref(main), argv, env, log),
                    daemon=True)
    with _environ(_CHILD_ENV):
        p.start()
    return ForkedProcess(p)


# --- counting collectives ----------------------------------------------------------------

# Every collective entry point of torch.distributed (each in both namespaces it lives in)
# and of ProcessGroup, which the functions call and an op could call directly.
_DIST_FUNCTIONS = (
    "all_reduce", "all_reduce_coalesced", "reduce",
    "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_coalesced",
    "all_gather_object", "_all_gather_base", "gather", "gather_object",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base",
    "scatter", "scatter_object_list",
    "broadcast", "broadcast_object_list", "_broadcast_coalesced",
    "all_to_all", "all_to_all_single",
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list",
    "recv_object_list",
    "barrier", "monitored_barrier",
)
_GROUP_METHODS = (
    "allreduce", "allreduce_coalesced", "reduce",
    "allgather", "allgather_coalesced", "allgather_into_tensor_coalesced", "_allgather_base",
    "all_gather_single", "all_gather_single_coalesced", "gather",
    "reduce_scatter", "reduce_scatter_single", "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced", "_reduce_scatter_base", "scatter",
    "broadcast", "alltoall", "alltoall_base", "all_to_all_single",
    "send", "recv", "recv_anysource", "barrier", "monitored_barrier",
)


#: The agreement checks' collectives that :func:`count_collectives` saw, in this process.
AGREEMENT_CHECKS: list[str] = []


@contextlib.contextmanager
def count_collectives() -> Iterator[list[str]]:
    """Yield a list that collects the name of every collective issued in the block.

    A collective that calls another (``all_gather_single`` calls
    ``ProcessGroup.all_gather_single``) is counted once, by its outermost name. The
    one-time agreement check of a group's sizes (``lmfuse._collectives.check_agreed_once``,
    the first call with new sizes) is listed apart, in ``AGREEMENT_CHECKS``: the list holds
    an op's own collectives, what it issues on every call.
    """
    import torch.distributed.distributed_c10d as c10d

    from lmfuse._collectives import CHECKING

    calls: list[str] = []
    depth = [0]

    def wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                (AGREEMENT_CHECKS if CHECKING[0] else calls).append(name)
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1

        return counted

    saved: list[tuple[Any, str, Any]] = []
    targets = [(ns, n) for ns in (dist, c10d) for n in _DIST_FUNCTIONS]
    targets += [(dist.ProcessGroup, n) for n in _GROUP_METHODS]
    for owner, name in targets:
        original = owner.__dict__.get(name) if isinstance(owner, type) else getattr(
            owner, name, None)
        if original is None:
            continue
        saved.append((owner, name, original))
        setattr(owner, name, wrap(name, original))
    try:
        yield calls
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


class Failures:
    """Runs checks, keeps going past failed ones, and raises once with all of them."""

    def __init__(self, rank: int) -> None:
        self.rank, self.messages, self.count = rank, [], 0

    def check(self, what: str, fn: Callable[[], None]) -> None:
        # Only comparisons fail here; every rank issues the same collectives either way.
        self.count += 1
        try:
            fn()
        except Exception:
            self.messages.append(f"[{what}]\n{traceback.format_exc(limit=-3)}")

    def raise_if_any(self, shown: int = 12) -> None:
        if self.messages:
            rest = [m.split("\n", 1)[0] for m in self.messages[shown:]]
            raise AssertionError(
                f"rank {self.rank}: {len(self.messages)} of {self.count} case(s) failed:\n"
                + "\n".join(self.messages[:shown])
                + (f"\n... and {len(rest)} more: " + ", ".join(rest) if rest else ""))
