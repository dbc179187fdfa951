"""The shared helpers themselves: tolerance checks, input makers.

The gloo spawner's tests are in ``tests/distributed/test_spawn.py``.
"""

from __future__ import annotations

import pytest
import torch
from helpers import TOL, assert_close, rand_bool, randn, rel_err


def test_rel_err_is_relative_and_float64() -> None:
    b = torch.tensor([3.0, 4.0])
    assert rel_err(b, b) == 0.0
    assert rel_err(b + torch.tensor([0.0, 0.5]), b) == pytest.approx(0.1)
    # In float64: float32 would round 1 + 1e-9 to 1 and report 0.
    one = torch.ones(1, dtype=torch.float64)
    assert rel_err(one + 1e-9, one) == pytest.approx(1e-9, rel=1e-6)


def test_assert_close_catches_one_bad_element_in_many() -> None:
    expected = torch.softmax(torch.randn(1, 4097, dtype=torch.float64), -1).to(torch.bfloat16)
    actual = expected.clone()
    actual[0, int(expected.float().argmax())] = 0
    with pytest.raises(AssertionError, match="case-x"):
        assert_close(actual, expected, torch.bfloat16, "case-x")


def test_assert_close_rejects_nan_and_shape() -> None:
    expected = torch.ones(3)
    with pytest.raises(AssertionError, match="NaN"):
        assert_close(torch.tensor([1.0, float("nan"), 1.0]), expected, torch.float32, "nan")
    with pytest.raises(AssertionError, match="shape"):
        assert_close(torch.ones(4), expected, torch.float32, "shape")
    assert_close(expected * (1 + 0.5 * TOL[torch.float32]), expected, torch.float32, "ok")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=lambda d: str(d).replace("torch.", ""))
def test_randn_makes_nonzero_values_of_dtype(dtype: torch.dtype) -> None:
    t = randn((64, 33), dtype, requires_grad=True)
    assert t.dtype == dtype and t.shape == (64, 33) and t.requires_grad
    assert (t != 0).all()
    assert t.float().std() > 0.5
    m = rand_bool((1000,))
    assert m.dtype == torch.bool and 0 < int(m.sum()) < 1000
