"""``moe_experts`` under torch.compile(fullgraph=True): the Triton path's forward and backward
are custom ops (``lmfuse::moe_experts_fwd`` / ``lmfuse::moe_experts_bwd``), the routing
inside them, so the graph has no break (no host synchronisation either), and the output and
every gradient equal the eager call's. Cases: GPT-OSS's form with every gradient, also with
``fp8_input_store`` (the forward op's fake gives the float8 ``h`` it returns); top-1
squared ReLU without biases and with a router that needs no gradient (the backward op's
empty outputs)."""

from __future__ import annotations

import pytest
import torch
from helpers import randn

import lmfuse


@pytest.mark.parametrize("case", ["gpt-oss", "gpt-oss-fp8", "top1-frozen-router"])
def test_fullgraph_compile_matches_eager(case: str) -> None:
    torch._dynamo.reset()
    T, H, F, E = 6, 16, 8, 3
    gpt_oss = case.startswith("gpt-oss")
    k, K2 = (2, 2 * F) if gpt_oss else (1, F)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    rw = torch.rand(T, k, requires_grad=gpt_oss)
    args = [randn((T, H), requires_grad=True),
            randn((E, K2, H), scale=0.25, requires_grad=True),
            randn((E, H, F), scale=0.35, requires_grad=True)]
    if gpt_oss:
        args += [randn((E, K2), scale=0.3, requires_grad=True),
                 randn((E, H), scale=0.3, requires_grad=True)]
    kw = (dict(activation="quick_geglu", linear_offset=1.0, clamp_value=7.0,
               gate_up_layout="interleaved") if gpt_oss else dict(activation="squared_relu"))
    if case.endswith("fp8"):
        kw["fp8_input_store"] = True
    g = randn((T, H))
    wrt = args + ([rw] if gpt_oss else [])

    def call(hidden, wgu, wd, *biases):
        bgu, bd = biases if biases else (None, None)
        return lmfuse.moe_experts(hidden, ids, rw, wgu, wd, gate_up_bias=bgu, down_bias=bd,
                                  impl="triton", **kw)

    want = call(*args)
    want_grads = torch.autograd.grad(want, wrt, g)
    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    got = compiled(*args)
    got_grads = torch.autograd.grad(got, wrt, g)
    assert torch.equal(got, want)
    for a, b in zip(got_grads, want_grads):
        assert torch.equal(a, b)
