"""Drop-in names with Megatron-Core's signatures, backed by lmfuse's fused ops.

    from lmfuse.megatron import FusedScaleMaskSoftmax, AttnMaskType

Each function keeps Megatron-Core's argument order; the semantics are Megatron's except
where lmfuse is exact and Megatron is not (masked positions are excluded as ``-inf``, so
a fully masked row is zeros rather than uniform).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from . import activations as act
from .activations.ops import check_bias as check_activation_bias
from .activations.ops import check_options as check_activation_options
from .cross_entropy import cross_entropy
from .cross_entropy import linear_cross_entropy as _linear_cross_entropy
from .cross_entropy.ops import outside_vocab_ignored
from .integrations.megatron_core import patch
from ._collectives import group_size
from ._dispatch import check_number
from .softmax import AttnMaskType, FusedScaleMaskSoftmax, fused_softmax
from .softmax.ops import check_inputs as check_softmax_inputs

__all__ = [
    "AttnMaskType",
    "FusedScaleMaskSoftmax",
    "bias_geglu_impl",
    "bias_gelu_impl",
    "bias_swiglu_impl",
    "fused_vocab_parallel_cross_entropy",
    "linear_cross_entropy",
    "patch",
    "scaled_masked_softmax",
    "scaled_softmax",
    "scaled_upper_triang_masked_softmax",
    "vocab_parallel_cross_entropy",
    "weighted_bias_quick_geglu_impl",
    "weighted_bias_swiglu_impl",
    "weighted_squared_relu_impl",
]


def _as_4d(name: str, x: torch.Tensor, dims: tuple[int, ...] = (3, 4),
           shapes: str = "[b, np, sq, sk] or [attn_batches, sq, sk]") -> torch.Tensor:
    """``inputs`` (``dims``-D: ``shapes``) as ``[b, np, sq, sk]``: a 3-D one is one batch."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: inputs must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in dims:
        raise ValueError(f"{name}: inputs must be {shapes}, got {tuple(x.shape)}")
    return x.unsqueeze(0) if x.dim() == 3 else x


def _softmax_inputs(name: str, inputs: Any, mask: Any, scale: Any, dims: tuple[int, ...],
                    shapes: str, causal: bool = False) -> torch.Tensor:
    """``inputs`` as ``[b, np, sq, sk]``, checked with ``mask`` and ``scale`` under the
    functional form's own name (its errors name ``inputs``, not fused_softmax's
    ``scores``, and no argument the caller did not pass)."""
    x = _as_4d(name, inputs, dims, shapes)
    check_softmax_inputs(x, mask, None, op=name, scores_name="inputs")
    check_number(name, "scale", scale)
    if causal and x.shape[2] > x.shape[3]:
        raise ValueError(f"{name}: inputs {shapes} must have sq <= sk (queries are the last "
                         f"sq of the sk keys), got {tuple(inputs.shape)}")
    return x


