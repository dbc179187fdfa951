"""The kernels' side of programmatic dependent launch (see ``_pdl``): ``pdl_wait`` and
``pdl_start``, called first in every kernel that takes a ``PDL`` flag. Imported by the kernel
modules only (through ``_pdl``), so that importing lmfuse does not import Triton."""

from __future__ import annotations

import triton
import triton.language as tl

try:  # Triton 3.4 and later
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL is never enabled (_pdl.mode)
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """``PDL == 1``: let the next kernel launch now (its programs wait for this one before
    they read); 2: when this one's programs exit."""
    if PDL == 1:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the kernels before this one are complete and their writes visible."""
    if PDL:
        gdc_wait()
