"""``lmfuse.serving.Generator`` against ``model.generate`` on tiny random-weight models of
every supported family, float32 on the CPU, both kernel paths (Triton's interpreter and
the reference): greedy tokens must be identical, for batches of prompts of different
lengths, with shared prefixes, requests added mid-run, preemption forced by a small pool;
an fp8 cache's logits within a stated tolerance of a float32 cache's; seeded sampling
repeatable and top-k / top-p respected; bad input refused with nothing changed."""

from __future__ import annotations

import pytest
import torch
from helpers import (TINY_LM, TINY_LM_FAMILIES, TINY_MOE_LM_FAMILIES, hf_greedy, max_rel_err,
                     tiny_causal_lm)

from lmfuse.serving import Generator
from lmfuse.serving import engine as engine_module

# Prompts of different lengths: longer than the tiny models' window (6), several blocks of
# 4, one a single token.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3], list(range(20, 40)), [90, 2, 2, 2, 41]]
NEW = 8

_models: dict[str, object] = {}
_wants: dict[tuple[str, tuple[int, ...], int], list[int]] = {}


def model_of(family: str):
    if family not in _models:
        _models[family] = tiny_causal_lm(family)
    return _models[family]


def want(family: str, prompt: list[int], n: int = NEW) -> list[int]:
    key = (family, tuple(prompt), n)
    if key not in _wants:
        _wants[key] = hf_greedy(model_of(family), prompt, n)
    return _wants[key]


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("family", TINY_LM_FAMILIES)
def test_greedy_tokens_equal_hf_generate(family: str, impl: str) -> None:
    """Every family (Llama 3 rope scaling, Qwen3 qk-norm, Gemma (1 + w) norms and scaled
    embeddings, sliding windows, Gemma 2 attention and final soft-caps, GPT-OSS sinks,
    yarn rope and experts), a batch of four prompts of different lengths."""
    gen = Generator(model_of(family), block_len=4, num_blocks=64, impl=impl)
    got = gen.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[])
    assert got == [want(family, p) for p in PROMPTS]
    assert not gen.has_unfinished() and gen.cache.num_free_blocks == 64


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("family", TINY_MOE_LM_FAMILIES)
def test_greedy_tokens_of_the_moe_families_equal_hf_generate(family: str, impl: str) -> None:
    """Mixtral (with its sliding window), Qwen2-MoE (shared expert), Qwen3-MoE, OLMoE and
    Granite-MoE (its embedding, residual, attention and logit scalings): the model's own
    forward over the paged cache."""
    gen = Generator(model_of(family), block_len=4, num_blocks=64, impl=impl)
    assert gen.runner.decode_path == "model"
    got = gen.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[])
    assert got == [want(family, p) for p in PROMPTS]


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_shared_prefixes_share_blocks_and_give_the_same_tokens(impl: str) -> None:
    """Prompts sharing 9 and 13 tokens with a running one reuse its full blocks (block_len
    4: 2 and 3 blocks) and compute only the rest; the tokens do not change."""
    family = "qwen3"
    base = list(range(10, 27))
    prompts = [base, base[:9] + [70, 71, 72], base[:13] + [3, 4], base[:3] + [80]]
    gen = Generator(model_of(family), block_len=4, num_blocks=64, impl=impl)
    first = gen.add_request(prompts[0], max_new_tokens=NEW, eos_token_id=[])
    results = {first: []}
    for rid, toks, _ in gen.step():  # prefill the first prompt alone
        results[rid] += toks
    for p in prompts[1:]:
        results[gen.add_request(p, max_new_tokens=NEW, eos_token_id=[])] = []
    while gen.has_unfinished():
        for rid, toks, _ in gen.step():
            results[rid] += toks
    assert gen.scheduler.shared_tokens == 8 + 12  # base[:3] shares no full block
    assert [results[r] for r in sorted(results)] == [want(family, p) for p in prompts]
    assert gen.cache.num_free_blocks == 64


