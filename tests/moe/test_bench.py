"""``lmfuse bench moe_experts --quick`` on the CPU: the smoke run of the experts benchmark
(tiny float32 shapes, lmfuse's kernels in Triton's interpreter) writes the rows it promises
-- lmfuse, the torch loop and the floor timed in every case, every peer a row (run, or
noted why not) -- and the torch loop's result agrees with lmfuse's."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from lmfuse.bench import moe_experts

CASES = ("mixtral fwd+bwd T8 ", "qwen3-moe fwd+bwd T8 ", "gpt-oss decode T1 ",
         "gpt-oss decode T4 ")
ROWS = ("lmfuse", "torch loop", "hf grouped_mm", "hf batched_mm", "liger-kernel", "floor")


@pytest.mark.timeout(120)
def test_quick_run_writes_every_case_and_row(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    assert moe_experts.main(["--quick", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["environment"]["device"] == "cpu" and data["copy"]["tbps"] > 0
    rows = data["results"]
    names = list(dict.fromkeys(r["case"] for r in rows))
    assert len(names) == len(CASES)
    for prefix, name in zip(CASES, names, strict=True):
        assert name.startswith(prefix) and name.endswith("float32")
        by = {r["impl"]: r for r in rows if r["case"] == name}
        assert set(by) == set(ROWS)
        for impl in ("lmfuse", "torch loop", "floor"):
            ms = by[impl]["ms"]
            assert ms is not None and math.isfinite(ms) and ms > 0, (name, impl, by[impl])
        assert by["lmfuse"]["ratio"] == 1.0 and "impl auto: triton" in by["lmfuse"]["note"]
        # float32: the loop is lmfuse's result up to rounding, and not flagged
        note = by["torch loop"]["note"]
        diff = re.search(r"rel\. diff ([0-9.e+-]+)", note)
        assert diff and float(diff.group(1)) < 1e-5 and "CHECK" not in note, note
        for impl in ("hf grouped_mm", "hf batched_mm", "liger-kernel"):
            row = by[impl]
            assert (row["ms"] or 0) > 0 or row["note"].startswith("failed: "), row
    # Liger computes SwiGLU without biases only: the GPT-OSS rows say so
    decode = [r for r in rows if r["case"].startswith("gpt-oss") and r["impl"] == "liger-kernel"]
    assert decode and all("SwiGLU" in r["note"] for r in decode)


@pytest.mark.timeout(120)
def test_models_option_runs_those_cases_only(tmp_path: Path, capsys) -> None:
    out = tmp_path / "m.json"
    assert moe_experts.main(["--quick", "--no-liger", "--models", "qwen3-moe",
                             "--json", str(out)]) == 0
    names = {r["case"] for r in json.loads(out.read_text())["results"]}
    assert len(names) == 1 and next(iter(names)).startswith(CASES[1])
    assert moe_experts.main(["--quick", "--models", "llama"]) == 2
    assert "--models takes a comma-separated subset of gpt-oss, mixtral, qwen3-moe" in (
        capsys.readouterr().err)
