"""The scripts in examples/, run in-process through their ``main(argv)`` at tiny sizes on the
CPU in float32: training learns and its checkpoint round-trips; paged decoding continues
prompts as a plain full re-forward of the same weights does, and merging attention over two
halves of a cache gives attention over the whole.

conftest.py sets TRITON_INTERPRET=1, so ``--impl auto`` runs the Triton kernels in the
interpreter (slow: those runs are a few steps long); the longer runs take ``--impl torch``,
the ops' reference paths.
"""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from contextlib import redirect_stdout
from io import StringIO
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TINY = ["--device", "cpu", "--dtype", "fp32", "--d-model", "32", "--layers", "1",
        "--heads", "2", "--seq", "32", "--batch", "4"]
TRAIN_STEPS = 30
STEP_LINE = re.compile(r"^step\s+(\d+)/(\d+)\s+loss\s+(\S+)", re.MULTILINE)


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # decode_tiny_gpt imports train_tiny_gpt by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ex():
    """The two example modules (train, decode)."""
    train = _load("train_tiny_gpt")
    decode = _load("decode_tiny_gpt")
    yield train, decode
    for name in ("train_tiny_gpt", "decode_tiny_gpt"):
        sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def trained(ex, tmp_path_factory):
    """``train_tiny_gpt.main`` for TRAIN_STEPS steps: (exit code, stdout, checkpoint path)."""
    train, _ = ex
    path = tmp_path_factory.mktemp("examples") / "tiny_gpt.pt"
    out = StringIO()
    with redirect_stdout(out):
        rc = train.main([*TINY, "--impl", "torch", "--steps", str(TRAIN_STEPS),
                         "--log-every", "10", "--save", str(path)])
    return rc, out.getvalue(), path


def _losses(stdout: str) -> dict[int, float]:
    return {int(m[1]): float(m[3]) for m in STEP_LINE.finditer(stdout)}


def test_train_loss_falls_below_uniform(trained):
    rc, stdout, _ = trained
    assert rc == 0, stdout
    losses = _losses(stdout)
    assert sorted(losses) == [1, 10, 20, 30], stdout
    assert all(math.isfinite(v) for v in losses.values())
    # A fresh model guesses about uniformly (ln 256 = 5.55 nats a byte); 30 steps learn the
    # byte frequencies at least. Each logged loss is one random batch of a corpus made of
    # lmfuse's own sources (it changes with every commit): steps 10 and 30 are compared with
    # the first, not with each other, as batches differ by some 0.3 nats once the byte
    # frequencies are learnt (30 above 10 at one commit: 3.49 against 3.35).
    assert losses[1] > math.log(256) - 0.5
    assert losses[30] < math.log(256) - 1.5, losses
    assert losses[30] < losses[1] - 1.5 and losses[10] < losses[1], losses


def test_checkpoint_round_trips(ex, trained, tmp_path):
    train, _ = ex
    _, _, path = trained
    saved = torch.load(path, weights_only=True)
    model = train.load_checkpoint(str(path), impl="torch")
    assert model.cfg == train.ModelConfig(d_model=32, n_layers=1, n_heads=2, ffn=96)
    state = model.state_dict()
    assert state.keys() == saved["model"].keys()
    assert all(torch.equal(state[k], saved["model"][k]) for k in state)
    again = tmp_path / "again.pt"
    train.save_checkpoint(model, str(again))
    resaved = torch.load(again, weights_only=True)
    assert resaved["config"] == saved["config"]
    assert all(torch.equal(resaved["model"][k], v) for k, v in saved["model"].items())
    # The weights are the trained ones: well below a fresh model's loss on the corpus.
    x, y = train.random_batch(train.load_bytes(), 8, 32, torch.Generator().manual_seed(1))
    fresh = train.TinyGPT(model.cfg, impl="torch")
    with torch.no_grad():
        assert model.loss(x, y) < fresh.loss(x, y) - 1.0


