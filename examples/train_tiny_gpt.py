"""Train a tiny byte-level GPT whose every hot op is an lmfuse op.

    tokens -> embedding -> L x [x + attention(x); x + mlp(rmsnorm(x))] -> rmsnorm -> loss

    attention   lmfuse.rms_norm -> fused QKV projection -> rotary embedding
                -> q @ k.T -> lmfuse.fused_softmax(causal=True) -> @ v -> output projection
    mlp         lmfuse.rms_norm, then lmfuse.FusedMLP (SwiGLU by default: fc1, the fused
                activation, fc2)
    loss        lmfuse.linear_cross_entropy(hidden, head.weight, targets): the [tokens, 256]
                logits are never materialised; --materialise-logits computes them and calls
                lmfuse.cross_entropy instead. --z-loss and --label-smoothing go to either.

The model is ``lmfuse.tiny_gpt.TinyGPT`` (the one ``lmfuse demo`` trains; read it there),
built from a ``lmfuse.tiny_gpt.ModelConfig``. Its attention's parameters are named and laid out as
lmfuse.DecodeAttentionBlock's (``input_norm_weight``, ``qkv`` with q heads then k heads then
v heads, ``out``; no biases; rotate-half rotary embedding over the whole head, with the
block's frequencies), so decode_tiny_gpt.py loads the trained weights into that block with a
plain ``load_state_dict``. This script is the rest: data, training loop, checkpoints.

The text is lmfuse's own source code (or --text FILE), one token per byte: a model that
has learnt nothing scores ln 256 = 5.55 nats per byte.

    python examples/train_tiny_gpt.py --steps 300 --save tiny_gpt.pt
    python examples/train_tiny_gpt.py --steps 3 --d-model 32 --layers 1 --seq 32 --batch 2

On CUDA tensors the ops run their Triton kernels; on the CPU their PyTorch references
(``--impl`` forces either).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch

import lmfuse
from lmfuse.tiny_gpt import ModelConfig, TinyGPT, load_text

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# AdamW on float16 weights underflows (eps, squared gradients) and turns them to NaN.
FP16_TRAINING = ("--dtype fp16 cannot train here: float16 needs float32 master weights and "
                 "loss scaling, which this example leaves out; train in bf16 or fp32")


# --- data, training, checkpoints ---------------------------------------------------------------


def load_bytes(path: str | None = None) -> torch.Tensor:
    """The corpus as a 1-D int64 tensor of byte values: ``path``, or lmfuse's sources (as
    ``lmfuse demo`` reads them)."""
    return torch.frombuffer(bytearray(load_text(path)[0]), dtype=torch.uint8).long()


def random_batch(data: torch.Tensor, batch: int, seq: int,
                 gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random windows of ``seq + 1`` bytes, as (inputs, next-byte targets)."""
    starts = torch.randint(0, len(data) - seq, (batch,), generator=gen)
    windows = data[starts[:, None] + torch.arange(seq + 1)]
    return windows[:, :-1], windows[:, 1:]


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str | None, device: torch.device) -> torch.dtype:
    return DTYPES[name or ("bf16" if device.type == "cuda" else "fp32")]


def train(model: TinyGPT, data: torch.Tensor, *, steps: int, batch: int, seq: int,
          lr: float = 1e-2, seed: int = 0, materialise_logits: bool = False,
          z_loss: float = 0.0, label_smoothing: float = 0.0, log_every: int = 0,
          log=print) -> list[float]:
    """AdamW with a cosine schedule for ``steps`` steps on random windows of ``data``;
    returns every step's loss. Logs the first, the last and every ``log_every``-th."""
    if len(data) <= seq:
        raise ValueError(f"train: the corpus has {len(data)} bytes; need more than seq = {seq}")
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps)))
    gen = torch.Generator().manual_seed(seed)
    losses = []
    t_log, step_log = time.perf_counter(), 0
    for step in range(1, steps + 1):
        x, y = (t.to(device) for t in random_batch(data, batch, seq, gen))
        loss = model.loss(x, y, materialise_logits=materialise_logits, z_loss=z_loss,
                          label_smoothing=label_smoothing)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        schedule.step()
        losses.append(loss.detach())  # no host sync per step: read back when logging
        if step in (1, steps) or (log_every and step % log_every == 0):
            value = losses[-1].item()
            now = time.perf_counter()
            rate = (step - step_log) * batch * seq / (now - t_log)  # since the last line
            t_log, step_log = now, step
            log(f"step {step:5d}/{steps}  loss {value:.4f}  {rate:9,.0f} tok/s")
    return torch.stack(losses).float().tolist()


def save_checkpoint(model: TinyGPT, path: str) -> None:
    """The model's config and state dict (on the CPU), loadable with ``weights_only=True``."""
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    torch.save({"config": asdict(model.cfg), "model": state}, path)


