"""``lmfuse generate`` (``lmfuse/generate_cli.py``) on a tiny random-weight Llama saved to a
directory with a word-level tokenizer, on the CPU.

Greedy text must equal the tokenizer's decode of ``model.generate(do_sample=False)``'s new
tokens. End of sequence is *matched*, not disabled: the saved ``generation_config``'s
``eos_token_id`` is a token the first prompt reaches greedily at its third step, so both
``model.generate`` (which reads that config) and the command stop there, and the other
prompt runs to ``--max-new-tokens``. Errors exit 2 with one ``lmfuse generate: ...`` line
and no traceback; Ctrl-C exits 130 quietly; progress shows on a terminal only. The command
runs as on a CPU without the suite's Triton interpreter (PyTorch's path).
"""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from helpers import hf_greedy, run_cli, tiny_causal_lm

from lmfuse import cli, generate_cli

NEW = 5
PROMPT_A, PROMPT_B = "the cat sat on", "a dog"
WORDS = ["[UNK]", "<s>", "</s>", "the", "cat", "sat", "on", "mat", "a", "dog", "user",
         "assistant"]
VOCAB = WORDS + [f"w{i}" for i in range(len(WORDS), 97)]  # one word per model token
CHAT_TEMPLATE = ("{% for m in messages %}<s> user {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant{% endif %}")
SUMMARY = re.compile(r"^(\d+) prompts?, (\d+) new tokens, [\d.]+ s, [\d.]+ tokens/s$")


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # The tokenizer adds BOS by default, as Llama's does.
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>",
                                   eos_token="</s>", chat_template=CHAT_TEMPLATE)


@pytest.fixture(autouse=True)
def _cpu_users_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command as a CPU user runs it: PyTorch's path, not Triton's interpreter (which
    the suite turns on; the serving tests hold the kernels' paths to ``model.generate``)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """(directory, model, tokenizer): the saved tiny Llama (float32, its generation config's
    EOS set) and its tokenizer."""
    path = tmp_path_factory.mktemp("tiny-llama")
    model = tiny_causal_lm("llama")
    tokenizer = _tokenizer()
    # EOS: a token the first prompt reaches greedily at its third step or later (and not
    # before), the second prompt never.
    seq_a, seq_b = (hf_greedy(model, tokenizer(p)["input_ids"], NEW) for p in (PROMPT_A,
                                                                                PROMPT_B))
    eos = next(t for k, t in enumerate(seq_a) if k >= 2 and t not in seq_a[:k] + seq_b)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model, tokenizer


def hf_text(model, tokenizer, ids: list[int]) -> tuple[str, list[int]]:
    """``model.generate``'s greedy continuation (its generation config: EOS included) of
    ``ids``, decoded without special tokens; and its new token ids."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)
    new = out[0, len(ids):].tolist()
    return tokenizer.decode(new, skip_special_tokens=True), new


def expected_stdout(prompts: list[str], texts: list[str]) -> str:
    return "".join(f"{generate_cli.header(i, len(prompts), p)}\n{t}\n\n"
                   for i, (p, t) in enumerate(zip(prompts, texts)))


def blocks(out: str) -> list[str]:
    """The continuations in ``out``, in order."""
    parts = re.split(r"^--- prompt \d+ of \d+: .* ---\n", out, flags=re.MULTILINE)
    assert parts[0] == ""
    return [p.removesuffix("\n\n") for p in parts[1:]]


def test_greedy_text_equals_hf_generate_and_stops_at_eos(capsys, checkpoint) -> None:
    path, model, tokenizer = checkpoint
    want = [hf_text(model, tokenizer, tokenizer(p)["input_ids"]) for p in (PROMPT_A, PROMPT_B)]
    eos = model.generation_config.eos_token_id
    assert 3 <= len(want[0][1]) < NEW and want[0][1][-1] == eos and eos not in want[0][1][:-1]
    assert len(want[1][1]) == NEW  # the second prompt never meets the EOS token
    code, out, err = run_cli(capsys, "generate", str(path), "--prompt", PROMPT_A,
                             "--prompt", PROMPT_B, "--max-new-tokens", str(NEW))
    assert code == 0, err
    assert out == expected_stdout([PROMPT_A, PROMPT_B], [t for t, _ in want])
    # No terminal: no progress output, only the summary line.
    lines = err.splitlines()
    assert len(lines) == 1 and SUMMARY.match(lines[0]), err
    assert SUMMARY.match(lines[0]).groups() == ("2", str(len(want[0][1]) + NEW))


