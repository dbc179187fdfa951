"""Does the cache's row layout bound decode attention? Times ``lmfuse.decode_attention`` on
the usual ``[B, S, Hkv, D]`` cache (a key's KV heads adjacent, one head's row ``D``
elements long) and on the same bytes stored heads-major (``[B, Hkv, S, D]`` storage passed
as a ``[B, S, Hkv, D]`` view: each head's keys contiguous), bf16 and fp8.

    python bench/probe_decode_layout.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_attention import as_graph, to_fp8  # noqa: E402

import lmfuse  # noqa: E402

CASES = [(64, 4096, 8, 128, True), (16, 8192, 8, 128, True), (64, 4096, 8, 128, False),
         (16, 8192, 8, 64, False), (64, 4096, 8, 64, False)]  # B, S, Hkv, D, fp8


def cache(B: int, S: int, Hkv: int, D: int, fp8: bool, heads_major: bool, g: torch.Generator):
    """A ``[B, S, Hkv, D]`` view (and its fp8 scale or None)."""
    x = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    x = x.transpose(1, 2)  # [B, S, Hkv, D], heads-major storage
    if not heads_major:
        x = x.contiguous()
    if not fp8:
        return x, None
    x8, scale = to_fp8(x.contiguous())
    if heads_major:
        x8 = x8.transpose(1, 2).contiguous().transpose(1, 2)
    return x8, scale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_decode_layout: needs a CUDA device", file=sys.stderr)
        return 2
    rows = []
    for B, S, Hkv, D, fp8 in CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, 1, 4 * Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
        lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
        for layout in ("rows", "heads-major"):
            k, ks = cache(B, S, Hkv, D, fp8, layout != "rows", g)
            v, vs = cache(B, S, Hkv, D, fp8, layout != "rows", g)
            kw = dict(k_scale=ks, v_scale=vs) if fp8 else {}
            nbytes = 2 * k.numel() * k.element_size()
            ms = do_bench(as_graph(lambda k=k, v=v, kw=kw: lmfuse.decode_attention(
                q, k, v, lens, **kw)), warmup=25, rep=200, return_mode="median")
            row = dict(B=B, S=S, Hkv=Hkv, D=D, fp8=fp8, layout=layout, strides=list(k.stride()),
                       ms=ms, tbps=nbytes / ms / 1e9)
            rows.append(row)
            print(row, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