def test_requests_added_mid_run_join_the_batch() -> None:
    family = "llama"
    gen = Generator(model_of(family), block_len=4, num_blocks=64, impl="torch")
    results: dict[int, list[int]] = {}
    pending = list(PROMPTS)
    steps = 0
    while pending or gen.has_unfinished():
        if pending and steps % 3 == 0:  # a new request every third step
            results[gen.add_request(pending.pop(0), max_new_tokens=NEW,
                                    eos_token_id=[])] = []
        for rid, toks, finished in gen.step():
            results[rid] += toks
            assert finished == (len(results[rid]) == NEW)
        steps += 1
    assert [results[r] for r in sorted(results)] == [want(family, p) for p in PROMPTS]
    assert steps < len(PROMPTS) * (NEW + 1)  # they overlapped


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_preemption_in_a_small_pool_keeps_the_tokens(impl: str) -> None:
    """A pool of 12 blocks of 4 tokens cannot hold the four requests at full length (each
    up to 7 blocks): requests are preempted, recomputed, and still give HF's tokens; no
    KVCacheFullError reaches the caller."""
    family = "gemma2"
    prompts = [list(range(1, 13)), list(range(30, 41)), list(range(50, 60)), [7, 8, 9]]
    gen = Generator(model_of(family), block_len=4, num_blocks=12, impl=impl)
    got = gen.generate(prompts, max_new_tokens=14, eos_token_id=[])
    assert gen.scheduler.preemptions > 0
    assert got == [want(family, p, 14) for p in prompts]


@pytest.mark.parametrize("family,impl", [("llama", "triton"), ("mistral", "triton"),
                                         ("llama", "torch"), ("gemma2", "torch")])
def test_long_prompts_prefilled_in_chunks_keep_the_tokens(family: str, impl: str) -> None:
    """``max_prefill_tokens=5``: the 7- and 20-token prompts are prefilled in chunks of 5
    (each over the cache its earlier chunks wrote; mistral and gemma2 with windows of 6
    keys), a decode step of the running requests between two chunks; HF's tokens."""
    gen = Generator(model_of(family), block_len=4, num_blocks=64, impl=impl,
                    max_prefill_tokens=5)
    chunks = []
    prefill = gen.runner.prefill

    def recording(requests, new, *args, **kwargs):
        chunks.append([len(t) for t in new])
        return prefill(requests, new, *args, **kwargs)

    gen.runner.prefill = recording
    got = gen.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[])
    assert got == [want(family, p) for p in PROMPTS]
    # 7 = 5 + 2; then the 1-token prompt (the 20-token one over the budget left); 20 in
    # four chunks; then the 5-token prompt
    assert chunks == [[5], [2], [1], [5], [5], [5], [5], [5]]
    assert gen.stats["prefill_steps"] == 8 and not gen.has_unfinished()
    assert gen.cache.num_free_blocks == gen.cache.num_blocks


def test_eos_stops_a_request_and_is_included() -> None:
    family = "mistral"
    full = want(family, PROMPTS[2])
    eos = full[3]
    stop = full.index(eos)
    gen = Generator(model_of(family), block_len=4, num_blocks=64, impl="torch")
    got = gen.generate([PROMPTS[2], PROMPTS[0]], max_new_tokens=NEW, eos_token_id=eos)
    assert got[0] == full[:stop + 1]
    other = want(family, PROMPTS[0])
    assert got[1] == (other[:other.index(eos) + 1] if eos in other else other)


