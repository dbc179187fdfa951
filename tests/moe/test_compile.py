"""``moe_experts`` under torch.compile(fullgraph=True): the Triton path's forward and backward
are custom ops (``lmfuse::moe_experts_fwd`` / ``lmfuse::moe_experts_bwd``), the routing
inside them, so the graph has no break (no host synchronisation either), and the output and
every gradient equal the eager call's. Cases: GPT-OSS's form with every gradient, also with
``fp8_input_store`` (the forward op's fake gives the float8 ``h`` it returns); top-1
squared ReLU without biases and with a router that needs no gradient (the backward op's
empty outputs). The torch path (the CPU default: a loop over the experts that reads their
token counts on the host) compiles whole too, as one op each way, and does not recompile
when the routing changes (an expert with no token, then some)."""

from __future__ import annotations

import pytest
import torch
from helpers import randn

import lmfuse


@pytest.mark.parametrize("case", ["gpt-oss", "gpt-oss-fp8", "top1-frozen-router"])
def test_fullgraph_compile_matches_eager(case: str) -> None:
    torch._dynamo.reset()
    T, H, F, E = 6, 16, 8, 3
    gpt_oss = case.startswith("gpt-oss")
    k, K2 = (2, 2 * F) if gpt_oss else (1, F)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    rw = torch.rand(T, k, requires_grad=gpt_oss)
    args = [randn((T, H), requires_grad=True),
            randn((E, K2, H), scale=0.25, requires_grad=True),
            randn((E, H, F), scale=0.35, requires_grad=True)]
    if gpt_oss:
        args += [randn((E, K2), scale=0.3, requires_grad=True),
                 randn((E, H), scale=0.3, requires_grad=True)]
    kw = (dict(activation="quick_geglu", linear_offset=1.0, clamp_value=7.0,
               gate_up_layout="interleaved") if gpt_oss else dict(activation="squared_relu"))
    if case.endswith("fp8"):
        kw["fp8_input_store"] = True
    g = randn((T, H))
    wrt = args + ([rw] if gpt_oss else [])

    def call(hidden, wgu, wd, *biases):
        bgu, bd = biases if biases else (None, None)
        return lmfuse.moe_experts(hidden, ids, rw, wgu, wd, gate_up_bias=bgu, down_bias=bd,
                                  impl="triton", **kw)

    want = call(*args)
    want_grads = torch.autograd.grad(want, wrt, g)
    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    got = compiled(*args)
    got_grads = torch.autograd.grad(got, wrt, g)
    assert torch.equal(got, want)
    for a, b in zip(got_grads, want_grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fp8", [False, True], ids=["plain", "fp8_input_store"])
def test_the_torch_path_compiles_whole_without_recompiling(fp8: bool) -> None:
    T, H, F, E, k = 6, 16, 8, 4, 2
    ts = [randn((T, H), requires_grad=True), torch.rand(T, k, requires_grad=True),
          randn((E, 2 * F, H), scale=0.25, requires_grad=True),
          randn((E, H, F), scale=0.35, requires_grad=True),
          randn((E, 2 * F), scale=0.3, requires_grad=True),
          randn((E, H), scale=0.3, requires_grad=True)]

    def call(ids, hidden, rw, wgu, wd, bgu, bd):
        return lmfuse.moe_experts(hidden, ids, rw, wgu, wd, gate_up_bias=bgu, down_bias=bd,
                                  impl="torch", fp8_input_store=fp8)

    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True, backend="aot_eager", dynamic=False)
    routings = [torch.stack([torch.randperm(E)[:k] for _ in range(T)]),
                torch.tensor([[0, 1]] * T),  # experts 2 and 3 get no token
                torch.stack([torch.randperm(E)[:k] for _ in range(T)])]
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            for ids in routings:
                want = call(ids, *ts)
                got = compiled(ids, *ts)
                g = randn((T, H))
                assert torch.equal(got, want)
                for a, b in zip(torch.autograd.grad(got, ts, g), torch.autograd.grad(want, ts, g)):
                    assert torch.equal(a, b)
    finally:
        torch._dynamo.reset()


def test_a_patched_moe_model_compiles_whole_on_the_cpu_path(monkeypatch) -> None:
    """A tiny Mixtral patched by apply_lmfuse, on the CPU default path (no interpreter: the
    experts take the torch path), compiles with fullgraph=True, does not recompile over
    steps of other routings, and gives the unpatched model's loss."""
    transformers = pytest.importorskip("transformers")
    import copy

    from lmfuse.integrations.transformers import apply_lmfuse

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    config = transformers.AutoConfig.for_model(
        "mixtral", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=160, num_local_experts=4,
        num_experts_per_tok=2)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    plain = transformers.AutoModelForCausalLM.from_config(config).float().train()
    patched = apply_lmfuse(copy.deepcopy(plain))
    assert len(patched.lmfuse_patches["moe_experts"]) == 2
    torch._dynamo.reset()
    compiled = torch.compile(patched, fullgraph=True, backend="aot_eager")
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            for step in range(3):
                ids = torch.randint(3, 160, (2, 7), generator=torch.Generator().manual_seed(step))
                want = plain(input_ids=ids, labels=ids).loss
                got = compiled(input_ids=ids, labels=ids).loss
                assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    finally:
        torch._dynamo.reset()


def test_the_torch_path_ops_match_their_fakes_for_transposed_weights() -> None:
    """GPT-OSS's experts reach the op as transposed views: the ops' fakes give the strides
    their bodies return (contiguous gradients), which Inductor checks (it failed there)."""
    from lmfuse.moe import ops as moe_ops

    T, H, F, E, k = 5, 8, 4, 3, 2
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    wgu = randn((E, H, 2 * F)).transpose(1, 2)
    wd = randn((E, F, H)).transpose(1, 2)
    settings = ("swiglu", "halves", 0.0, None, False)
    forward = (randn((T, H)), ids, torch.rand(T, k), wgu, wd, None, None, *settings)
    utils = ("test_faketensor", "test_schema")
    for op, args in ((moe_ops._torch_path_op.op, forward),
                     (moe_ops._torch_path_bwd.op, (randn((T, H)), *forward))):
        result = torch.library.opcheck(op, args, test_utils=utils)
        assert set(result.values()) == {"SUCCESS"}, result
