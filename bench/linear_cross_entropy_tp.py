"""Benchmark vocabulary-parallel ``lmfuse.linear_cross_entropy`` on 2 or 4 GPUs against
Megatron-Core's output layer (a column-parallel GEMM, then its vocabulary-parallel
cross-entropy).

Run it as ``python3 bench/linear_cross_entropy_tp.py --world 2 [--json PATH]``: the ranks,
timing in lockstep, collective counting, checks and JSON are ``bench/cross_entropy_tp.py``'s
(see there); ``--cpu`` is the same gloo smoke test with tiny shapes.

Every rank holds the same bf16 hidden states ``[N, H]`` (requiring grad), its shard
``[V / world, H]`` of the classifier weight (rows ``[r V / world, (r + 1) V / world)``)
and the same global targets ``[N]``, about 5% ignored, for N = 8192, H = 4096 and
V = 128256 and 262144 (``--cpu``: N = 64, H = 32, V = 1000 x world). Forward+backward is
``torch.autograd.grad(loss, [hidden, weight])``:

* ``lmfuse``: ``lmfuse.linear_cross_entropy(hidden, weight, target, tp_group=group)``: no
  logits, one all-gather of loss statistics forward, one all-reduce of ``dhidden``
  backward;
* ``megatron-core fused``: what Megatron's output layer does: ``hidden`` through an
  identity whose backward all-reduces its gradient (``copy_to_tensor_model_parallel_region``),
  ``logits = hidden @ weight.T`` ``[N, V / world]`` in bf16, then
  ``fused_vocab_parallel_cross_entropy`` (which copies them to float32);
* ``megatron-core``: the same with the unfused ``vocab_parallel_cross_entropy``.

Rows report the median ms of rank 0 (every rank's in the JSON), the time as a multiple of
lmfuse's, the peak memory beyond the inputs (gradients included) and the collectives one
call issues. The TB/s column is empty: the op is compute-bound. The floor, timed alone in
the same run, is the three GEMMs on the rank's shard (``x @ W.T``, ``G @ W``, ``G.T @ x``,
each in the faster of its two layouts, as in ``bench/linear_cross_entropy.py``) plus the
all-reduce of ``dhidden``; the GEMMs alone and the all-reduce alone are timed too (their
sum and the combined time differ by the GEMMs' run-to-run variation, a few percent on
H200s).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import cross_entropy_tp as tp  # noqa: E402  (sets NCCL_NVLS_ENABLE=0 before torch's use)
from lmfuse.bench.common import (Result, copy_tbps, dist_version, environment,  # noqa: E402
                                 unavailable)

IGNORE = tp.IGNORE


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; the gradient summed over the group backward (Megatron's
    ``copy_to_tensor_model_parallel_region``)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def load_impls() -> dict[str, tuple[object, str]]:
    """Implementation name -> (loss_fn(hidden, weight, target, group), version or why it is
    unavailable)."""
    import lmfuse

    def ours(h, w, t, group):
        return lmfuse.linear_cross_entropy(h, w, t, ignore_index=IGNORE, tp_group=group)

    impls = {"lmfuse": (ours, lmfuse.__version__)}

    def megatron_style(ce):
        def loss(h, w, t, group):
            n = h.shape[0]
            logits = _AllReduceGrad.apply(h, group) @ w.T
            return tp._valid_mean(ce(logits.view(n, 1, -1), t.view(n, 1), group), t)
        return loss

    try:
        with warnings.catch_warnings():  # without Transformer Engine or Apex it warns
            warnings.simplefilter("ignore")
            from megatron.core.fusions.fused_cross_entropy import (
                fused_vocab_parallel_cross_entropy,
            )
        impls["megatron-core fused"] = (megatron_style(fused_vocab_parallel_cross_entropy),
                                        dist_version("megatron-core"))
    except Exception as exc:
        impls["megatron-core fused"] = (unavailable(exc), f"unavailable ({type(exc).__name__})")
    try:
        from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

        def unfused(logits, t, group):
            return vocab_parallel_cross_entropy(logits, t, label_smoothing=0.0, tp_group=group)

        impls["megatron-core"] = (megatron_style(unfused), dist_version("megatron-core"))
    except Exception as exc:
        impls["megatron-core"] = (unavailable(exc), f"unavailable ({type(exc).__name__})")
    return impls


class Inputs:
    """The hidden states ``[n, H]`` (the same on every rank), this rank's weight rows
    ``[V / world, H]`` (scaled by ``H ** -0.5``: unit-variance logits) and the global
    targets ``[n]`` (about 5% ignored)."""

    def __init__(self, n: int, H: int, V: int, rank: int, world: int, device: torch.device,
                 dtype: torch.dtype):
        self.n, self.H, self.V, self.V_local = n, H, V, V // world
        g = torch.Generator().manual_seed(0)
        self.hidden = torch.randn(n, H, generator=g).to(device, dtype).requires_grad_(True)
        target = torch.randint(0, V, (n,), generator=g)
        target[torch.rand(n, generator=g) < 0.05] = IGNORE
        self.target = target.to(device)
        torch.manual_seed(1 + rank)
        self.weight = (torch.randn(self.V_local, H, device=device) * H ** -0.5).to(dtype)
        self.weight.requires_grad_(True)


def time_floor(d: Inputs, device: torch.device, warmup: int, rep: int) -> dict[str, float]:
    """The three GEMMs on this rank's shard, each in its faster layout, and the all-reduce
    of ``dhidden``: alone and together (ms, rank 0's median, in lockstep)."""
    x, w = d.hidden.detach(), d.weight.detach()
    g = torch.empty(d.n, d.V_local, dtype=x.dtype, device=device).normal_(0.0, 1.0 / d.V)

    def best(a, b):
        plain = tp.time_ms(lambda: a @ b, device, 3, 20)
        swapped = tp.time_ms(lambda: (b.T @ a.T).T, device, 3, 20)
        return (lambda: (b.T @ a.T).T) if swapped < plain else (lambda: a @ b)

    logits, dx, dw = best(x, w.T), best(g, w), best(g.T, x)

    def gemms():
        logits()
        dw()
        return dx()

    dx_buf = torch.empty_like(x)
    out = {"3 GEMMs": tp.time_ms(gemms, device, warmup, rep),
           "all-reduce dhidden": tp.time_ms(lambda: dist.all_reduce(torch.empty_like(x)),
                                            device, warmup, rep),
           # dx in the swapped layout is a transposed view, which NCCL does not take: the
           # all-reduce runs on a contiguous buffer of its size after the GEMMs.
           "floor: 3 GEMMs + all-reduce": tp.time_ms(
               lambda: (gemms(), dist.all_reduce(dx_buf)), device, warmup, rep)}
    del g
    return out


def bench_rank(rank: int, world: int, device: torch.device, opts: dict) -> None:
    cpu = opts["cpu"]
    n, H, vocabs = (64, 32, (1000 * world,)) if cpu else (8192, 4096, (128256, 262144))
    dtype = torch.float32 if cpu else torch.bfloat16
    warmup, rep = (1, 3) if cpu else (opts["warmup"], opts["rep"])
    impls = load_impls()
    counter = tp._collective_counter()
    env: dict = {}
    copy: dict = {}
    if rank == 0:
        env = environment(device)
        env.update(world_size=world, backend=dist.get_backend())
        env.update({k: v for k, (_, v) in impls.items() if k != "lmfuse"})
        print(f"# {env['device']} x{world} ({env['backend']}) | torch {env['torch']} | triton "
              f"{env['triton']} | lmfuse {env['lmfuse']} | {env['date']}")
        copy_ms, copy_bw = copy_tbps(256 * 2**20, device)
        copy = {"bytes": 256 * 2**20, "ms": copy_ms, "tbps": copy_bw}
        print(f"# per rank: median of {rep} calls after {warmup}; x lmfuse = ms / lmfuse ms "
              "(> 1: lmfuse is faster); peak MiB beyond the inputs, gradients included",
              flush=True)
    floors: dict[str, dict[str, float]] = {}
    results: list[tuple[Result, dict]] = []
    for V in vocabs:
        if V % world:
            raise ValueError(f"V = {V} does not split evenly over {world} ranks")
        d = Inputs(n, H, V, rank, world, device, dtype)
        floor = time_floor(d, device, warmup, rep)
        floors[str(V)] = floor
        if rank == 0:
            print(f"# V={V}: " + "; ".join(f"{k}: {v:.3f} ms" for k, v in floor.items()),
                  flush=True)
        name = f"fwd+bwd N={n} H={H} V={d.V_local}x{world}"
        rows = tp.run_case(name, None, (d.hidden, d.weight), d.target, True, impls, device,
                           warmup, rep, counter,
                           {"V": V, "floor_ms": floor["floor: 3 GEMMs + all-reduce"]})
        for r, extra in rows:
            extra["x_floor"] = r.ms / extra["floor_ms"] if r.ms else None
        if rank == 0:
            tp.print_rows(rows, header=not results)
        results += rows
        del d
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0 and opts["json"]:
        tp.write_json(opts["json"], env, copy, floors, results, comm_key="floor_ms")


if __name__ == "__main__":
    raise SystemExit(tp.main(bench=bench_rank, prog="bench/linear_cross_entropy_tp.py",
                             doc=__doc__, rep=30))