def _capture_logits(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    real = engine_module.sample

    def spy(logits, params, counters, histories=None):
        seen.append(logits.detach().float().clone())
        return real(logits, params, counters, histories)

    monkeypatch.setattr(engine_module, "sample", spy)
    return seen


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_fp8_cache_logits_close_to_the_float32_cache(monkeypatch: pytest.MonkeyPatch,
                                                     impl: str) -> None:
    """An e4m3 cache (per-layer, per-head scales from the first prefill) against a float32
    cache on the same tokens (teacher-forced: the fp8 run is fed the float32 run's
    tokens): every decode step's logits within 5% (max relative error over the logits);
    e4m3 keeps 3 mantissa bits, about 6% relative error per element, averaged down by the
    attention sums. The prefill attends over the cache too where the fused layers run it
    (llama: a row per prompt token over the paged blocks), so its logits are held to the
    same bound."""
    model = model_of("llama")
    steps: list[tuple[torch.Tensor, torch.Tensor]] = []
    forced: list[torch.Tensor] = []
    real = engine_module.sample

    def spy(logits, params, counters, histories=None):
        tokens = real(logits, params, counters, histories) if not forced else forced.pop(0)
        steps.append((logits.detach().float().clone(), tokens))
        return tokens

    monkeypatch.setattr(engine_module, "sample", spy)
    gen = Generator(model, block_len=4, num_blocks=64, impl=impl)
    gen.lookahead = False  # every step's logits through sample (no step run ahead)
    gen.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[])
    reference = list(steps)
    steps.clear()
    forced.extend(t for _, t in reference)
    fp8 = Generator(model, block_len=4, num_blocks=64, impl=impl, kv_dtype="fp8")
    fp8.lookahead = False
    fp8.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[])
    assert fp8.cache.dtype == torch.float8_e4m3fn
    assert any(float((s - 1).abs().max()) > 0 for s in fp8.cache.k_scales), "not calibrated"
    assert len(steps) == len(reference) == NEW
    errors = [max_rel_err(a, b) for (a, _), (b, _) in zip(steps, reference)]
    assert 0 < max(errors) < 0.05, errors


def test_seeded_sampling_repeats_and_respects_top_k_and_top_p(
        monkeypatch: pytest.MonkeyPatch) -> None:
    family = "qwen2"
    model = model_of(family)
    kw = dict(max_new_tokens=NEW, temperature=1.5, eos_token_id=[], seed=1234)
    a = Generator(model, block_len=4, num_blocks=64, impl="torch").generate(PROMPTS, **kw)
    b = Generator(model, block_len=4, num_blocks=64, impl="torch").generate(PROMPTS, **kw)
    c = Generator(model, block_len=4, num_blocks=64, impl="torch").generate(
        PROMPTS, **{**kw, "seed": 99})
    assert a == b and a != c
    greedy = [want(family, p) for p in PROMPTS]
    assert a != greedy  # temperature 1.5 over 97 tokens: not the greedy path
    # top_k=1 and a tiny top_p leave only the best token: greedy.
    for opts in ({"top_k": 1}, {"top_p": 1e-6}):
        got = Generator(model, block_len=4, num_blocks=64, impl="torch").generate(
            PROMPTS, **kw, **opts)
        assert got == greedy, opts
    # top_k=3: every drawn token is among its row's 3 highest logits.
    seen = _capture_logits(monkeypatch)
    gen = Generator(model, block_len=4, num_blocks=64, impl="torch")
    rid = gen.add_request(PROMPTS[2], max_new_tokens=12, temperature=5.0, top_k=3,
                          eos_token_id=[], seed=5)
    drawn = []
    while gen.has_unfinished():
        drawn += [t for r, toks, _ in gen.step() if r == rid for t in toks]
    assert len(drawn) == 12 and len(set(drawn)) > 1
    for logits, tok in zip(seen, drawn):
        assert tok in torch.topk(logits[0], 3).indices.tolist()


def test_sampled_tokens_do_not_depend_on_the_batch() -> None:
    """A request's draws depend on its seed and token index only: alone, or in a batch
    with others (another order, other seeds), it samples the same tokens."""
    model = model_of("llama")
    kw = dict(max_new_tokens=NEW, temperature=1.0, eos_token_id=[])
    alone = Generator(model, block_len=4, num_blocks=64, impl="torch")
    rid = alone.add_request(PROMPTS[2], seed=7, **kw)
    solo = []
    while alone.has_unfinished():
        solo += [t for r, toks, _ in alone.step() if r == rid for t in toks]
    crowd = Generator(model, block_len=4, num_blocks=64, impl="torch")
    others = [crowd.add_request(p, seed=100 + i, **kw) for i, p in enumerate(PROMPTS[:2])]
    rid = crowd.add_request(PROMPTS[2], seed=7, **kw)
    mine = []
    while crowd.has_unfinished():
        mine += [t for r, toks, _ in crowd.step() if r == rid for t in toks]
    assert mine == solo and len(others) == 2


# --- bad input ---------------------------------------------------------------------------


