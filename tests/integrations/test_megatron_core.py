"""``lmfuse.megatron.patch`` on tiny Megatron-Core GPTModels (local spec) on the CPU.

Each case builds model A (2 layers, hidden 64, 4 heads in 2 query groups, vocabulary 100,
float32, weights and norm scales random), deep-copies it to B and patches B. The patched
model's per-token loss and every parameter's gradient (under random per-token loss
weights, as a loss mask gives) must equal the unpatched model's within the float32
tolerances of ``helpers.py``, and its logits without labels too. The lmfuse ops run their
Triton kernels in the CPU interpreter (the suite's ``TRITON_INTERPRET=1``).

Megatron-Core itself does not run on the CPU: its ``DotProductAttention`` takes its score
buffer from ``parallel_state.get_global_memory_buffer()`` (a CUDA tensor), rotary
embeddings, MoE routers and the sequence-parallel all-gather move or allocate on
``torch.cuda.current_device()``, dropout forks the CUDA RNG tracker, and 0.16.1 without
Transformer Engine leaves ``moe_utils.te_general_gemm`` undefined. The *reference* (the
unpatched model) runs inside :func:`megatron_on_cpu`, which points those at the CPU; the
patched model needs none of it (``test_patched_model_needs_no_cuda``) except where
Megatron's own layers around the patched ones ask for CUDA (rotary embeddings, MoE, the
sequence-parallel linears). Megatron's ``jit_fuser`` functions run eagerly here
(TorchDynamo off for this module: the same math, without minutes of CPU compilation).

Tensor parallelism on 2 gloo ranks is covered with and without sequence parallelism.
Megatron's local spec cannot build a sequence-parallel model (``WrappedTorchNorm`` asserts
``not config.sequence_parallel``; apex's ``FusedLayerNorm`` is LayerNorm-only), so the
sequence-parallel case gives the layers a ``torch.nn.RMSNorm`` subclass through a block
spec, which ``patch`` fuses like the local one.
"""

from __future__ import annotations

import contextlib
import copy
import types
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

try:
    import megatron.core  # noqa: F401
except ImportError as exc:
    pytest.skip(f"megatron.core cannot be imported ({type(exc).__name__}: {exc}); these tests "
                f"build Megatron-Core GPTModels (pip install megatron-core)",
                allow_module_level=True)

from helpers import assert_close  # noqa: E402
from spawn import Failures, free_port, spawn_gloo  # noqa: E402

from lmfuse.megatron import patch  # noqa: E402

F32 = torch.float32
VOCAB, SEQ, BATCH = 100, 16, 2


# --- Megatron on the CPU -----------------------------------------------------------------------


