"""Triton kernels of the activation family: one forward and one backward for all of it.

Both work on ``x [M, K]`` row-major (rows ``sx`` apart, columns contiguous), gated (``K =
2 N``: the activated half ``x[:, :N]`` and the linear half ``x[:, N:]``) or not (``K = N``),
with the activation, bias, clamp, linear offset and per-token weights chosen by constexpr
flags, so each variant compiles to straight-line code. Math is float32. The multipliers
(Falcon-H1's: ``act(g a) * lin * d``) and the linear offset are runtime float arguments: a
new value compiles nothing. ``SCALARS`` off (the offset 0, the multipliers 1) leaves their
operations out: exact either way, but at an H200's copy rate about 48 instructions a thread
and element fit a SwiGLU forward's time (computed from the clock, not profiled), and the
three took 3 of its 29 PTX instructions an element.

A pointer a variant does not read (``b_ptr``, ``w_ptr``, ``x8_ptr``, ``db_ptr``, ``dw_ptr``)
and ``clamp`` without ``HAS_CLAMP`` come as None: Triton binds them as constants, fewer
arguments per launch.

* ``act_fwd_kernel``: tiles ``[BLOCK_M, BLOCK_N]`` of the output; reads x (and bias,
  weights) once, writes ``y [M, N]`` once.
* ``act_bwd_kernel``: a program owns a column block and a group of rows, walking the rows
  tile by tile (a group of one tile where there is no bias gradient to sum: the flat
  launch, ``ops._launch_bwd``): it reads x (recomputing the activation) and the output
  gradient once and writes ``dx`` once. The bias gradient (a sum over rows) is accumulated
  in registers (elementwise over the tiles, reduced over rows once) and written as one
  float32 partial row per program (``db_part [groups, K]``); the weights'
  gradient (a sum over columns) as one float32 partial per tile and row (``dw_part
  [column blocks, M]``). Summing those small partials afterwards keeps the result
  deterministic (no atomics). With a clamp (applied before the bias, as Megatron-Core
  does) x's gradient is zero where the clamp is active; the bias's is not.

NaN and inf follow the reference (PyTorch's own formulas, see ``reference.py``): maxima,
minima and clamps propagate NaN (``tl.maximum`` alone drops it), and the sigmoid is written
from ``exp(-|z|)``, which never overflows (for any finite or infinite ``z``; NaN stays NaN),
instead of ``exp(-z)``, which overflows to inf for large ``|z|``; tanh-GELU is a sigmoid too
(:func:`activate`), its exponent clamped where it would overflow.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._fp8 import store_e4m3

GELU, SILU, QUICK_GELU, SQUARED_RELU = 0, 1, 2, 3

# The constants are written out in the functions below (a kernel can read a global only as a
# tl.constexpr, which Triton's interpreter cannot multiply by a tensor): from tanh-GELU's
# sqrt(2 / pi) = 0.79788456 and cubic coefficient 0.044715 (Megatron-Core's values, the same
# as reference.py's), the sigmoid form's exponent -2 sqrt(2 / pi) log2(e) = -2.3022082, its
# cubic term's -0.10294324 and the derivative's 2 u' = 1.5957691 + 0.21406445 a^2 (twice
# 0.79788456 + 3 * 0.79788456 * 0.044715 a^2); Quick-GELU's 1.702.


@triton.jit
def _sigmoid(z):
    # e = exp(-|z|) is in [0, 1]: sigmoid(|z|) = 1 / (1 + e), sigmoid(-|z|) = e / (1 + e).
    # (exp2 of the scaled argument: tl.exp's own scaling adds a denormal-safe ex2, which
    # costs instructions a memory-bound kernel on an H200 does not have to spare.)
    e = tl.exp2(tl.abs(z) * -1.4426950408889634)
    s = 1.0 / (1.0 + e)
    return tl.where(z >= 0, s, e * s)


@triton.jit
def _times_sigmoid(a, k: tl.constexpr):
    """``a sigmoid(a k / log2(e))`` (``k`` folds log2(e) and the slope) as ``a / (1 + e)``
    for ``a >= 0`` and ``a e / (1 + e)`` below, ``e = 2^(-k |a|)`` in [0, 1]: no overflow
    for any ``a``, one division (SiLU: ``x / (1 + exp(-x))``, PyTorch's own form, the same
    values within a rounding; ``+inf`` stays inf, ``-inf`` and NaN give NaN)."""
    e = tl.exp2(tl.abs(a) * -k)
    return tl.where(a >= 0, a, a * e) / (1.0 + e)


@triton.jit
def activate(a, ACT: tl.constexpr):
    """The activation of code ``ACT`` (``ops.ACT_CODES``) on float32 ``a``; shared with the
    MoE experts' kernels, as are :func:`activate_and_grad` and :func:`chain_grad`.

    tanh-GELU's ``0.5 a (1 + tanh(u))`` is computed as ``a sigmoid(2 u)`` = ``a / (1 + 2^z)``,
    ``z = -2 u log2(e)`` = ``a (-2.3022082 - 0.10294324 a^2)`` (the constants folded): one exp2
    and one division where the tanh form took about twice the instructions (it bounded
    GEGLU's forward on an H200), and no cancellation in ``1 + tanh(u)`` for negative ``a``.
    Past ``z = 26`` the value is ``a * 0``, as PyTorch's float32 formula gives it: there
    ``tanh(u)`` rounds to -1 (``1 - |tanh(u)| < 2^-25`` from ``2|u| > 26 ln 2``, which is
    ``z > 26``), so ``1 + tanh(u)`` is exactly 0, the product with an inf up half NaN, not
    +-inf: -0 for a finite ``a``, NaN for ``-inf`` (``-inf * 0``); the exp2's argument is
    clamped there (no overflow: no floating-point error in the interpreter). ``+inf`` and
    NaN pass through the division."""
    if ACT == 0:
        z = a * (-2.3022082 + -0.10294324 * (a * a))
        return tl.where(z > 26.0, a * 0.0, a / (1.0 + tl.exp2(tl.minimum(z, 26.0))))
    elif ACT == 1:
        return _times_sigmoid(a, 1.4426950408889634)
    elif ACT == 2:
        return _times_sigmoid(a, 2.4554669595930156)  # 1.702 log2(e)
    else:
        r = tl.maximum(a, 0.0, propagate_nan=tl.PropagateNan.ALL)
        return r * r


@triton.jit
def activate_and_grad(a, ACT: tl.constexpr):
    """(act(a), act'(a)). tanh-GELU as in :func:`activate`, ``s = sigmoid(2u)`` =
    ``1 / (1 + e)``, ``e = 2^z`` (``s`` 0 past ``z = 26``): ``act = a s``, ``act' = s + a s
    (1 - s) 2u'`` with ``2u' = 1.5957691 + 0.21406445 a^2`` (twice Megatron's ``0.79788456 +
    0.1070322243 a^2``), the tanh form's derivative written with ``1 - tanh^2 = 4 s (1 -
    s)``; ``1 - s`` is ``e s`` (no cancellation where ``s`` nears 1), 1 past ``z = 26``. Its
    NaNs are that formula's: at +-inf (``inf * 0``) and where ``a^2`` overflows (``0 *
    inf``)."""
    if ACT == 0:
        z = a * (-2.3022082 + -0.10294324 * (a * a))
        far = z > 26.0
        e = tl.exp2(tl.minimum(z, 26.0))
        s = tl.where(far, 0.0, 1.0 / (1.0 + e))
        y = a * s
        return y, s + y * tl.where(far, 1.0, e * s) * (1.5957691 + 0.21406445 * (a * a))
    elif ACT == 1:
        s = _sigmoid(a)
        return a * s, s * (1.0 + a * (1.0 - s))
    elif ACT == 2:
        s = _sigmoid(1.702 * a)
        # s + a (1.702 s (1 - s)), the factor first: 1.702 a overflows float32 past 2e38
        # where s (1 - s) is already 0 (inf * 0 would make the gradient NaN)
        return a * s, s + (1.702 * s * (1.0 - s)) * a
    else:
        r = tl.maximum(a, 0.0, propagate_nan=tl.PropagateNan.ALL)
        return r * r, 2.0 * r


@triton.jit
def chain_grad(a, up, dact, ACT: tl.constexpr):
    """``up * act'(a)`` for the upstream factor ``up``. ReLU's gradient is a select in PyTorch
    (``threshold_backward``), not a product: where ``a <= 0`` it is exactly 0 even when
    ``up`` is NaN or inf (a NaN routing weight, an inf linear half)."""
    if ACT == 3:
        return tl.where(a <= 0, 0.0, up * dact)
    else:
        return up * dact


@triton.jit
def act_fwd_kernel(
    x_ptr, sx, b_ptr, w_ptr, y_ptr, sy, x8_ptr, M, N, offset, clamp, gate_mul, down_mul,
    ACT: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_W: tl.constexpr,
    HAS_CLAMP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    STORE_X8: tl.constexpr = False, SCALARS: tl.constexpr = True,
):
    """A one-dimensional grid of ``cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)`` programs, the
    column tiles of a row tile consecutive: programs that run together walk x and y in
    address order, as a copy does (H100, bias-SwiGLU [16384, 2 x 14336] bf16: 0.486 ms with
    the row tiles consecutive, 0.460-0.465 this way; torch.compile's kernel 0.465).

    ``STORE_X8``: also write x as float8_e4m3fn to ``x8_ptr`` (``[M, K]`` contiguous),
    the copy ``fp8_input_store`` keeps for backward, from the values loaded here."""
    col_tiles = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    rows = (pid // col_tiles).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask, cmask = rows < M, cols < N
    mask = rmask[:, None] & cmask[None, :]
    xp = x_ptr + rows[:, None] * sx + cols[None, :]
    a = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
    K = 2 * N if GATED else N
    if STORE_X8:
        store_e4m3(x8_ptr + rows[:, None] * K + cols[None, :], a, mask)
    if GATED:
        b = tl.load(xp + N, mask=mask, other=0.0).to(tl.float32)
        if STORE_X8:
            store_e4m3(x8_ptr + rows[:, None] * K + N + cols[None, :], b, mask)
        if HAS_CLAMP:
            a = tl.minimum(a, clamp, propagate_nan=tl.PropagateNan.ALL)
            b = tl.clamp(b, -clamp, clamp, propagate_nan=tl.PropagateNan.ALL)
        if HAS_BIAS:
            a += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
            b += tl.load(b_ptr + N + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if SCALARS:
            y = activate(a * gate_mul, ACT) * (b + offset) * down_mul
        else:
            y = activate(a, ACT) * b
    else:
        if HAS_BIAS:
            a += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        y = activate(a * gate_mul, ACT) * down_mul if SCALARS else activate(a, ACT)
    if HAS_W:
        y *= tl.load(w_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + rows[:, None] * sy + cols[None, :], y.to(y_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def act_bwd_kernel(
    x_ptr, sx, g_ptr, sg, b_ptr, w_ptr, dx_ptr, sdx, db_ptr, dw_ptr, M, N, rows_per_group,
    offset, clamp, gate_mul, down_mul,
    ACT: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_W: tl.constexpr,
    HAS_CLAMP: tl.constexpr, BIAS_GRAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, STAGES: tl.constexpr = None, SCALARS: tl.constexpr = True,
    FLAT: tl.constexpr = False,
):
    # The grouped launch: a 2-D grid (column block, row group). The flat one (a group a row
    # tile): one axis, column blocks fastest, as a grid's second axis holds 65535 at most.
    if FLAT:
        col_blocks = tl.cdiv(N, BLOCK_N)
        pid_n, group = tl.program_id(0) % col_blocks, tl.program_id(0) // col_blocks
    else:
        pid_n, group = tl.program_id(0), tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    if HAS_BIAS:
        bias_a = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            bias_b = tl.load(b_ptr + N + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    # Bias-gradient sums kept per tile element and reduced over rows once, at the end.
    db_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    db_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = group.to(tl.int64) * rows_per_group
    for r0 in tl.range(0, rows_per_group, BLOCK_M, num_stages=STAGES):
        rows = first + r0 + tl.arange(0, BLOCK_M)
        rmask = (rows < M) & (r0 + tl.arange(0, BLOCK_M) < rows_per_group)
        mask = rmask[:, None] & cmask[None, :]
        xp = x_ptr + rows[:, None] * sx + cols[None, :]
        # The output multiplier folded into the upstream gradient: g = dL/dy * d.
        g = tl.load(g_ptr + rows[:, None] * sg + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        if SCALARS:
            g *= down_mul
        if HAS_W:
            w = tl.load(w_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
            gw = g * w
        else:
            gw = g
        a = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
        dxp = dx_ptr + rows[:, None] * sdx + cols[None, :]
        if GATED:
            b = tl.load(xp + N, mask=mask, other=0.0).to(tl.float32)
            if HAS_CLAMP:
                # torch.clamp's gradient: 0 where the clamp is active, and at NaN.
                keep_a = a <= clamp
                keep_b = (b >= -clamp) & (b <= clamp)
                a = tl.minimum(a, clamp, propagate_nan=tl.PropagateNan.ALL)
                b = tl.clamp(b, -clamp, clamp, propagate_nan=tl.PropagateNan.ALL)
            if HAS_BIAS:
                a += bias_a
                b += bias_b
            if SCALARS:
                u = a * gate_mul
                act, dact = activate_and_grad(u, ACT)
                lin = b + offset
                da = chain_grad(u, gw * lin * gate_mul, dact, ACT)
            else:
                act, dact = activate_and_grad(a, ACT)
                lin = b
                da = chain_grad(a, gw * lin, dact, ACT)
            dlin = gw * act
            if BIAS_GRAD:  # the bias is added after the clamp: its gradient is not clamped
                db_a += tl.where(mask, da, 0.0)
                db_b += tl.where(mask, dlin, 0.0)
            if HAS_CLAMP:
                da = tl.where(keep_a, da, 0.0)
                dlin = tl.where(keep_b, dlin, 0.0)
            tl.store(dxp, da.to(dx_ptr.dtype.element_ty), mask=mask)
            tl.store(dxp + N, dlin.to(dx_ptr.dtype.element_ty), mask=mask)
            if HAS_W:
                part = tl.sum(tl.where(mask, act * lin * g, 0.0), axis=1)
                tl.store(dw_ptr + pid_n.to(tl.int64) * M + rows, part, mask=rmask)
        else:
            if HAS_BIAS:
                a += bias_a
            if SCALARS:
                u = a * gate_mul
                act, dact = activate_and_grad(u, ACT)
                da = chain_grad(u, gw * gate_mul, dact, ACT)
            else:
                act, dact = activate_and_grad(a, ACT)
                da = chain_grad(a, gw, dact, ACT)
            tl.store(dxp, da.to(dx_ptr.dtype.element_ty), mask=mask)
            if HAS_W:
                part = tl.sum(tl.where(mask, act * g, 0.0), axis=1)
                tl.store(dw_ptr + pid_n.to(tl.int64) * M + rows, part, mask=rmask)
            if BIAS_GRAD:
                db_a += tl.where(mask, da, 0.0)
    if BIAS_GRAD:
        dbp = db_ptr + group.to(tl.int64) * (2 * N if GATED else N) + cols
        tl.store(dbp, tl.sum(db_a, axis=0), mask=cmask)
        if GATED:
            tl.store(dbp + N, tl.sum(db_b, axis=0), mask=cmask)
