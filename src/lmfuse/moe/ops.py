"""``moe_experts``: validation, dispatch, the torch path, the Triton launches, autograd.

Both paths sort the ``T * k`` (token, slot) pairs by expert once (a stable argsort: pairs
of one expert keep token order, so results do not depend on ties) and sum each token's
``k`` slot outputs back in slot order through the inverse permutation (deterministic: no
atomics, no ``index_add`` on CUDA).

* ``impl="torch"`` (and the default on CPU tensors): plain PyTorch, per expert one
  ``F.linear`` pair on its contiguous slice of the sorted rows, experts without tokens
  skipped, the activation in float32 (the reference's formulas); autograd differentiates
  it. It reads the per-expert counts on the host (one synchronisation per call).
* ``impl="triton"``: no host synchronisation. Forward: ``moe_up_kernel`` (gate/up GEMM,
  bias, activation; keeps the pre-activation ``h [T k, K2]`` when a gradient is needed),
  ``moe_down_kernel`` (down GEMM, bias, router weight), ``moe_combine_kernel`` (the slot
  sum; skipped for ``k = 1``, where the down kernel writes each token's row in place).
  Backward: ``moe_act_bwd_kernel`` (``dout @ w_down[e]`` with the activation's backward and
  the router weights' gradient in its epilogue), ``moe_wgrad_kernel`` twice (both weights
  and biases), ``moe_down_kernel`` and ``moe_combine_kernel`` for the hidden gradient.
  Saved for backward: the inputs, the routing (a few ``[T k]`` index vectors) and ``h``;
  the activation output ``a`` is recomputed from ``h`` in the backward's first kernel.
  The routing is one launch (``routing.route_small``) up to a few hundred pairs (decode),
  three beyond (``routing.route_large``; torch ops in Triton's interpreter).
* The grouped-GEMM engine of the Triton path (``_grouped_engine``: bf16 on a Hopper GPU, at
  least ``grouped_mm_min_rows`` pairs, dims at multiples of 8): the GEMMs run as
  ``torch._grouped_mm`` over the experts' row ranges (CUTLASS; faster than the row-tiled
  kernels at training sizes), the work the fused kernels do in their epilogues in
  element-wise kernels around them (``moe_act_kernel``: bias, activation, the float8 copy;
  ``moe_act_bwd_rows_kernel``: the activation's backward and the router weights' gradient;
  ``moe_combine_kernel``: down bias, router weight, slot sum; ``moe_segment_sum_kernel``:
  bias gradients; ``moe_spread_kernel``: the tokens' rows, and dout's, in sorted order).
  Same saved tensors; ``h`` is the GEMM's output rounded to bf16 with the bias then added,
  so with ``fp8_input_store`` it is rounded twice (as on the torch path).

``fp8_input_store=True`` keeps ``h`` as float8_e4m3fn (half of bf16's bytes) instead of in
hidden's dtype, as the activations' option of that name keeps their input: saturated at
+-448, rounded to nearest even, NaN kept. The forward output does not change (the
activation reads the unrounded ``h``); the backward works on the rounded ``h``, so the
gradients are those of the rounded pre-activation. On the Triton path ``moe_up_kernel``
rounds its float32 accumulator once and writes the float8 copy itself (compute capability
8.9+ and the interpreter; older GPUs get the same values through hidden's dtype, which
holds them exactly), and ``moe_act_bwd_kernel`` loads float8 where the GPU can (8.9+), a
copy in hidden's dtype elsewhere. On the torch path each expert's activation, down
projection and router weight are one autograd function that saves ``h.clamp(-448, 448)`` as
float8 (``h`` as that path computes it, in hidden's dtype: for fp16/bf16 a value that lands
on a float8 tie can round the other way than the Triton path's single rounding) and
recomputes them from it in the backward, so both paths' down-weight and router-weight
gradients use the rounded ``h`` too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from .. import tuning
from .._dispatch import (Plan, ResolvedCall, apply_function, check_number, check_same_device,
                         check_tensor, float64_fallback, interpreter_active, once_differentiable,
                         planner_of, select_impl, value_checks)
from .._launch import (FLOAT_DTYPES, cdiv, dtype_name, fp8_capable, kernel_op, lazy_kernels,
                       next_pow2, to_e4m3)
from .._nvtx import nvtx_range
from ..activations.ops import ACT_IDS
from . import reference as ref
from .routing import route_large, route_small, route_small_ok

OP = "moe_experts"
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
_FP8 = torch.float8_e4m3fn
_kernels = lazy_kernels("kernels", __package__)


def _kernel_stores_fp8(device: torch.device) -> bool:
    return interpreter_active() or fp8_capable(device)


def _kernel_loads_fp8(device: torch.device) -> bool:
    # Not in the interpreter: Triton 3.9's reads e4m3's NaN (0x7F) as 480.
    return not interpreter_active() and fp8_capable(device)


@dataclass(frozen=True, slots=True)
class MoELaunch:
    """The launches of one call's sizes (the ``moe_experts`` tuning section's keys, block
    sizes capped by the problem): the row-tiled GEMM kernels' tiles (``block_m/n/k``,
    ``warps``, ``stages``; up, down and act_bwd share them), the weight-gradient kernel's
    (``wgrad_*``), the slot sum's (``combine_*``), and, on the grouped-GEMM engine (at
    least ``grouped_mm_min_rows`` rows), its element-wise kernels' (``act_*``,
    ``act_bwd_block_r``, ``spread_*``)."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    wgrad_block_m: int
    wgrad_block_n: int
    wgrad_block_k: int
    wgrad_warps: int
    wgrad_stages: int
    combine_block: int
    combine_warps: int
    grouped_mm_min_rows: int
    act_block_r: int
    act_block_f: int
    act_warps: int
    act_bwd_block_r: int
    spread_block_t: int
    spread_block_n: int
    spread_warps: int
    tiles_from: str = "the section's tiles"  # or the decode_tiles entry that set them

    def gemm(self) -> dict[str, int]:
        """The row-tiled GEMM kernels' meta-parameters."""
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_K=self.block_k,
                    num_warps=self.warps, num_stages=self.stages)

    def wgrad(self) -> dict[str, int]:
        """The weight-gradient kernel's meta-parameters."""
        return dict(BLOCK_M=self.wgrad_block_m, BLOCK_N=self.wgrad_block_n,
                    BLOCK_K=self.wgrad_block_k, num_warps=self.wgrad_warps,
                    num_stages=self.wgrad_stages)


def _config(device: torch.device, rows: int, H: int, F: int) -> MoELaunch:
    """The launches for ``rows = T k`` pairs of hidden size ``H`` and intermediate size
    ``F``: the ``moe_experts`` section of the device's tuning table, each GEMM block size
    capped by the power of two covering its dimension (at least 16, ``tl.dot``'s smallest
    tile). The row-tiled GEMMs' tiles are the section's ``block_m/n/k``, ``warps`` and
    ``stages``, or, for a call of few rows (a decode step, or a small batch's forward and
    backward), those of the first ``decode_tiles`` entry ``[max_rows, block_m, block_n,
    block_k, warps, stages]`` with ``rows <= max_rows``. A decode step's kernels read the
    selected experts' weights once, and narrow, deep tiles spread that read over more
    programs (H200, GPT-OSS's experts at 1, 16 and 64 tokens: 0.76x / 0.96x / 0.93x the copy
    rate against the section's 0.48x / 0.57x / 0.60x,
    ``h200-2026-11-28-moe_experts-sweep-gptoss.json``; at 512 and 800 rows 0.41-0.46 ms
    against 0.65-0.70, ``h200-2026-11-28-moe_experts-mid-rows.json``). Forward and backward
    at 64-800 rows: faster at 64 and 512 GPT-OSS rows, elsewhere within the run's 10%
    spread between rounds, the same gradients
    (``h200-2026-11-28-moe_experts-mid-rows-bwd.json``)."""
    t = tuning.table("moe_experts", device)

    def fit(limit: int, n: int) -> int:
        return max(16, min(limit, next_pow2(n)))

    dim = max(H, F)
    bm, bn, bk, warps, stages = (t["block_m"], t["block_n"], t["block_k"], t["warps"],
                                 t["stages"])
    tiles_from = "the section's tiles"
    for entry in t["decode_tiles"]:
        if rows <= entry[0]:
            bm, bn, bk, warps, stages = entry[1:6]
            tiles_from = f"the decode_tiles entry for <= {entry[0]} rows"
            break
    return MoELaunch(
        block_m=fit(bm, rows), block_n=fit(bn, dim),
        block_k=fit(bk, dim), warps=warps, stages=stages,
        wgrad_block_m=fit(t["wgrad_block_m"], dim), wgrad_block_n=fit(t["wgrad_block_n"], dim),
        wgrad_block_k=fit(t["wgrad_block_k"], rows), wgrad_warps=t["wgrad_warps"],
        wgrad_stages=t["wgrad_stages"], combine_block=min(t["combine_block"], next_pow2(H)),
        combine_warps=t["combine_warps"], grouped_mm_min_rows=t["grouped_mm_min_rows"],
        act_block_r=t["act_block_r"], act_block_f=min(t["act_block_f"], next_pow2(F, 16)),
        act_warps=t["act_warps"], act_bwd_block_r=t["act_bwd_block_r"],
        spread_block_t=t["spread_block_t"], spread_block_n=t["spread_block_n"],
        spread_warps=t["spread_warps"], tiles_from=tiles_from)


