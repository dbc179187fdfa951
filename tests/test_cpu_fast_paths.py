"""The ops' CPU fast paths: the common call on float32 CPU tensors, where Triton's interpreter
is off (a CPU machine's default), skips the resolved call and runs PyTorch's op at once
(``lmfuse._dispatch.cpu_fast``). Each must give what the full path gives -- the reference's
results within rounding, the same NaN, the same gradients -- and leave every other call,
bad input included, to the full path and its errors. CI runs with the interpreter on, so
these tests turn it off for the call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lmfuse
from lmfuse.activations import ops as act_ops
from lmfuse.cross_entropy import ops as ce_ops
from lmfuse.norm import ops as norm_ops
from lmfuse.softmax import ops as sm_ops


@pytest.fixture
def no_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _spy(monkeypatch, module, name):
    """Counts the calls of ``module.name`` (the full path's resolution)."""
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    return calls


def _grads(fn, *inputs):
    xs = [x.clone().requires_grad_(True) for x in inputs]
    y = fn(*xs)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    return y.detach(), torch.autograd.grad(y, xs, g)


def _close(got, want, tol=1e-5):
    (y1, g1), (y2, g2) = got, want
    torch.testing.assert_close(y1, y2, rtol=tol, atol=tol, equal_nan=True)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, equal_nan=True)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_fast_path_is_the_full_path(no_interpreter, monkeypatch, reduction,
                                                   smoothing):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 7, generator=g) * 3
    t = torch.randint(0, 7, (12,), generator=g)
    t[::4] = -100
    resolved = _spy(monkeypatch, ce_ops, "_resolve")
    got = _grads(lambda x: lmfuse.cross_entropy(x, t, label_smoothing=smoothing,
                                                reduction=reduction), x)
    assert not resolved  # the fast path answered
    want = _grads(lambda x: lmfuse.cross_entropy(x, t, label_smoothing=smoothing,
                                                 reduction=reduction, impl="torch"), x)
    _close(got, want)


def test_cross_entropy_fast_path_mean_over_no_token_and_nan(no_interpreter):
    x = torch.randn(4, 5)
    t = torch.full((4,), -100)
    loss = lmfuse.cross_entropy(x, t)
    assert loss.item() == 0.0  # lmfuse's 0, not PyTorch's 0 / 0
    x[1, 2] = float("nan")
    t = torch.tensor([0, 1, 2, 3])
    assert lmfuse.cross_entropy(x, t).isnan()


def test_cross_entropy_fast_path_leaves_bad_input_to_the_full_path(no_interpreter):
    x = torch.randn(4, 5)
    with pytest.raises(ValueError, match="target"):
        lmfuse.cross_entropy(x, torch.tensor([0, 1, 5, 2]))
    with pytest.raises(ValueError, match="reduction"):
        lmfuse.cross_entropy(x, torch.tensor([0, 1, 2, 3]), reduction="avg")
    with pytest.raises((ValueError, TypeError), match="label_smoothing"):
        lmfuse.cross_entropy(x, torch.tensor([0, 1, 2, 3]), label_smoothing=1.5)
    # What PyTorch's op refuses itself (the fast path leaves these checks to it) reaches
    # lmfuse's own errors, and what it would take otherwise, lmfuse's answer.
    for bad in (torch.tensor([0, 1, 2]), torch.zeros(4, 1, dtype=torch.long),
                torch.tensor(1)):
        with pytest.raises(ValueError, match="target must have shape"):
            lmfuse.cross_entropy(x, bad)
    with pytest.raises(ValueError, match="at least one class"):
        lmfuse.cross_entropy(torch.randn(4, 0), torch.full((4,), -100))
    with pytest.raises(TypeError, match="ignore_index"):
        lmfuse.cross_entropy(x, torch.tensor([0, 1, 2, 3]), ignore_index=2.0)
    t32 = torch.tensor([0, 1, -100, 3], dtype=torch.int32)  # int32 ids: the full path's
    torch.testing.assert_close(lmfuse.cross_entropy(x, t32),
                               F.cross_entropy(x, t32.long()))
    cols = torch.randn(5, 4).t()  # column-strided logits: PyTorch's op takes them
    t = torch.tensor([0, 4, 2, 1])
    torch.testing.assert_close(lmfuse.cross_entropy(cols, t), F.cross_entropy(cols, t))


