"""``lmfuse.cross_entropy``'s Liger/PyTorch options: class ``weight``, ``return_z_loss``,
``return_token_accuracy`` and ``return_predicted_tokens``, on the torch path and the
Triton path (the kernels under the interpreter), every launch.

Oracles, in float64: ``cross_entropy_reference`` (``reference.py``, the spec of every
option) and, where it has the option, ``F.cross_entropy`` (class weights with label
smoothing and its weighted mean) and ``torch.argmax`` (the predicted tokens: first maximum,
NaN counts as the maximum).

Inputs are made on the CPU; the op runs on ``helpers.TEST_DEVICE`` (CUDA under
``LMFUSE_GPU_TESTS=1``, the kernels compiled: ``LMFUSE_GPU_TESTS=1 python -m pytest
tests/cross_entropy/test_options.py``) and its results come back to the CPU, where the
oracles run in float64.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import TEST_DEVICE as DEVICE
from helpers import CE_LAUNCHES, assert_close, ce_through_custom_ops, force_ce_launch, randn

import lmfuse
from lmfuse._dispatch import select_impl as _select_impl
from lmfuse.cross_entropy import CrossEntropyOutput, ops
from lmfuse.cross_entropy.reference import cross_entropy_reference

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
IMPLS = ["triton", "torch"]
IGNORE = -100
RETURNS = dict(return_z_loss=True, return_token_accuracy=True, return_predicted_tokens=True)

LAUNCHES = list(CE_LAUNCHES)
force = force_ce_launch


def make_target(shape: tuple[int, ...], V: int, gen: torch.Generator,
                every: int = 4) -> torch.Tensor:
    t = torch.randint(0, V, shape, generator=gen)
    t.view(-1)[1::every] = IGNORE
    return t


def class_weights(V: int, gen: torch.Generator) -> torch.Tensor:
    """Positive weights between 0.2 and 2.2 (never equal, never 0)."""
    return torch.rand(V, generator=gen) * 2.0 + 0.2


def on(device: torch.device, kw: dict[str, Any]) -> dict[str, Any]:
    """``kw`` with its CPU tensors (class weights) moved to ``device``."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v
            for k, v in kw.items()}


def to_cpu(out: Any) -> Any:
    """The op's result (a tensor or a ``CrossEntropyOutput``) on the CPU."""
    if isinstance(out, CrossEntropyOutput):
        return CrossEntropyOutput(*(None if f is None else f.cpu() for f in out))
    return out.cpu()


def run(impl: str, logits: torch.Tensor, target: torch.Tensor, grad_out: torch.Tensor | None,
        device: torch.device = DEVICE, **kw: Any) -> tuple[Any, torch.Tensor | None]:
    """The op's result and the logits' gradient, on a fresh copy of ``logits`` on ``device``
    (the test device), both returned on the CPU."""
    leaf = logits.detach().to(device).clone().requires_grad_(grad_out is not None)
    x = leaf * 1 if kw.get("inplace_backward") else leaf
    out = lmfuse.cross_entropy(x, target.to(device), impl=impl, **on(device, kw))
    loss = out.loss if isinstance(out, CrossEntropyOutput) else out
    if grad_out is not None:
        loss.backward(grad_out.to(device))
    return to_cpu(out), None if leaf.grad is None else leaf.grad.cpu()


def reference(logits: torch.Tensor, target: torch.Tensor, grad_out: torch.Tensor | None,
              **kw: Any) -> tuple[Any, torch.Tensor | None]:
    keep = {k: v for k, v in kw.items() if k not in ("inplace_backward",)}
    x = logits.detach().double().requires_grad_(True)
    if "weight" in keep:
        keep["weight"] = keep["weight"].double()
    out = cross_entropy_reference(x, target, **keep)
    loss = out.loss if isinstance(out, CrossEntropyOutput) else out
    if grad_out is None:
        return out, None
    (dx,) = torch.autograd.grad(loss, x, grad_out.double())
    return out, dx


