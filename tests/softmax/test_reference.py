"""The reference ``fused_softmax_reference`` against a naive construction built from loops.

The naive version shares no code with the reference: it decides visibility key by key
with explicit conditions, then calls ``torch.softmax`` on a ``-inf``-filled tensor in
float64 (with the sink as an extra column, like Megatron's SoftmaxOne).
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, rand_bool, randn

from lmfuse.softmax.reference import UNBOUNDED, fused_softmax_reference, visible_keys

F64 = torch.float64


def naive_visible(sq: int, sk: int, causal: bool, window: int | tuple[int, int] | None
                  ) -> torch.Tensor:
    """[sq, sk] bool: query i (at key position p = i + sk - sq) sees key j."""
    vis = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        p = i + (sk - sq)
        for j in range(sk):
            ok = True
            if causal and j > p:
                ok = False
            if isinstance(window, int) and not (p - window <= j <= p):
                ok = False
            if isinstance(window, tuple):
                left, right = window
                if left != -1 and j < p - left:
                    ok = False
                if right != -1 and j > p + right:
                    ok = False
            vis[i, j] = ok
    return vis


def naive_softmax(scores: torch.Tensor, *, scale: float = 1.0, mask: torch.Tensor | None = None,
                  causal: bool = False, window: int | tuple[int, int] | None = None,
                  offset: torch.Tensor | None = None) -> torch.Tensor:
    """Float64 softmax of the visible scaled scores; rows with nothing visible are zeros."""
    b, h, sq, sk = scores.shape
    z = scores.to(F64) * scale
    vis = naive_visible(sq, sk, causal, window).expand(b, h, sq, sk)
    if mask is not None and mask.dtype == torch.bool:
        vis = vis & ~mask.expand(b, h, sq, sk)
    elif mask is not None:
        z = z + mask.to(F64)
    z = z.masked_fill(~vis, float("-inf"))
    if offset is not None:  # SoftmaxOne: the sink is one more logit, dropped afterwards
        sink = offset.to(F64).view(1, h, 1, 1).expand(b, h, sq, 1)
        y = torch.softmax(torch.cat([z, sink], dim=-1), dim=-1)[..., :-1]
    else:
        y = torch.softmax(z, dim=-1)
    # torch.softmax of an all -inf row is NaN; the spec says zeros.
    any_visible = vis.any(dim=-1, keepdim=True)
    return torch.where(any_visible, y, torch.zeros_like(y))


def _bounds(causal: bool, window: int | tuple[int, int] | None) -> tuple[int, int]:
    """The reference's resolved (left, right), written out independently of ops.py."""
    left = right = UNBOUNDED
    if isinstance(window, int):
        left, right = window, 0
    elif isinstance(window, tuple):
        left = UNBOUNDED if window[0] == -1 else window[0]
        right = UNBOUNDED if window[1] == -1 else window[1]
    if causal:
        right = min(right, 0)
    return left, right


BANDS = [
    pytest.param(False, None, id="none"),
    pytest.param(True, None, id="causal"),
    pytest.param(False, 2, id="window2"),
    pytest.param(False, 0, id="window0"),
    pytest.param(False, (1, 2), id="window(1,2)"),
    pytest.param(False, (-1, 1), id="window(-1,1)"),
    pytest.param(False, (2, -1), id="window(2,-1)"),
    pytest.param(True, (3, 2), id="causal+window(3,2)"),
]
SHAPES = [
    pytest.param((2, 3, 5, 5), id="sq=sk"),
    pytest.param((1, 2, 3, 7), id="sq<sk"),
    pytest.param((1, 2, 1, 4), id="sq=1"),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal, window", BANDS)
def test_band_matches_naive(shape: tuple[int, ...], causal: bool,
                            window: int | tuple[int, int] | None) -> None:
    x = randn(shape, F64)
    left, right = _bounds(causal, window)
    y = fused_softmax_reference(x, scale=0.8, left=left, right=right)
    expected = naive_softmax(x, scale=0.8, causal=causal, window=window)
    assert_close(y, expected, F64, f"band causal={causal} window={window} shape={shape}")


def test_visible_keys_causal_is_bottom_right_aligned() -> None:
    vis = visible_keys(2, 5, UNBOUNDED, 0, torch.device("cpu"))
    expected = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(vis, expected)


def test_window_int_sees_w_keys_back_and_itself() -> None:
    vis = visible_keys(4, 4, 1, 0, torch.device("cpu"))
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]],
                            dtype=torch.bool)
    assert torch.equal(vis, expected)


MASK_SHAPES = [
    pytest.param(lambda b, h, q, k: (b, 1, q, k), id="b1qk"),
    pytest.param(lambda b, h, q, k: (b, 1, 1, k), id="b11k"),
    pytest.param(lambda b, h, q, k: (1, h, 1, 1), id="1h11"),
    pytest.param(lambda b, h, q, k: (q, k), id="qk"),
    pytest.param(lambda b, h, q, k: (b, h, q, k), id="bhqk"),
]


@pytest.mark.parametrize("mask_shape", MASK_SHAPES)
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_mask_matches_naive(mask_shape, kind: str) -> None:
    b, h, q, k = 2, 3, 4, 6
    x = randn((b, h, q, k), F64)
    shape = mask_shape(b, h, q, k)
    mask = rand_bool(shape) if kind == "bool" else randn(shape, F64)
    y = fused_softmax_reference(x, scale=1.3, mask=mask)
    expected = naive_softmax(x, scale=1.3, mask=mask)
    assert_close(y, expected, F64, f"{kind} mask {shape}")


