"""NVTX ranges around every op's forward and backward, for Nsight Systems timelines.

With ``LMFUSE_NVTX=1`` in the environment (read once, when lmfuse is imported) each public
op's forward runs inside a range named ``lmfuse.<op>.fwd`` and its backward inside
``lmfuse.<op>.bwd`` (``lmfuse.swiglu.fwd``, ``lmfuse.cross_entropy.bwd``, ...), so
``nsys profile`` shows which op the kernels under it belong to.

Off (the default), :func:`nvtx_range` reads one module constant and returns one shared
no-op context: nothing is allocated or formatted, and ``torch.compile`` traces it without a
graph break. On, ranges are still skipped while ``torch.compile`` traces (a range push is a
host call a graph cannot hold), and on a machine without CUDA, where ``torch.cuda.nvtx``
cannot run, a range only records its name (see :func:`enable`).
"""

from __future__ import annotations

import contextlib
import functools
from typing import ContextManager, Optional

import torch

from ._launch import ON_OFF, env_setting

_ENABLED = env_setting("LMFUSE_NVTX", "off", ON_OFF) == "on"
_NULL = contextlib.nullcontext()
_record: Optional[list[str]] = None


def enable(on: bool, record: Optional[list[str]] = None) -> None:
    """Turn the ranges on or off (overriding ``LMFUSE_NVTX``), e.g. around one profiled step.

    ``record``: a list each range's name is appended to as it opens (tests; ``None`` stops).
    """
    global _ENABLED, _record
    _ENABLED, _record = bool(on), record


@functools.lru_cache(maxsize=None)
def _nvtx_usable() -> bool:
    # CPU builds of torch ship torch.cuda.nvtx stubs that raise when called.
    return torch.cuda.is_available()


class _Range:
    __slots__ = ("name", "pushed")

    def __init__(self, name: str) -> None:
        self.name, self.pushed = name, False

    def __enter__(self) -> None:
        if _record is not None:
            _record.append(self.name)
        if _nvtx_usable():
            torch.cuda.nvtx.range_push(self.name)
            self.pushed = True

    def __exit__(self, *exc) -> None:
        if self.pushed:
            torch.cuda.nvtx.range_pop()


def nvtx_range(op: str, phase: str) -> ContextManager[None]:
    """``with nvtx_range("swiglu", "fwd"):`` — the range ``lmfuse.swiglu.fwd`` when enabled."""
    if not _ENABLED or torch.compiler.is_compiling():
        return _NULL
    return _Range(f"lmfuse.{op}.{phase}")
