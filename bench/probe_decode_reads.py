"""How fast can a decode step stream a KV cache at all? Reads a ``[B, S, Hkv, D]`` cache
with programs that each walk ``heads`` adjacent KV heads over all keys (``heads * D``
elements contiguous per key, the rows ``Hkv * D`` apart), as decode attention's programs
do, doing nothing but summing: the rate a decode kernel of that layout can reach.

    python bench/probe_decode_reads.py [--json PATH]

Prints ms and TB/s per (dtype, D, heads, key tile, stages) next to a 512 MiB device copy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench


@triton.jit
def stream_kernel(X, OUT, S, stride_b, stride_row, groups, BLOCK_N: tl.constexpr,
                  WIDTH: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // groups
    base = X + b.to(tl.int64) * stride_b + (pid % groups) * WIDTH
    c = tl.arange(0, WIDTH)
    acc = tl.zeros([BLOCK_N, WIDTH], tl.float32)
    for n0 in tl.range(0, S, BLOCK_N, num_stages=STAGES):
        r = n0 + tl.arange(0, BLOCK_N)
        x = tl.load(base + r.to(tl.int64)[:, None] * stride_row + c[None, :],
                    mask=(r < S)[:, None], other=0.0)
        acc += x.to(tl.float32)
    tl.store(OUT + pid, tl.sum(tl.sum(acc, 1), 0))


def time_stream(x: torch.Tensor, heads: int, block_n: int, stages: int) -> float:
    B, S, Hkv, D = x.shape
    out = torch.empty(B * Hkv // heads, device=x.device)

    def run() -> None:
        stream_kernel[(B * Hkv // heads,)](x, out, S, x.stride(0), x.stride(1), Hkv // heads,
                                           BLOCK_N=block_n, WIDTH=heads * D, STAGES=stages,
                                           num_warps=4)

    return do_bench(run, rep=200, return_mode="median")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_decode_reads: needs a CUDA device", file=sys.stderr)
        return 2
    a = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    copy_ms = do_bench(lambda: b.copy_(a), rep=200, return_mode="median")
    copy_tbps = 2 * a.numel() / copy_ms / 1e9
    print(f"copy of 512 MiB: {copy_tbps:.2f} TB/s")
    rows = []
    for dtype, D in ((torch.float8_e4m3fn, 128), (torch.bfloat16, 128), (torch.bfloat16, 64)):
        B, S, Hkv = 64, 4096, 8
        x = torch.randn(B, S, Hkv, D, device="cuda").to(dtype)
        nbytes = x.numel() * x.element_size()
        for heads in (1, 2, 4, 8):
            for block_n, stages in ((64, 3), (128, 3), (32, 4)):
                if block_n * heads * D * x.element_size() > 64 * 1024:
                    continue
                ms = time_stream(x, heads, block_n, stages)
                row = dict(dtype=str(dtype), D=D, heads=heads,
                           bytes_per_key=heads * D * x.element_size(), BN=block_n,
                           stages=stages, ms=ms, tbps=nbytes / ms / 1e9,
                           x_copy=nbytes / ms / 1e9 / copy_tbps)
                rows.append(row)
                print(row, flush=True)
        del x
    if args.json:
        Path(args.json).write_text(json.dumps(dict(copy_tbps=copy_tbps, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
