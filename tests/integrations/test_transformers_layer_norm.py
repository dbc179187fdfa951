"""``apply_lmfuse``'s LayerNorm patch (``layer_norm=True``) on tiny random-config models.

LLaVA's CLIP vision tower (``torch.nn.LayerNorm``: ``pre_layrnorm``, each layer's two norms,
``post_layernorm``), fed an image, and Nemotron (its ``NemotronLayerNorm1P``, ``weight + 1``,
found by a probe): in float32 the patched model's loss and every gradient equal the
unpatched model's (tolerances from ``helpers.py``), the LayerNorms run
``lmfuse.layer_norm``'s Triton kernels in the CPU interpreter (the suite's
``TRITON_INTERPRET=1``), and each patched module gives the output dtype the module gives.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import helpers
from helpers import assert_close, labelled_ids

import lmfuse.integrations as integrations
from lmfuse.integrations.transformers import apply_lmfuse

transformers = pytest.importorskip("transformers")

F32, BF16 = torch.float32, torch.bfloat16
VOCAB = 160
IMAGE = VOCAB - 10  # LLaVA's image token
PATCHES = 16  # an 8x8 image in 2x2 patches (the CLS feature is dropped)
TINY_TEXT = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
             "vocab_size": VOCAB, "max_position_embeddings": 64, "initializer_range": 0.1,
             "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _off_init(model):
    """``model`` in float32 and train mode, its norms' weights and biases moved off their
    init (ones and zeros), so that an offset or a bias left out would show."""
    model = model.to(F32).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def make_llava():
    """LLaVA of a two-layer Llama and a one-layer CLIP vision tower whose last layer's
    features are used (``vision_feature_layer=-1``: all of its norms but the unused pooled
    output's take part in the loss)."""
    text = {"model_type": "llama", **TINY_TEXT}
    vision = {"model_type": "clip_vision_model", "hidden_size": 16, "intermediate_size": 16,
              "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 8,
              "patch_size": 2, "projection_dim": 32}
    config = transformers.AutoConfig.for_model(
        "llava", text_config=text, vision_config=vision, image_token_index=IMAGE,
        vision_feature_layer=-1)
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    return _off_init(transformers.AutoModelForImageTextToText.from_config(config))


def make_nemotron():
    config = transformers.AutoConfig.for_model("nemotron", **TINY_TEXT)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return _off_init(transformers.AutoModelForCausalLM.from_config(config))


def image_batch():
    """Two sequences of an image's 16 tokens and 5 text tokens, their images and labels
    (the image tokens not scored)."""
    g = torch.Generator().manual_seed(1)
    text = torch.randint(3, IMAGE - 1, (2, 5), generator=g)
    ids = torch.cat([torch.full((2, PATCHES), IMAGE), text], dim=1)
    labels = ids.masked_fill(ids == IMAGE, -100)
    return ids, torch.randn(2, 3, 8, 8, generator=g), labels


def text_batch():
    return labelled_ids(VOCAB)


def assert_same_grads(a, b, what: str) -> None:
    # A key bias adds the same logit to every key of a query: the softmax cancels it, and
    # its gradient is zero but for rounding (5e-9 here, against 0.04 to 1.6 for the tower's
    # other parameters).
    helpers.assert_same_grads(a, b, what, zero_suffixes=("k_proj.bias",))


@pytest.fixture
def op_calls(monkeypatch):
    """The widths of the rows each lmfuse.layer_norm call of a patched module normalises."""
    calls = []
    real = integrations._layer_norm

    def counted(x, *args, **kwargs):
        calls.append(x.shape[-1])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(integrations, "_layer_norm", counted)
    return calls


def layer_norm_names(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)]


def test_llava_vision_tower_layer_norms_match_unpatched(op_calls):
    """LLaVA with an image: the CLIP tower's four nn.LayerNorms run lmfuse.layer_norm (the
    text stack's RMSNorms and MLPs and the loss as before); loss and every gradient, the
    tower's norm weights and biases included, as unpatched."""
    a = make_llava()
    b = apply_lmfuse(copy.deepcopy(a), inference_fallback_tokens=0)
    s = b.lmfuse_patches
    norms = layer_norm_names(b)
    assert len(norms) == 4 and all("vision_tower" in n for n in norms)
    assert s["layer_norm"] == norms
    assert s["rms_norm"] and s["swiglu"] and s["fused_linear_cross_entropy"]

    ids, pixels, labels = image_batch()
    out_a = a(input_ids=ids, pixel_values=pixels, labels=labels)
    op_calls.clear()
    out_b = b(input_ids=ids, pixel_values=pixels, labels=labels)
    assert op_calls == [16] * 4  # the tower's hidden size, each norm once
    assert_close(out_b.loss, out_a.loss, F32, "llava: loss")
    out_a.loss.backward()
    out_b.loss.backward()
    assert_same_grads(a, b, "llava")
    tower = "model.vision_tower."
    for name in ("pre_layrnorm.weight", "encoder.layers.0.layer_norm1.bias"):
        assert b.get_parameter(tower + name).grad is not None, name


