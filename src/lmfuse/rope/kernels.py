"""Triton kernels of the rotary position embedding: one body, both ways (``BACKWARD``), in
two launch forms.

Read against ``reference.py``. A program owns one token ``(b, s)``: it loads the token's
``cos`` and ``sin`` rows once (``R`` values, float32), then walks the token's query heads
``BLOCK_HQ`` at a time and its key heads ``BLOCK_HK`` at a time (when there are few tokens,
the grid's second axis splits a token's head blocks over several programs, block
``split``, ``split + splits``, ...), and rotates each head's first ``R`` values, halves
``x1 = x[:R/2]``, ``x2 = x[R/2:R]``::

    forward:   y1 = x1 cos1 - x2 sin1      y2 = x2 cos2 + x1 sin2
    backward:  y1 = x1 cos1 + x2 sin2      y2 = x2 cos2 - x1 sin1   (the transpose)

and copies the values past ``R`` (``HAS_PASS``, partial rotary). The head counts, ``R / 2``
(``half``) and the head size ``D`` are compile-time constants. Math in float32, each output
rounded once to its tensor's dtype (which may differ from its input's: transformers' formula
promotes bf16 queries and float32 tables to float32).

``rope_kernel`` takes every stride: heads sit ``sh`` apart, tokens ``ss``, batches ``sb``
(a head's values contiguous); ``cos``/``sin`` rows ``scs``/``sss`` apart and their batches
``scb``/``ssb`` (0: one table for every sequence). ``rope_dense_kernel`` is the same body for
the layouts models make (q, k and their outputs dense, tokens outer ``[B, S, H, D]`` or heads
outer ``[B, H, S, D]`` in memory; contiguous tables): its strides follow from the shapes, so
a launch passes 7 arguments instead of 23 (host time per call).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rotate_block(x_tok, y_tok, sxh, syh, h0, H: tl.constexpr, half: tl.constexpr,
                  D: tl.constexpr, c1, c2, s1, s2, BACKWARD: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, HAS_PASS: tl.constexpr,
                  BLOCK_P: tl.constexpr):
    """Heads ``h0 .. h0 + BLOCK_H`` (those below ``H``) of one token."""
    heads = h0 + tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_R)
    mask = (heads < H)[:, None] & (j < half)[None, :]
    x_row = x_tok + heads[:, None].to(tl.int64) * sxh
    y_row = y_tok + heads[:, None].to(tl.int64) * syh
    x1 = tl.load(x_row + j[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + half + j[None, :], mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(y_row + j[None, :], y1.to(y_tok.dtype.element_ty), mask=mask)
    tl.store(y_row + half + j[None, :], y2.to(y_tok.dtype.element_ty), mask=mask)
    if HAS_PASS:
        p = 2 * half + tl.arange(0, BLOCK_P)
        pmask = (heads < H)[:, None] & (p < D)[None, :]
        rest = tl.load(x_row + p[None, :], mask=pmask)
        tl.store(y_row + p[None, :], rest.to(y_tok.dtype.element_ty), mask=pmask)


@triton.jit
def _rotate_token(q_tok, sqh, qo_tok, soh, k_tok, skh, ko_tok, sph, c_row, s_row,
                  Hq: tl.constexpr, Hk: tl.constexpr, half: tl.constexpr, D: tl.constexpr,
                  BACKWARD: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                  BLOCK_R: tl.constexpr, HAS_PASS: tl.constexpr, BLOCK_P: tl.constexpr,
                  LOOP: tl.constexpr):
    """One token's heads (those of this program's split), its table rows at ``c_row``,
    ``s_row``."""
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    j = tl.arange(0, BLOCK_R)
    jm = j < half
    c1 = tl.load(c_row + j, mask=jm, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(c_row + half + j, mask=jm, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(s_row + j, mask=jm, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(s_row + half + j, mask=jm, other=0.0).to(tl.float32)[None, :]
    # The program's first block of each in straight-line code (all of a token's heads in
    # the common case, which compiles without the loops: ``LOOP`` False), then the rest of
    # its blocks, splits apart.
    _rotate_block(q_tok, qo_tok, sqh, soh, split * BLOCK_HQ, Hq, half, D, c1, c2, s1, s2,
                  BACKWARD, BLOCK_HQ, BLOCK_R, HAS_PASS, BLOCK_P)
    _rotate_block(k_tok, ko_tok, skh, sph, split * BLOCK_HK, Hk, half, D, c1, c2, s1, s2,
                  BACKWARD, BLOCK_HK, BLOCK_R, HAS_PASS, BLOCK_P)
    if LOOP:
        for h0 in range((split + splits) * BLOCK_HQ, Hq, splits * BLOCK_HQ):
            _rotate_block(q_tok, qo_tok, sqh, soh, h0, Hq, half, D, c1, c2, s1, s2,
                          BACKWARD, BLOCK_HQ, BLOCK_R, HAS_PASS, BLOCK_P)
        for h0 in range((split + splits) * BLOCK_HK, Hk, splits * BLOCK_HK):
            _rotate_block(k_tok, ko_tok, skh, sph, h0, Hk, half, D, c1, c2, s1, s2,
                          BACKWARD, BLOCK_HK, BLOCK_R, HAS_PASS, BLOCK_P)


@triton.jit
def rope_kernel(
    q_ptr, sqb, sqh, sqs, qo_ptr, sob, soh, sos,
    k_ptr, skb, skh, sks, ko_ptr, spb, sph, sps,
    cos_ptr, scb, scs, sin_ptr, ssb, sss, S,
    Hq: tl.constexpr, Hk: tl.constexpr, half: tl.constexpr, D: tl.constexpr,
    BACKWARD: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_R: tl.constexpr, HAS_PASS: tl.constexpr, BLOCK_P: tl.constexpr,
    LOOP: tl.constexpr,
):
    token = tl.program_id(0)
    b = (token // S).to(tl.int64)
    s = (token % S).to(tl.int64)
    _rotate_token(q_ptr + b * sqb + s * sqs, sqh, qo_ptr + b * sob + s * sos, soh,
                  k_ptr + b * skb + s * sks, skh, ko_ptr + b * spb + s * sps, sph,
                  cos_ptr + b * scb + s * scs, sin_ptr + b * ssb + s * sss,
                  Hq, Hk, half, D, BACKWARD, BLOCK_HQ, BLOCK_HK, BLOCK_R, HAS_PASS, BLOCK_P,
                  LOOP)


@triton.jit
def _dense_place(b, s, S, H: tl.constexpr, D: tl.constexpr, HEADS_OUTER: tl.constexpr):
    """``(offset, head stride)`` of token ``(b, s)``'s first head in a dense ``[B, S, H,
    D]`` tensor, or ``[B, H, S, D]`` with ``HEADS_OUTER``."""
    if HEADS_OUTER:
        return (b * H * S + s) * D, S * D
    else:
        return (b * S + s) * (H * D), D


@triton.jit
def rope_dense_kernel(
    q_ptr, qo_ptr, k_ptr, ko_ptr, cos_ptr, sin_ptr, S,
    Hq: tl.constexpr, Hk: tl.constexpr, half: tl.constexpr, D: tl.constexpr,
    BACKWARD: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_R: tl.constexpr, HAS_PASS: tl.constexpr, BLOCK_P: tl.constexpr,
    LOOP: tl.constexpr, Q_HEADS_OUTER: tl.constexpr, K_HEADS_OUTER: tl.constexpr,
    TABLE_BATCHED: tl.constexpr,
):
    """``rope_kernel`` where q and its output (and k and its) are dense ``[B, S, H, D]``
    (tokens outer) or ``[B, H, S, D]`` (``*_HEADS_OUTER``) in memory and the tables are
    contiguous ``[B, S, R]`` (``TABLE_BATCHED``) or one ``[S, R]`` for every sequence."""
    token = tl.program_id(0)
    b = (token // S).to(tl.int64)
    s = (token % S).to(tl.int64)
    q_off, sqh = _dense_place(b, s, S, Hq, D, Q_HEADS_OUTER)
    k_off, skh = _dense_place(b, s, S, Hk, D, K_HEADS_OUTER)
    if TABLE_BATCHED:
        t_off = (b * S + s) * (2 * half)
    else:
        t_off = s * (2 * half)
    _rotate_token(q_ptr + q_off, sqh, qo_ptr + q_off, sqh, k_ptr + k_off, skh, ko_ptr + k_off,
                  skh, cos_ptr + t_off, sin_ptr + t_off,
                  Hq, Hk, half, D, BACKWARD, BLOCK_HQ, BLOCK_HK, BLOCK_R, HAS_PASS, BLOCK_P,
                  LOOP)
