"""``moe_experts(..., fp8_input_store=True)`` on both paths (``impl="torch"``, and
``impl="triton"`` in the interpreter): the gate/up output ``h [T k, K2]`` kept for backward
as float8_e4m3fn.

The oracle (:func:`rounded_reference`) is the reference's per-expert loop in float32 with
``h`` passed through float8 (saturated at +-448, NaN kept) on its way to the activation and
the identity as that rounding's gradient: its gradients are those of the rounded ``h``,
which the option promises (the backward recomputes the activation, the down weight's and
the router weights' gradients from the rounded ``h``). Cases: every activation (GPT-OSS's
clamped Quick-GEGLU with its offset) in both layouts with biases, fp32 on both paths and
bf16 on the Triton path (h rounded once, from the float32 accumulator); the forward is
bitwise the default's; NaN and +-inf in hidden; what autograd keeps (its dtype and bytes,
through saved-tensor hooks, and its values); no gradient, no tokens; bad values.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import pytest
import torch
from helpers import MOE_ACT_CASES, assert_close, randn

import lmfuse
from lmfuse.moe.reference import expert_activation, moe_experts_reference

F32, BF16 = torch.float32, torch.bfloat16
FP8 = torch.float8_e4m3fn
IMPLS = ["torch", "triton"]
NAMES = ("hidden", "router_weights", "w_gate_up", "w_down", "gate_up_bias", "down_bias")
ACT_CASES = MOE_ACT_CASES


def make(T: int, H: int, F: int, E: int, k: int, activation: str = "swiglu", *,
         dtype: torch.dtype = F32) -> dict[str, Any]:
    """Inputs with biases in ``dtype``, leaves requiring grad; each token's ``k`` experts
    distinct (test_ops.py's ``make``)."""
    K2 = F if activation == "squared_relu" else 2 * F
    ids = (torch.stack([torch.randperm(E)[:k] for _ in range(T)]) if T
           else torch.zeros(0, k, dtype=torch.int64))
    return dict(
        hidden=randn((T, H), dtype, requires_grad=True),
        expert_ids=ids,
        router_weights=(torch.rand(T, k) + 0.1).to(dtype).requires_grad_(True),
        w_gate_up=randn((E, K2, H), dtype, scale=H ** -0.5, requires_grad=True),
        w_down=randn((E, H, F), dtype, scale=F ** -0.5, requires_grad=True),
        gate_up_bias=randn((E, K2), dtype, scale=0.3, requires_grad=True),
        down_bias=randn((E, H), dtype, scale=0.3, requires_grad=True),
    )


def leaves(inp: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    return [(n, inp[n]) for n in NAMES if inp[n] is not None and inp[n].requires_grad]


def call(fn, inp: dict[str, Any], **kw) -> torch.Tensor:
    return fn(inp["hidden"], inp["expert_ids"], inp["router_weights"], inp["w_gate_up"],
              inp["w_down"], gate_up_bias=inp["gate_up_bias"], down_bias=inp["down_bias"],
              **kw)


def through_fp8(h: torch.Tensor) -> torch.Tensor:
    """``h`` as float8_e4m3fn keeps it (saturated at +-448, NaN kept), in h's dtype."""
    return h.clamp(-448.0, 448.0).to(FP8).to(h.dtype)


class _ThroughFp8(torch.autograd.Function):
    """:func:`through_fp8` forward, the identity backward: downstream of it everything sees
    the rounded value, and the gradient reaching ``h`` is the one taken at that value."""

    @staticmethod
    def forward(ctx, h):
        return through_fp8(h)

    @staticmethod
    def backward(ctx, g):
        return g


def rounded_reference(hidden, expert_ids, router_weights, w_gate_up, w_down,
                      gate_up_bias=None, down_bias=None, *, activation="swiglu",
                      linear_offset=0.0, clamp_value=None,
                      gate_up_layout="halves") -> torch.Tensor:
    """``moe_experts_reference``'s loop in float32, ``h`` rounded through float8 before the
    activation: differentiate it for the gradients ``fp8_input_store`` gives."""
    T, k = expert_ids.shape
    x_all = hidden.float()
    out = torch.zeros(T, hidden.shape[1])
    for e in range(w_gate_up.shape[0]):
        token, slot = (expert_ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        h = x_all[token] @ w_gate_up[e].float().T
        if gate_up_bias is not None:
            h = h + gate_up_bias[e].float()
        a = expert_activation(_ThroughFp8.apply(h), activation=activation,
                              linear_offset=linear_offset, clamp_value=clamp_value,
                              gate_up_layout=gate_up_layout)
        y = a @ w_down[e].float().T
        if down_bias is not None:
            y = y + down_bias[e].float()
        out = out.index_add(0, token, y * router_weights[token, slot].float()[:, None])
    return out


def f32_leaves(inp: dict[str, Any]) -> dict[str, Any]:
    return {n: (v.detach().float().requires_grad_(v.requires_grad)
                if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for n, v in inp.items()}


def sorted_h(inp: dict[str, Any]) -> torch.Tensor:
    """The gate/up output ``[T k, K2]`` in float64, rows in the kernels' order (pairs
    sorted by expert, stably)."""
    ids = inp["expert_ids"]
    k = ids.shape[1]
    perm = torch.argsort(ids.reshape(-1), stable=True)
    token, expert = perm // k, ids.reshape(-1)[perm]
    x = inp["hidden"].detach().double()[token]
    h = torch.einsum("rh,rnh->rn", x, inp["w_gate_up"].detach().double()[expert])
    if inp["gate_up_bias"] is not None:
        h = h + inp["gate_up_bias"].detach().double()[expert]
    return h


def saved_tensors(inp: dict[str, Any], impl: str, **kw):
    """``(output, [every tensor autograd saved for the call's backward])``."""
    seen = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = call(lmfuse.moe_experts, inp, impl=impl, **kw)
    return out, seen


# --- forward and gradients ------------------------------------------------------------------


def oracle_grads(inp: dict[str, Any], g: torch.Tensor, fn=None, **kw) -> list[torch.Tensor]:
    """The gradients of ``fn`` (the rounded-h oracle) on float32 copies of ``inp``."""
    ref = f32_leaves(inp)
    out = call(fn or rounded_reference, ref, **kw)
    return list(torch.autograd.grad(out, [t for _, t in leaves(ref)], g.float()))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("activation, offset, clamp, layout", ACT_CASES,
                         ids=[f"{a}-{lay}" for a, _, _, lay in ACT_CASES])
def test_gradients_are_those_of_the_rounded_h(activation, offset, clamp, layout,
                                              impl) -> None:
    """fp32 with biases: the output is bitwise the default's; every gradient is the
    oracle's (and not the unrounded reference's, so the rounding took effect)."""
    kw = dict(activation=activation, linear_offset=offset, clamp_value=clamp,
              gate_up_layout=layout)
    inp = make(8, 16, 12, 3, 2, activation)
    what = f"{activation} {layout} {impl}"
    with torch.no_grad():
        out = call(lmfuse.moe_experts, inp, impl=impl, **kw)
    out8 = call(lmfuse.moe_experts, inp, impl=impl, fp8_input_store=True, **kw)
    assert torch.equal(out8, out), f"{what}: fp8_input_store changed the forward"
    g = randn(out.shape)
    grads8 = torch.autograd.grad(out8, [t for _, t in leaves(inp)], g)
    want = oracle_grads(inp, g, **kw)
    plain = oracle_grads(inp, g, moe_experts_reference, **kw)
    for (name, _), a, b, c in zip(leaves(inp), grads8, want, plain):
        assert_close(a, b, F32, f"{what}: d{name}")
        if name != "down_bias":  # the only gradient that does not depend on h
            assert not torch.allclose(a, c, rtol=1e-4, atol=0), (
                f"{what}: d{name} equals the unrounded reference's")


def test_bfloat16_triton() -> None:
    """bf16 on the Triton path, GPT-OSS's form (operands widened for the interpreter's
    dots, as in test_ops.py): h rounded to float8 once, from the float32 accumulator, as
    the oracle rounds its float32 h; gradients within bf16's tolerance."""
    kw = dict(activation="quick_geglu", linear_offset=1.0, clamp_value=0.7,
              gate_up_layout="interleaved")
    inp = make(9, 32, 16, 3, 2, "quick_geglu", dtype=BF16)
    with torch.no_grad():
        out = call(lmfuse.moe_experts, inp, impl="triton", **kw)
    out8 = call(lmfuse.moe_experts, inp, impl="triton", fp8_input_store=True, **kw)
    assert torch.equal(out8, out)
    g = randn(out.shape, BF16)
    grads8 = torch.autograd.grad(out8, [t for _, t in leaves(inp)], g)
    for (name, t), a, b in zip(leaves(inp), grads8, oracle_grads(inp, g, **kw)):
        assert a.dtype == t.dtype, f"d{name} dtype {a.dtype}"
        assert_close(a, b.to(a.dtype), BF16, f"gpt-oss bf16: d{name}")


# --- what is saved --------------------------------------------------------------------------


def fresh(saved: list[torch.Tensor], inp: dict[str, Any]) -> list[torch.Tensor]:
    """The floating tensors among ``saved`` that cost memory of their own: not views of an
    input (the weights autograd keeps for their GEMMs' backward), each storage once."""
    ptrs = {t.untyped_storage().data_ptr() for t in inp.values()
            if isinstance(t, torch.Tensor)}
    out = []
    for t in saved:
        ptr = t.untyped_storage().data_ptr()
        if t.is_floating_point() and ptr not in ptrs:
            ptrs.add(ptr)
            out.append(t)
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("activation", ["swiglu", "squared_relu"])
def test_saved_h_is_float8(activation: str, impl: str) -> None:
    """bf16: with the option, what autograd keeps of the experts' activations is ``h [T k,
    K2]`` as float8_e4m3fn, one byte an element, holding h rounded to float8; besides it
    only the router weights and, on the torch path, the gathered hidden rows (the gate/up
    weight's gradient needs them). Without it, the Triton path keeps h in bf16 (twice the
    bytes) and the torch path the activation's float32 intermediates."""
    T, H, F, E, k = 9, 16, 12, 3, 2
    K2 = 2 * F if activation == "swiglu" else F
    inp = make(T, H, F, E, k, activation, dtype=BF16)
    _, plain = saved_tensors(inp, impl, activation=activation)
    _, saved = saved_tensors(inp, impl, activation=activation, fp8_input_store=True)
    plain, saved = fresh(plain, inp), fresh(saved, inp)

    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in ts)

    fp8 = [t for t in saved if t.dtype == FP8]
    others = [t for t in saved if t.dtype != FP8]
    assert sum(t.shape[0] for t in fp8) == T * k and all(t.shape[1] == K2 for t in fp8)
    assert nbytes(fp8) == T * k * K2
    assert all(t.dim() == 1 or t.shape[-1] == H for t in others), [
        (t.dtype, tuple(t.shape)) for t in others]
    assert all(t.dtype != FP8 for t in plain)
    if impl == "triton":
        (h_plain,) = [t for t in plain if t.dim() == 2]
        assert h_plain.dtype == BF16 and h_plain.shape == (T * k, K2)
        assert nbytes([h_plain]) == 2 * nbytes(fp8)
    assert nbytes(saved) < nbytes(plain)
    # Both paths keep the rows in the sorted (by expert) order; the torch path one block
    # per expert.
    got = torch.cat(fp8).double()
    h = sorted_h(inp)
    if impl == "torch":
        h = h.to(BF16).double()  # that path rounds h to hidden's dtype first
    want = through_fp8(h)
    # Values within float32 rounding of a float8 tie may land on either side of it.
    tie = through_fp8(h * (1 + 1e-5)) != through_fp8(h * (1 - 1e-5))
    assert torch.equal(got[~tie], want[~tie]), (got - want).abs().max()


def test_without_float8_kernels_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The path of GPUs older than compute capability 8.9, forced: the up kernel writes the
    e4m3 values in hidden's dtype (cast to float8 after it, exactly); the same saved bits
    and the same gradients as when it writes float8."""
    from lmfuse.moe import ops as moe_ops

    inp = make(8, 16, 12, 3, 2, "quick_geglu", dtype=BF16)
    kw = dict(activation="quick_geglu", linear_offset=1.0, clamp_value=0.7,
              gate_up_layout="interleaved", fp8_input_store=True)

    def run():
        out, saved = saved_tensors(inp, "triton", **kw)
        h8 = [t.view(torch.uint8).clone() for t in saved if t.dtype == FP8]
        return h8, torch.autograd.grad(out, [t for _, t in leaves(inp)],
                                       torch.ones_like(out))

    h8, grads = run()
    monkeypatch.setattr(moe_ops, "_kernel_stores_fp8", lambda device: False)
    h8_old, grads_old = run()
    assert len(h8) == len(h8_old) == 1 and torch.equal(h8[0], h8_old[0])
    for (name, _), a, b in zip(leaves(inp), grads, grads_old):
        assert torch.equal(a, b), name


# --- NaN and inf ------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_and_inf_in_hidden(impl: str) -> None:
    """A NaN and +-inf in hidden: the output is the default's (NaN and inf included); the
    saved copy keeps NaN and holds +-448 for +-inf (float8_e4m3fn has no infinity); the
    gradients have the oracle's NaN and inf positions and its values elsewhere."""
    inp = make(6, 16, 8, 3, 2)
    with torch.no_grad():
        inp["hidden"][1, 3] = math.nan
        inp["hidden"][2, 5] = math.inf
        inp["hidden"][4, 0] = -math.inf
    with np.errstate(invalid="ignore", over="ignore"):  # the interpreter's numpy
        out = call(lmfuse.moe_experts, inp, impl=impl)
        out8, saved = saved_tensors(inp, impl, fp8_input_store=True)
        g = torch.ones_like(out8)
        got = torch.autograd.grad(out8, [t for _, t in leaves(inp)], g)
    assert torch.equal(out8.isnan(), out.isnan())
    assert torch.equal(out8.nan_to_num(), out.nan_to_num())
    h8 = torch.cat([t for t in saved if t.dtype == FP8]).float()
    h = sorted_h(inp)
    assert h.isnan().any() and h.isinf().any()
    assert torch.equal(h8.isnan(), h.isnan())
    assert torch.equal(h8[h == math.inf], torch.full_like(h8[h == math.inf], 448.0))
    assert torch.equal(h8[h == -math.inf], torch.full_like(h8[h == -math.inf], -448.0))
    for (name, _), a, b in zip(leaves(inp), got, oracle_grads(inp, g)):
        assert torch.equal(a.isnan(), b.isnan()), name
        assert torch.equal(a.isinf(), b.isinf()), name
        fin = b.isfinite()
        assert fin.any(), name
        assert_close(a[fin], b[fin], F32, f"{impl} d{name} finite part")


# --- no gradient, no tokens, bad values ---------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_without_gradient_nothing_changes(impl: str) -> None:
    """Inference (the Generator's calls): no autograd node, nothing saved, the default's
    output."""
    inp = make(7, 16, 12, 3, 2, "geglu")
    with torch.no_grad():
        want = call(lmfuse.moe_experts, inp, impl=impl, activation="geglu")
        got = call(lmfuse.moe_experts, inp, impl=impl, activation="geglu",
                   fp8_input_store=True)
    assert got.grad_fn is None and torch.equal(got, want)


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_tokens(impl: str) -> None:
    inp = make(0, 16, 8, 3, 2)
    out = call(lmfuse.moe_experts, inp, impl=impl, fp8_input_store=True)
    assert out.shape == (0, 16)
    grads = torch.autograd.grad(out, [t for _, t in leaves(inp)], torch.ones_like(out),
                                allow_unused=True)
    for (name, t), g in zip(leaves(inp), grads):
        assert g is None or (g.shape == t.shape and torch.count_nonzero(g) == 0), name


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("value", [1, 0, None, "yes", np.bool_(True)],
                         ids=["one", "zero", "none", "str", "numpy-bool"])
def test_fp8_input_store_must_be_a_bool(value: Optional[Any], impl: str) -> None:
    inp = make(4, 8, 6, 3, 2)
    with pytest.raises(TypeError, match=r"\bfp8_input_store\b.*bool"):
        call(lmfuse.moe_experts, inp, impl=impl, fp8_input_store=value)
    args = [inp[n] for n in ("hidden", "expert_ids", "router_weights", "w_gate_up", "w_down")]
    with pytest.raises(TypeError, match=r"\bfp8_input_store\b"):
        lmfuse.explain(lmfuse.moe_experts, *args, impl=impl, fp8_input_store=value)


@pytest.mark.parametrize("impl", IMPLS)
def test_explain_says_what_is_saved(impl: str) -> None:
    inp = make(4, 8, 6, 3, 2)
    args = [inp[n] for n in ("hidden", "expert_ids", "router_weights", "w_gate_up", "w_down")]
    plan = lmfuse.explain(lmfuse.moe_experts, *args, impl=impl, fp8_input_store=True)
    assert "float8_e4m3fn" in plan.details["saved for backward"], str(plan)
    plain = lmfuse.explain(lmfuse.moe_experts, *args, impl=impl)
    assert "float8" not in str(plain)


@pytest.mark.parametrize("activation, offset, clamp, layout", [
    ("swiglu", 0.0, None, "halves"), ("quick_geglu", 1.0, 0.7, "interleaved"),
    ("squared_relu", 0.0, None, "halves")], ids=["swiglu", "gpt-oss", "squared_relu"])
def test_grouped_engine(activation, offset, clamp, layout,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The grouped-GEMM engine (GEMMs in ``torch._grouped_mm``; forced here, as in
    test_ops.py): its activation kernel writes the float8 copy of ``h``; fp32: the forward
    unchanged, the gradients the oracle's; bf16: what autograd keeps is that copy."""
    from lmfuse.moe import ops as moe_ops

    monkeypatch.setattr(moe_ops, "_grouped_engine", lambda *a, **kw: True)
    kw = dict(activation=activation, linear_offset=offset, clamp_value=clamp,
              gate_up_layout=layout)
    inp = make(8, 16, 12, 3, 2, activation)
    with torch.no_grad():
        out = call(lmfuse.moe_experts, inp, impl="triton", **kw)
    out8 = call(lmfuse.moe_experts, inp, impl="triton", fp8_input_store=True, **kw)
    assert torch.equal(out8, out)
    g = randn(out.shape)
    grads8 = torch.autograd.grad(out8, [t for _, t in leaves(inp)], g)
    for (name, _), a, b in zip(leaves(inp), grads8, oracle_grads(inp, g, **kw)):
        assert_close(a, b, F32, f"grouped {activation}: d{name}")
    K2 = 16 if activation == "squared_relu" else 32  # dims at multiples of 16 bytes
    _, saved = saved_tensors(make(8, 16, 16, 3, 2, activation, dtype=BF16), "triton",
                             fp8_input_store=True, **kw)
    kept = [t for t in saved if t.dim() == 2 and t.shape == (16, K2)]
    assert [t.dtype for t in kept] == [FP8]


def test_torch_path_gemm_dtype_rounds_only_the_kept_copy() -> None:
    """The oracle's knob (``_torch_path``'s ``gemm_dtype``, which ``lmfuse check`` uses for
    the grouped-GEMM engine's bf16 calls): the forward unchanged bit for bit; the float8
    copy kept for the backward is that of the gate/up GEMM's output rounded to bf16 before
    the bias; the gradients those of that rounded copy."""
    from lmfuse.moe import ops as moe_ops

    inp = make(6, 16, 8, 3, 2)
    args = [inp[n] for n in ("hidden", "expert_ids", "router_weights", "w_gate_up", "w_down",
                             "gate_up_bias", "down_bias")]
    s = moe_ops._resolve(*args, "swiglu", 0.0, None, "halves", "torch", True)[2]
    plain = moe_ops._torch_path(*args, s)
    seen = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = moe_ops._torch_path(*args, s, BF16)
    assert torch.equal(out, plain)
    kept = torch.cat([t for t in seen if t.dtype == FP8])
    hidden, ids, _, w_gu, _, b_gu, _ = args
    rows = []
    for e in range(w_gu.shape[0]):  # the sorted order: expert by expert, tokens in order
        token = (ids == e).nonzero(as_tuple=True)[0]
        h = (hidden[token] @ w_gu[e].T).to(BF16).to(F32) + b_gu[e]
        rows.append(through_fp8(h.detach()))
    assert torch.equal(kept.to(F32), torch.cat(rows))
    # The gradients: those of the copy rounded so, not of the one rounded from float32.
    g = randn(out.shape)
    got = torch.autograd.grad(out, [t for _, t in leaves(inp)], g)
    single = torch.autograd.grad(plain, [t for _, t in leaves(inp)], g)
    assert any(not torch.equal(a, b) for a, b in zip(got, single))


def test_check_case_oracle_rounds_as_the_grouped_engine(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """``lmfuse check``'s bf16 fp8-store case where the grouped-GEMM engine runs (forced here,
    its kernels in the interpreter): its float64 oracle is the torch path with the knob
    (the call resolved by the op's own planner), and the case passes at bf16's bound."""
    from lmfuse import _check
    from lmfuse.moe import ops as moe_ops

    monkeypatch.setattr(moe_ops, "_grouped_engine", lambda *a, **kw: True)
    knob = []
    real = moe_ops._torch_path

    def spy(*args):
        knob.append(args[8] if len(args) > 8 else None)
        return real(*args)

    monkeypatch.setattr(moe_ops, "_torch_path", spy)
    case = next(c for c in moe_ops.checks(torch.device("cpu"), [BF16])
                if c.label == "swiglu+bias fp8 store")
    result = _check.run_case(case)
    assert knob == [BF16] and result.ok, (knob, result)
