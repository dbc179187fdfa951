"""``lmfuse generate``: continue prompts with a local Hugging Face checkpoint on lmfuse's
paged KV cache (:class:`lmfuse.serving.Generator`).

    lmfuse generate ./Llama-3.2-1B --prompt "The capital of France is" --max-new-tokens 32

* Loading reads only local files (``local_files_only=True``) and never runs code shipped
  with the checkpoint unless ``--trust-remote-code`` is given. The model is loaded in the
  checkpoint's dtype (``--dtype auto``, the config's ``dtype`` / ``torch_dtype``) on the
  CPU and on CUDA alike, so greedy text equals ``model.generate``'s (the
  ``generation_config``'s ``repetition_penalty`` applied as there; settings the Generator
  does not apply, such as ``no_repeat_ngram_size``, are named by a warning).
* Prompts: ``--prompt TEXT`` (repeatable), then the lines of ``--prompts-file F`` (``-``:
  stdin; blank lines skipped), tokenized as the tokenizer does by default (its BOS
  included); ``--chat`` wraps each in the tokenizer's chat template first.
* Stops at the model's ``generation_config.eos_token_id`` (included in the tokens,
  dropped from the text with the other special tokens) or after ``--max-new-tokens``.
  ``--temperature 0`` (the default) is greedy; above 0 each prompt ``i`` samples with
  seed ``S + i`` (``--seed S``; a random ``S`` without it). ``--repetition-penalty P``
  overrides the checkpoint's ``generation_config.repetition_penalty`` (1: none).
* stdout: for each prompt in order, a header line ``--- prompt i of n: 'text' ---``, its
  continuation, a blank line. stderr: a progress bar while it runs (terminal only), then
  one summary line. Errors are one ``lmfuse generate: ...`` line (exit 2 for a bad
  checkpoint, option or prompt; 1 for running out of memory or an unexpected error),
  never a traceback; Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from lmfuse._cli_args import DTYPES, int_range, nonempty, number_range

PROG = "lmfuse generate"
#: ``lmfuse generate --help``'s description: this docstring as plain text.
DESCRIPTION = (__doc__.replace(":class:`lmfuse.serving.Generator`", "lmfuse.serving.Generator")
               .replace("``", ""))
DTYPE_CHOICES = {"auto": "auto", "bf16": DTYPES["bf16"], "fp16": DTYPES["fp16"],
                 "fp32": DTYPES["fp32"]}
KV_DTYPE_CHOICES = ("auto", "fp8", "bf16", "fp16", "fp32")
BLOCK_LEN = 16  # the Generator's default
CPU_MAX_BLOCKS = 4096  # the Generator's default pool on the CPU
HEADER_WIDTH = 60  # characters of a prompt echoed in its header


class UsageError(Exception):
    """A bad checkpoint, option or prompt: printed as one line, exit 2."""


# --- options ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``lmfuse generate`` on ``parser`` (its subparser)."""
    parser.add_argument("model_dir", metavar="MODEL_DIR", type=nonempty,
                        help="a local Hugging Face checkpoint directory (config.json, weights, "
                        "tokenizer); nothing is downloaded")
    parser.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                        help="a prompt (repeatable)")
    parser.add_argument("--prompts-file", metavar="F", type=nonempty,
                        help="more prompts, one per line (blank lines skipped); '-': stdin")
    parser.add_argument("--max-new-tokens", type=int_range(1), default=128, metavar="N",
                        help="most tokens generated per prompt (default 128)")
    parser.add_argument("--kv-dtype", choices=KV_DTYPE_CHOICES, default="auto",
                        help="the KV cache's dtype (default auto: the model's; fp8: e4m3 "
                        "with per-head scales; bf16 / fp16 / fp32: the model's own, as "
                        "--dtype or the checkpoint gives it)")
    parser.add_argument("--temperature", type=number_range(0, note=" (0: greedy)"), default=0.0,
                        metavar="T", help="0: greedy (default); above 0: sample")
    parser.add_argument("--top-k", type=int_range(0), default=None, metavar="K",
                        help="sample among the K most likely tokens (0: all, as Hugging Face "
                        "takes it; needs --temperature > 0)")
    parser.add_argument("--top-p", type=number_range(0, 1, above=True), default=None, metavar="P",
                        help="sample among the smallest set of tokens of probability >= P "
                        "(needs --temperature > 0)")
    parser.add_argument("--repetition-penalty", type=number_range(0, above=True), default=None,
                        metavar="P", help="Hugging Face's repetition penalty (1: none; default "
                        "the checkpoint's generation_config)")
    parser.add_argument("--seed", type=int_range(), default=None, metavar="S",
                        help="sampling seed (prompt i uses S + i; default random)")
    parser.add_argument("--dtype", choices=tuple(DTYPE_CHOICES), default="auto",
                        help="the model's dtype (default auto: the checkpoint's)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="default: cuda when available, else cpu")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow the checkpoint's own Python code to run while loading "
                        "(off by default)")
    parser.add_argument("--no-graphs", action="store_true",
                        help="decode without CUDA graphs")
    parser.add_argument("--num-blocks", type=int_range(1, 1 << 31), default=None, metavar="N",
                        help=f"KV cache blocks of {BLOCK_LEN} tokens (default: on CUDA 90%% of "
                        "the free memory; on the CPU what the prompts need)")
    parser.add_argument("--chat", action="store_true",
                        help="wrap each prompt in the tokenizer's chat template (a user "
                        "turn, then the assistant's generation prompt)")


