"""Sweep fused_softmax launch configs on the GPU; prints ms per config (feeds tuning/*.json).

    python bench/sweep_softmax.py [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from triton.testing import do_bench

import lmfuse
from lmfuse import tuning


def _table_values(cfg: dict) -> dict:
    """The ``softmax`` table values under which the op launches ``cfg`` (its rows' width
    is ``BLOCK_N`` for a single tile): laid over the table, the op's own lookup runs it."""
    if cfg["SINGLE_BLOCK"]:
        return dict(max_single_block=cfg["BLOCK_N"], tile_elems=cfg["BLOCK_M"] * cfg["BLOCK_N"],
                    warps_by_block=[[cfg["BLOCK_N"], cfg["num_warps"]]])
    return dict(max_single_block=0, chunk_block=cfg["BLOCK_N"], chunk_warps=cfg["num_warps"])


def sweep(shape, causal, backward, configs):
    x = torch.randn(shape, dtype=torch.bfloat16, device="cuda", requires_grad=backward)
    g = torch.randn_like(x)
    out = []
    for cfg in configs:
        try:
            with tuning.overlay("softmax", _table_values(cfg)):
                if backward:
                    y = lmfuse.fused_softmax(x, scale=0.125, causal=causal)
                    fn = lambda: torch.autograd.grad(y, x, g, retain_graph=True)  # noqa: E731
                else:
                    fn = lambda: lmfuse.fused_softmax(x, scale=0.125, causal=causal)  # noqa: E731
                ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
        except Exception as exc:  # an infeasible config (registers, shared memory)
            ms = float("nan")
            print("  failed", cfg, type(exc).__name__)
        out.append({**cfg, "ms": ms})
        print(f"{str(shape):<24} causal={causal!s:<5} bwd={backward!s:<5} {cfg} {ms:.4f} ms",
              flush=True)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    args = p.parse_args()
    results = {}
    for shape in [(4, 32, 2048, 2048), (1, 16, 8192, 8192)]:
        sk = shape[-1]
        configs = [dict(BLOCK_M=m, BLOCK_N=sk, SINGLE_BLOCK=True, num_warps=w)
                   for m, w in itertools.product((1, 2, 4), (4, 8, 16))
                   if m * sk <= 16384]
        for causal, backward in [(True, False), (False, False), (True, True)]:
            key = f"{shape} causal={causal} bwd={backward}"
            results[key] = sweep(shape, causal, backward, configs)
    shape = (2, 8, 128, 65536)
    configs = [dict(BLOCK_M=1, BLOCK_N=n, SINGLE_BLOCK=False, num_warps=w)
               for n, w in itertools.product((2048, 4096, 8192), (4, 8, 16))]
    configs += [dict(BLOCK_M=1, BLOCK_N=65536, SINGLE_BLOCK=True, num_warps=w) for w in (16, 32)]
    results[f"{shape} plain"] = sweep(shape, False, False, configs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
