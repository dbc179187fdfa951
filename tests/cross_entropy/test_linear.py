"""lmfuse.linear_cross_entropy against the float64 reference (F.cross_entropy of the
logits), on the torch path and on the Triton path (cross-entropy kernels in the
interpreter, GEMMs by torch).

Inputs are made on the CPU (seeded); the op runs on ``helpers.TEST_DEVICE`` (CUDA under
``LMFUSE_GPU_TESTS=1``, the kernels compiled) and its results are compared on the CPU with
the float64 reference. The tests of the CPU's own default path and of the default tuning
table stay on the CPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from helpers import TEST_DEVICE as DEVICE
from helpers import value_checks_on

import lmfuse
from lmfuse.cross_entropy import linear, linear_config
from lmfuse.cross_entropy.linear import linear_cross_entropy_reference

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
IMPLS = ["torch", "triton"]
IGNORE = -100
TOL = {F32: 2e-5, F16: 2e-2, BF16: 5e-2}  # relative to the largest reference value


def inputs(N: int, H: int, V: int, *, bias: bool, scale: float = 1.0, seed: int = 0,
           every: int = 4):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g, dtype=F64) * scale
    w = torch.randn(V, H, generator=g, dtype=F64) / H ** 0.5
    b = torch.randn(V, generator=g, dtype=F64) if bias else None
    t = torch.randint(0, V, (N,), generator=g)
    if every:
        t[1::every] = IGNORE
    return h, w, b, t


def run(impl: str, h, w, b, t, dtype: torch.dtype, grad_out=None, **kw):
    """Loss and gradients (hidden, weight, bias) of the op on ``dtype`` copies on the test
    device, returned on the CPU."""
    args = [x.detach().to(DEVICE, dtype).requires_grad_(True) if x is not None else None
            for x in (h, w, b)]
    loss = lmfuse.linear_cross_entropy(args[0], args[1], t.to(DEVICE), bias=args[2],
                                       impl=impl, **kw)
    grads = _grads(loss, args, None if grad_out is None else grad_out.to(DEVICE))
    return loss.detach().cpu(), [g.cpu() for g in grads]


def reference(h, w, b, t, grad_out=None, **kw):
    args = [x.detach().clone().requires_grad_(True) if x is not None else None
            for x in (h, w, b)]
    loss = linear_cross_entropy_reference(args[0], args[1], t, bias=args[2], **kw)
    return loss, _grads(loss, args, grad_out)


def _grads(loss, args, grad_out):
    need = [a for a in args if a is not None]
    g = torch.ones_like(loss) if grad_out is None else grad_out.to(loss.dtype)
    return list(torch.autograd.grad(loss, need, g))


def assert_close(what: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    err = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
    scale = max(want.double().abs().max().item() if want.numel() else 0.0, 1e-3)
    assert torch.isfinite(got).all(), what
    assert err <= TOL[dtype] * scale, f"{what}: max err {err:.3e} (scale {scale:.3e})"


def check(impl, h, w, b, t, dtype, grad_out=None, **kw) -> None:
    ref_kw = {k: v for k, v in kw.items() if k != "max_chunk_bytes"}
    loss, grads = run(impl, h, w, b, t, dtype, grad_out, **kw)
    rloss, rgrads = reference(h, w, b, t, grad_out, **ref_kw)
    assert loss.dtype == F32 and loss.shape == rloss.shape
    assert_close(f"{impl} loss {kw}", loss, rloss, dtype)
    for name, g, r in zip(("hidden", "weight", "bias"), grads, rgrads):
        assert g.dtype == dtype and g.shape == r.shape, name
        assert_close(f"{impl} grad {name} {kw}", g, r, dtype)


OPTIONS = [
    pytest.param(dict(), id="plain"),
    pytest.param(dict(label_smoothing=0.1), id="ls"),
    pytest.param(dict(z_loss=1e-2), id="z"),
    pytest.param(dict(softcap=3.0), id="cap"),
    pytest.param(dict(label_smoothing=0.2, z_loss=1e-2, softcap=3.0), id="ls-z-cap"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_matches_reference_every_option(impl: str, reduction: str, options: dict[str, Any],
                                        bias: bool) -> None:
    """N = 13 in chunks of 5 rows (a short last chunk), V = 37, every option combination,
    with a non-trivial upstream gradient."""
    h, w, b, t = inputs(13, 8, 37, bias=bias, scale=2.0)
    grad_out = torch.randn(13, dtype=F64) if reduction == "none" else torch.tensor(2.5)
    check(impl, h, w, b, t, F32, grad_out, reduction=reduction, max_chunk_bytes=37 * 4 * 5,
          **options)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_half_precision(impl: str, dtype: torch.dtype, reduction: str) -> None:
    h, w, b, t = inputs(19, 16, 45, bias=True)
    grad_out = torch.randn(19, dtype=F64) if reduction == "none" else None
    check(impl, h, w, b, t, dtype, grad_out, reduction=reduction, label_smoothing=0.1,
          z_loss=1e-3, softcap=10.0, max_chunk_bytes=45 * 2 * 4)


@pytest.mark.parametrize("impl", ["auto", "torch"])
def test_float64_inputs_take_float64_math(impl: str) -> None:
    """float64 hidden/weight/bias: the torch path's float64 math (the kernels compute in
    float32), loss and gradients equal to the float64 reference to float64 rounding; the
    Triton path refuses them."""
    h, w, b, t = inputs(12, 32, 160, bias=True, scale=2.0)
    cw = torch.rand(160, dtype=F32) + 0.5
    grad_out = torch.tensor(1.5, dtype=F64)
    kw = dict(label_smoothing=0.1, z_loss=1e-2, softcap=3.0)
    loss, grads = run(impl, h, w, b, t, F64, grad_out, ce_weight=cw.to(DEVICE), **kw)
    rloss, rgrads = reference(h, w, b, t, grad_out, ce_weight=cw.double(), **kw)
    assert loss.dtype == F64
    assert (loss - rloss).abs().item() <= 1e-12 * rloss.abs().item()
    for name, g, r in zip(("hidden", "weight", "bias"), grads, rgrads):
        assert g.dtype == F64
        err = (g - r).abs().max().item()
        assert err <= 1e-12 * r.abs().max().item(), f"{name}: {err:.3e}"
    with pytest.raises(TypeError, match="linear_cross_entropy: the Triton path takes "
                       "float32/float16/bfloat16 hidden, got float64"):
        run("triton", h, w, b, t, F64)


@pytest.mark.parametrize("impl", IMPLS)
def test_long_rows_streamed_kernels(impl: str) -> None:
    """V past the single-block limit of the cross-entropy kernels (V = 20000)."""
    h, w, b, t = inputs(5, 8, 20000, bias=True, scale=3.0)
    check(impl, h, w, b, t, F32, label_smoothing=0.1, z_loss=1e-3, max_chunk_bytes=20000 * 4 * 2)


@pytest.mark.parametrize("impl", IMPLS)
def test_leading_shape_and_f_cross_entropy(impl: str) -> None:
    """hidden ``[2, 3, H]``; the plain loss equals F.cross_entropy of F.linear's logits."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 3, 8, generator=g, dtype=F64)
    w = torch.randn(11, 8, generator=g, dtype=F64)
    b = torch.randn(11, generator=g, dtype=F64)
    t = torch.randint(0, 11, (2, 3), generator=g)
    t[0, 1] = IGNORE
    hd, wd, bd, td = (x.to(DEVICE, F32) if x.is_floating_point() else x.to(DEVICE)
                      for x in (h, w, b, t))
    for reduction in ("mean", "none"):
        got = lmfuse.linear_cross_entropy(hd, wd, td, bias=bd, impl=impl, reduction=reduction,
                                          max_chunk_bytes=11 * 4 * 4).cpu()
        want = F.cross_entropy(F.linear(h, w, b).view(-1, 11), t.view(-1),
                               reduction=reduction).float()
        assert got.shape == (t.shape if reduction == "none" else ())
        torch.testing.assert_close(got, want.view(got.shape), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_all_ignored_and_empty(impl: str) -> None:
    h, w, b, t = inputs(6, 8, 9, bias=True)
    t[:] = IGNORE
    loss, grads = run(impl, h, w, b, t, F32)
    assert loss.item() == 0.0
    for g in grads:
        assert torch.count_nonzero(g) == 0
    h0 = torch.zeros(0, 8, device=DEVICE, requires_grad=True)
    w0 = torch.randn(9, 8).to(DEVICE).requires_grad_(True)
    loss = lmfuse.linear_cross_entropy(h0, w0, torch.zeros(0, dtype=torch.long, device=DEVICE),
                                       impl=impl)
    gh, gw = torch.autograd.grad(loss, [h0, w0])
    assert loss.item() == 0.0 and gh.shape == (0, 8) and torch.count_nonzero(gw) == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_huge_logits_stay_finite(impl: str) -> None:
    """Logits of order 1e4: no inf or NaN in the loss or any gradient."""
    h, w, b, t = inputs(7, 8, 21, bias=False, scale=3e4, every=3)
    check(impl, h, w, b, t, F32, z_loss=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_deterministic(impl: str) -> None:
    """Same inputs, bitwise the same loss and gradients."""
    h, w, b, t = inputs(23, 8, 30, bias=True)
    first = run(impl, h, w, b, t, F32, max_chunk_bytes=30 * 4 * 6, label_smoothing=0.1)
    again = run(impl, h, w, b, t, F32, max_chunk_bytes=30 * 4 * 6, label_smoothing=0.1)
    assert torch.equal(first[0], again[0])
    for x, y in zip(first[1], again[1]):
        assert torch.equal(x, y)


@pytest.mark.parametrize("impl", IMPLS)
def test_partial_requires_grad_and_no_grad(impl: str) -> None:
    """Only the weight trainable (a frozen trunk), and inference under no_grad."""
    h, w, b, t = inputs(9, 8, 17, bias=True)
    _, (rgh, rgw, rgb) = reference(h, w, b, t)
    hd, wd, bd, td = h.to(DEVICE, F32), w.to(DEVICE, F32), b.to(DEVICE, F32), t.to(DEVICE)
    wt = wd.clone().requires_grad_(True)
    loss = lmfuse.linear_cross_entropy(hd, wt, td, bias=bd, impl=impl)
    (gw,) = torch.autograd.grad(loss, [wt])
    assert_close("weight only", gw.cpu(), rgw, F32)
    with torch.no_grad():
        loss = lmfuse.linear_cross_entropy(hd, wd, td, bias=bd, impl=impl)
    rloss, _ = reference(h, w, b, t)
    assert not loss.requires_grad
    assert_close("no_grad loss", loss.cpu(), rloss, F32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("N, budget_rows", [(29, 4), (29, 29), (29, 100), (8, 1)])
def test_chunk_bound(monkeypatch: pytest.MonkeyPatch, impl: str, N: int,
                     budget_rows: int) -> None:
    """Every logits chunk formed, forward and backward, fits the budget, and they cover
    the N tokens exactly once each way."""
    V = 13
    formed: list[tuple[int, int]] = []
    real = linear._logits

    def spy(h, weight, bias, out):
        formed.append(tuple(out.shape))
        return real(h, weight, bias, out)

    monkeypatch.setattr(linear, "_logits", spy)
    h, w, b, t = inputs(N, 8, V, bias=False)
    budget = V * 4 * budget_rows
    grad_out = torch.randn(N, dtype=F64)
    check(impl, h, w, b, t, F32, grad_out, reduction="none", max_chunk_bytes=budget)
    rows = min(N, budget_rows)
    assert all(r <= rows and v == V and r * v * 4 <= budget for r, v in formed), formed
    # reduction="none": stats in forward, logits recomputed in backward
    assert sum(r for r, _ in formed) == 2 * N, formed
    assert formed[0][0] == rows


def test_default_chunk_budget_from_tuning_table() -> None:
    """The default budget is the tuning table's ``chunk_bytes``, independent of N; rows
    are rounded down to the table's ``row_multiple`` (128: 1046 rows -> 1024). (The CPU's
    table, default.json, whatever the test device: no tensor is made.)"""
    cfg, _ = linear_config.config(128256, torch.device("cpu"))
    assert cfg.chunk_bytes == 256 * 2**20 and cfg.row_multiple == 128
    V = 128256
    for n in (1, 1000, 10**6, 10**8):
        rows = linear_config.chunk_rows(n, V, 2, torch.device("cpu"))
        assert rows == min(n, 1024)
    assert linear_config.chunk_rows(10, 10**9, 4, torch.device("cpu")) == 1


@pytest.mark.parametrize("impl", IMPLS)
def test_out_of_range_target_raises_on_cpu(impl: str) -> None:
    """Always on CPU tensors; on CUDA ones (the GPU run's test device) only with
    ``lmfuse.set_checks(True)``, as for ``cross_entropy``: on with it here."""
    h, w, b, t = inputs(4, 8, 9, bias=False)
    t[2] = 9
    with value_checks_on(), pytest.raises(ValueError, match="target holds 9"):
        lmfuse.linear_cross_entropy(h.to(DEVICE, F32), w.to(DEVICE, F32), t.to(DEVICE),
                                    impl=impl)


@pytest.mark.parametrize("bad, kw, exc, match", [
    ("weight dtype", dict(weight=torch.randn(9, 8, dtype=F64)), TypeError, "weight must have"),
    ("weight shape", dict(weight=torch.randn(9, 7)), ValueError, r"weight must be \[V, H\]"),
    ("weight 1-D", dict(weight=torch.randn(9)), ValueError, "weight must be 2-D"),
    ("bias shape", dict(bias=torch.randn(8)), ValueError, r"bias must be \[V\]"),
    ("bias dtype", dict(bias=torch.randn(9, dtype=F16)), TypeError, "bias must have"),
    ("target shape", dict(target=torch.zeros(5, dtype=torch.long)), ValueError, "target must"),
    ("target dtype", dict(target=torch.zeros(4)), TypeError, "target must have dtype"),
    ("hidden int", dict(hidden=torch.zeros(4, 8, dtype=torch.long)), TypeError, "hidden"),
    ("chunk budget", dict(max_chunk_bytes=0), ValueError, "max_chunk_bytes"),
    ("reduction", dict(reduction="avg"), ValueError, "reduction"),
    ("softcap", dict(softcap=-1.0), ValueError, "softcap"),
])
def test_bad_inputs(bad: str, kw: dict[str, Any], exc: type, match: str) -> None:
    args = dict(hidden=torch.randn(4, 8), weight=torch.randn(9, 8),
                target=torch.zeros(4, dtype=torch.long))
    args.update({k: v for k, v in kw.items() if k in args})
    options = {k: v for k, v in kw.items() if k not in args}
    args, options = ({k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v
                      for k, v in d.items()} for d in (args, options))
    with pytest.raises(exc, match=match):
        lmfuse.linear_cross_entropy(args["hidden"], args["weight"], args["target"], **options)


@pytest.mark.parametrize("impl", IMPLS)
def test_explain(impl: str) -> None:
    h = torch.randn(10, 8).to(DEVICE).requires_grad_(True)
    w = torch.randn(7, 8).to(DEVICE).requires_grad_(True)
    t = torch.zeros(10, dtype=torch.long, device=DEVICE)
    plan = lmfuse.explain(lmfuse.linear_cross_entropy, h, w, t, impl=impl,
                          max_chunk_bytes=7 * 4 * 3)
    assert plan.impl == impl
    assert plan.details["chunks"].startswith("4 x 3 tokens"), plan.details
    assert plan.details["passes"].startswith("fused")
    plan = lmfuse.explain(lmfuse.linear_cross_entropy, h, w, t, impl=impl, reduction="none")
    assert plan.details["passes"].startswith("deferred")


@pytest.mark.parametrize("impl", IMPLS)
def test_second_backward_refused(impl: str) -> None:
    """The gradients kept from the forward are rescaled in place by backward: a second
    backward through the same graph raises instead of scaling them twice."""
    h, w, b, t = inputs(6, 8, 9, bias=False)
    hh = h.to(DEVICE, F32).requires_grad_(True)
    loss = lmfuse.linear_cross_entropy(hh, w.to(DEVICE, F32), t.to(DEVICE), impl=impl)
    half = torch.tensor(0.5, device=DEVICE)
    loss.backward(half, retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward(half)
    _, rgrads = reference(h, w, b, t, torch.tensor(0.5, dtype=F64))
    assert_close("the first backward's gradient", hh.grad.cpu(), rgrads[0], F32)


@pytest.mark.parametrize("impl", IMPLS)
def test_float16_gradient_scaled_before_rounding(impl: str) -> None:
    """As for cross_entropy: under a loss scale (fp16 training) the logits' gradient is
    formed with it, in backward, so dW does not lose the (p - y) / count that underflow
    float16 when formed for an upstream gradient of 1."""
    V, H, n = 4000, 8, 64
    h = torch.ones(n, H, dtype=F16, device=DEVICE, requires_grad=True)
    w = torch.zeros(V, H, dtype=F16, device=DEVICE, requires_grad=True)  # p = 1 / V
    t = torch.zeros(n, dtype=torch.long, device=DEVICE)
    scale = 2.0 ** 16
    plan = lmfuse.explain(lmfuse.linear_cross_entropy, h, w, t, impl=impl)
    assert plan.details["passes"].startswith("deferred")
    loss = lmfuse.linear_cross_entropy(h, w, t, impl=impl, max_chunk_bytes=V * 2 * 16)
    dw = torch.autograd.grad(loss * scale, w)[0]
    # row v != target: sum over tokens of scale * p / n * h = scale / V = 16.4
    want = scale / V
    assert abs(dw[1, 0].item() - want) <= 2e-3 * want, dw[1, 0].item()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("reduction, options", [
    ("mean", dict()), ("none", dict()),
    ("sum", dict(label_smoothing=0.1, z_loss=1e-3, softcap=15.0))])
def test_logits_in_fp32_match_a_float32_logits_reference(impl: str, dtype: torch.dtype,
                                                         reduction: str,
                                                         options: dict[str, Any]) -> None:
    """With ``logits_in_fp32`` the softmax sees the GEMM's float32 sums of the half-precision
    inputs: the loss matches the float64 loss of those logits to 1e-5 (the default mode,
    which rounds the logits to the inputs' dtype first, is off by far more), over several
    chunks; the gradients to the dtype's tolerance."""
    h, w, b, t = inputs(48, 64, 300, bias=True, scale=3.0)
    h, w, b = (x.to(dtype) for x in (h, w, b))  # the inputs as the op sees them
    want, want_grads = reference(h.double(), w.double(), b.double(), t, reduction=reduction,
                                 **options)
    chunk = dict(max_chunk_bytes=16 * 300 * 6)  # 16 rows a chunk: 3 chunks
    loss, grads = run(impl, h, w, b, t, dtype, logits_in_fp32=True, reduction=reduction,
                      **options, **chunk)
    err = ((loss.double() - want).abs().max() / want.abs().max()).item()
    assert err <= 1e-5, err
    for name, g, r in zip(("hidden", "weight", "bias"), grads, want_grads):
        assert g.dtype == dtype, name
        assert_close(f"{impl} grad {name}", g, r, dtype)
    # Per token, the default mode's rounded logits are visibly off the float32 ones.
    per_token, _ = reference(h.double(), w.double(), b.double(), t, reduction="none",
                             **options)
    rounded, _ = run(impl, h, w, b, t, dtype, reduction="none", **options, **chunk)
    assert ((rounded.double() - per_token).abs().max() / per_token.abs().max()).item() > 1e-4


def test_logits_in_fp32_plan_and_bad_value() -> None:
    h, w, b, t = inputs(8, 16, 40, bias=False)
    h, w, t = h.to(DEVICE, BF16), w.to(DEVICE, BF16), t.to(DEVICE)
    plan = linear.plan_linear_cross_entropy(h, w, t, logits_in_fp32=True)
    assert "float32 logits" in plan.details["chunks"]
    assert "float32" not in linear.plan_linear_cross_entropy(h, w, t).details["chunks"]
    with pytest.raises(TypeError, match="logits_in_fp32 must be a bool"):
        lmfuse.linear_cross_entropy(h, w, t, logits_in_fp32=1)
    # float32 inputs: the option changes nothing
    h32, w32 = h.float(), w.float()
    assert torch.equal(lmfuse.linear_cross_entropy(h32, w32, t, logits_in_fp32=True),
                       lmfuse.linear_cross_entropy(h32, w32, t))


@pytest.fixture
def native_calls(monkeypatch) -> list[int]:
    """``impl="auto"`` resolved as on a CPU machine without Triton (the CPU default path);
    the list counts the calls that took it (``_native_cross_entropy``)."""
    from lmfuse._dispatch import select_impl
    from lmfuse.cross_entropy import ops as ce_ops

    monkeypatch.setattr(ce_ops, "select_impl", lambda op, impl, device: (
        ("torch", "test: no Triton") if impl == "auto" else select_impl(op, impl, device)))
    calls: list[int] = []
    real = ce_ops._native_cross_entropy
    monkeypatch.setattr(ce_ops, "_native_cross_entropy",
                        lambda *a: (calls.append(1), real(*a))[1])
    return calls


@pytest.mark.parametrize("case", ["max_chunk_bytes", "past the budget", "autocast"])
def test_default_cpu_path_keeps_the_budget_and_float32_logits(monkeypatch, native_calls,
                                                              case) -> None:
    """The CPU default path forms the whole logits with F.linear: not when the caller gives
    a chunk budget, nor when the logits pass the default one (the op's memory stays within
    its budget), nor under autocast (F.linear would compute bfloat16 logits where every
    other path computes float32). The chunked path's results then, bit for bit."""
    calls = native_calls
    h, w, _, t = inputs(18, 16, 40, bias=False)
    h, w = h.float(), w.float()
    kw = dict(max_chunk_bytes=40 * 4 * 5) if case == "max_chunk_bytes" else {}
    if case == "past the budget":
        monkeypatch.setattr(linear, "_cpu_chunk_bytes", lambda vocab: 40 * 4 * 17)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast")
    out = {}
    for impl in ("auto", "torch"):
        args = [x.clone().requires_grad_(True) for x in (h, w)]
        with autocast:
            loss = lmfuse.linear_cross_entropy(*args, t, impl=impl, **kw)
        out[impl] = (loss, *torch.autograd.grad(loss, args))
    assert calls == []
    for got, want in zip(out["auto"], out["torch"]):
        assert torch.equal(got, want)


def test_errors_name_linear_cross_entropy_and_hidden() -> None:
    """The target and loss-option checks it shares with cross_entropy name the op called
    and its argument (they said ``cross_entropy`` and ``logits``)."""
    h, w = torch.randn(2, 5, 8), torch.randn(9, 8)
    t = torch.zeros(2, 5, dtype=torch.long)
    for kw, error, message in [
            (dict(target=torch.zeros(10, dtype=torch.long)), ValueError,
             r"target must have shape hidden.shape\[:-1\] = \(2, 5\), got \(10,\)"),
            (dict(target=torch.full((2, 5), 9)), ValueError,
             r"target holds 9, which is neither ignore_index"),
            (dict(label_smoothing=2.0), ValueError, "label_smoothing must be in"),
            (dict(reduction="avg"), ValueError, "reduction must be one of"),
            (dict(impl="cuda"), ValueError, "impl must be one of"),
            (dict(tp_group="tp"), TypeError, "tp_group must be a torch.distributed")]:
        target = kw.pop("target", t)
        for impl in ({kw.pop("impl")} if "impl" in kw else {"auto", "torch"}):
            with pytest.raises(error, match=rf"^linear_cross_entropy: {message}"):
                lmfuse.linear_cross_entropy(h, w, target, impl=impl, **kw)


@pytest.mark.parametrize("op", ["cross_entropy", "linear_cross_entropy"])
def test_float64_extras_and_class_weights_needing_grad(native_calls, op) -> None:
    """float64 inputs: the returned z-loss and token accuracy are float64, as the loss is
    (they were float32); class weights held as a Parameter get no gradient on every path
    (the CPU default path handed them to F.cross_entropy, which raised)."""
    calls = native_calls
    h, w, _, t = inputs(12, 8, 10, bias=False)
    cw = torch.nn.Parameter(torch.rand(10, dtype=F64) + 0.5)

    def call(x, impl, **kw):
        if op == "cross_entropy":
            return lmfuse.cross_entropy(x @ w.T.to(x.dtype), t, impl=impl, **kw)
        return lmfuse.linear_cross_entropy(x, w.to(x.dtype), t, impl=impl, **kw)

    out = call(h, "torch", z_loss=1e-3, return_z_loss=True, return_token_accuracy=True)
    assert out.loss.dtype == out.z_loss.dtype == out.token_accuracy.dtype == F64
    for impl in ("auto", "torch"):
        x = h.float().requires_grad_(True)
        weight_kw = {"weight" if op == "cross_entropy" else "ce_weight": cw}
        loss = call(x, impl, **weight_kw)
        loss.backward()
        assert cw.grad is None and x.grad is not None
    assert calls  # the default ("auto") call took the CPU default path


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("kw", [dict(), dict(label_smoothing=0.1)])
def test_default_cpu_path_is_f_linear_and_f_cross_entropy(native_calls, reduction, kw) -> None:
    """On CPU float32 tensors without Triton the default path is ``F.cross_entropy(
    F.linear(h, W, b))`` (the plain formula's speed): the chunked reference's loss and
    gradients; target errors as lmfuse's. (CPU tensors whatever the test device: this is
    the CPU's own path.)"""
    calls = native_calls
    h, w, b, t = inputs(2 * 9, 16, 40, bias=True)
    h, w, b = (x.float() for x in (h, w, b))
    h = h.view(2, 9, 16)
    t = t.view(2, 9)
    out = {}
    for impl in ("auto", "torch"):
        args = [x.clone().requires_grad_(True) for x in (h, w, b)]
        loss = lmfuse.linear_cross_entropy(args[0], args[1], t, bias=args[2], impl=impl,
                                           reduction=reduction, **kw)
        out[impl] = (loss, *torch.autograd.grad(loss.sum(), args))
    assert calls
    for got, want in zip(out["auto"], out["torch"]):
        assert got.shape == want.shape
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="neither ignore_index"):
        lmfuse.linear_cross_entropy(h, w, torch.full((2, 9), 40), reduction=reduction)
    t32 = lmfuse.linear_cross_entropy(h, w, t.int(), bias=b, reduction=reduction, **kw)
    assert torch.allclose(t32, out["auto"][0].detach())  # int32 ids
    # 2-D hidden (no reshape on that path) gives the same; explain says which path runs.
    h2 = h.reshape(18, 16)
    assert torch.allclose(lmfuse.linear_cross_entropy(h2, w, t.reshape(18), bias=b,
                                                      reduction=reduction, **kw).view_as(t32)
                          if reduction == "none" else
                          lmfuse.linear_cross_entropy(h2, w, t.reshape(18), bias=b,
                                                      reduction=reduction, **kw), t32)
    plan = lmfuse.explain(lmfuse.linear_cross_entropy, h, w, t, bias=b, reduction=reduction)
    assert "F.linear then F.cross_entropy" in plan.details["passes"], str(plan)
    assert "chunks" not in plan.details


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("max_chunk_bytes", [None, 512])
def test_gradients_keep_their_dtype_under_autocast(impl: str, max_chunk_bytes) -> None:
    # Under torch.autocast a new GEMM runs in autocast's dtype: the gradients' products must
    # not (float32 inputs keep float32 gradients, bitwise those without autocast; in several
    # chunks a bf16 first product then met float32 operands and raised).
    if DEVICE.type != "cpu":
        pytest.skip("CPU autocast case")
    g = torch.Generator().manual_seed(0)
    h = torch.randn(24, 16, generator=g, requires_grad=True)
    w = torch.randn(40, 16, generator=g, requires_grad=True)
    t = torch.randint(0, 40, (24,), generator=g)
    kw = dict(impl=impl, max_chunk_bytes=max_chunk_bytes)
    want = torch.autograd.grad(lmfuse.linear_cross_entropy(h, w, t, **kw), (h, w))
    with torch.autocast("cpu", torch.bfloat16):
        got = torch.autograd.grad(lmfuse.linear_cross_entropy(h, w, t, **kw), (h, w))
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        assert torch.equal(a, b)
