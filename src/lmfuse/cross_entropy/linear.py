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
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from .. import tuning
from .._dispatch import Plan, check_tensor, native_cpu, register_planner
from .._nvtx import nvtx_range
from ..distributed.collectives import all_reduce_sum_, group_rank
from . import ops
from . import reference as ref
from .vocab_parallel import gather_stats

_OP = "linear_cross_entropy"


def linear_cross_entropy_reference(
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
) -> torch.Tensor:
    """The specification: :func:`~lmfuse.cross_entropy.reference.cross_entropy_reference`
    of the float32 (float64 for float64) logits ``hidden @ weight.T + bias``, all at once.
    Differentiable in ``hidden``, ``weight`` and ``bias``."""
    compute = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logits = hidden.to(compute) @ weight.to(compute).T
    if bias is not None:
        logits = logits + bias.to(compute)
    return ref.cross_entropy_reference(logits, target, ignore_index=ignore_index,
                                       label_smoothing=label_smoothing, z_loss=z_loss,
                                       softcap=softcap, reduction=reduction)


_KERNEL_KEYS = ("BLOCK_V", "num_warps", "programs_per_sm")
_MAX_VALUES_PER_THREAD = 64  # fp32 row values a thread holds per tile; more spill registers


def config(v_local: int, device: torch.device) -> tuple[dict[str, Any], str]:
    """``(config, source)`` of the chunked op for ``v_local`` vocabulary rows on ``device``:
    the shape bucket's entry from the tuning tables and the ``lmfuse tune`` user cache
    (see :func:`lmfuse.tuning.bucket_config`), checked by :func:`check_config`.

    Keys: ``chunk_bytes`` (the logits chunk budget), ``row_multiple`` (chunk rows are
    rounded down to a multiple of it, for GEMM tiles) and ``kernel`` (``None``, or the
    launch config of the cross-entropy kernel's stats-and-gradient pass over rows longer
    than ``cross_entropy.max_single_block``: ``BLOCK_V``, ``num_warps``,
    ``programs_per_sm``, and optionally ``slice``, ``lag`` and ``hints``: 1 for L2 eviction
    hints on the logits and a streaming store of the gradient; or, for whole rows a
    program, ``vec`` and ``prefetch``: the barrier-free stats loop of ``ce_stream_kernel``).
    """
    cfg, source = tuning.bucket_config(_OP, device, v_local)
    return check_config(cfg, source), source


def check_config(cfg: dict[str, Any], source: str = "config") -> dict[str, Any]:
    """``cfg`` with defaults filled in, or a ``ValueError`` naming ``source`` if it could
    not launch (register budget, thread limit) or is malformed: the guard every table
    entry, cache entry and tuning candidate passes before anything runs."""
    def bad(what: str) -> ValueError:
        return ValueError(f"{_OP}: tuning config from {source}: {what}")

    cfg = dict(cfg)
    for key in ("chunk_bytes", "row_multiple"):
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise bad(f"{key} must be a positive int, got {v!r}")
    k = cfg.get("kernel")
    if k is None:
        return cfg
    if not isinstance(k, dict):
        raise bad(f"kernel must be null or an object, got {k!r}")
    missing = [key for key in _KERNEL_KEYS if key not in k]
    unknown = sorted(set(k) - set(_KERNEL_KEYS) - {"slice", "lag", "hints", "vec", "prefetch"})
    if missing or unknown:
        raise bad(f"kernel needs {', '.join(_KERNEL_KEYS)}"
                  f" (+ optional slice, lag, hints, vec, prefetch); missing {missing}, "
                  f"unknown {unknown}")
    for flag in ("hints", "prefetch"):
        if k.get(flag, 0) not in (0, 1):
            raise bad(f"kernel {flag} must be 0 or 1, got {k[flag]!r}")
    block, warps, per_sm = k["BLOCK_V"], k["num_warps"], k["programs_per_sm"]
    if not _pow2(block) or not 16 <= block <= 65536:
        raise bad(f"kernel BLOCK_V must be a power of two in [16, 65536], got {block!r}")
    if not _pow2(warps) or warps > 32:
        raise bad(f"kernel num_warps must be 1, 2, 4, 8, 16 or 32 (at most 1024 threads "
                  f"a program), got {warps!r}")
    per_thread = block // (32 * warps)
    if per_thread > _MAX_VALUES_PER_THREAD:
        raise bad(f"kernel BLOCK_V={block} over num_warps={warps} puts {per_thread} fp32 "
                  f"values in each thread's registers; at most {_MAX_VALUES_PER_THREAD} fit "
                  f"the 255-register budget without spilling (raise num_warps or lower "
                  f"BLOCK_V)")
    if isinstance(per_sm, bool) or not isinstance(per_sm, (int, float)) or \
            not 0 < per_sm <= 32:
        raise bad(f"kernel programs_per_sm must be in (0, 32], got {per_sm!r}")
    if "slice" in k:
        sl, lag = k["slice"], k.setdefault("lag", 1)
        if isinstance(sl, bool) or not isinstance(sl, int) or sl < block or sl % block:
            raise bad(f"kernel slice must be a multiple of BLOCK_V={block}, got {sl!r}")
        if isinstance(lag, bool) or not isinstance(lag, int) or lag < 1:
            raise bad(f"kernel lag must be a positive int, got {lag!r}")
    elif "lag" in k:
        raise bad("kernel lag is only meaningful with slice")
    vec = k.get("vec", 0)
    if vec and (not _pow2(vec) or vec > block or "slice" in k):
        raise bad(f"kernel vec must be 0 or a power of two <= BLOCK_V={block}, and without "
                  f"slice, got {vec!r}")
    if k.get("prefetch", 0) and not vec:
        raise bad("kernel prefetch is only meaningful with vec")
    cfg["kernel"] = k
    return cfg


