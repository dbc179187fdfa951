"""cross_entropy under torch.compile (fullgraph) and the custom ops' fake/autograd contracts.

The ops' arguments are not written out here: they are recorded, with a dispatch mode, from
real ``lmfuse.cross_entropy`` calls on small inputs (forward and backward), so each op is
checked with exactly what the autograd function passes it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import ce_through_custom_ops, randn
from torch.utils._python_dispatch import TorchDispatchMode

import lmfuse
from lmfuse.cross_entropy import ops as ce_ops

OPS = ("ce_stats", "ce_fwd_grad", "ce_fwd_grad_", "ce_grad", "ce_grad_", "ce_scale_")

# (reduction, inplace_backward) -> the lmfuse ops that call must run, forward then backward.
PASSES = {
    ("mean", False): ["ce_fwd_grad", "ce_scale_"],
    ("sum", True): ["ce_fwd_grad_", "ce_scale_"],
    ("none", False): ["ce_stats", "ce_grad"],
    ("none", True): ["ce_stats", "ce_grad_"],
}
CASES = [pytest.param(red, inplace, id=f"{red}" + ("-inplace" if inplace else ""))
         for red, inplace in PASSES]


class RecordLmfuseOps(TorchDispatchMode):
    """Records each ``torch.ops.lmfuse.*`` call with a copy of its arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple[Any, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "lmfuse":
            copy = tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args)
            self.calls.append((func, copy))
        return func(*args, **(kwargs or {}))


