"""``rms_norm`` and ``layer_norm``: validation, dispatch, launch configuration and autograd.

LayerNorm (at the end) runs the same two kernels as RMSNorm, centred (``CENTERED``), with
a bias; its forward saves ``mean [rows]`` besides ``rstd``, and its backward returns the
bias gradient too, as a second float32 partial per program. Its custom ops are
``lmfuse::layer_norm_fwd`` / ``lmfuse::layer_norm_bwd``. The rest of this docstring, said of
RMSNorm, holds for both.

The public function checks its inputs once (:func:`_resolve`, shared with the planner that
``lmfuse.explain`` calls), then runs the reference (``impl="torch"``, differentiated by
autograd) or one autograd function around the two Triton kernels: the forward saves ``x``,
``weight`` and the float32 ``rstd [rows]`` it computed; the backward reads them and ``dy``
once and returns ``dx`` and the weight gradient (float32 per-program partials summed once:
deterministic). A call with nothing to differentiate launches the forward kernel alone,
with no autograd node. Eager calls launch the kernels directly; under ``torch.compile`` they go
through the ``torch.library`` custom ops ``lmfuse::rms_norm_fwd`` / ``lmfuse::rms_norm_bwd``
(opaque graph nodes with fake implementations), so the graph does not break. Nothing syncs
with the host.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .. import _pdl, tuning
from .._dispatch import (
    FLOAT32_MAX,
    PLAIN_TENSORS,
    Plan,
    ResolvedCall,
    apply_function,
    check_float32,
    check_number,
    check_same_device,
    check_tensor,
    checked_once,
    cpu_fast,
    function_mode_active,
    float64_fallback,
    native_cpu,
    once_differentiable,
    planner_of,
    select_impl,
)
from .._launch import cdiv, dtype_name, kernel_op, lazy_kernels
from .._nvtx import nvtx_range
from .reference import layer_norm_reference, rms_norm_reference

_OP = "rms_norm"
_kernels = lazy_kernels("kernels", __package__)


def _config(H: int, device: torch.device, centered_bwd: bool = False, elem_bytes: int = 4
            ) -> tuple[tuning.RowTiles, int, int]:
    """``(tiles, backward programs per SM, backward stages)`` for rows of ``H`` values, from
    the ``rms_norm`` tuning section (both norms' kernels read it).

    A row up to ``max_single_block`` wide is one register tile, ``tile_elems // width``
    rows per program, with ``warps_by_block`` warps; a wider one is streamed in
    ``chunk_block``-column tiles, ``chunk_rows`` rows at a time, with ``chunk_warps``. The
    backward's number of programs per SM is ``bwd_programs_per_sm``, or
    ``chunk_bwd_programs_per_sm`` when streamed. (On an H100, bf16: a single tile beats
    streaming up to 16384 columns, forward and backward; 2 backward programs per SM are
    best at H = 4096 and within 2% of the best at 8192 to 16384.)

    The backward's row loop is software-pipelined over ``stages`` (Triton's ``num_stages``:
    the next rows' x and dy tiles copied into shared memory while this one is computed):
    ``bwd_stages`` (RMSNorm) or ``centered_bwd_stages`` (LayerNorm), ``[limit, stages]``
    entries by tile width as ``warps_by_block``'s, 1 (not pipelined) without one, and for
    float32 rows (``elem_bytes``, x's and dy's bytes a column, above 4) the ``_fp32``
    entries; streamed rows pipeline their first pass over the columns (the row's sums) over
    ``chunk_bwd_stages`` / ``centered_chunk_bwd_stages``.
    Stages are cut to what the device's shared memory holds (``stages - 1`` buffers of a
    tile's x and dy). H200, bf16 [16384, H], the backward alone: 3 stages take RMSNorm
    from 0.130 to 0.113 ms at H = 4096 and 0.266 to 0.214 at 8192, LayerNorm from 0.166 to
    0.114 and 0.314 to 0.228; narrow rows (64-256) and float32 RMSNorm are as fast or
    faster without, and RMSNorm at 16384.

    ``centered_bwd``: LayerNorm's backward, whose single tiles of the widths in
    ``centered_bwd_warps`` (a width's string -> warps) take that many warps: it holds
    seven row tiles to RMSNorm's five (H200, bf16 [16384, 16384]: 16 warps 3.3 ms
    unpipelined, 8 warps 1.08; with 3 stages 0.83 and 0.81).
    """
    return _cached_config(H, device, centered_bwd, elem_bytes, tuning.generation())


@functools.lru_cache(maxsize=256)
def _cached_config(H: int, device: torch.device, centered_bwd: bool, elem_bytes: int,
                   generation: int) -> tuple[tuning.RowTiles, int, int]:
    """:func:`_config`, looked up once per width, device, element size and tuning
    generation (the lookup is host time of every call: 2 us)."""
    t = tuning.table("rms_norm", device)
    tiles = tuning.row_tiles(t, H)
    per_sm = t["bwd_programs_per_sm" if tiles.single else "chunk_bwd_programs_per_sm"]
    prefix = "centered_" if centered_bwd else ""
    if tiles.single:
        if centered_bwd:
            warps = t.get("centered_bwd_warps", {}).get(str(tiles.block_n))
            if warps:
                tiles = dataclasses.replace(tiles, num_warps=warps)
        # (float32 rows, 8 bytes a column of x and dy, have entries of their own)
        key = prefix + ("bwd_stages_fp32" if elem_bytes > 4 else "bwd_stages")
        stages = tuning.by_width(t.get(key, ()), tiles.block_n, 1)
    else:
        stages = t.get(prefix + "chunk_bwd_stages", 1)
    smem = tuning.shared_memory(device)
    if smem is not None and stages > 1:
        # (stages - 1) buffers of the x and dy tiles, and room for the row reductions
        per_stage = tiles.block_m * tiles.block_n * elem_bytes
        stages = max(1, min(stages, 1 + (smem - _REDUCE_SMEM) // per_stage))
    return tiles, per_sm, stages


# Shared memory left beside the pipeline's buffers for the kernels' cross-warp reductions.
_REDUCE_SMEM = 16 * 1024


def _bwd_grid(M: int, block_m: int, programs_per_sm: int, device: torch.device
              ) -> tuple[int, int]:
    """``(programs, rows_per_program)``: a few programs per SM, each owning a contiguous
    group of rows (a multiple of ``block_m``). Depends on the shape and device only, so the
    weight gradient's summation order, and its value, are the same on every run."""
    programs = max(1, min(cdiv(M, block_m), programs_per_sm * tuning.sm_count(device)))
    rows_per_program = cdiv(cdiv(M, programs), block_m) * block_m
    return (cdiv(M, rows_per_program) if M else 1), rows_per_program


# --- launches --------------------------------------------------------------------------------


def _fwd(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
         eps: float, weight_offset: float, centered: bool, pdl: int = 0
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, H]`` (unit column stride) -> ``(y [M, H] in x's dtype, stats)``: RMSNorm's
    ``stats [M]`` float32 rstd, or LayerNorm's (``centered``) ``stats [2, M]``, the means
    then the rstd, in one buffer (one allocation: a host cost of every call)."""
    M, H = x.shape
    y = x.new_empty(M, H)
    stats = torch.empty((2, M) if centered else (M,), dtype=torch.float32, device=x.device)
    if M == 0 or H == 0:
        return y, stats
    tiles = _config(H, x.device)[0]
    _kernels().norm_fwd_kernel[(cdiv(M, tiles.block_m),)](
        x, x.stride(0), weight, bias, y, y.stride(0), stats, M, H, eps, weight_offset,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, CENTERED=centered,
        PDL=pdl, **tiles.meta(), **_pdl.launch_options(pdl))
    return y, stats


def _fwd_fake(x, weight, eps, weight_offset, pdl=0):
    return x.new_empty(x.shape), x.new_empty((x.shape[0],), dtype=torch.float32)


@kernel_op("rms_norm_fwd", _fwd_fake)
def launch_rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float,
                    weight_offset: float, pdl: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, H]`` (unit column stride) -> ``(y [M, H] in x's dtype, rstd [M] float32)``.
    ``pdl``: launched with programmatic dependent launch (``lmfuse._pdl``; CUDA only)."""
    return _fwd(x, weight, None, eps, weight_offset, False, pdl)


def _ln_fwd_fake(x, weight, bias, eps, weight_offset):
    return x.new_empty(x.shape), x.new_empty((2, x.shape[0]), dtype=torch.float32)


@kernel_op("layer_norm_fwd", _ln_fwd_fake)
def launch_layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor],
                      bias: Optional[torch.Tensor], eps: float, weight_offset: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, H]`` (unit column stride) -> ``(y [M, H] in x's dtype, stats [2, M]
    float32)``: ``stats[0]`` the rows' means, ``stats[1]`` their rstd."""
    return _fwd(x, weight, bias, eps, weight_offset, True)


def _bwd(x: torch.Tensor, dy: torch.Tensor, stats: torch.Tensor,
         weight: Optional[torch.Tensor], weight_offset: float, weight_grad: bool,
         bias_grad: bool, centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx [M, H] in x's dtype, dparams [k, H] float32)`` from the forward's ``stats``:
    ``dparams`` holds the weight's gradient (``weight_grad``), then the bias's
    (``bias_grad``), k of them; LayerNorm's when ``centered``. Each program adds its rows'
    parameter gradients into float32 partial rows of its own, and the partials are summed
    after, in one reduction (one program's partial is the sum itself: a view of it, not a
    reduction launch; the partials hold no -0.0, where a sum would give +0.0)."""
    M, H = x.shape
    dx = x.new_empty(M, H)
    tiles, per_sm, stages = _config(H, x.device, centered, x.element_size() + dy.element_size())
    programs, rows_per_program = _bwd_grid(M, tiles.block_m, per_sm, x.device)
    k = int(weight_grad) + int(bias_grad)
    if M == 0 or H == 0:
        return dx, torch.zeros(k, H, dtype=torch.float32, device=x.device)
    # Streamed rows add into their program's partial rows in place: they start at zero.
    part = ((torch.empty if tiles.single else torch.zeros)(
        k, programs, H, dtype=torch.float32, device=x.device) if k else None)
    _kernels().norm_bwd_kernel[(programs,)](
        x, x.stride(0), dy, dy.stride(0), weight, stats, dx, dx.stride(0), part, M, H,
        rows_per_program, weight_offset, HAS_WEIGHT=weight is not None,
        WEIGHT_GRAD=weight_grad, BIAS_GRAD=bias_grad, CENTERED=centered,
        STAGES=stages if stages > 1 else None, **tiles.meta())
    if not k:
        return dx, torch.empty(0, H, dtype=torch.float32, device=x.device)
    return dx, (part[:, 0] if programs == 1 else part.sum(1))


def _bwd_fake(x, dy, rstd, weight, weight_offset, weight_grad):
    return (x.new_empty(x.shape),
            x.new_empty((x.shape[1] if weight_grad else 0,), dtype=torch.float32))


@kernel_op("rms_norm_bwd", _bwd_fake)
def _launch_bwd(x: torch.Tensor, dy: torch.Tensor, rstd: torch.Tensor,
                weight: Optional[torch.Tensor], weight_offset: float,
                weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm's ``(dx [M, H] in x's dtype, dw [H] float32)``; ``dw`` is empty unless
    ``weight_grad``."""
    dx, dw = _bwd(x, dy, rstd, weight, weight_offset, weight_grad, False, False)
    return dx, (dw[0] if weight_grad else dw.new_empty(0))


def _ln_bwd_fake(x, dy, stats, weight, weight_offset, weight_grad, bias_grad):
    return (x.new_empty(x.shape),
            x.new_empty((int(weight_grad) + int(bias_grad), x.shape[1]), dtype=torch.float32))


@kernel_op("layer_norm_bwd", _ln_bwd_fake)
def _launch_ln_bwd(x: torch.Tensor, dy: torch.Tensor, stats: torch.Tensor,
                   weight: Optional[torch.Tensor], weight_offset: float, weight_grad: bool,
                   bias_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm's ``(dx [M, H] in x's dtype, dparams [k, H] float32)`` from the forward's
    ``stats [2, M]``: ``dparams`` holds the weight's gradient (``weight_grad``), then the
    bias's (``bias_grad``)."""
    return _bwd(x, dy, stats, weight, weight_offset, weight_grad, bias_grad, True)


# --- autograd ----------------------------------------------------------------------------------


class _RMSNorm(torch.autograd.Function):
    """``y = rms_norm(x, weight)`` for ``x [M, H]`` on the Triton path."""

    @staticmethod
    def forward(ctx, x, weight, s: NormCall):
        with nvtx_range(_OP, "fwd"):
            y, rstd = launch_rms_norm(x, weight, s.eps, s.weight_offset)
            ctx.s = s
            needs = ctx.needs_input_grad
            if needs[0] or needs[1]:
                ctx.save_for_backward(x, weight, rstd)
            return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        with nvtx_range(_OP, "bwd"):
            x, weight, rstd = ctx.saved_tensors
            need_x, need_w = ctx.needs_input_grad[:2]
            if dy.stride(-1) != 1:  # any row stride is read as is, even 0 (expanded)
                dy = dy.contiguous()
            offset = ctx.s.weight_offset
            dx, dw = _launch_bwd(x, dy, rstd, weight, offset, need_w)
            dw = dw.to(weight.dtype) if need_w else None
            return (dx if need_x else None), dw, None


# --- validation, planning, the public function ---------------------------------------------------


@functools.lru_cache(maxsize=64, typed=True)
def _scalars(op, eps, weight_offset) -> tuple[float, float]:
    """``eps`` and ``weight_offset``, validated (``typed``: ``True`` is not taken for ``1``)."""
    # (float32 arguments of the kernels: within float32's range)
    eps = check_float32(op, "eps", check_number(op, "eps", eps, allow_none=False))
    if eps < 0:
        what = "the mean square" if op == _OP else "the variance"
        raise ValueError(f"{op}: eps must be >= 0 (it is added to {what}), got {eps}")
    return eps, check_float32(op, "weight_offset",
                              check_number(op, "weight_offset", weight_offset,
                                           allow_none=False))


@dataclass(frozen=True, slots=True)
class NormCall(ResolvedCall):
    """A checked :func:`rms_norm` or :func:`layer_norm` call: what the launches and the
    planner read."""

    eps: float
    weight_offset: float
    rows: int  # the product of x's leading dims
    H: int  # x's last dim


def _resolve_norm(op, x, params: tuple, eps, weight_offset, impl) -> tuple[str, str, NormCall]:
    """Validate ``x``, its ``[H]`` parameters (``params``: ``(name, tensor or None)``
    pairs) and the scalars, and choose the path; cheap and traceable by torch.compile."""
    check_tensor(op, "x", x)
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have a last (hidden) dimension, got a 0-D tensor")
    H = x.shape[-1]
    for name, t in params:
        if t is not None:
            check_tensor(op, name, t, ndim=1)
            if t.shape[0] != H:
                raise ValueError(f"{op}: {name} must be [H] = [{H}] (x's last dim, x of shape "
                                 f"{tuple(x.shape)}), got {tuple(t.shape)}")
            check_same_device(op, "x", x, **{name: t})
    # A model's eps and offset repeat: checked once, not every call (as cross_entropy's
    # options). A bad or unhashable value is checked uncached, which raises.
    eps, weight_offset = checked_once(_scalars, op, eps, weight_offset)
    path, reason = float64_fallback(op, impl, *select_impl(op, impl, x.device), x.dtype, "x")
    rows = math.prod(x.shape[:-1])
    return path, reason, NormCall(eps, weight_offset, rows, H)


def _resolve(x, weight, eps, weight_offset, impl) -> tuple[str, str, NormCall]:
    """:func:`rms_norm`'s arguments, validated, and its path."""
    return _resolve_norm(_OP, x, (("weight", weight),), eps, weight_offset, impl)


class _RMSNormCPU(torch.autograd.Function):
    """The common CPU call with a gradient to take: ``torch.rms_norm``'s formula forward
    (``xh = x * rsqrt(mean(x^2) + eps)``, ``y = xh * w``) and its gradient in closed form,
    ``dx = rstd * (g - xh * mean(g * xh))`` with ``g = dy * w``, ``dw = sum(dy * xh)`` over
    the rows: four passes over ``[..., H]`` where autograd through the formula's six ops
    takes about twice as many. NaN and inf reach the gradients as through the formula: a
    NaN row's are NaN, and a row whose mean square overflowed (rstd 0, ``xh`` 0) takes the
    formula's own terms, NaN where they are ``inf * 0`` (the kernels' ``_dx``)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))
        xh = x * rstd
        ctx.save_for_backward(x, xh, rstd, weight)
        return xh * weight if weight is not None else xh

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, xh, rstd, weight = ctx.saved_tensors
        g = dy * weight if weight is not None else dy
        dx = dw = None
        if ctx.needs_input_grad[0]:
            c = (g * xh).mean(-1, keepdim=True)
            dx = torch.addcmul(g, xh, c, value=-1.0).mul_(rstd)
            dead = rstd == 0  # the mean square overflowed: the formula's inf * 0 terms
            if dead.any():
                c = (g * x).sum(-1, keepdim=True).mul_(rstd).div_(x.shape[-1])
                dx = torch.where(dead, g * rstd - (2.0 * x) * (c * rstd), dx)
        if weight is not None and ctx.needs_input_grad[1]:
            dw = dy * xh
            if dw.dim() > 1:
                dw = dw.sum(tuple(range(dw.dim() - 1)))
        return dx, dw, None


def _cpu_rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """PyTorch's RMSNorm of float32 CPU tensors; where a gradient will be taken, through
    :class:`_RMSNormCPU`."""
    if torch.is_grad_enabled() and (x.requires_grad or (
            weight is not None and weight.requires_grad)):
        return apply_function(_RMSNormCPU, x, weight, eps)
    return torch.rms_norm(x, x.shape[-1:], weight, eps)


def math_eps(dtype: torch.dtype) -> float:
    """``torch.nn.RMSNorm``'s ``eps=None``: the epsilon of the type its math runs in
    (float32's for 16-bit and float32 inputs, float64's for float64), not the input dtype's
    (bfloat16's 7.8e-3 would dominate small rows)."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, *, eps: float = 1e-6,
             weight_offset: float = 0.0, impl: str = "auto") -> torch.Tensor:
    """RMSNorm over the last dim: ``x / sqrt(mean(x ** 2) + eps) * (weight + weight_offset)``.

    Float32 math (float64 for float64 x on the reference path), rounded once to x's dtype.

    Args:
        x: ``[..., H]`` float32/float16/bfloat16 (float64 on the torch path), any leading
            shape and strides, any H (rows wider than one register tile are streamed).
        weight: optional ``[H]`` scale, any float dtype, on x's device; ``None``: no affine
            step (``weight_offset`` then has no effect). Its gradient comes in its dtype.
        eps: added to the mean square; finite and >= 0.
        weight_offset: added to ``weight`` before it scales: 1.0 is Gemma's ``(1 + weight)``,
            0.0 (Llama, Mistral, Qwen) scales by ``weight`` itself.
        impl: ``"auto"`` (Triton on CUDA or under the interpreter, else the reference;
            float32 CPU tensors there run ``torch.nn.functional.rms_norm``, the same
            formula), ``"triton"`` or ``"torch"``; see :func:`lmfuse.explain`.

    Returns:
        ``[..., H]`` in x's dtype (contiguous on the Triton path); gradients for x and
        weight.

    NaN and inf propagate as in the PyTorch formula: a NaN in a row (or in ``weight``'s
    column) makes that row (column) NaN; an inf makes its row's ``rstd`` 0, so the row is 0
    except NaN (``inf * 0``) at the inf; gradients likewise (a NaN row's are NaN).
    """
    # (an eps past float32's range: the full path refuses it)
    if (impl == "auto" and type(eps) is float and 0.0 <= eps <= FLOAT32_MAX
            and type(weight_offset) is float and weight_offset == 0.0 and cpu_fast(x)
            and x.dim() > 0 and (weight is None or (
                type(weight) in PLAIN_TENSORS and weight.dtype is torch.float32
                and weight.is_cpu and weight.shape == x.shape[-1:]))):
        # The common CPU call (float32, a float32 weight or none, no offset): the path
        # below at once, without the resolved call. What PyTorch's op refuses (a sparse or
        # nested x) takes the full path, whose checks name it.
        try:
            return _cpu_rms_norm(x, weight, eps)
        except RuntimeError:
            pass
    path, _, a = _resolve(x, weight, eps, weight_offset, impl)
    if native_cpu(impl, path, x) and (weight is None or weight.dtype == torch.float32):
        # The default path on CPU float32 (no Triton): PyTorch's own op, the same float32
        # formula and NaN/inf behaviour as the reference without its dtype round trips.
        if weight is not None and a.weight_offset:
            weight = weight + a.weight_offset
        return _cpu_rms_norm(x, weight, a.eps)
    if path == "torch":
        with nvtx_range(_OP, "fwd"):
            return rms_norm_reference(x, weight, eps=a.eps, weight_offset=a.weight_offset)
    # 2-D x goes in as it is: no reshape, whose view would add a node to the backward.
    flat = x.dim() == 2
    x2 = x if flat else x.reshape(a.rows, x.shape[-1])
    if x2.stride(-1) != 1:  # the kernels read any row stride, but columns at stride 1
        x2 = x2.contiguous()
    w = weight.contiguous() if weight is not None else None
    if not (torch.is_grad_enabled() and (x.requires_grad or (
            weight is not None and weight.requires_grad))):
        # Nothing to differentiate (inference): the launch alone, no autograd node.
        with nvtx_range(_OP, "fwd"):
            y = launch_rms_norm(x2, w, a.eps, a.weight_offset)[0]
    else:
        y = apply_function(_RMSNorm, x2, w, a)
    return y if flat else y.view(x.shape)


@planner_of(rms_norm)
def plan_rms_norm(x, weight, eps, weight_offset, impl) -> Plan:
    """What :func:`rms_norm` would do with these arguments (validated the same way)."""
    path, reason, a = _resolve(x, weight, eps, weight_offset, impl)
    return _plan(_OP, impl, path, reason, a, x, {"weight": weight},
                 "x, weight, rstd [rows] float32",
                 native=weight is None or weight.dtype == torch.float32)


def _plan(op: str, impl: str, path: str, reason: str, a: NormCall, x: torch.Tensor,
          params: dict, saved: str, native: bool) -> Plan:
    """The plan of a norm's call: its scale, its parameters, the launches' tiles."""
    H, weight = a.H, params["weight"]
    scale = ("none (no weight)" if weight is None else
             f"weight + {a.weight_offset:g}" if a.weight_offset else "weight")
    details = {
        "x": f"{list(x.shape)} {dtype_name(x.dtype)}: {a.rows} rows of {H}",
        "scale": scale,
        "eps": a.eps,
    }
    for name, t in params.items():
        if t is not None:
            details[name] = f"[{H}] {dtype_name(t.dtype)}"
    if path == "triton" and H > 0:
        tiles = _config(H, x.device)[0]
        details["forward"] = (
            f"one pass, {tiles.block_m} row(s) x {tiles.block_n} columns per program"
            if tiles.single else
            f"streamed in {tiles.block_n}-column tiles, {tiles.block_m} row(s) per program")
        tiles, per_sm, stages = _config(H, x.device, op == _LN, 2 * x.element_size())
        programs, per = _bwd_grid(a.rows, tiles.block_m, per_sm, x.device)
        learned = " and ".join(n for n, t in params.items() if t is not None)
        details["backward"] = (
            f"{programs} program(s) of {per} rows, "
            + (f"{tiles.block_m} x {tiles.block_n} tiles, {tiles.num_warps} warps"
               if tiles.single else
               f"streamed in {tiles.block_n}-column tiles")
            + ((f", rows pipelined over {stages} stages" if tiles.single else
                f", each row's first pass over its columns pipelined over {stages} stages")
               if stages > 1 else "")
            + (f"; {learned} gradient: float32 partial per program, summed" if learned
               else ""))
        details["saved for backward"] = saved
    if native_cpu(impl, path, x) and native:
        reason += ("; CPU float32: PyTorch's own op (the same float32 formula)" if op == _OP
                   else "; CPU float32: PyTorch's own op, F.layer_norm")
    return Plan(op, path, reason, details, call=a)


# --- LayerNorm -----------------------------------------------------------------------------------

_LN = "layer_norm"


class _LayerNorm(torch.autograd.Function):
    """``y = layer_norm(x, weight, bias)`` for ``x [M, H]`` on the Triton path."""

    @staticmethod
    def forward(ctx, x, weight, bias, s: NormCall):
        with nvtx_range(_LN, "fwd"):
            y, stats = launch_layer_norm(x, weight, bias, s.eps, s.weight_offset)
            ctx.s = s
            ctx.bias_dtype = bias.dtype if bias is not None else None
            needs = ctx.needs_input_grad
            if needs[0] or needs[1] or needs[2]:
                ctx.save_for_backward(x, weight, stats)
            return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        with nvtx_range(_LN, "bwd"):
            x, weight, stats = ctx.saved_tensors
            need_x, need_w, need_b = ctx.needs_input_grad[:3]
            if dy.stride(-1) != 1:  # any row stride is read as is, even 0 (expanded)
                dy = dy.contiguous()
            dx, dparams = _launch_ln_bwd(x, dy, stats, weight, ctx.s.weight_offset,
                                         need_w, need_b)
            dw = db = None
            if need_w and need_b and weight.dtype == ctx.bias_dtype:
                dw, db = dparams.to(weight.dtype).unbind()  # one cast for both
            else:
                if need_w:
                    dw = dparams[0].to(weight.dtype)
                if need_b:
                    db = dparams[-1].to(ctx.bias_dtype)
            return (dx if need_x else None), dw, db, None


def _resolve_ln(x, weight, bias, eps, weight_offset, impl) -> tuple[str, str, NormCall]:
    """:func:`layer_norm`'s arguments, validated, and its path."""
    return _resolve_norm(_LN, x, (("weight", weight), ("bias", bias)), eps, weight_offset,
                         impl)


def _cpu_affine(t: Optional[torch.Tensor]) -> bool:
    """Whether ``t`` (a weight or a bias) may go to PyTorch's CPU op as it is: float32 (a
    plain tensor or a parameter; its shape and device the op checks)."""
    return t is None or (type(t) in PLAIN_TENSORS and t.dtype is _F32)


_F32 = torch.float32
_torch_layer_norm = torch.layer_norm  # (F.layer_norm's op; its last argument: cuDNN, unused)


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, *, eps: float = 1e-5,
               weight_offset: float = 0.0, impl: str = "auto") -> torch.Tensor:
    """LayerNorm over the last dim: ``(x - mean) / sqrt(var + eps) * (weight +
    weight_offset) + bias``, with the biased variance (``torch.nn.LayerNorm``'s).

    Float32 math (float64 for float64 x on the reference path), rounded once to x's dtype.
    One kernel forward (x read once, y written once; the row's mean and ``1 / std`` kept,
    8 bytes a row) and one backward (x and dy read once, dx written once, the weight and
    bias gradients as float32 partials per program, summed once: deterministic).

    Args:
        x: ``[..., H]`` float32/float16/bfloat16 (float64 on the torch path), any leading
            shape and strides, any H (rows wider than one register tile are streamed).
        weight: optional ``[H]`` scale, any float dtype, on x's device; ``None``: no scale
            (``weight_offset`` then has no effect). Its gradient comes in its dtype.
        bias: optional ``[H]`` shift, any float dtype, on x's device; ``None``: no shift.
            Its gradient comes in its dtype.
        eps: added to the variance; finite and >= 0.
        weight_offset: added to ``weight`` before it scales: 1.0 is the zero-centred scale
            of Megatron's ``layernorm_zero_centered_gamma`` and Nemotron's LayerNorm1P.
        impl: ``"auto"`` (Triton on CUDA or under the interpreter, else the reference;
            float32 CPU tensors there run ``torch.nn.functional.layer_norm``), ``"triton"``
            or ``"torch"``; see :func:`lmfuse.explain`.

    Returns:
        ``[..., H]`` in x's dtype (contiguous on the Triton path); gradients for x, weight
        and bias. Under CUDA autocast, as ``F.layer_norm`` there (on autocast's float32
        list), a 16-bit x is taken as float32: a float32 output, x's gradient in x's dtype.

    NaN and inf: a NaN or an inf in a row makes the whole row NaN (its mean is NaN or inf),
    and its gradients NaN, as ``F.layer_norm`` gives; a NaN weight (bias) element makes its
    column NaN. A constant row's output is the bias exactly, whatever its magnitude (the
    mean is summed from the row's first value; on the CPU default path, ``F.layer_norm``'s
    Welford statistics give NaN past about 2e19). Rows whose variance overflows float32
    (values past about 1e19): see :func:`~lmfuse.norm.reference.layer_norm_reference`;
    there the CPU default path gives what ``F.layer_norm`` gives, which may differ.
    """
    if (impl == "auto" and type(eps) is float and 0.0 <= eps <= FLOAT32_MAX
            and type(weight_offset) is float and weight_offset == 0.0 and cpu_fast(x)
            and x.dim() > 0 and _cpu_affine(weight) and _cpu_affine(bias)
            and not function_mode_active()):
        # The common CPU call (float32, float32 parameters or none, no offset): PyTorch's
        # own op at once, without the resolved call (nor F.layer_norm's Python wrapper,
        # 0.4 us; under a torch function mode, which should see F.layer_norm, the full
        # path). Where it refuses the parameters (their shape, their device), the full
        # path gives lmfuse's error; nothing was computed.
        try:
            return _torch_layer_norm(x, x.shape[-1:], weight, bias, eps, False)
        except RuntimeError:
            pass
    x = _autocast_ln(x)
    path, _, a = _resolve_ln(x, weight, bias, eps, weight_offset, impl)
    if (native_cpu(impl, path, x) and (weight is None or weight.dtype == torch.float32)
            and (bias is None or bias.dtype == torch.float32)):
        # The default path on CPU float32 (no Triton): PyTorch's own op.
        if weight is not None and a.weight_offset:
            weight = weight + a.weight_offset
        return torch.nn.functional.layer_norm(x, x.shape[-1:], weight, bias, a.eps)
    if path == "torch":
        with nvtx_range(_LN, "fwd"):
            return layer_norm_reference(x, weight, bias, eps=a.eps,
                                        weight_offset=a.weight_offset)
    flat = x.dim() == 2
    x2 = x if flat else x.reshape(a.rows, x.shape[-1])
    if x2.stride(-1) != 1:  # the kernels read any row stride, but columns at stride 1
        x2 = x2.contiguous()
    w = weight.contiguous() if weight is not None else None
    b = bias.contiguous() if bias is not None else None
    if torch.is_grad_enabled() and (x.requires_grad or (w is not None and w.requires_grad)
                                    or (b is not None and b.requires_grad)):
        y = apply_function(_LayerNorm, x2, w, b, a)
    else:  # nothing to differentiate (inference): the launch alone, no autograd node
        with nvtx_range(_LN, "fwd"):
            y = launch_layer_norm(x2, w, b, a.eps, a.weight_offset)[0]
    return y if flat else y.view(x.shape)


def _autocast_ln(x: Any) -> Any:
    """``x`` as CUDA autocast gives it to ``F.layer_norm`` (on its float32 list): a 16-bit
    CUDA x as float32 while autocast is on (the parameters are read as float32 anyway)."""
    if (isinstance(x, torch.Tensor) and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)
            and torch.is_autocast_enabled("cuda")):
        return x.float()
    return x


