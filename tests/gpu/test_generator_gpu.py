"""The Generator on a GPU, compiled kernels and CUDA graphs (what the CPU suite cannot show):

* every supported family (tiny random-weight configs, float32, TF32 off): the greedy tokens of
  ``model.generate``, with the decode step captured in CUDA graphs (no capture failure);
* bf16 (a Llama-shaped model of 4 layers, vocabulary 32000, random weights): every decode
  step's logits within a stated tolerance of the model's own forward (SDPA, no cache) over
  the same tokens, and the greedy continuations' agreement with ``model.generate``
  reported (printed; ``LMFUSE_GENERATOR_REPORT=FILE`` writes them as JSON).

Run on a CUDA machine::

    LMFUSE_GPU_TESTS=1 python -m pytest -q -rA -s tests/gpu/test_generator_gpu.py
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from helpers import TINY_LM_FAMILIES, TINY_MOE_LM_FAMILIES, tiny_causal_lm
from lmfuse.serving import Generator

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU and the Triton compiler (LMFUSE_GPU_TESTS=1)")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3], list(range(20, 60)), [90, 2, 2, 2, 41]]
NEW = 12
# bf16 logits of a decode step against the model's own forward over the same tokens:
# max |a - b| / max |b| over the vocabulary, per step (both are bf16 computations).
BF16_LOGITS_TOL = 3e-2


@pytest.fixture(autouse=True)
def _no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _hf(model, prompt, new):
    out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", TINY_LM_FAMILIES + TINY_MOE_LM_FAMILIES)
def test_greedy_tokens_with_cuda_graphs(family: str) -> None:
    model = tiny_causal_lm(family).cuda()
    want = [_hf(model, p, NEW) for p in PROMPTS]
    gen = Generator(model, block_len=4, num_blocks=256)
    got = gen.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[])
    assert got == want
    st = gen.stats
    assert st["graph_failures"] == 0, gen.runner.graph_failure
    assert st["cuda_graphs"] - st["prefill_graphs"] > 0  # the decode steps'
    # the fused families' prefills in graphs too
    assert (st["prefill_graphs"] > 0) == (gen.runner.decode_path == "fused")


def test_one_row_steps_prefetch_into_l2_and_keep_the_tokens() -> None:
    """One row in CUDA graphs on a GPU with PDL: the step's graph runs the L2 prefetch's
    branch (its kernel in the profile, no capture failure) and the tokens are
    model.generate's, as they are with the prefetch off."""
    from torch.profiler import ProfilerActivity, profile

    from lmfuse import _pdl, tuning

    if not _pdl.mode(torch.device("cuda")):
        pytest.skip("no programmatic dependent launch here (before Hopper): no L2 prefetch")
    model = tiny_causal_lm("llama").cuda()
    prompt = PROMPTS[2]
    want = [_hf(model, prompt, NEW)]
    with tuning.overlay("gemv", {"l2_prefetch_bytes": 16 << 20}):  # (on where unmeasured)
        gen = Generator(model, block_len=4, num_blocks=256)
    assert gen.runner.fused.l2_prefetch == 16 << 20
    gen.generate([prompt], max_new_tokens=2, eos_token_id=[])  # the graphs captured
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        got = gen.generate([prompt], max_new_tokens=NEW, eos_token_id=[])
        torch.cuda.synchronize()
    assert got == want
    print(f"one-row captures retried: {gen.runner.graph_retries} "
          f"({gen.runner.graph_retry_error})")
    assert gen.stats["graph_failures"] == 0
    assert any("l2_prefetch_kernel" in e.name for e in prof.events())
    with tuning.overlay("gemv", {"l2_prefetch_bytes": 0}):
        plain = Generator(model, block_len=4, num_blocks=256)
    assert plain.runner.fused.l2_prefetch == 0
    assert plain.generate([prompt], max_new_tokens=NEW, eos_token_id=[]) == want


