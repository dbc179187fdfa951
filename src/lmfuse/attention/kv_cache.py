"""A paged KV cache: a pool of fixed-size blocks shared by all layers, per-sequence block
tables, reference-counted blocks with copy-on-write after :meth:`PagedKVCache.fork`.

All bookkeeping (free list, refcounts, tables, lengths) lives on the host in plain Python
ints and lists, so managing sequences never synchronises with the GPU. Each decode step is:

    step = cache.reserve(seq_ids, 1)                 # room for 1 token each, all-or-nothing
    for layer in range(num_layers):
        cache.append(seq_ids, k_new, v_new, layer=layer, step=step)   # [n, 1, Hkv, D]
        out = cache.attention(q, step, layer=layer)                   # [n, 1, Hq, D]

``step`` holds the device tensors the kernels read (``block_table``, the lengths before and
after the reservation), built on the CPU and moved in one non-blocking transfer.
"""

from __future__ import annotations

import array
import numbers
from typing import Any, NamedTuple, Optional, Sequence, Union

import torch

from .._dispatch import check_int, check_tensor
from .._launch import FLOAT_DTYPES, FP8_DTYPES, KERNEL_DTYPES, cdiv, dtype_name
from .ops import decode_attention, kv_cache_append

_DTYPES = KERNEL_DTYPES + FP8_DTYPES
_OP = "PagedKVCache"

Scales = Union[torch.Tensor, Sequence[torch.Tensor], None]


class KVCacheFullError(RuntimeError):
    """The block pool cannot hold what :meth:`PagedKVCache.reserve` asked for (nothing was
    changed)."""


class DecodeStep(NamedTuple):
    """What one :meth:`PagedKVCache.reserve` made room for, for ``n`` sequences.

    The tensors are on the cache's device (views of pinned host memory where
    :meth:`PagedKVCache.reserve` was given such an ``out``); ``seq_ids`` and ``num_tokens``
    are host values.
    A step stays valid until one of its sequences is reserved again, truncated, forked or
    freed (:meth:`PagedKVCache.append` and :meth:`PagedKVCache.attention` then refuse it).
    """

    block_table: torch.Tensor  # [n, max_blocks] int32, padded with -1
    seqlens_before: torch.Tensor  # [n] int32: where the new tokens go (kv_cache_append)
    seqlens: torch.Tensor  # [n] int32: lengths with the new tokens (decode_attention)
    seq_ids: tuple[int, ...] = ()
    num_tokens: tuple[int, ...] = ()  # tokens reserved per sequence
    # each sequence's change count when the step was made (append and attention refuse a
    # step a later reserve, truncate, fork or free has made stale)
    epochs: tuple[int, ...] = ()


