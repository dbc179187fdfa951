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
