"""The default CPU path (no Triton) against the plain PyTorch formulas it replaces: forward +
backward, float32, 2 threads, at the demo's sizes and 10x them (medians of 21 rounds, the
two sides taking turns; swiglu's plain formula splits with ``chunk``, whose backward is one
concatenation, as the demo's plain MLP does; layer_norm's is ``F.layer_norm`` itself, which
lmfuse's CPU path calls too; apply_rotary_pos_emb's is transformers' Llama formula, ``x * cos
+ rotate_half(x) * sin``, on q and k made as transformers makes them: the demo's 4 heads of
16, ``[B, S, H, D]`` transposed). Then the host time of a forward call on tiny inputs (no
gradient: what each call costs beyond PyTorch's own op), and one training step of the
demo's CPU model (``lmfuse.tiny_gpt.TinyGPT``, its defaults, 1 thread) against the plain
model, the two taking turns::

    python bench/cpu_path.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

import lmfuse


def bench_pair(ours: Callable[[], object], plain: Callable[[], object], n: int,
               rounds: int = 21) -> tuple[float, float]:
    """(lmfuse ms, plain ms): the medians over ``rounds`` rounds of ``n`` calls, the two
    sides taking turns round by round (a shared CPU's drift hits both alike)."""
    for _ in range(5):
        ours()
        plain()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for fn, out in zip((ours, plain), times):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            out.append((time.perf_counter() - t0) / n * 1e3)
    return statistics.median(times[0]), statistics.median(times[1])


def rows_at(k: int) -> list[tuple[str, list[int], Callable, Callable]]:
    x = torch.randn(512 * k, 256 * k, requires_grad=True)
    t = torch.randint(0, x.shape[1], (x.shape[0],))
    sq = 64 * k
    s = torch.randn(8, 4, sq, sq, requires_grad=True)
    dy = torch.randn(8, 4, sq, sq)
    hidden = torch.triu(torch.ones(sq, sq, dtype=torch.bool), 1)
    a = torch.randn(512 * k, 768, requires_grad=True)
    da = torch.randn(512 * k, 384)
    r = torch.randn(512 * k, 64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    bias = torch.randn(64, requires_grad=True)
    dr = torch.randn(512 * k, 64)

    qr, kr = (torch.randn(8, 64 * k, 4, 16).transpose(1, 2).requires_grad_(True)
              for _ in range(2))
    angle = torch.rand(8, 64 * k, 8)
    cos, sin = torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()
    dq, dk = torch.randn(8, 4, 64 * k, 16), torch.randn(8, 4, 64 * k, 16)

    def plain_norm() -> None:
        (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-6) * w).backward(dr)

    def plain_softmax() -> None:
        torch.softmax((s * 0.125).masked_fill(hidden, float("-inf")), -1).backward(dy)

    return [
        ("cross_entropy", list(x.shape), lambda: lmfuse.cross_entropy(x, t).backward(),
         lambda: F.cross_entropy(x, t).backward()),
        ("fused_softmax causal", list(s.shape),
         lambda: lmfuse.fused_softmax(s, scale=0.125, causal=True).backward(dy), plain_softmax),
        ("swiglu", list(a.shape), lambda: lmfuse.swiglu(a).backward(da),
         lambda: (lambda h: F.silu(h[0]) * h[1])(a.chunk(2, -1)).backward(da)),
        ("rms_norm", list(r.shape), lambda: lmfuse.rms_norm(r, w).backward(dr), plain_norm),
        ("layer_norm", list(r.shape), lambda: lmfuse.layer_norm(r, w, bias).backward(dr),
         lambda: F.layer_norm(r, (64,), w, bias, 1e-5).backward(dr)),
        ("apply_rotary_pos_emb", list(qr.shape),
         lambda: torch.autograd.backward(lmfuse.apply_rotary_pos_emb(qr, kr, cos, sin),
                                         (dq, dk)),
         lambda: torch.autograd.backward(formula_rotary(qr, kr, cos, sin), (dq, dk))),
    ]


def formula_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Llama ``apply_rotary_pos_emb`` (``unsqueeze_dim=1``), written out."""
    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), -1)

    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


def host_rows() -> list[tuple[str, list[int], Callable, Callable]]:
    """Forward calls on tiny tensors under no_grad: lmfuse's checks and path choice over
    the plain op's own cost."""
    x, t = torch.randn(8, 16), torch.randint(0, 16, (8,))
    s = torch.randn(1, 1, 8, 8)
    hidden = torch.triu(torch.ones(8, 8, dtype=torch.bool), 1)
    a, r, w, bias = torch.randn(8, 32), torch.randn(8, 16), torch.randn(16), torch.randn(16)
    h, W = torch.randn(16, 8), torch.randn(32, 8)
    qr, kr = torch.randn(1, 8, 2, 16).transpose(1, 2), torch.randn(1, 8, 2, 16).transpose(1, 2)
    cos, sin = torch.randn(1, 8, 16), torch.randn(1, 8, 16)
    return [
        ("cross_entropy (host)", list(x.shape), lambda: lmfuse.cross_entropy(x, t),
         lambda: F.cross_entropy(x, t)),
        ("fused_softmax (host)", list(s.shape),
         lambda: lmfuse.fused_softmax(s, scale=0.125, causal=True),
         lambda: torch.softmax((s * 0.125).masked_fill(hidden, float("-inf")), -1)),
        ("swiglu (host)", list(a.shape), lambda: lmfuse.swiglu(a),
         lambda: (lambda u: F.silu(u[0]) * u[1])(a.chunk(2, -1))),
        ("rms_norm (host)", list(r.shape), lambda: lmfuse.rms_norm(r, w),
         lambda: F.rms_norm(r, (16,), w, 1e-6)),
        ("layer_norm (host)", list(r.shape), lambda: lmfuse.layer_norm(r, w, bias),
         lambda: F.layer_norm(r, (16,), w, bias, 1e-5)),
        ("linear_cross_entropy (host)", [*h.shape, W.shape[0]],
         lambda: lmfuse.linear_cross_entropy(h, W, t.repeat(2)),
         lambda: F.cross_entropy(F.linear(h, W), t.repeat(2))),
        ("apply_rotary_pos_emb (host)", list(qr.shape),
         lambda: lmfuse.apply_rotary_pos_emb(qr, kr, cos, sin),
         lambda: formula_rotary(qr, kr, cos, sin)),
    ]


def demo_step_row() -> tuple[str, list[int], Callable, Callable]:
    """One training step (loss + backward) of the demo's CPU model, fused and plain, from
    the same weights."""
    from lmfuse.demo import DEFAULTS
    from lmfuse.tiny_gpt import ModelConfig, TinyGPT

    d = DEFAULTS["cpu"]
    cfg = ModelConfig(d_model=d.d_model, n_layers=d.n_layers, n_heads=d.n_heads, ffn=d.ffn)
    tok = torch.randint(0, 256, (d.batch, d.seq_len))
    fused, plain = TinyGPT(cfg, True), TinyGPT(cfg, False)
    plain.load_state_dict(fused.state_dict())
    return ("demo training step", [d.batch, d.seq_len],
            lambda: fused.loss(tok, tok).backward(), lambda: plain.loss(tok, tok).backward())


def cpu_model() -> str:
    """The processor's name as Linux reports it (``platform.processor()`` elsewhere): the
    ratios move with it, so each result file says which CPU it ran on."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    out = []
    for k in (1, 10):
        n = 50 if k == 1 else 3
        for op, shape, ours, plain in rows_at(k):
            a, b = bench_pair(ours, plain, n)
            out.append(dict(op=op, shape=shape, lmfuse_ms=a, plain_ms=b, ratio=a / b))
            print(f"{op:22s} {str(shape):22s} lmfuse {a:8.3f} ms  plain {b:8.3f} ms  x{a / b:.2f}")
    with torch.no_grad():
        for op, shape, ours, plain in host_rows():
            a, b = bench_pair(ours, plain, 2000)
            out.append(dict(op=op, shape=shape, lmfuse_ms=a, plain_ms=b, ratio=a / b))
            print(f"{op:28s} {str(shape):12s} lmfuse {a * 1e3:6.1f} us  plain {b * 1e3:6.1f} us"
                  f"  +{(a - b) * 1e3:.1f} us")
    torch.set_num_threads(1)
    op, shape, ours, plain = demo_step_row()
    a, b = bench_pair(ours, plain, 10, rounds=31)
    out.append(dict(op=op, shape=shape, lmfuse_ms=a, plain_ms=b, ratio=a / b, threads=1))
    print(f"{op:22s} {str(shape):22s} lmfuse {a:8.3f} ms  plain {b:8.3f} ms  x{a / b:.2f}")
    if args.json:
        env = dict(device="cpu (2 threads)", cpu=cpu_model(), torch=torch.__version__,
                   lmfuse=lmfuse.__version__, date=time.strftime("%Y-%m-%d"),
                   command=" ".join(["python"] + getattr(sys, "orig_argv", sys.argv)[1:]))
        with open(args.json, "w") as f:
            json.dump(dict(env=env, rows=out), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
