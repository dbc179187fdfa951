"""``apply_rotary_pos_emb``: validation, dispatch, launch configuration and autograd.

The public function has transformers' signature (``q, k, cos, sin, unsqueeze_dim=1``), so
a model's module can take it in place of its own. It checks its inputs once
(:func:`_check`), then runs the reference (``impl="torch"``, and wherever
``cos`` or ``sin`` need a gradient: autograd through the formula), the CPU path (float32 CPU
tensors without Triton: :func:`_cpu_rotary`, the formula in fewer passes, an autograd node
for q and one for k) or one autograd function around one Triton kernel: the forward rotates
the queries and the keys in one launch; the backward rotates their gradients back (the
transpose: ``-sin``) in one more, so q's and k's outputs share one autograd node (backward
through both at once, or keep the graph for a second pass). Nothing is saved for the
backward but ``cos`` and ``sin`` (on the CPU path, ``sin`` with its sign). Under
``torch.compile`` the launch goes through the ``torch.library`` custom op
``lmfuse::rotary``, so the graph does not break.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .. import tuning
from .._dispatch import (
    PLAIN_TENSORS,
    Plan,
    ResolvedCall,
    apply_function,
    check_same_device,
    check_tensor,
    float64_fallback,
    native_cpu,
    once_differentiable,
    planner_of,
    select_impl,
)
from .._launch import cdiv, dtype_name, kernel_op, lazy_kernels, next_pow2
from .._nvtx import nvtx_range
from .reference import rotary_reference

_OP = "apply_rotary_pos_emb"
_kernels = lazy_kernels("kernels", __package__)


class _Constexprs(NamedTuple):
    """The kernel's compile-time arguments, in its order (passed positionally)."""

    Hq: int
    Hk: int
    half: int  # R / 2
    D: int
    backward: bool
    block_hq: int
    block_hk: int
    block_r: int
    has_pass: bool  # R < D: the values past R copied
    block_p: int
    loop: bool  # a program has more than one block of q or of k


def _config(tokens: int, Hq: int, Hk: int, D: int, R: int, backward: bool,
            device: torch.device) -> tuple[int, _Constexprs, int]:
    """``(splits, constexprs, num_warps)`` of a launch, from the ``rope`` tuning section: a
    program rotates a token's query heads, then its key heads, about ``tile_elems`` values
    (heads of ``D``) at a time; with fewer tokens than SMs (decoding) tiles of
    ``few_tokens_tile_elems`` and each token's blocks split over ``splits`` programs (one
    block of q and of k each). (H200, bf16, D 128, 32 or 64 query heads and 8 key heads,
    [B, S, H, D] q and k of 8K-32K tokens, CUDA graphs: one program a token with 4 warps
    runs the forward in 0.96-1.00x Liger-Kernel's time (its kernel is of that design), where
    a program for the queries and one for the keys took 1.14-1.18x as long; 8 warps up to
    15% and 2 or 16 warps 16-24% slower; 8192-value tiles 6% faster than 4096 at 64 query
    heads.)"""
    sms, tile, few_tile, warps = _device_settings(device, tuning.generation())
    few = tokens < sms
    return _constexprs(few, Hq, Hk, D, R, backward, few_tile if few else tile, warps)


@functools.lru_cache(maxsize=64)
def _device_settings(device: torch.device, generation: int) -> tuple[int, int, int, int]:
    """``(SMs, tile_elems, few_tokens_tile_elems, num_warps)`` of ``device`` (looked up once
    per device and tuning generation: the lookup is host time on every call)."""
    t = tuning.table("rope", device)
    return (tuning.sm_count(device), t["tile_elems"], t["few_tokens_tile_elems"],
            t["num_warps"])


