"""``moe_experts`` under torch.compile(fullgraph=True): the Triton path's forward and backward
are custom ops (``lmfuse::moe_experts_fwd`` / ``lmfuse::moe_experts_bwd``), the routing
inside them, so the graph has no break (no host synchronisation either), and the output and
every gradient equal the eager call's."""

from __future__ import annotations

import torch
from helpers import randn

import lmfuse


def test_fullgraph_compile_matches_eager() -> None:
    torch._dynamo.reset()
    T, H, F, E, k = 6, 16, 8, 3, 2
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    args = [randn((T, H), requires_grad=True), torch.rand(T, k, requires_grad=True),
            randn((E, 2 * F, H), scale=0.25, requires_grad=True),
            randn((E, H, F), scale=0.35, requires_grad=True),
            randn((E, 2 * F), scale=0.3, requires_grad=True),
            randn((E, H), scale=0.3, requires_grad=True)]
    g = randn((T, H))

    def call(hidden, rw, wgu, wd, bgu, bd):
        return lmfuse.moe_experts(hidden, ids, rw, wgu, wd, gate_up_bias=bgu, down_bias=bd,
                                  activation="quick_geglu", linear_offset=1.0,
                                  clamp_value=7.0, gate_up_layout="interleaved",
                                  impl="triton")

    want = call(*args)
    want_grads = torch.autograd.grad(want, args, g)
    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    got = compiled(*args)
    got_grads = torch.autograd.grad(got, args, g)
    assert torch.equal(got, want)
    for a, b in zip(got_grads, want_grads):
        assert torch.equal(a, b)
