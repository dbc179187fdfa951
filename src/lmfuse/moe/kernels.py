"""Triton kernels of the mixture-of-experts MLP: grouped GEMMs over the experts' token rows.

The ``T * k`` (token, slot) pairs are sorted by expert once (``routing.py``'s kernels; torch
ops in the interpreter): row ``r`` of the sorted order belongs to token ``token[r]``, and
expert ``e`` owns the rows ``offsets[e] .. offsets[e + 1]``. Two kinds of grouped GEMM walk
them:

* **Row-tiled** (``moe_up_kernel``, ``moe_down_kernel``, ``moe_act_bwd_kernel``): the grid is
  ``(row tiles, N tiles)``. Row tile ``i`` is a slot of the tile table ``tiles [slots, 3]``
  (expert, first row, end row), built on the device from the offsets: every expert's rows
  cut into ``BLOCK_M`` tiles, so a tile never mixes experts and an expert without rows has
  no tile. The table has a slot for the most tiles any routing can need
  (``cdiv(T k, BLOCK_M) + min(E, T k)``), so the grid does not depend on the routing (no
  host synchronisation; CUDA graphs capture it); unused slots (``first == end``) exit.
* **Per-expert reductions over rows** (``moe_wgrad_kernel``): the weight gradients
  ``sum_r A[r]^T B[r]`` over an expert's rows, the grid ``(M tiles * N tiles, E)``, each
  program looping over its expert's rows ``BLOCK_K`` at a time; an expert without rows
  writes zeros. Its bias gradient comes out of the same loop.

``moe_combine_kernel`` sums each token's ``k`` slot rows in a fixed order (deterministic, no
atomics). Accumulation is float32; the activation math (``activations/kernels.py``'s
helpers: the same formulas, NaN and inf behaviour as the activation family) is float32 in
the epilogues. With float32 operands ``IEEE`` keeps ``tl.dot`` in full float32 (no TF32);
``DOT_F32`` and ``RTNE`` make Triton's interpreter multiply and round bfloat16 as a GPU does.
Block sizes are launch parameters (``ops._config``); no tuning constant lives here.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._fp8 import store_e4m3
from ..activations.kernels import activate, activate_and_grad, chain_grad


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    """``acc + a @ b``; ``DOT_F32``: the operands widened to float32 first (bfloat16 in the
    interpreter, whose dot multiplies bf16 bit patterns; exact: the products of the widened
    values are those a bf16 tensor core forms)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _out(v, dtype: tl.constexpr, RTNE: tl.constexpr):
    """float32 ``v`` as ``dtype``. ``RTNE``: rounded to nearest even by hand first, for
    bfloat16 in Triton's interpreter, whose float32 -> bfloat16 conversion truncates (GPUs
    round to nearest even): the interpreter then rounds as the GPU does, so its bf16 results
    are checked at bf16's tolerance. NaN and inf are kept."""
    if RTNE:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        v = tl.where(v != v, v, bits.to(tl.float32, bitcast=True))
    return v.to(dtype)


@triton.jit
def _store_h(ptr, v, mask, H_FP8: tl.constexpr, RTNE: tl.constexpr):
    """float32 pre-activation ``v`` stored for the backward. ``H_FP8`` (``fp8_input_store``):
    as float8_e4m3fn values, saturated at +-448, rounded to nearest even, NaN kept
    (``saturate_e4m3``); into a float8_e4m3fn buffer, or, where the GPU cannot convert to
    float8 (compute capability < 8.9), into a buffer of hidden's dtype, which holds every
    e4m3 value exactly (ops.py then casts it to float8 without rounding again)."""
    if H_FP8:
        store_e4m3(ptr, v, mask)
    else:
        tl.store(ptr, _out(v, ptr.dtype.element_ty, RTNE), mask=mask)


@triton.jit
def _tile(TILES):
    """This program's row tile: (expert, first row, end row)."""
    t = tl.program_id(0)
    return tl.load(TILES + 3 * t), tl.load(TILES + 3 * t + 1), tl.load(TILES + 3 * t + 2)


@triton.jit
def _gate_up_cols(cols, F, INTERLEAVED: tl.constexpr):
    """Columns of the gate and up outputs ``cols`` in the ``2F`` gate/up dimension."""
    if INTERLEAVED:
        return 2 * cols, 2 * cols + 1
    else:
        return cols, cols + F