@functools.lru_cache(maxsize=256)
def _constexprs(few: bool, Hq: int, Hk: int, D: int, R: int, backward: bool, tile: int,
                warps: int) -> tuple[int, _Constexprs, int]:
    per_tile = max(1, tile // max(D, 2))
    per_tile = 1 << (per_tile.bit_length() - 1)  # (a power of two: the kernel's arange)
    block_hq, block_hk = (min(next_pow2(max(h, 1)), per_tile) for h in (Hq, Hk))
    splits = max(cdiv(Hq, block_hq), cdiv(Hk, block_hk)) if few else 1
    return splits, _Constexprs(
        Hq, Hk, R // 2, D, backward, block_hq, block_hk, next_pow2(max(R // 2, 1), 16), R < D,
        next_pow2(max(D - R, 1), 16), Hq > splits * block_hq or Hk > splits * block_hk), warps


def _rows(t: torch.Tensor) -> tuple[int, int]:
    """A ``cos``/``sin`` table's ``(batch, token)`` strides (batch 0: one table for all)."""
    st = t.stride()
    if len(st) == 2:
        return 0, st[0]
    return (0 if t.shape[0] == 1 else st[0]), st[1]


def _fake(q, k, cos, sin, heads_dim, backward, q_dtype, k_dtype):
    return torch.empty_like(q, dtype=q_dtype), torch.empty_like(k, dtype=k_dtype)


@kernel_op("rotary", _fake)
def launch_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  heads_dim: int, backward: bool, q_dtype: torch.dtype, k_dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_out, k_out)`` in ``q_dtype`` and ``k_dtype``, each like its input otherwise
    (``empty_like``: its strides where it is dense): ``q`` and ``k`` rotated by ``cos``,
    ``sin`` (``backward``: by their transpose, for the gradients). Heads at dim
    ``heads_dim`` (1 or 2); each head's values contiguous."""
    qo, ko = torch.empty_like(q, dtype=q_dtype), torch.empty_like(k, dtype=k_dtype)
    h, t = (1, 2) if heads_dim == 1 else (2, 1)  # the heads' and the tokens' dims
    qs, ks = q.shape, k.shape
    B, S, Hq, Hk, D, R = qs[0], qs[t], qs[h], ks[h], qs[3], cos.shape[-1]
    if B * S == 0 or Hq + Hk == 0 or D == 0:
        return qo, ko
    splits, constexprs, warps = _config(B * S, Hq, Hk, D, R, backward, q.device)
    sq, sk = q.stride(), k.stride()
    # (every argument positional, the constexprs too: the launch binds no keywords)
    q_order, k_order = _dense_order(sq, S, Hq, D, h), _dense_order(sk, S, Hk, D, h)
    if q_order is not None and k_order is not None and cos.is_contiguous() \
            and sin.is_contiguous() and S * D < _DENSE_HEAD_STRIDE_LIMIT:
        # (empty_like keeps a dense input's strides: the outputs are laid out as q and k)
        _kernels().rope_dense_kernel[(B * S, splits)](
            q, qo, k, ko, cos, sin, S, *constexprs, q_order, k_order,
            cos.dim() == 3 and cos.shape[0] != 1, num_warps=warps)
        return qo, ko
    so, sp = qo.stride(), ko.stride()
    _kernels().rope_kernel[(B * S, splits)](
        q, sq[0], sq[h], sq[t], qo, so[0], so[h], so[t],
        k, sk[0], sk[h], sk[t], ko, sp[0], sp[h], sp[t],
        cos, *_rows(cos), sin, *_rows(sin), S, *constexprs, num_warps=warps)
    return qo, ko


#: The dense launch computes a heads-outer head stride, ``S * D``, in 32 bits: from this
#: size the strided launch, whose strides come as 64-bit arguments where they need it.
_DENSE_HEAD_STRIDE_LIMIT = 1 << 31


def _dense_order(stride: tuple[int, ...], S: int, H: int, D: int, heads_dim: int
                 ) -> bool | None:
    """Whether a q or k of these strides is dense with its heads outer (``[B, H, S, D]`` in
    memory: True) or its tokens outer (``[B, S, H, D]``: False); None if neither."""
    if heads_dim == 1:  # [B, H, S, D] shapes
        if stride == (S * H * D, D, H * D, 1):
            return False
        return True if stride == (H * S * D, S * D, D, 1) else None
    if stride == (S * H * D, H * D, D, 1):
        return False
    return True if stride == (H * S * D, D, S * D, 1) else None


def _out_dtypes(q, k, cos, sin) -> tuple[torch.dtype, torch.dtype]:
    """The outputs' dtypes: what transformers' formula gives, each input promoted with the
    tables' (bf16 q and k with float32 tables, as under autocast: float32)."""
    qd, kd, cd = q.dtype, k.dtype, cos.dtype
    if qd is kd is cd is sin.dtype:  # (the common call: nothing to promote)
        return qd, kd
    table = torch.promote_types(cd, sin.dtype)
    return torch.promote_types(qd, table), torch.promote_types(kd, table)