def _dot_flags(hidden: torch.Tensor) -> dict[str, bool]:
    """float32 dots in IEEE precision (no TF32: the reference is float32). In Triton's
    interpreter, bfloat16 operands widened to float32 for the dots (it cannot multiply them)
    and results rounded to nearest even by hand (its conversion truncates)."""
    interp_bf16 = (hidden.dtype == torch.bfloat16
                   and (hidden.device.type != "cuda" or interpreter_active()))
    return dict(IEEE=hidden.dtype == torch.float32, DOT_F32=interp_bf16, RTNE=interp_bf16)


# --- routing -------------------------------------------------------------------------------


def _route(expert_ids: torch.Tensor, E: int) -> tuple[torch.Tensor, ...]:
    """``(perm, token, offsets, inv)`` for ``expert_ids [T, k]``: sorted row ``r`` is pair
    ``perm[r] = t k + j`` of token ``token[r] = t`` (int32); expert ``e`` owns the rows
    ``offsets[e] .. offsets[e + 1]`` (int32 ``[E + 1]``); ``inv`` is ``perm``'s inverse
    (pair -> sorted row). Pairs whose id lies outside ``[0, E)`` belong to no expert and
    take the rows after the experts', in pair order (as :func:`routing.route_small`). Torch
    ops on the device, no host synchronisation; the sort's keys are the ids narrowed to 16
    bits (the radix sort's passes a quarter of 64-bit keys')."""
    k = expert_ids.shape[1]
    narrow = torch.int16 if E < 2**15 - 1 else torch.int32
    # Negative ids and ids >= E become E (after every expert), then the narrow key.
    ids = expert_ids.reshape(-1)
    if E + 1 > torch.iinfo(ids.dtype).max:  # (int8 ids over 127 experts: E + 1 has no int8)
        ids = ids.to(torch.int32 if ids.dtype.is_signed else torch.int16)
    if ids.dtype.is_signed:
        keys = torch.remainder(ids.clamp(-1, E), E + 1).to(narrow)
    else:  # uint8: nothing negative
        keys = ids.clamp(max=E).to(narrow)
    sorted_keys, perm = torch.sort(keys, stable=True)
    token = torch.div(perm, k, rounding_mode="floor").to(torch.int32)
    bounds = torch.arange(E + 1, device=keys.device, dtype=narrow)
    offsets = torch.searchsorted(sorted_keys, bounds).to(torch.int32)
    inv = torch.empty_like(perm)
    inv.scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
    return perm, token, offsets, inv


