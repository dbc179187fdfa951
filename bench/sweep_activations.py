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

    python bench/sweep_activations.py --backward [--json PATH]

times the backward alone (``torch.autograd.grad`` over a kept forward) instead, on both of
its launches, and prints the table entries to paste into ``<device>.json``'s
``activations``: the grouped launch (a bias gradient to sum; bias-SwiGLU, bias-GEGLU on
``[16384, 2 * 14336]``, bias-GELU on ``[16384, 14336]``) over tiles, programs an SM and
pipeline stages (``gated_bwd_stages`` / ``plain_bwd_stages``), and the flat launch (no bias
gradient; squared ReLU, weighted squared ReLU, weighted SwiGLU) over tiles and warps
(``bwd_flat``, or null where the grouped launch is as fast). A candidate wins by the sum of
its ops' times over the table's.
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
    parser.add_argument("--backward", action="store_true",
                        help="sweep the backward's grouped and flat launches")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_activations: needs a CUDA device", file=sys.stderr)
        return 2
    if args.backward:
        out = sweep_backward()
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=1)
        return 0
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


GROUPED = [(tile, max_n, warps, per_sm) for tile, max_n, warps in
           [(1024, 512, 4), (1024, 1024, 4), (2048, 512, 4), (2048, 1024, 4), (1024, 512, 2),
            (2048, 1024, 8)] for per_sm in (16, 32)]
GATED_STAGES, PLAIN_STAGES = (None, 2, 4), (None, 3)
FLAT = [(1024, 1024, 4), (1024, 512, 4), (2048, 1024, 4), (4096, 1024, 4), (2048, 512, 4),
        (4096, 1024, 8)]


