"""``gate_multiplier`` / ``down_multiplier`` of ``swiglu`` and ``weighted_swiglu`` (Falcon-H1's
``silu(x1 * g) * x2 * d``), on both paths (``impl="torch"``, and ``impl="triton"`` in the
interpreter).

Every case is compared, output and gradients of x, bias and weights, with two oracles in
float64: ``activation_reference`` with the multipliers, and the plain PyTorch formula
``F.silu((x1 + b1) * g) * (x2 + b2) * d * weights`` differentiated by autograd. Cases:
fp32/fp16/bf16, with the clamp, fp8 storage and CPU offload of the saved input, multipliers
of 1 (bit for bit the defaults), the kernels' runtime arguments (no recompilation for a new
value), the CPU fast path, ``torch.compile``, ``explain`` and bad values.
"""

from __future__ import annotations

import inspect
import math

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, randn

import lmfuse
from lmfuse.activations.reference import activation_reference

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
FP8 = torch.float8_e4m3fn
OPS = ["swiglu", "weighted_swiglu"]
MULTIPLIERS = [pytest.param(0.5, 2.0, id="g0.5-d2"), pytest.param(-1.5, 0.25, id="g-1.5-d0.25")]


def make(op: str, lead: tuple[int, ...], f: int, dtype: torch.dtype, *, bias: bool = True
         ) -> dict[str, torch.Tensor]:
    """x, bias, weights (float32 routing weights, as MoE keeps them) and the upstream
    gradient."""
    tokens = math.prod(lead)
    return dict(x=randn(lead + (2 * f,), dtype, scale=2.0),
                bias=randn((2 * f,), dtype) if bias else None,
                weights=randn((tokens, 1), F32) if op == "weighted_swiglu" else None,
                dy=randn(lead + (f,), dtype))


def leaves(t: dict[str, torch.Tensor], dtype: torch.dtype | None = None
           ) -> dict[str, torch.Tensor]:
    return {k: (v.detach() if dtype is None else v.detach().to(dtype)).requires_grad_(True)
            for k, v in t.items() if k != "dy" and v is not None}


def run(op: str, t: dict[str, torch.Tensor], impl: str, **kw) -> tuple[torch.Tensor, dict]:
    lv = leaves(t)
    fn = getattr(lmfuse, op)
    args = (lv["x"], lv["weights"]) if "weights" in lv else (lv["x"],)
    out = fn(*args, lv.get("bias"), impl=impl, **kw)
    return out, dict(zip(lv, torch.autograd.grad(out, list(lv.values()), t["dy"])))


def reference(t: dict[str, torch.Tensor], x: torch.Tensor | None = None, **kw
              ) -> tuple[torch.Tensor, dict]:
    lv = leaves(dict(t, x=t["x"] if x is None else x), F64)
    out = activation_reference(lv["x"], lv.get("bias"), lv.get("weights"), activation="silu",
                               gated=True, **kw)
    return out, dict(zip(lv, torch.autograd.grad(out, list(lv.values()), t["dy"].to(F64))))


def plain_formula(t: dict[str, torch.Tensor], g: float, d: float) -> tuple[torch.Tensor, dict]:
    """``F.silu((x1 + b1) * g) * (x2 + b2) * d * weights`` in float64, autograd gradients."""
    lv = leaves(t, F64)
    x = lv["x"]
    f = x.shape[-1] // 2
    b = lv.get("bias", torch.zeros(2 * f, dtype=F64))
    out = F.silu((x[..., :f] + b[:f]) * g) * (x[..., f:] + b[f:]) * d
    if "weights" in lv:
        out = out * lv["weights"].view(*out.shape[:-1], 1)
    return out, dict(zip(lv, torch.autograd.grad(out, list(lv.values()), t["dy"].to(F64))))


def compare(what: str, t: dict[str, torch.Tensor], got: tuple[torch.Tensor, dict],
            want: tuple[torch.Tensor, dict]) -> None:
    out, grads = got
    assert out.dtype == t["x"].dtype, f"{what}: output dtype {out.dtype}"
    assert_close(out, want[0], t["x"].dtype, f"{what}: forward")
    assert grads.keys() == want[1].keys()
    for name, g in grads.items():
        assert g.dtype == t[name].dtype, f"{what}: d {name} dtype {g.dtype}"
        assert_close(g, want[1][name], t[name].dtype, f"{what}: d {name}")


IMPL_DTYPES = [pytest.param("torch", d, id=f"torch-{str(d)[6:]}") for d in (F32, F16, BF16)] + [
    pytest.param("triton", d, id=f"triton-{str(d)[6:]}") for d in (F32, F16)]


