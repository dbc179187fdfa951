"""``DecodeAttentionBlock``: the attention block of one decoding step, as one ``nn.Module``:

    x [B, s_active, hidden]
      -> RMSNorm (optional, learnable weight)
      -> fused QKV projection  [B, s_active, (Hq + 2 Hkv) * D]
      -> RMSNorm of each q and k head over D (optional, learnable weights [D])
      -> rotary embedding of q and k at each token's position (optional)
      -> append k, v to the KV cache (contiguous or paged, fp8 or not)
      -> decode attention over the cache (GQA, window, sinks)
      -> output projection     y [B, s_active, hidden]

On the Triton path the qk-norm, the rotary embedding and the cache append are one kernel
(``block_kernels.qk_norm_rope_append_kernel``) reading the projection's output once; the
input norm is :func:`lmfuse.rms_norm`, the projections are ``F.linear`` and the attention is
:func:`lmfuse.decode_attention`.

The specification is in :mod:`lmfuse.attention.reference` (imported here under the same
names): ``decode_attention_block_reference`` (the whole block, plain PyTorch, float32 math;
the ``impl="torch"`` path) and ``qk_norm_rope_append_reference`` (the fused stage alone),
built on the decode reference, the cache append's reference and the RMSNorm family's
reference (:mod:`lmfuse.norm.reference`).

Rounding points (both paths): the input norm's output, the QKV projection's output, q
after norm and rotation, the attention output and the block's output are each rounded
once to the model's dtype; k is computed in float32 and rounded once into the cache's
dtype (quantised straight from float32 for an fp8 cache), v is stored from the
projection's output.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .._dispatch import (IMPLS, check_choice, check_float32, check_int, check_number,
                         check_same_device, check_tensor, select_impl)
from .._launch import (FP8_DTYPES, INDEX_DTYPES, KERNEL_DTYPES, dtype_name, kernel_op,
                       lazy_kernels, next_pow2)
from . import ops
from ..norm.ops import rms_norm
from .reference import decode_attention_block_reference as decode_attention_block_reference
from .reference import default_positions as default_positions
from .reference import qk_norm_rope_append_reference as qk_norm_rope_append_reference
from .reference import rope_inv_freq as rope_inv_freq
from .reference import rope_reference as rope_reference

_kernels = lazy_kernels("block_kernels", __package__)


# --- validation -------------------------------------------------------------------------------


def _check_step(op: str, dtype: torch.dtype, B: int, s_active: int, Hq: int, Hkv: int, D: int,
                ref_name: str, ref: torch.Tensor, k_cache, v_cache, cache_seqlens, block_table,
                positions, k_scale, v_scale, tensors: dict[str, Any]) -> int:
    """The caches, lengths, block table, positions and scales of one step (shared by the
    block and the fused stage). Returns the capacity per sequence."""
    Hkv_cache, capacity = ops.check_cache(op, dtype, k_cache, v_cache, block_table, B, Hq, D,
                                          dtype_of=f"{ref_name}'s")
    if Hkv_cache != Hkv:
        raise ValueError(f"{op}: the caches have {Hkv_cache} KV heads but num_kv_heads is "
                         f"{Hkv}: k_cache {tuple(k_cache.shape)}")
    ops.check_seqlens(op, cache_seqlens, B)
    ops.check_scales(op, k_scale, v_scale, Hkv, k_cache.dtype)
    if positions is not None:
        check_tensor(op, "positions", positions, ndim=2, dtypes=INDEX_DTYPES)
        if tuple(positions.shape) != (B, s_active):
            raise ValueError(f"{op}: positions must be [B={B}, s_active={s_active}], got "
                             f"{tuple(positions.shape)}")
    check_same_device(op, ref_name, ref, k_cache=k_cache,
                      v_cache=v_cache, cache_seqlens=cache_seqlens, block_table=block_table,
                      positions=positions, k_scale=k_scale, v_scale=v_scale, **tensors)
    return capacity


def _check_step_values(op: str, path: str, s_active: int, k_cache, cache_seqlens, block_table,
                       k_scale, v_scale, capacity: int, *, attend: bool) -> None:
    """The values of a step, as ``ops`` checks them (when ``value_checks``, and always on the
    reference path): the append of ``s_active`` rows at ``cache_seqlens``, and with
    ``attend`` the attention over ``cache_seqlens + s_active`` tokens. Before anything is
    written: a refused call leaves the cache as it was."""
    force = path == "torch"
    ops.check_append_values(op, cache_seqlens, k_cache, block_table, capacity, s_active,
                            k_scale, v_scale, force=force)
    if attend and ops.checking_values(cache_seqlens, force):
        ops.check_decode_values(op, cache_seqlens, k_cache, block_table, capacity, None, None,
                                name="cache_seqlens + s_active",
                                lengths=cache_seqlens.long() + s_active, force=force)


def _select(op: str, impl: str, device: torch.device, dtype: torch.dtype, k_cache,
            v_cache) -> str:
    path, _ = select_impl(op, impl, device)
    if path == "triton" and dtype not in KERNEL_DTYPES:
        if impl == "triton":
            raise TypeError(f"{op}: impl='triton' runs float32/float16/bfloat16 tensors, got "
                            f"{dtype_name(dtype)}; use impl='torch'")
        path = "torch"
    if path == "triton":
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if c.stride(-1) != 1:
                raise ValueError(f"{op}: {name}'s head dim must be contiguous (stride 1), got "
                                 f"strides {tuple(c.stride())}")
    return path


# --- the fused stage: launch and public function ---------------------------------------------


def _prologue_fake(qkv, k_cache, v_cache, cache_seqlens, q_norm_weight, k_norm_weight,
                   inv_freq, positions, block_table, k_scale, v_scale, Hq, Hkv, eps,
                   interleaved, capacity):
    B, s_active, width = qkv.shape
    return qkv.new_empty((B, s_active, Hq, width // (Hq + 2 * Hkv)))


@kernel_op("qk_norm_rope_append_", _prologue_fake, mutates_args=("k_cache", "v_cache"))
def _launch_prologue(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cache_seqlens: torch.Tensor, q_norm_weight: Optional[torch.Tensor],
                     k_norm_weight: Optional[torch.Tensor], inv_freq: Optional[torch.Tensor],
                     positions: Optional[torch.Tensor], block_table: Optional[torch.Tensor],
                     k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor], Hq: int,
                     Hkv: int, eps: float, interleaved: bool, capacity: int) -> torch.Tensor:
    """The fused stage's launch on the layouts :func:`_run_prologue` makes: returns a new
    ``q [B, s_active, Hq, D]`` and writes k and v into the caches in place."""
    B, s_active, width = qkv.shape
    D = width // (Hq + 2 * Hkv)
    q = torch.empty((B, s_active, Hq, D), dtype=qkv.dtype, device=qkv.device)
    if B * s_active == 0 or D == 0:
        return q
    half_r = 0 if inv_freq is None else inv_freq.numel()
    # One head row a program (no tuning table entry): a warp per 128 elements of the row.
    block_d = next_pow2(D, 16)
    paged = block_table is not None
    fp8 = k_cache.dtype in FP8_DTYPES
    qk_norm = q_norm_weight is not None
    _kernels().qk_norm_rope_append_kernel[(B * s_active, Hq + Hkv)](
        qkv, q, k_cache, v_cache, cache_seqlens,
        positions if positions is not None else cache_seqlens,
        block_table if paged else cache_seqlens,
        q_norm_weight if qk_norm else qkv, k_norm_weight if qk_norm else qkv,
        inv_freq if inv_freq is not None else qkv,
        k_scale if k_scale is not None else qkv, v_scale if v_scale is not None else qkv,
        qkv.stride(0), qkv.stride(1),
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0) if paged else 0,
        positions.stride(0) if positions is not None else 0,
        positions.stride(1) if positions is not None else 0,
        s_active, Hq, Hkv, capacity, k_cache.shape[0] if paged else 0, float(eps),
        D=D, HALF_R=half_r, BLOCK_R=next_pow2(half_r, 2), BLOCK_T=next_pow2(D - 2 * half_r, 2),
        BLOCK_D=block_d, QK_NORM=qk_norm, ROPE=inv_freq is not None,
        INTERLEAVED=bool(interleaved), HAS_POS=positions is not None, PAGED=paged,
        BLOCK_LEN=k_cache.shape[1] if paged else 1, FP8=fp8,
        HAS_K_SCALE=k_scale is not None, HAS_V_SCALE=v_scale is not None,
        num_warps=max(1, min(4, block_d // 128)))
    return q


def _run_prologue(qkv, k_cache, v_cache, cache_seqlens, q_norm_weight, k_norm_weight,
                  inv_freq, positions, block_table, k_scale, v_scale, Hq, Hkv, eps,
                  interleaved, capacity) -> torch.Tensor:
    """Triton path after validation: the layouts the kernel assumes, then the launch."""
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    # 1-D tensors the kernel indexes as ``base + i``.
    cache_seqlens = cache_seqlens.contiguous()
    q_norm_weight, k_norm_weight, inv_freq, k_scale, v_scale = (
        None if t is None else t.contiguous()
        for t in (q_norm_weight, k_norm_weight, inv_freq, k_scale, v_scale))
    if block_table is not None and block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    return _launch_prologue(qkv, k_cache, v_cache, cache_seqlens, q_norm_weight, k_norm_weight,
                            inv_freq, positions, block_table, k_scale, v_scale, Hq, Hkv,
                            float(eps), bool(interleaved), capacity)


# The reference paths of the stage and of the block read the lengths on the host (the append
# checks them and indexes by them): under torch.compile each is one opaque op
# (``ops.opaque_reference``), which checks the values at run time as an eager call does, as
# ``ops``' decode reference.


@kernel_op("qk_norm_rope_append_reference_", _prologue_fake, mutates_args=("k_cache", "v_cache"))
def _prologue_reference(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        cache_seqlens: torch.Tensor, q_norm_weight: Optional[torch.Tensor],
                        k_norm_weight: Optional[torch.Tensor], inv_freq: Optional[torch.Tensor],
                        positions: Optional[torch.Tensor], block_table: Optional[torch.Tensor],
                        k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
                        Hq: int, Hkv: int, eps: float, interleaved: bool,
                        capacity: int) -> torch.Tensor:
    """:func:`qk_norm_rope_append`'s reference path as one op of a compiled graph (q a new
    contiguous tensor: without a norm or a rotary the reference's is a view of qkv)."""
    _check_step_values("qk_norm_rope_append", "torch", qkv.shape[1], k_cache, cache_seqlens,
                       block_table, k_scale, v_scale, capacity, attend=False)
    return qk_norm_rope_append_reference(
        qkv, k_cache, v_cache, cache_seqlens, num_heads=Hq, num_kv_heads=Hkv,
        q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, eps=eps, inv_freq=inv_freq,
        rope_interleaved=interleaved, positions=positions, block_table=block_table,
        k_scale=k_scale, v_scale=v_scale).clone(memory_format=torch.contiguous_format)