def check(what: str, impl: str, logits: torch.Tensor, target: torch.Tensor,
          grad_out: torch.Tensor | None, device: torch.device = DEVICE,
          **kw: Any) -> tuple[Any, torch.Tensor | None]:
    """Every field of the result and the gradient (on ``device``) against the float64
    reference (on the CPU)."""
    result, dx = run(impl, logits, target, grad_out, device, **kw)
    out = result
    want, dx_ref = reference(logits, target, grad_out, **kw)
    if not isinstance(want, CrossEntropyOutput):
        assert isinstance(out, torch.Tensor) and not isinstance(out, tuple), what
        out, want = CrossEntropyOutput(out), CrossEntropyOutput(want)
    assert isinstance(out, CrossEntropyOutput), f"{what}: {type(out)}"
    assert out.loss.dtype == F32
    assert_close(out.loss, want.loss.float(), F32, f"{what}: loss")
    for name in ("z_loss", "token_accuracy"):
        got, exp = getattr(out, name), getattr(want, name)
        assert (got is None) == (exp is None), f"{what}: {name} {got}"
        if got is not None:
            assert got.dtype == F32 and not got.requires_grad, f"{what}: {name} {got}"
            assert_close(got, exp.float(), F32, f"{what}: {name}")
    if want.predicted_tokens is None:
        assert out.predicted_tokens is None, what
    else:
        got = out.predicted_tokens
        assert got.dtype == torch.int64 and got.shape == target.shape, f"{what}: {got}"
        assert torch.equal(got, want.predicted_tokens), f"{what}: {got} != {want}"
    if grad_out is not None:
        assert dx is not None and dx.dtype == logits.dtype, what
        assert_close(dx, dx_ref.to(logits.dtype), logits.dtype, f"{what}: d logits")
    return result, dx


def upstream(reduction: str, target: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return torch.rand(target.shape, generator=gen) + 0.5 if reduction == "none" else \
        torch.tensor(3.5)


# --- class weights against F.cross_entropy ---------------------------------------------


WEIGHT_CASES = [
    pytest.param(dtype, red, ls, id=f"{str(dtype)[6:]}-{red}-ls{ls}")
    for dtype, red, ls in [*itertools.product([F32], ("mean", "sum", "none"), (0.0, 0.1)),
                           (F16, "sum", 0.1), (F16, "none", 0.0), (BF16, "mean", 0.1),
                           (BF16, "none", 0.1)]
]


@pytest.mark.parametrize("dtype, reduction, label_smoothing", WEIGHT_CASES)
@pytest.mark.parametrize("impl", IMPLS)
def test_weight_matches_reference_and_torch(impl: str, dtype: torch.dtype, reduction: str,
                                            label_smoothing: float) -> None:
    """[2, 3, 37] logits, class weights, some tokens ignored: loss and gradient as the
    reference's and as ``F.cross_entropy(weight=...)``'s (its mean: over sum w[target])."""
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 3, 37, generator=gen) * 3.0).to(dtype)
    target = make_target((2, 3), 37, gen)
    weight = class_weights(37, gen)
    grad_out = upstream(reduction, target, gen)
    kw = dict(weight=weight, label_smoothing=label_smoothing, reduction=reduction)
    out, dx = check(f"{impl} {dtype} {kw}", impl, logits, target, grad_out, **kw)

    x = logits.detach().double().requires_grad_(True)
    want = F.cross_entropy(x.view(-1, 37), target.view(-1), weight=weight.double(),
                           label_smoothing=label_smoothing, reduction=reduction)
    want = want.view(target.shape) if reduction == "none" else want
    (dx_torch,) = torch.autograd.grad(want, x, grad_out.double())
    assert_close(out, want.float(), F32, "vs F.cross_entropy: loss")
    assert_close(dx, dx_torch.to(dtype), dtype, "vs F.cross_entropy: d logits")


