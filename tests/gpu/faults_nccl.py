"""Faults in a step of lmfuse's parallel ops: a rank that raises mid-step must make every
rank of the process group raise a Python exception within the group's timeout, and nothing
may hang; on NCCL (2 or 4 GPUs, one a rank, ``cuda:LOCAL_RANK``) as on gloo::

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 tests/gpu/faults_nccl.py --out faults.json
    NCCL_NVLS_ENABLE=0 python3 tests/gpu/faults_nccl.py --world 2 --out faults.json  # the same

Dry run on the CPU (gloo ranks, Triton interpreter)::

    TRITON_INTERPRET=1 python3 tests/gpu/faults_nccl.py --world 2 --backend gloo --device cpu

How it runs. A broken NCCL communicator cannot be used again, so each scenario runs in a
fresh set of processes. This script is a *parent* that starts ``--world`` ranks per
scenario (itself again, with ``--worker``, as subprocesses with torchrun's environment:
MASTER_ADDR=127.0.0.1, a free port, RANK, WORLD_SIZE, LOCAL_RANK), watches them and kills
any left alive at its deadline (``--jobs`` scenarios at a time, each on its own port).
Under torchrun the process of RANK 0 is that parent (its world is torchrun's WORLD_SIZE,
one node) and the other torchrun processes exit at once: torchrun only launches it. Every
rank gets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1
in its environment (before it imports torch), TORCH_NCCL_BLOCKING_WAIT=1 (unless
``--no-blocking-wait``), on the CPU TRITON_INTERPRET=1 and one OpenMP thread, and the rest
of the parent's environment (so ``NCCL_RUNTIME_CONNECT=0 python3 ...`` reaches the ranks).

A rank: ``init_process_group(backend, timeout=--timeout)`` (the group under test; default
15 s on NCCL, 10 s on gloo); one warm-up step on a second group with a long timeout
(``--startup``), so that Triton's first compilations, which take each rank a different
time, are over before the short timeout counts; one healthy step on the group under test
(NCCL sets up a communicator's connections at its first collectives; ``--cold`` skips
it); then the measured run: two "decode steps" on the world group, the same shapes on
every rank:

1. ``kvdp_decode_attention`` (its two all-gathers, or all-to-alls, of queries and outputs);
2. ``cp_decode_attention`` with 2 active tokens (an all-reduce of the lengths, an
   all-gather of the partials);
3. a projection to this rank's vocabulary columns and ``lmfuse.cross_entropy(...,
   tp_group=group)``, forward (one all-gather) and backward (none); then the loss and the
   gradient are read (a host sync) and, on CUDA, ``torch.cuda.synchronize()``.

In step 0 one rank (the *faulty* one) raises. Every ``torch.distributed`` collective (and
ProcessGroup method: the list that ``tests/distributed/spawn.py``'s ``count_collectives``
wraps) is wrapped on every rank, counted per op; the faulty rank raises ``InjectedFault``
in place of the chosen collective of an op, and every rank records the collective an
exception came out of. Scenarios (``--list``):

* ``kvdp-query-gather``: the last rank at KVDP's collective 1 (the query all-gather);
* ``kvdp-a2a-output``: KVDP with ``exchange="all_to_all"``, rank 0 at collective 2 (the
  output all-to-all; the query all-to-all went through);
* ``cp-collective-1``: the last rank at CP's collective 1 (the lengths' all-reduce);
* ``cp-collective-2-exit``: rank 0 at CP's collective 2 (the partials' all-gather), and
  its process then exits with the exception: its peers wait on a rank that is gone (which
  hosted the TCP store);
* ``ce-forward``: the last rank at the cross-entropy forward's all-gather;
* ``between-ops``: rank 0 raises between the KVDP and the CP op (outside any collective);
* ``ce-backward``: the last rank raises in the cross-entropy backward, which has no
  collective: its peers finish step 0 and must raise in step 1's first collective;
* ``check-ranks-kvdp``, ``check-ranks-cp``: no raise, but bad input on one rank (a
  ``seqlens_local`` of the wrong shape; a negative count in ``seqlens_shard``) with
  ``check_ranks=True``: every rank must raise ValueError at once (the others' message names
  the bad rank), within ``--timeout`` / 2 (``check_on_all_ranks`` in
  ``lmfuse/distributed/cp.py``).

Except where it exits, the faulty rank stays alive after raising (as a process that caught
the error to log it would) until its peers have reported, so they face a silent peer, not
a closed connection. Every rank writes what it raised (type, first line of the message,
when, in which collective after how long) to a file the parent reads, then cleans up
(``--cleanup``: ``dist.destroy_process_group()`` on gloo; on NCCL the experimental
``_abort_process_group()``, see below) and exits. A scenario passes when every rank raised
a Python exception (the faulty rank its own), each healthy one within ``--timeout`` +
``--margin`` seconds of the fault, and every rank exited by the parent's deadline (all
ranks set up + timeout + margin + ``--grace``); a rank still alive then is killed: a HANG.
The parent prints one PASS/FAIL line per scenario and a summary; ``--out`` writes JSON
(device, torch/triton/NCCL versions, date, world size, timeout, options, and per scenario
and rank what it raised, after how many seconds, and whether and how it exited, with the
log's tail where a rank failed); the exit code is 1 when a scenario failed.
``--dump-stacks S`` makes each rank print its Python stacks every S seconds (``--keep``
keeps the logs): that is how the hangs below were located.

What was seen on NCCL (torch 2.11.0+cu130, NCCL 2.28.9, 2 x H100, timeout 10-15 s):

* As lmfuse is, with TORCH_NCCL_BLOCKING_WAIT=1 and a timeout: every raising scenario
  HANGs; only the check-ranks ones pass. A synchronous collective (``async_op=False``, what
  lmfuse issues) is enqueued on the current stream and PyTorch returns no Work for it, so
  there is nothing for the blocking wait to wait on, and in blocking-wait mode PyTorch
  starts no watchdog (both read in PyTorch's ProcessGroupNCCL): the healthy rank went
  through its collective calls and blocked in the step's first host sync (reading the
  loss) until it was killed (all 7 such scenarios; 3 of them also run warm-started).
* Without TORCH_NCCL_BLOCKING_WAIT (PyTorch's defaults): no Python exception either. The
  watchdog saw the timeout and began dumping debug information, but the healthy rank was
  still neither raised nor aborted 35 s after the timeout, when it was killed.
* With each collective issued as ``async_op=True`` and its Work waited on (``--async-wait``,
  which does that to the torch.distributed calls lmfuse makes) and TORCH_NCCL_BLOCKING_WAIT=1:
  every scenario passes. The healthy ranks raise ``torch.distributed.DistBackendError``
  ("Watchdog caught collective operation timeout: WorkNCCL(...) ran for 10000 milliseconds
  before timing out") in the collective, 10.5 s after the fault with a 10 s timeout, and
  exit about a second later.
* A fault at the first collectives of a fresh communicator (``--cold``): the healthy rank
  blocked inside the collective call itself (NCCL's lazy set-up of a communicator's
  connections at its first collectives, which waits for every peer, we take it), out of
  reach of any timeout. With
  NCCL_RUNTIME_CONNECT=0 (connections made at ``init_process_group``, which eager-inits
  with ``device_id``) and ``--async-wait`` that case passed too.
* After the fault, ``dist.destroy_process_group()`` on the faulty rank did not return
  (killed after 15 s) while its peer was stuck; ``_abort_process_group()`` returned in
  about 1 s on every rank.

So a user gets an exception on every rank only with ``TORCH_NCCL_BLOCKING_WAIT=1`` in every
rank's environment, a ``timeout=`` on ``init_process_group`` (or ``new_group``),
collectives that are waited on, and a communicator that has connected (a first step, or
NCCL_RUNTIME_CONNECT=0); then ``_abort_process_group()`` rather than
``destroy_process_group()``. Since those runs, lmfuse waits on its own collectives when
TORCH_NCCL_BLOCKING_WAIT=1 is set (``lmfuse/_collectives.py``: ``async_op=True``
and ``Work.wait()``, what ``--async-wait`` does from outside); the plain run of this script
on NCCL with that change is still to be made (the device time of that session was spent),
``--async-wait`` being its stand-in. On gloo none of
this is needed: its collectives block and raise RuntimeError after the group's timeout
("Timed out waiting 5000ms for recv operation"), within a second when the faulty process
exited ("Connection closed by peer"); every scenario passes with 2 and 4 ranks, with and
without ``--async-wait``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import faulthandler
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

_STARTED = time.time()  # about when this process began (torch's imports are timed from here)

# Before torch is imported, here and in every rank (the parent puts them in the ranks'
# environment too): no NVLink multicast (SHARP) communicators or symmetric memory.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
if __name__ == "__main__":
    for _k, _v in NO_MULTICAST.items():
        os.environ.setdefault(_k, _v)

_TESTS = Path(__file__).resolve().parent.parent
for _dir in (str(_TESTS / "distributed"), str(_TESTS)):
    if _dir not in sys.path:
        sys.path.insert(0, _dir)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

try:
    import lmfuse  # noqa: E402
except ImportError:  # not installed: the package from this work tree
    sys.path.insert(0, str(_TESTS.parent / "src"))
    import lmfuse  # noqa: E402

from spawn import _DIST_FUNCTIONS, _GROUP_METHODS  # noqa: E402

from lmfuse.distributed import (cp_decode_attention, cp_shard_seqlens,  # noqa: E402
                                kvdp_batch_range, kvdp_decode_attention)

# Variables that change what a fault does, as the parent saw them (the ranks get them too).
ENV_SHOWN = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_DUMP_ON_TIMEOUT",
             "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "NCCL_RUNTIME_CONNECT", "NCCL_NVLS_ENABLE",
             "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
STEPS = 2  # the fault is in step 0; step 1 is where the peers of a backward fault raise


# --- scenarios -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    faulty: int  # the faulty rank; negative counts from the end (-1: the last rank)
    op: str = ""  # raise in place of collective ``nth`` (1-based) of this op ...
    nth: int = 0
    between: str = ""  # ... or raise after this op of step 0 ...
    in_backward: bool = False  # ... or raise in the cross-entropy backward of step 0 ...
    bad_input: str = ""  # ... or pass bad input to this op, with check_ranks=True
    exchange: str = "all_gather"
    exits: bool = False  # the faulty rank's process exits at once (else it stays alive)

    def faulty_rank(self, world: int) -> int:
        return self.faulty % world


KVDP, CP, CE = "kvdp_decode_attention", "cp_decode_attention", "cross_entropy"
SCENARIOS = [
    Scenario("kvdp-query-gather", "KVDP: the last rank raises at the op's collective 1 (the "
             "query all-gather)", faulty=-1, op=KVDP, nth=1),
    Scenario("kvdp-a2a-output", "KVDP, exchange=all_to_all: rank 0 raises at the op's "
             "collective 2 (the output all-to-all)", faulty=0, op=KVDP, nth=2,
             exchange="all_to_all"),
    Scenario("cp-collective-1", "CP (2 active tokens): the last rank raises at the op's "
             "collective 1 (the lengths' all-reduce)", faulty=-1, op=CP, nth=1),
    Scenario("cp-collective-2-exit", "CP: rank 0 raises at the op's collective 2 (the "
             "partials' all-gather) and its process exits", faulty=0, op=CP, nth=2,
             exits=True),
    Scenario("ce-forward", "vocab-parallel cross-entropy: the last rank raises at the "
             "forward's all-gather", faulty=-1, op=CE, nth=1),
    Scenario("between-ops", "rank 0 raises between the KVDP and the CP op", faulty=0,
             between=KVDP),
    Scenario("ce-backward", "the last rank raises in the cross-entropy backward (no "
             "collective): the others raise in step 1", faulty=-1, in_backward=True),
    Scenario("check-ranks-kvdp", "the last rank passes a seqlens_local of the wrong shape to "
             "kvdp_decode_attention, check_ranks=True", faulty=-1, bad_input=KVDP),
    Scenario("check-ranks-cp", "rank 0 passes a negative seqlens_shard count to "
             "cp_decode_attention, check_ranks=True", faulty=0, bad_input=CP),
]
BY_NAME = {s.name: s for s in SCENARIOS}


class InjectedFault(RuntimeError):
    """The faulty rank's own exception."""


