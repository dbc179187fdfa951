"""lmfuse in Hugging Face ``transformers`` causal LMs: :func:`apply_lmfuse`.

Tested with transformers 5.x (the ``test`` extra pins the range). The patch replaces the
``forward`` of individual modules of one loaded model (an instance attribute, so other
models of the same class are untouched, and ``copy.deepcopy`` carries it along):

* the RMSNorms (every decoder layer's norms, the final norm, Qwen3's and Gemma3's q/k norms)
  run :func:`lmfuse.rms_norm` with the module's own ``weight`` and eps;
* the LayerNorms (``torch.nn.LayerNorm`` and its subclasses that keep its forward: the vision
  towers' and projectors'; Nemotron's LayerNorm1P, found by a probe) run
  :func:`lmfuse.layer_norm` with the module's own ``weight``, ``bias`` and eps;
* the attention layers whose forward calls its modeling module's rotate-half
  ``apply_rotary_pos_emb`` (found by a probe) run :func:`lmfuse.apply_rotary_pos_emb` there:
  the class's forward re-bound to globals holding lmfuse's (the module is untouched);
* the gated MLPs (``down_proj(act(gate_proj(x)) * up_proj(x))``) run :func:`lmfuse.swiglu`
  (SiLU) or :func:`lmfuse.geglu` (tanh-approximated GELU) between their projections
  (Falcon-H1's ``gate_multiplier`` and ``down_multiplier`` as swiglu's);
* the mixture-of-experts experts modules (transformers 5's fused experts of 3-D weights:
  Mixtral, Qwen2/3-MoE, OLMoE, Granite-MoE, GPT-OSS, DeepSeek-V2/V3/V4) run
  :func:`lmfuse.moe_experts` on views of their own weights, after the model's own router
  and top-k;
* the causal-LM forward, when given ``labels``, computes the loss with
  :func:`lmfuse.linear_cross_entropy` from the last hidden states, with no logits tensor.

Parameters, buffers and ``state_dict`` keys stay as they are, so checkpoints load and save
as before. ``transformers`` is imported only when :func:`apply_lmfuse` runs.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import math
import types
import typing
import warnings
from collections.abc import Iterator
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F

from .._dispatch import IMPLS
from ..activations import geglu as _geglu
from ..activations import squared_relu as _squared_relu
from ..activations import swiglu as _swiglu
from ..activations.reference import QUICK_GELU_K
from ..cross_entropy import linear_cross_entropy as _linear_cross_entropy
from ..moe import moe_experts as _moe_experts
from ..norm import rms_norm as _rms_norm
from ..rope.ops import rotary as _rotary
from ..rope.reference import rotary_reference as _rotary_reference
from . import _activation_name, _check_flags, _instance_attr, _layer_norm_like
from . import _Forward as _PatchedMethod

__all__ = ["SUPPORTED_MODEL_TYPES", "apply_lmfuse"]


class _Family(NamedTuple):
    norms: dict[str, float]  # RMSNorm class name -> weight offset (1.0: Gemma's 1 + weight)
    mlps: frozenset[str]  # gated MLP class names
    # mixture-of-experts experts class name -> why moe_experts cannot run it ("" if it can)
    experts: dict[str, str] = {}
    # norm and MLP classes a probe could not run (weights on the meta device): left as they are
    unprobed: tuple[str, ...] = ()
    # MLP classes of a fusable form whose probe found another formula (a dropout, a clamp)
    rejected_mlps: tuple[str, ...] = ()
    # torch.nn.LayerNorm subclasses with a forward of their own that a probe found to compute
    # a LayerNorm: class name -> weight offset (1.0: Nemotron's LayerNorm1P, weight + 1)
    layer_norms: dict[str, float] = {}


def _family(norm: str, offset: float, mlp: str) -> _Family:
    return _Family({norm: offset}, frozenset({mlp}), {})


_FAMILIES: dict[str, _Family] = {
    "llama": _family("LlamaRMSNorm", 0.0, "LlamaMLP"),
    "mistral": _family("MistralRMSNorm", 0.0, "MistralMLP"),
    "qwen2": _family("Qwen2RMSNorm", 0.0, "Qwen2MLP"),
    "qwen3": _family("Qwen3RMSNorm", 0.0, "Qwen3MLP"),
    "gemma": _family("GemmaRMSNorm", 1.0, "GemmaMLP"),
    "gemma2": _family("Gemma2RMSNorm", 1.0, "Gemma2MLP"),
    "gemma3_text": _family("Gemma3RMSNorm", 1.0, "Gemma3MLP"),
}

#: Model types whose RMSNorms and gated MLPs are found by what they compute: each module
#: class named ``*RMSNorm`` with one input is run once on a small input at patch time and
#: must give ``x * rsqrt(mean(x^2) + eps) * (w + offset)`` for offset 0 or 1; each module
#: with ``gate_proj``, ``up_proj``, ``down_proj`` and ``act_fn`` (or ``activation_fn``:
#: Llama 4) must give ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, or, with Falcon-H1's
#: number attributes ``gate_multiplier`` (g) and ``down_multiplier`` (d) and a SiLU
#: activation, ``down_proj(act_fn(gate_proj(x) * g) * up_proj(x)) * d``; one with a single
#: ``gate_up_proj`` projection (Phi-3, GLM-4: the gate's half, then the up's) likewise with
#: its halves. Anything else is left as it is.
_DETECTED: tuple[str, ...] = (
    "granite", "olmo2", "olmo3", "glm4", "smollm3", "exaone4", "ministral", "helium",
    "seed_oss", "arcee", "phi3", "lfm2", "hunyuan_v1_dense", "apertus", "llama4_text",
    "falcon_h1",
    # mixtures of experts: norms, dense or shared-expert MLPs, the experts (modules of
    # 3-D weights found by _experts_layout and checked by _probe_experts) and the loss (the
    # model's own forward when it returns router logits, whose load-balancing loss it adds)
    "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "gpt_oss", "hunyuan_v1_moe",
    # hybrids of gated linear attention and attention, MoE or dense: the (1 + w) RMSNorms and
    # MLPs (the gated norm of the linear attention takes two inputs and is left alone)
    "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text",
    # DeepSeek-V4: its norms, its experts (a clamped SwiGLU: moe_experts' clamp_value) and
    # the loss; its dense MLPs clamp the gate and up outputs, which the gated-MLP patch does
    # not do: the probe, at a scale where the clamp bites, leaves them as they are
    "deepseek_v4",
    # DeepSeek-V2 and -V3: their norms (MLA's latent q_a/kv_a norms too), dense MLPs and
    # shared experts, the routed experts and the loss. The router stays the model's (V2's
    # greedy or group-limited top-k, V3's grouped top-k over scores plus its correction bias,
    # "noaux_tc") and hands the experts weights already scaled by routed_scaling_factor, which
    # moe_experts takes as they are; the multi-head latent attention stays the model's too
    "deepseek_v2", "deepseek_v3",
    # Nemotron: LayerNorm1P (its own forward, found by a probe to be a LayerNorm of weight
    # + 1), ReLU^2 MLPs without a gate and the loss
    "nemotron",
    # vision-language models: the norms and gated MLPs of the text stack (and of the vision
    # tower where they are of these forms; the towers' and projectors' torch.nn.LayerNorms),
    # the MoE ones' experts, and the loss (GLM-4.1V's and GLM-4.5V's vision patch merger runs
    # a projection, a LayerNorm and a GELU before its gated MLP: the MLP stays the model's,
    # its LayerNorm is fused); their text stacks alone (base models: norms and
    # MLPs); Mllama's text model (MllamaForCausalLM, its cross-attention layers' norms and
    # MLPs too); Pixtral's vision encoder alone (norms, and its gated MLPs where SiLU:
    # transformers' default GELU ones stay the model's, with a warning); Llama 4's
    # image-text model: its text stack's norms and MLPs (its experts take tokens already
    # sorted, and its loss is computed by its own forward from the inner model's logits)
    "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "gemma3",
    "llava", "paligemma", "internvl", "mllama", "mistral3", "glm4v", "glm4v_moe", "smolvlm",
    "qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text", "qwen3_vl_moe_text",
    "mllama_text_model", "pixtral", "llama4",
    # Gemma 4, its text model and the vision-language model: the weighted RMSNorms (the
    # weightless v_norms stay), tanh-GELU gated MLPs and the loss
    "gemma4_text", "gemma4",
    # MuseGlimmer and its text model (a base model): the (1 + w) RMSNorms and the final norm
    # (the weightless ones, of the embedding, q/k and image features, stay), the SiLU gated
    # MLPs, the loss with the logits' output_multiplier applied before the soft cap; the
    # vision tower's LayerNorms (its GELU MLPs without a gate stay the model's)
    "muse_glimmer", "muse_glimmer_text")

#: ``config.model_type`` values :func:`apply_lmfuse` accepts.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(_FAMILIES) + _DETECTED


def _family_of(model: torch.nn.Module) -> _Family | None:
    """The norm and MLP classes to patch in ``model``: the hand-kept entry of its model
    type, or (for :data:`_DETECTED` types) what a probe of one module of each class finds;
    None for an unsupported model type."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not isinstance(model_type, str):
        return None
    if model_type in _FAMILIES:
        return _FAMILIES[model_type]
    if model_type not in _DETECTED:
        return None
    norms: dict[str, float] = {}
    mlps: set[str] = set()
    experts: dict[str, str] = {}
    unprobed: list[str] = []
    rejected: list[str] = []
    layer_norms: dict[str, float] = {}
    seen: set[type] = set()
    # The probes draw nothing from torch's generators, but a module's own forward may (a
    # dropout): the user's random numbers stay as they were.
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.is_cuda})
    with torch.random.fork_rng(devices=devices):
        for m in model.modules():
            cls = type(m)
            if cls in seen:
                continue
            if cls.__name__.endswith("RMSNorm") and getattr(m, "weight", None) is None:
                # A weightless instance (MuseGlimmer's and Gemma 4's ``with_scale=False``)
                # says nothing of its class: the probe takes one with a weight, if any
                # (patched or not, the weightless ones stay the model's).
                continue
            custom_ln = _own_forward_layer_norm(m)
            if custom_ln and getattr(m, "weight", None) is None:
                continue  # (likewise: the probe needs a weight, and so does the patch)
            if _instance_attr(m) not in (None, *_PATCHES):
                # Another library's forward on this instance: the class is probed on another
                # instance, if any (this one is named as foreign when the patch is applied).
                continue
            seen.add(cls)
            plain = cls.__name__.endswith("RMSNorm") or custom_ln or _is_fusable_mlp(m)
            if plain and _on_meta(m):
                unprobed.append(cls.__name__)
                continue
            with _probe_weights(m):
                if cls.__name__.endswith("RMSNorm"):
                    offset = _probe_norm(m)
                    if offset is not None:
                        norms[cls.__name__] = offset
                elif custom_ln:
                    offset = _probe_layer_norm(m)
                    if offset is not None:
                        layer_norms[cls.__name__] = offset
                elif _is_fusable_mlp(m):
                    found = _probe_mlp(m)
                    if found:
                        mlps.add(cls.__name__)
                    elif found is False:  # (None: not probed, another structure)
                        rejected.append(cls.__name__)
                else:
                    layout = _experts_layout(m)
                    if isinstance(layout, _ExpertsLayout):
                        experts[cls.__name__] = _probe_experts(m, layout)
                    elif layout is not None:
                        experts[cls.__name__] = layout
    return _Family(norms, frozenset(mlps), experts, tuple(unprobed), tuple(rejected),
                   layer_norms)


