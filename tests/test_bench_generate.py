"""``lmfuse bench generate --quick`` on the CPU: the smoke run of the generation benchmark (a
tiny Llama, float32) writes the rows it promises -- the bandwidth floor, lmfuse's
``Generator`` and HF ``generate`` with positive times, greedy tokens equal between them --
labelled as a smoke run, not performance. The Generator runs its torch path here
(``--impl torch``): the harness is under test, and Triton's interpreter would take a minute
over the same steps (tests/serving/ runs the Generator's Triton path)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def load_bench():
    from lmfuse.bench import generate

    return generate


@pytest.mark.timeout(120)
def test_quick_run_writes_the_expected_rows(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "generate.json"
    assert load_bench().main(["--quick", "--impl", "torch", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "SMOKE RUN" in printed and "NOT performance" in printed
    data = json.loads(out.read_text())
    env, rows = data["environment"], data["results"]
    assert env["smoke"] is True and env["kv_bytes_per_token"] == {"fp32": 2 * 2 * 2 * 16 * 4}
    assert env["device"] == "cpu" and data["copy"]["tbps"] > 0
    by = {(r["case"], r["impl"]): r for r in rows}
    for batch in (1, 2):
        step = f"decode step B{batch} P16 N8"
        e2e = f"generate B{batch} P16 N8 (end to end)"
        floor, lm = by[(step, "floor")], by[(step, "lmfuse")]
        assert floor["ms"] > 0 and floor["tbps"] > 0
        assert lm["ms"] > 0 and lm["ratio"] == 1.0 and "tok/s" in lm["note"]
        assert by[(e2e, "lmfuse generate()")]["ms"] > 0
        assert by[(e2e, "hf dynamic")]["ms"] > 0
        hf = by[(step, "hf dynamic")]
        assert (hf["ms"] or 0) > 0 or "noise" in hf["note"]
        # float32: greedy tokens are the same as transformers' own
        assert f"tokens = lmfuse's in {batch}/{batch}" in hf["note"]
        for impl in ("hf static+compile", "hf generate_batch"):  # a row, run or failed
            assert (step, impl) in by or (e2e, impl) in by
    for case in ("prefill 1x4", "prefill 2x12"):  # the smoke run's prefill cases
        lm, model_path = by[(case, "lmfuse")], by[(case, "lmfuse model path")]
        assert lm["ms"] > 0 and lm["ratio"] == 1.0 and "prompt tok/s" in lm["note"]
        assert model_path["ms"] > 0 and model_path["ratio"] > 0
    mixed = [r for r in rows if r["case"].startswith("mixed 6 req")]
    assert {r["impl"] for r in mixed} >= {"lmfuse", "hf generate (batches of 4)"}
    assert all(r["ms"] > 0 and "req/s" in r["note"] for r in mixed if r["impl"] == "lmfuse")
    assert {t["impl"] for t in env["tokens_per_s"]} >= {"lmfuse", "hf dynamic"}
