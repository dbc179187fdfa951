"""Whether the host bounds ``lmfuse.moe_experts``'s training step: forward + backward of
the Qwen3-MoE case of ``lmfuse bench moe_experts`` (T 8192, H 2048, F 768, E 128, k 8,
bf16, random routing) timed as the benchmark times it (eager, triton's ``do_bench``), the
same step captured in one CUDA graph and replayed (no host time), the host time of one
forward, one backward and one step (wall time of the Python call while the GPU is held
busy), and the benchmark's GEMM floor::

    python bench/moe_experts_host.py [--rounds 3] [--json PATH]

Eager at the graph's time means the host keeps ahead of the GPU and the kernels bound it.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from triton.testing import do_bench

import lmfuse
from lmfuse.bench.decode_attention import as_graph
from lmfuse.bench.moe_experts import route

T, H, F, E, K = 8192, 2048, 768, 128, 8


def host_ms(call, before=None, n: int = 20) -> float:
    """Median wall ms of ``call()`` issued while the GPU sleeps (``before()`` first,
    untimed, where given)."""
    times = []
    for _ in range(n):
        arg = before() if before else None
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # long enough that the call never waits on the GPU
        t0 = time.perf_counter()
        out = call(arg) if before else call()
        times.append((time.perf_counter() - t0) * 1e3)
        del out
    torch.cuda.synchronize()
    return sorted(times)[n // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev)
    g.manual_seed(0)
    w_gate_up = (torch.randn(E, 2 * F, H, generator=g, device=dev, dtype=dt) * 0.02)
    w_down = (torch.randn(E, H, F, generator=g, device=dev, dtype=dt) * 0.02)
    hidden = torch.randn(T, H, generator=g, device=dev, dtype=dt)
    ids, weights = route(T, E, K, dt, dev, g)
    wrt = [t.requires_grad_() for t in (hidden, w_gate_up, w_down, weights)]
    dy = torch.randn(T, H, generator=g, device=dev, dtype=dt)

    def forward():
        return lmfuse.moe_experts(hidden, ids, weights, w_gate_up, w_down)

    def step():
        return torch.autograd.grad(forward(), wrt, dy)

    rows = T * K
    x, a, dys, dh = (torch.randn(rows, n, device=dev, dtype=dt) for n in (H, F, H, 2 * F))
    w1, w2 = w_gate_up[0].detach(), w_down[0].detach()

    def floor():  # the benchmark's: dense GEMMs of the same flops
        return (x @ w1.T, a @ w2.T, dys @ w2, dys.T @ a, dh @ w1, dh.T @ x)

    def bench(fn) -> list[float]:
        return [float(do_bench(fn, warmup=50, rep=300, return_mode="median"))
                for _ in range(args.rounds)]

    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "shape": dict(T=T, H=H, F=F, E=E, k=K, dtype="bfloat16"),
           "floor_ms": bench(floor), "eager_ms": bench(step)}
    res["host_step_ms"] = host_ms(step)
    res["host_forward_ms"] = host_ms(forward)
    res["host_backward_ms"] = host_ms(lambda out: torch.autograd.grad(out, wrt, dy),
                                      before=forward)
    res["graph_ms"] = bench(as_graph(step))
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
