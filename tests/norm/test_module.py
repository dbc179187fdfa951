"""``lmfuse.RMSNorm``: its parameter and initialisation (Llama's ones, Gemma's zeros), its
forward against ``rms_norm`` and the reference, gradients reaching ``weight``, no-affine
mode, constructor validation."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, randn

import lmfuse
from lmfuse.norm.reference import rms_norm_reference

F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("offset, init", [(0.0, 1.0), (1.0, 0.0), (0.25, 0.75)])
def test_weight_starts_at_an_effective_scale_of_one(offset: float, init: float) -> None:
    norm = lmfuse.RMSNorm(24, weight_offset=offset, dtype=BF16)
    assert isinstance(norm.weight, torch.nn.Parameter)
    assert norm.weight.shape == (24,) and norm.weight.dtype == BF16
    assert torch.equal(norm.weight, torch.full((24,), init, dtype=BF16))
    x = randn((3, 24), BF16)
    assert torch.equal(norm(x), lmfuse.rms_norm(x, None))


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_forward_and_weight_gradient(offset: float, impl: str) -> None:
    norm = lmfuse.RMSNorm(40, eps=1e-5, weight_offset=offset, impl=impl)
    with torch.no_grad():
        norm.weight.normal_()
    x = randn((2, 3, 40), F32, requires_grad=True)
    y = norm(x)
    g = randn((2, 3, 40), F32)
    y.backward(g)
    xr = x.detach().double().requires_grad_(True)
    wr = norm.weight.detach().double().requires_grad_(True)
    ref = rms_norm_reference(xr, wr, eps=1e-5, weight_offset=offset)
    ref.backward(g.double())
    assert_close(y, ref, F32, "forward")
    assert_close(x.grad, xr.grad, F32, "dx")
    assert_close(norm.weight.grad, wr.grad, F32, "dweight")


def test_without_affine() -> None:
    norm = lmfuse.RMSNorm(16, elementwise_affine=False, weight_offset=1.0)
    assert norm.weight is None and list(norm.parameters()) == []
    x = randn((4, 16), F32)
    assert torch.equal(norm(x), lmfuse.rms_norm(x))
    assert "elementwise_affine=False" in repr(norm)


def test_repr_state_dict_and_reset() -> None:
    norm = lmfuse.RMSNorm(8, eps=1e-5, weight_offset=1.0)
    assert repr(norm) == "RMSNorm(8, eps=1e-05, weight_offset=1.0, impl='auto')"
    assert list(norm.state_dict()) == ["weight"]
    with torch.no_grad():
        norm.weight.fill_(3.0)
    norm.reset_parameters()
    assert not norm.weight.any()


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(hidden_size=0), ValueError, "hidden_size"),
    (dict(hidden_size=8.0), TypeError, "hidden_size"),
    (dict(hidden_size=8, eps=-1.0), ValueError, "eps"),
    (dict(hidden_size=8, weight_offset=float("inf")), ValueError, "weight_offset"),
    (dict(hidden_size=8, elementwise_affine=1), TypeError, "elementwise_affine"),
    (dict(hidden_size=8, impl="cuda"), ValueError, "impl"),
])
def test_bad_constructor_arguments(kwargs: dict, error, match: str) -> None:
    with pytest.raises(error, match=f"^RMSNorm: .*{match}"):
        lmfuse.RMSNorm(**kwargs)


@pytest.mark.parametrize("affine", [True, False], ids=["weight", "no-weight"])
@pytest.mark.parametrize("make_x, error, message", [
    pytest.param(lambda: randn((2, 12), F32), ValueError,
                 r"x must be \[..., hidden_size\] = \[..., 8\], got shape \(2, 12\)",
                 id="width"),
    pytest.param(lambda: torch.ones(2, 8, dtype=torch.int64), TypeError,
                 r"x must have dtype in \(.*\), got torch.int64", id="int"),
    pytest.param(lambda: torch.tensor(1.0), ValueError,
                 r"x must be \[..., hidden_size\] = \[..., 8\], got shape \(\)", id="0-d"),
    pytest.param(lambda: "x", TypeError, r"x must be a torch.Tensor, got str", id="str"),
])
def test_bad_input_at_forward_names_x(make_x, error, message: str, affine: bool) -> None:
    with pytest.raises(error, match=f"^RMSNorm: {message}"):
        lmfuse.RMSNorm(8, elementwise_affine=affine)(make_x())


def test_weight_dtype_may_differ_from_x() -> None:
    """A float32 weight with a bfloat16 x is the mixed-precision case, not an error."""
    y = lmfuse.RMSNorm(8, dtype=F32)(randn((3, 8), torch.bfloat16))
    assert y.dtype == torch.bfloat16


@pytest.mark.parametrize("shape", [8, [8], (8,), torch.Size([8])], ids=str)
def test_takes_nn_rmsnorm_normalized_shape(shape) -> None:
    """nn.RMSNorm's one-dim normalized_shape builds the same module (its state dict too)."""
    ours, theirs = lmfuse.RMSNorm(shape), torch.nn.RMSNorm(shape, eps=1e-6)
    assert ours.hidden_size == 8 and ours.normalized_shape == theirs.normalized_shape
    ours.load_state_dict(theirs.state_dict(), strict=True)


def test_normalized_shape_of_two_dims_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^RMSNorm: hidden_size must be an int or \[H\]"):
        lmfuse.RMSNorm([4, 8])


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16, torch.float16, torch.float64],
                         ids=str)
def test_eps_none_is_nn_rmsnorms(dtype: torch.dtype) -> None:
    """eps=None: the math type's epsilon, as nn.RMSNorm's (float32's for 16-bit x): equal
    to it where the rows are small enough for eps to matter."""
    x = randn((4, 8), dtype) * 1e-3
    ours = lmfuse.RMSNorm(8, eps=None, dtype=dtype)
    theirs = torch.nn.RMSNorm(8, eps=None, dtype=dtype)
    assert ours.eps is None
    assert_close(ours(x), theirs(x), dtype, "eps=None")


def test_meta_construction_then_reset_parameters() -> None:
    """The large-model recipe: build on the meta device, to_empty, reset_parameters on
    every module that has one; every parameter of lmfuse's modules gets its start value."""
    def built(make):
        m = make(device="meta").to_empty(device="cpu")
        with torch.no_grad():
            for p in m.parameters():
                p.fill_(float("nan"))  # what to_empty's memory may hold
        for sub in m.modules():
            if hasattr(sub, "reset_parameters"):
                sub.reset_parameters()
        return m

    mlp = built(lambda **kw: lmfuse.FusedMLP(8, 6, "swiglu", **kw))
    assert torch.equal(mlp.bias1, torch.zeros(12))
    block = built(lambda **kw: lmfuse.DecodeAttentionBlock(16, 4, 2, qk_norm=True, sinks=True,
                                                           qkv_bias=True, **kw))
    for w in (block.input_norm_weight, block.q_norm_weight, block.k_norm_weight):
        assert torch.equal(w, torch.ones_like(w))
    assert torch.equal(block.sinks, torch.zeros(4))
    norm = built(lambda **kw: lmfuse.RMSNorm(8, weight_offset=1.0, **kw))
    assert torch.equal(norm.weight, torch.zeros(8))
    for m in (mlp, block, norm):
        for name, p in m.named_parameters():
            assert torch.isfinite(p).all(), name
