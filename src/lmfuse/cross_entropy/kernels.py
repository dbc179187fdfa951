"""Triton kernels of cross-entropy on logits (read against ``reference.py``).

One program owns ``BLOCK_M`` rows (tokens) of ``logits [N, V]`` (this rank's columns
``[vocab_start, vocab_start + V)`` of a ``vocab_size`` vocabulary).

* ``ce_fwd_kernel``: the token stats ``lse``, ``x_t``, ``sum x`` (``[3, N]``), and, with
  ``WRITE_GRAD``, the gradient too, from that lse, before the program moves on. When
  the row fits one ``BLOCK_V`` tile (``SINGLE_BLOCK``) it is read once and held in
  registers; a longer row is streamed with an online max/sum and then streamed again,
  backwards, to write the gradient, so the chunks read last (the ones most likely still
  in L2) are read first.
* ``ce_grad_kernel``: the gradient alone from given stats (the vocabulary-parallel path
  and ``reduction="none"``, whose upstream gradient is known only in backward).
* ``ce_scale_kernel``: multiplies a gradient written in forward by the upstream gradient,
  and does nothing, without a host sync, when that is exactly 1.

Targets are never used as addresses: a token's target column is found by comparing
column indices, so an out-of-range target cannot read or write out of bounds.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_x(x_ptr, row_off, c, load_ok, softcap, HAS_SOFTCAP: tl.constexpr):
    """Logits of a [BLOCK_M, BLOCK_V] tile in float32, softcapped; -inf outside the row."""
    x = tl.load(x_ptr + row_off[:, None] + c[None, :], mask=load_ok, other=float("-inf"))
    x = x.to(tl.float32)
    if HAS_SOFTCAP:
        # c * tanh(x / c), with tanh(u) = 1 - 2 / (exp(2u) + 1) (exact at +-inf).
        x = softcap * (1.0 - 2.0 / (tl.exp(2.0 * x / softcap) + 1.0))
        x = tl.where(load_ok, x, float("-inf"))
    return x


@triton.jit
def _grad_tile(x, c, t_local, lse, w, ls_over_v, one_minus_ls, two_z, softcap,
               HAS_SOFTCAP: tl.constexpr):
    """w * [p (1 + 2 z lse) - s / V - (1 - s) [col == t]] (* d softcap), float32."""
    lse = tl.where(lse == float("-inf"), 0.0, lse)  # a row with nothing (tail rows): p = 0
    p = tl.exp(x - lse[:, None])
    g = p * (1.0 + two_z * lse)[:, None] - ls_over_v
    g = tl.where(c[None, :] == t_local[:, None], g - one_minus_ls, g)
    if HAS_SOFTCAP:
        u = tl.where(x > float("-inf"), x / softcap, 0.0)  # -inf: columns past the row
        g = g * (1.0 - u * u)
    return g * w[:, None]


@triton.jit
def _rows(pid, n_rows, t_ptr, vocab_start, vocab_size, ignore_index, BLOCK_M: tl.constexpr):
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    rows = tl.minimum(rows, n_rows - 1)  # keep index math in range on the tail tile
    t = tl.load(t_ptr + rows).to(tl.int64)
    # Only tokens with a real target carry a gradient (ignored / out of range: zero row).
    grad_ok = row_ok & (t != ignore_index) & (t >= 0) & (t < vocab_size)
    return rows, row_ok, t - vocab_start, grad_ok


@triton.jit
def ce_fwd_kernel(
    x_ptr, stride_x, t_ptr, stats_ptr, g_ptr, stride_g, w_ptr,
    n_rows, V, vocab_start, vocab_size, ignore_index,
    ls_over_v, one_minus_ls, two_z, softcap,
    HAS_SOFTCAP: tl.constexpr, WRITE_GRAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    rows, row_ok, t_local, grad_ok = _rows(pid, n_rows, t_ptr, vocab_start, vocab_size,
                                           ignore_index, BLOCK_M)
    x_off = rows.to(tl.int64) * stride_x
    cols = tl.arange(0, BLOCK_V)

    if SINGLE_BLOCK:
        ok = row_ok[:, None] & (cols[None, :] < V)
        x = _load_x(x_ptr, x_off, cols, ok, softcap, HAS_SOFTCAP)
        row_max = tl.max(x, 1)
        shift = tl.where(row_max == float("-inf"), 0.0, row_max)
        denom = tl.sum(tl.exp(x - shift[:, None]), 1)
        x_t = tl.sum(tl.where(ok & (cols[None, :] == t_local[:, None]), x, 0.0), 1)
        sum_x = tl.sum(tl.where(ok, x, 0.0), 1)
    else:
        row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_M], tl.float32)
        x_t = tl.zeros([BLOCK_M], tl.float32)
        sum_x = tl.zeros([BLOCK_M], tl.float32)
        for c0 in range(0, V, BLOCK_V):
            c = c0 + cols
            ok = row_ok[:, None] & (c[None, :] < V)
            x = _load_x(x_ptr, x_off, c, ok, softcap, HAS_SOFTCAP)
            new_max = tl.maximum(row_max, tl.max(x, 1))
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            denom = denom * tl.exp(row_max - shift) + tl.sum(tl.exp(x - shift[:, None]), 1)
            row_max = new_max
            x_t += tl.sum(tl.where(ok & (c[None, :] == t_local[:, None]), x, 0.0), 1)
            sum_x += tl.sum(tl.where(ok, x, 0.0), 1)
        shift = tl.where(row_max == float("-inf"), 0.0, row_max)

    lse = tl.where(denom > 0, shift + tl.log(tl.where(denom > 0, denom, 1.0)), float("-inf"))
    tl.store(stats_ptr + rows, lse, mask=row_ok)
    tl.store(stats_ptr + n_rows + rows, x_t, mask=row_ok)
    tl.store(stats_ptr + 2 * n_rows + rows, sum_x, mask=row_ok)

    if WRITE_GRAD:
        w = tl.where(grad_ok, tl.load(w_ptr).to(tl.float32), 0.0)
        g_off = rows.to(tl.int64) * stride_g
        if SINGLE_BLOCK:
            g = _grad_tile(x, cols, t_local, lse, w, ls_over_v, one_minus_ls, two_z, softcap,
                           HAS_SOFTCAP)
            tl.store(g_ptr + g_off[:, None] + cols[None, :], g.to(g_ptr.dtype.element_ty),
                     mask=ok)
        else:
            n_chunks = tl.cdiv(V, BLOCK_V)
            for i in range(0, n_chunks):
                c = (n_chunks - 1 - i) * BLOCK_V + cols  # last chunk first: warm in L2
                ok = row_ok[:, None] & (c[None, :] < V)
                x = _load_x(x_ptr, x_off, c, ok, softcap, HAS_SOFTCAP)
                g = _grad_tile(x, c, t_local, lse, w, ls_over_v, one_minus_ls, two_z,
                               softcap, HAS_SOFTCAP)
                tl.store(g_ptr + g_off[:, None] + c[None, :], g.to(g_ptr.dtype.element_ty),
                         mask=ok)


@triton.jit
def ce_grad_kernel(
    x_ptr, stride_x, t_ptr, lse_ptr, w_ptr, stride_w, g_ptr, stride_g,
    n_rows, V, vocab_start, vocab_size, ignore_index,
    ls_over_v, one_minus_ls, two_z, softcap,
    HAS_SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    rows, row_ok, t_local, grad_ok = _rows(pid, n_rows, t_ptr, vocab_start, vocab_size,
                                           ignore_index, BLOCK_M)
    lse = tl.load(lse_ptr + rows)
    w = tl.where(grad_ok, tl.load(w_ptr + rows * stride_w).to(tl.float32), 0.0)
    x_off = rows.to(tl.int64) * stride_x
    g_off = rows.to(tl.int64) * stride_g
    cols = tl.arange(0, BLOCK_V)
    for c0 in range(0, V, BLOCK_V):
        c = c0 + cols
        ok = row_ok[:, None] & (c[None, :] < V)
        x = _load_x(x_ptr, x_off, c, ok, softcap, HAS_SOFTCAP)
        g = _grad_tile(x, c, t_local, lse, w, ls_over_v, one_minus_ls, two_z, softcap,
                       HAS_SOFTCAP)
        tl.store(g_ptr + g_off[:, None] + c[None, :], g.to(g_ptr.dtype.element_ty), mask=ok)


@triton.jit
def ce_scale_kernel(g_ptr, s_ptr, n, BLOCK: tl.constexpr):
    """g *= s in place, skipped entirely (no load, no store) when s == 1."""
    s = tl.load(s_ptr).to(tl.float32)
    if s != 1.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        g = tl.load(g_ptr + offs, mask=ok)
        tl.store(g_ptr + offs, (g.to(tl.float32) * s).to(g_ptr.dtype.element_ty), mask=ok)
