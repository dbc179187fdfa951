"""Run Megatron-LM's own unit tests of its fusions against ``lmfuse.megatron`` (issue 21).

What it runs
    Megatron-LM's tests of the fusions lmfuse replaces, taken from a Megatron-LM git
    directory at run time (never copied into this repository):

        main ref:  tests/unit_tests/fusions/test_swiglu_fusion.py
                   tests/unit_tests/fusions/test_torch_softmax.py
                   tests/unit_tests/fusions/test_weighted_squared_relu_fusion.py
                   tests/unit_tests/tensor_parallel/test_cross_entropy.py
        dev ref:   tests/unit_tests/fusions/test_fused_linear_cross_entropy.py

    plus the helpers they import (tests/unit_tests/test_utilities.py, ...) and the
    ``__init__.py`` files on their paths. Only the imports of the fused functions and
    classes are rewritten (``from megatron.core.fusions.fused_softmax import
    FusedScaleMaskSoftmax`` -> ``from lmfuse.megatron import FusedScaleMaskSoftmax``, see
    ``FUSED_NAMES``); everything else (TransformerConfig, AttnMaskType, parallel_state, the
    reference ``squared_relu``, module objects that tests monkeypatch) still comes from the
    installed megatron-core. ``megatron.training`` is not part of megatron-core, so its
    imports go to a small generated shim (``_lmfuse_runner_shims``): its
    ``get_device_arch_version`` reports 10 by default, which lifts the linear
    cross-entropy tests' Blackwell-only gate (that gate is about Megatron's own kernel;
    ``--keep-arch-gate`` keeps the real value), and its other names raise when called.
    Each file runs in its own pytest process (one rank: RANK=0, WORLD_SIZE=1, LOCAL_RANK=0,
    MASTER_ADDR/PORT set; ``--nproc N`` runs it under torchrun instead). A generated conftest
    records every test's outcome, its one-line reason and which ``lmfuse.megatron`` names it
    called. The summary (``summary.json``, ``summary.txt`` in ``--out``) counts per file
    passed / failed / skipped / errors, lists each failure with its reason, and keeps apart
    the intended differences (``EXPECTED``), the tests that need more ranks than were given
    (``NEEDS_RANKS``, deselected) and, on a machine without CUDA, the tests that failed only
    for want of it.

Carrying the tests to a machine without network
    Extract once where the Megatron-LM git directory is, into a git-ignored folder of this
    checkout (``build/`` is ignored, so nothing of Megatron's is committed)::

        python bench/megatron_unit_tests.py --extract-only \\
            --megatron-git /work/.mirror/NVIDIA+Megatron-LM/repo --out build/megatron_tests

    and carry ``build/megatron_tests`` (about 100 KB) with the working tree. There, pass
    ``--tests-dir build/megatron_tests/source`` instead of ``--megatron-git``.

On the GPU machine (one GPU, megatron-core installed, no torchrun needed; leave
TRITON_INTERPRET unset; this checkout's ``src/`` is put first on the tests' path)::

    python bench/megatron_unit_tests.py --tests-dir build/megatron_tests/source --out $OUT/megatron

    ``--only PART`` (repeatable; any part of a test path) runs a subset, to split the work
    over commands with a time limit, e.g. ``--only fusions/test_s --only fusions/test_t
    --only fusions/test_w --only tensor_parallel`` and then ``--only test_fused_linear``;
    ``--collect-only`` only collects. ``--nproc 8`` (eight GPUs) also runs the tests that
    need eight ranks, under torchrun; with two or more, the tensor-parallel linear
    cross-entropy tests run too (and the one-GPU ones skip themselves).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# Test files per ref label; the label names the ref given by --ref-main / --ref-dev.
DEFAULT_FILES: dict[str, tuple[str, ...]] = {
    "main": (
        "tests/unit_tests/fusions/test_swiglu_fusion.py",
        "tests/unit_tests/fusions/test_torch_softmax.py",
        "tests/unit_tests/fusions/test_weighted_squared_relu_fusion.py",
        "tests/unit_tests/tensor_parallel/test_cross_entropy.py",
    ),
    "dev": ("tests/unit_tests/fusions/test_fused_linear_cross_entropy.py",),
}

# Megatron-Core module -> the names in it that lmfuse.megatron replaces (same signature).
FUSED_NAMES: dict[str, frozenset[str]] = {
    "megatron.core.fusions.fused_softmax": frozenset({"FusedScaleMaskSoftmax"}),
    "megatron.core.fusions.fused_bias_swiglu": frozenset(
        {"bias_swiglu_impl", "weighted_bias_swiglu_impl"}),
    "megatron.core.fusions.fused_bias_geglu": frozenset(
        {"bias_geglu_impl", "weighted_bias_quick_geglu_impl"}),
    "megatron.core.fusions.fused_bias_gelu": frozenset({"bias_gelu_impl"}),
    "megatron.core.fusions.fused_weighted_squared_relu": frozenset(
        {"weighted_squared_relu_impl"}),
    "megatron.core.fusions.fused_cross_entropy": frozenset(
        {"fused_vocab_parallel_cross_entropy"}),
    "megatron.core.tensor_parallel.cross_entropy": frozenset({"vocab_parallel_cross_entropy"}),
    "megatron.core.tensor_parallel": frozenset({"vocab_parallel_cross_entropy"}),
    "megatron.core.fusions.fused_linear_cross_entropy": frozenset({"linear_cross_entropy"}),
}
LMFUSE_MODULE = "lmfuse.megatron"
SHIM_MODULE = "_lmfuse_runner_shims"
MARK = "# lmfuse runner: was"


@dataclass(frozen=True)
class Expected:
    """An intended difference: the test fails, and its one-line reason matches ``match``."""

    reason: str
    match: str


# Node ids are relative to the extracted tree's root, as pytest prints them.
EXPECTED: dict[str, Expected] = {
    "tests/unit_tests/fusions/test_torch_softmax.py::TestTorchSoftmax::"
    "test_causal_mask_input_shape_assert": Expected(
        "lmfuse supports causal masks with sq != sk (bottom-right aligned, for chunked "
        "prefill; DESIGN.md, softmax); Megatron asserts sq == sk",
        r"DID NOT RAISE"),
    # The test builds its expected value from x after the call: Megatron's unfused path
    # masks the caller's x in place (attention_mask_func's masked_fill_), so its "expected"
    # is the causal result; lmfuse leaves x unchanged, so here it is the unmasked softmax.
    **{"tests/unit_tests/fusions/test_torch_softmax.py::TestSoftmaxOne::" + name: Expected(
        "the expected value is computed from the test's input after the call, which "
        "Megatron's torch path has masked in place (masked_fill_ with -10000); lmfuse does "
        "not modify its input",
        r"assert torch\.allclose\(output, expected")
       for name in ("test_fixed_offset", "test_learnable_offset")},
    # Only the all_reduce count is intended (lmfuse's forward uses one collective, none on a
    # one-rank group); a failure anywhere else in this test stays a real failure.
    "tests/unit_tests/tensor_parallel/test_cross_entropy.py::"
    "test_vocab_parallel_cross_entropy_uses_explicit_tp_group": Expected(
        "the test counts Megatron's three all_reduce calls; lmfuse's vocabulary-parallel "
        "forward uses one collective (DESIGN.md, cross-entropy)",
        r"all_reduce_groups == \[tp_group, tp_group, tp_group\]"),
}

# Tests that need a given number of ranks (torchrun --nproc-per-node N): deselected, and
# listed, when fewer are given.
NEEDS_RANKS: dict[str, int] = {
    # Utils.initialize_model_parallel(4, 2): tensor-parallel 4 x pipeline-parallel 2.
    "tests/unit_tests/tensor_parallel/test_cross_entropy.py::test_vocab_parallel_cross_entropy": 8,
}

# One-line reasons that mean "this machine has no CUDA", not a wrong result.
NO_CUDA = re.compile(r"Torch not compiled with CUDA|Found no NVIDIA driver|CUDA driver|"
                     r"No CUDA GPUs are available|no attribute '_cuda_|dummy base class|"
                     r"ProcessGroupNCCL is only supported with GPUs|NCCL.*not (built|available)")


# --- import rewriting ------------------------------------------------------------------------


@dataclass
class Rewrite:
    """One import the rewriter changed (``kind`` "lmfuse" or "shim") or noticed and left
    alone (``kind`` "kept": a module object holding fused names, a star import)."""

    line: int
    kind: str
    before: str
    after: str
    note: str = ""


def _names(aliases: list[ast.alias]) -> str:
    return ", ".join(a.name if a.asname is None else f"{a.name} as {a.asname}" for a in aliases)


def _attributes_used(tree: ast.AST, alias: str) -> list[str]:
    """Attributes read through the name ``alias`` (``m.f``, or ``setattr(m, "f", ..)``
    and ``monkeypatch.setattr(m, "f", ..)``)."""
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == alias:
            used.add(node.attr)
        elif isinstance(node, ast.Call) and len(node.args) >= 2 \
                and isinstance(node.args[0], ast.Name) and node.args[0].id == alias \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            used.add(node.args[1].value)
    return sorted(used)


def _is_training(module: str) -> bool:
    return module == "megatron.training" or module.startswith("megatron.training.")


def rewrite_imports(source: str) -> tuple[str, list[Rewrite]]:
    """``source`` with the fused names imported from ``lmfuse.megatron`` and
    ``megatron.training`` names from the runner's shim; every other line unchanged.

    A rewritten statement keeps its line span (one line, padded with empty lines), so
    tracebacks point at the same line numbers as in Megatron-LM. Module-object imports
    (``from megatron.core.tensor_parallel import cross_entropy as m``) are left alone, since
    tests use them to monkeypatch Megatron's own module; they are reported with the
    attributes the file uses through them, so a call of a fused function through a module
    object (which would test Megatron, not lmfuse) shows up in the log.
    """
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits: list[tuple[int, int, str]] = []
    log: list[Rewrite] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in FUSED_NAMES or _is_training(a.name):
                    used = _attributes_used(tree, a.asname or a.name.split(".")[0])
                    log.append(Rewrite(node.lineno, "kept", ast.get_source_segment(source, node),
                                       "", f"module import; attributes used: {used}"))
            continue
        if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
            continue
        module, before = node.module, ast.get_source_segment(source, node)
        if any(a.name == "*" for a in node.names):
            if module in FUSED_NAMES or _is_training(module):
                log.append(Rewrite(node.lineno, "kept", before, "", "star import: not rewritten"))
            continue
        if _is_training(module):
            statements = [f"from {SHIM_MODULE} import {_names(node.names)}"]
            kind = "shim"
        else:
            fused = FUSED_NAMES.get(module, frozenset())
            moved = [a for a in node.names if a.name in fused]
            for a in node.names:
                if a.name not in fused and f"{module}.{a.name}" in FUSED_NAMES:
                    used = _attributes_used(tree, a.asname or a.name)
                    hits = sorted(set(used) & FUSED_NAMES[f"{module}.{a.name}"])
                    note = f"module object; attributes used: {used}"
                    if hits:
                        note += f"; WARNING: fused names reached through it: {hits}"
                    log.append(Rewrite(node.lineno, "kept", before, "", note))
            if not moved:
                continue
            kept = [a for a in node.names if a.name not in fused]
            statements = [f"from {module} import {_names(kept)}"] if kept else []
            statements.append(f"from {LMFUSE_MODULE} import {_names(moved)}")
            kind = "lmfuse"
        # Offsets count UTF-8 bytes. Whatever shares the first or last line with the
        # statement (indentation, "x = 1; ", "; y = 2", a comment) stays.
        prefix = lines[node.lineno - 1].encode()[:node.col_offset].decode()
        suffix = lines[node.end_lineno - 1].encode()[node.end_col_offset:].decode()
        suffix = suffix.rstrip("\r\n")
        span = node.end_lineno - node.lineno + 1
        new = (f"{prefix}{'; '.join(statements)}{suffix}  {MARK} {module}\n"
               + "\n" * (span - 1))
        edits.append((node.lineno, node.end_lineno, new))
        log.append(Rewrite(node.lineno, kind, before, new.strip()))
    for start, end, new in sorted(edits, reverse=True):
        lines[start - 1:end] = [new]
    log.sort(key=lambda r: r.line)
    return "".join(lines), log


# --- reading Megatron-LM's files -------------------------------------------------------------


class GitSource:
    """Files of a Megatron-LM git directory (bare) or checkout, at a ref."""

    def __init__(self, path: Path):
        self.git = (["git", "-C", str(path)] if (path / ".git").exists()
                    else ["git", f"--git-dir={path}"])
        if self._run("rev-parse", "--git-dir") is None:
            raise SystemExit(f"--megatron-git: {path} is not a git directory or checkout")

    def _run(self, *args: str) -> str | None:
        r = subprocess.run(self.git + list(args), capture_output=True, text=True)
        return r.stdout if r.returncode == 0 else None

    def commit(self, ref: str) -> str:
        out = self._run("rev-parse", "--verify", f"{ref}^{{commit}}")
        if out is None:
            raise SystemExit(f"ref {ref!r} not found in the Megatron-LM git directory")
        return out.strip()

    def read(self, ref: str, path: str) -> str | None:
        return self._run("show", f"{ref}:{path}")


def _helper_paths(source: str) -> list[str]:
    """Files of Megatron-LM's ``tests`` package that ``source`` imports (candidates: a
    module, or a package's ``__init__.py``; ``from tests.a import b`` may name module b)."""
    out: list[str] = []
    for node in ast.walk(ast.parse(source)):
        mods: list[str] = []
        if isinstance(node, ast.ImportFrom) and not node.level and node.module \
                and (node.module == "tests" or node.module.startswith("tests.")):
            mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            mods = [a.name for a in node.names if a.name.startswith("tests.")]
        for m in mods:
            base = m.replace(".", "/")
            out += [f"{base}.py", f"{base}/__init__.py"]
    return out


