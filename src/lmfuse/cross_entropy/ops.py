"""``cross_entropy``: validation, dispatch, pass structure, autograd.

Two pass structures, chosen per call (``lmfuse.explain`` says which):

* **fused** (Triton, one rank, ``reduction`` "mean"/"sum", gradient needed): the forward
  kernel writes the loss stats *and* the gradient of the logits, assuming an upstream
  gradient of 1; backward multiplies by the real upstream gradient, a kernel that returns
  at once, with no host sync, when that is 1 (the usual ``loss.backward()``). Rows that
  fit in registers are read once; longer rows are read twice, the second time mostly
  from L1 where a row fits it (``ce_stream_kernel``, one program per SM streaming whole
  rows) and from L2 otherwise (``ce_slices_kernel``).
* **deferred** (``reduction="none"``, a ``tp_group``, float16 logits, no gradient needed,
  or the torch path): the forward reads the logits once for the stats; backward reads them
  again and writes the gradient, scaled by each token's upstream gradient. float16 needs
  that scale before rounding: ``(p - y) / count`` alone underflows its range at large V
  and N, where fp16 training's loss scale keeps the gradient representable.

With ``inplace_backward=True`` the gradient is written over the logits.

Each launch is also a ``torch.library`` custom op (:func:`lmfuse._launch.kernel_op`), which
is what ``torch.compile`` sees (opaque nodes); eager calls run the same function directly
and skip the dispatcher's overhead.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import functools
import math

import torch
import torch.nn.functional as F

from .. import tuning
from .._dispatch import (Plan, ResolvedCall, apply_function, check_choice, check_float32,
                         check_int, check_number, check_tensor, checked_once, cpu_fast,
                         float64_fallback, function_mode_active, native_cpu,
                         once_differentiable, planner_of, select_impl, transforms_active,
                         value_checks)
from .._launch import (INDEX_DTYPES, cdiv, dtype_name, kernel_op, lazy_kernels, next_pow2,
                       softcap_mode)
from .._nvtx import nvtx_range
from .._collectives import check_agreed_once, group_rank, group_size
from . import reference as ref
from .reference import CrossEntropyOutput
from .vocab_parallel import gather_stats, scalars

_OP = "cross_entropy"
_REDUCTIONS = ("mean", "sum", "none")
_kernels = lazy_kernels("kernels", __package__)


@dataclass(frozen=True, slots=True)
class StreamLaunch:
    """One launch of the stats-and-gradient pass over rows streamed in chunks (rows longer
    than the table's ``max_single_block``): an entry of a tuning table's ``fused`` list or
    ``linear_cross_entropy``'s ``kernel`` config, whose JSON keys are ``BLOCK_V``,
    ``num_warps``, ``programs_per_sm`` and, optionally, ``hints`` (L2 eviction hints on the
    logits and a streaming store of the gradient), ``slice`` and ``lag`` (rows in slices of
    ``slice`` columns, ``ce_slices_kernel``; phase B trails phase A by ``lag`` rows of
    slices) or ``vec`` and ``prefetch`` (whole rows a program, ``ce_stream_kernel``'s
    barrier-free stats loop). Without ``slice`` a program streams whole rows."""

    block_v: int
    num_warps: int
    programs_per_sm: float
    hints: bool = False
    slice: int = 0
    lag: int = 1
    vec: int = 0
    prefetch: bool = False

    @classmethod
    def of(cls, entry: dict[str, Any]) -> StreamLaunch:
        """The launch a table entry (a JSON object; flags as 0/1 or bools) describes."""
        return cls(entry["BLOCK_V"], entry["num_warps"], entry["programs_per_sm"],
                   bool(entry.get("hints", 0)), entry.get("slice", 0), entry.get("lag", 1),
                   entry.get("vec", 0), bool(entry.get("prefetch", 0)))

    def entry(self) -> dict[str, Any]:
        """The launch as a table entry: the three keys and the options it sets (``lag``
        with ``slice``; flags as 0/1)."""
        e: dict[str, Any] = dict(BLOCK_V=self.block_v, num_warps=self.num_warps,
                                 programs_per_sm=self.programs_per_sm)
        if self.hints:
            e["hints"] = 1
        if self.slice:
            e.update(slice=self.slice, lag=self.lag)
        if self.vec:
            e["vec"] = self.vec
        if self.prefetch:
            e["prefetch"] = 1
        return e

    def fit(self, itemsize: int, aligned: bool) -> StreamLaunch:
        """This launch for rows of ``itemsize``-byte logits: a ``vec`` launch's ``block_v``
        counts 2-byte logits (halved for float32), and unaligned rows get the plain stats
        loop at the same geometry (``vec`` is fast only on aligned rows)."""
        if not self.vec:
            return self
        if aligned:
            return replace(self, block_v=max(self.vec, self.block_v * 2 // itemsize))
        return replace(self, vec=0, prefetch=False)

    def encode(self) -> str:
        """The launch as a custom op's string argument (a custom op takes no object):
        its eight fields, comma-separated. Plain string formatting, so torch.compile
        traces it."""
        return (f"{self.block_v},{self.num_warps},{self.programs_per_sm},{int(self.hints)},"
                f"{self.slice},{self.lag},{self.vec},{int(self.prefetch)}")

    @classmethod
    def decode(cls, text: str) -> Optional[StreamLaunch]:
        """The launch :meth:`encode` wrote (``None`` for ``""``)."""
        if not text:
            return None
        v = text.split(",")
        return cls(int(v[0]), int(v[1]), _number(v[2]), v[3] == "1", int(v[4]), int(v[5]),
                   int(v[6]), v[7] == "1")


@dataclass(frozen=True, slots=True)
class CEConfig:
    """The launches of one row length: ``tiles`` (the row in registers, ``tiles.single``;
    else the stats-only pass's chunks) and, for streamed rows, the persistent passes'
    ``programs_per_sm`` and the stats-and-gradient pass's ``fused`` launch; ``stages``:
    the stats-only pass's chunk loop pipeline (the table's ``chunk_stages``; 0: Triton's
    default loop)."""

    tiles: tuning.RowTiles
    programs_per_sm: float = 0
    fused: Optional[StreamLaunch] = None
    stages: int = 0


def _config(V: int, device: torch.device, softcap: bool = False, itemsize: int = 2,
            aligned: bool = True) -> CEConfig:
    """The launches for rows of ``V`` logits, from the device's tuning table. With
    ``softcap`` the stats-and-gradient pass (compute-bound then: a tanh and its derivative
    per element) takes the table's ``fused_softcap`` launches where it has them.

    The fused pass's launches depend on what a row's bytes fit (L1, L2), so its buckets
    count a row in 2-byte elements: ``V * itemsize / 2`` (float32 rows count double). Its
    entries with ``vec`` (whole rows a program, the barrier-free stats loop) are sized for
    2-byte logits (``BLOCK_V`` halves for float32) and apply to ``aligned`` rows only:
    their masked loads are scalar otherwise, many times slower; the next entry of the list
    that fits is taken instead."""
    t = tuning.table("cross_entropy", device)
    tiles = tuning.row_tiles(t, V)
    if tiles.single:
        return CEConfig(tiles)
    # Streamed rows: the stats-only pass wants many programs in flight; the fused pass
    # (which reads each row twice) wants few enough rows in flight for L2 to keep them.
    fused = next(f for limit, f in t.get("fused_softcap" if softcap else "fused", t["fused"])
                 if V * itemsize // 2 <= limit and (aligned or not f.get("vec")))
    return CEConfig(tiles, t["programs_per_sm"], StreamLaunch.of(fused).fit(itemsize, aligned),
                    t.get("chunk_stages", 0))


def _aligned(x: torch.Tensor) -> bool:
    """2-D rows of 16-element multiples at 16-byte aligned addresses: Triton specializes on
    such sizes, which lets the whole-row launches' masked loads use 16-byte accesses."""
    return x.shape[-1] % 16 == 0 and x.stride(-2) % 16 == 0 and x.data_ptr() % 16 == 0


# --- kernel launches, as custom ops ------------------------------------------------------


def _persistent_grid(n: int, programs_per_sm: float, device: torch.device) -> int:
    return min(n, max(1, int(programs_per_sm * tuning.sm_count(device))))


def _launch_fwd(logits, target, count, grad, vocab_start, vocab_size, ignore_index,
                label_smoothing, z_loss, softcap, mean, fused=None, weight=None, wstat=None,
                argmax=False, token_scale=False):
    """Stats ``[4, N]`` (lse, x_t, sum x, loss), and the gradient into ``grad`` if given.

    The loss row (0 where ignored) is the whole loss only on one rank; it is scaled by
    ``1 / max(count, 1)`` when ``mean``, and so is the gradient. ``fused`` replaces the
    table's launch config of the stats-and-gradient pass over streamed rows (rows longer
    than ``max_single_block``), a :class:`StreamLaunch` (fitted to these rows by its
    :meth:`~StreamLaunch.fit`).

    ``weight``: class weights ``[V]`` float32 and ``wstat`` ``[2]`` = (their sum, the sum
    of the non-ignored targets'): the third stat is then ``sum w x`` and a mean divides
    the weighted terms by ``wstat[1]`` (:func:`_class_stats`). ``argmax``: stats ``[5, N]``,
    each row's first argmax (a global column, float32) last; the sliced launch is then
    replaced by the whole-row one of the same block and warps. ``token_scale`` (one rank,
    ``linear_cross_entropy``'s ``use_token_scaling``): each token's loss and gradient times
    its target probability ``exp(x_t - lse)``.
    """
    n, V = logits.shape
    stats = torch.empty(5 if argmax else 4, n, dtype=torch.float32, device=logits.device)
    if n == 0:
        return stats
    aligned = _aligned(logits) and (grad is None or grad is logits or _aligned(grad))
    cfg = _config(V, logits.device, softcap is not None, logits.element_size(), aligned)
    tiles = cfg.tiles
    if fused is not None and not tiles.single:
        cfg = replace(cfg, fused=fused.fit(logits.element_size(), aligned))
    write = grad is not None
    common = dict(HAS_SOFTCAP=softcap_mode(softcap), HAS_SMOOTHING=label_smoothing > 0,
                  WRITE_GRAD=write, MEAN=mean)
    if weight is not None or argmax:  # (left out otherwise: the default launches as they were)
        common.update(cw_ptr=weight, wstat_ptr=wstat, HAS_WEIGHT=weight is not None,
                      ARGMAX=argmax)
    if token_scale:
        common.update(TOKEN_SCALE=True)
    # (No gradient: None for its pointer, which the kernels read only with WRITE_GRAD, is
    # one tensor argument fewer to specialise at each launch.)
    args = (logits, logits.stride(0), target, stats, grad, grad.stride(0) if write else 0,
            count, n, V, vocab_start, vocab_size, ignore_index,
            *scalars(vocab_size, label_smoothing, z_loss, softcap))
    if tiles.single:
        _kernels().ce_fwd_kernel[(cdiv(n, tiles.block_m),)](
            *args, **common, BLOCK_M=tiles.block_m, BLOCK_V=tiles.block_n,
            num_warps=tiles.num_warps)
    elif write and cfg.fused.slice and not argmax:
        _launch_slices(logits, target, count, grad, stats, ignore_index, label_smoothing,
                       z_loss, softcap, mean, cfg.fused,
                       **({} if weight is None else dict(weight=weight, wstat=wstat)),
                       **({} if not token_scale else dict(token_scale=True)))
    elif write:  # persistent: a few programs per SM loop over the rows (sliced: whole rows
        f = cfg.fused  # at the slices' block and warps)
        _kernels().ce_stream_kernel[(_persistent_grid(n, f.programs_per_sm, logits.device),)](
            *args, **common, BLOCK_V=f.block_v, HINTS=f.hints, VEC=f.vec,
            PREFETCH=bool(f.vec and f.prefetch), num_warps=f.num_warps)
    else:
        _kernels().ce_stream_kernel[(_persistent_grid(n, cfg.programs_per_sm, logits.device),)](
            *args, **common, BLOCK_V=tiles.block_n, HINTS=False, VEC=0, PREFETCH=False,
            num_warps=tiles.num_warps, **({"STAGES": cfg.stages} if cfg.stages else {}))
    return stats


def _launch_slices(logits, target, count, grad, stats, ignore_index, label_smoothing, z_loss,
                   softcap, mean, f: StreamLaunch, weight=None, wstat=None, token_scale=False):
    """Stats and gradient of long rows in one launch, rows in slices (``ce_slices_kernel``)."""
    n, V = logits.shape
    block = f.block_v
    width = cdiv(min(f.slice, V), block) * block
    slices = cdiv(V, width)
    lag = f.lag * slices  # phase B trails phase A by this many tiles (>= slices)
    parts = torch.empty((n * slices * 4,), dtype=torch.float32, device=logits.device)
    counters = torch.zeros((n + 1,), dtype=torch.int32, device=logits.device)
    grid = min(n * slices + lag, max(1, int(f.programs_per_sm * tuning.sm_count(logits.device))))
    _kernels().ce_slices_kernel[(grid,)](
        logits, logits.stride(0), target, parts, counters[1:], counters[:1], stats, grad,
        grad.stride(0), count, n, V, ignore_index,
        *scalars(V, label_smoothing, z_loss, softcap), slices, width, lag,
        HAS_SOFTCAP=softcap_mode(softcap), HAS_SMOOTHING=label_smoothing > 0, MEAN=mean,
        SLICES_P2=next_pow2(slices, 2), BLOCK_V=block, HINTS=f.hints, num_warps=f.num_warps,
        **({} if weight is None else dict(cw_ptr=weight, wstat_ptr=wstat, HAS_WEIGHT=True)),
        **({} if not token_scale else dict(TOKEN_SCALE=True)),
    )


def _launch_grad(logits, target, stats, w, grad, vocab_start, vocab_size, ignore_index,
                 label_smoothing, z_loss, softcap, weight=None, wstat=None, wz=None, wt=None):
    """The gradient from whole-vocabulary ``stats`` and per-token upstream gradients ``w``
    (with class weights ``weight``, ``wstat`` as in :func:`_launch_fwd`: ``w`` scales the
    weighted terms, ``wz`` the z-loss's). ``wt [N]`` (vocabulary parallel): the tokens'
    target weights, ``weight`` being this rank's shard and ``wstat`` the whole
    vocabulary's."""
    n, V = logits.shape
    if n == 0:
        return
    cfg = _config(V, logits.device)
    args = (logits, logits.stride(0), target, stats, w, w.stride(0), grad, grad.stride(0),
            n, V, vocab_start, vocab_size, ignore_index,
            *scalars(vocab_size, label_smoothing, z_loss, softcap))
    extra = {} if weight is None else dict(
        cw_ptr=weight, wstat_ptr=wstat, wz_ptr=wz, stride_wz=wz.stride(0), HAS_WEIGHT=True,
        HAS_SMOOTHING=label_smoothing > 0)
    if wt is not None:
        extra.update(wt_ptr=wt, TARGET_WEIGHT=True)
    tiles = cfg.tiles
    if tiles.single:
        _kernels().ce_grad_kernel[(cdiv(n, tiles.block_m),)](
            *args, HAS_SOFTCAP=softcap_mode(softcap), BLOCK_M=tiles.block_m,
            BLOCK_V=tiles.block_n, num_warps=tiles.num_warps, **extra)
    else:
        _kernels().ce_stream_grad_kernel[(_persistent_grid(n, cfg.programs_per_sm,
                                                           logits.device),)](
            *args, HAS_SOFTCAP=softcap_mode(softcap), BLOCK_V=tiles.block_n,
            num_warps=tiles.num_warps, **extra)


# The launches the autograd functions call, each registered as its custom op by kernel_op
# (called directly when eager, through the op under torch.compile): each allocates and
# returns its outputs, or writes the argument it names in mutates_args.


def _stats_fake(logits, target, count, vocab_start, vocab_size, ignore_index,
                label_smoothing, z_loss, softcap, mean, weight=None, wstat=None, argmax=False):
    return logits.new_empty((5 if argmax else 4, logits.shape[0]), dtype=torch.float32)


@kernel_op("ce_stats", _stats_fake)
def _stats(logits: torch.Tensor, target: torch.Tensor, count: torch.Tensor, vocab_start: int,
           vocab_size: int, ignore_index: int, label_smoothing: float, z_loss: float,
           softcap: Optional[float], mean: bool, weight: Optional[torch.Tensor] = None,
           wstat: Optional[torch.Tensor] = None, argmax: bool = False) -> torch.Tensor:
    """The stats alone (:func:`_launch_fwd` without a gradient): the deferred forward."""
    return _launch_fwd(logits, target, count, None, vocab_start, vocab_size, ignore_index,
                       label_smoothing, z_loss, softcap, mean, None, weight, wstat, argmax)


def _fwd_grad_fake(logits, target, count, ignore_index, label_smoothing, z_loss, softcap, mean,
                   weight=None, wstat=None, argmax=False):
    return (logits.new_empty((5 if argmax else 4, logits.shape[0]), dtype=torch.float32),
            torch.empty_like(logits, memory_format=torch.contiguous_format))


@kernel_op("ce_fwd_grad", _fwd_grad_fake)
def _fwd_grad(logits: torch.Tensor, target: torch.Tensor, count: torch.Tensor,
              ignore_index: int, label_smoothing: float, z_loss: float,
              softcap: Optional[float], mean: bool, weight: Optional[torch.Tensor] = None,
              wstat: Optional[torch.Tensor] = None,
              argmax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(stats, gradient)`` of one rank's whole rows, the gradient in a new tensor: the
    fused forward."""
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    stats = _launch_fwd(logits, target, count, grad, 0, logits.shape[1], ignore_index,
                        label_smoothing, z_loss, softcap, mean, None, weight, wstat, argmax)
    return stats, grad


def _fwd_grad_inplace_fake(logits, target, count, ignore_index, label_smoothing, z_loss,
                           softcap, mean, launch="", weight=None, wstat=None, argmax=False,
                           token_scale=False):
    return logits.new_empty((5 if argmax else 4, logits.shape[0]), dtype=torch.float32)


@kernel_op("ce_fwd_grad_", _fwd_grad_inplace_fake, mutates_args=("logits",))
def _fwd_grad_(logits: torch.Tensor, target: torch.Tensor, count: torch.Tensor,
               ignore_index: int, label_smoothing: float, z_loss: float,
               softcap: Optional[float], mean: bool, launch: str = "",
               weight: Optional[torch.Tensor] = None, wstat: Optional[torch.Tensor] = None,
               argmax: bool = False, token_scale: bool = False) -> torch.Tensor:
    """The stats, the gradient written over the logits: the fused forward with
    ``inplace_backward``, and ``linear_cross_entropy``'s chunks. ``launch``:
    ``_launch_fwd``'s ``fused`` override, encoded by :meth:`StreamLaunch.encode` (a custom
    op takes no object)."""
    # Every kernel reads a row (or, sliced, a slice) in full before it writes any of its
    # gradient and the target's column is rewritten from the saved x_t: the gradient can
    # overwrite the logits.
    return _launch_fwd(logits, target, count, logits, 0, logits.shape[1], ignore_index,
                       label_smoothing, z_loss, softcap, mean, StreamLaunch.decode(launch), weight,
                       wstat, argmax, token_scale)


def _number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)


@kernel_op("ce_grad", lambda logits, *args, **kwargs: torch.empty_like(
    logits, memory_format=torch.contiguous_format))
def _grad(logits: torch.Tensor, target: torch.Tensor, stats: torch.Tensor, w: torch.Tensor,
          vocab_start: int, vocab_size: int, ignore_index: int, label_smoothing: float,
          z_loss: float, softcap: Optional[float], weight: Optional[torch.Tensor] = None,
          wstat: Optional[torch.Tensor] = None, wz: Optional[torch.Tensor] = None,
          wt: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The deferred backward's gradient (:func:`_launch_grad`) in a new tensor."""
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    _launch_grad(logits, target, stats, w, grad, vocab_start, vocab_size, ignore_index,
                 label_smoothing, z_loss, softcap, weight, wstat, wz, wt)
    return grad


@kernel_op("ce_grad_", lambda *args, **kwargs: None, mutates_args=("logits",))
def _grad_(logits: torch.Tensor, target: torch.Tensor, stats: torch.Tensor, w: torch.Tensor,
           vocab_start: int, vocab_size: int, ignore_index: int, label_smoothing: float,
           z_loss: float, softcap: Optional[float], weight: Optional[torch.Tensor] = None,
           wstat: Optional[torch.Tensor] = None, wz: Optional[torch.Tensor] = None,
           wt: Optional[torch.Tensor] = None) -> None:
    """The deferred backward's gradient written over the logits (``inplace_backward``, and
    ``linear_cross_entropy``'s chunks)."""
    _launch_grad(logits, target, stats, w, logits, vocab_start, vocab_size, ignore_index,
                 label_smoothing, z_loss, softcap, weight, wstat, wz, wt)


@kernel_op("ce_scale_", lambda grad, scale: None, mutates_args=("grad",))
def _launch_scale(grad: torch.Tensor, scale: torch.Tensor) -> None:
    """``grad *= scale[0]`` in place (float32 math, rounded to ``grad``'s dtype): the fused
    path's backward. A kernel that returns at once when the scale is 1."""
    n = grad.numel()
    if n:
        block = 4096
        grid = min(cdiv(n, block), 4 * tuning.sm_count(grad.device))
        _kernels().ce_scale_kernel[(grid,)](grad, scale, n, BLOCK=block, num_warps=8)


# --- autograd ---------------------------------------------------------------------------


def _class_stats(weight: torch.Tensor, target: torch.Tensor, ignore_index: int,
                 vocab_start: int = 0, whole: bool = True) -> torch.Tensor:
    """``[2]`` in ``weight``'s dtype (the op's float32, or float64 for float64 logits): the
    sum of ``weight`` and that of the non-ignored targets' weights among its columns from
    ``vocab_start`` on (a weighted mean's divisor: NaN where those targets' weights sum to
    0, :func:`reference.weighted_mean_divisor`, unless ``whole`` is False: a shard's
    share, to which the vocabulary-parallel forms apply that after summing). No host sync."""
    s = ref.target_weights(weight, target, ignore_index, vocab_start).sum()
    if whole:
        s = ref.weighted_mean_divisor(s, (target.long() != ignore_index).any())
    return torch.stack([weight.sum(), s])


class _CrossEntropy(torch.autograd.Function):
    """Loss of ``logits [N, V_local]``; see the module docstring for the passes.

    ``weight``: class weights ``[V]`` (float32, float64 for float64 logits) or None. With
    ``o.extras`` (a ``return_*`` option) it returns ``(loss, lse, predicted)``: each
    token's whole-vocabulary lse and, with ``o.argmax``, its first argmax (int64; an empty
    tensor otherwise), neither differentiable."""

    @staticmethod
    def forward(ctx, logits, target, weight, o: CrossEntropyCall):
        with nvtx_range(_OP, "fwd"):
            ls, z, cap, ignore = o.label_smoothing, o.z_loss, o.softcap, o.ignore_index
            count = torch.sum(target != ignore, dtype=torch.float32)
            ctx.o, ctx.fused = o, o.fused
            one_rank = o.tp_group is None
            mean = o.reduction == "mean" and one_rank
            argmax = o.argmax
            wstat = None if weight is None or not one_rank else _class_stats(weight, target,
                                                                              ignore)
            wt = pred = None  # (vocabulary parallel: the targets' weights, the argmax)
            opt = (weight, wstat, argmax)  # the launches' trailing arguments
            if o.fused:
                if o.inplace:
                    stats = _fwd_grad_(logits, target, count, ignore, ls, z, cap, mean, "",
                                       *opt)
                    _written(logits)
                    grad = logits
                else:
                    stats, grad = _fwd_grad(logits, target, count, ignore, ls, z, cap, mean,
                                            *opt)
                ctx.save_for_backward(grad)
            else:
                if o.path == "triton":
                    if not one_rank and weight is not None:  # (its loss row is not used)
                        opt = (weight, torch.ones(2, device=logits.device), argmax)
                    stats = _stats(logits, target, count, o.vocab_start, o.vocab_size, ignore,
                                   ls, z, cap, mean, *opt)
                else:
                    stats = ref.local_token_stats(logits, target, o.vocab_start, cap, weight)
                if not one_rank:
                    top = None
                    if argmax and o.path == "triton":
                        top = _local_top(logits, stats[4], o.vocab_start, cap)
                    elif argmax:
                        top = ref.local_top(logits, o.vocab_start, cap)
                    stats, wt, wstat, pred = gather_stats(stats, target, count, o,
                                                          o.reduction == "mean", weight, top)
                ctx.save_for_backward(logits, target, stats.contiguous(), count, weight, wstat,
                                      wt)
            if o.path == "triton":
                loss = stats[3]  # the kernels' per-token loss, already / count for "mean"
                # (a copy, not a view of the stats: a view made inside a Function could not
                # be changed in place, as a loss mask multiplied in does)
                loss = loss.clone() if o.reduction == "none" else loss.sum()
            else:
                ce, zl = ref.token_terms(stats, target, vocab_size=o.vocab_size,
                                         ignore_index=ignore, label_smoothing=ls, z_loss=z,
                                         weight=weight, target_weight=wt,
                                         weight_sum=None if wt is None else wstat[0])
                loss = ref.reduce_terms(ce, zl, target, count, o.reduction, ignore, weight,
                                        wt)
            if not o.extras:
                return loss
            if not argmax:
                pred = torch.empty(0, dtype=torch.int64, device=logits.device)
            elif pred is not None:
                pass  # vocabulary parallel: merged with the stats
            elif o.path == "triton":
                pred = stats[4].long()
            else:
                pred = ref.predicted_tokens(logits, target, ignore, cap)
            lse = stats[0].clone()
            ctx.mark_non_differentiable(lse, pred)
            return loss, lse, pred

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, *_extras):
        with nvtx_range(_OP, "bwd"):
            o = ctx.o
            if ctx.fused:
                _once(ctx, _OP)
                (grad,) = ctx.saved_tensors
                _launch_scale(grad, dout.float().reshape(1))
                return grad, None, None, None
            if o.inplace and getattr(ctx, "backward_done", False):
                # (before the saved logits are read: their bumped version would raise
                # autograd's less telling error)
                raise RuntimeError(
                    f"{_OP}: a second backward through the same loss is not supported "
                    "with inplace_backward=True: the first wrote its gradient over the "
                    "logits. Compute the loss again, or call backward once.")
            logits, target, stats, count, weight, wstat, wt = ctx.saved_tensors
            n = logits.shape[0]
            wz = None
            # float32 (float64 for float64 logits, which take the torch path)
            dout = dout.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
            if o.reduction == "none":
                w = dout.contiguous()
                wz = w
            elif o.reduction == "mean":
                w = (dout / count.clamp(min=1)).reshape(1).expand(n)
                if weight is not None:  # the weighted terms over sum w_t, the z-loss over count
                    wz = w
                    w_sum = torch.where(count > 0, wstat[1], torch.ones_like(wstat[1]))
                    w = (dout / w_sum).reshape(1).expand(n)
            else:
                w = dout.reshape(1).expand(n)
                wz = w
            args = (o.vocab_start, o.vocab_size, o.ignore_index, o.label_smoothing,
                    o.z_loss, o.softcap)
            opt = () if weight is None else (weight, wstat, wz, wt)
            if o.inplace:  # (this backward writes its gradient over the saved logits)
                ctx.backward_done = True
            if o.path == "triton":
                if o.inplace:
                    _grad_(logits, target, stats, w, *args, *opt)
                    _written(logits)
                    return logits, None, None, None
                return _grad(logits, target, stats, w, *args, *opt), None, None, None
            grad = ref.logits_grad(logits, target, stats[0], w, vocab_start=args[0],
                                   vocab_size=args[1], ignore_index=args[2],
                                   label_smoothing=args[3], z_loss=args[4], softcap=args[5],
                                   class_weight=weight, z_weight=wz, target_weight=wt,
                                   weight_sum=None if wt is None else wstat[0])
            return (logits.copy_(grad) if o.inplace else grad), None, None, None