# --- in a rank: the problem, the step, the fault --------------------------------------------


class Problem:
    """One rank's tiny inputs: B = W + 1 sequences (uneven KVDP split), head dim 16, 2 KV
    heads; KVDP with 2 query heads a rank, CP with 4 and 2 active tokens, a 16-column
    vocabulary slice a rank.
    Shared values (lengths, targets) come from one seed, the rest from the rank's."""

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        B, S, hkv, hq_local, hq, D, v_local, s_cp = world + 1, 8, 2, 2, 4, 16, 16, 2
        shared = torch.Generator().manual_seed(1234)
        mine = torch.Generator().manual_seed(99 + rank)
        start, stop = kvdp_batch_range(B, dist.group.WORLD)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(shape, generator=mine).to(device)

        self.device = device
        self.q_local = randn(B, 1, hq_local, D)
        self.k_kvdp, self.v_kvdp = randn(stop - start, S, hkv, D), randn(stop - start, S, hkv, D)
        self.lens_kvdp = torch.randint(1, S + 1, (stop - start,), generator=mine).to(device)
        lens = torch.randint(s_cp, world * S + 1, (B,), generator=shared).to(device)
        self.counts_cp = cp_shard_seqlens(lens, group=dist.group.WORLD)
        self.q_cp = randn(B, s_cp, hq, D)  # 2 active tokens: CP all-reduces the lengths
        self.k_cp, self.v_cp = randn(B, S, hkv, D), randn(B, S, hkv, D)
        self.w = randn((hq_local + s_cp * hq) * D, v_local) * 0.1
        self.target = torch.randint(0, world * v_local, (B,), generator=shared).to(device)