def test_unsupported_models_are_refused() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="model type 'gpt2'.*not supported"):
        Generator(gpt2)
    with pytest.raises(TypeError, match="model must be a loaded transformers causal LM"):
        Generator(torch.nn.Linear(2, 2))
    from transformers import AutoModel

    base = AutoModel.from_config(model_of("llama").config)  # no LM head
    with pytest.raises(ValueError, match="LlamaModel is not a causal LM"):
        Generator(base, num_blocks=8)
    with pytest.raises(TypeError, match="model's dtype must be float32, float16 or bfloat16.*"
                                        "float64"):
        Generator(tiny_causal_lm("llama").double(), num_blocks=8)


def test_longrope_serves_up_to_its_original_length() -> None:
    """transformers picks a longrope rotary's short or long factors by the largest position
    in a whole forward: past ``original_max_position_embeddings`` a short prompt batched
    with a long one would be rotated with the long factors (its tokens then depend on its
    neighbours). Within that length every request gets model.generate's tokens, alone or
    batched; a request that could pass it is refused, naming the limit."""
    half = TINY_LM["head_dim"] // 2
    model = tiny_causal_lm("llama", rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * half,
        "long_factor": [16.0] * half, "original_max_position_embeddings": 24})
    short, other = [3, 49, 55, 77], list(range(30, 42))
    gen = Generator(model, block_len=4, num_blocks=64, impl="torch")
    assert gen.generate([short, other], max_new_tokens=6, eos_token_id=[]) == [
        hf_greedy(model, short, 6), hf_greedy(model, other, 6)]
    with pytest.raises(ValueError, match=r"prompts\[1\] of 20 tokens plus max_new_tokens=6 "
                                         r"passes the longrope rotary's original_max_"
                                         r"position_embeddings \(24\)"):
        gen.generate([short, list(range(20))], max_new_tokens=6, eos_token_id=[])
    assert not gen.has_unfinished() and gen.cache.num_free_blocks == 64


def test_bidirectional_gemma3_is_refused() -> None:
    # (EmbeddingGemma-style: transformers' Gemma 3 prefill then attends both ways.)
    model = tiny_causal_lm("gemma3_text", use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="use_bidirectional_attention=True"):
        Generator(model, num_blocks=8)


def test_a_failed_generate_leaves_the_generator_usable(monkeypatch) -> None:
    """An error (or ^C) inside generate() takes its own requests with it: the caller never
    saw their ids, and the next generate() must not find the Generator busy. A closed
    Generator refuses new requests, not only steps."""
    gen = Generator(model_of("llama"), block_len=4, num_blocks=32, impl="torch")
    real = gen.runner.prefill

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(gen.runner, "prefill", boom)
    with pytest.raises(KeyboardInterrupt):
        gen.generate(PROMPTS[:2], max_new_tokens=3)
    assert not gen.has_unfinished() and gen.cache.num_free_blocks == 32
    monkeypatch.setattr(gen.runner, "prefill", real)
    assert gen.generate([[5, 6]], max_new_tokens=2, eos_token_id=[]) == [
        want("llama", [5, 6], 2)]
    gen.close()
    with pytest.raises(RuntimeError, match="closed"):
        gen.add_request([1, 2], max_new_tokens=2)


def test_the_models_default_eos_is_named_as_such_when_it_is_bad() -> None:
    model = tiny_causal_lm("llama")
    model.generation_config.eos_token_id = 500
    gen = Generator(model, block_len=4, num_blocks=16, impl="torch")
    with pytest.raises(ValueError, match=r"\[500\] outside .*generation_config.eos_token_id"):
        gen.generate([[1, 2]], max_new_tokens=2)
    assert gen.generate([[5, 6]], max_new_tokens=2, eos_token_id=[]) == [
        want("llama", [5, 6], 2)]


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_the_models_repetition_penalty_gives_hf_generates_tokens(impl: str,
                                                                 penalty: float) -> None:
    """A checkpoint whose generation_config sets ``repetition_penalty`` (many instruct
    models ship one): HF's greedy search applies it, so the Generator does by default, on
    the prompt's and the output's tokens, through preemption and recomputation too; an
    explicit ``repetition_penalty=1.0`` turns it off."""
    model = tiny_causal_lm("llama")
    plain = [hf_greedy(model, p, 12) for p in PROMPTS]
    model.generation_config.repetition_penalty = penalty
    hf = [hf_greedy(model, p, 12) for p in PROMPTS]
    assert hf != plain
    gen = Generator(model, block_len=4, num_blocks=64, impl=impl)
    assert gen.generate(PROMPTS, max_new_tokens=12, eos_token_id=[]) == hf
    assert gen.generate(PROMPTS, max_new_tokens=12, eos_token_id=[],
                        repetition_penalty=1.0) == plain
    small = Generator(model, block_len=4, num_blocks=10, impl=impl)
    assert small.generate(PROMPTS, max_new_tokens=12, eos_token_id=[]) == hf
    assert small.scheduler.preemptions > 0
    # a penalised request beside a plain one in the same decode steps
    mixed = Generator(model, block_len=4, num_blocks=64, impl=impl)
    rids = [mixed.add_request(PROMPTS[0], max_new_tokens=12, eos_token_id=[]),
            mixed.add_request(PROMPTS[2], max_new_tokens=12, eos_token_id=[],
                              repetition_penalty=1.0)]
    got: dict[int, list[int]] = {r: [] for r in rids}
    while mixed.has_unfinished():
        for rid, toks, _ in mixed.step():
            got[rid] += toks
    assert [got[r] for r in rids] == [hf[0], plain[2]]


