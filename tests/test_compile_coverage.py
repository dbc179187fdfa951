"""``torch.compile(fullgraph=True)`` of every public op, and a table proving none is missed.

The family test files compile most ops already (see ``COMPILE_TESTS``); this file compiles
the rest: ``merge_attention_states``, the ``FusedScaleMaskSoftmax`` and ``FusedMLP``
modules, ``DecodeAttentionBlock``, a ``PagedKVCache`` step, and the functional names of
``lmfuse.megatron``. Each compiled call (``backend="aot_eager"``: the graph is what is
tested, not Inductor's code generation) must trace without a graph break and give the
eager call's outputs and gradients exactly: both run the same kernels (the Triton ones,
through ``TRITON_INTERPRET=1``) on the same data, compiled code reaching them through the
``torch.library`` custom ops.

``test_every_public_op_has_a_compile_test`` lists ``lmfuse.__all__`` and
``lmfuse.megatron.__all__``: a name added there without an entry in ``COMPILE_TESTS`` (or,
if it is no op, in ``NOT_OPS`` with the reason) fails it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from helpers import randn

import lmfuse
from lmfuse import megatron

TESTS = Path(__file__).resolve().parent
HERE = "tests/test_compile_coverage.py"

# public name -> the tests that compile it with fullgraph=True ("path::function").
COMPILE_TESTS: dict[str, list[str]] = {
    "fused_softmax": ["tests/softmax/test_compile.py::test_compile_fullgraph_matches_eager"],
    "FusedScaleMaskSoftmax": [f"{HERE}::test_fused_scale_mask_softmax_module"],
    "cross_entropy": ["tests/cross_entropy/test_compile.py::test_compile_fullgraph_matches_eager"],
    "linear_cross_entropy": [
        "tests/cross_entropy/test_compile.py::test_linear_compile_fullgraph_matches_eager"],
    **{name: ["tests/activations/test_compile.py::test_fullgraph_compile_matches_eager"]
       for name in ("bias_gelu", "swiglu", "geglu", "quick_geglu", "squared_relu",
                    "weighted_swiglu", "weighted_quick_geglu", "weighted_squared_relu")},
    "FusedMLP": [f"{HERE}::test_fused_mlp_module"],
    "decode_attention": ["tests/attention/test_ops.py::test_compile_fullgraph_decode_and_append"],
    "kv_cache_append": ["tests/attention/test_ops.py::test_compile_fullgraph_decode_and_append"],
    "merge_attention_states": [f"{HERE}::test_merge_attention_states"],
    "PagedKVCache": [f"{HERE}::test_paged_kv_cache_step"],
    "DecodeAttentionBlock": [f"{HERE}::test_decode_attention_block"],
    "rms_norm": ["tests/norm/test_compile.py::test_fullgraph_compile_matches_eager"],
    "moe_experts": ["tests/moe/test_compile.py::test_fullgraph_compile_matches_eager"],
    "RMSNorm": ["tests/norm/test_compile.py::test_module_graph_holds_the_custom_ops"],
    "layer_norm": ["tests/norm/test_layer_norm.py::test_fullgraph_compile_holds_the_custom_ops"],
    "LayerNorm": ["tests/norm/test_layer_norm.py::test_module_compiles_whole"],
    "apply_rotary_pos_emb": ["tests/rope/test_rope.py::test_fullgraph_compile_holds_the_custom_op"],
    # lmfuse.megatron
    **{f"megatron.{name}": [f"{HERE}::test_megatron_functional"]
       for name in ("scaled_upper_triang_masked_softmax", "scaled_masked_softmax",
                    "scaled_softmax", "fused_vocab_parallel_cross_entropy",
                    "vocab_parallel_cross_entropy", "bias_gelu_impl", "bias_swiglu_impl",
                    "bias_geglu_impl", "weighted_bias_swiglu_impl",
                    "weighted_bias_quick_geglu_impl", "weighted_squared_relu_impl",
                    "linear_cross_entropy")},
    "megatron.FusedScaleMaskSoftmax": [f"{HERE}::test_fused_scale_mask_softmax_module"],
}

# Public names that are not ops, and why no compile test applies.
NOT_OPS: dict[str, str] = {
    "__version__": "a string",
    "AttnMaskType": "an enum (FusedScaleMaskSoftmax's argument)",
    "megatron.AttnMaskType": "an enum (FusedScaleMaskSoftmax's argument)",
    "KVCacheFullError": "an exception class",
    "Plan": "the record explain() returns",
    "set_checks": "a switch of input checks (no tensors)",
    "megatron.patch": "patches a Megatron-Core model's modules (the ops it calls have their own "
                      "compile tests)",
    "explain": "host-side introspection: says which path a call takes, computes nothing",
    "plan_sharding": "host-side arithmetic on shapes (the parallel-decode planner)",
}


def _public_names() -> list[str]:
    return list(lmfuse.__all__) + [f"megatron.{n}" for n in megatron.__all__]


def _defines(path: Path, function: str) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(node, ast.FunctionDef) and node.name == function
               for node in tree.body)


def test_every_public_op_has_a_compile_test() -> None:
    names = _public_names()
    missing = [n for n in names if n not in COMPILE_TESTS and n not in NOT_OPS]
    assert not missing, (f"public names without a torch.compile(fullgraph=True) test: "
                         f"{missing}; add one and list it in COMPILE_TESTS (or, for what is "
                         f"no op, in NOT_OPS with the reason)")
    stale = sorted((set(COMPILE_TESTS) | set(NOT_OPS)) - set(names))
    assert not stale, f"entries for names that are not public (any more): {stale}"
    for name, tests in COMPILE_TESTS.items():
        assert tests, name
        for test in tests:
            path, function = test.split("::")
            file = TESTS.parent / path
            assert file.is_file(), f"{name}: {path} does not exist"
            assert _defines(file, function), f"{name}: {path} defines no {function}"
            text = file.read_text()
            assert "fullgraph=True" in text, f"{name}: {path} compiles nothing fullgraph"
            assert name.split(".")[-1] in text, f"{name}: {path} never names it"


# --- the ops compiled here -----------------------------------------------------------------


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="aot_eager")


def _grads(fn, args: list[torch.Tensor], params: list[torch.Tensor] = ()) -> tuple:
    """``fn(*args)`` and the gradients, with respect to the ``args`` that require one and
    ``params``, of its outputs times fixed random weights, summed."""
    out = fn(*args)
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(7)
    total = sum((o.float() * torch.randn(o.shape, generator=gen)).sum() for o in outs)
    return outs + torch.autograd.grad(total, [a for a in args if a.requires_grad] + [*params])


def _assert_same(got: tuple, want: tuple, what: str) -> None:
    assert len(got) == len(want), what
    for k, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{what}: result {k} differs from eager"


def test_merge_attention_states() -> None:
    outs, lses = randn((3, 2, 5, 16)), 3 * randn((3, 2, 5))
    lses[0, 1, 2] = float("-inf")  # a partial that saw no key
    lses[:, 0, 4] = float("-inf")  # a row where no partial did

    def merge(o, lse):
        return lmfuse.merge_attention_states(o, lse, impl="triton")

    _assert_same(_compiled(merge)(outs, lses), merge(outs, lses), "merge_attention_states")


def test_fused_scale_mask_softmax_module() -> None:
    """Lmfuse's module and Megatron's name for it (the same class) with a padding mask,
    the causal band and a learnable sink."""
    assert megatron.FusedScaleMaskSoftmax is lmfuse.FusedScaleMaskSoftmax
    module = lmfuse.FusedScaleMaskSoftmax(False, False, lmfuse.AttnMaskType.padding_causal,
                                          True, None, True, 0.5)
    x, offset = randn((2, 3, 5, 7)), randn((3,))
    mask = torch.rand(2, 1, 1, 7) < 0.3
    results = []
    for fn in (module, _compiled(module)):
        leaves = [x.clone().requires_grad_(True), mask, offset.clone().requires_grad_(True)]
        results.append(_grads(fn, leaves))
    _assert_same(results[1], results[0], "FusedScaleMaskSoftmax")


@pytest.mark.parametrize("activation, weighted", [("swiglu", True), ("geglu", False),
                                                  ("squared_relu", False)])
def test_fused_mlp_module(activation: str, weighted: bool) -> None:
    """fc1 -> the fused activation -> fc2, gradients for the input, the routing weights and
    every parameter."""
    mlp = lmfuse.FusedMLP(16, 24, activation)
    x = randn((2, 3, 16))
    weights = torch.rand(6, 1) if weighted else None
    params = list(mlp.parameters())
    results = []
    for fn in (mlp, _compiled(mlp)):
        leaves = [x.clone().requires_grad_(True)]
        if weighted:
            leaves.append(weights.clone().requires_grad_(True))
        results.append(_grads(fn, leaves, params))
    _assert_same(results[1], results[0], f"FusedMLP({activation})")


def _megatron_cases() -> list:
    s, b, v, f = 3, 2, 40, 12
    target = torch.randint(0, v, (s, b))
    target[0, 1] = -100
    mask = torch.rand(2, 1, 5, 7) < 0.3
    return [
        ("scaled_upper_triang_masked_softmax",
         lambda x: megatron.scaled_upper_triang_masked_softmax(x, 0.5), [randn((6, 5, 5))]),
        ("scaled_masked_softmax", lambda x: megatron.scaled_masked_softmax(x, mask, 0.5),
         [randn((2, 3, 5, 7))]),
        ("scaled_softmax", lambda x: megatron.scaled_softmax(x, 0.5), [randn((6, 5, 7))]),
        ("fused_vocab_parallel_cross_entropy",
         lambda x: megatron.fused_vocab_parallel_cross_entropy(x, target), [randn((s, b, v))]),
        ("vocab_parallel_cross_entropy",
         lambda x: megatron.vocab_parallel_cross_entropy(x, target, 0.1), [randn((s, b, v))]),
        ("bias_gelu_impl", megatron.bias_gelu_impl, [randn((s, b, f)), randn((f,))]),
        ("bias_swiglu_impl", megatron.bias_swiglu_impl, [randn((s * b, 2 * f)), randn((2 * f,))]),
        ("bias_geglu_impl", megatron.bias_geglu_impl, [randn((s, b, 2 * f)), randn((2 * f,))]),
        ("weighted_bias_swiglu_impl", megatron.weighted_bias_swiglu_impl,
         [randn((s * b, 2 * f)), randn((2 * f,)), torch.rand(s * b, 1)]),
        ("weighted_bias_quick_geglu_impl",
         lambda x, bias, w: megatron.weighted_bias_quick_geglu_impl(
             x, bias, w, linear_offset=1.0, clamp_value=2.0),
         [randn((s * b, 2 * f)), randn((2 * f,)), torch.rand(s * b, 1)]),
        ("weighted_squared_relu_impl", megatron.weighted_squared_relu_impl,
         [randn((s * b, f)), torch.rand(s * b, 1)]),
        ("linear_cross_entropy",
         lambda h, w: megatron.linear_cross_entropy(h, w, target, reduction="none"),
         [randn((s, b, f)), randn((v, f))]),
    ]


@pytest.mark.parametrize("name", [c[0] for c in _megatron_cases()])
def test_megatron_functional(name: str) -> None:
    _, fn, inputs = next(c for c in _megatron_cases() if c[0] == name)
    results = []
    for f in (fn, _compiled(fn)):
        results.append(_grads(f, [t.clone().requires_grad_(True) for t in inputs]))
    _assert_same(results[1], results[0], f"megatron.{name}")


def test_paged_kv_cache_step() -> None:
    """A decode step over a ``PagedKVCache`` (its ``append`` and ``attention`` on a step from
    ``reserve``, which stays on the host, outside the graph) in one compiled function."""
    pools = []
    for _ in range(2):
        pool = lmfuse.PagedKVCache(8, 4, 2, 16, torch.float32, "cpu")
        seqs = [pool.add_sequence() for _ in range(2)]
        pool.reserve(seqs, [5, 2])
        with torch.no_grad():
            for c in pool.k_caches + pool.v_caches:
                c.copy_(randn(c.shape))
        pools.append((pool, seqs, pool.reserve(seqs, 1, max_blocks=3)))
    # the same contents in both pools
    pools[1][0].k_caches[0].copy_(pools[0][0].k_caches[0])
    pools[1][0].v_caches[0].copy_(pools[0][0].v_caches[0])
    q, k_new, v_new = randn((2, 1, 4, 16)), randn((2, 1, 2, 16)), randn((2, 1, 2, 16))

    def step_of(pool, seqs):
        def step(q, k_new, v_new, st):
            pool.append(seqs, k_new, v_new, step=st, impl="triton")
            return pool.attention(q, st, return_lse=True, impl="triton")
        return step

    eager_pool, seqs, st = pools[0]
    want = step_of(eager_pool, seqs)(q, k_new, v_new, st)
    comp_pool, seqs, st = pools[1]
    got = _compiled(step_of(comp_pool, seqs))(q, k_new, v_new, st)
    _assert_same(got, want, "PagedKVCache step")
    assert torch.equal(comp_pool.k_caches[0], eager_pool.k_caches[0])
    assert torch.equal(comp_pool.v_caches[0], eager_pool.v_caches[0])


@pytest.mark.parametrize("impl", ["auto", "torch"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_attention_block(paged: bool, impl: str) -> None:
    """One decode step of the block (RMSNorm, QKV GEMM, the fused q/k-norm + rope + append
    custom op, decode attention, out-projection) compiled whole, under ``no_grad`` (the
    Triton path is inference-only); output and the cache rows it wrote equal eager's. The
    reference path (``impl="torch"``, which reads the lengths on the host) too: one opaque
    op, as is the fused stage's alone."""
    blk = lmfuse.DecodeAttentionBlock(32, 4, 2, 16, qk_norm=True, sinks=True, window_size=5,
                                      impl=impl)
    with torch.no_grad():
        blk.sinks.copy_(randn((4,)))
    B, S = 2, 12
    k, v = randn((B, S, 2, 16)), randn((B, S, 2, 16))
    lens = torch.tensor([7, 3], dtype=torch.int32)
    table = None
    if paged:  # blocks of 4 rows: sequence 0 in blocks 2, 0, 5; sequence 1 in 4, 1, 3
        table = torch.tensor([[2, 0, 5], [4, 1, 3]], dtype=torch.int32)
        pool_k, pool_v = torch.empty(6, 4, 2, 16), torch.empty(6, 4, 2, 16)
        for b in range(B):
            for n in range(3):
                pool_k[table[b, n]] = k[b, 4 * n:4 * n + 4]
                pool_v[table[b, n]] = v[b, 4 * n:4 * n + 4]
        k, v = pool_k, pool_v
    x = randn((B, 2, 32))

    def step(x, k, v, lens):
        return blk(x, k, v, lens, block_table=table)

    k0 = k.clone()
    with torch.no_grad():
        k_eager, v_eager = k.clone(), v.clone()
        want = step(x, k_eager, v_eager, lens)
        got = _compiled(step)(x, k, v, lens)
    assert torch.equal(got, want)
    assert torch.equal(k, k_eager) and torch.equal(v, v_eager)
    assert not torch.equal(k, k0), "the compiled step wrote no keys into the cache"
    if impl == "torch":  # the fused stage alone
        from lmfuse.attention.block import qk_norm_rope_append, rope_inv_freq

        qkv = randn((B, 2, (4 + 2 * 2) * 16))

        def stage(qkv, k, v, lens):
            return qk_norm_rope_append(qkv, k, v, lens, num_heads=4, num_kv_heads=2,
                                       q_norm_weight=blk.q_norm_weight,
                                       k_norm_weight=blk.k_norm_weight,
                                       inv_freq=rope_inv_freq(16, 10000.0),
                                       block_table=table, impl="torch")

        def bare(qkv, k, v, lens):  # (no norm, no rotary: the reference's q is qkv's view)
            return qk_norm_rope_append(qkv, k, v, lens, num_heads=4, num_kv_heads=2,
                                       block_table=table, impl="torch") * 2

        for fn in (stage, bare):
            with torch.no_grad():
                k_eager, v_eager = k.clone(), v.clone()
                want = fn(qkv, k_eager, v_eager, lens + 2)
                got = _compiled(fn)(qkv, k, v, lens + 2)
            assert torch.equal(got, want)
            assert torch.equal(k, k_eager) and torch.equal(v, v_eager)



