"""Decode attention, the exact merge of partial attention states, and the KV-cache append:
validation, dispatch and launches.

Decode attention is an inference op: it has no backward (ask for ``impl="torch"`` to
differentiate through the reference). The Triton path never synchronises with the host:
the split count comes from the shapes (the cache's capacity, not the lengths in
``cache_seqlens``), so a call can be captured in a CUDA graph. Its launches are
``torch.library`` custom ops through :func:`lmfuse._launch.kernel_op`: called directly when
eager, opaque graph nodes under ``torch.compile``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch

from .. import _pdl, tuning
from .._dispatch import (Plan, ResolvedCall, check_float32, check_int, check_number,
                         check_same_device, check_tensor, interpreter_active, native_cpu,
                         planner_of, select_impl, value_checks)
from .._launch import (FP8_DTYPES, INDEX_DTYPES, KERNEL_DTYPES, cdiv, dtype_name, kernel_op,
                       lazy_kernels, next_pow2, softcap_mode)
from .._nvtx import nvtx_range
from . import reference as ref

_kernels = lazy_kernels("decode_kernels", __package__)


# --- validation ------------------------------------------------------------------------------


def check_cache(op: str, q_dtype, k_cache, v_cache, block_table, B: int, Hq: int, D: int,
                names: tuple[str, str, str] = ("k_cache", "v_cache", "block_table"),
                dtype_of: str = "the queries'"):
    """Shared by decode_attention, kv_cache_append, ``block.DecodeAttentionBlock`` and
    ``cp_cache_append`` (the attention package's one cache check; ``names``: the three
    arguments' names in the caller's errors; ``dtype_of``: whose dtype ``q_dtype`` is, and
    ``Hq=None`` where there are no queries): the two caches, their layout and the block
    table. Returns ``(Hkv, capacity per sequence)``."""
    kn, vn, tn = names
    check_tensor(op, kn, k_cache, ndim=4, dtypes=None)
    check_tensor(op, vn, v_cache, ndim=4, dtypes=None)
    for name, c in ((kn, k_cache), (vn, v_cache)):
        if c.dtype not in FP8_DTYPES and c.dtype != q_dtype:
            raise TypeError(f"{op}: {name} must have {dtype_of} dtype "
                            f"{dtype_name(q_dtype)} or be float8_e4m3fn, got "
                            f"{dtype_name(c.dtype)}")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"{op}: {kn} is {dtype_name(k_cache.dtype)} but {vn} is "
                        f"{dtype_name(v_cache.dtype)}; they must have one dtype")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"{op}: {kn} {tuple(k_cache.shape)} and {vn} "
                         f"{tuple(v_cache.shape)} must have one shape")
    n0, rows, Hkv, Dk = k_cache.shape
    if Dk != D:
        raise ValueError(f"{op}: the caches' head dim is {Dk} but the new/query rows' is {D}")
    if Hkv == 0:
        raise ValueError(f"{op}: the caches must have at least one KV head (dim 2), got "
                         f"{tuple(k_cache.shape)}")
    if Hq is not None and Hq % Hkv:
        raise ValueError(f"{op}: the query heads ({Hq}) must be a multiple of the caches' KV "
                         f"heads ({Hkv}) (GQA)")
    if block_table is None:
        if n0 != B:
            raise ValueError(f"{op}: a contiguous cache [B, S_max, Hkv, D] must have B = {B} "
                             f"rows (the queries' batch), got {tuple(k_cache.shape)}; pass "
                             f"{tn} for a paged cache [num_blocks, block_len, Hkv, D]")
        return Hkv, rows
    check_tensor(op, tn, block_table, ndim=2, dtypes=INDEX_DTYPES)
    if block_table.shape[0] != B:
        raise ValueError(f"{op}: {tn} must be [B={B}, max_blocks], got "
                         f"{tuple(block_table.shape)}")
    if rows == 0:
        raise ValueError(f"{op}: a paged cache's block_len (dim 1) must be >= 1, got 0")
    return Hkv, block_table.shape[1] * rows


def check_seqlens(op: str, cache_seqlens, B: int) -> None:
    check_tensor(op, "cache_seqlens", cache_seqlens, ndim=1, dtypes=INDEX_DTYPES)
    if cache_seqlens.shape[0] != B:
        raise ValueError(f"{op}: cache_seqlens must be [B={B}], got "
                         f"{tuple(cache_seqlens.shape)}")


def check_scales(op: str, k_scale, v_scale, Hkv: int, cache_dtype) -> None:
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is not None:
            if cache_dtype not in FP8_DTYPES:
                raise ValueError(f"{op}: {name} is for float8_e4m3fn caches; the caches are "
                                 f"{dtype_name(cache_dtype)}")
            check_tensor(op, name, s, ndim=1)
            if s.shape[0] != Hkv:
                raise ValueError(f"{op}: {name} must be [Hkv={Hkv}] (one scale per KV head), "
                                 f"got {tuple(s.shape)}")


def check_no_grad(op: str, path: str, why: str, **inputs: Optional[torch.Tensor]) -> None:
    """The Triton path has no backward: under grad mode, an input that requires grad would
    lose its gradient silently, so it is refused (``impl="torch"`` differentiates through
    the reference). ``why``: why the op has none; ``inputs``: the tensors by name."""
    if path != "triton" or not torch.is_grad_enabled():
        return
    for name, t in inputs.items():
        if t is not None and t.requires_grad:
            raise ValueError(f"{op}: the Triton path has no backward ({why}) but {name} "
                             "requires grad; run it under torch.no_grad() or use impl='torch'")


# --- value checks ------------------------------------------------------------------------
#
# The contract on the inputs' values, one for both paths: run whenever
# ``value_checks(tensor)`` is True (always on CPU tensors; on CUDA ones with
# ``lmfuse.set_checks(True)`` / ``LMFUSE_CHECK=1``, never while compiling or capturing), and
# on the reference path on any device (it reads the lengths on the host anyway, and would
# index out of range instead). All the conditions of a call are reduced on the device and
# read back in one host sync; the details of a failure are read only then. Without them the
# kernels stay in bounds (see the ops' docstrings for what they skip).

_Check = tuple[torch.Tensor, Callable[[Any], str]]


def _raise_first(checks: list[_Check]) -> None:
    """``checks``: ``(bad, message)`` pairs, ``bad`` a bool tensor (True where a value breaks
    the contract) and ``message(index)`` the error for its first bad index (a tuple for a
    multi-dimensional ``bad``). Raises ``ValueError`` for the first check that fails."""
    if not checks:
        return
    failed = torch.stack([bad.any() for bad, _ in checks]).tolist()  # the one host sync
    for (bad, message), fail in zip(checks, failed):
        if fail:
            first = bad.nonzero()[0].tolist()
            raise ValueError(message(first[0] if len(first) == 1 else tuple(first)))


def _rows_per_sequence(k_cache: torch.Tensor, block_table: Optional[torch.Tensor]) -> int:
    """A sequence's capacity in the cache: ``S_max``, or ``max_blocks * block_len``."""
    rows = k_cache.shape[1]
    return block_table.shape[1] * rows if block_table is not None else rows


def _kernel_dtype_path(op: str, impl: str, device: torch.device, dtype: torch.dtype, verb: str,
                       what: str) -> tuple[str, str]:
    """:func:`select_impl`'s ``(path, reason)``, with ``what`` of a dtype the kernels do not
    take on the reference instead (``impl="triton"``: a ``TypeError`` saying so)."""
    path, reason = select_impl(op, impl, device)
    if path == "triton" and dtype not in KERNEL_DTYPES:
        if impl == "triton":
            raise TypeError(f"{op}: impl='triton' {verb} float32/float16/bfloat16 {what}, got "
                            f"{dtype_name(dtype)}; use impl='torch'")
        path, reason = "torch", f"{dtype_name(dtype)} {what}: the reference"
    return path, reason


def _capacity(k_cache, block_table, capacity: int) -> str:
    if block_table is None:
        return f"{capacity} rows per sequence: the caches' S_max"
    return (f"{capacity} rows per sequence: max_blocks * block_len = {block_table.shape[1]} "
            f"* {k_cache.shape[1]}")


def _scale_checks(op: str, k_scale, v_scale) -> list[_Check]:
    checks = []
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc is not None:
            checks.append((~(torch.isfinite(sc) & (sc > 0)), lambda h, name=name, sc=sc: (
                f"{op}: {name} must be finite and > 0 (an fp8 cache's dequantisation scale "
                f"per KV head), got {name}[{h}] = {float(sc[h])}")))
    return checks


def _block_checks(op: str, block_table, num_blocks: int, first, stop, rows,
                  why: Callable[[int], str]) -> list[_Check]:
    """Block ids in columns ``[first[b], stop[b])`` of the rows ``rows [B]`` (bool) must be
    blocks of the pool; ``why(b)`` says why sequence ``b`` uses those columns."""
    cols = torch.arange(block_table.shape[1], device=block_table.device)[None, :]
    used = rows[:, None] & (cols >= first[:, None]) & (cols < stop[:, None])
    ids = block_table.long()
    bad = used & ((ids < 0) | (ids >= num_blocks))

    def message(at: tuple[int, int]) -> str:
        b, j = at
        return (f"{op}: block_table[{b}, {j}] = {int(ids[b, j])}, but {why(b)}: their ids "
                f"must be blocks of the pool, in [0, num_blocks={num_blocks}) (-1 pads a row "
                f"only after the blocks a sequence uses)")

    return [(bad, message)]