def test_weight_with_no_token_counted_and_zero_weight_sum() -> None:
    """A mean over no token is 0 (lmfuse's convention) with weights too, on both paths;
    targets whose weights sum to 0 give F.cross_entropy's 0 / 0 (NaN)."""
    gen = torch.Generator().manual_seed(2)
    logits = randn((4, 9))
    weight = class_weights(9, gen)
    for impl in IMPLS:
        out, dx = run(impl, logits, torch.full((4,), IGNORE), torch.tensor(1.0), weight=weight)
        assert out == 0 and torch.equal(dx, torch.zeros_like(dx)), impl
        zero = weight.clone()
        zero[[2, 5]] = 0.0
        target = torch.tensor([2, 5, IGNORE, 2])
        with np.errstate(divide="ignore", invalid="ignore"):  # 0 / 0, as PyTorch's
            out, _ = run(impl, logits, target, None, weight=zero)
        want = F.cross_entropy(logits.double(), target, weight=zero.double())
        assert out.isnan() and want.isnan(), (impl, out, want)
        # With label smoothing too: its term alone is x / 0 = inf, PyTorch's sum NaN, and
        # so are the gradients of the counted rows (once inf and -inf, or inf).
        x = logits.double().requires_grad_(True)
        want = F.cross_entropy(x, target, weight=zero.double(), label_smoothing=0.3)
        (want_dx,) = torch.autograd.grad(want, x)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            out, dx = run(impl, logits, target, torch.tensor(1.0), weight=zero,
                          label_smoothing=0.3)
        assert out.isnan() and want.isnan(), (impl, out, want)
        assert torch.equal(dx.isnan(), want_dx.isnan()), (impl, dx, want_dx)


# --- the returned values ----------------------------------------------------------------


COMBOS = [
    pytest.param(red, weighted, kw, inplace,
                 id=f"{red}-{'w' if weighted else 'now'}-{'-'.join(kw) or 'plain'}"
                 + ("-inplace" if inplace else ""))
    for red, weighted, kw, inplace in itertools.product(
        ("mean", "sum", "none"), (False, True),
        (dict(), dict(label_smoothing=0.1, z_loss=0.01, softcap=4.0)), (False, True))
    if not (inplace and not kw) and not (weighted and not kw) and not (inplace and not weighted)
]


@pytest.mark.parametrize("reduction, weighted, options, inplace", COMBOS)
@pytest.mark.parametrize("impl", IMPLS)
def test_every_return_with_every_option(impl: str, reduction: str, weighted: bool,
                                        options: dict[str, Any], inplace: bool) -> None:
    """All four fields and the gradient, against the reference: float32 [5, 37] logits
    with a tie for the max in row 0 (the first wins), every option on or off."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 37, generator=gen) * 2.0
    logits[0, [4, 30]] = logits[0].max() + 1.0
    target = make_target((5,), 37, gen)
    target[0], target[2] = 30, int(logits[2].argmax())  # a tie's second; a right guess
    kw = dict(options, reduction=reduction, inplace_backward=inplace, **RETURNS)
    if weighted:
        kw["weight"] = class_weights(37, gen)
    out, _ = check(f"{impl} {kw}", impl, logits, target, upstream(reduction, target, gen),
                   **kw)
    assert out.loss.requires_grad and out.predicted_tokens[0] == 4


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fields", [("return_z_loss",), ("return_token_accuracy",),
                                    ("return_predicted_tokens",),
                                    ("return_z_loss", "return_predicted_tokens")],
                         ids=lambda f: "+".join(n[len("return_"):] for n in f))
def test_fields_not_asked_for_are_none(impl: str, fields: tuple[str, ...]) -> None:
    """The named tuple has None where not asked; without any ``return_*`` the op returns
    the loss tensor itself, as before."""
    gen = torch.Generator().manual_seed(4)
    logits = randn((3, 4, 11))
    target = make_target((3, 4), 11, gen)
    out = check(f"{impl} {fields}", impl, logits, target, torch.tensor(1.0), z_loss=1e-3,
                **{f: True for f in fields})[0]
    for name in RETURNS:
        assert (getattr(out, name[len("return_"):]) is None) == (name not in fields), out
    plain = lmfuse.cross_entropy(logits.to(DEVICE), target.to(DEVICE), impl=impl)
    assert type(plain) is torch.Tensor and plain.dim() == 0


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_returned_values_by_hand(impl: str, reduction: str) -> None:
    """Accuracy is over the non-ignored tokens (2 of 3 right here), per token for "none";
    predicted tokens are -1 where ignored; the z-loss is reduced as the loss (mean: over
    the 3 counted tokens) and 0 where ignored; with z_loss=0 it is 0."""
    logits = torch.tensor([[0.0, 5.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 3.0], [9.0, 0.0, 0.0]])
    target = torch.tensor([1, 2, 2, IGNORE])
    out, _ = run(impl, logits, target, None, z_loss=0.5, reduction=reduction, **RETURNS)
    assert out.predicted_tokens.tolist() == [1, 0, 2, -1]
    lse = torch.logsumexp(logits.double(), -1)[:3]
    z_tok = torch.cat([0.5 * lse * lse, torch.zeros(1, dtype=F64)])
    if reduction == "none":
        assert out.token_accuracy.tolist() == [1.0, 0.0, 1.0, 0.0]
        assert_close(out.z_loss, z_tok.float(), F32, "z_loss per token")
    else:
        assert out.token_accuracy.item() == pytest.approx(2 / 3)
        want = z_tok.sum() / (3 if reduction == "mean" else 1)
        assert_close(out.z_loss, want.float(), F32, "z_loss")
    none_ignored, _ = run(impl, logits, torch.full((4,), IGNORE), None, reduction=reduction,
                          **RETURNS)
    assert (none_ignored.token_accuracy == 0).all() and (none_ignored.z_loss == 0).all()
    assert (none_ignored.predicted_tokens == -1).all()
    no_z, _ = run(impl, logits, target, None, reduction=reduction, **RETURNS)
    assert (no_z.z_loss == 0).all()


# --- every launch: weights, argmax over chunks, special values ----------------------------


def argmax_batch(V: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    """[8, V] float32, one argmax case a row: 0 a tie across chunks (columns 3 and 40),
    1 a tie in one chunk (17, 18), 2 the max in the tail chunk, 3 a NaN after the max,
    4 NaN twice (the first wins), 5 +inf twice, 6 every logit -inf (column 0), 7 -inf but
    one column."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, V, generator=gen)
    x[0, [3, 40]] = 9.0
    x[1, [17, 18]] = 9.0
    x[2, V - 1] = 9.0
    x[3, 5], x[3, 30] = 9.0, float("nan")
    x[4, [33, 12]] = float("nan")
    x[5, [21, 44]] = float("inf")
    x[6] = float("-inf")
    x[7] = float("-inf")
    x[7, 37] = 0.0
    return x, torch.tensor([3, 18, V - 1, 5, 0, 21, 0, 37])