@kernel_op("decode_attention_block_reference_",
           lambda x, *args, **kwargs: x.new_empty(x.shape), mutates_args=("k_cache", "v_cache"))
def _block_reference(x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cache_seqlens: torch.Tensor, qkv_weight: torch.Tensor,
                     out_weight: torch.Tensor, qkv_bias: Optional[torch.Tensor],
                     out_bias: Optional[torch.Tensor], input_norm_weight: Optional[torch.Tensor],
                     q_norm_weight: Optional[torch.Tensor], k_norm_weight: Optional[torch.Tensor],
                     sinks: Optional[torch.Tensor], positions: Optional[torch.Tensor],
                     block_table: Optional[torch.Tensor], k_scale: Optional[torch.Tensor],
                     v_scale: Optional[torch.Tensor], num_heads: int, num_kv_heads: int,
                     norm_eps: float, rope: bool, rotary_dim: Optional[int], rope_theta: float,
                     rope_interleaved: bool, scale: Optional[float],
                     window_size: Optional[int], capacity: int) -> torch.Tensor:
    """:class:`DecodeAttentionBlock`'s reference path as one op of a compiled graph."""
    _check_step_values("DecodeAttentionBlock", "torch", x.shape[1], k_cache, cache_seqlens,
                       block_table, k_scale, v_scale, capacity, attend=True)
    return decode_attention_block_reference(
        x, k_cache, v_cache, cache_seqlens, qkv_weight=qkv_weight, out_weight=out_weight,
        num_heads=num_heads, num_kv_heads=num_kv_heads, qkv_bias=qkv_bias, out_bias=out_bias,
        input_norm_weight=input_norm_weight, q_norm_weight=q_norm_weight,
        k_norm_weight=k_norm_weight, norm_eps=norm_eps, rope=rope, rotary_dim=rotary_dim,
        rope_theta=rope_theta, rope_interleaved=rope_interleaved, scale=scale,
        window_size=window_size, sinks=sinks, positions=positions, block_table=block_table,
        k_scale=k_scale, v_scale=v_scale)