def _local_top(logits: torch.Tensor, columns: torch.Tensor, vocab_start: int,
               softcap: Optional[float]) -> torch.Tensor:
    """``[2, N]`` float32 for :func:`gather_stats`: each row's max logit among this rank's
    columns and the global column of its first maximum, ``columns`` (the stats kernels'
    argmax row). The max is read back at that column (N loads, not a pass over the
    logits) and softcapped by torch, in the order the kernel compared them up to float32
    rounding: a NaN there for a row that holds one."""
    local = (columns.long() - vocab_start).clamp(0, logits.shape[1] - 1)
    value = ref.softcapped(logits.gather(1, local[:, None])[:, 0], softcap)
    return torch.stack([value.float(), columns])


def _once(ctx, op: str) -> None:
    """The fused path rescales the gradient it kept from the forward in place, so a second
    backward through the same graph (``retain_graph=True``) would scale it twice: refuse."""
    if getattr(ctx, "backward_done", False):
        raise RuntimeError(
            f"{op}: a second backward through the same loss is not supported: its gradient "
            "is computed in the forward and rescaled in place by the first backward. "
            "Compute the loss again, or call backward once with the summed upstream "
            "gradient.")
    ctx.backward_done = True


# --- validation and planning -------------------------------------------------------------


@functools.lru_cache(maxsize=256, typed=True)
def _scalar_options(op, ignore_index, label_smoothing, z_loss, softcap, reduction,
                    inplace_backward, return_z_loss, return_token_accuracy,
                    return_predicted_tokens) -> tuple[int, float, float, Optional[float]]:
    """The scalar options, validated (``typed``: ``True`` is not taken for ``1``):
    ``(ignore_index, label_smoothing, z_loss, softcap)``; the flags are checked to be
    bools. Errors start with ``op`` (the op the caller called)."""
    ignore_index = check_int(op, "ignore_index", ignore_index)
    if not -(1 << 63) <= ignore_index < (1 << 63):
        raise ValueError(f"{op}: ignore_index must be within int64's range, got {ignore_index}")
    ls = check_number(op, "label_smoothing", label_smoothing, allow_none=False)
    if not 0.0 <= ls <= 1.0:
        raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {ls}")
    z = check_float32(op, "z_loss", check_number(op, "z_loss", z_loss, allow_none=False))
    if z < 0:
        raise ValueError(f"{op}: z_loss must be >= 0, got {z}")
    cap = check_float32(op, "softcap", check_number(op, "softcap", softcap))
    if cap is not None and cap <= 0:
        raise ValueError(f"{op}: softcap must be None or > 0, got {cap}")
    check_choice(op, "reduction", reduction, _REDUCTIONS)
    if not isinstance(inplace_backward, bool):
        raise TypeError(f"{op}: inplace_backward must be a bool, got {inplace_backward!r}")
    for name, flag in (("return_z_loss", return_z_loss),
                       ("return_token_accuracy", return_token_accuracy),
                       ("return_predicted_tokens", return_predicted_tokens)):
        if not isinstance(flag, bool):
            raise TypeError(f"{op}: {name} must be a bool, got {flag!r}")
    return ignore_index, ls, z, cap


