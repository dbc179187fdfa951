"""``linear_cross_entropy``: the loss of ``hidden @ weight.T (+ bias)`` without the logits.

Tokens go through in chunks of ``rows`` (as many as fit the chunk budget, never more, so
the extra memory does not grow with N). For each chunk:

1. ``logits = h @ W.T (+ b)``, a ``[rows, V_local]`` GEMM into a buffer reused by every chunk;
2. the cross-entropy kernels (or, on the torch path, the reference) reduce it to the token
   stats and, when gradients are needed, overwrite it with ``d loss / d logits``;
   with ``tp_group`` the ``[3, rows]`` stats are all-gathered first (one collective);
3. ``dh = G @ W`` and ``dW += G.T @ h`` (and ``db += sum G``), GEMMs in the inputs' dtype
   with float32 accumulation inside each.

So the three GEMMs every implementation needs run once each, and the logits are written
once and read twice by memory-bound passes between them. As in :func:`lmfuse.cross_entropy`,
the gradients are computed in the forward, for an upstream gradient of 1; backward only
rescales them (nothing to do when it is 1). With ``reduction="none"`` each token's upstream
gradient is known only in backward, which then recomputes the logits chunk by chunk (a
fourth GEMM). So does float16, for every reduction: its logits gradient, ``(p - y) / count``
for an upstream gradient of 1, would underflow float16's range at large V and N, where the
upstream gradient of fp16 training (a loss scale of 2**16, say) keeps it representable.

The weight gradient is summed over chunks in the weight's dtype (each chunk's GEMM adds to
it in float32 and rounds once): for bf16 weights that is one bf16 rounding per chunk,
which is why chunks are as large as the budget allows. Everything is deterministic: no
atomics, fixed chunking.

This file is the op: its checks and path (``_resolve``, :class:`LinearCrossEntropyCall`),
the autograd function and its chunk loop, the public function, its planner and the
``lmfuse check`` cases. The launch configuration (the tuning tables' entry, its guard, the
chunk rows) is in ``linear_config.py``, imported here under the same names (``config``,
``check_config``, ``chunk_rows``); the specification, ``linear_cross_entropy_reference``
(imported here too), and the per-token formulas of the torch path are in ``reference.py``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from .._dispatch import (PLAIN_TENSORS, Plan, ResolvedCall, apply_function, check_same_device,
                         check_tensor, cpu_fast, native_cpu, once_differentiable, planner_of)
from .._launch import cdiv, dtype_name
from .._nvtx import nvtx_range
from .._collectives import all_reduce_sum, all_reduce_sum_, group_rank
from . import ops
from . import reference as ref
from .linear_config import _OP, LCEConfig, _describe
from .linear_config import check_config as check_config
from .linear_config import chunk_rows as chunk_rows
from .linear_config import config as config
from .reference import linear_cross_entropy_reference as linear_cross_entropy_reference
from .vocab_parallel import gather_stats


@dataclass(frozen=True, slots=True)
class LinearCrossEntropyCall(ResolvedCall):
    """A checked :func:`linear_cross_entropy` call: the loss options (those of
    :func:`lmfuse.cross_entropy` on the logits-to-be, checked by its resolution) and what
    the chunked passes add. Its ``grad_needed`` and ``fused`` are the call's own (``loss``
    holds cross_entropy's, for logits that need no gradient: never read here)."""

    loss: ops.CrossEntropyCall
    needs: tuple[bool, bool, bool]  # gradients for hidden, weight, bias
    grad_needed: bool
    max_chunk_bytes: Optional[int]
    fused: bool  # the gradients computed in the forward
    config: Optional[LCEConfig]  # the chunk and kernel config (None on the native path)
    config_source: str
    fp32_logits: bool  # logits_in_fp32 for a half-precision hidden
    native: bool  # PyTorch's F.linear then F.cross_entropy
    token_scaling: bool  # use_token_scaling
    accum_fp32: bool = False  # accum_dtype=torch.float32 for a half-precision weight

    def as_dict(self) -> dict[str, Any]:
        """The fields by name, ``loss``'s flattened in (this call's ``grad_needed`` and
        ``fused`` over its)."""
        d = self.loss.as_dict()
        d.update((name, getattr(self, name)) for name in _OWN_FIELDS)
        return d


_OWN_FIELDS = tuple(f for f in LinearCrossEntropyCall.__dataclass_fields__ if f != "loss")


