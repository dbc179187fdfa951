"""Decode attention over short paged contexts (the Generator's decode step of the ``lmfuse
bench generate`` model: 16 query / 4 KV heads of 128, block_len 16, 512-640 cached tokens,
tables 64 blocks wide) at each forced split count against the chosen one, bf16::

    python bench/probe_decode_splits.py
"""

from __future__ import annotations

import torch
import triton.testing

import lmfuse


def main() -> int:
    dev = "cuda"
    Hq, Hkv, D, bl, width = 16, 4, 128, 16, 64
    for B in (1, 16, 64):
        g = torch.Generator(device=dev).manual_seed(B)
        nb = B * width
        kc = torch.randn(nb, bl, Hkv, D, device=dev, generator=g).bfloat16()
        vc = torch.randn(nb, bl, Hkv, D, device=dev, generator=g).bfloat16()
        table = torch.randperm(nb, device=dev, generator=g).int().view(B, width)
        lens = torch.randint(512, 641, (B,), device=dev, generator=g).int()
        q = torch.randn(B, 1, Hq, D, device=dev, generator=g).bfloat16()
        mb = int(lens.sum()) * Hkv * D * 2 * 2 / 1e6
        for splits in (None, 1, 2, 3, 4, 6, 8, 16):
            def f(splits=splits):
                return lmfuse.decode_attention(q, kc, vc, lens, block_table=table,
                                               num_splits=splits)
            t = triton.testing.do_bench_cudagraph(f, rep=50)
            print(f"B{B} splits {splits}: {t * 1e3:.1f} us, {mb / t / 1e3:.2f} TB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
