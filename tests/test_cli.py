"""The ``lmfuse`` command (``lmfuse/cli.py``) and the harness behind ``lmfuse check``
(``lmfuse/_check.py``).

The commands run in-process through ``main(argv)``; a few run ``python -m lmfuse`` (and
``python -m lmfuse.cli``) in a subprocess to cover the module entry points and what a user
sees on stderr.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
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
    from lmfuse.integrations.transformers import SUPPORTED_MODEL_TYPES
    assert f"apply_lmfuse model types: {', '.join(SUPPORTED_MODEL_TYPES)}" in out
    assert "lmfuse.serving.Generator model types: llama," in out and "gpt_oss" in out
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


def python_m(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.mark.parametrize("module", ["lmfuse", "lmfuse.cli"])
def test_python_dash_m_runs_main(module: str) -> None:
    done = python_m(module, "info")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"lmfuse {lmfuse.__version__}\n")
    assert "fused_softmax: " in done.stdout


def test_python_dash_m_lmfuse_bad_argument_is_one_line() -> None:
    """What a user sees in a terminal: one line on stderr, exit 2, nothing on stdout."""
    done = python_m("lmfuse", "demo", "--batch", "0")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == ("lmfuse demo: --batch must be >= 1, got 0 "
                           "(see `lmfuse demo --help`)\n")


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
    # Decode attention has no backward: its rows show no gradient error, not a 0.
    decode = [line for line in out.splitlines() if line.startswith("decode_attention ")]
    assert decode and all(line.split()[-2:] == ["-", "pass"] for line in decode), out
    assert all(line.split()[-2] != "-" for line in rows)
    # Columns line up whatever the op's name (linear_cross_entropy, weighted_quick_geglu).
    header, *body = out.splitlines()[1:-1]
    assert len({len(line) for line in body}) == 1, "rows of different widths"
    result = header.index("result")
    assert all(line[result:] in ("pass", "FAIL") for line in body), out
    assert out.rstrip().endswith("all checks passed")


def only_softmax_checks(monkeypatch: pytest.MonkeyPatch, checks) -> None:
    """``lmfuse check`` with ``checks`` as the softmax family's cases and no other family's
    (their cases take tens of seconds in the interpreter; test_check_passes_every_case runs
    them)."""
    from lmfuse.activations import ops as activation_ops
    from lmfuse.attention import ops as attention_ops
    from lmfuse.cross_entropy import linear as linear_ce
    from lmfuse.cross_entropy import ops as cross_entropy_ops
    from lmfuse.moe import ops as moe_ops
    from lmfuse.norm import ops as norm_ops

    for module in (cross_entropy_ops, linear_ce, activation_ops, attention_ops, norm_ops,
                   moe_ops):
        monkeypatch.setattr(module, "checks", lambda device, dtypes: [])
    monkeypatch.setattr(softmax_ops, "checks", checks)


def test_check_dtypes_and_seed(capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def checks(device, dtypes):
        seen["dtypes"], seen["seed_draw"] = list(dtypes), torch.rand(()).item()
        return []

    only_softmax_checks(monkeypatch, checks)
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
    only_softmax_checks(monkeypatch, lambda device, dtypes: [wrong_case()])
    code, out, _ = run_cli(capsys, "check", "--dtypes", "fp32")
    assert code == 1
    (row,) = table_rows(out)
    assert "wrong on purpose" in row and row.split()[-1] == "FAIL"
    assert out.rstrip().endswith("SOME CHECKS FAILED")


# --- bench -----------------------------------------------------------------------------


@pytest.mark.parametrize("family", cli.FAMILIES)
def test_bench_harnesses_ship_in_the_package(family: str) -> None:
    """``lmfuse bench`` works from an installed package: each harness is a module of
    lmfuse.bench."""
    module = importlib.import_module(f"lmfuse.bench.{family}")
    path = Path(module.__file__).resolve()
    assert path == Path(lmfuse.__file__).resolve().parent / "bench" / f"{family}.py"
    assert cli._bench_main(family) is module.main


def test_bench_forwards_the_remaining_arguments(capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_main(argv):
        print("bench argv", argv)
        return 3

    monkeypatch.setattr(cli, "_bench_main", lambda family: fake_main)
    code, out, _ = run_cli(capsys, "bench", "softmax", "--quick", "--json", "x.json")
    assert code == 3
    assert "bench argv ['--quick', '--json', 'x.json']" in out


def test_bench_family_help_is_the_harness_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "bench", "softmax", "--help")
    assert (code, err) == (0, "")
    assert out.startswith("usage: lmfuse bench softmax ") and "--quick" in out


def test_bench_harness_missing_a_package_is_a_clear_error(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(family):
        raise ModuleNotFoundError("No module named 'transformers'", name="transformers")

    monkeypatch.setattr(cli, "_bench_main", missing)
    code, out, err = run_cli(capsys, "bench", "generate")
    assert (code, out) == (2, "")
    assert err == ("lmfuse bench generate: needs transformers, which is not installed here: "
                   "pip install transformers\n")


# --- bad arguments -----------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    pytest.param([], "lmfuse: the following arguments are required: command", id="no-command"),
    pytest.param(["frob"], "lmfuse: argument command: invalid choice: 'frob'",
                 id="unknown-command"),
    pytest.param(["info", "--bogus"], "lmfuse info: unrecognized arguments: --bogus",
                 id="info-extra"),
    pytest.param(["check", "extra"], "lmfuse check: unrecognized arguments: extra",
                 id="check-extra"),
    pytest.param(["check", "--dtypes", "fp8"],
                 "argument --dtypes: unknown dtype 'fp8'; choose one of fp32, fp16, bf16",
                 id="check-dtype-unknown"),
    pytest.param(["check", "--dtypes", "fp32,,bf16"], "unknown dtype ''",
                 id="check-dtype-empty"),
    pytest.param(["check", "--seed", "x"], "argument --seed: expected an integer, got 'x'",
                 id="check-seed"),
    pytest.param(["check", "--seed", "-1"], "argument --seed: must be >= 0, got -1",
                 id="check-seed-negative"),
    pytest.param(["check", "--seed", str(2**64)], "argument --seed: must be <= ",
                 id="check-seed-huge"),
    pytest.param(["bench"], "lmfuse bench: the following arguments are required: FAMILY",
                 id="bench-none"),
    pytest.param(["bench", "attention"], "argument FAMILY: invalid choice: 'attention'",
                 id="bench-unknown-family"),
    pytest.param(["bench", "softmax", "--bogus"],
                 "lmfuse bench softmax: unrecognized arguments: --bogus", id="bench-extra"),
    pytest.param(["bench", "softmax", "--json", "/no/such/dir/x.json"],
                 "argument --json: cannot write '/no/such/dir/x.json': no directory",
                 id="bench-json-dir"),
    pytest.param(["bench", "softmax", "--json", "/"],
                 "argument --json: cannot write '/': it is a directory", id="bench-json-is-dir"),
    pytest.param(["bench", "decode_attention", "--cases"],
                 "lmfuse bench decode_attention: argument --cases: expected one argument",
                 id="bench-decode-cases"),
    pytest.param(["bench", "generate", "--batches", "1,0"],
                 "argument --batches: each must be >= 1, got '1,0'", id="bench-generate-batch"),
    pytest.param(["bench", "generate", "--new-tokens", "1"],
                 "argument --new-tokens: must be >= 2, got 1", id="bench-generate-tokens"),
    pytest.param(["bench", "generate", "--heads", "3"],
                 "must be a multiple of --heads (3)", id="bench-generate-heads"),
    pytest.param(["bench", "generate", "--prompt-range", "9,2"],
                 "argument --prompt-range: need 1 <= LO <= HI, got '9,2'",
                 id="bench-generate-range"),
    pytest.param(["bench", "generate", "--rate", "-1"],
                 "argument --rate: must be >= 0, got -1.0", id="bench-generate-rate"),
    pytest.param(["bench", "generate", "--peers", "hf,vllm"],
                 "argument --peers: unknown vllm", id="bench-generate-peers"),
    pytest.param(["plan", "--batch", "0"], "lmfuse plan: --batch must be >= 1",
                 id="plan-batch-0"),
    pytest.param(["plan", "--kv-heads", "-2"], "--kv-heads must be >= 1, got -2",
                 id="plan-kv-heads-negative"),
    pytest.param(["plan", "--s-active", "9"], "--s-active must be 1..8", id="plan-s-active"),
    pytest.param(["plan", "--hbm-gib", "0"], "argument --hbm-gib: must be in (0, 1e+09], got 0",
                 id="plan-hbm-0"),
    pytest.param(["plan", "--hbm-gib", "nan"], "argument --hbm-gib: must be finite",
                 id="plan-hbm-nan"),
    pytest.param(["plan", "--hbm-gib", "1e308"], "argument --hbm-gib: must be in",
                 id="plan-hbm-huge"),
    pytest.param(["bench", "decode_attention", "--graph-calls", "4"],
                 "argument --graph-calls: needs --graphs", id="bench-graph-calls-alone"),
    pytest.param(["bench", "generate", "--vocab", "1"], "argument --vocab: must be >= 2",
                 id="bench-generate-vocab-1"),
    pytest.param(["bench", "generate", "--hidden", "12", "--heads", "4", "--kv-heads", "2"],
                 "(the head dim, 3) must be even", id="bench-generate-odd-head-dim"),
    pytest.param(["bench", "generate", "--kv-dtype", "fp16"],
                 "argument --kv-dtype: the cache holds the model's dtype", id="bench-kv-dtype"),
    pytest.param(["demo", "--cpu-threads", "100000"], "--cpu-threads must be <= 1024",
                 id="demo-cpu-threads-huge"),
    pytest.param(["demo", "--n-layers", "1000000"], "--n-layers must be <= 4096",
                 id="demo-layers-huge"),
    pytest.param(["plan", "--tp", "0"], "--tp must be >= 1", id="plan-tp-0"),
    pytest.param(["plan", "--context", "x"], "argument --context: invalid int value: 'x'",
                 id="plan-context-x"),
    pytest.param(["plan", "--calibrate", "/no/such/file.json"],
                 "lmfuse plan: calibration file /no/such/file.json:", id="plan-calibrate"),
    pytest.param(["tune", "linear_cross_entropy", "--max-chunk-mib", "0"],
                 "argument --max-chunk-mib: must be >= 1, got 0", id="tune-chunk-0"),
    pytest.param(["tune", "linear_cross_entropy", "--dtype", "fp32,bf16"],
                 "argument --dtype: unknown dtype 'fp32,bf16'", id="tune-two-dtypes"),
    pytest.param(["tune", "linear_cross_entropy", "--shape", "8,0,4"],
                 "argument --shape: each must be >= 1, got '8,0,4'", id="tune-shape-0"),
    pytest.param(["tune", "linear_cross_entropy", "--json", "/no/such/dir/t.json"],
                 "argument --json: cannot write", id="tune-json-dir"),
    pytest.param(["tune", "softmax"], "argument family: invalid choice: 'softmax'",
                 id="tune-family"),
    # generate's own argument errors, through the command (its checkpoint errors are in
    # test_generate_cli.py)
    pytest.param(["generate"], "lmfuse generate: the following arguments are required: "
                 "MODEL_DIR", id="generate-no-dir"),
    pytest.param(["generate", "/no/such/model", "--prompt", "a"],
                 "lmfuse generate: /no/such/model: no such directory", id="generate-missing"),
    pytest.param(["generate", "", "--prompt", "a"],
                 "argument MODEL_DIR: expected a non-empty value, got ''", id="generate-dir-empty"),
    pytest.param(["generate", "m", "--prompts-file", ""],
                 "argument --prompts-file: expected a non-empty value", id="generate-file-empty"),
    pytest.param(["generate", "m", "--max-new-tokens", "0"],
                 "argument --max-new-tokens: must be >= 1, got 0", id="generate-tokens-0"),
    pytest.param(["generate", "m", "--top-k", "-1"], "argument --top-k: must be >= 0",
                 id="generate-top-k"),
    pytest.param(["generate", "m", "--top-p", "0"], "argument --top-p: must be in (0, 1]",
                 id="generate-top-p"),
    pytest.param(["generate", "m", "--temperature", "inf"],
                 "argument --temperature: must be finite", id="generate-temperature"),
    pytest.param(["generate", "m", "--num-blocks", "0"], "argument --num-blocks: must be >= 1",
                 id="generate-blocks"),
    pytest.param(["generate", "m", "--seed", "x"], "argument --seed: expected an integer",
                 id="generate-seed"),
    pytest.param(["generate", "m", "--device", "tpu"], "argument --device: invalid choice",
                 id="generate-device"),
])
def test_bad_arguments_exit_2_with_one_line(capsys: pytest.CaptureFixture[str],
                                            argv: list[str], message: str) -> None:
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert out == ""
    assert message in err, err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err and "usage:" not in err


def test_bench_plot_format_is_checked_before_timing(capsys: pytest.CaptureFixture[str],
                                                   tmp_path: Path) -> None:
    """A --plot format matplotlib cannot write, or a directory, is refused before any
    timing; a name without a suffix gets the .png matplotlib writes."""
    pytest.importorskip("matplotlib")  # (installed by make test: `lmfuse[test]`)
    from lmfuse._cli_args import plot_file

    code, out, err = run_cli(capsys, "bench", "softmax", "--plot", str(tmp_path / "b.xyz"))
    assert (code, out) == (2, "") and "matplotlib cannot write .xyz files" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    code, out, err = run_cli(capsys, "bench", "softmax", "--plot", str(tmp_path))
    assert (code, out) == (2, "") and "it is a directory" in err, err
    assert plot_file("a/b") == "a/b.png" and plot_file("a/b.svg") == "a/b.svg"


@pytest.mark.parametrize("entries, message", [
    ('{"decode": [{"b": 1}], "collectives": [1], "merge": [1]}', "decode entry 0 has no 'bytes'"),
    ('{"decode": [1, 2], "collectives": [1], "merge": [1]}', "decode entry 0 is int 1, not an"),
    ('{"decode": "x", "collectives": [1], "merge": [1]}', "'decode' must be a list"),
])
def test_plan_calibration_entries_are_checked(capsys: pytest.CaptureFixture[str],
                                              tmp_path: Path, entries: str,
                                              message: str) -> None:
    cal = tmp_path / "cal.json"
    cal.write_text(entries)
    code, out, err = run_cli(capsys, "plan", "--calibrate", str(cal))
    assert (code, out) == (2, "") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.skipif(ON_CUDA, reason="checks the no-CUDA message")
def test_tune_without_cuda_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "tune", "linear_cross_entropy")
    assert (code, out) == (2, "")
    assert err == ("lmfuse tune: no CUDA device here; tuning times kernels on the GPU it "
                   "tunes for\n")


@pytest.mark.parametrize("family", ["softmax", "generate"])
def test_bench_plot_without_matplotlib_says_what_to_install(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, family: str,
        tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    code, out, err = run_cli(capsys, "bench", family, "--plot", str(tmp_path / "b.png"))
    assert (code, out) == (2, ""), out  # before any timing: nothing printed
    assert err == (f"lmfuse bench {family}: --plot needs matplotlib, which is not installed "
                   f"here: pip install 'lmfuse[bench]' (or matplotlib) (see `lmfuse bench "
                   f"{family} --help`)\n")


def test_ctrl_c_exits_130_without_a_traceback(capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_info", interrupted)
    assert run_cli(capsys, "info") == (130, "", "")


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


def test_check_without_cuda_runs_in_the_interpreter_in_a_child(monkeypatch) -> None:
    """Triton reads TRITON_INTERPRET when it is imported (``import lmfuse`` has done that):
    on a CPU without the variable, ``lmfuse check`` runs itself again in a child process
    that has it (setting it in this process crashed in the first kernel)."""
    import subprocess

    from lmfuse import cli

    calls = []
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(subprocess, "call", lambda argv, env: calls.append((argv, env)) or 3)
    assert cli.main(["check", "--dtypes", "fp32"]) == 3
    (argv, env), = calls
    assert argv[1:] == ["-m", "lmfuse", "check", "--dtypes", "fp32"]
    assert env["TRITON_INTERPRET"] == "1"


def test_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    """`lmfuse info | head -1`: the reader leaves; no BrokenPipeError traceback."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(Path(lmfuse.__file__).parents[1]))
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from lmfuse.cli import main; "
                             "sys.exit(main(['info']))"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # before it writes anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


@pytest.mark.parametrize("seed", ["0", "3"])
def test_check_on_the_reference_path_alone_passes(seed: str) -> None:
    """Without Triton's interpreter (TRITON_INTERPRET=0, or no Triton: macOS, Windows) every
    case runs the reference path against its float64 oracle: the MoE float8-store cases
    failed there, their oracle rounding h once where the path rounds it twice (its 16-bit
    GEMM output, then float8)."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(Path(lmfuse.__file__).parents[1]),
               TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-m", "lmfuse", "check", "--dtypes", "fp16,bf16",
                           "--seed", seed], capture_output=True, text=True, env=env,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "reference only" in proc.stdout and "fp8 store" in proc.stdout
