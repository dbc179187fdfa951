"""``moe_experts_reference`` (the per-expert loop) against a naive per-token loop written
from the formula in float64: every activation, both gate/up layouts, with and without
biases, clamp and linear offset; gradients of every input by autograd through both."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, randn

from lmfuse.moe.reference import moe_experts_reference

F64 = torch.float64
GATED = {"swiglu": True, "geglu": True, "quick_geglu": True, "squared_relu": False}


def _act(name: str, a: torch.Tensor) -> torch.Tensor:
    if name == "swiglu":
        return a * torch.sigmoid(a)
    if name == "geglu":
        return 0.5 * a * (1 + torch.tanh(0.79788456 * (a + 0.044715 * a ** 3)))
    if name == "quick_geglu":
        return a * torch.sigmoid(1.702 * a)
    return torch.relu(a) ** 2


def naive(hidden, ids, rw, wgu, wd, bgu, bd, activation, offset, clamp, layout):
    """One token and one slot at a time, straight from the formula."""
    rows = []
    for t in range(hidden.shape[0]):
        acc = torch.zeros(hidden.shape[1], dtype=F64)
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = wgu[e] @ hidden[t] + (bgu[e] if bgu is not None else 0)
            if GATED[activation]:
                f = h.shape[0] // 2
                gate, up = (h[0::2], h[1::2]) if layout == "interleaved" else (h[:f], h[f:])
                if clamp is not None:
                    gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
                a = _act(activation, gate) * (up + offset)
            else:
                a = _act(activation, h)
            y = wd[e] @ a + (bd[e] if bd is not None else 0)
            acc = acc + rw[t, j] * y
        rows.append(acc)
    return torch.stack(rows)


def make(T, H, F, E, k, activation, bias, dtype=F64):
    K2 = 2 * F if GATED[activation] else F
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    return dict(
        hidden=randn((T, H), dtype, requires_grad=True),
        expert_ids=ids,
        router_weights=torch.rand(T, k, dtype=dtype).requires_grad_(True),
        w_gate_up=randn((E, K2, H), dtype, scale=H ** -0.5, requires_grad=True),
        w_down=randn((E, H, F), dtype, scale=F ** -0.5, requires_grad=True),
        gate_up_bias=randn((E, K2), dtype, scale=0.3, requires_grad=True) if bias else None,
        down_bias=randn((E, H), dtype, scale=0.3, requires_grad=True) if bias else None,
    )


# (activation, linear_offset, clamp_value, layout): squared_relu is not gated (no layout).
CASES = [(act, off, clamp, layout)
         for act, off, clamp in (("swiglu", 0.0, None), ("geglu", 0.0, None),
                                 ("quick_geglu", 1.0, 0.7))
         for layout in ("halves", "interleaved")] + [("squared_relu", 0.0, None, "halves")]


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("activation, offset, clamp, layout", CASES)
def test_reference_matches_per_token_loop(activation, offset, clamp, layout, bias) -> None:
    a = make(7, 12, 5, 4, 2, activation, bias)
    opts = dict(activation=activation, linear_offset=offset, clamp_value=clamp,
                gate_up_layout=layout)
    got = moe_experts_reference(**a, **opts)
    want = naive(*a.values(), activation, offset, clamp, layout)
    assert got.dtype == F64
    assert_close(got, want, F64, f"{activation} {layout} forward")
    leaves = [v for v in a.values() if isinstance(v, torch.Tensor) and v.requires_grad]
    g = randn(got.shape, F64)
    for x, y, name in zip(torch.autograd.grad(got, leaves, g),
                          torch.autograd.grad(want, leaves, g),
                          [n for n, v in a.items() if v is not None and v.requires_grad]):
        assert_close(x, y, F64, f"{activation} {layout} d{name}")


def test_reference_float32_math_for_half_inputs() -> None:
    """Half-precision inputs are computed in float32 and rounded once at the end."""
    a = make(5, 8, 4, 3, 2, "swiglu", True, dtype=torch.float16)
    got = moe_experts_reference(**a)
    want = moe_experts_reference(**{n: v.float() if v is not None and v.is_floating_point()
                                    else v for n, v in a.items()})
    assert got.dtype == torch.float16
    assert torch.equal(got, want.to(torch.float16))


def test_unused_expert_gets_zero_gradient() -> None:
    a = make(4, 8, 4, 4, 1, "swiglu", True)
    a["expert_ids"] = torch.tensor([[0], [2], [0], [2]])
    out = moe_experts_reference(**a)
    out.sum().backward()
    for name in ("w_gate_up", "w_down", "gate_up_bias", "down_bias"):
        grad = a[name].grad
        assert torch.count_nonzero(grad[1]) == 0 and torch.count_nonzero(grad[3]) == 0, name
        assert torch.count_nonzero(grad[0]) > 0 and torch.count_nonzero(grad[2]) > 0, name