# --- the command -------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """``lmfuse generate``: the exit code (0, 1, 2 or 130)."""
    try:
        return _run(args)
    except UsageError as exc:
        _error(str(exc))
        return 2
    except KeyboardInterrupt:
        return 130
    except torch.cuda.OutOfMemoryError as exc:
        _error(f"out of memory: {_first_line(exc)}; try fewer or shorter prompts, a smaller "
               "--max-new-tokens or --num-blocks, or --kv-dtype fp8")
        return 1
    except Exception as exc:  # noqa: BLE001 - the promise: one line, never a traceback
        _error(f"unexpected error: {type(exc).__name__}: {_first_line(exc)}")
        return 1


def _run(args: argparse.Namespace) -> int:
    if args.temperature == 0 and (args.top_k is not None or args.top_p is not None):
        raise UsageError("--top-k and --top-p choose among tokens to sample: they need "
                         "--temperature > 0 (0 is greedy)")
    texts = _read_prompts(args)
    device = _device(args.device)
    tokenizer, model = _load(Path(args.model_dir), args.dtype, device, args.trust_remote_code)
    prompts = [_tokenize(tokenizer, text, args.chat, i) for i, text in enumerate(texts)]

    from lmfuse.serving import Generator

    num_blocks = args.num_blocks
    if num_blocks is None and device.type == "cpu":
        # What every prompt needs at full length, at once: a small pool on the CPU, where
        # the Generator's default (4096 blocks) is large for a large model.
        need = sum(math.ceil((len(p) + args.max_new_tokens) / BLOCK_LEN) for p in prompts)
        num_blocks = min(need, CPU_MAX_BLOCKS)
    try:
        gen = Generator(model, block_len=BLOCK_LEN, num_blocks=num_blocks,
                        kv_dtype=None if args.kv_dtype == "auto" else args.kv_dtype,
                        cuda_graphs=not args.no_graphs)
    except (TypeError, ValueError) as exc:
        raise UsageError(_generator_message(exc)) from None
    seed = args.seed if args.seed is not None else random.randrange(1 << 62)
    rids = []
    try:
        for i, p in enumerate(prompts):
            rids.append(gen.add_request(p, max_new_tokens=args.max_new_tokens,
                                        temperature=args.temperature, top_k=args.top_k,
                                        top_p=args.top_p, seed=seed + i,
                                        repetition_penalty=args.repetition_penalty))
    except (TypeError, ValueError) as exc:
        message = _generator_message(exc)
        message = (message.removeprefix("prompt") if message.startswith("prompt ")
                   else f": {message}")
        raise UsageError(f"prompt {len(rids) + 1}{message}") from None

    results: dict[int, list[int]] = {rid: [] for rid in rids}
    progress = _Progress(len(prompts) * args.max_new_tokens)
    start = time.perf_counter()
    try:
        while gen.has_unfinished():
            for rid, tokens, finished in gen.step():
                results[rid].extend(tokens)
                progress.advance(len(tokens))
                if finished:  # ended before max_new_tokens: fewer tokens to come
                    progress.shrink(args.max_new_tokens - len(results[rid]))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
    finally:
        progress.close()

    for i, (text, rid) in enumerate(zip(texts, rids)):
        print(header(i, len(texts), text))
        print(tokenizer.decode(results[rid], skip_special_tokens=True))
        print()
    sys.stdout.flush()
    total = sum(len(t) for t in results.values())
    rate = total / seconds if seconds > 0 else float("inf")
    print(f"{len(texts)} prompt{'s' * (len(texts) != 1)}, {total} new tokens, "
          f"{seconds:.2f} s, {rate:.1f} tokens/s", file=sys.stderr)
    return 0


