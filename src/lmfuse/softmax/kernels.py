"""Triton kernels of fused scale → mask → softmax (forward and backward).

Read against ``reference.py``. One program owns ``BLOCK_M`` rows of the flattened
``[b * np * sq, sk]`` problem. Variants are constexpr switches of one kernel:

* ``SINGLE_BLOCK``: the whole row fits one ``BLOCK_N`` register tile: one read, one
  write. Otherwise the row is streamed in ``BLOCK_N`` chunks with an online max/sum
  (two reads of the visible keys, one write), so ``sk`` has no upper limit.
* ``BANDED``: a causal / sliding-window band ``[lo, hi)`` per row. Loads outside it are
  predicated off, so a causal row reads only the keys it can see; the invisible part of
  the output is written (zeros, NaN in a NaN row) without being read.
* ``MASK_KIND``: 0 none, 1 boolean (True = masked), 2 additive float; the mask is read
  through its own strides, so a broadcast ``[b, 1, 1, sk]`` mask is never materialised.
* ``HAS_OFFSET``: a per-head sink logit joins every denominator.

Non-finite values follow ``reference.py`` (PyTorch's softmax of the masked scores) without
a pass or a select of their own. The row max is only a shift (a NaN-ignoring max is as good
as a NaN-propagating one), and a NaN or ``+inf`` among the visible logits, or a NaN /
``+inf`` sink, makes the denominator NaN (``inf - inf``, ``NaN - shift``). Every key is then
written as ``exp(z - shift) * (1 / denom)`` with ``z = -inf`` at hidden keys, so a finite
row gets exact zeros there and a NaN row NaN (``0 * NaN``), hidden keys included, as
PyTorch gives. A row whose keys are all hidden or ``-inf`` (the max is ``-inf`` and no exp
is NaN) divides by 1 instead: zeros, whatever the sink.

The backward gives exact zeros where the saved output is 0, and at the hidden keys of a NaN
row (``masked_fill``'s backward): only a program holding a row whose ``sum(dy * y)`` is NaN
finds those again, from the band and a boolean mask read there, so finite rows pay
nothing for it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _row_setup(pid, n_rows, np_, sq, sk, left, right, BLOCK_M: tl.constexpr, BANDED: tl.constexpr):
    """Row ids of this program, their (batch, head, query) coordinates and key band [lo, hi).

    Also returns the band widened to multiples of 16 keys for the loads: a load mask whose
    bounds Triton can prove 16-aligned keeps 16-byte vector loads; the exact band is then
    applied in registers.
    """
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    rows = tl.minimum(rows, n_rows - 1)  # keep index math in range for the tail tile
    q = rows % sq
    bh = rows // sq
    h = bh % np_
    b = bh // np_
    if BANDED:
        p = q + (sk - sq)  # the row's position among the keys (bottom-right aligned)
        lo = tl.maximum(p - left, 0)
        hi = tl.minimum(p + right + 1, sk)
    else:
        lo = q * 0
        hi = q * 0 + sk
    hi = tl.where(row_ok, hi, 0)  # tail rows see nothing and store nothing
    lo_ld = (lo // 16) * 16
    hi_ld = tl.minimum(((hi + 15) // 16) * 16, sk)
    return rows, row_ok, b.to(tl.int64), h, q.to(tl.int64), lo, hi, lo_ld, hi_ld


@triton.jit
def _in(c, lo, hi):
    """[BLOCK_M, BLOCK_N] mask of keys c inside each row's [lo, hi)."""
    return (c[None, :] >= lo[:, None]) & (c[None, :] < hi[:, None])


@triton.jit
def _scale(scale, scale_lo, COMPUTE: tl.constexpr):
    """The scale in the compute dtype. A float argument reaches a kernel as float32, so the
    caller splits a float64 scale into ``scale + scale_lo`` (two float32 values); their sum
    in float64 restores it to about 2^-48, and in float32 it is ``scale`` itself."""
    return tl.cast(scale, COMPUTE) + tl.cast(scale_lo, COMPUTE)