@dataclass(frozen=True, slots=True)
class CrossEntropyCall(ResolvedCall):
    """A checked :func:`cross_entropy` call: the loss options and the pass structure, what
    the autograd function, the launches and the planner read (and, as the loss options of
    ``linear_cross_entropy``, :class:`~lmfuse.cross_entropy.linear.LinearCrossEntropyCall`'s
    ``loss``)."""

    path: str  # "triton" or "torch"
    ignore_index: int
    label_smoothing: float
    z_loss: float
    softcap: Optional[float]
    reduction: str  # "mean", "sum" or "none"
    inplace: bool  # inplace_backward
    tp_group: Optional[Any]  # None for a group of one rank
    vocab_start: int  # this rank's first global class
    vocab_size: int  # the whole vocabulary, every rank's classes
    fused: bool  # the gradient computed in the forward
    grad_needed: bool
    weighted: bool  # class weights given
    argmax: bool  # return_token_accuracy or return_predicted_tokens
    extras: bool  # any return_* option: the result is a CrossEntropyOutput
    return_z_loss: bool
    return_token_accuracy: bool
    return_predicted_tokens: bool


def _resolve(logits, target, ignore_index, label_smoothing, z_loss, softcap, reduction,
             tp_group, inplace_backward, impl, weight=None, return_z_loss=False,
             return_token_accuracy=False,
             return_predicted_tokens=False) -> tuple[str, str, CrossEntropyCall]:
    """Validate the arguments and choose path and pass structure (no host sync on CUDA)."""
    check_tensor(_OP, "logits", logits)
    if logits.dim() < 1:
        raise ValueError(f"{_OP}: logits must be [..., V], got a 0-D tensor")
    return _resolve_logits(logits.shape, logits.dtype, logits.device, logits.requires_grad,
                           target, ignore_index, label_smoothing, z_loss, softcap, reduction,
                           tp_group, inplace_backward, impl, weight, return_z_loss,
                           return_token_accuracy, return_predicted_tokens)


