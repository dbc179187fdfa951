"""``lmfuse.layer_norm`` and ``lmfuse.LayerNorm`` on both paths (``impl="torch"`` and
``impl="triton"`` in the interpreter) against ``layer_norm_reference`` evaluated in float64,
and the CPU default path against ``F.layer_norm``.

Every case runs forward and backward from the same inputs (rounded to the dtype under test)
and compares the output and the gradients of x, weight and bias with the float64 reference,
within the tolerance of each result's dtype (``helpers.TOL``). Cases: fp32/fp16/bf16, H = 1
and odd H, rows streamed in column tiles (a lowered tile limit, and a real 65536-wide row),
3-D and non-contiguous x / parameters / upstream gradient, weight or bias alone, none,
``weight_offset``, float32 parameters with half x, empty inputs, the backward's row groups,
deterministic parameter gradients, NaN and inf, torch.compile, the module against
``torch.nn.LayerNorm``, bad input, ``explain``.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, randn

import lmfuse
from lmfuse import tuning
from lmfuse.norm import ops as norm_ops
from lmfuse.norm.reference import layer_norm_reference

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
IMPLS = ["torch", "triton"]
DTYPES = [pytest.param(d, id=str(d).replace("torch.", "")) for d in (F32, F16, BF16)]


def check(what: str, x: torch.Tensor, weight, bias, g: torch.Tensor, impl: str, **kw
          ) -> list[torch.Tensor]:
    """Run ``layer_norm`` on leaves with the inputs' values, dtypes and strides; compare
    output and gradients with the float64 reference on the same values."""
    names = [n for n, t in (("x", x), ("weight", weight), ("bias", bias)) if t is not None]
    given = {"x": x, "weight": weight, "bias": bias}
    leaves = {n: given[n].detach().requires_grad_(True) for n in names}
    out = lmfuse.layer_norm(leaves["x"], leaves.get("weight"), leaves.get("bias"), impl=impl,
                            **kw)
    grads = torch.autograd.grad(out, list(leaves.values()), g)
    ref_leaves = {n: t.detach().to(F64).requires_grad_(True) for n, t in leaves.items()}
    ref = layer_norm_reference(ref_leaves["x"], ref_leaves.get("weight"),
                               ref_leaves.get("bias"), **kw)
    ref_grads = torch.autograd.grad(ref, list(ref_leaves.values()), g.to(F64))
    assert out.dtype == x.dtype and out.shape == x.shape, what
    assert out.is_contiguous() or impl == "torch", what
    assert_close(out, ref, x.dtype, f"{what}: forward")
    for name, got, want in zip(names, grads, ref_grads):
        assert got.dtype == leaves[name].dtype, f"{what}: d {name} dtype {got.dtype}"
        assert_close(got, want, leaves[name].dtype, f"{what}: d {name}")
    return list(grads)


# --- forward and backward against the reference ----------------------------------------------


CASES = [  # (x shape, weight offset, weight, bias)
    pytest.param((5, 7), 0.0, True, True, id="2d-H7"),
    pytest.param((2, 3, 100), 1.0, True, True, id="3d-H100-1p"),
    pytest.param((19, 333), 0.0, True, False, id="2d-H333-nobias"),
    pytest.param((3, 2, 48), 0.0, False, True, id="3d-H48-biasonly"),
    pytest.param((4, 40), -0.5, False, False, id="H40-noaffine"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, offset, with_weight, with_bias", CASES)
def test_matches_reference(shape, offset: float, with_weight: bool, with_bias: bool,
                           dtype: torch.dtype, impl: str) -> None:
    # An offset mean per row: the centring must take it off (a variance summed as
    # E[x^2] - mean^2 would lose the fp32 digits of a row at 30 +- 2).
    x = randn(shape, dtype, scale=2.0) + 30.0
    w = randn((shape[-1],), dtype) if with_weight else None
    b = randn((shape[-1],), dtype) if with_bias else None
    check(f"{shape} {dtype} {impl}", x.to(dtype), w, b, randn(shape, dtype), impl,
          weight_offset=offset, eps=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_hidden_size_one(impl: str) -> None:
    """H = 1: every value is its row's mean, so y is the bias and dx is 0."""
    x, w, b = randn((6, 1), F32), randn((1,), F32), randn((1,), F32)
    g = randn((6, 1), F32)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    y = lmfuse.layer_norm(*leaves, impl=impl)
    dx, dw, db = torch.autograd.grad(y, leaves, g)
    assert torch.equal(y, b.expand(6, 1)) and not dx.any() and not dw.any()
    assert torch.allclose(db, g.sum(0))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_float32_parameters_with_half_x(dtype: torch.dtype, impl: str) -> None:
    """Mixed precision: the parameters' gradients come in float32, x's in the half dtype."""
    x = randn((6, 50), dtype)
    check(f"{dtype} x, fp32 params", x, randn((50,), F32), randn((50,), F32),
          randn((6, 50), dtype), impl)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("shape, offset, with_weight, with_bias", [
    pytest.param((7, 100), 0.0, True, True, id="H100"),
    pytest.param((2, 3, 70), 1.0, True, False, id="3d-H70-1p"),
    pytest.param((5, 33), 0.0, False, True, id="H33-biasonly"),
])
def test_streamed_rows(small_tiles: list, shape, offset: float, with_weight: bool,
                       with_bias: bool, dtype: torch.dtype) -> None:
    """Rows wider than the (lowered) tile limit: both kernels stream column tiles (the
    forward in three passes: mean, centred squares, output)."""
    x = randn(shape, dtype) + 30.0
    w = randn((shape[-1],), dtype) if with_weight else None
    b = randn((shape[-1],), dtype) if with_bias else None
    check(f"streamed {shape}", x.to(dtype), w, b, randn(shape, dtype), "triton",
          weight_offset=offset)
    assert small_tiles and all(not single for *_, single in small_tiles)


