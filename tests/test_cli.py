"""The ``lmfuse`` command (``lmfuse/cli.py``) and the harness behind ``lmfuse check``
(``lmfuse/_check.py``).

The commands run in-process through ``main(argv)``; one test runs ``python -m lmfuse.cli``
in a subprocess to cover the module entry point.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
import triton
from helpers import randn, run_cli

import lmfuse
from lmfuse import _check, cli
from lmfuse._check import TOLERANCE, CheckCase, bound, rel_err, run_all, run_case
from lmfuse.softmax import ops as softmax_ops

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
ON_CUDA = torch.cuda.is_available()


# --- info ------------------------------------------------------------------------------


def test_info_prints_versions_devices_and_paths(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "info")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"lmfuse {lmfuse.__version__}"
    assert f"torch {torch.__version__}" in lines[1]
    assert f"triton {triton.__version__}" in lines[1]
    assert "python " in lines[1]
    if ON_CUDA:
        assert "cuda:0 " in out and "SMs" in out
    else:
        assert "no CUDA device" in out
    assert "Triton interpreter (TRITON_INTERPRET=1): on" in out
    # The per-op path: what explain() says for a sample input on the best device.
    assert "fused_softmax: triton (auto:" in out
    assert "band: keys p-inf .. p+0" in out  # the sample is causal


def test_info_with_interpreter_off_reports_the_reference_path(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    code, out, err = run_cli(capsys, "info")
    assert code == 0, err
    if ON_CUDA:
        assert "fused_softmax: triton (auto: CUDA tensor" in out
    else:
        assert "Triton interpreter (TRITON_INTERPRET=1): off" in out
        assert "fused_softmax: torch (auto: reference path because CPU tensor" in out


def test_python_dash_m_runs_main() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-m", "lmfuse.cli", "info"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"lmfuse {lmfuse.__version__}\n")
    assert "fused_softmax: " in done.stdout


def test_console_script_points_at_main() -> None:
    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "lmfuse"]
    assert ep.value == "lmfuse.cli:main"
    assert ep.load() is cli.main


# --- check -----------------------------------------------------------------------------


def table_rows(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("fused_softmax ")]


def test_check_passes_every_case(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "check")
    assert code == 0, out + err
    where = "cuda" if ON_CUDA else "cpu, Triton kernels in the interpreter"
    assert out.startswith(f"lmfuse check on {where}:")
    header = next(line for line in out.splitlines() if line.startswith("op "))
    for column in ("case", "dtype", "shape", "impl", "fwd rel err", "grad rel err", "result"):
        assert column in header
    rows = table_rows(out)
    assert len(rows) == 24, out  # 8 cases x fp32, fp16, bf16
    for dtype in ("float32", "float16", "bfloat16"):
        assert sum(f" {dtype} " in r for r in rows) == 8, f"{dtype}: {out}"
    assert all(r.split()[-1] == "pass" for r in rows), out
    assert all(" triton " in r for r in rows), "auto should run the Triton kernels here"
    assert out.rstrip().endswith("all checks passed")


def test_check_dtypes_and_seed(capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def checks(device, dtypes):
        seen["dtypes"], seen["seed_draw"] = list(dtypes), torch.rand(()).item()
        return []

    monkeypatch.setattr(softmax_ops, "checks", checks)
    code, out, _ = run_cli(capsys, "check", "--dtypes", "bf16,fp32", "--seed", "7")
    assert code == 0 and "all checks passed" in out
    assert seen["dtypes"] == [BF16, F32]
    torch.manual_seed(7)
    assert seen["seed_draw"] == torch.rand(()).item(), "--seed did not seed torch"


def wrong_case(label: str = "wrong on purpose") -> CheckCase:
    """A case whose fused side is off by 1% (the reference side is right)."""

    def call(impl, x):
        y = lmfuse.fused_softmax(x, impl=impl)
        return y if impl == "torch" else y * 1.01

    return CheckCase("fused_softmax", label, F32, (1, 1, 2, 5),
                     lambda: [randn((1, 1, 2, 5), requires_grad=True)], call,
                     lambda x: lmfuse.explain(lmfuse.fused_softmax, x))


def test_check_exits_1_when_a_case_fails(capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(softmax_ops, "checks", lambda device, dtypes: [wrong_case()])
    code, out, _ = run_cli(capsys, "check", "--dtypes", "fp32")
    assert code == 1
    (row,) = table_rows(out)
    assert "wrong on purpose" in row and row.split()[-1] == "FAIL"
    assert out.rstrip().endswith("SOME CHECKS FAILED")


# --- bench -----------------------------------------------------------------------------


def test_bench_script_is_found_in_the_checkout() -> None:
    path = cli._bench_script("softmax")
    assert path.name == "softmax.py" and path.parent.name == "bench"
    assert path.is_file()


def test_bench_forwards_the_remaining_arguments(capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    script = tmp_path / "fake_bench.py"
    script.write_text(textwrap.dedent("""
        def main(argv):
            print("bench argv", argv)
            return 3
    """))
    monkeypatch.setattr(cli, "_bench_script", lambda family: script)
    code, out, _ = run_cli(capsys, "bench", "softmax", "--quick", "--json", "x.json")
    assert code == 3
    assert "bench argv ['--quick', '--json', 'x.json']" in out


def test_bench_without_the_script_is_a_clear_error(capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    missing = tmp_path / "bench" / "softmax.py"
    monkeypatch.setattr(cli, "_bench_script", lambda family: missing)
    code, out, err = run_cli(capsys, "bench", "softmax")
    assert code == 2
    assert f"lmfuse bench: {missing} not found" in err and out == ""


# --- bad arguments -----------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    pytest.param([], "the following arguments are required: command", id="no-command"),
    pytest.param(["frob"], "invalid choice: 'frob'", id="unknown-command"),
    pytest.param(["info", "--bogus"], "unrecognized arguments: --bogus", id="info-extra"),
    pytest.param(["check", "extra"], "unrecognized arguments: extra", id="check-extra"),
    pytest.param(["check", "--dtypes", "fp8"],
                 "argument --dtypes: unknown dtype(s) 'fp8'; choose from fp32, fp16, bf16",
                 id="check-dtype-unknown"),
    pytest.param(["check", "--dtypes", "fp32,,bf16"], "unknown dtype(s) ''",
                 id="check-dtype-empty"),
    pytest.param(["check", "--seed", "x"], "argument --seed: invalid int value: 'x'",
                 id="check-seed"),
    pytest.param(["bench"], "the following arguments are required: family", id="bench-none"),
    pytest.param(["bench", "attention"], "argument family: invalid choice: 'attention'",
                 id="bench-unknown-family"),
])
def test_bad_arguments_exit_2_with_a_message(capsys: pytest.CaptureFixture[str],
                                             argv: list[str], message: str) -> None:
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert message in err, err
    assert "usage: lmfuse" in err
    assert "Traceback" not in out + err


def test_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0
    for command in ("info", "check", "bench"):
        assert command in out


# --- lmfuse._check ---------------------------------------------------------------------


def tiny_case(dtype: torch.dtype, call=None) -> CheckCase:
    shape = (1, 2, 3, 5)

    def inputs():
        return [randn(shape, dtype, requires_grad=True), randn((2,), dtype, requires_grad=True)]

    def default_call(impl, x, offset):
        return lmfuse.fused_softmax(x, scale=0.5, causal=True, softmax_offset=offset, impl=impl)

    def plan(x, offset):
        return lmfuse.explain(lmfuse.fused_softmax, x, scale=0.5, causal=True,
                              softmax_offset=offset)

    return CheckCase("fused_softmax", "tiny causal + sink", dtype, shape, inputs,
                     call or default_call, plan)


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["float32", "float16", "bfloat16"])
def test_run_case_passes_on_a_correct_op(dtype: torch.dtype) -> None:
    r = run_case(tiny_case(dtype))
    assert r.ok, r
    assert (r.op, r.label, r.dtype, r.shape, r.impl) == (
        "fused_softmax", "tiny causal + sink", str(dtype).replace("torch.", ""), "1x2x3x5",
        "triton")
    assert 0 <= r.fwd_err <= TOLERANCE[dtype]
    assert 0 < r.grad_err <= TOLERANCE[dtype], "gradients were not compared"


def test_run_case_reports_a_wrong_forward() -> None:
    r = run_case(wrong_case())
    assert not r.ok
    assert r.fwd_err == pytest.approx(0.01, rel=1e-3)


def test_run_case_reports_a_wrong_gradient_with_a_right_forward() -> None:
    def call(impl, x, offset):
        y = lmfuse.fused_softmax(x, scale=0.5, causal=True, softmax_offset=offset, impl=impl)
        if impl == "torch":
            return y
        # The same values, but autograd sees no dependence on the inputs: zero gradients.
        return y.detach() + 0 * x + 0 * offset.sum()

    r = run_case(tiny_case(F32, call))
    assert not r.ok
    assert r.fwd_err <= TOLERANCE[F32]
    assert r.grad_err == pytest.approx(1.0)


def test_run_case_reports_nan_as_infinite_error() -> None:
    def call(impl, x, offset):
        y = lmfuse.fused_softmax(x, scale=0.5, causal=True, softmax_offset=offset, impl=impl)
        return y if impl == "torch" else y * float("nan")

    r = run_case(tiny_case(F32, call))
    assert not r.ok and r.fwd_err == float("inf")


def test_run_case_compares_against_float64() -> None:
    seen = []

    def call(impl, x, offset):
        seen.append((impl, x.dtype, offset.dtype))
        return lmfuse.fused_softmax(x, scale=0.5, causal=True, softmax_offset=offset, impl=impl)

    assert run_case(tiny_case(F16, call)).ok
    assert seen == [("auto", F16, F16), ("torch", torch.float64, torch.float64)]


def test_run_all_prints_one_row_per_case_and_returns_false_on_failure() -> None:
    lines: list[str] = []
    ok = run_all([tiny_case(F32), wrong_case("the bad one")], out=lines.append)
    assert ok is False
    assert len(lines) == 3 and lines[0].startswith("op ")
    assert lines[1].split()[-1] == "pass" and "tiny causal + sink" in lines[1]
    assert lines[2].split()[-1] == "FAIL" and "the bad one" in lines[2]
    lines.clear()
    assert run_all([tiny_case(F32)], out=lines.append) is True


def test_rel_err_and_bound() -> None:
    e = torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert rel_err(e, e) == 0.0
    assert rel_err(e + torch.tensor([0.0, 0.5], dtype=torch.float64), e) == pytest.approx(0.1)
    assert rel_err(torch.tensor([float("nan"), 1.0]), e) == float("inf")
    assert rel_err(torch.tensor([float("inf"), 1.0]), e) == float("inf")
    assert rel_err(torch.tensor([0.5, 0.0]), torch.zeros(2)) == 0.5  # absolute when ||e|| = 0
    assert bound(e, F32) == TOLERANCE[F32]
    # Values that fp16 can only store as subnormals: the bound is twice the storage error.
    tiny = torch.tensor([1.2345e-7, 3.3e-7, 5.55e-6], dtype=torch.float64)
    storage = rel_err(tiny.to(F16), tiny)
    assert storage > TOLERANCE[F16]
    assert bound(tiny, F16) == pytest.approx(2 * storage)
    assert _check.TOLERANCE is TOLERANCE
