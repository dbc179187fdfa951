"""Triton kernel of the rotary position embedding: one, both ways (``BACKWARD``).

Read against ``reference.py``. A program owns one token ``(b, s)`` and ``BLOCK_H`` heads of
the queries or of the keys (the second grid axis walks the query heads' blocks, then the
keys'): it loads the token's ``cos`` and ``sin`` rows once (``R`` values, float32) and
rotates each head's first ``R`` values, halves ``x1 = x[:R/2]``, ``x2 = x[R/2:R]``::

    forward:   y1 = x1 cos1 - x2 sin1      y2 = x2 cos2 + x1 sin2
    backward:  y1 = x1 cos1 + x2 sin2      y2 = x2 cos2 - x1 sin1   (the transpose)

and copies the values past ``R`` (``HAS_PASS``, partial rotary). Heads sit ``sh`` apart,
tokens ``ss``, batches ``sb``; a head's values are contiguous. ``cos``/``sin`` rows sit
``scs``/``sss`` apart and their batches ``scb``/``ssb`` (0: one table for every sequence).
Math in float32, each output rounded once to its tensor's dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, sxb, sxh, sxs, y_ptr, syb, syh, sys, b, s, h0, H, half, D,
                  c1, c2, s1, s2, BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_R: tl.constexpr, HAS_PASS: tl.constexpr, BLOCK_P: tl.constexpr):
    heads = h0 + tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_R)
    mask = (heads < H)[:, None] & (j < half)[None, :]
    x_row = x_ptr + b * sxb + s * sxs + heads[:, None].to(tl.int64) * sxh
    y_row = y_ptr + b * syb + s * sys + heads[:, None].to(tl.int64) * syh
    x1 = tl.load(x_row + j[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + half + j[None, :], mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(y_row + j[None, :], y1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_row + half + j[None, :], y2.to(y_ptr.dtype.element_ty), mask=mask)
    if HAS_PASS:
        p = 2 * half + tl.arange(0, BLOCK_P)
        pmask = (heads < H)[:, None] & (p < D)[None, :]
        tl.store(y_row + p[None, :], tl.load(x_row + p[None, :], mask=pmask), mask=pmask)


@triton.jit
def rope_kernel(
    q_ptr, sqb, sqh, sqs, qo_ptr, sob, soh, sos, Hq,
    k_ptr, skb, skh, sks, ko_ptr, spb, sph, sps, Hk,
    cos_ptr, scb, scs, sin_ptr, ssb, sss, S, half, D,
    BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
    HAS_PASS: tl.constexpr, BLOCK_P: tl.constexpr,
):
    token = tl.program_id(0)
    b = (token // S).to(tl.int64)
    s = (token % S).to(tl.int64)
    hb = tl.program_id(1)
    j = tl.arange(0, BLOCK_R)
    jm = j < half
    c_row = cos_ptr + b * scb + s * scs
    s_row = sin_ptr + b * ssb + s * sss
    c1 = tl.load(c_row + j, mask=jm, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(c_row + half + j, mask=jm, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(s_row + j, mask=jm, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(s_row + half + j, mask=jm, other=0.0).to(tl.float32)[None, :]
    q_blocks = tl.cdiv(Hq, BLOCK_H)
    if hb < q_blocks:
        _rotate_heads(q_ptr, sqb, sqh, sqs, qo_ptr, sob, soh, sos, b, s, hb * BLOCK_H, Hq,
                      half, D, c1, c2, s1, s2, BACKWARD, BLOCK_H, BLOCK_R, HAS_PASS, BLOCK_P)
    else:
        _rotate_heads(k_ptr, skb, skh, sks, ko_ptr, spb, sph, sps, b, s,
                      (hb - q_blocks) * BLOCK_H, Hk, half, D, c1, c2, s1, s2, BACKWARD,
                      BLOCK_H, BLOCK_R, HAS_PASS, BLOCK_P)