# The torch.distributed functions that --async-wait issues as ``async_op=True`` and then
# waits on (lmfuse's collectives are among them).
ASYNC_WAIT = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
              "_all_gather_base", "all_to_all_single", "reduce_scatter_tensor", "broadcast")


class _TrackedWork:
    """A collective's Work whose ``wait()`` records, if it raises, the collective it came
    out of (in the :class:`Collectives` that issued it)."""

    def __init__(self, work: Any, track: Collectives, what: str, start: float) -> None:
        self._work, self._track, self._what, self._start = work, track, what, start

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._work.wait(*args, **kwargs)
        except BaseException:
            self._track.failed_in = dict(collective=f"{self._what} (its wait)",
                                         waited_s=round(time.time() - self._start, 2))
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class Collectives:
    """Wraps every ``torch.distributed`` collective while installed: counts them (the
    outermost call of nested ones), per op of the step (:meth:`enter`), raises
    :class:`InjectedFault` in place of collective ``nth`` of op ``op`` of step 0 (``nth``
    0: never), and records the collective an exception came out of."""

    def __init__(self, rank: int, op: str, nth: int, async_wait: bool = False) -> None:
        self.rank, self.fail_op, self.fail_nth, self.async_wait = rank, op, nth, async_wait
        self.step, self.op, self.count, self.depth = 0, "", 0, 0
        self.fault_at: float | None = None
        self.fault_where = ""
        self.failed_in: dict[str, Any] | None = None

    def enter(self, op: str) -> None:
        self.op, self.count = op, 0

    def fault(self, where: str) -> None:
        self.mark(where)
        raise InjectedFault(f"rank {self.rank}: injected fault {where}")

    def mark(self, where: str) -> None:
        self.fault_at, self.fault_where = time.time(), where

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if self.depth:
                return original(*args, **kwargs)
            self.count += 1
            what = f"{name}, collective {self.count} of {self.op}, step {self.step}"
            if (self.step, self.op, self.count) == (0, self.fail_op, self.fail_nth):
                self.fault(f"in place of {what}")
            start = time.time()
            self.depth += 1
            try:
                if self.async_wait and name in ASYNC_WAIT and "async_op" not in kwargs:
                    work = original(*args, async_op=True, **kwargs)
                    return work.wait() if work is not None else None
                work = original(*args, **kwargs)
                if kwargs.get("async_op") and work is not None:
                    # The caller waits on it (lmfuse does, under TORCH_NCCL_BLOCKING_WAIT=1):
                    # an exception from that wait came out of this collective.
                    return _TrackedWork(work, self, what, start)
                return work
            except BaseException:
                self.failed_in = dict(collective=what, waited_s=round(time.time() - start, 2))
                raise
            finally:
                self.depth -= 1

        return wrapped

    @contextlib.contextmanager
    def installed(self) -> Iterator[Collectives]:
        import torch.distributed.distributed_c10d as c10d

        saved: list[tuple[Any, str, Any]] = []
        targets = [(ns, n) for ns in (dist, c10d) for n in _DIST_FUNCTIONS]
        targets += [(dist.ProcessGroup, n) for n in _GROUP_METHODS]
        for owner, name in targets:
            original = (owner.__dict__.get(name) if isinstance(owner, type)
                        else getattr(owner, name, None))
            if original is None:
                continue
            saved.append((owner, name, original))
            setattr(owner, name, self._wrap(name, original))
        try:
            yield self
        finally:
            for owner, name, original in reversed(saved):
                setattr(owner, name, original)


