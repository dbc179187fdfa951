"""``apply_rotary_pos_emb``: validation, dispatch, launch configuration and autograd.

The public function has transformers' signature (``q, k, cos, sin, unsqueeze_dim=1``), so
a model's module can take it in place of its own. It checks its inputs once
(:func:`_resolve`), then runs the reference (``impl="torch"``, and wherever
``cos`` or ``sin`` need a gradient: autograd through the formula) or one autograd function
around one Triton kernel: the forward rotates the queries and the keys in one launch; the
backward rotates their gradients back (the transpose: ``-sin``) in one more. Nothing is
saved for the backward but ``cos`` and ``sin``. Under ``torch.compile`` the launch goes
through the ``torch.library`` custom op ``lmfuse::rotary``, so the graph does not break.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import tuning
from .._dispatch import (
    Plan,
    ResolvedCall,
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


def _config(heads: int, D: int, device: torch.device) -> tuple[int, int]:
    """``(BLOCK_H, num_warps)``: about ``tile_elems`` values a program (heads of ``D``
    values: rotated, or passed through past a partial rotary's, whose tile is as wide),
    from the ``rope`` tuning section. (H200, bf16, D 128, 32 or 64 query
    heads and 8 key heads: 4096 values and 4 warps fastest of 1024-16384 and 2-8 warps,
    2048 with 4 within 6%; 8 warps 3-32% slower.)"""
    t = tuning.table("rope", device)
    block_h = max(1, min(next_pow2(max(heads, 1)), t["tile_elems"] // max(D, 2)))
    return block_h, t["num_warps"]


def _layout(x: torch.Tensor, heads_dim: int) -> tuple[int, int, int]:
    """``x``'s ``(batch, head, token)`` strides for heads at dim ``heads_dim``."""
    sb, s1, s2, _ = x.stride()
    return (sb, s1, s2) if heads_dim == 1 else (sb, s2, s1)


def _rows(t: torch.Tensor) -> tuple[int, int]:
    """A ``cos``/``sin`` table's ``(batch, token)`` strides (batch 0: one table for all)."""
    if t.dim() == 2:
        return 0, t.stride(0)
    return (0 if t.shape[0] == 1 else t.stride(0)), t.stride(1)


def _fake(q, k, cos, sin, heads_dim, backward):
    return torch.empty_like(q), torch.empty_like(k)


@kernel_op("rotary", _fake)
def launch_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  heads_dim: int, backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_out, k_out)``, each like its input (``empty_like``: its dtype, and its strides
    where it is dense): ``q`` and ``k`` rotated by ``cos``, ``sin`` (``backward``: by their
    transpose, for the gradients). Heads at dim ``heads_dim`` (1 or 2); each head's values
    contiguous."""
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    u = heads_dim
    B, S = q.shape[0], q.shape[3 - u]
    Hq, Hk, D, R = q.shape[u], k.shape[u], q.shape[-1], cos.shape[-1]
    if B * S == 0 or Hq + Hk == 0 or D == 0:
        return qo, ko
    block_h, warps = _config(max(Hq, Hk), D, q.device)
    grid = (B * S, cdiv(Hq, block_h) + cdiv(Hk, block_h))
    _kernels().rope_kernel[grid](
        q, *_layout(q, u), qo, *_layout(qo, u), Hq,
        k, *_layout(k, u), ko, *_layout(ko, u), Hk,
        cos, *_rows(cos), sin, *_rows(sin), S, R // 2, D,
        BACKWARD=backward, BLOCK_H=block_h, BLOCK_R=next_pow2(max(R // 2, 1), 16),
        HAS_PASS=R < D, BLOCK_P=next_pow2(max(D - R, 1), 16), num_warps=warps)
    return qo, ko


class _Rotary(torch.autograd.Function):
    """``(q_embed, k_embed)`` on the Triton path; gradients for q and k."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, heads_dim):
        with nvtx_range(_OP, "fwd"):
            ctx.u = heads_dim
            ctx.save_for_backward(cos, sin)
            qo, ko = launch_rotary(q, k, cos, sin, heads_dim, False)
            # (an output whose input takes no gradient needs none, as through the formula)
            ctx.mark_non_differentiable(*(o for o, need in zip((qo, ko), ctx.needs_input_grad)
                                          if not need))
            return qo, ko

    @staticmethod
    @once_differentiable
    def backward(ctx, dq, dk):
        with nvtx_range(_OP, "bwd"):
            cos, sin = ctx.saved_tensors
            dq = dq if dq.stride(-1) == 1 else dq.contiguous()
            dk = dk if dk.stride(-1) == 1 else dk.contiguous()
            dq, dk = launch_rotary(dq, dk, cos, sin, ctx.u, True)
            return dq, dk, None, None, None


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
    """Validate the arguments and choose the path; cheap and traceable by torch.compile.

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
    B, S, D = q.shape[0], q.shape[3 - u], q.shape[-1]
    layout = "[B, H, S, D]" if u == 1 else "[B, S, H, D]"
    if k.shape[0] != B or k.shape[3 - u] != S or k.shape[-1] != D:
        raise ValueError(f"{_OP}: k must be {layout} with q's batch, tokens and head size "
                         f"(q {tuple(q.shape)}), got {tuple(k.shape)}")
    R = cos.shape[-1]
    batch = cos.shape[0] if t == 3 else 1
    if cos.shape[-2] != S or batch not in (1, B) or R % 2 or not 0 < R <= D:
        raise ValueError(f"{_OP}: cos and sin must be [B, S, R] or [S, R] with q's B = {B}, "
                         f"S = {S} (or a batch of 1) and an even R of at most the head size "
                         f"{D}, got {tuple(cos.shape)}")
    check_same_device(_OP, "q", q, k=k, cos=cos, sin=sin)
    path, reason = select_impl(_OP, impl, q.device)
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        path, reason = float64_fallback(_OP, impl, path, reason, t.dtype, name)
    if path == "triton" and torch.is_grad_enabled() and (cos.requires_grad
                                                         or sin.requires_grad):
        path, reason = "torch", f"{reason}; cos or sin needs a gradient: the reference"
    return path, reason, RotaryCall(u, unsqueeze_dim, B, S, q.shape[u], k.shape[u], D, R)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, unsqueeze_dim: int = 1, *, impl: str = "auto"
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of queries and keys: ``x * cos + rotate_half(x) * sin``
    on each head's first ``R`` values (``R = cos.shape[-1]``; the rest pass through),
    transformers' ``apply_rotary_pos_emb`` with its signature.

    Float32 math (float64 for float64 inputs on the reference path), each output rounded
    once to its input's dtype (transformers' eager code rounds each step in the queries'
    dtype: in bf16 the two differ by a few roundings).

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
        ``(q_embed, k_embed)`` in q's and k's dtypes and shapes (on the Triton path with
        their strides where they are dense, transformers' transposed views included;
        contiguous otherwise, e.g. slices of a fused qkv); gradients for q and k (and cos,
        sin on the reference path).

    NaN and inf propagate as in the formula: a NaN in a head's value makes the values it
    pairs with NaN; an inf too, and NaN where it meets a sine or cosine of 0.
    """
    path, _, a = _resolve(q, k, cos, sin, unsqueeze_dim, impl)
    if path == "torch" or native_cpu(impl, path, q):
        with nvtx_range(_OP, "fwd"):
            return rotary_reference(q, k, cos, sin, unsqueeze_dim)
    u = a.heads_dim
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _Rotary.apply(q, k, cos, sin, u)
    with nvtx_range(_OP, "fwd"):
        return launch_rotary(q, k, cos, sin, u, False)


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
    }
    if path == "triton":
        block_h, warps = _config(max(a.Hq, a.Hk), a.D, q.device)
        details["launch"] = (f"{a.B * a.S} tokens x {cdiv(a.Hq, block_h) + cdiv(a.Hk, block_h)}"
                             f" head blocks of {block_h}, {warps} warps; q and k in one "
                             "launch each way")
        details["saved for backward"] = "cos, sin"
    if native_cpu(impl, path, q):
        reason += "; CPU float32: the reference's PyTorch ops (the formula's own)"
    return Plan(_OP, path, reason, details, call=a)


