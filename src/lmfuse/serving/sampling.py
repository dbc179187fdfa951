"""Choosing each request's next token from its logits: greedy, or temperature / top-k /
top-p sampling with per-request, counter-based randomness.

A sampled request's draw for its ``i``-th new token is the Gumbel-max of its filtered
logits with noise that is a hash of ``(seed, i, token id)``: no generator state, so the
tokens do not depend on which other requests share the batch, on their order, or on a
preemption and recomputation in between; the same seed gives the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import _pdl
from .._dispatch import triton_available
from .._launch import cdiv, lazy_kernels, next_pow2
from .request import SamplingParams

_M32 = 0xFFFFFFFF
_kernels = lazy_kernels("kernels", __package__)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x < 2**32`` without any int64 overflow: the product
    in 16-bit halves of ``c``."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser: every input bit affects every output bit."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[n, vocab]`` float64 in (0, 1): a hash of each row's ``(seed, counter)`` and the
    column index.

    Each row's key is 64 bits, two 32-bit lanes, and for a given counter a bijection of
    the seed's 64 bits (each lane an invertible mix of one seed half, the second also of
    the first lane): two seeds never share a draw's noise, and the streams of two
    (seed, counter) pairs coincide only by a 64-bit collision. (A 32-bit key made
    distinct seeds draw alike: 2**32 streams for 2**63 seeds.) Each column's value mixes
    both lanes and its index."""
    idx = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    s_lo, s_hi = seeds & _M32, (seeds >> 32) & _M32
    c = counters & _M32
    k_lo = _fmix32(s_lo ^ _fmix32(_mul32(c, 0x27D4EB2F) ^ 0x9E3779B9))
    k_hi = _fmix32(s_hi ^ _fmix32(_mul32(c, 0x165667B1) ^ 0x85EBCA77) ^ k_lo)
    x = _fmix32(((k_lo[:, None] + _mul32(idx, 0x165667B1)[None, :]) & _M32)
                ^ (k_hi ^ 0x5BD1E995)[:, None])
    return (x.double() + 0.5) / 4294967296.0


_TINY = torch.finfo(torch.float32).tiny


def filtered_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``logits [n, V]`` (float32) divided by each row's temperature, with the tokens outside
    its top-k and top-p sets at ``-inf`` (the highest token always stays)."""
    n, V = logits.shape
    # Each row less its maximum first (the draw does not change), so a tiny temperature
    # sends the others towards -inf instead of the top ones to +inf (a tie of infinities
    # the lowest id won); one that rounds to 0 in float32 is the smallest normal float32
    # (not 0 / 0 = NaN at the maximum). A row holding NaN is not shifted (its NaN stays
    # the one drawn, as greedy's).
    top = logits.amax(-1, keepdim=True)
    top = top.masked_fill(top.isnan(), 0.0)
    temps = torch.tensor([max(p.temperature, _TINY) for p in params], dtype=torch.float32)
    x = (logits - top).div_(temps.to(logits.device)[:, None])
    ks = [min(p.top_k, V) if p.top_k is not None else None for p in params]
    if any(k is not None for k in ks):
        kmax = max(k for k in ks if k is not None)
        top = torch.topk(x, kmax, dim=-1).values
        kth = torch.tensor([(k if k is not None else kmax) - 1 for k in ks], device=x.device)
        threshold = top.gather(1, kth[:, None])
        limited = torch.tensor([k is not None for k in ks], device=x.device)[:, None]
        x = torch.where(limited & (x < threshold), float("-inf"), x)
    ps = [p.top_p for p in params]
    if any(p is not None and p < 1.0 for p in ps):
        # transformers' TopPLogitsWarper step by step: ascending order, a token dropped
        # while the mass up to it is at most 1 - p, the highest kept; so among tied logits
        # at the cut the same ids stay (the highest ids, the ascending sort's last).
        order = torch.sort(x, dim=-1)
        mass = torch.softmax(order.values, dim=-1).cumsum(dim=-1)
        rest = torch.tensor([1.0 - p if p is not None else -1.0 for p in ps],
                            dtype=torch.float32, device=x.device)
        drop = mass <= rest[:, None]
        drop[:, -1] = False
        x = x.scatter(1, order.indices, torch.where(drop, float("-inf"), order.values))
    return x


def greedy(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``argmax(logits, -1)`` (the first of equal maxima; NaN counts as the largest), in
    ``out`` (int64 ``[n]``) where given. On CUDA two Triton launches (:func:`argmax_rows`):
    one row's argmax alone keeps a few SMs busy (36 us for a 128256-token vocabulary at
    batch 1 on an H100)."""
    if logits.is_cuda and triton_available() and logits.shape[1] > 0:
        return argmax_rows(logits, out=out)
    return torch.argmax(logits, dim=-1, out=out)


