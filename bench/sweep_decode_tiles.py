"""Decode attention over short paged contexts (the Generator's decode step of the ``lmfuse
bench generate`` model: 16 query / 4 KV heads of 128, block_len 16, 512-640 cached tokens,
tables 64 blocks wide, bf16) at each key tile, pipeline depth, warp count and split count,
CUDA-graph replays::

    python bench/sweep_decode_tiles.py [--batches 1,16,64] [--context 576] [--fp8]

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
        for section in ("paged", "fp8_paged"):
            t.setdefault(section, {})["block_n_by_head_dim"] = tile
            t[section]["short_context"] = None
            t[section].setdefault("few_programs", {})["block_n_by_head_dim"] = tile
    return t


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--context", type=int, default=576, help="mean cached tokens (576)")
    p.add_argument("--fp8", action="store_true", help="an e4m3 cache with per-head scales")
    p.add_argument("--splits", default="None,1,2,4,8")
    a = p.parse_args()
    split_list = [None if v == "None" else int(v) for v in a.splits.split(",")]
    tuning.table = _forced
    dev = "cuda"
    Hq, Hkv, D, bl = 16, 4, 128, 16
    width = 1 << ((a.context + 64) // bl - 1).bit_length()  # the Generator's table width
    for B in [int(x) for x in a.batches.split(",")]:
        g = torch.Generator(device=dev).manual_seed(B)
        nb = B * width
        kc = torch.randn(nb, bl, Hkv, D, device=dev, generator=g).bfloat16()
        vc = torch.randn(nb, bl, Hkv, D, device=dev, generator=g).bfloat16()
        table = torch.randperm(nb, device=dev, generator=g).int().view(B, width)
        lens = torch.randint(a.context - 64, a.context + 65, (B,), device=dev,
                             generator=g).int()
        q = torch.randn(B, 1, Hq, D, device=dev, generator=g).bfloat16()
        scales = {}
        if a.fp8:
            ks = torch.rand(Hkv, device=dev, generator=g) / 100 + 0.02
            vs = torch.rand(Hkv, device=dev, generator=g) / 100 + 0.02
            kc = (kc.float() / ks[:, None]).to(torch.float8_e4m3fn)
            vc = (vc.float() / vs[:, None]).to(torch.float8_e4m3fn)
            scales = dict(k_scale=ks, v_scale=vs)
        mb = int(lens.sum()) * Hkv * D * 2 * kc.element_size() / 1e6
        want = lmfuse.decode_attention(q, kc, vc, lens, block_table=table, impl="torch",
                                       **scales)
        results = []

        def run(label, splits):
            def f():
                return lmfuse.decode_attention(q, kc, vc, lens, block_table=table,
                                               num_splits=splits, **scales)
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
                    for splits in split_list:
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