@pytest.mark.parametrize("breaks", [1, 2])
def test_an_invalidated_capture_is_tried_again(breaks: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture that the GPU invalidates (here a synchronisation inside it, as a freshly
    started H200 did to the first one-row capture) is captured again, into a new memory
    pool: with one break the steps replay in graphs, one retry and no failure counted;
    with two that step runs eagerly (one failure) and the other captures still succeed.
    The tokens are model.generate's either way."""
    from lmfuse.serving import runner as runner_mod

    model = tiny_causal_lm("llama").cuda()
    prompt = PROMPTS[0]
    want = [_hf(model, prompt, NEW)]
    gen = Generator(model, block_len=4, num_blocks=256)
    real, broke = runner_mod._with_tokens, []

    def breaking(out):
        if torch.cuda.is_current_stream_capturing() and len(broke) < breaks:
            broke.append(True)
            torch.cuda.synchronize()  # not permitted while capturing: invalidates it
        return real(out)

    monkeypatch.setattr(runner_mod, "_with_tokens", breaking)
    stream = torch.cuda.current_stream()
    got = gen.generate([prompt], max_new_tokens=NEW, eos_token_id=[])
    assert len(broke) == breaks and got == want
    assert torch.cuda.current_stream() == stream  # not the failed capture's side stream
    st, r = gen.stats, gen.runner
    print(f"retried after: {r.graph_retry_error}")
    assert r.graph_retries == 1 and "capture" in r.graph_retry_error, r.graph_retry_error
    assert st["graph_failures"] == breaks - 1, r.graph_failure
    assert st["cuda_graphs"] > 0 and (r.graphs_on or r.prefill_graphs_on)
    if breaks == 1:
        assert r.graphs_on and r.prefill_graphs_on


def test_graphs_share_one_logits_buffer_and_sampling_reads_it() -> None:
    """Every captured graph (decode buckets, prefills) writes its logits into one buffer;
    a sampled run (top_k=1: the greedy token, drawn from the logits, not the graph's
    argmax) over batches that grow and shrink reads the right rows of it."""
    model = tiny_causal_lm("llama").cuda()
    want = [_hf(model, p, n) for p, n in zip(PROMPTS, (NEW, 3, NEW, 7))]
    gen = Generator(model, block_len=4, num_blocks=256)
    rids = [gen.add_request(PROMPTS[0], max_new_tokens=NEW, temperature=1.0, top_k=1, seed=1)]
    out: dict[int, list[int]] = {rids[0]: []}
    steps = 0
    while gen.has_unfinished():
        if steps in (2, 3, 5):  # join mid-run: batches of 2, 3 and 4 rows
            i = len(rids)
            rids.append(gen.add_request(PROMPTS[i], max_new_tokens=(NEW, 3, NEW, 7)[i],
                                        temperature=1.0, top_k=1, seed=i))
            out[rids[-1]] = []
        for rid, toks, _ in gen.step():
            out[rid].extend(toks)
        steps += 1
    assert [out[r] for r in rids] == want
    graphs = gen.runner._graphs.values()
    assert len(graphs) >= 3 and gen.stats["prefill_graphs"] > 0
    assert len({g.logits.untyped_storage().data_ptr() for g in graphs}) == 1
    gen.close()  # the buffer goes back with the graphs
    assert gen.runner._logits_buf is None and not gen.runner._graphs


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_repetition_penalty_of_the_generation_config_in_cuda_graphs(family: str) -> None:
    """A generation_config's repetition_penalty on the GPU: the penalised requests read the
    graphs' logits (not their argmax), beside a plain greedy one; model.generate's
    tokens."""
    model = tiny_causal_lm(family).cuda()
    plain = _hf(model, PROMPTS[2], NEW)
    model.generation_config.repetition_penalty = 1.3
    want = [_hf(model, p, NEW) for p in PROMPTS]
    gen = Generator(model, block_len=4, num_blocks=256)
    assert gen.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[]) == want
    rids = [gen.add_request(PROMPTS[0], max_new_tokens=NEW, eos_token_id=[]),
            gen.add_request(PROMPTS[2], max_new_tokens=NEW, eos_token_id=[],
                            repetition_penalty=1.0)]
    out: dict[int, list[int]] = {r: [] for r in rids}
    while gen.has_unfinished():
        for rid, toks, _ in gen.step():
            out[rid].extend(toks)
    assert [out[r] for r in rids] == [want[0], plain]
    assert gen.stats["cuda_graphs"] > 0


def _bf16_model(max_position_embeddings: int = 4096):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=1024, intermediate_size=2816,
                                  num_hidden_layers=4, num_attention_heads=8,
                                  num_key_value_heads=2, vocab_size=32000,
                                  max_position_embeddings=max_position_embeddings)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa")
    return model.eval()