@triton.jit
def _clamped(g, u, clamp, HAS_CLAMP: tl.constexpr):
    """``gate <= c``, ``-c <= up <= c`` (NaN kept, as torch.clamp)."""
    if HAS_CLAMP:
        g = tl.minimum(g, clamp, propagate_nan=tl.PropagateNan.ALL)
        u = tl.clamp(u, -clamp, clamp, propagate_nan=tl.PropagateNan.ALL)
    return g, u


@triton.jit
def _store_h_pair(row, gcol, ucol, g, u, mask, GATED: tl.constexpr, H_FP8: tl.constexpr,
                  RTNE: tl.constexpr):
    """The gate (and up) pre-activations of a tile stored at ``row + gcol`` (``+ ucol``) for
    the backward (``_store_h``)."""
    _store_h(row + gcol[None, :], g, mask, H_FP8, RTNE)
    if GATED:
        _store_h(row + ucol[None, :], u, mask, H_FP8, RTNE)


@triton.jit
def _gated_act(g, u, clamp, offset, ACT: tl.constexpr, GATED: tl.constexpr,
               HAS_CLAMP: tl.constexpr):
    """The experts' activation of the float32 pre-activations: ``act(g) * (u + offset)``
    after the clamp when GATED (``u`` unused otherwise), ``act(g)``."""
    if GATED:
        g, u = _clamped(g, u, clamp, HAS_CLAMP)
        a = activate(g, ACT) * (u + offset)
    else:
        a = activate(g, ACT)
    return a


@triton.jit
def _weighted_grad(g, s):
    """``g * s``: the gradient ``g`` of an expert's output (before its router weight ``s``)
    times the weight, NaN where ``s`` is +-inf. The reference multiplies first and sums
    after (``(s * dout) @ w_down[e]``): an infinite weight makes every term infinite, of
    mixed signs, so the sum is NaN there, not ``g``'s own sign times inf."""
    return tl.where(tl.abs(s) == float("inf"), float("nan"), g * s)


