"""Launch configs of cross-entropy's fused pass (stats and gradient in one launch), with
and without L2 eviction hints, on one GPU: ``python3 bench/probe_cross_entropy_hints.py``
(``$OUT`` or the current directory gets ``ce_probe2.json``).

bf16 logits ``[8192, V]``, V = 32000, 50000 (the stream kernel, and slices) and 128256,
262144 (the slices kernel): each candidate ``fused`` launch of
``lmfuse.cross_entropy.ops._launch_fwd`` timed by ``triton.testing.do_bench``, the three
fastest timed again; printed with the best time without hints and a copy of the logits.
"""
import json, os, itertools
import torch, triton
from lmfuse.cross_entropy import ops
dev = torch.device("cuda")
print(torch.cuda.get_device_name(dev), flush=True)
out = {}
n = 8192
def cands_for(V):
    c = []
    if V > 65536:
        for sl, pps, lag, h in itertools.product((16384, 32768), (4, 8), (1, 2, 3), (0, 1)):
            c.append(dict(BLOCK_V=4096, num_warps=8, programs_per_sm=pps, slice=sl, lag=lag, hints=h))
        c.append(dict(BLOCK_V=8192, num_warps=16, programs_per_sm=4, slice=32768, lag=2, hints=1))
    else:
        for pps, (bv, nw), h in itertools.product((2, 4, 8), ((8192, 16), (4096, 8)), (0, 1)):
            c.append(dict(BLOCK_V=bv, num_warps=nw, programs_per_sm=pps, hints=h))
        for sl, pps in itertools.product((8192, 16384, 32768), (4, 8)):
            c.append(dict(BLOCK_V=4096, num_warps=8, programs_per_sm=pps, slice=sl, lag=2, hints=1))
    return c
for V in (32000, 50000, 128256, 262144):
    x = torch.randn(n, V, device=dev, dtype=torch.bfloat16)
    t = torch.randint(0, V, (n,), device=dev)
    g = torch.empty_like(x)
    c = torch.tensor(float(n), device=dev)
    src = torch.empty(n * V, device=dev, dtype=torch.bfloat16); dst = torch.empty_like(src)
    copy = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100)
    del src, dst
    res = []
    for f in cands_for(V):
        ms = triton.testing.do_bench(lambda: ops._launch_fwd(x, t, c, g, 0, V, -100, 0.0, 0.0, None, True, fused=f), warmup=10, rep=50)
        res.append((ms, f))
    res.sort(key=lambda r: r[0])
    for ms0, f in list(res[:3]):
        ms = triton.testing.do_bench(lambda: ops._launch_fwd(x, t, c, g, 0, V, -100, 0.0, 0.0, None, True, fused=f), warmup=10, rep=100)
        print(V, "again", f, round(ms0, 4), round(ms, 4), flush=True)
    best0 = min((r for r in res if not r[1]["hints"]), key=lambda r: r[0])
    print(V, "copy", round(copy, 4), "best without hints", round(best0[0], 4), best0[1], flush=True)
    out[V] = {"copy_ms": copy, "results": res}
    del x, g
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "ce_probe2.json"), "w"), indent=1)