@pytest.mark.parametrize("causal, window", [pytest.param(False, None, id="plain"),
                                            pytest.param(True, None, id="causal"),
                                            pytest.param(False, (1, 1), id="window(1,1)")])
def test_offset_is_softmax_one(causal: bool, window) -> None:
    x = randn((2, 3, 4, 5), F64)
    offset = randn((3,), F64)
    left, right = _bounds(causal, window)
    y = fused_softmax_reference(x, left=left, right=right, softmax_offset=offset)
    expected = naive_softmax(x, causal=causal, window=window, offset=offset)
    assert_close(y, expected, F64, f"sink causal={causal} window={window}")
    assert (y.sum(-1) < 1).all(), "the sink must take some probability from every row"


def test_causal_mask_and_offset_combined() -> None:
    x = randn((2, 2, 3, 6), F64)
    mask = rand_bool((2, 1, 3, 6))
    offset = randn((2,), F64)
    y = fused_softmax_reference(x, scale=0.5, mask=mask, right=0, softmax_offset=offset)
    expected = naive_softmax(x, scale=0.5, mask=mask, causal=True, offset=offset)
    assert_close(y, expected, F64, "causal+bool mask+sink")


@pytest.mark.parametrize("with_offset", [False, True], ids=["no-sink", "sink"])
def test_fully_masked_rows_are_zeros(with_offset: bool) -> None:
    x = randn((1, 2, 3, 4), F64, requires_grad=True)
    mask = torch.zeros(1, 1, 3, 4, dtype=torch.bool)
    mask[..., 1, :] = True
    offset = randn((2,), F64, requires_grad=True) if with_offset else None
    y = fused_softmax_reference(x, mask=mask, softmax_offset=offset)
    assert torch.equal(y[..., 1, :], torch.zeros_like(y[..., 1, :]))
    assert not torch.isnan(y).any()
    assert y[..., 0, :].sum() > 0
    y.backward(randn(y.shape, F64))
    assert not torch.isnan(x.grad).any()
    assert torch.equal(x.grad[..., 1, :], torch.zeros_like(x.grad[..., 1, :]))
    if offset is not None:
        assert torch.isfinite(offset.grad).all()


def test_window_rows_before_the_first_key_are_zeros() -> None:
    # sq > sk without causal: rows 0..1 sit at key positions -2, -1 and see nothing.
    x = randn((1, 1, 5, 3), F64)
    left, right = _bounds(False, (1, 0))
    y = fused_softmax_reference(x, left=left, right=right)
    assert torch.equal(y[..., :2, :], torch.zeros(1, 1, 2, 3, dtype=F64))
    assert_close(y, naive_softmax(x, window=(1, 0)), F64, "window rows before key 0")


def test_additive_neg_inf_mask_row_gives_zeros() -> None:
    x = randn((1, 1, 2, 3), F64)
    mask = torch.zeros(1, 1, 2, 3, dtype=F64)
    mask[..., 0, :] = float("-inf")
    y = fused_softmax_reference(x, mask=mask)
    assert torch.equal(y[..., 0, :], torch.zeros(1, 1, 3, dtype=F64))
    assert_close(y[..., 1, :], torch.softmax(x[..., 1, :], -1), F64, "unmasked row")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=lambda d: str(d).replace("torch.", ""))
def test_output_dtype_and_float32_math(dtype: torch.dtype) -> None:
    # Scores whose softmax underflows/overflows in half precision if computed there.
    x = randn((1, 2, 3, 9), dtype, scale=8.0)
    y = fused_softmax_reference(x, scale=3.0, right=0)
    assert y.dtype == dtype
    expected = naive_softmax(x, scale=3.0, causal=True).to(dtype)
    assert_close(y, expected, dtype, f"reference in {dtype}")


def test_gradcheck_scores_offset_additive_mask() -> None:
    x = randn((1, 2, 3, 4), F64, requires_grad=True)
    mask = randn((1, 1, 3, 4), F64, requires_grad=True)
    offset = randn((2,), F64, requires_grad=True)

    def f(x, mask, offset):
        return fused_softmax_reference(x, scale=0.7, mask=mask, left=2, right=0,
                                       softmax_offset=offset)

    assert torch.autograd.gradcheck(f, (x, mask, offset))


def test_gradcheck_with_fully_masked_row() -> None:
    x = randn((1, 1, 3, 4), F64, requires_grad=True)
    offset = randn((1,), F64, requires_grad=True)
    mask = torch.zeros(1, 1, 3, 4, dtype=torch.bool)
    mask[..., 2, :] = True

    def f(x, offset):
        return fused_softmax_reference(x, mask=mask, right=0, softmax_offset=offset)

    assert torch.autograd.gradcheck(f, (x, offset))


def test_gradients_match_naive() -> None:
    x = randn((2, 2, 3, 5), F64, requires_grad=True)
    mask = randn((2, 1, 1, 5), F64, requires_grad=True)
    offset = randn((2,), F64, requires_grad=True)
    g = randn((2, 2, 3, 5), F64)
    got = torch.autograd.grad(
        fused_softmax_reference(x, scale=1.1, mask=mask, right=0, softmax_offset=offset),
        (x, mask, offset), g)
    want = torch.autograd.grad(
        naive_softmax(x, scale=1.1, mask=mask, causal=True, offset=offset), (x, mask, offset), g)
    for name, a, e in zip(("scores", "mask", "offset"), got, want):
        assert_close(a, e, F64, f"d {name}")
