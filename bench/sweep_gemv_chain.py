"""The fused decode layers' GEMV as a decode step runs it: ``--chain`` launches in a row,
each on its own weights (no L2 reuse), captured in one CUDA graph; per shape of the
``lmfuse bench generate`` model (hidden 2048, FFN 8192, 16/4 heads of 128, bf16) and row
count, the launch options of the one-row path (``BLOCK_M = 1``: products summed per
feature) and of the dot path, against cuBLAS chained the same way::

    python bench/sweep_gemv_chain.py [--rows 1] [--chain 8] [--json PATH]

Prints per shape the chosen configuration (``fused_ops.gemv_config``), the five fastest and
cuBLAS, in us per launch and TB/s.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from lmfuse.serving.fused_ops import gemv_config, gemv_split
from sweep_gemv import SHAPES, dot_rows, fits, launch, reference, weights


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def graph_us(fn, chain: int) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    times = []
    for _ in range(20):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / chain)
    return sorted(times)[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--rows", default="1")
    ap.add_argument("--chain", type=int, default=8)
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--dot", action="store_true", help="also sweep the dot path's options")
    ap.add_argument("--split", default="1",
                    help="K splits the dot sweep tries (not gated), e.g. 1,2,4,8")
    ap.add_argument("--block-m", default="",
                    help="row tiles the dot sweep tries, e.g. 16,32,64 (default: the chosen)")
    ap.add_argument("--block-n", default="32,64,128", help="feature tiles the dot sweep tries")
    ap.add_argument("--warps", default="4", help="warps the dot sweep tries, e.g. 4,8")
    a = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name in a.shapes.split(","):
        dims, gated, residual = SHAPES[name]
        sets = [weights(dims, g) for _ in range(a.chain)]
        K = dims[0][1]
        nbytes = sum(d[0] * d[1] * 2 for d in dims)
        for n in (int(v) for v in a.rows.split(",")):
            x = torch.randn(n, K, device=dev, generator=g).to(dt)
            n_out = dims[0][0] if gated else sum(d[0] for d in dims)
            y = torch.empty(n, n_out, device=dev, dtype=dt)
            r = torch.randn(n, n_out, device=dev, dtype=dt)
            ws = sets[0]
            want = reference(x, ws, gated)

            def blas():
                for ws in sets:
                    if gated:
                        F.silu(F.linear(x, ws[0])) * F.linear(x, ws[1])
                    elif residual:
                        r.addmm_(x, ws[0].t())
                    else:
                        [F.linear(x, w) for w in ws]

            t_blas = graph_us(blas, a.chain)
            results = []
            bm_dot = dot_rows(n)
            chosen = gemv_config(n_out, K, bm_dot, gated)
            configs = [(bm_dot,) + chosen + ("chosen", gemv_split(n_out, K, bm_dot, gated))]
            if a.dot:
                bms = [int(v) for v in a.block_m.split(",")] if a.block_m else [bm_dot]
                splits = [1] if gated else [int(v) for v in a.split.split(",")]
                configs += [(bm, bn, bk, w, st, f"dot/{sp}", sp) for bm, bn, bk, w, st, sp in
                            itertools.product(bms, _ints(a.block_n), (128, 256),
                                              _ints(a.warps), (3, 4), splits)
                            if bm <= bm_dot]
            if n == 1:
                configs += [(1, bn, bk, w, st, "m1", 1) for bn, bk, w, st in itertools.product(
                    (2, 4, 8), (512, 1024, 2048), (4, 8), (2, 3, 4))]
            for bm, bn, bk, warps, stages, kind, split in configs:
                if not fits(bm, bn, bk, stages, gated) or n_out % bn:
                    continue
                try:
                    out = torch.zeros_like(y)
                    launch(x, ws, out, None, gated, bn, bk, warps, stages, bm, split)
                    err = ((out.float() - want).abs().max() / want.abs().max()).item()

                    def chain(bm=bm, bn=bn, bk=bk, warps=warps, stages=stages, split=split):
                        for ws in sets:
                            launch(x, ws, r if residual else y, r if residual else None,
                                   gated, bn, bk, warps, stages, bm, split)

                    t = graph_us(chain, a.chain)
                except Exception as e:  # noqa: BLE001
                    print(name, n, kind, bm, bn, bk, warps, stages, "failed",
                          type(e).__name__, str(e)[:100])
                    continue
                results.append((t, kind, bm, bn, bk, warps, stages, err))
            results.sort()
            ch = next((x for x in results if x[1] == "chosen"), None)
            row = {"shape": name, "rows": n, "MB": nbytes / 1e6, "cublas_us": t_blas,
                   "cublas_TBps": nbytes / t_blas / 1e6,
                   "chosen": ch and {"us": ch[0], "TBps": nbytes / ch[0] / 1e6},
                   "best": [{"us": t, "TBps": nbytes / t / 1e6, "kind": k, "bm": bm,
                             "bn": bn, "bk": bk, "warps": w, "stages": st, "rel_err": e}
                            for t, k, bm, bn, bk, w, st, e in results[:5]]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
