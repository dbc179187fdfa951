"""lmfuse in Megatron-Core ``GPTModel``s built with the local layer spec: :func:`patch`.

    from lmfuse.megatron import patch
    model = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), ...)
    patch(model)          # nothing else in the training script changes

Tested on the CPU with megatron-core 0.16.1 and 0.19.2 (``tests/integrations/
test_megatron_core.py``; Megatron's own CUDA-only calls pointed at the CPU for the
unpatched reference): every class, attribute and method used below has the same name and
meaning in both (see "Versions"). Only the *instances* of one model are changed, never a
class: a module's ``forward`` (or the model's ``_postprocess`` /
``compute_language_model_loss``) becomes an instance attribute, or one parameter-free child
module is swapped. Parameters, buffers, ``state_dict`` keys and values,
``sharded_state_dict`` and checkpoints are unchanged, and the patches go along with a deep
copy (Megatron's process groups cannot be copied: share them through the ``memo``).

What is patched, class by class:

``megatron.core.transformer.dot_product_attention.DotProductAttention`` (the local core
attention; also the core of MLA's local spec), flag ``softmax``:
    its child ``scale_mask_softmax`` (Megatron's ``fusions.fused_softmax.
    FusedScaleMaskSoftmax``, no parameters) is replaced by an :class:`lmfuse.
    FusedScaleMaskSoftmax` with the same mask type, scale (``apply_query_key_layer_scaling``'s
    layer number), window and fp16/bf16 flags, and its ``forward`` by Megatron's own forward
    written out again with two differences: the ``[b * np, sq, sk]`` scores go to a fresh
    tensor (Megatron takes a CUDA tensor from ``parallel_state.get_global_memory_buffer()``;
    the scores are not saved for backward, so the caching allocator serves the same
    memory), and the dropout's CUDA RNG fork runs only when the dropout does something
    (training with ``attention_dropout > 0``). Scores, GQA repetition, the ``softmax_offset``
    sink (``softmax_type`` "off-by-one"/"learnable"), the context matmul and the output
    layout are Megatron's. The softmax is then fused for every shape and dtype (Megatron's
    CUDA kernel needs fp16/bf16, ``16 < sk <= 4096`` and multiples of 4, and falls back to
    an unfused PyTorch softmax otherwise, always when there is a ``softmax_offset``); masked
    keys are excluded exactly (Megatron fills them with -10000). A causal mask type adds the
    causal band to the given mask (Megatron's CUDA kernel ignores the mask then, its PyTorch
    path uses only the mask; with Megatron's usual causal mask all three agree). Calls with
    ``attention_bias`` or ``packed_seq_params`` (which Megatron's local attention refuses),
    or with keyword arguments a later version may add, run the class's forward (with the
    lmfuse softmax). Subclasses that override ``forward`` are left as they are.

``megatron.core.transformer.mlp.MLP`` (dense MLPs and each local expert of a
``SequentialMLP``), flag ``activations``:
    ``forward`` becomes Megatron's forward (``linear_fc1`` with ``skip_bias_add``, the
    activation, ``linear_fc2``, the expert output bias scaled by ``per_token_scale``) with
    the activation and fc1's bias in one lmfuse kernel: gated SiLU -> :func:`lmfuse.swiglu`,
    gated GELU -> :func:`lmfuse.geglu`, GELU -> :func:`lmfuse.bias_gelu` (Megatron's
    ``F.gelu`` under ``bias_activation_fusion``, which Megatron itself runs as the tanh
    approximation, or its tanh-GELU functions ``openai_gelu``/``fast_gelu``), gated
    Quick-GELU -> :func:`lmfuse.quick_geglu` (``glu_linear_offset``,
    ``activation_func_clamp_value``), squared ReLU -> :func:`lmfuse.squared_relu`; with a
    ``per_token_scale`` (MoE routing probabilities) the ``weighted_*`` variants.
    ``activation_func_fp8_input_store`` is honoured where Megatron honours it. Left as they
    are (listed in the summary with the reason): exact erf-GELU without
    ``bias_activation_fusion`` (lmfuse's GELU is the tanh one), SiLU GLUs with a clamp or
    linear offset outside ``bias_activation_fusion``, other activations,
    ``use_te_activation_func``, and MLP subclasses with their own ``forward`` (e.g.
    ``SharedExpertMLP``). A call no lmfuse kernel covers (a ``per_token_scale`` with GELU)
    runs the class's forward, which does what Megatron does.

``torch.nn.RMSNorm`` (what Megatron's ``WrappedTorchNorm`` builds for
``normalization="RMSNorm"``: input, pre-MLP, final and q/k norms) and
``megatron.core.transformer.torch_norm.L2Norm``, flag ``rms_norm``:
    ``forward`` becomes :func:`lmfuse.rms_norm` with the module's ``weight`` and ``eps``
    (torch's default eps when it is ``None``; no weight for ``L2Norm``).

``torch.nn.LayerNorm`` (what ``WrappedTorchNorm`` builds for ``normalization="LayerNorm"``,
the local spec's norm where apex is not installed), flag ``layer_norm``:
    ``forward`` becomes :func:`lmfuse.layer_norm` with the module's ``weight``, ``bias`` and
    ``eps``, in the dtype torch's forward gives (x's; float32 under CUDA autocast, whose
    float32 list has ``layer_norm``); a dtype mix PyTorch refuses runs torch's forward (its
    error). Megatron's ``layernorm_zero_centered_gamma`` (a ``weight + 1`` scale, lmfuse's
    ``weight_offset=1.0``) never reaches a ``torch.nn.LayerNorm``: ``WrappedTorchNorm``
    asserts it off ("zero_centered_gamma not supported by torch LayerNorm"), in 0.16.1 as
    in Megatron-LM's later main branch. Apex's ``FusedLayerNorm`` (the local spec's
    LayerNorm where apex is installed, which does apply it) and Transformer Engine's norms
    (the final norm Megatron builds even with the local spec when TE is installed) stay as
    they are, listed in the summary.

``megatron.core.models.gpt.GPTModel``, flag ``loss``:
    ``compute_language_model_loss(labels [b, s], logits [s, b, V/tp])`` becomes
    :func:`lmfuse.cross_entropy` over the tensor-parallel group (per-token float32 losses
    ``[b, s]``, as Megatron returns them; whichever of Megatron's three implementations the
    config chose). And where the logits need not exist, they are not formed: the model's
    ``_postprocess`` (which ``forward`` and Megatron's fine-grained 1F1B schedule both call)
    is wrapped so that, when it is given ``labels``, the ``output_layer``
    (``ColumnParallelLinear``) returns an unformed-logits handle holding its input and
    weight instead of the ``[s, b, V/tp]`` logits, and ``compute_language_model_loss`` runs
    :func:`lmfuse.megatron.linear_cross_entropy` on it: the tensor-parallel vocabulary split
    of the output layer, and under sequence parallelism the hidden rows gathered over the
    group as the output layer would (each rank gets its rows' gradient, summed over the
    group, as Megatron's reduce-scatter gives). Tied output weights (the word embeddings)
    work alike. The handle is never made (the logits are) without labels, in inference
    (an ``inference_context``), with ``runtime_gather_output=True`` or a gathering output
    layer (``parallel_output=False``), with 0.19's ``output_processor``, and in models with
    multi-token prediction, MuP output scaling, ``defer_embedding_wgrad_compute`` or the
    config logger on, which read the logits; the summary says which applies.
    Megatron's loss is per token (the training script masks and averages it), so the
    linear cross-entropy's backward recomputes the logits chunk by chunk instead of keeping
    them: extra GEMM time for ``[tokens, V]`` less memory. Labels outside the vocabulary
    (BERT's -1 padding, -100) get loss 0 and no gradient, where Megatron gives them the
    log-sum-exp of their logits: the same once the loss mask of 0 they come with applies.

Refused: models holding Transformer Engine modules (``transformer_impl="transformer_engine"``:
``TEDotProductAttention``, ``TELayerNormColumnParallelLinear``, ``TERowParallelLinear``,
``TEGroupedMLP``, ...), except TE's norms, which are left as they are (ValueError naming
``model``); anything that is not a Megatron-Core module (TypeError).

Versions: 0.16.1 and 0.19 have the same ``DotProductAttention`` (file unchanged), the same
``MLP.forward`` (0.19 calls its linears through ``typed_torch.apply_module``, which is the
plain call), the same ``FusedScaleMaskSoftmax`` attributes, ``WrappedTorchNorm`` building
``torch.nn.RMSNorm`` and ``torch.nn.LayerNorm``, ``ColumnParallelLinear.forward(input_,
weight=None, runtime_gather_output=None)``,
``LanguageModule.compute_language_model_loss(labels, logits)``
and ``GPTModel._postprocess(..., labels, ...)``, which calls ``self.output_layer`` and then
``self.compute_language_model_loss``. 0.19 adds ``_scale_logits`` between them (MuP; a
no-op unless ``use_mup``), the ``output_processor`` hook, and an MTP path that reads the
logits; the handle is not used in those cases. 0.19 also marks ``GPTModel`` deprecated in
favour of ``HybridModel``, whose ``forward`` calls the output layer itself: untested here;
its loss would get lmfuse's cross-entropy on formed logits only (``loss_note`` says so).
Megatron-Core is imported only when :func:`patch` runs.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ..activations import (bias_gelu, geglu, quick_geglu, squared_relu, swiglu,
                           weighted_quick_geglu, weighted_squared_relu, weighted_swiglu)
from ..cross_entropy import cross_entropy
from ..cross_entropy.ops import outside_vocab_ignored
from .._collectives import group_size
from ..norm import rms_norm as _rms_norm
from ..norm.ops import math_eps
from ..softmax import AttnMaskType, FusedScaleMaskSoftmax
from . import _activation_name, _check_flags, _Forward, _instance_attr, _layer_norm_like

__all__ = ["patch"]

_TE_MODULES = ("transformer_engine", "megatron.core.extensions.transformer_engine")


# --- instance-level forwards -------------------------------------------------------------------


def _set(m: torch.nn.Module, name: str, fn: Any) -> None:
    object.__setattr__(m, name, _Forward(fn, m))


def _group(group: Any) -> Any:
    """``group``, or ``None`` (one rank, no collective) for a group of one rank."""
    if group is None or torch.distributed.get_world_size(group) == 1:
        return None
    return group


# --- core attention ----------------------------------------------------------------------------


class _MegatronSoftmax(FusedScaleMaskSoftmax):
    """:class:`lmfuse.FusedScaleMaskSoftmax` in place of a DotProductAttention's
    ``scale_mask_softmax``: Megatron's settings, always the fused path."""


