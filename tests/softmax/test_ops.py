"""``lmfuse.fused_softmax``: the Triton path (under the interpreter) against the reference.

Every case runs forward and backward on both paths from the same inputs and compares
the output and every gradient (scores, learnable additive mask, softmax_offset) within
the dtype's tolerance; positions a row cannot see must be exactly 0 in the output and in
the scores' gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
from helpers import assert_close, rand_bool, randn
from hypothesis import given
from hypothesis import strategies as st

import lmfuse
from lmfuse.softmax import ops
from lmfuse.tuning import RowTiles
from lmfuse.softmax.reference import fused_softmax_backward_reference, visible_keys

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
DTYPES = [pytest.param(d, id=str(d).replace("torch.", "")) for d in (F32, F16, BF16)]

# Launch configurations forced through ops._config, for paths the default table only
# takes at large sk or never at these small shapes.
CHUNKED = RowTiles(block_m=1, block_n=16, single=False, num_warps=4)
TILE4 = RowTiles(block_m=4, block_n=64, single=True, num_warps=4)
CHUNKED_TILE4 = RowTiles(block_m=4, block_n=16, single=False, num_warps=4)

MASK_SHAPES: dict[str, Callable[[int, int, int, int], tuple[int, ...]]] = {
    "b1qk": lambda b, h, q, k: (b, 1, q, k),
    "b11k": lambda b, h, q, k: (b, 1, 1, k),
    "1h11": lambda b, h, q, k: (1, h, 1, 1),
    "1h1k": lambda b, h, q, k: (1, h, 1, k),
    "qk": lambda b, h, q, k: (q, k),
    "bhqk": lambda b, h, q, k: (b, h, q, k),
}


@dataclass(frozen=True)
class Case:
    """One fused_softmax call. ``mask`` is ``None`` or ``(kind, shape key)`` with kind
    ``bool``, ``additive`` (constant) or ``learned`` (additive, requires grad)."""

    id: str
    shape: tuple[int, int, int, int]
    causal: bool = False
    window: Any = None
    mask: tuple[str, str] | None = None
    offset: bool = False
    scale: float | None = None
    dead_row: bool = False  # a bool-masked row with every key hidden

    def kwargs(self) -> dict[str, Any]:
        return dict(scale=self.scale, causal=self.causal, window_size=self.window)


def make_inputs(case: Case, dtype: torch.dtype, offset_dtype: torch.dtype | None = None):
    b, h, q, k = case.shape
    scores = randn(case.shape, dtype, scale=2.0)
    mask = None
    if case.mask is not None:
        kind, key = case.mask
        shape = MASK_SHAPES[key](b, h, q, k)
        if kind == "bool":
            mask = rand_bool(shape)
            if case.dead_row:
                mask[..., -1 if len(shape) == 2 else slice(None), :] = False
                mask.view(-1, shape[-1])[0] = True  # first row of the mask: all hidden
        else:
            mask = randn(shape, dtype).requires_grad_(kind == "learned")
    offset = randn((h,), offset_dtype or dtype) if case.offset else None
    grad_out = randn(case.shape, dtype)
    return scores, mask, offset, grad_out


def forward_backward(impl: str, scores, mask, offset, grad_out, **kwargs):
    """y and the gradients of every differentiable input, on a fresh copy of the inputs."""
    x = scores.detach().clone().requires_grad_(True)
    m = None if mask is None else mask.detach().clone().requires_grad_(mask.requires_grad)
    o = None if offset is None else offset.detach().clone().requires_grad_(True)
    y = lmfuse.fused_softmax(x, mask=m, softmax_offset=o, impl=impl, **kwargs)
    y.backward(grad_out)
    grads = {"d scores": x.grad}
    if m is not None and m.requires_grad:
        grads["d mask"] = m.grad
    if o is not None:
        grads["d softmax_offset"] = o.grad
    return y, grads


def hidden_positions(scores, mask, **kwargs) -> torch.Tensor:
    """[b, np, sq, sk] bool: keys a row cannot see (band or bool mask)."""
    b, h, q, k = scores.shape
    call = lmfuse.explain(lmfuse.fused_softmax, scores, mask=mask, impl="torch", **kwargs).call
    hidden = ~visible_keys(q, k, call.left, call.right, scores.device)
    if mask is not None and mask.dtype == torch.bool:
        hidden = hidden | mask
    return hidden.expand(b, h, q, k)


def grads_from_output(y, scores, mask, offset, grad_out, **kwargs) -> dict[str, torch.Tensor]:
    """The gradients the fused backward must produce from the output ``y`` it saved.

    The Triton backward reads ``y`` as stored (bf16/fp16 for those dtypes), as every fused
    softmax does, so exact autograd is not its oracle in the half types: the rounding of
    ``y`` alone moves a gradient by more than a few ulps where ``grad - sum(grad * y)``
    cancels. This computes the same formula in float64 from that ``y``.
    """
    call = lmfuse.explain(lmfuse.fused_softmax, scores, mask=mask, softmax_offset=offset,
                          impl="torch", **kwargs).call
    g = fused_softmax_backward_reference(y.double(), grad_out)
    grads = {"d scores": (call.scale * g).to(y.dtype)}
    if mask is not None and mask.requires_grad:
        grads["d mask"] = g.sum_to_size(mask.shape).to(mask.dtype)
    if offset is not None:
        b, h, q, k = scores.shape
        z = scores.double() * call.scale
        if mask is not None and mask.dtype != torch.bool:
            z = z + mask.double()
        z = z.masked_fill(hidden_positions(scores, mask, **kwargs), float("-inf"))
        sink = offset.detach().double().view(1, h, 1, 1).expand(b, h, q, 1)
        lse = torch.logsumexp(torch.cat([z, sink], dim=-1), dim=-1, keepdim=True)
        dot = (y.double() * grad_out.double()).sum(dim=-1, keepdim=True)
        grads["d softmax_offset"] = (-torch.exp(sink - lse) * dot).sum(dim=(0, 2, 3)).to(
            offset.dtype)
    return grads


def check_against_reference(what: str, dtype: torch.dtype, scores, mask, offset, grad_out,
                            **kwargs) -> None:
    y, grads = forward_backward("triton", scores, mask, offset, grad_out, **kwargs)
    y_ref, grads_torch = forward_backward("torch", scores, mask, offset, grad_out, **kwargs)
    grads_ref = grads_from_output(y.detach(), scores, mask, offset, grad_out, **kwargs)
    if dtype in (F32, F64):  # where rounding y costs nothing, the oracle is plain autograd
        for name, g in grads_torch.items():
            assert_close(grads_ref[name], g, dtype, f"{what}: oracle vs autograd, {name}")
    assert y.dtype == scores.dtype, f"{what}: output dtype {y.dtype} != {scores.dtype}"
    assert y.is_contiguous(), f"{what}: output is not contiguous"
    assert_close(y, y_ref, dtype, f"{what}: forward")
    assert grads.keys() == grads_ref.keys()
    for name, g in grads.items():
        assert g is not None, f"{what}: {name} is None"
        ref = grads_ref[name]
        assert g.dtype == ref.dtype, f"{what}: {name} dtype {g.dtype} != {ref.dtype}"
        assert_close(g, ref, dtype, f"{what}: {name}")
    hidden = hidden_positions(scores, mask, **kwargs)
    zero = torch.zeros((), dtype=y.dtype)
    assert torch.equal(y[hidden], zero.expand(int(hidden.sum()))), f"{what}: y != 0 where hidden"
    dx = grads["d scores"]
    assert torch.equal(dx[hidden], zero.expand(int(hidden.sum()))), (
        f"{what}: d scores != 0 where hidden"
    )


CASES = [
    Case("plain", (2, 3, 5, 7)),
    Case("plain-scale0.35", (2, 3, 5, 7), scale=0.35),
    Case("causal-sq=sk", (2, 2, 6, 6), causal=True),
    Case("causal-sq<sk", (1, 2, 3, 9), causal=True, scale=0.5),
    Case("window-int2", (1, 2, 6, 6), window=2),
    Case("window-int0", (1, 2, 4, 4), window=0),
    Case("window-int3-sq<sk", (1, 2, 3, 8), window=3),
    Case("window(2,1)", (1, 2, 6, 6), window=(2, 1)),
    Case("window(-1,2)", (1, 2, 5, 7), window=(-1, 2)),
    Case("window(3,-1)", (1, 2, 5, 7), window=(3, -1)),
    Case("window(-1,-1)", (1, 2, 4, 5), window=(-1, -1)),
    Case("window(1,0)-sq>sk", (1, 2, 6, 3), window=(1, 0)),
    Case("causal+window(3,2)", (1, 2, 6, 6), causal=True, window=(3, 2)),
    Case("bool-b1qk", (2, 3, 4, 6), mask=("bool", "b1qk")),
    Case("bool-b11k", (2, 3, 4, 6), mask=("bool", "b11k")),
    Case("bool-1h11", (2, 3, 4, 6), mask=("bool", "1h11")),
    Case("bool-qk", (2, 3, 4, 6), mask=("bool", "qk")),
    Case("bool-bhqk", (2, 3, 4, 6), mask=("bool", "bhqk")),
    Case("additive-b1qk", (2, 2, 4, 6), mask=("additive", "b1qk")),
    Case("learned-b11k", (2, 2, 4, 6), mask=("learned", "b11k")),
    Case("learned-1h1k", (2, 2, 4, 6), mask=("learned", "1h1k")),
    Case("learned-qk", (2, 2, 4, 6), mask=("learned", "qk")),
    Case("learned-bhqk", (2, 2, 4, 6), mask=("learned", "bhqk"), scale=0.7),
    Case("sink", (2, 3, 4, 6), offset=True),
    Case("sink+causal", (2, 3, 4, 6), causal=True, offset=True),
    Case("causal+bool+sink", (2, 3, 4, 6), causal=True, mask=("bool", "b1qk"), offset=True,
         scale=0.6),
    Case("window+learned+sink", (1, 2, 5, 8), window=(2, 1), mask=("learned", "b1qk"),
         offset=True),
    Case("causal+learned+sink", (2, 2, 4, 6), causal=True, mask=("learned", "b11k"),
         offset=True, scale=1.5),
    Case("dead-row-bool", (1, 2, 3, 5), mask=("bool", "b1qk"), dead_row=True),
    Case("dead-row-bool+sink", (1, 2, 3, 5), mask=("bool", "b1qk"), dead_row=True, offset=True),
    Case("sq=1", (2, 2, 1, 9)),
    Case("sq=1-causal+sink", (2, 2, 1, 9), causal=True, offset=True),
    Case("sk=1", (2, 2, 3, 1)),
    Case("sk=1-causal+sink", (1, 2, 1, 1), causal=True, offset=True),
    Case("sk=3-bool", (1, 2, 2, 3), mask=("bool", "b11k")),
    Case("rows-not-x4", (3, 1, 1, 5)),
    Case("rows-not-x4-causal", (1, 3, 3, 7), causal=True),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_triton_matches_reference(case: Case, dtype: torch.dtype) -> None:
    scores, mask, offset, grad_out = make_inputs(case, dtype)
    check_against_reference(f"{case.id} {dtype}", dtype, scores, mask, offset, grad_out,
                            **case.kwargs())


def test_float32_offset_with_bfloat16_scores() -> None:
    # Mixed precision: the sink is an fp32 parameter, the activations are bf16.
    case = Case("sink-fp32", (2, 2, 3, 6), causal=True, offset=True)
    scores, mask, offset, grad_out = make_inputs(case, BF16, offset_dtype=F32)
    y, grads = forward_backward("triton", scores, mask, offset, grad_out, causal=True)
    y_ref, _ = forward_backward("torch", scores, mask, offset, grad_out, causal=True)
    grads_ref = grads_from_output(y.detach(), scores, mask, offset, grad_out, causal=True)
    assert y.dtype == BF16 and grads["d softmax_offset"].dtype == F32
    assert_close(y, y_ref, BF16, "bf16 scores, fp32 sink: forward")
    for name in grads:
        assert_close(grads[name], grads_ref[name], BF16, f"bf16 scores, fp32 sink: {name}")


@pytest.mark.parametrize("dtype", [pytest.param(F32, id="float32"), pytest.param(BF16, id="bf16")])
@pytest.mark.parametrize("case", [
    Case("sk=4097", (1, 1, 2, 4097)),
    Case("sk=4097-causal+b11k+sink", (1, 1, 2, 4097), causal=True, mask=("bool", "b11k"),
         offset=True),
], ids=lambda c: c.id)
def test_long_row_single_block(case: Case, dtype: torch.dtype) -> None:
    tiles = ops._config(case.shape[-1], torch.device("cpu"))
    assert tiles.single and tiles.block_n >= case.shape[-1]
    scores, mask, offset, grad_out = make_inputs(case, dtype)
    check_against_reference(f"{case.id} {dtype}", dtype, scores, mask, offset, grad_out,
                            **case.kwargs())


@pytest.mark.parametrize("case", [
    Case("sk=131072-causal+sink", (1, 1, 2, 131072), causal=True, offset=True),
    Case("sk=131075-window+b11k", (1, 1, 1, 131075), window=(70000, -1),
         mask=("bool", "b11k")),
], ids=lambda c: c.id)
def test_very_long_row_default_chunked(case: Case) -> None:
    """The default table's chunked path at the issue's longest rows, unforced."""
    tiles = ops._config(case.shape[-1], torch.device("cpu"))
    assert not tiles.single and tiles.block_n < case.shape[-1]
    scores, mask, offset, grad_out = make_inputs(case, F32)
    check_against_reference(f"{case.id} float32", F32, scores, mask, offset, grad_out,
                            **case.kwargs())


def test_default_config_goes_chunked_past_max_single_block() -> None:
    tiles = ops._config(1 << 20, torch.device("cpu"))
    assert tiles.single is False and tiles.block_m == 1
    plan = lmfuse.explain(lmfuse.fused_softmax, torch.empty(1, 1, 1, 1 << 15))
    assert "chunked" in plan.details["kernel"]


CHUNK_CASES = [
    Case("sk=37", (1, 2, 3, 37)),
    Case("sk=16-exact", (1, 1, 2, 16)),
    Case("causal-sk=50", (1, 2, 4, 50), causal=True),
    Case("window(5,3)-sk=50", (1, 1, 5, 50), window=(5, 3)),
    Case("window-int20-sk=50", (1, 1, 3, 50), window=20),
    Case("bool-b11k-sk=37", (2, 1, 2, 37), mask=("bool", "b11k")),
    Case("learned-b1qk-sk=37", (1, 2, 2, 37), mask=("learned", "b1qk")),
    Case("sink+causal-sk=37", (1, 2, 3, 37), causal=True, offset=True),
    Case("dead-row+sink-sk=37", (1, 2, 3, 37), mask=("bool", "b1qk"), dead_row=True,
         offset=True),
    Case("causal+window+learned+sink-sk=40", (1, 2, 3, 40), causal=True, window=(9, -1),
         mask=("learned", "b11k"), offset=True, scale=0.8),
]
# Some cases must end in a partial 4-row tile, so the tail rows' masking is exercised.
assert any((c.shape[0] * c.shape[1] * c.shape[2]) % 4 for c in CHUNK_CASES)
CONFIGS = [pytest.param(CHUNKED, id="chunked-M1"),
           pytest.param(CHUNKED_TILE4, id="chunked-M4"),
           pytest.param(TILE4, id="tile-M4")]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("case", CHUNK_CASES, ids=[c.id for c in CHUNK_CASES])
def test_forced_launch_configs(monkeypatch: pytest.MonkeyPatch, case: Case,
                               config: dict[str, Any]) -> None:
    """The online-softmax chunk loops and multi-row tiles (tail tile: rows % 4 != 0)."""
    monkeypatch.setattr(ops, "_config", lambda sk, device: config)
    scores, mask, offset, grad_out = make_inputs(case, F32)
    check_against_reference(f"{case.id} {config}", F32, scores, mask, offset, grad_out,
                            **case.kwargs())


@pytest.mark.parametrize("case", [CHUNK_CASES[2], CHUNK_CASES[5], CHUNK_CASES[9]],
                         ids=lambda c: c.id)
def test_streamed_rows_with_hints_and_a_backward_chunk_of_its_own(case: Case) -> None:
    """A table's ``chunk_hints`` (L2 eviction hints on the two passes) and
    ``bwd_chunk_block`` / ``bwd_chunk_warps`` (the backward streams y and dy in chunks of
    its own): the same values as the reference, and ``explain`` names both."""
    from lmfuse import tuning

    launched = []

    class Spy:
        def __init__(self, name):
            self.name, self.real = name, getattr(ops._kernels(), name)

        def __getitem__(self, grid):
            def launch(*args, **meta):
                launched.append((self.name, meta["BLOCK_N"], meta["num_warps"],
                                 meta.get("HINTS")))
                return self.real[grid](*args, **meta)
            return launch

    values = dict(max_single_block=16, chunk_block=16, chunk_warps=4, chunk_hints=1,
                  bwd_chunk_block=32, bwd_chunk_warps=2)
    with tuning.overlay("softmax", values), pytest.MonkeyPatch.context() as mp:
        for name in ("softmax_fwd_kernel", "softmax_bwd_kernel"):
            mp.setattr(ops._kernels(), name, Spy(name))
        scores, mask, offset, grad_out = make_inputs(case, F32)
        check_against_reference(f"{case.id} hints", F32, scores, mask, offset, grad_out,
                                **case.kwargs())
        plan = lmfuse.explain(lmfuse.fused_softmax, scores)
    assert set(launched) == {("softmax_fwd_kernel", 16, 4, True),
                             ("softmax_bwd_kernel", 32, 2, True)}, launched
    assert "16-key chunks (32 in the backward), L2 keeps" in plan.details["kernel"]


def test_long_rows_entry_from_its_min_keys_on() -> None:
    """A table's ``long_rows`` values apply to rows of ``min_keys`` keys or more (streamed
    ones: the forward's and the backward's chunks, the hints), the rest of the table below."""
    from lmfuse import tuning

    cpu = torch.device("cpu")
    long_rows = dict(min_keys=64, chunk_block=32, chunk_warps=2, chunk_hints=1,
                     bwd_chunk_block=64, bwd_chunk_warps=1)
    with tuning.overlay("softmax", dict(max_single_block=16, chunk_block=16, chunk_warps=4,
                                        long_rows=long_rows)):
        short, long = ops._config(63, cpu), ops._config(64, cpu)
        assert (short.block_n, short.num_warps, long.block_n, long.num_warps) == (16, 4, 32, 2)
        assert ops._streamed(short, 63, cpu) == ops._streamed(short, 63, cpu, True) == (
            short, {})
        assert ops._streamed(long, 64, cpu) == (long, {"HINTS": True})
        bwd, meta = ops._streamed(long, 64, cpu, backward=True)
        assert (bwd.block_n, bwd.num_warps, meta) == (64, 1, {"HINTS": True})
        case = Case("long-causal+sink", (1, 2, 3, 70), causal=True, offset=True)
        scores, mask, offset, grad_out = make_inputs(case, F32)
        check_against_reference(case.id, F32, scores, mask, offset, grad_out, **case.kwargs())


@pytest.mark.parametrize("dtype", [pytest.param(F16, id="fp16"), pytest.param(BF16, id="bf16")])
def test_chunked_half_precision(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    monkeypatch.setattr(ops, "_config", lambda sk, device: CHUNKED)
    case = Case("chunked-causal+sink", (1, 2, 3, 37), causal=True, offset=True)
    scores, mask, offset, grad_out = make_inputs(case, dtype)
    check_against_reference(f"{case.id} {dtype}", dtype, scores, mask, offset, grad_out,
                            **case.kwargs())


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_scores_and_grad(dtype: torch.dtype) -> None:
    base = randn((1, 2, 7, 5), dtype)  # [b, np, sk, sq]; the scores are its transpose
    g_base = randn((1, 2, 5, 14), dtype)
    grad_out = g_base[..., ::2]  # every other column: a strided upstream gradient
    assert not base.transpose(-1, -2).is_contiguous() and not grad_out.is_contiguous()
    results = {}
    for impl in ("triton", "torch"):
        leaf = base.detach().clone().requires_grad_(True)
        scores = leaf.transpose(-1, -2)
        y = lmfuse.fused_softmax(scores, causal=True, scale=0.9, impl=impl)
        y.backward(grad_out)
        results[impl] = (y, leaf.grad)
    assert_close(results["triton"][0], results["torch"][0], dtype, "transposed scores: forward")
    y = results["triton"][0].detach()
    expected = (0.9 * fused_softmax_backward_reference(y, grad_out)).to(dtype)
    assert_close(results["triton"][1], expected.transpose(-1, -2), dtype, "strided grad: d scores")
    contiguous = lmfuse.fused_softmax(base.transpose(-1, -2).contiguous(), causal=True,
                                      scale=0.9, impl="triton")
    assert torch.equal(results["triton"][0], contiguous)


@pytest.mark.parametrize("view", ["strided", "expanded"])
def test_offset_views_read_per_head(view: str) -> None:
    """A softmax_offset given as a strided or expanded view: each head takes its own sink
    (the kernels index a dense [np]) and the gradient reaches the viewed tensor, as on the
    reference path."""
    x = randn((2, 3, 4, 5), scale=2.0)
    dy = randn(x.shape)
    grads = {}
    for impl in ("triton", "torch"):
        base = (torch.tensor([0.5, 9.0, -1.0, 9.0, 2.0, 9.0]) if view == "strided"
                else torch.tensor([1.5])).requires_grad_()
        offset = base[::2] if view == "strided" else base.expand(3)
        xi = x.clone().requires_grad_()
        y = lmfuse.fused_softmax(xi, softmax_offset=offset, impl=impl)
        y.backward(dy)
        grads[impl] = (y, xi.grad, base.grad)
    for got, want, what in zip(grads["triton"], grads["torch"], ("y", "dx", "d offset")):
        assert_close(got, want, F32, f"{view} offset: {what}")
    if view == "strided":
        assert torch.equal(grads["triton"][2][1::2], torch.zeros(3))  # the skipped elements


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_empty_batch(impl: str) -> None:
    x = randn((0, 2, 3, 5), requires_grad=True)
    offset = randn((2,), requires_grad=True)
    mask = rand_bool((0, 1, 3, 5))
    y = lmfuse.fused_softmax(x, mask=mask, causal=True, softmax_offset=offset, impl=impl)
    assert y.shape == (0, 2, 3, 5) and y.dtype == x.dtype
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(offset.grad, torch.zeros(2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_offset", [False, True], ids=["no-sink", "sink"])
def test_fully_masked_rows_zero_output_zero_grad(dtype: torch.dtype, with_offset: bool) -> None:
    x = randn((2, 2, 3, 6), dtype, scale=4.0, requires_grad=True)
    mask = torch.zeros(2, 1, 3, 6, dtype=torch.bool)
    mask[0, :, 1, :] = True
    mask[1, :, :, :] = True  # a whole batch with nothing visible
    offset = randn((2,), dtype, requires_grad=True) if with_offset else None
    y = lmfuse.fused_softmax(x, mask=mask, softmax_offset=offset, impl="triton")
    y.backward(randn(y.shape, dtype))
    assert not torch.isnan(y).any() and not torch.isnan(x.grad).any()
    dead = mask.expand_as(y)
    assert torch.equal(y[dead], torch.zeros(int(dead.sum()), dtype=dtype))
    assert torch.equal(x.grad[dead], torch.zeros(int(dead.sum()), dtype=dtype))
    assert (y[0, :, 0].float().sum(-1) > 0.1).all(), "a row with visible keys lost its mass"
    if offset is not None:
        assert torch.isfinite(offset.grad).all()


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_additive_neg_inf_row_gives_zeros(impl: str) -> None:
    x = randn((1, 1, 3, 5), requires_grad=True)
    mask = torch.zeros(1, 1, 3, 5)
    mask[..., 1, :] = float("-inf")
    y = lmfuse.fused_softmax(x, mask=mask, impl=impl)
    y.backward(randn(y.shape))
    assert torch.equal(y[..., 1, :], torch.zeros(1, 1, 5))
    assert torch.isfinite(x.grad).all()
    assert torch.allclose(y[..., 0, :], torch.softmax(x[..., 0, :].detach(), -1), rtol=1e-5,
                          atol=1e-7)


def test_softmax_in_fp32_flag_does_not_change_result() -> None:
    x = randn((1, 2, 3, 6), F16)
    a = lmfuse.fused_softmax(x, causal=True, softmax_in_fp32=True, impl="triton")
    b = lmfuse.fused_softmax(x, causal=True, softmax_in_fp32=False, impl="triton")
    assert torch.equal(a, b)


def test_auto_runs_triton_here() -> None:
    x = randn((1, 2, 3, 6))
    assert lmfuse.explain(lmfuse.fused_softmax, x).impl == "triton"
    a = lmfuse.fused_softmax(x, causal=True)
    b = lmfuse.fused_softmax(x, causal=True, impl="triton")
    assert torch.equal(a, b)


# --- float64 ----------------------------------------------------------------------------


@pytest.mark.parametrize("case", [
    Case("plain", (1, 2, 3, 7), scale=0.7),
    Case("causal+sink", (1, 2, 3, 7), causal=True, offset=True),
    Case("window+bool+sink", (2, 2, 3, 7), window=(2, 1), mask=("bool", "b1qk"), offset=True),
    Case("additive-const", (1, 2, 3, 7), mask=("additive", "b11k")),
], ids=lambda c: c.id)
def test_float64_matches_reference(case: Case) -> None:
    scores, mask, offset, grad_out = make_inputs(case, F64)
    check_against_reference(f"{case.id} float64", F64, scores, mask, offset, grad_out,
                            **case.kwargs())


@pytest.mark.parametrize("causal, window", [pytest.param(True, None, id="causal"),
                                            pytest.param(False, (1, 2), id="window(1,2)")])
def test_gradcheck_triton_float64(causal: bool, window) -> None:
    x = randn((1, 2, 3, 5), F64, requires_grad=True)
    mask = randn((1, 1, 3, 5), F64, requires_grad=True)
    offset = randn((2,), F64, requires_grad=True)

    def f(x, mask, offset):
        return lmfuse.fused_softmax(x, scale=0.8, mask=mask, causal=causal, window_size=window,
                                    softmax_offset=offset, impl="triton")

    assert torch.autograd.gradcheck(f, (x, mask, offset))


# --- bad input ------------------------------------------------------------------------


BAD_INPUTS = [
    pytest.param(lambda: dict(scores=randn((2, 3, 4))), ValueError, r"scores must be 4-D",
                 id="scores-3d"),
    pytest.param(lambda: dict(scores=torch.ones(1, 1, 2, 3, dtype=torch.int32)), TypeError,
                 r"scores must have dtype", id="scores-int"),
    pytest.param(lambda: dict(scores=[[[[1.0]]]]), TypeError, r"scores must be a torch.Tensor",
                 id="scores-list"),
    pytest.param(lambda: dict(mask=rand_bool((1, 1, 3, 5))), ValueError,
                 r"mask of shape \(1, 1, 3, 5\) is not broadcastable", id="mask-wrong-sk"),
    pytest.param(lambda: dict(mask=rand_bool((3, 1, 3, 4))), ValueError,
                 r"mask of shape \(3, 1, 3, 4\) is not broadcastable", id="mask-wrong-b"),
    pytest.param(lambda: dict(mask=rand_bool((1, 2, 2, 3, 4))), ValueError,
                 r"mask of shape .* is not broadcastable", id="mask-5d"),
    pytest.param(lambda: dict(mask=torch.ones(1, 1, 3, 4, dtype=torch.int64)), TypeError,
                 r"mask must be bool .* got torch.int64", id="mask-int"),
    pytest.param(lambda: dict(mask=torch.ones(1, 1, 3, 4, dtype=torch.uint8)), TypeError,
                 r"mask must be bool .* got torch.uint8", id="mask-uint8"),
    pytest.param(lambda: dict(softmax_offset=randn((3,))), ValueError,
                 r"softmax_offset must have shape \[np\] = \[2\], got \(3,\)", id="sink-length"),
    pytest.param(lambda: dict(softmax_offset=randn((1, 2))), ValueError,
                 r"softmax_offset must have shape", id="sink-2d"),
    pytest.param(lambda: dict(softmax_offset=torch.ones(2, dtype=torch.int64)), TypeError,
                 r"softmax_offset must have dtype", id="sink-int"),
    pytest.param(lambda: dict(scores=randn((2, 2, 5, 4)), causal=True), ValueError,
                 r"causal=True needs sq <= sk.*sq=5, sk=4", id="causal-sq>sk"),
    pytest.param(lambda: dict(causal=1), TypeError, r"causal must be a bool", id="causal-int"),
    pytest.param(lambda: dict(window_size=-1), ValueError, r"window_size must be >= 0, got -1",
                 id="window-int-neg"),
    pytest.param(lambda: dict(window_size=(-2, 0)), ValueError,
                 r"window_size\[left\] must be >= -1, got -2", id="window-left-neg2"),
    pytest.param(lambda: dict(window_size=(0, -2)), ValueError,
                 r"window_size\[right\] must be >= -1, got -2", id="window-right-neg2"),
    pytest.param(lambda: dict(window_size=2.5), TypeError, r"window_size must be None",
                 id="window-float"),
    pytest.param(lambda: dict(window_size=(1, 2, 3)), TypeError, r"window_size must be None",
                 id="window-3-tuple"),
    pytest.param(lambda: dict(window_size=(1.0, 2)), TypeError,
                 r"window_size\[left\] must be an int", id="window-float-side"),
    pytest.param(lambda: dict(window_size=True), TypeError, r"window_size must be None",
                 id="window-bool"),
    pytest.param(lambda: dict(scale="0.5"), TypeError, r"scale must be a float, got str",
                 id="scale-str"),
    pytest.param(lambda: dict(scale=float("inf")), ValueError, r"scale must be finite",
                 id="scale-inf"),
    pytest.param(lambda: dict(scale=float("nan")), ValueError, r"scale must be finite",
                 id="scale-nan"),
    pytest.param(lambda: dict(scores=randn((2, 2, 3, 4), F64), scale=1e39), ValueError,
                 r"scale must be within float32's range \(\|scale\| <= 3.403e\+38\), "
                 r"got 1e\+39", id="scale-past-float32"),
    pytest.param(lambda: dict(softmax_in_fp32=None), TypeError, r"softmax_in_fp32 must be a bool",
                 id="fp32-flag-none"),
    pytest.param(lambda: dict(impl="cuda"), ValueError, r"impl must be one of", id="impl-bad"),
]


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("make, error, message", BAD_INPUTS)
def test_bad_input_raises(make, error: type[Exception], message: str, impl: str) -> None:
    kwargs = dict(scores=randn((2, 2, 3, 4)), impl=impl)
    kwargs.update(make())
    scores = kwargs.pop("scores")
    with pytest.raises(error, match=rf"^fused_softmax: {message}"):
        lmfuse.fused_softmax(scores, **kwargs)
    with pytest.raises(error, match=rf"^fused_softmax: {message}"):
        lmfuse.explain(lmfuse.fused_softmax, scores, **kwargs)


def test_a_right_bound_past_int32_is_no_bound() -> None:
    """``window_size=(1, 2**31 - 1)`` ("one key back, any number forward", a common
    sentinel): the kernels' band math is 32-bit, where ``p + right + 1`` wrapped negative
    and emptied every row; bounds past any key now mean no bound."""
    x = randn((1, 2, 4, 6))
    for right in (2**30 + 1, 2**31 - 1, 2**40):
        want = lmfuse.fused_softmax(x, window_size=(1, -1), impl="torch")
        for impl in ("triton", "torch"):
            got = lmfuse.fused_softmax(x, window_size=(1, right), impl=impl)
            assert_close(got, want, F32, f"{impl} right={right}")


def test_float64_additive_mask_keeps_the_scores_dtype_on_every_path(monkeypatch) -> None:
    """float32 scores with a float64 additive mask (a bias built in float64): float32
    out on every path, as the reference's float32 math gives (the default CPU path
    promoted its sum to float64); with the mask learnable too, its gradient float64."""
    from lmfuse._dispatch import select_impl
    from lmfuse.softmax import ops as sm_ops

    monkeypatch.setattr(sm_ops, "select_impl", lambda op, impl, device: (
        ("torch", "test: no Triton") if impl == "auto" else select_impl(op, impl, device)))
    x = randn((2, 3, 4, 5))
    mask = torch.randn(1, 3, 4, 5, dtype=F64)
    want = lmfuse.fused_softmax(x, mask=mask.float(), impl="torch")
    for impl in ("auto", "triton", "torch"):
        m = mask.clone().requires_grad_()
        y = lmfuse.fused_softmax(x, mask=m, impl=impl)
        assert y.dtype == F32, impl
        assert_close(y, want, F32, impl)
        y.sum().backward()
        assert m.grad.dtype == F64, impl


def test_float64_learnable_mask_gradients_stay_float64() -> None:
    """float64 scores and a learnable float64 mask: the Triton backward's unscaled
    gradient buffer (the mask's) was float32, so both gradients were float32-accurate."""
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 3, 4, 33, dtype=F64, generator=g)
    m0 = torch.randn(1, 3, 4, 33, dtype=F64, generator=g)
    dy = torch.randn(2, 3, 4, 33, dtype=F64, generator=g)
    grads = {}
    for impl in ("triton", "torch"):
        x, m = x0.clone().requires_grad_(), m0.clone().requires_grad_()
        lmfuse.fused_softmax(x, mask=m, scale=0.7, impl=impl).backward(dy)
        grads[impl] = x.grad, m.grad
    for a, b in zip(grads["triton"], grads["torch"]):
        assert a.dtype == F64 and (a - b).abs().max() < 1e-14