def test_layer_norm_fast_path_leaves_bad_parameters_to_the_full_path(no_interpreter,
                                                                    monkeypatch):
    """LayerNorm's CPU fast path leaves the parameters' shapes to PyTorch's op; where it
    refuses them lmfuse's own error is raised, and a float32 call with good parameters
    never builds the resolved call."""
    x = torch.randn(3, 8)
    for kw, msg in ((dict(weight=torch.randn(7)), r"weight must be \[H\]"),
                    (dict(weight=torch.randn(1, 8)), "weight must be 1-D"),
                    (dict(bias=torch.randn(9)), r"bias must be \[H\]")):
        with pytest.raises(ValueError, match=msg):
            lmfuse.layer_norm(x, **kw)
    resolved = _spy(monkeypatch, norm_ops, "_resolve_ln")
    w, b = torch.randn(8), torch.randn(8)
    torch.testing.assert_close(lmfuse.layer_norm(x, w, b), F.layer_norm(x, (8,), w, b))
    assert not resolved


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("scale", [None, 0.5])
def test_softmax_fast_path_is_the_full_path(no_interpreter, monkeypatch, causal, scale):
    x = torch.randn(2, 3, 5, 8, generator=torch.Generator().manual_seed(2)) * 3
    resolved = _spy(monkeypatch, sm_ops, "_resolve")
    got = _grads(lambda s: lmfuse.fused_softmax(s, scale=scale, causal=causal), x)
    assert not resolved
    want = _grads(lambda s: lmfuse.fused_softmax(s, scale=scale, causal=causal,
                                                 impl="torch"), x)
    _close(got, want)


@pytest.mark.parametrize("poison", ["nan", "all_minus_inf"])
def test_softmax_fast_path_gives_nan_rows_to_the_full_path(no_interpreter, poison):
    """A NaN row out of torch.softmax (a NaN logit, or a row of nothing visible) sends the
    call to the full path: NaN rows as PyTorch's, dead rows zeros, as the reference."""
    x = torch.randn(1, 2, 4, 6, generator=torch.Generator().manual_seed(3))
    if poison == "nan":
        x[0, 1, 2, 3] = float("nan")
    else:
        x[0, 0, 1] = float("-inf")
    got = _grads(lambda s: lmfuse.fused_softmax(s, scale=0.7), x)
    want = _grads(lambda s: lmfuse.fused_softmax(s, scale=0.7, impl="torch"), x)
    _close(got, want)


def test_softmax_fast_path_leaves_bad_input_to_the_full_path(no_interpreter):
    with pytest.raises(ValueError, match="sq <= sk"):
        lmfuse.fused_softmax(torch.randn(1, 1, 5, 3), causal=True)
    with pytest.raises(ValueError, match="finite"):
        lmfuse.fused_softmax(torch.randn(1, 1, 2, 3), scale=float("inf"))
    with pytest.raises(ValueError):
        lmfuse.fused_softmax(torch.randn(2, 3))


@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_fast_path_is_the_full_path(no_interpreter, monkeypatch, weighted):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 4, 16, generator=g)
    w = torch.randn(16, generator=g) if weighted else None
    resolved = _spy(monkeypatch, norm_ops, "_resolve")
    if weighted:
        got = _grads(lambda x, w: lmfuse.rms_norm(x, w, eps=1e-5), x, w)
    else:
        got = _grads(lambda x: lmfuse.rms_norm(x, eps=1e-5), x)
    assert not resolved
    if weighted:
        want = _grads(lambda x, w: lmfuse.rms_norm(x, w, eps=1e-5, impl="torch"), x, w)
    else:
        want = _grads(lambda x: lmfuse.rms_norm(x, eps=1e-5, impl="torch"), x)
    _close(got, want)


def test_rms_norm_fast_path_overflowing_row(no_interpreter):
    """A finite row whose mean square overflows (rstd 0): NaN gradients where the formula's
    terms are ``inf * 0`` (its ``sum(dy * w * x)`` or ``2 x`` overflowing), zeros elsewhere,
    as ``F.rms_norm``'s."""
    x = torch.tensor([[3e38, 1.0, 2.0, -1.0], [3e38, 1.0, 2.0, -1.0]])
    w = torch.tensor([2.0, 1.0, 1.0, 1.0])
    dy = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.5, 1.0, 1.0, 1.0]])
    got, want = [], []
    for fn, out in ((lambda a, b: lmfuse.rms_norm(a, b, eps=1e-6), got),
                    (lambda a, b: torch.nn.functional.rms_norm(a, (4,), b, 1e-6), want)):
        leaves = [x.clone().requires_grad_(True), w.clone().requires_grad_(True)]
        out.extend(torch.autograd.grad(fn(*leaves), leaves, dy))
    assert want[0][0].isnan().all() and want[0][1, 0].isnan() and (want[0][1, 1:] == 0).all()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, equal_nan=True)


