"""``lmfuse bench rope --quick`` on the CPU (Triton's interpreter, tests/conftest.py) as a smoke
run, not performance: every case has its five rows (lmfuse, transformers' function, its
torch.compile and the copy timed; Liger-Kernel a row, saying why it did not run where it
cannot), each float32 peer agrees with lmfuse, and the bytes counted are the minimal ones the
harness's docstring lists."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import check_copy_rows

from lmfuse.bench import rope


@pytest.mark.timeout(180)
def test_quick_run_writes_every_case_and_row(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rope.json"
    # (--graphs on the CPU: eager calls, as the environment says)
    assert rope.main(["--quick", "--graphs", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "# lmfuse against the copy of the same bytes" in printed
    data = json.loads(out.read_text())
    env, rows = data["environment"], data["results"]
    assert env["device"] == "cpu" and "liger-kernel" in env and "transformers" in env
    assert data["copy"]["tbps"] > 0 and env["timing"].startswith("eager calls")
    cases = [f"rope {mode} B{B} S{S} Hq{Hq}/Hk{Hk} D{D} fp32"
             for B, S, Hq, Hk, D in rope.QUICK_SHAPES for mode in ("fwd", "fwd+bwd")]
    for name, by in check_copy_rows(rows, cases).items():
        B, S, Hq, Hk, D = next(s for s in rope.QUICK_SHAPES
                               if name.endswith(f"B{s[0]} S{s[1]} Hq{s[2]}/Hk{s[3]} D{s[4]} fp32"))
        bw = "fwd+bwd" in name
        assert by["copy"]["tbps"] > 0
        assert by["lmfuse"]["tbps"] == pytest.approx(
            rope.minimal_bytes(B, S, Hq, Hk, D, D, 4, 4, bw) / by["lmfuse"]["ms"] / 1e9)


def test_rope_counts_the_minimal_bytes() -> None:
    B, S, Hq, Hk, D, R = 2, 3, 4, 1, 8, 6
    # forward: q and k read and written (2-byte elements); cos and sin [B, S, R] read (4-byte)
    fwd = 2 * B * S * (Hq + Hk) * D * 2 + 2 * B * S * R * 4
    assert rope.minimal_bytes(B, S, Hq, Hk, D, R, 2, 4, False) == fwd
    # backward besides: dq_embed and dk_embed read, dq and dk written, cos and sin read again
    assert rope.minimal_bytes(B, S, Hq, Hk, D, R, 2, 4, True) == 2 * fwd


def test_inputs_are_laid_out_as_transformers_makes_them() -> None:
    q = rope.heads_view(2, 5, 3, 8, torch.float32, torch.device("cpu"))
    assert q.shape == (2, 3, 5, 8) and not q.is_contiguous()
    assert q.transpose(1, 2).is_contiguous()  # the projection's [B, S, H, D]


def test_the_copied_formula_is_transformers() -> None:
    transformers = pytest.importorskip("transformers.models.llama.modeling_llama")
    q, k = torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8)
    cos, sin = torch.randn(1, 4, 8), torch.randn(1, 4, 8)
    for ours, theirs in zip(rope.formula(q, k, cos, sin),
                            transformers.apply_rotary_pos_emb(q, k, cos, sin), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