@pytest.mark.parametrize("grad", [False, True], ids=["stats", "fused"])
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_predicted_tokens_are_torch_argmax(monkeypatch: pytest.MonkeyPatch, launch: str,
                                           grad: bool) -> None:
    """The running argmax of every stats loop (stats-only pass and the fused
    stats-and-gradient pass) is ``torch.argmax``'s: first max across and within chunks,
    the tail chunk, NaN first, +inf, rows of -inf."""
    force(monkeypatch, launch)
    x, t = argmax_batch()
    want = x.argmax(dim=-1)
    with np.errstate(invalid="ignore"):  # the NaN rows' own NaN
        out, _ = run("triton", x, t, torch.tensor(1.0) if grad else None,
                     return_predicted_tokens=True, return_token_accuracy=True)
    assert torch.equal(out.predicted_tokens, want), (out.predicted_tokens, want)
    assert out.token_accuracy.item() == pytest.approx((want == t).float().mean().item())
    ref_pred = cross_entropy_reference(x, t, return_predicted_tokens=True).predicted_tokens
    assert torch.equal(ref_pred, want)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_every_launch_with_weights_and_returns(monkeypatch: pytest.MonkeyPatch, launch: str,
                                               reduction: str) -> None:
    """Class weights, smoothing, z-loss, softcap and every return through each launch,
    fused ("mean") and deferred ("none"): 7 rows (a tail tile), V = 50 (tail chunks)."""
    force(monkeypatch, launch)
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(7, 50, generator=gen) * 3.0
    target = make_target((7,), 50, gen, every=3)
    kw = dict(weight=class_weights(50, gen), label_smoothing=0.2, z_loss=0.01, softcap=6.0,
              reduction=reduction, **RETURNS)
    check(f"{launch} {reduction}", "triton", logits, target, upstream(reduction, target, gen),
          **kw)
    kw.update(softcap=None, label_smoothing=0.0, inplace_backward=True)  # no smoothing term
    check(f"{launch} {reduction} inplace", "triton", logits, target,
          upstream(reduction, target, gen), **kw)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1], ids=["ls0", "ls0.1"])
@pytest.mark.parametrize("impl, launch", [("torch", "table"), ("triton", "table"),
                                          ("triton", "vec-prefetch")])