# Float options that change between compiled calls become symbols in the graph (automatic
# dynamic), as every shape does with dynamic=True: the options' checks compare them
# (math.isfinite of a symbol broke the graph). name -> (inputs of n rows, the call).
DYNAMIC = {
    "fused_softmax": (lambda n: (randn((2, 2, n, n), requires_grad=True),),
                      lambda x, a, impl: lmfuse.fused_softmax(x, scale=a, causal=True,
                                                              impl=impl)),
    "cross_entropy": (lambda n: (randn((n, 11), requires_grad=True), torch.arange(n) % 11),
                      lambda x, t, a, impl: lmfuse.cross_entropy(
                          x, t, label_smoothing=a, z_loss=a, impl=impl)),
    "quick_geglu": (lambda n: (randn((n, 16), requires_grad=True),),
                    lambda x, a, impl: lmfuse.quick_geglu(x, linear_offset=a, clamp_value=7.0,
                                                          impl=impl)),
    "rms_norm": (lambda n: (randn((n, 8), requires_grad=True),
                            torch.rand(8, requires_grad=True)),
                 lambda x, w, a, impl: lmfuse.rms_norm(x, w, eps=a, impl=impl)),
}


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("name", sorted(DYNAMIC))
def test_changing_float_options_and_dynamic_shapes(name: str, impl: str) -> None:
    make, fn = DYNAMIC[name]
    for dynamic in (None, True):
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=dynamic)
        for n, a in ((4, 0.125), (6, 0.25), (5, 0.5)):
            inputs = make(n)
            got, want = compiled(*inputs, a, impl), fn(*inputs, a, impl)
            assert torch.allclose(got, want, rtol=1e-6, atol=1e-6), (name, dynamic, n, a)
            leaves = [t for t in inputs if t.requires_grad]
            for g, w in zip(torch.autograd.grad(got.sum(), leaves),
                            torch.autograd.grad(want.sum(), leaves)):
                assert torch.allclose(g, w, rtol=1e-5, atol=1e-6), (name, dynamic, n, a)