def argmax_rows(logits: torch.Tensor, block: int = 1024,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``argmax(logits, -1)`` of ``[n, V]`` (``V >= 1``, unit column stride) as int64
    ``[n]`` (in ``out`` where given), by Triton: the rows cut into chunks that about a
    thousand programs reduce side by side (each chunk's first maximum, NaN above
    everything), then one program a row takes the first chunk holding the row's best.
    Exactly ``torch.argmax``, ties and NaN included."""
    n, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if out is None:
        out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    want = max(1, min(256, cdiv(1024, n)))  # chunks a row
    chunk = cdiv(cdiv(V, want), block) * block
    chunks = cdiv(V, chunk)
    val = torch.empty((n, chunks), dtype=torch.float32, device=logits.device)
    idx = torch.empty((n, chunks), dtype=torch.int32, device=logits.device)
    _kernels().argmax_chunk_kernel[(n, chunks)](logits, val, idx, V, logits.stride(0), chunk,
                                                chunks, BLOCK=block, num_warps=4)
    return merge_argmax(val, idx, V, out)


def merge_argmax(val: torch.Tensor, idx: torch.Tensor, V: int,
                 out: torch.Tensor | None = None, pdl: int = 0) -> torch.Tensor:
    """Each row's argmax (int64 ``[n]``) from its chunks' first maxima ``val [n, chunks]``
    float32 and their columns ``idx`` int32, chunks in column order (NaN above everything):
    the second half of :func:`argmax_rows`, also what the decode step's LM-head GEMV leaves
    (``_gemv(..., argmax=True)``; ``pdl``: launched with programmatic dependent launch,
    ``lmfuse._pdl``)."""
    n, chunks = val.shape
    if out is None:
        out = torch.empty(n, dtype=torch.int64, device=val.device)
    elif out.shape != (n,) or out.dtype != torch.int64 or out.stride(0) != 1:
        raise ValueError(f"merge_argmax: out must be a contiguous int64 [{n}], got "
                         f"{out.dtype} {tuple(out.shape)} of strides {out.stride()}")
    if n:
        _kernels().argmax_merge_kernel[(n,)](val, idx, out, chunks, V,
                                             BLOCK_C=next_pow2(chunks, 2), PDL=pdl,
                                             num_warps=1, **_pdl.launch_options(pdl))
    return out


def penalized(logits: torch.Tensor, params: Sequence[SamplingParams],
              histories: Sequence[Sequence[int] | None] | None) -> torch.Tensor:
    """``logits`` with each row's repetition penalty applied (Hugging Face's
    ``RepetitionPenaltyLogitsProcessor``, in float32 as its ``generate`` does): the logits
    of the tokens in ``histories[i]`` (the prompt and the output so far) divided by row
    ``i``'s penalty where positive, multiplied where negative, every penalised row in one
    gather and one scatter. ``logits`` itself where no row has a penalty."""
    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if not rows:
        return logits
    if histories is None or any(histories[i] is None for i in rows):
        raise ValueError("sample: a repetition penalty needs the requests' token histories")
    seen_ids = [sorted(set(histories[i])) for i in rows]
    r = torch.tensor([i for i, ids in zip(rows, seen_ids) for _ in ids], device=logits.device)
    c = torch.tensor([t for ids in seen_ids for t in ids], dtype=torch.int64,
                     device=logits.device)
    pen = torch.tensor([params[i].repetition_penalty for i, ids in zip(rows, seen_ids)
                        for _ in ids], dtype=torch.float32, device=logits.device)
    x = logits.to(torch.float32, copy=True)
    seen = x[r, c]
    x[r, c] = torch.where(seen < 0, seen * pen, seen / pen)
    return x


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           counters: Sequence[int],
           histories: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """The next token of each row of ``logits [n, V]``: ``[n]`` int64 on logits' device.

    ``params[i]`` is row ``i``'s request's options, ``counters[i]`` how many tokens it
    has generated so far (the index of this draw) and ``histories[i]`` its tokens so far
    (prompt and output; needed only where a row has a repetition penalty)."""
    n, V = logits.shape
    logits = penalized(logits, params, histories)
    out = greedy(logits)  # exact in any float dtype: no widened copy
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    logits = logits.float()
    index = torch.tensor(rows, device=logits.device)
    chosen = [params[i] for i in rows]
    x = filtered_logits(logits.index_select(0, index), chosen)
    seeds = torch.tensor([p.seed for p in chosen], dtype=torch.int64, device=logits.device)
    steps = torch.tensor([counters[i] for i in rows], dtype=torch.int64, device=logits.device)
    u = uniform_noise(seeds, steps, V)
    gumbel = (-torch.log(-torch.log(u))).float()
    drawn = torch.argmax(x + gumbel, dim=-1)
    return out.index_copy(0, index, drawn)
