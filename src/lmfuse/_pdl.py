"""Programmatic dependent launch (PDL) for the kernels of a decode step.

A decode step is a chain of short kernels. Launched one after the other, each is scheduled
only once its predecessor has finished, and the GPU idles through every launch and ramp.
With PDL (Hopper and later) a kernel launched with ``launch_pdl=True`` may start while its
predecessor still runs, once every program of the predecessor has signalled
(``gdc_launch_dependents``) or exited; its programs then wait (``gdc_wait``: the
predecessor complete and its writes visible) before they touch memory.

Rules every kernel taking a ``PDL`` flag keeps:

* ``pdl_wait(PDL)`` first, in every program, before any load or store; then
  ``pdl_start(PDL)``. A kernel launched early that read before its wait would see its
  predecessor's output half written (a test checks the order in each kernel's source).
  Waits chain: a kernel's predecessor finished only after its own wait, so one wait covers
  every kernel before it.
* ``PDL`` is a ``tl.constexpr``: 0 (off) leaves the kernel as it was (and runnable in
  Triton's interpreter, which has no grid dependency control); 1 lets the next kernel
  launch as soon as this one's programs have waited; 2 only when they exit (what a kernel
  followed by a cuBLAS launch uses: the library's kernels are not ours to audit).

:func:`mode` says which a launch on a device uses.
"""

from __future__ import annotations

import functools

import torch

from ._dispatch import interpreter_active, triton_available
from ._launch import env_setting


@functools.lru_cache(maxsize=None)
def _gdc_available() -> bool:
    """Whether this Triton has the grid dependency control calls (3.4 and later); asked at
    the first launch on a Hopper GPU, so that importing lmfuse does not import Triton."""
    if not triton_available():
        return False
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:  # pragma: no cover - older Triton: never enabled
        return False
    return True


def mode(device: torch.device) -> int:
    """How kernels launched on ``device`` use programmatic dependent launch: 0 not at all,
    1 each lets the next one launch once it has waited for its own predecessors, 2 once
    its programs exit (``LMFUSE_PDL=0|1|2`` overrides the default; another value warns
    and keeps it)."""
    if device.type != "cuda" or interpreter_active() or not _gdc_available():
        return 0
    if torch.cuda.get_device_capability(device)[0] < 9:
        return 0
    return int(env_setting("LMFUSE_PDL", "1", {"0": "0", "1": "1", "2": "2"}))


def launch_options(pdl: int) -> dict:
    """The launch keyword that turns PDL on (nothing when off: the interpreter's launcher
    takes no such option)."""
    return {"launch_pdl": True} if pdl else {}


def __getattr__(name: str):
    """The kernels' side, ``pdl_start`` and ``pdl_wait`` (``_pdl_kernels``), imported by
    the kernel modules that use them: made when the first of those is imported, which
    imports Triton (importing lmfuse does not)."""
    if name in ("pdl_start", "pdl_wait"):
        from . import _pdl_kernels

        return getattr(_pdl_kernels, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