def inputs(reduction: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    leaf = randn((2, 3, 37), scale=2.0, requires_grad=True)
    target = torch.randint(0, 37, (2, 3))
    target[0, 1] = -100
    grad_out = randn(target.shape) if reduction == "none" else torch.tensor(2.5)
    return leaf, target, grad_out


def loss_fn(reduction: str, inplace: bool):
    def f(leaf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # inplace_backward overwrites the logits it gets: give it a non-leaf.
        x = leaf * 1.0 if inplace else leaf
        return lmfuse.cross_entropy(x, target, reduction=reduction, label_smoothing=0.1,
                                    z_loss=1e-3, softcap=8.0, inplace_backward=inplace)

    return f


@pytest.mark.parametrize("reduction, inplace", CASES)
def test_compile_fullgraph_matches_eager(reduction: str, inplace: bool) -> None:
    leaf, target, grad_out = inputs(reduction)
    f = loss_fn(reduction, inplace)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    leaf_c = leaf.detach().clone().requires_grad_(True)
    loss = f(leaf, target)
    loss.backward(grad_out)
    loss_c = compiled(leaf_c, target)
    loss_c.backward(grad_out)
    what = f"reduction={reduction} inplace={inplace}"
    assert torch.equal(loss, loss_c), what
    assert torch.equal(leaf.grad, leaf_c.grad), what


@pytest.fixture
def through_custom_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager calls launch the kernels directly (no dispatcher); make them take the custom
    ops, as compiled code does, so a dispatch mode can see them."""
    ce_through_custom_ops(monkeypatch)


@pytest.mark.parametrize("reduction, inplace", CASES)
def test_custom_op_path_equals_direct_launches(reduction: str, inplace: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    leaf, target, grad_out = inputs(reduction)
    f = loss_fn(reduction, inplace)
    loss = f(leaf, target)
    loss.backward(grad_out)
    ce_through_custom_ops(monkeypatch)
    leaf_op = leaf.detach().clone().requires_grad_(True)
    loss_op = f(leaf_op, target)
    loss_op.backward(grad_out)
    assert torch.equal(loss, loss_op) and torch.equal(leaf.grad, leaf_op.grad)


@pytest.mark.parametrize("reduction, inplace", CASES)
def test_pass_runs_the_expected_ops(reduction: str, inplace: bool,
                                    through_custom_ops: None) -> None:
    leaf, target, grad_out = inputs(reduction)
    with RecordLmfuseOps() as rec:
        loss_fn(reduction, inplace)(leaf, target).backward(grad_out)
    assert [func._schema.name.split("::")[1] for func, _ in rec.calls] == PASSES[
        (reduction, inplace)]


def test_custom_ops_pass_opcheck(through_custom_ops: None) -> None:
    recorded: dict[str, tuple[Any, tuple[Any, ...]]] = {}
    for reduction, inplace in PASSES:
        leaf, target, grad_out = inputs(reduction)
        with RecordLmfuseOps() as rec:
            loss_fn(reduction, inplace)(leaf, target).backward(grad_out)
        for func, args in rec.calls:
            recorded.setdefault(func._schema.name.split("::")[1], (func, args))
    assert sorted(recorded) == sorted(OPS)
    for name in OPS:
        func, args = recorded[name]
        torch.library.opcheck(func, args)


# --- linear_cross_entropy ------------------------------------------------------------------


def linear_inputs(bias: bool = True):
    h = randn((23, 16))
    w = randn((45, 16), scale=0.25)
    b = randn((45,)) if bias else None
    t = torch.randint(0, 45, (23,))
    t[::5] = -100
    return h, w, b, t


def linear_loss(reduction: str):
    def f(h, w, b, t):  # three chunks of 8 tokens (the last 7)
        return lmfuse.linear_cross_entropy(h, w, t, bias=b, reduction=reduction, impl="triton",
                                           label_smoothing=0.1, z_loss=1e-3,
                                           max_chunk_bytes=45 * 4 * 8)
    return f


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_compile_fullgraph_matches_eager(reduction: str) -> None:
    """The chunk loop, GEMMs and CE custom ops trace without a graph break, same numbers."""
    h, w, b, t = linear_inputs()
    f = linear_loss(reduction)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (f, compiled):
        leaves = [x.detach().clone().requires_grad_(True) for x in (h, w, b)]
        loss = fn(*leaves, t)
        grads = torch.autograd.grad(loss, leaves, torch.ones_like(loss))
        results.append((loss, *grads))
    for eager, comp, name in zip(*results, ("loss", "hidden", "weight", "bias")):
        assert torch.equal(eager, comp), name


def test_linear_custom_ops_carry_the_kernel_override(monkeypatch: pytest.MonkeyPatch,
                                                     streamed_short_rows: list) -> None:
    """Through the custom ops (compiled code's path) the config's CE kernel launch arrives
    as it does eagerly, and the numbers are the direct launches'."""
    from lmfuse.cross_entropy import linear

    launched = streamed_short_rows
    kernel = {"BLOCK_V": 16, "num_warps": 1, "programs_per_sm": 2, "slice": 32, "lag": 1}
    cfg = {"chunk_bytes": 45 * 4 * 8, "row_multiple": 1, "kernel": kernel}
    h, w, b, t = linear_inputs(bias=False)
    results = []
    for via_ops in (False, True):
        if via_ops:
            ce_through_custom_ops(monkeypatch)
        leaves = [x.detach().clone().requires_grad_(True) for x in (h, w)]
        loss = linear._apply(*leaves, t, None, -100, 0.0, 0.0, None, "sum", None, "triton",
                             None, cfg)
        results.append((loss, *torch.autograd.grad(loss, leaves)))
    # 3 chunks, eagerly and through lmfuse::ce_fwd_grad_
    assert launched == [ce_ops.StreamLaunch.of(kernel)] * 6
    for direct, via_ops in zip(*results):
        assert torch.equal(direct, via_ops)


def test_linear_compile_with_a_cached_kernel_override(tuning_cache, streamed_short_rows) -> None:
    """A tuned CE launch from the user cache is traced into the graph (as the custom op's
    string argument) and used by the compiled code."""
    from lmfuse import tuning

    kernel = {"BLOCK_V": 16, "num_warps": 1, "programs_per_sm": 2.5, "slice": 32, "lag": 1}
    tuning.record("linear_cross_entropy", torch.device("cpu"), 45, {
        "chunk_bytes": 45 * 4 * 8, "row_multiple": 1, "kernel": kernel}, {"ms": 1.0})
    h, w, b, t = linear_inputs(bias=False)
    f = linear_loss("mean")
    results = []
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        leaves = [x.detach().clone().requires_grad_(True) for x in (h, w)]
        loss = fn(*leaves, None, t)
        results.append((loss, *torch.autograd.grad(loss, leaves)))
    assert streamed_short_rows and all(k == ce_ops.StreamLaunch.of(kernel)
                                       for k in streamed_short_rows)
    for eager, comp in zip(*results):
        assert torch.equal(eager, comp)


@pytest.mark.parametrize("fused", [None, {"BLOCK_V": 4096, "num_warps": 8, "programs_per_sm": 4},
                                   {"BLOCK_V": 16, "num_warps": 1, "programs_per_sm": 0.5,
                                    "slice": 32, "lag": 2},
                                   # (flags as a JSON cache may hold them: true for 1)
                                   {"BLOCK_V": 32, "num_warps": 2, "programs_per_sm": 1e-5,
                                    "hints": True, "vec": 8, "prefetch": True}])
def test_launch_encoding_round_trips(fused) -> None:
    if fused is None:
        assert ce_ops.StreamLaunch.decode("") is None
        return
    launch = ce_ops.StreamLaunch.of(fused)
    assert ce_ops.StreamLaunch.decode(launch.encode()) == launch
    assert ce_ops.StreamLaunch.of(launch.entry()) == launch
