"""Reference rotary position embedding: the specification of ``lmfuse.apply_rotary_pos_emb``,
in plain PyTorch.

Hugging Face's "rotate half" form (Llama, Mistral, Qwen, Gemma, ...): with ``R`` the last
dim of ``cos`` and ``sin`` (even, at most the head size ``D``), each head's first ``R``
values ``x = [x1, x2]`` (halves of ``R / 2``) become::

    y = x * cos + rotate_half(x) * sin,   rotate_half(x) = [-x2, x1]

that is ``y1 = x1 * cos1 - x2 * sin1`` and ``y2 = x2 * cos2 + x1 * sin2`` for the halves
of ``cos`` and ``sin``; the values past ``R`` pass through (partial rotary, as GPT-NeoX's
``rotary_pct``). ``cos`` and ``sin`` are ``[B, S, R]`` (or ``[S, R]``, broadcast over the
batch), one row per token; ``unsqueeze_dim``, as in transformers, is where the tables gain
a dim before they broadcast against the heads (``[B, S, R]``: 1 for ``[B, H, S, D]``, the
attention layout, 2 for ``[B, S, H, D]``; ``[S, R]``: 0 and 1).

The math runs in float32 (float64 where an input is float64) and each result is rounded once
to its dtype, the input's promoted with the tables' as the formula's products promote them
(bf16 queries with float32 tables, as under autocast, give float32). Hugging Face's eager
code rounds each product and the sum to that dtype, so in 16-bit dtypes the two differ by a
few roundings. NaN and inf propagate as in the formula (an inf times a 0 sine is NaN). The
function is plain differentiable torch code: autograd gives the reference gradients.
"""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, promote: bool) -> torch.Tensor:
    wide = torch.promote_types(x.dtype, torch.promote_types(c.dtype, s.dtype))
    out = wide if promote else x.dtype
    compute = torch.float64 if wide == torch.float64 else torch.float32
    R = c.shape[-1]
    xf, c, s = x.to(compute), c.to(compute), s.to(compute)
    x1, x2, rest = xf[..., :R // 2], xf[..., R // 2:R], xf[..., R:]
    c1, c2 = c[..., :R // 2], c[..., R // 2:]
    s1, s2 = s[..., :R // 2], s[..., R // 2:]
    return torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2, rest), -1).to(out)


def rotary_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     unsqueeze_dim: int = 1, *, promote: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_embed, k_embed)``: ``q`` and ``k`` rotated by ``cos``, ``sin``.

    Args:
        q: ``[B, Hq, S, D]`` or ``[B, S, Hq, D]``.
        k: the same layout with its own head count.
        cos, sin: ``[B, S, R]`` or ``[S, R]``, ``R`` even and at most ``D``.
        unsqueeze_dim: as in transformers: the tables gain a dim there, then broadcast
            against q and k (``[B, S, R]``: 1 for ``[B, H, S, D]``, 2 for ``[B, S, H, D]``;
            ``[S, R]``: 0 and 1).
        promote: True: each output in its input's dtype promoted with the tables'
            (``torch.promote_types``: the formula's); False: in its input's dtype (the
            math unchanged), as modeling functions that cast their results back (OLMo 2's).
    Returns:
        q's and k's rotations, each in its input's shape.
    """
    c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _rotate(q, c, s, promote), _rotate(k, c, s, promote)