class _Rotary(torch.autograd.Function):
    """``(q_embed, k_embed)`` on the Triton path; gradients for q and k."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, heads_dim, out_dtypes):
        with nvtx_range(_OP, "fwd"):
            ctx.launch = (heads_dim, True, q.dtype, k.dtype)  # (the backward's arguments)
            ctx.save_for_backward(cos, sin)
            qo, ko = launch_rotary(q, k, cos, sin, heads_dim, False, *out_dtypes)
            need_q, need_k = ctx.needs_input_grad[:2]
            if not (need_q and need_k):
                # (an output whose input takes no gradient needs none, as through the formula)
                ctx.mark_non_differentiable(*(o for o, need in ((qo, need_q), (ko, need_k))
                                              if not need))
            return qo, ko

    @staticmethod
    @once_differentiable
    def backward(ctx, dq, dk):
        with nvtx_range(_OP, "bwd"):
            cos, sin = ctx.saved_tensors
            dq = dq if dq.stride(-1) == 1 else dq.contiguous()
            dk = dk if dk.stride(-1) == 1 else dk.contiguous()
            dq, dk = launch_rotary(dq, dk, cos, sin, *ctx.launch)
            return dq, dk, None, None, None, None


# --- the CPU path ------------------------------------------------------------------------------


def _roll_half(x: torch.Tensor, h: int) -> torch.Tensor:
    """``[x2, x1]`` for ``x = [x1, x2]`` (halves of ``h`` along the last dim)."""
    return torch.cat((x[..., h:], x[..., :h]), -1)


def _cpu_formula_takes(q, k, cos, sin) -> bool:
    """Whether :func:`_cpu_rotary` computes this call (plain float32 tensors everywhere,
    every value of a head rotated, no gradient wanted for the tables); the reference
    otherwise (fake tensors and other subclasses included)."""
    f32, plain = torch.float32, PLAIN_TENSORS
    return (k.dtype is f32 and cos.dtype is f32 and sin.dtype is f32
            and type(q) in plain and type(k) in plain and type(cos) in plain
            and type(sin) in plain and cos.shape[-1] == q.shape[-1]
            and not ((cos.requires_grad or sin.requires_grad) and torch.is_grad_enabled()))


def _cpu_rotary(q, k, cos, sin, unsqueeze_dim) -> tuple[torch.Tensor, torch.Tensor]:
    """The default path on float32 CPU tensors: ``x * cos + [x2, x1] * sin'`` with ``sin' =
    [-sin1, sin2]`` (transformers' ``x * cos + rotate_half(x) * sin`` with the sign moved
    onto the table, which q and k share), the product and the sum as one ``addcmul``: three
    operations a tensor where that formula takes five; its gradient (:class:`_RotaryCPU`)
    the transpose in three more, where autograd through the formula also fills the slices'
    gradients with zeros. Its values are the formula's within a rounding (``addcmul`` may
    fuse the multiply and the add); NaN and inf as the formula's. q and k get an autograd
    node each, as through the formula (each backward can run on its own)."""
    h = cos.shape[-1] // 2
    c = cos.unsqueeze(unsqueeze_dim)
    signed = (sin * _half_signs(h, sin.device)).unsqueeze(unsqueeze_dim)
    grad = torch.is_grad_enabled()
    return tuple(apply_function(_RotaryCPU, x, c, signed, h) if grad and x.requires_grad
                 else torch.addcmul(x * c, _roll_half(x, h), signed) for x in (q, k))


@functools.lru_cache(maxsize=16)
def _half_signs(h: int, device: torch.device) -> torch.Tensor:
    """``[-1] * h + [1] * h`` in float32 on ``device`` (times the sine: the sign of
    ``rotate_half``), whatever the default dtype and device."""
    return torch.cat((torch.full((h,), -1.0, dtype=torch.float32, device=device),
                      torch.ones(h, dtype=torch.float32, device=device)))


class _RotaryCPU(torch.autograd.Function):
    """One tensor of :func:`_cpu_rotary` with its gradient, ``dy * cos + [dy2, dy1] *
    [sin2, -sin1]`` (the transpose; torch ops, so differentiable again), its forward-mode
    derivative and, for ``torch.func``, its context set apart and its vmap rule generated.
    The tables take no gradient here (a call whose tables need one runs the reference)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, c, signed, h):
        return torch.addcmul(x * c, _roll_half(x, h), signed)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, c, signed, h = inputs
        ctx.save_for_backward(c, signed)
        ctx.save_for_forward(x, c, signed)
        ctx.h = h

    @staticmethod
    def backward(ctx, dy):
        c, signed = ctx.saved_tensors
        h = ctx.h
        return torch.addcmul(dy * c, _roll_half(dy, h), _roll_half(signed, h)), None, None, None

    @staticmethod
    def jvp(ctx, dx, dc, dsigned, _):
        x, c, signed = ctx.saved_tensors
        h = ctx.h
        out = (torch.zeros_like(x) if dx is None
               else torch.addcmul(dx * c, _roll_half(dx, h), signed))
        if dc is not None:  # (tangents of the tables: the product rule's other terms)
            out = out + x * dc
        if dsigned is not None:
            out = out + _roll_half(x, h) * dsigned
        return out