def _mask_type(value: Any) -> Optional[AttnMaskType]:
    name = getattr(value, "name", value)
    if isinstance(name, str) and name in AttnMaskType.__members__:
        return AttnMaskType[name]
    # Megatron's queries are the last sq keys (sq == sk in training): lmfuse's causal band
    # is bottom-right aligned already.
    return AttnMaskType.causal if name == "causal_bottom_right" else None


def _lmfuse_softmax(old: Any) -> Optional[_MegatronSoftmax]:
    mask_type = _mask_type(getattr(old, "attn_mask_type", None))
    if mask_type is None:
        return None
    return _MegatronSoftmax(
        input_in_fp16=bool(old.input_in_fp16), input_in_bf16=bool(old.input_in_bf16),
        attn_mask_type=mask_type, scaled_masked_softmax_fusion=True, mask_func=old.mask_func,
        softmax_in_fp32=bool(old.softmax_in_fp32), scale=old.scale,
        window_size=getattr(old, "window_size", None))


def _core_attention_forward(self: Any, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                            attn_mask_type: Any = None, attention_bias: Any = None,
                            packed_seq_params: Any = None, **kwargs: Any) -> torch.Tensor:
    """Megatron-Core's ``DotProductAttention.forward`` (0.16-0.19): ``query [sq, b, np, hn]``,
    ``key``/``value [sk, b, ng, hn]`` -> ``context [sq, b, np * hn]``; the softmax is
    ``self.scale_mask_softmax`` (lmfuse's), the scores a fresh tensor."""
    if attention_bias is not None or packed_seq_params is not None or kwargs:
        return type(self).forward(self, query, key, value, attention_mask,
                                  attn_mask_type=attn_mask_type, attention_bias=attention_bias,
                                  packed_seq_params=packed_seq_params, **kwargs)
    group = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
    if group > 1:  # GQA: each KV head repeated for its queries, as Megatron does
        key = key.repeat_interleave(group, dim=2)
        value = value.repeat_interleave(group, dim=2)
    sq, b, np_, _ = query.shape
    sk = key.shape[0]
    q = query.reshape(sq, b * np_, -1).transpose(0, 1)  # [b * np, sq, hn]
    k = key.reshape(sk, b * np_, -1).permute(1, 2, 0)  # [b * np, hn, sk]
    scores = torch.baddbmm(q.new_empty((b * np_, sq, sk)), q, k, beta=0.0,
                           alpha=self.softmax_scale)
    probs = self.scale_mask_softmax(scores.view(b, np_, sq, sk), attention_mask,
                                    self.softmax_offset)
    if self.training and self.attention_dropout.p > 0:
        if self.config.sequence_parallel:
            probs = self.attention_dropout(probs)
        else:
            from megatron.core import tensor_parallel

            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = self.attention_dropout(probs)
    v = value.reshape(sk, b * np_, -1).transpose(0, 1)  # [b * np, sk, hn]
    context = torch.bmm(probs.view(b * np_, sq, sk), v)
    context = context.view(b, np_, sq, -1).permute(2, 0, 1, 3).contiguous()  # [sq, b, np, hn]
    return context.view(*context.shape[:-2], self.hidden_size_per_partition)