def qk_norm_rope_append(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    q_norm_weight: Optional[torch.Tensor] = None,
    k_norm_weight: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    inv_freq: Optional[torch.Tensor] = None,
    rope_interleaved: bool = False,
    positions: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    impl: str = "auto",
) -> torch.Tensor:
    """The block's fused elementwise stage: per-head RMSNorm of q and k, rotary embedding,
    and the append of k and v to the cache, in one kernel. Inference only (no backward on
    the Triton path; ``impl="torch"`` is plain autograd).

    Args:
        qkv: ``[B, s_active, (Hq + 2 Hkv) * D]``, the fused projection's output: q heads,
            then k heads, then v heads, each ``D`` wide.
        k_cache, v_cache: ``[B, S_max, Hkv, D]``, or ``[num_blocks, block_len, Hkv, D]`` with
            ``block_table [B, max_blocks]``; qkv's dtype or float8 (``float8_e4m3fn``; stored
            = clamp(x / scale, +-max) with ``k_scale``/``v_scale [Hkv]``, default 1).
        cache_seqlens: ``[B]`` tokens in each cache *before* this step (not updated); token
            ``i``'s k and v go to position ``cache_seqlens[b] + i``.
        q_norm_weight, k_norm_weight: ``[D]`` RMSNorm weights of q and k (both or neither).
        eps: the RMSNorm's epsilon.
        inv_freq: ``[R / 2]`` float32 rotary frequencies (:func:`rope_inv_freq`), rotating
            the first ``R`` dims of each head; ``None``: no rotary embedding.
        rope_interleaved: pairs ``(2j, 2j + 1)`` (GPT-J) instead of ``(j, j + R/2)``.
        positions: ``[B, s_active]`` int rotary positions; default ``cache_seqlens[b] + i``.
    Returns:
        ``q [B, s_active, Hq, D]`` in qkv's dtype.

    The cache's values are checked as :func:`lmfuse.kv_cache_append` checks them (on CPU
    tensors always, on CUDA ones with ``lmfuse.set_checks(True)``), before anything is
    written; unchecked CUDA calls skip the rows that have no slot (past the capacity, at a
    negative position, in a block outside ``[0, num_blocks)``). NaN and inf in ``qkv`` go
    through (NaN stays NaN in an fp8 cache; inf saturates).
    """
    op = "qk_norm_rope_append"
    check_tensor(op, "qkv", qkv, ndim=3)
    Hq = check_int(op, "num_heads", num_heads, minimum=1)
    Hkv = check_int(op, "num_kv_heads", num_kv_heads, minimum=1)
    B, s_active, width = qkv.shape
    if width % (Hq + 2 * Hkv) or width == 0:
        raise ValueError(f"{op}: qkv's last dim must be (num_heads + 2 * num_kv_heads) * D = "
                         f"{Hq + 2 * Hkv} * D, got {tuple(qkv.shape)}")
    D = width // (Hq + 2 * Hkv)
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError(f"{op}: pass both q_norm_weight and k_norm_weight, or neither")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None:
            check_tensor(op, name, w, ndim=1)
            if w.shape[0] != D:
                raise ValueError(f"{op}: {name} must be [D={D}], got {tuple(w.shape)}")
    eps = check_number(op, "eps", eps, allow_none=False)
    if eps < 0:
        raise ValueError(f"{op}: eps must be >= 0, got {eps}")
    if inv_freq is not None:
        check_tensor(op, "inv_freq", inv_freq, ndim=1, dtypes=(torch.float32,))
        if not 1 <= inv_freq.shape[0] <= D // 2:
            raise ValueError(f"{op}: inv_freq must be [R/2] with 1 <= R/2 <= D/2 = {D // 2}, "
                             f"got {tuple(inv_freq.shape)}")
    if not isinstance(rope_interleaved, bool):
        raise TypeError(f"{op}: rope_interleaved must be a bool, got "
                        f"{type(rope_interleaved).__name__}")
    capacity = _check_step(op, qkv.dtype, B, s_active, Hq, Hkv, D, "qkv", qkv, k_cache,
                           v_cache, cache_seqlens, block_table, positions, k_scale, v_scale,
                           dict(q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight,
                                inv_freq=inv_freq))
    path = _select(op, impl, qkv.device, qkv.dtype, k_cache, v_cache)
    _check_step_values(op, path, s_active, k_cache, cache_seqlens, block_table, k_scale, v_scale,
                       capacity, attend=False)
    if path == "torch":
        if ops.opaque_reference(qkv, q_norm_weight, k_norm_weight, k_cache, v_cache):
            return _prologue_reference(qkv, k_cache, v_cache, cache_seqlens, q_norm_weight,
                                       k_norm_weight, inv_freq, positions, block_table,
                                       k_scale, v_scale, Hq, Hkv, float(eps),
                                       rope_interleaved, capacity)
        return qk_norm_rope_append_reference(
            qkv, k_cache, v_cache, cache_seqlens, num_heads=Hq, num_kv_heads=Hkv,
            q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, eps=eps,
            inv_freq=inv_freq, rope_interleaved=rope_interleaved, positions=positions,
            block_table=block_table, k_scale=k_scale, v_scale=v_scale)
    ops.check_no_grad(op, path, "an inference op", qkv=qkv, q_norm_weight=q_norm_weight,
                      k_norm_weight=k_norm_weight, k_cache=k_cache, v_cache=v_cache,
                      k_scale=k_scale, v_scale=v_scale)
    return _run_prologue(qkv, k_cache, v_cache, cache_seqlens, q_norm_weight, k_norm_weight,
                         inv_freq, positions, block_table, k_scale, v_scale, Hq, Hkv, eps,
                         rope_interleaved, capacity)


