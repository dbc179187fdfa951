"""``lmfuse.integrations.transformers.apply_lmfuse`` on tiny random-config models.

Each case builds model A (no weights downloaded), deep-copies it to B and patches B; in
float32 the patched model's loss and every parameter's gradient must equal the unpatched
model's (tolerances from ``helpers.py``), its logits and greedy generations without labels
too. The lmfuse ops run their Triton kernels in the CPU interpreter (``impl="auto"`` under
the suite's ``TRITON_INTERPRET=1``), so the sizes are tiny.
"""

from __future__ import annotations

import ast
import copy
import inspect
import math
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, assert_same_grads

import lmfuse
from lmfuse import geglu
from lmfuse.activations import reference as act_ref
from lmfuse.integrations.transformers import SUPPORTED_MODEL_TYPES, apply_lmfuse

transformers = pytest.importorskip("transformers")

F32 = torch.float32
VOCAB = 160

# Per family: what its config sets beyond the tiny common sizes. Llama's MLP has biases
# (the bias path), Qwen2 ties lm_head to the embedding (Gemma does by default), Gemma2/3 cap
# the logits at a value small enough for tanh to bend them.
FAMILIES = {
    "llama": {"mlp_bias": True},
    "mistral": {},
    "qwen2": {"tie_word_embeddings": True},
    "qwen3": {},
    "gemma": {},
    "gemma2": {"final_logit_softcapping": 0.5},
    "gemma3_text": {"final_logit_softcapping": 0.5},
    # Found by probing (_DETECTED): Granite divides its logits (and scales its embeddings
    # and residuals); Seed-OSS's default dropouts are off so that both models compute alike.
    "granite": {"logits_scaling": 4.0, "embedding_multiplier": 2.0, "residual_multiplier": 0.5},
    "olmo2": {},
    "olmo3": {},
    "glm4": {},
    "smollm3": {},
    "exaone4": {},
    "ministral": {},
    "helium": {},
    "seed_oss": {"residual_dropout": 0.0, "attention_dropout": 0.0},
    "arcee": {},
    "phi3": {},
    "lfm2": {},
    "hunyuan_v1_dense": {},
    "apertus": {},
    "llama4_text": {},
    # Falcon-H1 multiplies its logits, and its MLPs scale their gate and output: the loss
    # applies the former, the fused SwiGLU (gate_multiplier, down_multiplier) the latter.
    # Its Mamba-2 mixers at tiny sizes (the defaults: 128 heads, 1024 channels, 256 states).
    "falcon_h1": {"lm_head_multiplier": 0.5, "mlp_multipliers": [0.5, 2.0],
                  "mamba_d_ssm": 32, "mamba_n_heads": 4, "mamba_d_state": 8,
                  "mamba_chunk_size": 16},
    # two experts of two: with one, the renormalised routing weight is 1 and the router's
    # gradient mere rounding noise
    "mixtral": {"num_local_experts": 2, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 16,
                  "shared_expert_intermediate_size": 48},
    "qwen3_moe": {"num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 16},
    "olmoe": {"num_experts": 2, "num_experts_per_tok": 1},
    "granitemoe": {"num_local_experts": 2, "num_experts_per_tok": 1, "logits_scaling": 2.0},
    "gpt_oss": {"num_local_experts": 2, "num_experts_per_tok": 1},
}
# Mixtures of experts: their experts are not MLP modules of the gated form (Qwen2-MoE's
# shared expert is); their norms and loss are patched, and the experts of all but Llama 4
# (whose experts take tokens already sorted and scaled) run lmfuse.moe_experts.
MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "gpt_oss", "llama4_text")
MOE_EXPERTS = MOE[:-1]
GELU_FAMILIES = ("gemma", "gemma2", "gemma3_text")
VISION_LANGUAGE = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# Their MLPs are not gated SwiGLU/GEGLU (Arcee's is ReLU^2 without a gate): norms and loss
# only. (GLM-4's and Phi-3's gated MLPs take gate and up from one projection: patched.)
NO_GATED_MLP = ("arcee", "lfm2", "apertus")