def test_train_triton_kernels_and_materialised_logits_loss(ex, capsys):
    train, _ = ex
    # impl auto: the Triton kernels in the interpreter; the logits loss with z-loss and
    # label smoothing.
    rc = train.main([*TINY, "--steps", "3", "--materialise-logits", "--z-loss", "1e-4",
                     "--label-smoothing", "0.1"])
    stdout = capsys.readouterr().out
    assert rc == 0, stdout
    assert "fused_softmax: triton" in stdout
    losses = _losses(stdout)
    assert sorted(losses) == [1, 2, 3] and all(math.isfinite(v) for v in losses.values())
    assert losses[3] < losses[1], losses


def test_materialised_and_linear_losses_agree(ex):
    train, _ = ex
    model = train.TinyGPT(train.ModelConfig(d_model=32, n_layers=1, n_heads=2, ffn=64),
                          impl="torch")
    x, y = train.random_batch(train.load_bytes(), 2, 16, torch.Generator().manual_seed(0))
    with torch.no_grad():
        for opts in ({}, {"z_loss": 1e-2, "label_smoothing": 0.1}):
            linear = model.loss(x, y, **opts)
            logits = model.loss(x, y, materialise_logits=True, **opts)
            torch.testing.assert_close(linear, logits, rtol=1e-5, atol=1e-5)
        assert model.loss(x, y, z_loss=1e-2) > model.loss(x, y)  # the options are applied


def _decode(decode, capsys, *argv: str) -> str:
    """``decode_tiny_gpt.main(argv)``'s output, once it has exited 0 with no check failed."""
    rc = decode.main(list(argv))
    stdout = capsys.readouterr().out
    assert rc == 0 and "FAILED" not in stdout, stdout
    return stdout


def test_decode_matches_full_forward(ex, trained, capsys):
    train, decode = ex
    _, _, path = trained
    stdout = _decode(decode, capsys, "--checkpoint", str(path), "--device", "cpu", "--dtype",
                     "fp32", "--impl", "torch", "--new-tokens", "12")
    assert "agree with the full re-forward: yes" in stdout

    # The same path called directly: prompts of 3, 8 and 21 bytes (one, one full and three
    # prefill chunks), cache blocks of 4 tokens.
    model = train.load_checkpoint(str(path), impl="torch").eval()
    plain = train.TinyGPT(model.cfg, impl="torch")
    plain.load_state_dict(model.state_dict())
    prompts = [list(b"def"), list(b"import t"), list(b"class TinyGPT(nn.Modu")]
    g = decode.generate(model, prompts, 10, block_len=4, impl="torch")
    assert [len(c) for c in g.tokens] == [10, 10, 10]
    assert [g.cache.seqlen(s) for s in g.seq_ids] == [len(p) + 9 for p in prompts]
    for prompt, cont, got in zip(prompts, g.tokens, g.logits):
        full = decode.full_forward_logits(plain, prompt, cont)
        assert full.argmax(-1).tolist() == cont
        torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4)
    assert decode.split_kv_error(g, impl="torch") < 1e-5


def test_decode_triton_kernels(ex, trained, capsys):
    _, decode = ex
    _, _, path = trained
    # impl auto: DecodeAttentionBlock's and decode attention's Triton kernels (interpreter).
    stdout = _decode(decode, capsys, "--checkpoint", str(path), "--device", "cpu", "--dtype",
                     "fp32", "--new-tokens", "4", "--prompt", "ab", "--prompt", "import torch\n")
    assert "agree with the full re-forward: yes" in stdout


def test_decode_trains_itself_and_samples(ex, capsys):
    _, decode = ex
    stdout = _decode(decode, capsys, *TINY, "--impl", "torch", "--train-steps", "4", "--sample",
                     "--temperature", "1.0", "--new-tokens", "6", "--prompt", "x",
                     "--prompt", "a prompt of more than eight bytes")
    assert "training" in stdout and "sampled at T=1" in stdout


