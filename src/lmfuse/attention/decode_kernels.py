"""Triton kernels of decode attention: the split-KV attention pass, the log-sum-exp merge,
and the cache append.

* ``decode_kernel``: one program per ``(sequence b, KV head, split)``. Its rows are the
  ``GROUP * S_ACT`` query rows that read that KV head (row ``r``: active token ``r // GROUP``,
  query head ``kv_head * GROUP + r % GROUP``), so each K/V tile is loaded once for the whole
  group and all active tokens and fed to two ``tl.dot``s. The keys are walked in tiles of
  ``BLOCK_N`` with the online softmax in base 2 (``scale * log2(e)`` folded into one
  multiply of the scores). A paged cache is read through ``block_table``: each key's row
  address is its block's id times the block stride plus its offset in the block, so any
  block length works and blocks may lie anywhere in the pool; ids of blocks past the
  sequence's length (the -1 padding) are never loaded. fp8 caches are widened to the
  query's dtype in registers (V before it is staged for the second dot, see
  ``_widened_here``); their per-head scales multiply the scores (``k_scale``) and
  the output (``v_scale``) instead of every element. With one split the program writes the
  output (and the LSE); with several each writes a float32 partial output normalised by
  its own denominator plus its LSE, and ``merge_kernel`` combines them.
* ``merge_kernel``: one program per output row: ``lse = log(sum_p exp(lse_p))``, ``out =
  sum_p exp(lse_p - lse) out_p``; partials with ``lse_p = -inf`` add nothing, a row whose
  partials are all such gives zeros and ``-inf``, a NaN or ``+inf`` one makes the row NaN.
  Strided over the partial index so it serves the split-KV pass and
  ``merge_attention_states`` alike.

NaN and inf follow ``reference.py``'s rules with no extra work in the loops: the running
maxima skip NaNs (max.f32) and NaN reaches the sums instead, which the end of each kernel
reads (see there). Nothing is read or written outside the tensors whatever the lengths and
block ids hold: lengths are clamped to ``[0, capacity]``, every load and store is masked by
the position's range and the block id's ``[0, num_blocks)``.
* ``append_kernel``: one program per ``(sequence, new token)``, writing its K and V rows
  for all KV heads at position ``cache_seqlens[b] + i`` (contiguous or paged; quantised
  to fp8 as ``x / scale`` when the cache is fp8).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._fp8 import store_e4m3
from .._pdl import pdl_start, pdl_wait
from .._softcap import tanh_over_z

# log2(e) = 1.4426950408889634 and ln(2) = 0.6931471805599453 are written inline below (see
# activations/kernels.py on why kernels do not read float globals).


@triton.jit
def _kv_rows(TABLE, b, stride_tb, offs, valid, stride_blk, stride_row, num_blocks,
             PAGED: tl.constexpr, BLOCK_LEN: tl.constexpr, ROWS_I32: tl.constexpr = 0):
    """Element offsets of keys ``offs`` of sequence ``b`` in the cache, and which may be read:
    ``valid`` and, paged, a block id in ``[0, num_blocks)`` (so a wrong table entry can never
    make the kernel read outside the pool). ``ROWS_I32``: every offset of the cache fits in
    int32 (the caller checked its extent) and ``offs >= 0``: the block and the row in it
    by unsigned division and the offsets in 32 bits (integer multiply, add and shift
    instructions, most of them 64-bit address arithmetic, were 17% of a paged fp8 tile's
    on an H200); an id that fails the check may wrap, and is never read."""
    if PAGED:
        if ROWS_I32:
            o = offs.to(tl.uint32)
            idx = (o // BLOCK_LEN).to(tl.int32)
            within = (o % BLOCK_LEN).to(tl.int32)
        else:
            idx = offs // BLOCK_LEN
            within = offs % BLOCK_LEN
        blk = tl.load(TABLE + b.to(tl.int64) * stride_tb + idx, mask=valid, other=-1)
        ok = valid & (blk >= 0) & (blk < num_blocks)
        if ROWS_I32:
            rows = blk * stride_blk + within * stride_row
        else:
            rows = blk.to(tl.int64) * stride_blk + within.to(tl.int64) * stride_row
        return rows, ok
    else:
        if ROWS_I32:
            rows = b * stride_blk + offs * stride_row
        else:
            rows = b.to(tl.int64) * stride_blk + offs.to(tl.int64) * stride_row
        return rows, valid


@triton.jit
def _split_keys(base, L, split, num_splits, keys_per_split, BLOCK_N: tl.constexpr,
                EVEN_TILES: tl.constexpr):
    """``[start, end)``: the keys of ``[base, L)`` that split ``split`` of ``num_splits``
    walks (``base`` a multiple of ``BLOCK_N``). ``EVEN_TILES``: the sequence's own key
    tiles dealt out evenly, split ``s`` taking tiles ``[s T / n, (s + 1) T / n)`` of its
    ``T``, so a sequence shorter than the cache's capacity (a serving batch's table is as
    wide as its longest sequence, or wider) keeps every split busy instead of leaving the
    last ones empty; otherwise consecutive pieces of ``keys_per_split`` keys (a forced
    split count's, not whole tiles)."""
    if EVEN_TILES:
        tiles = (L - base + BLOCK_N - 1) // BLOCK_N
        start = base + (split * tiles // num_splits) * BLOCK_N
        end = tl.minimum(base + ((split + 1) * tiles // num_splits) * BLOCK_N, L)
    else:
        start = base + split * keys_per_split
        end = tl.minimum(start + keys_per_split, L)
    return start, end


@triton.jit
def _tanh_of_scaled(z, SERIES: tl.constexpr):
    """tanh(z) for a softcap's ``z = x / c``: ``sign(z) (1 - t) / (1 + t)`` with ``t =
    e^(-2|z|) <= 1`` (no overflow; +-1 at +-inf; NaN stays NaN). ``1 - t`` cancels for
    small ``|z|``: an absolute error of ~ulp(1) in tanh, ~c ulp(1) in the capped score,
    which grows with the cap (1e-4 at c = 1e4, every score 0 at c = 1e8). ``SERIES`` (caps
    above ``_launch.SOFTCAP_SERIES_ABOVE``): for ``|z| < 1/8`` tanh's odd series instead
    (``_softcap.tanh_over_z``); the usual caps (30, 50) keep the cheaper form, whose
    error is a few 1e-6 there (the series cost the fp8 cache's loop 7%)."""
    az = tl.abs(z)
    t = tl.exp(-2.0 * az)
    th = (1.0 - t) / (1.0 + t)
    if SERIES:
        th = tl.where(az < 0.125, az * tanh_over_z(z * z), th)
    return tl.where(z < 0.0, -th, th)


@triton.jit
def _widened_here(x):
    """``x`` unchanged, through an identity the layout passes cannot move a conversion
    across (an instruction they must treat as having effects). Triton 3.6 otherwise moves
    the fp8 V tile's widening past its conversion to the second dot's operand layout: the
    bytes are then read from shared memory one at a time along the keys (``LDS.U8``, ~40%
    of the loop's instructions) where, widened first, the tile is stored as 16-bit values
    and read back with transposing ``ldmatrix``. 16-bit values only, GPU only (the
    interpreter runs no PTX)."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype,
                                     is_pure=False, pack=2)


@triton.jit
def decode_kernel(
    Q, K, V, SEQLENS, TABLE, SINKS, K_SCALE, V_SCALE, OUT, LSE,
    stride_blk, stride_row, stride_h, stride_tb,
    num_kv_heads, num_splits, keys_per_split, qk_scale, window, capacity, num_blocks,
    softcap_log2,
    S_ACT: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGED: tl.constexpr, BLOCK_LEN: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_K_SCALE: tl.constexpr, HAS_V_SCALE: tl.constexpr,
    WRITE_LSE: tl.constexpr, DOT_F32: tl.constexpr,
    F16_DOT: tl.constexpr, IEEE: tl.constexpr, NUM_STAGES: tl.constexpr,
    WIDEN_V_FIRST: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PDL: tl.constexpr = 0,
    EVEN_TILES: tl.constexpr = 0, ROWS_I32: tl.constexpr = 0,
):
    pdl_wait(PDL)  # PDL: launched early in a decode step's chain (lmfuse._pdl)
    pdl_start(PDL)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // num_kv_heads
    kvh = pid % num_kv_heads
    # Lengths are checked on the host only when value checks are on: an unchecked one past
    # the capacity is read as the capacity, a negative one as 0, so every position below
    # stays in [-S_ACT, capacity] (no int32 wrap, no key outside the sequence's rows).
    L = tl.minimum(tl.maximum(tl.load(SEQLENS + b), 0), capacity).to(tl.int32)

    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    qh = kvh * GROUP + rows % GROUP
    row_ok = rows < S_ACT * GROUP
    pos = L - S_ACT + tok  # each row's own position: it sees keys <= pos
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D

    # q [B, S_ACT, Hq, D], OUT [B, S_ACT, Hq, num_splits, D] and LSE [B, S_ACT, Hq,
    # num_splits] are contiguous (num_splits = 1: the final output): their offsets follow
    # from the shapes, which keeps the launch's argument list (its host cost) short.
    q_row = (b.to(tl.int64) * S_ACT + tok) * (num_kv_heads * GROUP) + qh
    q = tl.load(Q + q_row[:, None] * D + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_row_scale = tl.full([BLOCK_M], 1.0, tl.float32)
    if DOT_F32:
        q = q.to(tl.float32)
    elif F16_DOT:
        # bf16 queries over an fp8 cache: float16 dots (fp8 widens to float16 cheaply, and
        # float16 holds e4m3 exactly). Each query row is scaled by a power of two to a
        # largest magnitude in (0.5, 1], which float16 holds without overflow and which
        # undoes exactly on the scores.
        qf = q.to(tl.float32)
        top = tl.max(tl.abs(qf), 1)
        # (A row with an inf or NaN element keeps scale 1: inf / inf would make NaN of the
        # inf that the scores must see.)
        usable = (top > 0.0) & (top < float("inf"))
        q_row_scale = tl.where(usable, tl.exp2(tl.ceil(tl.log2(tl.where(usable, top,
                                                                       1.0)))), 1.0)
        q = (qf / q_row_scale[:, None]).to(tl.float16)

    # The keys any row sees: [lo, L), cut into the splits' ranges from lo rounded down to a
    # tile (see _split_keys).
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(L - S_ACT - window, 0)
    start, end = _split_keys((lo // BLOCK_N) * BLOCK_N, L, split, num_splits, keys_per_split,
                             BLOCK_N, EVEN_TILES)

    scale = qk_scale
    if HAS_K_SCALE:
        scale = scale * tl.load(K_SCALE + kvh).to(tl.float32)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:
        # A sink is a key with logit sinks[h] and a zero value: counted once, in split 0.
        sink = tl.load(SINKS + qh, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        first = (tl.zeros([BLOCK_M], tl.int32) + split) == 0
        m = tl.where(first & row_ok, sink, m)
        l_sum = tl.where(first & row_ok, 1.0, l_sum)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # K and V share their strides: per sequence (contiguous) or block (paged), row, head.
    k_base = K + kvh.to(tl.int64) * stride_h
    v_base = V + kvh.to(tl.int64) * stride_h
    for n0 in tl.range(start, end, BLOCK_N, num_stages=NUM_STAGES):
        offs = n0 + tl.arange(0, BLOCK_N)
        in_range = (offs < end) & (offs < capacity)
        kv_rows, kv_ok = _kv_rows(TABLE, b, stride_tb, offs, in_range, stride_blk,
                                  stride_row, num_blocks, PAGED, BLOCK_LEN, ROWS_I32)
        k = tl.load(k_base + kv_rows[:, None] + d[None, :],
                    mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
        k = k.to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if F16_DOT:
            s = s * (scale * q_row_scale)[:, None]
        else:
            s = s * scale
        if HAS_SOFTCAP:
            # c tanh(x / c) on the natural-log logits x, written on the base-2 scores s =
            # x log2(e) with C = c log2(e): C tanh(s / C) (see _tanh_of_scaled).
            s = softcap_log2 * _tanh_of_scaled(s / softcap_log2, HAS_SOFTCAP == 2)
        if S_ACT == 1:
            # One active token: every real row's position is L - 1, so the mask is one
            # vector over the keys (two fewer operations a score, where per-key
            # instructions bound the fp8 cache's loop). Padding rows see the same keys;
            # nothing of theirs is stored.
            seen = (offs <= L - 1) & kv_ok
            if HAS_WINDOW:
                seen = seen & (offs >= L - 1 - window)
            seen = seen[None, :]
        else:
            seen = (offs[None, :] <= pos[:, None]) & kv_ok[None, :]
            if HAS_WINDOW:
                seen = seen & (offs[None, :] >= pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        # The running max skips NaNs (max.f32, as tl.max does): a NaN score, or a NaN sink,
        # reaches l_sum and acc through p or alpha instead, and a +inf one makes m = +inf
        # and p (inf - inf) NaN; the end of the kernel reads the row's state from both.
        m_new = tl.maximum(m, tl.max(s, 1))
        # A row that has seen nothing yet keeps m = -inf; subtracting 0 then keeps exp2 at 0
        # instead of exp2(-inf - -inf) = NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m - m_ref)
        l_sum = l_sum * alpha + tl.sum(p, 1)

        # p is 0 for a key a row does not see, but 0 * NaN is NaN in the dot: value rows no
        # active token sees (before every row's window; past the length) are not loaded.
        # (A row seen by one active token and not another still reaches both: see
        # ``decode_attention``.)
        v_ok = kv_ok
        if HAS_WINDOW:
            v_ok = v_ok & (offs >= lo)
        v = tl.load(v_base + kv_rows[:, None] + d[None, :],
                    mask=v_ok[:, None] & d_ok[None, :], other=0.0)
        v = v.to(q.dtype)
        if WIDEN_V_FIRST:
            v = _widened_here(v)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new

    # l_sum is 0 for a row that saw nothing (zeros, lse = -inf), NaN for one that saw a NaN
    # logit or a +inf one, and m = +inf exactly when it saw a +inf logit (lse = +inf, which
    # wins over NaN as in merge_kernel). The output is NaN wherever the LSE is NaN or +inf:
    # the softmax is undefined there, and a merge of the partials gives the same.
    empty = l_sum == 0.0
    out = acc / tl.where(empty, 1.0, l_sum)[:, None]
    if HAS_V_SCALE:
        out = out * tl.load(V_SCALE + kvh).to(tl.float32)
    lse = tl.where(empty, float("-inf"),
                   (m + tl.log2(tl.where(empty, 1.0, l_sum))) * 0.6931471805599453)
    lse = tl.where(m == float("inf"), float("inf"), lse)
    out = tl.where(((lse != lse) | (lse == float("inf")))[:, None], float("nan"), out)

    o_row = q_row * num_splits + split
    o_ptr = OUT + o_row[:, None] * D + d[None, :]
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if WRITE_LSE:
        tl.store(LSE + o_row, lse, mask=row_ok)


@triton.jit
def merge_kernel(
    OUTS, LSES, OUT, LSE, num_parts, stride_op, stride_or, stride_lp, stride_lr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, CHUNK_P: tl.constexpr,
    WRITE_LSE: tl.constexpr, PDL: tl.constexpr = 0,
):
    """``OUTS`` partial ``p`` of row ``r`` at ``p * stride_op + r * stride_or`` (D contiguous);
    ``LSES``'s at ``p * stride_lp + r * stride_lr``; ``OUT [R, D]`` and ``LSE [R]``
    contiguous. Program ``(r, c)`` merges columns ``[c * BLOCK_D, (c + 1) * BLOCK_D)`` of
    row ``r``, reading the partials ``CHUNK_P`` at a time as one ``[CHUNK_P, BLOCK_D]`` tile
    so that their loads are in flight together (one partial after the other, a program
    waited out a memory round trip per partial: 14 us for 66 partials on an H100)."""
    pdl_wait(PDL)
    pdl_start(PDL)
    r = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1)
    parts = tl.arange(0, BLOCK_P).to(tl.int64)
    lses = tl.load(LSES + parts * stride_lp + r * stride_lr, mask=parts < num_parts,
                   other=float("-inf")).to(tl.float32)
    # top skips NaNs (max.f32); a NaN or +inf LSE makes total NaN (exp(NaN), exp(inf - inf)),
    # hence every weight and the output NaN; only partials with lse_p = -inf are left out.
    top = tl.max(lses, 0)
    top_ref = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.exp(lses - top_ref), 0)
    empty = total == 0.0
    inv_total = 1.0 / tl.where(empty, 1.0, total)
    d = col * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for p0 in range(0, num_parts, CHUNK_P):
        # 64-bit offsets: p * stride can pass 2**31 elements.
        pp = p0 + tl.arange(0, CHUNK_P).to(tl.int64)
        ok = pp < num_parts
        lse_p = tl.load(LSES + pp * stride_lp + r * stride_lr, mask=ok,
                        other=float("-inf")).to(tl.float32)
        w = tl.exp(lse_p - top_ref) * inv_total
        o = tl.load(OUTS + pp[:, None] * stride_op + r * stride_or + d[None, :],
                    mask=ok[:, None] & (d < D)[None, :], other=0.0)
        # An empty partial (lse_p = -inf) adds nothing, whatever its output holds; any other
        # adds w * o, so a NaN in its output stays visible even where w underflows to 0.
        acc += tl.sum(tl.where((lse_p == float("-inf"))[:, None], 0.0,
                               w[:, None] * o.to(tl.float32)), 0)
    o_ptr = OUT + r * D + d
    tl.store(o_ptr, acc.to(OUT.dtype.element_ty), mask=d < D)
    if WRITE_LSE:
        lse = tl.where(empty, float("-inf"), top_ref + tl.log(tl.where(empty, 1.0, total)))
        lse = tl.where(top == float("inf"), float("inf"), lse)
        if col == 0:
            tl.store(LSE + r, lse)


@triton.jit
def append_kernel(
    K_NEW, V_NEW, K, V, SEQLENS, TABLE, K_SCALE, V_SCALE,
    stride_nb, stride_ns, stride_vnb, stride_vns,
    stride_kblk, stride_krow, stride_vblk, stride_vrow, stride_tb,
    stride_kh, stride_vh,
    s_new, capacity, num_blocks,
    HD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    PAGED: tl.constexpr, BLOCK_LEN: tl.constexpr, FP8: tl.constexpr,
    HAS_K_SCALE: tl.constexpr, HAS_V_SCALE: tl.constexpr, FLAT: tl.constexpr = 1,
):
    """New rows ``[Hkv * D]`` (heads and dims contiguous in the new tensors). ``FLAT``: a
    cache row's heads are contiguous too (``stride_kh == stride_vh == D``), so the row is
    one run of ``Hkv * D`` values; else head ``h`` starts at ``h * stride_kh`` of the row
    (a heads-major cache, ``[B, Hkv, S, D]`` seen as ``[B, S, Hkv, D]``; dims contiguous)."""
    pid = tl.program_id(0)
    b = (pid // s_new).to(tl.int64)
    i = pid % s_new
    c = tl.arange(0, BLOCK)
    # The position as a vector, so that every mask below is a vector (the interpreter
    # rejects a vector mask combined with a scalar condition).
    p = tl.zeros([BLOCK], tl.int64) + tl.load(SEQLENS + b).to(tl.int64) + i
    inside = (p >= 0) & (p < capacity)
    k_row, ok = _kv_rows(TABLE, b, stride_tb, p, inside, stride_kblk, stride_krow, num_blocks,
                         PAGED, BLOCK_LEN)
    v_row, _ = _kv_rows(TABLE, b, stride_tb, p, inside, stride_vblk, stride_vrow, num_blocks,
                        PAGED, BLOCK_LEN)
    for c0 in range(0, HD, BLOCK):
        cc = c0 + c
        m = (cc < HD) & ok
        k = tl.load(K_NEW + b * stride_nb + i * stride_ns + cc, mask=m, other=0.0)
        v = tl.load(V_NEW + b * stride_vnb + i * stride_vns + cc, mask=m, other=0.0)
        if FLAT:
            kc = cc
            vc = cc
        else:
            kc = (cc // D) * stride_kh + cc % D
            vc = (cc // D) * stride_vh + cc % D
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        if FP8:
            if HAS_K_SCALE:
                k = tl.div_rn(k, tl.load(K_SCALE + cc // D, mask=m, other=1.0).to(tl.float32))
            if HAS_V_SCALE:
                v = tl.div_rn(v, tl.load(V_SCALE + cc // D, mask=m, other=1.0).to(tl.float32))
            store_e4m3(K + k_row + kc, k, m)  # NaN stored as NaN under the interpreter too
            store_e4m3(V + v_row + vc, v, m)
        else:
            tl.store(K + k_row + kc, k.to(K.dtype.element_ty), mask=m)
            tl.store(V + v_row + vc, v.to(V.dtype.element_ty), mask=m)
