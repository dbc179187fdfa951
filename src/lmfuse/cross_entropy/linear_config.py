"""The launch configuration of ``linear_cross_entropy`` (``linear.py``): the lookup of its
entry in the tuning tables and the ``lmfuse tune`` user cache (:func:`config`), the guard
every entry passes before anything runs (:func:`check_config`), the tokens a chunk holds
(:func:`chunk_rows`) and the config's line in ``lmfuse.explain``'s plan.

The values live in ``lmfuse/tuning/*.json`` (and the user cache); the sweep that writes the
cache's entries is ``tune.py``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .. import tuning
from .._launch import is_pow2
from .ops import StreamLaunch

_OP = "linear_cross_entropy"  # the op's name in messages, and its key in the tuning tables

_KERNEL_KEYS = ("BLOCK_V", "num_warps", "programs_per_sm")
_MAX_VALUES_PER_THREAD = 64  # fp32 row values a thread holds per tile; more spill registers


@dataclass(frozen=True, slots=True)
class LCEConfig:
    """A checked config of the chunked op: ``chunk_bytes`` (the logits chunk budget),
    ``row_multiple`` (chunk rows are rounded down to a multiple of it, for GEMM tiles) and
    ``kernel`` (``None``, or the launch of the cross-entropy kernel's stats-and-gradient
    pass over rows longer than ``cross_entropy.max_single_block``; see
    :class:`~lmfuse.cross_entropy.ops.StreamLaunch`). :meth:`entry` is its JSON form."""

    chunk_bytes: int
    row_multiple: int
    kernel: Optional[StreamLaunch]

    @classmethod
    def of(cls, cfg: dict[str, Any]) -> LCEConfig:
        """From an entry :func:`check_config` passed."""
        k = cfg.get("kernel")
        return cls(cfg["chunk_bytes"], cfg["row_multiple"],
                   None if k is None else StreamLaunch.of(k))

    def entry(self) -> dict[str, Any]:
        """The config as a tuning table or the user cache holds it."""
        return dict(chunk_bytes=self.chunk_bytes, row_multiple=self.row_multiple,
                    kernel=None if self.kernel is None else self.kernel.entry())


def config(v_local: int, device: torch.device) -> tuple[LCEConfig, str]:
    """``(config, source)`` of the chunked op for ``v_local`` vocabulary rows on ``device``:
    the shape bucket's entry from the tuning tables and the ``lmfuse tune`` user cache
    (see :func:`lmfuse.tuning.bucket_config`), checked by :func:`check_config`.

    The entry's keys: ``chunk_bytes``, ``row_multiple`` and ``kernel`` (``null``, or the
    launch's ``BLOCK_V``, ``num_warps``, ``programs_per_sm``, and optionally ``slice``,
    ``lag`` and ``hints``: 1 for L2 eviction hints on the logits and a streaming store of
    the gradient; or, for whole rows a program, ``vec`` and ``prefetch``: the barrier-free
    stats loop of ``ce_stream_kernel``).
    """
    return _table_config(v_local, device, tuning.generation())


@functools.lru_cache(maxsize=64)
def _table_config(v_local: int, device: torch.device, generation: int
                  ) -> tuple[LCEConfig, str]:
    # Looked up and checked once per vocabulary and device (its layers, the checks and, on
    # CUDA, the device's name cost tens of microseconds a call on a slow host), again after
    # the user cache is read again (``generation``).
    cfg, source = tuning.bucket_config(_OP, device, v_local)
    return LCEConfig.of(check_config(cfg, source)), source


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
    if not is_pow2(block) or not 16 <= block <= 65536:
        raise bad(f"kernel BLOCK_V must be a power of two in [16, 65536], got {block!r}")
    if not is_pow2(warps) or warps > 32:
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
    if vec and (not is_pow2(vec) or vec > block or "slice" in k):
        raise bad(f"kernel vec must be 0 or a power of two <= BLOCK_V={block}, and without "
                  f"slice, got {vec!r}")
    if k.get("prefetch", 0) and not vec:
        raise bad("kernel prefetch is only meaningful with vec")
    cfg["kernel"] = k
    return cfg


def chunk_rows(n: int, v_local: int, itemsize: int, device: torch.device,
               max_chunk_bytes: Optional[int] = None, cfg: Optional[LCEConfig] = None) -> int:
    """Tokens per chunk: as many as the budget (``max_chunk_bytes``, else ``cfg``'s or the
    device's tuning table's ``chunk_bytes``) holds of ``[rows, v_local]`` logits, rounded
    down to the config's ``row_multiple`` when that leaves any, at least 1, at most ``n``."""
    if cfg is None:
        cfg = config(v_local, device)[0]
    budget = cfg.chunk_bytes if max_chunk_bytes is None else max_chunk_bytes
    rows = budget // max(1, v_local * itemsize)
    if rows >= cfg.row_multiple:
        rows -= rows % cfg.row_multiple
    return max(1, min(n, rows))


def _describe(cfg: LCEConfig, source: str, max_chunk_bytes: Optional[int]) -> str:
    budget = (f"chunk budget {(max_chunk_bytes or cfg.chunk_bytes) / 2**20:.1f} MiB"
              + (" (max_chunk_bytes)" if max_chunk_bytes is not None else ""))
    kernel = ("table default" if cfg.kernel is None else
              ", ".join(f"{k}={v}" for k, v in cfg.kernel.entry().items()))
    return (f"{budget}, rows a multiple of {cfg.row_multiple}, CE kernel {kernel} "
            f"(from {source})")