def checking_values(t: torch.Tensor, force: bool) -> bool:
    """Whether to check values: ``value_checks(t)``, or ``force`` (the reference path) unless
    compiling."""
    return value_checks(t) or (force and not torch.compiler.is_compiling())


def check_decode_values(op: str, cache_seqlens, k_cache, block_table, capacity: int,
                        k_scale, v_scale, *, name: str = "cache_seqlens",
                        lengths: Optional[torch.Tensor] = None, force: bool = False) -> None:
    """What decode attention reads: ``0 <= lengths[b] <= capacity``, the blocks holding a
    sequence's ``lengths[b]`` tokens in the pool, fp8 scales finite and > 0. ``lengths``
    (default ``cache_seqlens``) is named ``name`` in messages."""
    if not checking_values(cache_seqlens, force):
        return
    L = (cache_seqlens if lengths is None else lengths).long()
    checks: list[_Check] = [((L < 0) | (L > capacity), lambda b: (
        f"{op}: {name} must be in [0, {capacity}] ({_capacity(k_cache, block_table, capacity)}"
        f"), got {name}[{b}] = {int(L[b])}"))]
    if block_table is not None:
        block_len = k_cache.shape[1]
        stop = (L.clamp(0, capacity) + block_len - 1) // block_len
        checks += _block_checks(
            op, block_table, k_cache.shape[0], torch.zeros_like(stop), stop,
            torch.ones_like(stop, dtype=torch.bool),
            lambda b: f"sequence {b}'s {int(L[b])} tokens lie in its first {int(stop[b])} blocks")
    checks += _scale_checks(op, k_scale, v_scale)
    _raise_first(checks)


def check_append_values(op: str, cache_seqlens, k_cache, block_table, capacity: int,
                        s_new: int, k_scale, v_scale, *, force: bool = False) -> None:
    """What an append writes: ``cache_seqlens[b] >= 0`` and ``cache_seqlens[b] + s_new <=
    capacity``, the blocks of those positions in the pool, fp8 scales finite and > 0. A
    paged row of only -1 is a padding row (nothing is written: padded batches, tokens another
    rank owns): only its length's sign is checked."""
    if not checking_values(cache_seqlens, force):
        return
    L = cache_seqlens.long()
    live = torch.ones_like(L, dtype=torch.bool)
    if block_table is not None and block_table.shape[1]:
        live = (block_table != -1).any(dim=1)
    checks: list[_Check] = [
        (L < 0, lambda b: f"{op}: cache_seqlens must be >= 0, got cache_seqlens[{b}] = "
                          f"{int(L[b])}"),
        (live & (L + s_new > capacity), lambda b: (
            f"{op}: sequence {b} holds cache_seqlens[{b}] = {int(L[b])} tokens; its {s_new} "
            f"new one(s) go up to position {int(L[b]) + s_new - 1}, past the capacity of "
            f"{_capacity(k_cache, block_table, capacity)}; reserve space first"))]
    if block_table is not None and s_new:
        block_len = k_cache.shape[1]
        first = L.clamp(0, capacity) // block_len
        stop = ((L + s_new - 1).clamp(0, max(capacity - 1, 0)) // block_len) + 1
        checks += _block_checks(
            op, block_table, k_cache.shape[0], first, stop, live,
            lambda b: (f"sequence {b}'s new tokens go to positions {int(L[b])}.."
                       f"{int(L[b]) + s_new - 1}, in its blocks {int(first[b])}.."
                       f"{int(stop[b]) - 1} (reserve them first; a row of only -1 is a "
                       f"padding row, written nowhere)"))
    checks += _scale_checks(op, k_scale, v_scale)
    _raise_first(checks)


@dataclass(frozen=True, slots=True)
class DecodeLaunch(ResolvedCall):
    """The kernels' launch of a :func:`decode_attention` call on the Triton path: tiles,
    the split of the context, the kernels' flags and scalar arguments (:func:`_config`)."""

    BLOCK_M: int  # query rows a program (a KV head's group x s_active, up to max_block_m)
    BLOCK_N: int  # keys a tile
    BLOCK_D: int
    row_blocks: int
    splits: int  # programs a (sequence, KV head) row block splits its keys over
    keys_per_split: int
    forced_splits: bool  # num_splits given (else the wave model's choice)
    DOT_F32: bool
    F16_DOT: bool
    WIDEN_V_FIRST: bool
    IEEE: bool
    num_warps: int
    qk_scale: float  # scale * log2(e): exp2 in the kernel
    window_arg: int
    num_blocks: int  # the paged pool's blocks (0: contiguous)
    rows_i32: bool  # every element offset of the cache fits in int32 (_offsets_fit_i32)
    num_stages: int
    merge_warps: int
    block_len: int  # a paged block's tokens (1: contiguous)


@dataclass(frozen=True, slots=True)
class DecodeCall(ResolvedCall):
    """A checked :func:`decode_attention` call: its sizes and options, and on the Triton
    path the kernels' launch. ``pdl``: programmatic dependent launch (``lmfuse._pdl``), set
    by a caller with ``dataclasses.replace`` (off otherwise)."""

    path: str  # "triton" or "torch"
    reason: str
    B: int
    s_active: int
    Hq: int
    Hkv: int
    D: int
    capacity: int  # keys a sequence's cache holds
    paged: bool
    scale: float
    window: Optional[int]  # None: unbounded, or as long as the cache
    return_lse: bool
    softcap: Optional[float]
    launch: Optional[DecodeLaunch]  # None on the torch path
    pdl: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The fields by name, the launch's flattened in (``pdl`` only where set)."""
        d = {name: getattr(self, name) for name in _CALL_FIELDS}
        if self.launch is not None:
            d.update(self.launch.as_dict())
        if self.pdl:
            d["pdl"] = self.pdl
        return d


_CALL_FIELDS = tuple(f for f in DecodeCall.__dataclass_fields__ if f not in ("launch", "pdl"))


def _resolve(q, k_cache, v_cache, cache_seqlens, block_table, scale, window_size, sinks,
             k_scale, v_scale, return_lse, num_splits, impl, softcap=None, *,
             check_values: bool = True) -> DecodeCall:
    """The checked call: :func:`_validate`, then :func:`_call` on the path it chose."""
    path, reason, scale, softcap = _validate(
        q, k_cache, v_cache, cache_seqlens, block_table, scale, window_size, sinks, k_scale,
        v_scale, return_lse, num_splits, impl, softcap, check_values=check_values)
    return _call(q, k_cache, block_table, scale, window_size, return_lse, num_splits, softcap,
                 path, reason)


def _validate(q, k_cache, v_cache, cache_seqlens, block_table, scale, window_size, sinks,
              k_scale, v_scale, return_lse, num_splits, impl, softcap=None, *,
              check_values: bool = True) -> tuple[str, str, float, Optional[float]]:
    """Every check of a :func:`decode_attention` call's arguments (their values too with
    ``check_values``, see :func:`check_decode_values`), and the path. Returns ``(path,
    reason, scale, softcap)``, the scale defaulted to ``1 / sqrt(D)``."""
    op = "decode_attention"
    check_tensor(op, "q", q, ndim=4)
    B, s_active, Hq, D = q.shape
    if s_active < 1:
        raise ValueError(f"{op}: q must be [B, s_active, Hq, D] with s_active >= 1, got "
                         f"{tuple(q.shape)}")
    if D == 0:
        raise ValueError(f"{op}: q's head dim D must be >= 1, got {tuple(q.shape)}")
    Hkv, capacity = check_cache(op, q.dtype, k_cache, v_cache, block_table, B, Hq, D)
    check_seqlens(op, cache_seqlens, B)
    scale = check_float32(op, "scale", check_number(op, "scale", scale))
    if window_size is not None:
        check_int(op, "window_size", window_size, minimum=0)
    if sinks is not None:
        check_tensor(op, "sinks", sinks, ndim=1)
        if sinks.shape[0] != Hq:
            raise ValueError(f"{op}: sinks must be [Hq={Hq}], got {tuple(sinks.shape)}")
    check_scales(op, k_scale, v_scale, Hkv, k_cache.dtype)
    if num_splits is not None:
        check_int(op, "num_splits", num_splits, minimum=1)
    softcap = check_float32(op, "softcap", check_number(op, "softcap", softcap))
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{op}: softcap must be > 0 (or None), got {softcap}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"{op}: return_lse must be a bool, got {type(return_lse).__name__}")
    check_same_device(op, "q", q, k_cache=k_cache, v_cache=v_cache,
                      cache_seqlens=cache_seqlens, block_table=block_table, sinks=sinks,
                      k_scale=k_scale, v_scale=v_scale)
    path, reason = _kernel_dtype_path(op, impl, q.device, q.dtype, "runs", "queries")
    if check_values:
        check_decode_values(op, cache_seqlens, k_cache, block_table, capacity, k_scale,
                            v_scale, force=path == "torch")
    check_no_grad(op, path, "decode attention is an inference op", q=q, k_cache=k_cache,
                  v_cache=v_cache, sinks=sinks, k_scale=k_scale, v_scale=v_scale)
    return path, reason, 1.0 / math.sqrt(D) if scale is None else scale, softcap


