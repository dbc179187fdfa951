"""Every activation under torch.compile(fullgraph=True): the Triton launches are custom ops
(``lmfuse::act_fwd`` / ``lmfuse::act_bwd``), so the graph has no break, and forward and
gradients equal the eager call's."""

from __future__ import annotations

import pytest
import torch
from helpers import randn

import lmfuse

# (function, gated, weighted, takes a bias)
OPS = [
    (lmfuse.bias_gelu, False, False, True),
    (lmfuse.swiglu, True, False, True),
    (lmfuse.geglu, True, False, True),
    (lmfuse.quick_geglu, True, False, True),
    (lmfuse.squared_relu, False, False, False),
    (lmfuse.weighted_swiglu, True, True, False),
    (lmfuse.weighted_quick_geglu, True, True, False),
    (lmfuse.weighted_squared_relu, False, True, False),
]


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("fn, gated, weighted, has_bias", OPS,
                         ids=[op[0].__name__ for op in OPS])
def test_fullgraph_compile_matches_eager(fn, gated, weighted, has_bias, impl: str) -> None:
    """Both paths: the reference's under compile runs its ops with their own autograd (its
    Function's backward took torch.autograd.grad, which Dynamo refuses)."""
    torch._dynamo.reset()
    x = randn((6, 32), requires_grad=True)
    extra = []
    if weighted:
        extra.append(torch.rand(6, 1, requires_grad=True))
    if has_bias:
        extra.append(randn((32,), requires_grad=True))
    g = randn((6, 16 if gated else 32))

    def call(x, *rest):
        return fn(x, *rest, impl=impl)

    want = call(x, *extra)
    want_grads = torch.autograd.grad(want, [x, *extra], g)
    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    got = compiled(x, *extra)
    got_grads = torch.autograd.grad(got, [x, *extra], g)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(got_grads, want_grads):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_fullgraph_compile_of_a_clamp_with_the_fp8_input_store(impl: str) -> None:
    """GPT-OSS's setting (Quick-GEGLU clamped at 7, the input kept in float8): the float8
    values around the clamp come from Python, not from a tensor read (Dynamo could not
    trace that); the torch path's backward takes torch.func.vjp."""
    torch._dynamo.reset()
    x = randn((6, 32), requires_grad=True) * 4
    w = torch.rand(6, 1, requires_grad=True)
    g = randn((6, 16))

    def call(x, w):
        return lmfuse.weighted_quick_geglu(x, w, linear_offset=1.0, clamp_value=7.0,
                                           fp8_input_store=True, impl=impl)

    want = call(x, w)
    want_grads = torch.autograd.grad(want, [x, w], g)
    got = torch.compile(call, fullgraph=True, backend="aot_eager")(x, w)
    got_grads = torch.autograd.grad(got, [x, w], g)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(got_grads, want_grads):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
