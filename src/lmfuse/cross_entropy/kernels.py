"""Triton kernels of cross-entropy on logits (read against ``reference.py``).

``logits [N, V]`` holds this rank's columns ``[vocab_start, vocab_start + V)`` of a
``vocab_size`` vocabulary. Every kernel produces the token stats ``lse``, ``x_t``,
``sum x`` and the token's loss (``[4, N]``, float32) and/or the gradient of the logits:

* ``ce_fwd_kernel``: rows of at most ``max_single_block`` columns, ``BLOCK_M`` rows per
  tile; a row is read once, held in registers, and (``WRITE_GRAD``) its gradient is
  written from them.
* ``ce_stream_kernel``: longer rows, one per program of a persistent grid, streamed in
  ``BLOCK_V`` chunks with an online max; with ``WRITE_GRAD`` the row is streamed again,
  last chunk first, to write its gradient (from L1, for the GPU tables' whole-row
  launches: one 32-warp program per SM, ``VEC`` > 0).
* ``ce_slices_kernel``: the fused path for the longest rows: rows cut in slices, phase A
  (stats of a slice) and phase B (gradient of a slice read a few tiles ago, still in L2)
  interleaved through a ticket counter; see its docstring.
* ``ce_grad_kernel`` / ``ce_stream_grad_kernel``: the gradient alone from given stats and
  per-token upstream gradients (vocabulary parallel, ``reduction="none"``).
* ``ce_merge_kernel``: vocabulary parallel, every rank's gathered stats to the
  whole-vocabulary stats and loss.
* ``ce_scale_kernel``: multiplies a gradient written in forward by the upstream gradient,
  and returns at once, with no host sync, when that is exactly 1.

The streamed loops are lean (per element: load, convert, max, subtract, multiply, exp2,
add; the gradient: load, convert, subtract, multiply, exp2, FMA, convert, store): full
chunks load unmasked, and the target column's ``- (1 - s)`` is written once per row
instead of a compare-and-select per element. A target is used as an address only
through a load or store masked by its check against this rank's column range, so an
out-of-range target reads and writes nothing out of bounds.

NaN and inf follow ``F.cross_entropy`` (``reference.py``) with no extra work per element:
the running max ignores NaN (``tl.max`` / ``tl.maximum``), but a NaN logit's own exp is
NaN, so is the row's sum, and ``_lse`` keeps it (it used to test ``denom > 0`` and turn it
into -inf); a +inf max gives a NaN shift (``_shift``), the NaN of ``inf - inf``. -inf is a
masked class. Loads fill -inf only past a row's end, tail rows of a tile repeat the last
row and lanes past the last merged row read 0, so padding never computes ``-inf - -inf``
(nor warns in the interpreter); only rows that make a NaN themselves do.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._softcap import tanh_over_z


@triton.jit
def _cap(x, softcap, MODE: tl.constexpr):
    """softcap * tanh(x / softcap), exact at +-inf, NaN for NaN (``MODE``: the launch's
    ``HAS_SOFTCAP``, 1 or 2).

    The exponent is capped at 80 (tanh is 1 in float32 from 2u = 19 on): exp never
    overflows, and the cap is a NaN-propagating min (``min.NaN``), so NaN stays NaN.
    ``1 - 2 / (e^2u + 1)`` cancels for small ``|u|``: an absolute error of ~ulp(1) in tanh,
    ~softcap ulp(1) in the capped logit, growing with the cap. ``MODE == 2`` (caps above
    ``_launch.SOFTCAP_SERIES_ABOVE``): for ``|u| < 1/8``, ``x`` times tanh's odd series
    (``_softcap.tanh_over_z``) instead; the usual caps keep the cheaper form
    (the series cost a softcapped loss 19% on an H200, where it is bound by instructions)."""
    if MODE == 2:
        u = x / softcap
        u2 = tl.minimum(2.0 * u, 80.0, propagate_nan=tl.PropagateNan.ALL)
        big = softcap * (1.0 - 2.0 / (tl.exp(u2) + 1.0))
        return tl.where(tl.abs(u) < 0.125, x * tanh_over_z(u * u), big)
    else:
        u2 = tl.minimum(2.0 * x / softcap, 80.0, propagate_nan=tl.PropagateNan.ALL)
        return softcap * (1.0 - 2.0 / (tl.exp(u2) + 1.0))


@triton.jit
def _shift(m):
    """What a row's exps are taken against, from its running max ``m`` (max ignores NaN;
    a NaN logit reaches the sum through its own exp): ``m``, but 0 for a row with nothing
    yet (-inf: exp(-inf - 0) = 0, no -inf - -inf) and NaN for a +inf max, whose row's
    log-sum-exp is NaN as in ``F.cross_entropy`` (inf - inf); a NaN shift makes that so
    without forming inf - inf."""
    return tl.where(m == float("-inf"), 0.0, tl.where(m == float("inf"), float("nan"), m))


@triton.jit
def _load_x(x_ptr, row_off, c, load_ok, softcap, HAS_SOFTCAP: tl.constexpr):
    """Logits of a [BLOCK_M, BLOCK_V] tile in float32, softcapped; -inf outside the row."""
    x = tl.load(x_ptr + row_off[:, None] + c[None, :], mask=load_ok, other=float("-inf"))
    x = x.to(tl.float32)
    if HAS_SOFTCAP:
        x = tl.where(load_ok, _cap(x, softcap, HAS_SOFTCAP), float("-inf"))
    return x


@triton.jit
def _tile_weights(cw_ptr, cols, V, HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr):
    """The class weights of a tile's columns for its smoothing terms (0 without smoothing,
    where they have none; unused without weights). Past the row 1, not 0: those columns'
    x is -inf, and -inf * 0 would form a NaN (masked out, but formed)."""
    if HAS_WEIGHT:
        if HAS_SMOOTHING:
            return tl.load(cw_ptr + cols, mask=cols < V, other=1.0)
        else:
            return tl.zeros(cols.shape, tl.float32)
    else:
        return 0.0


@triton.jit
def _grad_tile(x, c, t_local, lse, w, ls_over_v, one_minus_ls, two_z, softcap, cw, w_t,
               w_sum, w_z, HAS_SOFTCAP: tl.constexpr, HAS_WEIGHT: tl.constexpr = False):
    """w * [p (1 + 2 z lse) - s / V - (1 - s) [col == t]] (* d softcap), float32.

    ``HAS_WEIGHT``: class weights ``cw`` (the tile's columns; 0 without smoothing), ``w_t``
    the target's, ``w_sum`` their sum, ``w_z`` the z-loss's scale (``w`` scales the rest):
    p (w (w_t (1 - s) + s W / V) + w_z 2 z lse) - w (s / V) cw - w w_t (1 - s) [col == t].

    A NaN lse (a NaN or +inf logit) or a -inf one (every logit -inf) gives a NaN row, also
    where w = 0 (ignored rows), as ``F.cross_entropy``'s gradient is."""
    p = tl.exp(x - lse[:, None])
    if HAS_WEIGHT:
        a = w * (w_t * one_minus_ls + ls_over_v * w_sum) + w_z * two_z * lse
        g = p * a[:, None] - (ls_over_v * w)[:, None] * cw[None, :]
        g = tl.where(c[None, :] == t_local[:, None], g - (one_minus_ls * w * w_t)[:, None], g)
    else:
        g = p * (1.0 + two_z * lse)[:, None] - ls_over_v
        g = tl.where(c[None, :] == t_local[:, None], g - one_minus_ls, g)
    if HAS_SOFTCAP:
        u = tl.where(x > float("-inf"), x / softcap, 0.0)  # -inf: columns past the row
        g = g * (1.0 - u * u)
    if HAS_WEIGHT:
        return g
    else:
        return g * w[:, None]


@triton.jit
def _rows(tile, n_rows, V, t_ptr, vocab_start, vocab_size, ignore_index,
          BLOCK_M: tl.constexpr):
    """Rows of this tile, which are real, and ``_row_target`` of each (tail rows: no
    target column, no gradient). Tail rows are the last row again (``rows`` clamped):
    read, computed on, never stored; so they hold a real row's numbers, not -inf."""
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    rows = tl.minimum(rows, n_rows - 1)  # keep index math in range on the tail tile
    t_local, grad_ok, t = _row_target(t_ptr, rows, V, vocab_start, vocab_size, ignore_index)
    return rows, row_ok, tl.where(row_ok, t_local, -1), grad_ok & row_ok, t


@triton.jit
def _weight(count_ptr, MEAN: tl.constexpr):
    """The upstream gradient the forward assumes for each token: 1 / max(count, 1) for
    a mean over ``count`` valid tokens, else 1."""
    if MEAN:
        return 1.0 / tl.maximum(tl.load(count_ptr).to(tl.float32), 1.0)
    else:
        return 1.0


@triton.jit
def _class_scales(count_ptr, wstat_ptr, t_local, cw_ptr, MEAN: tl.constexpr):
    """With class weights: (the weighted terms' scale, the z-loss's scale, w_t, W) of a
    token for an upstream gradient of 1. A mean divides the weighted terms by ``sum w_t``
    over the non-ignored tokens and the z-loss by their count (``wstat`` = [W, sum w_t]);
    ``t_local`` -1 (no target column here) gives w_t = 0."""
    mine = t_local >= 0
    w_t = tl.load(cw_ptr + tl.where(mine, t_local, 0), mask=mine, other=0.0)
    w_sum = tl.load(wstat_ptr)
    if MEAN:
        count = tl.load(count_ptr).to(tl.float32)
        w_den = tl.where(count > 0.0, tl.load(wstat_ptr + 1), 1.0)
        return 1.0 / w_den, 1.0 / tl.maximum(count, 1.0), w_t, w_sum
    else:
        return 1.0, 1.0, w_t, w_sum


@triton.jit
def _token_loss(lse, x_t, sum_x, t, w, ignore_index, vocab_size, ls_over_v, one_minus_ls,
                two_z, w_t, w_sum, w_z, HAS_SMOOTHING: tl.constexpr,
                HAS_WEIGHT: tl.constexpr = False):
    """w * [(1 - s)(lse - x_t) + s (lse - sum x / V) + z lse^2]; 0 if ignored, +inf for
    a target outside [0, vocab_size) (see ``reference.token_terms``). ``HAS_WEIGHT``:
    w * [w_t (1 - s)(lse - x_t) + (s / V)(W lse - sum w x)] + w_z z lse^2, ``sum_x``
    holding sum w x and ``w_sum`` W."""
    lse_z = tl.where(two_z != 0.0, lse, 0.0)  # no 0 * inf where z = 0 and lse = -inf
    if HAS_WEIGHT:
        loss = w_t * one_minus_ls * (lse - x_t)
        if HAS_SMOOTHING:
            loss += ls_over_v * (w_sum * lse - sum_x)
        loss = loss * w + w_z * (0.5 * two_z * lse_z * lse_z)
    else:
        loss = one_minus_ls * (lse - x_t)
        if HAS_SMOOTHING:
            # (s / V)(V lse - sum x): s lse formed as (1 - (1 - s)) lse was off by 2.4e-8 lse
            # in float32 (a relative 4e-5 of a tiny loss at V = 1 on the GPU)
            loss += ls_over_v * (vocab_size * lse - sum_x)
        loss += 0.5 * two_z * lse_z * lse_z
        loss = loss * w
    valid = t != ignore_index
    bad = valid & ((t < 0) | (t >= vocab_size))
    loss = tl.where(bad, float("inf"), loss)
    return tl.where(valid, loss, 0.0)


@triton.jit
def _store_stats(stats_ptr, n_rows, rows, row_ok, lse, x_t, sum_x, t, w, ignore_index,
                 vocab_size, ls_over_v, one_minus_ls, two_z, HAS_SMOOTHING: tl.constexpr,
                 w_t=1.0, w_sum=1.0, w_z=1.0, pred=0, HAS_WEIGHT: tl.constexpr = False,
                 ARGMAX: tl.constexpr = False):
    """Rows ``rows`` of the ``[4, N]`` stats: lse, x_t, sum x and the (weighted) loss;
    with ``ARGMAX`` ``[5, N]``, the predicted class ``pred`` (a global column, exact in
    float32 below 2^24) in the fifth row."""
    tl.store(stats_ptr + rows, lse, mask=row_ok)
    tl.store(stats_ptr + n_rows + rows, x_t, mask=row_ok)
    tl.store(stats_ptr + 2 * n_rows + rows, sum_x, mask=row_ok)
    tl.store(stats_ptr + 3 * n_rows + rows,
             _token_loss(lse, x_t, sum_x, t, w, ignore_index, vocab_size, ls_over_v,
                         one_minus_ls, two_z, w_t, w_sum, w_z, HAS_SMOOTHING, HAS_WEIGHT),
             mask=row_ok)
    if ARGMAX:
        tl.store(stats_ptr + 4 * n_rows + rows, pred.to(tl.float32), mask=row_ok)


_NO_INDEX = tl.constexpr(2147483647)  # larger than any column: "none here" in a min


@triton.jit
def _first_max(x, c, x_max, m, first, first_nan, AXIS: tl.constexpr):
    """A running argmax as ``torch.argmax`` has it, chunk by chunk along ``AXIS``: ``first``
    moves to the chunk's first column ``c`` holding its max ``x_max`` when that beats the
    running max ``m`` (a tie keeps the earlier column); ``first_nan``, the first NaN's
    column, wins in the end (:func:`_argmax`). Columns past the row hold -inf: never
    picked unless every column is -inf, and then ``first`` keeps the row's first."""
    at_max = x == tl.expand_dims(x_max, AXIS)
    first = tl.where(x_max > m, tl.min(tl.where(at_max, c, _NO_INDEX), AXIS), first)
    first_nan = tl.minimum(first_nan, tl.min(tl.where(x != x, c, _NO_INDEX), AXIS))
    return first, first_nan


@triton.jit
def _argmax(first, first_nan):
    return tl.where(first_nan != _NO_INDEX, first_nan, first)


@triton.jit
def _target_p(x_t, lse):
    """A token's probability of its target, exp(x_t - lse): Liger's ``use_token_scaling``
    multiplies the token's loss and gradient by it (a constant to the gradient). Where the
    target is ignored or out of range the factor is unused (loss 0 or +inf, gradient 0)."""
    return tl.exp(x_t - lse)


@triton.jit
def _token_scales(count_ptr, wstat_ptr, t_local, cw_ptr, x_t, lse, MEAN: tl.constexpr,
                  HAS_WEIGHT: tl.constexpr, TOKEN_SCALE: tl.constexpr):
    """A token's (w, w_z, w_t, W) for an upstream gradient of 1: ``_class_scales`` with
    class weights, else the mean's ``1 / count`` for the loss and the z-loss alike (w_t = W
    = 1); with Liger's token scaling both scales times the target's probability."""
    if HAS_WEIGHT:
        w, w_z, w_t, w_sum = _class_scales(count_ptr, wstat_ptr, t_local, cw_ptr, MEAN)
    else:
        w = _weight(count_ptr, MEAN)
        w_z = w
        w_t = 1.0
        w_sum = 1.0
    if TOKEN_SCALE:
        p = _target_p(x_t, lse)
        w = w * p
        w_z = w_z * p
    return w, w_z, w_t, w_sum


@triton.jit
def ce_fwd_kernel(
    x_ptr, stride_x, t_ptr, stats_ptr, g_ptr, stride_g, count_ptr,
    n_rows, V, vocab_start, vocab_size, ignore_index,
    ls_over_v, one_minus_ls, two_z, softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, WRITE_GRAD: tl.constexpr,
    MEAN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
    cw_ptr=None, wstat_ptr=None, HAS_WEIGHT: tl.constexpr = False,
    ARGMAX: tl.constexpr = False, TOKEN_SCALE: tl.constexpr = False,
):
    """Rows that fit one BLOCK_V tile, BLOCK_M rows per tile: each row is read once and
    held in registers from the stats to the gradient.

    ``HAS_WEIGHT``: class weights ``cw_ptr [V]`` (float32) and ``wstat_ptr`` = [sum of
    them, sum of the non-ignored targets' (a mean's divisor)]. ``ARGMAX``: stats
    ``[5, N]``, the predicted class in the fifth row (``_store_stats``). ``TOKEN_SCALE``
    (one rank): each token's loss and gradient times its target probability
    (``_target_p``)."""
    cols = tl.arange(0, BLOCK_V)
    col_ok = cols[None, :] < V
    cw = _tile_weights(cw_ptr, cols, V, HAS_WEIGHT, HAS_SMOOTHING)
    for tile in range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_M), tl.num_programs(0)):
        rows, row_ok, t_local, grad_ok, t = _rows(tile, n_rows, V, t_ptr, vocab_start,
                                                  vocab_size, ignore_index, BLOCK_M)
        x_off = rows.to(tl.int64) * stride_x
        x_t = _target_x(x_ptr, x_off, t_local, 0, V, softcap, HAS_SOFTCAP)
        x = _load_x(x_ptr, x_off, cols, col_ok, softcap, HAS_SOFTCAP)
        row_max = tl.max(x, 1)
        denom = tl.sum(tl.exp(x - _shift(row_max)[:, None]), 1)
        if HAS_SMOOTHING:
            if HAS_WEIGHT:
                sum_x = tl.sum(tl.where(col_ok, x * cw[None, :], 0.0), 1)
            else:
                sum_x = tl.sum(tl.where(col_ok, x, 0.0), 1)
        else:
            sum_x = denom * 0.0
        lse = _lse(row_max, denom)
        pred = 0
        if ARGMAX:  # the first max of each row (-inf past its end: never first), or NaN
            first = tl.min(tl.where(x == row_max[:, None], cols[None, :], _NO_INDEX), 1)
            pred = _argmax(first, tl.min(tl.where(x != x, cols[None, :], _NO_INDEX), 1))
            pred = pred + vocab_start
        w, w_z, w_t, w_sum = _token_scales(count_ptr, wstat_ptr, t_local, cw_ptr, x_t, lse,
                                           MEAN, HAS_WEIGHT, TOKEN_SCALE)
        _store_stats(stats_ptr, n_rows, rows, row_ok, lse, x_t, sum_x, t, w, ignore_index,
                     vocab_size, ls_over_v, one_minus_ls, two_z, HAS_SMOOTHING, w_t, w_sum,
                     w_z, pred, HAS_WEIGHT, ARGMAX)

        if WRITE_GRAD:
            w = tl.where(grad_ok, w, 0.0)
            w_z = tl.where(grad_ok, w_z, 0.0)
            g_off = rows.to(tl.int64) * stride_g
            g = _grad_tile(x, cols, t_local, lse, w, ls_over_v, one_minus_ls, two_z,
                           softcap, cw, w_t, w_sum, w_z, HAS_SOFTCAP, HAS_WEIGHT)
            tl.store(g_ptr + g_off[:, None] + cols[None, :], g.to(g_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & col_ok)


@triton.jit
def ce_grad_kernel(
    x_ptr, stride_x, t_ptr, lse_ptr, w_ptr, stride_w, g_ptr, stride_g,
    n_rows, V, vocab_start, vocab_size, ignore_index,
    ls_over_v, one_minus_ls, two_z, softcap,
    HAS_SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
    cw_ptr=None, wstat_ptr=None, wz_ptr=None, stride_wz=0, HAS_WEIGHT: tl.constexpr = False,
    HAS_SMOOTHING: tl.constexpr = False, wt_ptr=None, TARGET_WEIGHT: tl.constexpr = False,
):
    """The gradient of rows that fit one BLOCK_V tile, from given stats (``lse_ptr``: their
    first row) and per-row upstream gradients. ``HAS_WEIGHT``: class weights as in
    ``ce_fwd_kernel``, ``w_ptr`` scaling the weighted terms and ``wz_ptr`` the z-loss's.
    ``TARGET_WEIGHT`` (vocabulary parallel): the rows' target weights from ``wt_ptr [N]``,
    where ``cw_ptr`` holds only this rank's columns (``wstat_ptr``: the whole
    vocabulary's)."""
    rows, row_ok, t_local, grad_ok, _t = _rows(tl.program_id(0), n_rows, V, t_ptr,
                                               vocab_start, vocab_size, ignore_index, BLOCK_M)
    lse = tl.load(lse_ptr + rows)
    w = tl.where(grad_ok, tl.load(w_ptr + rows * stride_w).to(tl.float32), 0.0)
    cols = tl.arange(0, BLOCK_V)
    col_ok = cols[None, :] < V
    x = _load_x(x_ptr, rows.to(tl.int64) * stride_x, cols, col_ok, softcap, HAS_SOFTCAP)
    cw, w_t, w_sum, w_z = 0.0, 1.0, 1.0, w
    if HAS_WEIGHT:
        _u, _uz, w_t, w_sum = _class_scales(None, wstat_ptr, t_local, cw_ptr, False)
        if TARGET_WEIGHT:
            w_t = tl.load(wt_ptr + rows)
        w_z = tl.where(grad_ok, tl.load(wz_ptr + rows * stride_wz).to(tl.float32), 0.0)
        cw = _tile_weights(cw_ptr, cols, V, True, HAS_SMOOTHING)
    g = _grad_tile(x, cols, t_local, lse, w, ls_over_v, one_minus_ls, two_z, softcap,
                   cw, w_t, w_sum, w_z, HAS_SOFTCAP, HAS_WEIGHT)
    g_off = rows.to(tl.int64) * stride_g
    tl.store(g_ptr + g_off[:, None] + cols[None, :], g.to(g_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok)


@triton.jit
def ce_merge_kernel(parts_ptr, t_ptr, stats_ptr, count_ptr, n_rows, world, vocab_size,
                    ignore_index, ls_over_v, one_minus_ls, two_z,
                    HAS_SMOOTHING: tl.constexpr, MEAN: tl.constexpr, BLOCK: tl.constexpr,
                    wt_ptr=None, wstat_ptr=None, HAS_WEIGHT: tl.constexpr = False,
                    ARGMAX: tl.constexpr = False, STATS: tl.constexpr = 3):
    """Vocabulary parallel: every rank's ``[world, 3, N]`` stats (all-gathered) to the
    whole-vocabulary ``[4, N]`` stats and loss of the forward kernels, in one launch: the
    lse by a log-sum-exp merge, ``x_t`` (0 on every rank but the target's owner) and
    ``sum x`` by sums. A rank's NaN lse makes the row's NaN (through ``denom``); lanes past
    the last row read lse 0 (finite numbers, never stored).

    A rank's block holds ``STATS`` rows of N: the three stats, then with ``HAS_WEIGHT``
    its ``w_t`` (unread here) and then, with ``ARGMAX``, its max logit and that max's
    first global column (the last two rows); with ``HAS_WEIGHT`` one float more (its sum
    of weights), so ranks are ``STATS * N + 1`` apart. ``HAS_WEIGHT``: the loss with the
    tokens' target weights ``wt_ptr [N]`` and ``wstat_ptr`` = [the whole vocabulary's sum
    of weights, the non-ignored targets' sum] (as the forward kernels'). ``ARGMAX``: the
    first maximum of the whole row, the largest max (NaN largest of all), the lowest rank
    among equal ones, into the fifth stats row."""
    if HAS_WEIGHT:
        rank_stride = STATS * n_rows + 1
    else:
        rank_stride = STATS * n_rows
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < n_rows
    p = parts_ptr + rows
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    for _ in range(world):
        m = tl.maximum(m, tl.load(p, mask=ok, other=0.0))
        p += rank_stride
    shift = _shift(m)
    denom = tl.zeros((BLOCK,), tl.float32)
    x_t = tl.zeros((BLOCK,), tl.float32)
    sum_x = tl.zeros((BLOCK,), tl.float32)
    p = parts_ptr + rows
    for _ in range(world):
        denom += tl.exp(tl.load(p, mask=ok, other=0.0) - shift)
        x_t += tl.load(p + n_rows, mask=ok, other=0.0)
        sum_x += tl.load(p + 2 * n_rows, mask=ok, other=0.0)
        p += rank_stride
    pred = 0
    if ARGMAX:
        p = parts_ptr + rows + (STATS - 2) * n_rows
        best = tl.load(p, mask=ok, other=0.0)
        column = tl.load(p + n_rows, mask=ok, other=0.0)
        for _ in range(1, world):
            p += rank_stride
            value = tl.load(p, mask=ok, other=0.0)
            take = (value > best) | ((value != value) & (best == best))
            best = tl.where(take, value, best)
            column = tl.where(take, tl.load(p + n_rows, mask=ok, other=0.0), column)
        pred = column.to(tl.int32)
    t = tl.load(t_ptr + rows, mask=ok, other=ignore_index).to(tl.int64)
    if HAS_WEIGHT:
        w_t = tl.load(wt_ptr + rows, mask=ok, other=0.0)
        w_sum = tl.load(wstat_ptr)
        if MEAN:
            count = tl.load(count_ptr).to(tl.float32)
            w = 1.0 / tl.where(count > 0.0, tl.load(wstat_ptr + 1), 1.0)
            w_z = 1.0 / tl.maximum(count, 1.0)
        else:
            w, w_z = 1.0, 1.0
    else:
        w = _weight(count_ptr, MEAN)
        w_z, w_t, w_sum = w, 1.0, 1.0
    _store_stats(stats_ptr, n_rows, rows, ok, _lse(m, denom), x_t, sum_x, t, w,
                 ignore_index, vocab_size, ls_over_v, one_minus_ls, two_z, HAS_SMOOTHING,
                 w_t, w_sum, w_z, pred, HAS_WEIGHT, ARGMAX)


@triton.jit
def ce_scale_kernel(g_ptr, s_ptr, n, BLOCK: tl.constexpr):
    """g *= s in place; when s == 1 (the usual ``loss.backward()``) it returns at once, so
    the launch (a small persistent grid) costs microseconds and no host sync."""
    s = tl.load(s_ptr).to(tl.float32)
    if s != 1.0:
        for b in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
            offs = tl.full([BLOCK], b, tl.int64) * BLOCK + tl.arange(0, BLOCK)
            ok = offs < n
            g = tl.load(g_ptr + offs, mask=ok)
            tl.store(g_ptr + offs, (g.to(tl.float32) * s).to(g_ptr.dtype.element_ty), mask=ok)



# --- streamed rows (V above the single-block limit): lean inner loops ----------------------
#
# Per element the stats loop does load, convert, max, subtract, multiply, exp2 and add; the
# gradient loop load, convert, subtract, multiply, exp2, FMA, convert, store. Exponents are
# 2^((x - m) log2 e), the difference formed first: x log2 e - m log2 e (one FMA) rounds the
# product at x's magnitude, an absolute error of ulp(1.44 x) in the exponent (~3e-5 at
# |x| ~ 200) where (x - m) is exact or nearly so. Full chunks are loaded without masks;
# only the tail chunk is masked. The target column's "- (1 - s)" is written once per row
# after the chunks, instead of a compare-and-select on every element.


@triton.jit
def _range_stats(x_ptr, x_off, lo, hi, softcap, HAS_SOFTCAP: tl.constexpr,
                 HAS_SMOOTHING: tl.constexpr, BLOCK_V: tl.constexpr, KEEP: tl.constexpr,
                 cw_ptr=None, HAS_WEIGHT: tl.constexpr = False, ARGMAX: tl.constexpr = False,
                 STAGES: tl.constexpr = None):
    """(max, sum exp(x - max), sum x, argmax) over columns [lo, hi) of one row: BLOCK_V
    chunks with an online max, full chunks unmasked, the tail masked. ``KEEP``: the loads'
    eviction policy ("evict_last" for logits read again soon). ``HAS_WEIGHT`` (with
    smoothing): sum w x over the class weights ``cw_ptr`` instead of sum x. ``ARGMAX``: the
    first max's column (``_first_max``; else 0). ``STAGES``: the full chunks' software
    pipeline (``tl.range``'s ``num_stages``; None: Triton's default loop)."""
    cols = tl.arange(0, BLOCK_V)
    acc = tl.zeros([BLOCK_V], tl.float32)
    m = tl.max(acc, 0) - float("inf")  # a float32 scalar, -inf
    sx = tl.zeros([BLOCK_V], tl.float32)
    first = (lo + tl.zeros([], tl.int32)).to(tl.int32)
    first_nan = tl.full([], _NO_INDEX, tl.int32)
    n_full = (hi - lo) // BLOCK_V
    for k in tl.range(0, n_full, num_stages=STAGES):
        x = tl.load(x_ptr + x_off + lo + k * BLOCK_V + cols, eviction_policy=KEEP)
        x = x.to(tl.float32)
        if HAS_SOFTCAP:
            x = _cap(x, softcap, HAS_SOFTCAP)
        x_max = tl.max(x, 0)
        if ARGMAX:
            first, first_nan = _first_max(x, (lo + k * BLOCK_V + cols).to(tl.int32), x_max,
                                          m, first, first_nan, 0)
        m_new = tl.maximum(m, x_max)
        m_safe = _shift(m_new)
        acc = acc * tl.exp2((m - m_safe) * 1.4426950408889634) + tl.exp2(
            (x - m_safe) * 1.4426950408889634)
        m = m_new
        if HAS_SMOOTHING:
            if HAS_WEIGHT:
                sx += x * tl.load(cw_ptr + lo + k * BLOCK_V + cols)
            else:
                sx += x
    c = lo + n_full * BLOCK_V + cols
    ok = c < hi
    x = tl.load(x_ptr + x_off + c, mask=ok, other=float("-inf"), eviction_policy=KEEP)
    x = x.to(tl.float32)
    if HAS_SOFTCAP:
        x = tl.where(ok, _cap(x, softcap, HAS_SOFTCAP), float("-inf"))
    x_max = tl.max(x, 0)
    if ARGMAX:
        first, first_nan = _first_max(x, c.to(tl.int32), x_max, m, first, first_nan, 0)
    m_new = tl.maximum(m, x_max)
    m_safe = _shift(m_new)
    acc = acc * tl.exp2((m - m_safe) * 1.4426950408889634) + tl.exp2(
        (x - m_safe) * 1.4426950408889634)
    if HAS_SMOOTHING:
        if HAS_WEIGHT:
            sx += tl.where(ok, x * tl.load(cw_ptr + c, mask=ok, other=1.0), 0.0)  # 1: x = -inf
        else:
            sx += tl.where(ok, x, 0.0)
    return m_new, tl.sum(acc, 0), tl.sum(sx, 0), _argmax(first, first_nan)


@triton.jit
def _range_stats_2d(x_ptr, x_off, lo, hi, softcap, HAS_SOFTCAP: tl.constexpr,
                    HAS_SMOOTHING: tl.constexpr, BLOCK_V: tl.constexpr, VEC: tl.constexpr,
                    PREFETCH: tl.constexpr, KEEP: tl.constexpr, cw_ptr=None,
                    HAS_WEIGHT: tl.constexpr = False, ARGMAX: tl.constexpr = False):
    """``_range_stats`` with no barrier in the loop: a chunk is a ``[BLOCK_V // VEC, VEC]``
    tile whose rows a thread holds whole (VEC 8 or 16: one to four 16-byte loads), so the
    running max and sum (and argmax) are kept per tile row and reduced across the program
    once, at the end.
    ``PREFETCH``: chunk ``k + 1`` is loaded before chunk ``k`` is reduced. For programs
    that run alone on an SM (one 32-warp program streaming a row), where a block-wide max
    per chunk would stall every warp at a barrier."""
    R: tl.constexpr = BLOCK_V // VEC
    offs = tl.arange(0, R)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    m = tl.full([R], float("-inf"), tl.float32)
    acc = tl.zeros([R], tl.float32)
    sx = tl.zeros([R], tl.float32)
    first = (lo + tl.zeros([R], tl.int32)).to(tl.int32)
    first_nan = tl.full([R], _NO_INDEX, tl.int32)
    n = tl.cdiv(hi - lo, BLOCK_V)
    if PREFETCH:
        x_next = tl.load(x_ptr + x_off + lo + offs, mask=lo + offs < hi, other=float("-inf"),
                         eviction_policy=KEEP)
    for k in range(0, n):
        c = lo + k * BLOCK_V + offs
        if PREFETCH:
            x = x_next.to(tl.float32)
            x_next = tl.load(x_ptr + x_off + c + BLOCK_V, mask=c + BLOCK_V < hi,
                             other=float("-inf"), eviction_policy=KEEP)
        else:
            x = tl.load(x_ptr + x_off + c, mask=c < hi, other=float("-inf"),
                        eviction_policy=KEEP).to(tl.float32)
        if HAS_SOFTCAP:
            x = tl.where(c < hi, _cap(x, softcap, HAS_SOFTCAP), float("-inf"))
        x_max = tl.max(x, 1)
        if ARGMAX:
            first, first_nan = _first_max(x, c.to(tl.int32), x_max, m, first, first_nan, 1)
        m_new = tl.maximum(m, x_max)
        m_safe = _shift(m_new)
        acc = acc * tl.exp2((m - m_safe) * 1.4426950408889634) + tl.sum(
            tl.exp2((x - m_safe[:, None]) * 1.4426950408889634), 1)
        m = m_new
        if HAS_SMOOTHING:
            if HAS_WEIGHT:
                x = x * tl.load(cw_ptr + c, mask=c < hi, other=1.0)  # 1: x = -inf there
            sx += tl.sum(tl.where(c < hi, x, 0.0), 1)
    row_max = tl.max(m, 0)
    denom = tl.sum(acc * tl.exp2((m - _shift(row_max)) * 1.4426950408889634), 0)
    # the first tile row's first max among the rows that reach the row's max
    first = tl.min(tl.where(m == row_max, first, _NO_INDEX), 0)
    return row_max, denom, tl.sum(sx, 0), _argmax(first, tl.min(first_nan, 0))


@triton.jit
def _lse(m, denom):
    """log-sum-exp from a row's max and ``denom = sum exp(x - _shift(m))``: -inf for a row
    of -inf (denom 0), NaN when denom is NaN (a NaN or +inf logit)."""
    empty = denom == 0.0
    return tl.where(empty, float("-inf"), _shift(m) + tl.log(tl.where(empty, 1.0, denom)))


@triton.jit
def _range_grad(x_ptr, x_off, g_ptr, g_off, lo, hi, lse, x_t, t_local, w, ls_over_v,
                one_minus_ls, two_z, softcap, HAS_SOFTCAP: tl.constexpr,
                BLOCK_V: tl.constexpr, STREAM: tl.constexpr, cw_ptr=None, w_t=1.0,
                w_sum=1.0, w_z=1.0, HAS_WEIGHT: tl.constexpr = False,
                HAS_SMOOTHING: tl.constexpr = False):
    """Write the gradient of columns [lo, hi) of one row,
    w * (p (1 + 2 z lse) - s / V - (1 - s) [j == t]); with class weights (``HAS_WEIGHT``,
    see ``_grad_tile``) p (w (w_t (1 - s) + s W / V) + w_z 2 z lse) - w (s / V) w_j
    - w w_t (1 - s) [j == t], the w_j read only with ``HAS_SMOOTHING``.

    ``STREAM``: the logits are read for the last time (evict first) and the gradient is
    stored streaming (``.cs``), so neither displaces logits that wait in L2 for this read.

    Chunks go last to first (the stats pass read the last ones most recently). The target
    column (``t_local``, when in range) is rewritten at the end from ``x_t``, so it is
    right even when the gradient overwrites the logits.
    """
    cols = tl.arange(0, BLOCK_V)
    b = -ls_over_v * w
    if HAS_WEIGHT:
        a = w * (w_t * one_minus_ls + ls_over_v * w_sum) + w_z * two_z * lse
        minus_t = one_minus_ls * w * w_t
        b_t = b * w_t
    else:
        a = w * (1.0 + two_z * lse)  # NaN for a NaN lse, so the row is (see ``_grad_tile``)
        minus_t = one_minus_ls * w
        b_t = b
    n_full = (hi - lo) // BLOCK_V
    c = lo + n_full * BLOCK_V + cols
    ok = c < hi
    x = tl.load(x_ptr + x_off + c, mask=ok, other=0.0,
                eviction_policy="evict_first" if STREAM else "").to(tl.float32)
    g = _grad_values(x, lse, a, _smoothing_b(b, cw_ptr, c, ok, HAS_WEIGHT, HAS_SMOOTHING,
                                             False), 0.0, softcap, HAS_SOFTCAP, True)
    tl.store(g_ptr + g_off + c, g.to(g_ptr.dtype.element_ty), mask=ok,
             cache_modifier=".cs" if STREAM else "")
    for i in range(0, n_full):
        c = lo + (n_full - 1 - i) * BLOCK_V + cols
        x = tl.load(x_ptr + x_off + c,
                    eviction_policy="evict_first" if STREAM else "").to(tl.float32)
        g = _grad_values(x, lse, a, _smoothing_b(b, cw_ptr, c, c, HAS_WEIGHT, HAS_SMOOTHING,
                                                 True), 0.0, softcap, HAS_SOFTCAP, True)
        tl.store(g_ptr + g_off + c, g.to(g_ptr.dtype.element_ty),
                 cache_modifier=".cs" if STREAM else "")
    tl.debug_barrier()  # the chunk store of the target column happens before this one
    if (t_local >= lo) & (t_local < hi):
        g_t = _grad_values(x_t, lse, a, b_t, minus_t, softcap, HAS_SOFTCAP, False)
        tl.store(g_ptr + g_off + t_local, g_t.to(g_ptr.dtype.element_ty))


@triton.jit
def _smoothing_b(b, cw_ptr, c, ok, HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
                 FULL: tl.constexpr):
    """The smoothing term of columns ``c``: ``b`` (= -w s / V), times the class weights when
    there are some (``ok``: the load's mask, unused for a ``FULL`` chunk)."""
    if HAS_WEIGHT and HAS_SMOOTHING:
        if FULL:
            return b * tl.load(cw_ptr + c)
        else:
            return b * tl.load(cw_ptr + c, mask=ok, other=0.0)
    else:
        return b


@triton.jit
def _grad_values(x, lse, a, b, minus, softcap, HAS_SOFTCAP: tl.constexpr,
                 CAP_INPUT: tl.constexpr):
    """a * p + b - minus (times the softcap's derivative), p = exp(x - lse) = 2^((x - lse)
    log2 e); ``x`` raw logits (capped here when CAP_INPUT) or already capped. The difference
    is formed first (see the comment above ``_range_stats``)."""
    if HAS_SOFTCAP and CAP_INPUT:
        x = _cap(x, softcap, HAS_SOFTCAP)
    g = tl.exp2((x - lse) * 1.4426950408889634) * a + b - minus
    if HAS_SOFTCAP:
        u = x / softcap
        g = g * (1.0 - u * u)
    return g


@triton.jit
def _target_x(x_ptr, x_off, t_local, lo, hi, softcap, HAS_SOFTCAP: tl.constexpr):
    """The (softcapped) logit of a target column in [lo, hi); 0 otherwise."""
    mine = (t_local >= lo) & (t_local < hi)
    x_t = tl.load(x_ptr + x_off + tl.where(mine, t_local, lo), mask=mine, other=0.0)
    x_t = x_t.to(tl.float32)
    if HAS_SOFTCAP:
        x_t = _cap(x_t, softcap, HAS_SOFTCAP)
    return tl.where(mine, x_t, 0.0)


@triton.jit
def _row_target(t_ptr, row, V, vocab_start, vocab_size, ignore_index):
    """A row's target column among this rank's (-1 when not here), whether the row carries
    a gradient (not ignored, target in range), and the target itself."""
    t = tl.load(t_ptr + row).to(tl.int64)
    grad_ok = (t != ignore_index) & (t >= 0) & (t < vocab_size)
    t_local = t - vocab_start
    mine = grad_ok & (t_local >= 0) & (t_local < V)
    return tl.where(mine, t_local, -1).to(tl.int32), grad_ok, t


@triton.jit
def ce_stream_kernel(
    x_ptr, stride_x, t_ptr, stats_ptr, g_ptr, stride_g, count_ptr,
    n_rows, V, vocab_start, vocab_size, ignore_index,
    ls_over_v, one_minus_ls, two_z, softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, WRITE_GRAD: tl.constexpr,
    MEAN: tl.constexpr, BLOCK_V: tl.constexpr, HINTS: tl.constexpr, VEC: tl.constexpr = 0,
    PREFETCH: tl.constexpr = False, cw_ptr=None, wstat_ptr=None,
    HAS_WEIGHT: tl.constexpr = False, ARGMAX: tl.constexpr = False,
    TOKEN_SCALE: tl.constexpr = False, STAGES: tl.constexpr = None,
):
    """Stats (and with WRITE_GRAD the gradient) of long rows, one row at a time per
    program, persistent over rows. ``HINTS`` (with WRITE_GRAD): the first read of a row
    asks L2 to keep it, the second evicts it, the gradient is stored streaming. ``VEC``
    > 0: the stats loop of ``_range_stats_2d`` (no barrier per chunk; ``PREFETCH``).
    ``HAS_WEIGHT``, ``ARGMAX``, ``TOKEN_SCALE``: as in ``ce_fwd_kernel``. ``STAGES``: the
    plain stats loop's software pipeline (``_range_stats``; the stats-only pass's, where
    the table's ``chunk_stages`` sets it: the fused pass was slower pipelined).

    With one 32-warp program per SM and rows that fit L1 (bf16 rows up to about 128K
    columns on an H100), the second read, last chunk first, is mostly L1 hits: the first
    read left the row's end there."""
    for row in range(tl.program_id(0).to(tl.int64), n_rows, tl.num_programs(0)):
        t_local, grad_ok, t = _row_target(t_ptr, row, V, vocab_start, vocab_size,
                                          ignore_index)
        x_off = row * stride_x
        x_t = _target_x(x_ptr, x_off, t_local, 0, V, softcap, HAS_SOFTCAP)
        if VEC > 0:
            m, denom, sum_x, pred = _range_stats_2d(
                x_ptr, x_off, 0, V, softcap, HAS_SOFTCAP, HAS_SMOOTHING, BLOCK_V, VEC,
                PREFETCH, "evict_last" if HINTS else "", cw_ptr, HAS_WEIGHT, ARGMAX)
        else:
            m, denom, sum_x, pred = _range_stats(
                x_ptr, x_off, 0, V, softcap, HAS_SOFTCAP, HAS_SMOOTHING, BLOCK_V,
                "evict_last" if HINTS else "", cw_ptr, HAS_WEIGHT, ARGMAX, STAGES)
        lse = _lse(m, denom)
        w, w_z, w_t, w_sum = _token_scales(count_ptr, wstat_ptr, t_local, cw_ptr, x_t, lse,
                                           MEAN, HAS_WEIGHT, TOKEN_SCALE)
        _store_stats(stats_ptr, n_rows, row, True, lse, x_t, sum_x, t, w, ignore_index,
                     vocab_size, ls_over_v, one_minus_ls, two_z, HAS_SMOOTHING, w_t, w_sum,
                     w_z, pred + vocab_start, HAS_WEIGHT, ARGMAX)
        if WRITE_GRAD:
            w = tl.where(grad_ok, w, 0.0)
            w_z = tl.where(grad_ok, w_z, 0.0)
            _range_grad(x_ptr, x_off, g_ptr, row * stride_g, 0, V, lse, x_t, t_local, w,
                        ls_over_v, one_minus_ls, two_z, softcap, HAS_SOFTCAP, BLOCK_V, HINTS,
                        cw_ptr, w_t, w_sum, w_z, HAS_WEIGHT, HAS_SMOOTHING)


@triton.jit
def ce_stream_grad_kernel(
    x_ptr, stride_x, t_ptr, stats_ptr, w_ptr, stride_w, g_ptr, stride_g,
    n_rows, V, vocab_start, vocab_size, ignore_index,
    ls_over_v, one_minus_ls, two_z, softcap,
    HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr,
    cw_ptr=None, wstat_ptr=None, wz_ptr=None, stride_wz=0, HAS_WEIGHT: tl.constexpr = False,
    HAS_SMOOTHING: tl.constexpr = False, wt_ptr=None, TARGET_WEIGHT: tl.constexpr = False,
):
    """The gradient of long rows from given stats and per-row upstream gradients (class
    weights, ``TARGET_WEIGHT``: as in ``ce_grad_kernel``)."""
    for row in range(tl.program_id(0).to(tl.int64), n_rows, tl.num_programs(0)):
        t_local, grad_ok, _t = _row_target(t_ptr, row, V, vocab_start, vocab_size,
                                           ignore_index)
        lse = tl.load(stats_ptr + row)
        x_t = tl.load(stats_ptr + n_rows + row)
        w = tl.where(grad_ok, tl.load(w_ptr + row * stride_w).to(tl.float32), 0.0)
        w_t, w_sum, w_z = 1.0, 1.0, w
        if HAS_WEIGHT:
            _u, _uz, w_t, w_sum = _class_scales(None, wstat_ptr, t_local, cw_ptr, False)
            if TARGET_WEIGHT:
                w_t = tl.load(wt_ptr + row)
            w_z = tl.where(grad_ok, tl.load(wz_ptr + row * stride_wz).to(tl.float32), 0.0)
        _range_grad(x_ptr, row * stride_x, g_ptr, row * stride_g, 0, V, lse, x_t, t_local, w,
                    ls_over_v, one_minus_ls, two_z, softcap, HAS_SOFTCAP, BLOCK_V, False,
                    cw_ptr, w_t, w_sum, w_z, HAS_WEIGHT, HAS_SMOOTHING)


@triton.jit
def ce_slices_kernel(
    x_ptr, stride_x, t_ptr, part_ptr, arrived_ptr, ticket_ptr, stats_ptr, g_ptr, stride_g,
    count_ptr, n_rows, V, ignore_index, ls_over_v, one_minus_ls, two_z, softcap,
    SLICES, SLICE, LAG,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, MEAN: tl.constexpr,
    SLICES_P2: tl.constexpr, BLOCK_V: tl.constexpr, HINTS: tl.constexpr = False,
    cw_ptr=None, wstat_ptr=None, HAS_WEIGHT: tl.constexpr = False,
    TOKEN_SCALE: tl.constexpr = False,
):
    """Loss, stats and gradient of long rows in one launch, rows cut in SLICES slices
    (class weights, ``HAS_WEIGHT``, and ``TOKEN_SCALE``: as in ``ce_fwd_kernel``; no
    argmax).

    Tile ``i`` is slice ``i % SLICES`` of row ``i // SLICES``. Programs (a persistent
    grid) take tile numbers from a ticket counter, so tile numbers follow the order in
    which work really started, and for each ticket ``i``:

    * phase A: reduce tile ``i``'s slice to (max, sum exp, sum x, target logit),
      publish them and count them in for the row;
    * phase B: write the gradient of tile ``i - LAG`` (``LAG >= SLICES``): wait until
      its row's slices, all numbered below ``i``, are counted in, merge them into the
      row's lse and re-read that slice, read only ``LAG`` tiles ago: an L2 hit.

    Only smaller tile numbers are ever waited for, and those were taken by running
    programs that finish phase A without waiting, so nothing can deadlock, whatever the
    number of resident programs (the argument of decoupled look-back scans). The
    interpreter, running programs one by one, runs it too. HBM sees one read of the logits
    and one write of the gradient; the grid size bounds what is read between a slice's
    two reads.
    """
    n_tiles = n_rows * SLICES
    tile = tl.atomic_add(ticket_ptr, 1)
    while tile < n_tiles + LAG:
        if tile < n_tiles:  # phase A
            row = (tile // SLICES).to(tl.int64)
            lo = (tile % SLICES) * SLICE
            hi = tl.minimum(lo + SLICE, V)
            x_off = row * stride_x
            t_local, grad_ok, t = _row_target(t_ptr, row, V, 0, V, ignore_index)
            p_max, p_sum, p_sx, _pred = _range_stats(
                x_ptr, x_off, lo, hi, softcap, HAS_SOFTCAP, HAS_SMOOTHING, BLOCK_V,
                "evict_last" if HINTS else "", cw_ptr, HAS_WEIGHT)
            x_t = _target_x(x_ptr, x_off, t_local, lo, hi, softcap, HAS_SOFTCAP)
            base = tile.to(tl.int64) * 4
            tl.store(part_ptr + base, p_max)
            tl.store(part_ptr + base + 1, p_sum)
            tl.store(part_ptr + base + 2, p_sx)
            tl.store(part_ptr + base + 3, x_t)
            tl.debug_barrier()  # all of this program's stores happen before the release
            tl.atomic_add(arrived_ptr + row, 1, sem="release")
        j = tile - LAG
        if j >= 0:  # phase B, for tile j
            row = (j // SLICES).to(tl.int64)
            done = tl.atomic_add(arrived_ptr + row, 0, sem="acquire")
            while done < SLICES:
                done = tl.atomic_add(arrived_ptr + row, 0, sem="acquire")
            k = tl.arange(0, SLICES_P2)
            have = k < SLICES
            slots = row * SLICES * 4 + k * 4
            maxes = tl.load(part_ptr + slots, mask=have, other=float("-inf"),
                            cache_modifier=".cg")
            sums = tl.load(part_ptr + slots + 1, mask=have, other=0.0, cache_modifier=".cg")
            x_ts = tl.load(part_ptr + slots + 3, mask=have, other=0.0, cache_modifier=".cg")
            row_max = tl.max(maxes, 0)
            lse = _lse(row_max, tl.sum(sums * tl.exp(maxes - _shift(row_max)), 0))
            x_t = tl.sum(x_ts, 0)
            t_local, grad_ok, t = _row_target(t_ptr, row, V, 0, V, ignore_index)
            w, w_z, w_t, w_sum = _token_scales(count_ptr, wstat_ptr, t_local, cw_ptr, x_t,
                                               lse, MEAN, HAS_WEIGHT, TOKEN_SCALE)
            if j % SLICES == 0:  # one tile per row reports the row's stats and loss
                sxs = tl.load(part_ptr + slots + 2, mask=have, other=0.0, cache_modifier=".cg")
                _store_stats(stats_ptr, n_rows, row, True, lse, x_t, tl.sum(sxs, 0), t, w,
                             ignore_index, V, ls_over_v, one_minus_ls, two_z, HAS_SMOOTHING,
                             w_t, w_sum, w_z, 0, HAS_WEIGHT)
            w = tl.where(grad_ok, w, 0.0)
            w_z = tl.where(grad_ok, w_z, 0.0)
            lo = (j % SLICES) * SLICE
            hi = tl.minimum(lo + SLICE, V)
            _range_grad(x_ptr, row * stride_x, g_ptr, row * stride_g, lo, hi, lse, x_t,
                        t_local, w, ls_over_v, one_minus_ls, two_z, softcap, HAS_SOFTCAP,
                        BLOCK_V, HINTS, cw_ptr, w_t, w_sum, w_z, HAS_WEIGHT, HAS_SMOOTHING)
        tile = tl.atomic_add(ticket_ptr, 1)
