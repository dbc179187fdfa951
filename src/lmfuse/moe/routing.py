"""The MoE routing of small problems in one kernel launch: what ``ops._route``, ``ops._tiles``
and the sorted router weights compute with about twenty small torch ops (argsort, div,
searchsorted, scatter, cumsum, stack, where, index_select, ...), bit for bit.

At decode sizes (a few to a few hundred (token, slot) pairs) those ops are each a kernel
launch of a few microseconds, under a CUDA graph too, and together they cost about as much
as the expert GEMMs' copy of the selected experts' weights. ``moe_route_kernel``
(``routing_kernels.py``) does all of it in one program whose largest live tensors are the
pairs' one-hot rows over the experts, ``[ROWS, EP]`` (``ROWS``, ``EP``: powers of two
covering the pairs and the experts). :func:`route_small_ok` bounds them at ``MAX_ELEMENTS``
elements and the pairs at ``MAX_ROWS``; larger problems take :func:`route_large`, a
counting sort in three launches (count, scan, place), where the dozen torch ops' own GPU
time would show (H100, 65,536 pairs over 128 experts: 24 against about 60 us).

No host synchronisation: the outputs' shapes follow from ``T``, ``k``, ``E`` and ``block_m``
alone, so a CUDA graph captures the launches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._launch import cdiv, lazy_kernels, next_pow2

__all__ = ["MAX_ROWS", "MAX_ELEMENTS", "route_small_ok", "route_small", "route_large"]

#: The most (token, slot) pairs ``T k`` the one-program kernel takes.
MAX_ROWS = 1024
#: The most elements of the pairs' one-hot tensor ``[ROWS, EP]`` (padded sizes): at 16
#: warps, 32 registers a thread for each live copy of it.
MAX_ELEMENTS = 16384
#: The largest ``block_m``: keeps ``row + block_m`` far inside the kernel's int32.
MAX_BLOCK_M = 1 << 16

_kernels = lazy_kernels("routing_kernels", __package__)


@dataclass(frozen=True)
class _Launch:
    """The kernel's padded sizes (powers of two covering ``rows``, ``E``, ``slots``) and warps."""
    ROWS: int
    EP: int
    SLOTS: int
    warps: int


def _slots(rows: int, E: int, block_m: int) -> int:
    """The tile table's slots, as ``ops._tiles`` sizes it: enough for any routing."""
    return cdiv(rows, block_m) + min(E, rows)