def header(index: int, count: int, text: str) -> str:
    """The line before prompt ``index``'s continuation: the prompt, quoted and escaped by
    ``repr`` (one line), shortened to about 60 characters."""
    shown = repr(text)
    if len(shown) > HEADER_WIDTH:
        shown = shown[:HEADER_WIDTH - 4] + "..." + shown[-1]
    return f"--- prompt {index + 1} of {count}: {shown} ---"


def _error(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


#: The Generator's words for what the command line sets by its options.
_OPTION_WORDS = (
    ("give the Generator more blocks", "give a larger --num-blocks"),
    ("pass repetition_penalty= to override it", "pass --repetition-penalty to override it"),
    ("(model.to(...))", "(--dtype)"),
    ("kv_dtype", "--kv-dtype"),
    ("num_blocks", "--num-blocks"),
    ("pass eos_token_id= to override it", "fix the checkpoint's generation_config.json"),
)


def _generator_message(exc: BaseException) -> str:
    """The Generator's error as the command line's: its option names for the arguments."""
    message = _first_line(exc).removeprefix("Generator: ")
    for words, option in _OPTION_WORDS:
        message = message.replace(words, option)
    return message


# --- prompts, device, loading ------------------------------------------------------------


def _read_prompts(args: argparse.Namespace) -> list[str]:
    texts = list(args.prompt)
    for i, text in enumerate(texts):
        if not text.strip():
            raise UsageError(f"--prompt number {i + 1} is empty")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # bytes that are not UTF-8, as the shell passed them
            raise UsageError(f"--prompt number {i + 1} is not UTF-8 text") from None
    if args.prompts_file is not None:
        name = args.prompts_file
        try:
            data = (sys.stdin.read() if name == "-"
                    # (utf-8-sig: a byte-order mark is not part of the first prompt)
                    else Path(name).read_text(encoding="utf-8-sig"))
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"cannot read --prompts-file {name}: {_first_line(exc)}") from None
        lines = [line for line in data.splitlines() if line.strip()]
        if not lines:
            raise UsageError(f"--prompts-file {'(stdin)' if name == '-' else name} has no "
                             "prompts (one per line; blank lines are skipped)")
        texts += lines
    if not texts:
        raise UsageError("no prompts: give --prompt TEXT (repeatable) or --prompts-file F")
    return texts


def _device(name: str | None) -> torch.device:
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device here (use --device cpu)")
    return torch.device(name)