@triton.jit
def _scaled_scores(
    x_ptr, x_row, stride_xk, m_ptr, m_row, stride_mk, cols, visible, load_ok, scale,
    MASK_KIND: tl.constexpr, COMPUTE: tl.constexpr, EVICT: tl.constexpr,
):
    """``(z, visible)``: z = scale * x (+ additive mask) on visible keys, -inf elsewhere,
    and the visibility (band and boolean mask) itself; ``[BLOCK_M, BLOCK_N]`` each.

    ``load_ok`` (the 16-aligned widening of ``visible``) bounds what is read. A NaN or inf
    score under the boolean mask or outside the band becomes -inf here (never poisons the
    row); under an additive mask it stays in z (``NaN + -inf`` is NaN, as in PyTorch).
    ``EVICT``: the score loads' L2 eviction policy ("" for none; passed at every call: a
    string default of a nested jit function does not compile in Triton 3.6).
    """
    x = tl.load(x_ptr + x_row[:, None] + cols[None, :] * stride_xk, mask=load_ok, other=0.0,
                eviction_policy=EVICT)
    z = x.to(COMPUTE) * scale
    if MASK_KIND == 1:
        hidden = tl.load(m_ptr + m_row[:, None] + cols[None, :] * stride_mk, mask=load_ok, other=1)
        visible = visible & (hidden == 0)
    if MASK_KIND == 2:
        add = tl.load(m_ptr + m_row[:, None] + cols[None, :] * stride_mk, mask=load_ok, other=0.0)
        z += add.to(COMPUTE)
    return tl.where(visible, z, float("-inf")), visible


