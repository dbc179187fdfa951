"""``lmfuse demo``: train a small byte-level GPT with lmfuse's ops and the same GPT in plain
PyTorch, side by side, then decode from the lmfuse one through ``lmfuse.serving.Generator``
and from the same weights through Hugging Face's ``generate``.

    model      tokens -> embedding -> L x [x + attn(x); x + mlp(rmsnorm(x))] -> rmsnorm -> head
    attn       RMSNorm -> fused QKV projection -> rotary embedding -> causal attention -> out
               (a Llama decoder layer's computation: decoding views the trained weights as
               a transformers LlamaForCausalLM without copying them)

The two models start from one set of weights and see the same batches; they differ only
in the ops:

    lmfuse                                   plain PyTorch
    lmfuse.rms_norm(x, w)                    x * rsqrt(mean(x ** 2) + eps) * w
    lmfuse.fused_softmax(causal=True)        torch.softmax of masked scores
    lmfuse.FusedMLP(activation="swiglu")     F.silu(a) * g
    lmfuse.linear_cross_entropy(h, W, y)     F.cross_entropy(h @ W.T, y)

Decoding: the trained lmfuse model, viewed as a LlamaForCausalLM, continues every prompt
at once through lmfuse.serving.Generator (paged KV cache, lmfuse's decode kernels, each
decode step captured in a CUDA graph on a GPU) and, as the plain side, through the same
model's own generate (greedy, its dynamic KV cache). Both are timed the same way (one
untimed call first, then a whole generate call: prefill and decode, every prompt
together). The Generator's greedy tokens must equal generate's in fp32, and its logits at
every step must match the plain model's full forward on the same tokens.

Sizes: an option not given takes the device's default, small on the CPU (well under a
minute on 2 cores) and, on CUDA, a model large enough for the GPU to matter: d-model 1024,
8 layers, 16 heads, ffn 4096, 8 x 1024 tokens a step, 200 steps at lr 3e-4, 8 prompts of
128 new tokens.

On CUDA the ops take their Triton kernels (``impl="auto"``); on the CPU their PyTorch
paths. ``run(DemoConfig(...))`` is the Python entry point; ``main(argv)`` the command.
Every option is checked before any work (``check_config``): a bad one is one line on stderr
and exit status 2.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional

import torch

import lmfuse
from lmfuse.bench.common import Memory, wall_ms
from lmfuse._cli_args import DTYPES, ArgumentParser, missing_package, plot_file, plot_format_error
# The model (lmfuse.tiny_gpt, shared with examples/), under the names this module had.
from lmfuse.tiny_gpt import (NORM_EPS, PLAIN_MLP, ROPE_THETA, VOCAB, ModelConfig,  # noqa: F401
                             TinyGPT, as_llama, load_text)

BLOCK_LEN = 16  # tokens per block of the Generator's KV cache
# Decode-path logits against the full forward's, relative to the largest logit: float32
# rounding; half precision's (each path rounds its activations differently).
LOGIT_TOLERANCE = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 5e-2}
# The largest relative difference of the two models' losses over training for the run to
# count as the same training: their kernels round at other points, which a chaotic training
# run amplifies (measured: 0 and 1.4e-6 in fp32 on the CPU, 3e-4 fp16, 9.2e-4 bf16 over an
# H100's 200 steps), far below what a wrong op gives (the loss off by tens of percent).
LOSS_TOLERANCE = {"fp32": 5e-3, "fp16": 5e-2, "bf16": 5e-2}
DEFAULT_PROMPTS = ("def ", "import torch\n", "        return self.",
                   'class PagedKVCache:\n    """', "    def forward(self, x", "# ",
                   "from lmfuse import ", "        if x.dim() ")


@dataclass(frozen=True)
class Defaults:
    """What the options left unset (None) become on a device: the sizes, the learning rate
    that suits them, and how many of :data:`DEFAULT_PROMPTS` are continued."""

    steps: int
    d_model: int
    n_layers: int
    n_heads: int
    ffn: int
    seq_len: int
    batch: int
    lr: float
    new_tokens: int
    prompts: int


DEFAULTS = {
    # A few seconds of training on a 2-core CPU: every op is tiny, the step bound by Python.
    "cpu": Defaults(steps=400, d_model=64, n_layers=2, n_heads=4, ffn=192, seq_len=64,
                    batch=8, lr=1e-2, new_tokens=48, prompts=4),
    # Sizes at which the GPU matters: the fused softmax and linear cross-entropy against
    # 16 x [1024, 1024] score matrices a sequence and a 256-way head over 8K tokens a step
    # (1.9-2.6x the plain model's tokens/s on an H100, the host's pace varying; BENCHMARKS.md);
    # decoding 8 prompts x 128 tokens through 8 layers, where the plain generate launches
    # every kernel of a step from Python and the Generator replays one CUDA graph a step.
    "cuda": Defaults(steps=200, d_model=1024, n_layers=8, n_heads=16, ffn=4096, seq_len=1024,
                     batch=8, lr=3e-4, new_tokens=128, prompts=8),
}


