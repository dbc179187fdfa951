"""Decode attention over short paged contexts (the Generator's decode step of the ``lmfuse
bench generate`` model: 16 query / 4 KV heads of 128, block_len 16, 512-640 cached tokens,
tables 64 blocks wide, bf16) at each key tile, pipeline depth, warp count and split count,
CUDA-graph replays::

    python bench/probe_decode_tiles.py [--batches 1,16,64]

Prints one line per case (us, TB/s of the K/V bytes read) and, per batch, the fastest and
the configuration the tables choose now.
"""

from __future__ import annotations

import argparse
import copy

import torch
import triton.testing

import lmfuse
from lmfuse import tuning

_table = tuning.table
FORCE: dict = {}


def _forced(family, device):
    t = _table(family, device)
    if family == "decode_attention" and FORCE:
        t = copy.deepcopy(t)
        tile = [[128, FORCE["bn"], FORCE["st"], FORCE["w"]], [1048576, 16]]
        t.setdefault("paged", {})["block_n_by_head_dim"] = tile
        t["paged"].setdefault("few_programs", {})["block_n_by_head_dim"] = tile
    return t


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,16,64")
    a = p.parse_args()
    tuning.table = _forced
    dev = "cuda"
    Hq, Hkv, D, bl, width = 16, 4, 128, 16, 64
    for B in [int(x) for x in a.batches.split(",")]:
        g = torch.Generator(device=dev).manual_seed(B)
        nb = B * width
        kc = torch.randn(nb, bl, Hkv, D, device=dev, generator=g).bfloat16()
        vc = torch.randn(nb, bl, Hkv, D, device=dev, generator=g).bfloat16()
        table = torch.randperm(nb, device=dev, generator=g).int().view(B, width)
        lens = torch.randint(512, 641, (B,), device=dev, generator=g).int()
        q = torch.randn(B, 1, Hq, D, device=dev, generator=g).bfloat16()
        mb = int(lens.sum()) * Hkv * D * 2 * 2 / 1e6
        want = lmfuse.decode_attention(q, kc, vc, lens, block_table=table, impl="torch")
        results = []

        def run(label, splits):
            def f():
                return lmfuse.decode_attention(q, kc, vc, lens, block_table=table,
                                               num_splits=splits)
            err = (f().float() - want.float()).abs().max().item()
            t = triton.testing.do_bench_cudagraph(f, rep=30)
            results.append((t, label))
            print(f"B{B} {label}: {t * 1e3:.1f} us, {mb / t / 1e3:.2f} TB/s, err {err:.1e}",
                  flush=True)

        FORCE.clear()
        run("chosen now", None)
        for bn in (32, 64, 128):
            for st in (2, 3, 4):
                for w in (2, 4, 8):
                    FORCE.update(bn=bn, st=st, w=w)
                    for splits in (None, 1, 2, 4, 8):
                        try:
                            run(f"bn {bn} st {st} w {w} splits {splits}", splits)
                        except Exception as e:  # out of shared memory, say
                            print(f"B{B} bn {bn} st {st} w {w}: {type(e).__name__}")
                            break
        FORCE.clear()
        best = sorted(results)[:5]
        print(f"B{B} best: " + "; ".join(f"{lab} {t * 1e3:.1f} us" for t, lab in best))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
