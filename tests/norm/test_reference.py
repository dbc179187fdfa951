"""The RMSNorm reference (``lmfuse.norm.reference``) against the formulas it specifies.

Cases: Llama's ``weight * x / rms`` and Gemma's ``(1 + weight)`` written out in float64,
one rounding to x's dtype (not one per step, as Hugging Face's Llama rounds before the
weight), float64 math for float64 input, no weight, the normalised rows' unit mean square,
scale invariance, row independence, rstd, and gradients against a float64 gradcheck.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, randn

from lmfuse.norm.reference import compute_dtype, rms_norm_reference, rms_norm_rstd_reference

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
DTYPES = [pytest.param(d, id=str(d).replace("torch.", "")) for d in (F32, F16, BF16)]


def by_hand(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
            offset: float) -> torch.Tensor:
    """The formula in float64: ``x / sqrt(mean(x**2) + eps) * (weight + offset)``."""
    x = x.to(F64)
    y = x / torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps)
    return y if weight is None else y * (weight.to(F64) + offset)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0, -0.25])
def test_matches_the_formula(dtype: torch.dtype, offset: float) -> None:
    x, w = randn((3, 5, 37), dtype, scale=3.0), randn((37,), dtype)
    y = rms_norm_reference(x, w, eps=1e-5, weight_offset=offset)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, by_hand(x, w, 1e-5, offset), dtype, f"{dtype} offset {offset}")


def test_rounds_once_at_the_end() -> None:
    """The float32 result rounded to bf16 once: exactly, not the value of a bf16 step."""
    x, w = randn((64, 48), BF16), randn((48,), F32)
    y = rms_norm_reference(x, w, eps=1e-6)
    expected = by_hand(x, w, 1e-6, 0.0).to(F32).to(BF16)
    # float32 and float64 math may differ in the last float32 bit, which can flip a bf16
    # rounding now and then; a per-step rounding would differ in many elements.
    assert (y != expected).float().mean().item() < 0.01
    hf_style = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
                ).to(BF16) * w.to(BF16)
    assert (y != hf_style).float().mean().item() > 0.05, "the rounding points do not differ?"


def test_float64_math_for_float64_input() -> None:
    x, w = randn((4, 33), F64), randn((33,), F64)
    y = rms_norm_reference(x, w, eps=1e-6, weight_offset=0.5)
    assert y.dtype == F64
    assert torch.allclose(y, by_hand(x, w, 1e-6, 0.5), rtol=1e-14, atol=0)
    assert compute_dtype(F64) == F64 and compute_dtype(BF16) == F32


def test_weight_none_is_no_affine_step() -> None:
    x = randn((6, 20), F32)
    plain = rms_norm_reference(x, None, eps=1e-6)
    assert torch.equal(plain, rms_norm_reference(x, None, eps=1e-6, weight_offset=1.0))
    assert torch.allclose(plain, rms_norm_reference(x, torch.ones(20), eps=1e-6))
    assert torch.allclose(plain, rms_norm_reference(x, torch.zeros(20), weight_offset=1.0))


def test_unit_mean_square_scale_invariance_and_rows_independent() -> None:
    x = randn((5, 64), F64, scale=7.0)
    y = rms_norm_reference(x, None, eps=0.0)
    assert torch.allclose(y.square().mean(-1), torch.ones(5, dtype=F64), rtol=1e-12)
    assert torch.allclose(rms_norm_reference(3.5 * x, None, eps=0.0), y, rtol=1e-12)
    rows = torch.stack([rms_norm_reference(r, None, eps=0.0) for r in x])
    assert torch.equal(rows, y)


def test_eps_matters_for_small_rows() -> None:
    x = torch.full((1, 4), 1e-3, dtype=F64)
    y = rms_norm_reference(x, None, eps=1e-6)
    assert torch.allclose(y, x / (1e-6 + 1e-6) ** 0.5)


def test_rstd() -> None:
    x = randn((2, 3, 10), F16)
    rstd = rms_norm_rstd_reference(x, eps=1e-5)
    assert rstd.dtype == F32 and rstd.shape == (2, 3)
    want = 1 / torch.sqrt(x.double().square().mean(-1) + 1e-5)
    assert torch.allclose(rstd.double(), want, rtol=1e-6)


def test_gradcheck() -> None:
    x = randn((3, 7), F64, requires_grad=True)
    w = randn((7,), F64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, w: rms_norm_reference(x, w, eps=1e-3, weight_offset=1.0), (x, w))
