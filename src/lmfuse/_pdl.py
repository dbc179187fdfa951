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

import os

import torch

from ._dispatch import interpreter_active, triton_available

gdc_launch_dependents = gdc_wait = None
if triton_available():  # the host side below works without Triton (never enabled there)
    import triton
    import triton.language as tl

    try:  # Triton 3.4 and later
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:  # pragma: no cover - older Triton: never enabled
        pass


def mode(device: torch.device) -> int:
    """How kernels launched on ``device`` use programmatic dependent launch: 0 not at all,
    1 each lets the next one launch once it has waited for its own predecessors, 2 once
    its programs exit (``LMFUSE_PDL=0|1|2`` overrides the default)."""
    if gdc_wait is None or device.type != "cuda" or interpreter_active():
        return 0
    if torch.cuda.get_device_capability(device)[0] < 9:
        return 0
    value = os.environ.get("LMFUSE_PDL", "1").strip()
    return int(value) if value in ("0", "1", "2") else 1


def launch_options(pdl: int) -> dict:
    """The launch keyword that turns PDL on (nothing when off: the interpreter's launcher
    takes no such option)."""
    return {"launch_pdl": True} if pdl else {}


if triton_available():
    @triton.jit
    def pdl_start(PDL: tl.constexpr):
        """``PDL == 1``: let the next kernel launch now (its programs wait for this one
        before they read); 2: when this one's programs exit."""
        if PDL == 1:
            gdc_launch_dependents()

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """Wait until the kernels before this one are complete and their writes visible."""
        if PDL:
            gdc_wait()
