"""``moe_experts`` on a GPU with the compiled Triton kernels (never run in CI: the
interpreter tests in ``tests/moe/`` cover the same code at tiny shapes).

Run on a CUDA machine::

    LMFUSE_GPU_TESTS=1 python -m pytest -q -rA tests/gpu/test_moe_gpu.py

What only a GPU shows: bf16 tensor-core dots and fp32 dots kept out of TF32 (``IEEE``) at
realistic block sizes (tiles full, several row tiles per expert, several K steps), a
routing-independent launch (a CUDA graph captured once replays with new expert ids, bitwise
equal to eager calls: no host synchronisation, no data-dependent grid), determinism, the
value checks under ``lmfuse.set_checks``, and ``fp8_input_store``'s float8 stores and loads
in the kernels (compute capability 8.9+; the interpreter converts float8 for the backward).
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import assert_close, capture_graph

import lmfuse
from lmfuse.moe.reference import moe_experts_reference

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="GPU tests need a CUDA GPU and the Triton compiler (run them with "
           "LMFUSE_GPU_TESTS=1, which keeps TRITON_INTERPRET unset)")

DEV = "cuda"
BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
NAMES = ("hidden", "router_weights", "w_gate_up", "w_down", "gate_up_bias", "down_bias")


def make(T, H, F, E, k, dtype, *, gated=True, bias=True):
    K2 = 2 * F if gated else F
    ids = torch.rand(T, E, device=DEV).topk(k, dim=1).indices
    t = dict(hidden=torch.randn(T, H, device=DEV).to(dtype),
             expert_ids=ids,
             router_weights=torch.rand(T, k, device=DEV).softmax(-1),
             w_gate_up=(torch.randn(E, K2, H, device=DEV) * H ** -0.5).to(dtype),
             w_down=(torch.randn(E, H, F, device=DEV) * F ** -0.5).to(dtype),
             gate_up_bias=(torch.randn(E, K2, device=DEV) * 0.3).to(dtype) if bias else None,
             down_bias=(torch.randn(E, H, device=DEV) * 0.3).to(dtype) if bias else None)
    for n in NAMES:
        if t[n] is not None:
            t[n].requires_grad_(True)
    return t


def call(fn, t, **kw):
    return fn(t["hidden"], t["expert_ids"], t["router_weights"], t["w_gate_up"], t["w_down"],
              gate_up_bias=t["gate_up_bias"], down_bias=t["down_bias"], **kw)


def leaves(t):
    return [t[n] for n in NAMES if t[n] is not None]


# (label, T, H, F, E, k, activation options)
SHAPES = [
    ("mixtral-like", 1024, 1024, 1536, 8, 2, dict(activation="swiglu")),
    ("qwen3-moe-like", 512, 512, 256, 64, 8, dict(activation="swiglu")),
    ("gpt-oss-like", 256, 720, 720, 32, 4, dict(activation="quick_geglu", linear_offset=1.0,
                                                 clamp_value=7.0,
                                                 gate_up_layout="interleaved")),
    ("decode-1", 1, 720, 720, 32, 4, dict(activation="quick_geglu", linear_offset=1.0,
                                           clamp_value=7.0, gate_up_layout="interleaved")),
    ("decode-16", 16, 1024, 512, 32, 4, dict(activation="swiglu")),
    ("squared-relu", 300, 512, 384, 8, 2, dict(activation="squared_relu")),
]


@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("label, T, H, F, E, k, kw", SHAPES, ids=[s[0] for s in SHAPES])
def test_against_reference(label, T, H, F, E, k, kw, dtype) -> None:
    t = make(T, H, F, E, k, dtype, gated=kw["activation"] != "squared_relu")
    ref = {n: (v.detach().double().requires_grad_(True)
               if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
           for n, v in t.items()}
    out = call(lmfuse.moe_experts, t, **kw)
    want = call(moe_experts_reference, ref, **kw)
    assert_close(out, want.to(dtype), dtype, f"{label} forward")
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves(t), g)
    exp = torch.autograd.grad(want, leaves(ref), g.double())
    for name, a, b in zip([n for n in NAMES if t[n] is not None], got, exp):
        limit = dtype if name == "router_weights" else a.dtype
        assert_close(a, b.to(a.dtype), limit, f"{label} d{name}")


def test_strided_weights_read_in_place() -> None:
    """GPT-OSS stores gate_up_proj [E, H, 2F] and down_proj [E, F, H]: their transposes are
    passed as views."""
    T, H, F, E, k = 256, 512, 384, 8, 2
    t = make(T, H, F, E, k, BF16)
    wgu = t["w_gate_up"].detach().transpose(1, 2).contiguous().transpose(1, 2)
    wd = t["w_down"].detach().transpose(1, 2).contiguous().transpose(1, 2)
    kw = dict(activation="quick_geglu", linear_offset=1.0, clamp_value=7.0,
              gate_up_layout="interleaved")
    want = call(lmfuse.moe_experts, t, **kw)
    s = dict(t, w_gate_up=wgu.requires_grad_(True), w_down=wd.requires_grad_(True))
    got = call(lmfuse.moe_experts, s, **kw)
    assert torch.equal(got, want)


def test_deterministic() -> None:
    t = make(1024, 1024, 512, 16, 4, BF16)
    runs = []
    for _ in range(2):
        out = call(lmfuse.moe_experts, t)
        runs.append((out, *torch.autograd.grad(out, leaves(t), torch.ones_like(out))))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_cuda_graph_replays_new_routing_like_eager() -> None:
    """Forward and backward captured once; replays with new hidden states, expert ids and
    router weights equal eager calls bitwise (the grid does not depend on the routing)."""
    T, H, F, E, k = 64, 512, 256, 16, 4
    t = make(T, H, F, E, k, BF16)
    g = torch.randn(T, H, device=DEV, dtype=BF16)

    def step():
        out = call(lmfuse.moe_experts, t)
        return (out, *torch.autograd.grad(out, leaves(t), g))

    graph, static = capture_graph(step)
    replays = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        with torch.no_grad():
            t["hidden"].copy_(torch.randn(T, H, device=DEV))
            t["router_weights"].copy_(torch.rand(T, k, device=DEV).softmax(-1))
            # A skewed routing on the second replay: most pairs on two experts.
            ids = torch.rand(T, E, device=DEV)
            if seed == 2:
                ids[:, :2] += 1.0
            t["expert_ids"].copy_(ids.topk(k, dim=1).indices)
        graph.replay()
        eager = step()
        for a, b in zip(static, eager):
            assert torch.equal(a, b)
        replays.append(static[0].clone())
    assert not torch.equal(replays[0], replays[1])


def test_value_checks_on_cuda() -> None:
    t = make(8, 64, 32, 4, 2, BF16)
    bad = t["expert_ids"].clone()
    bad[3, 1] = 4
    args = (t["hidden"], bad, t["router_weights"], t["w_gate_up"], t["w_down"])
    lmfuse.set_checks(True)
    try:
        with pytest.raises(ValueError, match=r"expert_ids.*\[0, 4\)"):
            lmfuse.moe_experts(*args)
    finally:
        lmfuse.set_checks(False)


# --- fp8_input_store ----------------------------------------------------------------------------


class _ThroughFp8(torch.autograd.Function):
    """``h`` as float8_e4m3fn keeps it (saturated at +-448, NaN kept) forward, the identity
    backward: what follows sees the rounded value, and ``h`` gets the gradient taken there.
    With ``kept`` (float8) the forward returns those values instead: the op's own copy."""

    @staticmethod
    def forward(ctx, h, kept=None):
        if kept is None:
            kept = h.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return kept.to(h.dtype)

    @staticmethod
    def backward(ctx, g):
        return g, None


