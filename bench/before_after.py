"""One call of every family timed on two source trees, run as two processes
(``PYTHONPATH=<tree>/src``), alternated ``--rounds`` times so drift hits both: what a change
costs (the NaN/inf semantics' cost, a refactor's "no op slower")::

    git archive 7b9ea77 src | tar -x -C before    # the tree before the change
    python bench/before_after.py --tree before=before/src --tree after=src --json ba.json

(``--cases softmax`` times the softmax cases alone; with more than two ``--tree`` options
every tree's times are printed, with no ratio.)

Each case: median of CUDA-event timings (``triton.testing.do_bench``, 25 ms warm-up,
100 ms measured) of one call -- forward, or forward + backward (``torch.autograd.grad``:
no gradient accumulated into ``.grad``, which neither tree owns) -- on bf16 inputs at a
training or serving size; decode attention and MoE decode as CUDA-graph replays. The ratio
is after / before (1.00: no cost). Cases: softmax (causal, boolean mask), cross-entropy,
linear cross-entropy, SwiGLU, GEGLU, RMSNorm, paged decode (bf16 and fp8 caches), the MoE
experts (Qwen3-MoE's training shape, GPT-OSS's decode).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def cases():
    import torch
    import triton.testing

    import lmfuse

    dev, bf16 = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, dtype=bf16, grad=False):
        return torch.randn(*shape, device=dev, dtype=dtype, generator=g).requires_grad_(grad)

    out = {}

    only = os.environ.get("NAN_OVERHEAD_CASES", "")

    def bench(name, fn):
        if only and not any(w in name for w in only.split(",")):
            return
        try:
            fn()
            torch.cuda.synchronize()
            out[name] = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        except Exception as exc:  # an older tree may lack a case's op or option
            out[name] = None
            print(f"{name}: {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)

    def section(fn):
        """Sets up and runs a group of cases; an error in the set-up (a graph capture on a
        tree without the option) skips the group, said on stderr."""
        try:
            fn()
        except Exception as exc:
            print(f"{fn.__name__}: {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)

    s = rnd(4, 32, 2048, 2048)
    bench("softmax fwd [4,32,2048,2048] causal", lambda: lmfuse.fused_softmax(
        s, scale=0.125, causal=True))
    keep = torch.rand(4, 1, 2048, 2048, device=dev, generator=g) < 0.1
    bench("softmax fwd [4,32,2048,2048] boolean mask", lambda: lmfuse.fused_softmax(
        s, scale=0.125, mask=keep))
    sg = rnd(4, 32, 2048, 2048, grad=True)
    dy = rnd(4, 32, 2048, 2048)
    bench("softmax fwd+bwd [4,32,2048,2048] causal", lambda: torch.autograd.grad(
        lmfuse.fused_softmax(sg, scale=0.125, causal=True), sg, dy))
    bench("softmax fwd+bwd [4,32,2048,2048] boolean mask", lambda: torch.autograd.grad(
        lmfuse.fused_softmax(sg, scale=0.125, mask=keep), sg, dy))
    x = rnd(8192, 128256, grad=True)
    t = torch.randint(0, 128256, (8192,), device=dev, generator=g)
    bench("cross_entropy fwd [8192,128256]", lambda: lmfuse.cross_entropy(x.detach(), t))
    bench("cross_entropy fwd+bwd [8192,128256]", lambda: torch.autograd.grad(
        lmfuse.cross_entropy(x, t), x))
    x = None
    h = rnd(8192, 4096, grad=True)
    w = rnd(128256, 4096, grad=True)
    bench("linear_cross_entropy fwd+bwd N8192 H4096 V128256",
          lambda: torch.autograd.grad(
              lmfuse.linear_cross_entropy(h, w, t), (h, w)))
    h = w = None
    a = rnd(16384, 2 * 14336, grad=True)
    da = rnd(16384, 14336)
    bench("swiglu fwd+bwd [16384,28672]", lambda: torch.autograd.grad(lmfuse.swiglu(a), a, da))
    bench("geglu fwd+bwd [16384,28672]", lambda: torch.autograd.grad(lmfuse.geglu(a), a, da))
    a = da = None
    r = rnd(16384, 4096, grad=True)
    rw = rnd(4096, grad=True)
    dr = rnd(16384, 4096)
    bench("rms_norm fwd+bwd [16384,4096]", lambda: torch.autograd.grad(
        lmfuse.rms_norm(r, rw), (r, rw), dr))
    def decode():
        # decode: B64, 32/8 heads of 128, 4096 keys, paged blocks of 16, a graph replay
        B, Hq, Hkv, D, L, bl = 64, 32, 8, 128, 4096, 16
        nb = B * L // bl
        kc, vc = rnd(nb, bl, Hkv, D), rnd(nb, bl, Hkv, D)
        table = torch.randperm(nb, device=dev, generator=g).view(B, L // bl).int()
        lens = torch.full((B,), L, device=dev, dtype=torch.int32)
        q = rnd(B, 1, Hq, D)
        lmfuse.decode_attention(q, kc, vc, lens, block_table=table)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            lmfuse.decode_attention(q, kc, vc, lens, block_table=table)
        bench("decode_attention B64 S4096 32/8x128 paged (graph)", graph.replay)
        # the same with an e4m3 cache (per-head scales 1)
        k8, v8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
        ones = torch.ones(Hkv, device=dev)
        kw8 = dict(block_table=table, k_scale=ones, v_scale=ones)
        lmfuse.decode_attention(q, k8, v8, lens, **kw8)
        torch.cuda.synchronize()
        graph8 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph8):
            lmfuse.decode_attention(q, k8, v8, lens, **kw8)
        bench("decode_attention B64 S4096 32/8x128 paged fp8 (graph)", graph8.replay)

    section(decode)

    def moe():
        # mixture of experts: Qwen3-MoE's shape fwd+bwd, GPT-OSS's decode at T16 (a graph)
        T, H, Fd, E, k = 8192, 2048, 768, 128, 8
        xm = rnd(T, H, grad=True)
        rl, ids = torch.randn(T, E, device=dev, generator=g).topk(k, dim=1)
        rwm = rl.softmax(-1).to(bf16).requires_grad_(True)
        wgu = (rnd(E, 2 * Fd, H) * H ** -0.5).requires_grad_(True)
        wd = (rnd(E, H, Fd) * Fd ** -0.5).requires_grad_(True)
        dym = rnd(T, H)
        bench("moe_experts fwd+bwd T8192 H2048 F768 E128 k8", lambda: torch.autograd.grad(
            lmfuse.moe_experts(xm, ids, rwm, wgu, wd), (xm, rwm, wgu, wd), dym))
        xm = wgu = wd = dym = None
        T, H, Fd, E, k = 16, 2880, 2880, 32, 4
        xd = rnd(T, H)
        rl, ids = torch.randn(T, E, device=dev, generator=g).topk(k, dim=1)
        rwd = rl.softmax(-1).to(bf16)
        wgu, wd = rnd(E, 2 * Fd, H) * H ** -0.5, rnd(E, H, Fd) * Fd ** -0.5
        bgu, bd = rnd(E, 2 * Fd) * 0.1, rnd(E, H) * 0.1
        moe_kw = dict(gate_up_bias=bgu, down_bias=bd, activation="quick_geglu",
                      linear_offset=1.0, clamp_value=7.0, gate_up_layout="interleaved")
        with torch.no_grad():
            lmfuse.moe_experts(xd, ids, rwd, wgu, wd, **moe_kw)
            torch.cuda.synchronize()
            graph_moe = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph_moe):
                lmfuse.moe_experts(xd, ids, rwd, wgu, wd, **moe_kw)
        bench("moe_experts decode T16 H2880 F2880 E32 k4 (graph)", graph_moe.replay)

    section(moe)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", default=[], help="NAME=PATH of a src tree")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--cases", default="", help="only cases whose name holds one of these "
                    "comma-separated words")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(cases()))
        return 0
    trees = dict(t.split("=", 1) for t in args.tree)
    times: dict[str, dict[str, list[float]]] = {n: {} for n in trees}
    for _ in range(args.rounds):
        for name, path in trees.items():
            env = dict(os.environ, PYTHONPATH=path, NAN_OVERHEAD_CASES=args.cases)
            res = subprocess.run([sys.executable, __file__, "--worker"], env=env,
                                 capture_output=True, text=True, check=False)
            if res.returncode:
                print(res.stderr[-3000:], file=sys.stderr)
                return 1
            for case, ms in json.loads(res.stdout.strip().splitlines()[-1]).items():
                times[name].setdefault(case, []).append(ms)
    names = list(trees)
    rows = []
    for case in times[names[0]]:
        got = {n: [ms for ms in times[n].get(case, []) if ms is not None] for n in names}
        if not all(got.values()):
            print(f"{case:55s} not run on " + ", ".join(n for n in names if not got[n]))
            continue
        best = {n: min(got[n]) for n in names}
        row = dict(case=case, **{f"{n}_ms": best[n] for n in names})
        if len(names) == 2:
            row["ratio"] = best[names[1]] / best[names[0]]
        rows.append(row)
        print(f"{case:55s} " + " ".join(f"{n} {best[n]:8.3f} ms" for n in names)
              + (f"  x{row['ratio']:.3f}" if "ratio" in row else ""))
    if args.json:
        import torch
        import triton

        env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__, date=time.strftime("%Y-%m-%d"), trees=trees,
                   rounds=args.rounds,
                   command=" ".join(["python"] + getattr(sys, "orig_argv", sys.argv)[1:]))
        with open(args.json, "w") as f:
            json.dump(dict(env=env, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
