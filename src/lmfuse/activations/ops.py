"""The fused activations: validation, dispatch, autograd.

Every public function goes through :func:`_run`: inputs checked and flattened to ``[tokens,
K]``, the path chosen (``impl``), then one autograd function for the whole family. Its
forward saves only ``x`` (optionally as float8, or in pinned CPU memory) plus bias and
weights; its backward recomputes the activation from ``x``. On the Triton path that is one
kernel each way (see ``kernels.py``); on the torch path the reference, differentiated by
autograd in the backward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from .. import tuning
from .._dispatch import (Plan, ResolvedCall, apply_function, check_float32, check_number,
                         check_tensor, checked_once, cpu_fast, explain, float64_fallback,
                         native_cpu, planner_of, select_impl)
from .._launch import (cdiv, dtype_name, fp8_capable, kernel_op, lazy_kernels, next_pow2,
                       to_e4m3)
from .._nvtx import nvtx_range
from . import reference as ref

#: The kernels' activation codes (``activate`` in kernels.py), shared with the MoE experts.
ACT_IDS = {"gelu": 0, "silu": 1, "quick_gelu": 2, "squared_relu": 3}
_FP8 = torch.float8_e4m3fn
_kernels = lazy_kernels("kernels", __package__)


# --- resolved calls ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ActivationCall(ResolvedCall):
    """A checked call of one of the activations: what the kernels and the reference compute
    (the activation and its scalar options), the path and the saving."""

    activation: str  # a key of ACT_IDS
    gated: bool  # x = [.., 2f]: act(x1) * x2
    linear_offset: float
    clamp_value: Optional[float]
    gate_multiplier: float
    down_multiplier: float
    op: str  # the public function's name
    path: str  # "triton" or "torch"
    fp8_input_store: bool
    cpu_offload_input: bool
    tokens: int  # x's rows: the product of its leading dims

    def kernel_args(self) -> tuple[str, bool, float, Optional[float], float, float]:
        """The options the launches take, in their order (after the tensors)."""
        return (self.activation, self.gated, self.linear_offset, self.clamp_value,
                self.gate_multiplier, self.down_multiplier)


# --- launches ------------------------------------------------------------------------------


# The kernels take None for an absent tensor (bias, weights, the float8 copy, a partial not
# asked for) and for the clamp when off: Triton binds None as a constant, where a stand-in
# tensor or float would be one more argument to specialise and pass on every launch. Each
# None goes with its flag (HAS_BIAS, ...), so it compiles no extra variant.


def _scalars(linear_offset: float, gate_multiplier: float, down_multiplier: float) -> bool:
    """Whether the kernels apply the offset and the multipliers (``SCALARS``): not at 0, 1
    and 1, where they are exact but cost 3 of bias-SwiGLU's 29 PTX instructions an element
    (sm_90), in a forward that reads at an H200's copy rate."""
    return linear_offset != 0 or gate_multiplier != 1 or down_multiplier != 1


