"""Triton kernels of RMSNorm: one forward, one backward.

Read against ``reference.py``. Both work on ``x [M, H]`` with rows ``sx`` apart and
contiguous columns; math is float32. ``w' = weight + offset`` (``HAS_WEIGHT``; 1 without a
weight), ``rstd = 1 / sqrt(mean(x ** 2) + eps)`` per row, ``x_hat = x * rstd``.

A pointer a variant does not read comes as None (``w_ptr`` without ``HAS_WEIGHT``, ``dw_ptr``
without ``WEIGHT_GRAD``): Triton binds it as a constant, one argument fewer per launch.

NaN and inf need no code of their own: a NaN in a row makes its sum of squares, rstd and
so the whole row (and its gradients) NaN; an inf makes rstd 0 and the row ``[0, .., NaN
(inf * 0), .., 0]``, exactly as the reference's PyTorch computes it. The backward's
``mean(g * x_hat)`` is formed as ``sum(g * x) * rstd / H``, the reference's order, and a
finite row whose mean square overflows (rstd 0) gets NaN gradients exactly where the
reference's are ``inf * 0`` (``_dx``).

* ``rms_norm_fwd_kernel``: a program owns ``BLOCK_M`` rows. ``SINGLE_BLOCK``: a row fits one
  ``BLOCK_N`` register tile, so x is read once and ``y`` written once. Otherwise the row is
  streamed in ``BLOCK_N``-column tiles, twice (the sum of squares, then the output), so H
  has no upper limit. Writes ``y [M, H]`` and float32 ``rstd [M]`` for the backward.
* ``rms_norm_bwd_kernel``: ``dx = rstd * (g - x_hat * mean(g * x_hat))`` with
  ``g = dy * w'``, and ``dweight = sum over rows of dy * x_hat``. A program owns a
  contiguous group of ``rows_per_program`` rows and walks them ``BLOCK_M`` at a time,
  reading x and dy once (twice when streamed) and writing dx once. Its share of the weight
  gradient is one float32 partial row ``dw_part[pid, :H]``: kept in registers (single
  tile) or added into that row in place, by this program only (streamed); the caller sums
  the partials, so the result is deterministic (no atomics).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._pdl import pdl_start, pdl_wait


@triton.jit
def _weight(w_ptr, cols, cmask, offset, HAS_WEIGHT: tl.constexpr):
    """``[1, BLOCK_N]`` float32 ``weight + offset`` (ones without a weight)."""
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32) + offset
    else:
        w = tl.where(cmask, 1.0, 0.0)
    return w[None, :]


@triton.jit
def _rstd(sum_sq, H, eps, rmask):
    """``1 / sqrt(sum_sq / H + eps)`` per row; the tail tile's rows past M (all zeros)
    take 1, not ``rsqrt(0)`` (they store nothing, but eps may be 0)."""
    return tl.rsqrt(tl.where(rmask, sum_sq / H + eps, 1.0))


@triton.jit
def _dx(g, x, c, rstd):
    """``(g - x_hat * c) * rstd``, ``c = sum(g * x) * rstd / H`` (the sum scaled after, as
    autograd through the formula forms it), with ``x_hat`` formed as ``(2 x) (rstd / 2)``:
    the same value, except in a row whose mean square overflowed (rstd 0), where the
    formula's ``2 x`` past float32's range times 0 is NaN, as there (``sum(g * x)``
    overflowing too makes ``c`` NaN, an inf ``g`` makes ``g * 0`` NaN, as there). A row
    whose mean square underflowed to 0 with ``eps = 0`` (rstd inf) is NaN, as autograd's
    rsqrt(0) backward makes it (the formula gave -inf there)."""
    dx = (g - ((2.0 * x) * (0.5 * rstd)) * c) * rstd
    return tl.where(rstd == float("inf"), float("nan"), dx)


@triton.jit
def rms_norm_fwd_kernel(
    x_ptr, sx, w_ptr, y_ptr, sy, rstd_ptr, M, H, eps, offset,
    HAS_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr, PDL: tl.constexpr = 0,
):
    # PDL: launched early in a decode step's chain of kernels (see lmfuse._pdl).
    pdl_wait(PDL)
    pdl_start(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    cols = tl.arange(0, BLOCK_N)
    x_row = x_ptr + rows[:, None] * sx
    y_row = y_ptr + rows[:, None] * sy
    if SINGLE_BLOCK:
        cmask = cols < H
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = _rstd(tl.sum(x * x, axis=1), H, eps, rmask)
        y = x * rstd[:, None] * _weight(w_ptr, cols, cmask, offset, HAS_WEIGHT)
        tl.store(y_row + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        # Squares summed per tile element, reduced over columns once after the loop.
        sq = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for c0 in range(0, H, BLOCK_N):
            c = c0 + cols
            mask = rmask[:, None] & (c < H)[None, :]
            x = tl.load(x_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
            sq += x * x
        rstd = _rstd(tl.sum(sq, axis=1), H, eps, rmask)
        for c0 in range(0, H, BLOCK_N):
            c = c0 + cols
            cmask = c < H
            mask = rmask[:, None] & cmask[None, :]
            x = tl.load(x_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
            y = x * rstd[:, None] * _weight(w_ptr, c, cmask, offset, HAS_WEIGHT)
            tl.store(y_row + c[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)


@triton.jit
def rms_norm_bwd_kernel(
    x_ptr, sx, dy_ptr, sdy, w_ptr, rstd_ptr, dx_ptr, sdx, dw_ptr, M, H, rows_per_program,
    offset,
    HAS_WEIGHT: tl.constexpr, WEIGHT_GRAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    first = pid.to(tl.int64) * rows_per_program
    cols = tl.arange(0, BLOCK_N)
    if WEIGHT_GRAD:  # (dw_ptr is None otherwise)
        dw_row = dw_ptr + pid.to(tl.int64) * H
    if SINGLE_BLOCK:
        cmask = cols < H
        w = _weight(w_ptr, cols, cmask, offset, HAS_WEIGHT)
        # Weight-gradient sums kept per tile element, reduced over rows once at the end.
        dw = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, rows_per_program, BLOCK_M):
            rows = first + r0 + tl.arange(0, BLOCK_M)
            rmask = (rows < M) & (r0 + tl.arange(0, BLOCK_M) < rows_per_program)
            mask = rmask[:, None] & cmask[None, :]
            x = tl.load(x_ptr + rows[:, None] * sx + cols[None, :], mask=mask,
                        other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + rows[:, None] * sdy + cols[None, :], mask=mask,
                         other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)[:, None]
            x_hat = x * rstd
            g = dy * w
            c = tl.sum(g * x, axis=1)[:, None] * rstd / H
            dx = _dx(g, x, c, rstd)
            tl.store(dx_ptr + rows[:, None] * sdx + cols[None, :],
                     dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if WEIGHT_GRAD:
                dw += dy * x_hat
        if WEIGHT_GRAD:
            tl.store(dw_row + cols, tl.sum(dw, axis=0), mask=cmask)
    else:
        for r0 in range(0, rows_per_program, BLOCK_M):
            rows = first + r0 + tl.arange(0, BLOCK_M)
            rmask = (rows < M) & (r0 + tl.arange(0, BLOCK_M) < rows_per_program)
            x_row = x_ptr + rows[:, None] * sx
            dy_row = dy_ptr + rows[:, None] * sdy
            rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)[:, None]
            # Pass 1: sum(g * x) over the row's tiles (times rstd / H: mean(g * x_hat)).
            gx = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for c0 in range(0, H, BLOCK_N):
                c = c0 + cols
                cmask = c < H
                mask = rmask[:, None] & cmask[None, :]
                x = tl.load(x_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
                gx += dy * _weight(w_ptr, c, cmask, offset, HAS_WEIGHT) * x
            mean_gx = tl.sum(gx, axis=1)[:, None] * rstd / H
            # Pass 2: dx, and this tile's rows added into the program's partial row.
            for c0 in range(0, H, BLOCK_N):
                c = c0 + cols
                cmask = c < H
                mask = rmask[:, None] & cmask[None, :]
                x = tl.load(x_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
                x_hat = x * rstd
                dx = _dx(dy * _weight(w_ptr, c, cmask, offset, HAS_WEIGHT), x, mean_gx, rstd)
                tl.store(dx_ptr + rows[:, None] * sdx + c[None, :],
                         dx.to(dx_ptr.dtype.element_ty), mask=mask)
                if WEIGHT_GRAD:
                    # The partial row was last written by other threads of this program:
                    # the barrier orders those stores before these loads.
                    tl.debug_barrier()
                    part = tl.load(dw_row + c, mask=cmask, other=0.0)
                    tl.store(dw_row + c, part + tl.sum(dy * x_hat, axis=0), mask=cmask)