def test_rms_norm_fast_path_takes_a_module_weight(no_interpreter, monkeypatch):
    """A module's weight is an ``nn.Parameter`` (a tensor subclass the fast path takes as
    it is: ``lmfuse.RMSNorm`` and models' own norms call with one)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 5, 16, generator=g, requires_grad=True)
    norm = lmfuse.RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, generator=g))
    resolved = _spy(monkeypatch, norm_ops, "_resolve")
    y = lmfuse.rms_norm(x, norm.weight, eps=1e-5)
    assert not resolved
    y.backward(torch.ones_like(y))
    want_x = x.detach().clone().requires_grad_(True)
    want_w = norm.weight.detach().clone().requires_grad_(True)
    want = lmfuse.rms_norm(want_x, want_w, eps=1e-5, impl="torch")
    want.backward(torch.ones_like(want))
    _close((y.detach(), (x.grad, norm.weight.grad)),
           (want.detach(), (want_x.grad, want_w.grad)))


def test_rms_norm_fast_path_leaves_bad_input_to_the_full_path(no_interpreter):
    with pytest.raises(ValueError, match="weight"):
        lmfuse.rms_norm(torch.randn(2, 8), torch.randn(4))
    with pytest.raises(ValueError, match="eps"):
        lmfuse.rms_norm(torch.randn(2, 8), eps=-1.0)


@pytest.mark.parametrize("op", ["swiglu", "geglu"])
def test_gated_fast_paths_are_the_full_path(no_interpreter, monkeypatch, op):
    x = torch.randn(5, 2, 12, generator=torch.Generator().manual_seed(5)) * 2
    x[0, 0, 0] = float("nan")
    x[1, 1, 7] = float("inf")
    resolved = _spy(monkeypatch, act_ops, "_resolve")
    got = _grads(getattr(lmfuse, op), x)
    assert not resolved
    want = _grads(lambda x: getattr(lmfuse, op)(x, impl="torch"), x)
    _close(got, want, tol=1e-5 if op == "swiglu" else 1e-4)


def test_gated_fast_paths_leave_bad_input_to_the_full_path(no_interpreter):
    with pytest.raises(ValueError, match="even"):
        lmfuse.swiglu(torch.randn(3, 5))
    with pytest.raises(ValueError, match="0-D"):
        lmfuse.geglu(torch.tensor(1.0))
    with pytest.raises(TypeError, match="gate_multiplier"):
        lmfuse.swiglu(torch.randn(3, 4), gate_multiplier=True)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_linear_cross_entropy_fast_path_is_the_full_path(no_interpreter, monkeypatch,
                                                          reduction, smoothing):
    from lmfuse.cross_entropy import linear as lce

    g = torch.Generator().manual_seed(6)
    h = torch.randn(12, 8, generator=g)
    w = torch.randn(7, 8, generator=g) / 2
    t = torch.randint(0, 7, (12,), generator=g)
    t[::5] = -100
    resolved = _spy(monkeypatch, lce, "_resolve")
    got = _grads(lambda h, w: lmfuse.linear_cross_entropy(
        h, w, t, label_smoothing=smoothing, reduction=reduction), h, w)
    assert not resolved  # the fast path answered
    want = _grads(lambda h, w: lmfuse.linear_cross_entropy(
        h, w, t, label_smoothing=smoothing, reduction=reduction, impl="torch"), h, w)
    _close(got, want)
    assert lmfuse.linear_cross_entropy(h, w, torch.full((12,), -100)).item() == 0.0


def test_linear_cross_entropy_fast_path_leaves_bad_input_to_the_full_path(no_interpreter):
    h, w = torch.randn(4, 8), torch.randn(5, 8)
    with pytest.raises(ValueError, match="target"):
        lmfuse.linear_cross_entropy(h, w, torch.tensor([0, 1, 5, 2]))
    with pytest.raises(ValueError, match="weight"):
        lmfuse.linear_cross_entropy(h, torch.randn(5, 6), torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="reduction"):
        lmfuse.linear_cross_entropy(h, w, torch.tensor([0, 1, 2, 3]), reduction="avg")


def test_fused_mlp_fast_path_is_the_unfused_module(no_interpreter, monkeypatch):
    """FusedMLP's common CPU call (SwiGLU, no options) runs fc1, silu * up, fc2 at once:
    the module's reference forward and gradients; any other call keeps its checks."""
    from lmfuse.activations import mlp as mlp_module

    torch.manual_seed(7)
    m = lmfuse.FusedMLP(16, 24, "swiglu", bias=False)
    x = torch.randn(3, 5, 16)
    checked = _spy(monkeypatch, mlp_module.FusedMLP, "_check")
    got = _grads(m, x)
    assert not checked
    want = _grads(m.reference_forward, x)
    _close(got, want)
    with pytest.raises(ValueError, match="hidden_size"):
        m(torch.randn(3, 15))
    assert checked  # a bad input went to the checks