@contextlib.contextmanager
def megatron_on_cpu():
    """What unpatched Megatron-Core needs to run on the CPU (see the module docstring)."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.moe import moe_utils

    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(torch.cuda, "current_device", lambda: "cpu")
        tracker = types.SimpleNamespace(fork=lambda *a, **k: contextlib.nullcontext())
        mp.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda *a, **k: tracker)
        if not hasattr(moe_utils, "te_general_gemm"):
            mp.setattr(moe_utils, "te_general_gemm", None, raising=False)
        yield
    finally:
        mp.undo()


def init_megatron(tp: int) -> None:
    from megatron.core import parallel_state

    torch._dynamo.config.disable = True  # Megatron's jit_fuser functions run eagerly
    parallel_state.initialize_model_parallel(tp, 1)


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    """torch.distributed with one gloo rank and Megatron's model parallelism (TP 1) for this
    module's tests; both torn down after them."""
    from megatron.core import parallel_state

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        pytest.skip("torch.distributed is initialised with several ranks in this process")
    dynamo = torch._dynamo.config.disable
    init_megatron(1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        torch._dynamo.config.disable = dynamo
        if created:
            dist.destroy_process_group()


# --- models ------------------------------------------------------------------------------------


class BlockRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` built the way Megatron builds its norms, with no
    ``WrappedTorchNorm`` assertion against sequence parallelism."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps)


def build_gpt(*, seed: int = 0, rope: bool = True, tie: bool = False, qk_layernorm: bool = False,
              block_norm: bool = False, parallel_output: bool = True, **overrides: Any):
    """A two-layer GPTModel of the local spec, float32; norm scales moved off 1."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
              ffn_hidden_size=96, use_cpu_initialization=True, normalization="RMSNorm",
              gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
              bias_activation_fusion=True, masked_softmax_fusion=True, hidden_dropout=0.0,
              attention_dropout=0.0, layernorm_epsilon=1e-5, init_method_std=0.1)
    kw.update(overrides, qk_layernorm=qk_layernorm)  # 0.19 checks the spec against it
    config = TransformerConfig(**kw)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts,
                                    qk_layernorm=qk_layernorm,
                                    normalization=config.normalization)
    if block_norm:
        spec.submodules.input_layernorm = BlockRMSNorm
        spec.submodules.pre_mlp_layernorm = BlockRMSNorm
        spec = TransformerBlockSubmodules(layer_specs=[spec] * config.num_layers,
                                          layer_norm=BlockRMSNorm)
    torch.manual_seed(seed)
    with megatron_on_cpu():  # a learnable softmax offset is made on the current device
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                         max_sequence_length=64,
                         position_embedding_type="rope" if rope else "learned_absolute",
                         share_embeddings_and_output_weights=tie,
                         parallel_output=parallel_output)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.mul_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias") or name.endswith("softmax_offset"):
                p.normal_(0, 0.3)
    return model


def copy_model(model):
    """A deep copy sharing the process groups (which cannot be copied)."""
    pg = torch.distributed.ProcessGroup
    memo = {}
    for m in model.modules():
        for v in vars(m).values():
            inner = list(vars(v).values()) if hasattr(v, "__dict__") and not isinstance(
                v, (torch.nn.Module, torch.Tensor)) else []
            for x in [v, *inner]:
                if isinstance(x, pg):
                    memo[id(x)] = x
    return copy.deepcopy(model, memo)


def inputs(seed: int = 1, seq: int = SEQ):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, seq), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, seq), generator=g)
    pos = torch.arange(seq).expand(BATCH, seq)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)[None, None]
    weights = torch.rand(BATCH, seq, generator=g)  # a loss mask's per-token weights
    return ids, pos, mask, labels, weights


def step(model, batch, *, labels: bool = True):
    """(per-token loss [b, s] or logits, {parameter: gradient})."""
    ids, pos, mask, lab, weights = batch
    model.zero_grad(set_to_none=True)
    out = model(ids, pos, mask, labels=lab if labels else None)
    (out * (weights if labels else 1.0)).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return out.detach(), grads


def assert_same_step(patched, reference, batch, what: str, *, labels: bool = True) -> None:
    with megatron_on_cpu():
        want, want_grads = step(reference, batch, labels=labels)
        got, got_grads = step(patched, batch, labels=labels)
    assert_close(got, want, F32, f"{what}: {'loss' if labels else 'logits'}")
    assert got_grads.keys() == want_grads.keys(), f"{what}: gradients of different parameters"
    for name, g in want_grads.items():
        assert_close(got_grads[name], g, F32, f"{what}: gradient of {name}")


def module_names(model, cls) -> list[str]:
    return [n for n, m in model.named_modules() if type(m) is cls]


# --- tests -------------------------------------------------------------------------------------


def test_summary_lists_every_module_and_state_dict_is_unchanged() -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.mlp import MLP

    reference = build_gpt()
    model = copy_model(reference)
    params = {n: id(p) for n, p in model.named_parameters()}
    summary = patch(model)

    assert summary is model.lmfuse_patches
    assert summary["softmax"] == module_names(reference, DotProductAttention)
    assert len(summary["softmax"]) == 2
    assert summary["activations"] == {n: "swiglu" for n in module_names(reference, MLP)}
    assert summary["rms_norm"] == module_names(reference, torch.nn.RMSNorm)
    assert len(summary["rms_norm"]) == 5  # 2 per layer and the final norm
    assert summary["loss"] == "linear_cross_entropy" and summary["loss_note"] == ""
    assert summary["unpatched"] == {}
    assert summary["megatron_core"].count(".") == 2

    want, got = reference.state_dict(), model.state_dict()
    assert list(got) == list(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key  # Megatron's None _extra_state
    assert {n: id(p) for n, p in model.named_parameters()} == params, "parameters replaced"
    # Megatron's distributed checkpoint sees the same shards.
    want, got = reference.sharded_state_dict(), model.sharded_state_dict()
    assert list(got) == list(want)
    for key, value in want.items():
        assert getattr(got[key], "key", None) == getattr(value, "key", None), key
        if isinstance(getattr(value, "data", None), torch.Tensor):
            assert torch.equal(got[key].data, value.data), key
    assert [n for n, _ in model.named_buffers()] == [n for n, _ in reference.named_buffers()]
    # The swapped softmax is an lmfuse module with Megatron's settings and no state.
    import lmfuse

    for name in summary["softmax"]:
        sm = model.get_submodule(name).scale_mask_softmax
        assert isinstance(sm, lmfuse.FusedScaleMaskSoftmax)
        assert sm.attn_mask_type is lmfuse.AttnMaskType.causal


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied-embeddings"])
def test_loss_gradients_and_logits_match_megatron(tie: bool, monkeypatch) -> None:
    from megatron.core.tensor_parallel import ColumnParallelLinear

    reference = build_gpt(tie=tie)
    model = copy_model(reference)
    patch(model)
    batch = inputs()

    calls = []
    real = ColumnParallelLinear.forward

    def counted(self, *args, **kwargs):
        calls.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ColumnParallelLinear, "forward", counted)
    assert_same_step(model, reference, batch, f"GPT ({'tied' if tie else 'untied'})")
    # The unpatched step formed the logits; the patched one never called the output layer's
    # own forward (its loss came from the hidden states and the weight).
    assert calls.count(reference.output_layer) == 1
    assert calls.count(model.output_layer) == 0
    assert_same_step(model, reference, batch, "GPT without labels", labels=False)
    assert calls.count(model.output_layer) == 1


@pytest.mark.parametrize("formed", [False, True], ids=["unformed-logits", "formed-logits"])
def test_padding_labels_under_a_zero_loss_mask_match_megatron(formed: bool) -> None:
    """Labels outside the vocabulary (BERT's dataset pads with -1; -100; V) come with a loss
    mask of 0: Megatron gives them the log-sum-exp, which the mask zeroes; the patched loss
    gives them 0 (its cross-entropies refused them on the CPU, and gave +inf on CUDA: NaN
    under the mask). The masked step is Megatron's, on both of the patch's loss paths."""
    reference = build_gpt()
    model = copy_model(reference)
    patch(model)
    if formed:  # compute_language_model_loss on formed logits
        del model.__dict__["_postprocess"], model.output_layer.__dict__["forward"]
    ids, pos, mask, labels, weights = inputs()
    labels, weights = labels.clone(), weights.clone()
    for (b, t), pad in zip(((0, 1), (0, SEQ - 1), (1, 3)), (-1, -100, VOCAB)):
        labels[b, t], weights[b, t] = pad, 0.0
    batch = (ids, pos, mask, labels, weights)
    what = f"padding labels ({'formed' if formed else 'unformed'} logits)"
    with megatron_on_cpu():
        want, want_grads = step(reference, batch)
        got, got_grads = step(model, batch)
    assert_close(got * weights, want * weights, F32, f"{what}: masked loss")
    assert got_grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        assert_close(got_grads[name], g, F32, f"{what}: gradient of {name}")
    assert got[0, 1] == 0 and got[0, SEQ - 1] == 0 and got[1, 3] == 0


def test_logits_are_formed_where_the_output_layer_gathers_them() -> None:
    reference = build_gpt(parallel_output=False)
    model = copy_model(reference)
    summary = patch(model)
    assert summary["loss"] == "cross_entropy"
    assert "parallel_output=False" in summary["loss_note"]
    assert "_postprocess" not in vars(model) and "forward" not in vars(model.output_layer)
    # Megatron's own loss fails here (its vocab-parallel cross-entropy writes into the
    # gathered logits in place): the reference is torch's on Megatron's logits.
    ids, pos, mask, labels, weights = batch = inputs()
    with megatron_on_cpu():
        logits = reference(ids, pos, mask)
        want = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
        (want * weights).sum().backward()
        got, got_grads = step(model, batch)
    assert_close(got, want.detach(), F32, "parallel_output=False: loss")
    for name, p in reference.named_parameters():
        assert_close(got_grads[name], p.grad, F32, f"parallel_output=False: gradient of {name}")


def test_patched_model_needs_no_cuda() -> None:
    reference = build_gpt(rope=False)  # Megatron's rotary embedding moves to CUDA
    model = copy_model(reference)
    patch(model)
    ids, pos, mask, labels, weights = batch = inputs(seq=24)
    model.zero_grad()
    loss = model(ids, pos, mask, labels=labels)  # no megatron_on_cpu() here
    (loss * weights).sum().backward()
    assert loss.shape == (BATCH, 24) and loss.dtype == F32
    assert all(p.grad is not None for p in model.parameters())
    assert_same_step(model, reference, batch, "GPT, learned positions")


def test_eval_mode_and_causal_without_a_mask() -> None:
    """Validation (eval) takes the same fused loss; attention_mask=None is causal (lmfuse's
    band; Megatron's own CPU path would build a CUDA mask)."""
    reference = build_gpt()
    model = copy_model(reference)
    patch(model)
    reference.eval()
    model.eval()
    ids, pos, mask, labels, _ = inputs()
    with megatron_on_cpu(), torch.no_grad():
        want = reference(ids, pos, mask, labels=labels)
        got = model(ids, pos, None, labels=labels)
    assert_close(got, want, F32, "eval loss, no mask tensor")


ACTIVATIONS = {
    # name: (config overrides, lmfuse op the MLPs get)
    "swiglu-bias-unfused": (dict(add_bias_linear=True, bias_activation_fusion=False), "swiglu"),
    "geglu-fused": (dict(activation_func=F.gelu, add_bias_linear=True), "geglu"),
    "bias-gelu-layernorm": (dict(activation_func=F.gelu, gated_linear_unit=False,
                                 add_bias_linear=True, normalization="LayerNorm"),
                            "bias_gelu"),
    "squared-relu": (dict(activation_func="squared_relu", gated_linear_unit=False,
                          add_bias_linear=True, bias_activation_fusion=False),
                     "squared_relu"),
    "quick-geglu-clamp-offset": (dict(activation_func="quick_gelu", add_bias_linear=True,
                                      bias_activation_fusion=False, glu_linear_offset=1.0,
                                      activation_func_clamp_value=0.5), "quick_geglu"),
}


@pytest.mark.parametrize("case", list(ACTIVATIONS))
def test_activations_match_megatron(case: str) -> None:
    from megatron.core import activations
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    overrides, op = ACTIVATIONS[case]
    overrides = dict(overrides)
    named = {"squared_relu": activations.squared_relu, "quick_gelu": quick_gelu}
    if isinstance(overrides.get("activation_func"), str):
        overrides["activation_func"] = named[overrides["activation_func"]]
    reference = build_gpt(**overrides)
    model = copy_model(reference)
    summary = patch(model)
    assert set(summary["activations"].values()) == {op}
    assert len(summary["activations"]) == 2
    if overrides.get("normalization") == "LayerNorm":  # (fused: test_layer_norms_...)
        assert summary["rms_norm"] == [] and summary["unpatched"] == {}
        assert summary["layer_norm"] == module_names(model, torch.nn.LayerNorm)
    assert_same_step(model, reference, inputs(), case)


def test_exact_gelu_is_left_as_megatron_runs_it() -> None:
    reference = build_gpt(activation_func=F.gelu, bias_activation_fusion=False)
    model = copy_model(reference)
    summary = patch(model)
    assert summary["activations"] == {}
    reasons = [summary["unpatched"][f"decoder.layers.{i}.mlp"] for i in range(2)]
    assert all("erf" in r for r in reasons), reasons
    assert_same_step(model, reference, inputs(), "erf GELU left unpatched")


def test_qk_norms_and_learnable_softmax_offset() -> None:
    reference = build_gpt(qk_layernorm=True, softmax_type="learnable")
    model = copy_model(reference)
    summary = patch(model)
    assert "decoder.layers.0.self_attention.q_layernorm" in summary["rms_norm"]
    assert "decoder.layers.1.self_attention.k_layernorm" in summary["rms_norm"]
    assert len(summary["rms_norm"]) == 9
    assert_same_step(model, reference, inputs(), "qk norms, learnable sink")
    offset = "decoder.layers.0.self_attention.core_attention.softmax_offset"
    assert model.get_parameter(offset).grad is not None


def test_moe_experts_get_weighted_swiglu() -> None:
    reference = build_gpt(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                          moe_token_dispatcher_type="allgather")
    model = copy_model(reference)
    summary = patch(model)
    experts = {n: op for n, op in summary["activations"].items() if "local_experts" in n}
    assert len(experts) == 8 and set(experts.values()) == {"swiglu"}
    assert_same_step(model, reference, inputs(), "MoE (SequentialMLP experts)")


def test_gelu_experts_are_listed_unpatched() -> None:
    """SequentialMLP calls its experts with per_token_scale, and lmfuse has no weighted
    GELU: Megatron's forward runs for them every time, so the summary lists them under
    ``unpatched`` (it listed them as fused), and the step is Megatron's."""
    from megatron.core.transformer.utils import openai_gelu

    reference = build_gpt(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                          moe_token_dispatcher_type="allgather", activation_func=openai_gelu,
                          gated_linear_unit=False, bias_activation_fusion=False)
    model = copy_model(reference)
    summary = patch(model)
    assert not [n for n in summary["activations"] if "local_experts" in n]
    experts = [n for n in summary["unpatched"] if "local_experts" in n]
    assert len(experts) == 8
    assert "lmfuse has no weighted bias_gelu" in summary["unpatched"][experts[0]]
    assert_same_step(model, reference, inputs(), "MoE (GELU experts)")


def test_layer_norms_match_megatron(monkeypatch) -> None:
    """normalization="LayerNorm": WrappedTorchNorm builds torch.nn.LayerNorms (two a layer,
    the q/k norms, the final norm); each runs lmfuse.layer_norm (its Triton kernel in the
    interpreter) with its own weight, bias and eps, and the loss and every gradient (the
    norms' weights and biases, moved off their init, included) are Megatron's.
    ``layer_norm=False`` leaves them as they are."""
    import lmfuse.integrations as integrations

    reference = build_gpt(normalization="LayerNorm", qk_layernorm=True, layernorm_epsilon=1e-3)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "layernorm.bias" in name:
                p.normal_(0, 0.3)
    model = copy_model(reference)
    summary = patch(model)
    norms = module_names(reference, torch.nn.LayerNorm)
    assert summary["layer_norm"] == norms and len(norms) == 9
    assert summary["rms_norm"] == [] and summary["unpatched"] == {}
    assert all(model.get_submodule(n).eps == 1e-3 for n in norms)

    widths = []
    real = integrations._layer_norm
    monkeypatch.setattr(integrations, "_layer_norm",
                        lambda x, *a, **k: (widths.append(x.shape[-1]), real(x, *a, **k))[1])
    assert_same_step(model, reference, inputs(), "LayerNorm")
    assert sorted(widths) == [16] * 4 + [64] * 5  # the q/k norms over the head dim

    kept = copy_model(reference)
    summary = patch(kept, layer_norm=False)
    assert summary["layer_norm"] == [] and summary["unpatched"] == {}
    assert not any("forward" in vars(kept.get_submodule(n)) for n in norms)
    assert len(summary["activations"]) == 2


def test_a_norm_of_a_kind_turned_off_is_not_listed() -> None:
    """Norm classes lmfuse does not take (apex's FusedLayerNorm and FusedRMSNorm, stood in
    for here by modules of those names) are listed as left alone, but not where the caller
    turned their kind off (``layer_norm=False``, ``rms_norm=False``)."""

    class FusedLayerNorm(torch.nn.Module):
        def __init__(self, norm: torch.nn.Module) -> None:
            super().__init__()
            self.norm = norm

        def forward(self, x):
            return self.norm(x)

    class FusedRMSNorm(FusedLayerNorm):
        pass

    class ScaledLayerNorm(torch.nn.LayerNorm):  # (a torch LayerNorm of its own forward)
        def forward(self, x):
            return super().forward(x)

    for kind, flag in ((FusedLayerNorm, "layer_norm"), (FusedRMSNorm, "rms_norm"),
                       (ScaledLayerNorm, "layer_norm")):
        model = build_gpt(normalization="LayerNorm")
        final = model.decoder.final_layernorm
        model.decoder.final_layernorm = (kind(final) if kind is not ScaledLayerNorm
                                         else kind(final.normalized_shape))
        assert "decoder.final_layernorm" not in patch(copy_model(model),
                                                      **{flag: False})["unpatched"]
        reason = patch(copy_model(model))["unpatched"]["decoder.final_layernorm"]
        assert f"{kind.__name__} (" in reason and "only" in reason


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_patched_layer_norm_gives_torchs_dtype(dtype: torch.dtype) -> None:
    """A 16-bit x into float32 parameters (torch's mixed type, as a float32 norm in a
    bfloat16 model gets it) and x of the parameters' dtype: x's dtype, as torch gives it; a
    float32 x into bfloat16 parameters: torch's own error."""
    from lmfuse.integrations.megatron_core import _layer_norm_forward

    norm = torch.nn.LayerNorm(8, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_(1, 0.3)
        norm.bias.normal_(0, 0.3)
    x = (torch.randn(3, 8) * 2 + 1).to(dtype)
    y = _layer_norm_forward(norm, x)
    assert y.dtype == dtype
    assert_close(y, norm(x), dtype, f"LayerNorm, {dtype} x")
    if dtype == torch.float32:
        norm.to(torch.bfloat16)
        with pytest.raises(RuntimeError) as want:
            norm(x)
        with pytest.raises(RuntimeError) as got:
            _layer_norm_forward(norm, x)
        assert str(got.value) == str(want.value)


def test_patched_weightless_rms_norm_checks_the_width() -> None:
    from lmfuse.integrations.megatron_core import _rms_norm_forward

    norm = torch.nn.RMSNorm(8, eps=1e-5, elementwise_affine=False)
    with pytest.raises(ValueError, match=r"normalized_shape is \[8\], so the input must be "
                                         r"\[\.\.\., 8\], got \[3, 6\]"):
        _rms_norm_forward(norm, torch.randn(3, 6))
    x = torch.randn(3, 8)
    assert_close(_rms_norm_forward(norm, x), norm(x), F32, "weightless RMSNorm")


def test_patch_is_idempotent_and_flags_leave_parts_alone() -> None:
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax

    reference = build_gpt()
    model = copy_model(reference)
    first = patch(model)
    assert patch(model) == first
    fwd = model.decoder.layers[0].mlp.forward
    patch(model)
    assert model.decoder.layers[0].mlp.forward is fwd  # not wrapped twice
    assert_same_step(model, reference, inputs(), "patched three times")

    partial = copy_model(reference)
    summary = patch(partial, softmax=False, loss=False)
    assert summary["softmax"] == [] and summary["loss"] is None
    assert len(summary["activations"]) == 2 and len(summary["rms_norm"]) == 5
    core = partial.decoder.layers[0].self_attention.core_attention
    assert type(core.scale_mask_softmax) is FusedScaleMaskSoftmax
    assert "forward" not in vars(core)
    assert "compute_language_model_loss" not in vars(partial)


def test_wrapped_model_is_found_and_copies_stay_patched() -> None:
    reference = build_gpt()

    class Wrapper(torch.nn.Module):  # as Megatron's DDP / Float16Module hold the model
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    wrapped = Wrapper(copy_model(reference))
    summary = patch(wrapped)
    assert wrapped.module.lmfuse_patches is summary and summary["loss"] == "linear_cross_entropy"
    clone = copy_model(wrapped.module)
    fwd = vars(clone.decoder.layers[0].mlp)["forward"]
    assert fwd.module is clone.decoder.layers[0].mlp  # bound to the copy's module
    assert_same_step(clone, reference, inputs(), "deep copy of a patched model")


def test_refuses_what_it_cannot_patch() -> None:
    model = build_gpt()
    with pytest.raises(TypeError, match="model must be a Megatron-Core model"):
        patch(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="model must be a Megatron-Core model"):
        patch("gpt")
    with pytest.raises(TypeError, match="call patch on each chunk"):
        patch([model])
    for flag in ("softmax", "activations", "rms_norm", "layer_norm", "loss"):
        with pytest.raises(TypeError, match=f"{flag} must be a bool"):
            patch(model, **{flag: 1})

    # A module of Megatron's Transformer Engine extension (what transformer_impl=
    # "transformer_engine" builds) is refused, naming it; nothing is patched.
    TEDotProductAttention = type("TEDotProductAttention", (torch.nn.Module,), {
        "__module__": "megatron.core.extensions.transformer_engine"})
    model.decoder.layers[1].self_attention.core_attention = TEDotProductAttention()
    with pytest.raises(ValueError, match="model holds Transformer Engine modules.*"
                       "decoder.layers.1.self_attention.core_attention: TEDotProductAttention"):
        patch(model)
    assert "forward" not in vars(model.decoder.layers[0].mlp)
    assert not hasattr(model, "lmfuse_patches")


# --- tensor (and sequence) parallelism on 2 gloo ranks -----------------------------------------


def _tensor_parallel_rank(rank: int, world_size: int) -> None:
    from megatron.core import parallel_state

    init_megatron(world_size)
    f = Failures(rank)
    try:
        for sp in (False, True):
            what = f"TP {world_size}{' + SP' if sp else ''}, rank {rank}"
            reference = build_gpt(tensor_model_parallel_size=world_size, sequence_parallel=sp,
                                  block_norm=sp)
            model = copy_model(reference)
            summary = patch(model)
            assert summary["loss"] == "linear_cross_entropy", summary
            assert len(summary["softmax"]) == 2 and len(summary["rms_norm"]) == 5, summary
            assert model.output_layer.sequence_parallel is sp
            # The output layer holds this rank's half of the vocabulary.
            assert model.output_layer.weight.shape[0] == VOCAB // world_size
            batch = inputs()
            f.check(what, lambda: assert_same_step(model, reference, batch, what))
    finally:
        parallel_state.destroy_model_parallel()
    f.raise_if_any()


@pytest.mark.timeout(120)
def test_tensor_and_sequence_parallel_match_megatron() -> None:
    spawn_gloo(2, _tensor_parallel_rank, timeout=110)


def test_module_docstring_names_every_patched_class() -> None:
    from lmfuse.integrations import megatron_core

    doc = megatron_core.__doc__
    for name in ("DotProductAttention", "scale_mask_softmax", "MLP", "SequentialMLP",
                 "torch.nn.RMSNorm", "L2Norm", "torch.nn.LayerNorm",
                 "layernorm_zero_centered_gamma", "GPTModel", "compute_language_model_loss",
                 "_postprocess", "output_layer", "ColumnParallelLinear", "0.16.1", "0.19"):
        assert name in doc, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_patched_rms_norm_without_eps_takes_torchs_default(dtype: torch.dtype) -> None:
    """``torch.nn.RMSNorm(eps=None)`` adds the epsilon of its math's type (float32 for 16-bit
    inputs), not the input dtype's: bfloat16's 7.8e-3 would swamp a row of mean square 1e-4."""
    from lmfuse.integrations.megatron_core import _rms_norm_forward

    norm = torch.nn.RMSNorm(8, eps=None, dtype=dtype)
    x = torch.full((2, 8), 0.01, dtype=dtype)
    assert_close(_rms_norm_forward(norm, x), norm(x), dtype, "eps=None")
