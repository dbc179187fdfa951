"""``lmfuse demo``: train a tiny byte-level GPT with lmfuse's ops and the same GPT in plain
PyTorch, side by side, then decode from the lmfuse one over a paged KV cache.

    model      tokens -> embedding -> L x [x + attn(x); x + mlp(rmsnorm(x))] -> rmsnorm -> head
    attn       RMSNorm -> fused QKV projection -> rotary embedding -> causal attention -> out
               (the parameter layout of :class:`lmfuse.DecodeAttentionBlock`, so decoding
               loads the trained weights into that block unchanged)

The two models start from one set of weights and see the same batches; they differ only
in the ops:

    lmfuse                                   plain PyTorch
    lmfuse.rms_norm(x, w)                    x * rsqrt(mean(x ** 2) + eps) * w
    lmfuse.fused_softmax(causal=True)        torch.softmax of masked scores
    lmfuse.FusedMLP(activation="swiglu")     F.silu(a) * g
    lmfuse.linear_cross_entropy(h, W, y)     F.cross_entropy(h @ W.T, y)

Decoding runs the lmfuse model's layers with one :class:`lmfuse.DecodeAttentionBlock` per
layer over one :class:`lmfuse.PagedKVCache` (prompts of different lengths prefilled in
chunks of up to 8 tokens, then decoded together one token a step), and checks its greedy
continuation against a full re-forward of the plain model with the same weights.

On CUDA the ops take their Triton kernels (``impl="auto"``); on the CPU their PyTorch
references. ``run(DemoConfig(...))`` is the Python entry point; ``main(argv)`` the command.
Every option is checked before any work (``check_config``): a bad one is one line on stderr
and exit status 2.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

import lmfuse

VOCAB = 256  # bytes
NORM_EPS = 1e-6
ROPE_THETA = 10000.0
PREFILL_CHUNK = 8  # decode attention takes 1..8 active tokens per step
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Decode-path logits against the full forward's, relative to the largest logit: float32
# rounding; half precision's (each path rounds its activations differently).
LOGIT_TOLERANCE = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 5e-2}
DEFAULT_PROMPTS = ("def ", "import torch\n", "        return self.",
                   'class PagedKVCache:\n    """')


@dataclass
class DemoConfig:
    steps: int = 400
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    ffn: int = 192
    seq_len: int = 64
    batch: int = 8
    lr: float = 1e-2
    seed: int = 0
    device: str = "auto"
    dtype: Optional[str] = None  # fp32 on the CPU, bf16 on CUDA
    impl: str = "auto"
    # The demo's matrices are tiny: on the CPU, intra-op threads cost more in hand-offs than
    # they save (one thread ran it 4x faster than two on a busy 2-core machine).
    cpu_threads: int = 1
    text: Optional[str] = None  # default: lmfuse's own source files
    prompts: Optional[list[str]] = None
    new_tokens: int = 48
    sample: bool = False
    temperature: float = 0.8
    plot: Optional[str] = None
    log_every: int = 25
    quiet: bool = False


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
    decoded: list[list[int]]  # greedy, through DecodeAttentionBlock + PagedKVCache
    full_forward: list[list[int]]  # greedy, plain model re-run on the whole sequence
    # max |decode logits - full-forward logits| / max |full-forward logits| over the greedy
    # steps, the full forward fed the decoded tokens (teacher-forced: no divergence)
    decode_logit_err: float
    sampled: Optional[list[list[int]]]
    decode_tokens_per_s: float
    device: str
    dtype: str

    @property
    def decode_matches(self) -> bool:
        return self.decoded == self.full_forward

    @property
    def decode_logits_ok(self) -> bool:
        return self.decode_logit_err <= LOGIT_TOLERANCE[self.dtype]

    @property
    def max_loss_diff(self) -> float:
        return max(abs(a - b) for a, b in zip(self.lmfuse.losses, self.plain.losses))

    @property
    def max_loss_rel_diff(self) -> float:
        return max(abs(a - b) / abs(b) for a, b in zip(self.lmfuse.losses, self.plain.losses))


# --- the options -----------------------------------------------------------------------------