def test_bf16_decode_logits_and_greedy_agreement() -> None:
    model = _bf16_model()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 32000, (n,), generator=g).tolist() for n in (1, 17, 200, 513)]
    new = 32
    gen = Generator(model, block_len=16, num_blocks=1024)
    seen: list[torch.Tensor] = []
    decode = gen.runner.decode

    def recording(requests, step):
        logits = decode(requests, step)
        seen.append(logits.float().clone())
        return logits

    gen.runner.decode = recording
    gen.lookahead = False  # every decode step through runner.decode
    got = gen.generate(prompts, max_new_tokens=new, eos_token_id=[])
    assert gen.stats["graph_failures"] == 0
    # Decode step k (k >= 1) of request i saw prompt + got[i][:k]; its logits against the
    # model's own forward over those tokens (all requests decode together: same step k).
    worst = 0.0
    for k, logits in enumerate(seen, start=1):
        for i, p in enumerate(prompts):
            ids = torch.tensor([p + got[i][:k]], device="cuda")
            with torch.inference_mode():
                ref = model(input_ids=ids, use_cache=False).logits[0, -1].float()
            err = float((logits[i] - ref).abs().max() / ref.abs().max())
            worst = max(worst, err)
    want = [_hf(model, p, new) for p in prompts]
    agree = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), new)
             for x, y in zip(got, want)]
    same = sum(a == b for x, y in zip(got, want) for a, b in zip(x, y))
    report = dict(model="llama hidden 1024, 4 layers, 8/2 heads, vocab 32000, bf16",
                  prompts=[len(p) for p in prompts], new_tokens=new,
                  worst_logits_rel_err=worst, tolerance=BF16_LOGITS_TOL,
                  identical_prefix_tokens=agree, tokens_equal=same,
                  tokens_total=new * len(prompts), device=torch.cuda.get_device_name())
    print("\nbf16 Generator vs model:", json.dumps(report))
    if os.environ.get("LMFUSE_GENERATOR_REPORT"):
        with open(os.environ["LMFUSE_GENERATOR_REPORT"], "w") as f:
            json.dump(report, f, indent=1)
    assert len(seen) == new - 1
    assert worst <= BF16_LOGITS_TOL, report


def test_prefill_graphs_replay_the_eager_prefill() -> None:
    """Fused prefills captured per (tokens, sequences, width) bucket give the logits of the
    same padded prefill run eagerly (bitwise), and the model's own forward's within the
    stated tolerance; the first tokens are their argmax."""
    model = _bf16_model()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 32000, (n,), generator=g).tolist() for n in (1, 17, 200, 513)]
    runs = {}
    for graphs in (True, False):
        gen = Generator(model, block_len=16, num_blocks=1024, cuda_graphs=graphs)
        gen.runner.pad_prefill = True
        seen: list[torch.Tensor] = []
        prefill = gen.runner.prefill

        def recording(*args, **kwargs):
            logits = prefill(*args, **kwargs)
            seen.append(logits.clone())
            return logits

        gen.runner.prefill = recording
        first = gen.generate(prompts, max_new_tokens=1, eos_token_id=[])
        runs[graphs] = seen, first, gen.stats
    (graph, first, stats), (eager, first_eager, _) = runs[True], runs[False]
    assert stats["graph_failures"] == 0 and stats["prefill_steps"] == 1
    assert stats["cuda_graphs"] == stats["prefill_graphs"] == 1  # no decode step
    assert len(graph) == len(eager) == 1 and torch.equal(graph[0], eager[0])
    assert first == first_eager == [[int(t)] for t in graph[0].float().argmax(-1)]
    for i, p in enumerate(prompts):
        with torch.inference_mode():
            ref = model(input_ids=torch.tensor([p], device="cuda"),
                        use_cache=False).logits[0, -1].float()
        err = float((graph[0][i].float() - ref).abs().max() / ref.abs().max())
        assert err <= BF16_LOGITS_TOL, (len(p), err)