def make_model(model_type: str, **overrides):
    """A two-layer random model of ``model_type``, norm weights moved off their init (so
    Gemma's ``1 + weight`` offset matters), in float32 and train mode."""
    kw = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": VOCAB,
          "max_position_embeddings": 64, "initializer_range": 0.1,
          "attn_implementation": "eager", "pad_token_id": 0, "bos_token_id": 1,
          "eos_token_id": 2}
    kw.update(FAMILIES.get(model_type, {}))
    kw.update(overrides)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:  # an older transformers than the CI's
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r} models")
    config = transformers.AutoConfig.for_model(model_type, **kw)
    model = transformers.AutoModelForCausalLM.from_config(config).to(F32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model.train()


def make_pair(model_type: str, **overrides):
    a = make_model(model_type, **overrides)
    # Every call fused, no-grad ones too, so the comparisons below exercise the fused ops.
    b = apply_lmfuse(copy.deepcopy(a), inference_fallback_tokens=0)
    return a, b


def batch(b: int = 2, s: int = 7):
    ids = torch.randint(3, VOCAB, (b, s))
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt not scored
    labels[-1, -2] = -100
    return ids, labels


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_loss_and_gradients_match_unpatched(model_type):
    a, b = make_pair(model_type)
    ids, labels = batch()
    out_a = a(input_ids=ids, labels=labels)
    out_b = b(input_ids=ids, labels=labels)
    assert out_b.logits is None, "the fused loss must not form logits"
    assert type(out_b) is type(out_a)
    assert_close(out_b.loss, out_a.loss, F32, f"{model_type}: loss")
    out_a.loss.backward()
    out_b.loss.backward()
    assert_same_grads(a, b, model_type)

    # What is patched: every norm of the family (Qwen3's/Gemma3's q/k norms included) and
    # every MLP, with the activation the config names.
    s = b.lmfuse_patches
    norms = [n for n, m in b.named_modules() if type(m).__name__.endswith("RMSNorm")]
    mlps = [n for n, m in b.named_modules() if type(m).__name__.endswith("MLP")]
    assert sorted(s["rms_norm"]) == sorted(norms) and len(norms) >= 5
    if model_type in ("qwen3", "gemma3_text"):
        assert "model.layers.0.self_attn.q_norm" in s["rms_norm"]
    act = "geglu" if model_type in GELU_FAMILIES else "swiglu"
    if model_type in NO_GATED_MLP:
        assert not s["swiglu"] and not s["geglu"]
        # Arcee's ReLU^2 MLPs without a gate: lmfuse.squared_relu between the projections
        assert s["squared_relu"] == (sorted(mlps) if model_type == "arcee" else [])
    elif model_type in MOE:
        modules = dict(b.named_modules())
        gated = [n for n in mlps if hasattr(modules[n], "gate_proj") and (
            hasattr(modules[n], "act_fn") or hasattr(modules[n], "activation_fn"))]
        assert gated or model_type != "llama4_text"  # (its MLPs' activation_fn)
        assert sorted(s[act]) == sorted(gated)
    else:
        assert sorted(s[act]) == sorted(mlps) and len(mlps) == 2
    assert s["fused_linear_cross_entropy"] and not s["mlp_unsupported_activation"]
    experts = [n for n, m in b.named_modules() if type(m).__name__.endswith("Experts")]
    assert s["moe_experts"] == (experts if model_type in MOE_EXPERTS else [])
    assert len(experts) == (2 if model_type in MOE else 0)


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_evaluation_with_labels_returns_logits_and_the_loss(model_type):
    """Eval mode under no_grad (the Trainer's evaluate / predict) with labels: the model's
    own forward, its logits and loss (also as a tuple); eval mode with gradients on (a
    step trained in eval mode) still takes the fused loss."""
    a, b = make_pair(model_type)
    a.eval()
    b.eval()
    ids, labels = batch()
    with torch.no_grad():
        out_a, out_b = a(input_ids=ids, labels=labels), b(input_ids=ids, labels=labels)
        tup = b(input_ids=ids, labels=labels, return_dict=False)
    assert out_b.logits is not None
    assert_close(out_b.logits, out_a.logits, F32, f"{model_type}: eval logits")
    assert_close(out_b.loss, out_a.loss, F32, f"{model_type}: eval loss")
    assert_close(tup[1], out_a.logits, F32, f"{model_type}: tuple's logits")
    trained = b(input_ids=ids, labels=labels)
    assert trained.logits is None
    assert_close(trained.loss, out_a.loss, F32, f"{model_type}: fused loss in eval mode")


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_all_labels_ignored_gives_the_unpatched_nan_and_zero_grads(model_type):
    """Every label -100 (an empty micro-batch): transformers' mean is NaN; the fused loss
    gives NaN too, with the same zero gradients; with num_items_in_batch the same 0."""
    a, b = make_pair(model_type)
    ids, _ = batch()
    labels = torch.full_like(ids, -100)
    out_a, out_b = a(input_ids=ids, labels=labels), b(input_ids=ids, labels=labels)
    assert out_b.logits is None
    assert torch.isnan(out_a.loss) and torch.isnan(out_b.loss)
    out_a.loss.backward()
    out_b.loss.backward()
    assert_same_grads(a, b, f"{model_type}: all ignored")
    assert all(p.grad is None or not p.grad.any() for p in b.parameters())
    n = torch.tensor(5)
    sum_a = a(input_ids=ids, labels=labels, num_items_in_batch=n).loss
    sum_b = b(input_ids=ids, labels=labels, num_items_in_batch=n).loss
    assert sum_a.item() == 0 and sum_b.item() == 0


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_logits_and_generation_unchanged_without_labels(model_type):
    a, b = make_pair(model_type)
    a.eval()
    b.eval()
    ids, _ = batch()
    with torch.no_grad():
        logits_a = a(input_ids=ids).logits
        logits_b = b(input_ids=ids).logits
    assert_close(logits_b, logits_a, F32, f"{model_type}: logits without labels")
    prompt = ids[:1, :4]
    gen = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(b.generate(prompt, **gen), a.generate(prompt, **gen))


@pytest.mark.parametrize("model_type", ["gemma2"])
def test_gradient_accumulation_with_num_items_in_batch(model_type):
    """Two micro-batches, each loss summed and divided by the tokens of both (transformers'
    ``num_items_in_batch``): the same loss values and accumulated gradients."""
    a, b = make_pair(model_type)
    micro = [batch(), batch(b=1, s=5)]
    total = torch.tensor(sum(int((lab[..., 1:] != -100).sum()) for _, lab in micro))
    for ids, labels in micro:
        loss_a = a(input_ids=ids, labels=labels, num_items_in_batch=total).loss
        loss_b = b(input_ids=ids, labels=labels, num_items_in_batch=total).loss
        assert_close(loss_b, loss_a, F32, f"{model_type}: micro-batch loss")
        loss_a.backward()
        loss_b.backward()
    assert_same_grads(a, b, f"{model_type} accumulated")


def test_shift_labels_and_tuple_output():
    """Labels already shifted by the caller (``shift_labels``, as for sequence parallelism)
    are used as given, and ``return_dict=False`` gives transformers' tuple, loss first."""
    a, b = make_pair("qwen3")
    ids, labels = batch()
    shift = torch.randint(3, VOCAB, ids.shape)
    shift[:, 0] = -100
    loss_a = a(input_ids=ids, labels=labels, shift_labels=shift).loss
    out_b = b(input_ids=ids, labels=labels, shift_labels=shift, return_dict=False)
    out_a = a(input_ids=ids, labels=labels, shift_labels=shift, return_dict=False)
    assert isinstance(out_b, tuple) and out_b[0].dim() == 0
    # The logits' place kept (None: never formed), the rest where the model puts it.
    assert len(out_b) == len(out_a) and out_b[1] is None
    assert [type(x) for x in out_b[2:]] == [type(x) for x in out_a[2:]]
    assert_close(out_b[0], loss_a, F32, "shift_labels loss")
    loss_a.backward()
    out_b[0].backward()
    assert_same_grads(a, b, "shift_labels")


class _LoraLinear(torch.nn.Linear):
    """An adapter in the PEFT style: ``W x + B A x``, an ``nn.Linear`` subclass."""

    def __init__(self, base: torch.nn.Linear) -> None:
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None)
        self.load_state_dict(base.state_dict())
        self.lora_a = torch.nn.Parameter(0.3 * torch.randn(4, base.in_features))
        self.lora_b = torch.nn.Parameter(0.3 * torch.randn(base.out_features, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + F.linear(F.linear(x, self.lora_a), self.lora_b)


@pytest.mark.parametrize("change", ["adapter", "hook", "loss_function"])
def test_loss_runs_what_the_model_would_call(change):
    """An ``lm_head`` the model calls (an adapter, a forward hook; FSDP2's weight gather is
    a hook too) or a loss of the user's (``model.loss_function = ...``): the fused loss
    would read the head's weight and skip them, so the model's own forward runs."""
    a, b = make_pair("llama")
    if change == "adapter":
        for m in (a, b):
            m.lm_head = _LoraLinear(m.lm_head)
        b.lm_head.load_state_dict(a.lm_head.state_dict())
    elif change == "hook":
        for m in (a, b):
            m.lm_head.register_forward_hook(lambda mod, inp, out: out / 4)
    else:
        def summed(logits, labels, vocab_size, **kwargs):
            return F.cross_entropy(logits[:, :-1].reshape(-1, vocab_size).float(),
                                   labels[:, 1:].reshape(-1), reduction="sum",
                                   label_smoothing=0.1)
        for m in (a, b):
            m.loss_function = summed
    ids, labels = batch()
    loss_a = a(input_ids=ids, labels=labels).loss
    out_b = b(input_ids=ids, labels=labels)
    assert out_b.logits is not None  # the model's own forward ran
    assert_close(out_b.loss, loss_a, F32, change)
    loss_a.backward()
    out_b.loss.backward()
    assert_same_grads(a, b, change)


def test_hooks_on_the_mlp_projections_run():
    """A hook on ``up_proj`` (or ``gate_proj``) runs as in the model: the patched MLP then
    calls the projections as modules instead of reading their weights."""
    a, b = make_pair("llama")
    calls = {"a": 0, "b": 0}

    def hook(key):
        def fn(mod, inp, out):
            calls[key] += 1
            return out * 0.5
        return fn

    for key, m in (("a", a), ("b", b)):
        for layer in m.model.layers:
            layer.mlp.up_proj.register_forward_hook(hook(key))
    ids, labels = batch()
    loss_a, loss_b = a(input_ids=ids, labels=labels).loss, b(input_ids=ids, labels=labels).loss
    assert calls["a"] == calls["b"] == 2
    assert_close(loss_b, loss_a, F32, "hooked up_proj")


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_an_mlp_with_dropout_is_left_to_the_model(mode):
    """Seed-OSS's MLP applies a residual dropout (0.1 by default): the fused MLP has none,
    so it must stay the model's, whatever mode the model is in when patched (eval after
    ``from_pretrained``: the probe then ran without the dropout and patched it)."""
    a = make_model("seed_oss", residual_dropout=0.1)
    getattr(a, mode)()
    b = apply_lmfuse(copy.deepcopy(a))
    assert b.lmfuse_patches["swiglu"] == []
    assert [m.training for m in b.modules()] == [m.training for m in a.modules()]


def test_a_clamp_past_the_probes_default_peak_is_found():
    """An MLP clamping its projections at 100 (DeepSeek-V4's ``swiglu_limit`` set high):
    the probe tries twice each limit the module holds, not only its default peak of 64,
    so the clamp is seen and the MLP left to the model (the fused SwiGLU has no clamp)."""

    class ClampedMLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj = torch.nn.Linear(16, 24, bias=False)
            self.up_proj = torch.nn.Linear(16, 24, bias=False)
            self.down_proj = torch.nn.Linear(24, 16, bias=False)
            self.act_fn = torch.nn.SiLU()
            self.swiglu_limit = 100.0

        def forward(self, x):
            c = self.swiglu_limit
            return self.down_proj(self.act_fn(self.gate_proj(x).clamp(max=c))
                                  * self.up_proj(x).clamp(-c, c))

    from lmfuse.integrations import transformers as integration

    class UnclampedMLP(ClampedMLP):  # the limit held but not applied: the plain formula
        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    assert not integration._probe_mlp(ClampedMLP())
    assert integration._probe_mlp(UnclampedMLP())


def test_weights_on_the_meta_device_leave_probed_classes_with_a_warning():
    """A model built on the meta device (deferred initialisation): the families found by
    probing cannot be probed there, so their norms and MLPs are left as they are, and
    the warning says so and what to do."""
    config = make_model("granite").config
    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.warns(UserWarning, match="GraniteMLP, GraniteRMSNorm left unpatched: their "
                                         "weights are on the meta device.*after the weights "
                                         "are loaded"):
        apply_lmfuse(m)
    assert m.lmfuse_patches["rms_norm"] == [] and m.lmfuse_patches["swiglu"] == []


def test_unbatched_labels_of_one_sequence():
    """transformers' loss takes a batch of one sequence's labels (and shift_labels) as 1-D
    ``[S]``: so does the fused loss."""
    a, b = make_pair("llama")
    ids, labels = batch(1)
    for kw in (dict(labels=labels[0]), dict(labels=labels[0], shift_labels=labels[0])):
        loss_a = a(input_ids=ids, **kw).loss
        loss_b = b(input_ids=ids, **kw).loss
        assert_close(loss_b, loss_a, F32, str(list(kw)))


def test_state_dict_signature_and_idempotency():
    a, b = make_pair("qwen3")
    assert list(b.state_dict()) == list(a.state_dict())
    b.load_state_dict(a.state_dict())  # a checkpoint of the unpatched model loads strictly
    # transformers reads the forward's signature (generation, the Trainer's column filter).
    assert inspect.signature(b.forward) == inspect.signature(a.forward)

    ids, labels = batch()
    first = b(input_ids=ids, labels=labels).loss.detach()
    forwards = {n: m.forward.fn for n, m in b.named_modules() if "forward" in m.__dict__}
    assert apply_lmfuse(b, impl="torch") is b
    again = {n: m.forward.fn for n, m in b.named_modules() if "forward" in m.__dict__}
    assert again == forwards, "applying twice must not wrap twice"
    assert b.lmfuse_patches["impl"] == "torch"
    assert_close(b(input_ids=ids, labels=labels).loss.detach(), first, F32, "re-applied")
    # A deep copy (and a pickled whole model) carries the patch, bound to its own modules.
    for c in (copy.deepcopy(b), pickle.loads(pickle.dumps(b))):
        assert c.model.layers[0].mlp.forward.module is c.model.layers[0].mlp
        assert c.forward.module is c and c.lmfuse_patches == b.lmfuse_patches
        assert_close(c(input_ids=ids, labels=labels).loss.detach(), first, F32, "copied")


def test_unsupported_activation_leaves_mlp_with_a_warning():
    a = make_model("llama", hidden_act="relu")
    b = copy.deepcopy(a)
    with pytest.warns(UserWarning, match="relu|ReLU"):
        apply_lmfuse(b)
    s = b.lmfuse_patches
    assert not s["swiglu"] and len(s["mlp_unsupported_activation"]) == 2
    assert len(s["rms_norm"]) == 5 and s["fused_linear_cross_entropy"]
    ids, labels = batch()
    assert_close(b(input_ids=ids, labels=labels).loss, a(input_ids=ids, labels=labels).loss,
                 F32, "relu llama loss")


def test_bad_arguments_raise():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=16, n_layer=1, n_head=2, vocab_size=32, n_positions=16))
    with pytest.raises(ValueError, match=r"gpt2.*llama, mistral, qwen2, qwen3, gemma"):
        apply_lmfuse(gpt2)
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        apply_lmfuse("llama")
    model = make_model("llama", num_hidden_layers=1)
    with pytest.raises(ValueError, match="impl must be one of"):
        apply_lmfuse(model, impl="cuda")
    with pytest.raises(TypeError, match="swiglu must be a bool"):
        apply_lmfuse(model, swiglu="yes")
    assert "forward" not in model.__dict__, "a refused call must patch nothing"
    # every supported model type is tested: the causal LMs here, the VLMs below
    # (and Llama 4's image-text model: test_llama4_vision_language_model_norms_and_mlps)
    assert set(SUPPORTED_MODEL_TYPES) == set(FAMILIES) | set(VISION_LANGUAGE) | set(
        MORE_FAMILIES) | set(OTHER_VLMS) | {"llama4"}


