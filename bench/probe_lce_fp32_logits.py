"""linear_cross_entropy with ``logits_in_fp32`` against the default and the 3-GEMM floor:
fwd+bwd time (median, CUDA events) and peak memory beyond the inputs, bf16, and the loss's
distance from a float32-logits reference on a slice of the tokens::

    python bench/probe_lce_fp32_logits.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton.testing

import lmfuse


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for N, H, V in ((8192, 4096, 128256), (8192, 4096, 152064)):
        g = torch.Generator(device="cuda").manual_seed(0)
        h = (torch.randn(N, H, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
        w = (torch.randn(V, H, device="cuda", generator=g) / H ** 0.5).bfloat16().requires_grad_()
        t = torch.randint(0, V, (N,), device="cuda", generator=g)
        dl = torch.randn(N, V, device="cuda", dtype=torch.bfloat16)

        def floor():  # the three GEMMs: logits, d hidden, d weight
            torch.mm(h, w.T)
            torch.mm(dl, w)
            torch.mm(dl.T, h)

        res = dict(shape=[N, H, V], floor_ms=triton.testing.do_bench(floor, rep=200))
        dl = None
        for name, kw in (("default", {}), ("logits_in_fp32", dict(logits_in_fp32=True))):
            def step(kw=kw):
                h.grad = w.grad = None
                lmfuse.linear_cross_entropy(h, w, t, **kw).backward()
            step()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            ms = triton.testing.do_bench(step, rep=300)
            with torch.no_grad():  # per-token loss against float32 logits, 512 tokens
                k = 512
                ref = torch.nn.functional.cross_entropy(
                    torch.mm(h[:k].float(), w.float().T), t[:k], reduction="none")
                got = lmfuse.linear_cross_entropy(h[:k], w, t[:k], reduction="none", **kw)
                err = ((got - ref).abs().max() / ref.abs().max()).item()
            res[name] = dict(ms=ms, peak_mib=peak, per_token_rel_err_vs_fp32_logits=err)
        res["fp32_over_default"] = res["logits_in_fp32"]["ms"] / res["default"]["ms"]
        res["fp32_over_floor"] = res["logits_in_fp32"]["ms"] / res["floor_ms"]
        rows.append(res)
        print(json.dumps(res), flush=True)
    if args.json:
        import triton as tr
        env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=tr.__version__, date=time.strftime("%Y-%m-%d"))
        with open(args.json, "w") as f:
            json.dump(dict(env=env, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
