"""The launches of the Generator's fused decode layers (``fused.py``): the rotary + cache
append (``rope_append_kernel``), the token embeddings' gather (``embed_kernel``) and the
GEMV (``gemv_kernel``, its split-K and rotary variants), with their tile choices. Their
references are in ``fused_reference.py``, the kernels in ``kernels.py``; the module that
chains them into a decode step is ``fused.py``'s :class:`~lmfuse.serving.fused.FusedDecoder`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from .. import _pdl, tuning
from .._dispatch import interpreter_active
from .._launch import cdiv, lazy_kernels, next_pow2
from .fused_reference import gemv_reference, prenorm_reference, rope_append_reference
from .sampling import merge_argmax

#: Most rows the GEMV kernels take; more go through cuBLAS.
GEMV_MAX_ROWS = 64
_OP = "Generator"
_kernels = lazy_kernels("kernels", __package__)
_CPU = torch.device("cpu")  # (the default table's values)


# --- rotary + cache append -------------------------------------------------------------------

_ROPE_ROWS_FROM = 64  # more rows than this: several a program

#: Triton's interpreter runs a launch's programs one after another, each costing it about
#: 15-30 ms whatever its tile's width (numpy does a tile's lanes at once): there the
#: one-row GEMV and the rotary append take wider tiles (fewer programs, the same kernel
#: code) unless this is set, as a test does to run the GPU's tiles in the interpreter.
_GPU_TILES_IN_INTERPRETER = False


def _interpreter_tiles() -> bool:
    return not _GPU_TILES_IN_INTERPRETER and interpreter_active()


def launch_rope_append(qkv, cos, sin, pos, table, k_cache, v_cache, q_norm, k_norm, eps,
                        k_scale, v_scale, hq, hkv, d, pdl=0) -> torch.Tensor:
    n = qkv.shape[0]
    q = torch.empty((n, hq, d), dtype=qkv.dtype, device=qkv.device)
    if n == 0:
        return q
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    norm = q_norm is not None
    # A row a program for a decode step's few; 16 for a prefill's many (H100, 4096 rows of
    # 24 heads of 128: a program per row and head took 99 us)
    rows = 1 if n <= _ROPE_ROWS_FROM else 16
    if _interpreter_tiles():
        rows = min(next_pow2(n), 64)
    _kernels().rope_append_kernel[(cdiv(n, rows), hq + hkv)](
        qkv, q, k_cache, v_cache, cos, sin, pos, table,
        q_norm if norm else qkv, k_norm if norm else qkv,
        k_scale if fp8 else cos, v_scale if fp8 else cos,
        qkv.stride(0), q.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), table.stride(0), k_cache.shape[0], cos.shape[0], float(eps), n,
        HQ=hq, HKV=hkv, D=d, HALF=d // 2, BLOCK_LEN=k_cache.shape[1], QK_NORM=norm, FP8=fp8,
        PDL=pdl, ROWS=rows, num_warps=1 if rows == 1 else 4, **_pdl.launch_options(pdl))
    return q


# --- GEMV ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowNorm:
    """What a GEMV needs to RMS-norm its input rows itself (``row_scale``): the residual
    stream's sums of squares ``ss [n, tiles]`` float32 (per row, in parts to be added in
    order), over ``features`` features, and the norm's ``eps``."""
    ss: torch.Tensor
    features: int
    eps: float

    def scale(self) -> torch.Tensor:
        """Each row's ``rsqrt(mean(h^2) + eps)``, float32 ``[n]``."""
        return torch.rsqrt(self.ss.sum(-1) / self.features + self.eps)


def _prenorm_unfused(h: torch.Tensor, prenorm: tuple[torch.Tensor, float]
                     ) -> tuple[torch.Tensor, RowNorm]:
    """``(h * g, its RowNorm)`` of the stored ``h [n, H]`` by torch ops (one sum a row),
    where a kernel that would leave them does not run."""
    return prenorm_reference(h, *prenorm)[0], RowNorm(
        h.float().square().sum(-1, keepdim=True), h.shape[1], float(prenorm[1]))