def run_step(p: Problem, group: Any, scn: Scenario, fault_here: bool,
             track: Collectives) -> float:
    """One decode step over ``group``; ``fault_here``: this rank is faulty and this is the
    step of the fault (``track`` raises or marks it)."""
    check = bool(scn.bad_input)
    with torch.no_grad():
        track.enter(KVDP)
        lens = p.lens_kvdp
        if fault_here and scn.bad_input == KVDP:
            lens = lens[:-1]  # [B_r - 1]: the wrong shape
            track.mark(f"bad seqlens_local passed to {KVDP}")
        a = kvdp_decode_attention(p.q_local, p.k_kvdp, p.v_kvdp, lens, group=group,
                                  exchange=scn.exchange, check_ranks=check)
        if fault_here and scn.between == KVDP:
            track.fault(f"between {KVDP} and {CP}")
        track.enter(CP)
        counts = p.counts_cp
        if fault_here and scn.bad_input == CP:
            counts = counts.clone()
            counts[0] = -1
            track.mark(f"negative seqlens_shard passed to {CP}")
        c = cp_decode_attention(p.q_cp, p.k_cp, p.v_cp, counts, group=group, check_ranks=check)
    hidden = torch.cat([a.flatten(1), c.flatten(1)], dim=1).float()
    w = p.w.detach().requires_grad_(True)
    logits = hidden @ w  # [B, V_local]: this rank's vocabulary columns
    if fault_here and scn.in_backward:
        logits.register_hook(lambda grad: track.fault(f"in the {CE} backward"))
    track.enter(CE)
    loss = lmfuse.cross_entropy(logits, p.target, tp_group=group)
    loss.backward()
    value = float(loss.detach()) + float(w.grad.sum())  # reads the results (a host sync)
    if p.device.type == "cuda":
        torch.cuda.synchronize(p.device)
    return value