def test_streamed_row_of_65536() -> None:
    assert not norm_ops._config(65536, torch.device("cpu"))[0].single
    x = randn((2, 65536), F32)
    check("H 65536", x, randn((65536,), F32), randn((65536,), F32), randn((2, 65536), F32),
          "triton")


@pytest.mark.parametrize("streamed", [False, True], ids=["tile", "streamed"])
def test_backward_row_groups(small_tiles: list, streamed: bool) -> None:
    """Several backward programs, each walking several row tiles with a partial last one:
    the weight and bias gradients are the sums of their partials."""
    H = 40 if streamed else 24
    check("row groups", randn((23, H), F32), randn((H,), F32), randn((H,), F32),
          randn((23, H), F32), "triton")
    programs, rows_per_program = small_tiles[-1][:2]
    assert programs > 1 and rows_per_program > 2 and 23 % rows_per_program


def test_backward_stages_by_width_and_shared_memory(monkeypatch) -> None:
    """The backward's pipeline stages: RMSNorm's ``bwd_stages`` and LayerNorm's
    ``centered_bwd_stages`` by tile width, the streamed ones' by norm, 1 without an entry;
    cut to what the device's shared memory holds (stages - 1 buffers of the x and dy tiles
    beside the reductions' room); the gradients the same at any count (the interpreter
    runs the loop as written)."""
    cpu = torch.device("cpu")
    table = {"bwd_stages": [[32, 4], [64, 2]], "centered_bwd_stages": [[64, 3]],
             "bwd_stages_fp32": [], "centered_bwd_stages_fp32": [[16, 1], [64, 6]],
             "chunk_bwd_stages": 2, "centered_chunk_bwd_stages": 5, "max_single_block": 64}
    with tuning.overlay("rms_norm", table):
        assert [norm_ops._config(h, cpu)[2] for h in (8, 32, 33, 64)] == [4, 4, 2, 2]
        assert [norm_ops._config(h, cpu, True)[2] for h in (8, 64)] == [3, 3]
        # float32 rows (8 bytes a column of x and dy): their own entries
        assert [norm_ops._config(h, cpu, False, 8)[2] for h in (8, 64)] == [1, 1]
        assert [norm_ops._config(h, cpu, True, 8)[2] for h in (8, 64)] == [1, 6]
        assert norm_ops._config(64, cpu, True, 4)[2] == 3
        assert norm_ops._config(65, cpu)[2] == 2 and norm_ops._config(65, cpu, True)[2] == 5
        assert "first pass over its columns pipelined over 5 stages" in lmfuse.explain(
            "layer_norm", randn((3, 65), torch.float16)).details["backward"]
        assert "pipelined over 3 stages" in lmfuse.explain(
            "layer_norm", randn((3, 24), torch.float16)).details["backward"]
        check("pipelined", randn((7, 24)), randn((24,)), randn((24,)), randn((7, 24)),
              "triton")
    with tuning.overlay("rms_norm", {"bwd_stages": [], "centered_bwd_stages": []}):
        assert norm_ops._config(24, cpu)[2] == 1 and norm_ops._config(24, cpu, True)[2] == 1
        assert "pipelined" not in lmfuse.explain("layer_norm", randn((3, 24))).details[
            "backward"]
    # A device whose shared memory holds two 4096-column bf16 tiles of x and dy (16 KiB
    # each) beside the reductions' room: 3 stages at most, whatever the table asks.
    monkeypatch.setattr(tuning, "shared_memory",
                        lambda device: norm_ops._REDUCE_SMEM + 2 * 4096 * 4)
    with tuning.overlay("rms_norm", {"bwd_stages": [[16384, 6]], "bwd_stages_fp32": [[16384, 6]],
                                     "tile_elems": 4096}):
        assert norm_ops._config(4096, cpu, False, 4)[2] == 3
        assert norm_ops._config(4096, cpu, False, 8)[2] == 2  # float32: one buffer
        assert norm_ops._config(8192, cpu, False, 8)[2] == 1  # not even one: unpipelined