def embed(ids: torch.Tensor, table: torch.Tensor,
           prenorm: tuple[torch.Tensor, float] | None = None, pdl: int = 0) -> Any:
    """The step's residual stream: a new ``[n, H]`` tensor of the rows ``table[ids]``
    (``embed_kernel``; the engine checked the ids). ``prenorm = (g, eps)``: returns ``(h,
    xw, rn)`` as ``gemv``'s prenorm does, the first RMSNorm's work done in the gather."""
    n, H = ids.shape[0], table.shape[1]
    if ids.stride(0) != 1:
        ids = ids.contiguous()
    if table.stride(1) != 1 or n == 0:
        h = table[ids.long()]
        return h if prenorm is None else (h, *_prenorm_unfused(h, prenorm))
    h = torch.empty((n, H), dtype=table.dtype, device=table.device)
    xw = ss = None
    if prenorm is not None:
        xw = torch.empty_like(h)
        ss = torch.empty((n, 1), dtype=torch.float32, device=h.device)
    _kernels().embed_kernel[(n,)](
        ids, table, None if prenorm is None else prenorm[0], h, xw, ss, H, table.stride(0),
        h.stride(0), BLOCK=min(next_pow2(H, 16), 2048), PRENORM=prenorm is not None,
        PDL=pdl, num_warps=4, **_pdl.launch_options(pdl))
    return h if prenorm is None else (h, xw, RowNorm(ss, H, float(prenorm[1])))


#: Output features from which a matrix counts as an LM head (a vocabulary) for the GEMV.
LM_HEAD_MIN_FEATURES = 65536


