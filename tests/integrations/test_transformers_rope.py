"""``apply_lmfuse``'s rotary patch (``rope=True``) on tiny random-config models.

Llama and Qwen3 (whose attention forwards call their modeling module's rotate-half
``apply_rotary_pos_emb``, wrapped by ``deprecate_kwarg``): in float32 the patched model's
loss and every gradient equal the unpatched model's (tolerances from ``helpers.py``), each
attention layer's rotary runs ``lmfuse.apply_rotary_pos_emb``'s Triton kernel in the CPU
interpreter (the suite's ``TRITON_INTERPRET=1``), and another model of the same class in
the process keeps its own. GLM-4's interleaved partial rotary fails the probe and is left
as it is.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_close, labelled_ids

import lmfuse.integrations.transformers as lt
from lmfuse.integrations.transformers import apply_lmfuse, fused_norms_and_mlps

transformers = pytest.importorskip("transformers")

F32 = torch.float32
VOCAB = 160
TINY = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "vocab_size": VOCAB, "max_position_embeddings": 64, "initializer_range": 0.1,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
ATTENTION = {"llama": "LlamaAttention", "qwen3": "Qwen3Attention", "glm4": "Glm4Attention",
             "olmo2": "Olmo2Attention"}


def make_model(model_type: str):
    config = transformers.AutoConfig.for_model(model_type, **TINY)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(F32).train()


def batch():
    return labelled_ids(VOCAB)


def attention_names(model, model_type: str) -> list[str]:
    return [n for n, m in model.named_modules() if type(m).__name__ == ATTENTION[model_type]]


@pytest.fixture
def rope_calls(monkeypatch):
    """The q shapes of the lmfuse.apply_rotary_pos_emb calls of the patched attentions, and
    the path each took (its Triton kernel in the interpreter)."""
    from lmfuse.rope import ops

    calls = []
    real, launch = lt._rotary, ops.launch_rotary

    def counted(q, *args, **kwargs):
        calls.append(tuple(q.shape))
        return real(q, *args, **kwargs)

    def launched(*args, **kwargs):
        calls.append("kernel")
        return launch(*args, **kwargs)

    monkeypatch.setattr(lt, "_rotary", counted)
    monkeypatch.setattr(ops, "launch_rotary", launched)
    return calls


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_rope_matches_unpatched_loss_and_grads(model_type, rope_calls):
    a = make_model(model_type)
    b = apply_lmfuse(copy.deepcopy(a), rms_norm=False, layer_norm=False, swiglu=False,
                     fused_linear_cross_entropy=False)
    names = attention_names(a, model_type)
    assert len(names) == 2 and b.lmfuse_patches["rope"] == names
    ids, labels = batch()
    want = a(input_ids=ids, labels=labels).loss
    want.backward()
    assert rope_calls == []
    got = b(input_ids=ids, labels=labels).loss
    assert rope_calls == [(2, 4, 7, 8), "kernel"] * 2  # [B, H, S, D], one launch a layer
    got.backward()
    assert rope_calls.count("kernel") == 4  # and one a layer for the backward
    assert_close(got, want, F32, "loss")
    grads = dict(a.named_parameters())
    for name, p in b.named_parameters():
        assert_close(p.grad, grads[name].grad, F32, f"grad of {name}")
    # a second model of the class, made after the patch, runs the model's own rotary
    rope_calls.clear()
    other = make_model(model_type)
    assert not any("forward" in m.__dict__ for m in other.modules())
    other(input_ids=ids, labels=labels)
    assert rope_calls == []
    # and with every other patch on, the loss is still the unpatched one
    c = apply_lmfuse(copy.deepcopy(a))
    assert c.lmfuse_patches["rope"] == names
    assert_close(c(input_ids=ids, labels=labels).loss, want, F32, "loss, all patches")


def test_the_probe_finds_what_a_dtype_mix_gives():
    """bf16 q and k with float32 tables (autocast's mix): Llama's function promotes
    (float32 out), OLMo 2's casts back to q's and k's dtypes, and the patched rotary gives
    what each gives; a function that refuses a mix keeps it (the model's own runs)."""
    from transformers.models.llama import modeling_llama
    from transformers.models.olmo2 import modeling_olmo2

    def refuses_mixes(q, k, cos, sin, unsqueeze_dim=1):
        if q.dtype != cos.dtype:
            raise RuntimeError("one dtype, please")
        return modeling_llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g)
    cos, sin = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    qb, kb = q.bfloat16(), k.bfloat16()
    for own, rule, dtype in ((modeling_llama.apply_rotary_pos_emb, "promote", F32),
                             (modeling_olmo2.apply_rotary_pos_emb, "cast back", torch.bfloat16)):
        assert lt._probe_rotary(own) == rule
        for got, want in zip(lt._rotary_for(own, "triton")(qb, kb, cos, sin),
                             own(qb, kb, cos, sin)):
            assert got.dtype == want.dtype == dtype
            assert_close(got, want, dtype, rule)
    assert lt._probe_rotary(refuses_mixes) == "unknown"
    ours = lt._rotary_for(refuses_mixes, "triton")
    assert [t.dtype for t in ours(q, k, cos, sin)] == [F32, F32]  # (one dtype: lmfuse's)
    with pytest.raises(RuntimeError, match="one dtype"):
        ours(qb, kb, cos, sin)  # (a mix: the model's own, and its error)


@pytest.mark.parametrize("model_type, keys", [("llama", F32), ("olmo2", torch.bfloat16)])
def test_rope_under_autocast_runs_lmfuses_rotary(model_type, keys, rope_calls):
    """A float32 model under bf16 autocast (q and k bf16 out of the projections, the
    rotary embedding's tables float32): lmfuse's kernel runs and gives the dtypes the
    model's function gives (Llama's promotes to float32, OLMo 2's casts back to bf16: the
    keys a cache holds), and the loss and gradients are the unpatched model's within bf16's
    tolerance (the model's formula rounds q * cos and its rotated half in float32 too)."""
    a = make_model(model_type)
    b = apply_lmfuse(copy.deepcopy(a), rms_norm=False, layer_norm=False, swiglu=False,
                     fused_linear_cross_entropy=False)
    assert b.lmfuse_patches["rope"] == attention_names(a, model_type)
    ids, labels = batch()
    with torch.autocast("cpu", torch.bfloat16):
        want = a(input_ids=ids, labels=labels).loss
        got = b(input_ids=ids, labels=labels).loss
    want.backward()
    got.backward()
    assert rope_calls == [(2, 4, 7, 8), "kernel"] * 2 + ["kernel"] * 2
    assert_close(got, want, torch.bfloat16, "loss under autocast")
    grads = dict(a.named_parameters())
    for name, p in b.named_parameters():
        assert_close(p.grad, grads[name].grad, torch.bfloat16, f"grad of {name}")
    with torch.autocast("cpu", torch.bfloat16), torch.no_grad():
        caches = [m(input_ids=ids, use_cache=True).past_key_values for m in (a, b)]
    assert [c.layers[0].keys.dtype for c in caches] == [keys] * 2


def test_rope_false_leaves_them_and_the_flag_is_checked(rope_calls):
    a = make_model("llama")
    b = apply_lmfuse(copy.deepcopy(a), rope=False)
    assert b.lmfuse_patches["rope"] == []
    assert b.lmfuse_patches["rms_norm"] and b.lmfuse_patches["swiglu"]
    assert not any("forward" in b.get_submodule(n).__dict__
                   for n in attention_names(b, "llama"))
    ids, labels = batch()
    b(input_ids=ids, labels=labels)
    assert rope_calls == []
    with pytest.raises(TypeError, match="rope must be a bool"):
        apply_lmfuse(b, rope=1)


def test_an_interleaved_rotary_is_left_as_it_is(rope_calls):
    """GLM-4's rotary rotates interleaved pairs of a partial head: the probe of its module's
    function finds another formula, and its attentions stay the model's."""
    a = make_model("glm4")
    b = apply_lmfuse(copy.deepcopy(a))
    assert b.lmfuse_patches["rope"] == []
    assert b.lmfuse_patches["rms_norm"]  # (the rest of the patch still applies)
    assert not any("forward" in b.get_submodule(n).__dict__
                   for n in attention_names(b, "glm4"))
    ids, labels = batch()
    assert_close(b(input_ids=ids, labels=labels).loss, a(input_ids=ids, labels=labels).loss,
                 F32, "loss")
    assert rope_calls == []


def test_the_patched_forward_keeps_the_decorators_and_the_signature():
    """The re-bound forward is the class's own decorated one (``deprecate_kwarg`` still maps
    ``past_key_values`` to ``cache``), with the class's signature; the patch deep-copies."""
    import inspect

    a = apply_lmfuse(make_model("llama"))
    attn = a.model.layers[0].self_attn
    cls = type(attn)
    assert inspect.signature(attn.forward) == inspect.signature(cls.forward.__get__(attn))
    rebound = lt._rebound_forward(cls.forward, "auto")
    assert rebound is not cls.forward and rebound.__code__ is cls.forward.__code__
    assert rebound.__wrapped__.__globals__["apply_rotary_pos_emb"] is not (
        cls.forward.__wrapped__.__globals__["apply_rotary_pos_emb"])
    assert cls.forward.__wrapped__.__globals__["apply_rotary_pos_emb"] is (
        transformers.models.llama.modeling_llama.apply_rotary_pos_emb)
    copied = copy.deepcopy(a).model.layers[0].self_attn
    assert copied.forward.module is copied and copied.forward.fn is attn.forward.fn


def test_fused_norms_and_mlps_fuses_the_rotary_and_restores_the_model(rope_calls):
    """The Generator's graph-capture patch: inside the block every attention's rotary runs
    lmfuse's, one token too; afterwards each module is as before (plain, or apply_lmfuse's
    patch with its own fallback: one token runs the class's forward)."""
    a = make_model("llama").eval()
    plain = copy.deepcopy(a)
    patched = apply_lmfuse(copy.deepcopy(a), inference_fallback_tokens=4)
    names = attention_names(a, "llama")
    ids = torch.randint(3, VOCAB, (1, 1))
    with torch.no_grad():
        want = a(input_ids=ids).logits
        for model in (plain, patched):
            before = {n: dict(model.get_submodule(n).__dict__) for n in names}
            with fused_norms_and_mlps(model) as supported:
                assert supported
                rope_calls.clear()
                assert_close(model(input_ids=ids).logits, want, F32, "inside the block")
                assert rope_calls == [(1, 4, 1, 8), "kernel"] * 2
            for n in names:
                after = model.get_submodule(n).__dict__
                assert after.keys() == before[n].keys(), n
                for k in ("forward", "_lmfuse_fallback_tokens", "_lmfuse_impl"):
                    assert after.get(k) is before[n].get(k), (n, k)
            rope_calls.clear()
            model(input_ids=ids)
            assert rope_calls == []  # one token, autograd off: the class's own forward
    assert not any("forward" in plain.get_submodule(n).__dict__ for n in names)


def test_calls_of_other_forms(rope_calls):
    """Pixtral's ``[S, R]`` tables with ``unsqueeze_dim=0`` run lmfuse's (heads at dim 1),
    and so do bf16 q and k with float32 tables (autocast's mix: float32 out, as the model's
    formula promotes it); float64 tables and a 2-D table with ``unsqueeze_dim=1`` (which the
    model's function broadcasts otherwise) run the model's function."""
    from transformers.models.pixtral import modeling_pixtral

    own = modeling_pixtral.apply_rotary_pos_emb
    assert lt._probe_rotary(own)
    ours = lt._rotary_for(own, "auto")
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 6, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g)
    cos, sin = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    for got, want in zip(ours(q, k, cos, sin, 0), own(q, k, cos, sin, 0)):
        assert_close(got, want, F32, "[S, R] tables")
    assert rope_calls == [(1, 2, 6, 8), "kernel"]
    rope_calls.clear()
    qb, kb = q.bfloat16(), k.bfloat16()
    for got, want in zip(ours(qb, kb, cos, sin, 0), own(qb, kb, cos, sin, 0)):
        assert got.dtype == want.dtype == F32
        assert_close(got, want, F32, "bf16 q and k, float32 tables")
    assert rope_calls == [(1, 2, 6, 8), "kernel"]
    rope_calls.clear()
    cos3, sin3 = cos[None].double(), sin[None].double()
    for got, want in zip(ours(q, k, cos3, sin3), own(q, k, cos3, sin3)):
        assert got.dtype == want.dtype == torch.float64
    q6 = torch.randn(1, 6, 6, 8, generator=g)
    for got, want in zip(ours(q6, q6, cos, sin), own(q6, q6, cos, sin)):
        assert torch.equal(got, want)
    assert rope_calls == []