def _call(q, k_cache, block_table, scale: float, window_size: Optional[int], return_lse: bool,
          num_splits: Optional[int], softcap: Optional[float], path: str = "triton",
          reason: str = "") -> DecodeCall:
    """The :class:`DecodeCall` of arguments already validated: the sizes from the shapes, and
    on the Triton path the launch (:func:`_config`). :func:`_resolve` builds it after the
    checks; the ops :func:`_decode` and :func:`_decode_partials` build it from their own
    arguments alone, validating nothing again (their callers validated the arguments, a
    compiled call while tracing)."""
    B, s_active, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    paged = block_table is not None
    capacity = _rows_per_sequence(k_cache, block_table)
    # A window as long as the cache hides nothing: dropping it keeps the kernel's int32
    # position arithmetic away from windows near 2**31.
    window = window_size if window_size is not None and window_size < capacity else None
    launch = None
    if path == "triton":
        launch = _config(q, k_cache, B, s_active, Hq, Hkv, D, capacity, paged, scale, window,
                         num_splits)
    return DecodeCall(path, reason, B, s_active, Hq, Hkv, D, capacity, paged, scale, window,
                      return_lse, softcap, launch)


def _config(q, k_cache, B: int, s_active: int, Hq: int, Hkv: int, D: int, capacity: int,
            paged: bool, scale: float, window: Optional[int],
            num_splits: Optional[int]) -> DecodeLaunch:
    """Tile sizes and the split count for a call (see ``tuning/*.json``,
    ``decode_attention``)."""
    t = tuning.table("decode_attention", q.device)
    fp8 = k_cache.dtype in FP8_DTYPES
    for key, on in (("paged", paged), ("fp8", fp8), ("fp8_paged", fp8 and paged)):
        if on:
            t.update(t.get(key, {}))
    group = Hq // Hkv
    block_d = next_pow2(D, 16)
    rows = group * s_active
    block_m = min(next_pow2(rows, 16), t["max_block_m"])
    row_blocks = cdiv(rows, block_m)
    # Fewer (sequence, KV head) programs than SMs: each SM runs one or two programs of a
    # split context, so a program must keep more bytes in flight by itself (longer key tiles,
    # deeper pipelines) and extra splits cost more than they gain (measured on an H100).
    if B * Hkv * row_blocks < tuning.sm_count(q.device):
        t.update(t.get("few_programs", {}))
    # Many programs (a few waves of them): shorter tiles, more resident programs an SM
    # (``many_programs``: from ``min_programs_per_sm`` programs an SM; H100, paged fp8 Hkv 8,
    # B64 S4096 and B256 S1024, 64-key tiles at 2 warps: 1.95x bf16 where 128-key tiles
    # give 1.85x / 1.67x; paged bf16 head dim 128, 64-key tiles at 3 stages: B64 S4096
    # 0.385 -> 0.371 ms, B64 S576 0.075 -> 0.068).
    many = t.get("many_programs")
    if many and B * Hkv * row_blocks >= (many["min_programs_per_sm"]
                                         * tuning.sm_count(q.device)):
        t.update(many)
    # Entries [head-dim limit, key tile], optionally followed by pipeline stages and warps.
    tile = next(e for e in t["block_n_by_head_dim"] if block_d <= e[0])
    block_n, num_stages = tile[1], (tile[2] if len(tile) > 2 else t["num_stages"])
    # At least a warp per 16 query rows: a one-warp tile suits 16 rows (its scores never
    # leave the warp), not 64 (four warps' registers in one).
    num_warps = max(tile[3] if len(tile) > 3 else t["num_warps"], block_m // 16)
    # Keys a program may have to walk: the cache's capacity, or less with a window (plus
    # the tile the window's start is rounded down to).
    span = capacity
    if window is not None:
        span = min(span, window + s_active + block_n)
    # Short caches (a few key tiles a program): a shallower pipeline (``short_context``:
    # its ``num_stages`` up to ``max_keys`` keys; H100, 576 paged keys at B64: 38 -> 33 us).
    short = t.get("short_context")
    if short and span <= short["max_keys"]:
        num_stages = short["num_stages"]
    block_n, num_stages = _fit_shared_memory(block_n, num_stages, block_m, block_d,
                                             k_cache.element_size(), q.element_size(),
                                             paged, tuning.shared_memory(q.device))
    programs = B * Hkv * row_blocks
    if num_splits is None:
        splits = _choose_splits(programs, span, block_n,
                                t["programs_per_sm"] * tuning.sm_count(q.device),
                                t["min_keys_per_split"], t["split_cost_keys"], t["max_splits"])
        keys = cdiv(cdiv(max(span, 1), splits), block_n) * block_n
        splits = max(1, cdiv(span, keys))
        forced = False
    else:
        # More splits than keys (or than a grid dimension holds) would only add empty ones.
        splits = max(1, min(num_splits, span, 65535))
        keys = max(1, cdiv(span, splits))
        forced = True
    # The interpreter runs CPU tensors, and CUDA ones too when TRITON_INTERPRET=1.
    interp = q.device.type != "cuda" or interpreter_active()
    f16_dot = fp8 and q.dtype == torch.bfloat16
    dot_f32 = interp and q.dtype == torch.bfloat16 and not f16_dot  # no bf16 dots there
    return DecodeLaunch(
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, row_blocks=row_blocks,
        splits=splits, keys_per_split=keys, forced_splits=forced, DOT_F32=dot_f32,
        F16_DOT=f16_dot,
        WIDEN_V_FIRST=fp8 and not interp and q.dtype != torch.float32
        and t.get("widen_v_first", True),
        IEEE=q.dtype == torch.float32, num_warps=num_warps,
        qk_scale=scale * 1.4426950408889634,  # exp2 in the kernel
        window_arg=window if window is not None else 0,
        num_blocks=k_cache.shape[0] if paged else 0,
        # 32-bit row offsets where the cache allows (H200, paged fp8 B64 S4096: 163 -> 151
        # us); a table's ``rows_i32: false`` keeps 64 bits (the tests compare the two).
        rows_i32=t.get("rows_i32", True) and _offsets_fit_i32(k_cache),
        num_stages=num_stages, merge_warps=t["merge_warps"],
        block_len=k_cache.shape[1] if paged else 1)


def _offsets_fit_i32(cache: torch.Tensor) -> bool:
    """Whether every element offset of ``cache`` (its largest: the sum of ``(size - 1) *
    stride``) is below 2**31, so the kernel may address its rows in 32 bits. K and V share
    their shapes and strides (checked), so K's answer is V's."""
    return sum((n - 1) * st for n, st in zip(cache.shape, cache.stride()) if n > 0) < 2**31 - 1


def _fit_shared_memory(block_n: int, num_stages: int, block_m: int, block_d: int,
                       cache_bytes: int, q_bytes: int, paged: bool,
                       limit: Optional[int]) -> tuple[int, int]:
    """The largest of the table's (key tile, stages) that fits ``limit`` bytes of shared
    memory: fewer stages first, then shorter tiles. The tables are measured with 2-byte and
    fp8 caches; a float32 cache in the same tiles can need more than a program may have.
    The estimate, as Triton 3.6 lays the kernel out: the pipeline's K and V tiles (``stages``
    of each for a paged cache, ``stages - 1`` for a contiguous one), the probabilities' tile
    (the cache's dtype, float32 at most) and the query tile. On 4 H200s it matched the two
    launches that did not fit (float32, 128-key tiles, 3 stages: contiguous head dim 128 with
    16 query rows, 272 KiB; paged head dim 64 with 64 rows, 240 KiB; a program may have 227)."""
    if limit is None:
        return block_n, num_stages

    def need(n: int, stages: int) -> int:
        buffers = stages if paged else max(stages - 1, 1)
        return (buffers * 2 * n * block_d * cache_bytes + block_m * n * max(cache_bytes, 2)
                + block_m * block_d * q_bytes)

    while need(block_n, num_stages) > limit and (num_stages > 2 or block_n > 16):
        if num_stages > 2:
            num_stages -= 1
        else:
            block_n //= 2
    return block_n, num_stages


@functools.lru_cache(maxsize=4096)
def _choose_splits(programs: int, span: int, block_n: int, slots: int, min_keys: int,
                   split_cost: int, max_splits: int) -> int:
    """Split count minimising a wave model of the run time: ``ceil(programs * s / slots)``
    rounds (``slots`` programs run at once) of ``span / s`` keys (whole key tiles) plus a
    fixed cost per program (``split_cost_keys``, in keys), over ``s`` with at least
    ``min_keys_per_split`` keys per split, counted in whole tiles (a short cache's last,
    partial tile may be a split of its own: 656 paged keys in 128-key tiles split 6 ways,
    not 3 of 256; H100, the Generator's B1 step 0.677 -> 0.659 ms). Ties go to fewer
    splits (less merging)."""
    tiles = cdiv(max(span, 1), block_n)
    best, best_cost = 1, None
    for s in range(1, max(1, min(max_splits, tiles)) + 1):
        keys = cdiv(tiles, s) * block_n
        if s > 1 and keys < min_keys:
            break  # (keys only fall as s grows)
        cost = cdiv(programs * s, slots) * (keys + split_cost)
        if best_cost is None or cost < best_cost * 0.99:
            best, best_cost = s, cost
    return best


# --- launches --------------------------------------------------------------------------------


def _launch_decode(q, k_cache, v_cache, cache_seqlens, block_table, sinks, k_scale, v_scale,
                   s: DecodeCall, out=None, lse=None):
    """The kernels of the resolved call ``s`` on contiguous ``q``, ``cache_seqlens``,
    ``block_table``, ``sinks`` and scales, and caches whose last dim is contiguous and whose
    strides are equal; into contiguous ``out [B, S, Hq, D]`` (any float dtype) and ``lse
    [B, S, Hq]`` float32 when given. ``s.pdl`` (set by a caller, off otherwise): the kernels
    launched with programmatic dependent launch (``lmfuse._pdl``). The public functions
    reach it through their ops (:func:`_decode`, :func:`_decode_partials`); a caller that
    holds a resolved call launches it directly (the serving decode step, with ``pdl``)."""
    B, S, Hq, D = q.shape
    pdl, c = s.pdl, s.launch
    Hkv, splits = s.Hkv, c.splits
    if out is None:
        out = torch.empty((B, S, Hq, D), dtype=q.dtype, device=q.device)
    if lse is None and s.return_lse:
        lse = torch.empty((B, S, Hq), dtype=torch.float32, device=q.device)
    if B == 0:
        return out, lse
    rows = B * S * Hq
    if splits > 1:
        # One buffer for the float32 partials: outputs [rows, splits, D], then LSEs.
        part = torch.empty(rows * splits * (D + 1), dtype=torch.float32, device=q.device)
        o_t, l_t = part, part[rows * splits * D:]
    else:
        o_t, l_t = out, (lse if lse is not None else out)
    paged = block_table is not None
    _kernels().decode_kernel[(B * Hkv, splits, c.row_blocks)](
        q, k_cache, v_cache, cache_seqlens, block_table if paged else cache_seqlens,
        sinks if sinks is not None else q, k_scale if k_scale is not None else q,
        v_scale if v_scale is not None else q, o_t, l_t,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.shape[1] if paged else 0, Hkv, splits, c.keys_per_split, c.qk_scale,
        c.window_arg, s.capacity,
        c.num_blocks, (s.softcap or 0.0) * 1.4426950408889634,
        S_ACT=S, GROUP=Hq // Hkv, D=D, BLOCK_M=c.BLOCK_M, BLOCK_N=c.BLOCK_N,
        BLOCK_D=c.BLOCK_D, PAGED=paged, BLOCK_LEN=c.block_len,
        HAS_WINDOW=s.window is not None, HAS_SINKS=sinks is not None,
        HAS_K_SCALE=k_scale is not None, HAS_V_SCALE=v_scale is not None,
        WRITE_LSE=splits > 1 or lse is not None, DOT_F32=c.DOT_F32, F16_DOT=c.F16_DOT,
        IEEE=c.IEEE, NUM_STAGES=c.num_stages, WIDEN_V_FIRST=c.WIDEN_V_FIRST,
        HAS_SOFTCAP=softcap_mode(s.softcap), num_warps=c.num_warps, PDL=pdl,
        EVEN_TILES=splits > 1 and not c.forced_splits, ROWS_I32=c.rows_i32,
        **_pdl.launch_options(pdl))
    if splits > 1:
        cols = min(c.BLOCK_D, _MERGE_COLUMNS)
        _kernels().merge_kernel[(rows, cdiv(D, cols))](
            o_t, l_t, out, lse if lse is not None else out, splits, D, splits * D, 1, splits,
            D=D, BLOCK_D=cols, BLOCK_P=next_pow2(splits, 2), CHUNK_P=_merge_chunk(splits, cols),
            WRITE_LSE=lse is not None, num_warps=c.merge_warps, PDL=pdl,
            **_pdl.launch_options(pdl))
    return out, lse


# Columns of a row one merge program takes: more programs for the few rows of a small
# batch (B = 1: Hq rows, each with up to 128 partials).
_MERGE_COLUMNS = 32


def _merge_chunk(parts: int, block_d: int) -> int:
    """Partials the merge reads per step: all of them while the tile stays within 4096
    float32 values (32 a thread at 4 warps), else as many as fit."""
    return min(next_pow2(parts, 2), max(2, 4096 // block_d))


def _merge_fake(outs, lses, out_dtype):
    dtype = out_dtype if out_dtype in KERNEL_DTYPES else outs.dtype
    return (outs.new_empty(outs.shape[1:], dtype=dtype),
            lses.new_empty(lses.shape[1:], dtype=torch.float32))


@kernel_op("merge_attention_states", _merge_fake)
def _launch_merge(outs: torch.Tensor, lses: torch.Tensor,
                  out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``outs [P, R, D]`` and ``lses [P, R]`` (any strides but D's = 1) merged into new
    contiguous ``(out [R, D], lse [R] float32)``. The kernel stores ``out`` in ``out_dtype``
    where it can (a kernel dtype: no cast after); otherwise ``out`` is in outs' dtype and the
    caller casts it."""
    P, R, D = outs.shape
    out = outs.new_empty((R, D), dtype=out_dtype if out_dtype in KERNEL_DTYPES else outs.dtype)
    lse = lses.new_empty((R,), dtype=torch.float32)
    if R == 0 or D == 0:
        if R:
            lse.copy_(ref.logsumexp(lses.float(), 0))
        return out, lse
    cols = min(next_pow2(D, 16), _MERGE_COLUMNS)
    _kernels().merge_kernel[(R, cdiv(D, cols))](
        outs, lses, out, lse, P, outs.stride(0), outs.stride(1), lses.stride(0), lses.stride(1),
        D=D, BLOCK_D=cols, BLOCK_P=next_pow2(P, 2), CHUNK_P=_merge_chunk(P, cols),
        WRITE_LSE=True, num_warps=4)
    return out, lse


def opaque_reference(*tensors: Optional[torch.Tensor], params: Any = ()) -> bool:
    """Whether a reference path that reads the lengths on the host runs as one opaque op of
    a compiled graph: while ``torch.compile`` traces, where no gradient is needed (the ops
    have no autograd: a call that needs one keeps the reference's own ops)."""
    return torch.compiler.is_compiling() and not (torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (*tensors, *params)))


@kernel_op("kv_cache_append_reference_", lambda *args, **kwargs: None,
           mutates_args=("k_cache", "v_cache"))
def _append_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor,
                      v_new: torch.Tensor, cache_seqlens: torch.Tensor,
                      block_table: Optional[torch.Tensor], k_scale: Optional[torch.Tensor],
                      v_scale: Optional[torch.Tensor], capacity: int) -> None:
    """:func:`kv_cache_append`'s reference path as one op of a compiled graph (the reference
    reads the lengths on the host; the values checked here first, skipped while tracing)."""
    check_append_values("kv_cache_append", cache_seqlens, k_cache, block_table, capacity,
                        k_new.shape[1], k_scale, v_scale, force=True)
    ref.kv_cache_append_reference(k_cache, v_cache, k_new, v_new, cache_seqlens,
                                  block_table=block_table, k_scale=k_scale, v_scale=v_scale)


@kernel_op("kv_cache_append_", lambda *args, **kwargs: None,
           mutates_args=("k_cache", "v_cache"))
def _launch_append(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor,
                   v_new: torch.Tensor, cache_seqlens: torch.Tensor,
                   block_table: Optional[torch.Tensor], k_scale: Optional[torch.Tensor],
                   v_scale: Optional[torch.Tensor], capacity: int, check: bool = False) -> None:
    """Write ``k_new``, ``v_new`` into the caches in place. ``check``: run the value checks
    here first (:func:`check_append_values`). A compiled call passes it: its checks at the
    API boundary were skipped while tracing, so the graph runs them here, on the values of
    each run; an eager call has run them already."""
    if check:
        check_append_values("kv_cache_append", cache_seqlens, k_cache, block_table, capacity,
                            k_new.shape[1], k_scale, v_scale)
    B, s_new, Hkv, D = k_new.shape
    if B * s_new == 0 or Hkv * D == 0:
        return
    paged = block_table is not None
    fp8 = k_cache.dtype in FP8_DTYPES
    block = min(next_pow2(Hkv * D, 16), tuning.table("decode_attention", k_new.device)
                ["append_block"])
    _kernels().append_kernel[(B * s_new,)](
        k_new, v_new, k_cache, v_cache, cache_seqlens,
        block_table if paged else cache_seqlens,
        k_scale if k_scale is not None else k_new, v_scale if v_scale is not None else k_new,
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_table.stride(0) if paged else 0, k_cache.stride(2), v_cache.stride(2),
        s_new, capacity, k_cache.shape[0],
        HD=Hkv * D, D=D, BLOCK=block, PAGED=paged,
        BLOCK_LEN=k_cache.shape[1] if paged else 1, FP8=fp8,
        HAS_K_SCALE=k_scale is not None, HAS_V_SCALE=v_scale is not None,
        FLAT=Hkv == 1 or (k_cache.stride(2) == D and v_cache.stride(2) == D), num_warps=4)


# Decode attention's ops take primitives (a custom op cannot take a DecodeCall) and build
# the call from them and the shapes (:func:`_call`): the public functions validate before
# calling them (``_validate``; a compiled call while tracing), so nothing is validated
# twice. ``check``: run the value checks here, as for the append.


def _decode_fake(q, k_cache, v_cache, cache_seqlens, block_table, sinks, k_scale, v_scale,
                 scale, window_size, num_splits, softcap, return_lse, check):
    out = torch.empty_like(q)
    # (float64 queries take the reference, whose LSE is float64 too)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return [out, q.new_empty(q.shape[:3], dtype=lse_dtype)] if return_lse else [out]


@kernel_op("decode_attention", _decode_fake)
def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            cache_seqlens: torch.Tensor, block_table: Optional[torch.Tensor],
            sinks: Optional[torch.Tensor], k_scale: Optional[torch.Tensor],
            v_scale: Optional[torch.Tensor], scale: float, window_size: Optional[int],
            num_splits: Optional[int], softcap: Optional[float], return_lse: bool,
            check: bool) -> list[torch.Tensor]:
    """:func:`decode_attention` on the Triton path, on inputs laid out by :func:`_laid_out`:
    ``[out]``, or ``[out, lse]`` with ``return_lse``. A list because an op cannot return
    None in a tuple, and a call without the LSE should not allocate one."""
    s = _call(q, k_cache, block_table, scale, window_size, return_lse, num_splits, softcap)
    if check:
        check_decode_values("decode_attention", cache_seqlens, k_cache, block_table,
                            s.capacity, k_scale, v_scale)
    out, lse = _launch_decode(q, k_cache, v_cache, cache_seqlens, block_table, sinks, k_scale,
                              v_scale, s)
    return [out] if lse is None else [out, lse]


@kernel_op("decode_attention_reference",
           lambda q, k_cache, v_cache, cache_seqlens, block_table, sinks, k_scale, v_scale,
           scale, window_size, softcap, return_lse: _decode_fake(
               q, k_cache, v_cache, cache_seqlens, block_table, sinks, k_scale, v_scale, scale,
               window_size, None, softcap, return_lse, False))
def _decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cache_seqlens: torch.Tensor, block_table: Optional[torch.Tensor],
                      sinks: Optional[torch.Tensor], k_scale: Optional[torch.Tensor],
                      v_scale: Optional[torch.Tensor], scale: float,
                      window_size: Optional[int], softcap: Optional[float],
                      return_lse: bool) -> list[torch.Tensor]:
    """:func:`decode_attention`'s reference path as one op of a compiled graph (the
    reference reads the lengths on the host; the values checked here first)."""
    check_decode_values("decode_attention", cache_seqlens, k_cache, block_table,
                        _rows_per_sequence(k_cache, block_table), k_scale, v_scale, force=True)
    res = ref.decode_attention_reference(
        q, k_cache, v_cache, cache_seqlens, block_table=block_table, scale=scale,
        window_size=window_size, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
        return_lse=return_lse, softcap=softcap)
    # (contiguous, as the fake says: a compiled graph reads them at those strides)
    return [t.contiguous() for t in res] if return_lse else [res.contiguous()]


@kernel_op("decode_attention_partials", lambda q, *args, **kwargs: q.new_empty(
    (q.numel() // q.shape[-1] * (q.shape[-1] + 1),), dtype=torch.float32))
def _decode_partials(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cache_seqlens: torch.Tensor, block_table: Optional[torch.Tensor],
                     sinks: Optional[torch.Tensor], k_scale: Optional[torch.Tensor],
                     v_scale: Optional[torch.Tensor], scale: float, num_splits: Optional[int],
                     softcap: Optional[float], check: bool) -> torch.Tensor:
    """:func:`decode_attention_partials` on the Triton path: the kernels write the flat
    float32 ``[outputs | LSEs]`` directly."""
    s = _call(q, k_cache, block_table, scale, None, True, num_splits, softcap)
    if check:
        check_decode_values("decode_attention", cache_seqlens, k_cache, block_table,
                            s.capacity, k_scale, v_scale)
    B, S, Hq, D = q.shape
    R = B * S * Hq
    states = torch.empty(R * (D + 1), dtype=torch.float32, device=q.device)
    _launch_decode(q, k_cache, v_cache, cache_seqlens, block_table, sinks, k_scale, v_scale, s,
                   out=states[:R * D].view(B, S, Hq, D), lse=states[R * D:].view(B, S, Hq))
    return states


# --- public functions -------------------------------------------------------------------------


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    block_table: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    window_size: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    num_splits: Optional[int] = None,
    impl: str = "auto",
    softcap: Optional[float] = None,
):
    """Attention of the ``s_active`` newest tokens of each sequence over its KV cache.

    Args:
        q: ``[B, s_active, Hq, D]`` float32/float16/bfloat16 (float64 on the reference). The
            active tokens are already in the cache, at positions ``cache_seqlens[b] -
            s_active + i``; token ``i`` sees the keys up to its own position.
        k_cache, v_cache: contiguous ``[B, S_max, Hkv, D]``, or paged ``[num_blocks,
            block_len, Hkv, D]`` with ``block_table``; q's dtype or ``float8_e4m3fn`` (value =
            stored * scale). ``Hq`` must be a multiple of ``Hkv`` (GQA: query head ``h``
            reads KV head ``h // (Hq // Hkv)``; each KV head is read once for its group).
        cache_seqlens: ``[B]`` int32/int64, tokens in each cache (active ones included), in
            ``[0, capacity]`` (``S_max``, or ``max_blocks * block_len``); 0 gives zeros (and
            ``lse = -inf``, or the sink's logit with ``sinks``). A token whose position
            ``cache_seqlens[b] - s_active + i`` is negative sees no key (likewise).
        block_table: ``[B, max_blocks]`` int32 block ids: the first ``ceil(cache_seqlens[b]
            / block_len)`` of row ``b`` in ``[0, num_blocks)``, then anything (-1 by
            convention; never read).
        scale: of ``q . k``; default ``1 / sqrt(D)``.
        window_size: ``w``: a token at position ``p`` sees keys ``p - w .. p``.
        sinks: ``[Hq]`` per-head sink logits, added to the softmax denominator (``-inf``:
            no sink).
        k_scale, v_scale: ``[Hkv]`` dequantisation scales of an fp8 cache, finite and > 0.
        return_lse: also return the natural-log LSE ``[B, s_active, Hq]`` float32 (sink
            included), mergeable by :func:`merge_attention_states`.
        num_splits: force the number of key splits (flash-decoding: consecutive equal
            pieces of the capacity); default: chosen from B, Hkv, the capacity and the SM
            count, each sequence's own key tiles then dealt out evenly over the splits.
        softcap: ``c > 0``: each score ``x = scale * q . k`` becomes ``c * tanh(x / c)``
            (Gemma 2's attention-logit soft-capping); sinks are not capped.
    Returns:
        ``out [B, s_active, Hq, D]`` in q's dtype, and ``lse`` with ``return_lse``.

    Paths: ``impl="auto"`` runs Triton on CUDA (or under the interpreter); on CPU float32
    tensors without it, one ``scaled_dot_product_attention`` over the batch (no sinks,
    softcap, LSE or fp8; where its output has a NaN, the reference instead); elsewhere the
    reference, which ``impl="torch"`` always runs.

    NaN and inf propagate as in PyTorch's ``softmax(q k^T * scale + mask) v`` (the
    reference's module docstring has the rules): a NaN query head, a NaN key or value the
    token sees, a NaN or ``+inf`` sink give NaN for that token (``lse`` NaN, or ``+inf``
    for a ``+inf`` logit); ``-inf`` scores and sinks add nothing. Cache rows a token does
    not see never reach it; on the Triton path one exception: a NaN or inf *value* row seen
    by one active token of a sequence also reaches the other active tokens of that sequence
    and KV head that do not see it (causal order among the ``s_active`` tokens, their
    windows' different starts: ``0 * NaN`` in the probabilities-times-values product).

    Values are checked (``ValueError`` naming the argument, the same on both paths) on CPU
    tensors and on the reference path always, on CUDA tensors when
    ``lmfuse.set_checks(True)`` (or ``LMFUSE_CHECK=1``; one host synchronisation per call;
    never while compiling or capturing a CUDA graph): ``cache_seqlens`` in ``[0,
    capacity]``, the block ids a sequence reads in ``[0, num_blocks)``, fp8 scales finite
    and > 0. Unchecked CUDA calls never read outside the tensors: a length past the capacity
    is read as the capacity and a negative one as 0; keys in a block whose id is outside
    ``[0, num_blocks)`` (-1 included) are skipped, as if masked out; scales are used as given
    (a zero ``k_scale`` makes every score 0, a zero ``v_scale`` the output 0).
    """
    path, _, scale, softcap = _validate(q, k_cache, v_cache, cache_seqlens, block_table, scale,
                                        window_size, sinks, k_scale, v_scale, return_lse,
                                        num_splits, impl, softcap)
    with nvtx_range("decode_attention", "fwd"):
        if _native_decode(impl, path, q, k_cache, sinks, softcap, return_lse):
            out = native_decode(q, k_cache, v_cache, cache_seqlens, block_table, scale,
                                window_size)
            if out is not None:
                return out
        if path == "torch":
            if opaque_reference(q, k_cache, v_cache, sinks):
                # The reference reads lengths on the host: one opaque node for the graph,
                # which checks the values at run time as an eager call does here.
                res = _decode_reference(q, k_cache, v_cache, cache_seqlens, block_table,
                                        sinks, k_scale, v_scale, scale, window_size, softcap,
                                        return_lse)
                return (res[0], res[1]) if return_lse else res[0]
            return _reference()(
                q, k_cache, v_cache, cache_seqlens, block_table=block_table, scale=scale,
                window_size=window_size, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
                return_lse=return_lse, softcap=softcap)
        q, k_cache, v_cache, cache_seqlens, block_table, sinks, k_scale, v_scale = _laid_out(
            q, k_cache, v_cache, cache_seqlens, block_table, sinks, k_scale, v_scale)
        # A compiled call checks the values inside the op, at run time (``_validate`` skipped
        # them while tracing); an eager call has checked them already.
        res = _decode(q, k_cache, v_cache, cache_seqlens, block_table, sinks, k_scale, v_scale,
                      scale, window_size, num_splits, softcap, return_lse,
                      check=torch.compiler.is_compiling())
        return (res[0], res[1]) if return_lse else res[0]


def _reference():
    """The torch path's function: the reference, or while ``torch.compile`` traces (with
    autograd: the opaque op has none) its form that reads no length on the host."""
    if torch.compiler.is_compiling():
        return ref.decode_attention_traceable
    return ref.decode_attention_reference


def launch_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cache_seqlens: torch.Tensor, block_table: Optional[torch.Tensor],
                            scale: Optional[float], window_size: Optional[int],
                            k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
                            impl: str, pdl: int = 0) -> torch.Tensor:
    """:func:`decode_attention`'s checks and kernels for a caller that lays out its inputs as
    the kernels read them (contiguous ``q``, ``cache_seqlens`` and ``block_table``; no sinks,
    softcap, LSE or forced splits), with programmatic dependent launch ``pdl``
    (``lmfuse._pdl``), which the public signature does not take: the Generator's decode step.
    Triton path only (``impl`` ``"auto"`` or ``"triton"`` where it runs)."""
    s = _resolve(q, k_cache, v_cache, cache_seqlens, block_table, scale, window_size, None,
                 k_scale, v_scale, False, None, impl)
    return _launch_decode(q, k_cache, v_cache, cache_seqlens, block_table, None, k_scale,
                          v_scale, replace(s, pdl=pdl))[0]


def _native_decode(impl: str, path: str, q: torch.Tensor, k_cache: torch.Tensor, sinks: Any,
                   softcap: Any, return_lse: bool) -> bool:
    """Whether the call may take :func:`native_decode` (the CPU float32 default path without
    the options SDPA lacks)."""
    return (native_cpu(impl, path, q) and k_cache.dtype == torch.float32 and sinks is None
            and softcap is None and not return_lse)


def native_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  lengths: torch.Tensor, block_table: Optional[torch.Tensor], scale: float,
                  window: Optional[int]) -> Optional[torch.Tensor]:
    """The default path on CPU float32 caches (no Triton; no sinks, softcap, LSE or fp8):
    the whole batch in one ``scaled_dot_product_attention`` over the gathered keys, where the
    reference loops over sequences and tokens (the Generator's CPU decode step spent half
    its time there). Keys and values past a sequence's length are zeroed (a pool's unused
    rows may hold anything). A NaN in the output (NaN or inf among the inputs, or a value
    that the softmax gives no weight but a matrix product still multiplies by 0) returns
    None: the caller runs the reference, whose NaN/inf rules differ there."""
    B, s_active, Hq, D = q.shape
    if B == 0 or int(lengths.min()) < s_active:
        return None  # a token that sees nothing: the reference's zeros
    longest = int(lengths.max())
    pos = torch.arange(longest, device=q.device)
    past = (pos[None, :] >= lengths[:, None].long())[:, :, None, None]  # beyond a sequence
    if block_table is None:  # views of the cache: zeroed into copies
        k = k_cache[:, :longest].masked_fill(past, 0.0)
        v = v_cache[:, :longest].masked_fill(past, 0.0)
    else:  # the gather copies already: zeroed in place
        # Columns past a shorter sequence's blocks may hold anything (-1, or any id): clamped
        # into the pool, their rows are masked as past that sequence's length.
        ids = block_table[:, :cdiv(longest, k_cache.shape[1])].long().clamp(
            0, k_cache.shape[0] - 1)
        k = k_cache[ids].flatten(1, 2)[:, :longest].masked_fill_(past, 0.0)
        v = v_cache[ids].flatten(1, 2)[:, :longest].masked_fill_(past, 0.0)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, S, D]
    token = lengths[:, None].long() - s_active + torch.arange(s_active, device=q.device)
    seen = pos[None, None, :] <= token[:, :, None]  # [B, s_active, S]
    if window is not None:
        seen &= pos[None, None, :] >= token[:, :, None] - window
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, attn_mask=seen[:, None], scale=scale,
        enable_gqa=Hq != k.shape[1])
    if bool(out.isnan().any()):
        return None
    return out.transpose(1, 2).contiguous()


