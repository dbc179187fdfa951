"""``fused_softmax``: validation, dispatch, launch configuration and autograd.

The Triton path's two launches are ``torch.library`` custom ops (``lmfuse::softmax_fwd`` and
``lmfuse::softmax_bwd``, through :func:`lmfuse._launch.kernel_op`: called directly when
eager, as opaque nodes under ``torch.compile``), joined by an ``autograd.Function`` as in
every family; nothing syncs with the host.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from .. import tuning
from .._dispatch import (
    Plan,
    ResolvedCall,
    apply_function,
    check_float32,
    check_int,
    check_number,
    check_same_device,
    check_tensor,
    cpu_fast,
    native_cpu,
    planner_of,
    select_impl,
)
from .._dispatch import once_differentiable
from .._launch import cdiv, dtype_name, kernel_op, lazy_kernels
from .._nvtx import nvtx_range
from .reference import UNBOUNDED, fused_softmax_reference, visible_keys

_OP = "fused_softmax"
_kernels = lazy_kernels("kernels", __package__)


def _section(sk: int, device: torch.device) -> dict[str, Any]:
    """The device's ``softmax`` table for rows of ``sk`` keys: its ``long_rows`` entry's
    values laid over the rest from ``long_rows["min_keys"]`` keys on, where it has one."""
    t = tuning.table("softmax", device)
    long_rows = t.get("long_rows")
    if long_rows and sk >= long_rows["min_keys"]:
        return {**t, **long_rows}
    return t


def _config(sk: int, device: torch.device) -> tuning.RowTiles:
    """Block sizes and warps for rows of ``sk`` keys, from the device's tuning table."""
    return tuning.row_tiles(_section(sk, device), sk)


def _streamed(tiles: tuning.RowTiles, sk: int, device: torch.device,
              backward: bool = False) -> tuple[tuning.RowTiles, dict]:
    """``(tiles, extra meta-parameters)`` of a launch over rows of ``sk`` keys from
    :func:`_config`'s ``tiles``: a single tile as it is; streamed rows with ``HINTS`` where
    the table's ``chunk_hints`` asks for them (L2 keeps the first pass's reads for the
    second; nothing otherwise, so those launches are the kernels' defaults) and, for the
    ``backward`` (y and dy, twice the forward's bytes a chunk), the table's
    ``bwd_chunk_block`` and ``bwd_chunk_warps`` where it has them."""
    if tiles.single:
        return tiles, {}
    t = _section(sk, device)
    if backward and "bwd_chunk_block" in t:
        tiles = replace(tiles, block_n=t["bwd_chunk_block"], num_warps=t["bwd_chunk_warps"])
    return tiles, {"HINTS": True} if t.get("chunk_hints") else {}


def _split_scale(scale: float) -> tuple[float, float]:
    """``(hi, lo)``: ``hi`` the float32 nearest ``scale``, ``lo`` the rest (the kernels get
    float arguments as float32; ``hi + lo`` in float64 is ``scale`` to about 2^-48)."""
    hi = struct.unpack("f", struct.pack("f", scale))[0]
    return hi, scale - hi


def _compute_dtype(dtype: torch.dtype):
    import triton.language as tl

    return tl.float64 if dtype == torch.float64 else tl.float32


def _mask_operand(mask, shape, placeholder):
    """``(tensor, strides)`` a kernel reads ``mask`` through: expanded to ``shape`` with
    stride 0 on broadcast dims (nothing is copied), a boolean one as bytes; without a mask,
    ``placeholder`` and zero strides."""
    if mask is None:
        return placeholder, (0, 0, 0, 0)
    m = mask.expand(*shape)
    if mask.dtype == torch.bool:
        m = m.view(torch.uint8)
    return m, m.stride()


def _fwd_fake(scores, mask, softmax_offset, scale, left, right):
    n = scores.shape[0] * scores.shape[1] * scores.shape[2] if softmax_offset is not None else 0
    lse_dtype = torch.float64 if scores.dtype == torch.float64 else torch.float32
    return scores.new_empty(scores.shape), scores.new_empty((n,), dtype=lse_dtype)