def test_nemotron_layer_norm_1p_matches_unpatched(op_calls):
    """Nemotron: its LayerNorm1P's forward is found by the probe to be a LayerNorm of
    ``weight + 1``; every one (two a layer, the final norm) runs lmfuse.layer_norm with
    weight_offset=1.0, and the loss and every gradient are the unpatched model's."""
    from lmfuse.integrations.transformers import _family_of

    a = make_nemotron()
    assert _family_of(a).layer_norms == {"NemotronLayerNorm1P": 1.0}
    b = apply_lmfuse(copy.deepcopy(a), inference_fallback_tokens=0)
    s = b.lmfuse_patches
    norms = layer_norm_names(b)
    assert len(norms) == 5 and s["layer_norm"] == norms
    assert all(b.get_submodule(n)._lmfuse_weight_offset == 1.0 for n in norms)
    ids, labels = text_batch()
    out_a = a(input_ids=ids, labels=labels)
    op_calls.clear()
    out_b = b(input_ids=ids, labels=labels)
    assert op_calls == [32] * 5
    assert_close(out_b.loss, out_a.loss, F32, "nemotron: loss")
    out_a.loss.backward()
    out_b.loss.backward()
    assert_same_grads(a, b, "nemotron")


def test_layer_norm_false_leaves_them_and_the_flag_is_checked():
    a = make_nemotron()
    b = apply_lmfuse(copy.deepcopy(a), layer_norm=False)
    assert b.lmfuse_patches["layer_norm"] == []
    assert b.lmfuse_patches["squared_relu"] and b.lmfuse_patches["fused_linear_cross_entropy"]
    assert not any("forward" in b.get_submodule(n).__dict__ for n in layer_norm_names(b))
    with pytest.raises(TypeError, match="layer_norm must be a bool"):
        apply_lmfuse(b, layer_norm=1)


def test_fused_norms_and_mlps_fuses_the_layer_norms_and_restores_the_model(op_calls):
    """The Generator's graph-capture patch: inside the block every LayerNorm call fuses, one
    token too, with the unpatched logits; afterwards the modules are exactly as before
    (plain, or apply_lmfuse's patch with its own fallback: one token runs the module)."""
    from lmfuse.integrations.transformers import fused_norms_and_mlps

    a = make_nemotron().eval()
    plain = copy.deepcopy(a)
    patched = apply_lmfuse(copy.deepcopy(a), inference_fallback_tokens=4)
    ids = torch.randint(3, VOCAB, (1, 1))
    with torch.no_grad():
        want = a(input_ids=ids).logits
        for model in (plain, patched):
            before = {n: dict(m.__dict__) for n, m in model.named_modules()}
            with fused_norms_and_mlps(model) as supported:
                assert supported
                op_calls.clear()
                assert_close(model(input_ids=ids).logits, want, F32, "inside the block")
                assert op_calls == [32] * 5
            after = {n: dict(m.__dict__) for n, m in model.named_modules()}
            assert after.keys() == before.keys()
            for n in before:
                assert after[n].keys() == before[n].keys(), n
                for k in ("forward", "_lmfuse_fallback_tokens", "_lmfuse_layer_norm_autocast"):
                    assert after[n].get(k) is before[n].get(k), (n, k)
            op_calls.clear()
            model(input_ids=ids)
            assert op_calls == []  # one token, autograd off: the module's own forward


class ScaledLayerNorm(torch.nn.LayerNorm):
    """A LayerNorm subclass with a forward of its own that is a plain LayerNorm."""

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class NoBiasLayerNorm(torch.nn.LayerNorm):
    """Its own forward leaves the bias out: not torch's LayerNorm once the bias is trained."""

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, None, self.eps)


def test_layer_norms_of_other_shapes_and_subclasses():
    """nn.LayerNorm over two dims (normalised as one flattened row), without affine
    parameters and without a bias, are patched; of the subclasses with their own forward,
    the probe takes the one that computes a LayerNorm and leaves the one that drops its
    bias (even with the bias at its init, zeros). Forward and gradients as the modules'."""
    model = make_nemotron()
    model.model.extra = torch.nn.ModuleDict({
        "two_dims": torch.nn.LayerNorm((4, 8)),
        "no_affine": torch.nn.LayerNorm(8, elementwise_affine=False),
        "no_bias": torch.nn.LayerNorm(8, bias=False),
        "own_forward": ScaledLayerNorm(8),
        "drops_its_bias": NoBiasLayerNorm(8)})
    _off_init(model.model.extra)
    with torch.no_grad():
        model.model.extra.drops_its_bias.bias.zero_()
    ref = copy.deepcopy(model)
    apply_lmfuse(model)
    patched = [n.split(".")[-1] for n in model.lmfuse_patches["layer_norm"] if "extra" in n]
    assert patched == ["two_dims", "no_affine", "no_bias", "own_forward"]
    assert "forward" not in model.model.extra.drops_its_bias.__dict__
    for name in patched:
        m, r = model.model.extra[name], ref.model.extra[name]
        x = torch.randn(3, 2, 4, 8) if name == "two_dims" else torch.randn(3, 5, 8)
        x = (x * 2 + 1).requires_grad_()
        x_ref = x.detach().clone().requires_grad_()
        y, y_ref = m(x), r(x_ref)
        assert_close(y, y_ref, F32, f"{name}: output")
        g = torch.randn_like(y)
        y.backward(g)
        y_ref.backward(g)
        assert_close(x.grad, x_ref.grad, F32, f"{name}: dx")
        for (pname, p), q in zip(m.named_parameters(), r.parameters()):
            assert_close(p.grad, q.grad, F32, f"{name}: grad of {pname}")