def _laid_out(q, k_cache, v_cache, cache_seqlens, block_table, sinks, k_scale, v_scale):
    """The inputs as the launch reads them: q, the 1-D inputs and the block table
    contiguous, both caches through one set of strides (copies only for unusual layouts)."""
    if not q.is_contiguous():
        q = q.contiguous()
    if k_cache.stride(-1) != 1:
        k_cache = k_cache.contiguous()
    if v_cache.stride() != k_cache.stride():
        k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    if block_table is not None and not block_table.is_contiguous():
        block_table = block_table.contiguous()
    if cache_seqlens.stride(0) != 1:
        cache_seqlens = cache_seqlens.contiguous()
    if sinks is not None and sinks.stride(0) != 1:
        sinks = sinks.contiguous()
    if k_scale is not None and k_scale.stride(0) != 1:
        k_scale = k_scale.contiguous()
    if v_scale is not None and v_scale.stride(0) != 1:
        v_scale = v_scale.contiguous()
    return q, k_cache, v_cache, cache_seqlens, block_table, sinks, k_scale, v_scale


def decode_attention_partials(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              cache_seqlens: torch.Tensor, *,
                              block_table: Optional[torch.Tensor] = None,
                              scale: Optional[float] = None,
                              sinks: Optional[torch.Tensor] = None,
                              k_scale: Optional[torch.Tensor] = None,
                              v_scale: Optional[torch.Tensor] = None,
                              num_splits: Optional[int] = None,
                              impl: str = "auto",
                              softcap: Optional[float] = None) -> torch.Tensor:
    """:func:`decode_attention`'s output and LSE packed for an exchange and a merge (the
    parallel ops' form of a partial): one flat tensor of ``R * (D + 1)`` values, the
    outputs ``[R, D]`` then the LSEs ``[R]`` (``R = B * s_active * Hq`` rows in
    ``[B, s_active, Hq]`` order), float32 (float64 for float64 ``q``). On the Triton path
    the kernels write it directly: no copy of the output, no cast, no concatenation. Inputs,
    their checks and NaN/inf as for :func:`decode_attention`."""
    path, _, scale, softcap = _validate(q, k_cache, v_cache, cache_seqlens, block_table, scale,
                                        None, sinks, k_scale, v_scale, True, num_splits, impl,
                                        softcap)
    with nvtx_range("decode_attention", "fwd"):
        if path == "torch":
            # q widened first (exactly), so the reference's output is the float32 partial
            # itself, not one rounded to q's dtype and widened back.
            compute = torch.float64 if q.dtype == torch.float64 else torch.float32
            out, lse = _reference()(
                q.to(compute), k_cache, v_cache, cache_seqlens, block_table=block_table,
                scale=scale, sinks=sinks, k_scale=k_scale, v_scale=v_scale, return_lse=True,
                softcap=softcap)
            return torch.cat([out.to(compute).reshape(-1), lse.to(compute).reshape(-1)])
        q, k_cache, v_cache, cache_seqlens, block_table, sinks, k_scale, v_scale = _laid_out(
            q, k_cache, v_cache, cache_seqlens, block_table, sinks, k_scale, v_scale)
        # Values checked inside the op when compiled, as in decode_attention.
        return _decode_partials(q, k_cache, v_cache, cache_seqlens, block_table, sinks,
                                k_scale, v_scale, scale, num_splits, softcap,
                                check=torch.compiler.is_compiling())