# --- validation, planning, the public function ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class RotaryCall(ResolvedCall):
    """A checked :func:`apply_rotary_pos_emb` call: what the launch and the planner read."""

    heads_dim: int  # 1 or 2: the heads' dim of q and k
    unsqueeze_dim: int  # as given (transformers' meaning: where the table gains a dim)
    B: int
    S: int
    Hq: int
    Hk: int
    D: int  # the head size
    R: int  # the rotated values of each head (cos's last dim)


def _resolve(q, k, cos, sin, unsqueeze_dim, impl) -> tuple[str, str, RotaryCall]:
    """Validate the arguments and choose the path (:func:`_check`), and the call the
    planner reads."""
    path, reason, u = _check(q, k, cos, sin, unsqueeze_dim, impl)
    qs = q.shape
    return path, reason, RotaryCall(u, unsqueeze_dim, qs[0], qs[3 - u], qs[u], k.shape[u],
                                    qs[3], cos.shape[-1])


def _check(q, k, cos, sin, unsqueeze_dim, impl) -> tuple[str, str, int]:
    """``(path, reason, heads_dim)``: the arguments validated and the path chosen; cheap
    and traceable by torch.compile (the call runs on this alone: a frozen dataclass of the
    call would add a microsecond of host time).

    ``unsqueeze_dim`` means what it means in transformers: the dim of the table at which a
    1 is inserted before the table broadcasts against q, so the heads' dim of q is that
    dim of the table's unsqueezed form aligned to q's last dims (``[B, S, R]`` tables: 1
    or 2, -3 or -2; ``[S, R]`` ones: 0 or 1, -3 or -2, as Pixtral calls it with 0)."""
    for name, t in (("q", q), ("k", k)):
        check_tensor(_OP, name, t, ndim=4)
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(_OP, name, t, ndim=(2, 3))
    if cos.shape != sin.shape:
        raise ValueError(f"{_OP}: cos and sin must have one shape, got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}")
    if type(unsqueeze_dim) is not int:
        raise TypeError(f"{_OP}: unsqueeze_dim must be an int, got "
                        f"{type(unsqueeze_dim).__name__} {unsqueeze_dim!r}")
    t = cos.dim()
    at = unsqueeze_dim + t + 1 if unsqueeze_dim < 0 else unsqueeze_dim
    u = at + 3 - t  # the heads' dim of q once the unsqueezed table is aligned to its dims
    if not 0 <= at <= t or u not in (1, 2):
        wants = "1 or 2 (or -3, -2)" if t == 3 else "0 or 1 (or -3, -2)"
        raise ValueError(f"{_OP}: unsqueeze_dim must put the heads at dim 1 ([B, H, S, D] q "
                         f"and k) or 2 ([B, S, H, D]): for {t}-D tables {wants}, got "
                         f"{unsqueeze_dim}")
    qs, ks, cs = q.shape, k.shape, cos.shape
    B, S, D = qs[0], qs[3 - u], qs[3]
    if ks[0] != B or ks[3 - u] != S or ks[3] != D:
        layout = "[B, H, S, D]" if u == 1 else "[B, S, H, D]"
        raise ValueError(f"{_OP}: k must be {layout} with q's batch, tokens and head size "
                         f"(q {tuple(qs)}), got {tuple(ks)}")
    R = cs[-1]
    batch = cs[0] if t == 3 else 1
    if cs[-2] != S or batch not in (1, B) or R % 2 or not 0 < R <= D:
        raise ValueError(f"{_OP}: cos and sin must be [B, S, R] or [S, R] with q's B = {B}, "
                         f"S = {S} (or a batch of 1) and an even R of at most the head size "
                         f"{D}, got {tuple(cs)}")
    dev = q.device
    if k.device != dev or cos.device != dev or sin.device != dev:
        check_same_device(_OP, "q", q, k=k, cos=cos, sin=sin)  # (raises, naming the one)
    path, reason = select_impl(_OP, impl, dev)
    f64 = torch.float64
    if f64 in (q.dtype, k.dtype, cos.dtype, sin.dtype):
        for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
            path, reason = float64_fallback(_OP, impl, path, reason, t.dtype, name)
    if path == "triton" and (cos.requires_grad or sin.requires_grad) and torch.is_grad_enabled():
        path, reason = "torch", f"{reason}; cos or sin needs a gradient: the reference"
    return path, reason, u


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, unsqueeze_dim: int = 1, *, impl: str = "auto"
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of queries and keys: ``x * cos + rotate_half(x) * sin``
    on each head's first ``R`` values (``R = cos.shape[-1]``; the rest pass through),
    transformers' ``apply_rotary_pos_emb`` with its signature.

    Float32 math (float64 for float64 inputs on the reference path), each output rounded
    once to its dtype (transformers' eager code rounds each step in that dtype: in bf16 the
    two differ by a few roundings). The outputs' dtypes are the formula's: each input's
    promoted with the tables' (bf16 q and k with float32 tables, as under autocast, give
    float32 outputs and bf16 gradients).

    Args:
        q: ``[B, Hq, S, D]`` (the attention layout) or ``[B, S, Hq, D]``, as
            ``unsqueeze_dim`` says; float32/float16/bfloat16 (float64 on the torch path);
            any strides (a head's values are read contiguous: copied once if not).
        k: ``[B, Hk, S, D]`` likewise (its own head count and dtype).
        cos, sin: ``[B, S, R]`` or ``[S, R]`` (a batch of 1 broadcast), any float dtype, on
            q's device; ``R`` even, at most ``D``. If they require a gradient, the call runs
            the reference (autograd through the formula) and they get theirs.
        unsqueeze_dim: transformers' meaning: the dim of the tables that gains a 1 before
            they broadcast against q. ``[B, S, R]`` tables: 1 for ``[B, H, S, D]`` q and k,
            2 for ``[B, S, H, D]``; ``[S, R]`` tables: 0 and 1 (negative dims too).
        impl: ``"auto"`` (Triton on CUDA or under the interpreter, else the reference),
            ``"triton"`` or ``"torch"``; see :func:`lmfuse.explain`.

    Returns:
        ``(q_embed, k_embed)`` in q's and k's shapes, their dtypes promoted with the
        tables' (``torch.promote_types``, as the formula's products), (on the Triton path with
        their strides where they are dense, transformers' transposed views included;
        contiguous otherwise, e.g. slices of a fused qkv); gradients for q and k (and cos,
        sin on the reference path).

    NaN and inf propagate as in the formula: a NaN in a head's value makes the values it
    pairs with NaN; an inf too, and NaN where it meets a sine or cosine of 0.
    """
    return rotary(q, k, cos, sin, unsqueeze_dim, impl, True)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           unsqueeze_dim: int, impl: str, promote: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rotary_pos_emb`, with its outputs' dtypes chosen: ``promote`` True,
    the formula's (q's and k's promoted with the tables'); False, q's and k's (the math
    unchanged, one rounding), for modeling functions that cast their results back to
    their inputs' dtypes (OLMo 2's, under autocast)."""
    path, _, u = _check(q, k, cos, sin, unsqueeze_dim, impl)
    if path == "torch":
        with nvtx_range(_OP, "fwd"):
            if native_cpu(impl, path, q) and _cpu_formula_takes(q, k, cos, sin):
                return _cpu_rotary(q, k, cos, sin, unsqueeze_dim)
            return rotary_reference(q, k, cos, sin, unsqueeze_dim, promote=promote)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    dtypes = _out_dtypes(q, k, cos, sin) if promote else (q.dtype, k.dtype)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return apply_function(_Rotary, q, k, cos, sin, u, dtypes)
    with nvtx_range(_OP, "fwd"):
        return launch_rotary(q, k, cos, sin, u, False, *dtypes)