@kernel_op("softmax_fwd", _fwd_fake)
def _launch_fwd(scores: torch.Tensor, mask: Optional[torch.Tensor],
                softmax_offset: Optional[torch.Tensor], scale: float, left: int,
                right: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, lse)``: the probabilities and, with a sink, each row's log-sum-exp (the
    backward's sink gradient reads it; empty without one)."""
    b, np_, sq, sk = scores.shape
    y = torch.empty((b, np_, sq, sk), dtype=scores.dtype, device=scores.device)
    n_rows = b * np_ * sq
    lse_dtype = torch.float64 if scores.dtype == torch.float64 else torch.float32
    lse = torch.empty(n_rows if softmax_offset is not None else 0, dtype=lse_dtype,
                      device=scores.device)
    if n_rows == 0 or sk == 0:
        return y, lse
    kind = 0 if mask is None else 1 if mask.dtype == torch.bool else 2
    m, m_strides = _mask_operand(mask, (b, np_, sq, sk), scores)
    tiles, stream = _streamed(_config(sk, scores.device), sk, scores.device)
    grid = (cdiv(n_rows, tiles.block_m),)
    _kernels().softmax_fwd_kernel[grid](
        scores, y, m, softmax_offset if softmax_offset is not None else scores, lse,
        n_rows, np_, sq, sk,
        *scores.stride(), *m_strides,
        *_split_scale(scale), left, right,
        BANDED=left < UNBOUNDED or right < UNBOUNDED, MASK_KIND=kind,
        HAS_OFFSET=softmax_offset is not None, STORE_LSE=softmax_offset is not None,
        COMPUTE=_compute_dtype(scores.dtype), **tiles.meta(), **stream,
    )
    return y, lse


def _dx_dtype(y_dtype: torch.dtype, unscaled_fp32: bool) -> torch.dtype:
    """The backward's ``dx``: the unscaled gradient (a learnable mask's, scaled afterwards
    for the scores) in float32, or float64 for float64 scores; else ``y``'s dtype."""
    return torch.float32 if unscaled_fp32 and y_dtype != torch.float64 else y_dtype


def _bwd_fake(dy, y, lse, softmax_offset, scale, left, right, unscaled_fp32, mask=None):
    dx = y.new_empty(y.shape, dtype=_dx_dtype(y.dtype, unscaled_fp32))
    n = y.shape[0] * y.shape[1] * y.shape[2] if softmax_offset is not None else 0
    return dx, lse.new_empty((n,))


