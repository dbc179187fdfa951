"""``lmfuse demo`` (src/lmfuse/demo.py), shortened: the lmfuse model learns, its loss curve
is the plain PyTorch model's, and decoding through ``lmfuse.serving.Generator`` continues
prompts as the Llama model's own ``generate`` does (the model itself: test_tiny_gpt.py).

conftest.py sets TRITON_INTERPRET=1, under which ``impl="auto"`` would run the Triton
kernels in the interpreter on the CPU (slow at these shapes); the demo runs here with
``impl="torch"``, the ops' reference paths. The command's bad options (one line on stderr,
exit 2, before any work) run through ``lmfuse.cli.main``.
"""

from __future__ import annotations

import re
import sys
from dataclasses import asdict

import pytest
import torch
from helpers import run_cli

from lmfuse import demo
from lmfuse.demo import DEFAULT_PROMPTS, DEFAULTS, DemoConfig, check_config, run

SMALL = dict(steps=40, d_model=32, n_layers=2, n_heads=2, ffn=64, seq_len=32, batch=4,
             lr=1e-2, impl="torch", new_tokens=8, quiet=True)


@pytest.fixture(scope="module")
def result():
    return run(DemoConfig(**SMALL))


def test_demo_loss_falls(result):
    assert len(result.lmfuse.losses) == SMALL["steps"]
    assert result.lmfuse.losses[-1] < 0.8 * result.lmfuse.losses[0]


def test_demo_lmfuse_matches_plain_pytorch(result):
    # fp32, same weights and batches: the curves differ by rounding only.
    assert result.max_loss_rel_diff < 1e-3, result.max_loss_diff


def test_demo_generator_decodes_as_hf_generate(result):
    assert result.decoded == result.plain_decoded == result.decoded_again
    assert result.decode_matches
    assert result.decode_logits_ok and result.decode_logit_err < 1e-4, result.decode_logit_err
    assert [len(c) for c in result.decoded] == [SMALL["new_tokens"]] * len(result.prompts)
    assert len({len(p) for p in result.prompts}) > 1  # prompts of different lengths
    assert result.decode_tokens_per_s > 0 and result.plain_decode_tokens_per_s > 0
    assert result.cuda_graphs == 0 and result.decode_peak_mib is None  # the CPU
    assert result.config.log_every == 4 and result.config.d_model == SMALL["d_model"]


def test_tokens_unlike_hf_generate_exit_1_in_fp32(capsys, monkeypatch):
    def off_by_one(*args, **kwargs):
        out = plain_generate(*args, **kwargs)
        out.tokens[0][-1] = (out.tokens[0][-1] + 1) % 256
        return out

    plain_generate = demo.generate_plain
    monkeypatch.setattr(demo, "generate_plain", off_by_one)
    code, out, _ = run_cli(capsys, "demo", "--device", "cpu", "--impl", "torch", "--steps", "2",
                           "--d-model", "16", "--n-heads", "2", "--ffn", "16", "--seq-len",
                           "8", "--batch", "1", "--new-tokens", "3", "--prompt", "ab")
    assert code == 1, out
    assert "identical to the same model's transformers generate: no" in out


def test_models_that_train_differently_exit_1(capsys, monkeypatch):
    """The fused model's loss scaled by 1.5 (a wrong op): the demo printed the loss
    difference and still exited 0."""
    from lmfuse import tiny_gpt

    real = tiny_gpt.lmfuse.linear_cross_entropy
    monkeypatch.setattr(tiny_gpt.lmfuse, "linear_cross_entropy",
                        lambda *a, **k: real(*a, **k) * 1.5)
    code, out, _ = run_cli(capsys, "demo", "--device", "cpu", "--impl", "torch", "--steps", "2",
                           "--d-model", "16", "--n-heads", "2", "--ffn", "16", "--seq-len",
                           "8", "--batch", "1", "--new-tokens", "3", "--prompt", "ab")
    assert code == 1, out
    assert "FAILED: the two models train differently" in out