# --- the module -------------------------------------------------------------------------------


class DecodeAttentionBlock(nn.Module):
    """The attention block of a decoding step: RMSNorm -> fused QKV projection -> per-head
    q/k RMSNorm -> rotary embedding -> KV-cache append -> decode attention -> output
    projection. Equal to :func:`decode_attention_block_reference` built from its weights.

    **Inference only on the Triton path**: decode attention and the fused stage have no
    backward, so with ``impl`` resolving to Triton the forward must run under
    ``torch.no_grad()`` / ``torch.inference_mode()`` (it raises otherwise);
    ``impl="torch"`` is the reference, differentiable by plain autograd.

    Args:
        hidden_size: the model width (x's and y's last dim).
        num_heads, num_kv_heads: query heads ``Hq`` and KV heads ``Hkv`` (``Hq % Hkv == 0``;
            GQA: query head ``h`` reads KV head ``h // (Hq // Hkv)``).
        head_dim: ``D``; default ``hidden_size // num_heads`` (which must divide).
        input_norm: RMSNorm of x (learnable ``input_norm_weight [hidden]``, ones at start).
        qk_norm: RMSNorm of every q and k head over D (``q_norm_weight``,
            ``k_norm_weight [D]``), before the rotary embedding (Qwen3, OLMo-2 style).
        rope: rotary embedding of q and k. ``inv_freq[j] = rope_theta ** (-2j /
            rotary_dim)`` in float32 (:func:`rope_inv_freq`); the angle of pair ``j`` at
            position ``p`` is the float32 product ``p * inv_freq[j]``. Pairs ``(j, j +
            rotary_dim/2)`` ("rotate half", GPT-NeoX / Llama), or ``(2j, 2j + 1)`` with
            ``rope_interleaved=True`` (GPT-J); ``(a, b) -> (a cos - b sin, b cos + a sin)``.
        rotary_dim: the rotated leading dims of each head (even, <= D; default D); the rest
            pass through (partial rotary, as GPT-NeoX's ``rotary_pct``).
        norm_eps: every RMSNorm's epsilon.
        qkv_bias, out_bias: biases of the projections.
        window_size: ``w``: the token at position ``p`` attends to cache rows ``p - w .. p``.
        sinks: learnable per-head sink logits ``sinks [Hq]`` (zeros at start) in the softmax
            denominator.
        scale: the attention's ``q . k`` scale; default ``1 / sqrt(D)``.
        impl: ``"auto"`` (Triton on CUDA, or on the CPU under Triton's interpreter; the
            reference elsewhere), ``"triton"`` or ``"torch"``.
        device, dtype: of the parameters, as ``torch.nn.Linear``'s.

    Parameters: ``input_norm_weight``, ``qkv`` (``nn.Linear(hidden, (Hq + 2 Hkv) * D)``, its
    output q heads, then k heads, then v heads), ``q_norm_weight``, ``k_norm_weight``,
    ``out`` (``nn.Linear(Hq * D, hidden)``), ``sinks``; absent ones are ``None``.

    ``forward(x, k_cache, v_cache, cache_seqlens, *, block_table=None, k_scale=None,
    v_scale=None, positions=None, num_splits=None) -> y``:

    * ``x [B, s_active, hidden]`` in the parameters' dtype; ``y`` likewise.
    * ``k_cache, v_cache``: contiguous ``[B, S_max, Hkv, D]`` or paged ``[num_blocks,
      block_len, Hkv, D]`` with ``block_table [B, max_blocks]`` (int32, -1 padded); x's
      dtype or ``float8_e4m3fn`` with optional ``k_scale``/``v_scale [Hkv]`` (value = stored
      * scale; new rows are stored as clamp(value / scale, +-448)).
    * ``cache_seqlens [B]``: tokens in each cache *before* this step. The step writes its
      keys and values at ``cache_seqlens[b] + i`` (in place) and attends over
      ``cache_seqlens + s_active`` tokens; it does not update ``cache_seqlens`` (add
      ``s_active`` after the call). Reserve the room first: ``cache_seqlens[b] + s_active``
      must be within the capacity and its blocks in ``[0, num_blocks)``; checked as
      :func:`lmfuse.kv_cache_append` and :func:`lmfuse.decode_attention` check them (on
      CPU tensors always, on CUDA ones with ``lmfuse.set_checks(True)``), before the cache
      is written, with the same ``ValueError`` on both paths (in a compiled graph at run
      time; but a compiled call of the reference path that needs a gradient, which runs
      the reference's own ops, raises the append's or the attention's error, the latter
      after the append). Unchecked CUDA calls write no row without a slot and read no block
      outside the pool.
    * ``positions [B, s_active]``: rotary positions; default ``cache_seqlens[b] + i``.
    * ``num_splits``: forwarded to :func:`lmfuse.decode_attention`.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: Optional[int] = None, *, input_norm: bool = True,
                 qk_norm: bool = False, rope: bool = True, rope_theta: float = 10000.0,
                 rotary_dim: Optional[int] = None, rope_interleaved: bool = False,
                 norm_eps: float = 1e-6, qkv_bias: bool = False, out_bias: bool = False,
                 window_size: Optional[int] = None, sinks: bool = False,
                 scale: Optional[float] = None, device=None, dtype=None,
                 impl: str = "auto") -> None:
        super().__init__()
        op = "DecodeAttentionBlock"
        hidden_size = check_int(op, "hidden_size", hidden_size, minimum=1)
        num_heads = check_int(op, "num_heads", num_heads, minimum=1)
        num_kv_heads = check_int(op, "num_kv_heads", num_kv_heads, minimum=1)
        if num_heads % num_kv_heads:
            raise ValueError(f"{op}: num_heads ({num_heads}) must be a multiple of "
                             f"num_kv_heads ({num_kv_heads}) (GQA)")
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(f"{op}: hidden_size ({hidden_size}) is not a multiple of "
                                 f"num_heads ({num_heads}); pass head_dim")
            head_dim = hidden_size // num_heads
        head_dim = check_int(op, "head_dim", head_dim, minimum=1)
        for name, flag in (("input_norm", input_norm), ("qk_norm", qk_norm), ("rope", rope),
                           ("rope_interleaved", rope_interleaved), ("qkv_bias", qkv_bias),
                           ("out_bias", out_bias), ("sinks", sinks)):
            if not isinstance(flag, bool):
                raise TypeError(f"{op}: {name} must be a bool, got {type(flag).__name__}")
        if rope:
            rotary_dim = head_dim if rotary_dim is None else check_int(
                op, "rotary_dim", rotary_dim, minimum=1)
            if rotary_dim % 2 or rotary_dim > head_dim:
                raise ValueError(f"{op}: rotary_dim must be even and <= head_dim "
                                 f"({head_dim}), got {rotary_dim}")
            rope_theta = check_number(op, "rope_theta", rope_theta, allow_none=False)
            if rope_theta <= 0:
                raise ValueError(f"{op}: rope_theta must be > 0, got {rope_theta}")
        elif rotary_dim is not None or rope_interleaved:
            raise ValueError(f"{op}: rotary_dim and rope_interleaved need rope=True")
        norm_eps = check_number(op, "norm_eps", norm_eps, allow_none=False)
        if norm_eps < 0:
            raise ValueError(f"{op}: norm_eps must be >= 0, got {norm_eps}")
        if window_size is not None:
            check_int(op, "window_size", window_size, minimum=0)
        scale = check_float32(op, "scale", check_number(op, "scale", scale))
        check_choice(op, "impl", impl, IMPLS)

        self.hidden_size, self.num_heads, self.num_kv_heads = hidden_size, num_heads, num_kv_heads
        self.head_dim = head_dim
        self.rope, self.rotary_dim = rope, rotary_dim if rope else 0
        self.rope_theta, self.rope_interleaved = float(rope_theta), rope_interleaved
        self.norm_eps, self.window_size, self.scale, self.impl = norm_eps, window_size, scale, impl
        kw = dict(device=device, dtype=dtype)
        D, Hq, Hkv = head_dim, num_heads, num_kv_heads
        self.input_norm_weight = (nn.Parameter(torch.ones(hidden_size, **kw)) if input_norm
                                  else None)
        self.qkv = nn.Linear(hidden_size, (Hq + 2 * Hkv) * D, bias=qkv_bias, **kw)
        self.q_norm_weight = nn.Parameter(torch.ones(D, **kw)) if qk_norm else None
        self.k_norm_weight = nn.Parameter(torch.ones(D, **kw)) if qk_norm else None
        self.out = nn.Linear(Hq * D, hidden_size, bias=out_bias, **kw)
        self.sinks = nn.Parameter(torch.zeros(Hq, **kw)) if sinks else None
        # Not a buffer: ``module.to(torch.float16)`` would round the frequencies.
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def reset_parameters(self) -> None:
        """The parameters as constructed: the norm weights ones, the sinks zeros, the
        projections by ``nn.Linear``'s initialisation (after building on the meta device and
        ``to_empty``, every parameter gets its values here)."""
        self.qkv.reset_parameters()
        self.out.reset_parameters()
        with torch.no_grad():
            for w in (self.input_norm_weight, self.q_norm_weight, self.k_norm_weight):
                if w is not None:
                    w.fill_(1.0)
            if self.sinks is not None:
                self.sinks.zero_()

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """The rotary frequencies ``[rotary_dim / 2]`` float32 on ``device``, made on the
        first call for that device (a warm-up step before capturing a CUDA graph makes them)."""
        if device not in self._inv_freq:
            self._inv_freq[device] = rope_inv_freq(self.rotary_dim, self.rope_theta, device)
        return self._inv_freq[device]

    def reference_kwargs(self) -> dict[str, Any]:
        """The weights and options of :func:`decode_attention_block_reference` for this
        module."""
        return dict(qkv_weight=self.qkv.weight, out_weight=self.out.weight,
                    num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                    qkv_bias=self.qkv.bias, out_bias=self.out.bias,
                    input_norm_weight=self.input_norm_weight, q_norm_weight=self.q_norm_weight,
                    k_norm_weight=self.k_norm_weight, norm_eps=self.norm_eps, rope=self.rope,
                    rotary_dim=self.rotary_dim if self.rope else None,
                    rope_theta=self.rope_theta, rope_interleaved=self.rope_interleaved,
                    scale=self.scale, window_size=self.window_size, sinks=self.sinks)

    def _check(self, x, k_cache, v_cache, cache_seqlens, block_table, positions, k_scale,
               v_scale, num_splits) -> tuple[str, int]:
        op = "DecodeAttentionBlock"
        check_tensor(op, "x", x, ndim=3)
        B, s_active, hidden = x.shape
        if hidden != self.hidden_size or s_active < 1:
            raise ValueError(f"{op}: x must be [B, s_active >= 1, hidden_size="
                             f"{self.hidden_size}], got {tuple(x.shape)}")
        if x.dtype != self.qkv.weight.dtype:
            raise TypeError(f"{op}: x is {dtype_name(x.dtype)} but the parameters are "
                            f"{dtype_name(self.qkv.weight.dtype)}")
        if num_splits is not None:
            check_int(op, "num_splits", num_splits, minimum=1)
        capacity = _check_step(op, x.dtype, B, s_active, self.num_heads, self.num_kv_heads,
                               self.head_dim, "x", x, k_cache, v_cache, cache_seqlens,
                               block_table, positions, k_scale, v_scale,
                               dict(weight=self.qkv.weight))
        path = _select(op, self.impl, x.device, x.dtype, k_cache, v_cache)
        _check_step_values(op, path, s_active, k_cache, cache_seqlens, block_table, k_scale,
                           v_scale, capacity, attend=True)
        if path == "triton" and torch.is_grad_enabled() and (
                x.requires_grad or any(p.requires_grad for p in self.parameters())):
            raise ValueError(f"{op}: the Triton path is inference-only (decode attention has "
                             "no backward); run it under torch.no_grad() or "
                             "torch.inference_mode(), or use impl='torch'")
        return path, capacity

    def forward(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cache_seqlens: torch.Tensor, *, block_table: Optional[torch.Tensor] = None,
                k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
                positions: Optional[torch.Tensor] = None,
                num_splits: Optional[int] = None) -> torch.Tensor:
        # Everything is validated before the cache is written, so a bad call leaves it as it
        # was.
        path, capacity = self._check(x, k_cache, v_cache, cache_seqlens, block_table,
                                     positions, k_scale, v_scale, num_splits)
        if path == "torch":
            kw = self.reference_kwargs()
            if ops.opaque_reference(x, k_cache, v_cache, params=self.parameters()):
                return _block_reference(
                    x, k_cache, v_cache, cache_seqlens, kw["qkv_weight"], kw["out_weight"],
                    kw["qkv_bias"], kw["out_bias"], kw["input_norm_weight"],
                    kw["q_norm_weight"], kw["k_norm_weight"], kw["sinks"], positions,
                    block_table, k_scale, v_scale, self.num_heads, self.num_kv_heads,
                    float(self.norm_eps), self.rope, kw["rotary_dim"], float(self.rope_theta),
                    self.rope_interleaved, kw["scale"], self.window_size, capacity)
            return decode_attention_block_reference(
                x, k_cache, v_cache, cache_seqlens, positions=positions,
                block_table=block_table, k_scale=k_scale, v_scale=v_scale, **kw)
        B, s_active, _ = x.shape
        h = x
        if self.input_norm_weight is not None:
            h = rms_norm(x, self.input_norm_weight, eps=self.norm_eps, impl="triton")
        qkv = F.linear(h, self.qkv.weight, self.qkv.bias)
        q = _run_prologue(qkv, k_cache, v_cache, cache_seqlens, self.q_norm_weight,
                          self.k_norm_weight, self.inv_freq(x.device) if self.rope else None,
                          positions, block_table, k_scale, v_scale, self.num_heads,
                          self.num_kv_heads, self.norm_eps, self.rope_interleaved, capacity)
        attn = ops.decode_attention(q, k_cache, v_cache, cache_seqlens + s_active,
                                    block_table=block_table, scale=self.scale,
                                    window_size=self.window_size, sinks=self.sinks,
                                    k_scale=k_scale, v_scale=v_scale, num_splits=num_splits,
                                    impl="triton")
        return self.out(attn.reshape(B, s_active, self.num_heads * self.head_dim))

    def extra_repr(self) -> str:
        parts = [f"hidden_size={self.hidden_size}", f"num_heads={self.num_heads}",
                 f"num_kv_heads={self.num_kv_heads}", f"head_dim={self.head_dim}",
                 f"input_norm={self.input_norm_weight is not None}",
                 f"qk_norm={self.q_norm_weight is not None}"]
        if self.rope:
            parts.append(f"rope(theta={self.rope_theta:g}, rotary_dim={self.rotary_dim}"
                         f"{', interleaved' if self.rope_interleaved else ''})")
        if self.window_size is not None:
            parts.append(f"window_size={self.window_size}")
        if self.sinks is not None:
            parts.append("sinks")
        parts.append(f"impl={self.impl!r}")
        return ", ".join(parts)


__all__ = ["DecodeAttentionBlock", "decode_attention_block_reference", "qk_norm_rope_append",
           "qk_norm_rope_append_reference", "rope_inv_freq", "rope_reference"]