# --- MLP activations ---------------------------------------------------------------------------

_WEIGHTED = ("swiglu", "quick_geglu", "squared_relu")


def _megatron_functions() -> dict[str, tuple[Any, ...]]:
    """Megatron's activation functions by kind (whichever of them this version has)."""
    import importlib

    def get(module: str, name: str) -> Any:
        try:
            return getattr(importlib.import_module(module), name, None)
        except ImportError:
            return None

    found = {
        "quick_gelu": (get("megatron.core.activations", "quick_gelu"),
                       get("megatron.core.fusions.fused_bias_geglu", "quick_gelu")),
        "squared_relu": (get("megatron.core.activations", "squared_relu"),),
        # tanh-approximated GELUs (lmfuse's formula, Megatron's constants)
        "gelu_tanh": (get("megatron.core.activations", "fast_gelu"),
                      get("megatron.core.transformer.utils", "openai_gelu")),
    }
    return {k: tuple(f for f in v if f is not None) for k, v in found.items()}


def _mlp_kind(mlp: Any, fns: dict[str, tuple[Any, ...]]) -> tuple[Optional[str], str]:
    """``(kind, "")`` for an MLP whose activation an lmfuse kernel runs, else
    ``(None, why)``."""
    cfg = mlp.config
    if getattr(cfg, "use_te_activation_func", False):
        return None, "use_te_activation_func: Transformer Engine's activation module"
    act = mlp.activation_func
    gated = bool(cfg.gated_linear_unit)
    fused = bool(getattr(cfg, "bias_activation_fusion", False))
    plain_glu = (getattr(cfg, "activation_func_clamp_value", None) is None
                 and getattr(cfg, "glu_linear_offset", 0.0) == 0.0)
    name = f"{'gated ' if gated else ''}{_activation_name(act)}"
    if gated and any(act is f for f in fns["quick_gelu"]):
        return "quick_geglu", ""
    if act is F.silu and gated:
        # Megatron's fused bias_swiglu ignores the clamp and offset; its unfused GLU does not.
        if fused or plain_glu:
            return "swiglu", ""
        return None, (f"{name} with activation_func_clamp_value / glu_linear_offset and no "
                      "bias_activation_fusion: no lmfuse kernel")
    # Megatron runs F.gelu under bias_activation_fusion as the tanh approximation.
    if any(act is f for f in fns["gelu_tanh"]) or (act is F.gelu and fused):
        if not gated:
            return "bias_gelu", ""
        if fused or plain_glu:
            return "geglu", ""
        return None, f"{name} with a clamp / linear offset: no lmfuse kernel"
    if act is F.gelu:
        return None, (f"{name} (exact erf GELU, no bias_activation_fusion): lmfuse's GELU "
                      "kernels are the tanh approximation Megatron fuses")
    if not gated and any(act is f for f in fns["squared_relu"]):
        return "squared_relu", ""
    return None, f"{name}: no lmfuse kernel"