def test_demo_sampling_and_custom_text(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    r = run(DemoConfig(**{**SMALL, "steps": 5}, text=str(text), sample=True))
    assert len(r.prompts) == DEFAULTS["cpu"].prompts
    assert all(p and p in text.read_text() for p in r.prompts)
    assert r.sampled is not None and all(len(c) == SMALL["new_tokens"] for c in r.sampled)
    assert all(0 <= t < 256 for c in r.sampled for t in c)


def test_unset_options_take_the_device_defaults(monkeypatch):
    cpu = check_config(DemoConfig(device="cpu"))
    want = {k: v for k, v in asdict(DEFAULTS["cpu"]).items() if k != "prompts"}
    assert {k: getattr(cpu.config, k) for k in want} == want
    assert cpu.config.log_every == DEFAULTS["cpu"].steps // 10
    assert cpu.prompts == list(DEFAULT_PROMPTS[:DEFAULTS["cpu"].prompts])
    assert set(cpu.defaulted) == set(want) | {"log_every"}
    # A device that resolves to CUDA takes the CUDA sizes; the options given stay.
    monkeypatch.setattr(demo, "_device", lambda text, name: torch.device("cuda"))
    cuda = check_config(DemoConfig(device="auto", d_model=512, steps=10))
    gpu = DEFAULTS["cuda"]
    assert (cuda.config.d_model, cuda.config.steps, cuda.config.n_layers, cuda.config.seq_len,
            cuda.config.new_tokens, cuda.config.lr) == (512, 10, gpu.n_layers, gpu.seq_len,
                                                        gpu.new_tokens, gpu.lr)
    assert cuda.dtype == "bf16" and len(cuda.prompts) == gpu.prompts == 8
    assert "d_model" not in cuda.defaulted and "n_layers" in cuda.defaulted
    assert gpu.d_model > DEFAULTS["cpu"].d_model


def test_help_gives_both_defaults(capsys):
    code, out, _ = run_cli(capsys, "demo", "--help")
    assert code == 0
    assert "model width, >= 1 (default 64 on the CPU, 1024 on CUDA)" in " ".join(out.split())
    assert "lmfuse.serving.Generator" in out


# --- bad options: one line on stderr, exit 2, before any work ------------------------------


@pytest.mark.parametrize("argv, message", [
    pytest.param(["--prompt", ""], "--prompt number 1 is empty", id="empty-prompt"),
    pytest.param(["--prompt", "def", "--prompt", ""], "--prompt number 2 is empty",
                 id="second-prompt-empty"),
    pytest.param(["--batch", "0"], "--batch must be >= 1, got 0", id="batch-0"),
    pytest.param(["--batch", "-2"], "--batch must be >= 1, got -2", id="batch-negative"),
    pytest.param(["--steps", "0"], "--steps must be >= 1, got 0", id="steps-0"),
    pytest.param(["--seq-len", "0"], "--seq-len must be >= 1, got 0", id="seq-len-0"),
    pytest.param(["--d-model", "0"], "--d-model must be >= 1, got 0", id="d-model-0"),
    pytest.param(["--n-heads", "0"], "--n-heads must be >= 1, got 0", id="n-heads-0"),
    pytest.param(["--n-layers", "-1"], "--n-layers must be >= 1, got -1", id="n-layers-neg"),
    pytest.param(["--ffn", "0"], "--ffn must be >= 1, got 0", id="ffn-0"),
    pytest.param(["--new-tokens", "0"], "--new-tokens must be >= 1, got 0", id="new-tokens-0"),
    pytest.param(["--cpu-threads", "-1"], "--cpu-threads must be >= 0, got -1",
                 id="cpu-threads-negative"),
    pytest.param(["--seed", "-1"], "--seed must be >= 0, got -1", id="seed-negative"),
    pytest.param(["--seed", str(2**64)], "--seed must be <= 9223372036854775807",
                 id="seed-huge"),
    pytest.param(["--lr", "0"], "--lr must be a finite number > 0, got 0.0", id="lr-0"),
    pytest.param(["--lr", "nan"], "--lr must be a finite number > 0, got nan", id="lr-nan"),
    pytest.param(["--sample", "--temperature", "0"],
                 "--temperature must be a finite number > 0, got 0.0", id="temperature-0"),
    pytest.param(["--temperature", "-1"], "--temperature must be a finite number > 0",
                 id="temperature-negative"),
    pytest.param(["--d-model", "10", "--n-heads", "4"],
                 "--d-model (10) must be --n-heads (4) times an even head size",
                 id="heads-do-not-divide"),
    pytest.param(["--d-model", "6", "--n-heads", "2"],
                 "--d-model (6) must be --n-heads (2) times an even head size", id="odd-head"),
    pytest.param(["--device", "mps"], "--device must be auto, cpu, cuda or cuda:N, got 'mps'",
                 id="device-unknown"),
    pytest.param(["--device", "cuda:x"], "--device must be auto, cpu, cuda or cuda:N",
                 id="device-bad-index"),
    pytest.param(["--text", "/no/such/file.txt"],
                 "--text /no/such/file.txt: cannot read it: No such file or directory",
                 id="text-missing"),
    pytest.param(["--seq-len", "100000000"], "--seq-len must be <= 1048576, got 100000000",
                 id="seq-len-huge"),
    pytest.param(["--batch", "x"], "argument --batch: invalid int value: 'x'", id="batch-x"),
    pytest.param(["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'", id="dtype"),
    pytest.param(["--bogus"], "unrecognized arguments: --bogus", id="unknown-option"),
])
def test_bad_option_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run_cli(capsys, "demo", *argv)
    assert (code, out) == (2, ""), out  # nothing printed: the demo did not start
    assert err.startswith("lmfuse demo: ") and message in err, err
    assert err.endswith(" (see `lmfuse demo --help`)\n") and err.count("\n") == 1, err


def test_seq_len_past_the_text(capsys, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("x" * 500)
    code, out, err = run_cli(capsys, "demo", "--text", str(text), "--seq-len", "1000")
    assert (code, out) == (2, ""), out
    assert "--seq-len 1000 needs a text of at least 1002 bytes" in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_device_cuda_without_cuda(capsys, device):
    code, out, err = run_cli(capsys, "demo", "--device", device)
    assert (code, out) == (2, "")
    assert err == (f"lmfuse demo: --device {device}: no CUDA device here; use cpu or auto "
                   "(see `lmfuse demo --help`)\n")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA, impl='triton' can run")
def test_impl_triton_without_the_interpreter(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    code, out, err = run_cli(capsys, "demo", "--impl", "triton")
    assert (code, out) == (2, "")
    assert err.startswith("lmfuse demo: --impl triton cannot run on cpu: CPU tensor and "
                          "Triton's interpreter is off (set TRITON_INTERPRET=1); use auto or "
                          "torch, or a CUDA device"), err
    assert err.count("\n") == 1


def test_text_too_short_and_unreadable(capsys, tmp_path):
    short = tmp_path / "short.txt"
    short.write_bytes(b"0123456789")
    code, out, err = run_cli(capsys, "demo", "--text", str(short), "--seq-len", "9")
    assert (code, out) == (2, "")
    assert f"--seq-len 9 needs a text of at least 11 bytes; {short} has 10" in err, err
    code, out, err = run_cli(capsys, "demo", "--text", str(tmp_path))
    assert (code, out) == (2, "")
    assert f"--text {tmp_path}: cannot read it: Is a directory" in err, err


def test_plot_without_matplotlib_says_what_to_install_first(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    code, out, err = run_cli(capsys, "demo", "--plot", str(tmp_path / "loss.png"))
    assert (code, out) == (2, ""), out  # before training, not after it
    assert err == ("lmfuse demo: --plot needs matplotlib, which is not installed here: pip "
                   "install 'lmfuse[plot]' (or matplotlib) (see `lmfuse demo --help`)\n")


def test_without_transformers_says_what_to_install_first(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    code, out, err = run_cli(capsys, "demo")
    assert (code, out) == (2, ""), out  # before training, not after it
    assert err == ("lmfuse demo: decoding through lmfuse.serving.Generator (a transformers "
                   "model) needs transformers, which is not installed here: pip install "
                   "'transformers>=5,<6' (see `lmfuse demo --help`)\n")


def test_plot_path_is_checked_first(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    code, out, err = run_cli(capsys, "demo", "--plot", str(tmp_path / "no" / "loss.png"))
    assert (code, out) == (2, "") and "no directory" in err, err
    code, out, err = run_cli(capsys, "demo", "--plot", str(tmp_path / "loss.xyz"))
    assert (code, out) == (2, "") and "matplotlib cannot write .xyz files" in err, err
    code, out, err = run_cli(capsys, "demo", "--plot", str(tmp_path))
    assert (code, out) == (2, "") and "is a directory" in err, err


@pytest.mark.parametrize("bad, message", [
    ({"prompts": "hello"}, "prompts must be a list of strings, got 'hello'"),
    ({"prompts": ["a", 3]}, "prompts must be a list of strings"),
    ({"text": 123}, "text must be a path (str) or None, got int 123"),
    ({"temperature": True}, "temperature must be a finite number > 0, got True"),
    ({"sample": "no"}, "sample must be True or False, got 'no'"),
])
def test_config_types_are_checked(bad, message):
    """A string of prompts became its letters, an int text a TypeError naming nothing, a
    bool temperature 1.0."""
    with pytest.raises(ValueError, match=re.escape(f"DemoConfig.{message}")):
        check_config(DemoConfig(**{**SMALL, **bad}))


def test_run_checks_the_config_before_any_work():
    with pytest.raises(ValueError, match=r"^DemoConfig.batch must be >= 1, got 0$"):
        run(DemoConfig(**{**SMALL, "batch": 0}))
    with pytest.raises(ValueError, match=r"^DemoConfig.prompts number 1 is empty$"):
        run(DemoConfig(**SMALL, prompts=[""]))
    with pytest.raises(ValueError, match=r"^DemoConfig.steps must be an integer, got 2.5$"):
        check_config(DemoConfig(**{**SMALL, "steps": 2.5}))
    setup = check_config(DemoConfig(**SMALL))
    assert setup.device == torch.device("cpu") and setup.dtype == "fp32"
    assert setup.prompts == list(DEFAULT_PROMPTS[:4]) and len(setup.text) > 10_000


TINY = ("--d-model", "16", "--n-heads", "2", "--n-layers", "1", "--ffn", "32", "--seq-len",
        "16", "--batch", "2")


def test_a_diverged_training_is_a_failure(capsys):
    """A loss that turns NaN (here a learning rate of 1e30) fails the demo, exit 1, with a
    line saying so (Python's max skipped the NaN differences, and the demo passed)."""
    code, out, err = run_cli(capsys, "demo", "--lr", "1e30", "--steps", "3", "--new-tokens",
                             "2", *TINY)
    assert code == 1
    assert "nan" in out
    assert "lmfuse demo: training diverged" in err, err


def test_fp16_training_stays_finite(capsys):
    """AdamW's eps of 1e-8 is 0 in float16 weights (0 / 0 where a gradient is 0): the demo
    gives float16 its smallest normal."""
    code, out, err = run_cli(capsys, "demo", "--dtype", "fp16", "--steps", "20",
                             "--new-tokens", "2", "--impl", "torch", *TINY)
    assert code == 0, err
    assert "nan" not in out.lower()