# --- the fast paths' own backwards ------------------------------------------------------------
# Softmax, SwiGLU and GEGLU write the plain formula's gradient with fewer passes (the same
# PyTorch ops, in place where autograd makes new tensors): equal bit for bit, NaN and inf
# included, upstream as well. RMSNorm's is the closed form: within rounding, NaN where the
# formula's is.


def _poisoned(shape, seed, **at):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 2
    for value, where in at.items():
        x[where] = {"nan": float("nan"), "inf": float("inf"), "ninf": float("-inf")}[value]
    return x


def _both(fn, plain, *inputs, dy):
    """(output, grads) of the fast path and of the plain formula through autograd."""
    out = []
    for f in (fn, plain):
        xs = [x.clone().requires_grad_(True) for x in inputs]
        y = f(*xs)
        out.append((y, torch.autograd.grad(y, xs, dy), y.grad_fn))
    return out


def _equal(a, b):
    return torch.equal(a.nan_to_num(1e30, 1e31, -1e31), b.nan_to_num(1e30, 1e31, -1e31))


@pytest.mark.parametrize("case", ["causal", "plain", "bool_mask", "float_mask", "scale_1"])
def test_softmax_cpu_backward_is_the_formulas_bit_for_bit(no_interpreter, case):
    shape = (2, 3, 5, 7)
    s = torch.randn(shape, generator=torch.Generator().manual_seed(6)) * 3
    dy = _poisoned(shape, 7, inf=(0, 1, 0, 6), nan=(1, 2, 3, 0))  # at a hidden key, a seen one
    mask = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(8)) < 0.3
    mask[..., 0] = False  # no dead row (those take the reference)
    add = torch.randn(2, 1, 5, 7, generator=torch.Generator().manual_seed(9))
    scale = 1.0 if case == "scale_1" else 0.4
    hidden = torch.ones(5, 7, dtype=torch.bool).triu(3)
    kw = dict(scale=scale, causal=case in ("causal", "scale_1"),
              mask={"bool_mask": mask, "float_mask": add}.get(case))

    def plain(x):
        z = x * scale
        if case == "float_mask":
            z = z + add
        if kw["causal"]:
            z = z.masked_fill(hidden, float("-inf"))
        if case == "bool_mask":
            z = z.masked_fill(mask, float("-inf"))
        return torch.softmax(z, -1)

    (y1, g1, node), (y2, g2, _) = _both(lambda x: lmfuse.fused_softmax(x, **kw), plain, s,
                                        dy=dy)
    assert "SoftmaxCPU" in type(node).__name__
    assert torch.equal(y1, y2) and _equal(g1[0], g2[0])


@pytest.mark.parametrize("poison", ["nan", "inf", "ninf"])
def test_softmax_band_bias_at_poisoned_hidden_keys(no_interpreter, poison):
    """The band masks (causal, windows) are added as a -inf / 0 bias, not masked_fill'd: a
    NaN or +inf score at a hidden key then makes its row NaN, which goes to the reference,
    so the output and gradient are still the plain formula's, the hidden key ignored (to
    the reference's rounding; a -inf there stays on the fast path, bit for bit)."""
    shape = (2, 2, 5, 6)
    s = _poisoned(shape, 11, **{poison: (1, 0, 2, 4)})  # row 2 sees keys 0..3
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(12))
    hidden = torch.ones(5, 6, dtype=torch.bool).triu(2)

    def plain(x):
        return torch.softmax((x * 0.5).masked_fill(hidden, float("-inf")), -1)

    (y1, g1, node), (y2, g2, _) = _both(
        lambda x: lmfuse.fused_softmax(x, scale=0.5, causal=True), plain, s, dy=dy)
    assert not y1.isnan().any() and not g1[0].isnan().any()
    if poison == "ninf":
        assert "SoftmaxCPU" in type(node).__name__
        assert torch.equal(y1, y2) and _equal(g1[0], g2[0])
    else:
        _close((y1, g1), (y2, g2))


