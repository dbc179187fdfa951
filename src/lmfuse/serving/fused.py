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
kernels. The GEMV kernels serve up to :data:`fused_ops.GEMV_MAX_ROWS` rows; larger batches (long
prefills) use cuBLAS, each projection group's GEMMs writing the columns of one buffer, the
residual adds in the GEMMs' epilogues and the MLP's activation through lmfuse's swiglu.

On a Hopper GPU the step's Triton kernels are launched with programmatic dependent launch
(``lmfuse._pdl``): each is scheduled while the one before it runs and waits for it on the
GPU, which hides a launch and ramp per kernel (H200, 2026-11-26: a B1 step 0.69 -> 0.66 ms,
B64 0.93 -> 0.90 ms, the same tokens). ``LMFUSE_PDL=0`` turns it off.

One row, captured in a graph, with PDL: after each layer's QKV GEMV a side branch of the
graph asks the L2 cache for the weights read next (``l2_prefetch_kernel``: ``Wo`` whole and
the first rows of gate and up, :func:`fused_ops.l2_prefetch_bytes`: 16 MiB on an H200, off
on GPUs where it is not measured), fetched while the rotary append, the attention and its
merge keep the memory bus idle (about 8 us a layer on an H200); the branch joins the step
at its end. H200, the benchmark model's B1 step, three alternating rounds: 0.5124-0.5133 ->
0.5028-0.5042 ms; at 16 rows the same 16 MiB lost (0.650-0.674 ms against 0.634-0.645
without; ``bench/results/h200-2026-11-28-generate-l2prefetch-ab.json``), so it stays at one
row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .. import _pdl
from .._dispatch import select_impl
from .._launch import KERNEL_DTYPES, is_pow2
from ..attention.kv_cache import PagedKVCache
from ..activations import swiglu
from ..attention.ops import decode_attention, launch_decode_attention, native_decode
from ..norm.ops import launch_rms_norm as _launch_rms_norm
from ..norm.ops import rms_norm
from . import fused_ops
from .fused_ops import RopeAppend
from .fused_reference import rope_append_reference
from .sampling import greedy

#: ``config.model_type`` values whose decode runs the fused layers.
FUSED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# Rotary variants whose angles depend on the position alone (a table per position holds them).
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")
_OP = "Generator"


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
    return replaced_modules(model)


def replaced_modules(model: Any) -> str | None:
    """Why the fused layers cannot stand in for the modules of ``model`` (of a supported
    type: :func:`unsupported` checks that first) whose weights they read (None: they can;
    the Generator asks again at each ``generate``): a forward hook or pre-hook (steering,
    logit bias, patching), a module of a class of neither transformers nor torch.nn (a
    subclass with its own forward), an LM head that is not a plain ``nn.Linear``, or a
    forward set on the instance other than ``apply_lmfuse``'s (which computes the same).
    The model's forward honours all of them."""
    from torch.nn.modules import module as nn_module

    if (nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks
            or getattr(nn_module, "_global_forward_hooks_always_called", None)):
        return "global module forward hooks (torch.nn.modules.module)"
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        return f"an LM head of type {type(head).__name__} (a plain nn.Linear only)"
    embed = model.model.embed_tokens
    if type(embed) is not torch.nn.Embedding:
        return f"token embeddings of type {type(embed).__name__} (a plain nn.Embedding only)"
    for name, m in model.named_modules():
        if any(not _transformers_own(h) for h in (*m._forward_hooks.values(),
                                                  *m._forward_pre_hooks.values())):
            return f"forward hooks on {name or 'the model'}"
        own = type(m).__module__.split(".")[0]
        if own not in ("transformers", "torch"):
            return f"{name or 'the model'} of class {type(m).__qualname__} ({own})"
        patched = m.__dict__.get("forward")
        if patched is not None and not (
                type(patched).__module__.startswith("lmfuse.")  # apply_lmfuse's
                or getattr(patched, "__module__", "").startswith("torch.")):  # torch.compile's
            return f"a forward set on {name or 'the model'} itself"
    return None