def _resolve_logits(shape, dtype, device, requires_grad, target, ignore_index, label_smoothing,
                    z_loss, softcap, reduction, tp_group, inplace_backward, impl, weight,
                    return_z_loss, return_token_accuracy, return_predicted_tokens,
                    owner: tuple[str, str] = (_OP, "logits"),
                    ) -> tuple[str, str, CrossEntropyCall]:
    """:func:`_resolve` past the logits' own checks, from their shape, dtype, device and
    ``requires_grad``: what ``linear_cross_entropy`` checks its logits-to-be with (``owner``:
    the op and the argument whose dtype is ``dtype``, for the float64 message)."""
    op, name = owner
    check_tensor(op, "target", target, dtypes=INDEX_DTYPES)
    if tuple(target.shape) != tuple(shape[:-1]):
        raise ValueError(
            f"{op}: target must have shape {name}.shape[:-1] = {tuple(shape[:-1])}, "
            f"got {tuple(target.shape)}"
        )
    if target.device != device:
        raise ValueError(f"{op}: target is on {target.device} but {name} is on "
                         f"{device}; move them to one device")
    V_local = shape[-1]
    if V_local < 1:
        raise ValueError(f"{op}: logits must have at least one class, got V = 0")
    if tp_group is not None and not isinstance(tp_group, torch.distributed.ProcessGroup):
        raise TypeError(f"{op}: tp_group must be a torch.distributed.ProcessGroup or None, "
                        f"got {type(tp_group).__name__}")
    scalars = (ignore_index, label_smoothing, z_loss, softcap, reduction, inplace_backward,
               return_z_loss, return_token_accuracy, return_predicted_tokens)
    # The scalar options of a training loop repeat: checked once, not every call (2 us of
    # a 3 us op on a small CPU tensor). Only immutable values pass the checks.
    ignore_index, ls, z, cap = checked_once(_scalar_options, op, *scalars)
    if target.dtype == torch.int32 and not -(1 << 31) <= ignore_index < (1 << 31):
        # (torch compares an int32 tensor with it wrapped to int32: 2**32 + 1 would ignore
        # the targets of class 1 in some passes and not in others)
        raise ValueError(f"{op}: ignore_index must be within int32's range for int32 "
                         f"targets, got {ignore_index}")
    world = group_size(tp_group)
    vocab_start = group_rank(tp_group) * V_local
    vocab_size = V_local * world
    check_class_weights(_OP, "weight", weight, V_local, "logits.shape[-1]", device, "logits")
    argmax = return_token_accuracy or return_predicted_tokens
    if argmax and vocab_size > _MAX_ARGMAX_CLASSES:
        raise ValueError(f"{op}: return_token_accuracy / return_predicted_tokens take at most "
                         f"{_MAX_ARGMAX_CLASSES} classes (the kernels carry a class id in "
                         f"float32), got V = {vocab_size}")
    # float64: the torch path's float64 math (the kernels compute in float32).
    path, reason = float64_fallback(op, impl, *select_impl(op, impl, device), dtype, name)
    grad_needed = torch.is_grad_enabled() and requires_grad
    # float16 takes the deferred path: its gradient, scaled by the upstream gradient (the
    # loss scale of fp16 training) before rounding, must not be formed for a gradient of 1,
    # where (p - y) / count underflows float16 at large V and N.
    fused = (path == "triton" and world == 1 and reduction != "none" and grad_needed
             and dtype != torch.float16)
    call = CrossEntropyCall(
        path, ignore_index, ls, z, cap, reduction, inplace_backward,
        tp_group if world > 1 else None, vocab_start, vocab_size, fused, grad_needed,
        weight is not None, argmax, return_z_loss or argmax, return_z_loss,
        return_token_accuracy, return_predicted_tokens)
    return path, reason, call