@pytest.mark.parametrize("g, d", MULTIPLIERS)
@pytest.mark.parametrize("impl, dtype", IMPL_DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_matches_reference_and_plain_formula(op: str, impl: str, dtype: torch.dtype,
                                             g: float, d: float) -> None:
    t = make(op, (2, 3), 7, dtype)
    got = run(op, t, impl, gate_multiplier=g, down_multiplier=d)
    what = f"{op} {impl} {dtype} g={g} d={d}"
    compare(f"{what} vs reference", t, got,
            reference(t, gate_multiplier=g, down_multiplier=d))
    compare(f"{what} vs F.silu(x1 * g) * x2 * d", t, got, plain_formula(t, g, d))
    plain, _ = run(op, t, impl)
    assert not torch.allclose(got[0], plain), f"{what}: the multipliers changed nothing"


OPTIONS = [
    pytest.param(dict(clamp_value=1.5), id="clamp"),
    pytest.param(dict(fp8_input_store=True), id="fp8"),
    pytest.param(dict(cpu_offload_input=True), id="offload"),
    pytest.param(dict(clamp_value=1.0, fp8_input_store=True, cpu_offload_input=True),
                 id="clamp-fp8-offload"),
]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("op", OPS)
def test_with_clamp_fp8_store_and_offload(op: str, impl: str, options: dict[str, Any],
                                          bias: bool) -> None:
    """The multipliers apply after the clamp and the bias; with ``fp8_input_store`` the
    gradients are those at the float8-rounded x, the forward is unchanged."""
    g, d = 0.75, -1.5
    t = make(op, (5,), 6, BF16, bias=bias)
    got = run(op, t, impl, gate_multiplier=g, down_multiplier=d, **options)
    c = options.get("clamp_value")
    want_out, want_grads = reference(t, clamp_value=c, gate_multiplier=g, down_multiplier=d)
    if options.get("fp8_input_store"):
        # the float8 copy keeps each value on its side of a clamp (not plain rounding)
        from lmfuse.activations.ops import _e4m3_keeping_clamp

        x8 = t["x"].to(FP8) if c is None else _e4m3_keeping_clamp(t["x"], c)
        _, want_grads = reference(t, x=x8.to(BF16), clamp_value=c,
                                  gate_multiplier=g, down_multiplier=d)
        no_fp8 = {k: v for k, v in options.items() if k != "fp8_input_store"}
        out, _ = run(op, t, impl, gate_multiplier=g, down_multiplier=d, **no_fp8)
        assert torch.equal(got[0], out), "fp8_input_store changed the forward"
    compare(f"{op} {impl} {options} bias={bias}", t, got, (want_out, want_grads))


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("op", OPS)
def test_multipliers_of_one_are_the_defaults_bit_for_bit(op: str, impl: str) -> None:
    """1.0 (or the int 1) leaves output and gradients bit for bit what the call without
    them gives (a multiply by 1.0 is exact)."""
    t = make(op, (4,), 9, F16)
    base_out, base = run(op, t, impl, clamp_value=2.0)
    for one in (1.0, 1):
        out, grads = run(op, t, impl, clamp_value=2.0, gate_multiplier=one, down_multiplier=one)
        assert torch.equal(out, base_out)
        for name in base:
            assert torch.equal(grads[name], base[name]), name


def test_multipliers_are_runtime_float_arguments_of_the_kernels(monkeypatch) -> None:
    """A new multiplier value compiles nothing: the kernels take them as plain (not
    ``tl.constexpr``) arguments, launched as Python floats (Triton specialises an int
    argument of 1 or a multiple of 16 as a constant, never a float)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from lmfuse.activations import kernels
    from lmfuse.activations import ops as act_ops

    for kernel in (kernels.act_fwd_kernel, kernels.act_bwd_kernel):
        params = inspect.signature(getattr(kernel, "fn", kernel)).parameters
        for name in ("gate_mul", "down_mul"):
            assert params[name].annotation is inspect.Parameter.empty, (kernel, name)
    launches: list[tuple[str, dict[str, Any]]] = []

    class Spy:
        def __init__(self, name: str) -> None:
            self.name, self.real = name, getattr(kernels, name)

        def __getitem__(self, grid):
            def launch(*args, **kw):
                names = inspect.signature(getattr(self.real, "fn", self.real)).parameters
                launches.append((self.name, dict(zip(names, args))))
                return self.real[grid](*args, **kw)
            return launch

    spies = type("K", (), {n: Spy(n) for n in ("act_fwd_kernel", "act_bwd_kernel")})
    monkeypatch.setattr(act_ops, "_kernels", lambda: spies)
    keys = set()
    for g, d in ((2, 16), (0.5, 3.0), (1, 1)):
        t = make("weighted_swiglu", (3,), 4, F32)
        run("weighted_swiglu", t, "triton", gate_multiplier=g, down_multiplier=d)
        for kernel, args in launches[-2:]:
            assert (args["gate_mul"], args["down_mul"]) == (g, d), kernel
            for name in ("gate_mul", "down_mul"):
                assert type(args[name]) is float, (kernel, name, args[name])
                keys.add(native_specialize_impl(BaseBackend, args[name], False, True, True))
    assert len(launches) == 6
    assert keys == {("fp32", None)}, keys


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_default_cpu_path_takes_the_multipliers(monkeypatch, bias: bool) -> None:
    """On CPU float32 tensors without Triton, swiglu runs PyTorch's ops (``F.silu``) with
    the multipliers, giving the reference's output and gradients."""
    from lmfuse._dispatch import select_impl
    from lmfuse.activations import ops as act_ops

    calls = []
    real_silu = act_ops.F.silu
    monkeypatch.setattr(act_ops, "select_impl", lambda op, impl, device: (
        ("torch", "test: no Triton") if impl == "auto" else select_impl(op, impl, device)))
    monkeypatch.setattr(act_ops.F, "silu", lambda a: (calls.append(1), real_silu(a))[1])
    t = make("swiglu", (3, 2), 8, F32, bias=bias)
    got = run("swiglu", t, "auto", gate_multiplier=-0.75, down_multiplier=1.25)
    assert calls, "the CPU fast path did not run"
    compare("auto on CPU", t, got, reference(t, gate_multiplier=-0.75, down_multiplier=1.25))


def test_torch_compile_fullgraph() -> None:
    """The multipliers go through the custom ops (``lmfuse::act_fwd`` / ``act_bwd``):
    compiled with ``fullgraph=True``, output and gradients equal the eager call's."""
    torch._dynamo.reset()
    t = make("weighted_swiglu", (6,), 16, F32)
    lv = leaves(t)

    def call(x, w, b):
        return lmfuse.weighted_swiglu(x, w, b, gate_multiplier=0.5, down_multiplier=2.0,
                                      impl="triton")

    args = [lv["x"], lv["weights"], lv["bias"]]
    want = call(*args)
    want_grads = torch.autograd.grad(want, args, t["dy"])
    got = torch.compile(call, fullgraph=True, backend="aot_eager")(*args)
    got_grads = torch.autograd.grad(got, args, t["dy"])
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(got_grads, want_grads):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)