# --- properties -----------------------------------------------------------------------


@st.composite
def problems(draw: st.DrawFn) -> dict[str, Any]:
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    sq, sk = draw(st.integers(1, 6)), draw(st.integers(1, 40))
    causal = draw(st.booleans()) if sq <= sk else False
    window = draw(st.one_of(st.none(), st.integers(0, 8),
                            st.tuples(st.integers(-1, 8), st.integers(-1, 8))))
    mask_kind = draw(st.sampled_from([None, "bool", "additive", "learned"]))
    mask_key = draw(st.sampled_from(sorted(MASK_SHAPES)))
    return dict(shape=(b, h, sq, sk), causal=causal, window=window,
                mask=None if mask_kind is None else (mask_kind, mask_key),
                offset=draw(st.booleans()), scale=draw(st.sampled_from([None, 0.5, 2.0])),
                seed=draw(st.integers(0, 2**31 - 1)))


@given(problem=problems(),
       config=st.sampled_from([None, CHUNKED, CHUNKED_TILE4, TILE4]))
def test_property_triton_matches_reference(problem: dict[str, Any], config) -> None:
    torch.manual_seed(problem.pop("seed"))
    case = Case("hypothesis", **problem)
    scores, mask, offset, grad_out = make_inputs(case, F32)
    with pytest.MonkeyPatch.context() as mp:
        if config is not None:
            mp.setattr(ops, "_config", lambda sk, device: config)
        check_against_reference(f"{problem} config={config}", F32, scores, mask, offset,
                                grad_out, **case.kwargs())


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(5, 0)),
                                dict(mask="bool"), dict(mask="additive"), dict()])