def _vision_norm(model):
    return model.model.vision_tower.pre_layrnorm


@pytest.mark.parametrize("case", ["bf16-x-f32-params", "bf16-x-bf16-params",
                                  "cpu-autocast-f32-x", "cpu-autocast-bf16-x"])
def test_patched_layer_norm_gives_the_modules_dtype(case, op_calls):
    """The patched nn.LayerNorm returns what the module returns: a 16-bit x with float32
    parameters (F.layer_norm's mixed type) or its own dtype's gives x's dtype; CPU autocast
    has no policy for layer_norm (float32 stays float32, bfloat16 bfloat16). Values within
    the dtype's tolerance."""
    a = make_llava()
    b = apply_lmfuse(copy.deepcopy(a))
    norm, ref = _vision_norm(b), _vision_norm(a)
    if case == "bf16-x-bf16-params":
        norm.to(BF16)
        ref.to(BF16)
    x = torch.randn(2, 17, 16) * 3 + 1
    x = x if case == "cpu-autocast-f32-x" else x.to(BF16)
    autocast = torch.autocast("cpu", dtype=BF16, enabled=case.startswith("cpu-autocast"))
    with autocast:
        op_calls.clear()
        y, want = norm(x), ref(x)
    assert op_calls == [16]
    assert y.dtype == want.dtype == x.dtype
    assert_close(y, want, want.dtype, case)


def test_a_dtype_mix_pytorch_refuses_gets_its_error(op_calls):
    """A float32 x into bfloat16 parameters: F.layer_norm refuses it; so does the patched
    module (the module's own forward runs, with PyTorch's error), where lmfuse.layer_norm
    would have taken it."""
    a = make_llava()
    b = apply_lmfuse(copy.deepcopy(a))
    norm, ref = _vision_norm(b).to(BF16), _vision_norm(a).to(BF16)
    x = torch.randn(2, 17, 16)
    with pytest.raises(RuntimeError) as want:
        ref(x)
    with pytest.raises(RuntimeError) as got:
        norm(x)
    assert str(got.value) == str(want.value) and op_calls == []


def test_nemotron_layer_norm_1p_dtypes(monkeypatch, op_calls):
    """LayerNorm1P's dtypes as its own forward gives them: a bfloat16 model's x in bfloat16
    (its weight + 1 rounded to bfloat16 first: one rounding from lmfuse's float32 sum); and
    under CUDA's autocast (the ``torch.is_autocast_enabled()`` its forward asks, stood in
    for here on the CPU), x, weight + 1 and bias cast to the autocast dtype (bfloat16, from
    float32 parameters and x): a bfloat16 output."""
    a = make_nemotron()
    b = apply_lmfuse(copy.deepcopy(a))
    norm, ref = b.model.norm, a.model.norm
    x = torch.randn(2, 5, 32) * 3 + 1
    norm16, ref16 = copy.deepcopy(norm).to(BF16), copy.deepcopy(ref).to(BF16)
    op_calls.clear()
    y, want = norm16(x.to(BF16)), ref16(x.to(BF16))
    assert op_calls == [32] and y.dtype == want.dtype == BF16
    assert_close(y, want, BF16, "bfloat16 LayerNorm1P")

    real = torch.is_autocast_enabled
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *a: True if not a else real(*a))
    assert torch.get_autocast_dtype("cpu") == BF16
    op_calls.clear()
    y, want = norm(x), ref(x)
    assert op_calls == [32] and y.dtype == want.dtype == BF16
    assert_close(y, want, BF16, "LayerNorm1P under CUDA's autocast flag")


def test_a_probed_subclass_runs_its_own_forward_under_autocast(op_calls):
    """A LayerNorm subclass with its own forward that the probe took: its casts under
    autocast are unknown to lmfuse, so there its own forward runs."""
    model = make_nemotron()
    model.model.extra = ScaledLayerNorm(8)
    apply_lmfuse(model)
    assert "model.extra" in model.lmfuse_patches["layer_norm"]
    x = torch.randn(3, 8)
    model.model.extra(x)
    assert op_calls == [8]
    op_calls.clear()
    with torch.autocast("cpu", dtype=BF16):
        model.model.extra(x)
    assert op_calls == []
