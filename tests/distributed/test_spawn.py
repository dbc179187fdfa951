"""The gloo spawner and the collective counter (``tests/distributed/spawn.py``)."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from spawn import count_collectives, spawn_gloo


def _child_rank(rank: int, world_size: int) -> None:
    """What a spawned rank can count on: interpreter on, and a counter that sees everything."""
    from lmfuse._dispatch import interpreter_active, select_impl

    assert os.environ.get("TRITON_INTERPRET") == "1", os.environ.get("TRITON_INTERPRET")
    assert interpreter_active()
    assert select_impl("cross_entropy", "auto", torch.device("cpu"))[0] == "triton"

    t = torch.full((2,), float(rank))
    with count_collectives() as calls:
        dist.all_reduce(t)
        out = torch.empty(world_size * 2)
        dist.all_gather_into_tensor(out, t)
        dist.all_gather_single(out, t)
        group = dist.group.WORLD
        group.allreduce([t]).wait()  # a ProcessGroup method called directly
        dist.barrier()
    # Each collective once, by its outermost name, though one calls another underneath.
    assert calls == ["all_reduce", "all_gather_into_tensor", "all_gather_single",
                     "allreduce", "barrier"], calls
    with count_collectives() as calls:
        torch.ones(3).sum()
    assert calls == []
    # The originals are back once the block is left.
    with count_collectives() as outer:
        pass
    dist.all_reduce(t)
    assert outer == []


def _failing_rank(rank: int, world_size: int) -> None:
    if rank == 1:  # with a report far larger than a pipe's buffer
        raise ValueError("rank one fails on purpose" + "." * 1_000_000)


def _hanging_rank(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(60)


@pytest.mark.timeout(120)
def test_spawn_gloo_all_reduce_from_a_module_whose_name_ranks_cannot_import(
        tmp_path: Path) -> None:
    # As pytest's --import-mode=importlib leaves a test module: in sys.modules, under a
    # name that the ranks cannot import.
    path = tmp_path / "ranks_from_a_file.py"
    path.write_text("import torch\n"
                    "import torch.distributed as dist\n\n"
                    "def rank_fn(rank, world_size, expected):\n"
                    "    t = torch.full((2,), float(rank + 1))\n"
                    "    dist.all_reduce(t)\n"
                    "    assert t.tolist() == [expected] * 2, t\n")
    name = "not.an.importable.name"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        spawn_gloo(2, module.rank_fn, 3.0, timeout=60)
    finally:
        del sys.modules[name]


@pytest.mark.timeout(120)
def test_spawned_ranks_run_the_interpreter_and_count_collectives() -> None:
    spawn_gloo(2, _child_rank, timeout=60)


@pytest.mark.timeout(120)
def test_spawn_gloo_reports_failed_rank() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)rank 1.*rank one fails on purpose"):
        spawn_gloo(2, _failing_rank, timeout=60)
    assert time.monotonic() - start < 30  # the long report did not block the rank


@pytest.mark.timeout(120)
def test_spawn_gloo_times_out() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[0"):
        spawn_gloo(2, _hanging_rank, timeout=5)
    assert time.monotonic() - start < 30  # the hung rank was killed, not waited for


def test_spawn_gloo_rejects_a_function_ranks_cannot_import() -> None:
    def local(rank: int, world_size: int) -> None:
        pass

    with pytest.raises(TypeError, match="module-level function"):
        spawn_gloo(2, local)
    with pytest.raises(TypeError, match="module-level function"):
        spawn_gloo(2, lambda rank, world_size: None)
    with pytest.raises(TypeError, match="module-level function"):
        spawn_gloo(2, print)  # a builtin: no module file to load it from