def _activate(self: Any, h: torch.Tensor, bias: Optional[torch.Tensor],
              per_token_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """The MLP's activation of ``h [..., ffn(*2)]`` (+ fc1's ``bias``, times
    ``per_token_scale [tokens]``) through an lmfuse kernel."""
    kind, cfg = self._lmfuse_activation, self.config
    fused = bool(getattr(cfg, "bias_activation_fusion", False))
    fp8 = fused and bool(getattr(cfg, "activation_func_fp8_input_store", False))
    w = per_token_scale.unsqueeze(-1) if per_token_scale is not None else None
    if kind == "swiglu":
        if w is not None:
            return weighted_swiglu(h, w, bias, fp8_input_store=fp8)
        from megatron.core.transformer import mlp as megatron_mlp

        offload = (fused and bool(getattr(cfg, "cpu_offloading", False))
                   and bool(getattr(cfg, "cpu_offloading_activations", False))
                   and bool(getattr(megatron_mlp, "HAVE_TE", False)) and h.is_cuda)
        return swiglu(h, bias, fp8_input_store=fp8, cpu_offload_input=offload)
    if kind == "geglu":
        return geglu(h, bias)
    if kind == "bias_gelu":
        return bias_gelu(h, bias)
    if kind == "quick_geglu":
        offset = float(getattr(cfg, "glu_linear_offset", 0.0))
        clamp = getattr(cfg, "activation_func_clamp_value", None)
        if bias is not None and not fused:
            # Megatron's unfused GLU adds the bias before the clamp, its kernel after.
            h, bias = h + bias, None
        if w is not None:
            return weighted_quick_geglu(h, w, bias, linear_offset=offset, clamp_value=clamp,
                                        fp8_input_store=fp8)
        return quick_geglu(h, bias, linear_offset=offset, clamp_value=clamp)
    assert kind == "squared_relu"
    h = h + bias if bias is not None else h
    return weighted_squared_relu(h, w) if w is not None else squared_relu(h)


def _mlp_forward(self: Any, hidden_states: torch.Tensor,
                 per_token_scale: Optional[torch.Tensor] = None, **kwargs: Any):
    """Megatron-Core's ``MLP.forward`` (0.16-0.19) with the activation fused: ``hidden_states
    [s, b, h]`` or ``[tokens, h]`` -> ``(output, output_bias)``."""
    if per_token_scale is not None and self._lmfuse_activation not in _WEIGHTED:
        # No weighted lmfuse kernel (GELU): Megatron's forward does what it does.
        return type(self).forward(self, hidden_states, per_token_scale, **kwargs)
    h, bias = self.linear_fc1(hidden_states)
    output, output_bias = self.linear_fc2(_activate(self, h, bias, per_token_scale))
    if per_token_scale is not None and output_bias is not None:
        # An expert's output bias, weighted like its output (Megatron adds it here too).
        output += output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)
        output_bias = None
    return output, output_bias


