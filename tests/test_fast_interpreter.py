"""``tests/fast_interpreter.py``: the suite's interpreter skips a ``@triton.jit`` helper's
language swap inside a launch, and nothing else changes: the kernel's results, and the
builtins put back after the launch."""

from __future__ import annotations

import fast_interpreter
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter


@triton.jit
def _twice(x):
    return x * 2.0


@triton.jit
def _helper_kernel(X, Y, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(X + i, mask=m, other=0.0)
    tl.store(Y + i, _twice(x) + tl.exp(x), mask=m)


def test_installed_and_installs_once() -> None:
    assert getattr(interpreter._patch_lang, "_lmfuse", False)
    assert fast_interpreter.install() is False  # conftest.py did


def test_helpers_in_a_launch_swap_nothing_and_results_hold(monkeypatch) -> None:
    swaps = []
    inner = interpreter._patch_lang

    def counting(fn):
        scope = inner(fn)
        swaps.append((fn.__name__, type(scope).__name__))
        return scope

    monkeypatch.setattr(interpreter, "_patch_lang", counting)
    x = torch.randn(37)
    y = torch.empty(37)
    _helper_kernel[(3,)](x, y, 37, BLOCK=16)
    torch.testing.assert_close(y, x * 2 + x.exp())
    # The launch's own swap, then each program's helper call swapped nothing.
    assert swaps[0] == ("_helper_kernel", "_LangPatchScope")
    assert [s for _, s in swaps[1:]] == ["_NoChange"] * 3
    # The builtins are Triton's own again after the launch.
    assert tl.core.is_builtin(tl.arange) and tl.core.is_builtin(tl.load)


def test_float32_to_bfloat16_rounds_to_nearest_even() -> None:
    """Stores of float32 values into bfloat16 round to nearest even under the test suite's
    interpreter, as on a GPU (Triton's interpreter truncates), NaN and inf kept."""
    import triton
    import triton.language as tl

    @triton.jit
    def store(X, Y, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(Y + i, tl.load(X + i).to(tl.bfloat16))

    x = torch.randn(1024, dtype=torch.float32)
    x[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0 + 2**-8 + 2**-9])
    y = torch.empty(1024, dtype=torch.bfloat16)
    store[(1,)](x, y, N=1024)
    want = x.to(torch.bfloat16)
    assert torch.equal(y[1:], want[1:]) and y[0].isnan()