def test_mlp_with_wrapped_projection_and_under_autocast():
    """A projection that is not a plain ``nn.Linear`` (LoRA-like) is called as a module;
    under autocast the projections run in the autocast dtype as ``F.linear`` would."""

    class Adapted(torch.nn.Linear):
        def forward(self, x):
            y = super().forward(x)
            return y + 0.1 * y * y

    a = make_model("llama", num_hidden_layers=1)
    mlp_a = a.model.layers[0].mlp
    old = mlp_a.gate_proj
    mlp_a.gate_proj = Adapted(old.in_features, old.out_features, bias=True)
    b = apply_lmfuse(copy.deepcopy(a))
    mlp_b = b.model.layers[0].mlp
    x = torch.randn(2, 5, 32)
    assert_close(mlp_b(x), mlp_a(x), F32, "wrapped gate_proj")

    b = apply_lmfuse(make_model("mistral", num_hidden_layers=1))
    mlp_b = b.model.layers[0].mlp
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_b = mlp_b(x)
        y_a = type(mlp_b).forward(mlp_b, x)  # the class's own forward
    assert y_b.dtype == y_a.dtype == torch.bfloat16
    assert_close(y_b, y_a, torch.bfloat16, "autocast bf16 MLP")


def test_geglu_is_transformers_tanh_gelu():
    """lmfuse's GELU constants are the tanh approximation's, so Gemma's
    ``gelu_pytorch_tanh`` gated MLP and lmfuse's GEGLU agree."""
    assert math.isclose(act_ref.GELU_A, math.sqrt(2.0 / math.pi), rel_tol=1e-8)
    x = torch.randn(6, 2 * 40) * 3
    expected = F.gelu(x[:, :40], approximate="tanh") * x[:, 40:]
    assert_close(geglu(x), expected, F32, "geglu vs F.gelu(approximate='tanh')")
    hf_act = transformers.activations.ACT2FN["gelu_pytorch_tanh"]
    assert_close(geglu(x), hf_act(x[:, :40]) * x[:, 40:], F32, "geglu vs gelu_pytorch_tanh")


def test_importing_lmfuse_does_not_import_transformers():
    """No module of lmfuse imports transformers at import time (the integration imports it
    inside apply_lmfuse), and ``import lmfuse`` does not load the integrations. Checked on
    the source (a fresh interpreter to look at ``sys.modules`` costs seconds of start-up)."""
    root = Path(lmfuse.__file__).parent
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module-level statements only
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            assert not any(n.split(".")[0] == "transformers" for n in names), (
                f"{path.relative_to(root)} imports transformers at module level")
    init = ast.parse((root / "__init__.py").read_text())
    assert not any(isinstance(n, ast.ImportFrom) and (n.module or "").startswith("integrations")
                   for n in ast.walk(init)), "import lmfuse must not load lmfuse.integrations"


def test_small_no_grad_calls_run_the_module_forward(monkeypatch):
    """With autograd off, norm and MLP calls on at most ``inference_fallback_tokens`` tokens
    run the modules' own forward (no lmfuse launch); larger ones and training calls fuse."""
    import lmfuse.integrations.transformers as integration

    calls = []
    real_norm, real_swiglu = integration._rms_norm, integration._swiglu
    monkeypatch.setattr(integration, "_rms_norm",
                        lambda *a, **k: (calls.append("norm"), real_norm(*a, **k))[1])
    monkeypatch.setattr(integration, "_swiglu",
                        lambda *a, **k: (calls.append("swiglu"), real_swiglu(*a, **k))[1])
    a = make_model("llama").eval()
    b = apply_lmfuse(copy.deepcopy(a), inference_fallback_tokens=4)
    ids, _ = batch(b=1, s=4)
    with torch.no_grad():
        assert_close(b(input_ids=ids).logits, a(input_ids=ids).logits, F32, "4 tokens")
        assert calls == []
        ids, _ = batch(b=1, s=5)
        assert_close(b(input_ids=ids).logits, a(input_ids=ids).logits, F32, "5 tokens")
        assert "norm" in calls and "swiglu" in calls
    calls.clear()
    b(input_ids=ids[:, :2]).logits.sum().backward()  # training: always fused
    assert "norm" in calls and "swiglu" in calls
    with pytest.raises(ValueError, match="inference_fallback_tokens must be an int >= 0"):
        apply_lmfuse(b, inference_fallback_tokens=-1)


def _module_state(model) -> dict[str, dict]:
    return {n: dict(m.__dict__) for n, m in model.named_modules()}


def _assert_restored(model, before: dict[str, dict], attrs: tuple[str, ...]) -> None:
    """Every module of ``model`` holds the attributes it held in ``before``, and ``attrs``
    are the very same objects."""
    after = _module_state(model)
    assert after.keys() == before.keys()
    for n in before:
        assert after[n].keys() == before[n].keys(), n
        for k in attrs:
            assert after[n].get(k) is before[n].get(k), (n, k)


@pytest.mark.parametrize("model_type", ["llama", "gemma"])
def test_fused_norms_and_mlps_fuses_every_call_and_restores_the_model(monkeypatch, model_type):
    """The Generator's graph-capture patch: inside the block every norm and MLP call fuses
    (one token too) with the unpatched model's logits; afterwards the modules are exactly as
    before, plain or patched by apply_lmfuse with its own fallback."""
    import lmfuse.integrations.transformers as integration
    from lmfuse.integrations.transformers import fused_norms_and_mlps

    calls = []
    real_norm, real_swiglu = integration._rms_norm, integration._gated_mlp_forward
    monkeypatch.setattr(integration, "_rms_norm",
                        lambda *a, **k: (calls.append("norm"), real_norm(*a, **k))[1])
    a = make_model(model_type).eval()
    plain = copy.deepcopy(a)
    patched = apply_lmfuse(copy.deepcopy(a), inference_fallback_tokens=4)
    ids = torch.randint(3, VOCAB, (1, 1))
    with torch.no_grad():
        want = a(input_ids=ids).logits
        for model in (plain, patched):
            before = _module_state(model)
            with fused_norms_and_mlps(model) as supported:
                assert supported
                calls.clear()
                assert_close(model(input_ids=ids).logits, want, F32, model_type)
                assert calls.count("norm") == 2 * 2 + 1  # two a layer and the final one
            _assert_restored(model, before, ("forward", "_lmfuse_fallback_tokens"))
            calls.clear()
            model(input_ids=ids)
            assert calls == []  # one token: the module forwards again
    assert real_swiglu is integration._gated_mlp_forward
    gpt2 = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
        "gpt2", n_embd=32, n_layer=1, n_head=4, vocab_size=VOCAB))
    with fused_norms_and_mlps(gpt2) as supported:
        assert not supported


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss"])
def test_fused_norms_and_mlps_runs_the_experts_through_moe_experts(monkeypatch, model_type):
    """Inside the Generator's graph-capture patch a mixture of experts' experts run
    lmfuse.moe_experts (one call a layer, one decode token too) with the unpatched model's
    logits; afterwards the modules are as before (plain, or apply_lmfuse's experts patch
    kept as it was)."""
    import lmfuse.integrations.transformers as integration
    from lmfuse.integrations.transformers import fused_norms_and_mlps

    seen = []
    real = integration._moe_experts
    monkeypatch.setattr(integration, "_moe_experts",
                        lambda *a, **k: (seen.append(a[0].shape[0]), real(*a, **k))[1])
    a = make_model(model_type).eval()
    plain = copy.deepcopy(a)
    patched = apply_lmfuse(copy.deepcopy(a))
    ids = torch.randint(3, VOCAB, (1, 1))
    with torch.no_grad():
        want = a(input_ids=ids).logits
        for model in (plain, patched):
            before = _module_state(model)
            with fused_norms_and_mlps(model) as supported:
                assert supported
                seen.clear()
                assert_close(model(input_ids=ids).logits, want, F32, model_type)
                assert seen == [1, 1]  # the two layers' experts, one token
            _assert_restored(model, before, ("forward", "_lmfuse_experts"))
            seen.clear()
            model(input_ids=ids)
            assert seen == ([] if model is plain else [1, 1])