@planner_of(layer_norm)
def plan_layer_norm(x, weight, bias, eps, weight_offset, impl) -> Plan:
    """What :func:`layer_norm` would do with these arguments (validated the same way)."""
    x = _autocast_ln(x)
    path, reason, a = _resolve_ln(x, weight, bias, eps, weight_offset, impl)
    return _plan(_LN, impl, path, reason, a, x, {"weight": weight, "bias": bias},
                 "x, weight, mean and rstd [rows] float32",
                 native=(weight is None or weight.dtype == torch.float32)
                 and (bias is None or bias.dtype == torch.float32))


# --- self-check cases for ``lmfuse check`` -------------------------------------------------------


def checks(device: torch.device, dtypes) -> list:
    """Fresh random cases of every variant of both norms (weight or not, bias or not, the
    weight offsets, streamed rows), for :mod:`lmfuse._check`."""
    from .._check import op_case

    small = device.type != "cuda"
    shapes = {"plain": (9, 100) if small else (1000, 4096),
              "3-D": (2, 5, 96) if small else (4, 512, 5120),
              "streamed row": (2, 16411) if small else (64, 70000)}

    def case(label, shape, dtype, weight="same", **kw):
        H = shape[-1]

        def inputs():
            t = [torch.randn(shape, device=device).to(dtype).requires_grad_(True)]
            if weight is not None:
                w = 1.0 + 0.1 * torch.randn(H, device=device)
                t.append(w.to(dtype if weight == "same" else weight).requires_grad_(True))
            return t

        return op_case(_OP, label, dtype, shape, inputs, rms_norm, plan_rms_norm, **kw)

    cases = []
    for dtype in dtypes:
        cases += [
            case("weight", shapes["plain"], dtype),
            case("fp32 weight", shapes["plain"], dtype, weight=torch.float32),
            case("gemma 1+weight", shapes["plain"], dtype, weight_offset=1.0),
            case("no weight", shapes["3-D"], dtype, weight=None),
            case("streamed row", shapes["streamed row"], dtype, eps=1e-5),
        ]

    def ln_case(label, shape, dtype, affine=("same", "same"), **kw):
        H = shape[-1]

        def inputs():
            t = [torch.randn(shape, device=device).to(dtype).requires_grad_(True)]
            for kind, base in zip(affine, (1.0, 0.0)):
                if kind is not None:
                    p = base + 0.1 * torch.randn(H, device=device)
                    t.append(p.to(dtype if kind == "same" else kind).requires_grad_(True))
            return t

        return op_case(_LN, label, dtype, shape, inputs, layer_norm, plan_layer_norm, **kw)

    for dtype in dtypes:
        cases += [
            ln_case("weight and bias", shapes["plain"], dtype),
            ln_case("fp32 weight and bias", shapes["plain"], dtype,
                    affine=(torch.float32, torch.float32)),
            ln_case("1+weight (LayerNorm1P)", shapes["plain"], dtype, weight_offset=1.0),
            ln_case("no affine", shapes["3-D"], dtype, affine=(None, None)),
            ln_case("streamed row", shapes["streamed row"], dtype, eps=1e-6),
        ]
    return cases