def test_a_patched_model_compiles_with_lmfuses_rotary():
    """torch.compile(fullgraph=True) of the patched training step: one graph holding
    lmfuse's rotary op (its globals are the re-bound forward's, not the modeling module's,
    which compile would otherwise read), the loss and gradients as eager's."""
    a = make_model("llama")
    b = apply_lmfuse(copy.deepcopy(a), fused_linear_cross_entropy=False)
    ids, labels = batch()
    want = a(input_ids=ids, labels=labels).loss
    want.backward()
    targets = []

    def backend(gm, example_inputs):  # (the autograd functions' bodies are subgraphs)
        targets.extend(str(n.target) for sub in gm.modules() if hasattr(sub, "graph")
                       for n in sub.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    try:
        loss = torch.compile(b, backend=backend, fullgraph=True)(input_ids=ids,
                                                                 labels=labels).loss
        loss.backward()
    finally:
        torch._dynamo.reset()
    assert sum(t == "lmfuse.rotary.default" for t in targets) == 4  # two layers, fwd + bwd
    assert_close(loss, want, F32, "compiled loss")
    grads = dict(a.named_parameters())
    for name, p in b.named_parameters():
        assert_close(p.grad, grads[name].grad, F32, f"compiled grad of {name}")


def test_an_unpickled_model_compiles_with_lmfuses_rotary(monkeypatch):
    """A patched model unpickled where its re-bound forwards were never built (a new
    process: the cache emptied here) builds them as it is loaded, so torch.compile traces
    one graph with lmfuse's rotary; were they missing in a traced call, the model's own
    rotary would run (one graph still), not a build compile cannot trace."""
    import pickle

    b = apply_lmfuse(make_model("llama"), fused_linear_cross_entropy=False)
    blob = pickle.dumps(b)
    ids, labels = batch()
    want = b(input_ids=ids, labels=labels).loss.detach()
    for warm in (True, False):
        monkeypatch.setattr(lt, "_REBOUND", {})
        loaded = pickle.loads(blob)
        if not warm:
            lt._REBOUND.clear()
        targets = []

        def backend(gm, example_inputs):
            targets.extend(str(n.target) for sub in gm.modules() if hasattr(sub, "graph")
                           for n in sub.graph.nodes)
            return gm.forward

        torch._dynamo.reset()
        try:
            loss = torch.compile(loaded, backend=backend, fullgraph=True)(
                input_ids=ids, labels=labels).loss
        finally:
            torch._dynamo.reset()
        assert (sum(t == "lmfuse.rotary.default" for t in targets) == 4) == warm, warm
        assert_close(loss.detach(), want, F32, f"unpickled loss (warm {warm})")


def test_each_patch_takes_the_modules_globals_as_they_are(monkeypatch):
    """A model patched after the modeling module changed (here its attention function
    wrapped) runs the changed module's code, as the unpatched model does."""
    from transformers.models.llama import modeling_llama

    apply_lmfuse(make_model("llama"))
    calls = []
    real = modeling_llama.eager_attention_forward

    def wrapped(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(modeling_llama, "eager_attention_forward", wrapped)
    ids, _ = batch()
    make_model("llama")(input_ids=ids)
    unpatched = len(calls)
    calls.clear()
    apply_lmfuse(make_model("llama"))(input_ids=ids)
    assert unpatched == 2 and len(calls) == unpatched


def test_a_class_forward_replaced_after_the_patch_runs_as_it_is(monkeypatch, rope_calls):
    """Another library's forward assigned to the class after apply_lmfuse, calling a rotary
    of its own under the same global name (never probed: here one that scales instead of
    rotating), runs as it is: lmfuse's rotary is not put into it, and the patched model
    computes what the unpatched one now does."""
    import inspect
    import types

    from transformers.models.llama import modeling_llama

    a = make_model("llama")
    b = apply_lmfuse(copy.deepcopy(a), rms_norm=False, layer_norm=False, swiglu=False,
                     fused_linear_cross_entropy=False)
    inner = inspect.unwrap(modeling_llama.LlamaAttention.forward)

    def other_rotary(q, k, cos, sin, unsqueeze_dim=1):
        return q * 2.0, k * 0.5

    replaced = types.FunctionType(inner.__code__, {**inner.__globals__,
                                                   "apply_rotary_pos_emb": other_rotary},
                                  inner.__name__, inner.__defaults__, inner.__closure__)
    replaced.__kwdefaults__ = inner.__kwdefaults__
    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", replaced)
    ids, _ = batch()
    rope_calls.clear()
    got = b(input_ids=ids).logits
    assert rope_calls == [] and torch.equal(got, a(input_ids=ids).logits)
