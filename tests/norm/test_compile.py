"""``rms_norm`` under torch.compile(fullgraph=True): the Triton launches are custom ops
(``lmfuse::rms_norm_fwd`` / ``lmfuse::rms_norm_bwd``), so the graph has no break, and the
output and gradients equal the eager call's."""

from __future__ import annotations

import pytest
import torch
from helpers import randn

import lmfuse


@pytest.mark.parametrize("with_weight, offset", [(True, 0.0), (True, 1.0), (False, 0.0)],
                         ids=["weight", "gemma", "no-weight"])
def test_fullgraph_compile_matches_eager(with_weight: bool, offset: float) -> None:
    torch._dynamo.reset()
    x = randn((2, 3, 40), requires_grad=True)
    leaves = [x] + ([randn((40,), requires_grad=True)] if with_weight else [])
    g = randn((2, 3, 40))

    def call(x, *weight):
        return lmfuse.rms_norm(x, *weight, eps=1e-5, weight_offset=offset, impl="triton")

    want = call(*leaves)
    want_grads = torch.autograd.grad(want, leaves, g)
    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    got = compiled(*leaves)
    got_grads = torch.autograd.grad(got, leaves, g)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(got_grads, want_grads):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)


def test_module_graph_holds_the_custom_ops() -> None:
    """The compiled module's forward and backward graphs call the custom ops, and its
    output and weight gradient equal the eager module's."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    norm = lmfuse.RMSNorm(24, impl="triton")
    with torch.no_grad():
        norm.weight.normal_()
    x = randn((5, 24))
    seen: list[str] = []

    def record(gm, inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=record, bw_compiler=record)
    y = torch.compile(norm, fullgraph=True, backend=backend)(x)
    (got,) = torch.autograd.grad(y.sum(), [norm.weight])
    (want,) = torch.autograd.grad(norm(x).sum(), [norm.weight])
    assert torch.allclose(y, norm(x), rtol=1e-6, atol=1e-6)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    assert "lmfuse.rms_norm_fwd.default" in seen and "lmfuse.rms_norm_bwd.default" in seen