def test_decode_half_precision_held_to_a_float32_forward(ex, trained, capsys):
    _, decode = ex
    _, _, path = trained
    # bf16: the decode path's logits are judged against a float32 re-forward, next to the
    # plain bf16 re-forward's own error.
    stdout = _decode(decode, capsys, "--checkpoint", str(path), "--device", "cpu", "--dtype",
                     "bf16", "--impl", "torch", "--new-tokens", "6")
    assert "against a float32 re-forward" in stdout


def test_decode_reports_nan_logits_as_a_failure(ex, trained, capsys, tmp_path):
    """One NaN row of the output head (a diverged run's checkpoint): every logit error is
    NaN, which Python's max kept out of the reported error (0.0e+00, "ok", exit 0)."""
    train, decode = ex
    _, _, path = trained
    model = train.load_checkpoint(str(path), impl="torch")
    with torch.no_grad():
        model.head.weight[5] = float("nan")
    bad = tmp_path / "nan_head.pt"
    train.save_checkpoint(model, str(bad))
    rc = decode.main(["--checkpoint", str(bad), "--device", "cpu", "--dtype", "fp32",
                      "--impl", "torch", "--new-tokens", "4"])
    stdout = capsys.readouterr().out
    assert rc == 1 and "max |diff| / max |logit| = nan" in stdout and "FAILED" in stdout, stdout


def test_decode_rate_counts_only_timed_steps(ex, trained):
    """The first token comes from the prefill's logits, before the clock starts: one new
    token is no decode step (a rate of 0, not thousands of tokens a second)."""
    train, decode = ex
    _, _, path = trained
    model = train.load_checkpoint(str(path), impl="torch").eval()
    g = decode.generate(model, [list(b"def")], 1, block_len=4, impl="torch")
    assert g.tokens_per_s == 0.0 and len(g.tokens[0]) == 1


@pytest.mark.parametrize("argv, message", [
    (["--layers", "0"], "--layers must be >= 1, got 0"),
    (["--heads", "0"], "--heads must be >= 1, got 0"),
    (["--d-model", "30", "--heads", "4"], "--d-model (30) must be --heads (4) times an even"),
    (["--seq", "0"], "--seq must be >= 1"),
    (["--ffn", "0"], "--ffn must be >= 1"),
    (["--lr", "nan"], "--lr must be a finite number > 0"),
    (["--z-loss", "-1"], "--z-loss must be a finite number >= 0"),
    (["--label-smoothing", "2"], "--label-smoothing must be in [0, 1)"),
    (["--text", "/no/such/file"], "--text /no/such/file: cannot read it"),
    (["--device", "tpu"], "--device must be auto, cpu, cuda or cuda:N"),
    (["--save", "/no/such/dir/x.pt"], "no directory to write it into"),
])
def test_train_refuses_bad_flags_in_one_line(ex, capsys, argv, message):
    """Each was a traceback, a model of 0 layers, or a run of loss 0 that exited 0."""
    train, _ = ex
    with pytest.raises(SystemExit) as exit_:
        train.main([*TINY, "--steps", "2", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv, message", [
    (["--block-len", "0"], "--block-len must be >= 1"),
    (["--sample", "--temperature", "0"], "--temperature must be a finite number > 0"),
    (["--prompt", ""], "--prompt must not be empty"),
    (["--checkpoint", "/no/such/file.pt"], "not a train_tiny_gpt.py checkpoint"),
])
def test_decode_refuses_bad_flags_in_one_line(ex, capsys, argv, message):
    _, decode = ex
    with pytest.raises(SystemExit) as exit_:
        decode.main([*TINY, "--train-steps", "1", "--new-tokens", "2", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err, err


def test_training_that_diverges_fails_and_saves_nothing(ex, capsys, tmp_path):
    train, _ = ex
    path = tmp_path / "nan.pt"
    rc = train.main([*TINY, "--impl", "torch", "--steps", "3", "--lr", "1e30",
                     "--save", str(path)])
    out = capsys.readouterr().out
    assert rc == 1 and "FAILED: the loss is nan" in out and not path.exists(), out