def load_checkpoint(path: str, impl: str = "auto") -> TinyGPT:
    """A :class:`TinyGPT` with the weights :func:`save_checkpoint` wrote (on the CPU, in the
    dtype they were saved in)."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    model = TinyGPT(ModelConfig(**ckpt["config"]), impl=impl)
    model.to(next(iter(ckpt["model"].values())).dtype)
    model.load_state_dict(ckpt["model"])
    return model


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """Model-size and training flags (shared with decode_tiny_gpt.py)."""
    d = ModelConfig()
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    parser.add_argument("--dtype", choices=tuple(DTYPES),
                        help="default bf16 on CUDA, fp32 on the CPU (fp16: decoding only)")
    parser.add_argument("--impl", choices=("auto", "triton", "torch"), default="auto")
    parser.add_argument("--d-model", type=int, default=d.d_model)
    parser.add_argument("--layers", type=int, default=d.n_layers)
    parser.add_argument("--heads", type=int, default=d.n_heads)
    parser.add_argument("--ffn", type=int, help="MLP width (default 3 * d_model)")
    parser.add_argument("--activation", default=d.activation,
                        choices=("swiglu", "geglu", "quick_geglu", "gelu", "squared_relu"))
    parser.add_argument("--seq", type=int, default=64, help="tokens per training sequence")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--text", help="train on this file (default: lmfuse's own source)")


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace, *,
               model: bool = True) -> tuple[torch.device, torch.dtype]:
    """The shared flags' values, each refused by ``parser.error`` (one line, exit 2) when it
    cannot run, before any work: the device and the path, and with ``model`` the sizes and
    the training flags. Returns the device and dtype."""
    try:
        device = pick_device(args.device)
    except (RuntimeError, ValueError):
        parser.error(f"--device must be auto, cpu, cuda or cuda:N, got {args.device!r}")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device must be auto, cpu, cuda or cuda:N, got {args.device!r}")
    if device.type == "cuda" and (not torch.cuda.is_available()
                                  or (device.index or 0) >= torch.cuda.device_count()):
        parser.error(f"--device {args.device}: no such CUDA device here; use cpu or auto")
    try:  # (refuses impl="triton" where Triton cannot run, naming why)
        lmfuse.explain(lmfuse.swiglu, torch.zeros(1, 2, device=device), impl=args.impl)
    except (TypeError, ValueError, RuntimeError) as exc:
        parser.error(f"--impl {args.impl}: {exc}")
    if not model:
        return device, pick_dtype(args.dtype, device)
    for flag, value in (("--d-model", args.d_model), ("--layers", args.layers),
                        ("--heads", args.heads), ("--seq", args.seq), ("--batch", args.batch)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if args.ffn is not None and args.ffn < 1:
        parser.error(f"--ffn must be >= 1, got {args.ffn}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        parser.error(f"--lr must be a finite number > 0, got {args.lr}")
    try:
        TinyGPT(model_config(args), impl="torch")
    except ValueError as exc:
        parser.error(str(exc).replace("TinyGPT: d_model", "--d-model").replace(
            "n_heads", "--heads"))
    try:
        data = load_bytes(args.text)
    except OSError as exc:
        parser.error(f"--text {args.text}: cannot read it: {exc.strerror or exc}")
    if len(data) <= args.seq + 1:
        parser.error(f"--seq {args.seq} needs a text of more than {args.seq + 1} bytes; it has "
                     f"{len(data):,}")
    return device, pick_dtype(args.dtype, device)


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(d_model=args.d_model, n_heads=args.heads, n_layers=args.layers,
                       ffn=args.ffn or 3 * args.d_model, activation=args.activation)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    add_model_args(parser)
    parser.add_argument("--materialise-logits", action="store_true",
                        help="head(hidden) then lmfuse.cross_entropy, instead of "
                             "lmfuse.linear_cross_entropy")
    parser.add_argument("--z-loss", type=float, default=0.0,
                        help="add z_loss * logsumexp(logits) ** 2 per token (e.g. 1e-4)")
    parser.add_argument("--label-smoothing", type=float, default=0.0)
    parser.add_argument("--log-every", type=int, help="default steps / 10")
    parser.add_argument("--save", metavar="PATH", help="write the config and state dict here")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.dtype == "fp16":
        parser.error(FP16_TRAINING)
    if not (math.isfinite(args.z_loss) and args.z_loss >= 0):
        parser.error(f"--z-loss must be a finite number >= 0, got {args.z_loss}")
    if not 0 <= args.label_smoothing < 1:
        parser.error(f"--label-smoothing must be in [0, 1), got {args.label_smoothing}")
    if args.log_every is not None and args.log_every < 1:
        parser.error(f"--log-every must be >= 1, got {args.log_every}")
    if args.save and not Path(args.save).resolve().parent.is_dir():
        parser.error(f"--save {args.save}: no directory to write it into")

    device, dtype = check_args(parser, args)
    torch.manual_seed(args.seed)
    model = TinyGPT(model_config(args), impl=args.impl).to(device=device, dtype=dtype)
    data = load_bytes(args.text)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tiny GPT: {model.cfg}, {n_params:,} parameters, on {device} ({dtype})")
    print(f"corpus: {len(data):,} bytes; loss of a uniform guess: ln 256 = {math.log(256):.3f}")
    plan = lmfuse.explain(lmfuse.fused_softmax, torch.zeros(1, 1, 2, 2, device=device),
                          causal=True, impl=args.impl)
    print(str(plan).splitlines()[0])

    losses = train(model, data, steps=args.steps, batch=args.batch, seq=args.seq, lr=args.lr,
                   seed=args.seed, materialise_logits=args.materialise_logits,
                   z_loss=args.z_loss, label_smoothing=args.label_smoothing,
                   log_every=args.log_every or max(1, args.steps // 10))
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {args.steps} steps")
    bad = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
    if bad is not None:
        print(f"FAILED: the loss is {losses[bad]} from step {bad + 1} on (try a lower --lr)"
              + ("; nothing saved" if args.save else ""))
        return 1
    if args.save:
        save_checkpoint(model, args.save)
        print(f"saved to {args.save}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
