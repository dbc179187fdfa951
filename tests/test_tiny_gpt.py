"""``lmfuse.tiny_gpt``, the model ``lmfuse demo`` and ``examples/`` share: its weights viewed
as a transformers Llama (``as_llama``) are its own tensors and compute its logits, its plain
twin computes the fused model's loss and gradients, and what it cannot build it refuses."""

from __future__ import annotations

import pytest
import torch

from lmfuse.tiny_gpt import PLAIN_MLP, ModelConfig, TinyGPT, as_llama


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "lmfuse"])
def test_as_llama_views_the_weights_and_computes_the_same_logits(fused):
    """Every Llama parameter is a view of a TinyGPT tensor (q/k/v row blocks of the fused
    QKV weight, gate/up halves of fc1), all of TinyGPT's numbers and no others; the logits
    agree on random weights (norm weights too, so a misplaced norm would show)."""
    cfg = ModelConfig(d_model=32, n_heads=2, n_layers=2, ffn=64)
    torch.manual_seed(3)
    model = TinyGPT(cfg, fused=fused, impl="torch")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if p.dim() == 1
                    else torch.randn_like(p) * p.shape[-1] ** -0.5)
    llama = as_llama(model, 64)
    d, f = cfg.d_model, cfg.ffn
    pairs = [(llama.model.embed_tokens.weight, model.embed.weight),
             (llama.model.norm.weight, model.final_norm.weight),
             (llama.lm_head.weight, model.head.weight)]
    for theirs, ours in zip(llama.model.layers, model.layers):
        qkv, fc1 = ours.attn.qkv.weight, ours.mlp.fc1.weight
        pairs += [(theirs.input_layernorm.weight, ours.attn.input_norm_weight),
                  (theirs.self_attn.q_proj.weight, qkv[:d]),
                  (theirs.self_attn.k_proj.weight, qkv[d:2 * d]),
                  (theirs.self_attn.v_proj.weight, qkv[2 * d:]),
                  (theirs.self_attn.o_proj.weight, ours.attn.out.weight),
                  (theirs.post_attention_layernorm.weight, ours.mlp_norm.weight),
                  (theirs.mlp.gate_proj.weight, fc1[:f]),
                  (theirs.mlp.up_proj.weight, fc1[f:]),
                  (theirs.mlp.down_proj.weight, ours.mlp.fc2.weight)]
    for got, want in pairs:
        assert got.data_ptr() == want.data_ptr() and got.shape == want.shape
    assert len(pairs) == len(list(llama.parameters()))
    assert sum(p.numel() for p in llama.parameters()) == sum(
        p.numel() for p in model.parameters())

    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model.logits(tokens)
        got = llama(tokens).logits
        err = float((got - want).abs().max() / want.abs().max())
        assert err < 1e-6, err
        model.head.weight.mul_(0.5)  # a change to TinyGPT's weights is the Llama model's
        assert torch.allclose(llama(tokens).logits, want * 0.5, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", sorted(PLAIN_MLP))
def test_plain_twin_computes_the_fused_models_loss(activation):
    """TinyGPT: for every activation its plain twin
    has, fed the fused model's weights, it gives the fused model's loss and gradients, z-loss
    and label smoothing included, against both fused losses."""
    cfg = ModelConfig(d_model=32, n_heads=2, n_layers=2, ffn=48, activation=activation)
    torch.manual_seed(0)
    fused = TinyGPT(cfg, impl="torch")
    plain = TinyGPT(cfg, fused=False)
    plain.load_state_dict(fused.state_dict())
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    opts = dict(z_loss=1e-2, label_smoothing=0.1)
    want = plain.loss(tokens, tokens.roll(-1, 1), **opts)
    want.backward()
    for materialise in (False, True):
        fused.zero_grad()
        got = fused.loss(tokens, tokens.roll(-1, 1), materialise_logits=materialise, **opts)
        got.backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert plain.loss(tokens, tokens, z_loss=1e-2) > plain.loss(tokens, tokens)


def test_tiny_gpt_refuses_what_it_cannot_build():
    with pytest.raises(ValueError, match=r"d_model \(10\) must be n_heads \(4\) times an "
                       "even head_dim"):
        TinyGPT(ModelConfig(d_model=10, n_heads=4))
    with pytest.raises(ValueError, match=r"activation must be one of swiglu, .* in the plain "
                       r"model \(fused=False\), got 'relu'"):
        TinyGPT(ModelConfig(activation="relu"), fused=False)
    with pytest.raises(ValueError, match="activation must be one of"):
        TinyGPT(ModelConfig(activation="relu"))  # FusedMLP's own check
    with pytest.raises(ValueError, match="as_llama: Llama's MLP is SwiGLU; this model's "
                       "activation is 'gelu'"):
        as_llama(TinyGPT(ModelConfig(activation="gelu"), impl="torch"), 64)


@pytest.mark.parametrize("bad", [dict(n_heads=0), dict(n_heads=-4), dict(n_layers=0),
                                 dict(n_layers=-1), dict(ffn=0), dict(d_model=64.0)])
def test_sizes_are_checked_by_name(bad: dict) -> None:
    """A ZeroDivisionError, a model of 0 layers, a negative head count that failed only in
    the loss, a TypeError from torch.empty: each now a ValueError naming the field."""
    from lmfuse.tiny_gpt import ModelConfig, TinyGPT

    (name, value), = bad.items()
    with pytest.raises(ValueError, match=rf"TinyGPT: {name} must be an integer >= 1, got"):
        TinyGPT(ModelConfig(**bad))


def test_plain_twin_averages_the_z_loss_over_counted_tokens() -> None:
    """Ignored targets (-100) count in neither model's z-loss mean (the plain twin averaged
    over every token: 9.170 against the fused 9.174 in the audit's case)."""
    from lmfuse.tiny_gpt import ModelConfig, TinyGPT

    torch.manual_seed(0)
    fused = TinyGPT(ModelConfig(), impl="torch")
    plain = TinyGPT(ModelConfig(), fused=False)
    plain.load_state_dict(fused.state_dict())
    x, y = torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8))
    y[:, -3:] = -100
    for z in (0.0, 0.1):
        a, b = fused.loss(x, y, z_loss=z), plain.loss(x, y, z_loss=z)
        assert torch.allclose(a, b, rtol=1e-5), (z, a, b)
