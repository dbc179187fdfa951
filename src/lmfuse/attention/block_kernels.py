"""Triton kernel of the decode-attention block's elementwise stages: per-head RMSNorm of q
and k, the rotary embedding, and the KV-cache append, in one pass over the fused QKV
projection's output (see ``block.py`` for the launch, ``reference.py`` for the reference).

* ``qk_norm_rope_append_kernel``: one program per ``(token, head)`` of the ``Hq + Hkv``
  query and key heads of one active token ``(b, i)``. The QKV row of a token is laid out
  ``[q heads (Hq * D) | k heads (Hkv * D) | v heads (Hkv * D)]``, so query head ``h`` and key
  head ``h - Hq`` both start at ``h * D`` and the value head paired with key head ``h - Hq``
  at ``(h + Hkv) * D``. A query program writes its normalised, rotated row to ``Q_OUT``;
  a key program writes its key row and copies the value row into the cache at position
  ``cache_seqlens[b] + i`` (contiguous or paged, addressed as ``decode_kernels.append_kernel``
  addresses it; an fp8 cache stores ``x / scale`` clamped to the format's largest finite
  value and rounded to nearest even).

The rotary embedding pairs element ``i1(j)`` with ``i2(j)`` for ``j < R / 2`` (``R`` the
rotary dims): ``(j, j + R/2)`` ("rotate half", GPT-NeoX / Llama) or ``(2j, 2j + 1)``
(interleaved, GPT-J); dims ``R .. D`` pass through. The row is loaded as those three
pieces (first elements of the pairs, second elements, the tail) so the rotation needs no
shuffle of registers and no element is loaded twice; the RMSNorm's sum of squares is the
sum over the three. Everything is float32 in registers and rounded once on the store.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._fp8 import store_e4m3
from .decode_kernels import _kv_rows


@triton.jit
def _norm_rope(ROW, W, INV_FREQ, pos, eps, j, pair, i1, i2, t, tail,
               D: tl.constexpr, QK_NORM: tl.constexpr, ROPE: tl.constexpr):
    """One head's row, normalised (weights ``W [D]``) and rotated at position ``pos``
    (float32): ``(first of pairs, second of pairs, tail)``."""
    x1 = tl.load(ROW + i1, mask=pair, other=0.0).to(tl.float32)
    x2 = tl.load(ROW + i2, mask=pair, other=0.0).to(tl.float32)
    xt = tl.load(ROW + t, mask=tail, other=0.0).to(tl.float32)
    if QK_NORM:
        ms = (tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0) + tl.sum(xt * xt, 0)) / D
        rstd = 1.0 / tl.sqrt(ms + eps)
        x1 = x1 * rstd * tl.load(W + i1, mask=pair, other=0.0).to(tl.float32)
        x2 = x2 * rstd * tl.load(W + i2, mask=pair, other=0.0).to(tl.float32)
        xt = xt * rstd * tl.load(W + t, mask=tail, other=0.0).to(tl.float32)
    if ROPE:
        # The angle is the float32 product position * inv_freq, as the reference forms it
        # (the sine and cosine of a large angle depend on that rounding).
        angle = pos * tl.load(INV_FREQ + j, mask=pair, other=0.0)
        c = tl.cos(angle)
        s = tl.sin(angle)
        y1 = x1 * c - x2 * s
        y2 = x2 * c + x1 * s
        x1 = y1
        x2 = y2
    return x1, x2, xt


@triton.jit
def qk_norm_rope_append_kernel(
    QKV, Q_OUT, K, V, SEQLENS, POS, TABLE, Q_W, K_W, INV_FREQ, K_SCALE, V_SCALE,
    stride_xb, stride_xs,
    stride_ob, stride_os, stride_oh,
    stride_kblk, stride_krow, stride_kh,
    stride_vblk, stride_vrow, stride_vh,
    stride_tb, stride_pb, stride_ps,
    s_active, num_q_heads, num_kv_heads, capacity, num_blocks, eps,
    D: tl.constexpr, HALF_R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr, QK_NORM: tl.constexpr, ROPE: tl.constexpr,
    INTERLEAVED: tl.constexpr, HAS_POS: tl.constexpr, PAGED: tl.constexpr,
    BLOCK_LEN: tl.constexpr, FP8: tl.constexpr, HAS_K_SCALE: tl.constexpr,
    HAS_V_SCALE: tl.constexpr,
):
    """``QKV [B, s_active, (Hq + 2 Hkv) * D]`` (last dim contiguous) -> ``Q_OUT [B, s_active,
    Hq, D]`` and the cache rows; caches' and ``Q_OUT``'s head dims contiguous."""
    tok = tl.program_id(0)
    h = tl.program_id(1)
    b = (tok // s_active).to(tl.int64)
    i = tok % s_active
    L = tl.load(SEQLENS + b).to(tl.int64)
    if HAS_POS:
        pos = tl.load(POS + b * stride_pb + i * stride_ps).to(tl.float32)
    else:
        pos = (L + i).to(tl.float32)

    j = tl.arange(0, BLOCK_R)
    pair = j < HALF_R
    if INTERLEAVED:
        i1 = 2 * j
        i2 = 2 * j + 1
    else:
        i1 = j
        i2 = j + HALF_R
    t = 2 * HALF_R + tl.arange(0, BLOCK_T)
    tail = t < D

    row = QKV + b * stride_xb + i * stride_xs + h * D
    if h < num_q_heads:
        y1, y2, yt = _norm_rope(row, Q_W, INV_FREQ, pos, eps, j, pair, i1, i2, t, tail,
                                D, QK_NORM, ROPE)
        out = Q_OUT + b * stride_ob + i * stride_os + h * stride_oh
        tl.store(out + i1, y1.to(Q_OUT.dtype.element_ty), mask=pair)
        tl.store(out + i2, y2.to(Q_OUT.dtype.element_ty), mask=pair)
        tl.store(out + t, yt.to(Q_OUT.dtype.element_ty), mask=tail)
    else:
        kvh = h - num_q_heads
        y1, y2, yt = _norm_rope(row, K_W, INV_FREQ, pos, eps, j, pair, i1, i2, t, tail,
                                D, QK_NORM, ROPE)
        d = tl.arange(0, BLOCK_D)
        v = tl.load(row + num_kv_heads * D + d, mask=d < D, other=0.0).to(tl.float32)

        p = L + i
        inside = (p >= 0) & (p < capacity)
        k_row, ok = _kv_rows(TABLE, b, stride_tb, p, inside, stride_kblk, stride_krow,
                             num_blocks, PAGED, BLOCK_LEN)
        v_row, _ = _kv_rows(TABLE, b, stride_tb, p, inside, stride_vblk, stride_vrow,
                            num_blocks, PAGED, BLOCK_LEN)
        k_ptr = K + k_row + kvh * stride_kh
        v_ptr = V + v_row + kvh * stride_vh

        # The row's width if it has a slot in the cache, else 0: every store below is then
        # masked off (a width, not `mask & ok`, which the interpreter mistypes for a scalar).
        width = tl.where(ok, D, 0)
        if FP8:
            # Correctly rounded division (as the reference's), then store_e4m3 saturates at
            # the format's largest finite value instead of rounding to NaN (NaN stays NaN,
            # under the interpreter too).
            if HAS_K_SCALE:
                ks = tl.load(K_SCALE + kvh).to(tl.float32)
                y1 = tl.div_rn(y1, ks)
                y2 = tl.div_rn(y2, ks)
                yt = tl.div_rn(yt, ks)
            if HAS_V_SCALE:
                v = tl.div_rn(v, tl.load(V_SCALE + kvh).to(tl.float32))
            store_e4m3(k_ptr + i1, y1, pair & (i1 < width))
            store_e4m3(k_ptr + i2, y2, pair & (i2 < width))
            store_e4m3(k_ptr + t, yt, t < width)
            store_e4m3(v_ptr + d, v, d < width)
        else:
            tl.store(k_ptr + i1, y1.to(K.dtype.element_ty), mask=pair & (i1 < width))
            tl.store(k_ptr + i2, y2.to(K.dtype.element_ty), mask=pair & (i2 < width))
            tl.store(k_ptr + t, yt.to(K.dtype.element_ty), mask=t < width)
            tl.store(v_ptr + d, v.to(V.dtype.element_ty), mask=d < width)