@contextlib.contextmanager
def _probe_weights(m: torch.nn.Module) -> Iterator[None]:
    """``m``'s parameters as plain tensors for a probe. A sharded one (a ``DTensor``, as
    FSDP2's ``fully_shard`` leaves them between forwards, where a probe input of plain
    tensors cannot meet them) is stood in for, while the probe runs, by a plain parameter
    of its full shape and dtype with random values: the probes compare what the class
    computes with lmfuse's formula on the same weights, whatever they are, so nothing is
    gathered and no collective issued. Restored afterwards (the forward that FSDP2
    unshards then sees plain tensors, which the patched forwards take)."""
    swapped = []
    dtensor = _dtensor_type()
    if dtensor is not None:
        g = torch.Generator(device="cpu").manual_seed(1)
        for sub in m.modules():
            for name, p in list(sub._parameters.items()):
                if isinstance(p, dtensor):
                    plain = torch.randn(tuple(p.shape), generator=g).to(device=p.device,
                                                                        dtype=p.dtype)
                    sub._parameters[name] = torch.nn.Parameter(plain, p.requires_grad)
                    swapped.append((sub, name, p))
    try:
        yield
    finally:
        for sub, name, p in swapped:
            sub._parameters[name] = p


def _dtensor_type() -> type | None:
    """``torch.distributed``'s ``DTensor`` class, None where there is none."""
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5
        try:
            from torch.distributed._tensor import DTensor
        except ImportError:
            return None
    return DTensor


def _on_meta(m: torch.nn.Module) -> bool:
    p = next(m.parameters(), None)
    return p is not None and p.device.type == "meta"


@contextlib.contextmanager
def _training_mode(m: torch.nn.Module) -> Iterator[None]:
    """``m`` and its submodules in training mode for a probe (a dropout there is then
    active, so a module with one fails the probe, in eval mode as in training: its patch
    would drop the dropout); each module's own mode restored afterwards."""
    modes = [(sub, sub.training) for sub in m.modules()]
    m.train()
    try:
        yield
    finally:
        for sub, mode in modes:
            sub.training = mode


def _positional_inputs(m: torch.nn.Module, n: int) -> bool:
    """``m.forward`` takes exactly ``n`` arguments, each of them positional: one for a norm
    or an MLP (the hidden states); three for an experts module, ``(hidden_states,
    top_k_index, top_k_weights)``, the routing being the caller's and the gather and the
    weighted sum the module's (not Llama 4's experts, which take tokens already sorted by
    expert and scaled by their router weights)."""
    params = list(_signature(type(m)).parameters.values())[1:]
    return len(params) == n and all(p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                               inspect.Parameter.POSITIONAL_OR_KEYWORD)
                                    for p in params)


def _probe_input(m: torch.nn.Module, width: int) -> torch.Tensor | None:
    p = next(m.parameters(), None)
    if p is None or p.device.type == "meta":
        return None
    g = torch.Generator(device="cpu").manual_seed(0)
    return torch.randn(3, width, generator=g).to(device=p.device, dtype=p.dtype)


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in float32."""
    a, b = a.float(), b.float()
    return float(((a - b).abs().max() / b.abs().max().clamp(min=1e-6)).item())


_PROBE_TOL = 1e-2  # half precision rounds to 4e-3; a different formula is off by far more


def _close(y: Any, want: torch.Tensor) -> bool:
    """``y`` is a tensor of ``want``'s shape, within :data:`_PROBE_TOL` of it."""
    return isinstance(y, torch.Tensor) and y.shape == want.shape and _error(y, want) <= _PROBE_TOL


@torch.no_grad()
def _probe_norm(m: torch.nn.Module) -> float | None:
    """0.0 or 1.0 when ``m`` computes an RMSNorm with that weight offset, else None."""
    weight, eps = getattr(m, "weight", None), _norm_eps(m)
    if not (isinstance(weight, torch.nn.Parameter) and weight.dim() == 1 and eps is not None
            and _positional_inputs(m, 1) and _instance_attr(m) in (None, _rms_norm_forward)):
        return None
    x = _probe_input(m, weight.shape[0])
    if x is None:
        return None
    try:
        # The class's forward, not the module's call: the hooks of a module fully_shard
        # wrapped on its own would gather its weights, which the probe stands in for.
        y = type(m).forward(m, x)
    except Exception:  # noqa: BLE001 - not a plain norm of one input
        return None
    if not (isinstance(y, torch.Tensor) and y.shape == x.shape):
        return None
    xf = x.float()
    base = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    # The closer of the two offsets (large weights make them near), if close enough.
    err, offset = min((_error(y, base * (weight.float() + o)), o) for o in (0.0, 1.0))
    return offset if err <= _PROBE_TOL else None


def _own_forward_layer_norm(m: torch.nn.Module) -> bool:
    """``m`` is a ``torch.nn.LayerNorm`` whose class replaces its forward (Nemotron's
    LayerNorm1P): what it computes is for :func:`_probe_layer_norm` to find."""
    return (isinstance(m, torch.nn.LayerNorm)
            and type(m).forward is not torch.nn.LayerNorm.forward)


@torch.no_grad()
def _probe_layer_norm(m: torch.nn.Module) -> float | None:
    """0.0 or 1.0 when LayerNorm ``m`` (:func:`_own_forward_layer_norm`) computes
    ``F.layer_norm(x, normalized_shape, weight + offset, bias, eps)`` over one dim, else None.

    The class's forward runs on rows of nonzero mean (where an RMSNorm differs) with random
    stand-ins for the weight and the bias (restored afterwards): a formula that agrees with
    a LayerNorm only at the initial ones and zeros (a bias left out) is told apart."""
    shape = tuple(m.normalized_shape)
    weight, bias, eps = m.weight, m.bias, _number(getattr(m, "eps", None))
    if not (len(shape) == 1 and isinstance(weight, torch.nn.Parameter)
            and tuple(weight.shape) == shape and eps is not None and eps >= 0
            and (bias is None or (isinstance(bias, torch.nn.Parameter)
                                  and tuple(bias.shape) == shape))
            and _positional_inputs(m, 1) and _instance_attr(m) in (None, _layer_norm_forward)):
        return None
    x = _probe_input(m, shape[0])
    if x is None:
        return None
    x = x + 1.0
    g = torch.Generator(device="cpu").manual_seed(2)
    saved = {name: m._parameters[name] for name in ("weight", "bias") if name in m._parameters}
    stand_ins = {name: torch.nn.Parameter(torch.randn(shape, generator=g).to(p), p.requires_grad)
                 for name, p in saved.items() if p is not None}
    m._parameters.update(stand_ins)
    try:
        y = type(m).forward(m, x)  # (the class's forward: see _probe_norm)
    except Exception:  # noqa: BLE001 - not a plain norm of one input
        return None
    finally:
        m._parameters.update(saved)
    if not (isinstance(y, torch.Tensor) and y.shape == x.shape):
        return None
    w = stand_ins["weight"].float()
    b = stand_ins["bias"].float() if "bias" in stand_ins else 0.0
    base = F.layer_norm(x.float(), shape, None, None, eps)
    err, offset = min((_error(y, base * (w + o) + b), o) for o in (0.0, 1.0))
    return offset if err <= _PROBE_TOL else None


@torch.no_grad()
def _probe_mlp(m: torch.nn.Module) -> bool | None:
    """``m`` computes ``down_proj(act(gate * g) * up) * d`` (:func:`_mlp_formula`): g and d
    its :func:`_mlp_multipliers`, other than 1 only with a SiLU activation (lmfuse's GEGLU
    has no multipliers). False: it computes another formula on the probe (a dropout, a
    clamp); None: it could not be probed (another signature or structure, multipliers
    lmfuse cannot apply)."""
    relu2 = _is_relu2_mlp(m)
    gate = (m.up_proj if relu2 else m.gate_up_proj if _fused_gate_up(m)
            else getattr(m, "gate_proj", None))
    # The input width: the first projection's, or the output's of down_proj (a projection
    # wrapped by an adapter is called as a module, as the patched forward calls it).
    width = getattr(gate, "in_features", None)
    if not isinstance(width, int):
        width = getattr(getattr(m, "down_proj", None), "out_features", None)
    multipliers = _mlp_multipliers(m)
    if not (isinstance(width, int) and _positional_inputs(m, 1)
            and multipliers is not None and _instance_attr(m) in (None, _gated_mlp_forward)):
        return None
    g, d = multipliers
    if (g, d) != (1.0, 1.0) and _mlp_activation(m) != "swiglu":
        return None
    x = _probe_input(m, width)
    if x is None:
        return None
    try:
        with _training_mode(m):
            # The projections in eval mode: a dropout inside one (a LoRA adapter's) stays
            # with the patch, which calls such projections as modules; only the MLP's own
            # steps decide.
            for name in ("gate_proj", "up_proj", "down_proj", "gate_up_proj"):
                sub = getattr(m, name, None)
                if isinstance(sub, torch.nn.Module):
                    sub.eval()
            peak = float(_gate_up_outputs(m, x).abs().max())
            # Unit-scale inputs, and inputs whose largest projection output is _PROBE_PEAK
            # and twice each limit the module holds: a clamp of the projections
            # (DeepSeek-V4's swiglu_limit) shows only past it.
            peaks = [_PROBE_PEAK] + [2 * v for v in _limits(m) if 2 * v > _PROBE_PEAK]
            for xs in [x] + [x * (p / peak) for p in peaks if peak > 0]:
                # (the class's forward: see _probe_norm)
                y = type(m).forward(m, xs)
                want = _mlp_formula(m, xs, g, d)
                # Twice: a random module (a dropout, active here) differs from itself.
                if not (_close(y, want) and _close(type(m).forward(m, xs), want)):
                    return False
    except Exception:  # noqa: BLE001 - another structure
        return None
    return True


_PROBE_PEAK = 64.0  # beyond the clamps models put on their gate/up outputs (7 to 10)


def _mlp_act(m: torch.nn.Module) -> Any:
    """A gated MLP's activation: ``act_fn`` (most families) or ``activation_fn`` (Llama 4,
    Phi-3, GLM-4); None when it has neither."""
    act = getattr(m, "act_fn", None)
    return act if act is not None else getattr(m, "activation_fn", None)


def _fused_gate_up(m: torch.nn.Module) -> bool:
    """The gate and up projections are one module, ``gate_up_proj``, its output the gate's
    half then the up's (Phi-3's and GLM-4's MLPs), not ``gate_proj`` and ``up_proj``."""
    return (not hasattr(m, "gate_proj")
            and isinstance(getattr(m, "gate_up_proj", None), torch.nn.Module))


def _is_gated_mlp(m: torch.nn.Module) -> bool:
    """``m`` has a gated MLP's parts: ``gate_proj`` and ``up_proj`` (or one
    ``gate_up_proj`` module), ``down_proj`` and an activation (:func:`_mlp_act`). An
    experts module's 3-D ``gate_up_proj`` parameter is not one."""
    if _mlp_act(m) is None or not hasattr(m, "down_proj"):
        return False
    return (hasattr(m, "gate_proj") and hasattr(m, "up_proj")) or _fused_gate_up(m)


def _is_relu2_mlp(m: torch.nn.Module) -> bool:
    """``m`` is an MLP without a gate, ``down_proj(relu(up_proj(x)) ** 2)`` by its parts
    (Nemotron's and Arcee's: transformers' ReLU-squared activation): lmfuse's
    :func:`lmfuse.squared_relu` between the two projections."""
    from transformers.activations import ReLUSquaredActivation

    return (type(_mlp_act(m)) is ReLUSquaredActivation and hasattr(m, "up_proj")
            and hasattr(m, "down_proj") and not hasattr(m, "gate_proj")
            and not hasattr(m, "gate_up_proj"))


def _is_fusable_mlp(m: torch.nn.Module) -> bool:
    """A gated MLP (:func:`_is_gated_mlp`) or a ReLU-squared one (:func:`_is_relu2_mlp`)."""
    return _is_gated_mlp(m) or _is_relu2_mlp(m)


def _mlp_activation(m: torch.nn.Module) -> str | None:
    """The fused activation that runs MLP ``m``: ``"swiglu"``/``"geglu"`` (gated),
    ``"squared_relu"`` (no gate), None for another activation."""
    return "squared_relu" if _is_relu2_mlp(m) else _gated_activation(_mlp_act(m))