def _fwd(x: torch.Tensor, bias: Optional[torch.Tensor], weights: Optional[torch.Tensor],
         activation: str, gated: bool, linear_offset: float, clamp_value: Optional[float],
         gate_multiplier: float, down_multiplier: float,
         x8: Optional[torch.Tensor]) -> torch.Tensor:
    """The forward kernel: ``y``; with ``x8`` (float8_e4m3fn ``[M, K]``, contiguous) it also
    writes x's float8 copy there."""
    M, K = x.shape
    N = K // 2 if gated else K
    y = x.new_empty(M, N)
    if M == 0 or N == 0:
        return y
    t = tuning.table("activations", x.device)
    block_n = min(next_pow2(N), t["fwd_max_block_n"])
    block_m = max(1, t["fwd_tile"] // block_n)
    _kernels().act_fwd_kernel[(cdiv(M, block_m) * cdiv(N, block_n),)](
        x, x.stride(0), bias, weights, y, y.stride(0), x8, M, N, float(linear_offset),
        None if clamp_value is None else float(clamp_value), float(gate_multiplier),
        float(down_multiplier), ACT=ACT_IDS[activation], GATED=gated,
        HAS_BIAS=bias is not None, HAS_W=weights is not None, HAS_CLAMP=clamp_value is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, STORE_X8=x8 is not None,
        SCALARS=_scalars(linear_offset, gate_multiplier, down_multiplier),
        num_warps=t["fwd_warps"])
    return y


def _fwd_fake(x, bias, weights, activation, gated, linear_offset, clamp_value,
              gate_multiplier, down_multiplier, x8=None):
    return x.new_empty((x.shape[0], x.shape[1] // 2 if gated else x.shape[1]))


# Two ops, with and without the float8 copy: a mutated argument that may be None trips
# torch 2.11's functionalization under torch.compile (an IndexError while tracing).


@kernel_op("act_fwd", _fwd_fake)
def _launch_fwd(x: torch.Tensor, bias: Optional[torch.Tensor], weights: Optional[torch.Tensor],
                activation: str, gated: bool, linear_offset: float, clamp_value: Optional[float],
                gate_multiplier: float, down_multiplier: float) -> torch.Tensor:
    """``y`` (:func:`_fwd` without the float8 copy)."""
    return _fwd(x, bias, weights, activation, gated, linear_offset, clamp_value,
                gate_multiplier, down_multiplier, None)


@kernel_op("act_fwd_x8", _fwd_fake, mutates_args=("x8",))
def _launch_fwd_x8(x: torch.Tensor, bias: Optional[torch.Tensor],
                   weights: Optional[torch.Tensor], activation: str, gated: bool,
                   linear_offset: float, clamp_value: Optional[float], gate_multiplier: float,
                   down_multiplier: float, x8: torch.Tensor) -> torch.Tensor:
    """``y``, and x's float8 copy written into ``x8`` (``fp8_input_store``)."""
    return _fwd(x, bias, weights, activation, gated, linear_offset, clamp_value,
                gate_multiplier, down_multiplier, x8)


def _bwd_fake(x, g, bias, weights, activation, gated, linear_offset, clamp_value,
              gate_multiplier, down_multiplier, dtype, bias_grad):
    M, K = x.shape
    return (x.new_empty((M, K), dtype=dtype),
            x.new_empty((K if bias_grad else 0,), dtype=torch.float32),
            x.new_empty((M if weights is not None else 0,), dtype=torch.float32))


@kernel_op("act_bwd", _bwd_fake)
def _launch_bwd(x: torch.Tensor, g: torch.Tensor, bias: Optional[torch.Tensor],
                weights: Optional[torch.Tensor], activation: str, gated: bool,
                linear_offset: float, clamp_value: Optional[float], gate_multiplier: float,
                down_multiplier: float, dtype: torch.dtype,
                bias_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx [M, K] in dtype, db [K] float32, dw [M] float32)``: ``db`` empty unless
    ``bias_grad``, ``dw`` empty without weights. The kernel writes them as float32 partials
    (a row group's bias gradient, a column block's weight gradient), summed here.

    A program walks a group of rows (``bwd_programs_per_sm`` groups of column blocks an SM),
    so that it sums the bias gradient over them. The group's loop is software-pipelined over
    the table's ``plain_bwd_stages`` for the non-gated activations (H200, bf16, fwd+bwd:
    bias-GELU [16384, 14336] 0.771 -> 0.690 ms with 3 stages, squared ReLU 0.588 -> 0.575)
    and ``gated_bwd_stages`` for the gated ones (absent: Triton's default; H200: 4 stages
    over 2048-element tiles, 32 programs an SM, the backward alone at [16384, 2 x 14336]:
    bias-SwiGLU 0.665 -> 0.597 ms, bias-GEGLU 0.650 -> 0.593).

    Without a bias gradient there is nothing to sum over rows: the table's ``bwd_flat``
    (``tile``, ``max_block_n``, ``warps``; null: the grouped launch) gives each program one
    tile, in the forward's order (H200, bf16 [16384, 14336], the backward alone: squared
    ReLU 0.352 -> 0.326 ms, weighted 0.403 -> 0.334, weighted SwiGLU [16384, 2 x 14336]
    0.605 -> 0.551, with 1024-element tiles one row high, 4 warps)."""
    M, K = x.shape
    N = K // 2 if gated else K
    dx = torch.empty(M, K, dtype=dtype, device=x.device)
    t = tuning.table("activations", x.device)
    flat = None if bias_grad else t["bwd_flat"]
    tile, max_n, warps = ((flat["tile"], flat["max_block_n"], flat["warps"]) if flat is not None
                          else (t["bwd_tile"], t["bwd_max_block_n"], t["bwd_warps"]))
    block_n = min(next_pow2(N), max_n)
    block_m = max(1, tile // block_n)
    col_blocks = cdiv(N, block_n)
    if flat is not None:  # one tile a program, in the forward's order
        rows_per_group, stages = block_m, None
    else:
        stages = t.get("gated_bwd_stages" if gated else "plain_bwd_stages")
        programs = t["bwd_programs_per_sm"] * tuning.sm_count(x.device)
        groups = max(1, min(cdiv(M, block_m), cdiv(programs, col_blocks)))
        rows_per_group = cdiv(cdiv(M, groups), block_m) * block_m
    groups = cdiv(M, rows_per_group) if M else 1
    db = torch.empty(groups, K, dtype=torch.float32, device=x.device) if bias_grad else None
    dw = (torch.empty(col_blocks, M, dtype=torch.float32, device=x.device)
          if weights is not None else None)
    if M == 0 or N == 0:
        if db is not None:
            db.zero_()
    else:
        grid = (col_blocks * groups,) if flat is not None else (col_blocks, groups)
        _kernels().act_bwd_kernel[grid](
            x, x.stride(0), g, g.stride(0), bias, weights, dx, dx.stride(0), db, dw, M, N,
            rows_per_group, float(linear_offset),
            None if clamp_value is None else float(clamp_value),
            float(gate_multiplier), float(down_multiplier),
            ACT=ACT_IDS[activation], GATED=gated, HAS_BIAS=bias is not None,
            HAS_W=weights is not None, HAS_CLAMP=clamp_value is not None, BIAS_GRAD=bias_grad,
            BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages,
            SCALARS=_scalars(linear_offset, gate_multiplier, down_multiplier),
            FLAT=flat is not None, num_warps=warps)
    # (Two empties, not one: a custom op's outputs may not alias one another.)
    return (dx, db.sum(0) if db is not None else x.new_empty((0,), dtype=torch.float32),
            dw.sum(0) if dw is not None else x.new_empty((0,), dtype=torch.float32))


# --- saving the input ----------------------------------------------------------------------


#: Every finite float8_e4m3fn value, ascending, as Python floats (sign, 4 exponent bits of
#: bias 7, 3 mantissa bits; no inf; NaN at exponent and mantissa all ones): computed here,
#: not read from a tensor, so that torch.compile traces :func:`_e4m3_around` as constants.
_E4M3_VALUES: tuple[float, ...] = tuple(sorted({
    sign * (m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    for sign in (1.0, -1.0) for e in range(16) for m in range(8) if (e, m) != (15, 7)}))


def _e4m3_around(c: float) -> tuple[float, Optional[float]]:
    """The largest float8_e4m3fn value <= ``c`` and the smallest > ``c`` (None: none)."""
    below = max(v for v in _E4M3_VALUES if v <= c)
    above = [v for v in _E4M3_VALUES if v > c]
    return below, (above[0] if above else None)


def _e4m3_keeping_clamp(x: torch.Tensor, c: float) -> torch.Tensor:
    """``x [..., 2N]`` (gate half, linear half) as float8_e4m3fn for backward, every value
    on the side of the clamp it was on: the backward's clamp mask (gate > c, |linear| > c)
    is read from this copy, and rounding alone would carry 7.2 to 7.0 at c = 7 (a clamped
    element's gradient let through) or 1.69 to 1.75 past c = 1.7 (a free one's zeroed).
    A value rounded across is replaced by the float8 value nearest c on its side (one
    float8 step from its rounding). With no float8 value above c (c >= 448), ``x`` as it
    is (its dtype, not float8)."""
    below, above = _e4m3_around(float(c))
    if above is None:
        return x
    xf, sf = x.float(), to_e4m3(x).float()
    n = x.shape[-1] // 2
    g, sg, u, su = xf[..., :n], sf[..., :n], xf[..., n:], sf[..., n:]
    sg = torch.where((g <= c) & (sg > c), below, sg)
    sg = torch.where((g > c) & (sg <= c), above, sg)
    side = torch.where(u < 0, -1.0, 1.0)
    su = torch.where((u.abs() <= c) & (su.abs() > c), side * below, su)
    su = torch.where((u.abs() > c) & (su.abs() <= c), side * above, su)
    return to_e4m3(torch.cat([sg, su], dim=-1))


class _Saved:
    """The input kept for backward: as is, as float8 (``fp8_input_store``), and/or in pinned
    CPU memory copied on a side stream (``cpu_offload_input``, CUDA tensors only).

    ``device_copy`` is what goes through ``ctx.save_for_backward`` (so autograd checks it
    for in-place changes and saved-tensor hooks see it; the forward drops it here once
    saved, so that autograd's is the only reference); ``None`` once offloaded, when the
    pinned host copy lives here instead.
    """

    def __init__(self, x: torch.Tensor, fp8: bool, offload: bool,
                 x8: Optional[torch.Tensor] = None, clamp: Optional[float] = None) -> None:
        """``x8``: x's float8 copy when the forward kernel already wrote it; ``clamp``: the
        clamp of a gated activation, whose sides the float8 copy keeps (see
        :func:`_e4m3_keeping_clamp`)."""
        self.dtype, self.device, self.event, self.host = x.dtype, x.device, None, None
        keep = x
        if fp8:
            keep = (x8 if x8 is not None else to_e4m3(x)) if clamp is None else (
                _e4m3_keeping_clamp(x, clamp))
        self.device_copy = keep
        if offload and x.is_cuda:
            side = _side_stream(x.device)
            side.wait_stream(torch.cuda.current_stream(x.device))
            host = torch.empty(keep.shape, dtype=keep.dtype, pin_memory=True)
            with torch.cuda.stream(side):
                host.copy_(keep, non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record(side)
            keep.record_stream(side)  # not reused by the allocator before the copy is done
            self.host, self.device_copy = host, None

    def restore(self, device_copy: Optional[torch.Tensor], for_kernel: bool) -> torch.Tensor:
        """The input on its device (``device_copy``: from ``ctx.saved_tensors``): float8 kept
        as float8 for a CUDA kernel on a GPU that loads it (compute capability >= 8.9),
        converted to the original dtype otherwise."""
        t = device_copy
        if self.host is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
            t = self.host.to(self.device, non_blocking=True)
        if t.dtype == _FP8 and not (for_kernel and t.is_cuda and fp8_capable(t.device)):
            t = t.to(self.dtype)
        return t


@functools.lru_cache(maxsize=None)
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


# --- autograd --------------------------------------------------------------------------------


def _ref_options(s: ActivationCall) -> dict[str, Any]:
    """The settings ``s`` as :func:`reference.activation_reference`'s keyword arguments."""
    return dict(activation=s.activation, gated=s.gated, linear_offset=s.linear_offset,
                clamp_value=s.clamp_value, gate_multiplier=s.gate_multiplier,
                down_multiplier=s.down_multiplier)


class _Activation(torch.autograd.Function):
    """``y = act(x ...)`` for ``x [M, K]``; see the module docstring."""

    @staticmethod
    def forward(ctx, x, bias, weights, s: ActivationCall):
        with nvtx_range(s.op, "fwd"):
            needs = ctx.needs_input_grad
            saving = needs[0] or needs[1] or needs[2]
            x8 = None
            if s.path == "triton":
                # The float8 copy for backward comes out of the forward kernel itself where
                # the kernel can store float8 (the interpreter, or compute capability 8.9+).
                # (Not with a clamp: that copy must keep each value's side of it.)
                if saving and s.fp8_input_store and s.clamp_value is None and (
                        not x.is_cuda or fp8_capable(x.device)):
                    x8 = torch.empty(x.shape, dtype=_FP8, device=x.device)
                    y = _launch_fwd_x8(x, bias, weights, *s.kernel_args(), x8)
                else:
                    y = _launch_fwd(x, bias, weights, *s.kernel_args())
            else:
                y = ref.activation_reference(x, bias, weights, **_ref_options(s))
            ctx.s = s
            if saving and not (s.fp8_input_store or s.cpu_offload_input):
                # x kept as it is: autograd's saved tensor alone, no _Saved to restore from.
                ctx.saved = None
                ctx.save_for_backward(x, bias, weights)
            elif saving:
                ctx.saved = _Saved(x, s.fp8_input_store, s.cpu_offload_input, x8,
                                   s.clamp_value if s.gated else None)
                ctx.save_for_backward(ctx.saved.device_copy, bias, weights)
                # Autograd holds it now: no second reference here, so saved-tensor hooks
                # (torch.autograd.graph.save_on_cpu, ...) can free the device copy.
                ctx.saved.device_copy = None
            return y

    @staticmethod
    def backward(ctx, g):
        if torch.is_grad_enabled():  # create_graph=True: a gradient with its own graph
            return _second_order(ctx, g)
        s = ctx.s
        with nvtx_range(s.op, "bwd"):
            kept, bias, weights = ctx.saved_tensors
            need_x, need_b, need_w = ctx.needs_input_grad[:3]
            saved = ctx.saved
            triton = s.path == "triton"
            if saved is None:
                x, dtype = kept, kept.dtype
            else:
                x, dtype = saved.restore(kept, for_kernel=triton), saved.dtype
            if triton:
                dx, db, dw = _launch_bwd(x, g.contiguous(), bias, weights, *s.kernel_args(),
                                         dtype, need_b)
                db = db.to(bias.dtype) if need_b else None
                dw = dw.to(weights.dtype).view(weights.shape) if need_w else None
                return (dx if need_x else None), db, dw, None
            # The reference's gradient by torch.func.vjp (which torch.compile traces, where
            # it refuses torch.autograd.grad) of the inputs that need one.
            wanted = [n for n, t, need in (("x", x, True), ("bias", bias, need_b),
                                            ("weights", weights, need_w)) if need]
            fixed = {"x": x, "bias": bias, "weights": weights}

            def reference(*leaves: torch.Tensor) -> torch.Tensor:
                args = {**fixed, **dict(zip(wanted, leaves))}
                return ref.activation_reference(args["x"], args["bias"], args["weights"],
                                                **_ref_options(s))

            _, vjp = torch.func.vjp(reference, *(fixed[n] for n in wanted))
            got = dict(zip(wanted, vjp(g)))
            return ((got["x"] if need_x else None), got.get("bias"), got.get("weights"), None)


def _second_order(ctx, g):
    """``_Activation``'s backward under ``create_graph=True``: the reference's gradient,
    itself differentiable, of the saved inputs (which carry their graph then), so second
    derivatives (a gradient penalty, ``gradgradcheck``) hold every term."""
    s = ctx.s
    if ctx.saved is not None:
        raise RuntimeError(
            f"{s.op}: second derivatives (create_graph=True) need the input kept as it is; "
            "got fp8_input_store=True or cpu_offload_input=True")
    x, bias, weights = ctx.saved_tensors
    need = ctx.needs_input_grad[:3]
    y = ref.activation_reference(x, bias, weights, **_ref_options(s))
    got = iter(torch.autograd.grad(y, [t for t, n in zip((x, bias, weights), need) if n], g,
                                   create_graph=True))
    return tuple(next(got) if n else None for n in need) + (None,)


# --- validation and planning -----------------------------------------------------------------


def check_bias(op: str, bias: Any, x: torch.Tensor, x_name: str = "x") -> None:
    """``bias`` is a float tensor ``[K]`` for ``x [..., K]`` (errors start with ``op`` and
    call the input ``x_name``; its dtype is the caller's to check: ``lmfuse.megatron``
    promotes a bias of another float dtype, as Megatron-Core does)."""
    check_tensor(op, "bias", bias, ndim=1)
    K = x.shape[-1]
    if bias.shape[0] != K:
        raise ValueError(f"{op}: bias must be [{K}] ({x_name}'s last dim), got "
                         f"{tuple(bias.shape)}")


def _resolve(op: str, x, bias, weights, activation: str, gated: bool, linear_offset,
             clamp_value, fp8_input_store, cpu_offload_input, impl, gate_multiplier=1.0,
             down_multiplier=1.0) -> tuple[str, str, ActivationCall]:
    check_tensor(op, "x", x)
    if weights is None and op.startswith("weighted_"):
        raise TypeError(f"{op}: weights must be a float tensor of per-token weights "
                        f"[tokens, 1], got None (the unweighted op is {op[9:]})")
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have a last (hidden) dimension, got a 0-D tensor")
    K = x.shape[-1]
    if K == 0:
        raise ValueError(f"{op}: x's last (hidden) dim must be at least 1, got shape "
                         f"{tuple(x.shape)}")
    if gated and K % 2:
        raise ValueError(f"{op}: x's last dim must be even (the gated and linear halves), "
                         f"got {K} (shape {tuple(x.shape)})")
    if bias is not None:
        check_bias(op, bias, x)
        if bias.dtype != x.dtype:
            raise TypeError(f"{op}: bias must have x's dtype {x.dtype}, got {bias.dtype}")
    tokens = x.numel() // K if K else 0
    if weights is not None:
        check_tensor(op, "weights", weights)
        ok = (tuple(weights.shape) in ((tokens, 1), tuple(x.shape[:-1]) + (1,)))
        if not ok:
            raise ValueError(f"{op}: weights must be [tokens, 1] = [{tokens}, 1] (one per "
                             f"token of x {tuple(x.shape)}), got {tuple(weights.shape)}")
    for name, t in (("bias", bias), ("weights", weights)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device} but x is on {x.device}")
    options = (op, linear_offset, clamp_value, fp8_input_store, cpu_offload_input,
               gate_multiplier, down_multiplier)
    # A model's options repeat: checked once, not every call (as cross_entropy's). A bad or
    # unhashable value is checked uncached, which raises.
    linear_offset, clamp_value, gate_multiplier, down_multiplier = checked_once(_options,
                                                                                *options)
    path, reason = float64_fallback(op, impl, *select_impl(op, impl, x.device), x.dtype, "x")
    # (The offload copies CUDA tensors to the host; a CPU tensor is kept as it is.)
    s = ActivationCall(activation, gated, linear_offset, clamp_value, gate_multiplier,
                       down_multiplier, op, path, fp8_input_store,
                       cpu_offload_input and x.is_cuda, tokens)
    return path, reason, s


@functools.lru_cache(maxsize=256, typed=True)
def _options(op: str, linear_offset, clamp_value, fp8_input_store, cpu_offload_input,
             gate_multiplier, down_multiplier
             ) -> tuple[float, Optional[float], float, float]:
    """The scalar options, validated and as floats (``typed``: ``True`` is not taken for
    ``1``): ``(linear_offset, clamp_value, gate_multiplier, down_multiplier)``."""
    # (each a float32 argument of the kernels: within float32's range)
    linear_offset = check_float32(op, "linear_offset", check_number(
        op, "linear_offset", linear_offset, allow_none=False))
    # Any finite value (0 and negative ones too): they are plain factors of the formula.
    gate_multiplier = check_float32(op, "gate_multiplier", check_number(
        op, "gate_multiplier", gate_multiplier, allow_none=False))
    down_multiplier = check_float32(op, "down_multiplier", check_number(
        op, "down_multiplier", down_multiplier, allow_none=False))
    if check_float32(op, "clamp_value", check_number(op, "clamp_value",
                                                     clamp_value)) is not None:
        if not clamp_value > 0:
            raise ValueError(f"{op}: clamp_value must be positive (x1 <= c, -c <= x2 <= c), "
                             f"got {clamp_value!r}")
        clamp_value = float(clamp_value)
    for name, flag in (("fp8_input_store", fp8_input_store),
                       ("cpu_offload_input", cpu_offload_input)):
        if not isinstance(flag, bool):
            raise TypeError(f"{op}: {name} must be a bool, got {flag!r}")
    return linear_offset, clamp_value, gate_multiplier, down_multiplier


def check_options(op: str, *, linear_offset: Any = 0.0, clamp_value: Any = None,
                  fp8_input_store: Any = False) -> None:
    """The activation ops' checks of these options, raising under ``op``'s name (for
    wrappers such as ``lmfuse.megatron``'s, whose errors name themselves)."""
    _options(op, linear_offset, clamp_value, fp8_input_store, False, 1.0, 1.0)


def _run(op: str, x, bias, weights, activation, gated, linear_offset=0.0, clamp_value=None,
         fp8_input_store=False, cpu_offload_input=False, impl="auto", gate_multiplier=1.0,
         down_multiplier=1.0) -> torch.Tensor:
    _, _, s = _resolve(op, x, bias, weights, activation, gated, linear_offset, clamp_value,
                       fp8_input_store, cpu_offload_input, impl, gate_multiplier,
                       down_multiplier)
    K = x.shape[-1]
    if _takes_native(impl, s, x, weights):
        return _native(x, bias, weights, s)
    # 2-D x goes in as it is: no reshape, whose view would add a node to the backward.
    flat = x.dim() == 2
    x2 = x if flat else x.reshape(-1, K)
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < K):
        x2 = x2.contiguous()
    w2 = weights.reshape(-1, 1).contiguous() if weights is not None else None
    b = bias.contiguous() if bias is not None else None  # the kernels read it at stride 1
    if s.path == "triton" and not (torch.is_grad_enabled() and (
            x.requires_grad or (bias is not None and bias.requires_grad)
            or (weights is not None and weights.requires_grad))):
        # Nothing to differentiate (inference): the launch alone, no autograd node and no
        # saved input, which halves the host time of a small call.
        with nvtx_range(op, "fwd"):
            y = _launch_fwd(x2, b, w2, *s.kernel_args())
    elif s.path == "torch" and torch.compiler.is_compiling() and not (
            fp8_input_store or s.cpu_offload_input):
        # Traced by torch.compile: the reference's ops with their own autograd (the
        # Function's backward recomputes through torch.autograd.grad, which Dynamo refuses;
        # the compiled graph decides what to keep for backward anyway).
        y = ref.activation_reference(x2, b, w2, **_ref_options(s))
    else:
        y = apply_function(_Activation, x2, b, w2, s)
    return y if flat else y.view(*x.shape[:-1], y.shape[-1])


# PyTorch's own activations (native forward and backward kernels) where it has the formula.
_NATIVE = {"silu": lambda a: F.silu(a), "gelu": lambda a: F.gelu(a, approximate="tanh"),
           # PyTorch has none: the reference's (silu(k a) / k overflowed past |a| = 2e38 into
           # inf and NaN where the formula is finite; autograd through a * sigmoid(k a) would
           # form inf - inf where the others keep an inf linear half's +-inf)
           "quick_gelu": lambda a: ref.activate(a, "quick_gelu"),
           "squared_relu": lambda a: torch.relu(a).square()}


# Their backwards, writing into ``out`` (the activation half of the input's gradient).
_NATIVE_BACKWARD = {
    "silu": lambda g, a, out: torch.ops.aten.silu_backward.grad_input(g, a, grad_input=out),
    "gelu": lambda g, a, out: torch.ops.aten.gelu_backward.grad_input(
        g, a, approximate="tanh", grad_input=out)}


class _GatedCPU(torch.autograd.Function):
    """``act(x1) * x2`` for the gated ops' common CPU call: PyTorch's own forward and
    activation backward, the two halves' gradients written straight into one ``[..., 2f]``
    tensor (autograd through ``chunk`` makes them apart and then concatenates them: one more
    pass over the whole gradient). The plain formula's values and gradients, bit for bit."""

    @staticmethod
    def forward(ctx, x, act):
        a, b = x.chunk(2, -1)
        s = _NATIVE[act](a)
        ctx.save_for_backward(x, s)
        ctx.act = act
        return s * b

    @staticmethod
    def backward(ctx, dy):
        x, s = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the plain formula's own gradient
            a, b = x.chunk(2, -1)
            return torch.autograd.grad(_NATIVE[ctx.act](a) * b, x, dy, create_graph=True)[0], None
        a, b = x.chunk(2, -1)
        dx = torch.empty_like(x)
        da, db = dx.chunk(2, -1)
        torch.mul(dy, s, out=db)
        _NATIVE_BACKWARD[ctx.act](dy * b, a, da)
        return dx, None


def _cpu_gated(x: torch.Tensor, act: str) -> torch.Tensor:
    """The common CPU call of SwiGLU / GEGLU (``act`` "silu" / "gelu"): the plain formula,
    through :class:`_GatedCPU` where a gradient will be taken."""
    if x.requires_grad and torch.is_grad_enabled():
        return apply_function(_GatedCPU, x, act)
    a, b = x.chunk(2, -1)
    return _NATIVE[act](a) * b


def _cpu_fast_halves(x: torch.Tensor) -> bool:
    """A gated op's common CPU call may skip the resolved call: float32 ``x`` on the CPU
    whose last dim splits into two non-empty halves (``cpu_fast``; every other call takes
    ``_run``, whose checks and errors apply)."""
    return cpu_fast(x) and x.dim() > 0 and x.shape[-1] > 0 and x.shape[-1] % 2 == 0


def _takes_native(impl: str, s: ActivationCall, x: torch.Tensor, weights: Any) -> bool:
    """Whether the call runs :func:`_native` (the CPU float32 default path, nothing kept in
    float8 or offloaded, float32 weights)."""
    return (native_cpu(impl, s.path, x) and not s.fp8_input_store and not s.cpu_offload_input
            and (weights is None or weights.dtype == torch.float32))


def _native(x, bias, weights, s: ActivationCall) -> torch.Tensor:
    """The default path on CPU float32 tensors: the reference's formula in PyTorch's own
    ops, with autograd for the gradients (the plain formula's speed; the reference's
    results within rounding: GELU's constants are PyTorch's, the reference's are Megatron's
    8-digit ones). impl="torch" keeps the reference, the tests' oracle. A multiplier of 1,
    an offset of 0, no clamp cost no pass."""
    act = _NATIVE[s.activation]
    g, d, c = s.gate_multiplier, s.down_multiplier, s.clamp_value
    if s.gated:
        # chunk, not two slices: its backward is one concatenation of the halves' gradients
        # where two slices' zero-fill a [..., K] gradient each and add them (on the demo's
        # model, 0.43 ms of fills a step more than its plain twin's, under the profiler).
        if c is None and bias is not None:
            x = x + bias
        x1, x2 = x.chunk(2, -1)
        if c is not None:  # before the bias (Megatron's order)
            x1, x2 = x1.clamp(max=c), x2.clamp(min=-c, max=c)
            if bias is not None:
                b1, b2 = bias.chunk(2)
                x1, x2 = x1 + b1, x2 + b2
        if s.linear_offset:
            x2 = x2 + s.linear_offset
        y = act(x1 * g if g != 1 else x1) * x2
    else:
        xb = x if bias is None else x + bias
        y = act(xb * g if g != 1 else xb)
    if d != 1:
        y = y * d
    if weights is not None:
        y = y * weights.reshape(*y.shape[:-1], 1)
    return y


def _plan(op: str, x, bias, weights, activation, gated, linear_offset=0.0, clamp_value=None,
          fp8_input_store=False, cpu_offload_input=False, impl="auto", gate_multiplier=1.0,
          down_multiplier=1.0) -> Plan:
    path, reason, s = _resolve(op, x, bias, weights, activation, gated, linear_offset,
                               clamp_value, fp8_input_store, cpu_offload_input, impl,
                               gate_multiplier, down_multiplier)
    K = x.shape[-1]
    details = {
        "x": f"{list(x.shape)} {dtype_name(x.dtype)}: {s.tokens} tokens",
        "activation": (f"{activation}(x1{' + b1' if bias is not None else ''}) * (x2"
                       f"{' + b2' if bias is not None else ''}"
                       f"{f' + {linear_offset}' if linear_offset else ''}), f = {K // 2}"
                       if gated else f"{activation}(x{' + bias' if bias is not None else ''})"),
        "saved for backward": ("x as float8_e4m3fn" if fp8_input_store else "x") + (
            " in pinned CPU memory" if cpu_offload_input and x.is_cuda else ""),
    }
    if clamp_value is not None:
        details["clamp"] = f"x1 <= {clamp_value}, |x2| <= {clamp_value} (before the bias)"
    if s.gate_multiplier != 1 or s.down_multiplier != 1:
        details["multipliers"] = (f"activation input * {s.gate_multiplier} (after the "
                                  f"bias), output * {s.down_multiplier}")
    if weights is not None:
        details["weights"] = f"{list(weights.shape)} {dtype_name(weights.dtype)}"
    if _takes_native(impl, s, x, weights):
        reason += "; CPU float32: the formula in PyTorch's own ops (F.silu, F.gelu, ...)"
    return Plan(op, path, reason, details, call=s)


# --- the public functions --------------------------------------------------------------------


def bias_gelu(x: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
              impl: str = "auto") -> torch.Tensor:
    """``gelu(x + bias)`` with the tanh approximation (Megatron-Core's constants).

    Args:
        x: ``[..., K]`` float32/float16/bfloat16. bias: optional ``[K]``, x's dtype.
        impl: ``"auto"``, ``"triton"`` or ``"torch"`` (every activation's; see
            :func:`lmfuse.explain`).
    Returns:
        ``[..., K]`` in x's dtype; gradients for x and bias.

    NaN and inf propagate as through the formula in PyTorch: ``gelu(+inf) = inf``,
    ``gelu(-inf) = NaN`` (``-inf * 0``), NaN in x or bias gives NaN, forward and backward.
    """
    return _run("bias_gelu", x, bias, None, "gelu", False, impl=impl)


def swiglu(x: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
           fp8_input_store: bool = False, cpu_offload_input: bool = False,
           clamp_value: Optional[float] = None, gate_multiplier: float = 1.0,
           down_multiplier: float = 1.0, impl: str = "auto") -> torch.Tensor:
    """``silu(x1 * g) * x2 * d`` for ``x = [x1 | x2]`` (after ``+ bias``), the halves of the
    last dim; ``g = gate_multiplier``, ``d = down_multiplier`` (1 by default: ``silu(x1) *
    x2``).

    Args:
        x: ``[..., 2f]``. bias: optional ``[2f]``.
        fp8_input_store: keep the input for backward as float8_e4m3fn (half of bf16's
            bytes; the gradient is then that of the rounded input).
        cpu_offload_input: keep the input for backward in pinned CPU memory (CUDA tensors;
            copied on a side stream, brought back in backward).
        clamp_value: ``c > 0`` first clamps ``x1 <= c`` and ``-c <= x2 <= c`` (before the
            bias, as :func:`quick_geglu`; no gradient where a clamp is active).
        gate_multiplier, down_multiplier: Falcon-H1's MLP multipliers, any finite int or
            float (a bool raises TypeError, NaN or inf ValueError). ``g`` scales the gated
            half after the clamp and the bias (``silu((x1 + b1) * g)``, as Falcon-H1's
            ``act_fn(gate_proj(x) * gate_multiplier)`` with gate_proj's bias); ``d`` scales
            the output (Falcon-H1 scales ``down_proj``'s output, the same where down_proj
            has no bias). Runtime arguments of the kernels: a new value compiles nothing.
        impl: ``"auto"``, ``"triton"`` or ``"torch"``; see :func:`lmfuse.explain`.
    Returns:
        ``[..., f]`` in x's dtype.

    NaN and inf propagate as through ``F.silu(x1 * g) * x2 * d`` in PyTorch (``silu(-inf)``
    is NaN, ``silu(+inf)`` inf; NaN in x or bias gives NaN; ``inf * 0`` is NaN for a zero
    multiplier), forward and backward. With ``fp8_input_store`` the backward sees x as
    float8 stores it: NaN stays NaN, ``+-inf`` is saturated to ``+-448`` (float8_e4m3fn has
    no infinity).
    """
    if (impl == "auto" and bias is None and clamp_value is None and fp8_input_store is False
            and cpu_offload_input is False and type(gate_multiplier) is float
            and gate_multiplier == 1.0 and type(down_multiplier) is float
            and down_multiplier == 1.0 and _cpu_fast_halves(x)):
        try:  # the common CPU call: _native's formula at once
            return _cpu_gated(x, "silu")
        except RuntimeError:  # refused by PyTorch's ops (a sparse x): the checks name it
            pass
    return _run("swiglu", x, bias, None, "silu", True, clamp_value=clamp_value,
                fp8_input_store=fp8_input_store, cpu_offload_input=cpu_offload_input,
                impl=impl, gate_multiplier=gate_multiplier, down_multiplier=down_multiplier)


def geglu(x: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
          fp8_input_store: bool = False, cpu_offload_input: bool = False,
          impl: str = "auto") -> torch.Tensor:
    """``gelu_tanh(x1) * x2``; arguments, and NaN / inf behaviour, as :func:`swiglu`."""
    if (impl == "auto" and bias is None and fp8_input_store is False
            and cpu_offload_input is False and _cpu_fast_halves(x)):
        try:  # the common CPU call: _native's formula at once
            return _cpu_gated(x, "gelu")
        except RuntimeError:  # refused by PyTorch's ops (a sparse x): the checks name it
            pass
    return _run("geglu", x, bias, None, "gelu", True, fp8_input_store=fp8_input_store,
                cpu_offload_input=cpu_offload_input, impl=impl)


def quick_geglu(x: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                linear_offset: float = 0.0, clamp_value: Optional[float] = None,
                fp8_input_store: bool = False, cpu_offload_input: bool = False,
                impl: str = "auto") -> torch.Tensor:
    """``quick_gelu(x1) * (x2 + linear_offset)``, ``quick_gelu(a) = a * sigmoid(1.702 a)``.

    ``clamp_value=c`` first clamps ``x1 <= c`` and ``-c <= x2 <= c`` (before the bias, as
    Megatron-Core does; no gradient where a clamp is active). Other arguments as
    :func:`swiglu`. NaN and inf as :func:`swiglu`; the clamp keeps NaN (as ``torch.clamp``:
    NaN out, zero gradient) and turns ``+-inf`` into ``+-c``.
    """
    return _run("quick_geglu", x, bias, None, "quick_gelu", True, linear_offset, clamp_value,
                fp8_input_store, cpu_offload_input, impl)


def weighted_swiglu(x: torch.Tensor, weights: torch.Tensor,
                    bias: Optional[torch.Tensor] = None, *, fp8_input_store: bool = False,
                    cpu_offload_input: bool = False, clamp_value: Optional[float] = None,
                    gate_multiplier: float = 1.0, down_multiplier: float = 1.0,
                    impl: str = "auto") -> torch.Tensor:
    """``swiglu(x) * weights`` (``silu(x1 * g) * x2 * d * weights``) with per-token
    ``weights [tokens, 1]`` (MoE routing probabilities, any float dtype), whose gradient is
    summed over the hidden dim and returned in their dtype. Other arguments, the
    multipliers included, as :func:`swiglu`. A NaN or inf weight propagates to its token's
    outputs and gradients as ``y * weights`` does in PyTorch."""
    return _run("weighted_swiglu", x, bias, weights, "silu", True, clamp_value=clamp_value,
                fp8_input_store=fp8_input_store, cpu_offload_input=cpu_offload_input,
                impl=impl, gate_multiplier=gate_multiplier, down_multiplier=down_multiplier)


def weighted_quick_geglu(x: torch.Tensor, weights: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, *, linear_offset: float = 0.0,
                         clamp_value: Optional[float] = None, fp8_input_store: bool = False,
                         cpu_offload_input: bool = False, impl: str = "auto") -> torch.Tensor:
    """``quick_geglu(x) * weights``; see :func:`quick_geglu` and :func:`weighted_swiglu`
    (NaN and inf included)."""
    return _run("weighted_quick_geglu", x, bias, weights, "quick_gelu", True, linear_offset,
                clamp_value, fp8_input_store, cpu_offload_input, impl)


def squared_relu(x: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """``relu(x) ** 2``, ``[..., K]`` -> ``[..., K]``. NaN stays NaN (``torch.relu`` keeps
    it), ``+inf`` gives inf, ``-inf`` 0; the gradient is exactly 0 wherever ``x <= 0``.
    ``impl``: ``"auto"``, ``"triton"`` or ``"torch"``; see :func:`lmfuse.explain`."""
    return _run("squared_relu", x, None, None, "squared_relu", False, impl=impl)


def weighted_squared_relu(x: torch.Tensor, weights: torch.Tensor, *,
                          impl: str = "auto") -> torch.Tensor:
    """``relu(x) ** 2 * weights``, per-token ``weights [tokens, 1]``. NaN and inf as
    :func:`squared_relu` and :func:`weighted_swiglu` (x's gradient is 0 where ``x <= 0``,
    even for a NaN weight, as ``torch.relu``'s backward gives). ``impl`` as there."""
    return _run("weighted_squared_relu", x, None, weights, "squared_relu", False, impl=impl)


def _planner(fn, activation: str, gated: bool):
    """Register the planner of public function ``fn`` (:func:`planner_of`): :func:`_plan`."""

    def plan(x, bias=None, weights=None, **a) -> Plan:
        return _plan(fn.__name__, x, bias, weights, activation, gated, **a)

    plan.__name__ = f"plan_{fn.__name__}"
    return planner_of(fn)(plan)


plan_bias_gelu = _planner(bias_gelu, "gelu", False)
plan_swiglu = _planner(swiglu, "silu", True)
plan_geglu = _planner(geglu, "gelu", True)
plan_quick_geglu = _planner(quick_geglu, "quick_gelu", True)
plan_weighted_swiglu = _planner(weighted_swiglu, "silu", True)
plan_weighted_quick_geglu = _planner(weighted_quick_geglu, "quick_gelu", True)
plan_squared_relu = _planner(squared_relu, "squared_relu", False)
plan_weighted_squared_relu = _planner(weighted_squared_relu, "squared_relu", False)


def checks(device: torch.device, dtypes) -> list:
    """Fresh random cases of every activation, for :mod:`lmfuse._check`."""
    from .._check import op_case

    small = device.type != "cuda"
    M, f = (9, 100) if small else (1000, 3000)

    def case(fn, label, dtype, gated, weighted, bias, **kw):
        K = 2 * f if gated else f

        def inputs():
            xs = [torch.randn(M, K, device=device).to(dtype).requires_grad_(True)]
            if weighted:
                xs.append(torch.rand(M, 1, device=device).requires_grad_(True))
            if bias:
                xs.append(torch.randn(K, device=device).to(dtype).requires_grad_(True))
            return xs

        # (planned by its registered planner, through explain)
        return op_case(fn.__name__, label, dtype, (M, K), inputs, fn,
                       functools.partial(explain, fn), **kw)

    cases = []
    for dtype in dtypes:
        cases += [
            case(bias_gelu, "bias", dtype, False, False, True),
            case(swiglu, "bias", dtype, True, False, True),
            case(swiglu, "fp8 store", dtype, True, False, False, fp8_input_store=True),
            case(swiglu, "multipliers", dtype, True, False, True, gate_multiplier=0.5,
                 down_multiplier=2.0),
            case(geglu, "bias", dtype, True, False, True),
            case(quick_geglu, "offset+clamp", dtype, True, False, True, linear_offset=1.0,
                 clamp_value=1.5),
            case(weighted_swiglu, "fp32 weights", dtype, True, True, False),
            case(weighted_quick_geglu, "clamp", dtype, True, True, False, clamp_value=2.0),
            case(squared_relu, "plain", dtype, False, False, False),
            case(weighted_squared_relu, "fp32 weights", dtype, False, True, False),
        ]
    return cases