@pytest.mark.parametrize("op", ["swiglu", "geglu"])
def test_gated_cpu_backward_is_the_formulas_bit_for_bit(no_interpreter, op):
    x = _poisoned((4, 3, 10), 10, nan=(0, 0, 1), inf=(1, 2, 7), ninf=(2, 1, 3))
    dy = _poisoned((4, 3, 5), 11, inf=(3, 0, 4))
    act = {"swiglu": torch.nn.functional.silu,
           "geglu": lambda a: torch.nn.functional.gelu(a, approximate="tanh")}[op]
    (y1, g1, node), (y2, g2, _) = _both(getattr(lmfuse, op),
                                        lambda x: (lambda a, b: act(a) * b)(*x.chunk(2, -1)),
                                        x, dy=dy)
    assert "GatedCPU" in type(node).__name__
    assert _equal(y1, y2) and _equal(g1[0], g2[0])
    with torch.no_grad():  # nothing to differentiate: no autograd node
        assert getattr(lmfuse, op)(x).grad_fn is None


@pytest.mark.parametrize("shape", [(6, 16), (2, 3, 8), (8,), (0, 4), (3, 0)])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_cpu_backward_is_the_formulas(no_interpreter, shape, weighted):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(12))
    if x.numel() > 4:
        x.view(-1)[1] = float("nan")
        x.view(-1)[-2] = float("inf")
    w = torch.randn(shape[-1], generator=torch.Generator().manual_seed(13))
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(14))

    def plain(x, w=None):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return y * w if w is not None else y

    inputs = (x, w) if weighted else (x,)
    (y1, g1, node), (y2, g2, _) = _both(lambda *t: lmfuse.rms_norm(*t, eps=1e-6), plain,
                                        *inputs, dy=dy)
    assert "RMSNormCPU" in type(node).__name__
    assert _equal(y1, y2)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
        assert torch.equal(a.isnan(), b.isnan())