def test_weighted_special_values_as_torch(monkeypatch: pytest.MonkeyPatch, impl: str,
                                          launch: str, label_smoothing: float) -> None:
    """NaN, +inf and -inf logits with class weights (one of them 0, on a -inf column):
    NaN and inf exactly where ``F.cross_entropy(weight=...)`` has them, per token and
    in the gradient, the finite values equal."""
    force(monkeypatch, launch)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, 37, generator=gen)
    t = torch.randint(0, 37, (6,), generator=gen)
    t[0], t[4] = 2, IGNORE
    x[1, (t[1] + 1) % 37] = float("nan")
    x[2, (t[2] + 1) % 37] = float("inf")
    x[3] = float("-inf")
    x[:, 9] = float("-inf")  # a masked class ...
    t[t == 9] = 10
    weight = class_weights(37, gen)
    weight[9] = 0.0  # ... of weight 0: with smoothing 0 * -inf, NaN as in PyTorch
    grad_out = torch.linspace(0.5, 2.0, 6)
    kw = dict(weight=weight, label_smoothing=label_smoothing, reduction="none")
    with np.errstate(invalid="ignore"):
        loss, dx = run(impl, x, t, grad_out, **kw)
    xd = x.double().requires_grad_(True)
    want = F.cross_entropy(xd, t, weight=weight.double(), label_smoothing=label_smoothing,
                           reduction="none")
    (dx_want,) = torch.autograd.grad(want, xd, grad_out.double())
    for got, exp, what in ((loss, want, "loss"), (dx, dx_want, "d logits")):
        assert torch.equal(got.isnan(), exp.isnan()), (what, got, exp)
        fin = ~exp.isnan()
        assert torch.equal(got[fin].isinf(), exp[fin].isinf()), (what, got, exp)
        ok = fin & ~exp.isinf()
        assert_close(got[ok], exp[ok].float(), F32, what)


# --- plumbing: the custom ops (compiled code's path), the CPU default, bad input ----------


