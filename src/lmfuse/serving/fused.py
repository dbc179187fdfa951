"""The Generator's fused decode forward for Llama-shaped models (Llama, Mistral, Qwen2, Qwen3).

A decode step runs each layer as a handful of launches over the model's own weights (read
in place, never copied):

    x = rms_norm(h)                       lmfuse RMSNorm (one row: inside the GEMV below,
                                          the sum of squares gathered in its pass over K;
                                          several rows: left by the GEMV that wrote h, see
                                          below, but in the first layer)
    qkv = x @ [Wq | Wk | Wv].T (+ b)      one GEMV launch over the three matrices
    q = rope_append(qkv)                  q/k RMSNorm (Qwen3), rotary of q and k, K/V rows
                                          written to their paged-cache blocks (fp8: scaled);
                                          several rows without a q/k norm: in the QKV
                                          GEMV's epilogue (a program holds the 16-dim
                                          tiles of both halves of a head that rotate
                                          together; H100 step B16 0.852 -> 0.823 ms, B64
                                          1.002 -> 0.999)
    o = decode_attention(q, cache)        lmfuse decode kernel (GQA, windows, fp8)
    h = h + o @ Wo.T                      GEMV with the residual add in its epilogue
    x = rms_norm(h)                       (one row: inside the next GEMV, as above;
                                          several rows: in the GEMVs around it, below)
    a = silu(x @ Wg.T) * (x @ Wu.T)       one GEMV launch: both projections and the gate
    h = h + a @ Wd.T                      GEMV with the residual add (one row; K split over
                                          programs at 2-16 and 33-64 rows), else cuBLAS addmm_
    logits = rms_norm(h) @ W_lm.T         GEMV for a long vocabulary (128-feature tiles at
                                          2-64 rows; one row: 256-feature tiles, the norm
                                          inside), each tile's row maxima stored beside it
                                          for the greedy tokens (no argmax pass over the
                                          logits)

instead of the model's forward (per layer three projections, a dozen elementwise launches
of rotary code, the cache append, the adds), which is what the Generator runs otherwise.
The rotary tables (cos and sin per position, from the model's own rotary module in float32,
so every rotary variant it computes once per position is covered) are made once.

The RMSNorm inside the GEMV pays at one row only (H100, CUDA-graph replays of the
benchmark model's step: B1 0.684 -> 0.676 ms; at 16 and 64 rows the dot tile's operand,
scaled in registers, no longer streams straight into shared memory: B16 0.844 -> 1.09 ms,
B64 0.99 -> 1.25). At several rows the norm is split around the dot instead: the residual
GEMV that writes ``h`` (Wo, Wd) also stores ``h * g`` (the norm's weight applied, rounded
to the model's dtype) and each tile's sums of squares of its rows (``prenorm``); the GEMV
that takes the norm's output (QKV, gate/up, the LM head) reads ``h * g`` as its operand
and scales each row's products by ``rsqrt(mean(h^2) + eps)``, its tiles' sums added in
order (``row_scale``). ``x @ W.T = r * ((h * g) @ W.T)``: one rounding of the operand as
before, at another place (H100, whole steps, two rounds each: B16 0.818 / 0.826 ->
0.799 / 0.795 ms, B64 0.994 / 0.996 -> 0.990 / 0.981). The first layer's input norm is
done the same way by the token embeddings' gather (``embed_kernel``), so no RMSNorm is
launched (B16 0.797 / 0.796 -> 0.784 / 0.781 ms). A last-tile reduction of the sums
inside the residual GEMV (counted with an atomic) cost more than the norm's launch it
saved (B64 0.99 -> 1.04 ms).

Math: float32 accumulation and element math, one rounding per stored tensor (the model's
code rounds to its dtype between steps: the bf16 logits differ within rounding, not more).
On the CPU, or with ``impl="torch"``, each step is the same formula in plain PyTorch
(``F.linear`` in the model's dtype, float32 rotary), the reference and test oracle of the
kernels. The GEMV kernels serve up to :data:`GEMV_MAX_ROWS` rows; larger batches (long
prefills) use cuBLAS, each projection group's GEMMs writing the columns of one buffer, the
residual adds in the GEMMs' epilogues and the MLP's activation through lmfuse's swiglu.

On a Hopper GPU the step's Triton kernels are launched with programmatic dependent launch
(``lmfuse._pdl``): each is scheduled while the one before it runs and waits for it on the
GPU, which hides a launch and ramp per kernel (H200, 2026-11-26: a B1 step 0.69 -> 0.66 ms,
B64 0.93 -> 0.90 ms, the same tokens). ``LMFUSE_PDL=0`` turns it off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .. import _pdl
from .._dispatch import interpreter_active, select_impl
from .._launch import KERNEL_DTYPES, cdiv, is_pow2, lazy_kernels, next_pow2
from ..attention.kv_cache import PagedKVCache
from ..activations import swiglu
from ..attention.ops import decode_attention, launch_decode_attention, native_decode
from ..attention.reference import kv_cache_append_reference
from ..norm.ops import launch_rms_norm as _launch_rms_norm
from ..norm.ops import rms_norm
from ..tuning import shared_memory
from .sampling import greedy, merge_argmax

#: ``config.model_type`` values whose decode runs the fused layers.
FUSED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# Rotary variants whose angles depend on the position alone (a table per position holds them).
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")
#: Most rows the GEMV kernels take; more go through cuBLAS.
GEMV_MAX_ROWS = 64
_OP = "Generator"
_kernels = lazy_kernels("kernels", __package__)


def unsupported(model: Any) -> str | None:
    """Why ``model``'s decode cannot run the fused layers (None: it can)."""
    config = model.config
    kind = getattr(config, "model_type", None)
    if kind not in FUSED_MODEL_TYPES:
        return f"model type {kind!r} (fused decode layers: {', '.join(FUSED_MODEL_TYPES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (silu only)"
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    if inner is None or rotary is None or not hasattr(inner, "layers"):
        return "no model.model.layers / rotary_emb"
    rope = getattr(rotary, "rope_type", "default")
    if rope not in _STATIC_ROPE:
        return f"rope_type {rope!r} (its angles depend on the sequence length)"
    if getattr(config, "partial_rotary_factor", 1.0) not in (None, 1.0):
        return "partial rotary"
    dtype = next(model.parameters()).dtype
    if dtype not in KERNEL_DTYPES:
        return f"weights of dtype {dtype}"
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                   mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if any(type(m) is not torch.nn.Linear for m in linears):
            return "projections that are not plain nn.Linear (quantised or wrapped weights)"
        if any(m.weight.dtype != dtype or not m.weight.is_contiguous() for m in linears):
            return "projection weights of mixed dtypes or strides"
    return None