def test_detected_families_patch_only_what_computes_the_formula():
    """For the model types found by probing, a module is patched only when it computes the
    RMSNorm or gated-MLP formula: a norm or MLP of the same kind that does something more
    (a shift, a multiplier) is left as it is, and the loss and gradients stay the model's."""
    a = make_model("helium")
    base_mlp, base_norm = type(a.model.layers[0].mlp), type(a.model.norm)

    class ScaledMLP(base_mlp):
        def forward(self, x):
            return 2.0 * super().forward(x)

    class ShiftedRMSNorm(base_norm):
        def forward(self, x):
            return super().forward(x) + 1.0

    a.model.layers[1].mlp.__class__ = ScaledMLP
    a.model.norm.__class__ = ShiftedRMSNorm
    b = apply_lmfuse(copy.deepcopy(a), inference_fallback_tokens=0)
    s = b.lmfuse_patches
    assert s["swiglu"] == ["model.layers.0.mlp"]
    assert "model.norm" not in s["rms_norm"] and "model.layers.0.input_layernorm" in s["rms_norm"]
    ids, labels = batch()
    out_a, out_b = a(input_ids=ids, labels=labels), b(input_ids=ids, labels=labels)
    assert_close(out_b.loss, out_a.loss, F32, "helium with odd modules: loss")
    out_a.loss.backward()
    out_b.loss.backward()
    assert_same_grads(a, b, "helium with odd modules")


def test_falcon_h1_mlp_multipliers(monkeypatch):
    """Falcon-H1's MLP, ``down_proj(up_proj(x) * act_fn(gate_proj(x) * g)) * d``, runs the
    fused SwiGLU with ``gate_multiplier=g``; d goes into the activation where down_proj has
    no bias and after down_proj where it has one (``mlp_bias``), the loss and every
    gradient the unpatched model's. The multipliers are read on every call; ones lmfuse
    cannot take (a tensor) leave the call to the module, and a GELU MLP with multipliers is
    not patched (GEGLU has none)."""
    import lmfuse.integrations.transformers as integration

    seen = []
    real = integration._swiglu
    monkeypatch.setattr(integration, "_swiglu", lambda *a, **k: (seen.append(
        (k.get("gate_multiplier"), k.get("down_multiplier"))), real(*a, **k))[1])
    a = make_model("falcon_h1", num_hidden_layers=1, mlp_bias=True)
    b = apply_lmfuse(copy.deepcopy(a), inference_fallback_tokens=0)
    assert b.lmfuse_patches["swiglu"] == ["model.layers.0.feed_forward"]
    ids, labels = batch()
    out_a, out_b = a(input_ids=ids, labels=labels), b(input_ids=ids, labels=labels)
    assert_close(out_b.loss, out_a.loss, F32, "falcon_h1 mlp_bias: loss")
    out_a.loss.backward()
    out_b.loss.backward()
    assert_same_grads(a, b, "falcon_h1 mlp_bias")
    assert set(seen) == {(0.5, 1.0)}, seen  # d = 2 after down_proj and its bias

    mlp_a, mlp_b = a.model.layers[0].feed_forward, b.model.layers[0].feed_forward
    for m in (mlp_a, mlp_b):
        m.down_proj.bias = None
        m.gate_multiplier = -0.75
    x = torch.randn(2, 5, 32, requires_grad=True)
    dy = torch.randn(2, 5, 32)
    seen.clear()
    y_a, y_b = mlp_a(x), mlp_b(x)
    assert seen == [(-0.75, 2.0)]  # both multipliers in the activation
    assert_close(y_b, y_a, F32, "falcon_h1 MLP without down_proj bias")
    for g_b, g_a in zip(torch.autograd.grad(y_b, [x, *mlp_b.parameters()], dy),
                        torch.autograd.grad(y_a, [x, *mlp_a.parameters()], dy)):
        assert_close(g_b, g_a, F32, "falcon_h1 MLP gradients")
    for m in (mlp_a, mlp_b):
        m.gate_multiplier = torch.tensor(0.5)
    seen.clear()
    assert_close(mlp_b(x), mlp_a(x), F32, "tensor multiplier: the module's forward")
    assert seen == []
    plain = copy.deepcopy(mlp_a)
    plain.gate_multiplier = 1.5
    assert integration._probe_mlp(plain)
    plain.act_fn = transformers.activations.ACT2FN["gelu_pytorch_tanh"]
    assert not integration._probe_mlp(plain)
    plain.gate_multiplier = plain.down_multiplier = 1
    assert integration._probe_mlp(plain)


@pytest.mark.parametrize("where", ["config", "call"])
def test_moe_with_router_logits_keeps_the_models_own_loss(where):
    """A mixture of experts asked for its router logits adds a load-balancing loss in its
    own forward: the patched model then runs that forward (logits formed), the same loss."""
    kw = {"output_router_logits": True, "router_aux_loss_coef": 0.5} if where == "config" else {}
    a, b = make_pair("mixtral", **kw)
    ids, labels = batch()
    call = {} if where == "config" else {"output_router_logits": True}
    out_a = a(input_ids=ids, labels=labels, **call)
    out_b = b(input_ids=ids, labels=labels, **call)
    assert out_b.logits is not None and out_b.aux_loss is not None
    assert_close(out_b.loss, out_a.loss, F32, "mixtral with router logits: loss")
    plain = b(input_ids=ids, labels=labels, output_router_logits=False)
    assert plain.logits is None  # without them the fused loss runs


@pytest.mark.parametrize("cls_name, offset", [("LlamaRMSNorm", 0.0), ("GemmaRMSNorm", 1.0)])
@pytest.mark.parametrize("weight", [0.0, 1.0, 300.0])
def test_norm_probe_finds_the_weight_offset(cls_name, offset, weight):
    """The probe tells ``w`` from ``1 + w`` norms by the closer formula, large weights too
    (where both are within half precision of each other, it still picks the right one)."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from lmfuse.integrations.transformers import _probe_norm

    cls = {"LlamaRMSNorm": LlamaRMSNorm, "GemmaRMSNorm": GemmaRMSNorm}[cls_name]
    norm = cls(16)
    with torch.no_grad():
        norm.weight.fill_(weight)
    if cls is LlamaRMSNorm and weight == 0.0:
        assert _probe_norm(norm) in (0.0, None)  # all-zero output: no formula to tell
    else:
        assert _probe_norm(norm) == offset


@pytest.mark.parametrize("model_type", VISION_LANGUAGE)
def test_vision_language_models_text_stack(model_type):
    """The Qwen vision-language models: the text stack's norms and MLPs fused, and the
    loss from the last hidden states (text-only batch): loss and gradients as unpatched."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r} models")
    rope = ({"rope_type": "default", "mrope_section": [1, 1, 2], "mrope_interleaved": True}
            if model_type == "qwen3_vl" else {"type": "mrope", "mrope_section": [1, 1, 2]})
    text = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "vocab_size": VOCAB, "max_position_embeddings": 64, "initializer_range": 0.1,
            "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "rope_scaling": rope}
    vision = {"depth": 1, "embed_dim": 16, "hidden_size": 16, "num_heads": 2,
              "out_hidden_size": 32, "intermediate_size": 16, "patch_size": 2,
              "spatial_merge_size": 1, "temporal_patch_size": 1}
    config = transformers.AutoConfig.for_model(
        model_type, text_config=text, vision_config=vision, image_token_id=VOCAB - 10,
        video_token_id=VOCAB - 9, vision_start_token_id=VOCAB - 8)
    torch.manual_seed(0)
    a = transformers.AutoModelForImageTextToText.from_config(config).to(F32)
    with torch.no_grad():
        for name, p in a.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        b = apply_lmfuse(copy.deepcopy(a), inference_fallback_tokens=0)
    # Mistral 3's vision tower has a plain-GELU gated MLP: left as it is, and said so.
    told = [str(w.message) for w in caught if "left unpatched" in str(w.message)]
    assert told == (["apply_lmfuse: 1 MLP(s) left unpatched: lmfuse fuses SiLU and tanh-GELU "
                     "gated MLPs, these use GELUActivation"] if model_type == "mistral3" else [])
    s = b.lmfuse_patches
    text_norms = [n for n, m in b.named_modules()  # (Gemma 4's weightless v_norms stay)
                  if type(m).__name__.endswith("RMSNorm") and "language_model" in n
                  and getattr(m, "weight", None) is not None]
    assert text_norms and set(text_norms) <= set(s["rms_norm"])
    assert any("language_model" in n for n in s["swiglu"])
    assert s["fused_linear_cross_entropy"]
    ids = torch.randint(3, VOCAB - 20, (2, 7))
    out_a, out_b = a(input_ids=ids, labels=ids), b(input_ids=ids, labels=ids)
    assert out_b.logits is None
    assert_close(out_b.loss, out_a.loss, F32, f"{model_type}: loss")
    out_a.loss.backward()
    out_b.loss.backward()
    assert_same_grads(a, b, model_type)


