"""The small helpers every family's launcher uses: ceiling division and powers of two for
grids and block sizes, dtype names for messages, the shared dtype sets, the saturating fp8
cast and whether a GPU's kernels can convert to fp8, and the lazy import of a family's
Triton kernels.

It sits below every other module (it imports torch alone) and never imports ``triton``:
``import lmfuse`` works where Triton is absent (the reference path still runs); a family's
kernels module is imported on its first launch.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any, Callable

import torch

__all__ = ["FLOAT_DTYPES", "KERNEL_DTYPES", "INDEX_DTYPES", "FP8_DTYPES", "cdiv", "next_pow2",
           "is_pow2", "dtype_name", "lazy_kernels", "to_e4m3", "fp8_capable"]

#: The floating dtypes the ops take (``check_tensor``'s default).
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
#: The dtypes the Triton kernels compute on (float64 inputs take the reference path).
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Integer dtypes taken for indices and lengths (block tables, positions, targets).
INDEX_DTYPES = (torch.int32, torch.int64)
#: The fp8 format the kernels store and read (KV caches, saved activations).
FP8_DTYPES = (torch.float8_e4m3fn,)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints (``b > 0``), without going through floats."""
    return -(-a // b)


def next_pow2(n: int, minimum: int = 1) -> int:
    """The smallest power of two ``>= n``, and at least ``minimum`` (1 for ``n <= 1``)."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


def is_pow2(v: Any) -> bool:
    """True for a positive ``int`` (not a bool) that is a power of two."""
    return isinstance(v, int) and not isinstance(v, bool) and v > 0 and v & (v - 1) == 0


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: a dtype as messages and tables spell it."""
    return str(dtype).replace("torch.", "")


def to_e4m3(t: torch.Tensor) -> torch.Tensor:
    """``t`` as float8_e4m3fn, saturated at +-448 as the kernels' own fp8 stores are (torch's
    CUDA cast turns magnitudes above 464 into NaN); NaN stays NaN (clamp keeps it)."""
    return t.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


@functools.lru_cache(maxsize=None)
def fp8_capable(device: torch.device) -> bool:
    """A CUDA device on which Triton compiles float8_e4m3fn conversions and loads (compute
    capability 8.9 and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def lazy_kernels(module: str, package: str) -> Callable[[], ModuleType]:
    """A function returning the kernels module ``package.module``, imported on its first call
    and kept. Triton reads ``TRITON_INTERPRET`` when a kernel is defined, and ``lmfuse``
    must import without triton: so no family imports its kernels at import time.

    A family binds it once, ``_kernels = lazy_kernels("kernels", __package__)``, and
    launches ``_kernels().some_kernel[grid](...)`` (tests may replace ``_kernels``)."""
    loaded: ModuleType | None = None

    def kernels() -> ModuleType:
        nonlocal loaded
        if loaded is None:
            loaded = importlib.import_module(f".{module}", package)
        return loaded

    return kernels