class Report:
    """This rank's report, a JSON file the parent reads (rewritten whole at each update)."""

    def __init__(self, path: Path, **fields: Any) -> None:
        self.path, self.data = path, dict(fields)

    def update(self, **fields: Any) -> None:
        self.data.update(fields)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        os.replace(tmp, self.path)


def read_report(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def versions(device: torch.device) -> dict[str, Any]:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    nccl = None
    if device.type == "cuda":
        with contextlib.suppress(Exception):
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        f"cpu ({platform.processor() or platform.machine()})")
    return dict(device=name, torch=torch.__version__, triton=triton_version, nccl=nccl,
                cuda=torch.version.cuda, python=platform.python_version())


def worker(args: argparse.Namespace) -> int:
    """One rank of one scenario (``--worker NAME``)."""
    scn = BY_NAME[args.worker]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    faulty = rank == scn.faulty_rank(world)
    results = Path(args.results)
    report = Report(results / f"rank{rank}.json", rank=rank, pid=os.getpid(),
                    role="faulty" if faulty else "healthy", started_at=_STARTED)
    report.update(imported_at=time.time())
    # A safety net for a parent that died: the parent's own deadline comes well before it.
    limit = args.startup + args.timeout + args.margin + args.grace + 60
    alarm = threading.Timer(limit, lambda: os._exit(3))
    alarm.daemon = True
    alarm.start()

    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        import fast_interpreter  # tests/: the interpreter as the CPU suite runs it

        fast_interpreter.install()
        fast_interpreter.install_bf16_rounding()  # a GPU's bfloat16 rounding
        device = torch.device("cpu")
    extra = dict(device_id=device) if args.backend == "nccl" else {}
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout),
                            **extra)
    warm = dist.new_group(backend=args.backend,
                          timeout=datetime.timedelta(seconds=args.startup))
    report.update(joined_at=time.time())
    problem = Problem(rank, world, device)
    run_step(problem, warm, scn, False, Collectives(rank, "", 0))  # compiles the kernels
    dist.barrier(group=warm)
    if not args.cold:  # the group under test, once healthy: NCCL connects it lazily
        run_step(problem, dist.group.WORLD, scn, False, Collectives(rank, "", 0))
        dist.barrier(group=warm)
    report.update(ready_at=time.time(), **(versions(device) if rank == 0 else {}))
    if args.dump_stacks:
        faulthandler.dump_traceback_later(args.dump_stacks, repeat=True)

    track = Collectives(rank, scn.op, scn.nth if faulty else 0, args.async_wait)
    try:
        with track.installed():
            for step in range(STEPS):
                track.step = step
                run_step(problem, dist.group.WORLD, scn, faulty and step == 0, track)
    except BaseException as e:  # noqa: BLE001 (the point: whatever the step raised)
        report.update(raised=True, raised_at=time.time(), type=type(e).__qualname__,
                      module=type(e).__module__,
                      message=(str(e).strip().splitlines() or [""])[0][:400],
                      step=track.step, failed_in=track.failed_in, fault_at=track.fault_at,
                      fault_where=track.fault_where,
                      traceback=traceback.format_exc(limit=-6)[-3000:])
        if faulty and scn.exits:
            raise  # the process ends with the exception (exit code 1)
        if faulty:  # stay alive until the others have reported (or past their deadline)
            deadline = (track.fault_at or time.time()) + args.timeout + args.margin
            others = [results / f"rank{r}.json" for r in range(world) if r != rank]
            while time.time() < deadline and not all(
                    "raised" in (read_report(f) or {}) for f in others):
                time.sleep(0.05)
        code = 1
    else:
        report.update(raised=False, completed_at=time.time())
        code = 0
    cleanup(report, args.cleanup)
    return code


def cleanup(report: Report, how: str) -> None:
    """After the run: ``destroy_process_group()``, or (``abort``) the experimental
    ``_abort_process_group()``, which aborts the NCCL communicators without waiting on
    them, or (``exit``) nothing. The rank then exits."""
    start = time.time()
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    what = ("_abort_process_group" if how == "abort" and abort is not None
            else "destroy_process_group" if how != "exit" else "")
    report.update(cleanup=f"{what} called" if what else "none")
    try:
        if what == "_abort_process_group":
            abort()
        elif what:
            dist.destroy_process_group()
        report.update(cleanup=f"{what} returned" if what else "none",
                      cleanup_s=round(time.time() - start, 2))
    except BaseException as e:  # noqa: BLE001
        report.update(cleanup=f"{what} raised {type(e).__name__}: {e}"[:300],
                      cleanup_s=round(time.time() - start, 2))
    sys.stdout.flush()
    sys.stderr.flush()