def _resolve_merge(outs, lses, impl) -> tuple[str, str]:
    op = "merge_attention_states"
    check_tensor(op, "outs", outs, ndim=range(2, 16))
    check_tensor(op, "lses", lses, ndim=range(1, 15))
    if tuple(lses.shape) != tuple(outs.shape[:-1]):
        raise ValueError(f"{op}: lses must be outs' shape without its last dim: outs "
                         f"{tuple(outs.shape)} needs lses {tuple(outs.shape[:-1])}, got "
                         f"{tuple(lses.shape)}")
    if outs.shape[0] == 0:
        raise ValueError(f"{op}: need at least one partial state (outs [P, ..., D], P >= 1), "
                         f"got P = 0")
    check_same_device(op, "outs", outs, lses=lses)
    path, reason = select_impl(op, impl, outs.device)
    if path == "triton" and (outs.dtype not in KERNEL_DTYPES or lses.dtype == torch.float64):
        if impl == "triton":
            raise TypeError(f"{op}: impl='triton' merges float32/float16/bfloat16 states, got "
                            f"outs {dtype_name(outs.dtype)}, lses {dtype_name(lses.dtype)}; "
                            "use impl='torch'")
        path, reason = "torch", "float64 states: the reference"
    check_no_grad(op, path, "an inference op", outs=outs, lses=lses)
    return path, reason