@planner_of(apply_rotary_pos_emb)
def plan_rotary(q, k, cos, sin, unsqueeze_dim, impl) -> Plan:
    """What :func:`apply_rotary_pos_emb` would do with these arguments."""
    path, reason, a = _resolve(q, k, cos, sin, unsqueeze_dim, impl)
    layout = "[B, H, S, D]" if a.heads_dim == 1 else "[B, S, H, D]"
    details: dict[str, Any] = {
        "q": f"{list(q.shape)} {dtype_name(q.dtype)} ({layout}): {a.Hq} heads of {a.D}",
        "k": f"{list(k.shape)} {dtype_name(k.dtype)}: {a.Hk} heads",
        "rotated": (f"the first {a.R} of {a.D} values of each head (the rest pass through)"
                    if a.R < a.D else f"all {a.D} values of each head"),
        "cos, sin": f"{list(cos.shape)} {dtype_name(cos.dtype)}"
                    + (" (one table for every sequence)" if cos.dim() == 2
                       or cos.shape[0] == 1 else ""),
        "outputs": "{}, {} (the formula's promotion)".format(
            *(dtype_name(d) for d in _out_dtypes(q, k, cos, sin))),
    }
    if path == "triton":
        splits, c, warps = _config(a.B * a.S, a.Hq, a.Hk, a.D, a.R, False, q.device)
        block_hq, block_hk = c.block_hq, c.block_hk
        per = f"{splits} programs" if splits > 1 else "one program"
        details["launch"] = (f"{a.B * a.S} tokens, {per} a token ({warps} warps): query "
                             f"heads {block_hq} at a time, key heads {block_hk}; q and k in "
                             "one launch each way")
        details["saved for backward"] = "cos, sin"
    if native_cpu(impl, path, q) and _cpu_formula_takes(q, k, cos, sin):
        reason += ("; CPU float32: the formula in PyTorch ops, the sign of rotate_half on "
                   "the table, its own backward")
    return Plan(_OP, path, reason, details, call=a)