def check_shards(op: str, o: CrossEntropyCall, n: int, V_local: int,
                 device: torch.device, **more: int) -> None:
    """With a ``tp_group``: every rank's shard of one width (its columns are placed at
    ``rank * V_local``) and one token count (the stats' all-gather), checked by the op's
    first call with the group (:func:`lmfuse._collectives.check_agreed_once`: a sharding
    set up wrongly); not by the planner, which issues no collective."""
    if o.tp_group is not None:
        check_agreed_once(op, o.tp_group, device,
                          **{"classes per rank": V_local, "tokens": n, **more})


_MAX_ARGMAX_CLASSES = 1 << 24  # every class id is exact in float32 up to here


def check_class_weights(op: str, name: str, w: Any, V_local: int, size_of: str,
                        device: torch.device, device_of: str) -> None:
    """Class weights ``name``: None, or a floating ``[V_local]`` tensor on ``device``
    (``size_of`` and ``device_of`` name where the vocabulary size and the device come from,
    for the messages). Shared by cross_entropy (``weight``) and linear_cross_entropy
    (``ce_weight``)."""
    if w is None:
        return
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor of class weights or None, "
                        f"got {type(w).__name__}")
    check_tensor(op, name, w, dtypes=None)  # (a dense one)
    if not w.is_floating_point():
        raise TypeError(f"{op}: {name} must be a floating-point tensor (class weights), "
                        f"got {w.dtype}")
    if w.dim() != 1 or w.shape[0] != V_local:
        raise ValueError(f"{op}: {name} must be 1-D [V] with V = {size_of} = "
                         f"{V_local}, got shape {tuple(w.shape)}")
    if w.device != device:
        raise ValueError(f"{op}: {name} is on {w.device} but {device_of} is on "
                         f"{device}; move them to one device")