def _pow2(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0 and v & (v - 1) == 0


def chunk_rows(n: int, v_local: int, itemsize: int, device: torch.device,
               max_chunk_bytes: Optional[int] = None, cfg: Optional[dict] = None) -> int:
    """Tokens per chunk: as many as the budget (``max_chunk_bytes``, else ``cfg``'s or the
    device's tuning table's ``chunk_bytes``) holds of ``[rows, v_local]`` logits, rounded
    down to the config's ``row_multiple`` when that leaves any, at least 1, at most ``n``."""
    if cfg is None:
        cfg = config(v_local, device)[0]
    budget = cfg["chunk_bytes"] if max_chunk_bytes is None else max_chunk_bytes
    rows = budget // max(1, v_local * itemsize)
    if rows >= cfg["row_multiple"]:
        rows -= rows % cfg["row_multiple"]
    return max(1, min(n, rows))


def _resolve(hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, softcap,
             reduction, tp_group, impl, max_chunk_bytes,
             cfg=None, logits_in_fp32=False) -> tuple[str, str, dict[str, Any]]:
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
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{_OP}: {name} is on {t.device} but hidden is on "
                             f"{hidden.device}; move them to one device")
    if not isinstance(logits_in_fp32, bool):
        raise TypeError(f"{_OP}: logits_in_fp32 must be a bool, got {logits_in_fp32!r}")
    if max_chunk_bytes is not None and (isinstance(max_chunk_bytes, bool) or not isinstance(
            max_chunk_bytes, int) or max_chunk_bytes < 1):
        raise ValueError(f"{_OP}: max_chunk_bytes must be a positive int or None, "
                         f"got {max_chunk_bytes!r}")
    # The loss options and target checks are those of cross_entropy, on a stand-in for
    # the logits of the right shape (no memory: a zero-stride expand).
    stand_in = hidden.new_empty(()).expand(*hidden.shape[:-1], weight.shape[0])
    path, reason, o = ops._resolve(stand_in, target, ignore_index, label_smoothing, z_loss,
                                   softcap, reduction, tp_group, False, impl)
    needs = (hidden.requires_grad, weight.requires_grad,
             bias is not None and bias.requires_grad)
    grad_needed = torch.is_grad_enabled() and any(needs)
    if cfg is None:
        cfg, source = config(weight.shape[0], hidden.device)
    else:
        cfg, source = check_config(cfg, "the caller"), "the caller"
    # float16: gradients in backward, scaled by the upstream gradient (a loss scale) before
    # they are rounded; computed in the forward for a gradient of 1, they would underflow.
    fused = grad_needed and reduction != "none" and hidden.dtype != torch.float16
    # float32 logits: only half-precision inputs change (float32/float64 logits already are).
    fp32_logits = logits_in_fp32 and hidden.dtype in (torch.float16, torch.bfloat16)
    o.update(needs=needs, grad_needed=grad_needed, max_chunk_bytes=max_chunk_bytes,
             fused=fused, config=cfg, config_source=source, fp32_logits=fp32_logits)
    return path, reason, o