def _backward_case(name: str):
    """(call, inputs to differentiate, upstream gradient) of one op on bf16 CUDA tensors."""
    M, f = 16384, 14336
    gated = name in ("bias_swiglu", "bias_geglu", "weighted_swiglu")
    x = torch.randn(M, 2 * f if gated else f, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    b = torch.randn(x.shape[1], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(M, 1, device="cuda", dtype=torch.float32, requires_grad=True)
    call, inputs = {
        "bias_swiglu": (lambda: lmfuse.swiglu(x, b), (x, b)),
        "bias_geglu": (lambda: lmfuse.geglu(x, b), (x, b)),
        "bias_gelu": (lambda: lmfuse.bias_gelu(x, b), (x, b)),
        "squared_relu": (lambda: lmfuse.squared_relu(x), (x,)),
        "weighted_squared_relu": (lambda: lmfuse.weighted_squared_relu(x, w), (x, w)),
        "weighted_swiglu": (lambda: lmfuse.weighted_swiglu(x, w), (x, w)),
    }[name]
    return call, inputs, torch.randn(M, f, device="cuda", dtype=torch.bfloat16)


def _time_backward(call, inputs, g, ref) -> tuple[float, bool]:
    """(ms of the backward alone, its gradients equal the reference's: x's bitwise, the
    bias' / weights' float32 sums within 1e-2)."""
    y = call()
    got = torch.autograd.grad(y, inputs, g, retain_graph=True)
    ok = torch.equal(got[0], ref[0]) and all(
        torch.allclose(a.float(), r.float(), rtol=1e-2, atol=1e-2)
        for a, r in zip(got[1:], ref[1:]))
    ms = do_bench(lambda: torch.autograd.grad(y, inputs, g, retain_graph=True), warmup=10,
                  rep=60, return_mode="median")
    return ms, ok


def _grouped_entry(times: dict) -> dict:
    """The grouped launch's table keys with the lowest summed relative time over the three
    bias-gradient ops, each stage count the best for its ops at that launch."""
    def stage_score(ops, c, stages):  # (summed time, stage count) of the best count at c
        return min(((sum(times[(op, c, st)] for op in ops), st) for st in stages),
                   key=lambda pair: pair[0])

    gated, plain = ("bias_swiglu", "bias_geglu"), ("bias_gelu",)
    best = min(GROUPED, key=lambda c: stage_score(gated, c, GATED_STAGES)[0]
               + stage_score(plain, c, PLAIN_STAGES)[0])
    tile, max_n, warps, per_sm = best
    return {"bwd_tile": tile, "bwd_max_block_n": max_n, "bwd_warps": warps,
            "bwd_programs_per_sm": per_sm,
            "gated_bwd_stages": stage_score(gated, best, GATED_STAGES)[1],
            "plain_bwd_stages": stage_score(plain, best, PLAIN_STAGES)[1]}


def sweep_backward() -> dict:
    """Time both backward launches' candidates; print the best table entries."""
    out = {"device": torch.cuda.get_device_name(),
           "base": tuning.table("activations", torch.device("cuda")), "rows": []}
    times: dict = {}  # (op, candidate) -> ms relative to the table's
    for name in ("bias_swiglu", "bias_geglu", "bias_gelu", "squared_relu",
                 "weighted_squared_relu", "weighted_swiglu"):
        call, inputs, g = _backward_case(name)
        ref = torch.autograd.grad(call(), inputs, g)
        base, _ = _time_backward(call, inputs, g, ref)
        out["rows"].append(dict(op=name, candidate="table", ms=base))
        print(f"{name} table: {base:.4f} ms", flush=True)
        if name.startswith("bias_"):
            gated = name != "bias_gelu"
            key = "gated_bwd_stages" if gated else "plain_bwd_stages"
            cands = [(c, st) for c in GROUPED
                     for st in (GATED_STAGES if gated else PLAIN_STAGES)]
            for (tile, max_n, warps, per_sm), st in cands:
                cfg = {"bwd_tile": tile, "bwd_max_block_n": max_n, "bwd_warps": warps,
                       "bwd_programs_per_sm": per_sm, key: st}
                with tuning.overlay("activations", cfg):
                    ms, ok = _time_backward(call, inputs, g, ref)
                times[(name, (tile, max_n, warps, per_sm), st)] = ms / base if ok else 1e9
                out["rows"].append(dict(op=name, candidate=cfg, ms=ms, ok=ok))
                print(f"{name} {cfg}: {ms:.4f} ms{'' if ok else ' WRONG'}", flush=True)
        else:
            for tile, max_n, warps in FLAT:
                flat = {"tile": tile, "max_block_n": max_n, "warps": warps}
                with tuning.overlay("activations", {"bwd_flat": flat}):
                    ms, ok = _time_backward(call, inputs, g, ref)
                times[(name, (tile, max_n, warps), "flat")] = ms / base if ok else 1e9
                out["rows"].append(dict(op=name, candidate={"bwd_flat": flat}, ms=ms, ok=ok))
                print(f"{name} bwd_flat={flat}: {ms:.4f} ms{'' if ok else ' WRONG'}",
                      flush=True)
            # No flat launch: the grouped one at the best grouped candidate (timed above)
            grouped = _grouped_entry(times)
            with tuning.overlay("activations", {**grouped, "bwd_flat": None}):
                ms, ok = _time_backward(call, inputs, g, ref)
            times[(name, None, "flat")] = ms / base if ok else 1e9
            out["rows"].append(dict(op=name, candidate={**grouped, "bwd_flat": None}, ms=ms,
                                    ok=ok))
            print(f"{name} bwd_flat=None (grouped {grouped}): {ms:.4f} ms"
                  f"{'' if ok else ' WRONG'}", flush=True)
        del call, inputs, g, ref
        torch.cuda.empty_cache()

    flat_ops = ("squared_relu", "weighted_squared_relu", "weighted_swiglu")
    flat = min([None, *FLAT], key=lambda c: sum(times[(op, c, "flat")] for op in flat_ops))
    entry = {**_grouped_entry(times),
             "bwd_flat": None if flat is None else dict(zip(("tile", "max_block_n", "warps"),
                                                            flat))}
    out["entry"] = entry
    print("activations entry:", json.dumps(entry), flush=True)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
