"""Sharded decode attention (``lmfuse.distributed``) on NCCL ranks: the checks of
``tests/distributed/test_sharded_decode.py`` (gloo, CPU tensors) on 2 or 4 GPUs, one per rank
(``cuda:LOCAL_RANK``)::

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 tests/gpu/sharded_decode_nccl.py --out n2.json
    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 4 tests/gpu/sharded_decode_nccl.py --out n4.json

Every rank builds the same full problem from one seed with the gloo module's helpers
(``full_problem`` draws it on the CPU and moves it to the rank's GPU), and computes the
single-GPU answers on the unsharded caches there: ``decode_attention`` on the Triton path and
the float32 reference (``impl="torch"``). It cuts its share with the gloo module's layouts
(``cp_shard``, ``kvdp_share``, ``layout``: contiguous or paged), runs the parallel op (on the
Triton path and on the reference path) and checks out and LSE against both answers within
``tests/helpers.py``'s tolerance for the output dtype (float32's for the LSE), and the
collectives each call issues against the counts the gloo tests assert.

Every KVDP decode (and KVDP append) runs with ``exchange="all_to_all"`` too, whose results
must equal the all-gather ones bit for bit, from all-to-alls only over the KVDP group.

Sections: ``cp``: CP over all ranks, the gloo ``CP_CASES`` plus longer and empty (0- and
1-token) sequences; ``kvdp``: KVDP over all ranks, ``KVDP_CASES`` plus the same (a rank
with no sequence when B < N); ``append``: CP and KVDP appends over two decoding steps, the
shards bitwise equal to the single-rank append cut the same way, then attention on them;
``grid`` (N = 4): KVDP x CP on a 2 x 2 grid, decode and append, and its check_ranks errors;
``errors``: the gloo module's ``check_bad_inputs`` (on each pair of ranks when N = 4). Head
dims 64 and 128; bf16, fp16 and fp32 caches (one float64 case on the reference path), fp8
caches with scales, sinks, GQA and MQA, s_active 1, 3 and 8.

It does not hang. After each case the ranks exchange their results (with the case's name
and the collectives each issued) over a gloo side group with a timeout. A case that fails
on some rank is reported and the run goes on while every rank issued the same collectives;
otherwise, or when a rank does not answer within ``--timeout`` seconds, every rank aborts
with a message (exit code 2; torchrun then stops any rank left). Rank 0 prints one line
per case (PASS/FAIL, largest error and its tolerance), ``--out`` writes a JSON summary, and
the exit code is 1 when a case failed.

Dry run on the CPU (gloo ranks, Triton interpreter)::

    TRITON_INTERPRET=1 torchrun --nproc_per_node 2 tests/gpu/sharded_decode_nccl.py \\
        --backend gloo --device cpu
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from collections.abc import Callable
from typing import Any

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (SHARP) communicators
os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # a timed-out rank exits

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

import test_sharded_decode as sd  # noqa: E402
from helpers import assert_close, max_rel_err, rel_err, tol  # noqa: E402
from spawn import count_collectives  # noqa: E402

from lmfuse.distributed import (cp_cache_append, cp_decode_attention,  # noqa: E402
                                cp_shard_seqlens, kvdp_batch_range, kvdp_cache_append,
                                kvdp_decode_attention)

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
I32, I64 = torch.int32, torch.int64
KERNEL_DTYPES = (F32, F16, BF16)
SECTIONS = ("cp", "kvdp", "append", "grid", "errors")

# Beyond the gloo cases: longer contexts (several KV tiles, several cp_blocks per rank),
# empty and one-token sequences, realistic GQA. (lens, s_active, hq, hkv, cp_block,
# block_len, dtype, fp8, sinks) as CP_CASES (less the impl).
CP_EXTRA = [
    ([0, 1, 5, 17], 1, 8, 2, 1, 16, BF16, False, True),
    ([0, 1, 9, 4], 1, 4, 4, 2, None, F16, False, False),
    ([1000, 3, 517, 64], 3, 32, 8, 16, 64, BF16, False, True),
    ([777, 8, 64, 2048], 8, 16, 2, 64, None, F16, True, False),
    ([300, 45, 130], 8, 8, 1, 32, 16, F32, True, True),
]
# (lens, s_active, hq_local, hkv, block_len, dtype, fp8, sinks): KVDP_CASES with lengths.
KVDP_EXTRA = [
    ([0, 1, 700], 1, 8, 2, 16, BF16, False, True),
    ([1, 0, 260, 33, 1], 1, 4, 1, None, F16, True, False),
    ([900, 8, 31, 444, 129, 64], 8, 4, 2, 32, F32, False, True),
]
# (B, s_new, block_len, dtype, fp8, D)
KVDP_APPENDS = [(3, 3, None, BF16, False, 128), (5, 2, 16, F32, True, 64),
                (4, 8, 8, F16, False, 128), (2, 1, None, F32, False, 64)]
# (s_new, cp_block, block_len, dtype, fp8, D)
CP_APPENDS = [(1, 1, None, BF16, False, 128), (3, 3, 4, F32, True, 64),
              (8, 16, 16, F16, False, 128), (3, 2, 8, BF16, True, 64),
              (1, 4, None, F32, True, 128)]
# (lens, s_active, hq_local, hkv, cp_block, block_len, dtype, fp8, sinks): hkv KV heads in
# all, the caches of a KVDP rank's sequences holding all of them.
GRID_CASES = [
    ([14, 3, 21], 3, 2, 2, 2, None, F32, False, True),
    ([9, 22, 8, 17, 12], 8, 2, 2, 4, 4, F32, True, True),
    ([4, 1, 15, 7], 1, 1, 2, 3, 3, F16, False, False),
    ([0, 1, 600, 1333, 77], 1, 8, 2, 16, 32, BF16, False, True),
    ([512, 9, 1100], 3, 4, 1, 64, None, BF16, True, False),
]


def fmt_dtype(dtype: torch.dtype) -> str:
    return str(dtype)[6:]


def describe(lens: Any, s: int, heads: str, layout: int | None, dtype: torch.dtype,
             fp8: bool = False, sinks: bool = False) -> str:
    shown = lens if len(str(lens)) <= 40 else f"{str(lens)[:37]}..."
    return (f"lens={shown} s={s} {heads} {'contig' if layout is None else f'paged{layout}'} "
            f"{fmt_dtype(dtype)}{' fp8' if fp8 else ''}{' sinks' if sinks else ''}")


# --- one case on every rank ------------------------------------------------------------------


class Checks:
    """One case's comparisons on this rank. A failed comparison is recorded, not raised, so
    the rank still issues the case's later collectives (the other ranks expect them)."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.errors: dict[str, tuple[float, float]] = {}  # label -> (error, tolerance)
        self.bitwise = 0

    def check(self, what: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # pytest.raises' "DID NOT RAISE" is a BaseException
            self.failures.append(f"[{what}] {type(e).__name__}: {e}")

    def close(self, what: str, label: str, got: torch.Tensor, want: torch.Tensor,
              dtype: torch.dtype) -> None:
        """``assert_close(got, want, dtype)``, the larger of its two metrics noted as ``label``."""
        def run() -> None:
            if isinstance(got, torch.Tensor) and got.shape == want.shape:
                fin = torch.isfinite(want)
                err = max(rel_err(got[fin], want[fin]), max_rel_err(got[fin], want[fin]))
                err = math.inf if math.isnan(err) else err
                old = self.errors.get(label, (0.0, tol(dtype)))
                self.errors[label] = max(old, (err, tol(dtype)), key=lambda e: e[0] / e[1])
            assert_close(got, want, dtype, what)

        self.check(what, run)

    def same_bits(self, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        def run() -> None:
            assert got.shape == want.shape and got.dtype == want.dtype, (
                f"{tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}")
            a, b = got.view(torch.uint8), want.view(torch.uint8)
            assert torch.equal(a, b), f"{what}: {int((a != b).sum())} bytes differ"
            self.bitwise += 1

        self.check(what, run)


class Runner:
    """Runs cases on every rank in lockstep and reports them on rank 0."""

    def __init__(self, rank: int, world: int, status_group: Any, args: Any,
                 device: torch.device) -> None:
        self.rank, self.world, self.status_group = rank, world, status_group
        self.args, self.device = args, device
        self.results: list[dict[str, Any]] = []
        self.start = time.perf_counter()

    def case(self, section: str, name: str, fn: Callable[[Checks], None]) -> None:
        """``fn(checks)`` on every rank: it issues the case's collectives and compares through
        ``checks``; an exception out of it fails the case on this rank."""
        if self.args.filter and self.args.filter not in name:
            return
        c, raised = Checks(), None
        t0 = time.perf_counter()
        with count_collectives() as calls:
            try:
                fn(c)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException:  # pytest.raises' "DID NOT RAISE" is a BaseException
                raised = traceback.format_exc(limit=-4).strip()
        mine = dict(name=name, raised=raised, failures=c.failures, errors=c.errors,
                    bitwise=c.bitwise, calls=list(calls), seconds=time.perf_counter() - t0)
        every: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(every, mine, group=self.status_group)
        except Exception as e:
            self.abort(f"the ranks did not all report after case {name!r} within "
                       f"{self.args.timeout}s (a rank hung or died): {e}")
        self.record(section, name, every)

    def record(self, section: str, name: str, every: list[dict[str, Any]]) -> None:
        failed = [r for r, s in enumerate(every) if s["raised"] or s["failures"]]
        errors: dict[str, tuple[float, float]] = {}
        for s in every:
            for label, e in s["errors"].items():
                errors[label] = max(errors.get(label, e), e, key=lambda x: x[0] / x[1])
        messages = {r: ([every[r]["raised"]] if every[r]["raised"] else []) + every[r]["failures"]
                    for r in failed}
        result = dict(section=section, name=name, status="FAIL" if failed else "PASS",
                      failed_ranks=failed, errors=errors, bitwise=every[0]["bitwise"],
                      collectives=every[0]["calls"], messages=messages,
                      seconds=max(s["seconds"] for s in every))
        self.results.append(result)
        if self.rank == 0:
            print(self.line(result), flush=True)
            for r in failed:
                for m in messages[r][:4]:
                    print(f"    rank {r}: " + m.replace("\n", "\n      ")[:3000], flush=True)
        names = [s["name"] for s in every]
        if len(set(names)) > 1:
            self.abort(f"the ranks ran different cases ({names}): out of step")
        calls = [s["calls"] for s in every]
        if any(c != calls[0] for c in calls):
            self.abort(f"in case {name!r} the ranks issued different collectives "
                       f"({dict(enumerate(calls))}): the process group is out of step")

    @staticmethod
    def line(r: dict[str, Any]) -> str:
        parts = [f"{r['status']} [{r['section']}] {r['name']}"]
        by_kind: dict[str, tuple[float, float]] = {}
        for label, e in r["errors"].items():
            kind = label.split("~")[0]
            by_kind[kind] = max(by_kind.get(kind, e), e, key=lambda x: x[0] / x[1])
        errs = [f"{k} err {e:.2e} (tol {t:.1e})" for k, (e, t) in sorted(by_kind.items())]
        if r["bitwise"]:
            errs.append(f"{r['bitwise']} bitwise")
        if errs:
            parts.append(", ".join(errs))
        parts.append(f"{len(r['collectives'])} coll")
        if r["failed_ranks"]:
            parts.append(f"failed on rank(s) {r['failed_ranks']}")
        return " | ".join(parts)

    def summary(self, aborted: str | None = None) -> dict[str, Any]:
        failed = [r["name"] for r in self.results if r["status"] == "FAIL"]
        cuda = self.device.type == "cuda"
        return dict(
            script="tests/gpu/sharded_decode_nccl.py", command=sys.argv, world_size=self.world,
            backend=dist.get_backend(), device=torch.cuda.get_device_name(self.device)
            if cuda else platform.processor() or "cpu",
            torch=torch.__version__, triton=_triton_version(),
            cuda=torch.version.cuda, date=datetime.datetime.now().isoformat(timespec="seconds"),
            seconds=round(time.perf_counter() - self.start, 1), cases=len(self.results),
            passed=len(self.results) - len(failed), failed=len(failed), failed_cases=failed,
            aborted=aborted, results=self.results)

    def write(self, aborted: str | None = None) -> None:
        if self.rank == 0 and self.args.out:
            Path(self.args.out).write_text(json.dumps(self.summary(aborted), indent=1) + "\n")

    def abort(self, message: str) -> None:
        print(f"[rank {self.rank}] ABORT: {message}", file=sys.stderr, flush=True)
        self.write(aborted=message)
        sys.stdout.flush()
        os._exit(2)  # no destroy_process_group: a collective may still be pending

    def section(self, name: str, fn: Callable[[], None]) -> None:
        """Runs a section's cases; an error outside them is reported as a case of its own
        (the ranks abort unless all of them stopped there)."""
        try:
            fn()
        except Exception:
            tb = traceback.format_exc(limit=-4).strip()

            def stopped(c: Checks) -> None:
                raise RuntimeError(f"section {name} stopped outside a case:\n{tb}")

            self.case(name, f"{name}: stopped outside a case", stopped)


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


# --- shared checks ---------------------------------------------------------------------------


def answers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor,
            **kw: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The single-GPU ``decode_attention`` on the unsharded caches: the Triton path (for the
    kernel dtypes) and the float32 reference."""
    res = {"torch": lmfuse.decode_attention(q, k, v, lens, return_lse=True, impl="torch", **kw)}
    if q.dtype in KERNEL_DTYPES:
        res["triton"] = lmfuse.decode_attention(q, k, v, lens, return_lse=True, impl="triton",
                                                **kw)
    return res


def from_problem(p: dict[str, Any]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    res = {"torch": (p["want"], p["want_lse"])}
    if p["q"].dtype in KERNEL_DTYPES:
        res["triton"] = lmfuse.decode_attention(
            p["q"], p["k"], p["v"], p["lens"], sinks=p["sinks"], k_scale=p["k_scale"],
            v_scale=p["v_scale"], return_lse=True, impl="triton")
    return res


def compare(c: Checks, got: Any, want: dict[str, Any], heads: slice, dtype: torch.dtype,
            calls: list[str], n_gathers: int, n_reduces: int, lse: bool = True) -> None:
    """The op's ``(out, lse)`` (or ``out``) against every single-GPU answer (its ``heads``),
    and the collectives it issued."""
    c.check("collectives", lambda: sd.assert_collectives(calls, n_gathers, n_reduces))
    out, out_lse = got if lse else (got, None)
    c.check("dtypes", lambda: sd.assert_equal(
        (out.dtype, None if out_lse is None else out_lse.dtype),
        (dtype, None if out_lse is None else want["torch"][1].dtype)))
    for name, (w, w_lse) in want.items():
        c.close(f"out vs {name}", f"out~{name}", out, w[:, :, heads], dtype)
        if lse:
            c.close(f"lse vs {name}", f"lse~{name}", out_lse, w_lse[:, :, heads], w_lse.dtype)


def paths(dtype: torch.dtype, chosen: list[str]) -> list[str]:
    """The parallel op's paths for ``dtype``: float64 only runs the reference ("auto")."""
    return ["auto"] if dtype == F64 else chosen


# --- context parallelism ---------------------------------------------------------------------


def cp_decode_case(c: Checks, *, rank: int, world: int, group: Any, device: torch.device,
                   seed: int, case: tuple, D: int, impl: str, given: bool,
                   index_dtype: torch.dtype) -> None:
    lens, s, hq, hkv, blk, bl, dtype, fp8, sinks = case
    p = sd.full_problem(seed, lens, s, hq, hkv, max(24, max(lens)), dtype, fp8, sinks,
                        head_dim=D, device=device)
    want = from_problem(p)
    k, v, table = sd.cp_shard(p, rank, world, blk, bl, seed)
    local = sd.cp_counts(p["lens"], rank, world, blk, index_dtype)
    extra = dict(cache_seqlens=p["lens"]) if given else {}
    with count_collectives() as calls:
        got = cp_decode_attention(p["q"], k, v, local, group=group, block_table_shard=table,
                                  cp_block=blk, sinks=p["sinks"], k_scale=p["k_scale"],
                                  v_scale=p["v_scale"], return_lse=True, impl=impl, **extra)
    compare(c, got, want, slice(None), dtype, calls, 1, sd.lens_reduces(given, p["q"]))
    counts = cp_shard_seqlens(p["lens"], group=group, cp_block=blk)
    c.check("cp_shard_seqlens", lambda: sd.assert_equal(
        counts.tolist(), sd.cp_local_lens(lens, rank, world, blk)))
    # Without return_lse, with split keys: the output alone, from the same collectives.
    with count_collectives() as calls:
        out = cp_decode_attention(p["q"], k, v, local, group=group, block_table_shard=table,
                                  cp_block=blk, sinks=p["sinks"], k_scale=p["k_scale"],
                                  v_scale=p["v_scale"], num_splits=2, impl=impl, **extra)
    compare(c, out, want, slice(None), dtype, calls, 1, sd.lens_reduces(given, p["q"]),
            lse=False)


def cp_section(run: Runner, rank: int, world: int, group: Any, device: torch.device,
               args: Any) -> None:
    cases = [(*case[:-1], 100 + i) for i, case in enumerate(sd.CP_CASES)]
    cases += [(*case, 150 + i) for i, case in enumerate(CP_EXTRA)]
    n = 0
    for *case, seed in cases:
        lens, s, hq, hkv, blk, bl, dtype, fp8, sinks = case
        for D in args.head_dims:
            for impl in paths(dtype, args.paths):
                given = n % 2 == 0  # the global lengths every other call: no all-reduce then
                index_dtype = I32 if n % 3 else I64
                n += 1
                what = describe(lens, s, f"hq={hq} hkv={hkv}", bl, dtype, fp8, sinks)
                name = (f"cp{world} {what} cp_block={blk} D={D} {impl}"
                        f" {'cache_seqlens' if given else 'counts only'}")
                run.case("cp", name, functools.partial(
                    cp_decode_case, rank=rank, world=world, group=group, device=device,
                    seed=seed, case=tuple(case), D=D, impl=impl, given=given,
                    index_dtype=index_dtype))


# --- KV data parallelism ---------------------------------------------------------------------


def kvdp_decode_case(c: Checks, *, rank: int, world: int, group: Any, device: torch.device,
                     seed: int, case: tuple, D: int, impl: str) -> None:
    lens, s, hq_local, hkv, bl, dtype, fp8, sinks = case
    B = len(lens)
    p = sd.full_problem(seed, lens, s, hq_local * world, hkv, max(20, max(lens)), dtype, fp8,
                        sinks, head_dim=D, device=device)
    want = from_problem(p)
    q, k, v, local_lens, table, heads, rows = sd.kvdp_share(p, B, rank, world, hq_local, bl,
                                                            seed)
    c.check("kvdp_batch_range", lambda: sd.assert_equal(
        list(range(*kvdp_batch_range(B, group))), rows))
    kw = dict(block_table_local=table, sinks=p["sinks"], k_scale=p["k_scale"],
              v_scale=p["v_scale"], impl=impl)
    with count_collectives() as calls:
        got = kvdp_decode_attention(q, k, v, local_lens, group=group, return_lse=True, **kw)
    compare(c, got, want, heads, dtype, calls, 2, 0)
    with count_collectives() as calls:  # cache_seqlens: unused without cp_group
        out = kvdp_decode_attention(q, k, v, local_lens, group=group, num_splits=3,
                                    cache_seqlens=local_lens, **kw)
    compare(c, out, want, heads, dtype, calls, 2, 0, lse=False)
    # exchange="all_to_all": two all-to-alls instead, the same results bit for bit.
    with count_collectives() as calls:
        got_a2a = kvdp_decode_attention(q, k, v, local_lens, group=group, return_lse=True,
                                        exchange="all_to_all", **kw)
        out_a2a = kvdp_decode_attention(q, k, v, local_lens, group=group, num_splits=3,
                                        cache_seqlens=local_lens, exchange="all_to_all", **kw)
    same_as_all_gather(c, calls, 4, [*got_a2a, out_a2a], [*got, out])


def same_as_all_gather(c: Checks, calls: list[str], n_all_to_alls: int,
                       got: list[torch.Tensor], want: list[torch.Tensor], n_gathers: int = 0,
                       n_reduces: int = 0) -> None:
    """The ``exchange="all_to_all"`` results ``got`` equal the all-gather ones ``want`` bit
    for bit, from ``n_all_to_alls`` all-to-alls (and the given others)."""
    c.check("all_to_all collectives", lambda: sd.assert_collectives(
        calls, n_gathers, n_reduces, n_all_to_alls=n_all_to_alls))
    for n, (a, b) in enumerate(zip(got, want)):
        c.same_bits(f"all_to_all result {n} == all_gather's", a.contiguous(), b.contiguous())


def kvdp_section(run: Runner, rank: int, world: int, group: Any, device: torch.device,
                 args: Any) -> None:
    cases = []
    for i, (B, s, hq_local, hkv, bl, dtype, fp8, sinks, _) in enumerate(sd.KVDP_CASES):
        g = torch.Generator().manual_seed(11 + i)
        lens = torch.randint(s, 20, (B,), generator=g).tolist()
        cases.append(((lens, s, hq_local, hkv, bl, dtype, fp8, sinks), 200 + i))
    cases += [(case, 250 + i) for i, case in enumerate(KVDP_EXTRA)]
    for case, seed in cases:
        lens, s, hq_local, hkv, bl, dtype, fp8, sinks = case
        for D in args.head_dims:
            for impl in paths(dtype, args.paths):
                what = describe(lens, s, f"hq={hq_local}x{world} hkv={hkv}", bl, dtype, fp8,
                                sinks)
                name = f"kvdp{world} B={len(lens)} {what} D={D} {impl}"
                run.case("kvdp", name, functools.partial(
                    kvdp_decode_case, rank=rank, world=world, group=group, device=device,
                    seed=seed, case=case, D=D, impl=impl))


# --- appends ---------------------------------------------------------------------------------


def cp_append_case(c: Checks, *, rank: int, world: int, group: Any, device: torch.device,
                   seed: int, case: tuple, impl: str) -> None:
    """Two decoding steps: append ``s`` tokens (cp_cache_append; the single-GPU
    kv_cache_append on the full cache), then attend. After each append the shard equals the
    full cache cut by the layout (same block ids), bit for bit."""
    s, blk, bl, dtype, fp8, D = case
    start, steps = [5, 0, 37, 1], 2
    s_max = max(start) + s * steps + 3
    p = sd.full_problem(seed, start, s, 4, 2, s_max, dtype, fp8, head_dim=D, device=device)
    g = torch.Generator().manual_seed(seed + 1)
    new_k = torch.randn((steps, len(start), s, 2, D), generator=g).to(dtype).to(device)
    new_v = torch.randn((steps, len(start), s, 2, D), generator=g).to(dtype).to(device)
    own = sd.cp_positions(rank, world, blk, s_max)
    final = sd.cp_local_lens([n + s * steps for n in start], rank, world, blk)
    full_k, full_v = p["k"].clone(), p["v"].clone()
    # The shard's capacity covers the final lengths; paged: blocks reserved for them.
    k, v, table = sd.layout(full_k[:, own].clone(), full_v[:, own].clone(), final, bl, seed)
    lens = p["lens"].clone()
    kw = dict(k_scale=p["k_scale"], v_scale=p["v_scale"])
    for step in range(steps):
        lmfuse.kv_cache_append(full_k, full_v, new_k[step], new_v[step], lens, impl=impl, **kw)
        with count_collectives() as calls:
            cp_cache_append(k, v, new_k[step], new_v[step], lens, group=group,
                            block_table_shard=table, cp_block=blk, impl=impl, **kw)
        c.check(f"step {step}: append collectives", lambda calls=calls: sd.assert_equal(
            calls, []))
        want_k, want_v, _ = sd.layout(full_k[:, own], full_v[:, own], final, bl, seed)
        c.same_bits(f"step {step}: k shard", k, want_k)
        c.same_bits(f"step {step}: v shard", v, want_v)
        lens = lens + s
        given = dict(cache_seqlens=lens) if step == 1 else {}
        with count_collectives() as calls:
            got = cp_decode_attention(p["q"], k, v, sd.cp_counts(lens, rank, world, blk),
                                      group=group, block_table_shard=table, cp_block=blk,
                                      return_lse=True, impl=impl, **given, **kw)
        compare(c, got, answers(p["q"], full_k, full_v, lens, **kw), slice(None), dtype, calls,
                1, sd.lens_reduces(given, p["q"]))


def kvdp_append_case(c: Checks, *, rank: int, world: int, group: Any, device: torch.device,
                     seed: int, case: tuple, impl: str) -> None:
    """Each rank gives its KV head (of ``world``) for every sequence; its own sequences'
    caches must come out as the single-GPU append's rows, bit for bit; then the active
    tokens (the appended ones) attend over them."""
    B, s, bl, dtype, fp8, D = case
    hkv = world
    lens = torch.randint(0, 40, (B,), generator=torch.Generator().manual_seed(seed)).tolist()
    p = sd.full_problem(seed, lens, s, 2 * hkv, hkv, 60, dtype, fp8, head_dim=D,
                        device=device)
    g = torch.Generator().manual_seed(seed + 1)
    new_k = torch.randn((B, s, hkv, D), generator=g).to(dtype).to(device)
    new_v = torch.randn((B, s, hkv, D), generator=g).to(dtype).to(device)
    full_k, full_v = p["k"].clone(), p["v"].clone()
    kw = dict(k_scale=p["k_scale"], v_scale=p["v_scale"], impl=impl)
    lmfuse.kv_cache_append(full_k, full_v, new_k, new_v, p["lens"], **kw)
    rows = torch.tensor_split(torch.arange(B), world)[rank].tolist()
    after = p["lens"][rows] + s
    k, v, table = sd.layout(p["k"][rows], p["v"][rows], after.tolist(), bl, seed + rank)
    mine = slice(rank, rank + 1)
    with count_collectives() as calls:
        kvdp_cache_append(k, v, new_k[:, :, mine], new_v[:, :, mine], p["lens"][rows],
                          group=group, block_table_local=table, **kw)
    c.check("append collectives", lambda: sd.assert_collectives(calls, 1))
    want_k, want_v, _ = sd.layout(full_k[rows], full_v[rows], after.tolist(), bl, seed + rank)
    c.same_bits("k cache", k, want_k)
    c.same_bits("v cache", v, want_v)
    # exchange="all_to_all": the same caches from one all-to-all.
    k2, v2, _ = sd.layout(p["k"][rows], p["v"][rows], after.tolist(), bl, seed + rank)
    with count_collectives() as calls:
        kvdp_cache_append(k2, v2, new_k[:, :, mine], new_v[:, :, mine], p["lens"][rows],
                          group=group, block_table_local=table, exchange="all_to_all", **kw)
    c.check("append all_to_all collectives", lambda: sd.assert_collectives(
        calls, 0, n_all_to_alls=1))
    c.same_bits("k cache (all_to_all)", k2, want_k)
    c.same_bits("v cache (all_to_all)", v2, want_v)
    heads = slice(2 * rank, 2 * rank + 2)
    with count_collectives() as calls:
        got = kvdp_decode_attention(p["q"][:, :, heads], k, v, after, group=group,
                                    block_table_local=table, return_lse=True, **kw)
    compare(c, got, answers(p["q"], full_k, full_v, p["lens"] + s, k_scale=p["k_scale"],
                            v_scale=p["v_scale"]), heads, dtype, calls, 2, 0)


def append_section(run: Runner, rank: int, world: int, group: Any, device: torch.device,
                   args: Any) -> None:
    for i, case in enumerate(CP_APPENDS):
        s, blk, bl, dtype, fp8, D = case
        for impl in args.paths:
            name = (f"cp{world} append+decode x2 s={s} cp_block={blk} "
                    f"{'contig' if bl is None else f'paged{bl}'} {fmt_dtype(dtype)}"
                    f"{' fp8' if fp8 else ''} D={D} {impl}")
            run.case("append", name, functools.partial(
                cp_append_case, rank=rank, world=world, group=group, device=device,
                seed=300 + 10 * i, case=case, impl=impl))
    for i, case in enumerate(KVDP_APPENDS):
        B, s, bl, dtype, fp8, D = case
        for impl in args.paths:
            name = (f"kvdp{world} append+decode B={B} s={s} "
                    f"{'contig' if bl is None else f'paged{bl}'} {fmt_dtype(dtype)}"
                    f"{' fp8' if fp8 else ''} D={D} {impl}")
            run.case("append", name, functools.partial(
                kvdp_append_case, rank=rank, world=world, group=group, device=device,
                seed=600 + 10 * i, case=case, impl=impl))


# --- KVDP x CP grid (N = 4) ------------------------------------------------------------------


def grid_decode_case(c: Checks, *, rank: int, kvdp: Any, cp: Any, device: torch.device,
                     seed: int, case: tuple, D: int, impl: str, given: bool) -> None:
    """Rank ``2 * i + j``: KVDP rank ``i`` (groups {0, 2}, {1, 3}), CP rank ``j`` (groups
    {0, 1}, {2, 3}): heads and sequences split over KVDP, context over CP."""
    lens, s, hq_local, hkv, blk, bl, dtype, fp8, sinks = case
    i, j = rank // 2, rank % 2
    B = len(lens)
    p = sd.full_problem(seed, lens, s, hq_local * 2, hkv, max(22, max(lens)), dtype, fp8,
                        sinks, head_dim=D, device=device)
    want = from_problem(p)
    rows = torch.tensor_split(torch.arange(B), 2)[i].tolist()
    sub = dict(k=p["k"][rows], v=p["v"][rows], lens=p["lens"][rows])
    k, v, table = sd.cp_shard(sub, j, 2, blk, bl, seed + 10 * i)
    heads = slice(i * hq_local, (i + 1) * hq_local)
    local = sd.cp_counts(sub["lens"], j, 2, blk)
    extra = dict(cache_seqlens=sub["lens"]) if given else {}
    with count_collectives() as calls:
        got = kvdp_decode_attention(p["q"][:, :, heads], k, v, local, group=kvdp,
                                    block_table_local=table, cp_group=cp, cp_block=blk,
                                    sinks=p["sinks"], k_scale=p["k_scale"],
                                    v_scale=p["v_scale"], return_lse=True, impl=impl, **extra)
    compare(c, got, want, heads, dtype, calls, 3, sd.lens_reduces(given, p["q"]))
    with count_collectives() as calls:
        got_a2a = kvdp_decode_attention(p["q"][:, :, heads], k, v, local, group=kvdp,
                                        block_table_local=table, cp_group=cp, cp_block=blk,
                                        sinks=p["sinks"], k_scale=p["k_scale"],
                                        v_scale=p["v_scale"], return_lse=True, impl=impl,
                                        exchange="all_to_all", **extra)
    same_as_all_gather(c, calls, 2, list(got_a2a), list(got), 1,
                       sd.lens_reduces(given, p["q"]))


def grid_append_case(c: Checks, *, rank: int, kvdp: Any, cp: Any, device: torch.device,
                     seed: int, case: tuple, impl: str) -> Any:
    """Two decoding steps on the grid: append (kvdp_cache_append with cp_group; the shard
    bitwise equal to the single-GPU append's cut), then attend; the global lengths given to
    the append in step 1, to the attention in step 0. Returns what the error cases use."""
    B, s, blk, bl, dtype, fp8, D = case
    i, j = rank // 2, rank % 2
    start, steps = [6, 0, 9, 1, 40], 2
    s_max = max(start) + s * steps + 3
    lens = torch.tensor(start, dtype=I32, device=device)
    p = sd.full_problem(seed, start, s, 4, 2, s_max, dtype, fp8, head_dim=D, device=device)
    g = torch.Generator().manual_seed(seed + 1)
    full_k, full_v = p["k"].clone(), p["v"].clone()
    rows = torch.tensor_split(torch.arange(B), 2)[i].tolist()
    own = sd.cp_positions(j, 2, blk, s_max)
    final = sd.cp_local_lens([start[r] + s * steps for r in rows], j, 2, blk)
    k, v, table = sd.layout(full_k[rows][:, own], full_v[rows][:, own], final, bl, seed + i)
    kv_heads, heads = slice(i, i + 1), slice(2 * i, 2 * i + 2)
    kw = dict(k_scale=p["k_scale"], v_scale=p["v_scale"], impl=impl)
    for step in range(steps):
        new_k = torch.randn((B, s, 2, D), generator=g).to(dtype).to(device)
        new_v = torch.randn((B, s, 2, D), generator=g).to(dtype).to(device)
        lmfuse.kv_cache_append(full_k, full_v, new_k, new_v, lens, **kw)
        given = dict(cache_seqlens=lens[rows]) if step == 1 else {}
        with count_collectives() as calls:
            kvdp_cache_append(k, v, new_k[:, :, kv_heads], new_v[:, :, kv_heads],
                              sd.cp_counts(lens[rows], j, 2, blk), group=kvdp,
                              block_table_local=table, cp_group=cp, cp_block=blk, **kw,
                              **given)
        c.check(f"step {step}: append collectives", lambda calls=calls, step=step: (
            sd.assert_collectives(calls, 1, 1 - step)))
        want_k, want_v, _ = sd.layout(full_k[rows][:, own], full_v[rows][:, own], final, bl,
                                      seed + i)
        c.same_bits(f"step {step}: k shard", k, want_k)
        c.same_bits(f"step {step}: v shard", v, want_v)
        lens = lens + s
        given = dict(cache_seqlens=lens[rows]) if step == 0 else {}
        with count_collectives() as calls:
            got = kvdp_decode_attention(p["q"][:, :, heads], k, v,
                                        sd.cp_counts(lens[rows], j, 2, blk), group=kvdp,
                                        block_table_local=table, cp_group=cp, cp_block=blk,
                                        return_lse=True, **kw, **given)
        compare(c, got, answers(p["q"], full_k, full_v, lens, k_scale=p["k_scale"],
                                v_scale=p["v_scale"]), heads, dtype, calls, 3,
                step if s > 1 else 0)
    return p["q"][:, :, heads], k, v, table, lens[rows], blk


def grid_section(run: Runner, rank: int, groups: dict[str, Any], device: torch.device,
                 args: Any) -> None:
    kvdp, cp = groups["kvdp"], groups["cp"]
    n = 0
    for m, case in enumerate(GRID_CASES):
        lens, s, hq_local, hkv, blk, bl, dtype, fp8, sinks = case
        for D in args.head_dims:
            for impl in paths(dtype, args.paths):
                given = n % 2 == 0
                n += 1
                what = describe(lens, s, f"hq={hq_local}x2 hkv={hkv}", bl, dtype, fp8, sinks)
                name = (f"grid 2x2 B={len(lens)} {what} cp_block={blk} D={D} {impl}"
                        f" {'cache_seqlens' if given else 'counts only'}")
                run.case("grid", name, functools.partial(
                    grid_decode_case, rank=rank, kvdp=kvdp, cp=cp, device=device,
                    seed=800 + m, case=case, D=D, impl=impl, given=given))
    kept: list[Any] = []
    for m, case in enumerate([(5, 3, 2, None, F32, False, 128), (5, 8, 16, 8, BF16, True, 64),
                              (5, 1, 3, 4, F16, False, 128)]):
        B, s, blk, bl, dtype, fp8, D = case
        for impl in args.paths:
            name = (f"grid 2x2 append+decode x2 B={B} s={s} cp_block={blk} "
                    f"{'contig' if bl is None else f'paged{bl}'} {fmt_dtype(dtype)}"
                    f"{' fp8' if fp8 else ''} D={D} {impl}")

            def body(c: Checks, case=case, impl=impl, m=m) -> None:
                kept[:] = [grid_append_case(c, rank=rank, kvdp=kvdp, cp=cp, device=device,
                                            seed=950 + 10 * m, case=case, impl=impl)]

            run.case("grid", name, body)

    # Bad input on one rank of the grid, with check_ranks: all four ranks raise (the bad
    # rank's KVDP column over KVDP, then every row over CP), none waits.
    if not kept:
        return
    q, k, v, table, lens, blk = kept[0]
    j = rank % 2
    good = sd.cp_counts(lens, j, 2, blk)
    bad = good[:0] if rank == 0 else good
    kw = dict(group=kvdp, cp_group=cp, cp_block=blk, block_table_local=table, check_ranks=True)
    checks = AsCases(run)
    sd.raises(checks, "grid seqlens_local bad on rank 0", lambda: kvdp_decode_attention(
        q, k, v, bad, **kw), ValueError, r"seqlens_local must be \[B_r=3\]" if rank == 0 else
        r"rank 0 of the group rejected its inputs.*seqlens_local must be", 2)
    sd.raises(checks, "grid global lengths as seqlens_local", lambda: kvdp_decode_attention(
        q, k, v, lens, cache_seqlens=lens, **kw), ValueError,
        rf"seqlens_local\[\d\] = \d+ is not rank {j}'s share", 2)


class AsCases:
    """The ``f`` of the gloo module's ``raises`` and ``check_bad_inputs``: each of its checks
    becomes a case of the runner."""

    def __init__(self, run: Runner, prefix: str = "") -> None:
        self.run, self.prefix = run, prefix

    def check(self, what: str, fn: Callable[[], None]) -> None:
        self.run.case("errors", self.prefix + what, lambda c: fn())


# --- main ------------------------------------------------------------------------------------


def parse_args() -> Any:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write a JSON summary here (rank 0)")
    ap.add_argument("--backend", default="nccl", help="process group backend (default nccl)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cuda: cuda:LOCAL_RANK (default); cpu: a dry run with --backend gloo")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds a collective (and the per-case exchange) may wait")
    ap.add_argument("--head-dims", default="64,128", help="head dims of the decode cases")
    ap.add_argument("--paths", default="triton,torch",
                    help="impl of the parallel ops (comma-separated)")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"which of {','.join(SECTIONS)} to run")
    ap.add_argument("--filter", default="", help="only cases whose name contains this")
    args = ap.parse_args()
    args.head_dims = [int(x) for x in args.head_dims.split(",")]
    args.paths = [x for x in args.paths.split(",") if x]
    args.sections = [x for x in args.sections.split(",") if x]
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}")
    return args


