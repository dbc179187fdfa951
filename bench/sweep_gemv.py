"""The fused decode layers' GEMV kernel against cuBLAS on the decode shapes of the
``lmfuse bench generate`` model (hidden 2048, FFN 8192, 16/4 heads of 128, vocabulary
128256 for ``--shapes lm_head``), bf16, over its
launch options (times of CUDA-graph replays): the best per shape and row count, and
cuBLAS's time for the same work (three / two launches where the kernel takes three / two
matrices)::

    python bench/sweep_gemv.py [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton.testing

from lmfuse.serving.fused_ops import split_buffers
from lmfuse.serving.kernels import gemv_kernel


# The ``lmfuse bench generate`` model's decode GEMVs: name -> (the matrices' [N, K], gated,
# with the residual add). Also what ``sweep_gemv_chain.py`` chains.
H, FF, HQ, HKV, D, VOCAB = 2048, 8192, 16, 4, 128, 128256
SHAPES = {"qkv": ([(HQ * D, H), (HKV * D, H), (HKV * D, H)], False, False),
          "o": ([(H, HQ * D)], False, True),
          "gate_up": ([(FF, H), (FF, H)], True, False),
          "down": ([(H, FF)], False, True),
          "lm_head": ([(VOCAB, H)], False, False)}


def dot_rows(n: int) -> int:
    """The dot path's row tile for ``n`` rows (BLOCK_M: 16, 32 or 64)."""
    return 16 if n <= 16 else 32 if n <= 32 else 64


def fits(bm: int, bn: int, bk: int, stages: int, gated: bool) -> bool:
    """Whether a launch's pipelined tiles fit 220 KiB of shared memory (bf16)."""
    return (bm + (2 if gated else 1) * bn) * bk * 2 * stages <= 220 * 1024


def weights(dims, g: torch.Generator) -> list[torch.Tensor]:
    """Random bf16 matrices of these ``[N, K]`` shapes, scaled by ``K ** -0.5``."""
    return [(torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
            for n, k in dims]


def reference(x, ws, gated: bool) -> torch.Tensor:
    """The GEMV's output in float32 (without the residual)."""
    if gated:
        return F.silu(x.float() @ ws[0].float().t()) * (x.float() @ ws[1].float().t())
    return torch.cat([x.float() @ w.float().t() for w in ws], -1)


def launch(x, ws, y, r, gated, bn, bk, warps, stages, bm=None, split=1):
    """``gemv_kernel`` with these options; ``split``: programs per tile along K."""
    n, K = x.shape
    ns = [w.shape[0] for w in ws]
    n_out = ns[0] if gated else sum(ns)
    w = list(ws) + [ws[0]] * (3 - len(ws))
    bm = bm or dot_rows(n)
    k_split = -(-(-(-K // split)) // bk) * bk
    split = -(-K // k_split)
    grid = (n_out // bn, -(-n // bm), split)
    tiles = grid[0] * grid[1]
    wsp, count = (split_buffers(x.device, split * tiles * bm * bn, tiles) if split > 1
                  else (y, y))
    gemv_kernel[grid](
        x, w[0], w[1], w[2], w[0], w[0], w[0], y if r is None else r, y, n, K, ns[0],
        ns[1] if len(ns) > 1 else 0, x.stride(0), y.stride(0), y.stride(0), wsp, count,
        k_split, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, HAS_BIAS=False, RESIDUAL=r is not None,
        GATED=gated, EVEN_K=K % bk == 0, SPLIT_K=split, num_warps=warps, num_stages=stages)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down",
                    help="of qkv, o, gate_up, down, lm_head (vocabulary 128256)")
    a = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name in a.shapes.split(","):
        dims, gated, residual = SHAPES[name]
        ws = weights(dims, g)
        K = ws[0].shape[1]
        nbytes = sum(w.numel() * w.element_size() for w in ws)
        for n in (int(v) for v in a.rows.split(",")):
            x = torch.randn(n, K, device=dev, generator=g).to(dt)
            n_out = ws[0].shape[0] if gated else sum(w.shape[0] for w in ws)
            y = torch.empty(n, n_out, device=dev, dtype=dt)
            r = torch.randn(n, n_out, device=dev, dtype=dt) if residual else None

            def blas():
                if gated:
                    return F.silu(F.linear(x, ws[0])) * F.linear(x, ws[1])
                if residual:
                    return torch.addmm(r, x, ws[0].t())
                return [F.linear(x, w) for w in ws]

            want = reference(x, ws, gated)
            if residual:
                want = want + r.float()
            t_blas = triton.testing.do_bench_cudagraph(blas, rep=50)
            best = None
            for bn, bk, warps, stages in itertools.product((16, 32, 64, 128), (128, 256, 512),
                                                           (4, 8), (3, 4, 6)):
                if not fits(dot_rows(n), bn, bk, stages, gated):
                    continue
                try:
                    rr = None if r is None else r.clone()
                    launch(x, ws, y if rr is None else rr, rr, gated, bn, bk, warps, stages)
                    out = y if rr is None else rr
                    err = ((out.float() - want).abs().max() / want.abs().max()).item()
                    t = triton.testing.do_bench_cudagraph(
                        lambda: launch(x, ws, y if rr is None else rr, rr, gated, bn, bk,
                                       warps, stages), rep=50)
                except Exception as e:  # noqa: BLE001
                    print(name, n, bn, bk, warps, stages, "failed", type(e).__name__, e)
                    continue
                if best is None or t < best[0]:
                    best = (t, bn, bk, warps, stages, err)
            row = {"shape": name, "rows": n, "MB": nbytes / 1e6, "cublas_us": t_blas * 1e3,
                   "best_us": best[0] * 1e3, "block_n": best[1], "block_k": best[2],
                   "warps": best[3], "stages": best[4], "rel_err": best[5],
                   "best_TBps": nbytes / best[0] / 1e9, "cublas_TBps": nbytes / t_blas / 1e9}
            rows.append(row)
            print(json.dumps(row))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