def test_custom_ops_carry_weights_and_argmax(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the torch.library custom ops (what torch.compile sees) the weights, their
    stats and the argmax row arrive as in the direct launches: equal results."""
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(5, 37, generator=gen) * 2.0
    target = make_target((5,), 37, gen)
    weight = class_weights(37, gen)
    for reduction, inplace in (("mean", False), ("mean", True), ("none", False),
                               ("none", True)):
        kw = dict(weight=weight, label_smoothing=0.1, z_loss=1e-3, reduction=reduction,
                  inplace_backward=inplace, **RETURNS)
        results = []
        for via_ops in (False, True):
            if via_ops:
                ce_through_custom_ops(monkeypatch)
            out, dx = run("triton", logits, target, torch.ones(target.shape)
                          if reduction == "none" else torch.tensor(2.0), **kw)
            results.append((*out, dx))
        for direct, via_ops in zip(*results):
            assert torch.equal(direct, via_ops), (reduction, inplace)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_default_cpu_path_takes_weights(monkeypatch: pytest.MonkeyPatch, reduction: str) -> None:
    """On CPU float32 logits the default path runs ``F.cross_entropy(weight=...)`` (the
    returns need the reference path): the reference's results either way."""
    monkeypatch.setattr(ops, "select_impl", lambda op, impl, device: (
        ("torch", "test: no Triton") if impl == "auto" else _select_impl(op, impl, device)))
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(6, 13, generator=gen) * 2.0
    target = make_target((6,), 13, gen)
    kw = dict(weight=class_weights(13, gen), label_smoothing=0.1, reduction=reduction)
    _, _, o = ops._resolve(logits, target, IGNORE, 0.1, 0.0, None, reduction, None, False,
                           "auto", kw["weight"])
    assert ops._native_cpu(logits, "auto", o)
    cpu = torch.device("cpu")  # (the CPU's own path, whatever the test device)
    check(f"native {reduction}", "auto", logits, target, upstream(reduction, target, gen), cpu,
          **kw)
    check(f"auto + returns {reduction}", "auto", logits, target,
          upstream(reduction, target, gen), cpu, **kw, **RETURNS)


def test_explain_names_the_options() -> None:
    logits, target = randn((4, 37)).to(DEVICE), torch.tensor([1, 2, 3, 4], device=DEVICE)
    plan = lmfuse.explain(lmfuse.cross_entropy, logits, target,
                          weight=torch.ones(37, device=DEVICE), return_token_accuracy=True,
                          impl="triton")
    assert plan.details["options"] == "class weights, argmax in the stats pass"
    assert "options" not in lmfuse.explain(lmfuse.cross_entropy, logits, target).details


BAD = [
    pytest.param(dict(weight=torch.ones(5, 1)), ValueError,
                 r"weight must be 1-D \[V\] with V = logits.shape\[-1\] = 5, got shape "
                 r"\(5, 1\)", id="weight-2d"),
    pytest.param(dict(weight=torch.ones(6)), ValueError,
                 r"weight must be 1-D \[V\] with V = logits.shape\[-1\] = 5, got shape \(6,\)",
                 id="weight-length"),
    pytest.param(dict(weight=torch.ones(5, dtype=torch.int64)), TypeError,
                 r"weight must be a floating-point tensor \(class weights\), got torch.int64",
                 id="weight-int"),
    pytest.param(dict(weight=[1.0] * 5), TypeError,
                 r"weight must be a torch.Tensor of class weights or None, got list",
                 id="weight-list"),
    pytest.param(dict(weight=torch.ones(5, device="meta")), ValueError,
                 r"weight is on meta but logits is on {device}; move them to one device",
                 id="weight-device"),
    pytest.param(dict(return_z_loss=1), TypeError, r"return_z_loss must be a bool, got 1",
                 id="return-z-int"),
    pytest.param(dict(return_token_accuracy="yes"), TypeError,
                 r"return_token_accuracy must be a bool", id="return-acc-str"),
    pytest.param(dict(return_predicted_tokens=None), TypeError,
                 r"return_predicted_tokens must be a bool", id="return-pred-none"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kw, error, message", BAD)
def test_bad_options_raise(kw: dict[str, Any], error: type[Exception], message: str,
                           impl: str) -> None:
    logits, target = randn((3, 5)).to(DEVICE), torch.tensor([0, 4, IGNORE], device=DEVICE)
    kw, message = on(DEVICE, kw), message.replace("{device}", str(logits.device))
    with pytest.raises(error, match=rf"^cross_entropy: {message}"):
        lmfuse.cross_entropy(logits, target, impl=impl, **kw)
    with pytest.raises(error, match=rf"^cross_entropy: {message}"):
        lmfuse.explain(lmfuse.cross_entropy, logits, target, impl=impl, **kw)


def test_options_with_tp_group_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a tp_group of several ranks the options are accepted (weight: the rank's
    ``[V_local]`` shard) and ride in the one all-gather: its rows grow by one for the
    target weights and two for the argmax (a bare 2-rank ProcessGroup over a local store:
    the plan issues no collective; its size and rank read from it, as no default group
    exists here). tests/distributed/test_vocab_parallel_options.py runs them on ranks."""
    group = torch.distributed.ProcessGroup(torch.distributed.HashStore(), 1, 2)
    monkeypatch.setattr(ops, "group_size", lambda g: g.size())
    monkeypatch.setattr(ops, "group_rank", lambda g: g.rank())
    logits = randn((3, 5)).to(DEVICE)
    target = torch.tensor([0, 9, IGNORE], device=DEVICE)
    for kw, rows, options in (
            (dict(weight=torch.ones(5)), 4, "class weights"),
            (dict(return_token_accuracy=True), 5, "argmax in the stats pass"),
            (dict(weight=torch.ones(5), return_predicted_tokens=True), 6,
             "class weights, argmax in the stats pass"),
            (dict(return_z_loss=True), 3, "z-loss returned")):
        plan = lmfuse.explain(lmfuse.cross_entropy, logits, target, tp_group=group,
                              **on(DEVICE, kw))
        assert plan.details["vocabulary"] == (f"5 of 10 (rank 1, one all-gather of [{rows}, "
                                              "N] stats)"), plan.details
        assert plan.details["options"] == options
    with pytest.raises(ValueError, match=r"weight must be 1-D \[V\] with V = logits.shape"
                                         r"\[-1\] = 5, got shape \(10,\)"):
        lmfuse.explain(lmfuse.cross_entropy, logits, target, tp_group=group,
                       weight=torch.ones(10, device=DEVICE))
