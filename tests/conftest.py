"""Test set-up shared by the whole suite.

``TRITON_INTERPRET=1`` must be in the environment before anything imports ``triton`` or
``lmfuse`` (Triton decides between its compiler and its CPU interpreter when a kernel is
defined), so it is set on the very first lines, before any other import (with
``OMP_NUM_THREADS=1``: one torch thread a test process). Gloo ranks
spawned by ``tests/distributed/spawn.py`` get it in their environment as well. So does
``LMFUSE_TUNING_CACHE``, pointed at a file that does not exist, so a user cache written by
``lmfuse tune`` on the machine cannot change what the tests see.

``LMFUSE_GPU_TESTS=1`` leaves ``TRITON_INTERPRET`` alone, so the Triton kernels are
compiled for the GPU: for ``tests/gpu/`` on a CUDA machine (``LMFUSE_GPU_TESTS=1 python -m
pytest tests/gpu``), whose tests skip while the interpreter is on. CI never sets it.
"""

from __future__ import annotations

import os

if os.environ.get("LMFUSE_GPU_TESTS") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    # One intra-op thread a test process (unless the caller sets another count): `make test`
    # runs a pytest-xdist worker per core, and with torch's default of a thread per core in
    # each, the suite's tiny ops spent their time handing work between oversubscribed
    # threads (a third of the wall time on 2 cores). Set before torch is imported; spawned
    # ranks inherit it.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# Never read the user's own ``lmfuse tune`` cache: a path no test writes (tests that record
# point the variable at their tmp_path).
os.environ["LMFUSE_TUNING_CACHE"] = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "no-such-dir", "tuning.json")

import sys  # noqa: E402
import zlib  # noqa: E402
from pathlib import Path  # noqa: E402

# ``import helpers`` (and ``import spawn``, the gloo spawner in tests/distributed/) from
# any test folder, without an ``__init__.py`` in each of them. Spawned gloo ranks start
# with this process's sys.path, so they find the same modules.
_TESTS_DIR = Path(__file__).resolve().parent
for _dir in (str(_TESTS_DIR / "distributed"), str(_TESTS_DIR)):
    if _dir not in sys.path:
        sys.path.insert(0, _dir)

import fast_interpreter  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

fast_interpreter.install()  # Triton's interpreter without its repeated language swaps
fast_interpreter.install_bf16_rounding()  # a GPU's bfloat16 rounding

from hypothesis import HealthCheck, settings  # noqa: E402

# "ci" (the default): few examples, the same ones every run, no example database written
# into the work tree. "dev": more examples, random ones, for hunting bugs by hand
# (HYPOTHESIS_PROFILE=dev). The interpreter is slow, so no deadline in either.
settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    # The autouse seeding fixture below is function-scoped; property tests reseed from a
    # drawn seed themselves, so running the fixture once per test (not per example) is fine.
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "dev",
    parent=settings.get_profile("ci"),
    max_examples=300,
    derandomize=False,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _seed_torch(request: pytest.FixtureRequest) -> int:
    """Seed torch per test from its node id: reproducible, and different for every case."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    return seed


@pytest.fixture
def tuning_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A fresh, empty ``lmfuse tune`` user cache file for one test (its path)."""
    from lmfuse import tuning

    path = tmp_path / "tuning.json"
    before = os.environ.get(tuning.CACHE_ENV)
    monkeypatch.setenv(tuning.CACHE_ENV, str(path))
    tuning.reload()
    yield path
    # Back to the suite's cache before reading it again: re-reading this test's file, which
    # a test may have left broken on purpose, would warn outside the test.
    if before is None:
        monkeypatch.delenv(tuning.CACHE_ENV, raising=False)
    else:
        monkeypatch.setenv(tuning.CACHE_ENV, before)
    tuning.reload()


@pytest.fixture
def streamed_short_rows(monkeypatch: pytest.MonkeyPatch) -> list:
    """Cross-entropy rows longer than 16 are streamed (the table's ``max_single_block``
    lowered), so the streamed kernels run at small V; returns the list that receives the
    launch (``ops.StreamLaunch``) of every slices-kernel launch."""
    from lmfuse import tuning
    from lmfuse.cross_entropy import ops

    small = dict(tuning.table("cross_entropy", torch.device("cpu")), max_single_block=16)
    real_table = tuning.table
    monkeypatch.setattr(tuning, "table", lambda family, device: small
                        if family == "cross_entropy" else real_table(family, device))
    launched: list = []
    real_slices = ops._launch_slices
    monkeypatch.setattr(ops, "_launch_slices",
                        lambda *a: (launched.append(a[-1]), real_slices(*a))[1])
    return launched