@triton.jit
def softmax_fwd_kernel(
    x_ptr, y_ptr, m_ptr, offset_ptr, lse_ptr,
    n_rows, np_, sq, sk,
    stride_xb, stride_xh, stride_xq, stride_xk,
    stride_mb, stride_mh, stride_mq, stride_mk,
    scale, scale_lo, left, right,
    BANDED: tl.constexpr, MASK_KIND: tl.constexpr, HAS_OFFSET: tl.constexpr,
    STORE_LSE: tl.constexpr, COMPUTE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
    HINTS: tl.constexpr = False,
):
    """y = softmax(scale * x, masked), and with ``STORE_LSE`` each row's log-sum-exp.
    ``HINTS`` (streamed rows): L2 is asked to keep the first pass's reads for the second,
    which evicts them."""
    pid = tl.program_id(0)
    sc = _scale(scale, scale_lo, COMPUTE)
    rows, row_ok, b, h, q, lo, hi, lo_ld, hi_ld = _row_setup(
        pid, n_rows, np_, sq, sk, left, right, BLOCK_M, BANDED
    )
    x_row = b * stride_xb + h.to(tl.int64) * stride_xh + q * stride_xq
    m_row = b * stride_mb + h.to(tl.int64) * stride_mh + q * stride_mq
    y_row = rows.to(tl.int64) * sk
    cols = tl.arange(0, BLOCK_N)
    out_ok = row_ok[:, None] & (cols[None, :] < sk)

    if SINGLE_BLOCK:
        # The visibility is not kept (a [BLOCK_M, BLOCK_N] tile held across the reductions
        # costs registers: 20% of the forward's time at 2048 keys): z = -inf says it all.
        z, _ = _scaled_scores(x_ptr, x_row, stride_xk, m_ptr, m_row, stride_mk, cols,
                              _in(cols, lo, hi), _in(cols, lo_ld, hi_ld), sc, MASK_KIND,
                              COMPUTE, "")
        row_max = tl.max(z, 1)
    else:
        # Pass 1: online max and sum over the chunks that hold visible keys.
        row_max = tl.full([BLOCK_M], float("-inf"), COMPUTE)
        denom = tl.zeros([BLOCK_M], COMPUTE)
        start = (tl.min(lo, 0) // BLOCK_N) * BLOCK_N
        for c0 in range(start, tl.max(hi, 0), BLOCK_N):
            c = c0 + cols
            z, _ = _scaled_scores(x_ptr, x_row, stride_xk, m_ptr, m_row, stride_mk, c,
                                  _in(c, lo, hi), _in(c, lo_ld, hi_ld), sc, MASK_KIND,
                                  COMPUTE, "evict_last" if HINTS else "")
            new_max = tl.maximum(row_max, tl.max(z, 1))
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            denom = denom * tl.exp(row_max - shift) + tl.sum(tl.exp(z - shift[:, None]), 1)
            row_max = new_max

    if HAS_OFFSET:
        sink = tl.load(offset_ptr + h).to(COMPUTE)
        shift = tl.maximum(row_max, sink)
    else:
        shift = row_max
    # A row with no visible key has max -inf: shift by 0 so exp() gives 0, not NaN.
    shift = tl.where(shift == float("-inf"), 0.0, shift)

    if SINGLE_BLOCK:
        e = tl.exp(z - shift[:, None])
        denom = tl.sum(e, 1)
    else:
        denom = denom * tl.exp(row_max - shift)
    # Every key hidden or -inf: the max is -inf and no exp is NaN, so each e is exactly 0
    # (whatever the sink: the shift is never NaN here). Such a row divides by 1: zeros.
    dead = (row_max == float("-inf")) & (denom == 0.0)
    if HAS_OFFSET:
        denom += tl.exp(sink - shift)
    # Elsewhere a NaN denom (a NaN or +inf logit or sink) passes through: every output of the
    # row, hidden keys included (0 * NaN), is NaN as in PyTorch.
    denom = tl.where(dead, 1.0, denom)
    inv = 1.0 / denom

    if SINGLE_BLOCK:
        y = e * inv[:, None]
        tl.store(y_ptr + y_row[:, None] + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=out_ok)
    else:
        # Pass 2: every chunk is written; keys outside the band load nothing (z = -inf) and
        # store exp(-inf) * inv: 0, or NaN in a NaN row.
        for c0 in range(0, sk, BLOCK_N):
            c = c0 + cols
            z, _ = _scaled_scores(x_ptr, x_row, stride_xk, m_ptr, m_row, stride_mk, c,
                                  _in(c, lo, hi), _in(c, lo_ld, hi_ld), sc, MASK_KIND,
                                  COMPUTE, "evict_first" if HINTS else "")
            y = tl.exp(z - shift[:, None]) * inv[:, None]
            c_ok = row_ok[:, None] & (c[None, :] < sk)
            tl.store(y_ptr + y_row[:, None] + c[None, :], y.to(y_ptr.dtype.element_ty), mask=c_ok)

    if STORE_LSE:
        lse = shift + tl.log(denom)  # a row with nothing visible and a -inf sink: lse = 0
        tl.store(lse_ptr + rows, lse, mask=row_ok)


@triton.jit
def _zero_hidden(dx, dot, cols, lo, hi, ld, m_ptr, m_row, stride_mk,
                 BANDED: tl.constexpr, BOOL_MASK: tl.constexpr):
    """``dx`` with zeros at the hidden keys of NaN rows (``sum(dy * y)`` NaN).

    A finite row already has them: its stored y is 0 there. A NaN row stored NaN at every
    key, so its hidden keys are found again: the exact band ``[lo, hi)`` (the loads cover
    the 16-aligned widening of it) and a boolean mask, read only by a program that holds a
    NaN row.
    """
    nan_row = dot != dot
    if tl.sum(nan_row.to(tl.int32), 0) > 0:
        if BOOL_MASK:
            masked = tl.load(m_ptr + m_row[:, None] + cols[None, :] * stride_mk,
                             mask=ld & nan_row[:, None], other=0)
        if BANDED:
            hidden = (cols[None, :] < lo[:, None]) | (cols[None, :] >= hi[:, None])
            if BOOL_MASK:
                hidden = hidden | (masked != 0)
        else:
            hidden = masked != 0
        # (A finite row's hidden keys are 0 already: zeroing them again changes nothing.)
        dx = tl.where(hidden, 0.0, dx)
    return dx


@triton.jit
def softmax_bwd_kernel(
    dy_ptr, y_ptr, dx_ptr, m_ptr, offset_ptr, lse_ptr, doffset_ptr,
    n_rows, np_, sq, sk,
    stride_db, stride_dh, stride_dq, stride_dk,
    stride_mb, stride_mh, stride_mq, stride_mk,
    scale, scale_lo, left, right,
    BANDED: tl.constexpr, BOOL_MASK: tl.constexpr, HAS_OFFSET: tl.constexpr,
    COMPUTE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
    HINTS: tl.constexpr = False,
):
    """dx = scale * y * (dy - sum(dy * y)) from the saved output y; one pass when the row fits.
    ``HINTS``: as in ``softmax_fwd_kernel``, for y and dy.

    dx is exactly 0 where y is 0 (hidden keys of a finite row, dead rows, keys whose
    probability underflowed) and at the hidden keys of a NaN row, where the forward stored
    NaN (:func:`_zero_hidden`): a masked key gets no gradient, as ``masked_fill``'s
    backward gives it none. ``BOOL_MASK``: ``m_ptr`` is the boolean mask (as bytes, through
    its strides), read only for NaN rows.
    """
    pid = tl.program_id(0)
    sc = _scale(scale, scale_lo, COMPUTE)
    rows, row_ok, b, h, q, lo, hi, lo_ld, hi_ld = _row_setup(
        pid, n_rows, np_, sq, sk, left, right, BLOCK_M, BANDED
    )
    dy_row = b * stride_db + h.to(tl.int64) * stride_dh + q * stride_dq
    m_row = b * stride_mb + h.to(tl.int64) * stride_mh + q * stride_mq
    y_row = rows.to(tl.int64) * sk
    cols = tl.arange(0, BLOCK_N)

    # Outside the band the forward stored 0 (NaN in a NaN row, where the gradient is 0 all
    # the same), so only the (16-aligned) band is read and the rest of dx is stored as 0.
    if SINGLE_BLOCK:
        ld = _in(cols, lo_ld, hi_ld)
        y = tl.load(y_ptr + y_row[:, None] + cols[None, :], mask=ld, other=0.0).to(COMPUTE)
        dy = tl.load(dy_ptr + dy_row[:, None] + cols[None, :] * stride_dk, mask=ld,
                     other=0.0).to(COMPUTE)
        dot = tl.sum(y * dy, 1)
        dx = tl.where(y == 0.0, 0.0, sc * y * (dy - dot[:, None]))
        if BANDED or BOOL_MASK:
            dx = _zero_hidden(dx, dot, cols, lo, hi, ld, m_ptr, m_row, stride_mk, BANDED,
                              BOOL_MASK)
        out_ok = row_ok[:, None] & (cols[None, :] < sk)
        tl.store(dx_ptr + y_row[:, None] + cols[None, :], dx.to(dx_ptr.dtype.element_ty),
                 mask=out_ok)
    else:
        dot = tl.zeros([BLOCK_M], COMPUTE)
        start = (tl.min(lo, 0) // BLOCK_N) * BLOCK_N
        for c0 in range(start, tl.max(hi, 0), BLOCK_N):
            c = c0 + cols
            ld = _in(c, lo_ld, hi_ld)
            y = tl.load(y_ptr + y_row[:, None] + c[None, :], mask=ld, other=0.0,
                        eviction_policy="evict_last" if HINTS else "").to(COMPUTE)
            dy = tl.load(dy_ptr + dy_row[:, None] + c[None, :] * stride_dk, mask=ld,
                         other=0.0, eviction_policy="evict_last" if HINTS else "").to(COMPUTE)
            dot += tl.sum(y * dy, 1)
        for c0 in range(0, sk, BLOCK_N):
            c = c0 + cols
            ld = _in(c, lo_ld, hi_ld)
            y = tl.load(y_ptr + y_row[:, None] + c[None, :], mask=ld, other=0.0,
                        eviction_policy="evict_first" if HINTS else "").to(COMPUTE)
            dy = tl.load(dy_ptr + dy_row[:, None] + c[None, :] * stride_dk, mask=ld,
                         other=0.0, eviction_policy="evict_first" if HINTS else "").to(COMPUTE)
            dx = tl.where(y == 0.0, 0.0, sc * y * (dy - dot[:, None]))
            if BANDED or BOOL_MASK:
                dx = _zero_hidden(dx, dot, c, lo, hi, ld, m_ptr, m_row, stride_mk, BANDED,
                                  BOOL_MASK)
            c_ok = row_ok[:, None] & (c[None, :] < sk)
            tl.store(dx_ptr + y_row[:, None] + c[None, :], dx.to(dx_ptr.dtype.element_ty),
                     mask=c_ok)

    if HAS_OFFSET:
        # d loss / d offset_h = -p_sink * sum(dy * y), with p_sink = exp(offset_h - lse).
        sink = tl.load(offset_ptr + h).to(COMPUTE)
        # (Unmasked: a tail tile's extra rows are clamped to the last row, so they compute a
        # real row's value, not exp(sink - 0), which overflows for a large sink.)
        lse = tl.load(lse_ptr + rows)
        tl.store(doffset_ptr + rows, -tl.exp(sink - lse) * dot, mask=row_ok)