# Vision-language models whose text stack is a family above: (model type, its text and
# vision configs' model types, the image token's config key, more of the model's config).
OTHER_VLMS = {
    # Gemma 3's logits soft-capped (from the text config) at a value where tanh bends them
    "gemma3": ("gemma3_text", "siglip_vision_model", "image_token_index",
               {"mm_tokens_per_image": 4}),
    "llava": ("llama", "clip_vision_model", "image_token_index", {}),
    "paligemma": ("gemma", "siglip_vision_model", "image_token_index", {}),
    "internvl": ("qwen2", "internvl_vision", "image_token_id", {}),
    "mllama": ("mllama_text_model", "mllama_vision_model", "image_token_index", {}),
    "mistral3": ("mistral", "pixtral", "image_token_index", {}),
    "gemma4": ("gemma4_text", "gemma4_vision", "image_token_id", {"audio_config": None}),
    # GLM-4.1V and GLM-4.5V: the text MLPs fuse gate and up (GLM-4.5V's MoE layer's shared
    # experts do not), the vision tower has RMSNorms and SiLU gated MLPs
    "glm4v": ("glm4v_text", "glm4v_vision", "image_token_id", {}),
    "glm4v_moe": ("glm4v_moe_text", "glm4v_moe_vision", "image_token_id", {}),
    "qwen3_vl_moe": ("qwen3_vl_moe_text", "qwen3_vl_moe_vision", "image_token_id", {}),
    "qwen3_5": ("qwen3_5_text", "qwen3_5_vision", "image_token_id", {}),
    "qwen3_5_moe": ("qwen3_5_moe_text", "qwen3_5_moe_vision", "image_token_id", {}),
    "smolvlm": ("llama", "smolvlm_vision", "image_token_id", {}),
    # MuseGlimmer: (1 + w) norms, SiLU gated MLPs, logits multiplied by output_multiplier
    # before the soft cap; a vision tower of LayerNorms (fused) and GELU fc1/fc2 MLPs (left
    # alone)
    "muse_glimmer": ("muse_glimmer_text", "muse_glimmer_vision", "image_token_id",
                     {"video_token_id": VOCAB - 9, "out_hidden_size": 64,
                      "projector_hidden_size": 32}),
}
# Their text and vision configs beyond the common tiny sizes: the multimodal rotary
# sections of head_dim 8's 4 frequencies (GLM-4.5V and Qwen3.5 rotate half and a quarter of
# each head by default: all of it here), the Qwen/GLM vision towers' own names for their
# sizes, the MoE and linear-attention layers.
_MROPE = {"rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, 2],
                              "partial_rotary_factor": 1.0}}
_QWEN_MROPE = {"rope_parameters": {**_MROPE["rope_parameters"], "mrope_interleaved": True}}
_QWEN_VISION = {"depth": 1, "num_heads": 2, "out_hidden_size": 32, "spatial_merge_size": 1,
                "temporal_patch_size": 1}
_LINEAR_ATTENTION = {"layer_types": ["linear_attention", "full_attention"],
                     "linear_num_key_heads": 2, "linear_num_value_heads": 2,
                     "linear_key_head_dim": 8, "linear_value_head_dim": 8}