def main() -> int:
    args = parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if world not in (2, 4):
        print(f"[rank {rank}] run with 2 or 4 ranks, not {world}", file=sys.stderr)
        return 2
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference stays float32
    else:
        device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=args.timeout)
    extra = dict(device_id=device) if args.backend == "nccl" else {}
    dist.init_process_group(args.backend, timeout=timeout, **extra)
    # Every rank creates every group, in one order (new_group is collective over the world).
    status = dist.new_group(backend="gloo", timeout=timeout)
    groups: dict[str, Any] = {"pair": dist.group.WORLD}
    if world == 4:  # rank 2 * i + j: KVDP rank i of column j, CP rank j of pair (row) i
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        columns = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        groups = {"pair": pairs[rank // 2], "cp": pairs[rank // 2], "kvdp": columns[rank % 2]}
    world_group = dist.group.WORLD
    run = Runner(rank, world, status, args, device)
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(f"sharded decode on {world} x {name}, backend {args.backend}, torch "
              f"{torch.__version__}, triton {_triton_version()}", flush=True)
    with torch.no_grad():
        if "cp" in args.sections:
            run.section("cp", lambda: cp_section(run, rank, world, world_group, device, args))
        if "kvdp" in args.sections:
            run.section("kvdp", lambda: kvdp_section(run, rank, world, world_group, device,
                                                     args))
        if "append" in args.sections:
            run.section("append", lambda: append_section(run, rank, world, world_group,
                                                         device, args))
        if "grid" in args.sections and world == 4:
            run.section("grid", lambda: grid_section(run, rank, groups, device, args))
    if "errors" in args.sections:
        # Two-rank cases: on the world, or on each pair {0, 1}, {2, 3} at once.
        prefix = "" if world == 2 else "pairs {0,1} {2,3}: "
        run.section("errors", lambda: sd.check_bad_inputs(AsCases(run, prefix), groups["pair"],
                                                          device))
    failed = [r for r in run.results if r["status"] == "FAIL"]
    if rank == 0:
        print(f"{len(run.results) - len(failed)} of {len(run.results)} cases passed on "
              f"{world} ranks in {time.perf_counter() - run.start:.0f} s"
              + (f"; FAILED: {len(failed)}" if failed else ""), flush=True)
    run.write()
    dist.barrier(group=status)
    dist.destroy_process_group()
    return 1 if failed or not run.results else 0


if __name__ == "__main__":
    sys.exit(main())
