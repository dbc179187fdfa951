"""The small helpers every family's launcher uses: ceiling division and powers of two for
grids and block sizes, dtype names for messages, the shared dtype sets, the saturating fp8
cast and whether a GPU's kernels can convert to fp8, the lazy import of a family's Triton
kernels, and :func:`kernel_op`, the one way a launch is called: directly when eager, through
its ``torch.library`` custom op under ``torch.compile``.

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
           "is_pow2", "dtype_name", "lazy_kernels", "kernel_op", "to_e4m3", "fp8_capable"]

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


def kernel_op(name: str, fake: Callable[..., Any], *,
              mutates_args: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], Any]:
    """Register a launch function as the custom op ``lmfuse::name`` and return what the ops
    call in its place: the launch itself when eager (the dispatcher costs tens of
    microseconds a call), the custom op while ``torch.compile`` traces (an opaque node, so
    the graph does not break). ``fake`` computes the outputs' shapes for tracing;
    ``mutates_args`` names the arguments written in place.

    The launch takes what a custom op can (tensors, optional tensors, numbers, bools,
    strings, dtypes), fully annotated, and returns new tensors (or None); the same body runs
    both ways, so eager and compiled calls compute alike. The result keeps the custom op as
    ``.op`` (for ``torch.library.opcheck``) and the plain function as ``.launch``::

        @kernel_op("rms_norm_fwd", fake=lambda x, w, eps: ...)
        def _launch_fwd(x: torch.Tensor, w: Optional[torch.Tensor], eps: float) -> ...:
            ...
    """

    def register(launch: Callable[..., Any]) -> Callable[..., Any]:
        op = torch.library.custom_op(f"lmfuse::{name}", launch, mutates_args=mutates_args)
        op.register_fake(fake)

        @functools.wraps(launch)
        def call(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                return op(*args, **kwargs)
            return launch(*args, **kwargs)

        call.op, call.launch = op, launch
        return call

    return register