def _chunk_itemsize(hidden: torch.Tensor, o: dict[str, Any]) -> int:
    """Bytes a logit takes in the chunk budget: the chunk in hidden's dtype, or in float32
    plus its gradient's copy in hidden's dtype (what the weight-gradient GEMMs read)."""
    return hidden.element_size() + (4 if o["fp32_logits"] else 0)


def _chunk_buffers(hidden: torch.Tensor, rows: int, v: int, o: dict[str, Any],
                   grads: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The logits chunk buffer (float32 with ``fp32_logits``) and, then, the buffer its
    gradient is rounded into for the GEMMs (``None`` otherwise: they read the chunk)."""
    if not o["fp32_logits"]:
        return hidden.new_empty((rows, v)), None
    buf = torch.empty((rows, v), dtype=torch.float32, device=hidden.device)
    return buf, (hidden.new_empty((rows, v)) if grads else None)


def _grad_operand(logits: torch.Tensor, half: Optional[torch.Tensor]) -> torch.Tensor:
    if half is None:
        return logits
    out = half[: logits.shape[0]]
    out.copy_(logits)
    return out


def _chunk_stats(logits, target, count, o, grad: bool, mean: bool):
    """Whole-vocabulary ``[3, rows]`` stats of one logits chunk and, with ``grad`` (for an
    upstream gradient of 1, or ``1 / count`` when ``mean``), its gradient in place."""
    ignore, ls, z, cap = o["ignore_index"], o["label_smoothing"], o["z_loss"], o["softcap"]
    one_rank = o["tp_group"] is None
    eager = ops._eager()  # else through the custom ops, opaque to torch.compile
    if o["path"] == "triton" and one_rank and grad:
        kernel = o["config"]["kernel"]
        if eager:
            return ops._launch_fwd(logits, target, count, logits, 0, logits.shape[1], ignore,
                                   ls, z, cap, mean, fused=kernel)[:3]
        return torch.ops.lmfuse.ce_fwd_grad_(logits, target, count, ignore, ls, z, cap, mean,
                                             ops.encode_launch(kernel))[:3]
    if o["path"] == "triton":
        start, size = o["vocab_start"], o["vocab_size"]  # (the loss row, scaled by mean,
        stats = (ops._launch_fwd(logits, target, count, None, start, size, ignore, ls, z, cap,
                                 False) if eager else  # is not used: [:3])
                 torch.ops.lmfuse.ce_stats(logits, target, count, start, size, ignore, ls, z,
                                           cap, False))[:3]
        if one_rank:
            return stats
    else:
        stats = ref.local_token_stats(logits, target, o["vocab_start"], cap)
    if not one_rank:
        stats = gather_stats(stats, target, count, o, False)[:3].contiguous()
    if grad:
        w = (1.0 / count.clamp(min=1) if mean else torch.ones((), device=logits.device))
        _chunk_grad(logits, target, stats, w.reshape(1).expand(logits.shape[0]), o)
    return stats


def _chunk_grad(logits, target, stats, w, o) -> None:
    """Overwrite a logits chunk with its gradient, from whole-vocabulary stats and the
    tokens' upstream gradients ``w [rows]`` (float32)."""
    args = (o["vocab_start"], o["vocab_size"], o["ignore_index"], o["label_smoothing"],
            o["z_loss"], o["softcap"])
    if o["path"] == "triton" and ops._eager():
        ops._launch_grad(logits, target, stats, w, logits, *args)
    elif o["path"] == "triton":
        torch.ops.lmfuse.ce_grad_(logits, target, stats, w, *args)
    else:
        logits.copy_(ref.logits_grad(logits, target, stats[0], w, vocab_start=args[0],
                                     vocab_size=args[1], ignore_index=args[2],
                                     label_smoothing=args[3], z_loss=args[4],
                                     softcap=args[5]))


class _Grads:
    """Accumulates the gradients of hidden, weight and bias over chunks."""

    def __init__(self, hidden, weight, bias, needs) -> None:
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.dh = torch.empty_like(hidden) if needs[0] else None
        self.dw = torch.empty_like(weight) if needs[1] else None
        self.db = (torch.zeros(bias.shape, dtype=_stats_dtype(bias), device=bias.device)
                   if needs[2] else None)
        self.first = True

    def add(self, g: torch.Tensor, r0: int, r1: int) -> None:
        """Add chunk ``[r0, r1)``'s contribution, from its logits gradient ``g``."""
        if self.dh is not None:
            torch.mm(g, self.weight, out=self.dh[r0:r1])
        if self.dw is not None:
            if self.first:
                torch.mm(g.T, self.hidden[r0:r1], out=self.dw)
            else:
                self.dw.addmm_(g.T, self.hidden[r0:r1])
        if self.db is not None:
            self.db += g.sum(dim=0, dtype=self.db.dtype)
        self.first = False

    def finish(self, tp_group) -> tuple:
        """(dh, dW, db); dh summed over the vocabulary-parallel group."""
        if self.dh is not None and tp_group is not None:
            all_reduce_sum_(self.dh, tp_group)
        if self.dw is not None and self.first:  # no tokens
            self.dw.zero_()
        db = self.db.to(self.bias.dtype) if self.db is not None else None
        return self.dh, self.dw, db


class _LinearCrossEntropy(torch.autograd.Function):
    """Loss of ``hidden [N, H] @ weight [V_local, H].T (+ bias)``; see the module docstring."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, o: dict[str, Any]):
        with nvtx_range(_OP, "fwd"):
            n = hidden.shape[0]
            rows = chunk_rows(n, weight.shape[0], _chunk_itemsize(hidden, o), hidden.device,
                              o["max_chunk_bytes"], o["config"])
            count = torch.sum(target != o["ignore_index"], dtype=torch.float32)
            mean = o["reduction"] == "mean"
            ctx.o, ctx.rows = o, rows
            grads = _Grads(hidden, weight, bias, o["needs"]) if o["fused"] else None
            buf, half = _chunk_buffers(hidden, min(rows, n), weight.shape[0], o,
                                       grads is not None)
            stats = torch.empty((3, n), dtype=_stats_dtype(hidden), device=hidden.device)
            for r0 in range(0, n, rows):
                r1 = min(n, r0 + rows)
                logits = buf[: r1 - r0]
                _logits(hidden[r0:r1], weight, bias, out=logits)
                stats[:, r0:r1] = _chunk_stats(logits, target[r0:r1], count, o, grads is not None,
                                               mean)
                if grads is not None:
                    grads.add(_grad_operand(logits, half), r0, r1)
            del buf, half
            loss = ref.token_loss(stats, target, vocab_size=o["vocab_size"],
                                  ignore_index=o["ignore_index"],
                                  label_smoothing=o["label_smoothing"], z_loss=o["z_loss"])
            if grads is not None:
                ctx.save_for_backward(*(g for g in grads.finish(o["tp_group"])
                                        if g is not None))
            elif o["grad_needed"]:
                ctx.save_for_backward(hidden, weight, bias, target, stats, count)
            ctx.has = tuple(o["needs"])
            if o["reduction"] == "none":
                return loss
            total = loss.sum()
            return total / count.clamp(min=1) if mean else total

    @staticmethod
    def backward(ctx, dout):
        with nvtx_range(_OP, "bwd"):
            o = ctx.o
            if o["fused"]:
                ops._once(ctx, _OP)
                saved = list(ctx.saved_tensors)
                out = []
                for need in ctx.has:
                    g = saved.pop(0) if need else None
                    if g is not None:
                        _scale(g, dout, o["path"])
                    out.append(g)
                return out[0], out[1], out[2], None, None
            hidden, weight, bias, target, stats, count = ctx.saved_tensors
            n, rows = hidden.shape[0], ctx.rows
            w = dout.float().contiguous()
            if o["reduction"] != "none":
                w = (w / count.clamp(min=1) if o["reduction"] == "mean" else w).reshape(1).expand(n)
            grads = _Grads(hidden, weight, bias, ctx.has)
            buf, half = _chunk_buffers(hidden, min(rows, n), weight.shape[0], o, True)
            for r0 in range(0, n, rows):
                r1 = min(n, r0 + rows)
                logits = buf[: r1 - r0]
                _logits(hidden[r0:r1], weight, bias, out=logits)
                _chunk_grad(logits, target[r0:r1], stats[:, r0:r1].contiguous(), w[r0:r1], o)
                grads.add(_grad_operand(logits, half), r0, r1)
            dh, dw, db = grads.finish(o["tp_group"])
            return dh, dw, db, None, None


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


def _scale(g: torch.Tensor, dout: torch.Tensor, path: str) -> None:
    """``g *= dout`` (a scalar tensor), without a host sync; a no-op kernel when it is 1."""
    if path == "triton" and g.is_contiguous() and ops._eager():
        ops._launch_scale(g, dout.float().reshape(1))
    elif path == "triton" and g.is_contiguous():
        torch.ops.lmfuse.ce_scale_(g, dout.float().reshape(1))
    else:
        g.mul_(dout.to(g.dtype))


@register_planner(_OP)
def plan_linear_cross_entropy(
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
) -> Plan:
    """What :func:`linear_cross_entropy` would do with these arguments."""
    path, reason, o = _resolve(hidden, weight, target, bias, ignore_index, label_smoothing,
                               z_loss, softcap, reduction, tp_group, impl, max_chunk_bytes,
                               logits_in_fp32=logits_in_fp32)
    n = target.numel()
    rows = chunk_rows(max(n, 1), weight.shape[0], _chunk_itemsize(hidden, o), hidden.device,
                      max_chunk_bytes, o["config"])
    chunks = -(-n // rows)
    details = {
        "hidden": f"{list(hidden.shape)} {str(hidden.dtype).replace('torch.', '')}",
        "vocabulary": (f"{weight.shape[0]} of {o['vocab_size']} (rank {group_rank(tp_group)}, "
                       f"one all-gather of [3, rows] stats per chunk)"
                       if o["tp_group"] is not None else str(weight.shape[0])),
        "chunks": (f"{chunks} x {rows} tokens; logits buffer "
                   f"{rows * weight.shape[0] * _chunk_itemsize(hidden, o) / 2**20:.1f} MiB"
                   + (" (float32 logits and their gradient in hidden's dtype)"
                      if o["fp32_logits"] else "")),
        "config": _describe(o["config"], o["config_source"], max_chunk_bytes),
        "passes": ("fused: gradients in the forward, backward only rescales" if o["fused"]
                   else "deferred: stats in forward, logits recomputed in backward"
                   if o["grad_needed"] else "stats only (no gradient needed)"),
    }
    return Plan(_OP, path, reason, details, o)


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
) -> torch.Tensor:
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
            all-reduced over the group. ``None`` or a one-rank group: no collective.
        max_chunk_bytes: the budget of the one logits chunk held at a time (default: the
            device's tuning table, 256 MiB); the op's extra memory beyond the gradients is
            this plus O(N) per-token state, whatever N.
        ignore_index, label_smoothing, z_loss, softcap, reduction, impl: as for
            :func:`lmfuse.cross_entropy`.
        logits_in_fp32: for float16/bfloat16 inputs, keep each logits chunk in float32 as
            the GEMM accumulates it (no rounding to the inputs' dtype before the softmax),
            so the loss and the softmax gradient match a float32-logits reference (what
            Megatron-Core's fused linear cross-entropy computes) to float32 rounding; the
            gradient is rounded to the inputs' dtype only for the GEMMs that make ``hidden``'s
            and ``weight``'s gradients. The chunk budget then counts 4 bytes a logit more
            (fewer rows a chunk). No effect on float32/float64 inputs.

    NaN and inf propagate as in ``F.cross_entropy(hidden @ weight.T + bias)`` (see
    :func:`lmfuse.cross_entropy`): a NaN in one row of ``weight`` makes every token's loss
    and every gradient NaN.

    Returns:
        float32 loss: a scalar, or per-token ``[...]`` for ``reduction="none"``.
    """
    return _apply(hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, softcap,
                  reduction, tp_group, impl, max_chunk_bytes, None, logits_in_fp32)


def _apply(hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, softcap,
           reduction, tp_group, impl, max_chunk_bytes, cfg,
           logits_in_fp32=False) -> torch.Tensor:
    """:func:`linear_cross_entropy`, with ``cfg`` (if not ``None``) in place of the tuning
    tables' config (how ``lmfuse tune`` times its candidates)."""
    path, _, o = _resolve(hidden, weight, target, bias, ignore_index, label_smoothing, z_loss,
                          softcap, reduction, tp_group, impl, max_chunk_bytes, cfg,
                          logits_in_fp32)
    lead = target.shape
    if (cfg is None and native_cpu(impl, path, hidden) and o["z_loss"] == 0.0
            and o["softcap"] is None and o["tp_group"] is None):
        # The default path on CPU float32 tensors: F.linear then F.cross_entropy (the plain
        # formula's speed; on a CPU the logits' memory is not what is scarce). impl="torch"
        # keeps the chunked reference, the tests' oracle.
        logits = F.linear(hidden.reshape(-1, hidden.shape[-1]), weight, bias)
        loss = ops._native_cross_entropy(logits, target.reshape(-1), o)
        return loss.view(lead) if reduction == "none" else loss
    ops._check_targets(target, o)
    h2d = hidden.reshape(-1, hidden.shape[-1])
    if not h2d.is_contiguous():
        h2d = h2d.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    t1d = target.reshape(-1)
    if not t1d.is_contiguous():
        t1d = t1d.contiguous()
    loss = _LinearCrossEntropy.apply(h2d, w, bias, t1d, o)
    return loss.view(lead) if reduction == "none" else loss


def _describe(cfg: dict[str, Any], source: str, max_chunk_bytes: Optional[int]) -> str:
    budget = (f"chunk budget {max_chunk_bytes / 2**20:.1f} MiB (max_chunk_bytes)"
              if max_chunk_bytes is not None else
              f"chunk budget {cfg['chunk_bytes'] / 2**20:.1f} MiB")
    kernel = ("table default" if cfg["kernel"] is None else
              ", ".join(f"{k}={v}" for k, v in cfg["kernel"].items()))
    return (f"{budget}, rows a multiple of {cfg['row_multiple']}, CE kernel {kernel} "
            f"(from {source})")


def checks(device: torch.device, dtypes) -> list:
    """Fresh random cases covering the options, for :mod:`lmfuse._check`."""
    from .._check import CheckCase

    small = device.type != "cuda"
    n, H, vs = (37, 16, (45, 3000)) if small else (1024, 512, (32000, 128256))

    def case(label, V, dtype, **kw):
        target = torch.randint(0, V, (n,), device=device)
        target[::7] = -100

        def inputs():
            return [torch.randn(n, H, device=device).to(dtype).requires_grad_(True),
                    (torch.randn(V, H, device=device) / H ** 0.5).to(dtype)
                    .requires_grad_(True)]

        def call(impl, h, w):
            return linear_cross_entropy(h, w, target, impl=impl, max_chunk_bytes=V * 256, **kw)

        def plan(h, w):
            return plan_linear_cross_entropy(h, w, target, **kw)

        return CheckCase(_OP, label, dtype, (n, H, V), inputs, call, plan)

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


# --- lmfuse tune linear_cross_entropy ----------------------------------------------------

TUNE_SHAPES = ((8192, 4096, 32000), (8192, 4096, 128256), (8192, 4096, 262144))
TUNE_TOLERANCE = 0.01  # a smaller chunk budget wins if within 1% of the fastest time
_MIB = 2**20
_KERNEL_CANDIDATES = (
    None,  # the cross_entropy table's own choice
    {"BLOCK_V": 8192, "num_warps": 16, "programs_per_sm": 8},
    {"BLOCK_V": 4096, "num_warps": 8, "programs_per_sm": 8},
    {"BLOCK_V": 8192, "num_warps": 8, "programs_per_sm": 4},
    {"BLOCK_V": 2048, "num_warps": 4, "programs_per_sm": 16},
    {"BLOCK_V": 4096, "num_warps": 8, "programs_per_sm": 4, "slice": 16384, "lag": 1},
    {"BLOCK_V": 8192, "num_warps": 16, "programs_per_sm": 2, "slice": 32768, "lag": 1},
    {"BLOCK_V": 4096, "num_warps": 8, "programs_per_sm": 8, "slice": 8192, "lag": 2},
    {"BLOCK_V": 4096, "num_warps": 8, "programs_per_sm": 4, "slice": 32768, "lag": 2,
     "hints": 1},
    {"BLOCK_V": 8192, "num_warps": 16, "programs_per_sm": 8, "hints": 1},
    {"BLOCK_V": 8192, "num_warps": 16, "programs_per_sm": 2, "hints": 1, "vec": 8,
     "prefetch": 1},
    {"BLOCK_V": 32768, "num_warps": 32, "programs_per_sm": 1, "hints": 1, "vec": 16,
     "prefetch": 1},
)


def tune_stages(v_local: int, device: torch.device, max_chunk_bytes: int) -> list:
    """The ``(key, values)`` stages ``lmfuse tune`` sweeps for ``v_local`` vocabulary rows:
    the chunk budget (powers of two from 64 MiB up to ``max_chunk_bytes``), the row
    multiple, and, when the rows are streamed, the cross-entropy kernel's launch."""
    budgets, b = [], 64 * _MIB
    while b <= max_chunk_bytes:
        budgets.append(b)
        b *= 2
    stages = [("chunk_bytes", budgets or [max_chunk_bytes]), ("row_multiple", [1, 64, 128, 256])]
    streamed = tuning.single_block_tile(tuning.table("cross_entropy", device), v_local) is None
    if streamed:
        stages.append(("kernel", list(_KERNEL_CANDIDATES)))
    return stages


def tune(shapes=TUNE_SHAPES, dtype: torch.dtype = torch.bfloat16,
         device: Optional[torch.device] = None, *, max_chunk_bytes: int = 512 * _MIB,
         timer=None, impl: str = "auto", record: bool = True, log=print) -> list[dict]:
    """Sweep configs of the chunked op for each ``(N, H, V)`` in ``shapes`` (forward and
    backward, ``dtype``) and, with ``record``, write the best into the user cache for V's
    bucket (:func:`lmfuse.tuning.record`), with its measured time. The best is the fastest,
    or the one with the smallest chunk budget among those within ``TUNE_TOLERANCE`` of it
    (memory is the op's other cost). Returns one dict per shape: shape, bucket, best
    config, its time, and every trial.

    ``timer(fn) -> ms`` defaults to CUDA events (:func:`lmfuse.tuning.sweep.cuda_timer`);
    candidates over ``max_chunk_bytes`` are not tried, and every candidate passes
    :func:`check_config` first.
    """
    from ..tuning import sweep

    device = torch.device("cuda") if device is None else device
    if timer is None:
        if device.type != "cuda":
            raise ValueError(f"{_OP} tune: timing needs a CUDA device, got {device}; pass a "
                             f"timer to sweep elsewhere")
        timer = sweep.cuda_timer()
    results = []
    for N, H, V in shapes:
        gen = torch.Generator(device=device).manual_seed(0)
        h = torch.randn(N, H, device=device, generator=gen).to(dtype).requires_grad_(True)
        w = (torch.randn(V, H, device=device, generator=gen) / H ** 0.5).to(dtype)
        w.requires_grad_(True)
        t = torch.randint(0, V, (N,), device=device, generator=gen)

        def run(cfg):
            h.grad = w.grad = None
            _apply(h, w, t, None, -100, 0.0, 0.0, None, "mean", None, impl, None,
                   cfg).backward()

        start, source = config(V, device)
        start = dict(start, chunk_bytes=min(start["chunk_bytes"], max_chunk_bytes))
        log(f"{_OP} N={N} H={H} V={V} {str(dtype).replace('torch.', '')} "
            f"(start: {source})")
        out = sweep.coordinate_sweep(start, tune_stages(V, device, max_chunk_bytes), run,
                                     lambda c: check_config(c, "a tuning candidate"), timer,
                                     log, prefer=lambda c: c["chunk_bytes"],
                                     tolerance=TUNE_TOLERANCE, confirm=3)
        best = {k: out.best[k] for k in ("chunk_bytes", "row_multiple", "kernel")}
        result = dict(shape=[N, H, V], dtype=str(dtype).replace("torch.", ""),
                      bucket=tuning.bucket_of(_OP, V), best=best, ms=out.ms,
                      trials=[vars(tr) for tr in out.trials])
        log(f"  best {out.ms:.3f} ms: {sweep._brief(best)}")
        if record:
            path = tuning.record(_OP, device, V, best, dict(
                ms=round(out.ms, 4), shape=[N, H, V], dtype=result["dtype"],
                torch=torch.__version__, triton=_triton_version()))
            log(f"  recorded in {path}")
        results.append(result)
        h = w = t = None  # free the sweep's tensors
    return results


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "not installed"
    return triton.__version__