# --- norms -------------------------------------------------------------------------------------


def _rms_norm_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    eps = self.eps if self.eps is not None else math_eps(x.dtype)  # torch.nn.RMSNorm's None
    if self.weight is None and tuple(x.shape[-1:]) != tuple(self.normalized_shape):
        # (with a weight, rms_norm's own check names the mismatch)
        raise ValueError(f"RMSNorm: normalized_shape is {list(self.normalized_shape)}, so the "
                         f"input must be [..., {self.normalized_shape[0]}], got "
                         f"{list(x.shape)}")
    return _rms_norm(x, self.weight, eps=eps)


def _l2_norm_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    return _rms_norm(x, None, eps=self.eps)


def _layer_norm_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    # torch.nn.LayerNorm's output, dtype included (float32 under CUDA autocast); a call
    # lmfuse.layer_norm does not stand in for (another shape, a dtype mix PyTorch refuses)
    # runs the module's own forward.
    y = _layer_norm_like(self, x, autocast="fp32")
    return y if y is not None else torch.nn.LayerNorm.forward(self, x)


# --- language-model loss -----------------------------------------------------------------------


class _UnformedLogits:
    """What the patched output layer returns, in place of its logits, inside a
    ``_postprocess`` given labels: its input ``hidden [s (/tp with sequence parallelism), b,
    H]`` and ``weight [V/tp, H]``, for ``compute_language_model_loss`` to take the loss of
    ``hidden @ weight.T`` without forming it."""

    __slots__ = ("hidden", "weight", "tp_group", "sequence_parallel")

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, tp_group: Any,
                 sequence_parallel: bool) -> None:
        self.hidden, self.weight = hidden, weight
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"lmfuse.megatron.patch: the logits of a forward with labels are not formed "
            f"(the loss is computed from the output layer's input and weight); code between "
            f"the output layer and compute_language_model_loss read .{name}. Pass "
            f"loss=False to patch() to form them")

    def loss(self, labels: torch.Tensor) -> torch.Tensor:
        """Megatron's per-token loss ``[b, s]`` (float32) of ``labels [b, s]``."""
        from ..megatron import linear_cross_entropy

        target = labels.transpose(0, 1).contiguous()  # [s, b], the hidden rows' order
        # Labels outside the vocabulary (BERT's -1 padding): loss 0, as Megatron's lse is
        # once its loss mask of 0 there applies (see outside_vocab_ignored).
        vocab = self.weight.shape[0] * group_size(self.tp_group)
        target = outside_vocab_ignored(target, vocab)
        loss = linear_cross_entropy(self.hidden, self.weight, target, tp_group=self.tp_group,
                                    reduction="none", sequence_parallel=self.sequence_parallel)
        return loss.view(target.shape).transpose(0, 1).contiguous()


def _output_layer_args(input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                       runtime_gather_output: Optional[bool] = None):
    """``ColumnParallelLinear.forward``'s arguments (0.16-0.19)."""
    return input_, weight, runtime_gather_output


def _output_layer_forward(self: Any, *args: Any, **kwargs: Any):
    """``ColumnParallelLinear.forward(input_, weight=None, runtime_gather_output=None)``;
    inside a ``_postprocess`` given labels, ``(_UnformedLogits, None)``."""
    if self.__dict__.get("_lmfuse_unformed"):
        try:
            hidden, weight, gather = _output_layer_args(*args, **kwargs)
        except TypeError:  # arguments of a later version: form the logits
            gather = True
        if not gather:
            tp_group = _group(self.tp_group)
            return _UnformedLogits(hidden, self.weight if weight is None else weight, tp_group,
                                   bool(self.sequence_parallel) and tp_group is not None), None
    return type(self).forward(self, *args, **kwargs)


@functools.cache
def _signature(fn: Any) -> inspect.Signature:
    return inspect.signature(fn)