def test_cpu_backwards_save_through_autograd_and_second_derivatives(no_interpreter):
    """What their backwards read goes through save_for_backward (an in-place change of it
    after the forward raises instead of giving a wrong gradient: softmax's output,
    SwiGLU's and RMSNorm's input); a double
    backward is refused by the softmax and the norm and taken by SwiGLU (the plain
    formula's second derivative)."""
    x = torch.randn(4, 4, requires_grad=True)
    y = lmfuse.fused_softmax(x.view(1, 1, 4, 4) * 1.0, causal=True)
    y.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    h = x * 1.0
    y = lmfuse.swiglu(h)
    h.mul_(0.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    w, dy = torch.randn(4), torch.randn(4, 4)
    h = x * 1.0
    y = lmfuse.rms_norm(h, w)
    h.mul_(0.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(y, x, dy)
    for call in (lambda x: lmfuse.fused_softmax(x.view(1, 1, 4, 4), causal=True),
                 lambda x: lmfuse.rms_norm(x, w)):
        with pytest.raises(RuntimeError, match="second derivatives are not supported"):
            torch.autograd.grad(call(x).pow(2).sum(), x, create_graph=True)
    (gx,) = torch.autograd.grad(lmfuse.swiglu(x).pow(2).sum(), x, create_graph=True)
    a, b = x.chunk(2, -1)
    (want,) = torch.autograd.grad((torch.nn.functional.silu(a) * b).pow(2).sum(), x,
                                  create_graph=True)
    torch.testing.assert_close(torch.autograd.grad(gx.pow(2).sum(), x)[0],
                               torch.autograd.grad(want.pow(2).sum(), x)[0])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", ["plain", "ignored", "nan", "all_ignored"])
def test_cross_entropy_cpu_backward_on_large_logits(no_interpreter, monkeypatch, reduction,
                                                    case):
    """From ``_CPU_OWN_BACKWARD`` elements the loss takes its own backward (the softmax
    minus the one-hot): F.cross_entropy's gradient within rounding, NaN where its is (an
    ignored row's NaN too), a mean over no token 0 with a zero gradient; below, PyTorch's."""
    monkeypatch.setattr(ce_ops, "_CPU_OWN_BACKWARD", 9 * 13)
    g = torch.Generator().manual_seed(15)
    x = torch.randn(9, 13, generator=g) * 3
    t = torch.randint(0, 13, (9,), generator=g)
    if case == "ignored":
        t[::3] = -100
    elif case == "nan":
        x[2, 4], x[5, 1], t[5] = float("nan"), float("inf"), -100
    elif case == "all_ignored":
        t[:] = -100
    dy = torch.tensor(1.7)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = lmfuse.cross_entropy(x1, t, reduction=reduction)
    got.backward(dy)
    want = torch.nn.functional.cross_entropy(x2, t, reduction=reduction)
    if case == "all_ignored" and reduction == "mean":  # lmfuse: 0, not PyTorch's 0 / 0
        want = torch.nn.functional.cross_entropy(x2, t, reduction="sum")
    want.backward(dy)
    assert "CrossEntropyCPU" in type(got.grad_fn).__name__
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-6, atol=1e-7, equal_nan=True)
    assert torch.equal(x1.grad.isnan(), x2.grad.isnan())
    small = lmfuse.cross_entropy(x[:8].clone().requires_grad_(), t[:8], reduction=reduction)
    assert "CrossEntropyCPU" not in type(small.grad_fn).__name__
    bad = t.clone()
    bad[0] = 13  # out of range: lmfuse's error, as on the other paths
    with pytest.raises(ValueError, match="neither ignore_index"):
        lmfuse.cross_entropy(x.clone().requires_grad_(), bad, reduction=reduction)


def test_rms_norm_native_path_with_an_offset_takes_the_own_backward(no_interpreter):
    """Gemma's ``(1 + w)`` (weight_offset=1.0) goes past the fast path to the native one,
    which takes the same backward: the formula's gradients, for x and the weight."""
    g = torch.Generator().manual_seed(16)
    x, w = torch.randn(3, 5, 8, generator=g), torch.randn(8, generator=g)
    dy = torch.randn(3, 5, 8, generator=g)

    def plain(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (w + 1.0)

    (y1, g1, node), (y2, g2, _) = _both(
        lambda x, w: lmfuse.rms_norm(x, w, eps=1e-6, weight_offset=1.0), plain, x, w, dy=dy)
    assert "RMSNormCPU" in type(node).__name__
    torch.testing.assert_close(y1, y2, rtol=1e-6, atol=1e-6)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_softmax_band_cached_under_inference_mode_serves_training(no_interpreter) -> None:
    """The causal and window bands are cached per shape: one first made under
    torch.inference_mode was an inference tensor, which every later training call of that
    shape failed to save for backward."""
    from lmfuse.softmax import ops as softmax_ops

    softmax_ops._hidden_band.cache_clear()  # (the first call below makes them)
    softmax_ops._band_bias.cache_clear()
    s = torch.randn(1, 2, 5, 7)
    with torch.inference_mode():
        lmfuse.fused_softmax(s, causal=True)
        lmfuse.fused_softmax(s, window_size=2)
    x = s.clone().requires_grad_(True)
    for kw in ({"causal": True}, {"window_size": 2}):
        got = torch.autograd.grad(lmfuse.fused_softmax(x, **kw).square().sum(), x)[0]
        want = torch.autograd.grad(lmfuse.fused_softmax(x, **kw, impl="torch").square().sum(),
                                   x)[0]
        assert torch.allclose(got, want, atol=1e-6), kw


def _hf_rotary(q, k, cos, sin, u):
    """transformers' Llama formula, written out (the plain ops the CPU path replaces)."""
    def half(x):
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), -1)

    c, s = cos.unsqueeze(u), sin.unsqueeze(u)
    return q * c + half(q) * s, k * c + half(k) * s


@pytest.mark.parametrize("layout, tables", [("hf", 3), ("bhsd", 3), ("bshd", 3), ("hf", 2),
                                            ("hf", 1)], ids=["hf", "bhsd", "bshd", "2d-table",
                                                             "one-table"])