_MOE = {"num_experts": 2, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
# Gemma 4's per-layer input embeddings and its full-attention layers' heads at tiny sizes
# (the defaults, a 262144 x 256 table a layer and heads of 512, made each test 15-20 s).
_GEMMA4_TEXT = {"vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8,
                "global_head_dim": 16}
VLM_SUBCONFIGS = {
    "gemma4": (_GEMMA4_TEXT, {}),
    "glm4v": (_MROPE, _QWEN_VISION),
    "glm4v_moe": ({**_MROPE, "n_routed_experts": 2, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 16, "first_k_dense_replace": 1}, _QWEN_VISION),
    "qwen3_vl_moe": ({**_QWEN_MROPE, **_MOE}, _QWEN_VISION),
    "qwen3_5": ({**_QWEN_MROPE, **_LINEAR_ATTENTION}, _QWEN_VISION),
    "qwen3_5_moe": ({**_QWEN_MROPE, **_LINEAR_ATTENTION, **_MOE,
                     "shared_expert_intermediate_size": 16}, _QWEN_VISION),
    # a cap and a multiplier that bend the tiny model's logits (the defaults, 20 and 0.196,
    # would leave tanh near linear); a 4x4 position table
    "muse_glimmer": ({"final_logit_softcapping": 0.5, "output_multiplier": 3.0},
                     {"pos_emb_height": 4, "pos_emb_width": 4}),
}
# The text stack's gated MLPs patched (2 unless listed) and the experts modules run through
# moe_experts (none unless listed): Qwen3-VL-MoE's layers are all experts (GLM-4.1V's text
# MLPs, which take gate and up from one projection, are patched); GLM-4.5V's first layer is
# dense, its second a MoE with shared experts (Qwen3.5-MoE's two are MoEs with shared
# experts).
VLM_TEXT_MLPS = {"qwen3_vl_moe": 0}
VLM_EXPERTS = {"glm4v_moe": 1, "qwen3_vl_moe": 2, "qwen3_5_moe": 2}


def _text_stack(name: str) -> bool:
    """A module of a vision-language model's text stack (SmolVLM calls it ``text_model``)."""
    return ".language_model." in f".{name}." or ".text_model." in f".{name}."


def image_text_model(config):
    """The image-text model of ``config`` (seed 0), its norm weights moved off their init,
    in float32 and train mode."""
    torch.manual_seed(0)
    a = transformers.AutoModelForImageTextToText.from_config(config).to(F32).train()
    with torch.no_grad():
        for name, p in a.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return a


def make_vlm(model_type: str):
    """A tiny random vision-language model of ``model_type`` (OTHER_VLMS), its norm weights
    (and Qwen3.5's linear-attention decay rates) moved off their init, in float32 and train
    mode."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r} models")
    text_type, vision_type, image_key, more = OTHER_VLMS[model_type]
    text_more, vision_more = VLM_SUBCONFIGS.get(model_type, ({}, {}))
    text = {"model_type": text_type, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 8, "vocab_size": VOCAB, "max_position_embeddings": 64,
            "initializer_range": 0.1, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
            **text_more}
    if text_type == "gemma3_text":
        text["final_logit_softcapping"] = 0.5
    vision = {"model_type": vision_type, "hidden_size": 16, "intermediate_size": 16,
              "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 8,
              "patch_size": 2, "projection_dim": 32, **vision_more}
    config = transformers.AutoConfig.for_model(model_type, text_config=text,
                                               vision_config=vision, **{image_key: VOCAB - 10},
                                               **more)
    a = image_text_model(config)
    with torch.no_grad():
        # Qwen3.5's gated linear attention draws its decay rates A from U(0.01, 16). Seed 0
        # gives both heads of the first layer A near 12.4 (Qwen3.5-MoE's 12.35 and 12.57): a
        # decay of e^-16 a token, below float32's epsilon against the terms it is summed
        # with, so dL/dA_log is rounding noise (Qwen3.5-MoE's at most 1.8e-5, against 0.06 to
        # 1.9 for the layer's other weights; the unpatched float32 model's is 4.7e-4 from the
        # float64 model's, whose delta rule transformers runs in float32 too, and the
        # patched model's as far from the unpatched one's). A in (1/e, e) keeps it real.
        for m in a.modules():
            if isinstance(getattr(m, "A_log", None), torch.nn.Parameter):
                m.A_log.uniform_(-1.0, 1.0)
    return a


@pytest.mark.parametrize("model_type", list(OTHER_VLMS))
def test_other_vision_language_models_text_stack(model_type):
    """Gemma 3, LLaVA, PaliGemma, InternVL, Llama 3.2 Vision (mllama), Mistral 3, Gemma 4 (no
    audio tower), GLM-4.1V, GLM-4.5V, Qwen3-VL-MoE, Qwen3.5 (dense and MoE), SmolVLM and
    MuseGlimmer with their vision towers, a text-only batch: the text stack's norms and gated
    MLPs fused (vision towers' norms and MLPs where they are of these forms; others left as
    they are), the MoE ones' experts through moe_experts, the loss from the last hidden
    states: loss and every gradient as unpatched."""
    import lmfuse.integrations.transformers as integration

    a = make_vlm(model_type)
    text_type = OTHER_VLMS[model_type][0]
    a64 = copy.deepcopy(a).double() if model_type in OWN_ROUNDING else None
    if a64 is not None:
        a64.config._experts_implementation = "eager"  # (grouped_mm takes no float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        b = apply_lmfuse(copy.deepcopy(a), inference_fallback_tokens=0)
    # Mistral 3's vision tower has a plain-GELU gated MLP: left as it is, and said so.
    told = [str(w.message) for w in caught if "left unpatched" in str(w.message)]
    assert told == (["apply_lmfuse: 1 MLP(s) left unpatched: lmfuse fuses SiLU and tanh-GELU "
                     "gated MLPs, these use GELUActivation"] if model_type == "mistral3" else [])
    s, family = b.lmfuse_patches, integration._family_of(a)
    modules = dict(b.named_modules())
    text_norms = [n for n, m in modules.items()  # (Gemma 4's weightless v_norms stay)
                  if type(m).__name__.endswith("RMSNorm") and _text_stack(n)
                  and getattr(m, "weight", None) is not None]
    assert len(text_norms) >= 5 and set(text_norms) <= set(s["rms_norm"])
    # every module of a class the probe took is patched, vision towers' too
    assert sorted(s["rms_norm"]) == sorted(
        n for n, m in modules.items() if type(m).__name__ in family.norms
        and getattr(m, "weight", None) is not None)
    # (the MLPs of a fusable form that their probe refused are listed too: GLM-4.1V's
    # patch merger, Gemma 4's vision MLPs)
    assert sorted(s["swiglu"] + s["geglu"] + list(s["mlp_unsupported_activation"])) == sorted(
        n for n, m in modules.items()
        if type(m).__name__ in family.mlps or type(m).__name__ in family.rejected_mlps)
    act = "geglu" if text_type.startswith("gemma") else "swiglu"
    assert len([n for n in s[act] if _text_stack(n)]) == VLM_TEXT_MLPS.get(model_type, 2)
    experts = [n for n, m in modules.items() if type(m).__name__.endswith("Experts")]
    assert sorted(s["moe_experts"]) == sorted(experts)
    assert len(experts) == VLM_EXPERTS.get(model_type, 0)
    if model_type == "muse_glimmer":  # the final norm's class is weightless elsewhere
        assert "model.language_model.norm" in s["rms_norm"]
        assert not any(n.endswith(("embed_norm", "qk_norm")) for n in s["rms_norm"])
    if model_type.startswith("glm4v"):  # the vision tower's gated MLP, not its merger's
        assert "model.visual.blocks.0.mlp" in s["swiglu"]
        assert "model.visual.merger" not in s["swiglu"]
        assert "model.visual.post_layernorm" in s["rms_norm"]
    assert s["fused_linear_cross_entropy"]
    ids = torch.randint(3, VOCAB - 20, (2, 7))
    out_a, out_b = a(input_ids=ids, labels=ids), b(input_ids=ids, labels=ids)
    assert out_b.logits is None and type(out_b) is type(out_a)
    assert_close(out_b.loss, out_a.loss, F32, f"{model_type}: loss")
    out_a.loss.backward()
    out_b.loss.backward()
    if a64 is not None:
        a64(input_ids=ids, labels=ids).loss.backward()
        assert_grads_within_own_rounding(a, a64, b, model_type)
    else:
        assert_same_grads(a, b, model_type)


@pytest.mark.parametrize("model_type", list(VLM_EXPERTS))
def test_moe_vision_language_models_router_logits_in_the_text_config(model_type):
    """The MoE vision-language models read ``output_router_logits`` from their text config
    (the top-level config has none): asked for there, the patched model runs its own
    forward, load-balancing loss included, as the unpatched one; asked for by the call, too."""
    a = make_vlm(model_type)
    a.config.text_config.router_aux_loss_coef = 0.5
    b = apply_lmfuse(copy.deepcopy(a))
    ids = torch.randint(3, VOCAB - 20, (2, 7))
    plain = b(input_ids=ids, labels=ids)
    assert plain.logits is None and plain.aux_loss is None
    for model in (a, b):
        model.config.text_config.output_router_logits = True
    out_a, out_b = a(input_ids=ids, labels=ids), b(input_ids=ids, labels=ids)
    assert out_b.logits is not None and out_b.aux_loss is not None
    assert_close(out_b.loss, out_a.loss, F32, f"{model_type} with router logits: loss")
    assert float((out_a.loss - plain.loss).detach().abs()) > 1e-3  # the aux loss counts
    for model in (a, b):
        model.config.text_config.output_router_logits = False
    out_a = a(input_ids=ids, labels=ids, output_router_logits=True)
    out_b = b(input_ids=ids, labels=ids, output_router_logits=True)
    assert out_b.logits is not None
    assert_close(out_b.loss, out_a.loss, F32, f"{model_type} router logits by the call: loss")


def _experts_weights(model) -> dict[str, tuple[torch.Tensor, int]]:
    return {n: (p, p.data_ptr()) for n, p in model.named_parameters() if ".experts." in n}


@pytest.mark.parametrize("model_type", MOE_EXPERTS)
def test_moe_experts_run_the_op_on_the_models_own_weights(monkeypatch, model_type):
    """The experts of each mixture of experts run ``lmfuse.moe_experts`` (the model's router
    and top-k as they are) on views of their own parameters: the same tensors, no copy, in
    the patched model and in what the op receives. Keyword calls (GPT-OSS's argument
    names) give the module's result; expert-parallel modules (whose routing may name other
    ranks' experts) run the model's code; ``experts=False`` leaves the experts alone."""
    import lmfuse.integrations.transformers as integration

    a = make_model(model_type)
    b = copy.deepcopy(a)
    before = _experts_weights(b)
    apply_lmfuse(b, inference_fallback_tokens=0)
    after = _experts_weights(b)
    assert after.keys() == before.keys() and len(after) >= 4
    for n, (p, ptr) in after.items():
        assert p is before[n][0] and ptr == before[n][1], n

    seen = []
    real = integration._moe_experts

    def spy(hidden, ids, weights, **kw):
        seen.append({k: kw[k].data_ptr() for k in ("w_gate_up", "w_down", "gate_up_bias",
                                                    "down_bias") if kw[k] is not None})
        return real(hidden, ids, weights, **kw)

    monkeypatch.setattr(integration, "_moe_experts", spy)
    ids, labels = batch()
    b(input_ids=ids, labels=labels).loss.backward()
    assert len(seen) == 2  # one call a layer

    def layer0_experts(model):
        return next(m for n, m in model.named_modules() if n.endswith("layers.0.mlp.experts")
                    or n.endswith("layers.0.block_sparse_moe.experts"))

    ea, eb = layer0_experts(a), layer0_experts(b)
    names = {"w_gate_up": "gate_up_proj", "w_down": "down_proj",
             "gate_up_bias": "gate_up_proj_bias", "down_bias": "down_proj_bias"}
    assert {names[k]: v for k, v in seen[0].items()} == {
        n: p.data_ptr() for n, p in eb.named_parameters()}

    x = torch.randn(5, 32)
    top = torch.randint(0, 2, (5, 1))
    w = torch.rand(5, 1)
    want = ea(x, top, w)
    params = list(inspect.signature(eb.forward).parameters)
    assert params == list(inspect.signature(ea.forward).parameters)
    seen.clear()
    assert_close(eb(**dict(zip(params, (x, top, w)))), want, F32, "keyword call")
    assert len(seen) == 1
    with torch.autocast("cpu", dtype=torch.bfloat16):  # weights cast as F.linear's are
        got, want_bf16 = eb(x, top, w), ea(x, top, w)
    assert got.dtype == want_bf16.dtype == F32 and len(seen) == 2
    assert_close(got, want_bf16, torch.bfloat16, "under bfloat16 autocast")
    eb._is_expert_parallel = True
    assert_close(eb(x, top, w), want, F32, "expert parallel")
    assert len(seen) == 2  # the model's own loop ran

    c = apply_lmfuse(copy.deepcopy(a), experts=False)
    assert c.lmfuse_patches["moe_experts"] == []
    assert all("forward" not in m.__dict__ for n, m in c.named_modules()
               if n.endswith(".experts"))
    assert c.lmfuse_patches["rms_norm"]
    with pytest.raises(TypeError, match="experts must be a bool"):
        apply_lmfuse(c, experts=1)


def test_gpt_oss_clamp_and_the_formulas_the_op_does_not_compute():
    """GPT-OSS with a clamp its activations reach (limit 0.3): its experts map to
    ``quick_geglu(linear_offset=1, clamp_value=limit)`` on interleaved columns, loss and
    gradients as the model's. With another ``alpha`` than quick GELU's 1.702, or an experts
    class whose forward computes something more, the experts run the model's code, with a
    warning; everything else stays patched."""
    a, b = make_pair("gpt_oss", swiglu_limit=0.3)
    assert b.lmfuse_patches["moe_experts"] and b.model.layers[0].mlp.experts.limit == 0.3
    ids, labels = batch()
    out_a, out_b = a(input_ids=ids, labels=labels), b(input_ids=ids, labels=labels)
    assert_close(out_b.loss, out_a.loss, F32, "gpt_oss clamped: loss")
    out_a.loss.backward()
    out_b.loss.backward()
    assert_same_grads(a, b, "gpt_oss clamped")

    other = make_model("gpt_oss", swiglu_alpha=1.5)
    with pytest.warns(UserWarning, match=r"alpha 1\.5 \(lmfuse's quick_geglu has 1\.702\)"):
        apply_lmfuse(other)
    assert other.lmfuse_patches["moe_experts"] == [] and other.lmfuse_patches["rms_norm"]

    mixtral = make_model("mixtral")
    base = type(mixtral.model.layers[0].mlp.experts)

    class ScaledExperts(base):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return 2.0 * super().forward(hidden_states, top_k_index, top_k_weights)

    mixtral.model.layers[1].mlp.experts.__class__ = ScaledExperts
    with pytest.warns(UserWarning, match="computes another formula than moe_experts"):
        b = apply_lmfuse(copy.deepcopy(mixtral))
    assert b.lmfuse_patches["moe_experts"] == ["model.layers.0.mlp.experts"]
    out_a, out_b = mixtral(input_ids=ids, labels=labels), b(input_ids=ids, labels=labels)
    assert_close(out_b.loss, out_a.loss, F32, "mixtral with odd experts: loss")

    class FailingExperts(base):  # as HF's grouped_mm experts in float64
        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise RuntimeError("Expected mat_a to be Float32, got Double")

    failing = make_model("mixtral")
    failing.model.layers[1].mlp.experts.__class__ = FailingExperts
    with pytest.warns(UserWarning, match=r"its forward raised on a probe input in torch\.float32 "
                      r"\(RuntimeError: Expected mat_a .*\), so it could not be compared"):
        b = apply_lmfuse(failing)
    assert b.lmfuse_patches["moe_experts"] == ["model.layers.0.mlp.experts"]


# DeepSeek-V2/V3's latent attention and mixture of experts at tiny sizes
_MLA = {"q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
        "v_head_dim": 8, "first_k_dense_replace": 1, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
        "moe_intermediate_size": 16}
# Model types found by probing that the tests above do not build (each case builds one tiny
# model and checks one training step only, to keep the suite's time): config overrides, and
# whether the model is a base model (a text stack of a vision-language model, no lm_head).
MORE_FAMILIES = {
    # two experts routed to both: with one slot, the renormalised router weight is 1 and
    # the router's gradient mere rounding noise
    "hunyuan_v1_moe": {"num_experts": 2, "moe_topk": 2},
    "qwen3_next": {"layer_types": ["linear_attention", "full_attention"],
                   "linear_num_key_heads": 2, "linear_num_value_heads": 2,
                   "linear_key_head_dim": 8, "linear_value_head_dim": 8, "num_experts": 2,
                   "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                   "shared_expert_intermediate_size": 16},
    "qwen3_5_text": {"layer_types": ["linear_attention", "full_attention"],
                     "linear_num_key_heads": 2, "linear_num_value_heads": 2,
                     "linear_key_head_dim": 8, "linear_value_head_dim": 8},
    "qwen3_5_moe_text": {"layer_types": ["linear_attention", "full_attention"],
                         "linear_num_key_heads": 2, "linear_num_value_heads": 2,
                         "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                         "num_experts": 2, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16},
    # a clamp (swiglu_limit) small enough for the experts' activations to reach it; top-k
    # routed layers (a hash-routed one's router gradient is zero but for rounding noise)
    "deepseek_v4": {"n_routed_experts": 3, "num_experts_per_tok": 2, "swiglu_limit": 0.3,
                    "moe_intermediate_size": 16, "q_lora_rank": 16, "o_lora_rank": 16,
                    "index_n_heads": 2, "index_head_dim": 8, "o_groups": 2, "hc_mult": 2,
                    "mlp_layer_types": ["moe", "moe"]},
    # DeepSeek-V2 and -V3: a dense first layer, then a MoE of four experts in two groups,
    # top-2 from the best group (V2's "group_limited_greedy", V3's "noaux_tc"), one shared
    # expert, routed weights scaled; the multi-head latent attention needs as many key/value
    # heads as query heads (its keys are expanded per head); V2's MLPs with biases
    "deepseek_v2": {**_MLA, "num_key_value_heads": 4, "topk_method": "group_limited_greedy",
                    "routed_scaling_factor": 1.5, "mlp_bias": True},
    "deepseek_v3": {**_MLA, "num_key_value_heads": 4, "routed_scaling_factor": 2.5},
    "nemotron": {},
    "qwen2_vl_text": {"rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}},
    "qwen2_5_vl_text": {"rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}},
    "qwen3_vl_text": {},
    "qwen3_vl_moe_text": {"num_experts": 2, "num_experts_per_tok": 2,
                          "moe_intermediate_size": 16},
    "gemma4_text": _GEMMA4_TEXT,
    # Mllama's text model with a cross-attention layer (fed vision states below)
    "mllama_text_model": {"cross_attention_layers": [1]},
    # Pixtral's vision encoder (fed images below) with SiLU gated MLPs; transformers'
    # default GELU ones stay the model's, with a warning (the mistral3 case above)
    "pixtral": {"hidden_act": "silu", "image_size": 8, "patch_size": 2},
    "muse_glimmer_text": {},
}
BASE_MODELS = ("qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text", "qwen3_vl_moe_text",
               "pixtral", "muse_glimmer_text")
# Causal LMs that AutoModelForCausalLM does not build from their config
CAUSAL_LM_CLASSES = {"mllama_text_model": "MllamaForCausalLM"}
# Model types whose unpatched float32 gradients are themselves further from their float64
# model's than the float32 tolerance (transformers computes Gemma 4's norms, attention
# softmax and rotary angles in float32 whatever the model's dtype: seed 0's up_proj
# gradient is 1.4e-5 from the float64 model's): there the patched float32 model is held to
# the float64 model, no further from it than twice the unpatched float32 model is (the
# margin FlashAttention's tests use), and never beyond the tolerance when that is larger.
# Qwen3-Next's linear attention (Qwen3.5-MoE's, below): its dt_bias float32 gradient is
# ill-conditioned, 1.15e-5 between the patched and unpatched float32 models on one CPU
# (AVX2, 2 threads) and within the tolerance on CI's.
OWN_ROUNDING = ("gemma4_text", "gemma4", "qwen3_next")
# Model types checked in float64 (patched and unpatched), to the float32 tolerance (HF's loss
# takes the logits in float32): Qwen3.5-MoE's linear attention makes its dt_bias / A_log
# float32 gradients ill-conditioned (with transformers 5.24, the unpatched float32 model's
# are 9.8e-6 from its float64 twin's, at the tolerance, and any change of rounding in the
# norms, MLPs or experts moves them as much). HF's grouped_mm experts take no float64: the
# eager experts there. (lmfuse's ops run their torch paths in float64; the other families
# check the Triton paths of the same patches in float32.)
IN_FLOAT64 = ("qwen3_5_moe_text",)


def assert_grads_within_own_rounding(a, a64, b, what: str) -> None:
    from helpers import max_rel_err, rel_err, tol

    ref, grads_b = dict(a64.named_parameters()), dict(b.named_parameters())
    for name, p in a.named_parameters():
        q = grads_b[name]
        assert (p.grad is None) == (q.grad is None), f"{what}: {name} grad presence differs"
        if p.grad is None:
            continue
        g64 = ref[name].grad
        own = max(rel_err(p.grad, g64), max_rel_err(p.grad, g64))
        err = max(rel_err(q.grad, g64), max_rel_err(q.grad, g64))
        assert err <= max(tol(F32), 2 * own), (
            f"{what}: grad of {name} is {err:.2e} from the float64 model's, the unpatched "
            f"float32 model's {own:.2e}")


@pytest.mark.parametrize("model_type", list(MORE_FAMILIES))
def test_more_families_one_training_step(model_type):
    """One training step of each: the loss (or, for a base model, a weighted sum of its last
    hidden states) and every gradient as the unpatched model's; the output of the same
    type; every RMSNorm and gated MLP of the formulas patched, and nothing else."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    import lmfuse.integrations.transformers as integration

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r} models")
    kw = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
          "vocab_size": VOCAB, "max_position_embeddings": 64, "initializer_range": 0.1,
          "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **MORE_FAMILIES[model_type]}
    config = transformers.AutoConfig.for_model(model_type, **kw)
    config._attn_implementation = "eager"
    dtype = torch.float64 if model_type in IN_FLOAT64 else F32
    if model_type in IN_FLOAT64:
        config._experts_implementation = "eager"
    torch.manual_seed(0)
    if model_type in CAUSAL_LM_CLASSES:
        a = getattr(transformers, CAUSAL_LM_CLASSES[model_type])(config).to(dtype)
    elif model_type in BASE_MODELS:
        a = transformers.AutoModel.from_config(config).to(dtype)
    else:
        a = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():
        for name, p in a.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
            elif name.endswith(("cross_attn_attn_gate", "cross_attn_mlp_gate")):
                p.fill_(0.5)  # Mllama's start at 0: the cross-attention layer would add 0
    a.train()
    a64 = copy.deepcopy(a).double() if model_type in OWN_ROUNDING else None
    if a64 is not None:
        a64.config._experts_implementation = "eager"  # (grouped_mm takes no float64)
    b = apply_lmfuse(copy.deepcopy(a), inference_fallback_tokens=0)
    ids, labels = batch()
    inputs = {"input_ids": ids}
    if model_type == "pixtral":  # two 8x8 images, 16 patches each
        inputs = {"pixel_values": torch.randn(2, 3, 8, 8)}
    elif model_type == "mllama_text_model":  # vision states for the cross-attention layer
        inputs["cross_attention_states"] = torch.randn(2, 5, 32)
    if a64 is not None:
        a64(input_ids=ids, labels=labels).loss.backward()
    if model_type in BASE_MODELS:
        out_a, out_b = a(**inputs), b(**inputs)
        assert_close(out_b.last_hidden_state, out_a.last_hidden_state, F32, model_type)
        g = torch.randn_like(out_a.last_hidden_state)
        loss_a, loss_b = (out_a.last_hidden_state * g).sum(), (out_b.last_hidden_state * g).sum()
    else:
        out_a, out_b = a(**inputs, labels=labels), b(**inputs, labels=labels)
        assert out_b.logits is None and b.lmfuse_patches["fused_linear_cross_entropy"]
        loss_a, loss_b = out_a.loss, out_b.loss
        assert_close(loss_b, loss_a, F32, f"{model_type}: loss")
    assert type(out_b) is type(out_a)
    loss_a.backward()
    loss_b.backward()
    if a64 is not None:
        assert_grads_within_own_rounding(a, a64, b, model_type)
    else:
        assert_same_grads(a, b, model_type)

    s, family = b.lmfuse_patches, integration._family_of(a)
    modules = dict(b.named_modules())
    assert sorted(s["rms_norm"]) == sorted(  # Gemma 4's weightless v_norms stay its own
        n for n, m in modules.items() if type(m).__name__ in family.norms
        and getattr(m, "weight", None) is not None)
    assert sorted(s["swiglu"] + s["geglu"] + s["squared_relu"]) == sorted(
        n for n, m in modules.items() if type(m).__name__ in family.mlps)
    assert sorted(s["moe_experts"]) == sorted(
        n for n, m in modules.items() if type(m).__name__ in family.experts)
    if model_type == "nemotron":  # LayerNorm1P (lmfuse.layer_norm), ReLU^2 MLPs without a gate
        assert not s["rms_norm"] and not s["swiglu"] and len(s["layer_norm"]) == 5
        assert s["squared_relu"] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    else:
        assert len(s["rms_norm"]) >= 5
    # the norms of the other formulas stay as they are: the gated norms of the linear
    # attention (two inputs), DeepSeek-V4's weightless ones
    assert all(n not in s["rms_norm"] for n, m in modules.items()
               if type(m).__name__.endswith(("RMSNormGated", "UnweightedRMSNorm")))
    experts = [n for n, m in modules.items() if type(m).__name__.endswith("Experts")]
    assert sorted(s["moe_experts"]) == sorted(experts)
    if model_type == "deepseek_v4":  # clamped dense MLPs: not the patch's formula
        assert not s["swiglu"] and len(experts) == 2
        assert b.model.layers[0].mlp.experts.limit == 0.3
    elif model_type == "gemma4_text":  # tanh-GELU gated MLPs; the weightless v_norms stay
        assert len(s["geglu"]) == 2 and not s["swiglu"]
        assert all(n not in s["rms_norm"] for n in modules if n.endswith("v_norm"))
    elif model_type in ("deepseek_v2", "deepseek_v3"):
        # MLA's latent norms, the dense MLP and the shared experts, the routed experts; the
        # router (grouped top-k, scaled weights) and the attention stay the model's
        assert {"model.layers.1.self_attn.q_a_layernorm",
                "model.layers.1.self_attn.kv_a_layernorm"} <= set(s["rms_norm"])
        assert s["swiglu"] == ["model.layers.0.mlp", "model.layers.1.mlp.shared_experts"]
        assert s["moe_experts"] == ["model.layers.1.mlp.experts"]
        assert not any("forward" in m.__dict__ for n, m in modules.items()
                       if n.endswith(("mlp.gate", "self_attn")))
    elif model_type == "muse_glimmer_text":
        # four (1 + w) norms a layer and the final norm, whose class's other instances (of
        # the embedding, the q/k heads) have no weight and stay the model's
        assert len(s["rms_norm"]) == 9 and "norm" in s["rms_norm"] and len(s["swiglu"]) == 2
        assert not any(n.endswith(("embed_norm", "qk_norm")) for n in s["rms_norm"])
    elif model_type not in ("nemotron", "qwen3_vl_moe_text"):  # the latter: experts only
        assert s["swiglu"]
    if model_type == "mllama_text_model":  # the cross-attention layer's q/k norms and MLP
        assert {"model.layers.1.cross_attn.q_norm", "model.layers.1.cross_attn.k_norm",
                "model.layers.1.input_layernorm"} <= set(s["rms_norm"])
        assert s["swiglu"] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    elif model_type == "pixtral":  # ln_pre and two norms a layer; the SiLU MLPs
        assert len(s["rms_norm"]) == 5 and len(s["swiglu"]) == 2