@pytest.mark.parametrize("poison", [None, "nan", "inf", "all_minus_inf"])
def test_default_cpu_path_is_torch_softmax_with_the_reference_results(monkeypatch, kw,
                                                                      poison) -> None:
    """On CPU float32 scores without Triton (what a CPU machine without the interpreter
    picks) the default path is ``torch.softmax`` of the masked, scaled scores; rows that
    come out NaN there go through the reference (NaN rows as torch.softmax's, rows of
    nothing visible zeros): the reference's outputs and gradients either way."""
    from lmfuse._dispatch import select_impl
    from lmfuse.softmax import ops as sm_ops

    monkeypatch.setattr(sm_ops, "select_impl", lambda op, impl, device: (
        ("torch", "test: no Triton") if impl == "auto" else select_impl(op, impl, device)))
    calls = []
    real = sm_ops._native_cpu
    monkeypatch.setattr(sm_ops, "_native_cpu", lambda *a: (calls.append(1), real(*a))[1])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 9, 13, generator=g) * 3
    if poison == "nan":  # (not in column 0: the path's NaN check reads only that column)
        x[0, 1, 4, 6] = float("nan")
    elif poison == "inf":
        x[1, 0, 7, 11] = float("inf")
    elif poison == "all_minus_inf":
        x[1, 2, 8] = float("-inf")
    kw = dict(kw)
    if kw.get("mask") == "bool":
        kw["mask"] = torch.rand(2, 1, 9, 13, generator=g) < 0.3
    elif kw.get("mask") == "additive":
        kw["mask"] = torch.randn(1, 1, 9, 13, generator=g)
    dy = torch.randn(2, 3, 9, 13, generator=g)
    out = {}
    for impl in ("auto", "torch"):
        xi = x.clone().requires_grad_(True)
        y = lmfuse.fused_softmax(xi, scale=0.7, impl=impl, **kw)
        (gx,) = torch.autograd.grad(y, xi, dy)
        out[impl] = (y, gx)
    assert calls  # the auto call took the native path (or tried it first)
    for got, want in zip(out["auto"], out["torch"]):
        assert torch.equal(got.isnan(), want.isnan())
        fin = ~want.isnan()
        assert torch.allclose(got[fin], want[fin], rtol=1e-5, atol=1e-7)