def _no_expert_zero(d_rw: torch.Tensor, inv: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``d_rw [T k]`` (pair order) with 0 for the pairs of no expert (sorted rows from
    ``offsets[-1]`` on, whose values no kernel wrote): no host synchronisation."""
    return d_rw.masked_fill_(inv >= offsets[-1], 0.0)


def _tiles(offsets: torch.Tensor, rows: int, block_m: int) -> torch.Tensor:
    """The row-tile table ``[slots, 3]`` int32 (expert, first row, end row) of the row-tiled
    kernels, ``slots = cdiv(rows, block_m) + min(E, rows)`` whatever the routing; unused
    slots hold ``(0, 0, 0)``."""
    E = offsets.numel() - 1
    off = offsets.to(torch.int64)
    per = torch.div(off[1:] - off[:-1] + block_m - 1, block_m, rounding_mode="floor")
    last = torch.cumsum(per, 0)
    slots = cdiv(rows, block_m) + min(E, rows)
    i = torch.arange(slots, device=offsets.device)
    e = torch.searchsorted(last, i, right=True)
    used = e < E
    e = e.clamp(max=E - 1)
    start = off[e] + (i - (last[e] - per[e])) * block_m
    end = torch.minimum(start + block_m, off[e + 1])
    zero = torch.zeros_like(start)
    return torch.stack([torch.where(used, e, zero), torch.where(used, start, zero),
                        torch.where(used, end, zero)], 1).to(torch.int32).contiguous()


#: Tests switch ``route_large`` on in the interpreter.
_LARGE_ROUTE_IN_INTERPRETER = False


# --- resolved calls --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MoESettings(ResolvedCall):
    """What the kernels and the torch path compute: the activation and its options (the
    launches rebuild it from their plain arguments, :func:`_settings`, cached)."""

    activation: str  # the public name: "swiglu", "geglu", "quick_geglu", "squared_relu"
    act: str  # its activation function, a key of ACT_IDS
    gated: bool
    gate_up_layout: str  # "halves" or "interleaved"
    interleaved: bool  # gated and "interleaved"
    linear_offset: float
    clamp_value: Optional[float]
    fp8_input_store: bool


@dataclass(frozen=True, slots=True)
class MoECall(MoESettings):
    """A checked :func:`moe_experts` call: its settings, the path and the sizes."""

    path: str  # "triton" or "torch"
    T: int  # tokens
    k: int  # experts a token
    E: int  # experts
    H: int  # hidden size
    F: int  # the experts' intermediate size


# --- the torch path --------------------------------------------------------------------------


def _torch_path(hidden, expert_ids, router_weights, w_gate_up, w_down, gate_up_bias,
                down_bias, s: MoECall, gemm_dtype: Optional[torch.dtype] = None,
                gemm_bias: bool = False) -> torch.Tensor:
    """The per-expert loop. ``gemm_dtype`` (an oracle's knob, with ``fp8_input_store``):
    the float8 copy of ``h`` made from the gate/up GEMM's output rounded to it before the
    bias, as the grouped-GEMM engine rounds (see the module docstring), or with
    ``gemm_bias`` after it, as this path itself rounds in a 16-bit dtype; the forward is
    not changed by it."""
    T, k = expert_ids.shape
    E, H = w_gate_up.shape[0], hidden.shape[1]
    compute = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    ids = expert_ids.reshape(-1).to(torch.int64)
    # A pair whose id lies outside [0, E) (unchecked: compiled, or CUDA) belongs to no
    # expert: sorted after every expert's, it adds nothing (as on the kernels' path).
    ids = torch.where((ids >= 0) & (ids < E), ids, E)
    perm = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=E + 1).tolist()
    # Gathers whose backward is deterministic: the pair rows are an expand (its gradient a
    # sum over k), the sort a permutation (unique indices).
    pairs = hidden.unsqueeze(1).expand(T, k, H).reshape(T * k, H)
    x = pairs.index_select(0, perm)
    weights = router_weights.reshape(-1).index_select(0, perm).to(compute)
    wgu, wd = w_gate_up.unbind(0), w_down.unbind(0)  # one stacked gradient, not E
    bgu = gate_up_bias.unbind(0) if gate_up_bias is not None else [None] * E
    bd = down_bias.unbind(0) if down_bias is not None else [None] * E
    # fp8_input_store: each expert's activation, down projection and router weight as one
    # autograd function that keeps h as float8 (what a gradient needs of them, not more).
    fp8 = s.fp8_input_store and torch.is_grad_enabled()
    ys, start = [], 0
    for e, n in enumerate(counts[:E]):
        if n == 0:
            continue
        h = F.linear(x[start:start + n], wgu[e], bgu[e])
        w = weights[start:start + n]
        if fp8:
            kept = h
            if gemm_dtype is not None and gemm_bias:
                kept = F.linear(x[start:start + n], wgu[e], bgu[e]).to(gemm_dtype).to(h.dtype)
            elif gemm_dtype is not None:
                kept = F.linear(x[start:start + n], wgu[e]).to(gemm_dtype).to(h.dtype)
                kept = kept if bgu[e] is None else kept + bgu[e]
            ys.append(apply_function(_Fp8StoredExpert, h, wd[e], bd[e], w, s, kept.detach()))
        else:
            ys.append(_expert_out(h, wd[e], bd[e], w, s))
        start += n
    if not ys:  # no pair: the first expert over the empty rows, so that every input gets
        # its (zero) gradient, as from the kernels, instead of none
        ys.append(_expert_out(F.linear(x[:0], wgu[0], bgu[0]), wd[0], bd[0], weights[:0], s))
    if counts[E]:
        ys.append(ys[0].new_zeros((counts[E], H)))
    y = torch.cat(ys)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return y.index_select(0, inv).view(T, k, H).sum(1).to(hidden.dtype)


def _expert_out(h, w_down, down_bias, weights, s: MoESettings) -> torch.Tensor:
    """One expert's weighted output rows ``(act(h) @ w_down.T + down_bias) * weights`` in
    the compute dtype (``weights`` already in it), from its gate/up output ``h [n, K2]``."""
    a = ref.expert_activation(h, activation=s.activation, linear_offset=s.linear_offset,
                              clamp_value=s.clamp_value, gate_up_layout=s.gate_up_layout)
    return F.linear(a, w_down, down_bias).to(weights.dtype) * weights[:, None]


class _Fp8StoredExpert(torch.autograd.Function):
    """:func:`_expert_out` with ``fp8_input_store`` (the torch path): the forward from ``h``
    itself; kept for the backward ``h`` as float8 (not ``act(h)`` nor the output rows, which
    autograd would keep), from which the backward recomputes them and differentiates, as
    the Triton path's backward does: every gradient is that of the rounded ``h``."""

    @staticmethod
    def forward(ctx, h, w_down, down_bias, weights, s: MoESettings, kept):
        """``kept``: the values whose float8 copy is kept (``h``, or an oracle's rounding
        of it, ``_torch_path``'s ``gemm_dtype``)."""
        ctx.s, ctx.dtype = s, h.dtype
        # The backward recomputes under the forward's autocast (its GEMM then runs in the
        # dtype it ran in here, whatever the context of the backward call).
        device = h.device.type
        ctx.amp = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.save_for_backward(to_e4m3(kept), w_down, down_bias, weights)
        return _expert_out(h, w_down, down_bias, weights, s)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        h8, w_down, down_bias, weights = ctx.saved_tensors
        needs = ctx.needs_input_grad[:4]
        device, amp, amp_dtype = ctx.amp
        with torch.enable_grad(), torch.autocast(device, dtype=amp_dtype, enabled=amp):
            leaves = [t.detach().requires_grad_(need) if t is not None else None
                      for t, need in zip((h8.to(ctx.dtype), w_down, down_bias, weights),
                                         needs)]
            y = _expert_out(*leaves, ctx.s)
            wanted = [t for t, need in zip(leaves, needs) if need]
            got = iter(torch.autograd.grad(y, wanted, dy) if wanted else ())
        return (*(next(got) if need else None for need in needs), None, None)


# --- the Triton launches -----------------------------------------------------------------------


def _combine(y: torch.Tensor, inv: torch.Tensor, offsets: torch.Tensor, T: int, k: int,
             c: MoELaunch, scale: Optional[torch.Tensor] = None,
             bias: Optional[torch.Tensor] = None,
             row_expert: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each token's ``k`` slot rows of ``y [T k, N]`` (sorted order) summed in slot order;
    ``bias [E, N]`` added by the rows' experts (:func:`_row_expert`) and ``scale [T k]``
    (sorted order) multiplied first where given. Rows past ``offsets[-1]`` (pairs of no
    expert) add nothing."""
    N = y.shape[1]
    out = torch.empty((T, N), dtype=y.dtype, device=y.device)
    if T and N:
        _kernels().moe_combine_kernel[(T, cdiv(N, c.combine_block))](
            y, inv, out, N, k, scale, bias, row_expert, offsets[-1:],
            HAS_SCALE=scale is not None,
            HAS_BIAS=bias is not None, RTNE=_dot_flags(y)["RTNE"],
            BLOCK_N=c.combine_block, num_warps=c.combine_warps)
    return out


# --- the grouped-GEMM engine ----------------------------------------------------------------
# On Hopper, cuBLAS-class grouped GEMMs (``torch._grouped_mm``) run the training sizes' GEMMs
# faster than the row-tiled Triton kernels (H100, bf16, Mixtral's shape: 0.66 against 0.52
# PFLOP/s); the element-wise work those kernels fuse into their epilogues (bias,
# activation, router weights, the router weights' gradient) then runs in
# ``moe_act_kernel`` / ``moe_act_bwd_rows_kernel`` / ``moe_combine_kernel`` over the GEMMs'
# outputs. Decode sizes (fewer than ``grouped_mm_min_rows`` rows) keep the fused kernels.


def _gmm_operand(t: torch.Tensor) -> bool:
    """A layout ``torch._grouped_mm`` takes: one of the last two dims at stride 1, the other
    and the leading stride at multiples of 16 bytes, the data 16-byte aligned."""
    mult = 16 // t.element_size()
    inner = ((t.stride(-1) == 1 and t.stride(-2) % mult == 0)
             or (t.stride(-2) == 1 and t.stride(-1) % mult == 0))
    return inner and (t.dim() == 2 or t.stride(0) % mult == 0) and t.data_ptr() % 16 == 0


def _grouped_engine(hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                    rows: int, c: MoELaunch) -> bool:
    """Whether this call's GEMMs go to ``torch._grouped_mm``: a Hopper GPU (what it was
    validated on: exact zero gradients for experts without rows, CUDA-graph capture; other
    GPUs take torch's host-synchronising fallback loop or, on Blackwell, report nonzero
    gradients for empty groups), bfloat16 (its fast kernels' dtype), dims at multiples of
    8, at least ``grouped_mm_min_rows`` rows (``T k``), weights in a layout it reads in
    place."""
    if (hidden.device.type != "cuda" or interpreter_active() or hidden.dtype != torch.bfloat16
            or rows < c.grouped_mm_min_rows or not hasattr(torch, "_grouped_mm")
            or torch.version.hip is not None
            or torch.cuda.get_device_capability(hidden.device)[0] != 9):
        return False
    H, Fdim = hidden.shape[1], w_down.shape[2]
    return H % 8 == 0 and Fdim % 8 == 0 and _gmm_operand(w_gate_up) and _gmm_operand(w_down)


def _row_expert(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """Each sorted row's expert (int64 ``[rows]``), from the offsets: always in ``[0, E)``,
    so a bias indexed by it is never read out of bounds, even for the rows of pairs whose
    ids lie outside ``[0, E)`` (unchecked on CUDA: rows after every expert's, which no GEMM
    writes and :func:`_combine` leaves out)."""
    E = offsets.numel() - 1
    r = torch.arange(rows, device=offsets.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets[1:], r, right=True).clamp_(max=E - 1)


def _spread(x: torch.Tensor, inv: torch.Tensor, k: int, c: MoELaunch) -> torch.Tensor:
    """``x.index_select(0, token)``: the tokens' rows ``x [T, N]`` (rows at any stride) in
    sorted order, ``[T k, N]``, by ``moe_spread_kernel``, which reads each token's row once
    and writes it to its ``k`` sorted rows ``inv[t k + j]`` (H100, Qwen3-MoE's 65536 x 2048
    bf16 rows: 0.113 ms against index_select's 0.164)."""
    T, N = x.shape
    y = x.new_empty((T * k, N))
    if T and N:
        bt, bn = c.spread_block_t, min(c.spread_block_n, next_pow2(N))
        _kernels().moe_spread_kernel[(cdiv(T, bt), cdiv(N, bn))](
            x, x.stride(0), inv, y, T, N, k, BLOCK_T=bt, BLOCK_N=bn,
            num_warps=c.spread_warps)
    return y


def _gmm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` over the experts' row ranges: ``a [R, K] @ b[e] [K, N]`` per
    expert (``b`` 3-D), or ``a [M, R] @ b [R, N]`` summed per expert (``b`` 2-D: ``[E, M,
    N]``, zeros for an expert without rows)."""
    return torch._grouped_mm(a, b, offs=offsets[1:])


def _forward_grouped(hidden, expert_ids, w_gate_up, w_down, gate_up_bias, down_bias, s, save,
                     route, c):
    """``_forward`` on the grouped-GEMM engine (same outputs)."""
    perm, token, offsets, inv, weights = route
    T, k = expert_ids.shape
    rows, K2, Fdim = perm.numel(), w_gate_up.shape[1], w_down.shape[2]
    kern, rt = _kernels(), _dot_flags(hidden)["RTNE"]
    x = _spread(hidden, inv, k, c)
    h = _gmm(x, w_gate_up.transpose(1, 2), offsets)
    del x
    fp8 = save and s.fp8_input_store
    h8 = torch.empty_like(h, dtype=_FP8) if fp8 else None
    a = hidden.new_empty((rows, Fdim))
    biased = gate_up_bias is not None or down_bias is not None
    row_expert = _row_expert(offsets, rows) if biased else None
    br, bf = c.act_block_r, c.act_block_f
    kern.moe_act_kernel[(cdiv(rows, br) * cdiv(Fdim, bf),)](
        h, h8, a, gate_up_bias, row_expert, rows, Fdim, s.linear_offset,
        s.clamp_value or 0.0, ACT=ACT_IDS[s.act], GATED=s.gated,
        INTERLEAVED=s.interleaved, HAS_BIAS=gate_up_bias is not None,
        HAS_CLAMP=s.clamp_value is not None,
        WRITE_H=save and not fp8 and gate_up_bias is not None, H_FP8=fp8, RTNE=rt,
        BLOCK_R=br, BLOCK_F=bf, num_warps=c.act_warps)
    kept = h8 if fp8 else (h if save else h.new_empty((0, K2)))
    del h  # the bf16 GEMM output, unless kept: freed before the down GEMM's output exists
    y = _gmm(a, w_down.transpose(1, 2), offsets)
    del a
    out = _combine(y, inv, offsets, T, k, c, scale=weights, bias=down_bias,
                   row_expert=row_expert)
    return out, kept, perm, token, offsets, inv, weights


def _backward_grouped(dout, hidden, w_gate_up, w_down, gate_up_bias, down_bias, h, perm,
                      offsets, inv, weights, s, needs, c):
    """``_backward`` on the grouped-GEMM engine (same outputs)."""
    need_x, need_rw, need_wgu, need_wd, need_bgu, need_bd = needs
    T, H = hidden.shape
    E, K2, _ = w_gate_up.shape
    Fdim = w_down.shape[2]
    rows = perm.numel()
    k = rows // T
    kern, rt = _kernels(), _dot_flags(hidden)["RTNE"]
    if h.dtype == _FP8 and not _kernel_loads_fp8(h.device):
        h = h.to(hidden.dtype)  # exact: hidden's dtype holds every e4m3 value
    d_rows = _spread(dout, inv, k, c)
    g = _gmm(d_rows, w_down, offsets)
    dh = hidden.new_empty((rows, K2))
    a_s = hidden.new_empty((rows, Fdim))
    d_rw = torch.empty(rows, dtype=torch.float32, device=hidden.device) if need_rw else None
    row_expert = _row_expert(offsets, rows) if down_bias is not None and need_rw else None
    br, bf = c.act_bwd_block_r, c.act_block_f
    kern.moe_act_bwd_rows_kernel[(cdiv(rows, br),)](
        g, h, weights, perm, d_rows, down_bias, row_expert, dh, a_s, d_rw, rows, H, Fdim,
        s.linear_offset, s.clamp_value or 0.0, ACT=ACT_IDS[s.act], GATED=s.gated,
        INTERLEAVED=s.interleaved, HAS_CLAMP=s.clamp_value is not None,
        HAS_DOWN_BIAS=row_expert is not None, NEED_RW=need_rw, RTNE=rt, BLOCK_R=br,
        BLOCK_F=bf, num_warps=c.act_warps)
    del g

    def segment_sum(t, scale):
        out = torch.empty((E, t.shape[1]), dtype=hidden.dtype, device=hidden.device)
        kern.moe_segment_sum_kernel[(cdiv(t.shape[1], c.combine_block), E)](
            t, scale, offsets, out, t.shape[1], HAS_SCALE=scale is not None, RTNE=rt,
            BLOCK_R=16, BLOCK_N=c.combine_block, num_warps=c.combine_warps)
        return out

    if need_rw:
        d_rw = _no_expert_zero(d_rw, inv, offsets)
    d_wd = _gmm(d_rows.t(), a_s, offsets) if need_wd else None
    d_bd = segment_sum(d_rows, weights) if need_bd else None
    del a_s, d_rows
    # The tokens' rows again (not kept from the forward: [T k, H] more memory, for about
    # 2% of Qwen3-MoE's step; see BENCHMARKS).
    d_wgu = _gmm(dh.t(), _spread(hidden, inv, k, c), offsets) if need_wgu else None
    d_bgu = segment_sum(dh, None) if need_bgu else None
    d_x = _combine(_gmm(dh, w_gate_up, offsets), inv, offsets, T, k, c) if need_x else None
    return d_x, d_rw, d_wgu, d_wd, d_bgu, d_bd


def _forward(hidden, expert_ids, router_weights, w_gate_up, w_down, gate_up_bias, down_bias,
             s: MoESettings, save: bool):
    """``(out [T, H], h [T k, K2] (or [0, K2] without save; float8_e4m3fn with
    ``fp8_input_store``), perm, token, offsets, inv, weights [T k] float32 in sorted
    order)``."""
    T, k = expert_ids.shape
    E, K2, H = w_gate_up.shape
    Fdim = w_down.shape[2]
    rows = T * k
    kern, c = _kernels(), _config(hidden.device, rows, H, Fdim)
    tiles = None
    if route_small_ok(rows, E, c.block_m):  # decode sizes: one launch
        perm, token, offsets, inv, tiles, weights = route_small(expert_ids, router_weights, E,
                                                                c.block_m)
    elif E < 2**15 and (not interpreter_active() or _LARGE_ROUTE_IN_INTERPRETER):  # 3 launches
        perm, token, offsets, inv, weights = route_large(expert_ids, router_weights, E)
    else:  # the interpreter: torch ops, which cost it far less than the kernels' sort
        perm, token, offsets, inv = _route(expert_ids, E)
        weights = router_weights.reshape(-1).index_select(0, perm).to(torch.float32)
    if rows and _grouped_engine(hidden, w_gate_up, w_down, rows, c):
        return _forward_grouped(hidden, expert_ids, w_gate_up, w_down, gate_up_bias, down_bias,
                                s, save, (perm, token, offsets, inv, weights), c)
    fp8 = save and s.fp8_input_store
    # Where the kernel cannot convert to float8 it writes the same e4m3 values in hidden's
    # dtype, cast after it.
    direct = fp8 and _kernel_stores_fp8(hidden.device)
    h = hidden.new_empty((rows if save else 0, K2),
                         dtype=_FP8 if direct or (fp8 and rows == 0) else hidden.dtype)
    if rows == 0:
        return hidden.new_zeros((T, H)), h, perm, token, offsets, inv, weights
    if tiles is None:
        tiles = _tiles(offsets, rows, c.block_m)
    dots, gemm, bn = _dot_flags(hidden), c.gemm(), c.block_n
    a = hidden.new_empty((rows, Fdim))
    kern.moe_up_kernel[(tiles.shape[0], cdiv(Fdim, bn))](
        hidden, hidden.stride(0), token, w_gate_up, *w_gate_up.stride(),
        gate_up_bias if gate_up_bias is not None else hidden, h, a, tiles, H, Fdim,
        s.linear_offset, s.clamp_value or 0.0,
        ACT=ACT_IDS[s.act], GATED=s.gated, INTERLEAVED=s.interleaved,
        HAS_BIAS=gate_up_bias is not None, HAS_CLAMP=s.clamp_value is not None,
        STORE_H=save, H_FP8=fp8, **dots, **gemm)
    if fp8 and not direct:
        h = h.to(_FP8)  # e4m3 values already: an exact cast
    scatter = k == 1
    # (k = 1 writes the tokens' rows in place: zeros first, for a pair of no expert)
    y = hidden.new_zeros((T, H)) if scatter else hidden.new_empty((rows, H))
    kern.moe_down_kernel[(tiles.shape[0], cdiv(H, bn))](
        a, a.stride(0), w_down, w_down.stride(0), w_down.stride(2), w_down.stride(1),
        down_bias if down_bias is not None else a, weights, token, y, y.stride(0), tiles,
        H, Fdim, HAS_BIAS=down_bias is not None, HAS_SCALE=True, SCATTER=scatter, **dots,
        **gemm)
    out = y if scatter else _combine(y, inv, offsets, T, k, c)
    return out, h, perm, token, offsets, inv, weights


def _backward(dout, hidden, w_gate_up, w_down, gate_up_bias, down_bias, h, perm, token,
              offsets, inv, weights, s: MoESettings, needs: tuple[bool, ...]):
    """Gradients ``(hidden, router weights [T k] float32 in pair order, w_gate_up, w_down,
    gate_up_bias, down_bias)``, ``None`` where ``needs`` (same order) is False."""
    need_x, need_rw, need_wgu, need_wd, need_bgu, need_bd = needs
    T, H = hidden.shape
    E, K2, _ = w_gate_up.shape
    Fdim = w_down.shape[2]
    rows = perm.numel()
    k = rows // T if T else 0
    kern, c = _kernels(), _config(hidden.device, rows, H, Fdim)
    if rows and _grouped_engine(hidden, w_gate_up, w_down, rows, c):
        return _backward_grouped(dout, hidden, w_gate_up, w_down, gate_up_bias, down_bias, h,
                                 perm, offsets, inv, weights, s, needs, c)
    dots, gemm, bn = _dot_flags(hidden), c.gemm(), c.block_n
    if h.dtype == _FP8 and not _kernel_loads_fp8(h.device):
        h = h.to(hidden.dtype)  # exact: hidden's dtype holds every e4m3 value
    dh = hidden.new_empty((rows, K2))
    a = hidden.new_empty((rows, Fdim))
    f_tiles = cdiv(Fdim, bn)
    dw_part = torch.empty((f_tiles, rows), dtype=torch.float32, device=hidden.device)
    tiles = _tiles(offsets, rows, c.block_m)
    if rows:
        kern.moe_act_bwd_kernel[(tiles.shape[0], f_tiles)](
            dout, dout.stride(0), token, w_down, w_down.stride(0), w_down.stride(1),
            w_down.stride(2), down_bias if down_bias is not None else dout, h, weights, dh, a,
            dw_part, tiles, rows, H, Fdim, s.linear_offset, s.clamp_value or 0.0,
            ACT=ACT_IDS[s.act], GATED=s.gated, INTERLEAVED=s.interleaved,
            HAS_CLAMP=s.clamp_value is not None, HAS_DOWN_BIAS=down_bias is not None,
            **dots, **gemm)
    d_rw = None
    if need_rw:
        d_rw = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        d_rw[perm] = dw_part.sum(0)
        d_rw = _no_expert_zero(d_rw, inv, offsets)
    wgrad = dict(**dots, **c.wgrad())

    def wgrad_grid(M: int, N: int) -> tuple[int, int]:
        return (cdiv(M, c.wgrad_block_m) * cdiv(N, c.wgrad_block_n), E)

    d_wd = d_bd = None
    if need_wd or need_bd:
        d_wd = torch.empty((E, H, Fdim), dtype=w_down.dtype, device=hidden.device)
        d_bd = (torch.empty((E, H), dtype=down_bias.dtype, device=hidden.device)
                if need_bd else None)
        kern.moe_wgrad_kernel[wgrad_grid(H, Fdim)](
            dout, dout.stride(0), a, a.stride(0), token, weights, offsets, d_wd,
            d_bd if need_bd else d_wd, H, Fdim, A_GATHER=True, B_GATHER=False,
            HAS_SCALE=True, BIAS_GRAD=need_bd, **wgrad)
    d_wgu = d_bgu = None
    if need_wgu or need_bgu:
        d_wgu = torch.empty((E, K2, H), dtype=w_gate_up.dtype, device=hidden.device)
        d_bgu = (torch.empty((E, K2), dtype=gate_up_bias.dtype, device=hidden.device)
                 if need_bgu else None)
        kern.moe_wgrad_kernel[wgrad_grid(K2, H)](
            dh, dh.stride(0), hidden, hidden.stride(0), token, weights, offsets, d_wgu,
            d_bgu if need_bgu else d_wgu, K2, H, A_GATHER=False, B_GATHER=True,
            HAS_SCALE=False, BIAS_GRAD=need_bgu, **wgrad)
    d_x = None
    if need_x:
        scatter = k == 1
        dx = hidden.new_zeros((T, H)) if scatter or not rows else hidden.new_empty((rows, H))
        if rows:
            kern.moe_down_kernel[(tiles.shape[0], cdiv(H, bn))](
                dh, dh.stride(0), w_gate_up, w_gate_up.stride(0), w_gate_up.stride(1),
                w_gate_up.stride(2), dh, weights, token, dx, dx.stride(0), tiles, H, K2,
                HAS_BIAS=False, HAS_SCALE=False, SCATTER=scatter, **dots, **gemm)
        else:
            dx.zero_()
        d_x = dx if scatter or not rows else _combine(dx, inv, offsets, T, k, c)
    return (d_x, d_rw, d_wgu, d_wd, d_bgu if need_bgu else None, d_bd if need_bd else None)


# The two launches (each a whole pass of the engine) as kernel_op custom ops: called
# directly when eager, as two opaque nodes under torch.compile. They take the settings as
# plain arguments and rebuild them (cached); gradients not asked for come back empty.


def _settings(activation: str, gate_up_layout: str, linear_offset: float,
              clamp_value: Optional[float], fp8_input_store: bool = False,
              *call: Any) -> MoESettings:
    """The settings; with ``call`` (``path, T, k, E, H, F``) the whole :class:`MoECall`."""
    act, gated = ref.ACTIVATIONS[activation]
    fields = (activation, act, gated, gate_up_layout, gated and gate_up_layout == "interleaved",
              float(linear_offset), None if clamp_value is None else float(clamp_value),
              fp8_input_store)
    return MoECall(*fields, *call) if call else MoESettings(*fields)


_launch_settings = functools.lru_cache(maxsize=64)(_settings)


def _op_args(s: MoESettings) -> tuple:
    """The settings as the launches take them."""
    return s.activation, s.gate_up_layout, s.linear_offset, s.clamp_value, s.fp8_input_store


# --- the torch path under torch.compile -----------------------------------------------------
# Its loop reads the experts' token counts on the host, which a traced graph cannot hold: under
# torch.compile the whole path is one opaque op (no graph break, no recompilation when the
# routing changes), its backward another, which recomputes the forward under autograd.


def _torch_fake(hidden, expert_ids, router_weights, w_gate_up, w_down, gate_up_bias, down_bias,
                activation, gate_up_layout, linear_offset, clamp_value, fp8_input_store):
    return hidden.new_empty(hidden.shape)


@kernel_op("moe_experts_torch", _torch_fake)
def _torch_path_op(hidden: torch.Tensor, expert_ids: torch.Tensor, router_weights: torch.Tensor,
                   w_gate_up: torch.Tensor, w_down: torch.Tensor,
                   gate_up_bias: Optional[torch.Tensor], down_bias: Optional[torch.Tensor],
                   activation: str, gate_up_layout: str, linear_offset: float,
                   clamp_value: Optional[float], fp8_input_store: bool) -> torch.Tensor:
    """:func:`_torch_path` as one op for compiled graphs (its gradients from
    :func:`_torch_path_bwd`)."""
    s = _launch_settings(activation, gate_up_layout, linear_offset, clamp_value, fp8_input_store)
    with torch.no_grad():
        return _torch_path(hidden, expert_ids, router_weights, w_gate_up, w_down, gate_up_bias,
                           down_bias, s)


_GRAD_OF = ("hidden", "router_weights", "w_gate_up", "w_down", "gate_up_bias", "down_bias")


def _torch_bwd_fake(grad, hidden, expert_ids, router_weights, w_gate_up, w_down, gate_up_bias,
                    down_bias, *settings):
    return [t.new_empty(t.shape) if t is not None else grad.new_empty(0)
            for t in (hidden, router_weights, w_gate_up, w_down, gate_up_bias, down_bias)]


@kernel_op("moe_experts_torch_bwd", _torch_bwd_fake)
def _torch_path_bwd(grad: torch.Tensor, hidden: torch.Tensor, expert_ids: torch.Tensor,
                    router_weights: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                    gate_up_bias: Optional[torch.Tensor], down_bias: Optional[torch.Tensor],
                    activation: str, gate_up_layout: str, linear_offset: float,
                    clamp_value: Optional[float], fp8_input_store: bool) -> list[torch.Tensor]:
    """The gradients of :func:`_torch_path_op`'s inputs named in :data:`_GRAD_OF`,
    contiguous (an empty tensor for a bias that is None): the forward recomputed under
    autograd, then differentiated (``fp8_input_store``'s rounding included)."""
    s = _launch_settings(activation, gate_up_layout, linear_offset, clamp_value, fp8_input_store)
    leaves = [t.detach().requires_grad_(True) if t is not None else None
              for t in (hidden, router_weights, w_gate_up, w_down, gate_up_bias, down_bias)]
    wrt = [t for t in leaves if t is not None]

    def differentiate() -> tuple:
        with torch.enable_grad():
            out = _torch_path(leaves[0], expert_ids, *leaves[1:], s)
            return torch.autograd.grad(out, wrt, grad, allow_unused=True)

    # An op's body runs with autograd's dispatch keys excluded (thread-local state, which
    # enable_grad does not undo): the recomputation runs on a thread of its own, as
    # autograd's engine runs a backward.
    grads = iter(_on_own_thread(differentiate))
    result = []
    for t in leaves:
        g = next(grads) if t is not None else None
        result.append(grad.new_empty(0) if t is None
                      else t.new_zeros(t.shape) if g is None else g.contiguous())
    return result


def _on_own_thread(fn: Any) -> Any:
    """``fn()`` run on a new thread (its thread-local dispatch state the default), its result
    returned or its exception raised here. CPU tensors only: a CUDA backward runs on
    autograd's device thread, which would wait here for work queued to itself."""
    import threading

    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 (raised again on the caller's thread)
            box["error"] = exc

    thread = threading.Thread(target=run, name="lmfuse-moe-reference-backward")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def _torch_op_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:7])
    ctx.settings = inputs[7:]


def _torch_op_backward(ctx, grad):
    hidden, ids, rw, wgu, wd, bgu, bd = ctx.saved_tensors
    dh, drw, dwgu, dwd, dbgu, dbd = _torch_path_bwd(grad, hidden, ids, rw, wgu, wd, bgu, bd,
                                                    *ctx.settings)
    return (dh, None, drw, dwgu, dwd, dbgu if bgu is not None else None,
            dbd if bd is not None else None, None, None, None, None, None)


torch.library.register_autograd("lmfuse::moe_experts_torch", _torch_op_backward,
                                setup_context=_torch_op_setup)


def _fwd_fake(hidden, expert_ids, router_weights, w_gate_up, w_down, gate_up_bias, down_bias,
              activation, gate_up_layout, linear_offset, clamp_value, fp8_input_store, save):
    T, k = expert_ids.shape
    rows, E = T * k, w_gate_up.shape[0]
    index = dict(dtype=torch.int64)
    h_dtype = _FP8 if save and fp8_input_store else hidden.dtype
    return (hidden.new_empty(hidden.shape),
            hidden.new_empty((rows if save else 0, w_gate_up.shape[1]), dtype=h_dtype),
            hidden.new_empty((rows,), **index), hidden.new_empty((rows,), dtype=torch.int32),
            hidden.new_empty((E + 1,), dtype=torch.int32), hidden.new_empty((rows,), **index),
            hidden.new_empty((rows,), dtype=torch.float32))


@kernel_op("moe_experts_fwd", _fwd_fake)
def _launch_fwd(hidden: torch.Tensor, expert_ids: torch.Tensor, router_weights: torch.Tensor,
                w_gate_up: torch.Tensor, w_down: torch.Tensor,
                gate_up_bias: Optional[torch.Tensor], down_bias: Optional[torch.Tensor],
                activation: str, gate_up_layout: str, linear_offset: float,
                clamp_value: Optional[float], fp8_input_store: bool,
                save: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                     torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_forward`'s outputs."""
    return _forward(hidden, expert_ids, router_weights, w_gate_up, w_down, gate_up_bias,
                    down_bias, _launch_settings(activation, gate_up_layout, linear_offset,
                                                clamp_value, fp8_input_store), save)


def _bwd_fake(dout, hidden, w_gate_up, w_down, gate_up_bias, down_bias, h, perm, token, offsets,
              inv, weights, activation, gate_up_layout, linear_offset, clamp_value,
              fp8_input_store, needs):
    shapes = (hidden.shape, perm.shape, w_gate_up.shape, w_down.shape,
              gate_up_bias.shape if gate_up_bias is not None else (0,),
              down_bias.shape if down_bias is not None else (0,))
    return [hidden.new_empty(shape if need else (0,),
                             dtype=torch.float32 if i == 1 else hidden.dtype)
            for i, (shape, need) in enumerate(zip(shapes, needs))]


@kernel_op("moe_experts_bwd", _bwd_fake)
def _launch_bwd(dout: torch.Tensor, hidden: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, gate_up_bias: Optional[torch.Tensor],
                down_bias: Optional[torch.Tensor], h: torch.Tensor, perm: torch.Tensor,
                token: torch.Tensor, offsets: torch.Tensor, inv: torch.Tensor,
                weights: torch.Tensor, activation: str, gate_up_layout: str,
                linear_offset: float, clamp_value: Optional[float], fp8_input_store: bool,
                needs: list[bool]) -> list[torch.Tensor]:
    """:func:`_backward`'s gradients, empty where ``needs`` is False."""
    grads = _backward(dout, hidden, w_gate_up, w_down, gate_up_bias, down_bias, h, perm,
                      token, offsets, inv, weights,
                      _launch_settings(activation, gate_up_layout, linear_offset, clamp_value,
                                       fp8_input_store), tuple(needs))
    return [g if g is not None else
            hidden.new_empty((0,), dtype=torch.float32 if i == 1 else hidden.dtype)
            for i, g in enumerate(grads)]


# --- autograd ---------------------------------------------------------------------------------


class _MoEExperts(torch.autograd.Function):
    """The Triton path; see the module docstring."""

    @staticmethod
    def forward(ctx, hidden, expert_ids, router_weights, w_gate_up, w_down, gate_up_bias,
                down_bias, s: MoECall):
        with nvtx_range(OP, "fwd"):
            args = (hidden, expert_ids, router_weights, w_gate_up, w_down, gate_up_bias,
                    down_bias)
            out, h, perm, token, offsets, inv, weights = _launch_fwd(*args, *_op_args(s),
                                                                     True)
            ctx.s = s
            ctx.rw_dtype = router_weights.dtype
            ctx.save_for_backward(hidden, w_gate_up, w_down, gate_up_bias, down_bias, h, perm,
                                  token, offsets, inv, weights)
            return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        with nvtx_range(OP, "bwd"):
            saved = ctx.saved_tensors
            n = ctx.needs_input_grad
            needs = (n[0], n[2], n[3], n[4], n[5], n[6])
            dout = dout.contiguous()
            grads = [g if need else None for g, need in
                     zip(_launch_bwd(dout, *saved, *_op_args(ctx.s), list(needs)), needs)]
            d_x, d_rw, d_wgu, d_wd, d_bgu, d_bd = grads
            T, k = ctx.s.T, ctx.s.k
            if d_rw is not None:
                d_rw = d_rw.view(T, k).to(ctx.rw_dtype)
            return d_x, None, d_rw, d_wgu, d_wd, d_bgu, d_bd, None


# --- validation and planning ----------------------------------------------------------------


def _resolve(hidden, expert_ids, router_weights, w_gate_up, w_down, gate_up_bias, down_bias,
             activation, linear_offset, clamp_value, gate_up_layout, impl,
             fp8_input_store=False) -> tuple[str, str, MoECall]:
    check_tensor(OP, "hidden", hidden, ndim=2)
    check_tensor(OP, "expert_ids", expert_ids, ndim=2, dtypes=_INT_DTYPES)
    check_tensor(OP, "router_weights", router_weights, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(OP, "w_gate_up", w_gate_up, ndim=3)
    check_tensor(OP, "w_down", w_down, ndim=3)
    if not isinstance(activation, str) or activation not in ref.ACTIVATIONS:
        raise ValueError(f"{OP}: activation must be one of {tuple(ref.ACTIVATIONS)}, got "
                         f"{activation!r}")
    if not isinstance(gate_up_layout, str) or gate_up_layout not in ref.LAYOUTS:
        raise ValueError(f"{OP}: gate_up_layout must be one of {ref.LAYOUTS}, got "
                         f"{gate_up_layout!r}")
    gated = ref.ACTIVATIONS[activation][1]
    T, H = hidden.shape
    if H == 0:
        raise ValueError(f"{OP}: hidden must have at least one feature, got shape "
                         f"{tuple(hidden.shape)}")
    if expert_ids.shape[0] != T:
        raise ValueError(f"{OP}: expert_ids must be [T, k] with T = {T} (hidden's tokens), "
                         f"got {tuple(expert_ids.shape)}")
    if router_weights.shape != expert_ids.shape:
        raise ValueError(f"{OP}: router_weights must have expert_ids' shape "
                         f"{tuple(expert_ids.shape)} ([T, k]), got "
                         f"{tuple(router_weights.shape)}")
    E, H_down, Fdim = w_down.shape
    if E == 0 or Fdim == 0:
        raise ValueError(f"{OP}: w_down must be [E, H, F] with E, F >= 1, got "
                         f"{tuple(w_down.shape)}")
    if H_down != H:
        raise ValueError(f"{OP}: w_down must be [E, H, F] with H = {H} (hidden's last dim), "
                         f"got {tuple(w_down.shape)}")
    K2 = 2 * Fdim if gated else Fdim
    if tuple(w_gate_up.shape) != (E, K2, H):
        what = "2F" if gated else f"F ({activation} is not gated)"
        raise ValueError(f"{OP}: w_gate_up must be [E, {what}, H] = [{E}, {K2}, {H}] "
                         f"(E, F from w_down {tuple(w_down.shape)}), got "
                         f"{tuple(w_gate_up.shape)}")
    for name, t, shape in (("gate_up_bias", gate_up_bias, (E, K2)),
                           ("down_bias", down_bias, (E, H))):
        if t is not None:
            check_tensor(OP, name, t, ndim=2)
            if tuple(t.shape) != shape:
                raise ValueError(f"{OP}: {name} must be {list(shape)}, got {tuple(t.shape)}")
    for name, t in (("w_gate_up", w_gate_up), ("w_down", w_down),
                    ("gate_up_bias", gate_up_bias), ("down_bias", down_bias)):
        if t is not None and t.dtype != hidden.dtype:
            raise TypeError(f"{OP}: {name} must have hidden's dtype {hidden.dtype}, got "
                            f"{t.dtype}")
    check_same_device(OP, "hidden", hidden, expert_ids=expert_ids, router_weights=router_weights,
                      w_gate_up=w_gate_up, w_down=w_down, gate_up_bias=gate_up_bias,
                      down_bias=down_bias)
    linear_offset = check_number(OP, "linear_offset", linear_offset, allow_none=False)
    if check_number(OP, "clamp_value", clamp_value) is not None and not clamp_value > 0:
        raise ValueError(f"{OP}: clamp_value must be positive (gate <= c, -c <= up <= c), "
                         f"got {clamp_value!r}")
    if not isinstance(fp8_input_store, bool):
        raise TypeError(f"{OP}: fp8_input_store must be a bool, got {fp8_input_store!r}")
    if not gated and (linear_offset or clamp_value is not None):
        raise ValueError(f"{OP}: linear_offset and clamp_value apply to the gated "
                         f"activations only; {activation} got linear_offset={linear_offset}, "
                         f"clamp_value={clamp_value}")
    if expert_ids.numel() and value_checks(expert_ids):
        lo, hi = int(expert_ids.min()), int(expert_ids.max())
        if lo < 0 or hi >= E:
            raise ValueError(f"{OP}: expert_ids must be in [0, E) = [0, {E}), got values in "
                             f"[{lo}, {hi}]")
    path, reason = float64_fallback(OP, impl, *select_impl(OP, impl, hidden.device),
                                    hidden.dtype, "hidden", fallback="the torch path")
    s = _settings(activation, gate_up_layout, linear_offset, clamp_value, fp8_input_store,
                  path, T, expert_ids.shape[1], E, H, Fdim)
    return path, reason, s


def moe_experts(
    hidden: torch.Tensor,
    expert_ids: torch.Tensor,
    router_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    gate_up_bias: Optional[torch.Tensor] = None,
    down_bias: Optional[torch.Tensor] = None,
    activation: str = "swiglu",
    linear_offset: float = 0.0,
    clamp_value: Optional[float] = None,
    gate_up_layout: str = "halves",
    fp8_input_store: bool = False,
    impl: str = "auto",
) -> torch.Tensor:
    """The routed experts' MLP: ``out[t] = sum_j router_weights[t, j] * expert(expert_ids[t,
    j], hidden[t])``, ``expert(e, x) = act(x @ w_gate_up[e].T + gate_up_bias[e]) @
    w_down[e].T + down_bias[e]``.

    Args:
        hidden: ``[T, H]`` float32/float16/bfloat16 (float64: the torch path).
        expert_ids: ``[T, k]`` integer expert of each token's slots, in ``[0, E)`` (checked:
            on CPU tensors in eager calls, on CUDA under :func:`lmfuse.set_checks`; where
            unchecked, on CUDA and in graphs ``torch.compile`` traced, a slot outside the
            range belongs to no expert and adds nothing, its router weight's gradient 0, as
            Hugging Face's loops skip the id ``E`` that marks another rank's expert).
        router_weights: ``[T, k]``, any float dtype; its gradient comes back in it.
        w_gate_up: ``[E, 2F, H]`` (``[E, F, H]`` for ``squared_relu``), hidden's dtype; any
            strides (a transposed view such as GPT-OSS's ``gate_up_proj.transpose(1, 2)``
            is read in place on the Triton path).
        w_down: ``[E, H, F]``, hidden's dtype, any strides.
        gate_up_bias: optional ``[E, 2F]`` (``[E, F]``); down_bias: optional ``[E, H]``.
        activation: ``"swiglu"``, ``"geglu"`` (tanh GELU), ``"quick_geglu"`` (``a *
            sigmoid(1.702 a)``), gated: ``act(gate) * (up + linear_offset)``; or
            ``"squared_relu"`` (not gated).
        linear_offset, clamp_value: gated only; ``c > 0`` clamps ``gate <= c`` and ``-c <= up
            <= c`` after ``gate_up_bias`` (GPT-OSS: ``quick_geglu``, offset 1, clamp 7).
        gate_up_layout: ``"halves"`` (gate ``[:F]``, up ``[F:]``) or ``"interleaved"``
            (gate ``[0::2]``, up ``[1::2]``, GPT-OSS); no effect for ``squared_relu``.
        fp8_input_store: keep the gate/up output ``h [T k, 2F]`` (the activation's input)
            for backward as float8_e4m3fn (half of bf16's bytes), as the activations' option
            keeps theirs. The output does not change; the gradients are then those of the
            rounded ``h``. NaN stays NaN, ``+-inf`` (and anything beyond) is saturated to
            ``+-448`` (float8_e4m3fn has no infinity). No effect without a gradient.
        impl: ``"auto"``, ``"triton"`` or ``"torch"``; see :func:`lmfuse.explain`.
    Returns:
        ``[T, H]`` in hidden's dtype; gradients for hidden, router_weights, both weights and
        both biases. Deterministic on both paths; experts that receive no token cost
        nothing (and get zero gradients). Both paths hold the activation's output (the
        down GEMM's input) in hidden's dtype, as the models' own loops do, where the
        float32 reference keeps float32: in float16 a value past 65504 there is inf on
        both paths and finite in the reference.

    NaN and inf reach the output and every gradient they touch, on both paths. Where they
    meet a sum of terms of both signs, the Triton path's router-weight gradient (``dout .
    (a @ w_down.T) + dout . down_bias``, without forming the expert's output ``y``) and
    its gradients through an infinite router weight can differ from the reference's (NaN
    against +-inf, or the other way round), as any reordering of such a sum does.
    """
    args = (hidden, expert_ids, router_weights, w_gate_up, w_down, gate_up_bias, down_bias)
    path, _, s = _resolve(*args, activation, linear_offset, clamp_value, gate_up_layout,
                          impl, fp8_input_store)
    if path == "torch":
        with nvtx_range(OP, "torch"):
            if (torch.compiler.is_compiling() and hidden.device.type == "cpu"
                    and not torch.is_autocast_enabled("cpu")):
                return _torch_path_op(*args, *_op_args(s))  # (one op: see above)
            return _torch_path(*args, s)
    if hidden.stride(-1) != 1 or (hidden.shape[0] > 1 and hidden.stride(0) < hidden.shape[1]):
        hidden = hidden.contiguous()
    # The kernels read the biases at stride 1 and the weights at any strides.
    gate_up_bias = gate_up_bias.contiguous() if gate_up_bias is not None else None
    down_bias = down_bias.contiguous() if down_bias is not None else None
    args = (hidden, expert_ids, router_weights, w_gate_up, w_down, gate_up_bias, down_bias)
    if not (torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in args)):
        # Nothing to differentiate (inference, decoding): no autograd node, no h stored.
        with nvtx_range(OP, "fwd"):
            return _launch_fwd(*args, *_op_args(s), False)[0]
    return apply_function(_MoEExperts, *args, s)


@planner_of(moe_experts)
def plan_moe_experts(**a) -> Plan:
    path, reason, s = _resolve(**a)
    T, k, E, H, Fdim = s.T, s.k, s.E, s.H, s.F
    dtype = dtype_name(a["hidden"].dtype)
    details = {
        "routing": f"{T} tokens x {k} slots over {E} experts (H {H}, F {Fdim}, {dtype}): "
                   f"one stable sort of the {T * k} pairs by expert",
    }
    h = f"the gate/up output [{T * k}, {(2 if s.gated else 1) * Fdim}]"
    lin = f" + {s.linear_offset}" if s.linear_offset else ""
    details["activation"] = (f"{s.act}(gate) * (up{lin}), gate/up {s.gate_up_layout}"
                             if s.gated else s.act)
    if s.clamp_value is not None:
        details["clamp"] = (f"gate <= {s.clamp_value}, |up| <= {s.clamp_value} (after "
                            f"the bias)")
    if path == "triton":
        h0 = a["hidden"]
        c = _config(h0.device, T * k, H, Fdim)
        if T * k and _grouped_engine(h0, a["w_gate_up"], a["w_down"], T * k, c):
            details["kernels"] = ("torch._grouped_mm for the GEMMs over the experts' row "
                                  "ranges; bias + activation, then down bias + router weight + "
                                  "slot sum, in element-wise kernels")
        else:
            details["kernels"] = ("grouped GEMMs over the experts' row tiles (gate/up + "
                                  "activation, down + router weight), then the slot sum" +
                                  (" (k = 1: written in place)" if k == 1 else ""))
            details["tiles"] = (f"{c.block_m} x {c.block_n} x {c.block_k}, {c.warps} warps, "
                                f"{c.stages} stages ({c.tiles_from} of the moe_experts "
                                "tuning section)")
        details["saved for backward"] = (f"inputs, routing and {h} "
                                         f"{'float8_e4m3fn' if s.fp8_input_store else dtype}")
    else:
        details["torch"] = "per-expert F.linear on contiguous slices; reads the counts on the host"
        if s.fp8_input_store:
            details["saved for backward"] = f"{h} as float8_e4m3fn"
    return Plan(OP, path, reason, details, call=s)


def checks(device: torch.device, dtypes) -> list:
    """Fresh random cases (SwiGLU with biases, GPT-OSS's clamped interleaved Quick-GEGLU,
    top-1 squared ReLU; SwiGLU with ``fp8_input_store`` in fp16/bf16), for
    :mod:`lmfuse._check`."""
    from .._check import op_case

    small = device.type != "cuda"
    T, H, Fdim, E = (9, 32, 24, 4) if small else (512, 1024, 768, 8)

    def case(label, dtype, k, activation, bias, **kw):
        K2 = 2 * Fdim if ref.ACTIVATIONS[activation][1] else Fdim
        ids = torch.stack([torch.randperm(E, device=device)[:k] for _ in range(T)])
        # The grouped-GEMM engine keeps the float8 copy of h rounded through its bf16 GEMM
        # output (module docstring), and the torch path (the CPU's default without Triton)
        # through its GEMM in the input's dtype: the float64 oracle rounds the same way.
        gemm_dtype = None
        gemm_bias = select_impl(OP, "auto", device)[0] == "torch"
        if kw.get("fp8_input_store") and (gemm_bias or _grouped_engine(
                torch.empty(T, H, dtype=dtype, device=device),
                torch.empty(E, K2, H, dtype=dtype, device=device),
                torch.empty(E, H, Fdim, dtype=dtype, device=device), T * k,
                _config(device, T * k, H, Fdim))):
            gemm_dtype = dtype

        def inputs():
            t = [torch.randn(T, H, device=device).to(dtype),
                 torch.rand(T, k, device=device),
                 (torch.randn(E, K2, H, device=device) * H ** -0.5).to(dtype),
                 (torch.randn(E, H, Fdim, device=device) * Fdim ** -0.5).to(dtype)]
            if bias:
                t += [(torch.randn(E, K2, device=device) * 0.3).to(dtype),
                      (torch.randn(E, H, device=device) * 0.3).to(dtype)]
            t = [x.requires_grad_(True) for x in t]
            return [t[0], ids, *t[1:]]

        def experts(*args, impl, **options):
            if impl == "torch" and gemm_dtype is not None:  # the call as the op resolves it
                s = plan_moe_experts(*args, impl="torch", **options).call
                return _torch_path(*args, options.get("gate_up_bias"),
                                   options.get("down_bias"), s, gemm_dtype, gemm_bias)
            return moe_experts(*args, impl=impl, **options)

        return op_case(OP, label, dtype, (T, H, Fdim, E, k), inputs, experts, plan_moe_experts,
                       keywords=("gate_up_bias", "down_bias") if bias else (),
                       activation=activation, **kw)

    cases = []
    for dtype in dtypes:
        cases += [
            case("swiglu+bias", dtype, 2, "swiglu", True),
            case("gpt-oss", dtype, 2, "quick_geglu", True, linear_offset=1.0,
                 clamp_value=7.0, gate_up_layout="interleaved"),
            case("squared_relu k=1", dtype, 1, "squared_relu", False),
        ]
        if dtype != torch.float32:
            # Against the float64 torch path with the option (h rounded to float8 there
            # too). Not float32's bound: the float32 and float64 h differ in their last
            # bits, and one of the [T k, 2F] values landing on the other side of a float8
            # tie moves its gradients by more than 1e-5.
            cases.append(case("swiglu+bias fp8 store", dtype, 2, "swiglu", True,
                              fp8_input_store=True))
    return cases