def _written(logits: torch.Tensor) -> None:
    """Bump the version of ``logits`` after a Triton kernel wrote the gradient over them
    (``inplace_backward``), as an in-place torch op would: a node that saved them (an
    activation's output, say) then raises autograd's "modified by an inplace operation"
    instead of reading the gradient as logits. (Not while compiling: the custom op
    declares the write.)"""
    if not torch.compiler.is_compiling():
        torch.autograd.graph.increment_version(logits)


def outside_vocab_ignored(target: Any, vocab_size: int, ignore_index: int = -100) -> Any:
    """``target`` with the ids outside the vocabulary ``[0, vocab_size)`` (padding labels
    such as -1) set to ``ignore_index``: their loss 0, their gradient none, on every device
    and without a host synchronisation. Megatron-Core's vocabulary-parallel loss gives such
    a token the log-sum-exp of its logits (its target's logit taken as 0), which the loss
    mask of 0 such labels come with turns into 0 as well; ``cross_entropy`` refuses them on
    CPU tensors and gives +inf on CUDA (NaN times that mask). Anything but an integer tensor
    is returned as it is, for the loss's own checks."""
    if not isinstance(target, torch.Tensor) or target.is_floating_point() or \
            target.dtype == torch.bool:
        return target
    return target.masked_fill((target < 0) | (target >= vocab_size), ignore_index)


def _check_targets(target: torch.Tensor, o: CrossEntropyCall, op: str = _OP) -> None:
    """Out-of-range targets raise on CPU tensors, and on CUDA ones with
    ``lmfuse.set_checks(True)`` (a host sync). Not under ``torch.compile`` or CUDA-graph
    capture: the check branches on tensor data; there a bad target gets the CUDA
    behaviour (loss +inf, zero gradient).
    """
    if target.numel() == 0 or not value_checks(target):
        return
    bad = ((target < 0) | (target >= o.vocab_size)) & (target != o.ignore_index)
    if bool(bad.any()):
        raise ValueError(
            f"{op}: target holds {int(target[bad][0])}, which is neither ignore_index "
            f"({o.ignore_index}) nor a class in [0, {o.vocab_size})"
        )


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    reduction: str = "mean",
    tp_group: Optional[Any] = None,
    inplace_backward: bool = False,
    weight: Optional[torch.Tensor] = None,
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False,
    impl: str = "auto",
) -> torch.Tensor | CrossEntropyOutput:
    """Cross-entropy of ``logits [..., V]`` against class ids ``target [...]``.

    Same loss as ``torch.nn.functional.cross_entropy(logits.view(-1, V), target.view(-1),
    ignore_index=..., label_smoothing=..., reduction=...)``, with float32 math for every
    input dtype, plus:

    Args:
        z_loss: adds ``z_loss * lse**2`` per token (``lse`` = log-sum-exp of the logits).
        softcap: ``c`` applies ``c * tanh(logits / c)`` before everything else.
        tp_group: vocabulary parallelism: rank ``r`` of the group holds columns
            ``[r * V_local, (r + 1) * V_local)`` and ``target`` holds global ids. The
            forward issues one all-gather of ``[3, N]`` float32 token stats (more rows with
            ``weight`` or the argmax: see below); the backward none. Every rank gets the
            full loss.
        inplace_backward: write the gradient over ``logits`` (which must not be needed
            again, by you or by autograd: a node that saved them, or a checkpoint that
            recomputes the loss from them, raises autograd's in-place error); the op then
            allocates nothing of size N x V.
        reduction: ``"mean"`` over non-ignored tokens (0 when all are ignored), ``"sum"``,
            or ``"none"`` (float32 per-token losses of ``target``'s shape, 0 where ignored).
        weight: class weights ``[V]`` (any float dtype, used in float32; float64 for float64
            logits), as in ``F.cross_entropy``: the token's loss is scaled by
            ``weight[target]`` and label smoothing weighs class ``j`` by ``weight[j]``;
            ``"mean"`` divides by the sum of ``weight[target]`` over non-ignored tokens. The
            z-loss is not weighted (and a mean divides it by the token count), as in
            Liger-Kernel. ``weight`` gets no gradient.
        return_z_loss: also return the z-loss term, reduced as the loss (it is included
            in the loss).
        return_token_accuracy: also return the fraction of non-ignored tokens whose argmax
            is their target (0 when every token is ignored; per token, 1.0 or 0.0 and 0
            where ignored, for ``reduction="none"``).
        return_predicted_tokens: also return each token's argmax (int64, ``target``'s
            shape, -1 where ignored): the first maximum as ``torch.argmax`` (a NaN logit
            counts as the maximum), of the softcapped logits with ``softcap``. Taken in
            the pass that finds the row max: no extra read of the logits.
        impl: ``"auto"``, ``"triton"`` or ``"torch"``; see :func:`lmfuse.explain`.

    Where the gradient is computed in the forward (the fused Triton path of a ``"mean"`` or
    ``"sum"`` loss, and ``inplace_backward``), a second backward through the same loss
    (``retain_graph=True``) raises a ``RuntimeError``: compute the loss again.

    NaN and inf propagate as in ``F.cross_entropy`` on every path: a NaN or +inf logit
    makes its token's loss and gradient row NaN; -inf logits are masked classes (an all
    -inf row is NaN); with ``softcap``, +-inf logits cap to +-c. An ignored token's loss
    stays 0 and never poisons the mean (its gradient row is NaN where its logits make
    the softmax NaN, as PyTorch's is).

    Targets must be ``ignore_index`` or in ``[0, V)``. On CPU tensors anything else raises
    ``ValueError`` (in eager calls: a graph that ``torch.compile`` traced reads no values);
    on CUDA the check would stall the GPU, so it is not made (unless
    ``lmfuse.set_checks(True)``): such a token gets loss ``+inf`` (loud in any loss curve)
    and a zero gradient, and nothing is read out of bounds; so it does in compiled graphs.

    With ``tp_group``, ``weight`` is this rank's ``[V_local]`` shard of the class weights;
    the weights' rows and the argmax's (each rank's max logit and its first column) join
    the token stats in the one all-gather.

    Returns:
        float32 loss (float64, on the torch path, for float64 inputs: the kernels compute in
        float32, and ``impl="triton"`` raises ``TypeError`` for them): a scalar, or per-token
        ``[...]`` for ``reduction="none"``. With any ``return_*`` set, a
        :class:`CrossEntropyOutput` named tuple ``(loss, z_loss, token_accuracy,
        predicted_tokens)``, None for the fields not asked for; only the loss is
        differentiable.
    """
    if (impl == "auto" and weight is None and z_loss == 0.0 and softcap is None
            and tp_group is None and not inplace_backward and not return_z_loss
            and not return_token_accuracy and not return_predicted_tokens and cpu_fast(logits)):
        loss = _cpu_fast_loss(logits, target, ignore_index, label_smoothing, reduction)
        if loss is not None:
            return loss
    path, _, o = _resolve(logits, target, ignore_index, label_smoothing, z_loss, softcap,
                          reduction, tp_group, inplace_backward, impl, weight, return_z_loss,
                          return_token_accuracy, return_predicted_tokens)
    check_shards(_OP, o, target.numel(), logits.shape[-1], logits.device)
    cw = None
    if weight is not None:  # float32 (float64 for float64 logits)
        f64 = logits.dtype == torch.float64
        # (class weights get no gradient: a Parameter's would reach F.cross_entropy's
        # weight, which PyTorch cannot differentiate)
        cw = weight.detach().to(torch.float64 if f64 else torch.float32).contiguous()
    native = _native_cpu(logits, impl, o)
    if not native:  # (PyTorch's op checks the targets itself: see _native_cross_entropy)
        _check_targets(target, o)
    V = logits.shape[-1]
    lead = target.shape
    # (Already 2-D: no reshape, whose view would add a node to the backward.)
    logits2d = logits if logits.dim() == 2 else logits.reshape(-1, V)
    # Rows may be strided; columns must not be. In place, the gradient is written with the
    # layout of a fresh tensor, so those logits must be contiguous. (A reshape that copied
    # is contiguous already; no data_ptr test: torch.compile cannot trace one.)
    if logits2d.stride(-1) != 1 or (o.inplace and not logits2d.is_contiguous()):
        logits2d = logits2d.contiguous()
    target1d = target if target.dim() == 1 else target.reshape(-1)
    if not target1d.is_contiguous():
        target1d = target1d.contiguous()
    if native:
        loss = _native_cross_entropy(logits2d, target1d, o, cw)
    elif o.extras:
        return _with_extras(*apply_function(_CrossEntropy, logits2d, target1d, cw, o), target1d,
                            lead, o)
    else:
        loss = apply_function(_CrossEntropy, logits2d, target1d, cw, o)
    return loss.view(lead) if reduction == "none" else loss