def _gate_up_outputs(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The gate and up projections of ``x`` side by side, through the module's own calls."""
    if _is_relu2_mlp(m):
        return m.up_proj(x)
    if _fused_gate_up(m):
        return m.gate_up_proj(x)
    return torch.cat([m.gate_proj(x), m.up_proj(x)], -1)


def _mlp_formula(m: torch.nn.Module, x: torch.Tensor, g: float, d: float) -> torch.Tensor:
    """``down_proj(act(gate * g) * up) * d`` by the module's own parts: what a gated MLP
    must compute for lmfuse's fused forward to stand in for it."""
    act = _mlp_act(m)
    if _is_relu2_mlp(m):
        return m.down_proj(act(m.up_proj(x) * g)) * d
    if _fused_gate_up(m):
        gate, up = m.gate_up_proj(x).chunk(2, dim=-1)
    else:
        gate, up = m.gate_proj(x), m.up_proj(x)
    return m.down_proj(act(gate * g) * up) * d


def _limits(m: torch.nn.Module) -> list[float]:
    """The finite positive numbers ``m`` holds under a name with ``limit`` or ``clamp`` in
    it (a clamp of its projections, which the probe must try both sides of)."""
    found = []
    for name, value in vars(m).items():
        v = _number(value) if ("limit" in name or "clamp" in name) else None
        if v is not None and v > 0:
            found.append(v)
    return found


def _mlp_multipliers(m: torch.nn.Module) -> tuple[float, float] | None:
    """``(gate_multiplier, down_multiplier)`` of gated MLP ``m``: Falcon-H1's attributes of
    these names (which scale ``gate_proj``'s output and ``down_proj``'s), 1.0 for one the
    module lacks; None when one is there but not a finite int or float."""
    g, d = (_number(getattr(m, name, 1.0)) for name in ("gate_multiplier", "down_multiplier"))
    return None if g is None or d is None else (g, d)


# --- RMSNorm -----------------------------------------------------------------------------------


def _norm_eps(norm: torch.nn.Module) -> float | None:
    """The module's epsilon: Llama-style norms call it ``variance_epsilon``, Gemma's ``eps``."""
    for name in ("variance_epsilon", "eps"):
        eps = getattr(norm, name, None)
        if isinstance(eps, (int, float)) and not isinstance(eps, bool):
            return float(eps)
    return None


def _small_inference_call(m: torch.nn.Module, x: torch.Tensor, width: int | None = None
                          ) -> bool:
    """True for a call the module's own forward serves better: autograd off (generation) and
    at most ``inference_fallback_tokens`` tokens (rows of ``width``, x's last dim unless
    given), where a fused launch's host time (tens of microseconds) costs more than the
    memory traffic it saves. Never while compiling (the custom ops are what the graph
    should hold there)."""
    return (not torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and x.numel() <= m._lmfuse_fallback_tokens * (width or x.shape[-1]))


def _rms_norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    if _small_inference_call(self, hidden_states):
        return type(self).forward(self, hidden_states)
    # The norm's eps is read on every call, so a later change to the module still counts.
    # Unlike Llama's own forward (which rounds the normalised x to the input dtype before
    # the weight multiplies it), the scale is applied in float32 and rounded once; in float32
    # the two agree.
    return _rms_norm(hidden_states, self.weight, eps=_norm_eps(self),
                     weight_offset=self._lmfuse_weight_offset, impl=self._lmfuse_impl)


# --- LayerNorm ---------------------------------------------------------------------------------

#: What the LayerNorm classes with their own forward do under autocast (see
#: ``integrations._layer_norm_like``): Nemotron's casts x, weight + 1 and bias to the
#: autocast dtype under CUDA's autocast. A probed class not listed runs its own forward
#: under any autocast.
_LAYER_NORM_AUTOCAST = {"NemotronLayerNorm1P": "cast"}


def _layer_norm_kind(m: torch.nn.Module, family: _Family) -> tuple[float, str] | None:
    """``(weight_offset, autocast rule)`` when ``m`` is a LayerNorm the patch runs through
    :func:`lmfuse.layer_norm`: a ``torch.nn.LayerNorm`` (or a subclass) with torch's own
    forward, any ``normalized_shape``, affine or not, with a bias or not; or an instance
    with a weight of a class the probe found (:attr:`_Family.layer_norms`). Else None."""
    if not isinstance(m, torch.nn.LayerNorm):
        return None
    if type(m).forward is torch.nn.LayerNorm.forward:
        return 0.0, "fp32"
    name = type(m).__name__
    if name in family.layer_norms and isinstance(getattr(m, "weight", None), torch.nn.Parameter):
        return family.layer_norms[name], _LAYER_NORM_AUTOCAST.get(name, "none")
    return None


def _layer_norm_forward(self: torch.nn.Module, input: torch.Tensor) -> torch.Tensor:
    # weight, bias, eps and normalized_shape are read on every call, as the module reads them;
    # a call lmfuse.layer_norm does not stand in for (integrations._layer_norm_like: another
    # shape, a dtype mix PyTorch refuses, an unknown autocast) runs the module's forward.
    if not (isinstance(input, torch.Tensor) and _small_inference_call(
            self, input, math.prod(self.normalized_shape))):
        y = _layer_norm_like(self, input, autocast=self._lmfuse_layer_norm_autocast,
                             weight_offset=self._lmfuse_weight_offset, impl=self._lmfuse_impl)
        if y is not None:
            return y
    return type(self).forward(self, input)


# --- gated MLP ---------------------------------------------------------------------------------


class _GateUpProjection(torch.autograd.Function):
    """``[x @ w_gate.T | x @ w_up.T]`` for ``x [T, H]``, ``w_gate``/``w_up [f, H]``: ``[T, 2f]``.

    lmfuse's gated activations read ``[activated half | linear half]`` as one tensor. The two
    GEMMs write straight into the two column halves of one ``[T, 2f]`` buffer (BLAS takes
    the row stride 2f as the output's leading dimension), and the backward reads the halves
    of the incoming gradient in place. The alternatives each copy something on every call:
    one GEMM over ``torch.cat([w_gate, w_up])`` copies 2fH weight values (all of the MLP's
    up-projection weights, the dominant cost when decoding a few tokens), and
    ``torch.cat`` of two separate GEMMs copies the 2fT activations. The parameters stay two
    separate ``nn.Linear`` weights, so state_dict keys and checkpoint loading are unchanged.
    On an H100, Llama-3-8B's MLP (H 4096, f 14336) over 8192 bf16 tokens, forward and
    backward: 12.4 ms this way, 12.9 ms with the outputs concatenated, 14.3 ms with the
    weights concatenated, 13.4 ms for transformers' own MLP.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
        f = w_gate.shape[0]
        out = x.new_empty((x.shape[0], 2 * f))
        torch.mm(x, w_gate.t(), out=out[:, :f])
        torch.mm(x, w_up.t(), out=out[:, f:])
        ctx.save_for_backward(x, w_gate, w_up)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w_gate, w_up = ctx.saved_tensors
        f = w_gate.shape[0]
        g_gate, g_up = grad[:, :f], grad[:, f:]
        need_x, need_gate, need_up = ctx.needs_input_grad
        dx = torch.mm(g_gate, w_gate).addmm_(g_up, w_up) if need_x else None
        d_gate = g_gate.t().mm(x) if need_gate else None
        d_up = g_up.t().mm(x) if need_up else None
        return dx, d_gate, d_up


def _plain_linear(m: Any) -> bool:
    """An ``nn.Linear`` whose forward is ``F.linear(x, weight, bias)`` (not a LoRA or
    quantised layer that only looks like one), with no hook to run around a call (a
    user's, or FSDP2's all-gather of its sharded weight): what the fused paths may read
    the weight of instead of calling it."""
    return (isinstance(m, torch.nn.Linear) and type(m).forward is torch.nn.Linear.forward
            and "forward" not in m.__dict__ and not _hooked(m))


def _hooked(m: torch.nn.Module) -> bool:
    """A forward or backward hook (the module's own, or a global one) would run around a
    call of ``m``."""
    from torch.nn.modules import module as nn_module

    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or m._backward_pre_hooks or nn_module._global_forward_hooks
                or nn_module._global_forward_pre_hooks or nn_module._global_backward_hooks
                or nn_module._global_backward_pre_hooks)


def _gate_up(mlp: torch.nn.Module, x: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(h [..., 2f], bias [2f] or None)``: the gate and up projections side by side, and
    their biases for the activation kernel to add (``None`` when they were applied here)."""
    if _fused_gate_up(mlp):
        lin = mlp.gate_up_proj
        if not _plain_linear(lin):
            return lin(x), None
        h = F.linear(x, lin.weight)  # (autocast casts its operands)
        return h, (lin.bias.to(h.dtype) if lin.bias is not None else None)
    gate, up = mlp.gate_proj, mlp.up_proj
    if not (_plain_linear(gate) and _plain_linear(up)):
        return torch.cat([gate(x), up(x)], dim=-1), None
    if gate.bias is None and up.bias is None:
        bias = None
    else:
        bias = torch.cat([gate.bias if gate.bias is not None else gate.weight.new_zeros(
            gate.out_features), up.bias if up.bias is not None else up.weight.new_zeros(
            up.out_features)])
    w_gate, w_up = gate.weight, up.weight
    if (torch.is_autocast_enabled(x.device.type) or torch.compiler.is_compiling()
            or not (x.dtype == w_gate.dtype == w_up.dtype)):
        # Autocast casts F.linear's operands (the custom function would not be); under
        # torch.compile the plain ops let Inductor plan the concatenation itself; a dtype
        # mismatch gets F.linear's own error.
        h = torch.cat([F.linear(x, w_gate), F.linear(x, w_up)], dim=-1)
    else:
        h = _GateUpProjection.apply(x.reshape(-1, x.shape[-1]), w_gate, w_up)
        h = h.view(*x.shape[:-1], h.shape[-1])
    return h, (bias.to(h.dtype) if bias is not None else None)


def _gated_mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    # The multipliers are read on every call (as the module's own forward reads them); ones
    # lmfuse cannot apply (not numbers, or on a GELU MLP) leave the call to the module.
    if self._lmfuse_activation == "squared_relu":  # no gate: up, squared ReLU, down
        if _small_inference_call(self, x):
            return type(self).forward(self, x)
        return self.down_proj(_squared_relu(self.up_proj(x), impl=self._lmfuse_impl))
    multipliers = _mlp_multipliers(self)
    if _small_inference_call(self, x) or multipliers is None or (
            multipliers != (1.0, 1.0) and self._lmfuse_activation != "swiglu"):
        return type(self).forward(self, x)
    h, bias = _gate_up(self, x)
    if self._lmfuse_activation != "swiglu":
        return self.down_proj(_geglu(h, bias, impl=self._lmfuse_impl))
    if multipliers == (1.0, 1.0):
        return self.down_proj(_swiglu(h, bias, impl=self._lmfuse_impl))
    g, d = multipliers
    # Falcon-H1 scales down_proj's output by d: the same as scaling its input (inside the
    # activation, no extra pass over the output) when down_proj is a plain nn.Linear
    # without a bias; otherwise d is applied to the output, as the model does.
    fold = _plain_linear(self.down_proj) and self.down_proj.bias is None
    y = _swiglu(h, bias, gate_multiplier=g, down_multiplier=d if fold else 1.0,
                impl=self._lmfuse_impl)
    return self.down_proj(y) if fold else self.down_proj(y) * d


def _gated_activation(act: Any) -> str | None:
    """``"swiglu"`` for a SiLU ``act_fn``, ``"geglu"`` for a tanh-approximated GELU, else
    ``None`` (the MLP is then left as it is)."""
    from transformers import activations as hf

    silu = tuple(c for c in (torch.nn.SiLU, getattr(hf, "SiLUActivation", None)) if c)
    # The tanh GELU under its transformers names (gelu_pytorch_tanh, gelu_new, gelu_fast):
    # 0.5 a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3))), lmfuse's GELU formula.
    gelu_tanh = tuple(c for c in (getattr(hf, name, None) for name in (
        "GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "FastGELUActivation")) if c)
    if act is F.silu or type(act) in silu:
        return "swiglu"
    if type(act) in gelu_tanh or (type(act) is torch.nn.GELU and act.approximate == "tanh"):
        return "geglu"
    return None


# --- rotary position embedding -----------------------------------------------------------------

#: The name an attention forward calls its rotary by, a global of its modeling module.
_ROTARY_NAME = "apply_rotary_pos_emb"
_ROTARY_PARAMS = ("q", "k", "cos", "sin", "unsqueeze_dim")
_ROTARY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _forward_chain(fn: Any) -> list[Any]:
    """``fn`` and the functions it wraps (decorators' ``__wrapped__``), outermost first."""
    chain = [fn]
    while (inner := getattr(chain[-1], "__wrapped__", None)) is not None and len(chain) < 16:
        chain.append(inner)
    return chain


def _rotary_target(forward: Any) -> tuple[int, Any] | None:
    """``(i, fn)``: the innermost function ``i`` of ``forward``'s decorator chain that
    calls the global ``apply_rotary_pos_emb``, and that global's value; None if there is
    none (or ``forward`` is not plain Python functions)."""
    chain = _forward_chain(forward)
    if not all(isinstance(f, types.FunctionType) for f in chain):
        return None
    for i in reversed(range(len(chain))):
        f = chain[i]
        if _ROTARY_NAME in f.__code__.co_names:
            fn = f.__globals__.get(_ROTARY_NAME)
            return (i, fn) if callable(fn) else None
    return None


MixRule = Literal["promote", "cast back", "unknown"]

#: probed function -> False (not lmfuse's formula), or what it does with a dtype mix (bf16 q
#: and k, float32 tables, as under autocast): "promote" (the formula's promotion: float32
#: out), "cast back" (outputs in q's and k's dtypes: OLMo 2's ``.to(q_type)``) or
#: "unknown" (another answer, or an error: a mix runs the model's function)
_ROTARY_PROBED: dict[Any, MixRule | bool] = {}


#: The probe's calls: (heads' dim of q and k, table shape, unsqueeze_dim); all [B, S, R]
#: tables but for Pixtral's ``[S, R]`` with ``unsqueeze_dim=0`` (heads at dim 1), and one
#: partial table (R = D / 2).
_ROTARY_PROBES = ((1, (2, 5, 8), 1), (2, (1, 5, 8), 2), (1, (5, 8), 0), (1, (2, 5, 4), 1))


@torch.no_grad()
def _probe_rotary(fn: Any) -> MixRule | bool:
    """Truthy when the modeling module's ``apply_rotary_pos_emb`` ``fn`` takes ``(q, k,
    cos, sin, unsqueeze_dim=1)`` and computes :func:`lmfuse.apply_rotary_pos_emb`'s
    rotate-half formula: checked once on small random float32 inputs (random tables, so
    that a function reading them another way differs) for each call of
    :data:`_ROTARY_PROBES`; ``fn`` must take the first and may refuse the others by raising
    (a model cannot make such a call then), but must not compute anything else.
    Interleaved (GPT-J style), multimodal and other variants differ and are left as they
    are. The truthy value says what ``fn`` does with a dtype mix (see
    :data:`_ROTARY_PROBED`), from one more call on bf16 q and k and float32 tables."""
    if fn in _ROTARY_PROBED:
        return _ROTARY_PROBED[fn]
    ok = False
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    if (tuple(p.name for p in params) == _ROTARY_PARAMS and params[4].default == 1
            and all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)):
        g = torch.Generator(device="cpu").manual_seed(0)
        ok = True
        for n, (u, table, arg) in enumerate(_ROTARY_PROBES):
            q, k = (torch.randn((2, h, 5, 8) if u == 1 else (2, 5, h, 8), generator=g)
                    for h in (3, 2))
            cos, sin = (torch.randn(table, generator=g) for _ in range(2))
            want = _rotary_reference(q, k, cos, sin, arg)
            try:
                got = fn(q, k, cos, sin, arg)
            except Exception:  # noqa: BLE001 (a call this function refuses)
                if n:
                    continue
                ok = False
                break
            if not (_two_tensors(got) and all(
                    y.shape == w.shape and torch.allclose(y, w, rtol=1e-5, atol=1e-5)
                    for y, w in zip(got, want))):
                ok = False
                break
        if ok:
            ok = _mix_rule(fn, g)
    _ROTARY_PROBED[fn] = ok
    return ok


def _two_tensors(got: Any) -> bool:
    """A rotary's answer has the form of ``(q_embed, k_embed)``."""
    return (isinstance(got, tuple) and len(got) == 2
            and all(isinstance(y, torch.Tensor) for y in got))


def _mix_rule(fn: Any, g: torch.Generator) -> MixRule:
    """What ``fn`` (lmfuse's formula in float32) does with bf16 q and k and float32 tables:
    "promote" (float32 outputs), "cast back" (bf16 ones) or "unknown"."""
    q, k = (torch.randn(2, h, 5, 8, generator=g).bfloat16() for h in (3, 2))
    cos, sin = (torch.randn(2, 5, 8, generator=g) for _ in range(2))
    try:
        got = fn(q, k, cos, sin, 1)
    except Exception:  # noqa: BLE001 (a mix this function refuses: the model's own, then)
        return "unknown"
    if not _two_tensors(got):
        return "unknown"
    dtypes = (got[0].dtype, got[1].dtype)
    return {(torch.float32,) * 2: "promote", (torch.bfloat16,) * 2: "cast back"}.get(
        dtypes, "unknown")


def _rotary_attention(m: torch.nn.Module) -> bool:
    """``m``'s class forward calls its modeling module's ``apply_rotary_pos_emb``, which
    the probe finds to be lmfuse's formula (and the forward can be re-bound: see
    :func:`_rebound_forward`). Not where the module's config sets ``rope_interleave``
    (DeepSeek-V3's default: its forward calls an interleaved rotary instead)."""
    if getattr(getattr(m, "config", None), "rope_interleave", False) is True:
        return False
    target = _rotary_target(getattr(type(m), "forward", None))
    return bool(target is not None and _probe_rotary(target[1])
                and _rebound_forward(type(m).forward, "torch") is not None)


def _rotary_heads_dim(q: Any, k: Any, cos: Any, sin: Any, unsqueeze_dim: Any,
                      mixes: bool = True) -> int | None:
    """Where the heads are (1 or 2) for a call :func:`lmfuse.apply_rotary_pos_emb` computes
    as the model's function does, else None: 4-D q and k; ``[B, S, R]`` tables with
    ``unsqueeze_dim`` 1 or 2, or ``[S, R]`` ones with ``unsqueeze_dim=0`` (Pixtral's: the
    heads at dim 1; a 2-D table with 1 or 2 the model's function broadcasts otherwise); float
    dtypes lmfuse's kernel takes, mixed only where ``mixes`` (the probe found what the
    model's function does with a mix)."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin)):
        return None
    if isinstance(unsqueeze_dim, bool) or not isinstance(unsqueeze_dim, int):
        return None
    if not (q.dim() == k.dim() == 4 and cos.shape == sin.shape
            and (cos.dim(), unsqueeze_dim) in ((3, 1), (3, 2), (2, 0))):
        return None
    dtypes = (q.dtype, k.dtype, cos.dtype, sin.dtype)
    if not (all(d in _ROTARY_DTYPES for d in dtypes) and (mixes or len(set(dtypes)) == 1)
            and q.device == k.device == cos.device == sin.device):
        return None
    u = unsqueeze_dim or 1
    B, S, D, R = q.shape[0], q.shape[3 - u], q.shape[-1], cos.shape[-1]
    if (k.shape[0] == B and k.shape[3 - u] == S and k.shape[-1] == D
            and (cos.dim() == 2 or cos.shape[0] in (1, B)) and cos.shape[-2] == S
            and R % 2 == 0 and 0 < R <= D):
        return u
    return None


def _rotary_for(own: Any, impl: str) -> Any:
    """What a patched attention forward finds as its global ``apply_rotary_pos_emb``:
    lmfuse's rotary, with its outputs' dtypes as ``own``'s (the modeling module's function,
    probed: the formula's promotion, or cast back to q's and k's dtypes), or ``own`` for a
    call :func:`_rotary_heads_dim` refuses (a dtype mix, where the probe could not tell what
    ``own`` does with one)."""
    rule = _probe_rotary(own)
    promote, mixes = rule != "cast back", rule in ("promote", "cast back")

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if _rotary_heads_dim(q, k, cos, sin, unsqueeze_dim, mixes) is None:
            return own(q, k, cos, sin, unsqueeze_dim)
        # (lmfuse's unsqueeze_dim means what the model's does: the tables' new dim)
        return _rotary(q, k, cos, sin, unsqueeze_dim, impl, promote)

    return apply_rotary_pos_emb


def _with(f: types.FunctionType, globals_: dict[str, Any] | None = None,
          closure: tuple[Any, ...] | None = None) -> types.FunctionType:
    """A copy of function ``f`` with other globals or closure cells, its attributes kept."""
    new = types.FunctionType(f.__code__, f.__globals__ if globals_ is None else globals_,
                             f.__name__, f.__defaults__,
                             f.__closure__ if closure is None else closure)
    new.__kwdefaults__ = copy.copy(f.__kwdefaults__)
    new.__dict__.update(f.__dict__)
    for a in ("__qualname__", "__module__", "__doc__", "__annotations__"):
        setattr(new, a, getattr(f, a))
    return new


_REBOUND: dict[tuple[Any, str], Any] = {}


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # (an empty cell)
        return False
    return True


def _rebound_forward(forward: Any, impl: str, refresh: bool = False) -> Any:
    """The attention class's ``forward`` with its modeling module's globals but for
    ``apply_rotary_pos_emb``, which is :func:`_rotary_for`'s: the innermost function that
    calls it re-bound to those globals (a copy of the module's globals, taken when built),
    and each decorator around it (``deprecate_kwarg``'s wrapper, ...) re-made with a
    closure that holds the re-bound function in place of the original. None when a
    decorator holds its function elsewhere than in a closure cell. Cached per function and
    ``impl`` (a process's patched models of one class share it); ``refresh``: built anew
    (each patch does, so the copy is the module's globals as of the latest patch)."""
    key = (forward, impl)
    if key in _REBOUND and not refresh:
        return _REBOUND[key]
    new = None
    target = _rotary_target(forward)
    if target is not None:
        chain = _forward_chain(forward)
        i, own = target
        f = chain[i]
        # Without ``__name__``: torch.compile resolves the globals of a function that names
        # its module through the module itself (where apply_rotary_pos_emb is the model's),
        # and those of one that does not through the dict (these).
        globals_ = {k: v for k, v in f.__globals__.items() if k != "__name__"}
        new = _with(f, {**globals_, _ROTARY_NAME: _rotary_for(own, impl)})
        for j in reversed(range(i)):
            w, inner = chain[j], chain[j + 1]
            cells = w.__closure__ or ()
            if not any(_filled(c) and c.cell_contents is inner for c in cells):
                new = None
                break
            prev = new
            new = _with(w, closure=tuple(
                types.CellType(prev) if _filled(c) and c.cell_contents is inner else c
                for c in cells))
            if "__wrapped__" in new.__dict__:
                new.__wrapped__ = prev
    _REBOUND[key] = new
    return new


def _rope_attention_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The patched attention forward: the class's own, its rotary lmfuse's (see
    :func:`_rebound_forward`); the class's as it is for a small call with autograd off
    (``inference_fallback_tokens``, counted on ``hidden_states``)."""
    forward = type(self).forward
    x = args[0] if args else kwargs.get("hidden_states")
    if isinstance(x, torch.Tensor) and _small_inference_call(self, x):
        return forward(self, *args, **kwargs)
    # Built at patch time (or as a patched model is unpickled), after the probe: a class
    # forward without one (replaced since: its rotary unprobed) runs as it is, as does
    # one whose building failed; nothing is built here, where torch.compile may trace.
    return (_REBOUND.get((forward, self._lmfuse_impl)) or forward)(self, *args, **kwargs)


def _warm_rope(module: torch.nn.Module) -> None:
    """Build an unpickled (or deep-copied) patched attention's re-bound forwards, for every
    ``impl``, outside any call torch.compile traces, where its class forward's rotary
    passes the probe (the module's own state may not be restored yet: only its class is
    read)."""
    forward = getattr(type(module), "forward", None)
    target = _rotary_target(forward)
    if target is not None and _probe_rotary(target[1]):
        for impl in ("auto", "triton", "torch"):
            _rebound_forward(forward, impl)


_rope_attention_forward.lmfuse_restored = _warm_rope


# --- mixture-of-experts experts ----------------------------------------------------------------


class _ExpertsLayout(NamedTuple):
    """How one experts module maps onto :func:`lmfuse.moe_experts`'s arguments."""

    transposed: bool  # gate_up_proj [E, H, 2F], down_proj [E, F, H] (GPT-OSS); else [E, 2F, H]
    biases: bool  # gate_up_proj_bias [E, 2F] and down_proj_bias [E, H]
    activation: str  # "swiglu", "geglu" or "quick_geglu"
    linear_offset: float
    clamp_value: float | None
    gate_up_layout: str  # "halves" or "interleaved"


def _number(v: Any) -> float | None:
    """``v`` as a float when it is a finite int or float (not a bool), else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _experts_layout(m: torch.nn.Module) -> _ExpertsLayout | str | None:
    """The :class:`_ExpertsLayout` of transformers' fused experts module ``m``, a sentence
    saying why :func:`lmfuse.moe_experts` cannot take it, or None when ``m`` is not one.

    An experts module holds all experts' weights as two 3-D parameters, ``gate_up_proj``
    and ``down_proj``: ``[E, 2F, H]`` and ``[E, H, F]`` (Mixtral, Qwen2/3-MoE, OLMoE,
    Granite-MoE), or transposed, ``[E, H, 2F]`` and ``[E, F, H]`` (GPT-OSS, read through
    ``transpose(1, 2)`` views: the op takes any strides). The two layouts cannot be confused:
    both would need ``F = 0``. The attributes transformers' ``use_experts_implementation``
    sets (``has_gate``, ``is_transposed``, ``is_concatenated``, ``has_bias``,
    ``has_post_expert_norm``) must agree. The activation is the module's ``act_fn`` (SiLU,
    tanh GELU, quick GELU), or GPT-OSS's ``(clamp(up, -limit, limit) + 1) *
    quick_gelu_alpha(clamp(gate, max=limit))`` with interleaved gate/up columns, which is
    ``quick_geglu(linear_offset=1, clamp_value=limit)`` only when ``alpha`` is 1.702.
    """
    gate_up, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    if not (isinstance(gate_up, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter)
            and gate_up.dim() == 3 and down.dim() == 3 and _positional_inputs(m, 3)):
        return None
    if getattr(m, "has_gate", True) is not True:
        return "experts without a gate projection"
    if getattr(m, "has_post_expert_norm", False) is not False:
        return "a norm after each expert"
    if not (gate_up.dtype == down.dtype and gate_up.dtype.is_floating_point):
        return f"weights of dtypes {gate_up.dtype} and {down.dtype}"
    E, a, b = gate_up.shape
    if down.shape[0] != E:
        return f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)}"
    if a == 2 * down.shape[2] and b == down.shape[1]:
        transposed, H, Fdim = False, b, down.shape[2]
    elif b == 2 * down.shape[1] and a == down.shape[2]:
        transposed, H, Fdim = True, a, down.shape[1]
    else:
        return (f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are "
                f"neither [E, 2F, H] and [E, H, F] nor their transposes")
    if getattr(m, "is_transposed", transposed) is not transposed:
        return f"is_transposed={m.is_transposed} with weights of the other layout"
    bias_gu, bias_d = getattr(m, "gate_up_proj_bias", None), getattr(m, "down_proj_bias", None)
    biases = getattr(m, "has_bias", bias_gu is not None or bias_d is not None)
    if biases is not False:
        if not (isinstance(bias_gu, torch.nn.Parameter) and isinstance(bias_d, torch.nn.Parameter)
                and tuple(bias_gu.shape) == (E, 2 * Fdim) and tuple(bias_d.shape) == (E, H)
                and bias_gu.dtype == bias_d.dtype == gate_up.dtype):
            return "expert biases other than gate_up_proj_bias [E, 2F], down_proj_bias [E, H]"
    concatenated = getattr(m, "is_concatenated", True)
    if not isinstance(concatenated, bool):
        return f"is_concatenated={concatenated!r}"
    layout = "halves" if concatenated else "interleaved"
    act = getattr(m, "act_fn", None)
    if act is not None:
        activation = _gated_activation(act)
        if activation is None:
            from transformers.activations import QuickGELUActivation

            if type(act) is not QuickGELUActivation:
                return f"activation {_activation_name(act)}"
            activation = "quick_geglu"
        # DeepSeek-V4 clamps gate <= limit and -limit <= up <= limit before its act_fn (in
        # _apply_gate): moe_experts' clamp_value; _probe_experts tries both sides of it.
        clamp = None
        if getattr(m, "limit", None) is not None:
            clamp = _number(m.limit)
            if clamp is None or not clamp > 0:
                return f"experts clamp limit {m.limit!r} (a clamp needs a positive number)"
        return _ExpertsLayout(transposed, biases is not False, activation, 0.0, clamp, layout)
    alpha, limit = _number(getattr(m, "alpha", None)), _number(getattr(m, "limit", None))
    if alpha is None or limit is None or "_apply_gate" not in type(m).__dict__:
        return "no act_fn, and not GPT-OSS's clamped gate (alpha, limit, _apply_gate)"
    if alpha != QUICK_GELU_K:
        return f"GPT-OSS gate with alpha {alpha} (lmfuse's quick_geglu has {QUICK_GELU_K})"
    if not limit > 0:
        return f"GPT-OSS gate with limit {limit} (a clamp needs a positive one)"
    return _ExpertsLayout(transposed, biases is not False, "quick_geglu", 1.0, limit, layout)


def _experts_args(m: torch.nn.Module, layout: _ExpertsLayout) -> dict[str, Any]:
    """``moe_experts``' weight and setting arguments: views of ``m``'s parameters, no copy."""
    w_gate_up, w_down = m.gate_up_proj, m.down_proj
    if layout.transposed:
        w_gate_up, w_down = w_gate_up.transpose(1, 2), w_down.transpose(1, 2)
    return dict(w_gate_up=w_gate_up, w_down=w_down,
                gate_up_bias=m.gate_up_proj_bias if layout.biases else None,
                down_bias=m.down_proj_bias if layout.biases else None,
                activation=layout.activation, linear_offset=layout.linear_offset,
                clamp_value=layout.clamp_value, gate_up_layout=layout.gate_up_layout)


@torch.no_grad()
def _probe_experts(m: torch.nn.Module, layout: _ExpertsLayout) -> str:
    """``''`` when ``m(hidden, expert_ids, router_weights)`` (the class's forward, whatever
    experts implementation the config picks) equals :func:`lmfuse.moe_experts` with
    ``layout`` on four tokens routed to up to two experts each; else why not (the
    warning's words). With a clamp, the tokens are scaled so that the largest gate/up
    output is three times the clamp: both sides of it are tried."""
    p = m.gate_up_proj
    if p.device.type == "meta":
        return "its weights are on the meta device: nothing to compare moe_experts with"
    args = _experts_args(m, layout)
    E, H = args["w_gate_up"].shape[0], args["w_gate_up"].shape[2]
    k = min(2, E)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(4, H, generator=g).to(device=p.device, dtype=p.dtype)
    ids = ((torch.arange(4)[:, None] + torch.arange(k)[None, :]) % E).to(p.device)
    w = (torch.rand(4, k, generator=g) + 0.5).to(device=p.device, dtype=p.dtype)
    if layout.clamp_value is not None:
        h = torch.stack([F.linear(x[t], args["w_gate_up"][int(e)], None if args[
            "gate_up_bias"] is None else args["gate_up_bias"][int(e)])
            for t in range(4) for e in ids[t]])
        peak = float(h.abs().max())
        if peak > 0:
            x = x * (3 * layout.clamp_value / peak)
    try:
        y = type(m).forward(m, x, ids, w)
    except Exception as e:  # noqa: BLE001 - another signature, or a dtype it cannot run
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return (f"its forward raised on a probe input in {p.dtype} ({type(e).__name__}: "
                f"{first}), so it could not be compared with moe_experts")
    try:
        want = _moe_experts(x, ids, w, **args, impl="torch")
    except Exception:  # noqa: BLE001 - another structure
        want = None
    if want is not None and _close(y, want):
        return ""
    return ("computes another formula than moe_experts with activation="
            f"{layout.activation}, linear_offset={layout.linear_offset}, clamp_value="
            f"{layout.clamp_value}, gate_up_layout={layout.gate_up_layout}")


def _experts_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The patched experts forward: ``(hidden_states [T, H], top_k_index [T, k],
    top_k_weights [T, k]) -> [T, H]`` (GPT-OSS names them ``router_indices``,
    ``routing_weights``) through :func:`lmfuse.moe_experts`; the class's forward for calls
    the op cannot serve."""
    if len(args) == 3 and not kwargs:
        hidden, ids, weights = args
    else:
        bound = _signature(type(self)).bind(self, *args, **kwargs).arguments
        hidden, ids, weights = (list(bound.values()) + [None] * 3)[1:4]
    layout: _ExpertsLayout = self._lmfuse_experts
    w = self.gate_up_proj
    if (getattr(self, "_is_expert_parallel", False)  # ids may name experts of other ranks
            or not isinstance(hidden, torch.Tensor) or hidden.dim() != 2
            or not isinstance(ids, torch.Tensor) or ids.is_floating_point()
            or ids.dim() != 2 or ids.shape[0] != hidden.shape[0]
            or not isinstance(weights, torch.Tensor) or not weights.is_floating_point()):
        return type(self).forward(self, *args, **kwargs)
    op_args = _experts_args(self, layout)
    dtype, device_type = hidden.dtype, hidden.device.type
    if not torch.is_autocast_enabled(device_type):
        if dtype != w.dtype:
            return type(self).forward(self, *args, **kwargs)
        return _moe_experts(hidden, ids, weights, **op_args, impl=self._lmfuse_impl)
    # The model's F.linear calls would run in the autocast dtype: so does the op (the weights
    # cast as autocast casts them), and the sum comes back in the input's dtype as the
    # model's does.
    cast = torch.get_autocast_dtype(device_type)
    for name in ("w_gate_up", "w_down", "gate_up_bias", "down_bias"):
        if op_args[name] is not None:
            op_args[name] = op_args[name].to(cast)
    with torch.autocast(device_type, enabled=False):
        out = _moe_experts(hidden.to(cast), ids, weights, **op_args, impl=self._lmfuse_impl)
    return out.to(dtype)


# --- causal-LM loss ----------------------------------------------------------------------------


def _causal_lm_loss(hidden: torch.Tensor, lm_head: torch.nn.Linear,
                    labels: torch.Tensor | None, *, shift_labels: torch.Tensor | None,
                    num_items_in_batch: Any, ignore_index: int, softcap: float | None,
                    impl: str, logits_scaling: Any = None, extras: bool = False) -> Any:
    """transformers' ``ForCausalLMLoss`` on ``lm_head(hidden)``, without the logits.

    ``hidden [B, S, H]``; ``labels [B, S]`` (position ``i`` is scored against label ``i + 1``,
    the last position against nothing) or, instead, ``shift_labels [B, S]`` already aligned
    with ``hidden``. Mean over the non-ignored tokens, or their sum divided by
    ``num_items_in_batch`` (gradient accumulation over micro-batches). ``extras``: returns
    ``(loss, token_accuracy, predicted_tokens)``, as :func:`lmfuse.linear_cross_entropy`
    gives them (the targets' shape, -1 where ignored; the accuracy over the counted tokens).
    """
    if shift_labels is None:
        # Padding the labels (not slicing hidden[:, :-1]) keeps hidden contiguous: no copy.
        target = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    else:
        target = shift_labels
    if target.dim() == 1 and hidden.dim() == 3 and hidden.shape[0] == 1:
        target = target[None]  # one sequence's labels unbatched, as transformers takes them
    target = target.to(hidden.device)
    weight, bias = lm_head.weight, lm_head.bias
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        # lm_head's F.linear would run in the autocast dtype; the fused op is not autocast.
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    if isinstance(logits_scaling, (int, float)) and logits_scaling != 1:
        # Granite divides the logits by config.logits_scaling: (h W^T + b) / s; Falcon-H1
        # multiplies them by lm_head_multiplier (passed here as its inverse)
        hidden = hidden / logits_scaling
        bias = bias / logits_scaling if bias is not None else None
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = _linear_cross_entropy(hidden, weight, target, bias=bias, ignore_index=ignore_index,
                                 softcap=softcap, reduction=reduction, impl=impl,
                                 return_token_accuracy=extras, return_predicted_tokens=extras)
    if extras:
        loss, _, accuracy, predicted = loss
    if num_items_in_batch is None:
        # transformers' mean over no token is NaN (F.cross_entropy's), lmfuse's 0: NaN
        # here too (an all-ignored batch shows as in the unpatched model; the gradients
        # stay zero, as there). No host synchronisation.
        loss = torch.where((target != ignore_index).any(), loss,
                           loss.new_full((), float("nan")))
    else:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return (loss, accuracy, predicted) if extras else loss


@functools.cache
def _signature(cls: type) -> inspect.Signature:
    """The signature of ``cls.forward`` (transformers' own causal-LM forward), ``self`` first."""
    return inspect.signature(cls.forward)


def _causal_lm_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    """The patched causal-LM forward: the class's own forward unless ``labels`` are given
    (and ``logits_to_keep`` is 0) and the call trains (training mode, or gradients on),
    then :func:`_forward_with_loss`. An evaluation (eval mode under ``torch.no_grad()``,
    as the Trainer's evaluate and predict call it) runs the model's own forward: it
    returns the logits, which metrics read."""
    original = type(self).forward
    if any(k in kwargs for k in _LIGER_OUTPUTS) or "skip_logits" in kwargs:
        liger = {k: kwargs.pop(k) for k in (*_LIGER_OUTPUTS, "skip_logits") if k in kwargs}
        if liger.get("skip_logits") is False:  # the logits asked for: the model's forward
            return original(self, *args, **kwargs)
        kwargs.update((k, v) for k, v in liger.items() if k in _LIGER_OUTPUTS and v)
        skip = liger.get("skip_logits") is True
    else:
        skip = False
    a = dict(_signature(type(self)).bind(self, *args, **kwargs).arguments)
    if skip and a.get("labels") is None:
        raise ValueError(f"{type(self).__name__}: skip_logits=True needs labels (the fused "
                         "loss is what it asks for)")
    keep = a.get("logits_to_keep", 0)
    if (a.get("labels") is None or not (isinstance(keep, int) and keep == 0)
            or not (self.training or torch.is_grad_enabled() or skip)
            # an lm_head to call (an adapter, a hook, FSDP2's weight gather), or a loss of
            # the user's (model.loss_function = ...): the model's own forward runs them
            or not _plain_linear(self.lm_head)
            or getattr(self, "_loss_function", None) is not None
            or not _causal_lm_loss_type(self)):
        return original(self, *args, **_without_liger(kwargs))
    router = kwargs.get("output_router_logits", a.get("output_router_logits"))
    if router is None:
        router = _config_router_logits(self.config)
    if router:  # a mixture of experts adds its load-balancing loss there: the model's own
        return original(self, *args, **_without_liger(kwargs))
    var_kw = next((p.name for p in _signature(type(self)).parameters.values()
                   if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    return _forward_with_loss(self, a, var_kw)


#: Liger-Kernel's forward keywords for the loss's by-products: with labels, the fused loss
#: adds ``token_accuracy`` and ``predicted_tokens`` to the output (``skip_logits=False``
#: asks for the logits: the model's own forward runs).
_LIGER_OUTPUTS = ("return_token_accuracy", "return_predicted_tokens")


def _without_liger(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` without the Liger output keywords (the model's own forward computes no such
    thing: ``token_accuracy`` and ``predicted_tokens`` come only with the fused loss)."""
    return {k: v for k, v in kwargs.items() if k not in _LIGER_OUTPUTS}


def _causal_lm_loss_type(model: Any) -> bool:
    """``model.loss_type`` names transformers' causal-LM loss (or none is named): the loss
    the fused path computes."""
    kind = getattr(model, "loss_type", None)
    if kind is None:
        return True
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:  # pragma: no cover - transformers without its loss table
        return kind == "ForCausalLM"
    return LOSS_MAPPING.get(kind) is ForCausalLMLoss


def _config_router_logits(config: Any) -> bool:
    """The config asks for router logits: its own ``output_router_logits`` or its text
    config's (the MoE vision-language models, GLM-4.5V, Qwen3-VL-MoE and Qwen3.5-MoE, read
    it there when the call does not say)."""
    return bool(getattr(config, "output_router_logits", False)
                or getattr(_text_config(config), "output_router_logits", False))


def _text_config(config: Any) -> Any:
    """A vision-language model's text (decoder) config; a text model's config itself."""
    return (config.get_text_config(decoder=True) if hasattr(config, "get_text_config")
            else config)


def _logits_scaling(model: Any, facts: _LossFacts) -> Any:
    """What the causal LM divides its ``lm_head`` output by (before any soft cap): Granite's
    ``config.logits_scaling``, over Falcon-H1's ``model.lm_head_multiplier`` and MuseGlimmer's
    (text) config ``output_multiplier`` (its logits are ``T * tanh(lm_head(h) * m / T)``)."""
    scaling = getattr(model.config, "logits_scaling", None)
    multiplier = 1.0
    found = [getattr(getattr(model, "model", None), "lm_head_multiplier", None)]
    if facts.reads_output_multiplier:
        found.append(getattr(_text_config(model.config), "output_multiplier", None))
    for m in found:
        if isinstance(m, (int, float)) and not isinstance(m, bool):
            multiplier *= m
    if multiplier != 1:
        return 1.0 / multiplier if scaling is None else scaling / multiplier
    return scaling


@functools.cache
def _forward_reads(cls: type, name: str) -> bool:
    """``cls.forward`` reads config field ``name`` (applies it to its logits): Gemma 2/3/4's
    causal LMs and PaliGemma apply ``final_logit_softcapping``, Gemma 3's multimodal model
    does not, whatever its text config says; MuseGlimmer's applies ``output_multiplier``."""
    try:
        return name in inspect.getsource(cls.forward)
    except (OSError, TypeError):  # no source to read: the config decides, as before
        return True


def _final_softcap(model: Any, facts: _LossFacts) -> Any:
    """The cap the causal LM's own forward puts on its logits, or None: its (text) config's
    ``final_logit_softcapping`` where its forward applies it."""
    if not facts.reads_softcap:
        return None
    return getattr(_text_config(model.config), "final_logit_softcapping", None)


@functools.cache
def _output_class(cls: type) -> type:
    """The output class ``cls.forward`` returns (its annotation: ``CausalLMOutputWithPast``,
    Mixtral's ``MoeCausalLMOutputWithPast``, Gemma 4's or a vision-language model's own),
    so that the patched forward returns the same type with the same fields."""
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.utils import ModelOutput

    ret = _signature(cls).return_annotation
    for c in (ret, *typing.get_args(ret)):
        if isinstance(c, type) and issubclass(c, ModelOutput) and "loss" in _fields_of(c):
            return c
    return CausalLMOutputWithPast


def _fields_of(c: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(c)) if dataclasses.is_dataclass(c) else ()


class _LossFacts(NamedTuple):
    """What the fused loss needs to know of a causal LM's class, read from its source and
    annotations once, when the patch is set (``inspect.getsource`` and
    ``dataclasses.fields`` break a ``torch.compile`` graph: read in the forward, they split
    every compiled training step and failed ``fullgraph=True``)."""
    reads_softcap: bool  # its forward applies final_logit_softcapping
    reads_output_multiplier: bool  # and MuseGlimmer's output_multiplier
    output_class: type  # the output class the forward returns
    fields: tuple[str, ...]  # the fields the patched forward copies from the base model's


@functools.cache
def _loss_facts(cls: type) -> _LossFacts:
    out = _output_class(cls)
    return _LossFacts(_forward_reads(cls, "final_logit_softcapping"),
                      _forward_reads(cls, "output_multiplier"), out,
                      tuple(n for n in _fields_of(out) if n not in ("loss", "logits", "aux_loss")))


def _forward_with_loss(model: Any, a: dict[str, Any], var_kw: str | None) -> Any:
    """The causal LM's forward with labels: base model, then the fused loss; ``logits=None``.

    ``a``: the forward's bound arguments. Everything but ``labels``/``logits_to_keep`` goes
    to the base model as transformers' forward passes it, the loss options (``shift_labels``,
    ``num_items_in_batch``, ``ignore_index``) to the loss as its ``loss_function`` takes them.
    """
    extra = dict(a.pop(var_kw, None) or {}) if var_kw else {}
    wanted = [k for k in _LIGER_OUTPUTS if extra.pop(k, False)]
    facts = getattr(model, "_lmfuse_loss_facts", None) or _loss_facts(type(model))
    a.pop("self", None)
    labels = a.pop("labels")
    a.pop("logits_to_keep", None)
    # As transformers' can_return_tuple: the call's return_dict, else the config's.
    return_dict = extra.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    outputs = model.model(**a, **extra)
    loss = _causal_lm_loss(
        outputs.last_hidden_state, model.lm_head, labels,
        shift_labels=extra.get("shift_labels"),
        num_items_in_batch=extra.get("num_items_in_batch"),
        ignore_index=extra.get("ignore_index", -100),
        softcap=_final_softcap(model, facts),
        impl=model._lmfuse_impl, logits_scaling=_logits_scaling(model, facts),
        extras=bool(wanted))
    if wanted:
        loss, accuracy, predicted = loss
    out = facts.output_class(loss=loss, logits=None, **{
        name: getattr(outputs, name) for name in facts.fields if hasattr(outputs, name)})
    # Liger's fields, as its forward adds them (keys of the output, last in its tuple)
    if "return_token_accuracy" in wanted:
        out["token_accuracy"] = accuracy
    if "return_predicted_tokens" in wanted:
        out["predicted_tokens"] = predicted
    if return_dict:
        return out
    # to_tuple() drops None fields: the logits' place kept (None), as the model's tuple
    # has them second.
    flat = out.to_tuple()
    return (flat[0], None) + flat[1:]


# --- applying the patch ------------------------------------------------------------------------


class _Forward(_PatchedMethod):
    """A patched module's ``forward`` (pickled whole with the model by ``torch.save``) that
    shows transformers the signature it inspects (generation's ``logits_to_keep`` support,
    the Trainer's column filter): the class's own forward's."""

    __slots__ = ()

    @property
    def __signature__(self) -> inspect.Signature:
        sig = (_signature(type(self.module)) if self.fn in (_causal_lm_forward,
                                                              _experts_forward,
                                                              _rope_attention_forward)
               else inspect.signature(self.fn))
        return sig.replace(parameters=list(sig.parameters.values())[1:])


def _set_forward(m: torch.nn.Module, fn: Any, **settings: Any) -> None:
    """Patch ``m``'s forward to run ``fn``, which reads ``settings`` as ``m._lmfuse_<name>``."""
    for name, value in settings.items():
        setattr(m, f"_lmfuse_{name}", value)
    m.forward = _Forward(fn, m)


def _patch_norm(m: torch.nn.Module, offset: float, impl: str, fallback: int) -> bool:
    """Run RMSNorm ``m`` through :func:`lmfuse.rms_norm`; False if it is not a plain one."""
    weight = getattr(m, "weight", None)
    if not (isinstance(weight, torch.nn.Parameter) and weight.dim() == 1
            and _norm_eps(m) is not None):
        return False
    _set_forward(m, _rms_norm_forward, weight_offset=offset, impl=impl, fallback_tokens=fallback)
    return True


def _patch_layer_norm(m: torch.nn.Module, kind: tuple[float, str], impl: str,
                      fallback: int) -> None:
    """Run LayerNorm ``m`` (:func:`_layer_norm_kind` gave ``kind``) through
    :func:`lmfuse.layer_norm`."""
    offset, autocast = kind
    _set_forward(m, _layer_norm_forward, weight_offset=offset, layer_norm_autocast=autocast,
                 impl=impl, fallback_tokens=fallback)


def _patch_mlp(m: torch.nn.Module, impl: str, fallback: int) -> str | None:
    """Run gated MLP ``m``'s activation fused: ``"swiglu"``/``"geglu"`` when patched, the
    activation's name when it is not one lmfuse fuses, None when ``m`` is not a gated MLP."""
    if not _is_fusable_mlp(m):
        return None
    activation = _mlp_activation(m)
    if activation is None:
        return _activation_name(_mlp_act(m))
    _set_forward(m, _gated_mlp_forward, activation=activation, impl=impl,
                 fallback_tokens=fallback)
    return activation


def _patch_rope(m: torch.nn.Module, impl: str, fallback: int) -> None:
    """Run attention ``m``'s rotary (:func:`_rotary_attention`) through
    :func:`lmfuse.apply_rotary_pos_emb`. Its re-bound forward is built here (not in a call
    torch.compile traces), from the module's globals as they are now."""
    _rebound_forward(type(m).forward, impl, refresh=True)
    _set_forward(m, _rope_attention_forward, impl=impl, fallback_tokens=fallback)


def _patch_experts(m: torch.nn.Module, impl: str) -> str:
    """Run experts module ``m`` through :func:`lmfuse.moe_experts`: ``""`` when patched,
    else why not. No inference fallback (see :func:`apply_lmfuse`'s ``experts``)."""
    layout = _experts_layout(m)
    if not isinstance(layout, _ExpertsLayout):
        return layout or "not an experts module"
    _set_forward(m, _experts_forward, experts=layout, impl=impl)
    return ""


#: what lmfuse patches run
_PATCHES = (_rms_norm_forward, _layer_norm_forward, _gated_mlp_forward, _experts_forward,
            _rope_attention_forward)
#: Why a probed MLP of a fusable form stays the model's (``mlp_unsupported_activation``).
_ANOTHER_FORMULA = "not the fused formula on a probe: a dropout, a clamp or another step"
#: The activations of the MLPs lmfuse runs fused (the keys of ``model.lmfuse_patches``).
_FUSED_ACTIVATIONS = ("swiglu", "geglu", "squared_relu")
_PATCH_ATTRS = ("forward", "_lmfuse_weight_offset", "_lmfuse_impl", "_lmfuse_fallback_tokens",
                "_lmfuse_activation", "_lmfuse_experts", "_lmfuse_layer_norm_autocast")


@contextlib.contextmanager
def fused_norms_and_mlps(model: torch.nn.Module, impl: str = "auto") -> Iterator[bool]:
    """While the block runs, ``model``'s RMSNorms, LayerNorms, gated MLPs and the rotary of
    its attention layers (of a family :func:`apply_lmfuse` supports; the attention modules
    ``apply_lmfuse``'s ``rope`` patches) run lmfuse's fused ops on every call, however few
    tokens (``inference_fallback_tokens=0``), and its mixture-of-experts experts modules (those
    :func:`apply_lmfuse` runs through :func:`lmfuse.moe_experts`: no host synchronisation,
    only the selected experts' weights read): for capturing a decode step in a CUDA graph,
    where a launch costs no host time and fewer, fused kernels are what pays. Afterwards the
    modules are exactly as before (an :func:`apply_lmfuse` patch with its own settings, or
    none). Yields whether the model's family is supported (else nothing changes)."""
    family = _family_of(model)
    saved: list[tuple[torch.nn.Module, dict[str, Any]]] = []
    if family is not None:
        for m in model.modules():
            cls = type(m).__name__
            ln = _layer_norm_kind(m, family)
            current = _instance_attr(m)
            rope = current is _rope_attention_forward or (
                current is None and _rotary_attention(m))
            if (ln is None and cls not in family.norms and cls not in family.mlps
                    and cls not in family.experts and not rope):
                continue
            if current is not None and current not in _PATCHES:
                continue  # another library's forward: left alone
            before = {a: m.__dict__[a] for a in _PATCH_ATTRS if a in m.__dict__}
            if current is _experts_forward:  # apply_lmfuse ran it through moe_experts already
                continue
            if cls in family.experts:
                if not family.experts[cls] and not _patch_experts(m, impl):
                    saved.append((m, before))
                continue
            if current is not None:  # patched by apply_lmfuse: only the fallback changes
                saved.append((m, before))
                m._lmfuse_fallback_tokens = 0
            elif ln is not None:
                _patch_layer_norm(m, ln, impl, 0)
                saved.append((m, before))
            elif rope:
                _patch_rope(m, impl, 0)
                saved.append((m, before))
            elif cls in family.norms and _patch_norm(m, family.norms[cls], impl, 0):
                saved.append((m, before))
            elif cls in family.mlps:
                if _patch_mlp(m, impl, 0) in _FUSED_ACTIVATIONS:
                    saved.append((m, before))
    try:
        yield family is not None
    finally:
        for m, before in saved:
            for a in _PATCH_ATTRS:
                if a in before:
                    m.__dict__[a] = before[a]
                else:
                    m.__dict__.pop(a, None)


def _summary(model: torch.nn.Module, family: _Family, impl: str) -> dict[str, Any]:
    norms, layer_norms, experts, rope, unpatched = [], [], [], [], {}
    mlps: dict[str, list[str]] = {name: [] for name in _FUSED_ACTIVATIONS}
    for name, m in model.named_modules():
        fn = _instance_attr(m)
        if fn is _rms_norm_forward:
            norms.append(name)
        elif fn is _layer_norm_forward:
            layer_norms.append(name)
        elif fn is _gated_mlp_forward:
            mlps[m._lmfuse_activation].append(name)
        elif fn is _experts_forward:
            experts.append(name)
        elif fn is _rope_attention_forward:
            rope.append(name)
        elif type(m).__name__ in family.mlps and _mlp_activation(m) is None:
            unpatched[name] = _activation_name(_mlp_act(m))
        elif type(m).__name__ in family.rejected_mlps:
            unpatched[name] = _ANOTHER_FORMULA
    return {"impl": impl, "rms_norm": norms, "layer_norm": layer_norms, "rope": rope, **mlps,
            "mlp_unsupported_activation": unpatched, "moe_experts": experts,
            "fused_linear_cross_entropy": _instance_attr(model) is _causal_lm_forward}


def apply_lmfuse(model: torch.nn.Module, *, rms_norm: bool = True, layer_norm: bool = True,
                 rope: bool = True, swiglu: bool = True, fused_linear_cross_entropy: bool = True,
                 experts: bool = True, impl: str = "auto",
                 inference_fallback_tokens: int = 64) -> torch.nn.Module:
    """Patch a loaded ``transformers`` model in place to run lmfuse's fused ops.

    Works on the Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma2 and Gemma3 (text) families and,
    with their norms and MLPs found by a probe of what each module computes, Granite
    (``logits_scaling`` applied), OLMo 2 and 3, GLM-4, SmolLM3, EXAONE 4, Ministral, Helium,
    Seed-OSS, Arcee, Phi-3, LFM2, Hunyuan dense, Apertus, Llama 4 (text), Falcon-H1 (its
    ``lm_head_multiplier`` applied in the loss, its MLPs' ``gate_multiplier`` and
    ``down_multiplier`` in the fused SwiGLU) and the mixtures of experts Mixtral,
    Qwen2-MoE, Qwen3-MoE, OLMoE, Granite-MoE, GPT-OSS, Hunyuan-MoE, DeepSeek-V2 and -V3
    (norms, dense MLPs, shared and routed experts behind the model's own grouped router;
    the latent attention stays the model's) and DeepSeek-V4 (its experts' clamp as
    ``moe_experts``' ``clamp_value``; its clamped dense MLPs left as they are), the
    gated-linear-attention hybrids Qwen3-Next and Qwen3.5 (text, dense and MoE),
    Nemotron (its LayerNorm1P, its ReLU^2 MLPs and the loss), the text
    stacks of Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE and MuseGlimmer (base models),
    Mllama's text model, Pixtral's
    vision encoder (norms and MLPs), and the MoE families' experts through
    :func:`lmfuse.moe_experts`; with ``output_router_logits`` (in the call, the config or
    its text config) the loss is the model's own; Llama 4's experts, fed tokens already
    sorted and scaled, run the model's code; and the vision-language Qwen2-VL, Qwen2.5-VL,
    Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 (dense and MoE), Gemma 3, Gemma 4, LLaVA, PaliGemma,
    InternVL, Llama 3.2 Vision, Mistral 3, GLM-4.1V, GLM-4.5V, SmolVLM and MuseGlimmer
    (``config.model_type`` in :data:`SUPPORTED_MODEL_TYPES`; modules that compute anything
    else are left as they are): the ``*ForCausalLM`` and ``*ForConditionalGeneration``
    models, or their base ``*Model`` (norms and MLPs only). Only module ``forward`` methods
    of this one model are replaced; parameters, buffers, ``state_dict`` keys and checkpoint
    loading and saving are unchanged, and the patch survives ``copy.deepcopy``. Applying it
    again is harmless (nothing is wrapped twice; ``impl`` is updated); a flag set to
    ``False`` leaves that part as it is (it does not undo an earlier patch).

    Args:
        model: the model, e.g. ``LlamaForCausalLM``, in any dtype and on any device.
        rms_norm: run every RMSNorm of the family (each decoder layer's, the final norm,
            Qwen3's/Gemma3's per-head ``q_norm``/``k_norm``) through :func:`lmfuse.rms_norm`,
            with the module's ``weight`` and eps (Gemma's ``1 + weight`` as
            ``weight_offset=1.0``). Float32 math rounded once to the input dtype; Llama's
            own norm rounds before the weight multiply, so half-precision outputs can differ
            from the unpatched model's by one rounding.
        layer_norm: run every LayerNorm through :func:`lmfuse.layer_norm` with the module's
            ``weight``, ``bias`` and eps (read on every call): each ``torch.nn.LayerNorm``, or
            subclass that keeps its forward, of the model (vision towers, projectors and
            patch mergers; any ``normalized_shape``, its dims normalised as one row; affine
            or not, with a bias or not), and Nemotron's ``NemotronLayerNorm1P``
            (``weight + 1``: ``weight_offset=1.0``), whose own forward a probe on a small
            input at patch time finds to be that LayerNorm (other LayerNorm subclasses with
            a forward of their own are patched only when the probe finds one, and run their
            own forward under autocast; modules that compute a LayerNorm without being a
            ``torch.nn.LayerNorm`` are left as they are). The output dtype is the module's:
            x's outside autocast (parameters of x's dtype, or float32 ones for a 16-bit x,
            as ``F.layer_norm`` takes them; other mixes run the module's forward, which
            raises PyTorch's error); under CUDA autocast float32 for ``torch.nn.LayerNorm``
            (autocast's float32 list), the autocast dtype for LayerNorm1P (it casts x, its
            weight and bias to it). Float32 math rounded once: where the module first
            rounds ``weight + 1`` (a 16-bit LayerNorm1P) or the parameters (under a 16-bit
            autocast), half-precision outputs can differ from the unpatched model's by one
            rounding; in float32 they agree.
        rope: run the rotary position embedding of each attention layer whose class forward
            calls its modeling module's ``apply_rotary_pos_emb(q, k, cos, sin,
            unsqueeze_dim=1)`` through :func:`lmfuse.apply_rotary_pos_emb` (q and k in one
            kernel each way). A probe at patch time calls the module's function on small
            random float32 inputs (random tables; both head layouts, a table shared over
            the batch, Pixtral's ``[S, R]`` tables with ``unsqueeze_dim=0``, a partial
            table) and requires lmfuse's rotate-half result; functions that compute
            anything else or take other arguments are left as they are: interleaved
            (GLM-4, GLM-4.1V, Helium), GPT-OSS's half tables, Gemma 4's one-tensor rotary,
            DeepSeek-V4's; attentions calling a rotary of another name (the vision towers',
            Llama 4's, DeepSeek-V2's) and DeepSeek-V3's where its config sets
            ``rope_interleave`` (the default) are not touched. The attention instance's
            ``forward`` becomes its class's forward (decorators included) re-bound to a
            copy of its module's globals in which ``apply_rotary_pos_emb`` is lmfuse's
            (taken at each patch and shared by the process's patched models of the class:
            a later change to the module's globals reaches them at the next patch): other
            models and the modeling module are untouched. Float32 math rounded once to
            the dtypes the module's function gives, as the probe finds them for
            autocast's mix (16-bit q and k, float32 tables): float32 where it promotes
            (transformers' formula), q's and k's where it casts back (OLMo 2's):
            half-precision outputs can differ from the model's (which rounds each step) by
            a rounding; in float32 they agree. A call lmfuse does not compute as the
            module's function does (tables of another shape, float64, a dtype mix whose
            answer the probe could not tell) runs the module's function.
        swiglu: run the gated MLPs ``down_proj(act(gate_proj(x)) * up_proj(x))`` with the
            gate and up projections written side by side into one buffer and the activation
            fused: :func:`lmfuse.swiglu` for SiLU (Llama, Mistral, Qwen; Falcon-H1's
            ``act_fn(gate_proj(x) * gate_multiplier)`` and ``down_proj(...) *
            down_multiplier`` through swiglu's ``gate_multiplier`` and ``down_multiplier``,
            read from the module on every call), :func:`lmfuse.geglu` for the
            tanh-approximated GELU (Gemma); a single ``gate_up_proj`` (Phi-3, GLM-4) gives
            the halves directly; and the MLPs without a gate, ``down_proj(relu(up_proj(x))
            ** 2)`` (Nemotron, Arcee), through :func:`lmfuse.squared_relu`. MLPs with any
            other activation stay as they are,
            with a warning, and are listed in ``model.lmfuse_patches``; so do the probed
            families' MLPs that apply a dropout (Seed-OSS's ``residual_dropout``) or a clamp
            (the probe tries both sides of every limit the module holds). Projections that
            are not plain ``nn.Linear`` layers, or carry hooks, are called as modules.
            Norms and MLPs whose weights are on the meta device cannot be probed: they are
            left as they are, with a warning (patch after loading the weights).
        fused_linear_cross_entropy: when the causal LM's forward is given ``labels``, compute
            the loss with :func:`lmfuse.linear_cross_entropy` from the last hidden states
            and ``lm_head`` (tied to the embedding or not; Gemma2/3's
            ``final_logit_softcapping`` applied, after MuseGlimmer's ``output_multiplier``),
            with transformers' ``ForCausalLMLoss`` semantics: labels shifted by one,
            ``ignore_index`` -100, ``shift_labels`` if passed, and ``num_items_in_batch``
            (sum divided by it) for gradient accumulation.
            **The output's ``logits`` is then ``None``**: the ``[tokens, vocab]`` logits are
            never formed. Without labels (inference, ``generate``), with a nonzero
            ``logits_to_keep``, or in an evaluation (eval mode under ``torch.no_grad()``:
            the Trainer's evaluate and predict, whose metrics read the logits), the model's
            own forward runs and returns logits and its loss as before. A batch whose
            labels are all ``ignore_index`` gives transformers' NaN mean (zero gradients).
            With ``return_dict=False`` the tuple keeps the logits' place, holding None.
            The model's own forward also runs when its ``lm_head`` is not a plain
            ``nn.Linear`` or carries hooks (an adapter such as LoRA, FSDP2's weight
            gather) and when a loss of the user's is set (``model.loss_function = ...``).
            Liger-Kernel's forward keywords: ``return_token_accuracy=True`` and
            ``return_predicted_tokens=True`` add ``token_accuracy`` (over the counted
            tokens, 0 when there are none) and ``predicted_tokens`` (the argmax, -1 where
            ignored, the labels' shape) to the fused loss's output; ``skip_logits=False``
            runs the model's own forward (logits and loss), ``skip_logits=True`` the fused
            loss in an evaluation too (labels needed: ``ValueError`` without).
            Only on models with an ``lm_head`` (ignored on base models).
        experts: run each mixture-of-experts experts module (``forward(hidden_states
            [T, H], top_k_index [T, k], top_k_weights [T, k])`` over ``gate_up_proj`` and
            ``down_proj`` parameters of all experts) through :func:`lmfuse.moe_experts`:
            the gather, the gate/up GEMM, the activation, the down GEMM and the
            router-weighted sum; the router and its top-k stay the model's. The weights are
            read in place: ``[E, 2F, H]``/``[E, H, F]`` as they are, GPT-OSS's transposed
            ``[E, H, 2F]``/``[E, F, H]`` (and its biases) through ``transpose(1, 2)`` views,
            never copied (except by autocast, which casts them to its dtype as the model's
            ``F.linear`` would). The activation is the module's ``act_fn`` (SiLU: swiglu,
            tanh GELU: geglu, quick GELU: quick_geglu) on gate/up halves, or GPT-OSS's
            ``(clamp(up, -limit, limit) + 1) * clamp(gate, max=limit) * sigmoid(alpha *
            clamp(gate, max=limit))`` on interleaved columns: ``quick_geglu(linear_offset=1,
            clamp_value=limit, gate_up_layout="interleaved")``, for ``alpha == 1.702``
            only. Each experts class is checked once on a small routed input against the
            op; one that computes anything else, or an ``alpha`` other than 1.702, runs the
            model's code, with a warning. The model's ``config._experts_implementation``
            no longer matters for patched modules. Calls the op cannot serve (expert
            parallelism, whose routing may name other ranks' experts; a dtype mismatch
            outside autocast) run the model's code. ``inference_fallback_tokens`` does
            not apply to the experts: the model's own loop launches kernels for every
            expert hit and waits on the host for the list of them (the op's decode-size
            time against it is not yet measured).
        impl: ``"auto"``, ``"triton"`` or ``"torch"``, passed to every lmfuse op (see
            :func:`lmfuse.explain`).
        inference_fallback_tokens: with autograd off (``torch.no_grad()``, ``generate``), a
            norm or MLP call on at most this many tokens runs the module's own forward:
            token-by-token decoding in eager mode is bound by the host's time per launch,
            which a fused op does not shorten (on an H100 host, 64 greedy tokens of an
            8-layer 2048-wide Llama took 517 ms unpatched and 567 ms with every call fused;
            ``bench/hf_training.py --generate 64``).
            Prefill, training and compiled code always take the fused ops. 0 fuses every
            call. (LayerNorms count their rows as tokens; a patched attention the rows of
            its ``hidden_states``, running the class's forward as it is.)

    Returns:
        ``model`` itself. ``model.lmfuse_patches`` says what is patched: ``"rms_norm"``,
        ``"layer_norm"``, ``"rope"`` (the attention modules), ``"swiglu"``, ``"geglu"``,
        ``"squared_relu"`` (lists of module names),
        ``"mlp_unsupported_activation"``
        (``{module name: activation}`` of MLPs left as they are),
        ``"moe_experts"`` (names of the experts modules patched),
        ``"fused_linear_cross_entropy"`` (bool) and ``"impl"``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or a flag is not a bool.
        ValueError: the model type is not supported (the message lists the supported ones),
            or ``impl`` is not one of ``"auto"``, ``"triton"``, ``"torch"``.
    """
    op = "apply_lmfuse"
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{op}: model must be a torch.nn.Module (a loaded transformers model), "
                        f"got {type(model).__name__}")
    _check_flags(op, rms_norm=rms_norm, layer_norm=layer_norm, rope=rope, swiglu=swiglu,
                 fused_linear_cross_entropy=fused_linear_cross_entropy, experts=experts)
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {IMPLS}, got {impl!r}")
    if (isinstance(inference_fallback_tokens, bool) or not isinstance(
            inference_fallback_tokens, int) or inference_fallback_tokens < 0):
        raise ValueError(f"{op}: inference_fallback_tokens must be an int >= 0, got "
                         f"{inference_fallback_tokens!r}")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    family = _family_of(model)
    if family is None:
        raise ValueError(
            f"{op}: {type(model).__name__} (model_type {model_type!r}) is not supported; "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}")

    foreign: list[str] = []  # modules whose forward another library already replaced
    unsupported: dict[str, str] = {}
    experts_left: dict[str, str] = {}  # experts modules moe_experts cannot run: why
    for name, m in model.named_modules():
        cls = type(m).__name__
        ln = _layer_norm_kind(m, family) if layer_norm else None
        rotary = rope and _rotary_attention(m)
        if (ln is None and cls not in family.norms and cls not in family.mlps
                and cls not in family.experts and not rotary):
            continue
        current = _instance_attr(m)
        if current is not None and current not in _PATCHES:
            foreign.append(name)
            continue
        if ln is not None:
            _patch_layer_norm(m, ln, impl, inference_fallback_tokens)
        elif rotary:
            _patch_rope(m, impl, inference_fallback_tokens)
        elif cls in family.norms and rms_norm:
            _patch_norm(m, family.norms[cls], impl, inference_fallback_tokens)
        elif cls in family.mlps and swiglu:
            activation = _patch_mlp(m, impl, inference_fallback_tokens)
            if activation is not None and activation not in _FUSED_ACTIVATIONS:
                unsupported[name] = activation
        elif cls in family.experts and experts:
            why = family.experts[cls] or _patch_experts(m, impl)
            if why:
                experts_left[name] = why

    if fused_linear_cross_entropy and hasattr(model, "lm_head"):
        current = _instance_attr(model)
        original = type(model).forward
        if current is _causal_lm_forward:
            model._lmfuse_impl = impl
            model._lmfuse_loss_facts = _loss_facts(type(model))
        elif current is not None:
            foreign.append("(the model's own forward)")
        elif not (isinstance(model.lm_head, torch.nn.Linear)
                  and isinstance(getattr(model, "model", None), torch.nn.Module)
                  and getattr(original, "__module__", "").startswith("transformers.")):
            warnings.warn(f"{op}: {type(model).__name__}'s loss is left as it is: the fused "
                          f"loss needs transformers' own forward, a base model at .model and "
                          f"an nn.Linear lm_head", stacklevel=2)
        else:
            _set_forward(model, _causal_lm_forward, impl=impl,
                         loss_facts=_loss_facts(type(model)))

    if family.unprobed:
        warnings.warn(f"{op}: {', '.join(family.unprobed)} left unpatched: their weights are "
                      f"on the meta device, where lmfuse cannot check what they compute; "
                      f"call apply_lmfuse after the weights are loaded", stacklevel=2)
    rejected = [name for name, m in model.named_modules()
                if type(m).__name__ in family.rejected_mlps] if swiglu else []
    if rejected:
        warnings.warn(f"{op}: {len(rejected)} MLP module(s) run the model's own code: a probe "
                      f"found another formula than the fused MLP's (a dropout, a clamp or "
                      f"another step): "
                      f"{', '.join(rejected[:5])}"
                      f"{f' and {len(rejected) - 5} more' if len(rejected) > 5 else ''}",
                      stacklevel=2)
    if unsupported:
        warnings.warn(f"{op}: {len(unsupported)} MLP(s) left unpatched: lmfuse fuses SiLU and "
                      f"tanh-GELU gated MLPs, these use "
                      f"{', '.join(sorted(set(unsupported.values())))}", stacklevel=2)
    if experts_left:
        reasons = sorted(set(experts_left.values()))
        warnings.warn(f"{op}: {len(experts_left)} experts module(s) run the model's own code: "
                      f"{'; '.join(reasons)}", stacklevel=2)
    if foreign:
        warnings.warn(f"{op}: left unpatched because another library already replaced their "
                      f"forward: {', '.join(foreign[:5])}"
                      f"{f' and {len(foreign) - 5} more' if len(foreign) > 5 else ''}",
                      stacklevel=2)
    model.lmfuse_patches = _summary(model, family, impl)
    return model