@dataclass
class DemoConfig:
    """The demo's options. Those left ``None`` take the device's :data:`DEFAULTS`
    (:func:`check_config` resolves them)."""

    steps: Optional[int] = None
    d_model: Optional[int] = None
    n_layers: Optional[int] = None
    n_heads: Optional[int] = None
    ffn: Optional[int] = None
    seq_len: Optional[int] = None
    batch: Optional[int] = None
    lr: Optional[float] = None
    seed: int = 0
    device: str = "auto"
    dtype: Optional[str] = None  # fp32 on the CPU, bf16 on CUDA
    impl: str = "auto"
    # The demo's matrices are tiny: on the CPU, intra-op threads cost more in hand-offs than
    # they save (one thread ran it 4x faster than two on a busy 2-core machine).
    cpu_threads: int = 1
    text: Optional[str] = None  # default: lmfuse's own source files
    prompts: Optional[list[str]] = None
    new_tokens: Optional[int] = None
    sample: bool = False
    temperature: float = 0.8
    plot: Optional[str] = None
    log_every: Optional[int] = None  # default: a tenth of the steps
    quiet: bool = False
    # Not an option: the demo's MLP is SwiGLU, which as_llama views as Llama's.
    activation: ClassVar[str] = "swiglu"


@dataclass
class TrainStats:
    losses: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0
    peak_mib: Optional[float] = None  # CUDA only


@dataclass
class DemoResult:
    lmfuse: TrainStats
    plain: TrainStats
    prompts: list[str]
    decoded: list[list[int]]  # greedy, through lmfuse.serving.Generator
    decoded_again: list[list[int]]  # the same, the Generator's timed run
    plain_decoded: list[list[int]]  # greedy, the same weights through HF generate
    # max |Generator logits - full-forward logits| / max |full-forward logits| over the
    # greedy steps, the plain model's full forward fed the decoded tokens (teacher-forced:
    # no divergence)
    decode_logit_err: float
    sampled: Optional[list[list[int]]]  # --sample: through the Generator's sampling
    decode_tokens_per_s: float  # the Generator's, all prompts together
    plain_decode_tokens_per_s: float  # HF generate's, timed the same way
    # CUDA only: the most memory a side's decoding held above what was allocated before it
    # (KV cache, activations, captured graphs; the weights are shared and not counted)
    decode_peak_mib: Optional[float]
    plain_decode_peak_mib: Optional[float]
    cuda_graphs: int  # CUDA graphs the Generator captured for its decode steps (CPU: 0)
    device: str
    dtype: str
    config: DemoConfig  # the options the run used, defaults resolved

    @property
    def decode_matches(self) -> bool:
        """Both greedy runs of the Generator gave HF generate's tokens."""
        return self.decoded == self.plain_decoded == self.decoded_again

    @property
    def decode_logits_ok(self) -> bool:
        return self.decode_logit_err <= LOGIT_TOLERANCE[self.dtype]  # (False for NaN)

    @property
    def losses_agree(self) -> bool:
        """The two training runs' losses within :data:`LOSS_TOLERANCE` (False for NaN)."""
        return self.max_loss_rel_diff <= LOSS_TOLERANCE[self.dtype]

    @property
    def losses_finite(self) -> bool:
        """Neither side's training diverged to a NaN or infinite loss."""
        return all(math.isfinite(x) for x in self.lmfuse.losses + self.plain.losses)

    @property
    def max_loss_diff(self) -> float:
        return _nan_max(abs(a - b) for a, b in zip(self.lmfuse.losses, self.plain.losses))

    @property
    def max_loss_rel_diff(self) -> float:
        return _nan_max(abs(a - b) / abs(b) if b else abs(a - b)
                        for a, b in zip(self.lmfuse.losses, self.plain.losses))


def _nan_max(values) -> float:
    """The largest value, NaN if any is NaN (Python's max skips a NaN that is not first)."""
    worst = 0.0
    for v in values:
        if math.isnan(v):
            return math.nan
        worst = max(worst, v)
    return worst


# --- the options -----------------------------------------------------------------------------

