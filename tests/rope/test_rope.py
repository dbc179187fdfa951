"""``lmfuse.apply_rotary_pos_emb`` on both paths (``impl="torch"`` and ``impl="triton"`` in
the interpreter) against ``rotary_reference`` evaluated in float64, and against
transformers' own ``apply_rotary_pos_emb``.

Cases: fp32/fp16/bf16 (and q and k of two dtypes), the attention layout ``[B, H, S, D]`` as
contiguous tensors and as transformers' transposed views, ``[B, S, H, D]``
(``unsqueeze_dim=2``), tables of one batch or per sequence, partial rotary, several head
blocks a token, empty inputs, partial and no gradients, gradients of cos and sin (the
reference path), NaN and inf, strides kept, torch.compile, bad input, ``explain``.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from helpers import assert_close, randn

import lmfuse
from lmfuse import tuning
from lmfuse.rope.reference import rotary_reference

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
IMPLS = ["torch", "triton"]
DTYPES = [pytest.param(d, id=str(d).replace("torch.", "")) for d in (F32, F16, BF16)]


def tables(batch: int, S: int, R: int, dtype=F32, *, same_halves: bool = True):
    """``cos, sin [batch, S, R]`` of random angles (transformers' tables repeat their halves;
    ``same_halves=False`` draws the second half apart, which the op must also take)."""
    half = torch.rand(batch, S, R // 2) * 6.3
    angle = torch.cat((half, half if same_halves else torch.rand(batch, S, R // 2) * 6.3), -1)
    return angle.cos().to(dtype), angle.sin().to(dtype)


def qk(B, S, Hq, Hk, D, dtype, layout):
    """q and k in ``layout``: "bhsd" contiguous, "hf" (transformers' ``view(B, S, H, D)
    .transpose(1, 2)``) or "bshd" (``unsqueeze_dim=2``)."""
    if layout == "bhsd":
        return randn((B, Hq, S, D), dtype), randn((B, Hk, S, D), dtype)
    q, k = randn((B, S, Hq, D), dtype), randn((B, S, Hk, D), dtype)
    return (q.transpose(1, 2), k.transpose(1, 2)) if layout == "hf" else (q, k)


def check(what, q, k, cos, sin, impl, u=1):
    """Output and q's and k's gradients against the float64 reference."""
    leaves = [q.detach().requires_grad_(True), k.detach().requires_grad_(True)]
    out = lmfuse.apply_rotary_pos_emb(*leaves, cos, sin, unsqueeze_dim=u, impl=impl)
    gs = [randn(t.shape, t.dtype) for t in out]
    grads = torch.autograd.grad(out, leaves, gs)
    refs = [t.detach().double().requires_grad_(True) for t in leaves]
    ref = rotary_reference(*refs, cos.double(), sin.double(), u)
    ref_grads = torch.autograd.grad(ref, refs, [g.double() for g in gs])
    table = torch.promote_types(cos.dtype, sin.dtype)
    for name, leaf, o, r, g, rg in zip("qk", leaves, out, ref, grads, ref_grads):
        want = torch.promote_types(leaf.dtype, table)  # (the formula's promotion)
        assert o.dtype == want and o.shape == leaf.shape, f"{what}: {name} {o.dtype}"
        assert_close(o, r, want, f"{what}: {name}")
        assert g.dtype == leaf.dtype
        assert_close(g, rg, leaf.dtype, f"{what}: d{name}")
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout, table_batch, R", [
    pytest.param("bhsd", 2, 16, id="bhsd-per-sequence"),
    pytest.param("hf", 1, 16, id="hf-view-one-table"),
    pytest.param("bshd", 2, 8, id="bshd-partial"),
    pytest.param("hf", 0, 10, id="hf-2d-table-partial"),
])
def test_matches_reference(layout, table_batch, R, dtype, impl) -> None:
    B, S, Hq, Hk, D = 2, 5, 6, 3, 16
    q, k = qk(B, S, Hq, Hk, D, dtype, layout)
    cos, sin = tables(max(table_batch, 1), S, R, same_halves=False)
    if table_batch == 0:
        cos, sin = cos[0], sin[0]
    # (2-D tables gain their dim at 0 for [B, H, S, D]: transformers' unsqueeze_dim)
    u = (2 if layout == "bshd" else 1) - (table_batch == 0)
    check(f"{layout} {dtype} {impl}", q, k, cos, sin, impl, u=u)


@pytest.mark.parametrize("B, S, splits", [(2, 3, 1), (1, 1, 4)], ids=["one-program", "split"])
def test_several_head_blocks_and_mixed_dtypes(B, S, splits) -> None:
    """Tiles lowered to 2 heads: a program loops over a token's head blocks (6 tokens, more
    than the interpreter's 4 SMs), or, with fewer tokens than SMs, the blocks are split
    over programs (block i on program i mod splits); odd head counts, k in float32 with
    bf16 q, a bf16 table."""
    with tuning.overlay("rope", {"tile_elems": 32, "few_tokens_tile_elems": 32,
                                 "num_warps": 1}):
        q, k = randn((B, 7, S, 16), BF16), randn((B, 5, S, 16), F32)
        cos, sin = tables(B, S, 16, BF16)
        check("blocks", q, k, cos, sin, "triton")
        plan = lmfuse.explain(lmfuse.apply_rotary_pos_emb, q, k, cos, sin)
        per = "one program" if splits == 1 else f"{splits} programs"
        assert f"{per} a token" in plan.details["launch"]
        # (a split program has one block of each: its kernel compiles no loop)
        from lmfuse.rope.ops import _config
        assert _config(B * S, 7, 5, 16, 16, False, q.device)[1].loop == (splits == 1)
        assert "query heads 2 at a time, key heads 2" in plan.details["launch"]


@pytest.mark.parametrize("D", [96, 80, 48])
@pytest.mark.parametrize("S", [1, 6], ids=["few-tokens", "tokens"])
def test_head_sizes_that_do_not_divide_the_tile(S, D) -> None:
    """Phi-3's 32 heads of 96 (and 80, 48): a tile's head count is a power of two (the
    kernel's arange) whatever the head size, with few tokens (decoding: the split tiles)
    or more tokens than the interpreter's 4 SMs."""
    q, k = qk(1, S, 32, 8, D, BF16, "hf")
    cos, sin = tables(1, S, D)
    check(f"D={D} S={S}", q, k, cos, sin, "triton")
    with tuning.overlay("rope", {"tile_elems": 32 * D // 3, "few_tokens_tile_elems": 1024}):
        check(f"D={D} S={S}, tiles of {32 * D // 3}", q, k, cos, sin, "triton")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("qk_dtype, table_dtype", [(BF16, F32), (F16, F32), (F32, BF16),
                                                   (BF16, F16)])
def test_mixed_dtypes_promote_as_the_formula(qk_dtype, table_dtype, impl) -> None:
    """16-bit q and k with float32 tables (autocast's mix) give float32 outputs and
    gradients in q's and k's dtypes, as transformers' formula does; float32 q with bf16
    tables float32; bf16 with fp16 float32."""
    q, k = qk(2, 5, 4, 2, 16, qk_dtype, "hf")
    cos, sin = tables(2, 5, 16, table_dtype)
    check(f"{qk_dtype} q, {table_dtype} tables, {impl}", q, k, cos, sin, impl)
    plan = lmfuse.explain(lmfuse.apply_rotary_pos_emb, q, k, cos, sin, impl=impl)
    assert plan.details["outputs"].startswith("float32, float32")
    pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama as llama

    for got, want in zip(lmfuse.apply_rotary_pos_emb(q, k, cos, sin, impl=impl),
                         llama.apply_rotary_pos_emb(q, k, cos, sin)):
        assert got.dtype == want.dtype == F32
        assert_close(got, want, F32 if qk_dtype == F32 else table_dtype, "transformers")


@pytest.mark.parametrize("impl", IMPLS + ["auto"])
def test_equals_transformers(monkeypatch, impl: str) -> None:
    """transformers' Llama ``apply_rotary_pos_emb`` in float32, on its own tables (its
    rotary embedding module's cos and sin) and layout."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama as llama

    if impl == "auto":
        monkeypatch.setenv("TRITON_INTERPRET", "0")  # the CPU default path
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16)
    rotary = llama.LlamaRotaryEmbedding(config)
    x = randn((2, 7, 64))
    position_ids = torch.arange(7)[None].expand(2, 7)
    cos, sin = rotary(x, position_ids)
    q, k = qk(2, 7, 4, 2, 16, F32, "hf")
    want = llama.apply_rotary_pos_emb(q, k, cos, sin)
    got = lmfuse.apply_rotary_pos_emb(q, k, cos, sin, impl=impl)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)


def test_outputs_keep_the_input_strides() -> None:
    """transformers' transposed q gives a transposed output, as its own formula does (the
    attention that follows reads it as it would read theirs)."""
    q, k = qk(2, 5, 4, 2, 16, F32, "hf")
    cos, sin = tables(2, 5, 16)
    qo, ko = lmfuse.apply_rotary_pos_emb(q, k, cos, sin, impl="triton")
    assert qo.stride() == q.stride() and ko.stride() == k.stride()


def _launched(monkeypatch) -> list[str]:
    """The names of the rotary kernels launched from here on (the launch form chosen)."""
    from lmfuse.rope import ops

    names: list[str] = []
    real = ops._kernels

    class Recording:
        def __getattr__(self, name):
            names.append(name)
            return getattr(real(), name)

    monkeypatch.setattr(ops, "_kernels", Recording)
    return names


@pytest.mark.parametrize("q_layout, k_layout, tables_of, S, dense", [
    ("hf", "hf", "batch", 5, True),  # transformers' transposed views: tokens outer
    ("bhsd", "bhsd", "one", 5, True),  # heads outer, one [1, S, R] table
    ("bshd", "bshd", "2d", 5, True),  # [B, S, H, D], a [S, R] table
    ("hf", "bhsd", "batch", 5, True),  # q and k in different orders
    ("hf", "hf", "batch", 1, True),  # a decode step (size-1 dims)
    # slices of a fused qkv: strided (their gradients, contiguous here, dense)
    ("qkv", "qkv", "batch", 5, (False, True)),
    ("hf", "hf", "strided", 5, False),  # tables not contiguous
])
def test_dense_and_strided_launches(monkeypatch, q_layout, k_layout, tables_of, S, dense
                                    ) -> None:
    """Dense q and k (either order in memory, each its own) with contiguous tables take the
    launch whose strides follow from the shapes; anything else the strided one; both
    give the reference's values, forward and backward (``dense``: of the forward's launch
    and the backward's)."""
    B, Hq, Hk, D = 2, 4, 2, 16
    u = 2 if q_layout == "bshd" else 1
    if q_layout == "qkv":
        qkv = randn((B, Hq + 2 * Hk, S, D), BF16)
        q, k = qkv[:, :Hq], qkv[:, Hq:Hq + Hk]
    else:
        q = qk(B, S, Hq, Hk, D, BF16, q_layout)[0]
        k = qk(B, S, Hq, Hk, D, BF16, k_layout)[1]
    cos, sin = tables(B if tables_of in ("batch", "strided") else 1, S, D)
    if tables_of == "2d":
        cos, sin = cos[0], sin[0]
        u -= 1
    elif tables_of == "strided":
        cos, sin = (torch.cat((t, t), -1)[..., :D] for t in (cos, sin))  # (rows 2D apart)
        assert not cos.is_contiguous()
    launched = _launched(monkeypatch)
    check(f"{q_layout}/{k_layout} {tables_of} S={S}", q, k, cos, sin, "triton", u=u)
    forms = dense if isinstance(dense, tuple) else (dense, dense)
    assert launched == ["rope_dense_kernel" if d else "rope_kernel" for d in forms], launched


def test_a_head_stride_past_32_bits_takes_the_strided_launch(monkeypatch) -> None:
    """The dense launch's heads-outer head stride ``S * D`` is a 32-bit product: from 2^31
    (lowered here to S * D) the strided launch runs, with the reference's values."""
    from lmfuse.rope import ops

    q, k = qk(2, 5, 4, 2, 16, BF16, "bhsd")
    cos, sin = tables(2, 5, 16)
    monkeypatch.setattr(ops, "_DENSE_HEAD_STRIDE_LIMIT", 5 * 16)
    launched = _launched(monkeypatch)
    check("past the limit", q, k, cos, sin, "triton")
    assert launched == ["rope_kernel", "rope_kernel"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", [(0, 4, 5, 16), (2, 4, 0, 16), (2, 0, 5, 16)],
                         ids=["B0", "S0", "H0"])
def test_empty(shape, impl: str) -> None:
    q = torch.zeros(shape, requires_grad=True)
    k = torch.zeros(shape, requires_grad=True)
    cos, sin = tables(shape[0] or 1, shape[2], 16)
    u = 1
    if shape[0] == 0:
        cos, sin, u = cos[0], sin[0], 0
    qo, ko = lmfuse.apply_rotary_pos_emb(q, k, cos, sin, u, impl=impl)
    assert qo.shape == ko.shape == shape
    dq, dk = torch.autograd.grad((qo, ko), (q, k), (torch.ones(shape), torch.ones(shape)))
    assert dq.shape == dk.shape == shape


@pytest.mark.parametrize("impl", IMPLS)
def test_partial_and_no_gradients(impl: str) -> None:
    q, k = qk(2, 5, 4, 2, 16, F32, "bhsd")
    cos, sin = tables(2, 5, 16)
    ref_q, ref_k = rotary_reference(q, k, cos, sin)
    kl = k.clone().requires_grad_(True)
    qo, ko = lmfuse.apply_rotary_pos_emb(q, kl, cos, sin, impl=impl)
    assert not qo.requires_grad and ko.requires_grad
    (dk,) = torch.autograd.grad(ko.sum(), [kl])  # an expanded upstream gradient
    k2 = k.double().requires_grad_(True)
    (want,) = torch.autograd.grad(rotary_reference(q.double(), k2, cos.double(),
                                                   sin.double())[1].sum(), [k2])
    assert_close(dk, want, F32, "dk alone")
    with torch.no_grad():
        qo, ko = lmfuse.apply_rotary_pos_emb(q.requires_grad_(True), kl, cos, sin, impl=impl)
    assert not qo.requires_grad and torch.allclose(qo, ref_q) and torch.allclose(ko, ref_k)


def test_table_gradients_take_the_reference() -> None:
    """cos and sin that need a gradient: the formula through autograd, theirs included."""
    q, k = qk(2, 5, 4, 2, 16, F32, "bhsd")
    cos, sin = (t.requires_grad_(True) for t in tables(2, 5, 16))
    out = lmfuse.apply_rotary_pos_emb(q, k, cos, sin)
    got = torch.autograd.grad(sum(t.sum() for t in out), [cos, sin])
    ref = rotary_reference(q, k, cos, sin)
    want = torch.autograd.grad(sum(t.sum() for t in ref), [cos, sin])
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("impl", IMPLS)
def test_nan_and_inf_as_the_formula(impl: str) -> None:
    q, k = qk(1, 3, 2, 1, 8, F32, "bhsd")
    q[0, 0, 0, 1] = math.nan
    k[0, 0, 1, 6] = math.inf
    cos, sin = tables(1, 3, 8)
    sin[0, 1, 2] = 0.0  # inf * 0: NaN where the inf meets it
    got = lmfuse.apply_rotary_pos_emb(q, k, cos, sin, impl=impl)
    want = rotary_reference(q, k, cos, sin)
    for a, b in zip(got, want):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf())
        fin = b.isfinite()
        assert torch.allclose(a[fin], b[fin], rtol=1e-6, atol=1e-6)


def test_second_derivatives_raise() -> None:
    q, k = (t.requires_grad_(True) for t in qk(1, 3, 2, 1, 8, F32, "bhsd"))
    cos, sin = tables(1, 3, 8)
    qo, _ = lmfuse.apply_rotary_pos_emb(q, k, cos, sin, impl="triton")
    with pytest.raises(RuntimeError, match="apply_rotary_pos_emb: second derivatives"):
        torch.autograd.grad(qo.square().sum(), [q], create_graph=True)


def test_fullgraph_compile_holds_the_custom_op() -> None:
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    q, k = (t.requires_grad_(True) for t in qk(2, 5, 4, 2, 16, F32, "hf"))
    cos, sin = tables(2, 5, 16)
    seen: list[str] = []

    def record(gm, inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes)
        return make_boxed_func(gm.forward)

    def call(q, k):
        qo, ko = lmfuse.apply_rotary_pos_emb(q, k, cos, sin, impl="triton")
        return qo * 2.0, ko

    compiled = torch.compile(call, fullgraph=True,
                             backend=aot_autograd(fw_compiler=record, bw_compiler=record))
    results = []
    for fn in (call, compiled):
        out = fn(q, k)
        results.append((*out, *torch.autograd.grad(out, [q, k], [torch.ones_like(t)
                                                                 for t in out])))
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    assert seen.count("lmfuse.rotary.default") == 2  # forward and backward


BAD = [  # (id, changed arguments, error, words the message must contain)
    ("q-3d", dict(q=randn((2, 4, 16))), ValueError, r"\bq\b 4-D 3-D"),
    ("q-int", dict(q=torch.ones(2, 4, 5, 16, dtype=torch.int32)), TypeError, r"\bq\b int32"),
    ("k-tokens", dict(k=randn((2, 2, 6, 16))), ValueError, r"\bk\b tokens \(2, 2, 6, 16\)"),
    ("k-head-size", dict(k=randn((2, 2, 5, 8))), ValueError, r"\bk\b head size"),
    ("unsqueeze", dict(unsqueeze_dim=3), ValueError, r"unsqueeze_dim 3-D 1 or 2 got 3"),
    ("unsqueeze-batch", dict(unsqueeze_dim=0), ValueError, r"unsqueeze_dim heads got 0"),
    ("unsqueeze-bool", dict(unsqueeze_dim=True), TypeError, r"unsqueeze_dim int bool"),
    ("unsqueeze-float", dict(unsqueeze_dim=1.0), TypeError, r"unsqueeze_dim int float"),
    ("cos-sin-shapes", dict(sin=randn((2, 5, 8))), ValueError, r"cos sin one shape"),
    ("cos-odd", dict(cos=randn((2, 5, 15)), sin=randn((2, 5, 15))), ValueError,
     r"even \(2, 5, 15\)"),
    ("cos-wide", dict(cos=randn((2, 5, 18)), sin=randn((2, 5, 18))), ValueError, r"at most 16"),
    ("cos-tokens", dict(cos=randn((2, 4, 16)), sin=randn((2, 4, 16))), ValueError, r"S = 5"),
    ("cos-batch", dict(cos=randn((3, 5, 16)), sin=randn((3, 5, 16))), ValueError, r"B = 2"),
    ("cos-4d", dict(cos=randn((1, 2, 5, 16)), sin=randn((1, 2, 5, 16))), ValueError,
     r"cos 2-D 3-D"),
    ("device", dict(cos=torch.ones(2, 5, 16, device="meta"),
                    sin=torch.ones(2, 5, 16, device="meta")), ValueError, r"cos meta cpu"),
    ("impl", dict(impl="cuda"), ValueError, r"impl 'cuda'"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("change, error, message", [pytest.param(*b[1:], id=b[0]) for b in BAD])
def test_bad_input_raises(change: dict, error, message: str, impl: str) -> None:
    args = dict(q=randn((2, 4, 5, 16)), k=randn((2, 2, 5, 16)), cos=randn((2, 5, 16)),
                sin=randn((2, 5, 16)), impl=impl)
    args.update(change)
    pattern = r"(?s)^apply_rotary_pos_emb: " + "".join(f"(?=.*{w})" for w in message.split())
    with pytest.raises(error, match=pattern):
        lmfuse.apply_rotary_pos_emb(**args)
    with pytest.raises(error, match=pattern):
        lmfuse.explain(lmfuse.apply_rotary_pos_emb, **args)


def test_signature_explain_and_float64() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf

    ours = inspect.signature(lmfuse.apply_rotary_pos_emb).parameters
    theirs = inspect.signature(hf).parameters
    assert [(p.name, p.default) for p in list(ours.values())[:len(theirs)]] == [
        (p.name, p.default) for p in theirs.values()]
    assert "apply_rotary_pos_emb" in lmfuse.__all__
    q, k = qk(2, 5, 4, 2, 16, F64, "bhsd")
    cos, sin = tables(2, 5, 8, F64)
    plan = lmfuse.explain("apply_rotary_pos_emb", q, k, cos, sin)
    assert plan.impl == "torch" and "the first 8 of 16" in plan.details["rotated"]
    assert lmfuse.apply_rotary_pos_emb(q, k, cos, sin)[0].dtype == F64
    with pytest.raises(TypeError, match="float64"):
        lmfuse.apply_rotary_pos_emb(q, k, cos, sin, impl="triton")


@pytest.mark.parametrize("table", ["cos", "sin"])
def test_a_float64_table_takes_the_reference(table: str) -> None:
    """Either table in float64 is what a float64 input is: the torch path (``auto``), a
    TypeError for ``impl="triton"``."""
    q, k = qk(1, 3, 2, 1, 8, F32, "bhsd")
    tabs = dict(zip(("cos", "sin"), tables(1, 3, 8)))
    tabs[table] = tabs[table].double()
    assert lmfuse.explain("apply_rotary_pos_emb", q, k, **tabs).impl == "torch"
    with pytest.raises(TypeError, match=f"apply_rotary_pos_emb: .*{table}.*float64"):
        lmfuse.apply_rotary_pos_emb(q, k, **tabs, impl="triton")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("table_dims, u, layout", [
    (2, 0, "hf"), (2, -3, "hf"), (2, 1, "bshd"), (2, -2, "bshd"),
    (3, 1, "hf"), (3, -3, "hf"), (3, 2, "bshd"), (3, -2, "bshd")])
def test_unsqueeze_dim_means_what_it_means_in_transformers(table_dims, u, layout, impl):
    """The tables gain their dim at ``unsqueeze_dim`` and broadcast against q, as in
    transformers (Pixtral calls ``[S, R]`` tables with 0): the function's results exactly,
    with 4 heads and 4 tokens (where a wrong reading would still broadcast)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf

    q, k = qk(2, 4, 4, 4, 8, F32, layout)
    cos, sin = tables(2, 4, 8)
    if table_dims == 2:
        cos, sin = cos[0], sin[0]
    got = lmfuse.apply_rotary_pos_emb(q, k, cos, sin, u, impl=impl)
    for a, b in zip(got, hf(q, k, cos, sin, u)):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="unsqueeze_dim must put the heads"):
        lmfuse.apply_rotary_pos_emb(q, k, cos, sin, u + (2 if u >= 0 else -2), impl=impl)


def test_explain_says_the_tables_gradient_takes_the_reference() -> None:
    q, k = qk(1, 3, 2, 1, 8, F32, "bhsd")
    cos, sin = tables(1, 3, 8)
    plan = lmfuse.explain("apply_rotary_pos_emb", q, k, cos.requires_grad_(True), sin,
                          impl="triton")
    assert plan.impl == "torch" and "cos or sin needs a gradient" in plan.reason
    assert "launch" not in plan.details
