"""GPU-only checks that CPU CI cannot make: torch.compile(fullgraph) and CUDA-graph capture
of fused_softmax forward and backward, compared with eager lmfuse."""

from __future__ import annotations

import torch

import lmfuse


def main() -> int:
    x = torch.randn(2, 8, 300, 1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    off = torch.randn(8, device="cuda", requires_grad=True)
    g = torch.randn_like(x)

    def f(t, o):
        return lmfuse.fused_softmax(t, scale=0.1, causal=True, softmax_offset=o)

    y = f(x, off)
    gx, go = torch.autograd.grad(y, (x, off), g)
    cf = torch.compile(f, fullgraph=True)
    yc = cf(x, off)
    gxc, goc = torch.autograd.grad(yc, (x, off), g)
    ok = torch.equal(y, yc) and torch.equal(gx, gxc) and torch.allclose(go, goc)
    print(f"torch.compile(fullgraph=True) fwd+bwd equals eager: {ok}")

    xs = x.detach().clone()
    static_out = None
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            lmfuse.fused_softmax(xs, scale=0.1, causal=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = lmfuse.fused_softmax(xs, scale=0.1, causal=True)
    xs.copy_(torch.randn_like(xs))
    graph.replay()
    torch.cuda.synchronize()
    ref = lmfuse.fused_softmax(xs, scale=0.1, causal=True)
    graph_ok = torch.equal(static_out, ref)
    print(f"CUDA graph capture + replay on new data equals eager: {graph_ok}")
    return 0 if ok and graph_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
