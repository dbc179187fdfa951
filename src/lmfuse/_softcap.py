"""tanh for the kernels' logit softcaps (``c tanh(x / c)``): decode attention's scores and the
cross-entropies' logits. One definition, below the families (it imports Triton: the kernels
modules import it, nothing imported by ``import lmfuse`` does; which form a launch takes is
``_launch.softcap_mode``).
"""

from __future__ import annotations

import triton


@triton.jit
def tanh_over_z(w):
    """``tanh(z) / z`` for ``w = z ** 2``, ``|z| < 1/8``: tanh's odd series to ``z ** 9``
    (relative error < 1e-10 there, where the exponential forms cancel: ``1 - e^(-2|z|)``
    loses ~ulp(1) absolute, ~cap ulp(1) in a capped value)."""
    return 1.0 + w * (-0.3333333333333333 + w * (0.13333333333333333 + w * (
        -0.05396825396825397 + w * 0.021869488536155203)))
