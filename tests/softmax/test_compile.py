"""fused_softmax under torch.compile (fullgraph) and the custom ops' fake contracts."""

from __future__ import annotations

import pytest
import torch

import lmfuse
from lmfuse.softmax.reference import UNBOUNDED


@pytest.mark.parametrize("case", ["causal+sink", "bool mask", "additive mask"])
def test_compile_fullgraph_matches_eager(case):
    x = torch.randn(2, 3, 5, 7, requires_grad=True)
    offset = torch.randn(3, requires_grad=True)
    mask = None
    if case == "bool mask":
        mask = torch.rand(2, 1, 1, 7) < 0.3
    elif case == "additive mask":
        mask = torch.randn(1, 3, 5, 7)

    def f(t, o):
        return lmfuse.fused_softmax(t, scale=0.3, causal=case == "causal+sink", mask=mask,
                                    softmax_offset=o if case == "causal+sink" else None)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    y, yc = f(x, offset), compiled(x, offset)
    g = torch.randn_like(y)
    inputs = (x, offset) if case == "causal+sink" else (x,)
    grads = torch.autograd.grad(y, inputs, g)
    grads_c = torch.autograd.grad(yc, inputs, g)
    assert torch.equal(y, yc), case
    for a, b in zip(grads, grads_c):
        assert torch.equal(a, b), case


def test_custom_ops_pass_opcheck():
    # The ops are launches (the autograd.Function around them differentiates): inputs
    # without grad, as the compiled graph passes them.
    x = torch.randn(2, 3, 4, 9)
    offset = torch.randn(3)
    mask = torch.rand(2, 1, 4, 9) < 0.2
    torch.library.opcheck(torch.ops.lmfuse.softmax_fwd.default,
                          (x, mask, offset, 0.5, UNBOUNDED, 0))
    y, lse = torch.ops.lmfuse.softmax_fwd(x, mask, offset, 0.5, UNBOUNDED, 0)
    dy = torch.randn_like(y)
    torch.library.opcheck(torch.ops.lmfuse.softmax_bwd.default,
                          (dy, y, lse, offset, 0.5, 4, 0, False))
    # With the boolean mask, which the backward reads for NaN rows only.
    torch.library.opcheck(torch.ops.lmfuse.softmax_bwd.default,
                          (dy, y, lse, offset, 0.5, 4, 0, False, mask))