def test_rotary_cpu_path_is_the_formula(no_interpreter, monkeypatch, layout,
                                                    tables):
    """Float32 CPU tensors (every value of a head rotated) take the formula in fewer passes
    (the sign on the table, the product and sum fused): transformers' values and gradients
    within a rounding, NaN and inf where the formula has them, for every layout and table
    form; the reference is not called."""
    from lmfuse.rope import ops as rope_ops

    g = torch.Generator().manual_seed(3)
    B, S, Hq, Hk, D = 2, 5, 4, 2, 8
    shape = (lambda H: (B, S, H, D)) if layout in ("hf", "bshd") else (lambda H: (B, H, S, D))
    q, k = (torch.randn(shape(H), generator=g) for H in (Hq, Hk))
    if layout == "hf":
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    q[0, 0, 0, 4], k[1, 1, 1, 5] = float("inf"), float("nan")
    angle = torch.rand(B if tables == 3 else 1, S, D // 2, generator=g) * 6.3
    angle = torch.cat((angle, angle), -1)
    angle[0, 0, 0] = 0.0  # (a sine of 0 meets the inf: NaN, as in the formula)
    cos, sin = angle.cos(), angle.sin()
    if tables == 2:
        cos, sin = cos[0], sin[0]
    u = (2 if layout == "bshd" else 1) - (tables == 2)
    reference = _spy(monkeypatch, rope_ops, "rotary_reference")
    leaves = [t.clone().requires_grad_(True) for t in (q, k)]
    got = lmfuse.apply_rotary_pos_emb(*leaves, cos, sin, unsqueeze_dim=u)
    assert not reference
    plain = [t.clone().requires_grad_(True) for t in (q, k)]
    want = _hf_rotary(*plain, cos, sin, u)
    gs = [torch.randn(t.shape, generator=g) for t in want]
    assert got[0].isnan().any() and got[0].isinf().any()  # (inf * sin 0, inf * cos 0)

    def same(a, b):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, equal_nan=True)
        assert a.isnan().equal(b.isnan()) and a.isinf().equal(b.isinf())

    for a, b in zip(got, want):
        same(a, b)
    for a, b in zip(torch.autograd.grad(got, leaves, gs), torch.autograd.grad(want, plain, gs)):
        same(a, b)
    with torch.no_grad():
        for a, b in zip(lmfuse.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=u), want):
            same(a, b.detach())


def test_rotary_cpu_path_partial_gradients_and_second_derivatives(no_interpreter):
    """Only q needing a gradient: k's output needs none; second derivatives (through the
    backward's own ops) equal the formula's; what the path does not take (partial rotary,
    bf16, the tables' gradients) is the reference's."""
    from lmfuse.rope import ops as rope_ops

    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(1, 3, 4, 8, generator=g), torch.randn(1, 2, 4, 8, generator=g)
    cos, sin = torch.randn(1, 4, 8, generator=g), torch.randn(1, 4, 8, generator=g)
    qg = q.clone().requires_grad_(True)
    qo, ko = lmfuse.apply_rotary_pos_emb(qg, k, cos, sin)
    assert qo.requires_grad and not ko.requires_grad
    (gq,) = torch.autograd.grad(qo.pow(2).sum(), qg, create_graph=True)
    (gg,) = torch.autograd.grad(gq.pow(2).sum(), qg)
    qp = q.clone().requires_grad_(True)
    (wq,) = torch.autograd.grad(_hf_rotary(qp, k, cos, sin, 1)[0].pow(2).sum(), qp,
                                create_graph=True)
    (wg,) = torch.autograd.grad(wq.pow(2).sum(), qp)
    torch.testing.assert_close(gq, wq, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gg, wg, rtol=1e-5, atol=1e-5)
    assert not rope_ops._cpu_formula_takes(q, k, cos[..., :4], sin[..., :4])
    assert not rope_ops._cpu_formula_takes(q, k.bfloat16(), cos, sin)
    assert not rope_ops._cpu_formula_takes(q, k, cos.requires_grad_(True), sin)
    with torch.no_grad():
        assert rope_ops._cpu_formula_takes(q, k, cos, sin)
    cos.requires_grad_(False)
    assert "the sign of rotate_half on the table" in lmfuse.explain(
        lmfuse.apply_rotary_pos_emb, q, k, cos, sin).reason
    assert "rotate_half" not in lmfuse.explain(lmfuse.apply_rotary_pos_emb, q, k.bfloat16(),
                                               cos, sin).reason


def _rotary_inputs():
    g = torch.Generator().manual_seed(5)
    return (torch.randn(1, 2, 3, 4, generator=g), torch.randn(1, 1, 3, 4, generator=g),
            torch.randn(1, 3, 4, generator=g), torch.randn(1, 3, 4, generator=g))


