"""``lmfuse tune linear_cross_entropy``: the sweep that writes the chunked op's tuning
entries (chunk budget, row multiple, the cross-entropy kernel's launch) into the user
cache, timed on the GPU it tunes for."""

from __future__ import annotations

from typing import Optional

import torch

from .. import tuning
from .._launch import dtype_name
from . import linear, linear_config

_OP = linear._OP

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
    if not tuning.row_tiles(tuning.table("cross_entropy", device), v_local).single:
        stages.append(("kernel", list(_KERNEL_CANDIDATES)))  # streamed rows
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
    :func:`~lmfuse.cross_entropy.linear_config.check_config` first.
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
            linear._apply(h, w, t, None, -100, 0.0, 0.0, None, "mean", None, impl, None,
                   cfg).backward()

        start, source = linear_config.config(V, device)
        start = dict(start.entry(), chunk_bytes=min(start.chunk_bytes, max_chunk_bytes))
        log(f"{_OP} N={N} H={H} V={V} {dtype_name(dtype)} (start: {source})")
        out = sweep.coordinate_sweep(start, tune_stages(V, device, max_chunk_bytes), run,
                                     lambda c: linear_config.check_config(c, "a tuning candidate"),
                                     timer, log, prefer=lambda c: c["chunk_bytes"],
                                     tolerance=TUNE_TOLERANCE, confirm=3)
        best = {k: out.best[k] for k in ("chunk_bytes", "row_multiple", "kernel")}
        result = dict(shape=[N, H, V], dtype=dtype_name(dtype),
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