# --- the parent: ranks per scenario, deadlines, the report ----------------------------------


def free_port(taken: set[int]) -> int:
    """A TCP port on localhost that was free a moment ago and is not in ``taken``."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in taken:
            taken.add(port)
            return port


def rank_env(rank: int, world: int, port: int, args: argparse.Namespace) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC_", "TORCH_ELASTIC_"))}
    env.update(NO_MULTICAST)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
               WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
               GROUP_RANK="0", PYTHONUNBUFFERED="1")
    if args.blocking_wait:
        env["TORCH_NCCL_BLOCKING_WAIT"] = "1"
    else:
        env.pop("TORCH_NCCL_BLOCKING_WAIT", None)
    if args.device == "cpu":
        env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    return env


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _log_tail(path: Path, chars: int = 1500) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-chars:]
    return ""


#: ``LAUNCH(main, argv, env, log_path)`` -> a ``Popen``-like process running ``main(argv)``
#: in place of a new interpreter running this script (None: ``subprocess.Popen``). The CPU
#: tests set it to fork the ranks from their preloaded fork server.
LAUNCH: Any = None


def run_scenario(scn: Scenario, world: int, args: argparse.Namespace,
                 ports: set[int]) -> dict[str, Any]:
    """Starts the ranks of one scenario, waits for them (killing any still alive at the
    deadline), and judges what they reported."""
    tmp = Path(tempfile.mkdtemp(prefix=f"lmfuse-faults-{scn.name}-"))
    port = free_port(ports)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", scn.name,
           "--results", str(tmp), "--backend", args.backend, "--device", args.device,
           "--timeout", str(args.timeout), "--margin", str(args.margin),
           "--grace", str(args.grace), "--startup", str(args.startup),
           "--dump-stacks", str(args.dump_stacks), "--cleanup", args.cleanup]
    cmd += [flag for flag, on in (("--cold", args.cold), ("--async-wait", args.async_wait)) if on]
    procs: list[Any] = []
    killed: set[int] = set()
    ended: dict[int, float] = {}
    began = time.time()
    deadline = began + args.startup
    try:
        for r in range(world):
            if LAUNCH is not None:
                procs.append(LAUNCH(main, cmd[2:], rank_env(r, world, port, args),
                                    str(tmp / f"rank{r}.log")))
                continue
            with open(tmp / f"rank{r}.log", "wb") as log:
                procs.append(subprocess.Popen(cmd, env=rank_env(r, world, port, args),
                                              stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL))
        ready = False
        while any(p.poll() is None for p in procs) and time.time() < deadline:
            for r, p in enumerate(procs):
                if r not in ended and p.poll() is not None:
                    ended[r] = time.time()
            reports = [read_report(tmp / f"rank{r}.json") or {} for r in range(world)]
            if not ready:
                at = [rep.get("ready_at") for rep in reports]
                if all(at):  # the measured run has begun: its deadline
                    ready = True
                    deadline = max(at) + args.timeout + args.margin + args.grace
                elif any(p.poll() is not None and not at[r] for r, p in enumerate(procs)):
                    break  # a rank died in its set-up: the others would wait for it
            time.sleep(0.05)
    finally:
        for r, p in enumerate(procs):
            if p.poll() is None:
                killed.add(r)
                p.kill()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
    for r in range(len(procs)):
        ended.setdefault(r, time.time())
    result = judge(scn, world, args, tmp, procs, killed, ended)
    result["wall_s"] = round(time.time() - began, 1)
    if not args.keep:
        for f in sorted(tmp.iterdir()):
            f.unlink()
        tmp.rmdir()
    else:
        result["files"] = str(tmp)
    return result


def judge(scn: Scenario, world: int, args: argparse.Namespace, tmp: Path,
          procs: list[subprocess.Popen], killed: set[int],
          ended: dict[int, float]) -> dict[str, Any]:
    faulty = scn.faulty_rank(world)
    reports = [read_report(tmp / f"rank{r}.json") or {} for r in range(world)]
    fault_at = reports[faulty].get("fault_at")
    limit = args.timeout / 2 if scn.bad_input else args.timeout + args.margin
    problems: list[str] = []
    ranks: list[dict[str, Any]] = []
    versions_seen = {k: reports[0].get(k) for k in ("device", "torch", "triton", "nccl",
                                                    "cuda", "python")}
    for r, rep in enumerate(reports):
        code = procs[r].returncode if r < len(procs) else None
        row: dict[str, Any] = dict(rank=r, role="faulty" if r == faulty else "healthy",
                                   raised=bool(rep.get("raised")), type=rep.get("type"),
                                   message=rep.get("message"), step=rep.get("step"),
                                   failed_in=(rep.get("failed_in") or {}).get("collective"),
                                   waited_s=(rep.get("failed_in") or {}).get("waited_s"),
                                   after_fault_s=None, exited=r not in killed,
                                   exit=_exit_text(code), cleanup=rep.get("cleanup"),
                                   cleanup_s=rep.get("cleanup_s"))
        if rep.get("raised") and fault_at is not None:
            row["after_fault_s"] = round(rep["raised_at"] - fault_at, 2)
        if rep.get("raised"):
            row["exit_after_raise_s"] = round(ended[r] - rep["raised_at"], 2)
        if rep.get("ready_at"):  # start-up: imports, process group, warm-up step
            row["startup_s"] = dict(imports=round(rep["imported_at"] - rep["started_at"], 2),
                                    join=round(rep["joined_at"] - rep["imported_at"], 2),
                                    warm_up=round(rep["ready_at"] - rep["joined_at"], 2))
        ranks.append(row)
        who = f"rank {r} ({row['role']})"
        if not rep.get("ready_at"):
            problems.append(f"{who} did not get through its set-up ({row['exit']})")
            row["log"] = _log_tail(tmp / f"rank{r}.log")
            continue
        if not rep.get("raised"):
            if r in killed:
                problems.append(f"{who} HANG: raised nothing, killed at the deadline")
            elif "completed_at" in rep:
                problems.append(f"{who} completed both steps without raising")
            else:
                problems.append(f"{who} ended without a Python exception ({row['exit']})")
            row["log"] = _log_tail(tmp / f"rank{r}.log")
            continue
        if r == faulty:
            want = "ValueError" if scn.bad_input else "InjectedFault"
            if row["type"] != want:
                problems.append(f"{who} raised {row['type']}, not its own {want}: "
                                f"{row['message']}")
        else:
            if fault_at is None:
                problems.append(f"{who} raised, but the faulty rank recorded no fault")
            elif row["after_fault_s"] > limit:
                problems.append(f"{who} raised {row['after_fault_s']} s after the fault, "
                                f"later than {limit:g} s")
            if scn.bad_input and "rejected its inputs" not in (row["message"] or ""):
                problems.append(f"{who} raised something other than the check_ranks error: "
                                f"{row['type']}: {row['message']}")
        if r in killed:
            problems.append(f"{who} raised, then did not exit (HANG after raising: "
                            f"{rep.get('cleanup') or 'in destroy_process_group or at exit'})")
            row["log"] = _log_tail(tmp / f"rank{r}.log")
    return dict(name=scn.name, what=scn.what, faulty_rank=faulty,
                status="FAIL" if problems else "PASS", problems=problems,
                fault_where=reports[faulty].get("fault_where"), limit_s=limit, ranks=ranks,
                versions=versions_seen)


def describe(result: dict[str, Any]) -> str:
    """One line: what each rank raised, where, how long after the fault."""
    parts = []
    for row in result["ranks"]:
        if not row["raised"]:
            parts.append(f"r{row['rank']} {'HANG' if not row['exited'] else row['exit']}")
            continue
        where = f" in {row['failed_in']}" if row["failed_in"] else ""
        after = "" if row["after_fault_s"] is None else f" +{row['after_fault_s']:.1f}s"
        parts.append(f"r{row['rank']} {row['type']}{where}{after}"
                     + ("" if row["exited"] else " (not exited)"))
    return "; ".join(parts)


def run_scenarios(world: int, scenarios: list[Scenario], args: argparse.Namespace,
                  echo: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Every scenario on ``world`` fresh ranks (``args.jobs`` scenarios at a time); prints
    one PASS/FAIL line per scenario as it ends; returns the results in scenario order."""
    ports: set[int] = set()
    lock = threading.Lock()

    def one(scn: Scenario) -> dict[str, Any]:
        result = run_scenario(scn, world, args, ports)
        with lock:
            echo(f"{result['status']} {scn.name:<20} {result['wall_s']:5.1f}s  "
                 f"{describe(result)}")
            for p in result["problems"]:
                echo(f"     {p}")
        return result

    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        return list(pool.map(one, scenarios))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=None,
                    help="ranks per scenario, 2 or 4 (default: torchrun's WORLD_SIZE, else 2)")
    ap.add_argument("--backend", default=None, choices=("nccl", "gloo"),
                    help="default: nccl with --device cuda, gloo with --device cpu")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cuda: cuda:LOCAL_RANK (default); cpu: a dry run on gloo")
    ap.add_argument("--timeout", type=float, default=None,
                    help="the process group's timeout in seconds (default 15 on nccl, 10 on "
                         "gloo)")
    ap.add_argument("--margin", type=float, default=10.0,
                    help="seconds past the timeout a healthy rank may take to raise")
    ap.add_argument("--grace", type=float, default=15.0,
                    help="seconds past timeout + margin the ranks have to exit")
    ap.add_argument("--startup", type=float, default=300.0,
                    help="seconds for start-up and the warm-up step (Triton compiles)")
    ap.add_argument("--jobs", type=int, default=None,
                    help="scenarios run at a time (default 1 on cuda, 3 on cpu)")
    ap.add_argument("--scenarios", default="", help="comma-separated names (default: all)")
    ap.add_argument("--no-blocking-wait", dest="blocking_wait", action="store_false",
                    help="leave TORCH_NCCL_BLOCKING_WAIT unset in the ranks (to see the "
                         "watchdog abort instead of an exception)")
    ap.add_argument("--cold", action="store_true",
                    help="no warm-up step on the group under test: the faults then hit its "
                         "first collectives")
    ap.add_argument("--async-wait", action="store_true",
                    help="issue every collective with async_op=True and wait on its work "
                         "(stands in for that change in lmfuse's collectives)")
    ap.add_argument("--cleanup", choices=("destroy", "abort", "exit"), default=None,
                    help="what a rank does after the run: destroy_process_group (default on "
                         "gloo), _abort_process_group (default on nccl), or nothing")
    ap.add_argument("--dump-stacks", type=float, default=0.0, metavar="SECONDS",
                    help="each rank prints its Python threads' stacks every SECONDS after "
                         "the warm-up (into its log; see --keep)")
    ap.add_argument("--keep", action="store_true", help="keep each scenario's logs and reports")
    ap.add_argument("--list", action="store_true", help="list the scenarios and exit")
    ap.add_argument("--out", help="write the JSON report here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--results", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.backend is None:
        args.backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cpu" and args.backend != "gloo":
        ap.error("--device cpu needs --backend gloo")
    if args.jobs is None:
        args.jobs = 1 if args.device == "cuda" else 3
    if args.cleanup is None:
        args.cleanup = "abort" if args.backend == "nccl" else "destroy"
    if args.timeout is None:
        args.timeout = 15.0 if args.backend == "nccl" else 10.0
    names = [n for n in args.scenarios.split(",") if n]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown scenarios {unknown}; --list lists them")
    args.selected = [BY_NAME[n] for n in names] if names else list(SCENARIOS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    if args.list:
        for s in SCENARIOS:
            print(f"{s.name:<20} {s.what}")
        return 0
    if "RANK" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:  # under torchrun
        if int(os.environ["RANK"]) != 0:
            return 0  # rank 0 starts every scenario's ranks itself
        args.world = args.world or int(os.environ["WORLD_SIZE"])
    world = args.world or 2
    if world not in (2, 4):
        print(f"run with 2 or 4 ranks, not {world}", file=sys.stderr)
        return 2
    began = time.time()
    flags = [f for f, on in (("--async-wait", args.async_wait), ("--cold", args.cold)) if on]
    print(f"faults: {len(args.selected)} scenario(s) on {world} {args.device} rank(s), backend "
          f"{args.backend}, timeout {args.timeout:g} s, TORCH_NCCL_BLOCKING_WAIT="
          f"{'1' if args.blocking_wait else 'unset'}, cleanup {args.cleanup}"
          + "".join(f", {f}" for f in flags), flush=True)
    results = run_scenarios(world, args.selected, args,
                            echo=lambda line: print(line, flush=True))
    failed = [r["name"] for r in results if r["status"] != "PASS"]
    seconds = time.time() - began
    print(f"{len(results) - len(failed)} of {len(results)} scenarios passed on {world} ranks "
          f"({args.backend}, timeout {args.timeout:g} s) in {seconds:.0f} s"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""), flush=True)
    if args.out:
        seen = next((r["versions"] for r in results if r["versions"].get("torch")), {})
        summary = dict(**seen, date=datetime.datetime.now().isoformat(timespec="seconds"),
                       host=platform.node(), world=world, backend=args.backend,
                       timeout_s=args.timeout, margin_s=args.margin, grace_s=args.grace,
                       blocking_wait=args.blocking_wait, async_wait=args.async_wait,
                       cold=args.cold, cleanup=args.cleanup, jobs=args.jobs,
                       env={k: os.environ.get(k) for k in ENV_SHOWN},
                       seconds=round(seconds, 1),
                       passed=len(results) - len(failed), failed=len(failed),
                       failed_scenarios=failed, scenarios=results)
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    return 1 if failed or not results else 0


if __name__ == "__main__":
    sys.exit(main())
