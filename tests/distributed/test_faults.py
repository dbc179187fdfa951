"""Faults on gloo ranks: a rank that raises mid-step makes every rank raise, within the
process group's timeout, and nothing hangs (``tests/gpu/faults_nccl.py``'s scenarios, on
the CPU).

The scenarios and their machinery are ``tests/gpu/faults_nccl.py``'s (run there on NCCL):
each scenario starts fresh rank processes (here forked from ``spawn``'s fork server, its
modules preloaded, with torchrun's environment, the Triton interpreter on, one thread;
on the GPU new interpreters), with a 5 s process-group timeout; a step of
``kvdp_decode_attention``, ``cp_decode_attention`` and vocabulary-parallel
``cross_entropy`` forward and backward, in which one rank raises (at a given collective
of an op, between two ops, or in the backward); every rank reports what it raised and
when, and a rank still alive at the deadline is killed and reported as a hang. Not
``spawn_gloo``: it gives the ranks no process-group timeout, counts a raising rank as a
failure, and cannot let a rank's process die as part of a scenario.

The scenarios of a test run side by side (they mostly wait out the timeout), so the
whole file takes about 30 s on 2 cores.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import spawn

TIMEOUT = 5.0  # the ranks' process-group timeout, seconds
MARGIN = 5.0  # how much later than that a healthy rank may raise (CPU contention)


def _load_faults() -> ModuleType:
    """``tests/gpu/faults_nccl.py`` as a module (``tests/gpu`` is no package)."""
    path = Path(__file__).resolve().parent.parent / "gpu" / "faults_nccl.py"
    name = "faults_nccl"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


faults = _load_faults()
# The ranks fork from spawn_gloo's fork server (torch, transformers and lmfuse imported once)
# instead of starting interpreters that import them each: seconds of CPU a rank.
faults.LAUNCH = spawn.fork_main


def _args(jobs: int) -> argparse.Namespace:
    return faults.parse_args(["--backend", "gloo", "--device", "cpu", "--timeout", str(TIMEOUT),
                              "--margin", str(MARGIN), "--grace", "10", "--startup", "90",
                              "--jobs", str(jobs)])


def _run(names: list[str], jobs: int) -> list[dict[str, Any]]:
    lines: list[str] = []
    results = faults.run_scenarios(2, [faults.BY_NAME[n] for n in names], _args(jobs),
                                   echo=lines.append)
    print("\n".join(lines))
    failed = [r for r in results if r["status"] != "PASS"]
    assert not failed, "\n".join(lines) + "\n" + json.dumps(failed, indent=1)[:6000]
    return results


RAISING = [s.name for s in faults.SCENARIOS if not s.bad_input]
CHECK_RANKS = [s.name for s in faults.SCENARIOS if s.bad_input]


@pytest.mark.timeout(180)
def test_a_rank_that_raises_mid_step_makes_every_rank_raise_within_the_timeout() -> None:
    assert len(RAISING) >= 7
    results = _run(RAISING, jobs=len(RAISING))
    for result in results:
        faulty = result["faulty_rank"]
        for row in result["ranks"]:
            assert row["raised"] and row["exited"], row
            if row["rank"] == faulty:
                assert row["type"] == "InjectedFault", row
            else:
                # Gloo: the healthy ranks raise RuntimeError, the collective having timed out
                # (or, where the faulty process exited, lost its peer), inside a collective.
                assert row["type"] in ("RuntimeError", "DistBackendError"), row
                assert row["failed_in"], row
                assert row["after_fault_s"] <= TIMEOUT + MARGIN, row
    by_name = {r["name"]: r for r in results}
    # A fault in the backward (no collective there) surfaces in the next step's first one.
    backward = by_name["ce-backward"]
    healthy = [r for r in backward["ranks"] if r["rank"] != backward["faulty_rank"]]
    assert all(r["step"] == 1 for r in healthy), healthy


@pytest.mark.timeout(120)
def test_bad_input_with_check_ranks_raises_on_every_rank_at_once() -> None:
    results = _run(CHECK_RANKS, jobs=len(CHECK_RANKS))
    for result in results:
        for row in result["ranks"]:
            assert row["raised"] and row["exited"] and row["type"] == "ValueError", row
            assert row["after_fault_s"] <= TIMEOUT / 2, row  # no timeout waited out


def test_a_rank_that_never_raises_is_reported_as_a_hang(tmp_path: Path) -> None:
    """The judge, on reports made up here: a healthy rank killed at the deadline without
    having raised is a HANG, and so is the faulty rank that raised but did not exit."""

    class Ended:
        returncode = -9

    scn = faults.BY_NAME["kvdp-query-gather"]
    ready = dict(started_at=0.0, imported_at=1.0, joined_at=2.0, ready_at=3.0)
    (tmp_path / "rank0.json").write_text(json.dumps(ready))
    (tmp_path / "rank1.json").write_text(json.dumps(dict(
        ready, raised=True, raised_at=4.0, fault_at=4.0, type="InjectedFault", message="x")))
    result = faults.judge(scn, 2, _args(1), tmp_path, [Ended(), Ended()], {0, 1},
                          {0: 40.0, 1: 40.0})
    assert result["status"] == "FAIL"
    assert any("rank 0 (healthy) HANG" in p for p in result["problems"]), result["problems"]
    assert any("rank 1 (faulty) raised, then did not exit" in p
               for p in result["problems"]), result["problems"]