class PagedKVCache:
    """A block pool ``[num_blocks, block_len, kv_heads, head_dim]`` per layer for K and V, and
    the block tables of the sequences that live in it.

    Args:
        num_blocks: blocks in the pool (every layer has the same blocks: one block id holds
            the same tokens in every layer).
        block_len: tokens per block.
        kv_heads, head_dim: ``Hkv`` and ``D`` of the cached keys and values.
        dtype: float32, float16, bfloat16 or float8_e4m3fn (stored = value / scale).
        device: where the pool lives (default: torch's default device).
        num_layers: number of per-layer ``K``/``V`` pools.
        k_scale, v_scale: fp8 caches only: ``[kv_heads]`` positive dequantisation scales
            (value = stored * scale), one tensor for all layers or a list with one per
            layer; default ones (a tensor of its own for each layer, K and V).

    Attributes:
        k_caches, v_caches: ``num_layers`` tensors ``[num_blocks, block_len, kv_heads,
            head_dim]`` (zeros at first).
        k_scales, v_scales: per layer ``[kv_heads]`` float tensors (fp8), or ``None``.

    Sequences are ints from :meth:`add_sequence` (or :meth:`fork`); unknown ids raise
    ``ValueError``. :meth:`append` and :meth:`attention` check the step's values as
    :func:`lmfuse.kv_cache_append` and :func:`lmfuse.decode_attention` do (on CPU tensors
    always, on CUDA ones with ``lmfuse.set_checks(True)``) and raise their errors. Blocks
    are reference-counted: a forked sequence shares its parent's blocks until one of them
    writes into a shared, partially filled last block, which is then copied first
    (copy-on-write); full blocks stay shared.
    """

    def __init__(self, num_blocks: int, block_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16, device: Any = None, *,
                 num_layers: int = 1, k_scale: Scales = None, v_scale: Scales = None) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_len", block_len),
                            ("kv_heads", kv_heads), ("head_dim", head_dim),
                            ("num_layers", num_layers)):
            check_int(_OP, name, value, minimum=1)
        if not isinstance(dtype, torch.dtype) or dtype not in _DTYPES:
            names = ", ".join(dtype_name(d) for d in _DTYPES)
            raise TypeError(f"{_OP}: dtype must be one of ({names}), got {dtype!r}")
        if device is None:
            device = torch.get_default_device()
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"{_OP}: device must be a torch.device, a device string or "
                             f"index, got {device!r} ({e})") from None
        self.num_blocks, self.block_len = num_blocks, block_len
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.dtype, self.device, self.num_layers = dtype, device, num_layers
        shape = (num_blocks, block_len, kv_heads, head_dim)
        self.k_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.k_scales = self._scales("k_scale", k_scale)
        self.v_scales = self._scales("v_scale", v_scale)
        # A stack: the lowest ids are handed out first from a fresh pool.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refs: list[int] = [0] * num_blocks
        # Each sequence's block ids as an int32 array: a step's table is packed from them
        # by memcpy (array.extend of an array), not element by element.
        self._tables: dict[int, array.array] = {}
        self._lens: dict[int, int] = {}
        self._epochs: dict[int, int] = {}  # per sequence: changes so far (DecodeStep.epochs)
        self._next_id = 0

    def _scales(self, name: str, scale: Scales) -> list[Optional[torch.Tensor]]:
        if self.dtype != torch.float8_e4m3fn:
            if scale is not None:
                raise ValueError(f"{_OP}: {name} applies to float8_e4m3fn caches only; this "
                                 f"cache is {dtype_name(self.dtype)}")
            return [None] * self.num_layers
        if scale is None:  # one tensor a layer (a caller may calibrate them in place)
            return [torch.ones(self.kv_heads, dtype=torch.float32, device=self.device)
                    for _ in range(self.num_layers)]
        if isinstance(scale, torch.Tensor):
            scale = [scale] * self.num_layers
        elif not isinstance(scale, (list, tuple)) or len(scale) != self.num_layers:
            raise TypeError(f"{_OP}: {name} must be a [kv_heads={self.kv_heads}] tensor or a "
                            f"list of num_layers={self.num_layers} of them, got "
                            f"{type(scale).__name__}"
                            + (f" of {len(scale)}" if isinstance(scale, (list, tuple)) else ""))
        out = []
        for i, s in enumerate(scale):
            check_tensor(_OP, f"{name}[{i}]", s, ndim=1, dtypes=FLOAT_DTYPES)
            if s.shape[0] != self.kv_heads:
                raise ValueError(f"{_OP}: {name}[{i}] must be [kv_heads={self.kv_heads}] "
                                 f"(one scale per KV head), got {tuple(s.shape)}")
            # Checked once here, never in the hot path.
            if not bool(torch.isfinite(s).all() & (s > 0).all()):
                raise ValueError(f"{_OP}: {name}[{i}] must be finite and > 0, got "
                                 f"{s.tolist()}")
            out.append(s.to(self.device))
        return out

    # --- state --------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any sequence."""
        return len(self._free)

    @property
    def sequences(self) -> list[int]:
        """Ids of the live sequences, in creation order."""
        return list(self._lens)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._lens

    def __len__(self) -> int:
        return len(self._lens)

    def __repr__(self) -> str:
        return (f"PagedKVCache(num_blocks={self.num_blocks}, block_len={self.block_len}, "
                f"kv_heads={self.kv_heads}, head_dim={self.head_dim}, "
                f"dtype={self.dtype}, device={self.device}, num_layers={self.num_layers}; "
                f"{len(self)} sequences, {self.num_free_blocks} blocks free)")

    def k_cache(self, layer: int = 0) -> torch.Tensor:
        """Layer ``layer``'s key pool ``[num_blocks, block_len, kv_heads, head_dim]``."""
        return self.k_caches[self._layer("k_cache", layer)]

    def v_cache(self, layer: int = 0) -> torch.Tensor:
        """Layer ``layer``'s value pool ``[num_blocks, block_len, kv_heads, head_dim]``."""
        return self.v_caches[self._layer("v_cache", layer)]

    def seqlen(self, seq_id: int) -> int:
        """Tokens held by sequence ``seq_id``."""
        return self._lens[self._known("seqlen", seq_id)]

    def block_ids(self, seq_id: int) -> list[int]:
        """The block ids of sequence ``seq_id``, in token order (a copy)."""
        return list(self._tables[self._known("block_ids", seq_id)])

    def _layer(self, op: str, layer: int) -> int:
        check_int(f"{_OP}.{op}", "layer", layer, minimum=0)
        if layer >= self.num_layers:
            raise ValueError(f"{_OP}.{op}: layer must be < num_layers={self.num_layers}, got "
                             f"{layer}")
        return layer

    def _known(self, op: str, seq_id: int) -> int:
        if isinstance(seq_id, bool) or not isinstance(seq_id, numbers.Integral):
            raise TypeError(f"{_OP}.{op}: a sequence id must be an int, got "
                            f"{type(seq_id).__name__} {seq_id!r}")
        seq_id = int(seq_id)  # (a NumPy integer too)
        if seq_id not in self._lens:
            ids = list(self._lens)
            live = str(ids) if len(ids) <= 16 else f"{str(ids[:16])[:-1]}, ...] ({len(ids)} in all)"
            raise ValueError(f"{_OP}.{op}: unknown sequence id {seq_id} (live ids: {live})")
        return seq_id

    def _ids(self, op: str, seq_ids: Union[int, Sequence[int]]) -> list[int]:
        if isinstance(seq_ids, numbers.Integral) and not isinstance(seq_ids, bool):
            seq_ids = [seq_ids]
        if not isinstance(seq_ids, (list, tuple, range)):
            raise TypeError(f"{_OP}.{op}: seq_ids must be a list of sequence ids, got "
                            f"{type(seq_ids).__name__}")
        ids = [self._known(op, s) for s in seq_ids]
        if len(set(ids)) != len(ids):
            raise ValueError(f"{_OP}.{op}: seq_ids must be distinct, got {ids}")
        return ids

    # --- sequences ----------------------------------------------------------------------

    def add_sequence(self) -> int:
        """A new, empty sequence (no block is allocated until :meth:`reserve`); its id."""
        seq_id = self._next_id
        self._next_id += 1
        self._tables[seq_id] = array.array("i")
        self._lens[seq_id] = 0
        self._epochs[seq_id] = 0
        return seq_id

    def fork(self, seq_id: int) -> int:
        """A new sequence with ``seq_id``'s tokens, sharing all its blocks (no allocation and
        no copy now: a shared partial last block is copied when either one appends)."""
        table = self._tables[self._known("fork", seq_id)]
        for blk in table:
            self._refs[blk] += 1
        child = self.add_sequence()
        self._tables[child] = array.array("i", table)
        self._lens[child] = self._lens[seq_id]
        # A step reserved before now would write the parent's new tokens into a block the
        # child shares (and counts): it is stale.
        self._epochs[seq_id] += 1
        return child

    def free(self, seq_id: int) -> None:
        """Drop sequence ``seq_id``: its blocks go back to the pool unless another sequence
        still shares them; the id becomes unknown."""
        self._release(self._tables.pop(self._known("free", seq_id)))
        del self._lens[seq_id]
        del self._epochs[seq_id]

    def truncate(self, seq_id: int, length: int) -> None:
        """Shrink sequence ``seq_id`` to its first ``length`` tokens (e.g. rejected
        speculative tokens), releasing the blocks it no longer needs."""
        self._known("truncate", seq_id)
        check_int(f"{_OP}.truncate", "length", length, minimum=0)
        if length > self._lens[seq_id]:
            raise ValueError(f"{_OP}.truncate: length must be <= the sequence's "
                             f"{self._lens[seq_id]} tokens, got {length}")
        table = self._tables[seq_id]
        keep = cdiv(length, self.block_len)
        self._release(table[keep:])
        del table[keep:]
        self._lens[seq_id] = length
        self._epochs[seq_id] += 1

    def _release(self, blocks: list[int]) -> None:
        for blk in blocks:
            self._refs[blk] -= 1
            if self._refs[blk] == 0:
                self._free.append(blk)

    # --- steps --------------------------------------------------------------------------

    def reserve(self, seq_ids: Union[int, Sequence[int]],
                num_tokens: Union[int, Sequence[int]] = 1, *,
                max_blocks: Optional[int] = None,
                out: Optional[torch.Tensor] = None) -> DecodeStep:
        """Make room for ``num_tokens`` more tokens in each of ``seq_ids``, all or nothing.

        Args:
            seq_ids: ``n`` distinct live sequence ids (the batch rows, in this order).
            num_tokens: tokens to add, one int for all or a list of ``n``.
            max_blocks: pad ``block_table`` to this many columns (fixed shapes, e.g. for
                CUDA graphs); default: the most blocks any listed sequence holds.
            out: a contiguous int32 vector of ``n * (max_blocks + 2)`` elements on the
                cache's device that receives the step (``block_table``, ``seqlens_before``
                and ``seqlens`` one after the other, as views of it): a CUDA graph's input
                buffer, which the step's one copy then fills directly. For a CUDA cache it
                may be pinned host memory instead, written on the host (no copy: the
                step's tensors are then views of it, for the caller to bring over).
        Returns:
            A :class:`DecodeStep`: ``block_table [n, max_blocks]``, ``seqlens_before [n]``
            and ``seqlens [n]`` (int32, on the cache's device, or views of a pinned
            ``out``).
        Raises:
            KVCacheFullError: if the blocks needed (new ones plus copy-on-write copies of
                shared partial blocks) exceed the free ones; nothing is changed then.
        """
        op = "reserve"
        ids, counts = self._check_room(op, seq_ids, num_tokens)
        widest = max((cdiv(self._lens[s] + n, self.block_len) for s, n in zip(ids, counts)),
                     default=0)
        width = self._width(op, max_blocks, widest)
        if out is not None and not (
                isinstance(out, torch.Tensor) and out.dtype == torch.int32
                and (out.device == self.device or (self.device.type == "cuda"
                                                   and out.device.type == "cpu"
                                                   and out.is_pinned()))
                and out.dim() == 1 and out.is_contiguous()
                and out.numel() == len(ids) * (width + 2)):
            got = (f"{out.dtype} {tuple(out.shape)} on {out.device}"
                   if isinstance(out, torch.Tensor) else type(out).__name__)
            where = f"{self.device}" + (" or pinned host memory" if self.device.type == "cuda"
                                        else "")
            raise ValueError(f"{_OP}.{op}: out must be a contiguous int32 vector of n * "
                             f"(width + 2) = {len(ids) * (width + 2)} elements on {where}, "
                             f"got {got}")
        before = [self._lens[s] for s in ids]
        self._grow(ids, counts)
        return self._step(ids, width, before, tuple(counts), out)

    def extend(self, seq_ids: Union[int, Sequence[int]],
               num_tokens: Union[int, Sequence[int]] = 1) -> None:
        """:meth:`reserve` without its :class:`DecodeStep`: the blocks only (host
        bookkeeping, no device copy), for callers that build their step's inputs
        themselves (read them back with :meth:`block_ids` and :meth:`seqlen`)."""
        self._grow(*self._check_room("extend", seq_ids, num_tokens))

    def _check_room(self, op: str, seq_ids: Union[int, Sequence[int]],
                    num_tokens: Union[int, Sequence[int]]) -> tuple[list[int], list[int]]:
        """The checked ``(ids, counts)`` of a reservation the pool has room for."""
        ids = self._ids(op, seq_ids)
        counts = self._counts(op, num_tokens, len(ids))
        grow, copies = self._needed(ids, counts)
        if grow + copies > len(self._free):
            raise KVCacheFullError(
                f"{_OP}.{op}: {grow + copies} blocks needed ({grow} new, {copies} "
                f"copy-on-write) for {sum(counts)} tokens in {len(ids)} sequences, but only "
                f"{len(self._free)} of {self.num_blocks} are free; nothing was reserved")
        return ids, counts

    def _grow(self, ids: list[int], counts: list[int]) -> None:
        """Add the blocks (and copy-on-write copies) ``counts`` more tokens need; the room
        was checked."""
        src, dst = [], []
        for s, n in zip(ids, counts):
            table, length = self._tables[s], self._lens[s]
            self._epochs[s] += 1
            if n == 0:
                continue
            if length % self.block_len and self._refs[table[-1]] > 1:
                new = self._free.pop()
                self._refs[table[-1]] -= 1
                self._refs[new] = 1
                src.append(table[-1])
                dst.append(new)
                table[-1] = new
            for _ in range(cdiv(length + n, self.block_len) - len(table)):
                new = self._free.pop()
                self._refs[new] = 1
                table.append(new)
            self._lens[s] = length + n
        if src:
            self._copy_blocks(src, dst)

    def blocks_needed(self, seq_ids: Union[int, Sequence[int]],
                      num_tokens: Union[int, Sequence[int]] = 1) -> int:
        """The free blocks :meth:`reserve` would take for these arguments (new blocks and
        copy-on-write copies); nothing is reserved."""
        ids = self._ids("blocks_needed", seq_ids)
        grow, copies = self._needed(ids, self._counts("blocks_needed", num_tokens, len(ids)))
        return grow + copies

    def _needed(self, ids: list[int], counts: list[int]) -> tuple[int, int]:
        """(new blocks, copy-on-write copies) for ``counts`` more tokens in ``ids``. A shared
        partial block is copied only while someone else still holds it (two forks
        reserving together copy once)."""
        grow, copies, pending = 0, 0, {}
        for s, n in zip(ids, counts):
            table, length = self._tables[s], self._lens[s]
            if n == 0:
                continue
            grow += cdiv(length + n, self.block_len) - len(table)
            if length % self.block_len:
                last = table[-1]
                if self._refs[last] - pending.get(last, 0) > 1:
                    copies += 1
                    pending[last] = pending.get(last, 0) + 1
        return grow, copies

    def block_table(self, seq_ids: Union[int, Sequence[int]], *,
                    max_blocks: Optional[int] = None) -> torch.Tensor:
        """The current ``block_table [n, max_blocks]`` int32 of ``seq_ids`` (padded with -1),
        on the cache's device."""
        ids = self._ids("block_table", seq_ids)
        width = self._width("block_table", max_blocks,
                            max((len(self._tables[s]) for s in ids), default=0))
        return self._step(ids, width, [self._lens[s] for s in ids], ()).block_table

    def seqlens(self, seq_ids: Union[int, Sequence[int]]) -> torch.Tensor:
        """The current lengths ``[n]`` int32 of ``seq_ids``, on the cache's device."""
        ids = self._ids("seqlens", seq_ids)
        lens = torch.tensor([self._lens[s] for s in ids], dtype=torch.int32)
        return lens.to(self.device, non_blocking=True)

    def _counts(self, op: str, num_tokens: Union[int, Sequence[int]], n: int) -> list[int]:
        if isinstance(num_tokens, (list, tuple)):
            if len(num_tokens) != n:
                raise ValueError(f"{_OP}.{op}: num_tokens must be one int or a list of one per "
                                 f"sequence ({n}), got a list of {len(num_tokens)}")
            return [check_int(f"{_OP}.{op}", "num_tokens", t, minimum=0) for t in num_tokens]
        return [check_int(f"{_OP}.{op}", "num_tokens", num_tokens, minimum=0)] * n

    def _width(self, op: str, max_blocks: Optional[int], widest: int) -> int:
        if max_blocks is None:
            return widest
        check_int(f"{_OP}.{op}", "max_blocks", max_blocks, minimum=0)
        if max_blocks < widest:
            raise ValueError(f"{_OP}.{op}: max_blocks={max_blocks} is less than the {widest} "
                             f"blocks a listed sequence holds")
        return max_blocks

    def _step(self, ids: list[int], width: int, before: list[int],
              counts: tuple[int, ...], out: Optional[torch.Tensor] = None) -> DecodeStep:
        n = len(ids)
        # One buffer (table | before | after), one host-to-device copy, three contiguous views.
        # array.array fills it at C speed (torch.tensor(list) is ~3x slower for long tables).
        buf, pad = array.array("i"), array.array("i", [-1]) * width
        for s in ids:
            table = self._tables[s]
            buf.extend(table)
            buf.extend(pad[len(table):])
        buf.extend(before)
        buf.extend(self._lens[s] for s in ids)
        packed = (torch.frombuffer(buf, dtype=torch.int32) if buf
                  else torch.empty(0, dtype=torch.int32))
        if out is not None and out.device.type != self.device.type:  # pinned host memory
            packed = out.copy_(packed)
        else:
            if self.device.type == "cuda":  # from pinned memory the copy does not wait
                packed = packed.pin_memory()
            packed = (out.copy_(packed, non_blocking=True) if out is not None
                      else packed.to(self.device, non_blocking=True))
        table = packed[:n * width].view(n, width)
        return DecodeStep(table, packed[n * width:n * width + n], packed[n * width + n:],
                          tuple(ids), counts, tuple(self._epochs[s] for s in ids))

    def _copy_blocks(self, src: list[int], dst: list[int]) -> None:
        if len(src) == 1:
            for cache in self.k_caches + self.v_caches:
                cache[dst[0]].copy_(cache[src[0]])
            return
        index = torch.tensor(src + dst, dtype=torch.int64).to(self.device, non_blocking=True)
        src_t, dst_t = index[:len(src)], index[len(src):]
        for cache in self.k_caches + self.v_caches:
            raw = cache.view(torch.uint8)  # bit copies; index_copy_ has no fp8 kernel on CPU
            raw.index_copy_(0, dst_t, raw.index_select(0, src_t))

    # --- kernels ------------------------------------------------------------------------

    def _check_step(self, op: str, step: DecodeStep) -> None:
        """``step`` is a :class:`DecodeStep` of this cache's current state: each of its
        sequences live and not reserved again, truncated, forked or freed since."""
        if not isinstance(step, DecodeStep):
            raise TypeError(f"{_OP}.{op}: step must be the DecodeStep from reserve(), got "
                            f"{type(step).__name__}")
        for s, epoch in zip(step.seq_ids, step.epochs):
            if self._epochs.get(s) != epoch:
                what = "freed" if s not in self._epochs else (
                    "reserved again, truncated or forked")
                raise ValueError(f"{_OP}.{op}: the step is stale: sequence {s} was {what} "
                                 "after reserve() made it; reserve a new step")

    def append(self, seq_ids: Union[int, Sequence[int]], k_new: torch.Tensor,
               v_new: torch.Tensor, *, layer: int = 0, step: DecodeStep,
               impl: str = "auto") -> None:
        """Write ``k_new``/``v_new [n, s_new, kv_heads, head_dim]`` (the cache's dtype, or a
        float dtype quantised into an fp8 cache) into layer ``layer`` at the positions
        ``step`` reserved, through :func:`lmfuse.kv_cache_append`. ``seq_ids`` must be the
        step's, and ``s_new`` the tokens it reserved for each sequence (one count for all:
        a reserved row left unwritten would be read as a token). A stale step (one of its
        sequences reserved again, truncated, forked or freed since) is refused."""
        op = "append"
        layer = self._layer(op, layer)
        self._check_step(op, step)
        ids = ([int(seq_ids)] if isinstance(seq_ids, numbers.Integral)
               and not isinstance(seq_ids, bool) else list(seq_ids))
        if tuple(ids) != step.seq_ids:
            raise ValueError(f"{_OP}.{op}: seq_ids {ids} are not the step's {list(step.seq_ids)}")
        check_tensor(f"{_OP}.{op}", "k_new", k_new, ndim=4, dtypes=None)
        s_new = k_new.shape[1]
        if k_new.shape[0] != len(ids):
            raise ValueError(f"{_OP}.{op}: k_new must be [n={len(ids)}, s_new, "
                             f"{self.kv_heads}, {self.head_dim}], got {tuple(k_new.shape)}")
        if step.num_tokens and any(n != s_new for n in step.num_tokens):
            # Rows past a sequence's reservation could land in a block shared with a fork;
            # reserved rows left unwritten would be read by attention as the step's tokens.
            raise ValueError(f"{_OP}.{op}: k_new has {s_new} new tokens per sequence but the "
                             f"step reserved {list(step.num_tokens)}; append exactly what "
                             "was reserved (one step per token count)")
        kv_cache_append(self.k_caches[layer], self.v_caches[layer], k_new, v_new,
                        step.seqlens_before, block_table=step.block_table,
                        k_scale=self.k_scales[layer], v_scale=self.v_scales[layer], impl=impl)

    def attention(self, q: torch.Tensor, step: DecodeStep, *, layer: int = 0,
                  **kwargs: Any):
        """:func:`lmfuse.decode_attention` of ``q [n, s_active, Hq, head_dim]`` over layer
        ``layer`` of the step's sequences (their last ``s_active`` tokens are the queries').
        ``kwargs`` go to ``decode_attention`` (``scale``, ``window_size``, ``sinks``,
        ``return_lse``, ``num_splits``, ``impl``). Returns ``out [n, s_active, Hq,
        head_dim]`` (and ``lse`` with ``return_lse=True``)."""
        op = "attention"
        layer = self._layer(op, layer)
        self._check_step(op, step)
        taken = sorted(set(kwargs) & {"block_table", "k_scale", "v_scale", "cache_seqlens"})
        if taken:
            raise TypeError(f"{_OP}.{op}: {taken} come from the cache and the step; do not "
                            f"pass them")
        return decode_attention(q, self.k_caches[layer], self.v_caches[layer], step.seqlens,
                                block_table=step.block_table, k_scale=self.k_scales[layer],
                                v_scale=self.v_scales[layer], **kwargs)