# Each integer option's smallest value.
MINIMUM = {"steps": 1, "d_model": 1, "n_layers": 1, "n_heads": 1, "ffn": 1, "seq_len": 1,
           "batch": 1, "new_tokens": 1, "cpu_threads": 0, "log_every": 1, "seed": 0}
MAX_SEED = 2**63 - 1  # torch.manual_seed's range, from 0


@dataclass(frozen=True)
class Setup:
    """What a checked :class:`DemoConfig` resolves to."""

    device: torch.device
    dtype: str  # a key of DTYPES
    text: bytes  # the training text
    source: str  # where it came from, for the log
    prompts: list[str]


def check_config(cfg: DemoConfig,
                 name: Callable[[str], str] = lambda f: f"DemoConfig.{f}") -> Setup:
    """Every option's range and the options' combinations, checked before any work; raises
    ``ValueError`` naming the option (``name(field)``: the command line passes ``--flag``).
    Reads the training text, and finds out whether the chosen device and path can run."""
    for key, low in MINIMUM.items():
        value = getattr(cfg, key)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name(key)} must be an integer, got {value!r}")
        if value < low:
            raise ValueError(f"{name(key)} must be >= {low}, got {value}")
    if cfg.seed > MAX_SEED:
        raise ValueError(f"{name('seed')} must be <= {MAX_SEED}, got {cfg.seed}")
    for key in ("lr", "temperature"):
        value = getattr(cfg, key)
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name(key)} must be a finite number > 0, got {value!r}")
    if cfg.d_model % cfg.n_heads or (cfg.d_model // cfg.n_heads) % 2:
        raise ValueError(f"{name('d_model')} ({cfg.d_model}) must be {name('n_heads')} "
                         f"({cfg.n_heads}) times an even head size (rotary embeddings rotate "
                         "pairs)")
    device = _device(cfg.device, name)
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
    if cfg.plot is not None:
        _check_plot(cfg.plot, name)
    text, source = _read_text(cfg.text, name)
    if len(text) < cfg.seq_len + 2:
        raise ValueError(f"{name('seq_len')} {cfg.seq_len} needs a text of at least "
                         f"{cfg.seq_len + 2} bytes; {source} has {len(text):,}")
    if not prompts and cfg.text is None:
        prompts = list(DEFAULT_PROMPTS)
    elif not prompts:  # slices of the text, of different lengths
        decoded = text.decode("utf-8", errors="replace")
        prompts = [decoded[len(decoded) * i // 4:][:n] for i, n in ((0, 4), (1, 9), (2, 17))]
    dtype = cfg.dtype or ("bf16" if device.type == "cuda" else "fp32")
    return Setup(device, dtype, text, source, prompts)


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
    from lmfuse.cli import missing_package

    missing = missing_package("matplotlib", name("plot"), "'lmfuse[plot]' (or matplotlib)")
    if missing:
        raise ValueError(missing)
    parent = Path(path).parent
    if not path or not parent.is_dir():
        raise ValueError(f"{name('plot')} {path!r}: no directory {str(parent)!r} to write into")
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix:
        from matplotlib.backend_bases import FigureCanvasBase

        formats = FigureCanvasBase.get_supported_filetypes()
        if suffix not in formats:
            raise ValueError(f"{name('plot')} {path!r}: matplotlib cannot write .{suffix} "
                             f"files; use one of .{', .'.join(sorted(formats))}")


def _read_text(path: Optional[str], name: Callable[[str], str]) -> tuple[bytes, str]:
    try:
        return load_text(path)
    except OSError as exc:
        raise ValueError(f"{name('text')} {path}: cannot read it: "
                         f"{exc.strerror or exc}") from None


# --- the model -------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # float32 math, rounded once: as DecodeAttentionBlock's input norm.
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + NORM_EPS)
            * weight.float()).to(x.dtype)


def rope(x: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of ``x [B, T, H, D]`` at positions ``0..T-1``: the cosine
    and sine of float32 angles (as DecodeAttentionBlock takes them), rounded to x's dtype."""
    T = x.shape[1]
    angle = torch.arange(T, device=x.device, dtype=torch.float32)[None, :, None, None] * inv_freq
    c, s = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x.chunk(2, -1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)


class RMSNorm(nn.Module):
    """``lmfuse.rms_norm`` in the fused model, the plain formula in the other."""

    def __init__(self, d: int, fused: bool, impl: str) -> None:
        super().__init__()
        self.fused, self.impl = fused, impl
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return lmfuse.rms_norm(x, self.weight, eps=NORM_EPS, impl=self.impl)
        return rms_norm(x, self.weight)


class CausalSelfAttention(nn.Module):
    """Training-time attention with DecodeAttentionBlock's parameters (``input_norm_weight``,
    ``qkv``, ``out``; no biases, rope over the whole head)."""

    def __init__(self, d: int, n_heads: int, fused: bool, impl: str) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.fused, self.impl = n_heads, d // n_heads, fused, impl
        self.input_norm_weight = nn.Parameter(torch.ones(d))
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        exponent = torch.arange(0, self.head_dim, 2).float() / self.head_dim
        self.register_buffer("inv_freq", 1.0 / ROPE_THETA ** exponent, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        H, D = self.n_heads, self.head_dim
        h = (lmfuse.rms_norm(x, self.input_norm_weight, eps=NORM_EPS, impl=self.impl)
             if self.fused else rms_norm(x, self.input_norm_weight))
        q, k, v = self.qkv(h).view(B, T, 3, H, D).unbind(2)
        q, k = rope(q, self.inv_freq), rope(k, self.inv_freq)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        scores = q @ k.transpose(-1, -2)  # [B, H, T, T]
        if self.fused:
            p = lmfuse.fused_softmax(scores, scale=D ** -0.5, causal=True, impl=self.impl)
        else:
            future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            p = torch.softmax((scores.float() * D ** -0.5).masked_fill(future, -math.inf),
                              -1).to(x.dtype)
        return self.out((p @ v).transpose(1, 2).reshape(B, T, d))


class PlainSwiGLU(nn.Module):
    """FusedMLP(activation="swiglu", bias=False) in plain PyTorch (same parameter names)."""

    def __init__(self, d: int, ffn: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * ffn, bias=False)
        self.fc2 = nn.Linear(ffn, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, g = self.fc1(x).chunk(2, -1)  # the activated half first, as FusedMLP
        return self.fc2(F.silu(a) * g)


class Layer(nn.Module):
    def __init__(self, cfg: DemoConfig, fused: bool, impl: str) -> None:
        super().__init__()
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_heads, fused, impl)
        self.mlp_norm = RMSNorm(cfg.d_model, fused, impl)
        self.mlp = (lmfuse.FusedMLP(cfg.d_model, cfg.ffn, "swiglu", bias=False, impl=impl)
                    if fused else PlainSwiGLU(cfg.d_model, cfg.ffn))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(self.mlp_norm(x))


class TinyGPT(nn.Module):
    def __init__(self, cfg: DemoConfig, fused: bool, impl: str = "auto") -> None:
        super().__init__()
        self.fused, self.impl = fused, impl
        self.embed = nn.Embedding(VOCAB, cfg.d_model)
        self.layers = nn.ModuleList(Layer(cfg, fused, impl) for _ in range(cfg.n_layers))
        self.final_norm = RMSNorm(cfg.d_model, fused, impl)
        self.head = nn.Linear(cfg.d_model, VOCAB, bias=False)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.final_norm(x)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.hidden(tokens).flatten(0, 1)
        if self.fused:
            return lmfuse.linear_cross_entropy(h, self.head.weight, targets.flatten(),
                                               impl=self.impl)
        return F.cross_entropy(self.head(h).float(), targets.flatten())

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(tokens))


# --- data and training -----------------------------------------------------------------------


def load_text(path: Optional[str]) -> tuple[bytes, str]:
    if path is not None:
        return Path(path).read_bytes(), path
    root = Path(lmfuse.__file__).resolve().parent
    files = sorted(root.rglob("*.py"))
    return b"\n".join(f.read_bytes() for f in files), f"lmfuse's own source ({len(files)} files)"


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
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, cfg.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps))))
    stats = TrainStats()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    skip = min(3, cfg.steps - 1)  # first steps compile kernels: not in tokens/s
    tokens_per_step = cfg.batch * cfg.seq_len
    timed, t_start = 0.0, time.perf_counter()
    window_t, window_n = time.perf_counter(), 0
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
    timed = time.perf_counter() - t_start
    stats.tokens_per_s = (cfg.steps - skip) * tokens_per_step / max(timed, 1e-9)
    if device.type == "cuda":
        stats.peak_mib = torch.cuda.max_memory_allocated(device) / 2**20
    return stats


