"""``lmfuse bench host --quick`` on the CPU, in Triton's interpreter (tests/conftest.py): the
host-time harness writes the rows it promises -- lmfuse and the plain torch formula for
every op in each of its modes with finite positive microseconds, a Liger-Kernel row (not
installed here: a note saying so) for every op Liger has, the breakdown rows -- as a smoke
run, not performance; ``--ops`` times the ops it names only, and refuses a name it does not
know before any work."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import run_cli

from lmfuse.bench import host

TRAINING = ("rms_norm", "layer_norm", "rope", "swiglu", "geglu", "quick_geglu", "bias_gelu",
            "squared_relu", "weighted_swiglu", "weighted_quick_geglu", "weighted_squared_relu",
            "fused_softmax", "cross_entropy", "linear_cross_entropy", "moe_experts")
INFERENCE = ("decode_attention", "kv_cache_append", "merge_attention_states")
WITH_LIGER = ("rms_norm", "layer_norm", "rope", "swiglu", "geglu", "cross_entropy",
              "linear_cross_entropy")


def positive(us) -> bool:
    return isinstance(us, float) and math.isfinite(us) and us > 0


@pytest.mark.timeout(120)
def test_quick_run_writes_every_op_and_mode(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "h.json"
    assert host.main(["--quick", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "SMOKE RUN" in printed and "lmfuse's host time per call, split" in printed
    data = json.loads(out.read_text())
    env, rows = data["environment"], data["results"]
    assert env["smoke"] is True and env["device"] == "cpu"
    assert set(env["inputs"]) == set(TRAINING + INFERENCE) == set(env["breakdown"])
    by = {(r["op"], r["mode"], r["impl"]): r for r in rows}
    assert len(by) == len(rows)  # one row per (op, mode, impl)
    for op in TRAINING + INFERENCE:
        modes = host.MODES if op in TRAINING else ("fwd",)
        assert {m for o, m, _ in by if o == op} == set(modes)
        for mode in modes:
            for impl in ("lmfuse", "torch"):
                r = by[(op, mode, impl)]
                assert positive(r["us"]), r
                assert r["ms"] == pytest.approx(r["us"] / 1e3)
                assert r["case"] == f"{op} {mode}"
            assert by[(op, mode, "lmfuse")]["ratio"] == 1.0
            assert by[(op, mode, "lmfuse")]["note"] == "path triton"  # the interpreter
            liger = by.get((op, mode, host.LIGER))
            if op in WITH_LIGER:  # Liger-Kernel is not installed in the test environment
                assert liger is not None and liger["us"] is None
                assert liger["note"].startswith("unavailable: ")
            else:
                assert liger is None
        # The breakdown: checks in fwd, launches in fwd and fwd+bwd, or a note why not.
        checks = by[(op, "fwd", host.CHECKS)]
        assert positive(checks["us"]) or (op == "kv_cache_append"
                                           and checks["note"].startswith("none"))
        for mode in ("fwd", "fwd+bwd") if op in TRAINING else ("fwd",):
            launch = by[(op, mode, host.LAUNCH)]
            if op == "linear_cross_entropy":
                assert launch["us"] is None and launch["note"].startswith("none")
            else:
                assert positive(launch["us"]), launch
    split = env["breakdown"]["rms_norm"]
    assert positive(split["fwd"]) and positive(split["checks"]) and positive(split["launch"])
    assert split["target"] == "liger-kernel did not run"


@pytest.mark.timeout(120)
def test_ops_option_times_those_ops_only(tmp_path: Path) -> None:
    out = tmp_path / "h.json"
    assert host.main(["--quick", "--ops", "layer_norm,rms_norm", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    env, rows = data["environment"], data["results"]
    assert list(env["inputs"]) == ["rms_norm", "layer_norm"] == list(env["breakdown"])
    assert {r["op"] for r in rows} == {"rms_norm", "layer_norm"}
    for op in ("rms_norm", "layer_norm"):
        assert {r["mode"] for r in rows if r["op"] == op} == set(host.MODES)


@pytest.mark.parametrize("ops, message", [
    ("layer_norm,bogus", "argument --ops: unknown bogus; choose from rms_norm, layer_norm, rope, "),
    (",", "argument --ops: no op in ','; choose from rms_norm, "),
])
def test_ops_option_names_the_ops_it_knows(ops: str, message: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "bench", "host", "--ops", ops)
    assert (code, out) == (2, "")  # before any work
    assert err.startswith(f"lmfuse bench host: {message}") and len(err.splitlines()) == 1