def gemv_config(n_out: int, K: int, block_m: int, gated: bool, itemsize: int = 2,
                smem: int | None = None, rope: bool = False,
                device: torch.device = _CPU) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` of a GEMV of ``K`` inputs to ``n_out``
    outputs (``gated``: two matrices of that many) at row tile ``block_m``, from the
    ``gemv`` section of ``device``'s tuning table: the first entry of its ``extra_tiles``
    (a device table's additions, searched first) and then of its ``tiles`` whose
    conditions hold (``kind``: "lm_head" for one matrix of at least
    :data:`LM_HEAD_MIN_FEATURES` outputs, "gated", else "plain"; ``rows``: the row tiles;
    ``split_k``: whether :func:`gemv_split` splits K, with ``rope`` :func:`rope_split`;
    ``max_k``; ``features_multiple``).
    An entry without ``block_n`` takes ``block_n_by_features``; ``cap_k`` caps ``block_k`` at
    K's power of two; ``dot: 0`` (one row, no dot tile) has no pipeline to fit. Otherwise
    ``rope`` (the QKV GEMV with the rotation inside) takes ``rope_block_n`` features of
    each half of a head, and ``block_k``, then the stages, shrink until the stages' tiles
    fit the entry's ``smem_limit`` (the section's by default) and ``smem`` (the device's
    shared memory a program may use, less 8 KiB for the kernel's scratch).

    The entries are the fastest CUDA-graph replays of ``bench/sweep_gemv.py`` and, chained
    as in a decode step, ``bench/sweep_gemv_chain.py`` on an H100 (a 2048-wide model, the
    LM head at V 128256, K 2048), against the next best or the previous choice:

    * one row, no dot tile (two features a program, K tiles of up to 2048), chained: QKV
      9.9 -> 6.8 us, Wo 7.5 -> 5.9, gate/up 24.9 -> 24.2 against the 16-row dot tile;
    * the LM head at one row, with the final norm and the argmax inside, graphs of 20:
      256 x 128 tiles, 16 warps 178.7 us, 64 x 128 and 8 warps 182.7, against 193.3 for
      RMSNorm + cuBLAS + the argmax's two launches;
    * the LM head at 16-64 rows: BLOCK_N 16-128, BLOCK_K 128-512, 4/8 warps, 3/4/6 stages
      swept, 2.96 / 2.84 TB/s; 64 rows at 2 stages 183.1 against 185.8 us at 4;
    * plain, 16 rows: QKV (K not split) 10.22 -> 8.26 us at 256-wide K tiles and 4 stages;
      Wo and Wd (K split in 4) 7.71 -> 7.08 us and 15.84 (cuBLAS 17.4); 64 rows, chained:
      QKV 9.9 -> 8.4 us, Wo 9.2 -> 7.6; Wd (K split in 2) 17.64 (cuBLAS 18.63).

    The H200's ``extra_tiles`` (whole ``step()`` calls of the benchmark model, three
    alternating rounds in one process): 32-row tiles (batch buckets of 17-32 rows), the
    gated GEMV at 4 stages and the plain ones (QKV, Wo) at 256-wide K tiles, B17 / B24 /
    B32 0.746 / 0.747 / 0.744 -> 0.713 / 0.731 / 0.717 ms; the K split for Wo and Wd at 32
    rows (2 and 4, faster chained alone) made the step slower (B32 0.745 -> 0.787)."""
    return _gemv_config(n_out, K, block_m, gated, itemsize, smem, rope, device,
                        LM_HEAD_MIN_FEATURES, tuning.generation())


def _kind(n_out: int, gated: bool, lm_head_min: int) -> str:
    return "gated" if gated else "lm_head" if n_out >= lm_head_min else "plain"


@functools.lru_cache(maxsize=256)
def _gemv_config(n_out, K, block_m, gated, itemsize, smem, rope, device, lm_head_min,
                 generation) -> tuple[int, int, int, int]:
    t = tuning.table("gemv", device)
    kind = _kind(n_out, gated, lm_head_min)
    # The entry of the launch that runs: the rotating GEMV splits K by rope_split alone.
    split = (rope_split(K, block_m, device) if rope else
             _gemv_split(n_out, K, block_m, gated, device, lm_head_min, generation)) > 1
    e = next(e for e in (*t["extra_tiles"], *t["tiles"])
             if kind in e["kind"] and block_m in e.get("rows", (block_m,))
             and e.get("split_k", split) == split and K <= e.get("max_k", K)
             and n_out % e.get("features_multiple", 1) == 0)
    block_n = e.get("block_n") or next(b for limit, b in t["block_n_by_features"]
                                       if n_out <= limit)
    block_k, warps, stages = e["block_k"], e["warps"], e["stages"]
    if e.get("cap_k"):
        block_k = min(block_k, next_pow2(K, 16))
    if not e.get("dot", 1):
        return block_n, block_k, warps, stages
    if rope:
        block_n = t["rope_block_n"]
    limit = e.get("smem_limit", t["smem_limit"])
    if smem is not None:
        limit = min(limit, smem - 8 * 1024)  # room for the kernel's own scratch
    tiles = 2 if gated or rope else 1
    while block_k > 64 and (block_m + tiles * block_n) * block_k * itemsize * stages > limit:
        block_k //= 2
    while stages > 2 and (block_m + tiles * block_n) * block_k * itemsize * stages > limit:
        stages -= 1
    return block_n, block_k, warps, stages


def row_tile(n: int) -> int:
    """The GEMV's row tile (BLOCK_M) for ``n`` rows: 1 (no dot tile), 16, 32 or 64."""
    return 1 if n == 1 else 16 if n <= 16 else 32 if n <= 32 else 64


def gemv_split(n_out: int, K: int, block_m: int, gated: bool,
               device: torch.device = _CPU) -> int:
    """How many programs share a tile's K range (``gemv_kernel``'s SPLIT_K): the first
    entry of the ``gemv`` section's ``split_k`` whose ``kind``, ``rows``, ``max_features``
    and ``min_k_per_feature`` hold, else 1. Where it was measured to pay
    (``bench/sweep_gemv_chain.py --dot --split 1,2,4,8``, H100, 8 launches chained in a
    graph, a 2048-wide model): 16 rows, output 2048 (Wo, Wd): 4; 64 rows, the long K of Wd
    (8192): 2."""
    return _gemv_split(n_out, K, block_m, gated, device, LM_HEAD_MIN_FEATURES,
                       tuning.generation())


@functools.lru_cache(maxsize=256)
def _gemv_split(n_out, K, block_m, gated, device, lm_head_min, generation) -> int:
    kind = _kind(n_out, gated, lm_head_min)
    return next((e["split"] for e in tuning.table("gemv", device)["split_k"]
                 if kind in e["kind"] and block_m in e["rows"] and n_out <= e["max_features"]
                 and K >= e.get("min_k_per_feature", 0) * n_out), 1)


# (device, workspace elements, tiles) -> (float32 partials, int32 counts), for the launches
# given no workspace of their own: kept for the process's life (CUDA graphs hold their
# addresses; the counts return to zero after each launch, so any later launch may use
# them). Launches that share a workspace must not overlap: each decoder (each Generator)
# passes its own, whose steps run on one stream at a time (a graph's capture stream
# included), which orders them. Not keyed by stream: a graph is captured on another stream
# than its warm-up ran on, and must find the warm-up's buffers.
_SPLIT_BUFFERS: dict[tuple[str, int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def split_buffers(device: torch.device, elements: int, tiles: int,
                  workspace: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A split-K launch's ``(partials, counts)`` from ``workspace`` (a dict its owner keeps:
    one decoder's; default: the process's :data:`_SPLIT_BUFFERS`), made there at first."""
    store = _SPLIT_BUFFERS if workspace is None else workspace
    key = (str(device), elements, tiles)
    if key not in store:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # The zeroed counts would only be recorded, not set: warm up before capturing.
            raise RuntimeError(f"{_OP}: a split-K GEMV of a new shape inside a CUDA-graph "
                               "capture; run it once before capturing")
        store[key] = (torch.empty(elements, dtype=torch.float32, device=device),
                      torch.zeros(tiles, dtype=torch.int32, device=device))
    return store[key]


@dataclass(frozen=True)
class RopeAppend:
    """What the QKV GEMV needs to rotate q and k and append k and v itself (the arguments
    of :func:`rope_append_reference` but ``qkv`` and the q/k norm, which it does not do)."""
    cos: torch.Tensor
    sin: torch.Tensor
    pos: torch.Tensor
    table: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: Any
    v_scale: Any
    hq: int
    hkv: int
    d: int


def rope_gemv_takes(n: int, d: int) -> bool:
    """Whether the QKV GEMV of ``n`` rows can rotate and append itself (several rows, and a
    head's half a multiple of its 16-dim tiles)."""
    return 1 < n <= GEMV_MAX_ROWS and d % 2 == 0 and (d // 2) % 16 == 0


def gemv(x: torch.Tensor, weights: tuple[torch.Tensor, ...], biases: Any = None, *,
          residual: torch.Tensor | None = None, gated: bool = False,
          pdl: int = 0, split_k: int | None = None,
          norm: tuple[torch.Tensor, float] | None = None,
          rope: RopeAppend | None = None, argmax: bool = False,
          prenorm: tuple[torch.Tensor, float] | None = None,
          row_scale: RowNorm | None = None, tokens: torch.Tensor | None = None,
          out: torch.Tensor | None = None, workspace: dict | None = None) -> Any:
    """``gemv_kernel`` launched: a new ``[n, N]`` output (in ``out`` where given, a
    contiguous tensor of ``x``'s dtype), or ``residual`` updated in place.
    ``pdl``: with programmatic dependent launch (``lmfuse._pdl``). ``split_k``: programs
    per tile along K (default :func:`gemv_split`'s, with ``rope`` :func:`rope_split`'s;
    not with ``gated`` or ``norm``). ``norm = (g, eps)``: ``x`` RMS-normed (weight ``g``)
    inside the kernel.
    ``rope`` (``weights`` = Wq, Wk, Wv): the projections' rotary and cache append inside
    (:func:`rope_append_reference` of the float32 projections); returns the rotated
    queries ``[n, hq d]``. ``argmax`` (one matrix, no residual, not gated): returns ``(y,
    each row's argmax)``, int64 ``[n]`` as ``torch.argmax`` of ``y`` gives it (ties and NaN
    included), taken from the tiles as they are stored, in ``tokens`` where given.
    ``prenorm = (g, eps)`` (with ``residual``, one matrix, not ``norm``): returns ``(h, xw,
    rn)``, the updated residual stream, ``h * g`` and its :class:`RowNorm`
    (:func:`prenorm_reference`); ``row_scale``
    (a :class:`RowNorm`): each row's products scaled by its factor, so that ``gemv(xw, W,
    row_scale=rn)`` is the GEMV of ``rms_norm(h)``. ``workspace``: the dict a split-K
    launch's buffers are kept in (:func:`split_buffers`; a decoder's own, so that two
    Generators' steps never share them)."""
    if (gated or norm is not None) and split_k is not None and split_k > 1:
        raise ValueError(f"{_OP}: the gated or normed GEMV does not split K "
                         f"(split_k={split_k})")
    if prenorm is not None and (residual is None or len(weights) != 1 or norm is not None
                                or argmax):
        raise ValueError(f"{_OP}: the GEMV's prenorm takes a residual, one matrix, no norm "
                         "and no argmax")
    if row_scale is not None and (norm is not None or prenorm is not None):
        raise ValueError(f"{_OP}: the GEMV's row_scale takes neither norm nor prenorm")
    if rope is not None:
        return _gemv_rope(x, weights, biases, rope, pdl, row_scale, split_k, workspace)
    n, K = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    ns = [w.shape[0] for w in weights]
    n_out = ns[0] if gated else sum(ns)
    block_m = row_tile(n)
    block_n, block_k, warps, stages = gemv_config(n_out, K, block_m, gated, x.element_size(),
                                                  tuning.shared_memory(x.device),
                                                  device=x.device)
    if argmax and (len(weights) != 1 or residual is not None or gated):
        raise ValueError(f"{_OP}: the GEMV's argmax takes one matrix, no residual, not gated")
    if block_m == 1 and block_n < 64 and _interpreter_tiles():
        while block_n < 64 and not any(v % (2 * block_n) for v in ns):
            block_n *= 2
    if any(v % block_n for v in ns) or n == 0:
        y = gemv_reference(x, weights, biases, residual=residual, gated=gated, norm=norm,
                           row_scale=None if row_scale is None else row_scale.scale())
        if residual is not None:
            y = residual.copy_(y)
        if out is not None:
            y = out.copy_(y)
        if prenorm is not None:
            return (y, *_prenorm_unfused(y, prenorm))
        return (y, torch.argmax(y, -1, out=tokens)) if argmax else y
    if residual is not None:
        y = residual
    elif out is not None:
        y = out
    else:
        y = torch.empty((n, n_out), dtype=x.dtype, device=x.device)
    w = list(weights) + [weights[0]] * (3 - len(weights))
    b = list(biases) if biases is not None else []
    b = b + [w[0]] * (3 - len(b))
    if argmax and split_k is not None and split_k > 1:
        raise ValueError(f"{_OP}: the GEMV's argmax does not split K (split_k={split_k})")
    split = (1 if norm is not None or argmax else gemv_split(n_out, K, block_m, gated, x.device)
             if split_k is None else split_k)
    k_split = cdiv(cdiv(K, split), block_k) * block_k
    split = cdiv(K, k_split)  # no empty split
    grid = (n_out // block_n, cdiv(n, block_m), split)
    tiles = grid[0] * grid[1]
    ws, count = (split_buffers(x.device, split * tiles * block_m * block_n, tiles, workspace)
                 if split > 1 else (y, y))
    aval = aidx = None
    if argmax:  # each row's first maximum per tile, merged below
        aval = torch.empty((n, grid[0]), dtype=torch.float32, device=x.device)
        aidx = torch.empty((n, grid[0]), dtype=torch.int32, device=x.device)
    # The norm's weight and eps: of the norm inside (NORM), or of the next one (PRENORM);
    # the RowNorm's eps (ROW_SCALE).
    G, eps, xw, ss = None, 0.0, None, None
    if norm is not None:
        G, eps = norm[0], float(norm[1])
    elif prenorm is not None:
        G, eps = prenorm[0], float(prenorm[1])
        xw = torch.empty_like(y)
        ss = torch.empty((n, grid[0]), dtype=torch.float32, device=x.device)
    if row_scale is not None:
        eps, ss = row_scale.eps, row_scale.ss
    _kernels().gemv_kernel[grid](
        x, w[0], w[1], w[2], b[0], b[1], b[2], y, y, n, K, ns[0],
        ns[1] if len(ns) > 1 else 0, x.stride(0), y.stride(0), y.stride(0), ws, count, k_split,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=biases is not None,
        RESIDUAL=residual is not None, GATED=gated, EVEN_K=K % block_k == 0, PDL=pdl,
        SPLIT_K=split, G=G, eps=eps, NORM=norm is not None,
        AVAL=aval, AIDX=aidx, ARGMAX=argmax,
        PRENORM=prenorm is not None, XW=xw, stride_xw=0 if xw is None else xw.stride(0),
        **_row_norm_args(ss, row_scale), ROW_SCALE=row_scale is not None,
        num_warps=warps, num_stages=stages, **_pdl.launch_options(pdl))
    if argmax:
        return y, merge_argmax(aval, aidx, n_out, out=tokens, pdl=pdl)
    if prenorm is not None:
        return y, xw, RowNorm(ss, n_out, eps)
    return y


def _row_norm_args(ss: torch.Tensor | None, rn: RowNorm | None) -> dict[str, Any]:
    """``gemv_kernel``'s arguments for the sums of squares ``ss`` it writes (PRENORM, one
    column a program along N) or the :class:`RowNorm` it reads (ROW_SCALE)."""
    if rn is not None:
        return dict(SS=rn.ss, ss_tiles=rn.ss.shape[1], norm_n=rn.features,
                    BLOCK_T=next_pow2(rn.ss.shape[1], 1))
    return dict(SS=ss)


def rope_split(K: int, block_m: int, device: torch.device = _CPU) -> int:
    """How many programs share a tile's K range in the rotating QKV GEMV: the first entry
    of the ``gemv`` section's ``rope_split_k`` whose ``rows`` holds ``block_m`` and whose
    ``min_k`` is at most ``K``, else 1."""
    return next((e["split"] for e in tuning.table("gemv", device)["rope_split_k"]
                 if block_m in e["rows"] and K >= e.get("min_k", 0)), 1)


def _gemv_rope(x: torch.Tensor, weights: tuple[torch.Tensor, ...], biases: Any,
               r: RopeAppend, pdl: int, row_scale: RowNorm | None = None,
               split_k: int | None = None, workspace: dict | None = None) -> torch.Tensor:
    n, K = x.shape
    ns = [w.shape[0] for w in weights]
    if ns != [r.hq * r.d, r.hkv * r.d, r.hkv * r.d]:
        raise ValueError(f"{_OP}: the rotating GEMV takes Wq, Wk, Wv of {r.hq}, {r.hkv}, "
                         f"{r.hkv} heads of {r.d} (got {ns} rows)")
    if x.stride(-1) != 1:
        x = x.contiguous()
    n_out = sum(ns)
    block_m = row_tile(n)
    block_n, block_k, warps, stages = gemv_config(n_out, K, block_m, False, x.element_size(),
                                                  tuning.shared_memory(x.device), rope=True,
                                                  device=x.device)
    if not rope_gemv_takes(n, r.d) or (r.d // 2) % block_n:
        qkv = gemv_reference(x.float(), weights, biases,  # float32, as the kernel's
                             row_scale=None if row_scale is None else row_scale.scale())
        q = rope_append_reference(qkv, r.cos, r.sin, r.pos, r.table, r.k_cache, r.v_cache,
                                  None, None, 0.0, r.k_scale, r.v_scale, r.hq, r.hkv, r.d)
        return q.to(x.dtype).view(n, r.hq * r.d)
    y = torch.empty((n, ns[0]), dtype=x.dtype, device=x.device)
    fp8 = r.k_cache.dtype == torch.float8_e4m3fn
    b = list(biases) if biases is not None else [weights[0]] * 3
    kc, vc = r.k_cache, r.v_cache
    split = rope_split(K, block_m, x.device) if split_k is None else split_k
    k_split = cdiv(cdiv(K, split), block_k) * block_k
    split = cdiv(K, k_split)  # no empty split
    grid = (n_out // (2 * block_n), cdiv(n, block_m), split)
    tiles = grid[0] * grid[1]
    ws, count = (split_buffers(x.device, 2 * split * tiles * block_m * block_n, tiles,
                               workspace) if split > 1 else (y, y))
    _kernels().gemv_kernel[grid](
        x, weights[0], weights[1], weights[2], b[0], b[1], b[2], y, y, n, K, ns[0], ns[1],
        x.stride(0), y.stride(0), y.stride(0), ws, count, k_split,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=biases is not None,
        RESIDUAL=False, GATED=False, EVEN_K=K % block_k == 0, PDL=pdl, SPLIT_K=split,
        ROPE=True, HALF=r.d // 2, COS=r.cos, SIN=r.sin, POS=r.pos, TABLE=r.table, KC=kc,
        VC=vc, K_SCALE=r.k_scale if fp8 else r.cos, V_SCALE=r.v_scale if fp8 else r.cos,
        stride_kblk=kc.stride(0), stride_krow=kc.stride(1), stride_vblk=vc.stride(0),
        stride_vrow=vc.stride(1), stride_tb=r.table.stride(0), num_blocks=kc.shape[0],
        positions=r.cos.shape[0], BLOCK_LEN=kc.shape[1], FP8=fp8,
        ROW_SCALE=row_scale is not None, **_row_norm_args(None, row_scale),
        eps=0.0 if row_scale is None else row_scale.eps, num_warps=warps, num_stages=stages,
        **_pdl.launch_options(pdl))
    return y


# --- the weights ahead, into L2 ---------------------------------------------------------------


def l2_prefetch_bytes(device: torch.device) -> int:
    """Bytes a one-row decode step asks the L2 cache for in each layer's attention window
    (:func:`prefetch_ranges`; 0: no prefetch): the ``gemv`` table's ``l2_prefetch_bytes``.
    H200 16 MiB (the benchmark model's B1 step: budgets of 12 to 32 MiB against none, best
    at 16; ``h200-2026-11-28-generate-l2prefetch-sweep.json``); elsewhere 0 until measured
    there."""
    return int(tuning.table("gemv", device)["l2_prefetch_bytes"])


#: Bytes a thread's bulk prefetch asks for, and threads a program: 64 KiB x 32 (2 MiB a
#: program). The same bytes over 32 programs (8 threads, or 16 KiB chunks) finish sooner and
#: gain nothing (H200, B1: 0.512-0.522 against 0.5025 ms).
_PREFETCH_CHUNK = 64 << 10
_PREFETCH_THREADS = 32


def prefetch_ranges(o: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                    budget: int) -> list[tuple[torch.Tensor, int]]:
    """The byte ranges ``(tensor, leading bytes)`` that a one-row step asks the L2 cache
    for while a layer's attention runs, ``budget`` bytes in all: the output projection
    ``o`` first (the next weights read), then the first rows of ``gate`` and ``up`` alike
    (what the gated GEMV's first programs read). Whole 16-byte units of contiguous tensors
    at 16-byte aligned addresses (what the bulk prefetch takes); others are left out."""
    def usable(w: torch.Tensor) -> bool:
        return w.is_contiguous() and w.data_ptr() % 16 == 0

    def take(w: torch.Tensor, n: int) -> int:
        return min(n, w.numel() * w.element_size()) // 16 * 16 if usable(w) else 0

    first = take(o, budget)
    each = (budget - first) // 2
    ranges = [(o, first), (gate, take(gate, each)), (up, take(up, each))]
    return [(w, n) for w, n in ranges if n]


def l2_prefetch(ranges: list[tuple[torch.Tensor, int]]) -> None:
    """``l2_prefetch_kernel`` over up to three ``(tensor, bytes)`` ranges (Hopper or later:
    ``cp.async.bulk.prefetch.L2``). Changes no memory."""
    if not ranges:
        return
    args: list[Any] = []
    for t, n in ranges:
        args += [t.view(-1).view(torch.uint8), n]
    args += [args[0], 0] * (3 - len(ranges))
    per_program = _PREFETCH_CHUNK * _PREFETCH_THREADS
    most = max(n for _, n in ranges)
    _kernels().l2_prefetch_kernel[(cdiv(most, per_program), len(ranges))](
        *args, CHUNK=_PREFETCH_CHUNK, BLOCK=_PREFETCH_THREADS, num_warps=1)