def test_long_prompt_prefilled_in_chunks() -> None:
    """A 32K-token prompt prefilled in chunks of ``max_prefill_tokens`` (8192), a short
    request decoding between them: the last chunk's logits within the stated tolerance of
    the model's forward over the whole prompt, its tokens and the short request's those
    of ``model.generate``."""
    model = _bf16_model(max_position_embeddings=40960)
    g = torch.Generator().manual_seed(2)
    long = torch.randint(0, 32000, (32768,), generator=g).tolist()
    short = [5, 6, 7]
    gen = Generator(model, block_len=16, num_blocks=2400)
    seen: list[torch.Tensor] = []
    prefill = gen.runner.prefill

    def recording(*args, **kwargs):
        logits = prefill(*args, **kwargs)
        seen.append(logits.float().clone())
        return logits

    gen.runner.prefill = recording
    rids = [gen.add_request(short, max_new_tokens=12), gen.add_request(long, max_new_tokens=1)]
    out: dict[int, list[int]] = {r: [] for r in rids}
    order = []
    while gen.has_unfinished():
        for rid, toks, _ in gen.step():
            out[rid].extend(toks)
            order.append(rid)
    st = gen.stats
    assert st["graph_failures"] == 0, gen.runner.graph_failure
    assert len(seen) == 5  # the short prompt, the long one's four chunks
    assert order.index(rids[1]) > order.index(rids[0]) + 2  # the short one decoded between
    with torch.inference_mode():
        ref = model(input_ids=torch.tensor([long], device="cuda"), use_cache=False,
                    logits_to_keep=1).logits[0, -1].float()
    err = float((seen[-1][0] - ref).abs().max() / ref.abs().max())
    assert err <= BF16_LOGITS_TOL, err
    assert out[rids[1]] == [int(seen[-1][0].argmax())]
    assert out[rids[0]] == _hf(model, short, 12)


@pytest.mark.parametrize("n,V", [(1, 128256), (64, 128256), (3, 50001), (300, 1000)])
def test_greedy_argmax_kernel_is_torch_argmax(n, V):
    """The decode step's Triton argmax (``sampling.argmax_rows``) at vocabulary sizes: the
    first of equal maxima, the first NaN, +inf and rows all -inf as ``torch.argmax``."""
    from lmfuse.serving.sampling import argmax_rows

    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(n, V, device="cuda", generator=g).bfloat16()
    x[0, V // 3] = x[0, V - 1] = 100.0  # a tie of maxima far apart
    if n > 2:
        x[1] = float("-inf")
        x[2, 7] = x[2, V - 2] = float("nan")
        x[2, 3] = float("inf")
    assert torch.equal(argmax_rows(x), torch.argmax(x, -1))
    assert torch.equal(argmax_rows(x.float()), torch.argmax(x.float(), -1))


@pytest.fixture
def nccl_world_of_one():
    """A one-rank NCCL process group on this GPU (its collectives are real NCCL calls and
    are captured as on several GPUs)."""
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, device_id=torch.device("cuda", 0))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("split", ["kvdp", "cp"])
def test_sharded_generator_steps_in_cuda_graphs(split: str, nccl_world_of_one) -> None:
    """The sharded decode step captured with its NCCL collectives (one rank: the 2- and
    4-GPU runs are tests/gpu/generator_nccl.py's): five prompts (the batch bucket 8, three
    padding rows), the tokens of model.generate, graphs captured, none failed; with
    lookahead off as well."""
    model = tiny_causal_lm("llama").cuda()
    prompts = PROMPTS + [[11, 12]]
    want = [_hf(model, p, NEW) for p in prompts]
    for lookahead in (True, False):
        gen = Generator(model, block_len=4, num_blocks=256, **{f"{split}_group":
                                                               nccl_world_of_one})
        gen.lookahead = lookahead
        got = gen.generate(prompts, max_new_tokens=NEW, eos_token_id=[])
        assert got == want, lookahead
        assert gen.stats["graph_failures"] == 0, gen.runner.graph_failure
        assert gen.stats["cuda_graphs"] > 0
        gen.close()