def scaled_upper_triang_masked_softmax(inputs: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax of ``scale * inputs`` for ``inputs [attn_batches, sq, sk]``.

    Megatron requires ``sq == sk``; here ``sq <= sk`` works (bottom-right aligned).
    """
    x = _softmax_inputs("scaled_upper_triang_masked_softmax", inputs, None, scale, (3,),
                        "[attn_batches, sq, sk]", causal=True)
    return fused_softmax(x, scale=scale, causal=True).squeeze(0)


def scaled_masked_softmax(inputs: torch.Tensor, mask: torch.Tensor | None,
                          scale: float) -> torch.Tensor:
    """Softmax of ``scale * inputs`` with ``mask`` (bool, True = masked),
    ``inputs [b, np, sq, sk]``."""
    x = _softmax_inputs("scaled_masked_softmax", inputs, mask, scale, (3, 4),
                        "[b, np, sq, sk] or [attn_batches, sq, sk]")
    return fused_softmax(x, scale=scale, mask=mask).view(inputs.shape)


def scaled_softmax(inputs: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax of ``scale * inputs`` over the last dim, ``inputs [b, np, sq, sk]`` (or 3-D)."""
    x = _softmax_inputs("scaled_softmax", inputs, None, scale, (3, 4),
                        "[b, np, sq, sk] or [attn_batches, sq, sk]")
    return fused_softmax(x, scale=scale).view(inputs.shape)


# --- cross-entropy -------------------------------------------------------------------------


def default_tp_group(op: str) -> Any:
    """The group an omitted ``tp_group`` means, as in Megatron-Core: its
    ``parallel_state``'s tensor-parallel group when Megatron's model parallelism is
    initialised; one rank (``None`` to lmfuse) when ``torch.distributed`` is not
    initialised or has one rank. With several ranks and no Megatron state the default is
    ambiguous (a tensor-parallel run would silently compute a wrong loss): ValueError."""
    # Initialised Megatron state implies its module is imported: no import here (which
    # torch.compile could not trace).
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_group()
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    raise ValueError(
        f"{op}: tp_group was omitted with {dist.get_world_size()} ranks in torch.distributed "
        "and Megatron-Core's parallel_state not initialised: in Megatron-Core an omitted group "
        "is the tensor-parallel group of parallel_state, which does not exist here. Pass the "
        "tensor-parallel group (or a group of one rank for a full vocabulary per rank)")


def _tp_group(op: str, tp_group: Any) -> Any:
    """``tp_group`` as lmfuse's ops take it. Megatron-Core hands its group to
    ``torch.distributed`` without looking at it, so any object passes there; lmfuse's
    collectives need a ``ProcessGroup``, except that a group of one rank (an object whose
    ``size()`` is 1, as Megatron's tests use) needs no collective at all and runs as
    ``None``. Omitted: :func:`default_tp_group`."""
    if tp_group is None:
        return default_tp_group(op)
    if isinstance(tp_group, torch.distributed.ProcessGroup):
        return tp_group
    size = getattr(tp_group, "size", None)
    if callable(size) and size() == 1:
        return None
    raise TypeError(f"{op}: tp_group must be a torch.distributed.ProcessGroup (or a group "
                    f"of one rank), got {type(tp_group).__name__}")


def fused_vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor,
                                       target: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Per-token loss ``[s, b]`` of ``logits [s, b, V_local]`` split over ``tp_group``.

    Megatron-Core's ``fused_vocab_parallel_cross_entropy``; one collective where it has two.
    Targets outside ``[0, V)`` (padding labels) get loss 0 and no gradient, where Megatron
    gives their log-sum-exp: the same under the loss mask of 0 such labels come with.
    Megatron requires ``tp_group``; omitted here, it means what an omitted group means in
    Megatron-Core (:func:`default_tp_group`: parallel_state's tensor-parallel group).
    """
    tp_group = _tp_group("fused_vocab_parallel_cross_entropy", tp_group)
    target = _outside_ignored(vocab_parallel_logits, target, tp_group)
    return cross_entropy(vocab_parallel_logits, target, reduction="none", tp_group=tp_group)


def _outside_ignored(logits: Any, target: Any, tp_group: Any) -> Any:
    """``target`` with ids outside the whole vocabulary ignored (see
    :func:`~lmfuse.cross_entropy.ops.outside_vocab_ignored`)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        return target
    return outside_vocab_ignored(target, logits.shape[-1] * group_size(tp_group))


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0, tp_group=None) -> torch.Tensor:
    """Megatron-Core's ``vocab_parallel_cross_entropy``: per-token loss ``[s, b]``.

    Label smoothing follows Megatron's formula, ``smoothing = label_smoothing * V / (V - 1)``
    and ``loss = (1 - smoothing) * nll - smoothing * mean(log_probs)`` over the whole
    vocabulary ``V``, which is ``cross_entropy``'s (``F.cross_entropy``'s) smoothing with
    ``smoothing`` in place of ``label_smoothing``. ``tp_group=None`` means parallel_state's
    tensor-parallel group, as in Megatron-Core (:func:`default_tp_group`); a group of one
    rank need not be a ``ProcessGroup`` (:func:`_tp_group`). Megatron reduces its three
    statistics with three all-reduces; lmfuse gathers them with one all-gather (none on one
    rank). Targets outside ``[0, V)``: loss 0 and no gradient, as in
    :func:`fused_vocab_parallel_cross_entropy`.
    """
    tp_group = _tp_group("vocab_parallel_cross_entropy", tp_group)
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        raise TypeError("vocab_parallel_cross_entropy: label_smoothing must be a float, got "
                        f"{type(label_smoothing).__name__}")
    smoothing = float(label_smoothing)
    if smoothing > 0:
        world = 1 if tp_group is None else torch.distributed.get_world_size(tp_group)
        V = vocab_parallel_logits.shape[-1] * world
        if V < 2:
            raise ValueError("vocab_parallel_cross_entropy: label smoothing needs a vocabulary "
                             f"of at least 2, got V = {V}")
        smoothing = smoothing * V / (V - 1)
        if smoothing > 1:
            raise ValueError(
                f"vocab_parallel_cross_entropy: label_smoothing={label_smoothing} gives "
                f"Megatron's smoothing = ls * V / (V - 1) = {smoothing:.4f} > 1 at V = {V}"
            )
    target = _outside_ignored(vocab_parallel_logits, target, tp_group)
    return cross_entropy(vocab_parallel_logits, target, label_smoothing=smoothing,
                         reduction="none", tp_group=tp_group)


class _GatherTokens(torch.autograd.Function):
    """Sequence parallel: every rank's rows of ``[n_local, H]``, in rank order, from one
    all-gather. Backward: this rank's rows of the gradient, which the vocabulary-parallel
    loss has already summed over the group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        from ._collectives import all_gather_stacked, group_rank

        ctx.rows, ctx.rank = x.shape[0], group_rank(group)
        return all_gather_stacked(x, group).flatten(0, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows], None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         tp_group: Any = None, reduction: str = "mean", ignore_index: int = -100,
                         sequence_parallel: bool = False) -> torch.Tensor:
    """Megatron-Core's fused linear cross-entropy (``megatron.core.fusions.
    fused_linear_cross_entropy.linear_cross_entropy``, ``dev`` branch): the loss of
    ``hidden @ weight.T`` against ``labels``, never forming the logits.

    Args, as Megatron's: ``hidden [..., H]`` (tokens flattened), ``weight [V_local, H]``
    (with ``tp_group``, this rank's equal shard of the vocabulary), ``labels [...]`` (global
    ids, the same on every rank), ``reduction`` ``"none" | "sum" | "mean"``,
    ``ignore_index``. ``tp_group=None``: one rank (data parallel; Megatron's meaning here,
    whatever ``sequence_parallel`` says). ``sequence_parallel=True`` with ``tp_group``:
    ``hidden`` is this rank's equal shard of the tokens (rank order), ``labels`` all of
    them; the ranks gather the hidden rows through ``tp_group``, and each gets the gradient
    of its own rows.
    Returns float32: the per-token loss ``[N]`` (flat, N the global token count) with
    ``"none"``, else a scalar (a mean over the non-ignored tokens); the same on every rank.
    The softmax sees the GEMM's float32 logits, as Megatron's kernel does
    (``lmfuse.linear_cross_entropy(..., logits_in_fp32=True)``), not logits rounded to
    ``hidden``'s dtype. The gradients are formed in the backward from the upstream
    gradient, as Megatron's are: the logits' gradient ``dout * (softmax - onehot)`` is
    rounded to ``hidden``'s dtype once, before the two GEMMs. (lmfuse's own ``"sum"`` and
    ``"mean"`` form them in the forward for an upstream gradient of 1 and rescale the
    rounded products, one GEMM fewer but one rounding more: Megatron's tensor-parallel test
    of ``d_weight`` at ``atol = rtol = 1e-4`` fails on about half of its bfloat16 ``"sum"``
    cases. Here every reduction is the per-token loss, reduced below.)
    """
    op = "linear_cross_entropy"
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"{op}: reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"{op}: sequence_parallel must be a bool, got "
                        f"{type(sequence_parallel).__name__}")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
        raise ValueError(f"{op}: hidden must be [..., H], got "
                         f"{tuple(getattr(hidden, 'shape', ()))}")
    # Megatron: no group is one rank, which holds every token, sequence parallel or not.
    gather = sequence_parallel and tp_group is not None
    rows = hidden.reshape(-1, hidden.shape[-1])
    if gather:
        rows = _GatherTokens.apply(rows, tp_group)
    target = labels.reshape(-1)
    if target.shape[0] != rows.shape[0]:
        raise ValueError(f"{op}: labels hold {target.shape[0]} tokens but hidden "
                         f"{'gathered over tp_group ' if gather else ''}has {rows.shape[0]}")
    # Per token, so that the backward forms the gradients from the upstream gradient (see
    # the docstring); the reduction is Megatron's epilogue.
    loss = _linear_cross_entropy(rows, weight, target, ignore_index=ignore_index,
                                 reduction="none", tp_group=tp_group,
                                 logits_in_fp32=True).float()
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "sum":
        return total
    return total / (target != ignore_index).sum().clamp(min=1)


# --- activations (megatron/core/fusions/fused_bias_*.py, fused_weighted_squared_relu.py) ---


def _tokens_2d_or_3d(name: str, x: torch.Tensor) -> None:
    if isinstance(x, torch.Tensor) and x.dim() not in (2, 3):
        raise ValueError(f"{name}: input must be [tokens, h] or [s, b, h], got "
                         f"{tuple(x.shape)}")


def bias_gelu_impl(input: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(input + bias)`` (Megatron-Core's ``bias_gelu_impl``: any shape, unlike
    the gated ones, which take ``[tokens, h]`` or ``[s, b, h]``)."""
    return act.bias_gelu(*_with_bias("bias_gelu_impl", input, bias))


