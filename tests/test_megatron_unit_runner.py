"""bench/megatron_unit_tests.py: its import rewriting and its classification of results,
on synthetic sources and records (no Megatron-LM files needed)."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import lmfuse.megatron

_PATH = Path(__file__).resolve().parent.parent / "bench" / "megatron_unit_tests.py"
_spec = importlib.util.spec_from_file_location("megatron_unit_tests", _PATH)
runner = importlib.util.module_from_spec(_spec)
sys.modules.setdefault(_spec.name, runner)  # dataclasses look their module up there
_spec.loader.exec_module(runner)

SOURCE = '''import torch
from megatron.core.fusions.fused_bias_swiglu import (
    SwiGLUFunction,
    bias_swiglu_impl as swiglu,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.tensor_parallel import cross_entropy as ce_module
from megatron.training.utils import get_device_arch_version


def helper(monkeypatch):
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax  # noqa
    monkeypatch.setattr(ce_module, "get_tensor_model_parallel_group", None)
    return FusedScaleMaskSoftmax, ce_module.vocab_parallel_cross_entropy
LAST_LINE = 15
'''


def test_rewrite_moves_only_the_fused_names():
    new, log = runner.rewrite_imports(SOURCE)
    lines = new.splitlines()
    # Same line count and the same line numbers below every rewritten statement.
    assert len(lines) == len(SOURCE.splitlines()) and lines[14] == "LAST_LINE = 15"
    assert lines[1].startswith("from megatron.core.fusions.fused_bias_swiglu import "
                               "SwiGLUFunction; from lmfuse.megatron import bias_swiglu_impl "
                               "as swiglu  # lmfuse runner: was")
    assert lines[2:5] == ["", "", ""]
    assert lines[5] == SOURCE.splitlines()[5]  # AttnMaskType stays Megatron's
    assert lines[6] == SOURCE.splitlines()[6]  # module object stays Megatron's
    assert lines[7].startswith("from _lmfuse_runner_shims import get_device_arch_version")
    # Indented import inside a function, its trailing comment kept.
    assert lines[11].startswith("    from lmfuse.megatron import FusedScaleMaskSoftmax  # noqa")
    ast.parse(new)
    kinds = [(r.line, r.kind) for r in log]
    assert kinds == [(2, "lmfuse"), (7, "kept"), (8, "shim"), (12, "lmfuse")]
    kept = log[1]
    assert "get_tensor_model_parallel_group" in kept.note
    assert "WARNING: fused names reached through it: ['vocab_parallel_cross_entropy']" in kept.note


def test_every_fused_name_is_in_lmfuse_megatron():
    for names in runner.FUSED_NAMES.values():
        assert names <= set(lmfuse.megatron.__all__)


def test_classify_keeps_expected_differences_apart():
    nodeid = next(iter(runner.EXPECTED))
    test = nodeid.split("::")[0]
    pattern_hit = "Failed: DID NOT RAISE <class 'AssertionError'>"
    records = [
        {"nodeid": nodeid, "outcome": "failed", "reason": pattern_hit, "lmfuse_calls": {}},
        {"nodeid": test + "::test_other", "outcome": "failed", "reason": "RuntimeError: boom",
         "lmfuse_calls": {"FusedScaleMaskSoftmax": 1}},
        {"nodeid": test + "::test_ok", "outcome": "passed", "reason": "", "lmfuse_calls": {}},
    ]
    env = {"cuda": True}
    result = {"returncode": 1, "wall_s": 1.0, "command": "pytest", "deselected": [],
              "ranks": {"0": {"env": env, "collected": [r["nodeid"] for r in records],
                              "tests": records}}}
    entry = runner.classify(test, result, collect_only=False)
    assert entry["counts"] == {"passed": 1, "failed": 1, "skipped": 0, "errors": 0,
                               "expected": 1}
    assert [r["nodeid"] for r in entry["expected"]] == [nodeid]
    assert [r["nodeid"] for r in entry["failures"]] == [test + "::test_other"]
    # The same test failing for another reason is a real failure.
    records[0]["reason"] = "RuntimeError: CUDA error"
    entry = runner.classify(test, result, collect_only=False)
    assert entry["counts"]["failed"] == 2 and "expected" not in entry
