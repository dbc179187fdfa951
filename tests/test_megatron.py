"""``lmfuse.megatron``: Megatron-Core's names and signatures, backed by the fused softmax.

Each function is compared with the plain float32 torch computation Megatron's kernel
stands for (mask True = masked out; upper-triangular = causal), forward and backward.
The functions run the Triton kernel (``impl="auto"``, the interpreter here), whose
backward reads the output it saved: in float16 the gradient's oracle is the
softmax-backward formula on that output, in float32 plain autograd.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from helpers import assert_close, rand_bool, randn

import lmfuse
from lmfuse import megatron
from lmfuse.softmax import ops
from lmfuse.softmax.reference import fused_softmax_backward_reference

F32, F16 = torch.float32, torch.float16
DTYPES = [pytest.param(F32, id="float32"), pytest.param(F16, id="float16")]


def plain_softmax(x32: torch.Tensor, scale: float, hidden: torch.Tensor | None) -> torch.Tensor:
    """float32 ``softmax(scale * x)`` with hidden keys at -inf; a row hiding every key is 0."""
    z = x32 * scale
    if hidden is None:
        return torch.softmax(z, dim=-1)
    hidden = hidden.expand_as(z)
    dead = hidden.all(dim=-1, keepdim=True)
    z = z.masked_fill(hidden & ~dead, float("-inf"))
    return torch.softmax(z, dim=-1).masked_fill(dead, 0.0)


def upper_triangle(sq: int, sk: int) -> torch.Tensor:
    """``[sq, sk]`` True strictly above the diagonal, bottom-right aligned (sq == sk: triu(1))."""
    return torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1)


def check(what: str, fn: Callable[[torch.Tensor], torch.Tensor], shape: tuple[int, ...],
          dtype: torch.dtype, scale: float, hidden: torch.Tensor | None) -> torch.Tensor:
    """Run ``fn`` forward and backward and compare with the plain float32 computation."""
    x = randn(shape, dtype, scale=2.0, requires_grad=True)
    grad = randn(shape, dtype)
    y = fn(x)
    y.backward(grad)

    x32 = x.detach().float().requires_grad_(True)
    y32 = plain_softmax(x32, scale, hidden)
    y32.backward(grad.float())

    assert y.dtype == dtype and y.shape == shape, f"{what}: got {y.dtype} {tuple(y.shape)}"
    assert_close(y, y32.to(dtype), dtype, f"{what}: forward")
    if dtype == F32:
        expected_dx = x32.grad
    else:
        expected_dx = (scale * fused_softmax_backward_reference(y.detach().double(), grad))
    assert x.grad.dtype == dtype
    assert_close(x.grad, expected_dx.to(dtype), dtype, f"{what}: d inputs")
    if hidden is not None:
        hid = hidden.expand(shape)
        zeros = torch.zeros(int(hid.sum()), dtype=dtype)
        assert torch.equal(y.detach()[hid], zeros), f"{what}: y != 0 where masked"
        assert torch.equal(x.grad[hid], zeros), f"{what}: d inputs != 0 where masked"
    return y


# --- scaled_upper_triang_masked_softmax ------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, scale", [
    pytest.param((4, 5, 5), 0.5, id="ab4-sq5"),
    pytest.param((3, 1, 1), 1.0, id="sq1"),
    pytest.param((2, 7, 7), 1.7, id="ab2-sq7"),
])
def test_scaled_upper_triang_masked_softmax(shape, scale: float, dtype: torch.dtype) -> None:
    ab, sq, sk = shape
    check(f"upper_triang {shape} {dtype}",
          lambda x: megatron.scaled_upper_triang_masked_softmax(x, scale),
          shape, dtype, scale, upper_triangle(sq, sk))


@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_upper_triang_sq_less_than_sk_is_bottom_right_aligned(dtype: torch.dtype) -> None:
    # Beyond Megatron (which needs sq == sk): the sq queries are the last sq of the keys.
    hidden = upper_triangle(3, 6)
    assert hidden[0].tolist() == [False] * 4 + [True] * 2
    check(f"upper_triang sq<sk {dtype}",
          lambda x: megatron.scaled_upper_triang_masked_softmax(x, 0.8),
          (2, 3, 6), dtype, 0.8, hidden)


# --- scaled_masked_softmax -------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, mask_shape, scale", [
    pytest.param((2, 3, 4, 6), (2, 1, 4, 6), 0.6, id="mask-b1qk"),
    pytest.param((2, 2, 3, 7), (2, 1, 1, 7), 1.25, id="mask-b11k"),
    pytest.param((1, 2, 3, 5), (1, 2, 3, 5), 1.0, id="mask-bhqk"),
])
def test_scaled_masked_softmax(shape, mask_shape, scale: float, dtype: torch.dtype) -> None:
    mask = rand_bool(mask_shape)
    check(f"scaled_masked {shape} mask {mask_shape} {dtype}",
          lambda x: megatron.scaled_masked_softmax(x, mask, scale),
          shape, dtype, scale, mask)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_masked_softmax_3d_input(dtype: torch.dtype) -> None:
    mask = rand_bool((4, 6))  # [sq, sk], shared by every attention batch
    check(f"scaled_masked 3-D {dtype}",
          lambda x: megatron.scaled_masked_softmax(x, mask, 0.9),
          (3, 4, 6), dtype, 0.9, mask)


def test_scaled_masked_softmax_fully_masked_row_is_zeros() -> None:
    # Megatron's kernel gives a uniform row here; lmfuse excludes masked keys exactly.
    mask = torch.zeros(1, 1, 3, 5, dtype=torch.bool)
    mask[..., 1, :] = True
    y = check("scaled_masked dead row", lambda x: megatron.scaled_masked_softmax(x, mask, 1.0),
              (1, 2, 3, 5), F32, 1.0, mask)
    assert torch.equal(y[..., 1, :].detach(), torch.zeros(1, 2, 5))


def test_scaled_masked_softmax_mask_none_is_plain_softmax() -> None:
    check("scaled_masked mask=None", lambda x: megatron.scaled_masked_softmax(x, None, 0.5),
          (1, 2, 3, 5), F32, 0.5, None)


# --- scaled_softmax --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, scale", [
    pytest.param((2, 3, 4, 6), 0.35, id="4d"),
    pytest.param((3, 2, 9), 1.0, id="3d"),
    pytest.param((1, 1, 1, 1), 2.0, id="one-key"),
])
def test_scaled_softmax(shape, scale: float, dtype: torch.dtype) -> None:
    check(f"scaled_softmax {shape} {dtype}", lambda x: megatron.scaled_softmax(x, scale),
          shape, dtype, scale, None)


# --- what backs them ---------------------------------------------------------------------


CALLS = {
    "scaled_upper_triang_masked_softmax":
        lambda x: megatron.scaled_upper_triang_masked_softmax(x[0], 0.5),
    "scaled_masked_softmax":
        lambda x: megatron.scaled_masked_softmax(x, torch.zeros(1, 1, 3, 3, dtype=torch.bool), 0.5),
    "scaled_softmax": lambda x: megatron.scaled_softmax(x, 0.5),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_runs_the_fused_kernel(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    calls = []
    real = ops._launch_fwd

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "_launch_fwd", counting)
    x = randn((1, 2, 3, 3))
    y = CALLS[name](x)
    assert calls == [torch.Size([1, 2, 3, 3])], f"{name}: Triton launches {calls}"
    causal = name == "scaled_upper_triang_masked_softmax"
    ref = lmfuse.fused_softmax(x, scale=0.5, causal=causal, impl="torch")
    assert_close(y.reshape(ref.shape), ref, F32, f"{name} vs fused_softmax reference")


def test_exports() -> None:
    assert set(megatron.__all__) == {
        "AttnMaskType", "FusedScaleMaskSoftmax", "scaled_masked_softmax", "scaled_softmax",
        "scaled_upper_triang_masked_softmax", "fused_vocab_parallel_cross_entropy",
        "vocab_parallel_cross_entropy", "bias_gelu_impl", "bias_swiglu_impl", "bias_geglu_impl",
        "weighted_bias_swiglu_impl", "weighted_bias_quick_geglu_impl",
        "weighted_squared_relu_impl", "linear_cross_entropy", "patch"}
    for name in megatron.__all__:
        assert callable(getattr(megatron, name)), name
    assert megatron.FusedScaleMaskSoftmax is lmfuse.FusedScaleMaskSoftmax
    assert megatron.AttnMaskType is lmfuse.AttnMaskType


# --- bad input -------------------------------------------------------------------------


@pytest.mark.parametrize("fn, args, error, message", [
    pytest.param(megatron.scaled_upper_triang_masked_softmax, (randn((1, 2, 3, 3)), 1.0),
                 ValueError, r"^scaled_upper_triang_masked_softmax: inputs must be "
                 r"\[attn_batches, sq, sk\], got \(1, 2, 3, 3\)", id="upper-triang-4d"),
    pytest.param(megatron.scaled_upper_triang_masked_softmax, ([[1.0]], 1.0), TypeError,
                 r"^scaled_upper_triang_masked_softmax: inputs must be a torch.Tensor, got list",
                 id="upper-triang-list"),
    pytest.param(megatron.scaled_upper_triang_masked_softmax, (randn((2, 4, 3)), 1.0),
                 ValueError, r"^scaled_upper_triang_masked_softmax: inputs \[attn_batches, "
                 r"sq, sk\] must have sq <= sk .*got \(2, 4, 3\)",
                 id="upper-triang-sq>sk"),
    pytest.param(megatron.scaled_masked_softmax, (randn((3, 4)), None, 1.0), ValueError,
                 r"^scaled_masked_softmax: inputs must be \[b, np, sq, sk\] or "
                 r"\[attn_batches, sq, sk\], got \(3, 4\)", id="masked-2d"),
    pytest.param(megatron.scaled_masked_softmax,
                 (randn((1, 2, 3, 4)), rand_bool((1, 1, 3, 5)), 1.0), ValueError,
                 r"^scaled_masked_softmax: mask of shape \(1, 1, 3, 5\) is not "
                 r"broadcastable to inputs",
                 id="masked-mask-shape"),
    pytest.param(megatron.scaled_masked_softmax,
                 (randn((1, 2, 3, 4)), torch.ones(1, 1, 3, 4, dtype=torch.int32), 1.0),
                 TypeError, r"^scaled_masked_softmax: mask must be bool",
                 id="masked-mask-int"),
    pytest.param(megatron.scaled_softmax, (randn((1, 1, 2, 3, 4)), 1.0), ValueError,
                 r"^scaled_softmax: inputs must be .*got \(1, 1, 2, 3, 4\)", id="softmax-5d"),
    pytest.param(megatron.scaled_softmax, (randn((1, 2, 3, 4)), "1"), TypeError,
                 r"^scaled_softmax: scale must be a float", id="softmax-scale-str"),
    pytest.param(megatron.scaled_softmax, (randn((1, 2, 3, 4)), float("nan")), ValueError,
                 r"^scaled_softmax: scale must be finite", id="softmax-scale-nan"),
    pytest.param(megatron.scaled_softmax,
                 (torch.ones(1, 2, 3, 4, dtype=torch.int64), 1.0), TypeError,
                 r"^scaled_softmax: inputs must have dtype", id="softmax-int-inputs"),
])
def test_bad_input_raises(fn, args, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        fn(*args)