def _megatron_clamp(name: str, clamp_value: Any) -> float | None:
    """Megatron clamps when ``clamp_value`` is not None and > 0, and ignores it otherwise
    (a value that is not a finite number is refused, naming ``name``)."""
    if clamp_value is None:
        return None
    value = check_number(name, "clamp_value", clamp_value)
    return value if value > 0 else None


def _with_bias(name: str, input: Any, bias: Any) -> tuple[Any, Any]:
    """``(input, bias)`` for the op: a bias checked under ``name`` (a tensor ``[h]`` for
    ``input [..., h]``, or None); of another float dtype than ``input``'s, both in the
    promoted dtype, as Megatron-Core's ``input + bias`` computes (and returns) it."""
    if bias is None or not isinstance(input, torch.Tensor) or input.dim() < 1:
        return input, bias  # (the op's own checks name what is wrong)
    check_activation_bias(name, bias, input, "input")
    if input.is_floating_point() and bias.dtype != input.dtype:
        dtype = torch.promote_types(input.dtype, bias.dtype)
        return input.to(dtype), bias.to(dtype)
    return input, bias


def bias_swiglu_impl(input: torch.Tensor, bias, fp8_input_store: bool = False,
                     cpu_offload_input: bool = False, clamp_value=None) -> torch.Tensor:
    """SwiGLU of ``input + bias`` (bias may be None), ``[.., 2f] -> [.., f]``.

    ``clamp_value > 0`` (Megatron-Core's): after the bias, the gated half is clamped from
    above and the linear half on both sides (``None`` or <= 0: no clamp). With both a bias
    and a clamp the bias is added first, in float32 as Megatron does (a sum rounded to
    bf16 first would move elements across the clamp's edge and change their gradients),
    as its own pass (the fused kernel clamps before the bias, as Megatron's Quick-GEGLU
    does); the result is rounded to the input's dtype."""
    _tokens_2d_or_3d("bias_swiglu_impl", input)
    clamp = _megatron_clamp("bias_swiglu_impl", clamp_value)
    input, bias = _with_bias("bias_swiglu_impl", input, bias)
    if clamp is not None and bias is not None:
        return act.swiglu(input.float() + bias.float(), None, fp8_input_store=fp8_input_store,
                          cpu_offload_input=cpu_offload_input,
                          clamp_value=clamp).to(input.dtype)
    return act.swiglu(input, bias, fp8_input_store=fp8_input_store,
                      cpu_offload_input=cpu_offload_input, clamp_value=clamp)


