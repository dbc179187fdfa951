"""``lmfuse bench rms_norm --quick`` and ``lmfuse bench layer_norm --quick`` on the CPU
(Triton's interpreter, tests/conftest.py) as smoke runs, not performance: every case has its
five rows (lmfuse, torch, torch.compile and the copy timed; Liger-Kernel a row, saying why
it did not run where it cannot), each float32 peer agrees with lmfuse, and the bytes counted are the
minimal ones the harness's docstring lists."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import check_copy_rows

from lmfuse.bench import layer_norm, rms_norm


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
    check_copy_rows(rows, [f"{op} {mode} [64, {H}] fp32" for H in (512, 1000)
                           for mode in ("fwd", "fwd+bwd")])


def test_layer_norm_counts_the_minimal_bytes() -> None:
    n, H = 3, 5
    # forward: x read, y written (2-byte elements); the weight and the bias read (4-byte)
    assert layer_norm.minimal_bytes(n, H, 2, 4, False) == 2 * n * H * 2 + 2 * H * 4
    # backward besides: x, dy read and dx written; the weight read, its and the bias's
    # gradients written
    assert (layer_norm.minimal_bytes(n, H, 2, 4, True)
            == layer_norm.minimal_bytes(n, H, 2, 4, False) + 3 * n * H * 2 + 3 * H * 4)
