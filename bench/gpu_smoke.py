"""GPU-only checks that CPU CI cannot make: torch.compile(fullgraph) and CUDA-graph capture
of fused_softmax and linear_cross_entropy, forward and backward, compared with eager lmfuse.

    python bench/gpu_smoke.py
"""

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
    return 0 if ok and graph_ok and linear_cross_entropy() else 1


def linear_cross_entropy() -> bool:
    """Inductor-compiled (fullgraph) fwd+bwd of linear_cross_entropy at an LM-head shape
    (streamed rows, several chunks, the table's CE launch) against eager, and a CUDA graph
    of the forward (no gradient) replayed on new data."""
    n, H, V = 4096, 1024, 128256
    h = torch.randn(n, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(V, H, device="cuda") / H ** 0.5).to(torch.bfloat16).requires_grad_(True)
    t = torch.randint(0, V, (n,), device="cuda")
    t[::9] = -100

    def f(h, w, t):
        return lmfuse.linear_cross_entropy(h, w, t, label_smoothing=0.1,
                                           max_chunk_bytes=V * 2 * 1024)

    out = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        loss = fn(h, w, t)
        out.append((loss, *torch.autograd.grad(loss * 0.5, (h, w))))
    diffs = [((a.float() - b.float()).abs().max() / a.float().abs().max()).item()
             for a, b in zip(*out)]
    ok = max(diffs) < 1e-6
    print(f"linear_cross_entropy torch.compile(fullgraph=True) fwd+bwd vs eager: max rel. "
          f"diff (loss, dh, dW) {', '.join(f'{d:.1e}' for d in diffs)}: {ok}")

    hs = h.detach().clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            f(hs, w.detach(), t)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = f(hs, w.detach(), t)
    hs.copy_(torch.randn_like(hs))
    graph.replay()
    torch.cuda.synchronize()
    graph_ok = torch.equal(static, f(hs, w.detach(), t))
    print(f"linear_cross_entropy CUDA graph (forward) on new data equals eager: {graph_ok}")
    return ok and graph_ok


if __name__ == "__main__":
    raise SystemExit(main())