def test_llama4_vision_language_model_norms_and_mlps():
    """Llama 4's image-text model (Llama4ForConditionalGeneration, model type "llama4"): the
    text stack's norms and its gated MLPs (the dense ones and the MoE layers' shared
    experts, whose activation is named activation_fn) fused; the experts (they take tokens
    already sorted by expert) and the loss stay the model's. Its text model's training step
    gives the unpatched loss and gradients."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "llama4" not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no Llama 4 models")
    text = {"hidden_size": 32, "intermediate_size": 48, "intermediate_size_mlp": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 8, "vocab_size": VOCAB, "max_position_embeddings": 64,
            "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
            "interleave_moe_layer_step": 2, "num_local_experts": 2}
    vision = {"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 8, "patch_size": 2,
              "vision_output_dim": 32, "projector_input_dim": 32, "projector_output_dim": 32}
    config = transformers.AutoConfig.for_model("llama4", text_config=text, vision_config=vision,
                                               image_token_index=VOCAB - 10)
    a = image_text_model(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = apply_lmfuse(copy.deepcopy(a), inference_fallback_tokens=0)
    s = b.lmfuse_patches
    assert sorted(s["swiglu"]) == ["language_model.model.layers.0.feed_forward",
                                   "language_model.model.layers.1.feed_forward.shared_expert"]
    norms = [n for n, m in b.named_modules() if type(m).__name__ == "Llama4TextRMSNorm"]
    assert len(norms) == 5 and set(norms) <= set(s["rms_norm"])
    assert not s["moe_experts"] and not s["fused_linear_cross_entropy"]
    ids, labels = batch()
    out_a = a.language_model(input_ids=ids, labels=labels)
    out_b = b.language_model(input_ids=ids, labels=labels)
    assert_close(out_b.loss, out_a.loss, F32, "llama4: loss")
    out_a.loss.backward()
    out_b.loss.backward()
    assert_same_grads(a, b, "llama4")


def test_liger_forward_keywords():
    """Liger-Kernel's forward keywords on a patched model: return_token_accuracy and
    return_predicted_tokens add the fused loss's token accuracy and argmax to the output
    (from the unpatched logits: the same), skip_logits=False returns the logits (the
    model's own forward), and without labels they change nothing."""
    a, b = make_pair("llama")
    ids, labels = batch()
    out_a = a(input_ids=ids, labels=labels)
    out_b = b(input_ids=ids, labels=labels, return_token_accuracy=True,
              return_predicted_tokens=True)
    assert_close(out_b.loss, out_a.loss, F32, "loss")
    target = F.pad(labels, (0, 1), value=-100)[..., 1:]
    counted = target != -100
    argmax = out_a.logits.argmax(-1)
    want_pred = torch.where(counted, argmax, -1)
    assert torch.equal(out_b.predicted_tokens, want_pred)
    want_acc = (argmax == target)[counted].float().mean()
    assert torch.allclose(out_b.token_accuracy, want_acc)
    assert out_b.logits is None
    out_c = b(input_ids=ids, labels=labels, skip_logits=False)
    assert out_c.logits is not None and "token_accuracy" not in out_c
    assert_close(out_c.loss, out_a.loss, F32, "loss with logits")
    out_d = b(input_ids=ids, return_token_accuracy=True)  # no labels: the logits, as before
    assert torch.allclose(out_d.logits, a(input_ids=ids).logits, atol=1e-5)
    # skip_logits=True: the fused loss in an evaluation too (eval mode, no gradient)
    b.eval()
    with torch.no_grad():
        out_e = b(input_ids=ids, labels=labels, skip_logits=True, return_token_accuracy=True)
        assert out_e.logits is None and torch.allclose(out_e.token_accuracy, want_acc)
        with pytest.raises(ValueError, match="skip_logits=True needs labels"):
            b(input_ids=ids, skip_logits=True)


def test_probes_leave_the_global_generator_and_name_the_mlps_they_refuse():
    """A probed MLP with a dropout (Seed-OSS's default residual_dropout) draws its masks from
    torch's generator while the probe runs: the user's random numbers stay as they were, and
    the MLPs left to the model are named in a warning and in lmfuse_patches."""
    a = make_model("seed_oss", residual_dropout=0.1)
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    with pytest.warns(UserWarning, match=r"2 MLP module\(s\) run the model's own code: a "
                                         r"probe found another formula"):
        b = apply_lmfuse(a)
    assert torch.equal(torch.rand(3), want)
    s = b.lmfuse_patches
    assert not s["swiglu"] and sorted(s["mlp_unsupported_activation"]) == [
        "model.layers.0.mlp", "model.layers.1.mlp"]


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "mixtral"])
def test_fused_loss_compiles_in_one_graph(model_type):
    """torch.compile(fullgraph=True) of a patched model's training step with labels (the
    fused loss): one graph, as the unpatched model's; the loss and gradients as eager's.
    (Reading the class's source and output fields in the forward broke the graph.)"""
    a, b = make_pair(model_type)
    ids, labels = batch()
    eager = b(input_ids=ids, labels=labels).loss
    eager.backward()
    grads = {n: p.grad.clone() for n, p in b.named_parameters() if p.grad is not None}
    b.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(b, backend="aot_eager", fullgraph=True)
    loss = compiled(input_ids=ids, labels=labels).loss
    loss.backward()
    assert_close(loss, eager, F32, "compiled loss")
    for n, p in b.named_parameters():
        if n in grads:
            assert_close(p.grad, grads[n], F32, f"compiled grad of {n}")
    torch._dynamo.reset()