def test_backward_warps_of_the_centred_table(monkeypatch) -> None:
    """LayerNorm's backward takes the warps ``centered_bwd_warps`` gives its tile width
    (RMSNorm's and the forward keep the table's), and computes the same gradients."""
    cpu = torch.device("cpu")
    base = norm_ops._config(24, cpu)[0]
    with tuning.overlay("rms_norm", {"centered_bwd_warps": {"32": base.num_warps + 2}}):
        assert norm_ops._config(24, cpu, True)[0].num_warps == base.num_warps + 2
        assert norm_ops._config(24, cpu)[0] == base
        assert norm_ops._config(64, cpu, True)[0] == norm_ops._config(64, cpu)[0]
        assert f"{base.num_warps + 2} warps" in lmfuse.explain(
            "layer_norm", randn((3, 24))).details["backward"]
        check("more warps", randn((5, 24)), randn((24,)), randn((24,)), randn((5, 24)),
              "triton")


@pytest.mark.parametrize("impl", IMPLS)
def test_parameter_gradients_are_deterministic(small_tiles: list, impl: str) -> None:
    x, w, b, g = randn((37, 40), BF16), randn((40,), F32), randn((40,), F32), randn((37, 40),
                                                                                    BF16)
    runs = []
    for _ in range(3):
        leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
        runs.append(torch.autograd.grad(lmfuse.layer_norm(*leaves, impl=impl), leaves, g))
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0]))


# --- layouts, shapes, partial gradients ---------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", ["row-strided", "transposed", "expanded"])
def test_non_contiguous_x(layout: str, impl: str) -> None:
    if layout == "row-strided":
        x = randn((6, 60), F16)[:, 5:45]
    elif layout == "transposed":
        x = randn((40, 6), F16).t()
    else:  # every row the same memory (row stride 0)
        x = randn((1, 40), F16).expand(6, 40)
    assert not x.is_contiguous()
    g = randn((40, 6), F16).t()  # a non-contiguous upstream gradient too
    check(f"{layout} {impl}", x, randn((80,), F16)[::2], randn((40,), F16), g, impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8), (3, 0)], ids=["0x8", "2x0x8", "3x0"])
def test_empty(shape, impl: str) -> None:
    x = torch.zeros(shape, dtype=BF16, requires_grad=True)
    w = torch.ones(shape[-1], requires_grad=True)
    b = torch.zeros(shape[-1], requires_grad=True)
    y = lmfuse.layer_norm(x, w, b, impl=impl)
    assert y.shape == shape and y.dtype == BF16
    dx, dw, db = torch.autograd.grad(y, [x, w, b], torch.zeros(shape, dtype=BF16))
    assert dx.shape == shape and dw.shape == db.shape == (shape[-1],)
    assert not dw.any() and not db.any()