@triton.jit
def _act_backward(h_row, dh_row, cols, mask, ds, F, offset, clamp, ACT: tl.constexpr,
                  GATED: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_CLAMP: tl.constexpr,
                  RTNE: tl.constexpr):
    """The activation's backward for one tile of outputs ``cols``: ``h`` read at ``h_row``
    (row pointers into ``[T k, K2]``, hidden's dtype or float8), ``ds`` the gradient of its
    output (router weight applied); ``dh`` stored at ``dh_row``; returns ``a = act(h)``
    recomputed (float32)."""
    if GATED:
        gcol, ucol = _gate_up_cols(cols, F, INTERLEAVED)
        g = tl.load(h_row + gcol[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_row + ucol[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_CLAMP:
            # torch.clamp's gradient: 0 where the clamp is active, and at NaN.
            keep_g = g <= clamp
            keep_u = (u >= -clamp) & (u <= clamp)
        g, u = _clamped(g, u, clamp, HAS_CLAMP)
        act, dact = activate_and_grad(g, ACT)
        lin = u + offset
        a = act * lin
        dg = chain_grad(g, ds * lin, dact, ACT)
        du = ds * act
        if HAS_CLAMP:
            dg = tl.where(keep_g, dg, 0.0)
            du = tl.where(keep_u, du, 0.0)
        tl.store(dh_row + gcol[None, :], _out(dg, dh_row.dtype.element_ty, RTNE), mask=mask)
        tl.store(dh_row + ucol[None, :], _out(du, dh_row.dtype.element_ty, RTNE), mask=mask)
    else:
        h = tl.load(h_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        a, dact = activate_and_grad(h, ACT)
        tl.store(dh_row + cols[None, :], _out(chain_grad(h, ds, dact, ACT),
                                              dh_row.dtype.element_ty, RTNE), mask=mask)
    return a


@triton.jit
def moe_up_kernel(
    X, stride_x, TOKEN, W, stride_we, stride_wn, stride_wk, BIAS, H_OUT, A_OUT, TILES,
    H, F, offset, clamp,
    ACT: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_CLAMP: tl.constexpr, STORE_H: tl.constexpr,
    H_FP8: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr, RTNE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``h = x[token[r]] @ W[e].T + bias[e]`` for the tile's rows and the gate/up columns of
    ``BLOCK_N`` activation outputs, then ``a = act(h)``: ``A_OUT [T k, F]``; with
    ``STORE_H`` also ``h`` itself (``H_OUT [T k, K2]``, the gate/up layout of W's rows),
    which the backward reads; ``H_FP8``: ``h`` rounded to float8_e4m3fn (see ``_store_h``),
    from the float32 accumulator (one rounding), while ``a`` is computed from the
    accumulator itself (the forward does not change). ``W [E, K2, H]`` at strides
    (``stride_we``, ``stride_wn``, ``stride_wk``), ``K2 = 2 F`` gated, else ``F``;
    ``BIAS [E, K2]`` contiguous."""
    e, start, end = _tile(TILES)
    if start < end:
        rows = start + tl.arange(0, BLOCK_M)
        rmask = rows < end
        tok = tl.load(TOKEN + rows, mask=rmask, other=0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < F
        ks = tl.arange(0, BLOCK_K)
        K2 = 2 * F if GATED else F
        if GATED:
            gcol, ucol = _gate_up_cols(cols, F, INTERLEAVED)
        else:
            gcol = cols
        w_e = W + e.to(tl.int64) * stride_we
        x_ptr = X + tok[:, None] * stride_x + ks[None, :]
        g_ptr = w_e + gcol.to(tl.int64)[None, :] * stride_wn + ks[:, None] * stride_wk
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        if GATED:
            u_ptr = w_e + ucol.to(tl.int64)[None, :] * stride_wn + ks[:, None] * stride_wk
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kmask = (k0 + ks) < H
            x = tl.load(x_ptr, mask=rmask[:, None] & kmask[None, :], other=0.0)
            wmask = kmask[:, None] & cmask[None, :]
            acc_g = _dot(x, tl.load(g_ptr, mask=wmask, other=0.0), acc_g, IEEE, DOT_F32)
            if GATED:
                acc_u = _dot(x, tl.load(u_ptr, mask=wmask, other=0.0), acc_u, IEEE, DOT_F32)
                u_ptr += BLOCK_K * stride_wk
            x_ptr += BLOCK_K
            g_ptr += BLOCK_K * stride_wk
        if HAS_BIAS:
            b_e = BIAS + e.to(tl.int64) * K2
            acc_g += tl.load(b_e + gcol, mask=cmask, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_u += tl.load(b_e + ucol, mask=cmask, other=0.0).to(tl.float32)[None, :]
        mask = rmask[:, None] & cmask[None, :]
        rows64 = rows.to(tl.int64)
        if not GATED:
            acc_u = acc_g  # (unused: one pre-activation)
            ucol = gcol
        if STORE_H:
            _store_h_pair(H_OUT + rows64[:, None] * K2, gcol, ucol, acc_g, acc_u, mask, GATED,
                          H_FP8, RTNE)
        a = _gated_act(acc_g, acc_u, clamp, offset, ACT, GATED, HAS_CLAMP)
        tl.store(A_OUT + rows64[:, None] * F + cols[None, :],
                 _out(a, A_OUT.dtype.element_ty, RTNE), mask=mask)


@triton.jit
def moe_down_kernel(
    A, stride_a, W, stride_we, stride_wk, stride_wn, BIAS, SCALE, TOKEN, C, stride_c, TILES,
    N, K,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, SCATTER: tl.constexpr,
    IEEE: tl.constexpr, DOT_F32: tl.constexpr, RTNE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``C[r] = (A[r] @ B_e + bias[e]) * scale[r]`` for the tile's rows ``r`` (expert ``e``),
    ``B_e[k, n] = W[e]`` at strides (``stride_wk``, ``stride_wn``), ``A [T k, K]`` rows
    contiguous, ``BIAS [E, N]`` contiguous, ``SCALE [T k]`` float32. ``SCATTER``: row ``r``
    is stored at ``C[token[r]]`` (``k = 1``: each token has one row, no sum needed).

    Forward: ``A = a [T k, F]``, ``W = w_down`` (``B_e = w_down[e].T``), the router weights
    as ``SCALE``. Backward: ``A = dh [T k, K2]``, ``W = w_gate_up`` (``B_e = w_gate_up[e]``),
    the gradient of the gathered hidden rows."""
    e, start, end = _tile(TILES)
    if start < end:
        rows = start + tl.arange(0, BLOCK_M)
        rmask = rows < end
        rows64 = rows.to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        ks = tl.arange(0, BLOCK_K)
        a_ptr = A + rows64[:, None] * stride_a + ks[None, :]
        w_ptr = (W + e.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wn
                 + ks[:, None] * stride_wk)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kmask = (k0 + ks) < K
            a = tl.load(a_ptr, mask=rmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_ptr, mask=kmask[:, None] & cmask[None, :], other=0.0)
            acc = _dot(a, w, acc, IEEE, DOT_F32)
            a_ptr += BLOCK_K
            w_ptr += BLOCK_K * stride_wk
        if HAS_BIAS:
            acc += tl.load(BIAS + e.to(tl.int64) * N + cols, mask=cmask,
                           other=0.0).to(tl.float32)[None, :]
        if HAS_SCALE:
            acc *= tl.load(SCALE + rows, mask=rmask, other=0.0)[:, None]
        if SCATTER:
            dest = tl.load(TOKEN + rows, mask=rmask, other=0).to(tl.int64)
        else:
            dest = rows64
        tl.store(C + dest[:, None] * stride_c + cols[None, :],
                 _out(acc, C.dtype.element_ty, RTNE), mask=rmask[:, None] & cmask[None, :])


@triton.jit
def moe_act_bwd_kernel(
    DOUT, stride_d, TOKEN, W, stride_we, stride_wk, stride_wn, DOWN_BIAS, HBUF, SCALE, DH,
    A_OUT, DW_PART, TILES, rows_total, H, F, offset, clamp,
    ACT: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr,
    HAS_CLAMP: tl.constexpr, HAS_DOWN_BIAS: tl.constexpr, IEEE: tl.constexpr,
    DOT_F32: tl.constexpr, RTNE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The backward through the down projection and the activation, for the tile's rows and
    ``BLOCK_N`` activation outputs.

    ``g = dout[token[r]] @ w_down[e]`` (the gradient of the expert output, before the router
    weight ``s_r``); then, from ``h`` (``HBUF [T k, K2]``) recomputed: ``a = act(h)`` (stored
    to ``A_OUT [T k, F]`` for the down weight's gradient), ``dh = act'(h) * g * s_r``
    (``DH [T k, K2]``, gate/up layout) and the router weight's gradient ``<dout[t],
    expert_out[r]> = <g, a> + <dout[t], down_bias[e]>`` as one float32 partial per column
    tile (``DW_PART [N tiles, T k]``; the bias term in tile 0), summed afterwards. ``HBUF``
    is in hidden's dtype or, with ``fp8_input_store``, float8_e4m3fn (loaded as such where
    the GPU can; ops.py converts it first elsewhere): the same code reads either."""
    e, start, end = _tile(TILES)
    if start < end:
        pid_n = tl.program_id(1)
        rows = start + tl.arange(0, BLOCK_M)
        rmask = rows < end
        rows64 = rows.to(tl.int64)
        tok = tl.load(TOKEN + rows, mask=rmask, other=0).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < F
        ks = tl.arange(0, BLOCK_K)
        d_ptr = DOUT + tok[:, None] * stride_d + ks[None, :]
        w_ptr = (W + e.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wn
                 + ks[:, None] * stride_wk)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        bdot = tl.zeros((BLOCK_M,), tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kmask = (k0 + ks) < H
            d = tl.load(d_ptr, mask=rmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_ptr, mask=kmask[:, None] & cmask[None, :], other=0.0)
            acc = _dot(d, w, acc, IEEE, DOT_F32)
            if HAS_DOWN_BIAS:
                bd = tl.load(DOWN_BIAS + e.to(tl.int64) * H + k0 + ks, mask=kmask, other=0.0)
                bdot += tl.sum(d.to(tl.float32) * bd.to(tl.float32)[None, :], axis=1)
            d_ptr += BLOCK_K
            w_ptr += BLOCK_K * stride_wk
        mask = rmask[:, None] & cmask[None, :]
        s = tl.load(SCALE + rows, mask=rmask, other=0.0)[:, None]
        ds = _weighted_grad(acc, s)
        K2 = 2 * F if GATED else F
        a = _act_backward(HBUF + rows64[:, None] * K2, DH + rows64[:, None] * K2, cols, mask,
                          ds, F, offset, clamp, ACT, GATED, INTERLEAVED, HAS_CLAMP, RTNE)
        tl.store(A_OUT + rows64[:, None] * F + cols[None, :],
                 _out(a, A_OUT.dtype.element_ty, RTNE), mask=mask)
        part = tl.sum(tl.where(mask, acc * a, 0.0), axis=1)
        if HAS_DOWN_BIAS:
            part += tl.where(pid_n == 0, bdot, 0.0)
        tl.store(DW_PART + pid_n.to(tl.int64) * rows_total + rows, part, mask=rmask)


@triton.jit
def moe_wgrad_kernel(
    A, stride_a, B, stride_b, TOKEN, SCALE, OFFSETS, C, DB, M, N,
    A_GATHER: tl.constexpr, B_GATHER: tl.constexpr, HAS_SCALE: tl.constexpr,
    BIAS_GRAD: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr, RTNE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``C[e] = sum_r (A[ra] * scale[r])^T B[rb]`` over expert ``e``'s rows ``r``
    (``C [E, M, N]`` contiguous), ``ra = token[r]`` with ``A_GATHER`` else ``r`` (``rb``
    likewise); ``BIAS_GRAD``: also ``DB[e] = sum_r A[ra] * scale[r]`` (``[E, M]``).

    Down weight: ``A = dout [T, H]`` gathered, ``SCALE`` the router weights, ``B = a``.
    Gate/up weight: ``A = dh [T k, K2]``, ``B = hidden [T, H]`` gathered."""
    pid = tl.program_id(0)
    e = tl.program_id(1)
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    lo = tl.load(OFFSETS + e)
    hi = tl.load(OFFSETS + e + 1)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = ms < M
    nmask = ns < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    db = tl.zeros((BLOCK_M,), tl.float32)
    for r0 in range(lo, hi, BLOCK_K):
        rr = r0 + tl.arange(0, BLOCK_K)
        rmask = rr < hi
        ra = rr.to(tl.int64)
        rb = rr.to(tl.int64)
        if A_GATHER:
            ra = tl.load(TOKEN + rr, mask=rmask, other=0).to(tl.int64)
        if B_GATHER:
            rb = tl.load(TOKEN + rr, mask=rmask, other=0).to(tl.int64)
        at = tl.load(A + ra[None, :] * stride_a + ms[:, None],
                     mask=mmask[:, None] & rmask[None, :], other=0.0)
        if HAS_SCALE:
            sa = at.to(tl.float32) * tl.load(SCALE + rr, mask=rmask, other=0.0)[None, :]
            at = _out(sa, A.dtype.element_ty, RTNE)
        else:
            sa = at.to(tl.float32)
        if BIAS_GRAD:
            db += tl.sum(sa, axis=1)
        b = tl.load(B + rb[:, None] * stride_b + ns[None, :],
                    mask=rmask[:, None] & nmask[None, :], other=0.0)
        acc = _dot(at, b, acc, IEEE, DOT_F32)
    e64 = e.to(tl.int64)
    tl.store(C + e64 * M * N + ms[:, None] * N + ns[None, :],
             _out(acc, C.dtype.element_ty, RTNE), mask=mmask[:, None] & nmask[None, :])
    if BIAS_GRAD:
        if pid_n == 0:
            tl.store(DB + e64 * M + ms, _out(db, DB.dtype.element_ty, RTNE), mask=mmask)


@triton.jit
def moe_combine_kernel(Y, INV, OUT, N, k, SCALE, BIAS, ROW_EXPERT, ROWS_END,
                       HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, RTNE: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """``OUT[t] = sum_j (Y[r] + bias[row_expert[r]]) * scale[r]``, ``r = inv[t k + j]``
    (slots in order, float32), ``Y [T k, N]``; the bias (``BIAS [E, N]``, ``ROW_EXPERT
    [T k]`` the sorted rows' experts, always in ``[0, E)``) and the scale (``SCALE [T k]``
    float32, sorted order) only with their flags (the grouped-GEMM forward's down bias and
    router weights). Rows from ``*ROWS_END`` (the experts' last offset) on hold the pairs
    of no expert (ids outside ``[0, E)``, unchecked): never written, so never read; such a
    pair adds nothing."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    rows_end = tl.load(ROWS_END).to(tl.int64)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for j in range(0, k):
        r = tl.load(INV + t * k + j).to(tl.int64)
        ok = r < rows_end  # (its loads stay in bounds either way)
        y = tl.load(Y + r * N + cols, mask=cmask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            e = tl.load(ROW_EXPERT + r).to(tl.int64)
            y += tl.load(BIAS + e * N + cols, mask=cmask, other=0.0).to(tl.float32)
        if HAS_SCALE:
            y *= tl.load(SCALE + r)
        acc += tl.where(ok, y, 0.0)
    tl.store(OUT + t * N + cols, _out(acc, OUT.dtype.element_ty, RTNE), mask=cmask)


# --- the grouped-GEMM engine's element-wise kernels -------------------------------------------
# With ``torch._grouped_mm`` doing the GEMMs (``ops._grouped_engine``), what the row-tiled
# kernels fuse into their epilogues runs here, over the GEMMs' outputs in sorted row order.


@triton.jit
def moe_act_kernel(
    HBUF, H8, A_OUT, BIAS, ROW_EXPERT, rows, F, offset, clamp,
    ACT: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_CLAMP: tl.constexpr, WRITE_H: tl.constexpr,
    H_FP8: tl.constexpr, RTNE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr,
):
    """``a = act(h + bias[e])`` for ``BLOCK_R`` rows and ``BLOCK_F`` activation outputs, from
    the gate/up GEMM's output ``HBUF [T k, K2]`` (``ROW_EXPERT [T k]``: each sorted row's
    expert, read with ``HAS_BIAS``), into ``A_OUT [T k, F]``. What the backward keeps of
    ``h + bias``: ``WRITE_H``, written back over ``HBUF``; ``H_FP8``, as float8_e4m3fn into
    ``H8`` (``_store_h``). A one-dimensional grid, a row tile's column tiles consecutive
    (programs that run together walk memory in address order; see ``act_fwd_kernel``)."""
    col_tiles = tl.cdiv(F, BLOCK_F)
    r = (tl.program_id(0) // col_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (tl.program_id(0) % col_tiles) * BLOCK_F + tl.arange(0, BLOCK_F)
    rmask = r < rows
    mask = rmask[:, None] & (cols < F)[None, :]
    r64 = r.to(tl.int64)
    K2 = 2 * F if GATED else F
    if GATED:
        gcol, ucol = _gate_up_cols(cols, F, INTERLEAVED)
    else:
        gcol = cols
    h_row = HBUF + r64[:, None] * K2
    g = tl.load(h_row + gcol[None, :], mask=mask, other=0.0).to(tl.float32)
    if GATED:
        u = tl.load(h_row + ucol[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b_e = BIAS + tl.load(ROW_EXPERT + r, mask=rmask, other=0).to(tl.int64)[:, None] * K2
        g += tl.load(b_e + gcol[None, :], mask=mask, other=0.0).to(tl.float32)
        if GATED:
            u += tl.load(b_e + ucol[None, :], mask=mask, other=0.0).to(tl.float32)
    if not GATED:
        u = g  # (unused: one pre-activation)
        ucol = gcol
    if WRITE_H:
        _store_h_pair(h_row, gcol, ucol, g, u, mask, GATED, False, RTNE)
    if H_FP8:
        _store_h_pair(H8 + r64[:, None] * K2, gcol, ucol, g, u, mask, GATED, True, RTNE)
    a = _gated_act(g, u, clamp, offset, ACT, GATED, HAS_CLAMP)
    tl.store(A_OUT + r64[:, None] * F + cols[None, :], _out(a, A_OUT.dtype.element_ty, RTNE),
             mask=mask)


@triton.jit
def moe_act_bwd_rows_kernel(
    G, HBUF, SCALE, PERM, DOUT_ROWS, DOWN_BIAS, ROW_EXPERT, DH, AS_OUT, D_RW, rows, H, F,
    offset, clamp,
    ACT: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr,
    HAS_CLAMP: tl.constexpr, HAS_DOWN_BIAS: tl.constexpr, NEED_RW: tl.constexpr,
    RTNE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr,
):
    """The backward through the activation for ``BLOCK_R`` sorted rows, all ``F`` outputs
    ``BLOCK_F`` at a time, from ``g = dout[token[r]] @ w_down[e]`` (``G [T k, F]``, before
    the router weight ``s_r = SCALE[r]``) and ``h`` (``HBUF [T k, K2]``, hidden's dtype or
    float8_e4m3fn): ``dh = act'(h) * g * s_r`` (``DH``), ``s_r act(h)`` (``AS_OUT [T k, F]``,
    the down weight's gradient operand) and, with ``NEED_RW``, the router weight's gradient
    ``<g, act(h)> + <dout[t], down_bias[e]>`` (``DOUT_ROWS [T k, H]``: dout's gathered rows)
    stored at ``D_RW[perm[r]]`` (pair order)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < rows
    r64 = r.to(tl.int64)
    s = tl.load(SCALE + r, mask=rmask, other=0.0)[:, None]
    dot = tl.zeros((BLOCK_R,), tl.float32)
    K2 = 2 * F if GATED else F
    h_row = HBUF + r64[:, None] * K2
    dh_row = DH + r64[:, None] * K2
    for f0 in range(0, F, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        mask = rmask[:, None] & (cols < F)[None, :]
        gr = tl.load(G + r64[:, None] * F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        ds = _weighted_grad(gr, s)
        a = _act_backward(h_row, dh_row, cols, mask, ds, F, offset, clamp, ACT, GATED,
                          INTERLEAVED, HAS_CLAMP, RTNE)
        tl.store(AS_OUT + r64[:, None] * F + cols[None, :],
                 _out(a * s, AS_OUT.dtype.element_ty, RTNE), mask=mask)
        if NEED_RW:
            dot += tl.sum(tl.where(mask, gr * a, 0.0), axis=1)
    if NEED_RW:
        if HAS_DOWN_BIAS:
            b_e = (DOWN_BIAS
                   + tl.load(ROW_EXPERT + r, mask=rmask, other=0).to(tl.int64)[:, None] * H)
            for h0 in range(0, H, BLOCK_F):
                hc = h0 + tl.arange(0, BLOCK_F)
                m = rmask[:, None] & (hc < H)[None, :]
                d = tl.load(DOUT_ROWS + r64[:, None] * H + hc[None, :], mask=m, other=0.0)
                b = tl.load(b_e + hc[None, :], mask=m, other=0.0)
                dot += tl.sum(d.to(tl.float32) * b.to(tl.float32), axis=1)
        dest = tl.load(PERM + r, mask=rmask, other=0)
        tl.store(D_RW + dest, dot, mask=rmask)


@triton.jit
def moe_segment_sum_kernel(A, SCALE, OFFSETS, OUT, N, HAS_SCALE: tl.constexpr,
                           RTNE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """``OUT[e] = sum_r A[r] * scale[r]`` over expert ``e``'s sorted rows (``A [T k, N]``
    contiguous, ``OUT [E, N]``; zeros for an expert without rows), in row order: the bias
    gradients of the grouped-GEMM engine, deterministic."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    e = tl.program_id(1)
    cmask = cols < N
    lo = tl.load(OFFSETS + e)
    hi = tl.load(OFFSETS + e + 1)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for r0 in range(lo, hi, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        rmask = rr < hi
        a = tl.load(A + rr.to(tl.int64)[:, None] * N + cols[None, :],
                    mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        if HAS_SCALE:
            a *= tl.load(SCALE + rr, mask=rmask, other=0.0)[:, None]
        acc += tl.sum(a, axis=0)
    tl.store(OUT + e.to(tl.int64) * N + cols, _out(acc, OUT.dtype.element_ty, RTNE),
             mask=cmask)


@triton.jit
def moe_spread_kernel(X, x_s0, INV, Y, T, N, k, BLOCK_T: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """``Y[inv[t k + j]] = X[t]`` for every slot ``j``: the tokens' rows in sorted order
    (``Y [T k, N]``), what ``X.index_select(0, token)`` gives, walked in token order so each
    row of ``X`` is read from memory once and written ``k`` times (the index_select's
    reads in sorted order come back from memory about as often as they are written)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tmask = t < T
    mask = tmask[:, None] & (cols < N)[None, :]
    t64 = t.to(tl.int64)
    v = tl.load(X + t64[:, None] * x_s0 + cols[None, :], mask=mask)
    for j in range(0, k):
        r = tl.load(INV + t64 * k + j, mask=tmask, other=0).to(tl.int64)
        tl.store(Y + r[:, None] * N + cols[None, :], v, mask=mask)