def _transformers_own(hook: Any) -> bool:
    """A hook transformers installs itself, which leaves the values alone: its output
    capture (installed by a forward with ``output_hidden_states``, acting only while
    capturing) and ``enable_input_require_grads``' (gradient checkpointing)."""
    return getattr(hook, "__module__", None) in ("transformers.utils.output_capturing",
                                                 "transformers.modeling_utils")


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
        # One-row steps in a graph: the weights after the attention into L2 on a side
        # branch (module docstring); PDL's GPUs (Hopper and later) have the bulk prefetch.
        self.l2_prefetch = fused_ops.l2_prefetch_bytes(self.device) if self.pdl else 0
        # The split-K GEMVs' partials and counts, this decoder's own (fused_ops.split_buffers:
        # two Generators' steps, on two streams, never share them).
        self.split_buffers: dict = {}
        self._side = torch.cuda.Stream(self.device) if self.l2_prefetch else None
        self._prefetch_loaded = False  # its kernel launched once outside a capture
        self.hq = int(config.num_attention_heads)
        self.hkv = cache.kv_heads
        self.d = cache.head_dim
        # A prefill's query chunk: the decode kernel's 64 query rows a program (a KV head's
        # group x the chunk's positions).
        self.chunk = max(1, 64 // (self.hq // self.hkv))
        # The rotary kernel holds a head's halves in one power-of-two tile.
        self.rope_kernel = self.triton and self.d % 2 == 0 and is_pow2(self.d // 2)
        # Several rows: the QKV GEMV rotates and appends itself (models without a q/k norm).
        self.rope_gemv = self.rope_kernel and fused_ops.rope_gemv_takes(2, self.d)
        self.embed = inner.embed_tokens.weight
        head = model.get_output_embeddings()
        self.lm_head, self.lm_bias = head.weight, getattr(head, "bias", None)
        # The LM head's GEMV: a vocabulary of at least LM_HEAD_MIN_FEATURES in whole
        # 128-feature tiles, a contiguous matrix, no bias.
        V = self.lm_head.shape[0]
        self.lm_gemv = (self.lm_bias is None and V >= fused_ops.LM_HEAD_MIN_FEATURES
                        and V % 128 == 0 and self.lm_head.is_contiguous())
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
        # One row captured in a graph: the L2 prefetch's side branch (module docstring).
        # Also the first one-row step outside a capture (a graph's warm-up), so that the
        # kernel is compiled and loaded before any capture launches it: launched first
        # inside one, it invalidated the capture on freshly started H200s.
        prefetch = (self._side is not None and self.triton and ids.shape[0] == 1
                    and prefill is None and (torch.cuda.is_current_stream_capturing()
                                             or not self._prefetch_loaded))
        self._prefetch_loaded |= prefetch
        try:
            return self._forward(ids, table, before, after, argmax, tokens, prefill, out,
                                 prefetch)
        finally:
            if prefetch:  # the branch joins the step
                torch.cuda.current_stream(self.device).wait_stream(self._side)

    def _forward(self, ids, table, before, after, argmax, tokens, prefill, out,
                 prefetch) -> Any:
        n = ids.shape[0]
        kernels = self.triton and n <= fused_ops.GEMV_MAX_ROWS
        keep = None if prefill is None else prefill.keep
        lm_gemv = kernels and self.lm_gemv
        # Several rows: (h * g, its RowNorm) of the next RMSNorm, left by the kernel that
        # wrote h (the gather, a residual GEMV's prenorm epilogue) for the GEMV that takes
        # the norm's output (row_scale).
        pre = None
        if kernels and n > 1:
            h, *pre = fused_ops.embed(ids, self.embed,
                                      (self.layers[0].norm_in, self.layers[0].eps),
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
            if prefetch:
                self._prefetch(L)
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
                # feature tiles: else fused_ops.gemv's float32 fallback.)
                tile = fused_ops.row_tile(n)
                down = ((n == 1 or fused_ops.gemv_split(*L.down.shape, tile, False,
                                                        self.device) > 1)
                        and L.down.shape[0] % fused_ops.gemv_config(
                            *L.down.shape, tile, False, device=self.device)[0] == 0)
                norm = rs = None
                if n == 1:
                    x, norm = h, (L.norm_post, L.eps_post)
                else:
                    x, rs = pre or (self._rms_norm(h, L.norm_post, L.eps_post), None)
                a = fused_ops.gemv(x, (L.gate, L.up), None, gated=True, norm=norm, row_scale=rs,
                          pdl=self.pdl if down else self.pdl_tail,
                          workspace=self.split_buffers)
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
            # norm and the argmax, fused_ops.gemv_config).
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

    def _prefetch(self, L: _Layer) -> None:
        """A side branch from here (a graph being captured) that asks the L2 cache for
        ``L``'s weights after its attention (:func:`fused_ops.prefetch_ranges`)."""
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            fused_ops.l2_prefetch(fused_ops.prefetch_ranges(L.o, L.gate, L.up,
                                                            self.l2_prefetch))

    def _rms_norm(self, h: torch.Tensor, w: torch.Tensor, eps: float,
                  pdl: int | None = None) -> torch.Tensor:
        if self.triton and h.is_contiguous():
            return _launch_rms_norm(h, w, eps, 0.0, pdl=self.pdl if pdl is None else pdl)[0]
        return rms_norm(h, w, eps=eps, impl=self.impl)

    def _gemv(self, x: torch.Tensor, weights: tuple[torch.Tensor, ...], biases: Any = None,
              **kw: Any) -> torch.Tensor:
        return fused_ops.gemv(x, weights, biases, pdl=self.pdl, workspace=self.split_buffers,
                              **kw)

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
            return fused_ops.launch_rope_append(qkv, self.cos, self.sin, before, table,
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