def _postprocess(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``GPTModel._postprocess`` with the output layer's logits left unformed when labels are
    given and nothing else reads them (see :func:`_logits_needed`)."""
    original = type(self)._postprocess
    try:
        a = _signature(original).bind(self, *args, **kwargs).arguments
    except TypeError:
        return original(self, *args, **kwargs)  # Megatron's own error
    if (a.get("labels") is None or a.get("inference_context") is not None
            or a.get("inference_params") is not None or a.get("runtime_gather_output")
            or a.get("output_processor") is not None):
        return original(self, *args, **kwargs)
    out = self.output_layer
    out.__dict__["_lmfuse_unformed"] = True
    try:
        return original(self, *args, **kwargs)
    finally:
        out.__dict__["_lmfuse_unformed"] = False


def _language_model_loss(self: Any, labels: torch.Tensor, logits: Any) -> torch.Tensor:
    """``LanguageModule.compute_language_model_loss``: per-token loss ``[b, s]`` (float32) of
    ``labels [b, s]`` against ``logits [s, b, V/tp]`` split over the tensor-parallel group,
    or of an unformed-logits handle."""
    if isinstance(logits, _UnformedLogits):
        return logits.loss(labels)
    group = getattr(self, "tp_group", None)
    if group is None:
        group = self.pg_collection.tp
    group = _group(group)
    target = outside_vocab_ignored(labels.transpose(0, 1).contiguous(),
                                   logits.shape[-1] * group_size(group))
    loss = cross_entropy(logits, target, reduction="none", tp_group=group)
    return loss.transpose(0, 1).contiguous()


def _logits_needed(model: Any) -> str:
    """Why ``model``'s loss must be taken from formed logits (``""`` when it need not be)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import ColumnParallelLinear

    if not isinstance(model, GPTModel):
        return f"only GPTModel's output layer is hooked, not {type(model).__name__}'s"
    if not callable(getattr(type(model), "_postprocess", None)):
        return "this Megatron-Core's GPTModel has no _postprocess"
    out = getattr(model, "output_layer", None)
    if not isinstance(out, ColumnParallelLinear) or \
            type(out).forward is not ColumnParallelLinear.forward:
        return f"the output layer is a {type(out).__name__}, not a ColumnParallelLinear"
    if getattr(out, "bias", None) is not None:
        return "the output layer has a bias"
    if getattr(out, "gather_output", False):
        return "the output layer gathers its output (parallel_output=False)"
    cfg = model.config
    for attr, why in (("mtp_num_layers", "multi-token prediction reads the logits"),
                      ("use_mup", "MuP scales the logits"),
                      ("defer_embedding_wgrad_compute",
                       "defer_embedding_wgrad_compute keeps the output layer's input"),
                      ("config_logger_dir", "the config logger records the logits")):
        if getattr(cfg, attr, None):
            return why
    for owner, attr in ((model, "_postprocess"), (out, "forward")):
        if _instance_attr(owner, attr) is not None:
            return f"{type(owner).__name__}.{attr} already replaced by another library"
    return ""


# --- applying the patch ------------------------------------------------------------------------


def _te_class(m: torch.nn.Module) -> Optional[type]:
    """The first class of ``m``'s MRO that belongs to Transformer Engine, if any."""
    for cls in type(m).__mro__:
        if cls.__module__.startswith(_TE_MODULES):
            return cls
    return None


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside Megatron's (or torch's) wrappers: DDP, Float16Module, FSDP hold it
    at ``.module``."""
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.transformer.module import MegatronModule

    seen = 0
    while (seen < 8 and not isinstance(model, LanguageModule)
           and isinstance(getattr(model, "module", None), torch.nn.Module)
           and not isinstance(model, torch.nn.ModuleList)):
        model, seen = model.module, seen + 1
    if not isinstance(model, MegatronModule):
        raise TypeError(f"patch: model must be a Megatron-Core model (a GPTModel, or a "
                        f"MegatronModule holding its modules, wrapped or not), got "
                        f"{type(model).__module__}.{type(model).__name__}")
    return model


def _megatron_version() -> str:
    try:
        from megatron.core.package_info import __version__
        return str(__version__)
    except ImportError:
        return "(version unknown)"


def patch(model: torch.nn.Module, *, softmax: bool = True, activations: bool = True,
          rms_norm: bool = True, layer_norm: bool = True, loss: bool = True) -> dict[str, Any]:
    """Make a Megatron-Core model built with the local spec run lmfuse's fused ops, in place.

    ``model``: a ``GPTModel`` built with ``get_gpt_layer_local_spec()`` (Megatron-LM's
    ``--transformer-impl local``), or any Megatron-Core module holding such layers, as built
    or inside Megatron's wrappers (``DistributedDataParallel``, ``Float16Module``: the model
    is found at ``.module``). Call it once per model chunk, before or after wrapping, on
    every rank. See the module's docstring for exactly what each flag patches, and how.

    Args:
        softmax: every local ``DotProductAttention`` runs :class:`lmfuse.FusedScaleMaskSoftmax`
            (no CUDA-only score buffer: the attention also runs on the CPU).
        activations: every ``MLP`` (dense, or a ``SequentialMLP``'s experts) runs its
            activation and fc1 bias in one lmfuse kernel (SwiGLU, GEGLU, bias-GELU,
            Quick-GEGLU, squared ReLU; weighted by the MoE routing probabilities).
        rms_norm: every ``torch.nn.RMSNorm`` and ``L2Norm`` runs :func:`lmfuse.rms_norm`.
        layer_norm: every ``torch.nn.LayerNorm`` (``normalization="LayerNorm"``) runs
            :func:`lmfuse.layer_norm`.
        loss: the GPT model's language-model loss runs lmfuse's cross-entropy over the
            tensor-parallel group, and with labels (in training) its linear cross-entropy
            on the output layer's input and weight: no ``[s, b, V/tp]`` logits.

    Applying it again is harmless (nothing is wrapped twice); a flag set to ``False`` leaves
    that part as it is (it does not undo an earlier patch).

    Returns:
        The summary, also stored as ``lmfuse_patches`` on the (unwrapped) model:
        ``"softmax"`` (core attention module names), ``"activations"`` (``{MLP name: lmfuse
        op}``), ``"rms_norm"`` and ``"layer_norm"`` (norm names), ``"loss"``
        (``"linear_cross_entropy"``,
        ``"cross_entropy"`` or ``None``) with ``"loss_note"`` (why the logits are formed,
        if they are), ``"unpatched"`` (``{module name: why}`` for the modules of these
        kinds left as they are) and ``"megatron_core"`` (the version).

    Raises:
        TypeError: ``model`` is not a Megatron-Core module (or is a list of model chunks),
            or a flag is not a bool.
        ValueError: ``model`` holds Transformer Engine modules (built with
            ``transformer_impl="transformer_engine"``; only TE's norms are tolerated).
    """
    op = "patch"
    _check_flags(op, softmax=softmax, activations=activations, rms_norm=rms_norm,
                 layer_norm=layer_norm, loss=loss)
    if isinstance(model, (list, tuple)):
        raise TypeError(f"{op}: model must be one Megatron-Core model, got a "
                        f"{type(model).__name__} (Megatron's model chunks?): call patch on "
                        f"each chunk")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{op}: model must be a Megatron-Core model (a torch.nn.Module), got "
                        f"{type(model).__name__}")
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        raise TypeError(f"{op}: model must be a Megatron-Core model, but megatron.core cannot "
                        f"be imported here ({exc})") from exc
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax as MegatronSoftmax
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.mlp import MLP

    try:
        from megatron.core.transformer.torch_norm import L2Norm
    except ImportError:  # pragma: no cover - both supported versions have it
        L2Norm = None

    model = _unwrap(model)
    te = [f"{n or '(the model)'}: {type(m).__name__}" for n, m in model.named_modules()
          if _te_class(m) is not None and not _is_norm(m)]
    if te:
        raise ValueError(
            f"{op}: model holds Transformer Engine modules ({', '.join(te[:4])}"
            f"{f' and {len(te) - 4} more' if len(te) > 4 else ''}): lmfuse patches "
            f"Megatron-Core's local modules only. Build the model with "
            f"get_gpt_layer_local_spec() (transformer_impl='local')")

    fns = _megatron_functions()
    unpatched: dict[str, str] = {}
    for name, m in model.named_modules():
        if softmax and isinstance(m, DotProductAttention):
            if _instance_attr(m, "forward") not in (None, _core_attention_forward):
                unpatched[name] = "forward already replaced by another library"
            elif type(m).forward is not DotProductAttention.forward:
                unpatched[name] = f"{type(m).__name__} overrides DotProductAttention.forward"
            elif isinstance(m.scale_mask_softmax, _MegatronSoftmax):
                pass  # patched before
            elif not isinstance(m.scale_mask_softmax, MegatronSoftmax):
                unpatched[name] = (f"its scale_mask_softmax is a "
                                   f"{type(m.scale_mask_softmax).__name__}")
            else:
                new = _lmfuse_softmax(m.scale_mask_softmax)
                if new is None:
                    unpatched[name] = (f"attention mask type "
                                       f"{m.scale_mask_softmax.attn_mask_type!r}")
                else:
                    m.scale_mask_softmax = new
                    _set(m, "forward", _core_attention_forward)
        elif activations and isinstance(m, MLP):
            if _instance_attr(m, "forward") is _mlp_forward:
                continue  # patched before
            if _instance_attr(m, "forward") is not None:
                unpatched[name] = "forward already replaced by another library"
            elif type(m).forward is not MLP.forward:
                unpatched[name] = f"{type(m).__name__} overrides MLP.forward"
            else:
                kind, why = _mlp_kind(m, fns)
                if kind is None:
                    unpatched[name] = why
                elif kind not in _WEIGHTED and "local_experts" in name.split("."):
                    # SequentialMLP calls its experts with per_token_scale: Megatron's forward
                    # would run every time (no weighted kernel of this activation).
                    unpatched[name] = (f"an expert of SequentialMLP (called with "
                                       f"per_token_scale): lmfuse has no weighted {kind}")
                else:
                    m._lmfuse_activation = kind
                    _set(m, "forward", _mlp_forward)
        elif (rms_norm or layer_norm) and _is_norm(m):
            current = _instance_attr(m, "forward")
            if current in (_rms_norm_forward, _l2_norm_forward, _layer_norm_forward):
                continue
            rms = ((isinstance(m, torch.nn.RMSNorm)
                    and type(m).forward is torch.nn.RMSNorm.forward)
                   or (L2Norm is not None and isinstance(m, L2Norm)
                       and type(m).forward is L2Norm.forward))
            ln = (isinstance(m, torch.nn.LayerNorm)
                  and type(m).forward is torch.nn.LayerNorm.forward)
            # (a norm of a kind the caller turned off is not listed, whatever its class:
            # apex's FusedLayerNorm with layer_norm=False, its FusedRMSNorm with rms_norm=False)
            kind = type(m).__name__
            if (not rms_norm and (isinstance(m, torch.nn.RMSNorm) or rms or "RMSNorm" in kind
                                  or kind == "L2Norm")) or (
                    not layer_norm and (isinstance(m, torch.nn.LayerNorm) or "LayerNorm" in kind)):
                continue
            if current is not None:
                unpatched[name] = "forward already replaced by another library"
            elif ln:
                _set(m, "forward", _layer_norm_forward)
            elif rms and isinstance(m, torch.nn.RMSNorm):
                if len(m.normalized_shape) == 1:
                    _set(m, "forward", _rms_norm_forward)
                else:
                    unpatched[name] = f"RMSNorm over {len(m.normalized_shape)} dims"
            elif rms:
                _set(m, "forward", _l2_norm_forward)
            elif _te_class(m) is not None:
                unpatched[name] = (f"Transformer Engine's {type(m).__name__} (Megatron builds the "
                                   f"final norm with TE where TE is installed): left as it is")
            else:
                unpatched[name] = (f"{type(m).__name__} ({type(m).__module__}): lmfuse fuses "
                                   f"torch.nn.RMSNorm, L2Norm and torch.nn.LayerNorm only")

    if isinstance(model, LanguageModule) and getattr(model, "post_process", False):
        _patch_loss(model, loss, unpatched)
    summary = _summary(model, unpatched)
    model.lmfuse_patches = summary
    return summary


def _patch_loss(model: Any, loss: bool, unpatched: dict[str, str]) -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    current = _instance_attr(model, "compute_language_model_loss")
    if not loss:
        return
    if current is None:
        if type(model).compute_language_model_loss is not \
                LanguageModule.compute_language_model_loss:
            unpatched["(the model's loss)"] = (f"{type(model).__name__} overrides "
                                               f"compute_language_model_loss")
            return
        _set(model, "compute_language_model_loss", _language_model_loss)
    elif current is not _language_model_loss:
        unpatched["(the model's loss)"] = ("compute_language_model_loss already replaced by "
                                           "another library")
        return
    if _instance_attr(model, "_postprocess") is _postprocess or _logits_needed(model):
        return
    _set(model, "_postprocess", _postprocess)
    _set(model.output_layer, "forward", _output_layer_forward)


def _is_norm(m: torch.nn.Module) -> bool:
    """An RMSNorm or LayerNorm of torch, Megatron, apex or Transformer Engine."""
    name = type(m).__name__
    return isinstance(m, (torch.nn.RMSNorm, torch.nn.LayerNorm)) or name in (
        "L2Norm", "FusedLayerNorm", "LayerNorm", "RMSNorm", "FusedRMSNorm", "MixedFusedLayerNorm",
        "MixedFusedRMSNorm")


def _summary(model: torch.nn.Module, unpatched: dict[str, str]) -> dict[str, Any]:
    attention, mlps, norms, layer_norms = [], {}, [], []
    for name, m in model.named_modules():
        fn = _instance_attr(m, "forward")
        if fn is _core_attention_forward:
            attention.append(name)
        elif fn is _mlp_forward:
            mlps[name] = m._lmfuse_activation
        elif fn in (_rms_norm_forward, _l2_norm_forward):
            norms.append(name)
        elif fn is _layer_norm_forward:
            layer_norms.append(name)
    loss, note = None, ""
    if _instance_attr(model, "compute_language_model_loss") is _language_model_loss:
        if _instance_attr(model, "_postprocess") is _postprocess:
            loss = "linear_cross_entropy"
        else:
            loss, note = "cross_entropy", _logits_needed(model)
    return {"megatron_core": _megatron_version(), "softmax": attention, "activations": mlps,
            "rms_norm": norms, "layer_norm": layer_norms, "loss": loss, "loss_note": note,
            "unpatched": unpatched}