@dataclass
class _Layer:
    norm_in: torch.Tensor
    norm_post: torch.Tensor
    eps: float
    eps_post: float
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    qkv_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    mlp_bias: tuple[Any, Any, Any] | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qk_eps: float
    scale: float
    window: int | None


@dataclass
class Prefill:
    """How a prefill's token rows attend and which rows it keeps. The queries go to the
    decode kernel in chunks of ``C`` consecutive positions of one sequence, the last at
    ``lengths[c] - 1`` (``C`` of them share each key tile's load, where a row per token
    reads its sequence's keys once per token); a chunk's slots before its sequence's first
    new token hold any row (their outputs are dropped). ``slots [R * C]`` int64: the token
    row of each chunk slot; ``table [R, W]`` int32 and ``lengths [R]`` int32: each chunk's
    sequence's blocks and its last position + 1 (a padding chunk: -1 and 0); ``rows [T]``
    int64: each token row's slot; ``keep [m]`` int64: the rows whose logits are returned."""

    slots: torch.Tensor
    table: torch.Tensor
    lengths: torch.Tensor
    rows: torch.Tensor
    keep: torch.Tensor


class FusedDecoder:
    """The fused decode forward of ``model`` over ``cache`` (see the module docstring)."""

    def __init__(self, model: Any, cache: PagedKVCache, impl: str = "auto") -> None:
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"{_OP}: decode_path='fused' cannot run this model: {why}")
        config = model.config
        inner = model.model
        self.model, self.cache = model, cache
        self.dtype = next(model.parameters()).dtype
        self.device = cache.device
        path, _ = select_impl(_OP, impl, self.device)
        self.triton = path == "triton"
        self.impl = impl
        # CPU float32 caches without Triton: attention through decode_attention's native
        # path directly (the engine built the lengths and tables: no per-call value checks).
        self.native = (not self.triton and impl == "auto" and self.device.type == "cpu"
                       and bool(cache.k_caches) and cache.k_caches[0].dtype == torch.float32)
        # Programmatic dependent launch of the step's kernels (lmfuse._pdl): each is
        # scheduled while the one before it runs, and waits for it on the GPU.
        self.pdl = _pdl.mode(self.device) if self.triton else 0
        # A kernel before a cuBLAS launch lets it start only when its own programs exit.
        self.pdl_tail = 2 if self.pdl else 0
        # fp8 caches: attention launched plainly (H100, B64 at 4096 fp8 keys, the step's
        # replay 1.73 ms without PDL, 1.94 with it on the attention kernels).
        fp8 = cache.k_caches[0].dtype == torch.float8_e4m3fn if cache.k_caches else False
        self.pdl_attention = 0 if fp8 else self.pdl
        self.hq = int(config.num_attention_heads)
        self.hkv = cache.kv_heads
        self.d = cache.head_dim
        # A prefill's query chunk: the decode kernel's 64 query rows a program (a KV head's
        # group x the chunk's positions).
        self.chunk = max(1, 64 // (self.hq // self.hkv))
        # The rotary kernel holds a head's halves in one power-of-two tile.
        self.rope_kernel = self.triton and self.d % 2 == 0 and is_pow2(self.d // 2)
        # Several rows: the QKV GEMV rotates and appends itself (models without a q/k norm).
        self.rope_gemv = self.rope_kernel and _rope_gemv_takes(2, self.d)
        self.embed = inner.embed_tokens.weight
        head = model.get_output_embeddings()
        self.lm_head, self.lm_bias = head.weight, getattr(head, "bias", None)
        # The LM head's GEMV: a vocabulary of at least LM_HEAD_MIN_FEATURES in whole
        # 128-feature tiles, a contiguous matrix, no bias.
        V = self.lm_head.shape[0]
        self.lm_gemv = (self.lm_bias is None and V >= LM_HEAD_MIN_FEATURES and V % 128 == 0
                        and self.lm_head.is_contiguous())
        self.norm, self.norm_eps = inner.norm.weight, _eps(inner.norm)
        self.layers = [self._layer(i, layer, config) for i, layer in enumerate(inner.layers)]
        limit = getattr(config, "max_position_embeddings", None) or (1 << 20)
        self.positions = min(int(limit), cache.num_blocks * cache.block_len)
        self.cos, self.sin = self._rope_tables(inner.rotary_emb, self.positions)

    def _layer(self, i: int, layer: Any, config: Any) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
        mlp_b = [mlp.gate_proj.bias, mlp.up_proj.bias, mlp.down_proj.bias]
        window = getattr(attn, "sliding_window", None)
        if config.model_type == "mistral":
            window = getattr(config, "sliding_window", None)
        qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        return _Layer(
            layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
            _eps(layer.input_layernorm), _eps(layer.post_attention_layernorm),
            tuple(m.weight for m in qkv),
            None if all(m.bias is None for m in qkv) else tuple(
                m.weight.new_zeros(m.weight.shape[0]) if m.bias is None else m.bias for m in qkv),
            attn.o_proj.weight, attn.o_proj.bias,
            mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight,
            None if all(b is None for b in mlp_b) else tuple(mlp_b),
            None if qn is None else qn.weight, None if kn is None else kn.weight,
            _eps(qn) if qn is not None else 1e-6, float(attn.scaling),
            None if window is None else max(int(window) - 1, 0))

    def _rope_tables(self, rotary: Any, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` ``[positions, D / 2]`` float32 from the model's rotary module."""
        half = self.d // 2
        cos = torch.empty((positions, half), dtype=torch.float32, device=self.device)
        sin = torch.empty_like(cos)
        probe = torch.zeros(1, dtype=torch.float32, device=self.device)
        chunk = 1 << 16
        with torch.inference_mode():
            for a in range(0, positions, chunk):
                b = min(positions, a + chunk)
                pos = torch.arange(a, b, device=self.device)[None]
                c, s = rotary(probe, pos)
                if not (torch.equal(c[0, :, :half], c[0, :, half:])
                        and torch.equal(s[0, :, :half], s[0, :, half:])):
                    raise ValueError(f"{_OP}: the model's rotary embedding is not of the "
                                     "rotate-half form (equal halves)")
                cos[a:b] = c[0, :, :half].float()
                sin[a:b] = s[0, :, :half].float()
        return cos, sin

    # --- the forward ------------------------------------------------------------------------

    def forward(self, ids: torch.Tensor, table: torch.Tensor, before: torch.Tensor,
                after: torch.Tensor | None, argmax: bool = False,
                tokens: torch.Tensor | None = None, prefill: Prefill | None = None,
                out: torch.Tensor | None = None) -> Any:
        """Logits ``[n, V]`` of one token per row: ``ids [n]`` at position ``before[n]``
        (its K/V written there), rows over ``block_table`` with ``after`` keys after the
        step. Padding rows (block -1, length 0) write and read nothing. ``argmax``:
        ``(logits, their greedy tokens)``, the tokens from the LM head's GEMV tiles where
        it runs (no pass over the logits), written into ``tokens`` (int64 ``[n]``) where
        given: it may be ``ids`` itself (read before), so that a captured step's output is
        the next step's input.

        A prefill (``prefill``, ``after`` unused) is the same forward over its tokens: each
        row one token of a prompt, its sequence's block table and its position in
        ``before``; every row's K/V is written before any row attends, and the queries
        attend in chunks of consecutive positions of one sequence (:class:`Prefill`), each
        token over its sequence's keys up to its own (causal); the logits are those of
        ``prefill.keep``'s rows (each prompt's last). ``out``: a contiguous ``[rows, V]``
        tensor of the logits' dtype that the LM head writes them into (a captured step's
        output in a buffer all of a runner's graphs share)."""
        n = ids.shape[0]
        kernels = self.triton and n <= GEMV_MAX_ROWS
        keep = None if prefill is None else prefill.keep
        lm_gemv = kernels and self.lm_gemv
        # Several rows: (h * g, its RowNorm) of the next RMSNorm, left by the kernel that
        # wrote h (the gather, a residual GEMV's prenorm epilogue) for the GEMV that takes
        # the norm's output (row_scale).
        pre = None
        if kernels and n > 1:
            h, *pre = _embed(ids, self.embed, (self.layers[0].norm_in, self.layers[0].eps),
                             self.pdl)
        else:
            h = F.embedding(ids, self.embed)
        for i, L in enumerate(self.layers):
            if kernels and n == 1:  # the input norm inside the GEMV (module docstring)
                qkv = self._gemv(h, L.qkv, L.qkv_bias, norm=(L.norm_in, L.eps))
            elif kernels:
                x, rs = pre or (self._rms_norm(h, L.norm_in, L.eps), None)
                if self.rope_gemv and L.q_norm is None:  # rotary + append inside
                    rope = RopeAppend(self.cos, self.sin, before, table,
                                      self.cache.k_caches[i], self.cache.v_caches[i],
                                      self.cache.k_scales[i], self.cache.v_scales[i],
                                      self.hq, self.hkv, self.d)
                    q = self._gemv(x, L.qkv, L.qkv_bias, rope=rope,
                                   row_scale=rs).view(n, self.hq, self.d)
                    qkv = None
                else:
                    qkv = self._gemv(x, L.qkv, L.qkv_bias, row_scale=rs)
            elif self.triton:  # more rows than the GEMV takes: cuBLAS into one buffer
                qkv = _linears(self._rms_norm(h, L.norm_in, L.eps, self.pdl_tail), L.qkv,
                               L.qkv_bias)
            else:
                x = self._rms_norm(h, L.norm_in, L.eps)
                qkv = torch.cat([F.linear(x, w, None if L.qkv_bias is None else L.qkv_bias[j])
                                 for j, w in enumerate(L.qkv)], dim=-1)
            if qkv is not None:
                q = self._rope_append(qkv, L, i, table, before)
            # (cuBLAS's Wo after it past the GEMV's rows or with a bias: launched once it
            # has ended)
            tail = not kernels or L.o_bias is not None
            if prefill is None:
                o = self._attention(q[:, None], i, L, table, after, tail).view(
                    n, self.hq * self.d)
            else:  # chunks of a sequence's consecutive tokens attend together
                chunks = prefill.lengths.shape[0]
                qc = q.reshape(n, -1).index_select(0, prefill.slots)
                o = self._attention(qc.view(chunks, -1, self.hq, self.d), i, L,
                                    prefill.table, prefill.lengths, tail)
                o = o.view(-1, self.hq * self.d).index_select(0, prefill.rows)
            pre = None
            if kernels and L.o_bias is None:
                if n > 1 and L.mlp_bias is None:  # the post-attention norm's work inside
                    pre = self._gemv(o, (L.o,), None, residual=h,
                                     prenorm=(L.norm_post, L.eps_post))[1:]
                else:
                    self._gemv(o, (L.o,), None, residual=h)
            elif self.triton and L.o_bias is None:
                h.addmm_(o, L.o.t())  # the residual add in the GEMM's epilogue
            else:
                h = h + F.linear(o, L.o, L.o_bias)
            if kernels and L.mlp_bias is None:
                # The GEMV (residual epilogue) where it beats cuBLAS on the long K (H100,
                # chained): one row (14.1 against 16.8 us), and K split over programs at 16
                # rows (15.8 against 17.4) and 64 (17.6 against 18.6); else cuBLAS. (Whole
                # feature tiles: else _gemv's float32 fallback.)
                tile = _row_tile(n)
                down = ((n == 1 or _gemv_split(*L.down.shape, tile, False) > 1)
                        and L.down.shape[0] % _gemv_config(*L.down.shape, tile, False)[0] == 0)
                norm = rs = None
                if n == 1:
                    x, norm = h, (L.norm_post, L.eps_post)
                else:
                    x, rs = pre or (self._rms_norm(h, L.norm_post, L.eps_post), None)
                a = _gemv(x, (L.gate, L.up), None, gated=True, norm=norm, row_scale=rs,
                          pdl=self.pdl if down else self.pdl_tail)
                # the next norm (the next layer's input norm, or the final one before the
                # LM head's GEMV) inside the down GEMV
                nxt = ((self.layers[i + 1].norm_in, self.layers[i + 1].eps)
                       if i + 1 < len(self.layers) else
                       (self.norm, self.norm_eps) if lm_gemv and keep is None else None)
                pre = None
                if down and n > 1 and nxt is not None:
                    pre = self._gemv(a, (L.down,), None, residual=h, prenorm=nxt)[1:]
                elif down:
                    self._gemv(a, (L.down,), None, residual=h)
                else:
                    h.addmm_(a, L.down.t())
            elif self.triton and L.mlp_bias is None:
                # Large prefills: gate and up into the halves of one buffer, lmfuse's swiglu
                # (one pass, where SiLU and the product took two), the residual in the down
                # GEMM (H100, 8 x 1024 tokens: the SiLU, product and two residual passes took
                # 0.28 ms a layer, the swiglu takes 0.13).
                x = self._rms_norm(h, L.norm_post, L.eps_post, self.pdl_tail)
                a = swiglu(_linears(x, (L.gate, L.up), None), impl=self.impl)
                h.addmm_(a, L.down.t())
            else:
                x = self._rms_norm(h, L.norm_post, L.eps_post)
                gb, ub, db = L.mlp_bias or (None, None, None)
                a = F.silu(F.linear(x, L.gate, gb)) * F.linear(x, L.up, ub)
                h = h + F.linear(a, L.down, db)
        if keep is not None:
            h = h.index_select(0, keep)
        if lm_gemv:
            # The GEMV's tiles beat cuBLAS on the long vocabulary (H100, CUDA-graph replays,
            # V 128256: 16 rows 177 vs 191 us, 64 rows 185 vs 198, bench/sweep_gemv.py
            # --shapes lm_head; one row, the final norm inside, 178.7 vs 193.3 us with the
            # norm and the argmax, _gemv_config).
            norm = None
            if h.shape[0] == 1 and pre is None:
                x, rs, norm = h, None, (self.norm, self.norm_eps)
            else:
                x, rs = pre or (self._rms_norm(h, self.norm, self.norm_eps), None)
            if argmax:  # the greedy tokens from the GEMV's tiles
                return self._gemv(x, (self.lm_head,), argmax=True, row_scale=rs, norm=norm,
                                  tokens=tokens, out=out)
            logits = self._gemv(x, (self.lm_head,), row_scale=rs, norm=norm, out=out)
        else:
            x = self._rms_norm(h, self.norm, self.norm_eps, self.pdl_tail)
            if out is None:
                logits = F.linear(x, self.lm_head, self.lm_bias)
            elif self.lm_bias is None:
                logits = torch.mm(x, self.lm_head.t(), out=out)
            else:
                logits = torch.addmm(self.lm_bias, x, self.lm_head.t(), out=out)
        return (logits, greedy(logits, out=tokens)) if argmax else logits

    def _rms_norm(self, h: torch.Tensor, w: torch.Tensor, eps: float,
                  pdl: int | None = None) -> torch.Tensor:
        if self.triton and h.is_contiguous():
            return _launch_rms_norm(h, w, eps, 0.0, pdl=self.pdl if pdl is None else pdl)[0]
        return rms_norm(h, w, eps=eps, impl=self.impl)

    def _gemv(self, x: torch.Tensor, weights: tuple[torch.Tensor, ...], biases: Any = None,
              **kw: Any) -> torch.Tensor:
        return _gemv(x, weights, biases, pdl=self.pdl, **kw)

    def _attention(self, q: torch.Tensor, i: int, L: _Layer, table: torch.Tensor,
                   after: torch.Tensor, tail: bool = False) -> torch.Tensor:
        """``tail``: a library's kernel follows (PDL's mode 2: it launches once this
        one's programs have exited)."""
        cache = self.cache
        args = (q, cache.k_caches[i], cache.v_caches[i], after)
        kw = dict(block_table=table, scale=L.scale, window_size=L.window,
                  k_scale=cache.k_scales[i], v_scale=cache.v_scales[i])
        if self.native and q.dtype == torch.float32:
            out = native_decode(q, cache.k_caches[i], cache.v_caches[i], after, table,
                                L.scale, L.window)
            if out is not None:
                return out
        if not self.triton:
            return decode_attention(*args, **kw, impl=self.impl)
        # The op's own launch, with the PDL flag its public signature does not take (the
        # inputs are laid out as it wants them: contiguous q, table and lengths).
        return launch_decode_attention(
            *args, table, L.scale, L.window, kw["k_scale"], kw["v_scale"], self.impl,
            pdl=self.pdl_tail if tail and self.pdl_attention else self.pdl_attention)

    def _rope_append(self, qkv: torch.Tensor, L: _Layer, i: int, table: torch.Tensor,
                     before: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        if self.rope_kernel:
            return _launch_rope_append(qkv, self.cos, self.sin, before, table,
                                       cache.k_caches[i], cache.v_caches[i], L.q_norm,
                                       L.k_norm, L.qk_eps, cache.k_scales[i],
                                       cache.v_scales[i], self.hq, self.hkv, self.d, self.pdl)
        return rope_append_reference(qkv, self.cos, self.sin, before, table,
                                     cache.k_caches[i], cache.v_caches[i], L.q_norm, L.k_norm,
                                     L.qk_eps, cache.k_scales[i], cache.v_scales[i], self.hq,
                                     self.hkv, self.d)


def _linears(x: torch.Tensor, weights: tuple[torch.Tensor, ...],
             biases: tuple[Any, ...] | None) -> torch.Tensor:
    """``[x @ W0.T (+ b0) | x @ W1.T (+ b1) | ...]``: each GEMM writes its columns of one
    ``[n, sum N]`` buffer (BLAS takes the row stride as the output's leading dimension: no
    concatenation pass; the weights read in place)."""
    out = x.new_empty((x.shape[0], sum(w.shape[0] for w in weights)))
    col = 0
    for j, w in enumerate(weights):
        part = out[:, col:col + w.shape[0]]
        b = None if biases is None else biases[j]
        if b is None:
            torch.mm(x, w.t(), out=part)
        else:
            torch.addmm(b, x, w.t(), out=part)
        col += w.shape[0]
    return out


def _eps(norm: Any) -> float:
    for name in ("variance_epsilon", "eps", "epsilon"):
        v = getattr(norm, name, None)
        if isinstance(v, (int, float)):
            return float(v)
    return 1e-6


# --- rotary + cache append -------------------------------------------------------------------

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


_ROPE_ROWS_FROM = 64  # more rows than this: several a program

#: Triton's interpreter runs a launch's programs one after another, each costing it about
#: 15-30 ms whatever its tile's width (numpy does a tile's lanes at once): there the
#: one-row GEMV and the rotary append take wider tiles (fewer programs, the same kernel
#: code) unless this is set, as a test does to run the GPU's tiles in the interpreter.
_GPU_TILES_IN_INTERPRETER = False


def _interpreter_tiles() -> bool:
    return not _GPU_TILES_IN_INTERPRETER and interpreter_active()


def _launch_rope_append(qkv, cos, sin, pos, table, k_cache, v_cache, q_norm, k_norm, eps,
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


def _prenorm_unfused(h: torch.Tensor, prenorm: tuple[torch.Tensor, float]
                     ) -> tuple[torch.Tensor, RowNorm]:
    """``(h * g, its RowNorm)`` of the stored ``h [n, H]`` by torch ops (one sum a row),
    where a kernel that would leave them does not run."""
    return prenorm_reference(h, *prenorm)[0], RowNorm(
        h.float().square().sum(-1, keepdim=True), h.shape[1], float(prenorm[1]))


def _embed(ids: torch.Tensor, table: torch.Tensor,
           prenorm: tuple[torch.Tensor, float] | None = None, pdl: int = 0) -> Any:
    """The step's residual stream: a new ``[n, H]`` tensor of the rows ``table[ids]``
    (``embed_kernel``; the engine checked the ids). ``prenorm = (g, eps)``: returns ``(h,
    xw, rn)`` as ``_gemv``'s prenorm does, the first RMSNorm's work done in the gather."""
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


def _gemv_config(n_out: int, K: int, block_m: int, gated: bool, itemsize: int = 2,
                 smem: int | None = None, rope: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages): the fastest CUDA-graph replays in
    ``bench/sweep_gemv.py`` on an H100 (the decode shapes of a 2048-wide model at 16 and 64
    rows), kept under the shared memory the pipeline's stages take. One row
    (``block_m == 1``, no dot tile): two features a program, K in tiles of up to 2048
    (``bench/sweep_gemv_chain.py``, H100, launches chained as in a decode step: QKV 9.9 ->
    6.8 us, Wo 7.5 -> 5.9, gate/up 24.9 -> 24.2 against the 16-row dot tile). ``smem``:
    the device's shared memory a program may use (the stages then fit it too). ``rope``:
    the QKV GEMV with the rotation inside (``BLOCK_N`` features of each half of a head)."""
    lm_head = not gated and n_out >= LM_HEAD_MIN_FEATURES
    if block_m == 1 and not lm_head:
        return 2, min(2048, next_pow2(K, 16)), 4, 3
    warps, stages = 4, 3
    limit = 200 * 1024
    if lm_head and block_m == 1:
        # One row (a scratch sweep of BLOCK_N 8-256, BLOCK_K 32-512, 4-16 warps, H100, V
        # 128256, K 2048, graphs of 20: with the final norm and the argmax inside, 178.7 us
        # at 256 x 128 and 16 warps, 182.7 at 64 x 128 and 8, against 193.3 for the
        # RMSNorm, cuBLAS and the argmax's two launches).
        block_n, block_k, warps = (256, 128, 16) if n_out % 256 == 0 else (64, 128, 8)
        limit = 220 * 1024
    elif lm_head:
        # An LM head (bench/sweep_gemv.py --shapes lm_head, H100: the fastest of BLOCK_N 16
        # to 128, BLOCK_K 128 to 512, 4/8 warps, 3/4/6 stages; 2.96 / 2.84 TB/s). 64 rows:
        # 2 stages, two programs an SM (a scratch sweep with BLOCK_N 256 and 2-6 stages,
        # 2026-11-27: 183.1 against 185.8 us at 4 stages).
        block_n, block_k, stages = 128, (256 if block_m == 16 else 128), \
            (3 if block_m == 16 else 2)
        limit = 220 * 1024
    elif gated:
        block_n, block_k = (32 if block_m == 16 else 64), 128
    else:
        block_n = 16 if n_out <= 2048 else 32 if n_out <= 16384 else 64
        block_k = 256 if block_n == 16 and block_m == 16 else 128
        if block_m == 64:  # chained (sweep_gemv_chain, H100): QKV 9.9 -> 8.4 us, Wo 9.2 -> 7.6
            block_k, stages = 256, 4
        split = _gemv_split(n_out, K, block_m, gated)
        if block_m == 16 and split == 1 and n_out > 2048:  # QKV: 10.22 -> 8.26 us
            block_k, stages = 256, 4
        elif block_m == 16 and split > 1:  # Wo 7.71 -> 7.08 us, Wd 15.84 (cuBLAS 17.4)
            block_n, block_k, stages = (64 if K <= 2048 else 32), 128, 4
        elif block_m == 64 and split > 1:  # Wd 17.64 us (cuBLAS 18.63)
            block_n, block_k, stages = 32, 256, 4
    if rope:
        block_n = 16
    if smem is not None:
        limit = min(limit, smem - 8 * 1024)  # room for the kernel's own scratch
    tiles = 2 if gated or rope else 1
    while block_k > 64 and (block_m + tiles * block_n) * block_k * itemsize * stages > limit:
        block_k //= 2
    while stages > 2 and (block_m + tiles * block_n) * block_k * itemsize * stages > limit:
        stages -= 1
    return block_n, block_k, warps, stages


def _row_tile(n: int) -> int:
    """The GEMV's row tile (BLOCK_M) for ``n`` rows: 1 (no dot tile), 16, 32 or 64."""
    return 1 if n == 1 else 16 if n <= 16 else 32 if n <= 32 else 64


def _gemv_split(n_out: int, K: int, block_m: int, gated: bool) -> int:
    """How many programs share a tile's K range (``gemv_kernel``'s SPLIT_K), where it was
    measured to pay (``bench/sweep_gemv_chain.py --dot --split 1,2,4,8``, H100, 8 launches
    chained in a graph, a 2048-wide model): 16 rows, output 2048 (Wo, Wd): 4; 64 rows, the
    long K of Wd (8192): 2; else 1."""
    if gated:
        return 1
    if block_m == 16 and n_out <= 2048:
        return 4
    if block_m == 64 and n_out <= 2048 and K >= 4 * n_out:
        return 2
    return 1


# (device, workspace elements, tiles) -> (float32 partials, int32 counts): kept for the
# process's life (CUDA graphs hold their addresses; the counts return to zero after each
# launch, so any later launch may use them). Launches that share them must not overlap:
# the decode steps of one process run on one stream at a time (a graph's capture stream
# included), which orders them. Not keyed by stream: a graph is captured on another stream
# than its warm-up ran on, and must find the warm-up's buffers.
_SPLIT_BUFFERS: dict[tuple[str, int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _split_buffers(device: torch.device, elements: int, tiles: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    key = (str(device), elements, tiles)
    if key not in _SPLIT_BUFFERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # The zeroed counts would only be recorded, not set: warm up before capturing.
            raise RuntimeError(f"{_OP}: a split-K GEMV of a new shape inside a CUDA-graph "
                               "capture; run it once before capturing")
        _SPLIT_BUFFERS[key] = (torch.empty(elements, dtype=torch.float32, device=device),
                               torch.zeros(tiles, dtype=torch.int32, device=device))
    return _SPLIT_BUFFERS[key]


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


def _rope_gemv_takes(n: int, d: int) -> bool:
    """Whether the QKV GEMV of ``n`` rows can rotate and append itself (several rows, and a
    head's half a multiple of its 16-dim tiles)."""
    return 1 < n <= GEMV_MAX_ROWS and d % 2 == 0 and (d // 2) % 16 == 0


def _gemv(x: torch.Tensor, weights: tuple[torch.Tensor, ...], biases: Any = None, *,
          residual: torch.Tensor | None = None, gated: bool = False,
          pdl: int = 0, split_k: int | None = None,
          norm: tuple[torch.Tensor, float] | None = None,
          rope: RopeAppend | None = None, argmax: bool = False,
          prenorm: tuple[torch.Tensor, float] | None = None,
          row_scale: RowNorm | None = None, tokens: torch.Tensor | None = None,
          out: torch.Tensor | None = None) -> Any:
    """``gemv_kernel`` launched: a new ``[n, N]`` output (in ``out`` where given, a
    contiguous tensor of ``x``'s dtype), or ``residual`` updated in place.
    ``pdl``: with programmatic dependent launch (``lmfuse._pdl``). ``split_k``: programs
    per tile along K (default :func:`_gemv_split`'s; not with ``gated``, ``norm`` or
    ``rope``). ``norm = (g, eps)``: ``x`` RMS-normed (weight ``g``) inside the kernel.
    ``rope`` (``weights`` = Wq, Wk, Wv): the projections' rotary and cache append inside
    (:func:`rope_append_reference` of the float32 projections); returns the rotated
    queries ``[n, hq d]``. ``argmax`` (one matrix, no residual, not gated): returns ``(y,
    each row's argmax)``, int64 ``[n]`` as ``torch.argmax`` of ``y`` gives it (ties and NaN
    included), taken from the tiles as they are stored, in ``tokens`` where given.
    ``prenorm = (g, eps)`` (with ``residual``, one matrix, not ``norm``): returns ``(h, xw,
    rn)``, the updated residual stream, ``h * g`` and its :class:`RowNorm`
    (:func:`prenorm_reference`); ``row_scale``
    (a :class:`RowNorm`): each row's products scaled by its factor, so that ``_gemv(xw, W,
    row_scale=rn)`` is the GEMV of ``rms_norm(h)``."""
    if (gated or norm is not None or rope is not None) and split_k is not None \
            and split_k > 1:
        raise ValueError(f"{_OP}: the gated, normed or rotating GEMV does not split K "
                         f"(split_k={split_k})")
    if prenorm is not None and (residual is None or len(weights) != 1 or norm is not None
                                or argmax):
        raise ValueError(f"{_OP}: the GEMV's prenorm takes a residual, one matrix, no norm "
                         "and no argmax")
    if row_scale is not None and (norm is not None or prenorm is not None):
        raise ValueError(f"{_OP}: the GEMV's row_scale takes neither norm nor prenorm")
    if rope is not None:
        return _gemv_rope(x, weights, biases, rope, pdl, row_scale)
    n, K = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    ns = [w.shape[0] for w in weights]
    n_out = ns[0] if gated else sum(ns)
    block_m = _row_tile(n)
    block_n, block_k, warps, stages = _gemv_config(n_out, K, block_m, gated, x.element_size(),
                                                   shared_memory(x.device))
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
    split = (1 if norm is not None or argmax else _gemv_split(n_out, K, block_m, gated)
             if split_k is None else split_k)
    k_split = cdiv(cdiv(K, split), block_k) * block_k
    split = cdiv(K, k_split)  # no empty split
    grid = (n_out // block_n, cdiv(n, block_m), split)
    tiles = grid[0] * grid[1]
    ws, count = (_split_buffers(x.device, split * tiles * block_m * block_n, tiles)
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


def _gemv_rope(x: torch.Tensor, weights: tuple[torch.Tensor, ...], biases: Any,
               r: RopeAppend, pdl: int, row_scale: RowNorm | None = None) -> torch.Tensor:
    n, K = x.shape
    ns = [w.shape[0] for w in weights]
    if ns != [r.hq * r.d, r.hkv * r.d, r.hkv * r.d]:
        raise ValueError(f"{_OP}: the rotating GEMV takes Wq, Wk, Wv of {r.hq}, {r.hkv}, "
                         f"{r.hkv} heads of {r.d} (got {ns} rows)")
    if x.stride(-1) != 1:
        x = x.contiguous()
    n_out = sum(ns)
    block_m = _row_tile(n)
    block_n, block_k, warps, stages = _gemv_config(n_out, K, block_m, False, x.element_size(),
                                                   shared_memory(x.device), rope=True)
    if not _rope_gemv_takes(n, r.d) or (r.d // 2) % block_n:
        qkv = gemv_reference(x.float(), weights, biases,  # float32, as the kernel's
                             row_scale=None if row_scale is None else row_scale.scale())
        q = rope_append_reference(qkv, r.cos, r.sin, r.pos, r.table, r.k_cache, r.v_cache,
                                  None, None, 0.0, r.k_scale, r.v_scale, r.hq, r.hkv, r.d)
        return q.to(x.dtype).view(n, r.hq * r.d)
    y = torch.empty((n, ns[0]), dtype=x.dtype, device=x.device)
    fp8 = r.k_cache.dtype == torch.float8_e4m3fn
    b = list(biases) if biases is not None else [weights[0]] * 3
    kc, vc = r.k_cache, r.v_cache
    grid = (n_out // (2 * block_n), cdiv(n, block_m), 1)
    _kernels().gemv_kernel[grid](
        x, weights[0], weights[1], weights[2], b[0], b[1], b[2], y, y, n, K, ns[0], ns[1],
        x.stride(0), y.stride(0), y.stride(0), y, y, K,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=biases is not None,
        RESIDUAL=False, GATED=False, EVEN_K=K % block_k == 0, PDL=pdl,
        ROPE=True, HALF=r.d // 2, COS=r.cos, SIN=r.sin, POS=r.pos, TABLE=r.table, KC=kc,
        VC=vc, K_SCALE=r.k_scale if fp8 else r.cos, V_SCALE=r.v_scale if fp8 else r.cos,
        stride_kblk=kc.stride(0), stride_krow=kc.stride(1), stride_vblk=vc.stride(0),
        stride_vrow=vc.stride(1), stride_tb=r.table.stride(0), num_blocks=kc.shape[0],
        positions=r.cos.shape[0], BLOCK_LEN=kc.shape[1], FP8=fp8,
        ROW_SCALE=row_scale is not None, **_row_norm_args(None, row_scale),
        eps=0.0 if row_scale is None else row_scale.eps, num_warps=warps, num_stages=stages,
        **_pdl.launch_options(pdl))
    return y
