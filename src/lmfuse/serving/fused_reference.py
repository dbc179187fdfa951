"""The references of the Generator's fused decode launches (``fused_ops.py``): float32
math, one rounding per stored value; the CPU path's formulas and the kernels' test oracles.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..attention.reference import kv_cache_append_reference


def rope_append_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          pos: torch.Tensor, table: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, q_norm: torch.Tensor | None,
                          k_norm: torch.Tensor | None, eps: float, k_scale: Any, v_scale: Any,
                          hq: int, hkv: int, d: int) -> torch.Tensor:
    """The reference of ``rope_append_kernel``: ``qkv [n, (hq + 2 hkv) d]`` -> the rotated
    queries ``[n, hq, d]`` in qkv's dtype; the rotated keys and the values written at
    position ``pos[b]`` of row ``b``'s blocks (``table``; a row whose block there is -1
    writes nothing). Float32 math, one rounding per stored value."""
    n = qkv.shape[0]
    x = qkv.float().view(n, hq + 2 * hkv, d)
    q, k, v = x[:, :hq], x[:, hq:hq + hkv], x[:, hq + hkv:]
    if q_norm is not None:
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + eps) * q_norm.float()
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps) * k_norm.float()
    p = pos.long()
    c, s = cos[p][:, None], sin[p][:, None]

    def rotate(t: torch.Tensor) -> torch.Tensor:
        t1, t2 = t[..., :d // 2], t[..., d // 2:]
        return torch.cat([t1 * c - t2 * s, t2 * c + t1 * s], dim=-1)

    q, k = rotate(q), rotate(k)
    # An fp8 cache quantises the float32 values (as the kernel); others take the rounded
    # ones. A padding row (its block -1) writes nothing.
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    k, v = (k, v) if fp8 else (k.to(k_cache.dtype), v.to(v_cache.dtype))
    # The append's reference itself: the engine built the positions and the table (the
    # public op's value checks cost as much as the write on a small CPU step).
    kv_cache_append_reference(k_cache, v_cache, k[:, None], v[:, None], pos, block_table=table,
                              k_scale=k_scale, v_scale=v_scale)
    return q.to(qkv.dtype)


def gemv_reference(x: torch.Tensor, weights: tuple[torch.Tensor, ...],
                   biases: tuple[Any, ...] | None = None, *, residual: torch.Tensor | None = None,
                   gated: bool = False,
                   norm: tuple[torch.Tensor, float] | None = None,
                   row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The reference of ``gemv_kernel``: ``x [n, K]`` times the concatenated ``weights``'
    rows (float32 accumulation), plus biases; ``gated``: ``silu(x W0.T) * (x W1.T)``;
    ``residual``: ``residual + ...``; ``norm = (g, eps)``: x RMS-normed first (weight g,
    float32, not rounded); ``row_scale [n]``: each row's products scaled by it (before
    the biases). Rounded once to x's dtype."""
    xf = x.float()
    if norm is not None:
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm[1]) * norm[0].float()
    ys = [xf @ w.float().t() for w in weights]
    if row_scale is not None:
        ys = [y * row_scale.float()[:, None] for y in ys]
    if biases is not None:
        ys = [y if b is None else y + b.float() for y, b in zip(ys, biases)]
    y = F.silu(ys[0]) * ys[1] if gated else torch.cat(ys, dim=-1)
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)


def prenorm_reference(h: torch.Tensor, g: torch.Tensor, eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of ``gemv_kernel``'s PRENORM outputs for the residual stream ``h [n,
    H]`` and the next RMSNorm's weight ``g`` and ``eps``: ``(h * g`` rounded to h's dtype,
    ``rsqrt(mean(h^2) + eps)`` float32 ``[n])``, so that ``gemv_reference(h * g, W,
    row_scale=r)`` is the GEMV of ``rms_norm(h)`` (``h * r * g``, ``r`` taken out of the
    dot)."""
    hf = h.float()
    return (hf * g.float()).to(h.dtype), torch.rsqrt(hf.square().mean(-1) + eps)


def embed_prenorm_reference(ids: torch.Tensor, table: torch.Tensor, g: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference of ``embed_kernel`` with PRENORM: the rows ``h = table[ids]`` and
    :func:`prenorm_reference`'s ``(h * g, rsqrt(mean(h^2) + eps))`` of them."""
    h = table[ids.long()]
    return (h, *prenorm_reference(h, g, eps))