def test_generation_config_settings_it_does_not_apply_are_named() -> None:
    model = tiny_causal_lm("llama")
    model.generation_config.no_repeat_ngram_size = 3
    model.generation_config.suppress_tokens = [4]
    with pytest.warns(UserWarning, match=r"sets no_repeat_ngram_size=3, suppress_tokens=\[4\], "
                                         "which the Generator does not apply"):
        Generator(model, block_len=4, num_blocks=16, impl="torch")
    model.generation_config.no_repeat_ngram_size = 0
    model.generation_config.suppress_tokens = None
    model.generation_config.repetition_penalty = -1.0
    gen = Generator(model, block_len=4, num_blocks=16, impl="torch")
    with pytest.raises(ValueError, match="generation_config.repetition_penalty"):
        gen.generate([[1, 2]], max_new_tokens=2)
    assert gen.generate([[5, 6]], max_new_tokens=2, eos_token_id=[],
                        repetition_penalty=1.0) == [want("llama", [5, 6], 2)]


def test_bfloat16_models_in_the_interpreter_decode_through_the_model() -> None:
    """Triton's interpreter has no bfloat16 tl.dot: a bfloat16 model there decodes through
    its own layers (lmfuse's attention), with HF's greedy tokens, and the fused layers are
    refused by name instead of giving wrong tokens."""
    model = tiny_causal_lm("llama").to(torch.bfloat16)
    gen = Generator(model, block_len=4, num_blocks=32)
    assert gen.runner.decode_path == "model"
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    assert gen.generate(prompts, max_new_tokens=4, eos_token_id=[]) == [
        hf_greedy(model, p, 4) for p in prompts]
    with pytest.raises(ValueError, match="decode_path='fused' cannot run a bfloat16 model"):
        Generator(model, block_len=4, num_blocks=32, decode_path="fused")


@pytest.mark.parametrize("prompt, kw, error, match", [
    ([], {}, ValueError, "is empty; a prompt needs at least one token"),
    ([1, 2, 97], {}, ValueError, r"token ids outside the vocabulary \[0, 97\): \[97\]"),
    ([1, -1], {}, ValueError, "outside the vocabulary"),
    ([1.0, 2], {}, TypeError, "must hold ints"),
    ("hello", {}, TypeError, "must be a list of token ids"),
    ([1, 2], {"max_new_tokens": 0}, ValueError, "max_new_tokens must be >= 1"),
    ([1, 2], {"temperature": -1.0}, ValueError, "temperature must be >= 0"),
    ([1, 2], {"top_k": -1}, ValueError, "top_k must be >= 0"),
    ([1, 2], {"top_p": 1.5}, ValueError, r"top_p must be in \(0, 1\]"),
    ([1, 2], {"eos_token_id": 500}, ValueError, r"eos_token_id \[500\] outside"),
    ([1, 2], {"repetition_penalty": 0.0}, ValueError,
     r"repetition_penalty must be a finite number > 0 \(1: none\), got 0.0"),
    ([1, 2], {"repetition_penalty": float("inf")}, ValueError, "repetition_penalty must be"),
    ([1, 2], {"repetition_penalty": "1.2"}, TypeError, "repetition_penalty"),
    (list(range(1, 60)), {"max_new_tokens": 10}, ValueError,
     "needs 17 blocks of 4 tokens, more than the pool's 16"),
    ([1, 2], {"max_new_tokens": 300}, ValueError, "max_position_embeddings"),
])
def test_bad_requests_raise_and_change_nothing(prompt, kw, error, match) -> None:
    gen = Generator(model_of("llama"), block_len=4, num_blocks=16, impl="torch")
    with pytest.raises(error, match=match):
        gen.add_request(prompt, **{"max_new_tokens": 4, **kw})
    assert not gen.has_unfinished() and gen.cache.num_free_blocks == 16
    with pytest.raises(error, match=match) as raised:
        gen.generate([[5, 6], prompt], **{"max_new_tokens": 4, **kw})
    assert "prompts[1]" in str(raised.value) or "prompt" not in match
    assert not gen.has_unfinished() and gen.cache.num_free_blocks == 16
    assert gen.generate([[5, 6]], max_new_tokens=2, eos_token_id=[]) == [
        want("llama", [5, 6], 2)]