@pytest.mark.parametrize("impl", IMPLS)
def test_partial_requires_grad_and_no_grad(impl: str) -> None:
    x, w, b, g = randn((5, 24)), randn((24,)), randn((24,)), randn((5, 24))
    refs = [t.double().requires_grad_(True) for t in (x, w, b)]
    ref = layer_norm_reference(*refs)
    want = torch.autograd.grad(ref, refs, g.double())
    for i, name in enumerate(("x", "weight", "bias")):
        leaves = [x, w, b]
        leaves[i] = leaves[i].clone().requires_grad_(True)
        (got,) = torch.autograd.grad(lmfuse.layer_norm(*leaves, impl=impl), [leaves[i]], g)
        assert_close(got, want[i], F32, f"d{name} alone")
    with torch.no_grad():
        y = lmfuse.layer_norm(x.requires_grad_(True), w, b, impl=impl)
    assert not y.requires_grad
    assert_close(y, ref, F32, "no_grad forward")


def test_float64_on_the_torch_path() -> None:
    x = randn((3, 10), F64)
    assert lmfuse.layer_norm(x, randn((10,), F64), randn((10,), F64)).dtype == F64
    with pytest.raises(TypeError, match="layer_norm: .*float64.*impl='torch'"):
        lmfuse.layer_norm(x, impl="triton")


def test_gradcheck_float64_torch_path() -> None:
    leaves = [randn(s, F64, requires_grad=True) for s in ((3, 6), (6,), (6,))]
    assert torch.autograd.gradcheck(
        lambda x, w, b: lmfuse.layer_norm(x, w, b, eps=1e-3, weight_offset=1.0,
                                          impl="torch"), leaves)


def test_triton_forward_saves_mean_and_rstd() -> None:
    x = randn((4, 3, 50), BF16)
    y, (mean, rstd) = norm_ops.launch_layer_norm(x.reshape(12, 50), None, None, 1e-5, 0.0)
    xf = x.float().reshape(12, 50)
    assert mean.dtype == rstd.dtype == F32 and mean.shape == rstd.shape == (12,)
    assert torch.allclose(mean, xf.mean(-1), rtol=1e-6, atol=1e-7)
    assert torch.allclose(rstd, torch.rsqrt(xf.var(-1, unbiased=False) + 1e-5), rtol=1e-5)


def test_second_derivatives_raise_on_the_triton_path() -> None:
    x = randn((3, 8), requires_grad=True)
    (dx,) = torch.autograd.grad(lmfuse.layer_norm(x, impl="triton").square().sum(), [x],
                                create_graph=False)
    y = lmfuse.layer_norm(x, impl="triton")
    with pytest.raises(RuntimeError, match="layer_norm: second derivatives"):
        torch.autograd.grad(y.square().sum(), [x], create_graph=True)
    assert dx.shape == x.shape


# --- NaN and inf -------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf
@pytest.mark.parametrize("impl", IMPLS + ["auto"])
@pytest.mark.parametrize("poison", ["x-nan", "x-inf", "x-neginf", "weight-nan", "bias-nan"])
def test_nan_and_inf_as_in_pytorch(monkeypatch, poison: str, impl: str) -> None:
    """A NaN or an inf in a row makes that row, and its gradients, NaN; a NaN weight or
    bias element its column: exactly where ``F.layer_norm`` and its autograd put them,
    the finite values equal to it. ``auto`` is the CPU default path (Triton's interpreter
    off: PyTorch's own op)."""
    if impl == "auto":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, w, b, g = randn((4, 24)), randn((24,)), randn((24,)), randn((4, 24))
    target, value = {"x-nan": (x[1], math.nan), "x-inf": (x[2], math.inf),
                     "x-neginf": (x[0], -math.inf), "weight-nan": (w, math.nan),
                     "bias-nan": (b, math.nan)}[poison]
    target[5] = value
    out = {}
    for name, fn in (("lmfuse", lambda *t: lmfuse.layer_norm(*t, impl=impl)),
                     ("torch", lambda x, w, b: F.layer_norm(x, (24,), w, b))):
        leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
        y = fn(*leaves)
        out[name] = (y, *torch.autograd.grad(y, leaves, g))
    for what, got, want in zip(("y", "dx", "dw", "db"), out["lmfuse"], out["torch"]):
        assert torch.equal(got.isnan(), want.isnan()), f"{poison} {what}"
        fin = ~want.isnan()
        assert torch.allclose(got[fin], want[fin], rtol=1e-4, atol=1e-5), f"{poison} {what}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("streamed", [False, True], ids=["tile", "streamed"])