def extract(git: GitSource, refs: dict[str, str], files: dict[str, list[str]],
            dest: Path) -> dict:
    """Write ``files`` (per ref label) with the helpers and ``__init__.py`` files they need,
    unmodified, under ``dest/<label>/``; returns what was written, by label."""
    record: dict = {}
    for label, paths in files.items():
        ref = refs[label]
        root = dest / label
        todo = list(paths)
        done: dict[str, str] = {}
        missing: list[str] = []
        while todo:
            path = todo.pop()
            if path in done:
                continue
            text = git.read(ref, path)
            if text is None:
                if path in paths:
                    missing.append(path)
                continue
            done[path] = text
            parts = path.split("/")
            todo += ["/".join(parts[:i]) + "/__init__.py" for i in range(1, len(parts))]
            todo += _helper_paths(text)
        for path, text in done.items():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(text)
        record[label] = {"ref": ref, "commit": git.commit(ref), "files": sorted(done),
                         "tests": list(paths), "missing": missing}
    (dest / "SOURCE.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


# --- the generated files of a run tree -------------------------------------------------------

SHIM_TEXT = '''"""Stand-ins for megatron.training (not part of megatron-core), written by
bench/megatron_unit_tests.py. Names the tests use at collection or in the tests it runs are
defined; any other name imports, and raises when called."""
import os
import random


def get_device_arch_version():
    if os.environ.get("LMFUSE_RUNNER_KEEP_ARCH_GATE") != "1":
        # Megatron gates its fused linear cross-entropy tests on Blackwell (its own kernel's
        # requirement); lmfuse's kernel runs on any GPU.
        return 10
    import torch
    return torch.cuda.get_device_properties(0).major if torch.cuda.is_available() else 0


def _set_random_seed(seed_, data_parallel_random_init=False, te_rng_tracker=False,
                     inference_rng_tracker=False, use_cudagraphable_rng=False):
    import numpy as np
    import torch
    random.seed(seed_)
    np.random.seed(seed_)
    torch.manual_seed(seed_)
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        from megatron.core import tensor_parallel
        tensor_parallel.model_parallel_cuda_manual_seed(seed_)


def __getattr__(name):
    def missing(*args, **kwargs):
        raise NotImplementedError(f"megatron.training.{name} is not available to the lmfuse "
                                  "runner (megatron.training is not part of megatron-core)")
    return missing
'''

CONFTEST_TEXT = '''"""Written by bench/megatron_unit_tests.py: Megatron's own conftest settings
that its fusion tests rely on, and a recorder of every test's outcome and lmfuse.megatron calls."""
import functools
import json
import os

import pytest
import torch

os.environ.setdefault("NCCL_MAX_NCHANNELS", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import lmfuse  # noqa: E402
import lmfuse.megatron as _lm  # noqa: E402

_calls = {}
_records = []
_collected = []


def _counting(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _calls[name] = _calls.get(name, 0) + 1
        return fn(*args, **kwargs)
    return wrapper


def _te_absent_guard():
    """Without TransformerEngine, megatron-core's is_te_min_version compares None with a
    version and raises; Megatron's helpers call it at collection (fp8 parametrisations of
    tests that skip anyway). No TransformerEngine means no version of it: False."""
    import megatron.core.utils as mcore_utils
    try:
        if mcore_utils.get_te_version() is not None:
            return False
    except Exception:
        pass

    def is_te_min_version(version, check_equality=True):
        return False

    mcore_utils.is_te_min_version = is_te_min_version
    return True


_TE_ABSENT = _te_absent_guard()
_DESELECT = set(json.loads(os.environ.get("LMFUSE_RUNNER_DESELECT", "[]")))

for _name in NAMES:
    _obj = getattr(_lm, _name)
    if isinstance(_obj, type):
        _obj.__init__ = _counting(_name, _obj.__init__)
    else:
        setattr(_lm, _name, _counting(_name, _obj))


def pytest_configure(config):
    config.addinivalue_line("markers", "internal: Megatron-LM's marker")


@pytest.fixture(autouse=True)
def experimental():
    from megatron.core import config
    config.ENABLE_EXPERIMENTAL = False


@pytest.fixture(scope="session", autouse=True)
def cleanup():
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        try:
            torch.distributed.barrier()
        except Exception:
            return
        torch.distributed.destroy_process_group()


def _one_line(report):
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    reason = " | ".join(lines[:3])[:300]
    tb = getattr(report.longrepr, "reprtraceback", None)
    for entry in reversed(getattr(tb, "reprentries", []) or []):
        stmt = [ln[1:].strip() for ln in getattr(entry, "lines", []) if ln.startswith(">")]
        loc = getattr(getattr(entry, "reprfileloc", None), "path", "")
        if stmt and "tests/" in str(loc).replace(os.sep, "/"):
            line = entry.reprfileloc.lineno
            reason += f" [at {os.path.basename(loc)}:{line}: {stmt[-1][:160]}]"
            break
    if crash is not None and "[at " not in reason:
        reason += f" [at {os.path.basename(crash.path)}:{crash.lineno}]"
    return reason


def pytest_collection_modifyitems(config, items):
    # Exact node ids (pytest's --deselect matches prefixes: test_x would also drop test_x_y).
    dropped = [item for item in items if item.nodeid in _DESELECT]
    if dropped:
        items[:] = [item for item in items if item.nodeid not in _DESELECT]
        config.hook.pytest_deselected(items=dropped)


def pytest_runtest_logstart(nodeid, location):
    _calls.clear()


def pytest_runtest_logreport(report):
    if report.when == "call" or report.failed or (report.skipped and report.when == "setup"):
        outcome = report.outcome
        if report.failed and report.when != "call":
            outcome = "error"
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        _records.append({"nodeid": report.nodeid, "when": report.when, "outcome": outcome,
                         "reason": "" if report.passed else _one_line(report),
                         "duration_s": round(report.duration, 4),
                         "lmfuse_calls": dict(_calls)})


def pytest_collectreport(report):
    if report.failed:
        _records.append({"nodeid": report.nodeid, "when": "collect", "outcome": "error",
                         "reason": _one_line(report), "duration_s": 0.0, "lmfuse_calls": {}})


def pytest_collection_finish(session):
    _collected.extend(item.nodeid for item in session.items)


def pytest_sessionfinish(session, exitstatus):
    try:
        import megatron.core
        megatron_version = getattr(megatron.core, "__version__", "?")
    except Exception as e:  # recorded, not raised: the summary says why
        megatron_version = f"import failed: {e}"
    cuda = torch.cuda.is_available()
    env = {"torch": torch.__version__, "megatron_core": megatron_version,
           "lmfuse": getattr(lmfuse, "__version__", "?"),
           "lmfuse_path": os.path.dirname(lmfuse.__file__), "cuda": cuda,
           "device": torch.cuda.get_device_name(0) if cuda else "cpu",
           "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
           "transformer_engine_absent_guard": _TE_ABSENT}
    path = os.environ["LMFUSE_RUNNER_RESULTS"] + f".rank{os.environ.get('RANK', '0')}.json"
    with open(path, "w") as f:
        json.dump({"env": env, "exitstatus": int(exitstatus), "collected": _collected,
                   "tests": _records}, f, indent=1)
'''


def _lmfuse_names() -> list[str]:
    return sorted(set().union(*FUSED_NAMES.values()))


def prepare_run_tree(source_root: Path, run_root: Path) -> list[dict]:
    """Copy ``source_root`` (one label's extracted tree) to ``run_root`` with the imports
    rewritten, plus the conftest, shim and pytest.ini; returns the rewrite log."""
    log: list[dict] = []
    for src in sorted(source_root.rglob("*.py")):
        rel = src.relative_to(source_root)
        text, changes = rewrite_imports(src.read_text())
        (run_root / rel).parent.mkdir(parents=True, exist_ok=True)
        (run_root / rel).write_text(text)
        log += [dict(asdict(c), file=str(rel)) for c in changes]
    (run_root / f"{SHIM_MODULE}.py").write_text(SHIM_TEXT)
    (run_root / "conftest.py").write_text(
        CONFTEST_TEXT.replace("for _name in NAMES:", f"for _name in {_lmfuse_names()!r}:"))
    (run_root / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    return log


# --- running and summarising -----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_file(run_root: Path, test: str, results: Path, log_path: Path, args) -> dict:
    """One pytest process (or torchrun of ``args.nproc``) on ``test``; returns its records."""
    env = dict(os.environ)
    # This checkout's lmfuse is the one under test, installed or not.
    src = Path(__file__).resolve().parent.parent / "src"
    env["PYTHONPATH"] = os.pathsep.join([str(run_root), str(src)] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["LMFUSE_RUNNER_RESULTS"] = str(results)
    env["LMFUSE_RUNNER_KEEP_ARCH_GATE"] = "1" if args.keep_arch_gate else "0"
    if args.nproc == 1:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="localhost",
                   MASTER_PORT=str(_free_port()))
        cmd = [sys.executable, "-m", "pytest"]
    else:
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.nproc}", "-m", "pytest"]
    deselected = [(n, r) for n, r in NEEDS_RANKS.items()
                  if n.split("::")[0] == test and r > args.nproc]
    env["LMFUSE_RUNNER_DESELECT"] = json.dumps([n for n, _ in deselected])
    cmd += [test, "-q", "-rA"]
    cmd += ["--collect-only"] if args.collect_only else []
    cmd += shlex.split(args.pytest_args)
    for old in results.parent.glob(results.name + ".rank*.json"):
        old.unlink()
    start = time.time()
    with open(log_path, "w") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        try:
            rc = subprocess.run(cmd, cwd=run_root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    ranks = {}
    for path in sorted(results.parent.glob(results.name + ".rank*.json")):
        ranks[path.name.rsplit(".rank", 1)[1].split(".")[0]] = json.loads(path.read_text())
    return {"returncode": rc, "wall_s": round(time.time() - start, 1), "ranks": ranks,
            "deselected": deselected, "command": shlex.join(cmd)}


def classify(test: str, result: dict, collect_only: bool) -> dict:
    """Per-file counts and lists; a test failed if it failed on any rank."""
    entry: dict = {"returncode": result["returncode"], "wall_s": result["wall_s"],
                   "command": result["command"]}
    ranks = result["ranks"]
    if not ranks:
        entry["counts"] = {"errors": 1}
        entry["failures"] = [{"nodeid": test, "outcome": "error", "reason":
                              f"pytest wrote no results (exit {result['returncode']}); "
                              "see the log", "lmfuse_calls": {}}]
        return entry
    primary = ranks.get("0", next(iter(ranks.values())))
    entry["env"] = primary["env"]
    entry["collected"] = len(primary["collected"])
    merged: dict[str, dict] = {}
    for rank, data in sorted(ranks.items()):
        for rec in data["tests"]:
            old = merged.get(rec["nodeid"])
            if old is None or (rec["outcome"] in ("failed", "error")
                               and old["outcome"] not in ("failed", "error")):
                merged[rec["nodeid"]] = dict(rec, rank=rank)
    counts = {k: 0 for k in ("passed", "failed", "skipped", "errors", "expected",
                             "expected_but_passed", "no_cuda", "needs_ranks", "xfailed",
                             "xpassed")}
    lists: dict[str, list] = {k: [] for k in ("failures", "expected", "no_cuda", "skipped",
                                              "needs_ranks", "expected_but_passed")}
    cuda = primary["env"]["cuda"]
    for nodeid, rank_need in result["deselected"]:
        counts["needs_ranks"] += 1
        lists["needs_ranks"].append({"nodeid": nodeid, "reason": f"needs {rank_need} ranks "
                                     f"(--nproc {rank_need} under torchrun)"})
    for rec in merged.values():
        out, item = rec["outcome"], {k: rec[k] for k in ("nodeid", "outcome", "reason",
                                                         "lmfuse_calls")}
        exp = EXPECTED.get(rec["nodeid"])
        if out in ("failed", "error") and exp and re.search(exp.match, rec["reason"]):
            counts["expected"] += 1
            lists["expected"].append(dict(item, why=exp.reason))
        elif out in ("failed", "error") and not cuda and NO_CUDA.search(rec["reason"]):
            counts["no_cuda"] += 1
            lists["no_cuda"].append(item)
        elif out in ("failed", "error"):
            counts["failed" if out == "failed" else "errors"] += 1
            lists["failures"].append(item)
        elif out == "passed" and exp:
            counts["expected_but_passed"] += 1
            lists["expected_but_passed"].append(dict(item, why=exp.reason))
        elif out == "passed":
            counts["passed"] += 1
        elif out == "skipped":
            counts["skipped"] += 1
            lists["skipped"].append(item)
        else:
            counts[out] += 1
    if collect_only:
        counts = {"collected": entry["collected"], "errors": counts["errors"],
                  "needs_ranks": counts["needs_ranks"]}
    entry["counts"] = {k: v for k, v in counts.items() if v or k in ("passed", "failed",
                                                                      "skipped", "errors")}
    entry.update({k: v for k, v in lists.items() if v})
    if collect_only:
        entry["collected_ids"] = primary["collected"]
    return entry


def summary_text(summary: dict) -> str:
    out = [f"Megatron-LM fusion unit tests against lmfuse.megatron "
           f"({'collection only' if summary['collect_only'] else 'run'}), {summary['date']}"]
    for label, src in summary["source"].items():
        out.append(f"  {label}: Megatron-LM {src['ref']} = {src['commit']}")
    out.append(f"  env: {json.dumps(summary.get('env', {}))}")
    out.append(f"  ranks: {summary['nproc']}; arch gate: {summary['arch_gate']}")
    out.append("")
    for name, f in summary["files"].items():
        counts = ", ".join(f"{k} {v}" for k, v in f["counts"].items())
        out.append(f"{name}: {counts}  ({f['wall_s']} s, exit {f['returncode']})")
    sections = [("failures", "Failures and errors"),
                ("expected", "Expected differences (EXPECTED table)"),
                ("expected_but_passed", "In EXPECTED but passed (stale entry?)"),
                ("needs_ranks", "Not run: need more ranks"),
                ("no_cuda", "Failed only for want of CUDA on this machine"),
                ("skipped", "Skipped (reason from the test)")]
    for key, title in sections:
        rows = [r for f in summary["files"].values() for r in f.get(key, [])]
        if not rows:
            continue
        if key in ("skipped", "no_cuda"):  # one line per file and reason
            groups: dict[tuple[str, str], int] = {}
            for r in rows:
                where = (r["nodeid"].split("::")[0], r["reason"])
                groups[where] = groups.get(where, 0) + 1
            out += ["", f"{title} ({len(rows)}):"]
            out += [f"  {n} x {path}: {reason}" for (path, reason), n in groups.items()]
            continue
        out += ["", f"{title} ({len(rows)}):"]
        for r in rows:
            note = r.get("why") or r["reason"]
            if key == "failures" and not r.get("lmfuse_calls"):
                note += "  (no lmfuse.megatron call before it)"
            if key == "expected":
                note = f"{r['why']}; got: {r['reason']}"
            out.append(f"  {r['nodeid']}\n      {note}")
    t = summary["totals"]
    out += ["", "Totals: " + ", ".join(f"{k} {v}" for k, v in t.items())]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--megatron-git", type=Path,
                     help="Megatron-LM git directory (bare) or checkout")
    src.add_argument("--tests-dir", type=Path,
                     help="an extracted tree: <dir>/main/tests/..., <dir>/dev/tests/... "
                          "(the 'source' folder of an earlier --out)")
    p.add_argument("--out", type=Path, required=True, help="scratch folder for everything")
    p.add_argument("--ref-main", default="HEAD")
    p.add_argument("--ref-dev", default="dev")
    p.add_argument("--extract-only", action="store_true",
                   help="write <out>/source and stop (to carry to a machine without network)")
    p.add_argument("--collect-only", action="store_true", help="pytest --collect-only")
    p.add_argument("--only", action="append", default=[],
                   help="run only the test files whose path contains this (repeatable)")
    p.add_argument("--nproc", type=int, default=1,
                   help="ranks: 1 runs plain pytest, N > 1 runs it under torchrun")
    p.add_argument("--keep-arch-gate", action="store_true",
                   help="keep Megatron's Blackwell-only gate of the linear cross-entropy tests")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per test file")
    p.add_argument("--pytest-args", default="", help="more pytest arguments, one string")
    args = p.parse_args(argv)
    out = args.out.resolve()
    repo = Path(__file__).resolve().parent.parent
    if out == repo or repo in out.parents and not (out.relative_to(repo).parts[0] == "build"):
        raise SystemExit(f"--out {out}: inside the repository; use a scratch folder (or build/, "
                         "which git ignores)")
    if args.nproc < 1:
        raise SystemExit(f"--nproc must be >= 1, got {args.nproc}")

    if args.megatron_git is not None:
        refs = {"main": args.ref_main, "dev": args.ref_dev}
        source = extract(GitSource(args.megatron_git.resolve()), refs,
                         {k: list(v) for k, v in DEFAULT_FILES.items()}, out / "source")
        source_dir = out / "source"
        for label, rec in source.items():
            if rec["missing"]:
                print(f"warning: not in {label} ({rec['ref']}): {rec['missing']}")
        if args.extract_only:
            print(f"extracted {sum(len(r['files']) for r in source.values())} files to "
                  f"{source_dir}")
            return 0
    else:
        source_dir = args.tests_dir.resolve()
        meta = source_dir / "SOURCE.json"
        source = json.loads(meta.read_text()) if meta.exists() else {
            d.name: {"ref": "?", "commit": "?", "tests": list(DEFAULT_FILES.get(d.name, ()))}
            for d in source_dir.iterdir() if d.is_dir()}

    (out / "logs").mkdir(parents=True, exist_ok=True)
    summary: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(),
                     "argv": sys.argv, "collect_only": args.collect_only, "nproc": args.nproc,
                     "arch_gate": "kept" if args.keep_arch_gate else "lifted (reports 10)",
                     "source": {k: {"ref": v["ref"], "commit": v["commit"]}
                                for k, v in source.items()},
                     "files": {}}
    rewrites: dict = {}
    for label, rec in source.items():
        run_root = out / "run" / label
        rewrites[label] = prepare_run_tree(source_dir / label, run_root)
        for test in rec["tests"]:
            if args.only and not any(s in test for s in args.only):
                continue
            if not (run_root / test).exists():
                continue
            stem = f"{label}__{Path(test).stem}"
            result = run_file(run_root, test, out / "logs" / stem, out / "logs" / f"{stem}.log",
                              args)
            entry = classify(test, result, args.collect_only)
            entry["log"] = str(out / "logs" / f"{stem}.log")
            summary["files"][f"{label}:{test}"] = entry
            summary.setdefault("env", entry.get("env", {}))
            print(f"{label}:{test}: {entry['counts']}", flush=True)
    totals: dict[str, int] = {}
    for f in summary["files"].values():
        for k, v in f["counts"].items():
            totals[k] = totals.get(k, 0) + v
    summary["totals"] = totals
    (out / "rewrites.json").write_text(json.dumps(rewrites, indent=1) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    text = summary_text(summary)
    (out / "summary.txt").write_text(text)
    print(text)
    return 1 if totals.get("failed", 0) + totals.get("errors", 0) else 0


if __name__ == "__main__":
    sys.exit(main())
