"""Triton kernels of RMSNorm and LayerNorm: one forward, one backward, the two norms as
``CENTERED`` variants of each.

Read against ``reference.py``. Both work on ``x [M, H]`` with rows ``sx`` apart and
contiguous columns; math is float32. ``w' = weight + offset`` (``HAS_WEIGHT``; 1 without a
weight). RMSNorm: ``xc = x``; LayerNorm (``CENTERED``): ``xc = x - mean(x)``. Then
``rstd = 1 / sqrt(mean(xc ** 2) + eps)`` per row, ``x_hat = xc * rstd`` and ``y = x_hat * w'
(+ bias)``: a LayerNorm is the RMSNorm of the centred row, plus a bias, and its backward
the RMSNorm's with ``mean(g)`` taken off ``g``.

A pointer a variant does not read comes as None (``w_ptr`` without ``HAS_WEIGHT``,
``part_ptr`` without a parameter gradient): Triton binds it as a constant, one argument
fewer per launch. The row statistics are one float32 buffer, ``stats``: RMSNorm's
``rstd [M]``, LayerNorm's ``[2, M]`` (the means, then the rstd); the backward's partial
rows one more, ``part [k, programs, H]`` (the weight's, then the bias's): one allocation
each, and no views to make, per call.

NaN and inf need no code of their own. RMSNorm: a NaN in a row makes its sum of squares,
rstd and so the whole row (and its gradients) NaN; an inf makes rstd 0 and the row ``[0, ..,
NaN (inf * 0), .., 0]``, exactly as the reference's PyTorch computes it. LayerNorm: a NaN or
an inf makes the row's mean NaN or inf and every centred value NaN (``inf - inf``) or
infinite, so the row and its gradients are NaN, as the reference's. The backward's
``mean(g * x_hat)`` is formed as ``sum(g * xc) * rstd / H``, the reference's order, and a
finite row whose mean square overflows (rstd 0) gets NaN gradients exactly where the
reference's are ``inf * 0`` (``_dx``).

* ``norm_fwd_kernel``: a program owns ``BLOCK_M`` rows (centred: the mean summed from the
  row's first value, ``_first``). ``SINGLE_BLOCK``: a row fits one
  ``BLOCK_N`` register tile, so x is read once and ``y`` written once. Otherwise the row is
  streamed in ``BLOCK_N``-column tiles, twice (the sum of squares, then the output; three
  times centred: the mean first, so the variance is summed from centred values, never as
  ``E[x^2] - mean^2``), so H has no upper limit. Writes ``y [M, H]``, float32 ``rstd [M]``
  and, centred, float32 ``mean [M]`` for the backward.
* ``norm_bwd_kernel``: ``dx = rstd * (g - x_hat * mean(g * x_hat))`` with ``g = dy * w'``
  (centred: ``g - mean(g)`` in the first term), ``dweight = sum over rows of dy * x_hat``,
  ``dbias = sum over rows of dy``. A program owns a contiguous group of
  ``rows_per_program`` rows and walks them ``BLOCK_M`` at a time, reading x and dy once
  (twice when streamed) and writing dx once; the walk is software-pipelined over
  ``STAGES`` (the next tiles' x and dy copied into shared memory while one is computed;
  None: Triton's default loop, which it does not pipeline). Its share of the weight (bias)
  gradient is one float32 partial row ``part[0, pid, :H]`` (the bias's: the last,
  ``part[k - 1, pid]``): kept in registers (single tile) or added into that row in place,
  by this program only (streamed); the caller sums the partials, so the result is
  deterministic (no atomics).
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
def _first(x_row, rmask):
    """``[BLOCK_M, 1]`` float32: each row's first value, the shift its mean is summed
    from (``mean = x0 + sum(x - x0) / H``): the sum is of the row's spread, not its
    magnitude, so a constant row's mean is exact (its centred values 0, its output the
    bias, as PyTorch's Welford statistics give) and an offset row's loses no digits to
    the offset."""
    return tl.load(x_row, mask=rmask[:, None], other=0.0).to(tl.float32)


@triton.jit
def _centred(x, mean, mask, CENTERED: tl.constexpr):
    """``x - mean`` per row (0 outside ``mask``, so the padding adds nothing to the
    sums), or x itself for RMSNorm."""
    if CENTERED:
        x = tl.where(mask, x - mean, 0.0)
    return x


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
def norm_fwd_kernel(
    x_ptr, sx, w_ptr, b_ptr, y_ptr, sy, stats_ptr, M, H, eps, offset,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, CENTERED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    # PDL: launched early in a decode step's chain of kernels (see lmfuse._pdl).
    pdl_wait(PDL)
    pdl_start(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    cols = tl.arange(0, BLOCK_N)
    x_row = x_ptr + rows[:, None] * sx
    y_row = y_ptr + rows[:, None] * sy
    mean = tl.zeros((BLOCK_M, 1), dtype=tl.float32)
    if SINGLE_BLOCK:
        cmask = cols < H
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if CENTERED:
            shift = _first(x_row, rmask)
            mean = shift + (tl.sum(tl.where(mask, x - shift, 0.0), axis=1) / H)[:, None]
        x = _centred(x, mean, mask, CENTERED)
        rstd = _rstd(tl.sum(x * x, axis=1), H, eps, rmask)
        y = x * rstd[:, None] * _weight(w_ptr, cols, cmask, offset, HAS_WEIGHT)
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_row + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        if CENTERED:  # the mean first: the squares below are summed centred
            shift = _first(x_row, rmask)
            s = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for c0 in range(0, H, BLOCK_N):
                c = c0 + cols
                mask = rmask[:, None] & (c < H)[None, :]
                x = tl.load(x_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
                s += tl.where(mask, x - shift, 0.0)
            mean = shift + (tl.sum(s, axis=1) / H)[:, None]
        # Squares summed per tile element, reduced over columns once after the loop.
        sq = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for c0 in range(0, H, BLOCK_N):
            c = c0 + cols
            mask = rmask[:, None] & (c < H)[None, :]
            x = tl.load(x_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
            x = _centred(x, mean, mask, CENTERED)
            sq += x * x
        rstd = _rstd(tl.sum(sq, axis=1), H, eps, rmask)
        for c0 in range(0, H, BLOCK_N):
            c = c0 + cols
            cmask = c < H
            mask = rmask[:, None] & cmask[None, :]
            x = tl.load(x_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
            x = _centred(x, mean, mask, CENTERED)
            y = x * rstd[:, None] * _weight(w_ptr, c, cmask, offset, HAS_WEIGHT)
            if HAS_BIAS:
                y += tl.load(b_ptr + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_row + c[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    if CENTERED:
        tl.store(stats_ptr + rows, tl.sum(mean, axis=1), mask=rmask)
        tl.store(stats_ptr + M + rows, rstd, mask=rmask)
    else:
        tl.store(stats_ptr + rows, rstd, mask=rmask)


@triton.jit
def norm_bwd_kernel(
    x_ptr, sx, dy_ptr, sdy, w_ptr, stats_ptr, dx_ptr, sdx, part_ptr, M, H,
    rows_per_program, offset,
    HAS_WEIGHT: tl.constexpr, WEIGHT_GRAD: tl.constexpr, BIAS_GRAD: tl.constexpr,
    CENTERED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr, STAGES: tl.constexpr = None,
):
    pid = tl.program_id(0)
    first = pid.to(tl.int64) * rows_per_program
    cols = tl.arange(0, BLOCK_N)
    # (part_ptr is None without a parameter gradient)
    if WEIGHT_GRAD:
        dw_row = part_ptr + pid.to(tl.int64) * H
    if BIAS_GRAD:  # after the weight's partials
        db_row = part_ptr + (pid.to(tl.int64) + WEIGHT_GRAD * tl.num_programs(0)) * H
    rstd_ptr = stats_ptr + M if CENTERED else stats_ptr
    mean = tl.zeros((BLOCK_M, 1), dtype=tl.float32)
    if SINGLE_BLOCK:
        cmask = cols < H
        w = _weight(w_ptr, cols, cmask, offset, HAS_WEIGHT)
        # Weight-gradient sums kept per tile element, reduced over rows once at the end.
        dw = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        db = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in tl.range(0, rows_per_program, BLOCK_M, num_stages=STAGES):
            rows = first + r0 + tl.arange(0, BLOCK_M)
            rmask = (rows < M) & (r0 + tl.arange(0, BLOCK_M) < rows_per_program)
            mask = rmask[:, None] & cmask[None, :]
            x = tl.load(x_ptr + rows[:, None] * sx + cols[None, :], mask=mask,
                        other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + rows[:, None] * sdy + cols[None, :], mask=mask,
                         other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)[:, None]
            if CENTERED:
                mean = tl.load(stats_ptr + rows, mask=rmask, other=0.0)[:, None]
            x = _centred(x, mean, mask, CENTERED)
            x_hat = x * rstd
            g = dy * w
            c = tl.sum(g * x, axis=1)[:, None] * rstd / H
            if CENTERED:
                g = tl.where(mask, g - (tl.sum(g, axis=1) / H)[:, None], 0.0)
            dx = _dx(g, x, c, rstd)
            tl.store(dx_ptr + rows[:, None] * sdx + cols[None, :],
                     dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if WEIGHT_GRAD:
                dw += dy * x_hat
            if BIAS_GRAD:
                db += dy
        if WEIGHT_GRAD:
            tl.store(dw_row + cols, tl.sum(dw, axis=0), mask=cmask)
        if BIAS_GRAD:
            tl.store(db_row + cols, tl.sum(db, axis=0), mask=cmask)
    else:
        for r0 in range(0, rows_per_program, BLOCK_M):
            rows = first + r0 + tl.arange(0, BLOCK_M)
            rmask = (rows < M) & (r0 + tl.arange(0, BLOCK_M) < rows_per_program)
            x_row = x_ptr + rows[:, None] * sx
            dy_row = dy_ptr + rows[:, None] * sdy
            rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)[:, None]
            if CENTERED:
                mean = tl.load(stats_ptr + rows, mask=rmask, other=0.0)[:, None]
            # Pass 1: sum(g * xc) over the row's tiles (times rstd / H: mean(g * x_hat)),
            # and centred sum(g).
            gx = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            gs = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for c0 in tl.range(0, H, BLOCK_N, num_stages=STAGES):
                c = c0 + cols
                cmask = c < H
                mask = rmask[:, None] & cmask[None, :]
                x = tl.load(x_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
                g = dy * _weight(w_ptr, c, cmask, offset, HAS_WEIGHT)
                gx += g * _centred(x, mean, mask, CENTERED)
                if CENTERED:
                    gs += g
            mean_gx = tl.sum(gx, axis=1)[:, None] * rstd / H
            mean_g = tl.sum(gs, axis=1)[:, None] / H
            # Pass 2: dx, and this tile's rows added into the program's partial rows.
            for c0 in range(0, H, BLOCK_N):
                c = c0 + cols
                cmask = c < H
                mask = rmask[:, None] & cmask[None, :]
                x = tl.load(x_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
                x = _centred(x, mean, mask, CENTERED)
                x_hat = x * rstd
                g = dy * _weight(w_ptr, c, cmask, offset, HAS_WEIGHT)
                if CENTERED:
                    g = g - mean_g
                dx = _dx(g, x, mean_gx, rstd)
                tl.store(dx_ptr + rows[:, None] * sdx + c[None, :],
                         dx.to(dx_ptr.dtype.element_ty), mask=mask)
                if WEIGHT_GRAD or BIAS_GRAD:
                    # The partial rows were last written by other threads of this program:
                    # the barrier orders those stores before these loads.
                    tl.debug_barrier()
                if WEIGHT_GRAD:
                    part = tl.load(dw_row + c, mask=cmask, other=0.0)
                    tl.store(dw_row + c, part + tl.sum(dy * x_hat, axis=0), mask=cmask)
                if BIAS_GRAD:
                    part = tl.load(db_row + c, mask=cmask, other=0.0)
                    tl.store(db_row + c, part + tl.sum(dy, axis=0), mask=cmask)