# --- decoding --------------------------------------------------------------------------------


def _pick(logits: torch.Tensor, sample: bool, temperature: float,
          gen: Optional[torch.Generator]) -> torch.Tensor:
    if not sample:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, -1)
    return torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(-1).to(logits.device)


@torch.inference_mode()
def generate_paged(model: TinyGPT, prompts: list[list[int]], new_tokens: int, *,
                   sample: bool = False, temperature: float = 1.0, seed: int = 0,
                   block_len: int = 16) -> tuple[list[list[int]], float, torch.Tensor]:
    """Continue ``prompts`` (token lists of any lengths) by ``new_tokens`` tokens each, with
    ``model``'s weights: attention through one :class:`lmfuse.DecodeAttentionBlock` per layer
    over a :class:`lmfuse.PagedKVCache`. Returns the continuations, the decode phase's
    tokens/s (all sequences together, after the prefill) and the logits each token was
    picked from, ``[len(prompts), new_tokens, V]`` float32."""
    empty = [i for i, prompt in enumerate(prompts) if len(prompt) == 0]
    if empty:
        raise ValueError(f"generate_paged: every prompt needs a token; prompts[{empty[0]}] "
                         "is empty")
    p = next(model.parameters())
    device, dtype = p.device, p.dtype
    first = model.layers[0].attn
    H, D = first.n_heads, first.head_dim
    blocks = []
    for layer in model.layers:
        block = lmfuse.DecodeAttentionBlock(H * D, H, H, rope=True, rope_theta=ROPE_THETA,
                                            norm_eps=NORM_EPS, impl=model.impl,
                                            device=device, dtype=dtype)
        # The training attention has the block's parameter layout: a plain state-dict copy.
        block.load_state_dict(layer.attn.state_dict())
        blocks.append(block)
    longest = max(map(len, prompts)) + new_tokens
    cache = lmfuse.PagedKVCache(len(prompts) * -(-longest // block_len), block_len, H, D,
                                dtype=dtype, device=device, num_layers=len(blocks))
    seqs = [cache.add_sequence() for _ in prompts]

    def forward(ids: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """tokens [n, s] -> the last token's logits [n, V], its keys/values cached."""
        step = cache.reserve(ids, tokens.shape[1])
        x = model.embed(tokens)
        for i, (block, layer) in enumerate(zip(blocks, model.layers)):
            x = x + block(x, cache.k_caches[i], cache.v_caches[i], step.seqlens_before,
                          block_table=step.block_table)
            x = x + layer.mlp(layer.mlp_norm(x))
        return model.head(model.final_norm(x[:, -1]))

    last = []
    for sid, prompt in zip(seqs, prompts):  # prefill, one prompt at a time
        t = torch.tensor(prompt, device=device)[None]
        for i in range(0, t.shape[1], PREFILL_CHUNK):
            logits = forward([sid], t[:, i:i + PREFILL_CHUNK])
        last.append(logits[0])
    logits = torch.stack(last)
    gen = torch.Generator().manual_seed(seed) if sample else None
    out: list[torch.Tensor] = []
    _sync(device)
    t0 = time.perf_counter()
    picked_from = []
    for i in range(new_tokens):  # decode: every sequence together, one token a step
        nxt = _pick(logits, sample, temperature, gen)
        out.append(nxt)
        picked_from.append(logits)
        if i + 1 < new_tokens:
            logits = forward(seqs, nxt[:, None])
    _sync(device)
    elapsed = time.perf_counter() - t0
    tokens = torch.stack(out, 1).tolist() if out else [[] for _ in prompts]
    steps = (torch.stack(picked_from, 1).float() if picked_from else
             logits.new_empty((len(prompts), 0, logits.shape[-1]), dtype=torch.float32))
    return tokens, len(prompts) * new_tokens / max(elapsed, 1e-9), steps


@torch.no_grad()
def generate_full(model: TinyGPT, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuation by re-running the whole sequence for every token (no cache)."""
    device = next(model.parameters()).device
    result = []
    for prompt in prompts:
        seq = list(prompt)
        for _ in range(new_tokens):
            seq.append(int(model.logits(torch.tensor(seq, device=device)[None])[0, -1].argmax()))
        result.append(seq[len(prompt):])
    return result


@torch.no_grad()
def teacher_forced_err(model: TinyGPT, prompts: list[list[int]], tokens: list[list[int]],
                       step_logits: torch.Tensor) -> float:
    """Max over prompts of ``max |step_logits - full| / max |full|``, where ``full`` are the
    plain model's next-token logits on the prompt followed by ``tokens`` (one forward a
    prompt): the decode path checked position by position on the same inputs, which in
    bf16 stays meaningful after a near-tie has made the greedy continuations part."""
    device = next(model.parameters()).device
    worst = 0.0
    for prompt, cont, got in zip(prompts, tokens, step_logits):
        if not cont:
            continue
        seq = torch.tensor(prompt + cont[:-1], device=device)[None]
        full = model.logits(seq)[0, len(prompt) - 1:].float()
        worst = max(worst, float((got - full).abs().max() / full.abs().max().clamp(min=1e-30)))
    return worst


# --- the demo --------------------------------------------------------------------------------


def _text(tokens: list[int]) -> str:
    return repr(bytes(tokens).decode("utf-8", errors="replace"))


def run(cfg: DemoConfig) -> DemoResult:
    """The whole demo; prints its progress and table unless ``cfg.quiet``. Raises
    ``ValueError`` for a bad option (:func:`check_config`) before any work."""
    setup = check_config(cfg)
    threads = torch.get_num_threads()
    if cfg.cpu_threads and setup.device.type == "cpu":
        torch.set_num_threads(cfg.cpu_threads)
    try:
        return _run(cfg, setup)
    finally:
        torch.set_num_threads(threads)


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
    log(f"lmfuse demo on {device} ({dtype_name}): {cfg.n_layers} layers, d_model "
        f"{cfg.d_model}, {cfg.n_heads} heads, ffn {cfg.ffn}, seq {cfg.seq_len}, batch "
        f"{cfg.batch}, {cfg.steps} steps")
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

    fused.eval()
    decoded, decode_tps, step_logits = generate_paged(fused, prompts, cfg.new_tokens)
    checker = TinyGPT(cfg, fused=False).to(device=device, dtype=dtype)
    checker.load_state_dict(fused.state_dict())  # the plain model with lmfuse's weights
    full = generate_full(checker, prompts, cfg.new_tokens)
    logit_err = teacher_forced_err(checker, prompts, decoded, step_logits)
    sampled = None
    if cfg.sample:
        sampled, decode_tps, _ = generate_paged(fused, prompts, cfg.new_tokens, sample=True,
                                                temperature=cfg.temperature, seed=cfg.seed)

    result = DemoResult(s_fused, s_plain, prompt_texts, decoded, full, logit_err, sampled,
                        decode_tps, str(device), dtype_name)
    shown = sampled if sampled is not None else decoded
    log(f"\ngeneration with the lmfuse model's weights: DecodeAttentionBlock over a "
        f"PagedKVCache, {len(prompts)} prompts at once, "
        f"{'sampled (T=%g)' % cfg.temperature if sampled is not None else 'greedy'}:")
    for prompt, cont in zip(prompts, shown):
        log(f"  {_text(prompt)} -> {_text(cont)}")
    log(f"decode logits against the plain model's full forward on the same tokens: max "
        f"|difference| / max |logit| = {logit_err:.1e} (tolerance in {dtype_name} "
        f"{LOGIT_TOLERANCE[dtype_name]:.0e}): {'ok' if result.decode_logits_ok else 'FAILED'}")
    log(f"greedy continuations identical to the plain model's (re-run per token): "
        f"{'yes' if result.decode_matches else 'no'}"
        + ("" if result.decode_matches or dtype_name == "fp32" else
           f" (in {dtype_name} a near-tie between two tokens can round either way in the two "
           "paths, and the continuations part from there)"))
    log("")
    log(summary(result))
    if cfg.plot:
        log(plot(result, cfg.plot))
    return result


def summary(r: DemoResult) -> str:
    def mem(s: TrainStats) -> str:
        return "n/a (CPU)" if s.peak_mib is None else f"{s.peak_mib:.1f} MiB"

    rows = [("", "lmfuse", "plain PyTorch"),
            ("loss at start", f"{r.lmfuse.losses[0]:.4f}", f"{r.plain.losses[0]:.4f}"),
            ("loss at end", f"{r.lmfuse.losses[-1]:.4f}", f"{r.plain.losses[-1]:.4f}"),
            ("training tokens/s", f"{r.lmfuse.tokens_per_s:,.0f}", f"{r.plain.tokens_per_s:,.0f}"),
            ("peak memory (training)", mem(r.lmfuse), mem(r.plain)),
            ("decode tokens/s (paged)", f"{r.decode_tokens_per_s:,.0f}", "-")]
    w0 = max(len(a) for a, _, _ in rows)
    w1 = max(len(b) for _, b, _ in rows)
    lines = [f"{a:<{w0}}  {b:>{w1}}  {c:>13}" for a, b, c in rows]
    lines.append(f"max |loss difference| over {len(r.lmfuse.losses)} steps: "
                 f"{r.max_loss_diff:.2e} (relative {r.max_loss_rel_diff:.2e})")
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
    fig.savefig(path)
    plt.close(fig)
    return f"loss curves written to {path}"


def _flag(key: str) -> str:
    """A DemoConfig field's command-line option."""
    return "--prompt" if key == "prompts" else "--" + key.replace("_", "-")


def main(argv: Optional[list[str]] = None) -> int:
    from lmfuse.cli import ArgumentParser

    d = DemoConfig()
    parser = ArgumentParser(prog="lmfuse demo", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--steps", type=int, default=d.steps, help=f"training steps, >= 1 (default {d.steps})")
    add("--device", default="auto", help="auto (cuda if available), cpu, cuda or cuda:N")
    add("--dtype", choices=tuple(DTYPES), help="default fp32 on the CPU, bf16 on CUDA")
    add("--seed", type=int, default=d.seed, help=f"0 .. 2**63-1 (default {d.seed})")
    add("--impl", choices=("auto", "triton", "torch"), default="auto",
        help="the ops' path (default auto: Triton on CUDA, the PyTorch reference on the CPU; "
        "triton on the CPU needs TRITON_INTERPRET=1, Triton's slow interpreter)")
    add("--text", help="train on this file (default: lmfuse's own source)")
    add("--prompt", action="append", dest="prompts",
        help="a prompt to continue (repeatable; not empty)")
    add("--new-tokens", type=int, default=d.new_tokens,
        help=f"tokens generated per prompt, >= 1 (default {d.new_tokens})")
    add("--sample", action="store_true", help="temperature sampling instead of greedy decoding")
    add("--temperature", type=float, default=d.temperature,
        help=f"sampling temperature, > 0 (default {d.temperature})")
    add("--plot", help="draw both loss curves into this PNG (needs matplotlib: pip install "
        "'lmfuse[plot]')")
    for key, text in (("d_model", "model width"), ("n_layers", "layers"),
                      ("n_heads", "attention heads (d-model / n-heads must be even)"),
                      ("ffn", "MLP width"), ("seq_len", "tokens per training sequence"),
                      ("batch", "sequences per training step")):
        add(_flag(key), type=int, default=getattr(d, key),
            help=f"{text}, >= 1 (default {getattr(d, key)})")
    add("--lr", type=float, default=d.lr, help=f"learning rate, > 0 (default {d.lr})")
    add("--cpu-threads", type=int, default=d.cpu_threads,
        help=f"torch threads on the CPU (0: leave torch's default; default {d.cpu_threads})")
    args = parser.parse_args(argv)
    cfg = DemoConfig(**vars(args), log_every=max(1, args.steps // 10))
    try:
        check_config(cfg, _flag)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        result = run(cfg)
    except torch.OutOfMemoryError as exc:
        first = (str(exc).strip().splitlines() or ["out of memory"])[0]
        print(f"lmfuse demo: out of memory: {first}; try a smaller --batch, --seq-len or "
              "--d-model", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    # In fp16/bf16 the two paths round at different points, so a near-tie may pick another
    # token; only an fp32 mismatch is an error.
    return 0 if result.decode_logits_ok and (result.decode_matches or result.dtype != "fp32") \
        else 1


if __name__ == "__main__":
    raise SystemExit(main())
