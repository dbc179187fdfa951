"""Triton kernels of the Generator's fused decode layers (see ``fused.py``).

* ``rope_append_kernel``: one program per (row, head) of a decode step's projections: a
  query head is (optionally RMS-normed, then) rotated and written to the attention's query
  buffer; a KV head's key is normed and rotated, and it and the value are written to their
  paged cache block (quantised to e4m3 with per-head scales for an fp8 cache). It replaces
  the dozen elementwise launches of a model's rotary code and the cache append.
* ``gemv_kernel``: ``y = x @ W.T`` for the few rows of a decode step, a program per
  ``BLOCK_N`` output features streaming its weight rows once. Up to three weight matrices
  (separate tensors, read in place) share one launch and one output row (Q, K and V); the
  epilogue may add a bias, add the residual stream (``y = r + x @ W.T``, in place), or
  gate two matrices (``silu(x @ Wg.T) * (x @ Wu.T)``: the gated MLP's two projections and
  its activation in one pass), do ``rope_append_kernel``'s work on the QKV projections
  (ROPE), or leave each tile's row maxima for the greedy tokens (ARGMAX).
* ``copy_kernel``: a flat copy between the GPU and pinned host memory on the compute
  queue (``runner.bus_copy``).
* ``embed_kernel``: the step's token embeddings gathered, with the first RMSNorm's work
  (``h * g`` and the sums of squares) that ``gemv_kernel``'s PRENORM does for the others.
* ``l2_prefetch_kernel``: asks the L2 cache for byte ranges of the weights a one-row step
  reads next (Hopper's bulk prefetch), on a side branch of the step's graph.

Float32 accumulation and math; one rounding to the output dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._pdl import pdl_start, pdl_wait
from .._fp8 import saturate_e4m3


@triton.jit
def rope_append_kernel(
    QKV, QOUT, KC, VC, COS, SIN, POS, TABLE, QNW, KNW, K_SCALE, V_SCALE,
    stride_b, stride_ob, stride_kblk, stride_krow, stride_vblk, stride_vrow, stride_tb,
    num_blocks, positions, eps, n_rows,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    BLOCK_LEN: tl.constexpr, QK_NORM: tl.constexpr, FP8: tl.constexpr,
    PDL: tl.constexpr = 0, ROWS: tl.constexpr = 1,
):
    """``QKV [B, (HQ + 2 HKV) * D]`` rows (q heads, k heads, v heads), ``POS [B]`` the
    token's position (also where it goes in its sequence), ``COS``/``SIN [P, HALF]``
    float32 (rotate-half convention: dims ``i`` and ``i + HALF`` rotate together). A
    program takes ``ROWS`` rows (of ``n_rows``) of one head: one for a decode step's few,
    more for a long prefill's (a program per row and head ran at about 0.5 TB/s there)."""
    pdl_wait(PDL)
    pdl_start(PDL)
    b = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    h = tl.program_id(1)
    i = tl.arange(0, HALF)
    live = b < n_rows
    pos = tl.load(POS + b, mask=live, other=0).to(tl.int64)
    angle = tl.minimum(tl.maximum(pos, 0), positions - 1)  # the table's rows only
    row = QKV + b[:, None] * stride_b + h * D + i[None, :]
    m2 = live[:, None]
    x1 = tl.load(row, mask=m2, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF, mask=m2, other=0.0).to(tl.float32)
    if QK_NORM:  # per-head RMSNorm of q and k (Qwen3) before the rotation
        r = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + eps)
        if h < HQ:
            w1 = tl.load(QNW + i).to(tl.float32)
            w2 = tl.load(QNW + HALF + i).to(tl.float32)
        else:
            w1 = tl.load(KNW + i).to(tl.float32)
            w2 = tl.load(KNW + HALF + i).to(tl.float32)
        x1 = x1 * r[:, None] * w1[None, :]
        x2 = x2 * r[:, None] * w2[None, :]
    c = tl.load(COS + angle[:, None] * HALF + i[None, :], mask=m2, other=0.0)
    s = tl.load(SIN + angle[:, None] * HALF + i[None, :], mask=m2, other=0.0)
    y1 = x1 * c - x2 * s
    y2 = x2 * c + x1 * s
    if h < HQ:
        out = QOUT + b[:, None] * stride_ob + h * D + i[None, :]
        tl.store(out, y1.to(QOUT.dtype.element_ty), mask=m2)
        tl.store(out + HALF, y2.to(QOUT.dtype.element_ty), mask=m2)
    else:
        j = h - HQ
        blk = tl.load(TABLE + b * stride_tb + pos // BLOCK_LEN, mask=live, other=-1)
        ok = (live & (blk >= 0) & (blk < num_blocks))[:, None]  # a padding row: no write
        off = pos % BLOCK_LEN
        v1 = tl.load(row + HKV * D, mask=ok, other=0.0).to(tl.float32)
        v2 = tl.load(row + HKV * D + HALF, mask=ok, other=0.0).to(tl.float32)
        if FP8:
            ks = tl.load(K_SCALE + j).to(tl.float32)
            vs = tl.load(V_SCALE + j).to(tl.float32)
            y1 = saturate_e4m3(tl.div_rn(y1, ks))
            y2 = saturate_e4m3(tl.div_rn(y2, ks))
            v1 = saturate_e4m3(tl.div_rn(v1, vs))
            v2 = saturate_e4m3(tl.div_rn(v2, vs))
        k_at = (KC + blk.to(tl.int64)[:, None] * stride_kblk + off[:, None] * stride_krow
                + j * D + i[None, :])
        v_at = (VC + blk.to(tl.int64)[:, None] * stride_vblk + off[:, None] * stride_vrow
                + j * D + i[None, :])
        tl.store(k_at, y1.to(KC.dtype.element_ty), mask=ok)
        tl.store(k_at + HALF, y2.to(KC.dtype.element_ty), mask=ok)
        tl.store(v_at, v1.to(VC.dtype.element_ty), mask=ok)
        tl.store(v_at + HALF, v2.to(VC.dtype.element_ty), mask=ok)


@triton.jit
def gemv_kernel(
    X, W0, W1, W2, B0, B1, B2, R, Y,
    M, K, N0, N1, stride_xm, stride_rm, stride_ym,
    WS, COUNT, K_SPLIT,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr, GATED: tl.constexpr,
    EVEN_K: tl.constexpr, PDL: tl.constexpr = 0, SPLIT_K: tl.constexpr = 1,
    G=None, eps=0.0, NORM: tl.constexpr = False,
    ROPE: tl.constexpr = False, HALF: tl.constexpr = 1, COS=None, SIN=None, POS=None,
    TABLE=None, KC=None, VC=None, K_SCALE=None, V_SCALE=None, stride_kblk=0, stride_krow=0,
    stride_vblk=0, stride_vrow=0, stride_tb=0, num_blocks=0, positions=1,
    BLOCK_LEN: tl.constexpr = 1, FP8: tl.constexpr = False,
    AVAL=None, AIDX=None, ARGMAX: tl.constexpr = False,
    PRENORM: tl.constexpr = False, XW=None, stride_xw=0, SS=None, ss_tiles=1, norm_n=1,
    BLOCK_T: tl.constexpr = 1, ROW_SCALE: tl.constexpr = False,
):
    """``Y[:, n] = X @ W.T`` over the concatenated output features of ``W0 | W1 | W2``
    (``N0``, ``N1`` rows: a program's ``BLOCK_N`` features lie in one matrix). GATED:
    ``Y = silu(X @ W0.T) * (X @ W1.T)`` (``N0`` features). RESIDUAL: ``Y = R + ...``.
    PDL: launched early in a decode step's chain (``lmfuse._pdl``).

    SPLIT_K > 1 (not GATED, not NORM): program ``(n, m, s)`` sums the K range ``[s *
    K_SPLIT, (s + 1) * K_SPLIT)`` into its float32 slot of ``WS`` (``[SPLIT_K, tiles,
    BLOCK_M, BLOCK_N]``), then counts itself in ``COUNT[tile]`` (int32, zero between
    launches); the tile's last program adds the slots in split order (the same sum
    whichever program comes last), runs the epilogue, and sets the count back to zero.

    NORM (SPLIT_K 1): ``X`` is the residual stream, RMS-normed with weight ``G`` on the way
    in: ``Y = rsqrt(mean(x^2) + eps) * ((x * g) @ W.T)``, the row's sum of squares gathered
    in the same pass over K (the norm's launch and its output's round trip saved).

    ROPE (several rows, ``W0 | W1 | W2`` = Wq | Wk | Wv of heads of ``2 HALF``
    features): ``rope_append_kernel`` in the epilogue. A program's features are ``BLOCK_N``
    dims of a head's first half and the ``BLOCK_N`` dims ``HALF`` after them (two
    accumulators, as GATED's), so it rotates its own pairs: queries to ``Y`` (``[M, N0]``),
    keys and values to their cache blocks at position ``POS[m]`` (``TABLE``; fp8 scaled by
    ``K_SCALE`` / ``V_SCALE``). One launch and one ``qkv`` round trip fewer a layer. With
    SPLIT_K > 1 as above, both accumulators in two ``WS`` slots (``[SPLIT_K, tiles, 2,
    BLOCK_M, BLOCK_N]``), the tile's last program rotating their sums.

    ARGMAX (one matrix, no residual, SPLIT_K 1; an LM head): each tile's first maximum of
    each row as ``argmax_chunk_kernel`` gives a chunk's (of the stored, rounded values; NaN
    above everything) to ``AVAL`` / ``AIDX`` ``[M, tiles]``, which ``argmax_merge_kernel``
    reduces: greedy decoding's pass over the logits saved.

    PRENORM (RESIDUAL, one matrix, not NORM; several rows): the next RMSNorm's work on the
    new residual stream ``h = Y``, left for the GEMV that takes the norm's output (the
    norm's launch saved): ``XW = h * G`` (each stored value of ``h`` times the norm's
    weight, rounded to ``XW``'s dtype), and each tile's sums of squares of its rows'
    stored values in ``SS [M, tiles]`` float32.

    ROW_SCALE (with ``X = XW`` and ``SS`` of a PRENORM launch of ``ss_tiles`` tiles over
    ``norm_n`` features): each row's products scaled by ``rsqrt(mean(h^2) + eps)``, its
    partial sums added in tile order, before the bias and the epilogue: the GEMV of the
    normed rows, ``rms_norm(h) @ W.T``."""
    pdl_wait(PDL)
    pdl_start(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    rows = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    if SPLIT_K > 1:
        k_start = tl.program_id(2) * K_SPLIT
        k_stop = tl.minimum(k_start + K_SPLIT, K)
    else:
        k_start = 0
        k_stop = K
    ks = ks + k_start
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = ms < M
    if ROPE:  # BLOCK_N dims of one head's first half (and, in acc_u, their partners)
        tiles_per_half = HALF // BLOCK_N
        n0 = (pid_n // tiles_per_half) * (2 * HALF) + (pid_n % tiles_per_half) * BLOCK_N
    # Which matrix this program's features belong to, and their rows in it.
    if GATED:
        W = W0
        local = n0
    elif n0 < N0:
        W = W0
        local = n0
    elif n0 < N0 + N1:
        W = W1
        local = n0 - N0
    else:
        W = W2
        local = n0 - N0 - N1
    w_ptr = W + (local + rows).to(tl.int64)[:, None] * K + ks[None, :]
    x_ptr = X + ms.to(tl.int64)[:, None] * stride_xm + ks[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if GATED:
        u_ptr = W1 + (local + rows).to(tl.int64)[:, None] * K + ks[None, :]
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if ROPE:
        u_ptr = W + (local + HALF + rows).to(tl.int64)[:, None] * K + ks[None, :]
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if NORM:
        ss = tl.zeros([BLOCK_M], tl.float32)
        g_ptr = G + ks
    if ROW_SCALE:  # (taken before the loop or after it: the same time, H100)
        t = tl.arange(0, BLOCK_T)
        part = tl.load(SS + ms.to(tl.int64)[:, None] * ss_tiles + t[None, :],
                       mask=mmask[:, None] & (t < ss_tiles)[None, :], other=0.0)
        xs = tl.rsqrt(tl.sum(part, axis=1) / norm_n + eps)[:, None]
    for k0 in range(k_start, k_stop, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptr)
            x = tl.load(x_ptr, mask=mmask[:, None], other=0.0)
            if NORM:
                g = tl.load(g_ptr)
        else:
            kmask = (ks + (k0 - k_start)) < k_stop
            w = tl.load(w_ptr, mask=kmask[None, :], other=0.0)
            x = tl.load(x_ptr, mask=mmask[:, None] & kmask[None, :], other=0.0)
            if NORM:
                g = tl.load(g_ptr, mask=kmask, other=0.0)
        if NORM:
            xn = x.to(tl.float32)
            ss += tl.sum(xn * xn, axis=1)
            xn = xn * g.to(tl.float32)[None, :]
            x = xn.to(x.dtype)
            g_ptr += BLOCK_K
        if BLOCK_M == 1:  # one row: products summed per feature (no 16-row dot tile)
            if NORM:
                xf = xn
            else:
                xf = x.to(tl.float32)
            acc += tl.sum(xf * w.to(tl.float32), axis=1)[None, :]
        else:
            acc += tl.dot(x, tl.trans(w))
        if GATED or ROPE:
            if EVEN_K:
                u = tl.load(u_ptr)
            else:
                u = tl.load(u_ptr, mask=kmask[None, :], other=0.0)
            if BLOCK_M == 1:
                acc_u += tl.sum(xf * u.to(tl.float32), axis=1)[None, :]
            else:
                acc_u += tl.dot(x, tl.trans(u))
            u_ptr += BLOCK_K
        w_ptr += BLOCK_K
        x_ptr += BLOCK_K
    if NORM:
        inv = tl.rsqrt(ss / K + eps)[:, None]
        acc = acc * inv
        if GATED:
            acc_u = acc_u * inv
    if ROW_SCALE:
        acc = acc * xs
        if GATED or ROPE:
            acc_u = acc_u * xs
    if SPLIT_K > 1:
        # Every split's partials in its slot; the tile's last program sums them in order.
        last, acc, acc_u = _split_k_sum(acc, acc_u if ROPE else acc, WS, COUNT, rows,
                                        BLOCK_M, BLOCK_N, SPLIT_K, ROPE)
        if last:
            if ROPE:
                _rope_epilogue(acc, acc_u, B0, B1, B2, Y, N0, N1, stride_ym, n0, local, rows,
                               ms, mmask, COS, SIN, POS, TABLE, KC, VC, K_SCALE, V_SCALE,
                               stride_kblk, stride_krow, stride_vblk, stride_vrow, stride_tb,
                               num_blocks, positions, HAS_BIAS, HALF, BLOCK_LEN, FP8)
            else:
                y = _gemv_epilogue(acc, acc, B0, B1, B2, R, Y, N0, N1, stride_rm, stride_ym,
                                   n0, local, rows, ms, mmask, HAS_BIAS, RESIDUAL, False)
                if PRENORM:
                    _prenorm_epilogue(y, G, XW, SS, stride_xw, n0 + rows, ms, mmask, pid_n,
                                      tl.num_programs(0))
    elif ROPE:
        _rope_epilogue(acc, acc_u, B0, B1, B2, Y, N0, N1, stride_ym, n0, local, rows, ms,
                       mmask, COS, SIN, POS, TABLE, KC, VC, K_SCALE, V_SCALE, stride_kblk,
                       stride_krow, stride_vblk, stride_vrow, stride_tb, num_blocks,
                       positions, HAS_BIAS, HALF, BLOCK_LEN, FP8)
    else:
        y = _gemv_epilogue(acc, acc_u if GATED else acc, B0, B1, B2, R, Y, N0, N1, stride_rm,
                           stride_ym, n0, local, rows, ms, mmask, HAS_BIAS, RESIDUAL, GATED)
        if PRENORM:
            _prenorm_epilogue(y, G, XW, SS, stride_xw, n0 + rows, ms, mmask, pid_n,
                              tl.num_programs(0))
        if ARGMAX:
            cols = (n0 + rows)[None, :]
            v, i = _first_max(y.to(tl.float32), cols, N0)
            at = ms.to(tl.int64) * tl.num_programs(0) + pid_n
            tl.store(AVAL + at, v, mask=mmask)
            tl.store(AIDX + at, i, mask=mmask)


@triton.jit
def _split_k_sum(acc, acc_u, WS, COUNT, rows, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 SPLIT_K: tl.constexpr, PAIR: tl.constexpr):
    """SPLIT_K's reduction (see ``gemv_kernel``): this program's float32 partial ``acc``
    (and ``acc_u`` when PAIR: two slots a tile) stored in its split's slot of ``WS``, then
    counted in ``COUNT[tile]``. Returns ``(last, acc, acc_u)``: ``last`` for the tile's
    last program, whose accumulators are then the slots' sums in split order (the same
    sum whichever program comes last) and which sets the count back to zero."""
    parts: tl.constexpr = 2 if PAIR else 1
    tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    tiles = tl.num_programs(0) * tl.num_programs(1)
    cell = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + rows[None, :]
    slot = (tl.program_id(2) * tiles + tile).to(tl.int64) * (parts * BLOCK_M * BLOCK_N)
    tl.store(WS + slot + cell, acc)
    if PAIR:
        tl.store(WS + slot + BLOCK_M * BLOCK_N + cell, acc_u)
    tl.debug_barrier()  # every thread's partials stored before the count says so
    done = tl.atomic_add(COUNT + tile, 1, sem="acq_rel")
    last = done == SPLIT_K - 1
    if last:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for s in range(SPLIT_K):
            slot = (s * tiles + tile).to(tl.int64) * (parts * BLOCK_M * BLOCK_N)
            acc += tl.load(WS + slot + cell, cache_modifier=".cg")
            if PAIR:
                acc_u += tl.load(WS + slot + BLOCK_M * BLOCK_N + cell, cache_modifier=".cg")
        tl.store(COUNT + tile, 0)
    return last, acc, acc_u


@triton.jit
def _prenorm_epilogue(y, G, XW, SS, stride_xw, cols, ms, mmask, pid_n, tiles):
    """PRENORM's epilogue (see ``gemv_kernel``) of the stored tile ``y`` of ``h``."""
    hv = y.to(tl.float32)
    tl.store(SS + ms.to(tl.int64) * tiles + pid_n, tl.sum(hv * hv, axis=1), mask=mmask)
    g = tl.load(G + cols).to(tl.float32)
    tl.store(XW + ms.to(tl.int64)[:, None] * stride_xw + cols[None, :],
             (hv * g[None, :]).to(XW.dtype.element_ty), mask=mmask[:, None])


@triton.jit
def _rope_epilogue(acc, acc_u, B0, B1, B2, Y, N0, N1, stride_ym, n0, local, rows, ms, mmask,
                   COS, SIN, POS, TABLE, KC, VC, K_SCALE, V_SCALE, stride_kblk, stride_krow,
                   stride_vblk, stride_vrow, stride_tb, num_blocks, positions,
                   HAS_BIAS: tl.constexpr, HALF: tl.constexpr, BLOCK_LEN: tl.constexpr,
                   FP8: tl.constexpr):
    """ROPE's epilogue (see ``gemv_kernel``): biases, the rotation of q and k (float32, as
    ``rope_append_kernel``), then the stores."""
    if HAS_BIAS:
        if n0 < N0:
            bias = B0
        elif n0 < N0 + N1:
            bias = B1
        else:
            bias = B2
        acc += tl.load(bias + local + rows).to(tl.float32)[None, :]
        acc_u += tl.load(bias + local + HALF + rows).to(tl.float32)[None, :]
    pos = tl.load(POS + ms, mask=mmask, other=0).to(tl.int64)
    i = (local % (2 * HALF)) + rows  # the dims of the head's first half
    y1 = acc
    y2 = acc_u
    if n0 < N0 + N1:  # q or k: rotated
        angle = tl.minimum(tl.maximum(pos, 0), positions - 1)  # the table's rows only
        c = tl.load(COS + angle[:, None] * HALF + i[None, :])
        s = tl.load(SIN + angle[:, None] * HALF + i[None, :])
        y1 = acc * c - acc_u * s
        y2 = acc_u * c + acc * s
    if n0 < N0:
        out = Y + ms.to(tl.int64)[:, None] * stride_ym + (n0 + rows)[None, :]
        tl.store(out, y1.to(Y.dtype.element_ty), mask=mmask[:, None])
        tl.store(out + HALF, y2.to(Y.dtype.element_ty), mask=mmask[:, None])
    else:
        blk = tl.load(TABLE + ms.to(tl.int64) * stride_tb + pos // BLOCK_LEN, mask=mmask,
                      other=-1)
        ok = (mmask & (blk >= 0) & (blk < num_blocks))[:, None]  # padding rows: nothing
        off = pos % BLOCK_LEN
        j = local // (2 * HALF)  # the KV head
        if n0 < N0 + N1:
            at = KC + blk.to(tl.int64) * stride_kblk + off * stride_krow + j * (2 * HALF)
            scale_ptr = K_SCALE
        else:
            at = VC + blk.to(tl.int64) * stride_vblk + off * stride_vrow + j * (2 * HALF)
            scale_ptr = V_SCALE
        at = at[:, None] + i[None, :]
        if FP8:
            sc = tl.load(scale_ptr + j).to(tl.float32)
            y1 = saturate_e4m3(tl.div_rn(y1, sc))
            y2 = saturate_e4m3(tl.div_rn(y2, sc))
        tl.store(at, y1.to(at.dtype.element_ty), mask=ok)
        tl.store(at + HALF, y2.to(at.dtype.element_ty), mask=ok)


@triton.jit
def _gemv_epilogue(acc, acc_u, B0, B1, B2, R, Y, N0, N1, stride_rm, stride_ym, n0, local,
                   rows, ms, mmask, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
                   GATED: tl.constexpr):
    """The GEMV's bias, gate and residual, then the store of its tile."""
    cols = local + rows
    if HAS_BIAS:
        if GATED:
            acc += tl.load(B0 + cols).to(tl.float32)[None, :]
            acc_u += tl.load(B1 + cols).to(tl.float32)[None, :]
        elif n0 < N0:
            acc += tl.load(B0 + cols).to(tl.float32)[None, :]
        elif n0 < N0 + N1:
            acc += tl.load(B1 + cols).to(tl.float32)[None, :]
        else:
            acc += tl.load(B2 + cols).to(tl.float32)[None, :]
    if GATED:
        acc = acc / (1.0 + tl.exp2(-acc * 1.4426950408889634)) * acc_u
    out_cols = n0 + rows
    if RESIDUAL:
        res = tl.load(R + ms.to(tl.int64)[:, None] * stride_rm + out_cols[None, :],
                      mask=mmask[:, None], other=0.0)
        acc += res.to(tl.float32)
    y = acc.to(Y.dtype.element_ty)
    tl.store(Y + ms.to(tl.int64)[:, None] * stride_ym + out_cols[None, :], y,
             mask=mmask[:, None])
    return y


@triton.jit
def _first_max(x, at, none):
    """``torch.argmax``'s pick along axis 1 of ``x [R, C]``, as ``(value, at of it)`` (``[R]``
    each): the first NaN (value NaN) where a row has one, else the first of its largest.
    Entries outside the data must hold -inf and an ``at`` above every real entry's."""
    isn = x != x
    nan_at = tl.min(tl.where(isn, at, none), 1)
    top = tl.max(tl.where(isn, float("-inf"), x), 1)
    top_at = tl.min(tl.where(x == top[:, None], at, none), 1)
    has_nan = nan_at < none
    return tl.where(has_nan, float("nan"), top), tl.where(has_nan, nan_at, top_at)


@triton.jit
def argmax_chunk_kernel(X, VAL, IDX, V, stride_x, chunk, num_chunks, BLOCK: tl.constexpr):
    """Program ``(r, c)``: the maximum of row ``r``'s columns ``[c * chunk, (c + 1) *
    chunk)`` and its first column, as ``argmax`` sees them (NaN above everything: the first
    NaN's column, the value NaN)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    start = c * chunk
    stop = tl.minimum(start + chunk, V)
    best_v = tl.full([1], float("-inf"), tl.float32)
    best_i = tl.full([1], V, tl.int32)  # no column yet
    for off in range(0, chunk, BLOCK):
        cols = (start + off + tl.arange(0, BLOCK))[None, :]
        m = cols < stop
        x = tl.load(X + r * stride_x + cols, mask=m, other=float("-inf")).to(tl.float32)
        v, i = _first_max(x, cols, V)  # (a block wholly past V: all -inf, never taken)
        # a later block wins with a larger value, or with the first NaN (ties keep the
        # earlier column; a NaN already taken stays)
        take = (best_i == V) | (v > best_v) | ((v != v) & (best_v == best_v))
        best_i = tl.where(take, i, best_i)
        best_v = tl.where(take, v, best_v)
    one = tl.arange(0, 1)
    tl.store(VAL + r * num_chunks + c + one, best_v)
    tl.store(IDX + r * num_chunks + c + one, best_i)


@triton.jit
def argmax_merge_kernel(VAL, IDX, OUT, num_chunks, V, BLOCK_C: tl.constexpr,
                        PDL: tl.constexpr = 0):
    """Row ``r``'s argmax from its chunks' (in column order): the first NaN chunk's column,
    else the first chunk holding the largest value's."""
    pdl_wait(PDL)
    pdl_start(PDL)
    r = tl.program_id(0).to(tl.int64)
    cs = tl.arange(0, BLOCK_C)[None, :]
    m = cs < num_chunks
    v = tl.load(VAL + r * num_chunks + cs, mask=m, other=float("-inf"))
    i = tl.load(IDX + r * num_chunks + cs, mask=m, other=V)
    _, best = _first_max(v, i, V)
    tl.store(OUT + r + tl.arange(0, 1), best.to(tl.int64))


@triton.jit
def embed_kernel(IDS, E, G, H, XW, SS, features, stride_e, stride_h, BLOCK: tl.constexpr,
                 PRENORM: tl.constexpr, PDL: tl.constexpr = 0):
    """Row ``r`` of the residual stream: ``H[r] = E[IDS[r]]`` (the token's embedding row);
    PRENORM: also ``XW[r] = H[r] * G`` (the first RMSNorm's weight applied, one rounding)
    and ``SS[r]`` the float32 sum of its squares, as ``gemv_kernel``'s PRENORM leaves them
    for the GEMV after it (one tile)."""
    pdl_wait(PDL)
    pdl_start(PDL)
    r = tl.program_id(0).to(tl.int64)
    src = E + tl.load(IDS + r).to(tl.int64) * stride_e
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for f0 in range(0, features, BLOCK):
        cols = f0 + tl.arange(0, BLOCK)
        m = cols < features
        x = tl.load(src + cols, mask=m, other=0.0)
        tl.store(H + r * stride_h + cols, x, mask=m)
        if PRENORM:
            xf = x.to(tl.float32)
            g = tl.load(G + cols, mask=m, other=0.0).to(tl.float32)
            tl.store(XW + r * stride_h + cols, (xf * g).to(XW.dtype.element_ty), mask=m)
            acc += xf * xf
    if PRENORM:
        tl.store(SS + r + tl.arange(0, 1), tl.sum(acc, axis=0))


@triton.jit(do_not_specialize=["numel"])
def copy_kernel(SRC, DST, numel, BLOCK: tl.constexpr):
    """``DST[:numel] = SRC[:numel]`` (one dtype); either side may be pinned host memory,
    read or written over the bus. One compilation a dtype: a serving step's sizes vary."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel
    tl.store(DST + offs, tl.load(SRC + offs, mask=m), mask=m)


@triton.jit
def l2_prefetch_kernel(P0, N0, P1, N1, P2, N2, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Asks the L2 cache to fetch up to three byte ranges (``Pi`` byte pointers, ``Ni``
    bytes, multiples of 16; program axis 1 picks the range) ahead of the kernels that read
    them, each thread one bulk prefetch of up to ``CHUNK`` bytes (Hopper's
    ``cp.async.bulk.prefetch.L2``: the copy engine fetches, no data reaches the SM, the
    program exits at once). Sets nothing: memory is unchanged. GPU only (PTX)."""
    r = tl.program_id(1)
    if r == 0:
        P = P0
        N = N0
    elif r == 1:
        P = P1
        N = N1
    else:
        P = P2
        N = N2
    offs = (tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)) * CHUNK
    size = tl.minimum(N - offs, CHUNK)
    size = tl.where(size > 0, size, 0).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [P + offs, size], dtype=tl.int32, is_pure=False, pack=1)