def test_constant_rows_give_the_bias_exactly(streamed: bool, impl: str) -> None:
    """A constant row's centred values are 0 whatever its magnitude, so its output is the
    bias exactly (as F.layer_norm's): the mean is summed from the row's first value, where
    sum(x) / H would round and give outputs of up to +-1 (1029.27 over 768 columns: 0.04,
    118367.34: 0.99)."""
    tiles = dict(max_single_block=32, chunk_block=16, chunk_rows=2) if streamed else {}
    x = torch.tensor([1029.27, 118367.34, -3.3e7, 7.1]).repeat_interleave(768).view(4, 768)
    w, b, g = randn((768,)), randn((768,)), randn((4, 768))
    assert torch.equal(F.layer_norm(x, (768,), w, b), b.expand(4, 768))
    with tuning.overlay("rms_norm", tiles):
        # (F.layer_norm's own dx is off here: 512 and 0 in the 118367.34 row)
        grads = check("constant rows", x, w, b, g, impl)
        y = lmfuse.layer_norm(x, w, b, impl=impl)
    assert torch.equal(y, b.expand(4, 768)) and grads[0].abs().max() > 1.0


@pytest.mark.parametrize("impl", IMPLS)
def test_tiny_spread_with_eps_zero_has_finite_gradients(impl: str) -> None:
    """A row of spread 1e-14 with eps = 0: its 1 / std is 1e14, whose cube (rsqrt's
    derivative) would overflow float32; the gradients are F.layer_norm's."""
    x = torch.tensor([[1e-14, -2e-14, 3e-14, 0.0]], requires_grad=True)
    dy = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    (got,) = torch.autograd.grad(lmfuse.layer_norm(x, eps=0.0, impl=impl), x, dy)
    (want,) = torch.autograd.grad(F.layer_norm(x, (4,), eps=0.0), x, dy)
    assert torch.allclose(got, want, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_rows_whose_variance_overflows() -> None:
    """Past float32's range: the bias where only the variance overflows (F.layer_norm
    agrees on this row), NaN where the differences from the first value overflow too;
    both paths alike."""
    x = torch.tensor([[1e20, -1e20, 5.0, 1.0], [3e38, -3e38, 1.0, 0.0]])
    b = torch.tensor([0.5, -0.25, 1.0, 2.0])
    for impl in IMPLS:
        y = lmfuse.layer_norm(x, None, b, impl=impl)
        assert torch.equal(y[0], b) and y[1].isnan().all(), impl
    assert torch.equal(F.layer_norm(x[:1], (4,), None, b), b[None])


# --- the CPU default path ------------------------------------------------------------------------


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_default_cpu_path_is_f_layer_norm(monkeypatch: pytest.MonkeyPatch, offset) -> None:
    """On CPU float32 without Triton the default path is PyTorch's op (``F.layer_norm``,
    offset folded into the weight; without an offset its op directly, ``torch.layer_norm``);
    outputs and gradients equal the reference's."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    calls = []
    for owner, name in ((torch.nn.functional, "layer_norm"), (norm_ops, "_torch_layer_norm")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _real=real, _name=name, **k: (
            calls.append(_name), _real(*a, **k))[1])
    x, w, b, g = randn((3, 5, 24), scale=2.0), randn((24,)), randn((24,)), randn((3, 5, 24))
    out = {}
    for impl in ("auto", "torch"):
        leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
        y = lmfuse.layer_norm(*leaves, eps=1e-5, weight_offset=offset, impl=impl)
        out[impl] = (y, *torch.autograd.grad(y, leaves, g))
    assert calls == ["layer_norm" if offset else "_torch_layer_norm"]
    assert "CPU float32:" in lmfuse.explain(lmfuse.layer_norm, x, w, b).reason
    for got, want in zip(out["auto"], out["torch"], strict=True):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


# --- torch.compile -------------------------------------------------------------------------------


def test_fullgraph_compile_holds_the_custom_ops() -> None:
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    leaves = [randn(s, requires_grad=True) for s in ((2, 3, 40), (40,), (40,))]
    g = randn((2, 3, 40))
    seen: list[str] = []

    def record(gm, inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes)
        return make_boxed_func(gm.forward)

    def call(x, w, b):
        return lmfuse.layer_norm(x, w, b, eps=1e-5, weight_offset=1.0, impl="triton")

    want = call(*leaves)
    want_grads = torch.autograd.grad(want, leaves, g)
    compiled = torch.compile(call, fullgraph=True,
                             backend=aot_autograd(fw_compiler=record, bw_compiler=record))
    got = compiled(*leaves)
    got_grads = torch.autograd.grad(got, leaves, g)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(got_grads, want_grads):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    assert "lmfuse.layer_norm_fwd.default" in seen and "lmfuse.layer_norm_bwd.default" in seen


@pytest.mark.parametrize("shape", [24, (3, 8)], ids=["H24", "2-dims"])
def test_module_compiles_whole(shape) -> None:
    """The module under torch.compile(fullgraph=True): no graph break (its checks and the
    flattening of a several-dims shape trace), the eager module's output and gradients."""
    torch._dynamo.reset()
    m = lmfuse.LayerNorm(shape, weight_offset=1.0, impl="triton")
    with torch.no_grad():
        m.weight.normal_()
        m.bias.normal_()
    dims = (shape,) if isinstance(shape, int) else shape
    x, g = randn((2, 5, *dims), requires_grad=True), randn((2, 5, *dims))
    results = []
    for fn in (m, torch.compile(m, fullgraph=True, backend="aot_eager")):
        y = fn(x)
        results.append((y, *torch.autograd.grad(y, [x, m.weight, m.bias], g)))
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)