def test_explain_shows_the_multipliers() -> None:
    x = randn((4, 8))
    plan = lmfuse.explain(lmfuse.swiglu, x, gate_multiplier=0.5, down_multiplier=4.0)
    assert "0.5" in plan.details["multipliers"] and "4.0" in plan.details["multipliers"]
    assert "multipliers" not in lmfuse.explain(lmfuse.swiglu, x).details


BAD = [
    pytest.param(True, TypeError, id="bool"),
    pytest.param("2.0", TypeError, id="str"),
    pytest.param(None, TypeError, id="None"),
    pytest.param(torch.tensor(2.0), TypeError, id="tensor"),
    pytest.param(math.nan, ValueError, id="nan"),
    pytest.param(math.inf, ValueError, id="inf"),
    pytest.param(-math.inf, ValueError, id="-inf"),
]


@pytest.mark.parametrize("value, error", BAD)
@pytest.mark.parametrize("name", ["gate_multiplier", "down_multiplier"])
@pytest.mark.parametrize("op", OPS)
def test_bad_multiplier_raises(op: str, name: str, value: Any, error: type) -> None:
    """A clear error naming the op, the argument and the value, from the op and from
    ``explain`` alike."""
    x = randn((4, 6))
    args = (x, torch.rand(4, 1)) if op == "weighted_swiglu" else (x,)
    fn = getattr(lmfuse, op)
    pattern = (rf"^{op}: {name} must be a float, got {type(value).__name__} "
               if error is TypeError else rf"^{op}: {name} must be finite, got {value}$")
    with pytest.raises(error, match=pattern):
        fn(*args, **{name: value})
    with pytest.raises(error, match=pattern):
        lmfuse.explain(fn, *args, **{name: value})