@pytest.mark.parametrize("kw, error, match", [
    ({"block_len": 0}, ValueError, "block_len must be >= 1"),
    ({"num_blocks": 0}, ValueError, "num_blocks must be >= 1"),
    ({"memory_fraction": 0.0}, ValueError, "memory_fraction"),
    ({"kv_dtype": "int8"}, ValueError, "kv_dtype must be one of"),
    ({"kv_dtype": torch.int8}, TypeError, "kv_dtype must be"),
    ({"impl": "cuda"}, ValueError, "impl must be one of"),
    ({"max_batch": 0}, ValueError, "max_batch must be >= 1"),
    # a cache dtype the model's K/V are not in: refused here, not by the first step
    ({"kv_dtype": "bf16"}, ValueError,
     r"kv_dtype must be the model's dtype \(float32\) or fp8 .*got bfloat16"),
    ({"kv_dtype": torch.float16}, ValueError, "kv_dtype must be the model's dtype"),
    ({"cuda_graphs": "yes"}, TypeError, "cuda_graphs must be True or False, got str 'yes'"),
    ({"prefix_sharing": None}, TypeError, "prefix_sharing must be True or False"),
    # a pool beyond any memory: named, not the allocator's bare RuntimeError
    ({"num_blocks": 10**15, "block_len": 1}, ValueError,
     r"a pool of num_blocks=1000000000000000 blocks of block_len=1 tokens needs .* GiB"),
    ({"block_len": 10**12}, ValueError, r"num_blocks=8 blocks of block_len=1000000000000"),
])
def test_bad_options_raise(kw, error, match) -> None:
    with pytest.raises(error, match=match):
        Generator(model_of("llama"), **{"num_blocks": 8, **kw})


def test_generate_needs_an_idle_generator_and_abort_frees() -> None:
    gen = Generator(model_of("llama"), block_len=4, num_blocks=32, impl="torch")
    rid = gen.add_request([1, 2, 3], max_new_tokens=5)
    gen.step()
    with pytest.raises(RuntimeError, match="idle Generator"):
        gen.generate([[1, 2]], max_new_tokens=2)
    gen.abort(rid)
    assert not gen.has_unfinished() and gen.cache.num_free_blocks == 32
    assert gen.generate([[5, 6]], max_new_tokens=2, eos_token_id=[]) == [
        want("llama", [5, 6], 2)]


def test_the_model_is_used_in_place_and_left_as_it_was() -> None:
    model = model_of("qwen3")
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    impl = model.config._attn_implementation
    gen = Generator(model, block_len=4, num_blocks=32, impl="torch")
    gen.generate([[1, 2, 3]], max_new_tokens=3, eos_token_id=[])
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before
    assert model.config._attn_implementation == impl
    # The model's own forward is unchanged afterwards.
    assert hf_greedy(model, [4, 5, 6], 3) == want("qwen3", [4, 5, 6], 3)
    assert gen.bytes_per_token == 2 * 2 * 2 * 16 * 4