def _resolve(hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, softcap,
             reduction, tp_group, impl, max_chunk_bytes,
             cfg=None, logits_in_fp32=False, ce_weight=None, return_z_loss=False,
             return_token_accuracy=False, return_predicted_tokens=False,
             use_token_scaling=False, accum_dtype=None
             ) -> tuple[str, str, LinearCrossEntropyCall]:
    check_tensor(_OP, "hidden", hidden)
    if hidden.dim() < 1:
        raise ValueError(f"{_OP}: hidden must be [..., H], got a 0-D tensor")
    check_tensor(_OP, "weight", weight, ndim=2)
    if weight.dtype != hidden.dtype:
        raise TypeError(f"{_OP}: weight must have hidden's dtype {hidden.dtype}, "
                        f"got {weight.dtype}")
    H = hidden.shape[-1]
    if weight.shape[1] != H:
        raise ValueError(f"{_OP}: weight must be [V, H] with H = hidden.shape[-1] = {H}, "
                         f"got {tuple(weight.shape)}")
    if weight.shape[0] < 1:
        raise ValueError(f"{_OP}: weight must have at least one row (class), got V = 0")
    if bias is not None:
        check_tensor(_OP, "bias", bias, ndim=1)
        if bias.dtype != hidden.dtype:
            raise TypeError(f"{_OP}: bias must have hidden's dtype {hidden.dtype}, "
                            f"got {bias.dtype}")
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"{_OP}: bias must be [V] with V = weight.shape[0] = "
                             f"{weight.shape[0]}, got {tuple(bias.shape)}")
    check_same_device(_OP, "hidden", hidden, weight=weight, bias=bias)
    if not (type(logits_in_fp32) is bool and type(return_z_loss) is bool
            and type(return_token_accuracy) is bool and type(return_predicted_tokens) is bool
            and type(use_token_scaling) is bool):
        flags = dict(logits_in_fp32=logits_in_fp32, return_z_loss=return_z_loss,
                     return_token_accuracy=return_token_accuracy,
                     return_predicted_tokens=return_predicted_tokens,
                     use_token_scaling=use_token_scaling)
        for name, flag in flags.items():
            if not isinstance(flag, bool):
                raise TypeError(f"{_OP}: {name} must be a bool, got {flag!r}")
    ops.check_class_weights(_OP, "ce_weight", ce_weight, weight.shape[0], "weight.shape[0]",
                            weight.device, "weight")
    if accum_dtype is not None and accum_dtype not in (torch.float32, weight.dtype):
        raise (TypeError if not isinstance(accum_dtype, torch.dtype) else ValueError)(
            f"{_OP}: accum_dtype must be None, torch.float32 or weight's dtype "
            f"({weight.dtype}), got {accum_dtype!r}")
    if max_chunk_bytes is not None and (isinstance(max_chunk_bytes, bool) or not isinstance(
            max_chunk_bytes, int) or max_chunk_bytes < 1):
        raise ValueError(f"{_OP}: max_chunk_bytes must be a positive int or None, "
                         f"got {max_chunk_bytes!r}")
    # The loss options and target checks are those of cross_entropy, for logits [..., V]
    # of hidden's dtype and device (described, not made: a tensor op costs microseconds).
    path, reason, loss = ops._resolve_logits(
        (*hidden.shape[:-1], weight.shape[0]), hidden.dtype, hidden.device, False, target,
        ignore_index, label_smoothing, z_loss, softcap, reduction, tp_group, False, impl,
        ce_weight, return_z_loss, return_token_accuracy, return_predicted_tokens,
        (_OP, "hidden"))
    needs = (hidden.requires_grad, weight.requires_grad,
             bias is not None and bias.requires_grad)
    grad_needed = torch.is_grad_enabled() and any(needs)
    # The default path on CPU float32 tensors, when PyTorch's ops have every option in use:
    # F.linear then F.cross_entropy (no chunks, so no tuning lookup: 5 us of a small call).
    native = (cfg is None and max_chunk_bytes is None and native_cpu(impl, path, hidden)
              and loss.z_loss == 0.0 and loss.softcap is None and loss.tp_group is None
              and not loss.extras and not use_token_scaling
              and _native_fits(math.prod(hidden.shape[:-1]), weight.shape[0]))
    if native:
        source = "none: PyTorch's F.linear then F.cross_entropy on the whole logits"
    elif cfg is None:
        cfg, source = config(weight.shape[0], hidden.device)
    else:
        cfg, source = LCEConfig.of(check_config(cfg, "the caller")), "the caller"
    # float16: gradients in backward, scaled by the upstream gradient (a loss scale) before
    # they are rounded; computed in the forward for a gradient of 1, they would underflow.
    fused = grad_needed and reduction != "none" and hidden.dtype != torch.float16
    # float32 logits: only half-precision inputs change (float32/float64 logits already are).
    fp32_logits = logits_in_fp32 and hidden.dtype in (torch.float16, torch.bfloat16)
    accum_fp32 = (accum_dtype == torch.float32
                  and weight.dtype in (torch.float16, torch.bfloat16))
    return path, reason, LinearCrossEntropyCall(
        loss, needs, grad_needed, max_chunk_bytes, fused, cfg, source, fp32_logits, native,
        use_token_scaling, accum_fp32)


def _chunk_itemsize(hidden: torch.Tensor, o: LinearCrossEntropyCall) -> int:
    """Bytes a logit takes in the chunk budget: the chunk in hidden's dtype, or in float32
    plus its gradient's copy in hidden's dtype (what the weight-gradient GEMMs read)."""
    return hidden.element_size() + (4 if o.fp32_logits else 0)


