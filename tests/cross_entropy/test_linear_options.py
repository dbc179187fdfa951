"""``lmfuse.linear_cross_entropy``'s Liger options: class weights ``ce_weight``,
``return_z_loss``, ``return_token_accuracy``, ``return_predicted_tokens`` and
``use_token_scaling``, on the torch path and the Triton path (the cross-entropy kernels in
the interpreter, GEMMs by torch), in chunks of a few tokens, forward and the gradients of
hidden, weight and bias.

Oracles, in float64 on the CPU: ``linear_cross_entropy_reference`` (the spec: the plain
formula on the whole logits) and, independent of lmfuse, ``F.cross_entropy(weight=...)``
of the logits times each token's detached ``softmax[target]`` (Liger's token scaling) and
``torch.argmax``. Inputs are made on the CPU; the op runs on ``helpers.TEST_DEVICE`` (CUDA
under ``LMFUSE_GPU_TESTS=1``) and its results are compared on the CPU.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import TEST_DEVICE as DEVICE
from helpers import CE_LAUNCHES, assert_close, ce_through_custom_ops, force_ce_launch

import lmfuse
from lmfuse._dispatch import select_impl as _select_impl
from lmfuse.cross_entropy import CrossEntropyOutput, ops
from lmfuse.cross_entropy.linear import linear_cross_entropy_reference

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
IMPLS = ["triton", "torch"]
IGNORE = -100
RETURNS = dict(return_z_loss=True, return_token_accuracy=True, return_predicted_tokens=True)
HALF_TOL = {F16: 2e-2, BF16: 5e-2}  # test_linear.py's: the logits are rounded to the dtype

# The launches of test_options.py but the whole-row one without prefetch.
LAUNCHES = [name for name in CE_LAUNCHES if name != "vec"]
force = force_ce_launch


def make_inputs(N: int, H: int, V: int, seed: int, *, bias: bool = True,
                every: int = 3) -> tuple[torch.Tensor, ...]:
    """float64 hidden ``[N, H]``, weight ``[V, H]``, bias ``[V]``, targets (every
    ``every``-th ignored, a third of the rest the row's argmax) and class weights in
    [0.2, 2.2]."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g, dtype=F64)
    w = torch.randn(V, H, generator=g, dtype=F64) / H ** 0.5
    b = torch.randn(V, generator=g, dtype=F64) if bias else None
    t = torch.randint(0, V, (N,), generator=g)
    logits = h @ w.T + (0 if b is None else b)
    t[::3] = logits[::3].argmax(-1)  # some right guesses
    if every:
        t[1::every] = IGNORE
    cw = torch.rand(V, generator=g, dtype=F64) * 2.0 + 0.2
    return h, w, b, t, cw


def run(impl: str, h, w, b, t, grad_out, dtype=F32, **kw) -> tuple[Any, list]:
    """The op on ``dtype`` copies on the test device: its result and the gradients of
    hidden, weight and bias, on the CPU."""
    args = [None if x is None else x.detach().to(DEVICE, dtype).requires_grad_(True)
            for x in (h, w, b)]
    if kw.get("ce_weight") is not None:
        kw = dict(kw, ce_weight=kw["ce_weight"].to(DEVICE, F32))
    out = lmfuse.linear_cross_entropy(args[0], args[1], t.to(DEVICE), bias=args[2],
                                      impl=impl, **kw)
    loss = out.loss if isinstance(out, CrossEntropyOutput) else out
    need = [a for a in args if a is not None]
    grads = [g.cpu() for g in torch.autograd.grad(loss, need, grad_out.to(DEVICE))]
    if isinstance(out, CrossEntropyOutput):
        return CrossEntropyOutput(*(None if f is None else f.cpu() for f in out)), grads
    return out.cpu(), grads


def reference(h, w, b, t, grad_out, dtype=F32, **kw) -> tuple[Any, list]:
    """The float64 spec on the inputs as rounded to ``dtype``."""
    args = [None if x is None else x.detach().to(dtype).double().requires_grad_(True)
            for x in (h, w, b)]
    kw = {k: v for k, v in kw.items() if k != "max_chunk_bytes"}
    if kw.get("ce_weight") is not None:
        kw["ce_weight"] = kw["ce_weight"].float().double()
    out = linear_cross_entropy_reference(args[0], args[1], t, bias=args[2], **kw)
    loss = out.loss if isinstance(out, CrossEntropyOutput) else out
    need = [a for a in args if a is not None]
    return out, list(torch.autograd.grad(loss, need, grad_out.double()))


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """float32 results at float32's tolerance; half precision as ``test_linear.py`` holds
    them: the largest error within ``HALF_TOL`` of the largest reference value."""
    if dtype == F32:
        assert_close(got, want.to(got.dtype), F32, what)
        return
    assert torch.isfinite(got).all(), what
    err = (got.double() - want).abs().max().item()
    scale = max(want.abs().max().item(), 1e-3)
    assert err <= HALF_TOL[dtype] * scale, f"{what}: max err {err:.3e} (scale {scale:.3e})"


def check(what: str, impl: str, h, w, b, t, grad_out, dtype=F32, **kw) -> Any:
    """Every field and every gradient against the float64 reference."""
    out, grads = run(impl, h, w, b, t, grad_out, dtype, **kw)
    want, want_grads = reference(h, w, b, t, grad_out, dtype, **kw)
    if not isinstance(want, CrossEntropyOutput):
        assert type(out) is torch.Tensor, f"{what}: {type(out)}"
        out, want = CrossEntropyOutput(out), CrossEntropyOutput(want)
    assert isinstance(out, CrossEntropyOutput), f"{what}: {type(out)}"
    assert out.loss.dtype == F32 and out.loss.shape == want.loss.shape, what
    close(out.loss, want.loss, dtype, f"{what}: loss")
    for name in ("z_loss", "token_accuracy"):
        got, exp = getattr(out, name), getattr(want, name)
        assert (got is None) == (exp is None), f"{what}: {name} {got}"
        if got is not None:
            assert got.dtype == F32 and not got.requires_grad, f"{what}: {name}"
            close(got, exp, dtype, f"{what}: {name}")
    if want.predicted_tokens is None:
        assert out.predicted_tokens is None, what
    else:
        got = out.predicted_tokens
        assert got.dtype == torch.int64 and got.shape == t.shape, f"{what}: {got}"
        assert torch.equal(got, want.predicted_tokens), f"{what}: {got} != {want}"
    for name, g, r in zip(("hidden", "weight", "bias"), grads, want_grads):
        assert g.dtype == dtype and g.shape == r.shape, f"{what}: d {name}"
        close(g, r, dtype, f"{what}: d {name}")
    return out


def upstream(reduction: str, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, generator=g) + 0.5 if reduction == "none" else torch.tensor(2.5)


# --- every option, both paths, several chunks -------------------------------------------


COMBOS = [
    pytest.param(red, weighted, scaling, returns, id=f"{red}-{'w' if weighted else 'now'}-"
                 f"{'scaled' if scaling else 'unscaled'}-{'returns' if returns else 'loss'}")
    for red, weighted, scaling, returns in itertools.product(
        ("mean", "sum", "none"), (False, True), (False, True), (False, True))
    if weighted or scaling or returns
]


@pytest.mark.parametrize("reduction, weighted, scaling, returns", COMBOS)
@pytest.mark.parametrize("impl", IMPLS)
def test_every_option_matches_reference(impl: str, reduction: str, weighted: bool,
                                        scaling: bool, returns: bool) -> None:
    """float32 [7, 8] hidden, V = 37, chunks of 3 tokens, smoothing, z-loss and softcap on:
    loss, every returned field and the three gradients as the float64 reference's."""
    h, w, b, t, cw = make_inputs(7, 8, 37, seed=1)
    kw = dict(label_smoothing=0.1, z_loss=0.01, softcap=4.0, reduction=reduction,
              use_token_scaling=scaling, max_chunk_bytes=3 * 37 * 4,
              ce_weight=cw if weighted else None, **(RETURNS if returns else {}))
    out = check(f"{impl} {reduction} weighted={weighted} scaling={scaling}", impl, h, w, b,
                t, upstream(reduction, 7), **kw)
    assert out.loss.requires_grad  # (only the loss is differentiable: check())


@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_half_precision_torch_path(dtype: torch.dtype, reduction: str) -> None:
    """float16 / bfloat16 inputs on the torch path, every option: the reference of the
    inputs as rounded, at test_linear.py's half-precision tolerances (the logits are
    formed in the dtype); the rows' argmax clear of their runner-up, so it is exact."""
    h, w, b, t, cw = make_inputs(9, 16, 29, seed=2)
    k = torch.arange(9) % 29
    h = h * 0.3 + 5.0 * w[k] / (w[k] * w[k]).sum(-1, keepdim=True)  # logit k about 5
    b = b * 0.3
    logits = h.to(dtype).double() @ w.to(dtype).double().T + b.to(dtype).double()
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 0.25  # (the inputs' premise)
    t[::2] = k[::2]
    kw = dict(ce_weight=cw, label_smoothing=0.1, z_loss=0.01, reduction=reduction,
              use_token_scaling=True, max_chunk_bytes=4 * 29 * 2, **RETURNS)
    check(f"torch {dtype} {reduction}", "torch", h, w, b, t, upstream(reduction, 9), dtype,
          **kw)


def test_float16_triton_defers_the_gradient_with_every_option() -> None:
    """float16 takes the deferred path (gradients in backward, scaled by the upstream
    gradient before rounding): class weights and token scaling reach its per-token
    scales there too."""
    h, w, b, t, cw = make_inputs(6, 16, 29, seed=3)
    h16 = h.to(DEVICE, F16).requires_grad_(True)
    plan = lmfuse.explain(lmfuse.linear_cross_entropy, h16, w.to(DEVICE, F16), t.to(DEVICE),
                          impl="triton")
    assert plan.details["passes"].startswith("deferred")
    kw = dict(ce_weight=cw, label_smoothing=0.1, z_loss=0.01, use_token_scaling=True,
              **RETURNS)
    check("triton float16", "triton", h, w, b, t, torch.tensor(64.0), F16, **kw)


# --- token scaling and class weights against PyTorch --------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("impl", IMPLS)
def test_token_scaling_is_liger_formula(impl: str, reduction: str) -> None:
    """``use_token_scaling``: each token's ``F.cross_entropy(weight=ce_weight,
    label_smoothing=...)`` loss times its detached ``softmax(logits)[target]``; a mean
    divides by the sum of the counted targets' weights, as without scaling."""
    h, w, b, t, cw = make_inputs(8, 8, 23, seed=4)
    grad_out = upstream(reduction, 8)
    x = h.requires_grad_(True)
    logits = x @ w.T + b
    per_token = F.cross_entropy(logits, t, weight=cw, label_smoothing=0.1, reduction="none")
    valid = t != IGNORE
    p = torch.softmax(logits.detach(), -1).gather(1, torch.where(valid, t, 0)[:, None])[:, 0]
    scaled = per_token * torch.where(valid, p, torch.zeros_like(p))
    want = (scaled if reduction == "none" else scaled.sum() / cw[t[valid]].sum()
            if reduction == "mean" else scaled.sum())
    (dh_want,) = torch.autograd.grad(want, x, grad_out.double())
    loss, (dh, _dw, _db) = run(impl, h, w, b, t, grad_out, ce_weight=cw, label_smoothing=0.1,
                               reduction=reduction, use_token_scaling=True)
    assert_close(loss, want.detach().float(), F32, "loss vs F.cross_entropy * p_t")
    assert_close(dh, dh_want.float(), F32, "d hidden vs autograd of F.cross_entropy * p_t")


@pytest.mark.parametrize("impl", IMPLS)
def test_class_weights_match_f_cross_entropy(impl: str) -> None:
    """``ce_weight`` is ``F.cross_entropy``'s ``weight``: the weighted mean over the
    counted targets' weights, smoothing weighing each class by its weight."""
    h, w, b, t, cw = make_inputs(10, 8, 31, seed=5)
    x = h.requires_grad_(True)
    want = F.cross_entropy(x @ w.T + b, t, weight=cw, label_smoothing=0.2)
    (dh_want,) = torch.autograd.grad(want, x)
    loss, (dh, _dw, _db) = run(impl, h, w, b, t, torch.tensor(1.0), ce_weight=cw,
                               label_smoothing=0.2, max_chunk_bytes=4 * 31 * 4)
    assert_close(loss, want.detach().float(), F32, "loss vs F.cross_entropy(weight=...)")
    assert_close(dh, dh_want.float(), F32, "d hidden vs F.cross_entropy(weight=...)")


# --- every launch of the kernels ------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_every_launch(monkeypatch: pytest.MonkeyPatch, launch: str, reduction: str) -> None:
    """Weights, token scaling and every return through each launch of the cross-entropy
    kernels on the logits chunks, fused ("mean": the gradient written in the forward, with
    the kernels' TOKEN_SCALE) and deferred ("none"): 7 tokens in chunks of 3, V = 50."""
    force(monkeypatch, launch)
    h, w, b, t, cw = make_inputs(7, 8, 50, seed=6)
    kw = dict(ce_weight=cw, label_smoothing=0.2, z_loss=0.01, softcap=6.0,
              reduction=reduction, use_token_scaling=True, max_chunk_bytes=3 * 50 * 4,
              **RETURNS)
    check(f"{launch} {reduction}", "triton", h, w, b, t, upstream(reduction, 7), **kw)
    kw.update(ce_weight=None, label_smoothing=0.0, softcap=None)  # the unweighted kernels
    check(f"{launch} {reduction} unweighted", "triton", h, w, b, t, upstream(reduction, 7),
          **kw)


# The interpreter reduces tl.max with np.nanmax, which warns on the NaN row (the GPU's
# max.f32 just gives NaN), as in test_properties.py.
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
@pytest.mark.parametrize("launch", ["chunked", "vec-prefetch", "table"])
def test_predicted_tokens_ties_and_nan(monkeypatch: pytest.MonkeyPatch, launch: str) -> None:
    """Equal logits in two vocabulary chunks (weight rows 3 and 40 alike): the first is
    predicted, as ``torch.argmax``; a NaN hidden row predicts 0 (NaN is the maximum)."""
    force(monkeypatch, launch)
    h, w, b, t, _ = make_inputs(5, 8, 50, seed=7, bias=False, every=0)
    w[3] *= 5.0
    w[40] = w[3]
    h[0] = w[3]  # row 0: 3 and 40 tie for the max, far above the rest
    h[2, 1] = float("nan")
    t[2] = IGNORE
    out, _ = run("triton", h, w, None, t, torch.tensor(1.0), return_predicted_tokens=True)
    want = (h.float() @ w.float().T).argmax(-1)
    want[2] = -1  # ignored
    assert out.predicted_tokens[0] == 3
    assert torch.equal(out.predicted_tokens, want), (out.predicted_tokens, want)


# --- plumbing --------------------------------------------------------------------------


def test_custom_ops_carry_every_option(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the torch.library custom ops (what torch.compile sees) the class weights,
    the argmax and the token scaling arrive as in the direct launches: equal results."""
    h, w, b, t, cw = make_inputs(6, 8, 37, seed=8)
    for reduction in ("mean", "none"):
        kw = dict(ce_weight=cw, label_smoothing=0.1, z_loss=1e-3, reduction=reduction,
                  use_token_scaling=True, max_chunk_bytes=4 * 37 * 4, **RETURNS)
        results = []
        for via_ops in (False, True):
            if via_ops:
                ce_through_custom_ops(monkeypatch)
            out, grads = run("triton", h, w, b, t, upstream(reduction, 6), **kw)
            results.append((*out, *grads))
        for direct, via_ops in zip(*results):
            assert torch.equal(direct, via_ops), reduction


def test_no_option_returns_the_loss_and_cpu_default_takes_weights(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``return_*`` the op returns the loss tensor itself; on CPU float32 tensors
    the default path (``F.linear`` + ``F.cross_entropy``) takes ``ce_weight`` and gives the
    reference's loss; token scaling and the returns take the chunked path. (CPU tensors
    whatever the test device: this is the CPU's own path.)"""
    monkeypatch.setattr(ops, "select_impl", lambda op, impl, device: (
        ("torch", "test: no Triton") if impl == "auto" else _select_impl(op, impl, device)))
    calls = []
    real = ops._native_cross_entropy
    monkeypatch.setattr(ops, "_native_cross_entropy",
                        lambda *a: (calls.append(1), real(*a))[1])
    h, w, b, t, cw = make_inputs(6, 8, 13, seed=9)
    hf, wf, bf = h.float(), w.float(), b.float()
    loss = lmfuse.linear_cross_entropy(hf, wf, t, bias=bf, ce_weight=cw.float(),
                                       label_smoothing=0.1)
    assert type(loss) is torch.Tensor and calls == [1]
    want = linear_cross_entropy_reference(h, w, t, bias=b, ce_weight=cw, label_smoothing=0.1)
    assert_close(loss, want.float(), F32, "CPU default path with ce_weight")
    for extra in (dict(use_token_scaling=True), dict(return_z_loss=True)):
        lmfuse.linear_cross_entropy(hf, wf, t, bias=bf, ce_weight=cw.float(), **extra)
        assert calls == [1], extra


def test_explain_names_the_options() -> None:
    h, w, b, t, cw = make_inputs(4, 8, 37, seed=10)
    args = (h.float().to(DEVICE), w.float().to(DEVICE), t.to(DEVICE))
    plan = lmfuse.explain(lmfuse.linear_cross_entropy, *args, ce_weight=cw.float().to(DEVICE),
                          return_predicted_tokens=True, use_token_scaling=True,
                          impl="triton")
    assert plan.details["options"] == "class weights, argmax in the stats pass, token scaling"
    assert "options" not in lmfuse.explain(lmfuse.linear_cross_entropy, *args).details


BAD = [
    pytest.param(dict(ce_weight=torch.ones(9, 1)), ValueError,
                 r"ce_weight must be 1-D \[V\] with V = weight.shape\[0\] = 9, got shape "
                 r"\(9, 1\)", id="ce-weight-2d"),
    pytest.param(dict(ce_weight=torch.ones(8)), ValueError,
                 r"ce_weight must be 1-D \[V\] with V = weight.shape\[0\] = 9, got shape "
                 r"\(8,\)", id="ce-weight-length"),
    pytest.param(dict(ce_weight=torch.ones(9, dtype=torch.int64)), TypeError,
                 r"ce_weight must be a floating-point tensor \(class weights\), got "
                 r"torch.int64", id="ce-weight-int"),
    pytest.param(dict(ce_weight=[1.0] * 9), TypeError,
                 r"ce_weight must be a torch.Tensor of class weights or None, got list",
                 id="ce-weight-list"),
    pytest.param(dict(ce_weight=torch.ones(9, device="meta")), ValueError,
                 r"ce_weight is on meta but weight is on {device}; move them to one device",
                 id="ce-weight-device"),
    pytest.param(dict(use_token_scaling=1), TypeError,
                 r"use_token_scaling must be a bool, got 1", id="scaling-int"),
    pytest.param(dict(return_z_loss="yes"), TypeError, r"return_z_loss must be a bool",
                 id="return-z-str"),
    pytest.param(dict(return_predicted_tokens=None), TypeError,
                 r"return_predicted_tokens must be a bool", id="return-pred-none"),
]


@pytest.mark.parametrize("kw, error, message", BAD)
def test_bad_options_raise(kw: dict[str, Any], error: type[Exception], message: str) -> None:
    h, w = torch.randn(4, 8, device=DEVICE), torch.randn(9, 8, device=DEVICE)
    t = torch.zeros(4, dtype=torch.long, device=DEVICE)
    kw = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v
          for k, v in kw.items()}
    message = message.replace("{device}", str(w.device))
    for call in (lmfuse.linear_cross_entropy,
                 lambda *a, **k: lmfuse.explain(lmfuse.linear_cross_entropy, *a, **k)):
        with pytest.raises(error, match=rf"^linear_cross_entropy: {message}"):
            call(h, w, t, **kw)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_accum_dtype_float32_sums_the_weight_gradient_once(impl: str, dtype) -> None:
    """accum_dtype=torch.float32 (Liger's option): the weight's gradient over 256 logits
    chunks is summed in float32 and rounded once, within the rounding of one chunk's
    product of the float64 truth, where the default (a rounding a chunk) drifts past it;
    the loss, hidden's and the bias's gradients are unchanged."""
    g = torch.Generator().manual_seed(0)
    N, H, V = 4096, 16, 32
    h = torch.randn(N, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    b = torch.randn(V, generator=g).to(dtype)
    t = torch.randint(0, V, (N,), generator=g)
    h64, w64, b64 = (x.double().requires_grad_() for x in (h, w, b))
    torch.nn.functional.cross_entropy(torch.nn.functional.linear(h64, w64, b64),
                                      t).backward()
    chunk = 16 * V * h.element_size()  # 16 tokens a chunk: 256 chunks

    def run(**kw):
        hh, ww, bb = (x.to(DEVICE, copy=True).requires_grad_() for x in (h, w, b))
        loss = lmfuse.linear_cross_entropy(hh, ww, t.to(DEVICE), bias=bb, impl=impl,
                                           **{"max_chunk_bytes": chunk, **kw})
        loss.backward()
        return (x.cpu() for x in (loss, hh.grad, ww.grad, bb.grad))

    def err(x, ref):
        return float((x.double() - ref).norm() / ref.norm())

    loss0, dh0, dw0, db0 = run()
    loss1, dh1, dw1, db1 = run(accum_dtype=torch.float32)
    assert dw1.dtype == dtype
    # One chunk: the product rounded once (bfloat16, either path: 1.9e-3); summed in
    # float32 the same, in bfloat16 1.7e-2.
    one = err(list(run(max_chunk_bytes=N * V * h.element_size()))[2], w64.grad)
    errs = (f"one chunk {one:.2e}, float32 {err(dw1, w64.grad):.2e}, "
            f"default {err(dw0, w64.grad):.2e}")
    assert err(dw1, w64.grad) <= 1.2 * one, errs
    assert err(dw0, w64.grad) > 2 * one, errs
    assert torch.equal(loss0, loss1) and torch.equal(dh0, dh1) and torch.equal(db0, db1)
    plan = lmfuse.explain(lmfuse.linear_cross_entropy, h.to(DEVICE), w.to(DEVICE),
                          t.to(DEVICE), bias=b.to(DEVICE), impl=impl,
                          accum_dtype=torch.float32)
    assert "the weight's gradient summed in float32" in str(plan)


@pytest.mark.parametrize("value, error", [(torch.float64, ValueError), ("float32", TypeError),
                                          (torch.int32, ValueError)])
def test_accum_dtype_refused(value, error) -> None:
    h, w = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(16, 8, dtype=torch.bfloat16)
    with pytest.raises(error, match=r"^linear_cross_entropy: accum_dtype must be None, "
                                    r"torch.float32 or weight's dtype"):
        lmfuse.linear_cross_entropy(h, w, torch.zeros(4, dtype=torch.long), accum_dtype=value)


def test_upstream_gradient_scales_in_float32() -> None:
    """The fused gradients (bfloat16: formed in the forward for an upstream gradient of 1;
    float16's are formed in the backward, with it) are scaled
    by the upstream gradient in float32 and rounded once: 1/378 (a gradient accumulation's
    1 / num_items_in_batch) rounded to bfloat16 first made every gradient 0.22% small."""
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    N, H, V = 64, 16, 32
    h = torch.randn(N, H, generator=g).to(dtype)
    w = torch.randn(V, H, generator=g).to(dtype)
    t = torch.randint(0, V, (N,), generator=g)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = lmfuse.linear_cross_entropy(hh, ww, t, reduction="sum", impl="torch")
    (loss / 378).backward()
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    lmfuse.linear_cross_entropy(h1, w1, t, reduction="sum", impl="torch").backward()
    for got, unit in ((hh.grad, h1.grad), (ww.grad, w1.grad)):
        assert torch.equal(got, (unit.float() / 378).to(dtype))