def test_stats_bytes_per_token_and_close() -> None:
    model = model_of("llama")
    gen = Generator(model, block_len=4, num_blocks=32, impl="torch")
    gen.generate(PROMPTS[:2], max_new_tokens=3, eos_token_id=[])
    st = gen.stats
    assert st["prefill_steps"] == 1 and st["decode_steps"] == 2 and st["preemptions"] == 0
    assert st["free_blocks"] == st["num_blocks"] == 32
    assert st["cuda_graphs"] == st["prefill_graphs"] == 0
    assert Generator.kv_bytes_per_token(model.config, torch.float32) == gen.bytes_per_token
    assert Generator.kv_bytes_per_token(model.config, "fp8") == gen.bytes_per_token // 4
    gen.add_request([1, 2], max_new_tokens=2)
    gen.close()
    assert not gen.has_unfinished() and not gen.cache.k_caches
    with pytest.raises(RuntimeError, match="closed"):
        gen.step()


def test_a_reserved_steps_inputs_come_as_one_packed_vector() -> None:
    """A decode graph takes a full batch's step with one copy: ``_packed`` gives the step's
    table, lengths before and after as the one int32 vector ``reserve`` packed them in, and
    None for tensors that do not lie so."""
    from lmfuse import PagedKVCache
    from lmfuse.serving.runner import _packed

    cache = PagedKVCache(num_blocks=8, block_len=4, kv_heads=1, head_dim=4,
                         dtype=torch.float32, device="cpu", num_layers=1)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.reserve([a, b], [5, 2])
    step = cache.reserve([a, b], 1, max_blocks=3)
    flat = _packed(step)
    assert flat is not None
    assert flat.tolist() == (step.block_table.flatten().tolist() + step.seqlens_before.tolist()
                             + step.seqlens.tolist())
    assert flat.tolist()[-4:] == [5, 2, 6, 3]
    apart = step._replace(seqlens=step.seqlens.clone())
    assert _packed(apart) is None
    assert _packed(step._replace(block_table=step.block_table.clone())) is None


def test_a_failed_capture_is_tried_once_more(monkeypatch) -> None:
    """A capture that fails is tried once more before the runner goes eager for good (a
    freshly started GPU invalidated the first capture of a step, never a later one); a
    second failure falls back with a warning, as before. The capture itself is stubbed:
    the mechanics, on any machine."""
    gen = Generator(model_of("llama"), block_len=4, num_blocks=16, impl="torch")
    runner = gen.runner
    runner.graphs_on = True
    pools = iter(["pool", "pool2", "pool3", "pool4"])
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(pools))
    tries = []

    def flaky(pool):
        tries.append(pool)
        if len(tries) == 1:
            raise RuntimeError("capture invalidated")
        return "graph"

    assert runner._graph((1, 4), flaky) == "graph"
    # the retry into a new pool (torch takes no capture into an invalidated one's)
    assert tries == ["pool", "pool2"] and runner.graph_retries == 1
    assert runner.graph_retry_error == "RuntimeError: capture invalidated"
    assert runner.graph_failures == 0 and runner.graphs_on

    def broken(pool):
        raise RuntimeError("broken")

    with pytest.warns(RuntimeWarning, match="could not be captured.*broken"):
        assert runner._graph((2, 4), broken) is None
    assert runner.graph_retries == 2 and runner.graph_failures == 1 and not runner.graphs_on
    assert runner._pool is None  # a later capture (a prefill's) into a new pool


def test_numpy_prompts_and_options_are_taken_as_ints() -> None:
    """A tokenizer's NumPy output (an int array, NumPy integers) and NumPy scalars for the
    options give the tokens of plain ints; NumPy bools and float arrays are refused."""
    import numpy as np

    gen = Generator(model_of("llama"), block_len=4, num_blocks=32, impl="torch")
    want_ = want("llama", [5, 6, 7], 3)
    eos = next(t for t in range(97) if t not in want_)  # an eos that never stops it
    got = gen.generate([np.array([5, 6, 7]), [np.int64(5), np.int32(6), 7]],
                       max_new_tokens=np.int64(3), eos_token_id=np.int64(eos),
                       seed=np.int64(1), temperature=np.float32(0.0))
    assert got == [want_, want_]
    stop = want_[1]  # a NumPy eos stops where a plain one does
    assert gen.generate([[5, 6, 7]], max_new_tokens=3, eos_token_id=np.int64(stop)) == [
        want_[:2]]
    with pytest.raises(TypeError, match=r"prompts\[0\] must hold ints"):
        gen.generate([[np.bool_(True)]], max_new_tokens=2)
    with pytest.raises(TypeError, match="1-D sequence of token ids, got a 1-D torch.float64"):
        gen.generate([np.array([1.5, 2.0])], max_new_tokens=2)