@kernel_op("softmax_bwd", _bwd_fake)
def _launch_bwd(dy: torch.Tensor, y: torch.Tensor, lse: torch.Tensor,
                softmax_offset: Optional[torch.Tensor], scale: float, left: int, right: int,
                unscaled_fp32: bool, mask: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, d offset per row)``; ``mask``: the forward's boolean mask (or None; a float
    mask hides nothing), read only for rows whose gradient is NaN."""
    b, np_, sq, sk = y.shape
    n_rows = b * np_ * sq
    dx = torch.empty_like(y, dtype=_dx_dtype(y.dtype, unscaled_fp32),
                          memory_format=torch.contiguous_format)
    drow = torch.empty(n_rows if softmax_offset is not None else 0, dtype=lse.dtype,
                       device=y.device)
    if n_rows == 0 or sk == 0:
        if drow.numel():
            # Rows without keys: the sink takes everything, so its gradient is 0, or NaN for a
            # NaN or +inf sink (0 * exp(NaN), as the reference's autograd gives).
            sink = softmax_offset.to(drow.dtype)
            per_head = torch.where(sink == float("-inf"), 0.0, sink * 0.0)
            drow.view(b, np_, sq).copy_(per_head.view(1, np_, 1).expand(b, np_, sq))
        return dx, drow
    tiles, stream = _streamed(_config(sk, y.device), sk, y.device, backward=True)
    grid = (cdiv(n_rows, tiles.block_m),)
    off = softmax_offset if softmax_offset is not None else y
    bool_mask = mask if mask is not None and mask.dtype == torch.bool else None
    m, m_strides = _mask_operand(bool_mask, (b, np_, sq, sk), y)
    _kernels().softmax_bwd_kernel[grid](
        dy, y, dx, m, off, lse if lse.numel() else y, drow if drow.numel() else y,
        n_rows, np_, sq, sk,
        *dy.stride(), *m_strides,
        *_split_scale(1.0 if unscaled_fp32 else scale), left, right,
        BANDED=left < UNBOUNDED or right < UNBOUNDED, BOOL_MASK=bool_mask is not None,
        HAS_OFFSET=softmax_offset is not None, COMPUTE=_compute_dtype(y.dtype), **tiles.meta(),
        **stream,
    )
    return dx, drow


# --- autograd ---------------------------------------------------------------------------


class _Softmax(torch.autograd.Function):
    """``y = softmax(scale * scores + mask)`` on the Triton path; see :func:`fused_softmax`."""

    @staticmethod
    def forward(ctx, scores, mask, softmax_offset, scale: float, left: int, right: int):
        y, lse = _launch_fwd(scores, mask, softmax_offset, scale, left, right)
        # A boolean mask is kept for the backward (a reference, no copy): the hidden keys of
        # a NaN row hold NaN in y, and it finds them there.
        bool_mask = mask if mask is not None and mask.dtype == torch.bool else None
        ctx.save_for_backward(y, lse, softmax_offset, bool_mask)
        ctx.scale, ctx.left, ctx.right = scale, left, right
        # An additive float mask (ALiBi, relative-position bias) may be learnable.
        ctx.mask_grad = ctx.needs_input_grad[1]
        if ctx.mask_grad:
            ctx.mask_shape, ctx.mask_dtype = mask.shape, mask.dtype
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        with nvtx_range(_OP, "bwd"):
            y, lse, softmax_offset, bool_mask = ctx.saved_tensors
            need_x, mask_grad, need_offset = ctx.needs_input_grad[:3]
            dx, drow = _launch_bwd(dy, y, lse, softmax_offset, ctx.scale, ctx.left, ctx.right,
                                   mask_grad, bool_mask)
            dmask = doffset = None
            if mask_grad:
                # The kernel wrote g = d loss / d (scale * x + mask), in float32.
                dmask = dx.sum_to_size(ctx.mask_shape).to(ctx.mask_dtype)
                dx = (dx * ctx.scale).to(y.dtype)
            if need_offset:
                b, np_, sq, _ = y.shape
                doffset = drow.view(b, np_, sq).sum(dim=(0, 2)).to(softmax_offset.dtype)
            return (dx if need_x else None), dmask, doffset, None, None, None


# --- validation and planning -------------------------------------------------------------


def _resolve_band(window_size, causal: bool, sq: int, sk: int) -> tuple[int, int]:
    if not isinstance(causal, bool):
        raise TypeError(f"{_OP}: causal must be a bool, got {type(causal).__name__}")
    if causal and sq > sk:
        raise ValueError(
            f"{_OP}: causal=True needs sq <= sk (queries are the last sq of the sk keys), "
            f"got sq={sq}, sk={sk}"
        )
    if window_size is None:
        left, right = UNBOUNDED, UNBOUNDED
    elif isinstance(window_size, int) and not isinstance(window_size, bool):
        left, right = check_int(_OP, "window_size", window_size, minimum=0), 0
    elif isinstance(window_size, (tuple, list)) and len(window_size) == 2:
        bounds = []
        for side, v in zip(("left", "right"), window_size):
            v = check_int(_OP, f"window_size[{side}]", v, minimum=-1)
            bounds.append(UNBOUNDED if v == -1 else v)
        left, right = bounds
    else:
        raise TypeError(
            f"{_OP}: window_size must be None, an int >= 0 or a (left, right) pair of ints "
            f">= -1 (-1 = unbounded), got {window_size!r}"
        )
    if causal:
        right = min(right, 0)
    # A bound past any key is no bound (2**31 - 1, a common "unbounded", would overflow the
    # kernels' 32-bit band math into an empty band).
    return min(left, UNBOUNDED), min(right, UNBOUNDED)


def check_inputs(scores, mask, softmax_offset, *, op: str = _OP,
                 scores_name: str = "scores") -> Optional[str]:
    """Check ``scores [b, np, sq, sk]``, ``mask`` and ``softmax_offset [np]`` (errors start
    with ``op`` and call the scores ``scores_name``: the module's are ``input``); returns
    the mask kind (``None``, ``"bool"`` or ``"additive"``)."""
    check_tensor(op, scores_name, scores, ndim=4)
    np_ = scores.shape[1]
    kind = None
    if mask is not None:
        check_tensor(op, "mask", mask, dtypes=None)
        if mask.dtype != torch.bool and not mask.is_floating_point():
            raise TypeError(
                f"{op}: mask must be bool (True = masked out) or a floating additive mask, "
                f"got {mask.dtype}"
            )
        check_same_device(op, scores_name, scores, mask=mask)
        # (each trailing dim 1 or the scores': broadcastable, and to their shape)
        if mask.dim() > 4 or not all(
                m in (1, s) for m, s in zip(mask.shape[::-1], scores.shape[::-1])):
            raise ValueError(
                f"{op}: mask of shape {tuple(mask.shape)} is not broadcastable to {scores_name} "
                f"{tuple(scores.shape)}; expected [b|1, np|1, sq|1, sk|1] with [b, np, sq, sk] "
                f"= {list(scores.shape)}"
            )
        kind = "bool" if mask.dtype == torch.bool else "additive"
    if softmax_offset is not None:
        check_tensor(op, "softmax_offset", softmax_offset)
        if softmax_offset.shape != (np_,):
            raise ValueError(
                f"{op}: softmax_offset must have shape [np] = [{np_}], got "
                f"{tuple(softmax_offset.shape)} ({scores_name} is {list(scores.shape)})"
            )
        check_same_device(op, scores_name, scores, softmax_offset=softmax_offset)
    return kind


@dataclass(frozen=True, slots=True)
class SoftmaxCall(ResolvedCall):
    """A checked :func:`fused_softmax` call: what the launches and the planner read."""

    scale: float  # 1.0 for scale=None
    mask: Optional[torch.Tensor]
    mask_kind: Optional[str]  # None, "bool" or "additive"
    left: int  # the band: keys p - left .. p + right (UNBOUNDED: no bound)
    right: int
    softmax_offset: Optional[torch.Tensor]


def _resolve(scores, scale, mask, causal, window_size, softmax_offset, softmax_in_fp32,
             impl) -> tuple[str, str, SoftmaxCall]:
    """Validate the arguments and choose the path; cheap and traceable by torch.compile."""
    mask_kind = check_inputs(scores, mask, softmax_offset)
    b, np_, sq, sk = scores.shape
    scale = check_float32(_OP, "scale", check_number(_OP, "scale", scale))
    left, right = _resolve_band(window_size, causal, sq, sk)
    if not isinstance(softmax_in_fp32, bool):
        raise TypeError(f"{_OP}: softmax_in_fp32 must be a bool, got {softmax_in_fp32!r}")
    path, reason = select_impl(_OP, impl, scores.device)
    if softmax_offset is not None and not softmax_offset.is_contiguous():
        # (the kernels read head h's at offset + h; a strided or expanded view would be
        # misread: the copy is in the autograd graph, its gradient reaches the view)
        softmax_offset = softmax_offset.contiguous()
    call = SoftmaxCall(1.0 if scale is None else scale, mask, mask_kind, left, right,
                       softmax_offset)
    return path, reason, call


def fused_softmax(
    scores: torch.Tensor,
    *,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    window_size: int | tuple[int, int] | None = None,
    softmax_offset: torch.Tensor | None = None,
    softmax_in_fp32: bool = True,
    impl: str = "auto",
) -> torch.Tensor:
    """Fused scale → mask → softmax over the last dim of attention scores.

    Args:
        scores: ``[b, np, sq, sk]`` attention scores, fp32/fp16/bf16 (fp64 too), any strides.
        scale: multiplies ``scores`` before masking (``None`` = 1).
        mask: bool (True = masked out, Megatron's convention) or an additive float mask,
            broadcastable to ``[b, np, sq, sk]`` (``[b, 1, sq, sk]``, ``[b, 1, 1, sk]``, ...);
            never expanded in memory. A float mask that requires grad gets its gradient. A
            boolean mask is kept for the backward (a NaN row's hidden keys are found in it),
            as ``masked_fill`` keeps it: changing it in place before the backward raises,
            and saved-tensor hooks see it.
        causal: query row ``i`` sees keys ``j <= i + (sk - sq)`` (bottom-right aligned, so
            ``sq < sk`` works for chunked prefill); no mask tensor is built. Needs
            ``sq <= sk``.
        window_size: ``w`` — a causal sliding window, keys ``p - w .. p`` with
            ``p = i + (sk - sq)``; or ``(left, right)`` — keys ``p - left .. p + right``,
            ``-1`` for an unbounded side (Megatron's / flash-attention's convention).
        softmax_offset: ``[np]`` learnable sink logits: each denominator gains
            ``exp(offset_h)`` ("softmax off by one"); it receives a gradient.
        softmax_in_fp32: accepted for Megatron compatibility; the math is always float32
            (float64 for float64 input), whatever the flag.
        impl: ``"auto"`` (Triton on CUDA or under the interpreter, else the reference),
            ``"triton"`` or ``"torch"``; see :func:`lmfuse.explain`.

    Returns:
        ``[b, np, sq, sk]`` probabilities in ``scores.dtype`` (contiguous). Masked keys are
        excluded exactly (as ``-inf``); rows with every key masked are zeros, not NaN.

    NaN and inf propagate exactly as in ``torch.softmax(z.masked_fill(hidden, -inf), -1)``
    (the sink as one more logit): a NaN or ``+inf`` visible logit (or sink) makes every
    output of its row NaN, hidden keys included, as in PyTorch; the gradient is NaN at the
    row's visible keys and exactly 0 at its hidden keys, as ``masked_fill``'s backward gives.
    ``-inf`` is probability 0; a NaN under the boolean mask or outside the band is never
    read. The one deviation: a row whose keys are all hidden or ``-inf`` is zeros (PyTorch:
    NaN), whatever the sink. See :mod:`lmfuse.softmax.reference`.
    """
    if (impl == "auto" and mask is None and window_size is None and softmax_offset is None
            and softmax_in_fp32 is True and (causal is True or causal is False)
            and cpu_fast(scores) and scores.dim() == 4
            and (scale is None or (type(scale) is float and math.isfinite(scale)))
            and not (causal and scores.shape[-2] > scores.shape[-1])):
        # The common CPU call (float32 scores, a finite float scale or none, causal or not,
        # nothing else): _native_cpu on a call made here without the full checks (None for
        # a NaN row: the full path then checks and decides).
        y = _native_cpu(scores, SoftmaxCall(1.0 if scale is None else scale, None, None,
                                            UNBOUNDED, 0 if causal else UNBOUNDED, None))
        if y is not None:
            return y
    path, _, a = _resolve(scores, scale, mask, causal, window_size, softmax_offset,
                          softmax_in_fp32, impl)
    with nvtx_range(_OP, "fwd"):
        if native_cpu(impl, path, scores) and a.softmax_offset is None:
            y = _native_cpu(scores, a)
            if y is not None:
                return y
        if path == "torch":
            return fused_softmax_reference(
                scores, scale=a.scale, mask=a.mask, left=a.left, right=a.right,
                softmax_offset=a.softmax_offset,
            )
        if torch.is_grad_enabled() and (scores.requires_grad or any(
                t is not None and t.requires_grad for t in (a.mask, a.softmax_offset))):
            return apply_function(_Softmax, scores, a.mask, a.softmax_offset, a.scale, a.left,
                                  a.right)
        # Nothing to differentiate (inference): the launch alone, no autograd node.
        return _launch_fwd(scores, a.mask, a.softmax_offset, a.scale, a.left, a.right)[0]


@planner_of(fused_softmax)
def plan_fused_softmax(**a: Any) -> Plan:
    """What :func:`fused_softmax` would do with these arguments (validated the same way)."""
    path, reason, c = _resolve(**a)
    scores, left, right = a["scores"], c.left, c.right
    sk = scores.shape[-1]
    details = {
        "scores": f"{list(scores.shape)} {dtype_name(scores.dtype)}",
        "mask": c.mask_kind or "none",
        "band": "none" if (left, right) == (UNBOUNDED, UNBOUNDED) else
                f"keys p-{left if left < UNBOUNDED else 'inf'} .. "
                f"p+{right if right < UNBOUNDED else 'inf'}",
        "softmax_offset": c.softmax_offset is not None,
    }
    if path == "triton" and sk > 0:
        tiles = _config(sk, scores.device)
        if tiles.single:
            details["kernel"] = (f"one pass, {tiles.block_m} row(s) x {tiles.block_n} keys "
                                 "per program")
        else:
            bwd, stream = _streamed(tiles, sk, scores.device, backward=True)
            hints = ", L2 keeps the first pass's reads" if stream else ""
            details["kernel"] = (f"chunked online softmax, {tiles.block_n}-key chunks "
                                 f"({bwd.block_n} in the backward){hints}")
    if native_cpu(a["impl"], path, scores) and c.softmax_offset is None:
        reason += ("; CPU float32: torch.softmax of the masked, scaled scores (the reference "
                   "for rows with a NaN or with every key hidden)")
    return Plan(_OP, path, reason, details, call=c)


# (Cached tensors are made outside inference mode: one made under torch.inference_mode
# could not be saved for backward by the training calls that reuse it.)
@functools.lru_cache(maxsize=64)
def _hidden_band(sq: int, sk: int, left: int, right: int) -> torch.Tensor:
    with torch.inference_mode(False):
        return ~visible_keys(sq, sk, left, right, torch.device("cpu"))


@functools.lru_cache(maxsize=64)
def _band_bias(sq: int, sk: int, left: int, right: int) -> torch.Tensor:
    """The band's hidden keys as a float32 bias: -inf hidden, 0 visible. Adding it is a
    fraction of ``masked_fill``'s time with a broadcast bool mask (one CPU thread, [8, 4, 64,
    64]: 10 against 73 us) and gives the same scores, except where a hidden key is +inf or
    NaN: its row turns NaN, which ``_native_cpu`` hands to the reference."""
    with torch.inference_mode(False):
        return torch.zeros(sq, sk).masked_fill_(_hidden_band(sq, sk, left, right),
                                                float("-inf"))


def _native_cpu(scores: torch.Tensor, a: SoftmaxCall) -> Optional[torch.Tensor]:
    """The default path on CPU float32 scores: ``torch.softmax`` of the masked, scaled
    scores (PyTorch's own ops: the plain formula's speed; its gradient by ``_SoftmaxCPU``,
    the formula's values with fewer passes). That
    is the spec itself, NaN rows included (a NaN or +inf logit: NaN everywhere forward,
    masked_fill's zero gradient at hidden keys), except a row whose keys are all hidden or
    -inf: NaN here, zeros in the spec. Both kinds come out as rows of NaN, and zeroing the
    dead ones afterwards is not enough (torch.softmax's backward would still give their -inf
    keys a NaN gradient): it would take a second softmax with their logits replaced. Both
    are rare, so any NaN (a host check, free on the CPU) returns None and the caller runs
    the reference, which gives the NaN rows the same NaN and the dead rows zeros. A row of
    torch.softmax is NaN everywhere or nowhere (every entry is divided by the row's sum,
    which a NaN, an +inf or an all -inf row makes NaN), so its first column tells: the
    check reads 1 / sk of the output, not all of it.
    ``impl="torch"`` always runs the reference, the tests' oracle."""
    sq, sk = scores.shape[-2:]
    hidden = add = band = None
    if a.left < UNBOUNDED or a.right < UNBOUNDED:
        hidden = _hidden_band(sq, sk, a.left, a.right)
        band = _band_bias(sq, sk, a.left, a.right)
    if a.mask is not None and a.mask.dtype == torch.bool:
        hidden = a.mask if hidden is None else hidden | a.mask
        band = None  # the combined mask, by masked_fill
    elif a.mask is not None:
        add = a.mask
    if (scores.requires_grad and torch.is_grad_enabled()
            and not (add is not None and add.requires_grad)):
        y = apply_function(_SoftmaxCPU, scores, a.scale, hidden, add, band)
    else:
        y = torch.softmax(_masked_scores(scores, a.scale, hidden, add, band), dim=-1)
    if sk and math.isnan(y.detach()[..., 0].sum().item()):
        return None
    return y


def _masked_scores(scores: torch.Tensor, scale: float, hidden: Optional[torch.Tensor],
                   add: Optional[torch.Tensor], band: Optional[torch.Tensor] = None
                   ) -> torch.Tensor:
    """``scores * scale + add`` with the ``hidden`` keys at -inf (``_native_cpu``); where the
    hidden keys are a band alone, by adding its bias ``band`` (``_band_bias``)."""
    z = scores * scale if scale != 1.0 else scores
    if add is not None:
        # A float64 mask is used in the scores' float32, as the reference's math is (the
        # sum would otherwise promote the output to float64).
        z = z + (add.to(z.dtype) if add.dtype == torch.float64 else add)
    if band is not None:
        z = z.add_(band) if z is not scores else z + band
    elif hidden is not None:
        # In place where z is this call's own tensor (the product's backward needs neither
        # it nor its values): one [.., sq, sk] copy fewer than the plain formula's.
        z = z.masked_fill_(hidden, float("-inf")) if z is not scores else \
            z.masked_fill(hidden, float("-inf"))
    return z


class _SoftmaxCPU(torch.autograd.Function):
    """``_native_cpu``'s autograd where the scores need a gradient: the forward as without
    one, the backward PyTorch's softmax backward with the hidden keys' gradient zeroed and
    the scale applied in place on its output (autograd through the formula makes a new
    tensor for each of the three steps). The plain formula's gradient, bit for bit, but for
    the sign of a hidden key's zero under a band mask (``-0.0`` where ``y (dy - sum)`` is a
    negative zero; ``masked_fill`` writes ``+0.0``)."""

    @staticmethod
    def forward(ctx, scores, scale, hidden, add, band):
        y = torch.softmax(_masked_scores(scores, scale, hidden, add, band), dim=-1)
        ctx.save_for_backward(y, hidden)
        ctx.scale, ctx.band = scale, band is not None
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        y, hidden = ctx.saved_tensors
        dz = torch._softmax_backward_data(dy, y, -1, y.dtype)
        # At a hidden key y is 0, so dz = y (dy - sum(y dy)) is 0 there (of either sign)
        # unless it is NaN (a NaN or inf in dy, an overflow): with a band mask the zeroing
        # is needed only then, and one sum over dz tells (a NaN anywhere makes it NaN).
        if hidden is not None and (not ctx.band or math.isnan(dz.sum().item())):
            dz.masked_fill_(hidden, 0.0)
        if ctx.scale != 1.0:
            dz.mul_(ctx.scale)
        return dz, None, None, None, None


# --- self-check cases for ``lmfuse check`` -----------------------------------------------


def checks(device: torch.device, dtypes) -> list:
    """Fresh random cases covering every mask kind, for :mod:`lmfuse._check`."""
    from .._check import op_case

    small = device.type != "cuda"
    shapes = {"plain": (2, 3, 17, 45) if small else (2, 8, 256, 1000),
              "long row (chunked)": (1, 1, 2, 20000) if small else (1, 4, 8, 70000)}

    def case(label, shape, dtype, offset=False, mask=None, **kw):
        b, np_, sq, sk = shape

        def inputs():
            t = [torch.randn(shape, dtype=dtype, device=device, requires_grad=True)]
            if offset:
                t.append(torch.randn(np_, dtype=dtype, device=device, requires_grad=True))
            return t

        if mask is not None:  # "bool" [b, 1, sq, sk] or "padding" [b, 1, 1, sk]
            kw["mask"] = torch.rand(b, 1, sq if mask == "bool" else 1, sk, device=device) < 0.3
        return op_case(_OP, label, dtype, shape, inputs, fused_softmax, plan_fused_softmax,
                       keywords=("softmax_offset",) if offset else (), scale=0.125, **kw)

    cases = []
    for dtype in dtypes:
        p = shapes["plain"]
        cases += [
            case("plain", p, dtype),
            case("causal", p, dtype, causal=True),
            case("causal sq<sk", (p[0], p[1], p[2] // 2, p[3]), dtype, causal=True),
            case("window 7", p, dtype, window_size=7),
            case("bool mask", p, dtype, mask="bool"),
            case("padding mask", p, dtype, mask="padding"),
            case("causal + sink", p, dtype, causal=True, offset=True),
            case("long row (chunked)", shapes["long row (chunked)"], dtype, causal=True),
        ]
    return cases