def _check_out_dtype(out_dtype: Any) -> None:
    if out_dtype is not None and (not isinstance(out_dtype, torch.dtype)
                                  or not out_dtype.is_floating_point):
        raise TypeError(f"merge_attention_states: out_dtype must be a floating torch.dtype or "
                        f"None, got {out_dtype!r}")


def merge_attention_states(outs: torch.Tensor, lses: torch.Tensor, *,
                           out_dtype: Optional[torch.dtype] = None, impl: str = "auto"):
    """Merge ``P`` attention results over disjoint key sets, exactly.

    Args:
        outs: ``[P, ..., D]`` partial outputs, each normalised by its own softmax
            denominator (as :func:`decode_attention` returns them).
        lses: ``[P, ...]`` their natural-log LSEs; ``-inf`` marks a partial that saw no key
            (it adds nothing).
        out_dtype: the output's dtype (default outs'): the merge writes it directly (the
            parallel ops merge float32 partials into the query's dtype).
        impl: ``"auto"``, ``"triton"`` or ``"torch"``; see :func:`lmfuse.explain`.
    Returns:
        ``(out [..., D]`` in ``out_dtype``, ``lse [...]`` float32 (float64 for float64
        lses)), with ``out = sum_p exp(lse_p - lse) out_p`` and ``lse = log(sum_p
        exp(lse_p))``; rows where every partial is empty give zeros and ``-inf``.

    NaN and inf stay visible on both paths: a NaN or ``+inf`` partial LSE gives a NaN
    output and a NaN (or, with a ``+inf`` one, ``+inf``) LSE; a NaN in the output of a
    partial whose LSE is not ``-inf`` gives NaN (even where its weight underflows to 0); a
    partial with ``lse_p = -inf`` adds nothing, whatever its output holds. No values are
    checked (any values are valid).
    """
    path, _ = _resolve_merge(outs, lses, impl)
    _check_out_dtype(out_dtype)
    dtype = outs.dtype if out_dtype is None else out_dtype
    with nvtx_range("merge_attention_states", "fwd"):
        if path == "torch":
            out, lse = ref.merge_attention_states_reference(outs, lses, out_dtype=dtype)
            return out, lse if lses.dtype == torch.float64 else lse.float()
        P, D = outs.shape[0], outs.shape[-1]
        lead = outs.shape[1:-1]
        rows = math.prod(lead)  # (explicit: a -1 cannot be inferred when D is 0)
        outs3 = outs.reshape(P, rows, D)
        if outs3.stride(-1) != 1:
            outs3 = outs3.contiguous()
        lses2 = lses.reshape(P, rows)
        out, lse = _launch_merge(outs3, lses2, dtype)
        if out.dtype != dtype:  # not a dtype the kernel stores (float64, float8)
            out = out.to(dtype)
        return out.view(*lead, D), lse.view(lead)