def _rounded_reference(hidden, expert_ids, router_weights, w_gate_up, w_down, gate_up_bias=None,
                       down_bias=None, *, activation="swiglu", linear_offset=0.0,
                       clamp_value=None, gate_up_layout="halves", gemm_dtype=None, kept=None):
    """``moe_experts_reference``'s loop (float64 here) with ``h`` rounded through float8 before
    the activation: its gradients are those ``fp8_input_store`` promises. ``gemm_dtype``: the
    gate/up GEMM's output rounded to it before the bias (the grouped-GEMM engine's h).

    ``kept``: the op's float8 ``h [T k, K2]`` (the pairs in a stable sort by expert), taken
    for each expert's rounded ``h`` in place of the loop's own rounding. The loop's ``h``
    differs from the kernels' in its last bits, and an element that close to a float8
    rounding boundary rounds the other way (a 6-12% step): a weight gradient, a sum over a
    few hundred rows, then moves by a few bf16 steps (seen: 1.6-2.8e-2 of its largest
    element, at 2 of 12 seeds). ``kept`` is checked against the loop's rounding: at most
    one element in 10^3 different, each by one float8 step at most."""
    from lmfuse.moe.reference import expert_activation

    T = expert_ids.shape[0]
    out = torch.zeros(T, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    start = differ = 0
    for e in range(w_gate_up.shape[0]):
        token, slot = (expert_ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        h = hidden[token] @ w_gate_up[e].T
        if gemm_dtype is not None:
            h = h.to(gemm_dtype).to(h.dtype)
        # what the kernels' GEMM output may differ by: two of gemm_dtype's steps (float32's)
        slack = h.detach().abs() * (2.0 ** -7 if gemm_dtype is not None else 2.0 ** -20)
        if gate_up_bias is not None:
            h = h + gate_up_bias[e]
        mine = None
        if kept is not None:
            mine = kept[start:start + token.numel()]
            start += token.numel()
            own = h.detach().clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(h.dtype)
            theirs = mine.to(h.dtype)
            # one float8 step (2^-3 of the larger magnitude, 2^-9 among the subnormals)
            # beyond the GEMM output's slack: after the bias, a small h holds the GEMM's
            # rounding error whole
            step = torch.maximum(own.abs(), theirs.abs()).mul(2.0 ** -3).clamp(min=2.0 ** -9)
            assert bool(((own - theirs).abs() <= step + slack).all()), (
                "kept h: beyond one float8 step")
            differ += int((own != theirs).sum())
        a = expert_activation(_ThroughFp8.apply(h, mine), activation=activation,
                              linear_offset=linear_offset, clamp_value=clamp_value,
                              gate_up_layout=gate_up_layout)
        y = a @ w_down[e].T
        if down_bias is not None:
            y = y + down_bias[e]
        out = out.index_add(0, token, y * router_weights[token, slot][:, None])
    if kept is not None:
        assert start == kept.shape[0]
        assert differ <= kept.numel() // 1000, f"kept h: {differ} of {kept.numel()} differ"
    return out


FP8_SHAPES = [s for s in SHAPES if s[0] in ("mixtral-like", "gpt-oss-like", "squared-relu")]


@pytest.mark.parametrize("label, T, H, F, E, k, kw", FP8_SHAPES, ids=[s[0] for s in FP8_SHAPES])
def test_fp8_input_store_bf16(label, T, H, F, E, k, kw) -> None:
    """bf16 with ``fp8_input_store``: the forward bitwise the default's; autograd keeps h as
    float8_e4m3fn ``[T k, K2]`` (compute capability 8.9+: written by the up kernel, read as
    float8 by the backward's first kernel; on the grouped-GEMM engine written by its
    activation kernel from the GEMM's bf16 output plus the bias); every gradient the
    float8-rounded oracle's within bf16's tolerance."""
    from lmfuse.moe import ops as moe_ops

    gated = kw["activation"] != "squared_relu"
    t = make(T, H, F, E, k, BF16, gated=gated)
    grouped = moe_ops._grouped_engine(t["hidden"], t["w_gate_up"], t["w_down"], T * k,
                                      moe_ops._config(t["hidden"].device, T * k, H, F))
    with torch.no_grad():
        plain = call(lmfuse.moe_experts, t, **kw)
    saved, kept = [], []

    def pack(x):
        saved.append((x.dtype, tuple(x.shape)))
        if x.dtype == torch.float8_e4m3fn:
            kept.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = call(lmfuse.moe_experts, t, fp8_input_store=True, **kw)
    assert torch.equal(out, plain), f"{label}: fp8_input_store changed the forward"
    K2 = 2 * F if gated else F
    assert (torch.float8_e4m3fn, (T * k, K2)) in saved, saved
    assert not any(d == BF16 and s == (T * k, K2) for d, s in saved), saved
    ref = {n: (v.detach().double().requires_grad_(True)
               if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
           for n, v in t.items()}
    (h8,) = [x for x in kept if tuple(x.shape) == (T * k, K2)]
    want = call(_rounded_reference, ref, gemm_dtype=BF16 if grouped else None,
                kept=h8, **kw)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves(t), g)
    exp = torch.autograd.grad(want, leaves(ref), g.double())
    for name, a, b in zip([n for n in NAMES if t[n] is not None], got, exp):
        limit = BF16 if name == "router_weights" else a.dtype
        assert_close(a, b.to(a.dtype), limit, f"{label} fp8 d{name} (grouped: {grouped})")


def test_fp8_input_store_without_float8_kernels_gives_the_same_bits(monkeypatch) -> None:
    """The path of GPUs older than compute capability 8.9 (the up kernel writes the e4m3
    values in bf16, cast to float8 after it; the backward reads them converted back to bf16),
    forced here: the same saved bits and the same gradients as the float8 kernels'."""
    from lmfuse.moe import ops as moe_ops

    t = make(512, 512, 384, 8, 2, BF16)
    kw = dict(activation="quick_geglu", linear_offset=1.0, clamp_value=7.0,
              gate_up_layout="interleaved", fp8_input_store=True)

    def run():
        saved = []

        def pack(x):
            if x.dtype == torch.float8_e4m3fn:
                saved.append(x.view(torch.uint8).clone())
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            out = call(lmfuse.moe_experts, t, **kw)
        return saved, torch.autograd.grad(out, leaves(t), torch.ones_like(out))

    saved, grads = run()
    monkeypatch.setattr(moe_ops, "_kernel_stores_fp8", lambda device: False)
    monkeypatch.setattr(moe_ops, "_kernel_loads_fp8", lambda device: False)
    saved_old, grads_old = run()
    assert len(saved) == len(saved_old) == 1 and torch.equal(saved[0], saved_old[0])
    for a, b in zip(grads, grads_old):
        assert torch.equal(a, b)


# --- the grouped-GEMM engine (bf16, at least grouped_mm_min_rows rows, Hopper) -------------


@pytest.mark.parametrize("label, T, H, F, E, k, kw", [
    ("mixtral-like", 1024, 1024, 1536, 8, 2, dict(activation="swiglu")),
    ("gpt-oss-like", 512, 720, 720, 32, 4, dict(activation="quick_geglu", linear_offset=1.0,
                                                 clamp_value=7.0,
                                                 gate_up_layout="interleaved")),
    ("squared-relu k=1", 2048, 512, 384, 8, 1, dict(activation="squared_relu"))],
    ids=["mixtral-like", "gpt-oss-like", "squared-relu-k1"])
def test_grouped_engine_matches_fused_kernels_and_skips_empty_experts(
        label, T, H, F, E, k, kw, monkeypatch) -> None:
    """The engine is taken at these sizes (counted), agrees with the row-tiled kernels and
    the float64 reference within bf16's tolerance, and gives exact zeros to the experts that
    receive no row (torch._grouped_mm's weight-gradient groups of no rows), GPT-OSS's
    transposed weight views read in place."""
    from lmfuse.moe import ops as moe_ops

    gated = kw["activation"] != "squared_relu"
    t = make(T, H, F, E, k, BF16, gated=gated)
    with torch.no_grad():  # experts 1 and 5 get no token
        ids = torch.rand(T, E, device=DEV)
        ids[:, [1, 5]] = -1.0
        t["expert_ids"] = ids.topk(k, dim=1).indices
        if label.startswith("gpt-oss"):
            t["w_gate_up"] = t["w_gate_up"].transpose(1, 2).contiguous().transpose(1, 2)
            t["w_down"] = t["w_down"].transpose(1, 2).contiguous().transpose(1, 2)
    for n in NAMES:
        if t[n] is not None:
            t[n].requires_grad_(True)
    calls = []
    real = moe_ops._backward_grouped
    monkeypatch.setattr(moe_ops, "_backward_grouped",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out = call(lmfuse.moe_experts, t, **kw)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves(t), g)
    assert calls == [1], "the grouped engine was not taken"
    monkeypatch.setattr(moe_ops, "_grouped_engine", lambda *a, **kw: False)
    fused = call(lmfuse.moe_experts, t, **kw)
    fused_grads = torch.autograd.grad(fused, leaves(t), g)
    ref = {n: (v.detach().double().requires_grad_(True)
               if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
           for n, v in t.items()}
    want = call(moe_experts_reference, ref, **kw)
    exp = torch.autograd.grad(want, leaves(ref), g.double())
    assert_close(out, want.to(BF16), BF16, f"{label} forward")
    assert_close(out, fused, BF16, f"{label} forward vs fused")
    for name, a, b, c in zip([n for n in NAMES if t[n] is not None], got, exp, fused_grads):
        assert_close(a, b.to(a.dtype), BF16, f"{label} d{name}")
        assert_close(a, c, BF16, f"{label} d{name} vs fused")
        if name in ("w_gate_up", "w_down", "gate_up_bias", "down_bias"):
            assert torch.count_nonzero(a[[1, 5]]) == 0, f"{label} d{name} of unused experts"


def test_grouped_engine_in_a_cuda_graph_and_deterministic(monkeypatch) -> None:
    """Forward and backward at a training size captured once (on the grouped-GEMM engine:
    counted): replays with a new routing equal eager calls bitwise (torch._grouped_mm reads
    the offsets on the device)."""
    from lmfuse.moe import ops as moe_ops

    T, H, F, E, k = 512, 512, 768, 16, 4
    t = make(T, H, F, E, k, BF16)
    g = torch.randn(T, H, device=DEV, dtype=BF16)
    calls = []
    real = moe_ops._forward_grouped
    monkeypatch.setattr(moe_ops, "_forward_grouped",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))

    def step():
        out = call(lmfuse.moe_experts, t)
        return (out, *torch.autograd.grad(out, leaves(t), g))

    graph, static = capture_graph(step)
    with torch.no_grad():
        ids = torch.rand(T, E, device=DEV)
        ids[:, :2] += 1.0
        t["expert_ids"].copy_(ids.topk(k, dim=1).indices)
    graph.replay()
    eager, again = step(), step()
    assert calls, "the grouped engine was not taken"
    for a, b, c in zip(static, eager, again):
        assert torch.equal(a, b) and torch.equal(b, c)