def _load(path: Path, dtype_name: str, device: torch.device, trust_remote_code: bool):
    """The checkpoint's tokenizer and causal LM (eval mode, on ``device``)."""
    if not path.exists():
        raise UsageError(f"{path}: no such directory (MODEL_DIR is a local checkpoint; "
                         "nothing is downloaded)")
    if not path.is_dir():
        raise UsageError(f"{path}: not a directory (MODEL_DIR is a checkpoint directory)")
    if not (path / "config.json").is_file():
        raise UsageError(f"{path}: no config.json; not a Hugging Face checkpoint directory")
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise UsageError("needs the transformers package (pip install transformers)") from None

    from lmfuse.serving import SUPPORTED_MODEL_TYPES

    local = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    try:
        config = AutoConfig.from_pretrained(path, **local)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds here
        raise UsageError(_load_message(path, "config", exc)) from None
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UsageError(f"{path}: model type {model_type!r} is not supported by "
                         f"lmfuse.serving; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **local)
    except Exception as exc:  # noqa: BLE001
        raise UsageError(_load_message(path, "tokenizer", exc)) from None
    from transformers.utils import logging as hf_logging

    # transformers' "Loading weights" bar: on a terminal only, like ours.
    quiet = not _stderr_is_tty() and hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, config=config,
                                                     dtype=DTYPE_CHOICES[dtype_name], **local)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise UsageError(_load_message(path, "model", exc)) from None
    finally:
        if quiet:
            hf_logging.enable_progress_bar()
    return tokenizer, model.to(device).eval()


def _load_message(path: Path, what: str, exc: BaseException) -> str:
    text = str(exc)
    if "trust_remote_code" in text or "custom code" in text:
        return (f"{path}: cannot load the {what}: it needs the checkpoint's own Python code "
                "(auto_map); read that code, then pass --trust-remote-code to run it")
    if what == "tokenizer" and not any(
            (path / name).is_file() for name in _TOKENIZER_FILES):
        return (f"{path}: cannot load the tokenizer: none of its files is there "
                f"({', '.join(_TOKENIZER_FILES)}); save the tokenizer with the checkpoint")
    if what == "model" and "Float8" in text:
        return (f"{path}: cannot load the model in its saved float8 dtype; give --dtype fp32, "
                "bf16 or fp16")
    return f"{path}: cannot load the {what}: {_first_line(exc)}"


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                    "spiece.model")


def _stderr_is_tty() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def _tokenize(tokenizer: Any, text: str, chat: bool, index: int) -> list[int]:
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UsageError("--chat: the tokenizer has no chat template")
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - a template error (jinja) of any kind
            raise UsageError(f"--chat: the chat template failed: {_first_line(exc)}") from None
        # The template writes the special tokens (BOS included) itself.
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(text)["input_ids"]
    if not ids:
        raise UsageError(f"prompt {index + 1} has no tokens")
    return [int(t) for t in ids]


# --- progress ------------------------------------------------------------------------------


class _Progress:
    """Tokens generated and tokens/s on stderr while it is a terminal: a tqdm bar, or a
    plain status line without tqdm; nothing otherwise."""

    def __init__(self, total: int) -> None:
        self.bar, self.plain = None, False
        self.total, self.done = total, 0
        self.start = self.shown = time.perf_counter()
        if not _stderr_is_tty():
            return
        try:
            from tqdm import tqdm
        except ImportError:
            self.plain = True
            return
        self.bar = tqdm(total=total, unit="tok", desc="generating", file=sys.stderr,
                        dynamic_ncols=True, leave=False)

    def advance(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.plain:
            now = time.perf_counter()
            if now - self.shown >= 0.1:
                self.shown = now
                self._line(now)

    def shrink(self, n: int) -> None:
        if n <= 0:
            return
        self.total -= n
        if self.bar is not None:
            self.bar.total = self.total
            self.bar.refresh()

    def _line(self, now: float) -> None:
        rate = self.done / max(now - self.start, 1e-9)
        sys.stderr.write(f"\rgenerating: {self.done}/{self.total} tokens, {rate:.1f} "
                         "tokens/s ")
        sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.plain:
            self._line(time.perf_counter())
            sys.stderr.write("\n")
            sys.stderr.flush()
            self.plain = False