def _resolve_append(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, k_scale,
                    v_scale, impl) -> tuple[str, str, int]:
    """``(path, reason, capacity)`` of a :func:`kv_cache_append` call, after every check of its
    arguments (values too: see its docstring)."""
    op = "kv_cache_append"
    check_tensor(op, "k_new", k_new, ndim=4)
    check_tensor(op, "v_new", v_new, ndim=4)
    if k_new.shape != v_new.shape:
        raise ValueError(f"{op}: k_new {tuple(k_new.shape)} and v_new {tuple(v_new.shape)} "
                         f"must have one shape")
    B, s_new, Hkv_new, D = k_new.shape
    if v_new.dtype != k_new.dtype:
        raise TypeError(f"{op}: k_new is {dtype_name(k_new.dtype)} but v_new is "
                        f"{dtype_name(v_new.dtype)}")
    Hkv, capacity = check_cache(op, k_new.dtype, k_cache, v_cache, block_table, B, None, D,
                                dtype_of="k_new's")
    if Hkv != Hkv_new:
        raise ValueError(f"{op}: k_new has {Hkv_new} KV heads but the caches have {Hkv}")
    check_seqlens(op, cache_seqlens, B)
    check_scales(op, k_scale, v_scale, Hkv, k_cache.dtype)
    check_same_device(op, "k_cache", k_cache, v_cache=v_cache, k_new=k_new, v_new=v_new,
                      cache_seqlens=cache_seqlens, block_table=block_table, k_scale=k_scale,
                      v_scale=v_scale)
    path, reason = _kernel_dtype_path(op, impl, k_cache.device, k_new.dtype, "appends",
                                      "rows")
    check_no_grad(op, path, "an in-place cache write", k_cache=k_cache, v_cache=v_cache,
                  k_new=k_new, v_new=v_new, k_scale=k_scale, v_scale=v_scale)
    check_append_values(op, cache_seqlens, k_cache, block_table, capacity, s_new, k_scale,
                        v_scale, force=path == "torch")
    return path, reason, capacity


def kv_cache_append(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    block_table: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    impl: str = "auto",
) -> None:
    """Write new keys and values into a contiguous or paged cache, in place.

    Args:
        k_cache, v_cache: ``[B, S_max, Hkv, D]``, or ``[num_blocks, block_len, Hkv, D]`` with
            ``block_table [B, max_blocks]``; the new rows' dtype, or float8 (then quantised:
            stored = clamp(value / scale, +-448) rounded to e4m3, with ``k_scale``/``v_scale
            [Hkv]``, default 1). Any strides with the head dim contiguous (a heads-major
            ``[B, Hkv, S_max, D]`` cache passed as ``.transpose(1, 2)`` too); the Triton path
            refuses a strided head dim (``impl="torch"`` takes it).
        k_new, v_new: ``[B, s_new, Hkv, D]``; token ``i`` goes to position
            ``cache_seqlens[b] + i``.
        cache_seqlens: ``[B]`` the lengths *before* the append (not updated here), with
            ``0 <= cache_seqlens[b]`` and ``cache_seqlens[b] + s_new <= capacity``
            (``S_max``, or ``max_blocks * block_len``).
        block_table: ``[B, max_blocks]``: the blocks the new positions fall in must be in
            ``[0, num_blocks)``. A row of only -1 is a *padding row*: nothing is written
            for it (padded batches of a captured CUDA graph, tokens another context-parallel
            rank owns) and only its length's sign is checked.
        k_scale, v_scale: finite and > 0.

    Values are checked (``ValueError`` naming the argument, the same on both paths, before
    anything is written) on CPU tensors and on the reference path always, on CUDA tensors
    when ``lmfuse.set_checks(True)`` (or ``LMFUSE_CHECK=1``; one host synchronisation;
    never while compiling or capturing a CUDA graph). Unchecked CUDA calls never write outside
    the caches: a new row at a negative position, past the capacity, or in a block whose id
    is outside ``[0, num_blocks)`` is not written (the others are); an fp8 scale of 0 stores
    +-448 (``x / 0`` saturated, NaN for ``x = 0``), a negative one flips the sign, a NaN one
    stores NaN. Reserve space first (``PagedKVCache`` does, and raises when the pool is
    exhausted). NaN and inf in the new rows are stored as they are (inf saturates to +-448
    in an fp8 cache; NaN stays NaN).
    """
    op = "kv_cache_append"
    path, reason, capacity = _resolve_append(k_cache, v_cache, k_new, v_new, cache_seqlens,
                                             block_table, k_scale, v_scale, impl)
    B, s_new, Hkv, D = k_new.shape
    with nvtx_range("kv_cache_append", "fwd"):
        if path == "torch":
            if opaque_reference(k_new, v_new):
                # The reference reads lengths on the host: one opaque node for the graph.
                _append_reference(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table,
                                  k_scale, v_scale, capacity)
            else:  # (while tracing with autograd: the form that reads nothing on the host)
                append = (ref.kv_cache_append_traceable if torch.compiler.is_compiling()
                          else ref.kv_cache_append_reference)
                append(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table=block_table,
                       k_scale=k_scale, v_scale=v_scale)
            return None
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            # The kernel writes a head's D values as one run (heads at any stride: token-major
            # or heads-major caches; strides of size-1 dims, and of a call that writes
            # nothing, do not matter).
            if B * s_new and c.stride(3) != 1 and D > 1:
                raise ValueError(f"{op}: {name}'s head dim must be contiguous (stride 1), got "
                                 f"strides {tuple(c.stride())}; use impl='torch'")
        k_new = k_new if k_new.stride(3) == 1 and k_new.stride(2) == D else k_new.contiguous()
        v_new = v_new if v_new.stride(3) == 1 and v_new.stride(2) == D else v_new.contiguous()
        if block_table is not None and block_table.stride(-1) != 1:
            block_table = block_table.contiguous()
        cache_seqlens = cache_seqlens.contiguous()
        k_scale = k_scale.contiguous() if k_scale is not None else None
        v_scale = v_scale.contiguous() if v_scale is not None else None
        # A compiled call checks the values inside the op, at run time (they were skipped
        # above while tracing); an eager call has checked them already.
        _launch_append(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, k_scale,
                       v_scale, capacity, check=torch.compiler.is_compiling())
        return None