def test_eos_token_id_may_be_an_int_tensor() -> None:
    """eos_token_id as a 0-d or 1-d integer tensor (as a generation config may hold it)
    stops where the plain ints do; a float, bool or 2-D tensor is refused by name."""
    gen = Generator(model_of("llama"), block_len=4, num_blocks=32, impl="torch")
    want_ = want("llama", [5, 6, 7], 3)
    stop = want_[1]
    import numpy as np
    for eos in (torch.tensor(stop), torch.tensor([stop, 96], dtype=torch.int32),
                np.array([stop, 96]), np.int64(stop)):
        assert gen.generate([[5, 6, 7]], max_new_tokens=3, eos_token_id=eos) == [want_[:2]]
    for bad in (torch.tensor([1.0]), torch.tensor([True]), torch.tensor([[1, 2]])):
        with pytest.raises(TypeError, match="eos_token_id as a tensor must hold integers"):
            gen.generate([[5, 6, 7]], max_new_tokens=3, eos_token_id=bad)
    assert not gen.has_unfinished()


@pytest.mark.parametrize("where", ["decode_ahead", "decode", "prefill"])
def test_a_step_that_raises_is_computed_again(where: str) -> None:
    """A step broken off (Ctrl-C, out of memory, any error) left slots reserved and never
    written: the requests are computed again from their tokens, and the tokens that come
    out are model.generate's (blocks of 4: a broken step's slots crossed into new blocks)."""
    gen = Generator(model_of("qwen3"), block_len=4, num_blocks=64, impl="torch")
    gen.lookahead = where == "decode_ahead"  # (greedy decode steps run ahead by default)
    prompts = [[3, 15], [77, 73, 15, 50], [47, 14]]
    rids = [gen.add_request(p, max_new_tokens=10, eos_token_id=[]) for p in prompts]
    real, calls = getattr(gen.runner, where), [0]

    def flaky(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    setattr(gen.runner, where, flaky)
    got, raised, steps = {r: [] for r in rids}, 0, 0
    while gen.has_unfinished():
        try:
            for rid, toks, _ in gen.step():
                got[rid] += toks
        except KeyboardInterrupt:
            raised += 1
        steps += 1
        if steps == 3:  # a prompt arriving while the others decode: a second prefill
            prompts.append([60, 61, 62, 63, 64])
            rids.append(gen.add_request(prompts[-1], max_new_tokens=10, eos_token_id=[]))
            got[rids[-1]] = []
    assert raised == 1
    assert [got[r] for r in rids] == [want("qwen3", p, 10) for p in prompts]
    assert gen.cache.num_free_blocks == 64


def test_a_request_takes_one_row_less_than_its_length() -> None:
    """The last new token is never fed: a prompt of max_position_embeddings - 1 tokens takes
    2 new ones, and a prompt that fills the pool takes 1, as model.generate does."""
    model = tiny_causal_lm("qwen3", max_position_embeddings=32)
    prompt = list(range(1, 32))
    gen = Generator(model, block_len=4, num_blocks=16, impl="torch")
    assert gen.generate([prompt], max_new_tokens=2, eos_token_id=[]) == [
        hf_greedy(model, prompt, 2)]
    with pytest.raises(ValueError, match="max_position_embeddings"):
        gen.generate([prompt], max_new_tokens=3, eos_token_id=[])
    full = list(range(1, 17))
    small = Generator(model, block_len=4, num_blocks=4, impl="torch")
    assert small.generate([full], max_new_tokens=1, eos_token_id=[]) == [
        hf_greedy(model, full, 1)]
    with pytest.raises(ValueError, match="more than the pool's 4"):
        small.generate([full], max_new_tokens=2, eos_token_id=[])