# --- the module ---------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape, affine, bias", [
    pytest.param(24, True, True, id="H24"),
    pytest.param((24,), True, False, id="nobias"),
    pytest.param(torch.Size([3, 8]), True, True, id="2-dims"),
    pytest.param(24, False, True, id="noaffine"),
])
def test_module_matches_torch_layer_norm(shape, affine: bool, bias: bool, impl: str) -> None:
    """Same constructor, parameters (names, shapes, initial values: state dicts load
    across), output and gradients as ``torch.nn.LayerNorm``."""
    ours = lmfuse.LayerNorm(shape, 1e-5, affine, bias, impl=impl)
    theirs = torch.nn.LayerNorm(shape, 1e-5, affine, bias)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    for k, v in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v), k
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_()
    ours.load_state_dict(theirs.state_dict())
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    x = randn((2, 5, *dims), scale=3.0) + 1.0
    g = randn((2, 5, *dims))
    results = []
    for m in (ours, theirs):
        xi = x.clone().requires_grad_(True)
        y = m(xi)
        leaves = [xi, *m.parameters()]
        results.append((y, *torch.autograd.grad(y, leaves, g)))
    for a, b in zip(*results, strict=True):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_module_weight_offset_and_repr() -> None:
    m = lmfuse.LayerNorm(16, weight_offset=1.0, dtype=BF16)
    assert not m.weight.any() and not m.bias.any() and m.weight.dtype == BF16
    x = randn((3, 16), BF16)
    assert torch.equal(m(x), lmfuse.layer_norm(x, None, None))
    assert repr(m) == "LayerNorm(16, eps=1e-05, weight_offset=1.0, impl='auto')"
    assert "bias=False" in repr(lmfuse.LayerNorm((2, 3), bias=False))


@pytest.mark.parametrize("args, error, words", [
    (dict(normalized_shape=-1), ValueError, "normalized_shape"),
    (dict(normalized_shape=()), ValueError, "normalized_shape"),
    (dict(normalized_shape=8, eps=-1.0), ValueError, "eps"),
    (dict(normalized_shape=8, elementwise_affine=1), TypeError, "elementwise_affine"),
    (dict(normalized_shape=8, bias="yes"), TypeError, "bias"),
    (dict(normalized_shape=8, impl="cuda"), ValueError, "impl"),
])
def test_module_bad_arguments(args: dict, error, words: str) -> None:
    with pytest.raises(error, match=f"LayerNorm: .*{words}"):
        lmfuse.LayerNorm(**args)


def test_module_bad_input_names_x() -> None:
    with pytest.raises(ValueError,
                       match=r"LayerNorm: x must be .* = \[\.\.\., 8\], got shape \(3, 7\)"):
        lmfuse.LayerNorm(8)(randn((3, 7)))