def test_rotary_cpu_path_whatever_the_default_dtype_and_with_fake_tensors(no_interpreter):
    """Its sign table is float32 whatever the default dtype when it is first made (float32
    outputs, then and after); fake tensors (FakeTensorMode, make_fx) take the reference
    and leave nothing behind that a real call would meet."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from lmfuse.rope import ops as rope_ops

    q, k, cos, sin = _rotary_inputs()
    rope_ops._half_signs.cache_clear()
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert [t.dtype for t in lmfuse.apply_rotary_pos_emb(q, k, cos, sin)] == [torch.float32] * 2
    finally:
        torch.set_default_dtype(before)
    assert [t.dtype for t in lmfuse.apply_rotary_pos_emb(q, k, cos, sin)] == [torch.float32] * 2
    rope_ops._half_signs.cache_clear()
    make_fx(lambda *a: lmfuse.apply_rotary_pos_emb(*a), tracing_mode="fake")(q, k, cos, sin)
    want = _hf_rotary(q, k, cos, sin, 1)
    for a, b in zip(lmfuse.apply_rotary_pos_emb(q, k, cos, sin), want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    with FakeTensorMode() as mode:
        out = lmfuse.apply_rotary_pos_emb(*(mode.from_tensor(t) for t in (q, k, cos, sin)))
    assert [tuple(t.shape) for t in out] == [tuple(q.shape), tuple(k.shape)]


def test_rotary_cpu_path_backward_per_output_and_torch_func(no_interpreter):
    """q's and k's outputs have an autograd node each (a backward through one, then the
    other, as through the formula); torch.func's grad, jacrev, jacfwd and vmap and
    forward-mode AD (a tangent on q and on the cosines) give the formula's."""
    from torch.autograd import forward_ad as fwAD

    q, k, cos, sin = _rotary_inputs()
    leaves = [t.clone().requires_grad_(True) for t in (q, k)]
    qo, ko = lmfuse.apply_rotary_pos_emb(*leaves, cos, sin)
    qo.sum().backward()
    ko.sum().backward()
    plain = [t.clone().requires_grad_(True) for t in (q, k)]
    wq, wk = _hf_rotary(*plain, cos, sin, 1)
    wq.sum().backward()
    wk.sum().backward()
    for a, b in zip(leaves, plain):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6)

    def ours(x):
        return lmfuse.apply_rotary_pos_emb(x, k, cos, sin)[0]

    def formula(x):
        return _hf_rotary(x, k, cos, sin, 1)[0]

    stacked = torch.stack((q, 2 * q, -q))
    for transform, x in ((lambda f: torch.func.grad(lambda x: f(x).pow(2).sum()), q),
                         (torch.func.jacrev, q), (torch.func.jacfwd, q),
                         (torch.func.vmap, stacked)):
        torch.testing.assert_close(transform(ours)(x), transform(formula)(x), rtol=1e-5,
                                   atol=1e-5)
    tq, tc = torch.randn_like(q), torch.randn_like(cos)
    with fwAD.dual_level():
        got = fwAD.unpack_dual(lmfuse.apply_rotary_pos_emb(
            fwAD.make_dual(q.clone().requires_grad_(True), tq), k, fwAD.make_dual(cos, tc),
            sin)[0]).tangent
        want = fwAD.unpack_dual(_hf_rotary(fwAD.make_dual(q, tq), k, fwAD.make_dual(cos, tc),
                                           sin, 1)[0]).tangent
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fast_paths_under_a_function_mode_and_torch_func(no_interpreter):
    """Under a torch function mode the CPU paths call ``F.cross_entropy`` and
    ``F.layer_norm`` (what such a mode looks for), and under ``torch.func`` transforms the
    cross-entropy's mean needs no scalar read: ``vmap`` works, a mean over no token is 0
    there too, and gradients match ``F.cross_entropy``'s."""
    from torch.overrides import TorchFunctionMode

    seen = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    x, t = torch.randn(4, 5), torch.tensor([0, 1, -100, 3])
    with Watch():
        lmfuse.cross_entropy(x, t)
        lmfuse.layer_norm(x)
    assert F.cross_entropy in seen and F.layer_norm in seen
    batch = torch.randn(3, 4, 5)
    batch[1, 2, 0] = float("nan")
    got = torch.func.vmap(lambda z: lmfuse.cross_entropy(z, t))(batch)
    want = torch.stack([F.cross_entropy(z, t) for z in batch])
    torch.testing.assert_close(got, want, equal_nan=True)
    none = torch.full((4,), -100)
    assert torch.equal(torch.func.vmap(lambda z: lmfuse.cross_entropy(z, none))(batch[::2]),
                       torch.zeros(2))
    for target in (t, none):
        g = torch.func.grad(lambda z: lmfuse.cross_entropy(z, target, label_smoothing=0.1))(x)
        if target is none:
            assert torch.equal(g, torch.zeros_like(x))
        else:
            torch.testing.assert_close(g, torch.func.grad(
                lambda z: F.cross_entropy(z, target, label_smoothing=0.1))(x))