def test_repetition_penalty_option_gives_hf_generates_text(capsys, checkpoint) -> None:
    """``--repetition-penalty``: the text model.generate gives with that penalty in its
    generation config (the checkpoint sets none)."""
    path, model, tokenizer = checkpoint
    ids = tokenizer(PROMPT_B)["input_ids"]
    out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False,
                         repetition_penalty=1.8)
    new = out[0, len(ids):].tolist()
    assert new != hf_text(model, tokenizer, ids)[1]
    code, got, err = run_cli(capsys, "generate", str(path), "--prompt", PROMPT_B,
                             "--max-new-tokens", str(NEW), "--repetition-penalty", "1.8")
    assert code == 0, err
    assert got == expected_stdout([PROMPT_B], [tokenizer.decode(new, skip_special_tokens=True)])


def test_prompts_file_from_stdin_follows_the_prompt_options(capsys, checkpoint,
                                                             monkeypatch) -> None:
    path, model, tokenizer = checkpoint
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"\n{PROMPT_B}\n   \nthe mat\n"))
    code, out, err = run_cli(capsys, "generate", str(path), "--prompt", PROMPT_A,
                             "--prompts-file", "-", "--max-new-tokens", str(NEW),
                             "--kv-dtype", "fp32", "--no-graphs", "--num-blocks", "8")
    assert code == 0, err
    prompts = [PROMPT_A, PROMPT_B, "the mat"]
    want = [hf_text(model, tokenizer, tokenizer(p)["input_ids"])[0] for p in prompts]
    assert out == expected_stdout(prompts, want)


def test_chat_wraps_each_prompt_in_the_template(capsys, checkpoint) -> None:
    path, model, tokenizer = checkpoint
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT_B}],
                                         add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == VOCAB.index("assistant")
    code, out, err = run_cli(capsys, "generate", str(path), "--prompt", PROMPT_B, "--chat",
                             "--max-new-tokens", str(NEW))
    assert code == 0, err
    assert out == expected_stdout([PROMPT_B], [hf_text(model, tokenizer, ids)[0]])


def test_seeded_sampling_repeats(capsys, checkpoint) -> None:
    path = str(checkpoint[0])

    def sample(seed: str, *more: str) -> list[str]:
        code, out, err = run_cli(capsys, "generate", path, "--prompt", PROMPT_B,
                                 "--max-new-tokens", str(NEW), "--temperature", "0.8",
                                 "--seed", seed, *more)
        assert code == 0, err
        return blocks(out)

    first = sample("1")
    assert sample("1") == first
    assert sample("1", "--top-k", "0") == first  # (0: no top-k, as Hugging Face takes it)
    assert sample("2") != first  # 97 near-uniform tokens: two seeds agree on five by chance
    assert len(first) == 1 and len(first[0].split()) == NEW


def test_ctrl_c_exits_130_quietly(capsys, checkpoint, monkeypatch) -> None:
    from lmfuse.serving import Generator

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(Generator, "step", interrupted)
    code, out, err = run_cli(capsys, "generate", str(checkpoint[0]), "--prompt", PROMPT_A)
    assert (code, out, err) == (130, "", "")


def test_an_unexpected_error_is_one_line_exit_1(capsys, checkpoint, monkeypatch) -> None:
    from lmfuse.serving import Generator

    def broken(self):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(Generator, "step", broken)
    code, out, err = run_cli(capsys, "generate", str(checkpoint[0]), "--prompt", PROMPT_A)
    assert (code, out) == (1, "")
    assert err == "lmfuse generate: unexpected error: RuntimeError: boom\n"


@pytest.mark.parametrize("with_tqdm", [True, False], ids=["tqdm", "plain"])
def test_progress_shows_on_a_terminal(capsys, checkpoint, monkeypatch,
                                      with_tqdm: bool) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    if not with_tqdm:
        monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm: ImportError
    code, out, err = run_cli(capsys, "generate", str(checkpoint[0]), "--prompt", PROMPT_B,
                             "--max-new-tokens", str(NEW))
    assert code == 0, err
    assert len(blocks(out)) == 1
    if with_tqdm:
        assert "generating" in err and "tok/s" in err
    else:
        assert f"generating: {NEW}/{NEW} tokens, " in err and " tokens/s" in err
    assert SUMMARY.match(err.splitlines()[-1])