def _both(*args: Any, **kwargs: Any) -> torch.Tensor:
    """The op's two outputs as one flat tensor (the self-check compares one)."""
    return torch.cat([t.flatten() for t in apply_rotary_pos_emb(*args, **kwargs)])


def checks(device: torch.device, dtypes) -> list:
    """Fresh random cases (the attention layout, [B, S, H, D], partial rotary, one table
    for every sequence) for :mod:`lmfuse._check`."""
    from .._check import op_case

    small = device.type != "cuda"
    B, S, Hq, Hk, D = (2, 5, 4, 2, 16) if small else (4, 1024, 32, 8, 128)

    def case(label, dtype, u=1, R=D, table_batch=B):
        def inputs():
            shape = (B, Hq, S, D) if u == 1 else (B, S, Hq, D)
            kshape = (B, Hk, S, D) if u == 1 else (B, S, Hk, D)
            angle = torch.rand(table_batch, S, R // 2, device=device) * 6.3
            angle = torch.cat((angle, angle), -1)
            return [torch.randn(shape, device=device).to(dtype).requires_grad_(True),
                    torch.randn(kshape, device=device).to(dtype).requires_grad_(True),
                    angle.cos().to(dtype), angle.sin().to(dtype)]

        return op_case(_OP, label, dtype, (B, S, Hq, D), inputs, _both, plan_rotary, u)

    cases = []
    for dtype in dtypes:
        cases += [case("[B, H, S, D]", dtype), case("[B, S, H, D]", dtype, u=2),
                  case("partial rotary", dtype, R=D // 2), case("one table", dtype,
                                                                 table_batch=1)]
    return cases
