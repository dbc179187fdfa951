"""``LMFUSE_NVTX``: every op's forward and backward inside a range named after the op.

On these CPU machines ``torch.cuda.nvtx`` cannot run, so the ranges are observed through
``lmfuse._nvtx.enable``'s record list (the names a CUDA run would push).
"""

from __future__ import annotations

import pytest
import torch
from helpers import randn

import lmfuse
from lmfuse import _nvtx

ACTIVATIONS = {  # public name -> (function, takes weights)
    "bias_gelu": (lmfuse.bias_gelu, False),
    "swiglu": (lmfuse.swiglu, False),
    "geglu": (lmfuse.geglu, False),
    "quick_geglu": (lmfuse.quick_geglu, False),
    "squared_relu": (lmfuse.squared_relu, False),
    "weighted_swiglu": (lmfuse.weighted_swiglu, True),
    "weighted_quick_geglu": (lmfuse.weighted_quick_geglu, True),
    "weighted_squared_relu": (lmfuse.weighted_squared_relu, True),
}


@pytest.fixture
def ranges():
    """Ranges on, their names recorded in the returned list; the previous state restored."""
    before = (_nvtx._ENABLED, _nvtx._record)
    names: list[str] = []
    _nvtx.enable(True, record=names)
    yield names
    _nvtx._ENABLED, _nvtx._record = before


def _fwd_bwd(op: str) -> list[str]:
    return [f"lmfuse.{op}.fwd", f"lmfuse.{op}.bwd"]


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activation_ranges(ranges, name):
    fn, weighted = ACTIVATIONS[name]
    x = randn((3, 8), requires_grad=True)
    y = fn(x, randn((3, 1)), impl="torch") if weighted else fn(x, impl="torch")
    y.sum().backward()
    assert ranges == _fwd_bwd(name)


def test_fused_softmax_ranges(ranges):
    # The Triton path (interpreter) is the one with an lmfuse backward; the reference's
    # backward is plain autograd, outside any range.
    x = randn((1, 2, 3, 5), requires_grad=True)
    lmfuse.fused_softmax(x, causal=True, impl="triton").sum().backward()
    assert ranges == _fwd_bwd("fused_softmax")


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_cross_entropy_ranges(ranges, impl):
    logits = randn((4, 11), requires_grad=True)
    lmfuse.cross_entropy(logits, torch.randint(0, 11, (4,)), impl=impl).backward()
    assert ranges == _fwd_bwd("cross_entropy")


def test_linear_cross_entropy_ranges(ranges):
    hidden, weight = randn((4, 8), requires_grad=True), randn((11, 8), requires_grad=True)
    lmfuse.linear_cross_entropy(hidden, weight, torch.randint(0, 11, (4,)),
                                impl="torch").backward()
    assert ranges == _fwd_bwd("linear_cross_entropy")


def test_inference_op_ranges(ranges):
    B, S, H, D = 2, 6, 2, 8
    k_cache, v_cache = randn((B, S, H, D)), randn((B, S, H, D))
    lens = torch.tensor([3, 4], dtype=torch.int32)
    lmfuse.kv_cache_append(k_cache, v_cache, randn((B, 1, H, D)), randn((B, 1, H, D)), lens,
                           impl="torch")
    out, lse = lmfuse.decode_attention(randn((B, 1, H, D)), k_cache, v_cache, lens + 1,
                                       return_lse=True, impl="torch")
    lmfuse.merge_attention_states(torch.stack([out, out]), torch.stack([lse, lse]),
                                  impl="torch")
    assert ranges == ["lmfuse.kv_cache_append.fwd", "lmfuse.decode_attention.fwd",
                      "lmfuse.merge_attention_states.fwd"]


def test_off_records_nothing(ranges):
    _nvtx.enable(False, record=ranges)
    x = randn((3, 8), requires_grad=True)
    lmfuse.swiglu(x, impl="torch").sum().backward()
    lmfuse.cross_entropy(randn((4, 11)), torch.randint(0, 11, (4,)), impl="torch")
    assert ranges == []
    assert _nvtx.nvtx_range("swiglu", "fwd") is _nvtx.nvtx_range("geglu", "bwd")  # shared


def test_a_failing_op_leaves_no_range_open(ranges):
    with pytest.raises(ValueError):
        lmfuse.swiglu(randn((3, 7)), impl="torch")  # odd last dim: refused before the range
    assert ranges == []


@pytest.mark.parametrize("on", [False, True])
def test_compiles_without_graph_break(ranges, on):
    """Off: one shared no-op context, traced through. On: skipped while compiling."""
    _nvtx.enable(on, record=ranges)

    def step(x):
        return lmfuse.swiglu(x, impl="triton").square().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x = randn((4, 8), requires_grad=True)
    compiled(x).backward()
    want = x.detach().clone().requires_grad_(True)
    step(want).backward()
    torch.testing.assert_close(x.grad, want.grad)
    assert ranges == (_fwd_bwd("swiglu") if on else [])  # only the eager call's
