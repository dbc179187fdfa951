"""Triton's interpreter without one repeated cost, for the test suite's CPU runs.

A kernel launch in the interpreter swaps ``triton.language``'s builtins for interpreted
ones (``_patch_lang``: ``inspect.getmembers`` over ``tl``, ``tl.tensor`` and ``tl.math``,
about 1.5 ms) and puts them back when the launch ends. Every call of a ``@triton.jit``
helper from inside a kernel (an epilogue, a load helper) does the same swap again, on
builtins that the launch has swapped already: 30-40% of the interpreter's time in the
suite's kernel tests. ``install()`` skips a helper's swap when the modules it sees are
ones its launch has swapped; a helper that sees another module (``tl.core`` where the
kernel saw only ``tl``) is swapped as before. What runs, and every result, is unchanged.

Installed by ``conftest.py`` and in the gloo ranks that ``spawn.py`` starts. With a
Triton whose interpreter lacks these names it installs nothing (``False``).
"""

from __future__ import annotations

import inspect
from typing import Any


class _NoChange:
    def restore(self) -> None:
        pass


def install() -> bool:
    """Wrap the interpreter's launch and language swap once per process; True if done."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch_lang = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or executor is None or getattr(patch_lang, "_lmfuse", False):
        return False
    langs_of_launch: list[set[int]] = []  # the swapped modules of the launch running now

    def langs(fn: Any) -> set[int]:
        return {id(v) for v in fn.__globals__.values()
                if inspect.ismodule(v) and (v is tl or v is tl.core)}

    def fast_patch_lang(fn: Any) -> Any:
        if langs_of_launch:
            seen = langs(fn)
            if langs_of_launch[-1] is not None and seen <= langs_of_launch[-1]:
                return _NoChange()  # a helper inside a launch: swapped already
            scope = patch_lang(fn)
            if langs_of_launch[-1] is None:
                langs_of_launch[-1] = seen  # the launch's own swap
            else:
                langs_of_launch[-1] |= seen
            return scope
        return patch_lang(fn)

    run = executor.__call__

    def launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        langs_of_launch.append(None)
        try:
            return run(self, *args, **kwargs)
        finally:
            langs_of_launch.pop()

    fast_patch_lang._lmfuse = True  # type: ignore[attr-defined]
    interpreter._patch_lang = fast_patch_lang
    executor.__call__ = launch
    return True


def install_bf16_rounding() -> bool:
    """Triton's interpreter casts float32 to bfloat16 by truncation (its ``cast_impl`` passes
    no rounding mode to ``_convert_float``), where a GPU rounds to nearest even: every
    bfloat16 value a kernel stored under the interpreter was up to an ulp toward zero (an
    RMSNorm's output 3.3e-3 from float64 where the GPU's is 1.7e-3; a model's gradients
    shrank step after step). Installed with :func:`install`: the cast rounds to nearest
    even (PyTorch's conversion, NaN kept), as the GPU's ``.to(tl.bfloat16)`` does. True if
    done."""
    try:
        import numpy as np
        import torch
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "cast_impl", None)
    np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if original is None or np_dtype is None or getattr(original, "_lmfuse", False):
        return False

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            data = np.asarray(src.data)
            f32 = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
            bits = f32.to(torch.bfloat16).view(torch.int16).numpy()
            return interpreter.TensorHandle(bits.view(np_dtype(dst_type)).reshape(data.shape),
                                            dst_type.scalar)
        return original(self, src, dst_type)

    cast_impl._lmfuse = True
    builder.cast_impl = cast_impl
    return True
