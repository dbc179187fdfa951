"""``lmfuse bench rms_norm --quick`` and ``lmfuse bench layer_norm --quick`` on the CPU
(Triton's interpreter, tests/conftest.py) as smoke runs, not performance: every case has its
five rows (lmfuse, torch, torch.compile and the copy timed; Liger-Kernel a row, saying why
it did not run where it cannot), each float32 peer agrees with lmfuse, and the bytes counted are the
minimal ones the harness's docstring lists."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from lmfuse.bench import layer_norm, rms_norm

ROWS = ("lmfuse", "torch", "torch.compile", "liger-kernel", "copy")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("harness", [rms_norm, layer_norm], ids=["rms_norm", "layer_norm"])
def test_quick_run_writes_every_case_and_row(harness, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "n.json"
    # (--graphs on the CPU: eager calls, as the environment says)
    assert harness.main(["--quick", "--graphs", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "# lmfuse against the copy of the same bytes" in printed
    data = json.loads(out.read_text())
    env, rows = data["environment"], data["results"]
    assert env["device"] == "cpu" and "liger-kernel" in env and data["copy"]["tbps"] > 0
    assert env["timing"].startswith("eager calls")
    op = harness.__name__.rsplit(".", 1)[-1]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    assert cases == [f"{op} {mode} [64, {H}] fp32" for H in (512, 1000)
                     for mode in ("fwd", "fwd+bwd")]
    for name in cases:
        by = {r["impl"]: r for r in rows if r["case"] == name}
        assert list(by) == list(ROWS)
        for impl in ("lmfuse", "torch", "torch.compile", "copy"):
            ms = by[impl]["ms"]
            assert ms is not None and math.isfinite(ms) and ms > 0, (name, impl, by[impl])
        assert by["lmfuse"]["ratio"] == 1.0
        for impl in ("torch", "torch.compile"):  # float32: lmfuse's result up to rounding
            note = by[impl]["note"]
            diff = re.search(r"rel\. diff ([0-9.e+-]+)", note)
            assert diff and float(diff.group(1)) < 1e-5 and "CHECK" not in note, note
        liger = by["liger-kernel"]  # (in the interpreter, Liger's libdevice calls fail)
        assert (liger["ms"] or 0) > 0 or liger["note"].startswith("failed: "), liger


def test_layer_norm_counts_the_minimal_bytes() -> None:
    n, H = 3, 5
    # forward: x read, y written (2-byte elements); the weight and the bias read (4-byte)
    assert layer_norm.minimal_bytes(n, H, 2, 4, False) == 2 * n * H * 2 + 2 * H * 4
    # backward besides: x, dy read and dx written; the weight read, its and the bias's
    # gradients written
    assert (layer_norm.minimal_bytes(n, H, 2, 4, True)
            == layer_norm.minimal_bytes(n, H, 2, 4, False) + 3 * n * H * 2 + 3 * H * 4)