# Each integer option's smallest value.
MINIMUM = {"steps": 1, "d_model": 1, "n_layers": 1, "n_heads": 1, "ffn": 1, "seq_len": 1,
           "batch": 1, "new_tokens": 1, "cpu_threads": 0, "log_every": 1, "seed": 0}
# And the largest (far past any machine's memory for the sizes: refused by name, not by an
# allocator's error or a hang; torch.set_num_threads crashes on a huge count).
MAXIMUM = {"steps": 1 << 30, "d_model": 1 << 16, "n_layers": 1 << 12, "n_heads": 1 << 12,
           "ffn": 1 << 20, "seq_len": 1 << 20, "batch": 1 << 20, "new_tokens": 1 << 20,
           "cpu_threads": 1024, "log_every": 1 << 30}
MAX_SEED = 2**63 - 1  # torch.manual_seed's range, from 0
# The options that may be left None (the device's default).
UNSET = tuple(f.name for f in fields(Defaults) if f.name != "prompts") + ("log_every",)


@dataclass(frozen=True)
class Setup:
    """What a checked :class:`DemoConfig` resolves to."""

    config: DemoConfig  # every option set: the device's defaults filled in
    device: torch.device
    dtype: str  # a key of DTYPES
    text: bytes  # the training text
    source: str  # where it came from, for the log
    prompts: list[str]
    defaulted: tuple[str, ...]  # the options that took the device's defaults


