"""Sweep the activations' launch configs on the GPU; prints ms per config (feeds
tuning/*.json's ``activations`` section).

    python bench/sweep_activations.py [--json PATH]

For bias-SwiGLU and bias-GEGLU on bf16 ``x [16384, 2 * 14336]`` it times the forward under
each forward candidate (``fwd_tile`` elements per program, ``fwd_max_block_n`` columns at
most, ``fwd_warps``) and forward+backward under each backward candidate (``bwd_tile``,
``bwd_max_block_n``, ``bwd_warps``, ``bwd_programs_per_sm``) with the table's forward,
each laid over the table (``lmfuse.tuning.overlay``) as a JSON file would. Each candidate's
output and x's gradient must equal the table's bitwise (the configs only re-tile elementwise
math); the bias gradient, whose float32 partials follow the row grouping, within 1e-2
(bf16).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from triton.testing import do_bench

import lmfuse
from lmfuse import tuning

FWD = [(4096, 1024, 8), (4096, 1024, 4), (8192, 1024, 8), (8192, 2048, 8), (2048, 1024, 4),
       (16384, 2048, 16), (8192, 1024, 16), (2048, 512, 4), (512, 512, 4), (1024, 1024, 4),
       (2048, 2048, 8), (4096, 4096, 8), (1024, 512, 4)]
BWD = [(2048, 512, 4, 8), (4096, 512, 8, 8), (4096, 1024, 8, 4), (2048, 1024, 4, 8),
       (4096, 1024, 4, 8), (8192, 1024, 8, 4), (2048, 512, 4, 16), (1024, 512, 4, 16),
       (1024, 256, 2, 16)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_activations: needs a CUDA device", file=sys.stderr)
        return 2
    base = tuning.table("activations", torch.device("cuda"))
    M, f = 16384, 14336
    x = torch.randn(M, 2 * f, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(2 * f, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(M, f, device="cuda", dtype=torch.bfloat16)
    out = {"device": torch.cuda.get_device_name(), "base": base, "fwd": [], "bwd": []}
    for name, fn in (("swiglu", lmfuse.swiglu), ("geglu", lmfuse.geglu)):
        with torch.no_grad():
            ref = fn(x, b)
        for tile, max_n, warps in FWD:
            with tuning.overlay("activations", dict(fwd_tile=tile, fwd_max_block_n=max_n,
                                                    fwd_warps=warps)), torch.no_grad():
                ok = torch.equal(fn(x, b), ref)
                ms = do_bench(lambda: fn(x, b), warmup=25, rep=100, return_mode="median")
            out["fwd"].append(dict(op=name, tile=tile, max_n=max_n, warps=warps, ms=ms, ok=ok))
            print(f"{name} fwd tile={tile} max_n={max_n} warps={warps}: {ms:.4f} ms"
                  f"{'' if ok else ' WRONG'}", flush=True)
        rx, rb = torch.autograd.grad(fn(x, b), (x, b), g)
        for tile, max_n, warps, per_sm in BWD:
            with tuning.overlay("activations", dict(bwd_tile=tile, bwd_max_block_n=max_n,
                                                    bwd_warps=warps,
                                                    bwd_programs_per_sm=per_sm)):
                dx, db = torch.autograd.grad(fn(x, b), (x, b), g)
                ok = torch.equal(dx, rx) and torch.allclose(db.float(), rb.float(), rtol=1e-2,
                                                            atol=1e-2)
                ms = do_bench(lambda: torch.autograd.grad(fn(x, b), (x, b), g), warmup=25,
                              rep=100, return_mode="median")
            out["bwd"].append(dict(op=name, tile=tile, max_n=max_n, warps=warps,
                                   per_sm=per_sm, ms=ms, ok=ok))
            print(f"{name} fwd+bwd tile={tile} max_n={max_n} warps={warps} per_sm={per_sm}: "
                  f"{ms:.4f} ms{'' if ok else ' WRONG'}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