def _both(*args: Any, **kwargs: Any) -> torch.Tensor:
    """The op's two outputs as one flat tensor (the self-check compares one)."""
    return torch.cat([t.flatten() for t in apply_rotary_pos_emb(*args, **kwargs)])


def checks(device: torch.device, dtypes) -> list:
    """Fresh random cases (the attention layout, [B, S, H, D], partial rotary, one table
    for every sequence, float32 tables with 16-bit q and k as under autocast, a decode
    step of fewer tokens than SMs: on the GPU, its head blocks split over programs; q and
    k sliced from one fused qkv: the strided launch) for :mod:`lmfuse._check`."""
    from .._check import op_case

    small = device.type != "cuda"
    B0, S0, Hq, Hk, D = (2, 5, 4, 2, 16) if small else (4, 1024, 32, 8, 128)

    def case(label, dtype, u=1, R=D, table_batch=None, B=B0, S=S0, table_dtype=None,
             qkv=False):
        table_batch = B if table_batch is None else table_batch

        def inputs():
            if qkv:  # q and k slices of one fused [B, Hq + 2 Hk, S, D]: the strided launch
                fused = torch.randn(B, Hq + 2 * Hk, S, D, device=device).to(dtype)
                q, k = fused[:, :Hq].detach(), fused[:, Hq:Hq + Hk].detach()
            else:
                shape = (B, Hq, S, D) if u == 1 else (B, S, Hq, D)
                kshape = (B, Hk, S, D) if u == 1 else (B, S, Hk, D)
                q = torch.randn(shape, device=device).to(dtype)
                k = torch.randn(kshape, device=device).to(dtype)
            angle = torch.rand(table_batch, S, R // 2, device=device) * 6.3
            angle = torch.cat((angle, angle), -1)
            return [q.requires_grad_(True), k.requires_grad_(True),
                    angle.cos().to(table_dtype or dtype), angle.sin().to(table_dtype or dtype)]

        return op_case(_OP, label, dtype, (B, S, Hq, D), inputs, _both, plan_rotary, u)

    cases = []
    for dtype in dtypes:
        cases += [case("[B, H, S, D]", dtype), case("[B, S, H, D]", dtype, u=2),
                  case("partial rotary", dtype, R=D // 2),
                  case("one table", dtype, table_batch=1),
                  case("decode", dtype, B=2, S=1), case("qkv slices", dtype, qkv=True)]
        if dtype != torch.float32:
            cases.append(case("float32 tables", dtype, table_dtype=torch.float32))
    return cases