# --- errors ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    path = tmp_path_factory.mktemp("tiny-gpt2")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=97,
                               n_positions=64)).save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def remote_code_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint whose config names its own Python code, which would leave a file
    ``ran`` beside it when imported."""
    path = tmp_path_factory.mktemp("remote-code")
    (path / "config.json").write_text(json.dumps({
        "model_type": "lmfuse_test_custom",
        "auto_map": {"AutoConfig": "custom.CustomConfig",
                     "AutoModelForCausalLM": "custom.CustomModel"}}))
    (path / "custom.py").write_text(
        "from pathlib import Path\n(Path(__file__).parent / 'ran').write_text('x')\n")
    return path


@pytest.mark.parametrize("case", [
    "missing-dir", "no-config", "unsupported-model-type", "remote-code", "max-new-tokens-0",
    "empty-prompts-file", "missing-prompts-file", "no-prompts", "empty-prompt",
    "top-p-greedy", "bad-temperature", "bad-repetition-penalty", "prompt-too-long",
    "unknown-option", "prompt-not-utf8", "no-tokenizer", "pool-too-small"])
def test_errors_exit_2_with_one_message(capsys, checkpoint, gpt2_dir, remote_code_dir,
                                        tmp_path: Path, case: str) -> None:
    model_dir = str(checkpoint[0])
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text((checkpoint[0] / "config.json").read_text())
    argv, message = {
        "missing-dir": ([str(tmp_path / "nope"), "--prompt", "a"], "no such directory"),
        "no-config": ([str(tmp_path), "--prompt", "a"], "no config.json"),
        "unsupported-model-type": ([str(gpt2_dir), "--prompt", "a"],
                                   "model type 'gpt2' is not supported"),
        "remote-code": ([str(remote_code_dir), "--prompt", "a"],
                        "pass --trust-remote-code to run it"),
        "max-new-tokens-0": ([model_dir, "--prompt", "a", "--max-new-tokens", "0"],
                             "argument --max-new-tokens: must be >= 1, got 0"),
        "empty-prompts-file": ([model_dir, "--prompts-file", str(empty)], "has no prompts"),
        "missing-prompts-file": ([model_dir, "--prompts-file", str(tmp_path / "x.txt")],
                                 "cannot read --prompts-file"),
        "no-prompts": ([model_dir], "no prompts"),
        "empty-prompt": ([model_dir, "--prompt", "a", "--prompt", ""],
                         "--prompt number 2 is empty"),
        "top-p-greedy": ([model_dir, "--prompt", "a", "--top-p", "0.9"],
                         "need --temperature > 0"),
        "bad-top-k": ([model_dir, "--prompt", "a", "--temperature", "1", "--top-k", "-1"],
                      "argument --top-k: must be >= 0, got -1"),
        "bad-temperature": ([model_dir, "--prompt", "a", "--temperature", "-1"],
                            "argument --temperature: must be >= 0"),
        "bad-repetition-penalty": ([model_dir, "--prompt", "a", "--repetition-penalty", "0"],
                                   "argument --repetition-penalty: must be > 0, got 0.0"),
        # 2 prompt tokens + 300 new pass the tiny model's max_position_embeddings (256).
        "prompt-too-long": ([model_dir, "--prompt", "a", "--max-new-tokens", "300"],
                            ("prompt 1 of 2 tokens plus max_new_tokens=300 passes the model's "
                             "max_position_embeddings (256)")),
        "unknown-option": ([model_dir, "--prompt", "a", "--bogus"],
                           "unrecognized arguments: --bogus"),
        # bytes that are not UTF-8, as a shell passes them (surrogate escapes)
        "prompt-not-utf8": ([model_dir, "--prompt", "abc\udcff"],
                            "--prompt number 1 is not UTF-8 text"),
        "no-tokenizer": ([str(no_tokenizer), "--prompt", "a"],
                         "cannot load the tokenizer: none of its files is there"),
        "pool-too-small": ([model_dir, "--prompt", "a", "--num-blocks", "1",
                            "--max-new-tokens", "40"], "give a larger --num-blocks"),
    }[case]
    code, out, err = run_cli(capsys, "generate", *argv)
    assert code == 2
    assert out == ""
    assert "Traceback" not in err
    assert f"{generate_cli.PROG}: " in err and message in err, err
    if not err.startswith("usage:"):  # argparse's own errors print the usage line first
        assert err.count("\n") == 1, err
    assert not (remote_code_dir / "ran").exists()  # the checkpoint's code never ran


def test_a_byte_order_mark_is_not_part_of_the_first_prompt(capsys, checkpoint,
                                                           tmp_path: Path) -> None:
    path, model, tokenizer = checkpoint
    prompts = tmp_path / "p.txt"
    prompts.write_text(PROMPT_A + "\n", encoding="utf-8-sig")
    code, out, _ = run_cli(capsys, "generate", str(path), "--prompts-file", str(prompts),
                           "--max-new-tokens", str(NEW))
    assert code == 0
    assert out.startswith(generate_cli.header(0, 1, PROMPT_A))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_device_cuda_without_cuda_is_an_error(capsys, checkpoint) -> None:
    code, out, err = run_cli(capsys, "generate", str(checkpoint[0]), "--prompt", "a",
                             "--device", "cuda")
    assert (code, out) == (2, "")
    assert err == "lmfuse generate: --device cuda: no CUDA device here (use --device cpu)\n"


def test_bench_generate_is_a_bench_family() -> None:
    assert "generate" in cli.FAMILIES
    assert cli._bench_main("generate").__module__ == "lmfuse.bench.generate"
