"""Sweep fused_softmax launch configs on the GPU; prints ms per config (feeds tuning/*.json).

    python bench/sweep_softmax.py [--json PATH]
    python bench/sweep_softmax.py --long-rows [--json PATH]

``--long-rows``: candidate ``long_rows`` entries for streamed rows of 32768 keys or more
(forward chunks and warps, the backward's, the L2 hints), each laid over the device's table
and timed in CUDA graphs on the shapes below, forward and backward apart; prints the entry
with the least summed time (forward's and backward's choices made independently) for the
device's table, against the table without one.
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
                    warps_by_block=[[cfg["BLOCK_N"], cfg["num_warps"]]], long_rows=None)
    # (no long_rows entry: a device table's would lay its chunks over these)
    return dict(max_single_block=0, chunk_block=cfg["BLOCK_N"], chunk_warps=cfg["num_warps"],
                long_rows=None)


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


LONG_SHAPES = [((2, 8, 128, 65536), False), ((2, 8, 128, 65536), True),
               ((4, 8, 64, 32768), False), ((4, 8, 64, 32768), True),
               ((1, 4, 32, 131072), False)]
LONG_FWD = [(4096, 8), (8192, 8), (8192, 16), (16384, 16), (16384, 32), (32768, 32)]
LONG_BWD = [(4096, 8), (8192, 16), (16384, 16), (16384, 32), (32768, 32)]


def sweep_long_rows() -> dict:
    """Forward and backward times (ms, CUDA graphs) of every candidate on LONG_SHAPES."""
    from triton.testing import do_bench_cudagraph

    from lmfuse.softmax import ops
    from lmfuse.softmax.reference import UNBOUNDED

    out: dict = {"fwd": {}, "bwd": {}}
    for shape, causal in LONG_SHAPES:
        x = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        gy = torch.randn_like(x)
        key = f"{shape} causal={causal}"
        cands = [("none", None, None)] + [
            (f"{n}x{w} hints={h}", (n, w), h) for n, w in LONG_FWD for h in (0, 1)]
        for name, geom, hints in cands:
            entry = None if geom is None else dict(
                min_keys=0, chunk_block=geom[0], chunk_warps=geom[1], chunk_hints=hints,
                bwd_chunk_block=geom[0], bwd_chunk_warps=geom[1])
            with tuning.overlay("softmax", dict(long_rows=entry)):
                ms = do_bench_cudagraph(lambda: lmfuse.fused_softmax(x, scale=0.125,
                                                                     causal=causal))
            out["fwd"].setdefault(name, {})[key] = ms
            print(f"fwd {key} {name}: {ms:.4f} ms", flush=True)
        y = lmfuse.fused_softmax(x, scale=0.125, causal=causal)
        lse = y.new_empty(0, dtype=torch.float32)
        cands = [("none", None, None)] + [
            (f"{n}x{w} hints={h}", (n, w), h) for n, w in LONG_BWD for h in (0, 1)]
        for name, geom, hints in cands:
            entry = None if geom is None else dict(
                min_keys=0, chunk_block=4096, chunk_warps=8, chunk_hints=hints,
                bwd_chunk_block=geom[0], bwd_chunk_warps=geom[1])
            with tuning.overlay("softmax", dict(long_rows=entry)):
                ms = do_bench_cudagraph(lambda: ops._launch_bwd(
                    gy, y, lse, None, 0.125, UNBOUNDED, 0 if causal else UNBOUNDED, False))
            out["bwd"].setdefault(name, {})[key] = ms
            print(f"bwd {key} {name}: {ms:.4f} ms", flush=True)
    best = {}
    for d in ("fwd", "bwd"):
        totals = {name: sum(v.values()) for name, v in out[d].items()}
        best[d] = min(totals, key=totals.get)
        print(f"{d}: none {totals['none']:.4f} ms summed, best {best[d]} "
              f"{totals[best[d]]:.4f}", flush=True)
    f, b = best["fwd"], best["bwd"]
    if f != "none" or b != "none":
        fn, fw = (int(v) for v in f.split()[0].split("x")) if f != "none" else (4096, 8)
        bn, bw = (int(v) for v in b.split()[0].split("x")) if b != "none" else (fn, fw)
        hints = int((f != "none" and f.endswith("=1")) or (b != "none" and b.endswith("=1")))
        entry = dict(min_keys=32768, chunk_block=fn, chunk_warps=fw, chunk_hints=hints,
                     bwd_chunk_block=bn, bwd_chunk_warps=bw)
        print("long_rows entry (check rows just past min_keys, and one hints flag for "
              "both passes):", json.dumps(entry), flush=True)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--long-rows", action="store_true",
                   help="sweep the long_rows entry only (streamed rows of 32768+ keys)")
    args = p.parse_args()
    if args.long_rows:
        results = sweep_long_rows()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return
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