@planner_of(cross_entropy)
def plan_cross_entropy(**a: Any) -> Plan:
    """What :func:`cross_entropy` would do with these arguments (validated the same way)."""
    path, reason, o = _resolve(**a)
    logits, tp_group = a["logits"], a["tp_group"]
    _check_targets(a["target"], o)
    V = logits.shape[-1]
    if _native_cpu(logits, a["impl"], o):
        return Plan(_OP, path, reason + "; CPU float32: PyTorch's F.cross_entropy",
                    {"logits": f"{list(logits.shape)} {dtype_name(logits.dtype)}",
                     "passes": "F.cross_entropy (autograd for the gradient)"}, call=o)
    details = {
        "logits": f"{list(logits.shape)} {dtype_name(logits.dtype)}",
        "vocabulary": (f"{V} of {o.vocab_size} (rank {group_rank(tp_group)}, one "
                       f"all-gather of [{3 + o.weighted + 2 * o.argmax}, N] stats)"
                       if o.tp_group is not None else str(V)),
        "passes": ("fused: stats + gradient in the forward kernel, backward only rescales"
                   if o.fused else
                   "deferred: stats in forward, gradient in backward" if o.grad_needed
                   else "stats only (no gradient needed)"),
    }
    if path == "triton":
        rows = logits.reshape(-1, V)  # what cross_entropy launches on, or a fresh copy
        copied = rows.stride(-1) != 1 or (o.inplace and not rows.is_contiguous())
        cfg = _config(V, logits.device, o.softcap is not None, logits.element_size(),
                      V % 16 == 0 if copied else _aligned(rows))
        tiles = cfg.tiles
        f = cfg.fused if o.fused and not tiles.single else None
        whole_rows = (f"streamed, a row per program in {f and f.block_v}-column chunks, "
                      "stats and gradient in one launch")
        details["kernel"] = (
            f"{tiles.block_m} row(s) x {tiles.block_n} per program, row in registers"
            if tiles.single else
            f"{whole_rows} (the argmax has no sliced launch)" if f and f.slice and o.argmax
            else f"rows in {f.slice}-column slices, stats and gradient in one launch"
            if f and f.slice else
            f"{whole_rows} (the second read, last chunk first, mostly from L1)"
            if f and f.vec else
            f"streamed in {f.block_v}-column chunks, stats and gradient in one launch"
            if f else
            f"streamed in {tiles.block_n}-column chunks, online log-sum-exp")
    extras = [name for name, on in (
        ("class weights", o.weighted), ("z-loss returned", o.return_z_loss),
        ("argmax in the stats pass", o.argmax)) if on]
    if extras:
        details["options"] = ", ".join(extras)
    return Plan(_OP, path, reason, details, call=o)


def _with_extras(loss: torch.Tensor, lse: torch.Tensor, pred: torch.Tensor,
                 target: torch.Tensor, lead: torch.Size, o: CrossEntropyCall,
                 token_scale: Optional[torch.Tensor] = None) -> CrossEntropyOutput:
    """The named tuple from the loss, each token's lse and argmax (see ``reference.py``);
    ``token_scale``: the tokens' z-loss factors (``use_token_scaling``)."""
    none = o.reduction == "none"
    count = torch.sum(target != o.ignore_index, dtype=torch.float32)
    if not o.argmax:
        pred = torch.zeros_like(target, dtype=torch.int64)
    # float32, or float64 with float64 logits (their loss is float64 too)
    stats = lse if lse.dtype == torch.float64 else lse.float()
    zl, right = ref.token_extras(stats, pred, target, count, z_loss=o.z_loss,
                                 ignore_index=o.ignore_index, reduction=o.reduction,
                                 token_scale=token_scale)
    pred = torch.where(target != o.ignore_index, pred, torch.full_like(pred, -1))
    return CrossEntropyOutput(
        loss.view(lead) if none else loss,
        (zl.view(lead) if none else zl) if o.return_z_loss else None,
        (right.view(lead) if none else right) if o.return_token_accuracy else None,
        pred.view(lead) if o.return_predicted_tokens else None)


