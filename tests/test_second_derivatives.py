"""Second derivatives (a gradient taken with ``create_graph=True`` and differentiated
again): the activation ops give the plain formula's; the ops whose backward has no
derivative of its own refuse at once, naming the op, instead of returning a gradient cut
from its inputs (a gradient penalty that silently lost their terms)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lmfuse

F64 = torch.float64

# (name, call(x, weights, bias), plain formula(x, weights, bias)); x is [3, 8].
GELU = lambda a: F.gelu(a, approximate="tanh")  # noqa: E731
ACTIVATIONS = [
    ("swiglu", lambda x, w, b: lmfuse.swiglu(x, b, **_kw()),
     lambda x, w, b: F.silu((x + b)[:, :4]) * (x + b)[:, 4:]),
    ("geglu", lambda x, w, b: lmfuse.geglu(x, b, **_kw()),
     lambda x, w, b: GELU((x + b)[:, :4]) * (x + b)[:, 4:]),
    ("quick_geglu", lambda x, w, b: lmfuse.quick_geglu(x, b, linear_offset=1.0, **_kw()),
     lambda x, w, b: ((x + b)[:, :4] * torch.sigmoid(1.702 * (x + b)[:, :4]))
     * ((x + b)[:, 4:] + 1.0)),
    ("bias_gelu", lambda x, w, b: lmfuse.bias_gelu(x, b, **_kw()),
     lambda x, w, b: GELU(x + b)),
    ("squared_relu", lambda x, w, b: lmfuse.squared_relu(x, **_kw()),
     lambda x, w, b: torch.relu(x) ** 2),
    ("weighted_swiglu", lambda x, w, b: lmfuse.weighted_swiglu(x, w, b, **_kw()),
     lambda x, w, b: F.silu((x + b)[:, :4]) * (x + b)[:, 4:] * w),
    ("weighted_squared_relu", lambda x, w, b: lmfuse.weighted_squared_relu(x, w, **_kw()),
     lambda x, w, b: torch.relu(x) ** 2 * w),
]
_IMPL = {"impl": "auto"}


def _kw() -> dict:
    return dict(_IMPL)


def _inputs(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 8, generator=g, dtype=dtype).requires_grad_()
    w = torch.rand(3, 1, generator=g, dtype=dtype).add_(0.5).requires_grad_()
    b = (torch.randn(8, generator=g, dtype=dtype) * 0.1).requires_grad_()
    return x, w, b


def _penalty_grads(fn, x, w, b):
    """d/d(x, w, b) of |d sum(fn^2) / d(x, w, b)|^2: a gradient penalty's gradient."""
    ins = [x, w, b]
    gs = torch.autograd.grad(fn(x, w, b).pow(2).sum(), ins, create_graph=True,
                             allow_unused=True)
    pen = sum(g.pow(2).sum() for g in gs if g is not None)
    return torch.autograd.grad(pen, ins, allow_unused=True)


@pytest.mark.parametrize("impl", ["auto", "torch"])
@pytest.mark.parametrize("name,call,plain", ACTIVATIONS, ids=[a[0] for a in ACTIVATIONS])
def test_activation_second_derivatives_float64(monkeypatch, impl, name, call, plain) -> None:
    monkeypatch.setitem(_IMPL, "impl", impl)
    x, w, b = _inputs(F64)
    assert torch.autograd.gradgradcheck(call, (x, w, b))
    for got, want in zip(_penalty_grads(call, x, w, b), _penalty_grads(plain, x, w, b)):
        if want is None:
            assert got is None or torch.count_nonzero(got) == 0
        else:
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("impl", ["auto", "triton"])
@pytest.mark.parametrize("name,call,plain", ACTIVATIONS[:1] + ACTIVATIONS[2:3] + ACTIVATIONS[5:6],
                         ids=["swiglu", "quick_geglu", "weighted_swiglu"])
def test_activation_second_derivatives_float32(monkeypatch, impl, name, call, plain) -> None:
    """The float32 paths (the CPU fast path, the Triton kernels' forward) give the plain
    formula's gradient penalty too: under create_graph the backward is the reference's."""
    monkeypatch.setitem(_IMPL, "impl", impl)
    x, w, b = _inputs(torch.float32)
    for got, want in zip(_penalty_grads(call, x, w, b), _penalty_grads(plain, x, w, b)):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_activation_second_derivative_refused_for_an_fp8_stored_input() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    y = lmfuse.swiglu(x, fp8_input_store=True, impl="torch")
    with pytest.raises(RuntimeError, match="swiglu: second derivatives .*fp8_input_store"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


def test_activation_second_derivative_of_a_cpu_input_with_the_offload_flag() -> None:
    """``cpu_offload_input`` moves CUDA tensors only: a CPU input is kept as it is, so its
    second derivatives hold (they were refused, as for an offloaded input)."""
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradgradcheck(
        lambda x: lmfuse.swiglu(x, cpu_offload_input=True, impl="torch"), (x,))


def _ce(x):
    return lmfuse.cross_entropy(x, torch.tensor([1, 0, 3, 2]), impl=_IMPL["impl"])


def _lce(x):
    w = torch.linspace(-1, 1, 40).view(5, 8)
    return lmfuse.linear_cross_entropy(x[:, :8], w, torch.tensor([1, 0, 3, 4]),
                                       impl=_IMPL["impl"])


def _softmax(x):
    return lmfuse.fused_softmax(x.view(1, 1, 4, 10), causal=True, impl=_IMPL["impl"])


def _rms(x):
    return lmfuse.rms_norm(x, torch.ones(10), impl=_IMPL["impl"])


@pytest.mark.parametrize("impl", ["auto", "triton"])
@pytest.mark.parametrize("name,fn", [("cross_entropy", _ce), ("linear_cross_entropy", _lce),
                                     ("fused_softmax", _softmax), ("rms_norm", _rms)])
def test_ops_without_second_derivatives_refuse_at_once(monkeypatch, impl, name, fn) -> None:
    """Refused when the gradient is taken (not later, where ``autograd.grad`` with respect
    to the inputs would never reach a mark); a first-order gradient is unchanged."""
    monkeypatch.setitem(_IMPL, "impl", impl)
    x = torch.randn(4, 10, requires_grad=True)
    with pytest.raises(RuntimeError, match=rf"^{name}: second derivatives are not "):
        torch.autograd.grad(fn(x).pow(2).sum(), x, create_graph=True)
    (g1,) = torch.autograd.grad(fn(x).pow(2).sum(), x)
    assert torch.isfinite(g1).all() and torch.count_nonzero(g1) > 0
