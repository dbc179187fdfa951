"""Implementation selection and ``explain`` (``lmfuse._dispatch``)."""

from __future__ import annotations

import pytest
import torch
from helpers import randn

import lmfuse
from lmfuse._dispatch import interpreter_active, registered_ops, select_impl

CPU = torch.device("cpu")


def test_interpreter_is_on_in_the_test_suite() -> None:
    assert interpreter_active()


@pytest.mark.parametrize("impl, expected", [("torch", "torch"), ("triton", "triton"),
                                            ("auto", "triton")], ids=["torch", "triton", "auto"])
def test_select_impl_on_cpu_under_interpreter(impl: str, expected: str) -> None:
    path, reason = select_impl("op_x", impl, CPU)
    assert path == expected
    assert isinstance(reason, str) and reason


def test_select_impl_reasons_name_the_cause() -> None:
    assert "interpreter" in select_impl("op_x", "triton", CPU)[1].lower()
    assert "reference" in select_impl("op_x", "torch", CPU)[1].lower()


def test_interpreter_state_follows_the_environment_as_it_changes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Read at every call (through os.environ's backing dict): set, changed, removed; as
    Triton reads it (" ON " is off for Triton, so for lmfuse too)."""
    for value, want in (("1", True), ("ON", True), (" ON ", False), ("0", False),
                        ("yes", True), ("no", False)):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert interpreter_active() is want, value
    monkeypatch.delenv("TRITON_INTERPRET")
    assert interpreter_active() is False
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import os
    monkeypatch.setattr(os, "environ", {"TRITON_INTERPRET": "0"})  # os.environ replaced
    assert interpreter_active() is False


@pytest.mark.parametrize("impl", ["cuda", "TRITON", "", None, 1], ids=repr)
def test_select_impl_bad_impl_raises_naming_it(impl: object) -> None:
    with pytest.raises(ValueError, match=r"op_x: impl must be one of") as exc:
        select_impl("op_x", impl, CPU)  # type: ignore[arg-type]
    assert repr(impl) in str(exc.value)


@pytest.mark.parametrize("value", ["0", "", "false"])
def test_interpreter_off_auto_picks_torch_and_triton_raises(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert not interpreter_active()
    path, reason = select_impl("op_x", "auto", CPU)
    assert path == "torch"
    assert "TRITON_INTERPRET" in reason
    assert select_impl("op_x", "torch", CPU)[0] == "torch"
    with pytest.raises(RuntimeError, match=r"op_x: impl='triton' cannot run here"):
        select_impl("op_x", "triton", CPU)


def test_interpreter_off_fused_softmax_runs_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    x = randn((1, 2, 3, 5))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    plan = lmfuse.explain(lmfuse.fused_softmax, x)
    assert plan.impl == "torch"
    y = lmfuse.fused_softmax(x)
    assert torch.allclose(y, torch.softmax(x, -1), atol=1e-6, rtol=1e-6)
    with pytest.raises(RuntimeError, match="impl='triton'"):
        lmfuse.fused_softmax(x, impl="triton")


def test_explain_by_function_causal() -> None:
    x = randn((1, 2, 3, 5))
    plan = lmfuse.explain(lmfuse.fused_softmax, x, causal=True)
    assert isinstance(plan, lmfuse.Plan)
    assert plan.op == "fused_softmax"
    assert plan.impl == "triton"
    text = str(plan)
    assert text.startswith("fused_softmax: triton")
    assert "band" in text and "p+0" in text
    assert "kernel" in plan.details


def test_explain_by_name_matches_function() -> None:
    x = randn((2, 1, 4, 4))
    by_name = lmfuse.explain("fused_softmax", x, window_size=(2, -1), impl="torch")
    by_fn = lmfuse.explain(lmfuse.fused_softmax, x, window_size=(2, -1), impl="torch")
    assert by_name.impl == by_fn.impl == "torch"
    assert by_name.details == by_fn.details
    assert by_name.details["band"] == "keys p-2 .. p+inf"


def test_explain_without_band_says_none() -> None:
    plan = lmfuse.explain("fused_softmax", randn((1, 1, 2, 3)), mask=torch.zeros(2, 3))
    assert plan.details["band"] == "none"
    assert plan.details["mask"] == "additive"


def test_explain_validates_like_the_op() -> None:
    with pytest.raises(ValueError, match="scores"):
        lmfuse.explain(lmfuse.fused_softmax, randn((2, 3, 4)))


def test_explain_reads_values_as_the_op_does() -> None:
    """Out-of-range targets and a non-float out_dtype, which the ops refuse, are refused by
    explain too (it accepted them)."""
    logits, bad = randn((6, 11)), torch.tensor([0, 1, 2, 3, 4, 11])
    match = r"target holds 11, which is neither ignore_index \(-100\) nor a class in \[0, 11\)"
    for op, args in (("cross_entropy", (logits, bad)),
                     ("linear_cross_entropy", (randn((6, 4)), randn((11, 4)), bad))):
        with pytest.raises(ValueError, match=match):
            getattr(lmfuse, op)(*args)
        with pytest.raises(ValueError, match=match):
            lmfuse.explain(op, *args)
    for dtype in (torch.int32, "float16"):
        with pytest.raises(TypeError, match="out_dtype must be a floating torch.dtype"):
            lmfuse.explain("merge_attention_states", randn((2, 3, 4)), randn((2, 3)),
                           out_dtype=dtype)


def test_explain_kv_cache_append() -> None:
    """A public op with ``impl=``: explain has its planner, checking what the op checks."""
    kc = torch.zeros(2, 8, 2, 4)
    new = randn((2, 1, 2, 4))
    plan = lmfuse.explain(lmfuse.kv_cache_append, kc, kc.clone(), new, new, torch.tensor([3, 7]))
    assert plan.op == "kv_cache_append" and plan.details["cache"].startswith("contiguous, S_max 8")
    assert "kv_cache_append" in registered_ops()
    with pytest.raises(ValueError, match="past the capacity of 8 rows"):
        lmfuse.explain("kv_cache_append", kc, kc.clone(), new, new, torch.tensor([3, 8]))


def test_explain_names_pytorchs_op_on_the_cpu_default_path(monkeypatch) -> None:
    """Without Triton's interpreter, float32 CPU calls run PyTorch's own ops: explain says so
    (it described the reference and lmfuse's kernel passes)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ce = lmfuse.explain("cross_entropy", randn((6, 11)), torch.arange(6))
    assert "PyTorch's F.cross_entropy" in ce.reason and "F.cross_entropy" in ce.details["passes"]
    for op, args in (("fused_softmax", (randn((1, 2, 4, 4)),)), ("swiglu", (randn((4, 8)),)),
                     ("rms_norm", (randn((4, 8)), torch.ones(8)))):
        assert "CPU float32:" in lmfuse.explain(op, *args).reason, op
    assert "CPU float32:" not in lmfuse.explain("cross_entropy", randn((6, 11)),
                                                torch.arange(6), z_loss=1e-4).reason


@pytest.mark.parametrize("op", ["no_such_op", "fused_softmax_v2"])
def test_explain_unknown_op_raises(op: str) -> None:
    with pytest.raises(ValueError, match=rf"unknown op '{op}'"):
        lmfuse.explain(op, randn((1, 1, 1, 1)))


def test_explain_unknown_callable_raises() -> None:
    with pytest.raises(ValueError, match="unknown op 'softmax'"):
        lmfuse.explain(torch.softmax, randn((1, 1, 1, 1)))


def test_fused_softmax_is_registered() -> None:
    assert "fused_softmax" in registered_ops()


def test_set_checks_switches_value_checks_on_device_tensors(monkeypatch) -> None:
    """CPU tensors are always checked; others only with set_checks(True) (or
    LMFUSE_CHECK=1 at import); the switch takes a bool."""
    import lmfuse
    from lmfuse import _dispatch

    monkeypatch.setattr(_dispatch, "_VALUE_CHECKS", False)
    cpu = torch.zeros(2)
    meta = torch.zeros(2, device="meta")
    assert _dispatch.value_checks(cpu) and not _dispatch.value_checks(meta)
    lmfuse.set_checks(True)
    assert _dispatch.value_checks(meta)
    lmfuse.set_checks(False)
    assert not _dispatch.value_checks(meta) and _dispatch.value_checks(cpu)
    with pytest.raises(TypeError, match="enabled must be a bool"):
        lmfuse.set_checks(1)



def _calls() -> dict:
    """One explain() call per op that resolves its arguments into a call object."""
    x, lg, t = randn((2, 3, 4, 6)), randn((5, 11)), torch.randint(0, 11, (5,))
    h, w = randn((5, 8)), randn((11, 8))
    T, H, F, E = 4, 8, 4, 3
    q, kc = randn((2, 1, 4, 8)), randn((2, 16, 2, 8))
    lens = torch.tensor([9, 16], dtype=torch.int32)
    return {
        "fused_softmax": (lmfuse.fused_softmax, (x,), dict(scale=0.5, causal=True)),
        "rms_norm": (lmfuse.rms_norm, (h, torch.ones(8)), {}),
        "swiglu": (lmfuse.swiglu, (h,), {}),
        "cross_entropy": (lmfuse.cross_entropy, (lg, t), dict(label_smoothing=0.1)),
        "linear_cross_entropy": (lmfuse.linear_cross_entropy, (h, w, t), {}),
        "moe_experts": (lmfuse.moe_experts, (randn((T, H)), torch.randint(0, E, (T, 2)),
                                             torch.rand(T, 2), randn((E, 2 * F, H)),
                                             randn((E, H, F))), {}),
        "decode_attention": (lmfuse.decode_attention, (q, kc, kc, lens), {}),
    }


@pytest.mark.parametrize("op", sorted(_calls()))
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_a_plan_carries_the_call_its_op_runs(op: str, impl: str) -> None:
    """``Plan.call`` is the op's resolved call (a frozen dataclass: the object its launches
    read), ``Plan.args`` the same fields as a dict (its public shape)."""
    import dataclasses

    from lmfuse._dispatch import ResolvedCall

    fn, args, kwargs = _calls()[op]
    plan = lmfuse.explain(fn, *args, **kwargs, impl=impl)
    assert isinstance(plan.call, ResolvedCall) and dataclasses.is_dataclass(plan.call)
    assert plan.args == plan.call.as_dict()
    assert plan.args is not plan.call.as_dict()  # a new dict each time
    name = dataclasses.fields(plan.call)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(plan.call, name, None)
    if op == "fused_softmax":
        assert (plan.call.scale, plan.call.right) == (0.5, 0)


@pytest.mark.parametrize("name", sorted(registered_ops()))
def test_every_planner_binds_its_ops_signature(name: str) -> None:
    """Each op's planner takes the op's own arguments (``planner_of``): an unknown keyword
    is a TypeError naming the op, before anything is checked or resolved."""
    import inspect

    op = getattr(lmfuse, name, None) or getattr(lmfuse.megatron, name, None)
    assert op is not None, name
    required = [p for p in inspect.signature(op).parameters.values()
                if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD]
    with pytest.raises(TypeError, match=rf"^{name}: .*'no_such_argument'"):
        lmfuse.explain(op, *[None] * len(required), no_such_argument=1)


def test_int_and_number_checks_take_numpy_scalars_not_bools() -> None:
    import numpy as np

    from lmfuse._dispatch import check_int, check_number

    assert check_int("op", "n", np.int64(3)) == 3 and type(check_int("op", "n", np.int32(3))) is int
    assert check_number("op", "x", np.float32(0.5)) == 0.5
    for bad in (True, np.bool_(True), 2.0, "3"):
        with pytest.raises(TypeError, match="op: n must be an int"):
            check_int("op", "n", bad)
    for bad in (True, np.bool_(False), "0.5", torch.tensor(0.5)):
        with pytest.raises(TypeError, match="op: x must be a float"):
            check_number("op", "x", bad)
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        check_int("op", "n", np.int64(0), minimum=1)


@pytest.mark.parametrize("raw", ["1", " 1", "1 ", "y", "Y", "yes", "TRUE", "on", "0", "no", "",
                                 "2", "t"])
def test_interpreter_variable_read_as_triton_reads_it(monkeypatch, raw: str) -> None:
    """lmfuse and Triton must agree on whether the interpreter runs: lmfuse stripped the
    value (" 1" on, for Triton off: CPU tensors sent to real launches) and ignored "y"."""
    libtriton = pytest.importorskip("triton._C.libtriton")
    monkeypatch.setenv("TRITON_INTERPRET", raw)
    assert interpreter_active() == libtriton.getenv_bool("TRITON_INTERPRET", False)


class _Scale(torch.autograd.Function):
    """An old-style autograd function (``forward(ctx, ...)``) for :func:`apply_function`."""

    @staticmethod
    def forward(ctx, x, y, factor):
        ctx.factor = factor
        return x * factor + y, x.new_empty(0)

    @staticmethod
    def backward(ctx, g, _):
        return g * ctx.factor, g, None


def test_apply_function_is_function_apply() -> None:
    """The C++ ``apply`` called directly gives what ``Function.apply`` gives: outputs, the
    node, the gradients; under torch.compile and inside functorch transforms it is
    ``Function.apply`` itself (Dynamo traces it whole; functorch refuses an old-style
    function, as ``apply`` does)."""
    from lmfuse._dispatch import apply_function

    x, y = randn((3, 4), torch.float32).requires_grad_(True), randn((3, 4), torch.float32)
    out, empty = apply_function(_Scale, x, y, 2.5)
    want, _ = _Scale.apply(x, y, 2.5)
    assert torch.equal(out, want) and empty.shape == (0,)
    assert type(out.grad_fn) is type(want.grad_fn)
    (gx,) = torch.autograd.grad(out.sum(), x)
    assert torch.equal(gx, torch.full_like(x, 2.5))
    with torch.no_grad():
        assert apply_function(_Scale, x, y, 2.5)[0].grad_fn is None
    compiled = torch.compile(lambda a, b: apply_function(_Scale, a, b, 2.5)[0],
                             fullgraph=True, backend="eager")
    assert torch.equal(compiled(x, y), want)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda a: apply_function(_Scale, a, y, 2.5)[0].sum())(x)


def test_apply_function_unwraps_a_dead_wrapper_of_a_tensor_subclass() -> None:
    """A Parameter made inside a torch.func transform and kept after it (MAML-style weight
    updates) is a dead functorch wrapper: unwrapped before the op's function runs, as
    ``Function.apply`` unwraps every tensor argument, subclasses included."""
    x, w, kept = randn((3, 8), torch.float32), randn((8,), torch.float32), []

    def f(b):
        kept.append(torch.nn.Parameter(b * 1.0))
        return b.sum()

    torch.func.grad(f)(w.clone())
    y = lmfuse.rms_norm(x.clone().requires_grad_(True), kept[0], impl="triton")
    torch.testing.assert_close(y, torch.rms_norm(x, (8,), w))


def _dense_only_calls() -> dict:
    w = torch.ones(4)
    target = torch.tensor([0, 1, 2, 3])
    mlp = lmfuse.FusedMLP(4, 8)
    return {
        "rms_norm": lambda x: lmfuse.rms_norm(x, w),
        "layer_norm": lambda x: lmfuse.layer_norm(x, (4,), w),
        "cross_entropy": lambda x: lmfuse.cross_entropy(x, target),
        "swiglu": lmfuse.swiglu,
        "geglu": lmfuse.geglu,
        "bias_gelu": lambda x: lmfuse.bias_gelu(x, w),
        "squared_relu": lmfuse.squared_relu,
        "fused_softmax": lmfuse.fused_softmax,
        "FusedMLP": mlp,
        "cross_entropy weight": lambda x: lmfuse.cross_entropy(torch.randn(4, 4), target,
                                                               weight=x),
        "linear_cross_entropy ce_weight": lambda x: lmfuse.linear_cross_entropy(
            torch.randn(4, 8), torch.randn(4, 8), target, ce_weight=x),
        # (F.linear takes sparse operands: the CPU fast path asks for strided ones)
        "linear_cross_entropy hidden": lambda x: lmfuse.linear_cross_entropy(
            x, torch.randn(8, 4), target),
        "linear_cross_entropy weight": lambda x: lmfuse.linear_cross_entropy(
            torch.randn(4, 4), x, target),
    }


def _not_dense(kind: str) -> torch.Tensor:
    if kind == "sparse_coo":
        return torch.randn(4, 4).to_sparse()
    if kind == "sparse_csr":
        return torch.randn(4, 4).to_sparse_csr()
    return torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)],
                                      layout=torch.jagged)


@pytest.mark.filterwarnings("ignore::UserWarning")  # the constructors' prototype notices
@pytest.mark.parametrize("interpreter", ["1", "0"], ids=["triton-path", "cpu-fast-path"])
@pytest.mark.parametrize("kind", ["sparse_coo", "sparse_csr", "nested"])
@pytest.mark.parametrize("name", list(_dense_only_calls()))
def test_sparse_and_nested_inputs_refused_naming_the_argument(
        monkeypatch: pytest.MonkeyPatch, name: str, kind: str, interpreter: str) -> None:
    """A sparse or (jagged) nested tensor gets lmfuse's TypeError naming the argument and
    its layout, on the Triton path and through the CPU fast paths (PyTorch's own ops refuse
    it there first, with their own messages, and the full path's checks name it)."""
    monkeypatch.setenv("TRITON_INTERPRET", interpreter)
    call = _dense_only_calls()[name]
    x = _not_dense(kind)
    with pytest.raises(TypeError, match=rf"must be a dense \(strided\) tensor, got a {kind}"):
        call(x)