def _cpu_fast_loss(logits: torch.Tensor, target: torch.Tensor, ignore_index: Any,
                   label_smoothing: Any, reduction: Any) -> Optional[torch.Tensor]:
    """The loss of the common CPU call (float32 ``[N, V]`` logits, int64 targets, the
    options in their plain types and ranges) by PyTorch's op itself, without the resolved
    call; None for any other call, which then takes the full path (its checks, its errors).

    What PyTorch's op checks itself is not checked first: the targets' shape and device
    and their values (an out-of-range target), where it raises, send the call to the
    full path, which raises lmfuse's ``ValueError``; nothing was computed. Under a torch
    function mode (which should see ``F.cross_entropy``) or a ``torch.func`` transform (no
    scalar to read) the full path runs too."""
    if not (type(target) is torch.Tensor and target.dtype is _I64 and logits.dim() == 2
            and type(ignore_index) is int and -(1 << 63) <= ignore_index < (1 << 63)
            and type(label_smoothing) is float and 0.0 <= label_smoothing <= 1.0
            and not function_mode_active() and not transforms_active()):
        return None
    n, v = logits.shape
    enum = _REDUCTION_ENUM.get(reduction) if type(reduction) is str else None
    if enum is None or v == 0:
        return None
    try:
        if n * v >= _CPU_OWN_BACKWARD:  # large logits: _native_loss picks the backward
            return _native_loss(logits, target, ignore_index, label_smoothing, reduction)
        # (F.cross_entropy's own op: its Python wrapper, 0.4 us, does nothing more here)
        loss = _ce_loss(logits, target, None, enum, ignore_index, label_smoothing)
    except (IndexError, RuntimeError, ValueError):  # PyTorch's refusal: the full path's
        return None
    if enum == 1 and _no_token(loss, target, ignore_index):
        return _ce_loss(logits, target, None, 2, ignore_index, label_smoothing)
    return loss


def _no_token(mean: torch.Tensor, target: torch.Tensor, ignore_index: int) -> bool:
    """Whether a mean loss was taken over no token (lmfuse's 0, PyTorch's 0 / 0): looked
    for only when the mean came out NaN (the scalar read as a Python float, a sixth of a
    tensor test's host time; no pass over the targets otherwise)."""
    return math.isnan(mean.item()) and not bool((target != ignore_index).any())


_I64 = torch.int64
# PyTorch's reduction numbers (torch.nn._reduction.get_enum), which its op takes
_REDUCTION_ENUM = {"none": 0, "mean": 1, "sum": 2}
_ce_loss = torch._C._nn.cross_entropy_loss


def _native_cpu(logits: torch.Tensor, impl: str, o: CrossEntropyCall) -> bool:
    """The default path on CPU float32 logits, when PyTorch's own op has every option in
    use: ``F.cross_entropy`` (float32 already, the same formula, NaN for NaN; autograd for
    the gradient) runs at the plain op's speed. ``impl="torch"`` keeps the reference, the
    tests' oracle; z-loss, softcap, tensor parallelism and ``inplace_backward`` need it."""
    return (native_cpu(impl, o.path, logits) and o.z_loss == 0.0
            and o.softcap is None and o.tp_group is None and not o.inplace
            and not o.extras)


def _native_cross_entropy(logits: torch.Tensor, target: torch.Tensor, o: CrossEntropyCall,
                          weight: Optional[torch.Tensor] = None, op: str = _OP
                          ) -> torch.Tensor:
    """``F.cross_entropy`` with lmfuse's reductions; an out-of-range target (PyTorch's
    ``IndexError``) raises lmfuse's ``ValueError``, nothing computed."""
    try:
        return _native_loss(logits, target, o.ignore_index, o.label_smoothing, o.reduction,
                            weight)
    except IndexError:
        _check_targets(target, o, op)
        raise


def _native_loss(logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
                 label_smoothing: float, reduction: str,
                 weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    if target.dtype is not torch.int64:
        target = target.long()  # lmfuse takes int32 ids too; PyTorch's op only int64
    # F.cross_entropy's arguments by position (input, target, weight, size_average,
    # ignore_index, reduce, reduction, label_smoothing): no keyword dict built a call.
    if reduction == "none":
        return F.cross_entropy(logits, target, weight, None, ignore_index, None, "none",
                               label_smoothing)
    transformed = transforms_active()  # (vmap / grad: no scalar read)
    own = (logits.numel() >= _CPU_OWN_BACKWARD and weight is None and label_smoothing == 0.0
           and logits.dim() == 2 and logits.stride(1) == 1 and logits.requires_grad
           and torch.is_grad_enabled() and not transformed)
    if reduction == "mean":
        loss = (apply_function(_CrossEntropyCPU, logits, target, ignore_index, "mean") if own
                else F.cross_entropy(logits, target, weight, None, ignore_index, None, "mean",
                                     label_smoothing))
        if transformed:  # a mean over no token is 0, picked without reading a value
            return torch.where((target != ignore_index).any(), loss, loss.new_zeros(()))
        if not _no_token(loss, target, ignore_index):
            return loss
    # "sum", or a mean over no token
    if own:
        return apply_function(_CrossEntropyCPU, logits, target, ignore_index, "sum")
    return F.cross_entropy(logits, target, weight, None, ignore_index, None, "sum",
                           label_smoothing)


# Logits of this many elements and more take the CPU loss's own backward: the softmax minus
# the one-hot, scaled in place (two passes over [N, V] where autograd's nll_loss and
# log_softmax backwards take three and a zero-filled [N, V] besides). Below, PyTorch's
# native backward nodes cost less than one in Python. 2 CPU threads (1), fwd+bwd against
# F.cross_entropy: [2048, 4096] 0.57x (0.80x), [512, 32000] 0.76x (0.79x), [2048, 32000]
# 0.79x (0.78x); [1024, 4096] 0.64x (1.07x), [512, 256] 1.75x.
_CPU_OWN_BACKWARD = 1 << 23


class _CrossEntropyCPU(torch.autograd.Function):
    """``F.cross_entropy`` (no class weights, no smoothing; "mean" or "sum") on large CPU
    logits: its forward (log-softmax, then the negative log-likelihood), and the gradient
    ``(softmax - onehot(target)) * g`` (over the counted tokens for the mean; ignored rows
    times 0, so a NaN row stays NaN as through PyTorch's backward)."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction):
        logp = torch.log_softmax(logits, -1)
        ctx.save_for_backward(logp, target)
        ctx.ignore_index, ctx.reduction = ignore_index, reduction
        return F.nll_loss(logp, target, ignore_index=ignore_index, reduction=reduction)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        logp, target = ctx.saved_tensors
        counted = target != ctx.ignore_index
        w = counted.to(logp.dtype) * (g / counted.sum() if ctx.reduction == "mean" else g)
        w = w.unsqueeze(1)
        dx = torch.exp(logp).mul_(w)
        dx.scatter_add_(1, target.where(counted, 0).unsqueeze(1), w.neg())
        return dx, None, None, None


# --- self-check cases for ``lmfuse check`` -----------------------------------------------


def checks(device: torch.device, dtypes) -> list:
    """Fresh random cases covering every option, for :mod:`lmfuse._check`."""
    from .._check import op_case

    small = device.type != "cuda"
    vs = (45, 5000, 20000) if small else (32000, 128256)

    def case(label, V, dtype, **kw):
        # (the interpreter's time grows with rows x columns: fewer rows at the long ones)
        n = (37 if V < 1000 else 13) if small else 1024
        target = torch.randint(0, V, (n,), device=device)
        target[::7] = -100

        def inputs():
            return [(torch.randn(n, V, device=device) * 3).to(dtype).requires_grad_(True)]

        return op_case(_OP, label, dtype, (n, V), inputs, cross_entropy, plan_cross_entropy,
                       target, **kw)

    cases = []
    for dtype in dtypes:
        for V in vs:
            cases += [
                case("mean", V, dtype),
                case("smoothing+z+softcap", V, dtype, label_smoothing=0.1, z_loss=1e-3,
                     softcap=30.0),
                case("none", V, dtype, reduction="none"),
            ]
    return cases