def check_config(cfg: DemoConfig,
                 name: Callable[[str], str] = lambda f: f"DemoConfig.{f}") -> Setup:
    """Every option's range and the options' combinations, checked before any work; raises
    ``ValueError`` naming the option (``name(field)``: the command line passes ``--flag``).
    Fills the options left None from the device's :data:`DEFAULTS`, reads the training
    text, and finds out whether the chosen device and path can run."""
    for key, low in MINIMUM.items():
        value = getattr(cfg, key)
        if value is None and key in UNSET:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name(key)} must be an integer, got {value!r}")
        if value < low:
            raise ValueError(f"{name(key)} must be >= {low}, got {value}")
        if key in MAXIMUM and value > MAXIMUM[key]:
            raise ValueError(f"{name(key)} must be <= {MAXIMUM[key]}, got {value}")
    if cfg.seed > MAX_SEED:
        raise ValueError(f"{name('seed')} must be <= {MAX_SEED}, got {cfg.seed}")
    for key in ("sample", "quiet"):
        if not isinstance(getattr(cfg, key), bool):
            raise ValueError(f"{name(key)} must be True or False, got {getattr(cfg, key)!r}")
    for key in ("text", "plot"):
        if getattr(cfg, key) is not None and not isinstance(getattr(cfg, key), str):
            raise ValueError(f"{name(key)} must be a path (str) or None, got "
                             f"{type(getattr(cfg, key)).__name__} {getattr(cfg, key)!r}")
    if cfg.prompts is not None and (isinstance(cfg.prompts, (str, bytes)) or not all(
            isinstance(p, str) for p in cfg.prompts)):
        raise ValueError(f"{name('prompts')} must be a list of strings, got {cfg.prompts!r}")
    for key in ("lr", "temperature"):
        value = getattr(cfg, key)
        if value is None and key in UNSET:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or \
                not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name(key)} must be a finite number > 0, got {value!r}")
    device = _device(cfg.device, name)
    defaults = DEFAULTS[device.type]
    defaulted = tuple(f for f in UNSET if getattr(cfg, f) is None)
    fill = {f: getattr(defaults, f) for f in defaulted if f != "log_every"}
    steps = fill.get("steps", cfg.steps)
    if "log_every" in defaulted:
        fill["log_every"] = max(1, steps // 10)
    cfg = replace(cfg, **fill)
    if cfg.d_model % cfg.n_heads or (cfg.d_model // cfg.n_heads) % 2:
        raise ValueError(f"{name('d_model')} ({cfg.d_model}) must be {name('n_heads')} "
                         f"({cfg.n_heads}) times an even head size (rotary embeddings rotate "
                         "pairs)")
    if cfg.dtype is not None and cfg.dtype not in DTYPES:
        raise ValueError(f"{name('dtype')} must be one of {', '.join(DTYPES)}, got "
                         f"{cfg.dtype!r}")
    if cfg.impl not in ("auto", "triton", "torch"):
        raise ValueError(f"{name('impl')} must be auto, triton or torch, got {cfg.impl!r}")
    if cfg.impl == "triton":
        from lmfuse._dispatch import triton_support

        ok, why = triton_support(device)
        if not ok:
            raise ValueError(f"{name('impl')} triton cannot run on {device}: {why}; use auto "
                             "or torch" + ("" if device.type == "cuda" else
                                           ", or a CUDA device"))
    prompts = list(cfg.prompts or [])
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{name('prompts')} number {i + 1} is empty")
    missing = missing_package("transformers", "decoding through lmfuse.serving.Generator "
                              "(a transformers model)", "'transformers>=5,<6'")
    if missing:
        raise ValueError(missing)
    if cfg.plot is not None:
        _check_plot(cfg.plot, name)
    try:
        text, source = load_text(cfg.text)
    except OSError as exc:
        raise ValueError(f"{name('text')} {cfg.text}: cannot read it: "
                         f"{exc.strerror or exc}") from None
    if len(text) < cfg.seq_len + 2:
        raise ValueError(f"{name('seq_len')} {cfg.seq_len} needs a text of at least "
                         f"{cfg.seq_len + 2} bytes; {source} has {len(text):,}")
    n = defaults.prompts
    if not prompts and cfg.text is None:
        prompts = list(DEFAULT_PROMPTS[:n])
    elif not prompts:  # slices of the text, of different lengths
        decoded = text.decode("utf-8", errors="replace")
        prompts = [decoded[len(decoded) * i // n:][:4 + 5 * i] for i in range(n)]
    dtype = cfg.dtype or ("bf16" if device.type == "cuda" else "fp32")
    return Setup(cfg, device, dtype, text, source, prompts, defaulted)


def _device(text: str, name: Callable[[str], str]) -> torch.device:
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name('device')} must be auto, cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name('device')} {text}: no CUDA device here; use cpu or auto")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"{name('device')} {text}: this machine has "
                         f"{torch.cuda.device_count()} CUDA device(s)")
    return device


def _check_plot(path: str, name: Callable[[str], str]) -> None:
    """``--plot PATH`` needs matplotlib, a directory to write into and a format matplotlib
    writes: said before training, not after it."""
    missing = missing_package("matplotlib", name("plot"), "'lmfuse[plot]' (or matplotlib)")
    if missing:
        raise ValueError(missing)
    parent = Path(path).parent
    if not path or not parent.is_dir():
        raise ValueError(f"{name('plot')} {path!r}: no directory {str(parent)!r} to write into")
    if Path(path).is_dir():
        raise ValueError(f"{name('plot')} {path!r} is a directory: give a file name in it")
    bad = plot_format_error(path)
    if bad:
        raise ValueError(f"{name('plot')} {bad}")


# --- data and training -----------------------------------------------------------------------


def make_batches(data: torch.Tensor, cfg: DemoConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(cfg.seed)
    starts = torch.randint(0, len(data) - cfg.seq_len - 1, (cfg.steps, cfg.batch), generator=gen)
    offsets = torch.arange(cfg.seq_len + 1)
    windows = data[starts[..., None] + offsets]  # [steps, batch, seq_len + 1]
    return [(w[:, :-1], w[:, 1:]) for w in windows]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _progress_bar(steps: int, name: str, enabled: bool):
    """A tqdm bar (step, loss, tokens/s) when printing to a terminal; None otherwise (no
    tqdm, quiet, or output to a file or pipe, where the periodic step lines are the log)."""
    if not (enabled and sys.stdout.isatty()):
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=steps, desc=f"  {name}", unit="step", leave=False, file=sys.stdout,
                dynamic_ncols=True)


def train(model: TinyGPT, batches, cfg: DemoConfig, device: torch.device, name: str,
          log) -> TrainStats:
    # AdamW's eps of 1e-8 rounds to 0 in float16 weights (0 / 0 where a gradient is 0):
    # float16's smallest normal there.
    dtype = next(model.parameters()).dtype
    eps = torch.finfo(torch.float16).tiny if dtype == torch.float16 else 1e-8
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            eps=eps)
    warmup = max(1, cfg.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps))))
    stats = TrainStats()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    skip = min(3, cfg.steps - 1)  # first steps compile kernels: not in tokens/s
    tokens_per_step = cfg.batch * cfg.seq_len
    t_start = window_t = time.perf_counter()
    window_n = 0
    bar = _progress_bar(cfg.steps, name, not cfg.quiet)
    rate = 0.0
    for step, (x, y) in enumerate(batches):
        if step == skip:
            _sync(device)
            t_start = time.perf_counter()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = model.loss(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        stats.losses.append(loss.item())  # a sync per step: fine for a demo
        window_n += 1
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            now = time.perf_counter()
            rate = window_n * tokens_per_step / (now - window_t)
            line = (f"  {name:6s} step {step + 1:4d}/{cfg.steps}  loss {stats.losses[-1]:.4f}  "
                    f"{rate:9.0f} tok/s")
            if bar is not None:
                bar.write(line)
            else:
                log(line)
            window_t, window_n = now, 0
        if bar is not None:
            speed = f", {rate:,.0f} tok/s" if rate else ""  # known from the first log line on
            bar.set_postfix_str(f"loss {stats.losses[-1]:.4f}{speed}", refresh=False)
            bar.update(1)
    if bar is not None:
        bar.close()
    _sync(device)
    stats.tokens_per_s = (cfg.steps - skip) * tokens_per_step / max(
        time.perf_counter() - t_start, 1e-9)
    if device.type == "cuda":
        stats.peak_mib = torch.cuda.max_memory_allocated(device) / 2**20
    return stats


# --- decoding --------------------------------------------------------------------------------


@dataclass
class Decoded:
    """One side's decoding of the prompts."""

    tokens: list[list[int]]  # greedy, new tokens only
    tokens_per_s: float
    peak_mib: Optional[float] = None  # CUDA only, above what was allocated before
    step_logits: Optional[torch.Tensor] = None  # [prompts, new_tokens, V] float32
    timed_tokens: Optional[list[list[int]]] = None  # the timed greedy run's
    sampled: Optional[list[list[int]]] = None
    cuda_graphs: int = 0
    graph_failure: Optional[str] = None


def generate_lmfuse(llama: Any, prompts: list[list[int]], new_tokens: int, *,
                    impl: str = "auto", sample: bool = False, temperature: float = 1.0,
                    seed: int = 0) -> Decoded:
    """Continue ``prompts`` (token lists of any lengths) by ``new_tokens`` tokens each
    through :class:`lmfuse.serving.Generator` (all of them in one batch): a greedy run
    that records the logits each token was picked from (it also captures the CUDA graphs
    and compiles the kernels), then the timed greedy run, then, with ``sample``, a sampled
    run (``temperature``, request ``i`` seeded ``seed + i``)."""
    from lmfuse.serving import Generator

    device = next(llama.parameters()).device
    longest = max(map(len, prompts)) + new_tokens
    mem = Memory(device)
    mem.start()
    blocks = len(prompts) * -(-longest // BLOCK_LEN)  # the pool: exactly what they need
    gen = Generator(llama, block_len=BLOCK_LEN, num_blocks=blocks, max_batch=len(prompts),
                    impl=impl)
    try:
        tokens, step_logits = _greedy_with_logits(gen, prompts, new_tokens)
        ms, timed = wall_ms(lambda: gen.generate(prompts, max_new_tokens=new_tokens,
                                                 eos_token_id=[]), device)
        sampled = (gen.generate(prompts, max_new_tokens=new_tokens, temperature=temperature,
                                seed=seed, eos_token_id=[]) if sample else None)
        st = gen.stats
        graphs, failure = st["cuda_graphs"] - st["prefill_graphs"], gen.runner.graph_failure
    finally:
        gen.close()
    return Decoded(tokens, len(prompts) * new_tokens / max(ms, 1e-6) * 1e3, mem.peak_mib(),
                   step_logits, timed, sampled, graphs, failure)


def _greedy_with_logits(gen: Any, prompts: list[list[int]],
                        new_tokens: int) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy continuations through the Generator's ``add_request`` and ``step``, and the
    logits ``[prompts, new_tokens, V]`` (float32) each token was picked from: read where
    the Generator's model runner returns them (its prefill and decode calls, wrapped for
    this run only), keyed by request and by how many tokens it had generated."""
    runner, seen = gen.runner, {}

    def recording(call: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def wrapped(requests: list[Any], *args: Any) -> torch.Tensor:
            logits = call(requests, *args)
            for req, row in zip(requests, logits):  # a graph's output buffer: copied
                seen[req.rid, len(req.output)] = row.to(torch.float32, copy=True)
            return logits
        return wrapped

    runner.prefill, runner.decode = recording(runner.prefill), recording(runner.decode)
    gen.lookahead = False  # every step through runner.decode, read before the next
    try:
        rids = [gen.add_request(p, max_new_tokens=new_tokens, eos_token_id=[])
                for p in prompts]
        out: dict[int, list[int]] = {rid: [] for rid in rids}
        while gen.has_unfinished():
            for rid, toks, _ in gen.step():
                out[rid] += toks
    finally:
        del runner.prefill, runner.decode  # the class's methods again
        gen.lookahead = True
    logits = torch.stack([torch.stack([seen[rid, i] for i in range(new_tokens)])
                          for rid in rids])
    return [out[rid] for rid in rids], logits


@torch.inference_mode()
def generate_plain(llama: Any, prompts: list[list[int]], new_tokens: int) -> Decoded:
    """The same continuations through ``llama.generate`` (greedy, its dynamic KV cache),
    the prompts left-padded into one batch: one call for the tokens, then the timed one."""
    device = next(llama.parameters()).device
    n, width = len(prompts), max(map(len, prompts))
    ids = torch.zeros((n, width), dtype=torch.int64)
    mask = torch.zeros((n, width), dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)

    def call() -> torch.Tensor:
        return llama.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                              do_sample=False, use_cache=True, pad_token_id=0)

    mem = Memory(device)
    mem.start()
    tokens = call()[:, width:].tolist()
    ms, _ = wall_ms(call, device)
    return Decoded(tokens, n * new_tokens / max(ms, 1e-6) * 1e3, mem.peak_mib())


@torch.no_grad()
def teacher_forced_err(model: TinyGPT, prompts: list[list[int]], tokens: list[list[int]],
                       step_logits: torch.Tensor) -> float:
    """Max over prompts of ``max |step_logits - full| / max |full|``, where ``full`` are the
    plain model's next-token logits on the prompt followed by ``tokens`` (one forward a
    prompt): the decode path checked position by position on the same inputs, which in
    bf16 stays meaningful after a near-tie has made the greedy continuations part."""
    device = next(model.parameters()).device

    def errors():
        for prompt, cont, got in zip(prompts, tokens, step_logits):
            if cont:
                seq = torch.tensor(prompt + cont[:-1], device=device)[None]
                full = model.logits(seq)[0, len(prompt) - 1:].float()
                yield float((got - full).abs().max() / full.abs().max().clamp(min=1e-30))

    return _nan_max(errors())


# --- the demo --------------------------------------------------------------------------------


def _text(tokens: list[int]) -> str:
    """The bytes as a quoted string; escaped to ASCII where stdout cannot encode them (a
    cp1252 console, a redirected Windows stream), which would end the demo in an error."""
    text = bytes(tokens).decode("utf-8", errors="replace")
    try:
        repr(text).encode(getattr(sys.stdout, "encoding", None) or "ascii")
    except (UnicodeEncodeError, LookupError):
        return ascii(text)
    return repr(text)


def run(cfg: DemoConfig) -> DemoResult:
    """The whole demo; prints its progress and table unless ``cfg.quiet``. Raises
    ``ValueError`` for a bad option (:func:`check_config`) before any work."""
    setup = check_config(cfg)
    threads = torch.get_num_threads()
    if cfg.cpu_threads and setup.device.type == "cpu":
        torch.set_num_threads(cfg.cpu_threads)
    try:
        return _run(setup.config, setup)
    finally:
        torch.set_num_threads(threads)


def _sizes_line(cfg: DemoConfig, setup: Setup) -> str:
    sizes = [f for f in UNSET if f != "log_every"]
    taken = [f for f in setup.defaulted if f in sizes]
    where = ("as given" if not taken else f"the {setup.device.type} defaults"
             + ("" if len(taken) == len(sizes) else " where not given"))
    return (f"sizes ({where}): {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} "
            f"heads, ffn {cfg.ffn}, seq {cfg.seq_len}, batch {cfg.batch}, {cfg.steps} steps "
            f"at lr {cfg.lr:g}; {len(setup.prompts)} prompts x {cfg.new_tokens} new tokens")


def _run(cfg: DemoConfig, setup: Setup) -> DemoResult:
    log = (lambda *a: None) if cfg.quiet else print
    device, dtype_name, raw, source = setup.device, setup.dtype, setup.text, setup.source
    dtype = DTYPES[dtype_name]
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    prompt_texts = setup.prompts
    # surrogateescape: a command-line argument that is not UTF-8 keeps its own bytes
    prompts = [list(t.encode("utf-8", "surrogateescape")) for t in prompt_texts]

    path = lmfuse.explain(lmfuse.fused_softmax, torch.zeros(1, 1, 2, 2, device=device),
                          causal=True, impl=cfg.impl)
    log(f"lmfuse demo on {device} ({dtype_name})")
    log(_sizes_line(cfg, setup))
    log(f"text: {source}, {len(raw):,} bytes")
    log(f"ops: impl={cfg.impl!r}; e.g. {str(path).splitlines()[0]}")

    torch.manual_seed(cfg.seed)
    fused = TinyGPT(cfg, fused=True, impl=cfg.impl)
    plain = TinyGPT(cfg, fused=False)
    plain.load_state_dict(fused.state_dict())  # identical initial weights
    fused.to(device=device, dtype=dtype)
    plain.to(device=device, dtype=dtype)
    batches = make_batches(data, cfg)

    log("training (same weights, same batches):")
    s_fused = train(fused, batches, cfg, device, "lmfuse", log)
    s_plain = train(plain, batches, cfg, device, "plain", log)
    del plain  # its memory, before decoding

    fused.eval()
    llama = as_llama(fused, max(cfg.seq_len, max(map(len, prompts)) + cfg.new_tokens))
    log(f"\ndecoding with the lmfuse model's weights, viewed as a transformers "
        f"LlamaForCausalLM (no copy), {len(prompts)} prompts at once:")
    ours = generate_lmfuse(llama, prompts, cfg.new_tokens, impl=cfg.impl, sample=cfg.sample,
                           temperature=cfg.temperature, seed=cfg.seed)
    theirs = generate_plain(llama, prompts, cfg.new_tokens)
    checker = TinyGPT(cfg, fused=False).to(device=device, dtype=dtype)
    checker.load_state_dict(fused.state_dict())  # the plain model with lmfuse's weights
    logit_err = teacher_forced_err(checker, prompts, ours.tokens, ours.step_logits)
    del checker

    result = DemoResult(
        lmfuse=s_fused, plain=s_plain, prompts=prompt_texts, decoded=ours.tokens,
        decoded_again=ours.timed_tokens, plain_decoded=theirs.tokens,
        decode_logit_err=logit_err, sampled=ours.sampled,
        decode_tokens_per_s=ours.tokens_per_s, plain_decode_tokens_per_s=theirs.tokens_per_s,
        decode_peak_mib=ours.peak_mib, plain_decode_peak_mib=theirs.peak_mib,
        cuda_graphs=ours.cuda_graphs, device=str(device), dtype=dtype_name, config=cfg)
    graphs = (f"decode steps replayed from {ours.cuda_graphs} CUDA graphs" if ours.cuda_graphs
              else "no CUDA graphs" + (f" (capture failed: {ours.graph_failure})"
                                       if ours.graph_failure else ""))
    log(f"lmfuse.serving.Generator (paged KV cache, lmfuse's kernels, {graphs}), "
        f"{'sampled (T=%g)' % cfg.temperature if ours.sampled is not None else 'greedy'}:")
    for prompt, cont in zip(prompts, ours.sampled if ours.sampled is not None else ours.tokens):
        log(f"  {_text(prompt)} -> {_text(cont)}")
    log(f"Generator logits against the plain model's full forward on the same tokens: max "
        f"|difference| / max |logit| = {logit_err:.1e} (tolerance in {dtype_name} "
        f"{LOGIT_TOLERANCE[dtype_name]:.0e}): {'ok' if result.decode_logits_ok else 'FAILED'}")
    repeat = "" if ours.timed_tokens == ours.tokens else " (the timed run's tokens differ)"
    log(f"greedy tokens identical to the same model's transformers generate: "
        f"{'yes' if result.decode_matches else 'no' + repeat}"
        + ("" if result.decode_matches or dtype_name == "fp32" else
           f" (in {dtype_name} a near-tie between two tokens can round either way in the two "
           "paths, and the continuations part from there)"))
    log("")
    log(summary(result))
    if cfg.plot:
        log(plot(result, cfg.plot))
    return result


def summary(r: DemoResult) -> str:
    def mem(mib: Optional[float]) -> str:
        return "n/a (CPU)" if mib is None else f"{mib:,.1f} MiB"

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if b > 0 else "-"

    rows = [("", "lmfuse", "plain", "lmfuse/plain"),
            ("loss at start", f"{r.lmfuse.losses[0]:.4f}", f"{r.plain.losses[0]:.4f}", ""),
            ("loss at end", f"{r.lmfuse.losses[-1]:.4f}", f"{r.plain.losses[-1]:.4f}", ""),
            ("training tokens/s", f"{r.lmfuse.tokens_per_s:,.0f}",
             f"{r.plain.tokens_per_s:,.0f}", ratio(r.lmfuse.tokens_per_s, r.plain.tokens_per_s)),
            ("peak memory (training)", mem(r.lmfuse.peak_mib), mem(r.plain.peak_mib), ""),
            ("decode tokens/s (Generator | HF generate)", f"{r.decode_tokens_per_s:,.0f}",
             f"{r.plain_decode_tokens_per_s:,.0f}",
             ratio(r.decode_tokens_per_s, r.plain_decode_tokens_per_s)),
            ("decode memory above the weights", mem(r.decode_peak_mib),
             mem(r.plain_decode_peak_mib), "")]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [f"{a:<{widths[0]}}  {b:>{widths[1]}}  {c:>{widths[2]}}  {d:>{widths[3]}}".rstrip()
             for a, b, c, d in rows]
    lines.append(f"max |loss difference| over {len(r.lmfuse.losses)} steps: "
                 f"{r.max_loss_diff:.2e} (relative {r.max_loss_rel_diff:.2e}, tolerance "
                 f"{LOSS_TOLERANCE[r.dtype]:.0e}): "
                 f"{'ok' if r.losses_agree else 'FAILED: the two models train differently'}")
    return "\n".join(lines)


def plot(r: DemoResult, path: str) -> str:
    """Both loss curves into ``path`` (needs matplotlib: ``pip install 'lmfuse[plot]'``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(r.lmfuse.losses, label="lmfuse")
    ax.plot(r.plain.losses, label="plain PyTorch", linestyle="--")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title(f"lmfuse demo ({r.device}, {r.dtype})")
    ax.legend()
    fig.tight_layout()
    path = plot_file(path)
    fig.savefig(path)
    plt.close(fig)
    return f"loss curves written to {path}"


def _flag(key: str) -> str:
    """A DemoConfig field's command-line option."""
    return "--prompt" if key == "prompts" else "--" + key.replace("_", "-")


def main(argv: Optional[list[str]] = None) -> int:
    d = DemoConfig()
    cpu, gpu = DEFAULTS["cpu"], DEFAULTS["cuda"]

    def default(key: str) -> str:
        a, b = getattr(cpu, key), getattr(gpu, key)
        return f"default {a:g}" if a == b else f"default {a:g} on the CPU, {b:g} on CUDA"

    parser = ArgumentParser(prog="lmfuse demo", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--steps", type=int, help=f"training steps, >= 1 ({default('steps')})")
    add("--device", default="auto", help="auto (cuda if available), cpu, cuda or cuda:N")
    add("--dtype", choices=tuple(DTYPES), help="default fp32 on the CPU, bf16 on CUDA")
    add("--seed", type=int, default=d.seed, help=f"0 .. 2**63-1 (default {d.seed})")
    add("--impl", choices=("auto", "triton", "torch"), default="auto",
        help="the ops' and the Generator's path (default auto: Triton on CUDA, PyTorch on "
        "the CPU; triton on the CPU needs TRITON_INTERPRET=1, Triton's slow interpreter)")
    add("--text", help="train on this file (default: lmfuse's own source)")
    add("--prompt", action="append", dest="prompts",
        help=f"a prompt to continue (repeatable; not empty; default {cpu.prompts} built-in "
        f"prompts on the CPU, {gpu.prompts} on CUDA)")
    add("--new-tokens", type=int,
        help=f"tokens generated per prompt, >= 1 ({default('new_tokens')})")
    add("--sample", action="store_true",
        help="show the Generator's temperature sampling instead of its greedy decoding")
    add("--temperature", type=float, default=d.temperature,
        help=f"sampling temperature, > 0 (default {d.temperature})")
    add("--plot", help="draw both loss curves into this PNG (needs matplotlib: pip install "
        "'lmfuse[plot]')")
    for key, text in (("d_model", "model width"), ("n_layers", "layers"),
                      ("n_heads", "attention heads (d-model / n-heads must be even)"),
                      ("ffn", "MLP width"), ("seq_len", "tokens per training sequence"),
                      ("batch", "sequences per training step")):
        add(_flag(key), type=int, help=f"{text}, >= 1 ({default(key)})")
    add("--lr", type=float, help=f"learning rate, > 0 ({default('lr')})")
    add("--cpu-threads", type=int, default=d.cpu_threads,
        help=f"torch threads on the CPU (0: leave torch's default; default {d.cpu_threads})")
    args = parser.parse_args(argv)
    cfg = DemoConfig(**vars(args))
    try:
        check_config(cfg, _flag)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        result = run(cfg)
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        # (on a CPU an allocation too large is a RuntimeError of the allocator's)
        first = (str(exc).strip().splitlines() or ["out of memory"])[0]
        if not isinstance(exc, torch.OutOfMemoryError) and "alloc" not in first.lower():
            raise
        print(f"lmfuse demo: out of memory: {first}; try a smaller --batch, --seq-len or "
              "--d-model", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if not result.losses_finite:
        print("lmfuse demo: training diverged (a loss is NaN or infinite); try a smaller "
              "--lr, or --dtype fp32", file=sys.stderr)
        return 1
    # In fp16/bf16 the two paths round at different points, so a near-tie may pick another
    # token; only an fp32 mismatch is an error.
    return 0 if result.decode_logits_ok and result.losses_agree and (
        result.decode_matches or result.dtype != "fp32") else 1


if __name__ == "__main__":
    raise SystemExit(main())