def test_probed_family_with_a_foreign_forward():
    """A probed family (Seed-OSS) as a hand-kept one (Llama): an MLP instance whose forward
    another library replaced is named as foreign and the class is probed on the next
    instance (it decided for the whole class, silently), not reported as another formula.
    (A wrapped projection: test_a_dropout_inside_a_projection_stays_with_the_patch.)"""
    import types

    a = make_model("seed_oss", residual_dropout=0.0)
    first = a.model.layers[0].mlp
    first.forward = types.MethodType(
        lambda self, x: self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)), first)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        b = apply_lmfuse(a)
    s = b.lmfuse_patches
    assert s["swiglu"] == ["model.layers.1.mlp"] and not s["mlp_unsupported_activation"]
    told = " ".join(str(w.message) for w in caught)
    assert "another library already replaced their forward: model.layers.0.mlp" in told
    assert "another formula" not in told


def test_a_dropout_inside_a_projection_stays_with_the_patch():
    """A probed family whose projections are wrapped modules carrying their own dropout (as
    a LoRA adapter's lora_dropout): the patch calls such projections as modules, so the MLP
    is fused (its probe looked at the MLP's own steps only), and training draws the same
    masks as the unpatched model."""
    class DroppedLinear(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.drop = inner, torch.nn.Dropout(0.1)

        def forward(self, x):
            return self.inner(self.drop(x))

    a = make_model("seed_oss", residual_dropout=0.0)
    for layer in a.model.layers:
        layer.mlp.gate_proj = DroppedLinear(layer.mlp.gate_proj)
    b = apply_lmfuse(copy.deepcopy(a))
    assert b.lmfuse_patches["swiglu"] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    ids, labels = batch()
    torch.manual_seed(5)
    loss_a = a(input_ids=ids, labels=labels).loss
    torch.manual_seed(5)
    loss_b = b(input_ids=ids, labels=labels).loss
    assert_close(loss_b, loss_a, F32, "same dropout masks")
