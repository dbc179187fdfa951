"""``lmfuse bench decode_attention --quick`` on the CPU (Triton's interpreter, tests/conftest.py)
as a smoke run, not performance: the rows it promises, the timing it says it used, and a
case timed as several calls back to back (``--graph-calls``) reported as one call's share."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import run_cli

from lmfuse.bench import common, decode_attention


@pytest.mark.timeout(120)
def test_quick_run_writes_a_row_per_case_and_impl(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "d.json"
    # On the CPU --graphs has nothing to capture: the calls are timed eagerly, and said so.
    assert decode_attention.main(["--quick", "--graphs", "--graph-calls", "4", "--json",
                                  str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["environment"]["timing"].startswith("eager calls")
    rows = data["results"]
    cases = {r["case"] for r in rows}
    assert len(cases) >= 5
    lmfuse = [r for r in rows if r["impl"] == "lmfuse"]
    assert {r["case"] for r in lmfuse} == cases  # an lmfuse row in every case
    assert all(r["ms"] and r["ms"] > 0 for r in lmfuse)
    assert "copy" in {r["impl"] for r in rows}
    capsys.readouterr()


def test_a_case_of_several_calls_reports_one_calls_share(monkeypatch) -> None:
    monkeypatch.setattr(common, "bench_ms", lambda fn, device: 8.0)
    case = common.Case("c", nbytes=4_000_000, impls={"lmfuse": lambda: None}, calls=4)
    (row,) = common.run_cases([case], torch.device("cpu"))
    assert row.ms == 2.0 and row.tbps == pytest.approx(4e6 / 2.0 / 1e9)


def test_graph_calls_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "bench", "decode_attention", "--graphs",
                             "--graph-calls", "0")
    assert code == 2 and out == ""
    assert "argument --graph-calls: must be >= 1, got 0" in err
    assert len(err.strip().splitlines()) <= 2  # usage and one message, no traceback


@pytest.mark.parametrize("role, paged, speedup, verdict", [
    ("fp8", False, 1.75, "met"),  # contiguous split-KV: issue 22's restated 1.7x
    ("long", False, 1.69, "MISSED"),
    ("batch", False, 1.75, "MISSED"),  # contiguous B64: 1.8x
    ("batch", True, 1.89, "MISSED"),  # paged B64: 1.9x
    ("many", True, 1.91, "met"),
    ("multi", True, 1.71, "met"),
])
def test_fp8_targets_by_shape(role: str, paged: bool, speedup: float, verdict: str,
                              capsys: pytest.CaptureFixture[str]) -> None:
    """Each fp8 row is judged against its bf16 twin at its shape's target: contiguous 1.8x
    at the batch shape and 1.7x at the split-KV ones; paged 1.9x at the batch shapes and
    1.7x at the others."""
    layout = "paged16" if paged else "contiguous"
    bf16, fp8 = f"X {layout}", f"X {layout} fp8"
    results = [common.Result(bf16, "lmfuse", speedup, 1.0),
               common.Result(fp8, "lmfuse", 1.0, 1.0)]
    info = {bf16: decode_attention.CaseInfo(role, paged, False, 1, True),
            fp8: decode_attention.CaseInfo(role, paged, True, 1, True)}
    decode_attention.check_targets(results, info, 0.0, judge=True)
    assert f"fp8 {speedup:.2f}x bf16 tokens/s" in results[1].note
    assert results[1].note.endswith(f": {verdict}"), results[1].note
    capsys.readouterr()