def _config(rows: int, E: int, block_m: int) -> _Launch:
    """Padded sizes, and warps growing with the one-hot tensor ``[ROWS, EP]`` from 4 (up to
    4096 elements) to 16 (16384): at most 32 elements a thread for each of its live copies."""
    ROWS, EP = next_pow2(rows), next_pow2(E)
    SLOTS = next_pow2(_slots(rows, E, block_m))
    return _Launch(ROWS, EP, SLOTS, warps=min(16, max(4, ROWS * EP // 1024)))


def route_small_ok(rows: int, E: int, block_m: int) -> bool:
    """Whether :func:`route_small` takes ``rows = T k`` pairs over ``E`` experts with row
    tiles of ``block_m``: ``rows <= MAX_ROWS``, ``E >= 1``, ``1 <= block_m <= MAX_BLOCK_M``
    and ``next_pow2(rows) * next_pow2(E) <= MAX_ELEMENTS``: up to 1024 pairs over 16
    experts, 512 over 32 (GPT-OSS at 128 tokens, ``k = 4``), 128 over 128 (16 tokens at
    ``k = 8``). Host arithmetic only."""
    if not (0 <= rows <= MAX_ROWS and E >= 1 and 1 <= block_m <= MAX_BLOCK_M):
        return False
    return next_pow2(rows) * next_pow2(E) <= MAX_ELEMENTS


def route_small(expert_ids: torch.Tensor, router_weights: torch.Tensor, E: int,
                block_m: int) -> tuple[torch.Tensor, ...]:
    """The routing of ``moe_experts``' Triton path in one kernel launch.

    Args:
        expert_ids: ``[T, k]`` any integer dtype, any strides, values in ``[0, E)`` (not
            checked here: a pair outside belongs to no expert and takes one of the rows
            after the experts', so every output is still a whole permutation).
        router_weights: ``[T, k]`` any float dtype, any strides, on expert_ids' device.
        E: the number of experts; block_m: the row tiles' height (``route_small_ok(T k, E,
            block_m)`` must hold).
    Returns:
        ``(perm, token, offsets, inv, tiles, weights)``, ``rows = T k``: sorted row ``r`` is
        pair ``perm[r] = t k + j`` (int64 ``[rows]``; a stable sort by expert: one expert's
        pairs keep pair order) of token ``token[r] = t`` (int32 ``[rows]``); expert ``e``
        owns the rows ``offsets[e] .. offsets[e + 1]`` (int32 ``[E + 1]``); ``inv`` is
        ``perm``'s inverse (int64 ``[rows]``, pair -> sorted row); ``tiles [slots, 3]`` int32
        (expert, first row, end row), ``slots = cdiv(rows, block_m) + min(E, rows)``, unused
        slots ``(0, 0, 0)``; ``weights``: ``router_weights`` in sorted order, float32
        ``[rows]``. Equal to ``ops._route(expert_ids, E)``, ``ops._tiles(offsets, rows,
        block_m)`` and ``router_weights.reshape(-1)[perm].float()``, bit for bit.
    """
    T, k = expert_ids.shape
    rows = T * k
    if not route_small_ok(rows, E, block_m):
        raise ValueError(f"route_small: {rows} pairs over {E} experts with block_m {block_m} "
                         f"exceed the one-program kernel's limits (see route_small_ok)")
    dev = expert_ids.device
    perm = torch.empty(rows, dtype=torch.int64, device=dev)
    inv = torch.empty(rows, dtype=torch.int64, device=dev)
    token = torch.empty(rows, dtype=torch.int32, device=dev)
    weights = torch.empty(rows, dtype=torch.float32, device=dev)
    slots = _slots(rows, E, block_m)
    tiles = torch.empty((slots, 3), dtype=torch.int32, device=dev)
    if rows == 0:
        return perm, token, torch.zeros(E + 1, dtype=torch.int32, device=dev), inv, tiles, \
            weights
    offsets = torch.empty(E + 1, dtype=torch.int32, device=dev)
    c = _config(rows, E, block_m)
    _kernels().moe_route_kernel[(1,)](
        expert_ids, *expert_ids.stride(), router_weights, *router_weights.stride(),
        perm, token, offsets, inv, tiles, weights, rows, k, E, slots, block_m,
        ROWS=c.ROWS, EP=c.EP, SLOTS=c.SLOTS, num_warps=c.warps)
    return perm, token, offsets, inv, tiles, weights


#: The pairs a block of the three-launch routing sorts in registers.
LARGE_BLOCK = 1024
#: Elements of ``[CHUNK, EP]`` count tiles ``moe_base_kernel`` scans at a time.
_BASE_ELEMENTS = 8192


def route_large(expert_ids: torch.Tensor, router_weights: torch.Tensor,
                E: int) -> tuple[torch.Tensor, ...]:
    """:func:`route_small`'s ``(perm, token, offsets, inv, weights)`` (no tile table) for any
    number of pairs, in three launches (a counting sort over blocks of ``LARGE_BLOCK``
    pairs: count, scan, place; see ``routing_kernels.py``) instead of about a dozen torch
    ops. Equal to ``ops._route(expert_ids, E)`` and the router weights in sorted order,
    bit for bit; no host synchronisation. ``E`` below ``2^15``."""
    T, k = expert_ids.shape
    rows = T * k
    if not 1 <= E < 2**15:
        raise ValueError(f"route_large: E must be in [1, 2^15), got {E}")
    dev = expert_ids.device
    perm = torch.empty(rows, dtype=torch.int64, device=dev)
    inv = torch.empty(rows, dtype=torch.int64, device=dev)
    token = torch.empty(rows, dtype=torch.int32, device=dev)
    weights = torch.empty(rows, dtype=torch.float32, device=dev)
    if rows == 0:
        return perm, token, torch.zeros(E + 1, dtype=torch.int32, device=dev), inv, weights
    offsets = torch.empty(E + 1, dtype=torch.int32, device=dev)  # moe_base_kernel fills it
    EP = next_pow2(E + 1)
    blocks = cdiv(rows, LARGE_BLOCK)
    counts = torch.empty((blocks, EP), dtype=torch.int32, device=dev)
    delta = torch.empty_like(counts)
    kern, ids_st, rw_st = _kernels(), expert_ids.stride(), router_weights.stride()
    kern.moe_count_kernel[(blocks,)](expert_ids, *ids_st, counts, rows, k, E, EP=EP,
                                     BLOCK=LARGE_BLOCK, num_warps=4)
    chunk = min(next_pow2(blocks), max(1, _BASE_ELEMENTS // EP))
    kern.moe_base_kernel[(1,)](counts, delta, offsets, blocks, E, EP=EP, CHUNK=chunk,
                               num_warps=8)
    kern.moe_place_kernel[(blocks,)](
        expert_ids, *ids_st, router_weights, *rw_st, delta, perm, token, inv, weights, rows,
        k, E, EP=EP, BLOCK=LARGE_BLOCK, LOG_BLOCK=LARGE_BLOCK.bit_length() - 1, num_warps=4)
    return perm, token, offsets, inv, weights