def bias_geglu_impl(input: torch.Tensor, bias) -> torch.Tensor:
    """GEGLU (tanh GELU) of ``input + bias`` (bias may be None)."""
    _tokens_2d_or_3d("bias_geglu_impl", input)
    return act.geglu(*_with_bias("bias_geglu_impl", input, bias))


def weighted_bias_swiglu_impl(input: torch.Tensor, bias, weights: torch.Tensor,
                              fp8_input_store: bool = False, clamp_value=None) -> torch.Tensor:
    """``swiglu(input + bias) * weights``, ``weights [tokens, 1]``; ``clamp_value`` as
    :func:`bias_swiglu_impl`. Megatron-Core raises on a bias here; lmfuse supports one."""
    _tokens_2d_or_3d("weighted_bias_swiglu_impl", input)
    clamp = _megatron_clamp("weighted_bias_swiglu_impl", clamp_value)
    input, bias = _with_bias("weighted_bias_swiglu_impl", input, bias)
    if clamp is not None and bias is not None:
        return act.weighted_swiglu(input.float() + bias.float(), weights, None,
                                   fp8_input_store=fp8_input_store,
                                   clamp_value=clamp).to(input.dtype)
    return act.weighted_swiglu(input, weights, bias, fp8_input_store=fp8_input_store,
                               clamp_value=clamp)


def weighted_bias_quick_geglu_impl(input: torch.Tensor, bias, weights: torch.Tensor,
                                   fp8_input_store: bool = False, linear_offset: float = 0.0,
                                   clamp_value=None) -> torch.Tensor:
    """``quick_geglu(clamp(input) + bias, linear_offset) * weights``; ``clamp_value`` None
    or > 0 (Megatron-Core clamps at any value given; at 0 or below every output is 0 or
    the clamp's bounds cross, so lmfuse refuses it)."""
    _tokens_2d_or_3d("weighted_bias_quick_geglu_impl", input)
    # The op's own option checks, under this function's name.
    check_activation_options("weighted_bias_quick_geglu_impl", linear_offset=linear_offset,
                             clamp_value=clamp_value, fp8_input_store=fp8_input_store)
    input, bias = _with_bias("weighted_bias_quick_geglu_impl", input, bias)
    return act.weighted_quick_geglu(input, weights, bias, linear_offset=linear_offset,
                                    clamp_value=clamp_value, fp8_input_store=fp8_input_store)


def weighted_squared_relu_impl(input: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``relu(input) ** 2 * weights``, ``weights [tokens, 1]``."""
    _tokens_2d_or_3d("weighted_squared_relu_impl", input)
    return act.weighted_squared_relu(input, weights)