# --- bad input, explain, signature --------------------------------------------------------------


BAD = [  # (id, changed arguments, error, words the message must contain)
    ("weight-length", dict(weight=randn((9,))), ValueError, r"weight \[8\] \(9,\)"),
    ("bias-length", dict(bias=randn((7,))), ValueError, r"bias \[8\] \(7,\)"),
    ("bias-2d", dict(bias=randn((1, 8))), ValueError, r"bias 1-D 2-D"),
    ("bias-int", dict(bias=torch.ones(8, dtype=torch.int64)), TypeError, r"bias int64"),
    ("bias-device", dict(bias=torch.ones(8, device="meta")), ValueError, r"bias meta cpu"),
    ("x-int", dict(x=torch.ones(4, 8, dtype=torch.int32)), TypeError, r"\bx\b int32"),
    ("x-0d", dict(x=torch.tensor(1.0), weight=None, bias=None), ValueError, r"\bx\b 0-D"),
    ("eps-negative", dict(eps=-1e-6), ValueError, r"eps >= 0 variance"),
    ("eps-nan", dict(eps=float("nan")), ValueError, r"eps finite nan"),
    ("eps-str", dict(eps="1e-6"), TypeError, r"eps str"),
    ("offset-inf", dict(weight_offset=float("inf")), ValueError, r"weight_offset finite"),
    ("impl", dict(impl="cuda"), ValueError, r"impl 'cuda'"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("change, error, message", [pytest.param(*b[1:], id=b[0]) for b in BAD])
def test_bad_input_raises(change: dict, error, message: str, impl: str) -> None:
    args = dict(x=randn((4, 8)), weight=randn((8,)), bias=randn((8,)), impl=impl)
    args.update(change)
    x, weight, bias = args.pop("x"), args.pop("weight"), args.pop("bias")
    pattern = r"(?s)^layer_norm: " + "".join(f"(?=.*{word})" for word in message.split())
    with pytest.raises(error, match=pattern):
        lmfuse.layer_norm(x, weight, bias, **args)
    with pytest.raises(error, match=pattern):
        lmfuse.explain(lmfuse.layer_norm, x, weight, bias, **args)


def test_explain() -> None:
    x, w, b = randn((2, 3, 100), BF16), randn((100,), F32), randn((100,), BF16)
    plan = lmfuse.explain("layer_norm", x, w, b, weight_offset=1.0)
    assert plan.op == "layer_norm" and plan.impl == "triton"
    assert plan.details["x"] == "[2, 3, 100] bfloat16: 6 rows of 100"
    assert plan.details["scale"] == "weight + 1" and plan.details["bias"] == "[100] bfloat16"
    assert "weight and bias gradient" in plan.details["backward"]
    assert "mean" in plan.details["saved for backward"]
    assert lmfuse.explain(lmfuse.layer_norm, torch.empty(2, 65536)).details[
        "forward"].startswith("streamed")


def test_signature_and_exports() -> None:
    import lmfuse.norm

    assert lmfuse.norm.layer_norm is lmfuse.layer_norm
    assert lmfuse.norm.LayerNorm is lmfuse.LayerNorm
    assert "layer_norm" in lmfuse.__all__ and "LayerNorm" in lmfuse.__all__
    sig = inspect.signature(lmfuse.layer_norm).replace(
        return_annotation=inspect.Signature.empty)
    plain = sig.replace(parameters=[p.replace(annotation=inspect.Parameter.empty)
                                    for p in sig.parameters.values()])
    assert str(plain) == ("(x, weight=None, bias=None, *, eps=1e-05, weight_offset=0.0, "
                          "impl='auto')")
    torch_params = list(inspect.signature(torch.nn.LayerNorm).parameters)
    assert list(inspect.signature(lmfuse.LayerNorm).parameters)[:len(torch_params)] == \
        torch_params


def test_module_of_an_empty_row() -> None:
    """``LayerNorm(0)``, as ``nn.LayerNorm(0)``: empty parameters, an empty output."""
    m = lmfuse.LayerNorm(0)
    assert m.weight.shape == m.bias.shape == (0,)
    assert m(randn((3, 0))).shape == torch.nn.LayerNorm(0)(randn((3, 0))).shape == (3, 0)