# --- explain ----------------------------------------------------------------------------------


def plan_decode_attention(q, k_cache, v_cache, cache_seqlens, *, block_table=None, scale=None,
                          window_size=None, sinks=None, k_scale=None, v_scale=None,
                          return_lse=False, num_splits=None, impl="auto", softcap=None,
                          check_values: bool = False) -> Plan:
    """The plan of a :func:`decode_attention` call: every check of its arguments' shapes,
    dtypes and devices, and with ``check_values`` of their values too (as the op runs them:
    on CPU tensors and the reference path always, on CUDA ones with ``set_checks``).
    ``lmfuse.explain`` checks the values; the parallel ops' own validation (which checks the
    lengths against their layouts first) calls this without."""
    s = _resolve(q, k_cache, v_cache, cache_seqlens, block_table, scale, window_size, sinks,
                 k_scale, v_scale, return_lse, num_splits, impl, softcap,
                 check_values=check_values)
    B, S, Hq, Hkv, D = s.B, s.s_active, s.Hq, s.Hkv, s.D
    cache = (f"paged [{k_cache.shape[0]} blocks x {k_cache.shape[1]}] x {block_table.shape[1]}"
             f" blocks per sequence" if s.paged else f"contiguous, S_max {k_cache.shape[1]}")
    details = {
        "q": f"{list(q.shape)} {dtype_name(q.dtype)}: {S} active token(s), {Hq} heads, D {D}",
        "cache": (f"{cache}, {Hkv} KV heads ({Hq // Hkv} query heads each), "
                  f"{dtype_name(k_cache.dtype)}"),
    }
    c = s.launch
    if c is not None:  # the Triton path
        how = "forced" if c.forced_splits else "heuristic"
        details["grid"] = (f"{B * Hkv} (sequence, KV head) x {c.splits} split(s) ({how}, "
                           f"<= {c.keys_per_split} keys each) x {c.row_blocks} row "
                           f"block(s) of {c.BLOCK_M}; key tiles of {c.BLOCK_N}")
        if c.splits > 1:
            details["merge"] = "partials (float32) merged by their LSEs in a second kernel"
    reason = s.reason
    if _native_decode(impl, s.path, q, k_cache, sinks, softcap, return_lse):
        reason += ("; CPU float32: one scaled_dot_product_attention over the gathered keys "
                   "(the reference where a token sees nothing or the output has a NaN)")
    return Plan("decode_attention", s.path, reason, details, call=s)


@planner_of(decode_attention)
def _explain_decode_attention(**a: Any) -> Plan:
    return plan_decode_attention(**a, check_values=True)


@planner_of(kv_cache_append)
def plan_kv_cache_append(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, k_scale,
                         v_scale, impl) -> Plan:
    path, reason, capacity = _resolve_append(k_cache, v_cache, k_new, v_new, cache_seqlens,
                                             block_table, k_scale, v_scale, impl)
    B, s_new, Hkv, D = k_new.shape
    cache = (f"paged [{k_cache.shape[0]} blocks x {k_cache.shape[1]}], {block_table.shape[1]}"
             " blocks per sequence" if block_table is not None else
             f"contiguous, S_max {k_cache.shape[1]}")
    details = {"new rows": f"{B} sequence(s) x {s_new} token(s), {Hkv} KV heads of D {D}",
               "cache": f"{cache} {dtype_name(k_cache.dtype)} (capacity {capacity})"}
    if k_cache.dtype in FP8_DTYPES:
        details["quantised"] = "x / scale per KV head, saturated to +-448"
    if path == "triton":
        details["kernel"] = "one program per (sequence, new token), every KV head's row"
    return Plan("kv_cache_append", path, reason, details)


@planner_of(merge_attention_states)
def plan_merge_attention_states(outs, lses, out_dtype, impl) -> Plan:
    _check_out_dtype(out_dtype)
    path, reason = _resolve_merge(outs, lses, impl)
    return Plan("merge_attention_states", path, reason,
                {"states": f"{outs.shape[0]} partial(s) of {list(outs.shape[1:])} "
                           f"{dtype_name(outs.dtype)}"})


def checks(device: torch.device, dtypes) -> list:
    """Fresh random cases of decode attention and the merge, for :mod:`lmfuse._check`."""
    from .._check import op_case

    small = device.type != "cuda"
    B, S, Hq, Hkv, D = (3, 70, 8, 2, 32) if small else (4, 3000, 32, 8, 128)

    def lengths():
        lens = torch.randint(1, S + 1, (B,), device=device, dtype=torch.int32)
        lens[-1] = S
        return lens

    def case(label, dtype, s_active, *, block_len=None, fp8=False, **kw):
        def inputs():
            q = torch.randn(B, s_active, Hq, D, device=device).to(dtype)
            cdt = FP8_DTYPES[0] if fp8 else dtype
            k = torch.randn(B, S, Hkv, D, device=device).to(cdt)
            v = torch.randn(B, S, Hkv, D, device=device).to(cdt)
            if block_len:
                blocks = cdiv(S, block_len)
                table = torch.randperm(B * blocks, device=device).view(B, blocks).int()
                xs = [q, _reshuffle(k, table, block_len, S), _reshuffle(v, table, block_len, S),
                      lengths(), table]
            else:
                xs = [q, k, v, lengths()]
            if fp8:
                xs += [torch.rand(Hkv, device=device) + 0.5, torch.rand(Hkv, device=device) + 0.5]
            return xs

        def attend(q, k, v, lens, **options):
            if fp8:  # the harness widens inputs for the reference; the cache stays float8
                k, v = k.to(FP8_DTYPES[0]), v.to(FP8_DTYPES[0])
            return decode_attention(q, k, v, lens, **options)

        # the inputs after the lengths: the table, then the scales
        keywords = ("block_table",) * bool(block_len) + ("k_scale", "v_scale") * fp8
        return op_case("decode_attention", label, dtype, (B, s_active, Hq, D), inputs, attend,
                       plan_decode_attention, keywords=keywords, **kw)

    def merge_case(dtype):
        P, R = 4, 3 * Hq

        def inputs():
            lses = torch.randn(P, B, R, device=device) * 3
            lses[0, 0] = float("-inf")
            return [torch.randn(P, B, R, D, device=device).to(dtype), lses]

        return op_case("merge_attn_states", "4 partials", dtype, (P, B, R, D), inputs,
                       lambda *a, **kw: merge_attention_states(*a, **kw)[0],
                       plan_merge_attention_states)

    cases = []
    for dtype in dtypes:
        cases += [
            case("contiguous GQA", dtype, 1),
            case("paged16 s4 win+sinks", dtype, 4, block_len=16, window_size=S // 3,
                 sinks=torch.randn(Hq, device=device)),
            case("paged7 s2 4 splits", dtype, 2, block_len=7, num_splits=4),
            case("fp8 cache", dtype, 1, fp8=True),
            merge_case(dtype),
        ]
    return cases


def _reshuffle(cache, table, block_len: int, S: int):
    """``cache [B, S, Hkv, D]`` laid out in a pool by ``table`` (block ``j`` of sequence
    ``b`` at ``table[b, j]``)."""
    B, _, Hkv, D = cache.shape
    blocks = table.shape[1]
    rows = torch.nn.functional.pad(cache, (0, 0, 0, 0, 0, blocks * block_len - S))
    pool = torch.empty((B * blocks, block_len, Hkv, D), dtype=cache.dtype, device=cache.device)
    pool[table.reshape(-1).long()] = rows.reshape(B * blocks, block_len, Hkv, D)
    return pool