def test_lm_head_gemv_greedy_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The LM head through the GEMV's 128-feature tiles (the vocabulary threshold lowered to
    a tiny model's 256; several rows), compiled: model.generate's tokens."""
    import lmfuse.serving.fused_ops as fused_ops

    monkeypatch.setattr(fused_ops, "LM_HEAD_MIN_FEATURES", 128)
    model = tiny_causal_lm("llama", vocab_size=256).cuda()
    want = [_hf(model, p, NEW) for p in PROMPTS]
    gen = Generator(model, block_len=4, num_blocks=256)
    assert gen.runner.decode_path == "fused"
    assert gen.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[]) == want


@pytest.mark.parametrize("rows, split", [(16, 4), (64, 2), (5, 3)])
def test_split_k_gemv_on_the_gpu_and_in_a_graph(rows: int, split: int) -> None:
    """The GEMV with K split over programs (the tile's last program sums the partials), as
    the decode step launches it for Wd: bf16 [rows, 8192] x [2048, 8192]^T with the
    residual added in place, against float32 math; then captured in a CUDA graph and
    replayed on new inputs (the counts return to zero between launches), bitwise the eager
    result each time."""
    from lmfuse.serving.fused_ops import gemv as _gemv

    g = torch.Generator(device="cuda").manual_seed(rows)
    w = (torch.randn(2048, 8192, device="cuda", generator=g) / 90).bfloat16()
    x = torch.randn(rows, 8192, device="cuda", generator=g).bfloat16()
    r = torch.randn(rows, 2048, device="cuda", generator=g).bfloat16()
    want = (x.float() @ w.float().t() + r.float())
    got = _gemv(x, (w,), residual=r.clone(), split_k=split)
    err = ((got.float() - want).abs().max() / want.abs().max()).item()
    assert err < 1e-2, err
    _assert_replays_are_eager(lambda x, r: (_gemv(x, (w,), residual=r, split_k=split),),
                              x, r, g)


def _assert_replays_are_eager(step, x: torch.Tensor, r: torch.Tensor,
                              g: torch.Generator) -> None:
    """``step(x, r)`` (a tuple of tensors; ``r`` may be updated in place) captured in a
    CUDA graph, after a warm-up outside the capture, and replayed on new inputs copied
    into its buffers: each replay's outputs bitwise ``step``'s eager ones on those
    inputs."""
    xs, rs = x.clone(), r.clone()
    step(xs, rs.clone())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(xs, rs)
    for k in range(3):
        x2 = torch.randn(x.shape, device="cuda", generator=g).to(x.dtype)
        r2 = torch.randn(r.shape, device="cuda", generator=g).to(r.dtype)
        xs.copy_(x2)
        rs.copy_(r2)
        graph.replay()
        eager = step(x2, r2.clone())
        assert all(torch.equal(a, b) for a, b in zip(out, eager)), k


@pytest.mark.parametrize("rows, split", [(16, 4), (64, 2), (5, 1), (40, 1)])
def test_prenorm_gemv_on_the_gpu_and_in_a_graph(rows: int, split: int) -> None:
    """The residual GEMV leaving the next RMSNorm's work (``prenorm``), as the decode step
    launches Wo and Wd, bf16: h against float32 math, ``h * g`` and each row's rsqrt
    factor (from its tiles' sums of squares) as ``prenorm_reference`` gives them from the
    stored h; the gated GEMV that takes them (``row_scale``) against float32 ``rms_norm(h)``
    then the gated projections; captured in a CUDA graph and replayed on new inputs,
    bitwise the eager result."""
    from lmfuse.norm.reference import rms_norm_reference
    from lmfuse.serving.fused_ops import gemv as _gemv
    from lmfuse.serving.fused_reference import prenorm_reference

    g = torch.Generator(device="cuda").manual_seed(rows)
    w = (torch.randn(2048, 8192, device="cuda", generator=g) / 90).bfloat16()
    x = torch.randn(rows, 8192, device="cuda", generator=g).bfloat16()
    r = torch.randn(rows, 2048, device="cuda", generator=g).bfloat16()
    gain = (1 + torch.randn(2048, device="cuda", generator=g) / 4).bfloat16()
    wg, wu = ((torch.randn(4096, 2048, device="cuda", generator=g) / 45).bfloat16()
              for _ in range(2))
    eps = 1e-5

    def step(x, r):
        h, xw, rn = _gemv(x, (w,), residual=r, prenorm=(gain, eps), split_k=split)
        return h, xw, rn.ss, _gemv(xw, (wg, wu), gated=True, row_scale=rn)

    h, xw, ss, a = step(x, r.clone())
    want = x.float() @ w.float().t() + r.float()
    assert ((h.float() - want).abs().max() / want.abs().max()).item() < 1e-2
    want_xw, want_rs = prenorm_reference(h, gain, eps)
    assert torch.equal(xw, want_xw)
    torch.testing.assert_close(torch.rsqrt(ss.sum(-1) / 2048 + eps), want_rs, rtol=1e-5, atol=0)
    normed = rms_norm_reference(h.float(), gain.float(), eps=eps)
    want_a = F.silu(normed @ wg.float().t()) * (normed @ wu.float().t())
    assert ((a.float() - want_a).abs().max() / want_a.abs().max()).item() < 2e-2
    _assert_replays_are_eager(step, x, r, g)


@pytest.mark.parametrize("rows", [1, 16, 64])
def test_embedding_gather_and_greedy_head_with_pdl_in_a_graph(rows: int) -> None:
    """The step's first and last kernels as it launches them on a Hopper GPU (programmatic
    dependent launch where the device has it), bf16: the gather's rows, ``h * g`` and the
    first norm's factors against ``embed_prenorm_reference``; the LM-head GEMV taking them
    (``row_scale``, ``argmax``) gives ``torch.argmax`` of its logits; captured in a CUDA
    graph and replayed on new ids, bitwise the eager result."""
    from lmfuse import _pdl
    from lmfuse.serving.fused_ops import embed as _embed
    from lmfuse.serving.fused_ops import gemv as _gemv
    from lmfuse.serving.fused_reference import embed_prenorm_reference

    pdl = _pdl.mode(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(rows)
    table = torch.randn(4096, 2048, device="cuda", generator=g).bfloat16()
    gain = (1 + torch.randn(2048, device="cuda", generator=g) / 4).bfloat16()
    w = (torch.randn(8192, 2048, device="cuda", generator=g) / 45).bfloat16()
    eps = 1e-5

    def step(ids):
        h, xw, rn = _embed(ids, table, (gain, eps), pdl=pdl)
        y, tok = _gemv(xw, (w,), row_scale=rn, argmax=True, pdl=pdl)
        return h, xw, rn.ss, y, tok, _embed(ids, table, pdl=pdl)

    ids = torch.randint(0, 4096, (rows,), device="cuda", generator=g)
    h, xw, ss, y, tok, plain = step(ids)
    want_h, want_xw, want_rs = embed_prenorm_reference(ids, table, gain, eps)
    assert torch.equal(h, want_h) and torch.equal(plain, want_h) and torch.equal(xw, want_xw)
    torch.testing.assert_close(torch.rsqrt(ss.sum(-1) / 2048 + eps), want_rs, rtol=1e-5, atol=0)
    assert torch.equal(tok, torch.argmax(y, -1))
    buf = ids.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(buf)
    for k in range(3):
        buf.copy_(torch.randint(0, 4096, (rows,), device="cuda", generator=g))
        graph.replay()
        eager = step(buf.clone())
        assert all(torch.equal(a, b) for a, b in zip(out, eager)), k


def test_decode_step_inputs_and_tokens_cross_the_bus_on_the_compute_queue() -> None:
    """A CUDA cache's ``reserve`` into pinned host memory (``out``): the step's tensors are
    views of it with the values a device reserve gives; ``bus_copy`` brings them to the
    GPU and a device tensor back to pinned memory on the current stream (a side stream
    here, ordered after a kernel that writes the source)."""
    from lmfuse.attention.kv_cache import PagedKVCache
    from lmfuse.serving.runner import bus_copy, bus_copies

    assert bus_copies(torch.device("cuda"))
    caches = [PagedKVCache(num_blocks=64, block_len=16, kv_heads=2, head_dim=64,
                           dtype=torch.bfloat16, device="cuda", num_layers=1) for _ in "ab"]
    ids = [[c.add_sequence() for _ in range(5)] for c in caches]
    for c, s in zip(caches, ids):
        c.reserve(s, [40, 3, 16, 0, 77])
    host = torch.empty(5 * (8 + 2), dtype=torch.int32, pin_memory=True)
    got = caches[0].reserve(ids[0], 1, max_blocks=8, out=host)
    want = caches[1].reserve(ids[1], 1, max_blocks=8)
    dev = torch.full_like(host, -9, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # dev's fill, want's copies
    with torch.cuda.stream(stream):
        bus_copy(dev, host)
        for a, b in zip(got[:3], want[:3]):
            assert a.device.type == "cpu" and a.untyped_storage().data_ptr() == host.data_ptr()
            assert torch.equal(a, b.cpu())
        tokens = torch.arange(64, device="cuda") * 3  # written by a kernel just before
        back = torch.empty(64, dtype=torch.int64, pin_memory=True)
        bus_copy(back, tokens)
    stream.synchronize()
    assert torch.equal(dev.cpu(), host) and back.tolist() == list(range(0, 192, 3))


@pytest.mark.parametrize("rows,split,K", [(4, None, 2048), (64, None, 2048), (16, 2, 4096),
                                          (4, 3, 4096)])
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_rotating_qkv_gemv_on_the_gpu(rows: int, split, K: int, cache: str) -> None:
    """The QKV GEMV that rotates q and k and appends k and v itself (the decode step's at
    several rows), compiled, at the benchmark model's shapes (16/4 heads of 128, hidden
    2048, blocks of 16 scattered in the pool; hidden 4096 with K split over programs): the
    queries and the written cache slots against ``rope_append_reference`` of the float32
    projections; fp8 slots at most one e4m3 step apart (the float32 sums add in another
    order) and mostly equal. Split (as the decode step calls it: with the previous GEMV's
    row norm, here with biases too): its workspace taken, the tile counts back at zero, and
    a second call writes the same bits."""
    import lmfuse.serving.fused_ops as fused_ops
    from lmfuse import tuning
    from lmfuse.serving.fused_ops import _SPLIT_BUFFERS, RopeAppend, RowNorm
    from lmfuse.serving.fused_ops import gemv as _gemv
    from lmfuse.serving.fused_reference import gemv_reference, rope_append_reference

    hq, hkv, d, bl = 16, 4, 128, 16
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, K, device="cuda", generator=g).bfloat16()
    ws = tuple((torch.randn(h * d, K, device="cuda", generator=g) / 45).bfloat16()
               for h in (hq, hkv, hkv))
    angles = torch.randn(4096, d // 2, device="cuda", generator=g, dtype=torch.float64)
    cos, sin = angles.cos().float(), angles.sin().float()
    nb = 8 * rows
    pos = torch.randint(0, 8 * bl, (rows,), device="cuda", generator=g, dtype=torch.int32)
    table = torch.randperm(nb, device="cuda", generator=g).view(rows, 8).to(torch.int32)
    table[1] = -1  # a padding row
    dtype = torch.float8_e4m3fn if cache == "fp8" else torch.bfloat16
    scales = ((torch.rand(hkv, device="cuda", generator=g) + 0.5,
               torch.rand(hkv, device="cuda", generator=g) + 0.5) if cache == "fp8"
              else (None, None))
    got_c = [torch.zeros(nb, bl, hkv, d, device="cuda").to(dtype) for _ in range(2)]
    want_c = [c.clone() for c in got_c]
    biases = rn = None
    if split is not None:
        biases = tuple(torch.randn(h * d, device="cuda", generator=g).bfloat16() / 8
                       for h in (hq, hkv, hkv))
        rn = RowNorm(torch.rand(rows, 4, device="cuda", generator=g) * 500 + 10, K, 1e-5)

    def call(caches):
        return _gemv(x, ws, biases, split_k=split, row_scale=rn,
                     rope=RopeAppend(cos, sin, pos, table, *caches, *scales, hq, hkv, d))

    q = call(got_c)
    if split is not None:
        torch.cuda.synchronize()
        bm = fused_ops.row_tile(rows)
        n_out = (hq + 2 * hkv) * d
        bn, bk = fused_ops.gemv_config(n_out, K, bm, False, 2,
                                       tuning.shared_memory(x.device), True,
                                       device=x.device)[:2]
        k_split = -(-(-(-K // split)) // bk) * bk
        tiles = n_out // (2 * bn) * -(-rows // bm)
        key = ("cuda:0", 2 * -(-K // k_split) * tiles * bm * bn, tiles)
        assert -(-K // k_split) > 1 and key in _SPLIT_BUFFERS, (key, list(_SPLIT_BUFFERS))
        assert all(int(c.abs().sum()) == 0 for _, c in _SPLIT_BUFFERS.values())
        again_c = [torch.zeros_like(c) for c in got_c]
        assert torch.equal(call(again_c), q)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                   for a, b in zip(again_c, got_c))
    qkv = gemv_reference(x.float(), ws, biases, row_scale=None if rn is None else rn.scale())
    want = rope_append_reference(qkv, cos, sin, pos, table,
                                 *want_c, None, None, 0.0, *scales, hq, hkv, d)
    err = ((q.float().view(rows, hq, d) - want.float()).abs().max()
           / want.float().abs().max()).item()
    assert err < 1e-2, err
    for a, b in zip(got_c, want_c):
        a, b = a.float(), b.float()
        if cache == "fp8":
            assert (a == b).float().mean() > 0.95
            torch.testing.assert_close(a, b, rtol=0.125, atol=0)
        else:
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    assert (got_c[0].float() != 0).any(-1).any(-1).sum() == rows - 1  # the padding row: none