def _chunk_buffers(hidden: torch.Tensor, rows: int, v: int, o: LinearCrossEntropyCall,
                   grads: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The logits chunk buffer (float32 with ``fp32_logits``) and, then, the buffer its
    gradient is rounded into for the GEMMs (``None`` otherwise: they read the chunk)."""
    if not o.fp32_logits:
        return hidden.new_empty((rows, v)), None
    buf = torch.empty((rows, v), dtype=torch.float32, device=hidden.device)
    return buf, (hidden.new_empty((rows, v)) if grads else None)


def _grad_operand(logits: torch.Tensor, half: Optional[torch.Tensor]) -> torch.Tensor:
    if half is None:
        return logits
    out = half[: logits.shape[0]]
    out.copy_(logits)
    return out


def _chunk_stats(logits, target, count, o, grad: bool, mean: bool, cw=None, wstat=None):
    """Whole-vocabulary ``[3, rows]`` stats of one logits chunk (on the one-rank Triton
    path the kernel's own ``[4+, rows]``, the first three those), its tokens' first argmax
    (``[rows]`` int64 with ``o.loss.argmax``, else None), their target weights (``[rows]``
    with class weights and ``tp_group``, else None) and, with ``grad``, its gradient in
    place: for an upstream gradient of 1 (over the mean's divisors when ``mean``; times
    each token's target probability with ``use_token_scaling``). ``cw``, ``wstat``: the
    class weights (this rank's) and their ``[2]`` stats over the whole vocabulary and
    batch (:func:`_weight_stats`), or None."""
    loss = o.loss
    ignore, ls, z, cap = loss.ignore_index, loss.label_smoothing, loss.z_loss, loss.softcap
    one_rank = loss.tp_group is None
    argmax = loss.argmax
    if loss.path == "triton" and one_rank and grad:
        # The config's CE launch travels as a string (a custom op takes no object).
        launch = "" if o.config.kernel is None else o.config.kernel.encode()
        stats = ops._fwd_grad_(logits, target, count, ignore, ls, z, cap, mean, launch, cw,
                               wstat, argmax, o.token_scaling)
        return stats, stats[4].long() if argmax else None, None
    if loss.path == "triton":
        # (The loss row, scaled by mean, is unused.)
        stats = ops._stats(logits, target, count, loss.vocab_start, loss.vocab_size, ignore,
                           ls, z, cap, False, cw, wstat, argmax)
        columns = stats[4] if argmax else None
        pred = columns.long() if argmax else None
        if one_rank:
            return stats, pred, None
        stats = stats[:3]
    else:
        stats = ref.local_token_stats(logits, target, loss.vocab_start, cap, cw)
        pred = ref.predicted_tokens(logits, target, ignore, cap) if argmax else None
    wt = None
    if not one_rank:
        top = None
        if argmax:
            top = (ops._local_top(logits, columns, loss.vocab_start, cap)
                   if loss.path == "triton" else ref.local_top(logits, loss.vocab_start, cap))
        merged = gather_stats(stats, target, count, loss, False, cw, top)
        stats, wt, pred = merged.stats[:3].contiguous(), merged.target_weight, merged.pred
    if grad:
        w, wz = _token_scales(torch.ones((), device=logits.device), stats, target, count,
                              wstat, o)
        _chunk_grad(logits, target, stats, w, loss, cw, wstat, wz, wt)
    return stats, pred, wt


def _weight_stats(cw: torch.Tensor, target: torch.Tensor,
                  loss: ops.CrossEntropyCall) -> torch.Tensor:
    """``[2]`` in ``cw``'s dtype (float32; float64 for float64 inputs): the sum of the class
    weights and that of the non-ignored targets' (a weighted mean's divisor), over the whole
    vocabulary: with ``tp_group`` each rank's share summed by one all-reduce of these two
    floats, before the chunks (the forward's gradients need the divisor from the first chunk
    on)."""
    whole = loss.tp_group is None
    mine = ops._class_stats(cw, target, loss.ignore_index, loss.vocab_start, whole)
    if whole:
        return mine
    total = all_reduce_sum(mine, loss.tp_group)
    counted = (target.long() != loss.ignore_index).any()
    return torch.stack([total[0], ref.weighted_mean_divisor(total[1], counted)])


def _token_scales(dout: torch.Tensor, stats: torch.Tensor, target: torch.Tensor,
                  count: torch.Tensor, wstat: Optional[torch.Tensor],
                  o: LinearCrossEntropyCall) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w, wz) [rows]`` float32 (``stats``' dtype: float64 on the torch path for float64
    inputs), what the gradient kernels scale each token's gradient
    by for the upstream gradient ``dout`` (per token for ``"none"``, else a scalar): ``w``
    the (class-weighted) terms', ``wz`` the z-loss's (they differ only for a weighted
    mean: ``sum w_t`` and the token count divide them); times each token's target
    probability (from the whole-vocabulary ``stats``) with ``use_token_scaling``."""
    d = dout.to(stats.dtype)
    count = count.to(stats.dtype)
    w = d.reshape(-1) if o.loss.reduction == "none" else d.reshape(1).expand(target.shape[0])
    wz = w
    if o.loss.reduction == "mean":
        wz = w / count.clamp(min=1)
        w = wz if wstat is None else w / torch.where(count > 0, wstat[1],
                                                     torch.ones_like(wstat[1]))
    if o.token_scaling:
        p = ref.target_probability(stats, target, vocab_size=o.loss.vocab_size,
                                   ignore_index=o.loss.ignore_index).to(stats.dtype)
        w, wz = w * p, wz * p
    return w, wz


def _chunk_grad(logits, target, stats, w, loss: ops.CrossEntropyCall, cw=None, wstat=None,
                wz=None, wt=None) -> None:
    """Overwrite a logits chunk with its gradient, from whole-vocabulary stats and the
    tokens' upstream gradients ``w [rows]`` (float32); with class weights ``cw`` (and
    ``wstat``), ``wz [rows]`` scales the z-loss's term (see :func:`_token_scales`) and,
    with ``tp_group``, ``wt [rows]`` holds the targets' weights."""
    args = (loss.vocab_start, loss.vocab_size, loss.ignore_index, loss.label_smoothing,
            loss.z_loss, loss.softcap)
    opt = () if cw is None else (cw, wstat, wz, wt)
    if loss.path == "triton":
        ops._grad_(logits, target, stats, w, *args, *opt)
    else:
        logits.copy_(ref.logits_grad(logits, target, stats[0], w, vocab_start=args[0],
                                     vocab_size=args[1], ignore_index=args[2],
                                     label_smoothing=args[3], z_loss=args[4],
                                     softcap=args[5], class_weight=cw, z_weight=wz,
                                     target_weight=wt,
                                     weight_sum=None if wt is None else wstat[0]))


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in the operands' dtype: under ``torch.autocast`` a new product would take
    autocast's dtype (the ``out=`` forms are exempt), and the gradients must not."""
    if torch.is_autocast_enabled(a.device.type):
        with torch.autocast(a.device.type, enabled=False):
            return torch.mm(a, b)
    return torch.mm(a, b)


def _mm_float32(a: torch.Tensor, b: torch.Tensor,
                acc: Optional[torch.Tensor]) -> torch.Tensor:
    """``acc + a @ b`` (``a @ b`` when ``acc`` is None) in float32 from half-precision
    ``a``, ``b``: on CUDA one GEMM with a float32 output (``out_dtype``), accumulating into
    ``acc`` in place; elsewhere on float32 copies of the operands."""
    with torch.autocast(a.device.type, enabled=False):
        if a.is_cuda:
            if acc is None:
                return torch.mm(a, b, out_dtype=torch.float32)
            return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        if acc is None:
            return torch.mm(a.float(), b.float())
        return acc.addmm_(a.float(), b.float())


class _Grads:
    """Accumulates the gradients of hidden, weight and bias over chunks.

    The products of a chunk holding every row, and the weight's of the first chunk, are
    formed as new tensors (the same GEMMs as into a buffer): a buffer, and a slice of it,
    would each be one more tensor op on the host."""

    def __init__(self, hidden, weight, bias, needs, accum_fp32: bool = False) -> None:
        self.hidden, self.weight, self.bias, self.needs = hidden, weight, bias, needs
        self.accum_fp32 = accum_fp32  # the weight's gradient summed over chunks in float32
        self.dh = self.dw = None
        self.db = (torch.zeros(bias.shape, dtype=_stats_dtype(bias), device=bias.device)
                   if needs[2] else None)
        self.first = True

    def add(self, g: torch.Tensor, r0: int, r1: int) -> None:
        """Add chunk ``[r0, r1)``'s contribution, from its logits gradient ``g``."""
        whole = r0 == 0 and r1 == self.hidden.shape[0]
        if self.needs[0]:
            if whole:
                self.dh = _mm(g, self.weight)
            else:
                if self.dh is None:
                    self.dh = torch.empty_like(self.hidden)
                torch.mm(g, self.weight, out=self.dh[r0:r1])
        if self.needs[1]:
            h = self.hidden if whole else self.hidden[r0:r1]
            if self.accum_fp32 and not whole:
                self.dw = _mm_float32(g.T, h, self.dw)
            elif self.first:
                self.dw = _mm(g.T, h)
            else:
                self.dw.addmm_(g.T, h)
        if self.db is not None:
            self.db += g.sum(dim=0, dtype=self.db.dtype)
        self.first = False

    def finish(self, tp_group) -> tuple:
        """(dh, dW, db); dh summed over the vocabulary-parallel group."""
        if self.needs[0] and self.dh is None:  # no tokens
            self.dh = torch.empty_like(self.hidden)
        if self.dh is not None and tp_group is not None:
            all_reduce_sum_(self.dh, tp_group)
        if self.needs[1] and self.first:  # no tokens
            self.dw = torch.zeros_like(self.weight)
        if self.dw is not None and self.dw.dtype != self.weight.dtype:  # summed in float32
            self.dw = self.dw.to(self.weight.dtype)
        db = self.db.to(self.bias.dtype) if self.db is not None else None
        return self.dh, self.dw, db


class _LinearCrossEntropy(torch.autograd.Function):
    """Loss of ``hidden [N, H] @ weight [V_local, H].T (+ bias)``; see the module docstring.

    ``cw``: class weights ``[V_local]`` (float32; float64 for float64 inputs) or None. With
    ``o.loss.extras`` (a ``return_*`` option) it returns ``(loss, lse, predicted, scale)``:
    each token's whole-vocabulary lse, its first argmax (int64, with ``o.loss.argmax``; an
    empty tensor otherwise) and its ``use_token_scaling`` factor (an empty tensor without),
    none of them differentiable."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, cw, o: LinearCrossEntropyCall):
        with nvtx_range(_OP, "fwd"):
            n = hidden.shape[0]
            rows = chunk_rows(n, weight.shape[0], _chunk_itemsize(hidden, o), hidden.device,
                              o.max_chunk_bytes, o.config)
            ignore = o.loss.ignore_index
            t = target.long()
            valid = t != ignore
            # (For int64 targets that is target != ignore: counted, not formed twice.)
            count = torch.sum(valid if t is target else target != ignore, dtype=torch.float32)
            wstat = None if cw is None else _weight_stats(cw, target, o.loss)
            mean = o.loss.reduction == "mean"
            ctx.o, ctx.rows = o, rows
            grads = _Grads(hidden, weight, bias, o.needs, o.accum_fp32) if o.fused else None
            sdtype = _stats_dtype(hidden)
            buf, half = _chunk_buffers(hidden, min(rows, n), weight.shape[0], o,
                                       grads is not None)
            if 0 < n <= rows:
                # One chunk holds every token: its stats, argmax and target weights are the
                # batch's, taken as they are (no slices of batch tensors to copy them into).
                _logits(hidden, weight, bias, out=buf)
                stats, pred, wt = _chunk_stats(buf, target, count, o, grads is not None, mean,
                                               cw, wstat)
                stats = stats.to(sdtype)
                pred = None if pred is None else pred.long()
                wt = None if wt is None else wt.to(sdtype)
                if grads is not None:
                    grads.add(_grad_operand(buf, half), 0, n)
            else:
                stats = torch.empty((3, n), dtype=sdtype, device=hidden.device)
                pred = (torch.empty((n,), dtype=torch.int64, device=hidden.device)
                        if o.loss.argmax else None)
                wt = None  # (with tp_group: the targets' weights, from the chunks' all-gathers)
                if cw is not None and o.loss.tp_group is not None:
                    wt = torch.empty((n,), dtype=sdtype, device=hidden.device)
                for r0 in range(0, n, rows):
                    r1 = min(n, r0 + rows)
                    logits = buf[: r1 - r0]
                    _logits(hidden[r0:r1], weight, bias, out=logits)
                    chunk_stats, chunk_pred, chunk_wt = _chunk_stats(
                        logits, target[r0:r1], count, o, grads is not None, mean, cw, wstat)
                    stats[:, r0:r1] = _first3(chunk_stats)
                    if chunk_pred is not None:
                        pred[r0:r1] = chunk_pred
                    if chunk_wt is not None:
                        wt[r0:r1] = chunk_wt
                    if grads is not None:
                        grads.add(_grad_operand(logits, half), r0, r1)
            del buf, half
            if pred is None and o.loss.extras:
                pred = torch.empty((0,), dtype=torch.int64, device=hidden.device)
            loss, scale = _loss(stats, target, t, valid, count, o, cw, wt, wstat)
            if grads is not None:
                ctx.save_for_backward(*(g for g in grads.finish(o.loss.tp_group)
                                        if g is not None))
            elif o.grad_needed:
                ctx.save_for_backward(hidden, weight, bias, target, _first3(stats), count, cw,
                                      wstat, wt)
            ctx.has = tuple(o.needs)
            if not o.loss.extras:
                return loss
            lse = stats[0].clone()
            scale = stats.new_empty((0,)) if scale is None else scale
            ctx.mark_non_differentiable(lse, pred, scale)
            return loss, lse, pred, scale

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, *_extras):
        with nvtx_range(_OP, "bwd"):
            o = ctx.o
            if o.fused:
                ops._once(ctx, _OP)
                saved = list(ctx.saved_tensors)
                out = [saved.pop(0) if need else None for need in ctx.has]
                _scale([g for g in out if g is not None], dout, o.loss.path)
                return out[0], out[1], out[2], None, None, None
            hidden, weight, bias, target, stats, count, cw, wstat, wt = ctx.saved_tensors
            n, rows = hidden.shape[0], ctx.rows
            w, wz = _token_scales(dout, stats, target, count, wstat, o)
            grads = _Grads(hidden, weight, bias, ctx.has, o.accum_fp32)
            buf, half = _chunk_buffers(hidden, min(rows, n), weight.shape[0], o, True)
            for r0 in range(0, n, rows):
                r1 = min(n, r0 + rows)
                logits = buf[: r1 - r0]
                _logits(hidden[r0:r1], weight, bias, out=logits)
                _chunk_grad(logits, target[r0:r1], stats[:, r0:r1].contiguous(), w[r0:r1],
                            o.loss, cw, wstat, None if cw is None else wz[r0:r1],
                            None if wt is None else wt[r0:r1])
                grads.add(_grad_operand(logits, half), r0, r1)
            dh, dw, db = grads.finish(o.loss.tp_group)
            return dh, dw, db, None, None, None


def _loss(stats: torch.Tensor, target: torch.Tensor, t: torch.Tensor, valid: torch.Tensor,
          count: torch.Tensor, o: LinearCrossEntropyCall, cw: Optional[torch.Tensor],
          wt: Optional[torch.Tensor], wstat: Optional[torch.Tensor]
          ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The loss from the batch's stats (``[3+, N]``: lse, x_t, sum x, any further rows
    ignored), and with ``use_token_scaling`` each token's factor: :func:`reference.token_terms`
    then :func:`reference.reduce_terms`. ``t``: ``target.long()``; ``valid``:
    ``t != ignore_index``."""
    if (o.loss.path == "triton" and cw is None and o.loss.reduction != "none"
            and not o.loss.label_smoothing and not o.loss.z_loss and not o.token_scaling):
        # The same, bit for bit, in fewer tensor ops (each costs microseconds on the host
        # of a small call): no product by 1 - label_smoothing = 1, no zero z-loss (adding
        # its +0.0 turns only a -0.0 into +0.0, which the sum does anyway), the bad-target
        # and ignored masks in two wheres of scalars.
        lse, x_t = stats.unbind()[:2]
        bad = t.clamp(0, o.loss.vocab_size - 1) != t
        ce = torch.where(valid, torch.where(bad, math.inf, lse - x_t), 0.0).sum()
        return (ce / count.clamp(min=1) if o.loss.reduction == "mean" else ce), None
    ignore = o.loss.ignore_index
    stats = _first3(stats)
    ce, zl = ref.token_terms(stats, target, vocab_size=o.loss.vocab_size, ignore_index=ignore,
                             label_smoothing=o.loss.label_smoothing, z_loss=o.loss.z_loss,
                             weight=cw, target_weight=wt,
                             weight_sum=None if wt is None else wstat[0])
    scale = None
    if o.token_scaling:
        scale = ref.target_probability(stats, target, vocab_size=o.loss.vocab_size,
                                       ignore_index=ignore)
        ce, zl = ce * scale, zl * scale
    return ref.reduce_terms(ce, zl, target, count, o.loss.reduction, ignore, cw, wt), scale


def _first3(stats: torch.Tensor) -> torch.Tensor:
    """``[3, N]`` of ``[3+, N]`` stats (a slice only where there are more rows)."""
    return stats if stats.shape[0] == 3 else stats[:3]


def _stats_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


# torch.mm(..., out_dtype=) (half-precision inputs, float32 output; CUDA) exists from
# torch 2.8 on; before, the inputs are widened.
_HAS_MM_OUT_DTYPE = "out_dtype" in (torch.mm.__doc__ or "")


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
            out: torch.Tensor) -> None:
    """``out = h @ weight.T (+ bias)``. A float32 ``out`` for half-precision inputs takes
    the GEMM's float32 accumulation as it is (cuBLAS's ``out_dtype``; elsewhere the inputs
    are widened, which gives the same products), the bias added in float32."""
    if out.dtype == h.dtype:
        if bias is None:
            torch.mm(h, weight.T, out=out)
        else:
            torch.addmm(bias, h, weight.T, out=out)
        return
    global _HAS_MM_OUT_DTYPE
    done = False
    if h.is_cuda and _HAS_MM_OUT_DTYPE:
        try:
            torch.mm(h, weight.T, out_dtype=out.dtype, out=out)
            done = True
        except (RuntimeError, TypeError, NotImplementedError):  # this build lacks it
            _HAS_MM_OUT_DTYPE = False
    if not done:
        torch.mm(h.to(out.dtype), weight.T.to(out.dtype), out=out)
    if bias is not None:
        out += bias.to(out.dtype)


def _scale(grads: list[torch.Tensor], dout: torch.Tensor, path: str) -> None:
    """``g *= dout`` (a scalar tensor) for each of ``grads``, without a host sync; a no-op
    kernel when it is 1."""
    scale = None  # formed once for every gradient
    for g in grads:
        if path == "triton" and g.is_contiguous():
            if scale is None:
                scale = dout.float().reshape(1)
            ops._launch_scale(g, scale)
        else:
            _mul_float32_(g, dout)


def _mul_float32_(g: torch.Tensor, dout: torch.Tensor) -> None:
    """``g *= dout`` with the product formed in float32 (at least) and rounded once to g's
    dtype: ``dout`` rounded to bfloat16 first would bias every gradient (1/378, a gradient
    accumulation's ``1 / num_items_in_batch``, is 0.22% small in bfloat16). In pieces of
    2**24 elements, so no float32 copy of a whole half-precision gradient is made."""
    if g.dtype in (torch.float32, torch.float64):
        g.mul_(dout.to(g.dtype))
        return
    d = dout.float()
    if not g.is_contiguous():
        g.copy_(g.float() * d)
        return
    for piece in g.view(-1).split(1 << 24):
        piece.copy_(piece.float() * d)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    reduction: str = "mean",
    tp_group: Optional[Any] = None,
    impl: str = "auto",
    max_chunk_bytes: Optional[int] = None,
    logits_in_fp32: bool = False,
    ce_weight: Optional[torch.Tensor] = None,
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False,
    use_token_scaling: bool = False,
    accum_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor | ref.CrossEntropyOutput:
    """Cross-entropy of the logits ``hidden @ weight.T (+ bias)``, never materialised.

    Same loss and options as :func:`lmfuse.cross_entropy` on those logits (which are
    formed chunk by chunk in ``hidden``'s dtype, as ``F.linear`` would), with gradients for
    ``hidden``, ``weight`` and ``bias``.

    Args:
        hidden: ``[..., H]`` float32/float16/bfloat16.
        weight: ``[V_local, H]``, hidden's dtype; with ``tp_group``, rank ``r``'s shard of
            vocabulary rows ``[r * V_local, (r + 1) * V_local)``.
        target: ``[...]`` (hidden's leading shape) int32/int64 global class ids.
        bias: optional ``[V_local]``, hidden's dtype.
        tp_group: vocabulary parallelism (``hidden`` replicated on the ranks): one
            all-gather of ``[3, rows]`` token stats per chunk, and ``hidden``'s gradient
            all-reduced over the group. ``None`` or a one-rank group: no collective. The
            options' rows join the stats' all-gather (the target weights, each rank's max
            logit and its column); with ``ce_weight`` one all-reduce of two floats (the
            weights' sum, the counted targets') comes first, the divisor of a weighted
            mean that the forward's gradients need from the first chunk on.
        max_chunk_bytes: the budget of the one logits chunk held at a time (default: the
            device's tuning table, 256 MiB); the op's extra memory beyond the gradients is
            this plus O(N) per-token state, whatever N. (On CPU float32 tensors without
            Triton the default runs PyTorch's ``F.linear`` and ``F.cross_entropy`` on the
            whole logits, when they fit in this budget and autocast is off.)
        ignore_index, label_smoothing, z_loss, softcap, reduction, impl: as for
            :func:`lmfuse.cross_entropy`.
        logits_in_fp32: for float16/bfloat16 inputs, keep each logits chunk in float32 as
            the GEMM accumulates it (no rounding to the inputs' dtype before the softmax),
            so the loss and the softmax gradient match a float32-logits reference (what
            Megatron-Core's fused linear cross-entropy computes) to float32 rounding; the
            gradient is rounded to the inputs' dtype only for the GEMMs that make ``hidden``'s
            and ``weight``'s gradients. The chunk budget then counts 4 bytes a logit more
            (fewer rows a chunk). No effect on float32/float64 inputs.
        ce_weight: class weights ``[V_local]`` (any float dtype, used in float32, float64 for
            float64 inputs; with ``tp_group`` this rank's shard), ``weight`` of
            :func:`lmfuse.cross_entropy` (``weight`` here is the projection): each token's loss
            is scaled by its target's weight, label smoothing weighs class ``j`` by
            ``ce_weight[j]``, a mean divides by the sum of the non-ignored targets' weights;
            the z-loss is not weighted. No gradient.
        return_z_loss, return_token_accuracy, return_predicted_tokens: as for
            :func:`lmfuse.cross_entropy`; the argmax is taken in the pass that reduces
            each logits chunk (no extra read).
        use_token_scaling: Liger-Kernel's option: each token's loss (z-loss included) and
            gradients multiplied by its probability of its target, ``exp(x_t - lse)``,
            detached (a constant to the gradient); a mean keeps its divisor. Computed
            from the token stats: no extra pass over the logits. The returned z-loss is
            scaled as well.
        accum_dtype: ``torch.float32`` (Liger-Kernel's option): for float16/bfloat16
            weights, the weight's gradient is summed over the logits chunks in float32 and
            rounded to the weight's dtype once (by default each chunk's product is added in
            the weight's dtype, a rounding a chunk: a relative error growing with the
            chunk count, 1.7e-2 after 256 bfloat16 chunks against 1.9e-3 for one). Costs a
            float32 ``[V_local, H]`` buffer while the gradients are formed. ``None`` (the
            default) or the weight's dtype: no change.

    NaN and inf propagate as in ``F.cross_entropy(hidden @ weight.T + bias)`` (see
    :func:`lmfuse.cross_entropy`): a NaN in one row of ``weight`` makes every token's loss
    and every gradient NaN.

    A second backward through the same loss (``retain_graph=True``) raises a
    ``RuntimeError`` (the gradients come from the chunked logits, which are not kept),
    except on the CPU default path (``F.linear`` and ``F.cross_entropy``): compute the loss
    again.

    Returns:
        float32 loss (float64, on the torch path, for float64 inputs: the kernels compute in
        float32, and ``impl="triton"`` raises ``TypeError`` for them): a scalar, or per-token
        ``[...]`` for ``reduction="none"``. With any ``return_*`` set, a
        :class:`~lmfuse.cross_entropy.CrossEntropyOutput` ``(loss, z_loss, token_accuracy,
        predicted_tokens)``, None where not asked; only the loss is differentiable.
    """
    if (impl == "auto" and bias is None and z_loss == 0.0 and softcap is None
            and tp_group is None and max_chunk_bytes is None and logits_in_fp32 is False
            and ce_weight is None and return_z_loss is False
            and return_token_accuracy is False and return_predicted_tokens is False
            and use_token_scaling is False and accum_dtype is None and cpu_fast(hidden)
            and hidden.layout is _STRIDED and not hidden.is_nested and hidden.dim() == 2
            and type(weight) in PLAIN_TENSORS and weight.layout is _STRIDED and weight.is_cpu
            and weight.dtype is torch.float32 and weight.dim() == 2
            and weight.shape[0] > 0 and weight.shape[1] == hidden.shape[1]
            and _native_fits(hidden.shape[0], weight.shape[0])):
        # The common CPU call: the native path's F.linear then F.cross_entropy without the
        # resolved call (None from the loss for any call its checks would refuse: the full
        # path then runs and raises its error).
        loss = ops._cpu_fast_loss(F.linear(hidden, weight), target, ignore_index,
                                  label_smoothing, reduction)
        if loss is not None:
            return loss
    return _apply(hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, softcap,
                  reduction, tp_group, impl, max_chunk_bytes, None, logits_in_fp32,
                  ce_weight=ce_weight, return_z_loss=return_z_loss,
                  return_token_accuracy=return_token_accuracy,
                  return_predicted_tokens=return_predicted_tokens,
                  use_token_scaling=use_token_scaling, accum_dtype=accum_dtype)


# (F.linear takes sparse operands; the full path refuses them with lmfuse's TypeError)
_STRIDED = torch.strided


def _native_fits(n: int, vocab: int) -> bool:
    """Whether the CPU default path may form the whole float32 logits ``[n, vocab]`` with
    PyTorch's ops: they fit in the chunk budget (so the op's extra memory stays within it,
    as the chunked path's does), and autocast is off (``F.linear`` would then compute
    bfloat16 logits, every other path float32)."""
    return n * vocab * 4 <= _cpu_chunk_bytes(vocab) and not torch.is_autocast_enabled("cpu")


@functools.lru_cache(maxsize=64)
def _cpu_chunk_bytes(vocab: int) -> int:
    return config(vocab, torch.device("cpu"))[0].chunk_bytes


@planner_of(linear_cross_entropy)
def plan_linear_cross_entropy(**a: Any) -> Plan:
    """What :func:`linear_cross_entropy` would do with these arguments."""
    path, reason, o = _resolve(**a)
    hidden, weight, max_chunk_bytes = a["hidden"], a["weight"], a["max_chunk_bytes"]
    target, tp_group = a["target"], a["tp_group"]
    ops._check_targets(target, o.loss, _OP)
    n = target.numel()
    shape = f"{list(hidden.shape)} {dtype_name(hidden.dtype)}"
    if o.native:
        details = {"hidden": shape, "vocabulary": str(weight.shape[0]),
                   "passes": o.config_source + " (autograd for the gradients)"}
        return Plan(_OP, path, reason + "; CPU float32: PyTorch's own ops", details,
                    call=o)
    rows = chunk_rows(max(n, 1), weight.shape[0], _chunk_itemsize(hidden, o), hidden.device,
                      max_chunk_bytes, o.config)
    chunks = cdiv(n, rows)
    details = {
        "hidden": shape,
        "vocabulary": (f"{weight.shape[0]} of {o.loss.vocab_size} (rank {group_rank(tp_group)}, "
                       f"one all-gather of [{3 + o.loss.weighted + 2 * o.loss.argmax}, rows] "
                       "stats per chunk"
                       + (", the class weights' sums all-reduced first" if o.loss.weighted
                          else "") + ")"
                       if o.loss.tp_group is not None else str(weight.shape[0])),
        "chunks": (f"{chunks} x {rows} tokens; logits buffer "
                   f"{rows * weight.shape[0] * _chunk_itemsize(hidden, o) / 2**20:.1f} MiB"
                   + (" (float32 logits and their gradient in hidden's dtype)"
                      if o.fp32_logits else "")),
        "config": _describe(o.config, o.config_source, max_chunk_bytes),
        "passes": ("fused: gradients in the forward, backward only rescales" if o.fused
                   else "deferred: stats in forward, logits recomputed in backward"
                   if o.grad_needed else "stats only (no gradient needed)"),
    }
    extras = [name for name, on in (
        ("class weights", o.loss.weighted), ("z-loss returned", o.loss.return_z_loss),
        ("argmax in the stats pass", o.loss.argmax),
        ("token scaling", o.token_scaling),
        ("the weight's gradient summed in float32", o.accum_fp32)) if on]
    if extras:
        details["options"] = ", ".join(extras)
    return Plan(_OP, path, reason, details, call=o)


def _apply(hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, softcap,
           reduction, tp_group, impl, max_chunk_bytes, cfg, logits_in_fp32=False, *,
           ce_weight=None, return_z_loss=False, return_token_accuracy=False,
           return_predicted_tokens=False, use_token_scaling=False,
           accum_dtype=None) -> torch.Tensor | ref.CrossEntropyOutput:
    """:func:`linear_cross_entropy`, with ``cfg`` (if not ``None``) in place of the tuning
    tables' config (how ``lmfuse tune`` times its candidates)."""
    path, _, o = _resolve(hidden, weight, target, bias, ignore_index, label_smoothing, z_loss,
                          softcap, reduction, tp_group, impl, max_chunk_bytes, cfg,
                          logits_in_fp32, ce_weight, return_z_loss, return_token_accuracy,
                          return_predicted_tokens, use_token_scaling, accum_dtype)
    if o.loss.tp_group is not None:
        # (and one chunking: each chunk's stats are one all-gather, and the chunk budget
        # comes from each rank's own tuning tables or max_chunk_bytes; compared as the
        # rows a chunk holds whatever the token count, so a later, longer call agrees too)
        rows = chunk_rows(1 << 62, weight.shape[0], _chunk_itemsize(hidden, o),
                          hidden.device, o.max_chunk_bytes, o.config)
        ops.check_shards(_OP, o.loss, target.numel(), weight.shape[0], hidden.device,
                         **{"tokens per chunk": rows})
    lead = target.shape
    cw = None
    if ce_weight is not None:  # float32 (float64 for float64 inputs)
        f64 = hidden.dtype == torch.float64
        # (no gradient for the class weights: see cross_entropy)
        cw = ce_weight.detach().to(torch.float64 if f64 else torch.float32).contiguous()
    if o.native:
        # The default path on CPU float32 tensors: F.linear then F.cross_entropy (the plain
        # formula's speed; on a CPU the logits' memory is not what is scarce). impl="torch"
        # keeps the chunked reference, the tests' oracle. (No reshape of 2-D hidden: its
        # view would add a node to the backward.)
        h2d = hidden if hidden.dim() == 2 else hidden.reshape(-1, hidden.shape[-1])
        loss = ops._native_cross_entropy(F.linear(h2d, weight, bias),
                                         target if target.dim() == 1 else target.reshape(-1),
                                         o.loss, cw, _OP)
        return loss.view(lead) if reduction == "none" else loss
    ops._check_targets(target, o.loss, _OP)
    # (Already 2-D, 1-D: no reshape, whose view would add a node to the backward.)
    h2d = hidden if hidden.dim() == 2 else hidden.reshape(-1, hidden.shape[-1])
    if not h2d.is_contiguous():
        h2d = h2d.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    t1d = target if target.dim() == 1 else target.reshape(-1)
    if not t1d.is_contiguous():
        t1d = t1d.contiguous()
    if o.loss.extras:
        loss, lse, pred, scale = apply_function(_LinearCrossEntropy, h2d, w, bias, t1d, cw, o)
        return ops._with_extras(loss, lse, pred, t1d, lead, o.loss,
                                scale if o.token_scaling else None)
    loss = apply_function(_LinearCrossEntropy, h2d, w, bias, t1d, cw, o)
    return loss.view(lead) if reduction == "none" else loss


def checks(device: torch.device, dtypes) -> list:
    """Fresh random cases covering the options, for :mod:`lmfuse._check`."""
    from .._check import op_case

    small = device.type != "cuda"
    H, vs = (16, (45, 3000)) if small else (512, (32000, 128256))

    def case(label, V, dtype, **kw):
        # (the interpreter's time grows with rows x columns: fewer rows at the long ones)
        n = (37 if V < 1000 else 13) if small else 1024
        target = torch.randint(0, V, (n,), device=device)
        target[::7] = -100

        def inputs():
            return [torch.randn(n, H, device=device).to(dtype).requires_grad_(True),
                    (torch.randn(V, H, device=device) / H ** 0.5).to(dtype)
                    .requires_grad_(True)]

        return op_case(_OP, label, dtype, (n, H, V), inputs, linear_cross_entropy,
                       plan_linear_cross_entropy, target, max_chunk_bytes=V * 256, **kw)

    cases = []
    for dtype in dtypes:
        # float16 at an upstream gradient of ~1 (no loss scale): "mean"'s (p - y) / count is
        # below float16's normal range at these V and N, for eager PyTorch as for lmfuse;
        # "sum" checks the same passes at a representable scale.
        red = "sum" if dtype == torch.float16 else "mean"
        for V in vs:
            cases += [case(red, V, dtype, reduction=red),
                      case("smoothing+z+softcap", V, dtype, label_smoothing=0.1, z_loss=1e-3,
                           softcap=30.0, reduction=red),
                      case("none", V, dtype, reduction="none")]
    return cases
