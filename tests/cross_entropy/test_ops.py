"""``lmfuse.cross_entropy``: the Triton path (under the interpreter) and the torch path
against the float64 reference.

Every case runs forward and backward from the same inputs and compares, with
``cross_entropy_reference`` on ``logits.double()`` as the oracle:

* the loss (always float32, whatever the logits' dtype) within float32's tolerance: both
  paths reduce in float32 from the logits as stored;
* the gradient, in the logits' dtype, against the float64 gradient rounded to that dtype,
  within that dtype's tolerance (the kernels write it rounded once; the fused path rounds
  it a second time when it rescales by an upstream gradient other than 1);
* ignored tokens' gradient rows exactly 0.

Pass structures (see ``ops.py``): *fused* (Triton, ``mean``/``sum``, gradient needed: the
forward kernel writes the gradient, backward rescales it in place with ``ce_scale_``),
*deferred* (``reduction="none"`` or the torch path: gradient computed in backward) and
*stats only* (no gradient needed).

Inputs are made on the CPU (seeded, so the same values on every device); the op runs on
``helpers.TEST_DEVICE`` (CUDA under ``LMFUSE_GPU_TESTS=1``, the kernels compiled:
``LMFUSE_GPU_TESTS=1 python -m pytest tests/cross_entropy/test_ops.py``) and its results
come back to the CPU, where the float64 oracle runs. The tests of the CPU's own default
path stay on the CPU.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import TEST_DEVICE as DEVICE
from helpers import assert_close, ce_config, randn, value_checks_on
from hypothesis import given
from hypothesis import strategies as st

import lmfuse
from lmfuse._dispatch import select_impl as _select_impl
from lmfuse.cross_entropy import ops
from lmfuse.cross_entropy.reference import cross_entropy_reference

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
DTYPES = [pytest.param(d, id=str(d).replace("torch.", "")) for d in (F32, F16, BF16)]
IMPLS = ["triton", "torch"]
REDUCTIONS = ("mean", "sum", "none")
IGNORE = -100

# Launch configurations forced through ops._config, for paths the default table takes
# only at large V (streamed chunks) or never at these small shapes (several rows a tile).
CHUNKED = dict(BLOCK_M=1, BLOCK_V=16, SINGLE_BLOCK=False, num_warps=4)
CHUNKED_TILE4 = dict(BLOCK_M=4, BLOCK_V=16, SINGLE_BLOCK=False, num_warps=4)
TILE4 = dict(BLOCK_M=4, BLOCK_V=64, SINGLE_BLOCK=True, num_warps=4)  # V <= 64 only
# The fused pass of streamed rows cut in 32-column slices (ce_slices_kernel), where the
# source has it; elsewhere the "fused" entry is not read and this is CHUNKED.
SLICED = dict(CHUNKED, fused=dict(BLOCK_V=16, num_warps=4, programs_per_sm=2, slice=32, lag=1))
# Both fused passes with the L2 eviction hints on (no-ops in the interpreter, but traced).
SLICED_HINTS = dict(CHUNKED, fused=dict(BLOCK_V=16, num_warps=4, programs_per_sm=2, slice=32,
                                        lag=2, hints=1))
STREAM_HINTS = dict(CHUNKED, fused=dict(BLOCK_V=16, num_warps=4, programs_per_sm=2, hints=1))
# The barrier-free stats loop over [BLOCK_V // vec, vec] tiles, with and without the
# next chunk's prefetch (the big-row fused launch of the GPU tables).
STREAM_VEC = dict(CHUNKED, fused=dict(BLOCK_V=16, num_warps=4, programs_per_sm=1, hints=1,
                                      vec=8, prefetch=1))
STREAM_VEC_NO_PREFETCH = dict(CHUNKED, fused=dict(BLOCK_V=32, num_warps=2, programs_per_sm=2,
                                                  vec=4))


def forced(config: dict[str, Any]) -> Any:
    """An ``ops._config`` stand-in that returns ``config`` whatever the row."""
    forced = ce_config(config)
    return lambda V, device, softcap=False, itemsize=2, aligned=True: forced


def make_target(shape: tuple[int, ...], V: int, dtype: torch.dtype = torch.int64,
                every: int = 4) -> torch.Tensor:
    """Random class ids, every ``every``-th token ignored (none when ``every`` is 0)."""
    t = torch.randint(0, V, shape, dtype=torch.int64)
    if every and t.numel():
        t.view(-1)[1::every] = IGNORE
    return t.to(dtype)


def upstream(reduction: str, target: torch.Tensor) -> torch.Tensor:
    """The gradient fed to ``loss.backward``, never 1: 3.5 for a scalar loss (a scaled
    loss), random per-token weights of ``target``'s shape for ``reduction="none"``."""
    return randn(target.shape) if reduction == "none" else torch.tensor(3.5)


def ce_options(kw: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments the reference takes (no tp_group / inplace / impl)."""
    keep = ("ignore_index", "label_smoothing", "z_loss", "softcap", "reduction")
    return {k: v for k, v in kw.items() if k in keep}


def run(impl: str, logits: torch.Tensor, target: torch.Tensor, grad_out: torch.Tensor | None,
        **kw: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Loss and gradient (on the CPU) and the tensor passed as logits (on the test device),
    on a fresh copy of ``logits`` on the test device.

    With ``inplace_backward`` the logits passed are a non-leaf (``leaf * 1``): the op
    overwrites them with the gradient, which must not destroy a leaf's values.
    """
    leaf = logits.detach().to(DEVICE).clone().requires_grad_(True)
    x = leaf * 1 if kw.get("inplace_backward") else leaf
    loss = lmfuse.cross_entropy(x, target.to(DEVICE), impl=impl, **kw)
    if grad_out is not None:
        loss.backward(grad_out.to(DEVICE))
    return loss.detach().cpu(), None if leaf.grad is None else leaf.grad.cpu(), x


def expected(logits: torch.Tensor, target: torch.Tensor, grad_out: torch.Tensor | None,
             **kw: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The float64 reference loss and gradient for the logits as stored."""
    x = logits.detach().double().requires_grad_(True)
    loss = cross_entropy_reference(x, target, **ce_options(kw))
    if grad_out is None:
        return loss.detach(), None
    (dx,) = torch.autograd.grad(loss, x, grad_out.double())
    return loss.detach(), dx


def check(what: str, impl: str, logits: torch.Tensor, target: torch.Tensor,
          grad_out: torch.Tensor | None, **kw: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run one case on ``impl`` and compare loss and gradient with the float64 reference."""
    dtype = logits.dtype
    loss, dx, _ = run(impl, logits, target, grad_out, **kw)
    loss_ref, dx_ref = expected(logits, target, grad_out, **kw)
    assert loss.dtype == F32, f"{what}: loss dtype {loss.dtype}"
    assert_close(loss, loss_ref.float(), F32, f"{what}: loss")
    if grad_out is None:
        return loss, None
    assert dx is not None and dx.dtype == dtype, f"{what}: gradient {dx}"
    assert_close(dx, dx_ref.to(dtype), dtype, f"{what}: d logits")
    ignored = target == kw.get("ignore_index", IGNORE)
    assert torch.equal(dx[ignored], torch.zeros_like(dx[ignored])), f"{what}: ignored rows"
    return loss, dx


def passes(logits: torch.Tensor, target: torch.Tensor, **kw: Any) -> str:
    """The first word of ``explain``'s pass structure (fused, deferred or stats) for these
    tensors on the test device."""
    plan = lmfuse.explain(lmfuse.cross_entropy, logits.to(DEVICE), target.to(DEVICE), **kw)
    return plan.details["passes"].split()[0].rstrip(":")


# --- every option, every dtype ----------------------------------------------------------


COMBOS = [
    pytest.param(red, ls, z, cap, inplace,
                 id=f"{red}-ls{ls}-z{z}-cap{cap}" + ("-inplace" if inplace else ""))
    for red, ls, z, cap, inplace in itertools.product(REDUCTIONS, (0.0, 0.1), (0.0, 0.01),
                                                      (None, 4.0), (False, True))
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction, label_smoothing, z_loss, softcap, inplace", COMBOS)
def test_every_option_combination(impl: str, dtype: torch.dtype, reduction: str,
                                  label_smoothing: float, z_loss: float, softcap: float | None,
                                  inplace: bool) -> None:
    """[2, 3, 37] logits, some tokens ignored, upstream gradient 3.5 or per-token weights."""
    logits = randn((2, 3, 37), dtype, scale=3.0)
    target = make_target((2, 3), 37)
    kw = dict(reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss,
              softcap=softcap, inplace_backward=inplace)
    grad_out = upstream(reduction, target)
    fused = impl == "triton" and reduction != "none" and dtype != torch.float16
    expect = "fused" if fused else "deferred"  # float16: gradients in backward
    assert passes(logits.requires_grad_(True), target, impl=impl, **kw) == expect
    check(f"{impl} {dtype} {kw}", impl, logits.detach(), target, grad_out, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
def test_upstream_gradient_one(impl: str, dtype: torch.dtype, reduction: str,
                               inplace: bool) -> None:
    """The usual ``loss.backward()``: the fused path's rescale must leave the gradient as is."""
    logits = randn((5, 37), dtype, scale=2.0)
    target = make_target((5,), 37)
    kw = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-3, softcap=10.0,
              inplace_backward=inplace)
    check(f"{impl} {dtype} upstream 1 {kw}", impl, logits, target, torch.ones(()), **kw)


# --- shapes -----------------------------------------------------------------------------


# Every small V with every leading shape and both target dtypes; the wide rows (V = 1000,
# 4097) with 2-D logits only, since the leading dims are flattened before any kernel.
SHAPES = [
    pytest.param(V, lead, tdt, id=f"V{V}-{len(lead) + 1}d-{str(tdt)[6:]}")
    for V, lead, tdt in [
        *itertools.product((1, 2, 3, 37), ((), (5,), (2, 3)), (torch.int32, torch.int64)),
        *itertools.product((1000, 4097), ((3,),), (torch.int32, torch.int64)),
    ]
]


@pytest.mark.parametrize("V, lead, target_dtype", SHAPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_shapes(impl: str, V: int, lead: tuple[int, ...], target_dtype: torch.dtype) -> None:
    """Odd V, [V] (0-d target) / [N, V] / [B, S, V] logits, int32 and int64 targets."""
    target = make_target(lead, V, target_dtype, every=4 if lead else 0)
    for dtype, reduction in itertools.product((F32, F16, BF16), ("mean", "none")):
        logits = randn((*lead, V), dtype, scale=2.0)
        grad_out = upstream(reduction, target)
        loss, _ = check(f"{impl} V={V} lead={lead} {target_dtype} {dtype} {reduction}", impl,
                        logits, target, grad_out, reduction=reduction, z_loss=0.01,
                        label_smoothing=0.1)
        assert loss.shape == (target.shape if reduction == "none" else ())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype, reduction", [pytest.param(F32, "mean", id="float32-mean"),
                                              pytest.param(BF16, "none", id="bf16-none")])
def test_long_rows_default_streamed_kernel(impl: str, dtype: torch.dtype, reduction: str) -> None:
    """V past the default single-block limit: the streamed (chunked) kernels, unforced."""
    V = 40000
    tiles = ops._config(V, DEVICE).tiles
    assert not tiles.single and tiles.block_n < V
    logits = randn((3, V), dtype, scale=2.0)
    target = torch.tensor([V - 1, IGNORE, 12345])
    grad_out = upstream(reduction, target)
    check(f"{impl} V={V} {dtype} {reduction}", impl, logits, target, grad_out,
          reduction=reduction, label_smoothing=0.1, z_loss=1e-3, softcap=20.0)
    if impl == "triton":
        plan = lmfuse.explain(lmfuse.cross_entropy, logits.to(DEVICE), target.to(DEVICE),
                              impl=impl)
        assert plan.details["kernel"].startswith("streamed"), plan.details


# --- forced launch configurations -------------------------------------------------------


class KernelSpy:
    """Stands in for ``ops._kernels()``: records each launch's grid and constexprs."""

    def __init__(self, real: Any) -> None:
        self.real, self.launches = real, []

    def __getattr__(self, name: str) -> Any:
        kernel, launches = getattr(self.real, name), self.launches

        class Grid:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    meta = {k: v for k, v in kwargs.items() if k.isupper() or k == "num_warps"}
                    launches.append((name, tuple(grid), meta))
                    return kernel[grid](*args, **kwargs)

                return launch

        return Grid()


FORCED_CASES = [  # (N, V): row counts not a multiple of 4; tail chunks of 5, 2, 16 and 1
    pytest.param(7, 37, id="N7-V37"),
    pytest.param(11, 50, id="N11-V50"),
    pytest.param(3, 64, id="N3-V64-exact"),
    pytest.param(9, 1, id="N9-V1"),
]
FORCED_OPTIONS = [
    pytest.param(dict(reduction="mean"), id="mean"),
    pytest.param(dict(reduction="sum", label_smoothing=0.2, z_loss=0.01, softcap=3.0,
                      inplace_backward=True), id="sum-ls-z-cap-inplace"),
    pytest.param(dict(reduction="none", z_loss=0.01, softcap=3.0), id="none-z-cap"),
    pytest.param(dict(reduction="none", label_smoothing=0.1, inplace_backward=True),
                 id="none-ls-inplace"),
]
CONFIGS = [pytest.param(CHUNKED, id="chunked-M1"),
           pytest.param(CHUNKED_TILE4, id="chunked-M4"),
           pytest.param(TILE4, id="tile-M4"),
           pytest.param(SLICED, id="sliced"),
           pytest.param(SLICED_HINTS, id="sliced-hints"),
           pytest.param(STREAM_HINTS, id="stream-hints"),
           pytest.param(STREAM_VEC, id="stream-vec-prefetch"),
           pytest.param(STREAM_VEC_NO_PREFETCH, id="stream-vec")]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("options", FORCED_OPTIONS)
@pytest.mark.parametrize("N, V", FORCED_CASES)
def test_forced_launch_configs(monkeypatch: pytest.MonkeyPatch, N: int, V: int,
                               options: dict[str, Any], config: dict[str, Any]) -> None:
    """The streamed chunk loops and multi-row tiles (tail tile: N % 4 != 0), and that the
    forced configuration is the one launched: one row kernel then ``ce_scale_kernel`` on
    the fused path, two row kernels (stats, gradient) on the deferred one, each with the
    forced column block (and row block, for single-block tiles)."""
    monkeypatch.setattr(ops, "_config", forced(config))
    spy = KernelSpy(ops._kernels())
    monkeypatch.setattr(ops, "_kernels", lambda: spy)
    if V == 1:  # one class: the exact gradient is 2 z lse, identically 0 without z-loss,
        options = dict(options, z_loss=0.05)  # where float32 leaves ~1e-8 of rounding
    logits = randn((N, V), F32, scale=3.0)
    target = make_target((N,), V, every=3)
    grad_out = upstream(options["reduction"], target)
    check(f"N={N} V={V} {options} {config}", "triton", logits, target, grad_out, **options)

    fused = options["reduction"] != "none"
    names = [name for name, _, _ in spy.launches]
    rows = [(name, meta) for name, _, meta in spy.launches if name != "ce_scale_kernel"]
    assert len(rows) == (1 if fused else 2), names
    assert ("ce_scale_kernel" in names) is fused, names
    for i, (name, meta) in enumerate(rows):
        cfg = dict(config, **config["fused"]) if fused and "fused" in config else config
        assert meta["BLOCK_V"] == cfg["BLOCK_V"], (name, meta, config)
        if config["SINGLE_BLOCK"] and "BLOCK_M" in meta:
            assert meta["BLOCK_M"] == config["BLOCK_M"], (name, meta, config)
        if i == 0:
            assert meta["num_warps"] == cfg["num_warps"], (name, meta, config)
            assert meta.get("WRITE_GRAD", fused) is fused, (name, meta)
    if fused and "vec" in config.get("fused", {}):  # the tile shape and prefetch asked for
        f = config["fused"]
        assert rows[0][0] == "ce_stream_kernel", names
        assert (rows[0][1]["VEC"], rows[0][1]["PREFETCH"]) == (f["vec"], bool(
            f.get("prefetch", 0))), rows[0]
    if fused and "slice" in config.get("fused", {}) and hasattr(ops._kernels(),
                                                                "ce_slices_kernel"):
        assert rows[0][0] == "ce_slices_kernel", names
    plan = lmfuse.explain(lmfuse.cross_entropy, logits.to(DEVICE), target.to(DEVICE),
                          impl="triton")
    assert plan.details["kernel"].startswith("streamed" if not config["SINGLE_BLOCK"] else "4 row")


@pytest.mark.parametrize("options", [FORCED_OPTIONS[0], FORCED_OPTIONS[2]])
def test_stats_pass_pipelined_chunk_loop(monkeypatch: pytest.MonkeyPatch,
                                         options: dict[str, Any]) -> None:
    """The table's ``chunk_stages`` reaches the stats-only pass (the deferred path's first
    launch, ``reduction="none"``; the forward without a gradient) as ``STAGES``, with the
    reference's values; the fused pass and a table without it pass none, so those kernels
    keep Triton's default loop."""
    staged = replace(ce_config(STREAM_HINTS), stages=3)
    monkeypatch.setattr(ops, "_config", lambda V, device, softcap=False, itemsize=2,
                        aligned=True: staged)
    spy = KernelSpy(ops._kernels())
    monkeypatch.setattr(ops, "_kernels", lambda: spy)
    logits = randn((11, 50), F32, scale=3.0)
    target = make_target((11,), 50, every=3)
    grad_out = upstream(options["reduction"], target)
    check(f"{options} stages 3", "triton", logits, target, grad_out, **options)
    rows = [(name, meta) for name, _, meta in spy.launches if name != "ce_scale_kernel"]
    if options["reduction"] != "none":  # one launch: the fused pass, not pipelined
        assert len(rows) == 1 and "STAGES" not in rows[0][1], rows
    else:  # the stats-only pass at chunk_stages, then the gradient kernel
        assert rows[0][0] == "ce_stream_kernel" and rows[0][1]["STAGES"] == 3, rows
        assert "STAGES" not in rows[1][1], rows
    spy.launches.clear()
    with torch.no_grad():
        lmfuse.cross_entropy(logits.to(DEVICE), target.to(DEVICE), impl="triton")
    assert [meta.get("STAGES") for _, _, meta in spy.launches] == [3], spy.launches
    spy.launches.clear()
    monkeypatch.setattr(ops, "_config", forced(STREAM_HINTS))
    with torch.no_grad():
        lmfuse.cross_entropy(logits.to(DEVICE), target.to(DEVICE), impl="triton")
    assert all("STAGES" not in meta for _, _, meta in spy.launches), spy.launches


# A table whose fused list has a whole-row (vec) entry, its fallback for unaligned rows of
# the same bucket, and slices for longer rows.
VEC_TABLE = dict(max_single_block=16, tile_elems=64, warps_by_block=[[16, 1]], chunk_block=16,
                 chunk_warps=1, programs_per_sm=2, fused=[
                     [64, dict(BLOCK_V=32, num_warps=1, programs_per_sm=1, vec=8, prefetch=1)],
                     [64, dict(BLOCK_V=16, num_warps=2, programs_per_sm=4)],
                     [1 << 40, dict(BLOCK_V=16, num_warps=4, programs_per_sm=2, slice=32,
                                    lag=1)]])


def test_fused_launch_by_row_bytes_and_alignment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fused buckets count a row in 2-byte elements; a vec entry applies to aligned rows
    only (else the next entry that fits) and halves its BLOCK_V for float32."""
    monkeypatch.setattr(ops.tuning, "table", lambda family, device: VEC_TABLE)
    cpu = torch.device("cpu")

    def fused(V: int, itemsize: int, aligned: bool) -> ops.StreamLaunch:
        return ops._config(V, cpu, False, itemsize, aligned).fused

    entries = [ops.StreamLaunch.of(e) for _, e in VEC_TABLE["fused"]]
    assert fused(48, 2, True) == entries[0]
    assert fused(48, 2, False) == entries[1]
    assert fused(32, 4, True) == replace(entries[0], block_v=16)  # 64 bytes / 2
    assert fused(48, 4, True) == entries[2]  # 96 "2-byte columns": slices
    assert VEC_TABLE["fused"][0][1]["BLOCK_V"] == 32  # the table itself is not modified


@pytest.mark.parametrize("V, vec", [pytest.param(48, 8, id="aligned-V48"),
                                    pytest.param(40, 0, id="unaligned-V40")])
def test_fused_launch_alignment_end_to_end(monkeypatch: pytest.MonkeyPatch, V: int,
                                           vec: int) -> None:
    """Through ``cross_entropy``: 16-column-multiple rows get the whole-row launch with
    its barrier-free stats loop, other rows the table's fallback; both exact."""
    monkeypatch.setattr(ops.tuning, "table", lambda family, device: VEC_TABLE)
    spy = KernelSpy(ops._kernels())
    monkeypatch.setattr(ops, "_kernels", lambda: spy)
    logits = randn((6, V), BF16, scale=3.0)
    target = make_target((6,), V, every=3)
    check(f"V={V}", "triton", logits, target, torch.tensor(2.0), reduction="mean")
    (name, _, meta), = [launch for launch in spy.launches if launch[0] != "ce_scale_kernel"]
    assert name == "ce_stream_kernel" and meta["VEC"] == vec, (name, meta)
    assert meta["BLOCK_V"] == (32 if vec else 16) and meta["PREFETCH"] is bool(vec), meta
    text = lmfuse.explain(lmfuse.cross_entropy, logits.to(DEVICE).requires_grad_(),
                          target.to(DEVICE)).details["kernel"]
    assert ("a row per program" in text) is bool(vec), text


@pytest.mark.parametrize("view", [
    pytest.param(lambda x: x[:, :48], id="prefix-of-64-column-rows"),
    pytest.param(lambda x: x[:, 16:], id="aligned-offset"),
    pytest.param(lambda x: x[:, 1:49], id="misaligned-address"),
    pytest.param(lambda x: x.reshape(-1)[:6 * 56].view(6, 56)[:, :48], id="stride-56"),
])
def test_fused_launch_alignment_of_views(monkeypatch: pytest.MonkeyPatch, view: Any) -> None:
    """48-column rows that are views into wider storage: 16-element strides and a 16-byte
    aligned start get the whole-row launch, others not (exact either way, and ``explain``
    says what is launched)."""
    monkeypatch.setattr(ops.tuning, "table", lambda family, device: VEC_TABLE)
    spy = KernelSpy(ops._kernels())
    monkeypatch.setattr(ops, "_kernels", lambda: spy)
    base = randn((6, 64), BF16, scale=3.0).to(DEVICE).requires_grad_(True)
    logits = view(base)
    aligned = logits.data_ptr() % 16 == 0 and logits.stride(0) % 16 == 0
    target = make_target((6,), 48, every=3)
    text = lmfuse.explain(lmfuse.cross_entropy, logits, target.to(DEVICE)).details["kernel"]
    lmfuse.cross_entropy(logits, target.to(DEVICE)).backward()
    (name, _, meta), = [launch for launch in spy.launches if launch[0] != "ce_scale_kernel"]
    assert meta["VEC"] == (8 if aligned else 0), (logits.stride(), logits.data_ptr(), meta)
    assert ("a row per program" in text) is aligned, text
    x = logits.detach().cpu().double().requires_grad_(True)
    F.cross_entropy(x, target, ignore_index=IGNORE).backward()
    assert base.grad is not None
    dx = base.grad.cpu()
    assert_close(view(dx), x.grad.to(BF16), BF16, "gradient through the view")
    assert torch.count_nonzero(dx) == torch.count_nonzero(view(dx)), "outside the view"


def test_fused_override_with_vec_on_unaligned_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller's ``vec`` launch (``linear_cross_entropy``'s kernel config) on rows it does
    not suit runs the plain stats loop at the same geometry; on float32 rows its chunk
    halves, as a table entry's does."""
    monkeypatch.setattr(ops.tuning, "table", lambda family, device: VEC_TABLE)
    spy = KernelSpy(ops._kernels())
    monkeypatch.setattr(ops, "_kernels", lambda: spy)
    f = dict(BLOCK_V=32, num_warps=1, programs_per_sm=1, vec=8, prefetch=1)
    for V, dtype, expect in ((40, BF16, (0, False, 32)), (48, F32, (8, True, 16))):
        spy.launches.clear()
        x = randn((5, V), dtype, scale=3.0)
        t = make_target((5,), V, every=3)
        xd, td = x.to(DEVICE), t.to(DEVICE)
        g = torch.empty_like(xd)
        stats = ops._launch_fwd(xd, td, (td != IGNORE).sum().float(), g, 0, V, IGNORE, 0.0,
                                0.0, None, True, fused=ops.StreamLaunch.of(f))
        (_, _, meta), = spy.launches
        assert (meta["VEC"], meta["PREFETCH"], meta["BLOCK_V"]) == expect, meta
        ref = F.cross_entropy(x.double(), t, ignore_index=IGNORE, reduction="none")
        assert_close(stats[3].cpu() * (t != IGNORE).sum(), ref.float(), F32, f"loss V={V}")


@pytest.mark.parametrize("dtype", [pytest.param(F16, id="fp16"), pytest.param(BF16, id="bf16")])
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_forced_configs_half_precision(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                       config: dict[str, Any], reduction: str) -> None:
    monkeypatch.setattr(ops, "_config", forced(config))
    logits = randn((7, 50), dtype, scale=3.0)
    target = make_target((7,), 50)
    grad_out = upstream(reduction, target)
    check(f"{dtype} {config} {reduction}", "triton", logits, target, grad_out,
          reduction=reduction, label_smoothing=0.1, z_loss=0.01, softcap=5.0)


# --- pass structures --------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_explain_pass_structure(impl: str, reduction: str) -> None:
    logits = randn((4, 9)).to(DEVICE).requires_grad_(True)
    target = make_target((4,), 9).to(DEVICE)
    fused = impl == "triton" and reduction != "none"
    assert passes(logits, target, impl=impl, reduction=reduction) == (
        "fused" if fused else "deferred")
    assert passes(logits.detach(), target, impl=impl, reduction=reduction) == "stats"
    with torch.no_grad():
        assert passes(logits, target, impl=impl, reduction=reduction) == "stats"
    plan = lmfuse.explain(lmfuse.cross_entropy, logits, target, impl=impl)
    assert plan.impl == impl and plan.details["vocabulary"] == "9"


def test_auto_runs_triton_here() -> None:
    """``impl="auto"`` takes Triton on the test device: the interpreter on the CPU, the
    compiled kernels on CUDA."""
    logits = randn((4, 9)).to(DEVICE).requires_grad_(True)
    target = make_target((4,), 9).to(DEVICE)
    assert lmfuse.explain(lmfuse.cross_entropy, logits, target).impl == "triton"
    a = lmfuse.cross_entropy(logits, target)
    b = lmfuse.cross_entropy(logits, target, impl="triton")
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("no_grad", ["no_grad", "requires_grad=False"])
def test_stats_only_without_gradient(impl: str, dtype: torch.dtype, reduction: str,
                                     no_grad: str) -> None:
    logits = randn((2, 3, 37), dtype, scale=2.0)
    target = make_target((2, 3), 37)
    kw = dict(reduction=reduction, label_smoothing=0.1, z_loss=0.01, softcap=6.0)
    x, t = logits.to(DEVICE), target.to(DEVICE)
    if no_grad == "no_grad":
        x.requires_grad_(True)
        with torch.no_grad():
            assert passes(x, t, impl=impl, **kw) == "stats"
            loss = lmfuse.cross_entropy(x, t, impl=impl, **kw)
    else:
        assert passes(x, t, impl=impl, **kw) == "stats"
        loss = lmfuse.cross_entropy(x, t, impl=impl, **kw)
    assert not loss.requires_grad
    loss_ref, _ = expected(logits, target, None, **kw)
    assert_close(loss.cpu(), loss_ref.float(), F32, f"{impl} {dtype} {kw} stats only")


# --- upstream gradients other than 1 ----------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_scaled_loss_backward(impl: str, dtype: torch.dtype, reduction: str) -> None:
    """``(loss * 3.5).backward()``: the fused path rescales its stored gradient in place."""
    logits = randn((6, 37), dtype, scale=2.0)
    target = make_target((6,), 37)
    leaf = logits.to(DEVICE).clone().requires_grad_(True)
    t = target.to(DEVICE)
    (lmfuse.cross_entropy(leaf, t, reduction=reduction, impl=impl) * 3.5).backward()
    _, dx_ref = expected(logits, target, torch.tensor(3.5), reduction=reduction)
    assert_close(leaf.grad.cpu(), dx_ref.to(dtype), dtype,
                 f"{impl} {dtype} {reduction} loss * 3.5")
    # A second loss on the same logits: the gradients accumulate, each scaled on its own.
    (lmfuse.cross_entropy(leaf, t, reduction=reduction, impl=impl) * -0.5).backward()
    _, dx_ref2 = expected(logits, target, torch.tensor(3.0), reduction=reduction)
    assert_close(leaf.grad.cpu(), dx_ref2.to(dtype), dtype,
                 f"{impl} {dtype} {reduction} accumulated")


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_kernel(dtype: torch.dtype) -> None:
    """``ce_scale_`` multiplies in place in float32 and rounds to the gradient's dtype, and
    leaves the gradient bit for bit when the scale is exactly 1.

    (Triton's interpreter rounds float32 to bfloat16 toward zero, not to nearest as the GPU
    does, so there the bf16 result may be 1 ulp off round-to-nearest: within tolerance.)
    """
    before = randn((3, 37), dtype)
    g = before.to(DEVICE).clone()
    torch.ops.lmfuse.ce_scale_(g, torch.ones(1, device=DEVICE))
    assert torch.equal(g.cpu(), before)
    torch.ops.lmfuse.ce_scale_(g, torch.full((1,), 3.5, device=DEVICE))
    want = (before.float() * 3.5).to(dtype)
    if dtype == BF16:
        assert_close(g.cpu(), want, dtype, "ce_scale_ bf16")
    else:
        assert torch.equal(g.cpu(), want)


# --- inplace_backward ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_inplace_backward_overwrites_logits(impl: str, dtype: torch.dtype,
                                            reduction: str) -> None:
    """inplace_backward=True gives the same gradient, bit for bit, written over the logits.

    The logits passed must not be needed again: here they are ``leaf * 1``, a non-leaf
    autograd does not save. On the fused path (Triton, mean/sum) the logits already hold
    the gradient (for an upstream gradient of 1) when the forward returns; the backward
    rescales them in place. On the deferred paths they are intact after the forward and
    overwritten in the backward. Either way, after backward the logits' storage *is* the
    gradient autograd passes on to the leaf.
    """
    logits = randn((2, 3, 37), dtype, scale=2.0)
    target = make_target((2, 3), 37)
    kw = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-3, softcap=8.0)
    grad_out = upstream(reduction, target)
    _, dx_out, _ = run(impl, logits, target, grad_out, **kw)

    leaf = logits.to(DEVICE).clone().requires_grad_(True)
    x = leaf * 1
    loss = lmfuse.cross_entropy(x, target.to(DEVICE), impl=impl, inplace_backward=True, **kw)
    fused = impl == "triton" and reduction != "none" and dtype != torch.float16
    if fused:
        _, dx_one, _ = run(impl, logits, target, torch.ones(()), **kw)
        assert torch.equal(x.detach().cpu(), dx_one), (
            "fused: logits hold the gradient after forward")
    else:
        assert torch.equal(x.detach().cpu(), logits), "deferred: logits intact until backward"
    loss.backward(grad_out.to(DEVICE))
    assert torch.equal(leaf.grad.cpu(), dx_out), (
        f"{impl} {dtype} {reduction}: inplace != out of place")
    assert torch.equal(x.detach(), leaf.grad), "the logits' storage holds the gradient"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_inplace_backward_non_contiguous_logits(impl: str, reduction: str) -> None:
    """Logits the kernels cannot overwrite as they are (a column slice) are copied first:
    the gradient is right and the caller's tensor is left alone."""
    base = randn((4, 40))
    logits = base[:, :37]
    target = make_target((4,), 37)
    grad_out = upstream(reduction, target)
    leaf = base.to(DEVICE).clone().requires_grad_(True)
    x = leaf * 1
    loss = lmfuse.cross_entropy(x[:, :37], target.to(DEVICE), impl=impl, reduction=reduction,
                                inplace_backward=True)
    loss.backward(grad_out.to(DEVICE))
    _, dx_ref = expected(logits, target, grad_out, reduction=reduction)
    dx = leaf.grad.cpu()
    assert_close(dx[:, :37], dx_ref.float(), F32, f"{impl} {reduction} sliced inplace")
    assert torch.equal(dx[:, 37:], torch.zeros(4, 3))


# --- special values and layouts -------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
def test_all_ignored_rows(impl: str, dtype: torch.dtype, reduction: str, inplace: bool) -> None:
    """A batch with every token ignored: mean is exactly 0 (not NaN), gradient exactly 0."""
    logits = randn((3, 37), dtype, scale=2.0)
    target = torch.full((3,), IGNORE)
    grad_out = upstream(reduction, target)
    loss, dx, _ = run(impl, logits, target, grad_out, reduction=reduction, label_smoothing=0.1,
                      z_loss=0.01, inplace_backward=inplace)
    assert torch.equal(loss, torch.zeros(loss.shape)), f"{impl} {reduction}: loss {loss}"
    assert torch.equal(dx, torch.zeros_like(dx)), f"{impl} {reduction}: gradient not 0"


def huge_logits(dtype: torch.dtype, N: int, V: int, target: torch.Tensor,
                ties: bool = False) -> torch.Tensor:
    """Logits of magnitude 1e4 (exp overflows float32 unless the max is subtracted): one
    +1e4 per row (a run of them with ``ties``), several -1e4, the rest N(0, 9). Row 0's
    target is at +1e4 (loss about 0), row 1's at -1e4 (loss about 2e4)."""
    x = randn((N, V), F32, scale=3.0)
    x[:, 1::4] = -1e4
    top = (target.clamp(min=0) + 2) % V
    top[0] = target[0]
    x[torch.arange(N), top] = 1e4
    x[1, target[1]] = -1e4
    if ties:
        x[:, ::3] = 1e4
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("softcap", [None, 30.0], ids=["no-cap", "cap30"])
def test_huge_logits(impl: str, dtype: torch.dtype, reduction: str,
                     softcap: float | None) -> None:
    """+-1e4 logits: finite loss and gradient, equal to the float64 reference."""
    target = make_target((6,), 37)
    target[:2] = torch.tensor([5, 9])
    logits = huge_logits(dtype, 6, 37, target)
    grad_out = upstream(reduction, target)
    loss, dx = check(f"{impl} {dtype} {reduction} cap={softcap} +-1e4", impl, logits, target,
                     grad_out, reduction=reduction, label_smoothing=0.1, z_loss=1e-4,
                     softcap=softcap)
    assert torch.isfinite(loss).all() and torch.isfinite(dx).all()
    if reduction == "none" and softcap is None:
        assert loss[1] > 1e4, "row 1: target logit -1e4 against a max of +1e4"


# Known float32 limits, pinned as strict xfails so that a fix shows up as XPASS (then make
# them plain tests). Each compares float32 logits' gradient with the float64 reference at
# float32's tolerance, in a case chosen to be ill-conditioned for float32 stats.


@pytest.mark.xfail(strict=True, reason=(
    "lse is one float32 number: near 1e4 its ulp is 2**-10, so p = exp(x - lse) carries a "
    "relative error up to ~5e-4 in a row with several logits near its max (both paths; "
    "reference.py's float32 math has the same). Within float16/bfloat16 tolerance."))
@pytest.mark.parametrize("impl", IMPLS)
def test_float32_gradient_with_ties_at_1e4(impl: str) -> None:
    target = make_target((6,), 37)
    logits = huge_logits(F32, 6, 37, target, ties=True)
    check(f"{impl} float32 ties at 1e4", impl, logits, target, torch.tensor(1.0))


@pytest.mark.parametrize("cap", [1e3, 1e5, 1e7])
@pytest.mark.parametrize("impl", IMPLS)
def test_float32_with_a_large_softcap(impl: str, cap: float) -> None:
    """A cap far above the logits: tanh(x / c) is taken from its series there (its
    formula's 1 - 2 / (e^2u + 1) cancels, an error growing with the cap: 1e-3 relative in
    the loss at c = 1e5), so the loss and gradient keep float32's accuracy."""
    gen = torch.Generator().manual_seed(5)
    logits = 4.0 * torch.randn(6, 37, generator=gen)
    target = torch.randint(0, 37, (6,), generator=gen)
    check(f"{impl} softcap {cap:g}", impl, logits, target, torch.tensor(1.0), softcap=cap)


def saturated_logits(V: int = 33) -> torch.Tensor:
    """[4, V] logits of magnitude 3..6, for softcap=1: every tanh is saturated."""
    signs = torch.tensor([1.0, -1.0]).repeat(V // 2 + 1)[:V]
    return (torch.linspace(3.0, 6.0, V) * signs).repeat(4, 1)


@pytest.mark.parametrize("impl", [
    pytest.param("triton", marks=pytest.mark.xfail(strict=True, reason=(
        "the kernels' tanh, 1 - 2 / (exp(2u) + 1), has an absolute error of ~ulp(2) (not "
        "a relative one), and the softcap derivative 1 - (x/c)**2 cancels where tanh "
        "saturates: when every logit is saturated the whole gradient is small and its "
        "error ~3e-5 relative (the torch path's float32 tanh gives ~6e-6)"))),
    "torch",
])
def test_float32_gradient_with_saturated_softcap(impl: str) -> None:
    target = torch.tensor([0, 3, 30, 32])
    check(f"{impl} float32 saturated softcap", impl, saturated_logits(), target,
          torch.ones(4), reduction="none", softcap=1.0)


@pytest.mark.parametrize("config", [pytest.param(CHUNKED, id="stream"),
                                    pytest.param(STREAM_VEC, id="stream-vec"),
                                    pytest.param(SLICED, id="sliced")])
@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_float32_gradient_of_offset_logits_streamed(monkeypatch: pytest.MonkeyPatch,
                                                    config: dict[str, Any],
                                                    reduction: str) -> None:
    """float32 logits 200 + N(0, 9) through the streamed loops, with z-loss: exponents
    formed as ``(x - m) * log2 e``. As ``x * log2 e - m * log2 e`` (the one-FMA form
    used before) the product is rounded at x's magnitude (ulp(288) = 3e-5 in the
    exponent) and this gradient was off by 1.6e-5 to 1.8e-5, over float32's tolerance; now 5e-6,
    the lse's own rounding (ulp(200) / 2 = 8e-6 at most). ``sum``: the fused
    stats-and-gradient kernel; ``none``: the stats kernel, then the gradient kernel."""
    monkeypatch.setattr(ops, "_config", forced(config))
    gen = torch.Generator().manual_seed(4)
    logits = 200.0 + 3.0 * torch.randn(16, 64, generator=gen)
    target = torch.randint(0, 64, (16,), generator=gen)
    check(f"{config} {reduction} 200 + noise", "triton", logits, target,
          torch.ones(() if reduction == "sum" else 16), reduction=reduction, z_loss=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl, config", [
    pytest.param("triton", None, id="triton"),
    pytest.param("triton", STREAM_VEC, id="triton-stream-vec"),
    pytest.param("torch", None, id="torch"),
])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1], ids=lambda s: f"ls{s}")
def test_neg_inf_logits_in_non_target_columns(monkeypatch: pytest.MonkeyPatch, impl: str,
                                              config: dict[str, Any] | None,
                                              dtype: torch.dtype, reduction: str,
                                              label_smoothing: float) -> None:
    """-inf logits (masked-out vocabulary) outside the targets.

    Without label smoothing the loss and gradient are finite (and the gradient is 0 in the
    -inf columns). With label smoothing the smoothing term averages log-probabilities that
    include -inf, so the loss is +inf, exactly as ``F.cross_entropy`` gives; the gradient
    stays finite (``-label_smoothing / V`` in the -inf columns), again as torch's.
    ``config``: a forced launch (the whole-row stats loop of the GPU tables).
    """
    if config is not None:
        monkeypatch.setattr(ops, "_config", forced(config))
    V = 37
    logits = randn((6, V), dtype, scale=2.0)
    target = make_target((6,), V)
    dead = torch.zeros(6, V, dtype=torch.bool)
    dead[:, ::5] = True
    dead[target.clamp(min=0)[:, None] == torch.arange(V)] = False
    logits[dead] = float("-inf")
    grad_out = upstream(reduction, target)
    kw = dict(reduction=reduction, label_smoothing=label_smoothing)
    loss, dx = check(f"{impl} {dtype} {kw} -inf columns", impl, logits, target, grad_out, **kw)

    x = logits.double().requires_grad_(True)
    torch_loss = F.cross_entropy(x, target, **kw)
    torch_loss.backward(grad_out.double())
    valid = target != IGNORE
    if label_smoothing:
        assert (torch_loss[valid] if reduction == "none" else torch_loss).eq(float("inf")).all()
        assert (loss[valid] if reduction == "none" else loss).eq(float("inf")).all()
    else:
        assert torch.isfinite(loss).all()
    assert_close(loss, torch_loss.float(), F32, "loss vs F.cross_entropy")
    assert torch.isfinite(dx).all()
    assert_close(dx, x.grad.to(dtype), dtype, "gradient vs F.cross_entropy")
    expect_dead = -label_smoothing / V * grad_out.double().expand(6)[:, None].expand(6, V)
    if reduction == "mean":
        expect_dead = expect_dead / int(valid.sum())
    expect_dead = torch.where(valid[:, None], expect_dead, 0.0)
    assert_close(dx[dead], expect_dead[dead].to(dtype), dtype, "gradient in -inf columns")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", ["transposed", "row-slice-3d", "column-step"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_non_contiguous_logits(impl: str, dtype: torch.dtype, layout: str,
                               reduction: str) -> None:
    """Strided logits views (and a strided target); the gradient lands in the leaf's layout."""
    if layout == "transposed":  # [V, N] storage, stride(-1) != 1: copied for the kernel
        base = randn((37, 6), dtype, scale=2.0)
        view = lambda t: t.t()  # noqa: E731
        target = make_target((2, 6), 37)[1]
    elif layout == "row-slice-3d":  # rows of 40 holding 37 logits: read in place, stride 40
        base = randn((2, 3, 40), dtype, scale=2.0)
        view = lambda t: t[..., :37]  # noqa: E731
        target = make_target((3, 2), 37).t()
    else:  # every other column
        base = randn((6, 74), dtype, scale=2.0)
        view = lambda t: t[:, ::2]  # noqa: E731
        target = make_target((6,), 37)
    logits = view(base)
    assert not logits.is_contiguous()
    grad_out = upstream(reduction, target)
    leaf = base.to(DEVICE).clone().requires_grad_(True)
    t = target.to(DEVICE)  # (a copy keeps the strides of the row-slice-3d case's target)
    assert t.stride() == target.stride() and not view(leaf).is_contiguous()
    loss = lmfuse.cross_entropy(view(leaf), t, impl=impl, reduction=reduction,
                                label_smoothing=0.1, softcap=5.0)
    loss.backward(grad_out.to(DEVICE))
    kw = dict(reduction=reduction, label_smoothing=0.1, softcap=5.0)
    loss_ref, dx_ref = expected(logits, target, grad_out, **kw)
    what = f"{impl} {dtype} {layout} {reduction}"
    assert_close(loss.cpu(), loss_ref.float(), F32, f"{what}: loss")
    dx = leaf.grad.cpu()
    assert_close(view(dx), dx_ref.to(dtype), dtype, f"{what}: d logits")
    untouched = torch.ones_like(base, dtype=torch.bool)
    view(untouched).fill_(False)
    assert torch.equal(dx[untouched], torch.zeros(int(untouched.sum()), dtype=dtype))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape", [(0, 5), (2, 0, 5)], ids=["N0", "B2-S0"])
def test_empty_batch(impl: str, reduction: str, shape: tuple[int, ...]) -> None:
    leaf = randn(shape).to(DEVICE).requires_grad_(True)
    target = torch.empty(shape[:-1], dtype=torch.int64, device=DEVICE)
    loss = lmfuse.cross_entropy(leaf, target, impl=impl, reduction=reduction,
                                label_smoothing=0.1)
    assert loss.dtype == F32
    if reduction == "none":
        assert loss.shape == shape[:-1]
    else:
        assert loss.shape == () and loss.item() == 0.0
    loss.sum().backward()
    assert leaf.grad is not None and leaf.grad.shape == shape


@pytest.mark.parametrize("impl", ["auto", "torch"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_float64_logits(impl: str, weighted: bool) -> None:
    """float64 logits take float64 math (the torch path; the kernels compute in float32):
    loss and gradient float64, equal to the float64 reference to float64 rounding."""
    logits = randn((4, 13), F64, scale=2.0)
    target = make_target((4,), 13)
    kw: dict[str, Any] = dict(label_smoothing=0.1, z_loss=0.01, softcap=4.0)
    w = torch.rand(13, dtype=F32) + 0.5 if weighted else None  # used in float64 here
    loss, dx, _ = run(impl, logits, target, torch.tensor(1.5),
                      weight=None if w is None else w.to(DEVICE), **kw)
    x = logits.clone().requires_grad_(True)
    loss_ref = cross_entropy_reference(x, target, weight=None if w is None else w.double(), **kw)
    (dx_ref,) = torch.autograd.grad(loss_ref, x, torch.tensor(1.5, dtype=F64))
    assert loss.dtype == F64 and dx.dtype == F64
    assert_close(loss, loss_ref, F64, f"{impl} float64: loss")
    assert_close(dx, dx_ref, F64, f"{impl} float64: d logits")
    assert "float64" in lmfuse.explain("cross_entropy", logits.to(DEVICE),
                                       target.to(DEVICE)).reason


def test_float64_logits_refused_by_triton() -> None:
    logits, target = randn((4, 13), F64).to(DEVICE), make_target((4,), 13).to(DEVICE)
    with pytest.raises(TypeError, match="cross_entropy: the Triton path takes "
                       "float32/float16/bfloat16 logits, got float64"):
        lmfuse.cross_entropy(logits, target, impl="triton")


# --- targets ------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bad", [7, 8, -1, -101, 2**40], ids=lambda b: f"t={b}")
def test_out_of_range_target_raises_on_cpu(impl: str, bad: int) -> None:
    """On CPU tensors the check always runs; on CUDA ones (the GPU run's test device) only
    with ``lmfuse.set_checks(True)``, as the op's docstring says: on with it here."""
    logits = randn((4, 7)).to(DEVICE)
    target = torch.tensor([0, IGNORE, bad, 6], device=DEVICE)
    with value_checks_on(), pytest.raises(
            ValueError, match=rf"^cross_entropy: target holds {bad}, which is "
                              r"neither ignore_index \(-100\) nor a class in \[0, 7\)"):
        lmfuse.cross_entropy(logits, target, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ignore_index", [-1, 7, 1000, 3], ids=lambda i: f"ignore={i}")
def test_ignore_index_is_never_out_of_range(impl: str, ignore_index: int) -> None:
    """ignore_index may be any int (negative, V, past V, or a real class id, then ignored)."""
    V = 7
    logits = randn((5, V), requires_grad=True)
    target = torch.tensor([0, ignore_index, 6, ignore_index, 2])
    kw = dict(ignore_index=ignore_index, label_smoothing=0.1)
    check(f"{impl} ignore_index={ignore_index}", impl, logits.detach(), target,
          torch.tensor(2.0), **kw)
    x = logits.detach().double()
    torch_loss = F.cross_entropy(x, target, **kw)
    loss = lmfuse.cross_entropy(logits.to(DEVICE), target.to(DEVICE), impl=impl, **kw)
    assert_close(loss.cpu(), torch_loss.float(), F32, "vs F.cross_entropy")


# --- bad input ------------------------------------------------------------------------


BAD_INPUTS = [
    pytest.param(lambda: dict(logits=torch.ones(3, 5, dtype=torch.int64)), TypeError,
                 r"logits must have dtype", id="logits-int"),
    pytest.param(lambda: dict(logits=[[1.0, 2.0]]), TypeError,
                 r"logits must be a torch.Tensor", id="logits-list"),
    pytest.param(lambda: dict(logits=torch.tensor(1.0), target=torch.tensor(0)), ValueError,
                 r"logits must be \[\.\.\., V\], got a 0-D tensor", id="logits-0d"),
    pytest.param(lambda: dict(target=torch.zeros(3)), TypeError,
                 r"target must have dtype in \(int32, int64\), got torch.float32",
                 id="target-float"),
    pytest.param(lambda: dict(target=torch.zeros(3, dtype=torch.int16)), TypeError,
                 r"target must have dtype", id="target-int16"),
    pytest.param(lambda: dict(target=torch.zeros(4, dtype=torch.int64)), ValueError,
                 r"target must have shape logits.shape\[:-1\] = \(3,\), got \(4,\)",
                 id="target-shape"),
    pytest.param(lambda: dict(target=torch.zeros(3, 1, dtype=torch.int64)), ValueError,
                 r"target must have shape", id="target-extra-dim"),
    pytest.param(lambda: dict(logits=randn((3, 0)), target=torch.zeros(3, dtype=torch.int64)),
                 ValueError, r"logits must have at least one class, got V = 0", id="V0"),
    pytest.param(lambda: dict(label_smoothing=-0.1), ValueError,
                 r"label_smoothing must be in \[0, 1\], got -0.1", id="ls-negative"),
    pytest.param(lambda: dict(label_smoothing=1.5), ValueError,
                 r"label_smoothing must be in \[0, 1\], got 1.5", id="ls-above-1"),
    pytest.param(lambda: dict(label_smoothing=None), TypeError,
                 r"label_smoothing must be a float", id="ls-none"),
    pytest.param(lambda: dict(label_smoothing=float("nan")), ValueError,
                 r"label_smoothing must be finite", id="ls-nan"),
    pytest.param(lambda: dict(z_loss=-1e-4), ValueError, r"z_loss must be >= 0, got -0.0001",
                 id="z-negative"),
    pytest.param(lambda: dict(z_loss="0.1"), TypeError, r"z_loss must be a float, got str",
                 id="z-str"),
    pytest.param(lambda: dict(softcap=0.0), ValueError, r"softcap must be None or > 0, got 0.0",
                 id="softcap-0"),
    pytest.param(lambda: dict(softcap=-2), ValueError, r"softcap must be None or > 0, got -2",
                 id="softcap-negative"),
    pytest.param(lambda: dict(softcap=float("inf")), ValueError, r"softcap must be finite",
                 id="softcap-inf"),
    pytest.param(lambda: dict(reduction="avg"), ValueError,
                 r"reduction must be one of \('mean', 'sum', 'none'\), got 'avg'",
                 id="reduction-unknown"),
    pytest.param(lambda: dict(reduction=None), ValueError, r"reduction must be one of",
                 id="reduction-none-value"),
    pytest.param(lambda: dict(inplace_backward=1), TypeError,
                 r"inplace_backward must be a bool, got 1", id="inplace-int"),
    pytest.param(lambda: dict(inplace_backward="yes"), TypeError,
                 r"inplace_backward must be a bool", id="inplace-str"),
    pytest.param(lambda: dict(tp_group=1), TypeError,
                 r"tp_group must be a torch.distributed.ProcessGroup or None, got int",
                 id="tp-group-int"),
    pytest.param(lambda: dict(tp_group="tp"), TypeError, r"tp_group must be", id="tp-group-str"),
    pytest.param(lambda: dict(ignore_index=-100.0), TypeError, r"ignore_index must be an int",
                 id="ignore-float"),
    pytest.param(lambda: dict(impl="cuda"), ValueError, r"impl must be one of", id="impl-bad"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("make, error, message", BAD_INPUTS)
def test_bad_input_raises(make, error: type[Exception], message: str, impl: str) -> None:
    kwargs: dict[str, Any] = dict(logits=randn((3, 5)), target=make_target((3,), 5), impl=impl)
    kwargs.update(make())
    logits, target = (t.to(DEVICE) if isinstance(t, torch.Tensor) else t
                      for t in (kwargs.pop("logits"), kwargs.pop("target")))
    with pytest.raises(error, match=rf"^cross_entropy: {message}"):
        lmfuse.cross_entropy(logits, target, **kwargs)
    with pytest.raises(error, match=rf"^cross_entropy: {message}"):
        lmfuse.explain(lmfuse.cross_entropy, logits, target, **kwargs)


# --- properties -----------------------------------------------------------------------


@st.composite
def problems(draw: st.DrawFn) -> dict[str, Any]:
    # V >= 2, N != 1 and moderate logits: a batch whose every token is near-certain has
    # a gradient p - 1 ~ 0 and a loss lse - x_t ~ 0, each carrying an absolute float32
    # rounding error that is large relative to itself (V = 1 and huge logits are covered
    # by test_shapes and test_huge_logits). Softcaps of 3 and more keep tanh from saturating
    # everywhere at once (see test_float32_gradient_with_saturated_softcap).
    return dict(N=draw(st.sampled_from([0, 2, 3, 5, 8, 9])), V=draw(st.integers(2, 64)),
                reduction=draw(st.sampled_from(REDUCTIONS)),
                label_smoothing=draw(st.sampled_from([0.0, 0.1, 1.0])),
                z_loss=draw(st.sampled_from([0.0, 1e-3, 0.1])),
                softcap=draw(st.sampled_from([None, 3.0, 15.0])),
                inplace_backward=draw(st.booleans()),
                scale=draw(st.sampled_from([0.5, 3.0])),
                config=draw(st.sampled_from([None, CHUNKED, CHUNKED_TILE4, TILE4, SLICED,
                                             STREAM_VEC])),
                seed=draw(st.integers(0, 2**31 - 1)))


@given(problem=problems())
def test_property_triton_matches_reference(problem: dict[str, Any]) -> None:
    p = dict(problem)
    torch.manual_seed(p.pop("seed"))
    N, V, scale, config = p.pop("N"), p.pop("V"), p.pop("scale"), p.pop("config")
    logits = randn((N, V), F32, scale=scale)
    target = make_target((N,), V, every=3)
    grad_out = upstream(p["reduction"], target)
    with pytest.MonkeyPatch.context() as mp:
        if config is not None:
            mp.setattr(ops, "_config", forced(config))
        check(f"{problem}", "triton", logits, target, grad_out, **p)


@pytest.mark.parametrize("impl", IMPLS)
def test_second_backward_through_fused_path_refused(impl: str) -> None:
    """The fused path rescales its kept gradient in place: a second backward through the
    same graph raises instead of scaling it twice (the deferred path allows it)."""
    logits = randn((5, 11)).to(DEVICE).requires_grad_(True)
    target = make_target((5,), 11).to(DEVICE)
    half = torch.tensor(0.5, device=DEVICE)
    loss = lmfuse.cross_entropy(logits, target, impl=impl)
    loss.backward(half, retain_graph=True)
    if impl == "triton":
        with pytest.raises(RuntimeError, match="second backward"):
            loss.backward(half)
    else:  # the torch path keeps the logits and recomputes: twice is twice
        first = logits.grad.clone()
        loss.backward(half)
        torch.testing.assert_close(logits.grad, 2 * first)



@pytest.mark.parametrize("impl", IMPLS)
def test_float16_gradient_scaled_before_rounding(impl: str) -> None:
    """fp16 training scales the loss (GradScaler): the gradient must be formed with that
    scale, not for 1 and multiplied after, where (p - y) / count underflows float16."""
    V, n = 20000, 32
    # p = 1 / V = 5e-5; formed for 1, p / n = 1.5625e-6 is a float16 subnormal (steps of
    # 2^-24: it rounds to 26 of them, 0.8% off, four times the tolerance below)
    logits = torch.zeros(n, V, dtype=torch.float16, device=DEVICE, requires_grad=True)
    target = torch.zeros(n, dtype=torch.long, device=DEVICE)
    scale = 2.0 ** 16
    loss = lmfuse.cross_entropy(logits, target, impl=impl)
    (grad,) = torch.autograd.grad(loss * scale, logits)
    # scale * p / n = 2**16 / 20000 / 32 = 0.1: well inside float16's range
    want = scale / V / n
    assert abs(grad[0, 1].item() - want) <= 2e-3 * want, grad[0, 1].item()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("kw", [dict(), dict(label_smoothing=0.1), dict(ignore_index=3)])
def test_default_cpu_path_is_pytorchs_op_with_the_reference_results(monkeypatch, reduction,
                                                                   kw) -> None:
    """On CPU float32 logits the default path (no Triton: what a CPU machine without the
    interpreter picks) runs ``F.cross_entropy`` (the plain op's speed) where it has every
    option in use: the reference's loss and gradients, NaN rows as PyTorch's, a mean over
    no token 0 with a zero gradient. (CPU tensors whatever the test device: this is the
    CPU's own path.)"""
    monkeypatch.setattr(ops, "select_impl", lambda op, impl, device: (
        ("torch", "test: no Triton") if impl == "auto" else _select_impl(op, impl, device)))
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 53, generator=g) * 3).requires_grad_(True)
    t = torch.randint(0, 53, (37,), generator=g)
    t[::5] = kw.get("ignore_index", -100)
    x.data[4, 7] = float("nan")
    assert ops._native_cpu(x, "auto", ops._resolve(
        x, t, kw.get("ignore_index", -100), kw.get("label_smoothing", 0.0), 0.0, None,
        reduction, None, False, "auto")[2])
    got = lmfuse.cross_entropy(x, t, reduction=reduction, **kw)
    (gx,) = torch.autograd.grad(got.sum(), x)
    xr = x.detach().clone().requires_grad_(True)
    want = lmfuse.cross_entropy(xr, t, reduction=reduction, impl="torch", **kw)
    (gr,) = torch.autograd.grad(want.sum(), xr)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(gx.isnan(), gr.isnan())
    fin = ~want.isnan()
    assert torch.allclose(got[fin], want[fin], rtol=1e-5, atol=1e-6)
    fin = ~gr.isnan()
    assert torch.allclose(gx[fin], gr[fin], rtol=1e-5, atol=1e-7)
    ignored = torch.full((5,), kw.get("ignore_index", -100))
    y = torch.randn(5, 53, requires_grad=True)
    loss = lmfuse.cross_entropy(y, ignored, reduction=reduction, **kw)
    loss.sum().backward()
    assert (loss == 0).all() and (y.grad == 0).all()
    with pytest.raises(ValueError, match="neither ignore_index"):
        lmfuse.cross_entropy(y, torch.tensor([0, 1, 53, 2, 0]), reduction=reduction, **kw)
    t32 = lmfuse.cross_entropy(x.detach(), t.int(), reduction=reduction, **kw)  # int32 ids
    assert torch.equal(t32.isnan(), got.isnan())
    assert torch.allclose(t32[~t32.isnan()], got.detach()[~got.isnan()])


def test_scalar_options_are_checked_on_every_call_whatever_came_before() -> None:
    """The scalar options' checks are cached by value and type: a value that passed once
    does not let an equal value of another type through (``True`` for ``1``), and a bad
    value raises on every call."""
    x, t = torch.randn(4, 5), torch.randint(0, 5, (4,))
    want = F.cross_entropy(x, t, ignore_index=1)
    assert torch.allclose(lmfuse.cross_entropy(x, t, ignore_index=1, impl="torch"), want)
    for _ in range(2):
        with pytest.raises(TypeError, match="ignore_index must be an int"):
            lmfuse.cross_entropy(x, t, ignore_index=True, impl="torch")
        with pytest.raises(ValueError, match="label_smoothing must be in"):
            lmfuse.cross_entropy(x, t, label_smoothing=1.5, impl="torch")
        with pytest.raises(TypeError, match="label_smoothing must be a float"):
            lmfuse.cross_entropy(x, t, label_smoothing=[0.1], impl="torch")  # unhashable
    assert torch.allclose(lmfuse.cross_entropy(x, t, label_smoothing=0.5, impl="torch"),
                          F.cross_entropy(x, t, label_smoothing=0.5))


# --- edges found by an audit (2026-11-29) ----------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS + ["auto"])
def test_ignore_index_outside_the_targets_range_is_refused(impl: str) -> None:
    """torch compares an int32 tensor with a Python int wrapped to int32: 2**32 + 1 ignored
    class 1 in the token count and not in the kernels (loss 2.42 against 1.81). Outside
    the target dtype's range (int64's for any), ignore_index is refused by name."""
    logits = torch.randn(4, 5)
    t32 = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^cross_entropy: ignore_index must be within "
                                         r"int32's range for int32 targets, got 4294967297"):
        lmfuse.cross_entropy(logits, t32, ignore_index=2**32 + 1, impl=impl)
    with pytest.raises(ValueError, match=r"ignore_index must be within int64's range"):
        lmfuse.cross_entropy(logits, t32.long(), ignore_index=2**70, impl=impl)


@pytest.mark.parametrize("name", ["softcap", "z_loss"])
def test_options_beyond_float32_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match=rf"^cross_entropy: {name} must be within float32's"):
        lmfuse.cross_entropy(torch.randn(4, 5), torch.tensor([0, 1, 2, 3]), **{name: 1e39})


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_inplace_backward_over_logits_another_node_saved_raises(impl: str,
                                                               reduction: str) -> None:
    """tanh keeps its output (the logits) for its backward: the Triton path wrote the
    gradient over them without bumping their version, so tanh's backward read the gradient
    as logits and gave a wrong gradient silently; now autograd's in-place error, as on the
    torch path."""
    h = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(11, 8)
    loss = lmfuse.cross_entropy(torch.tanh(h @ w.T), torch.tensor([1, 0, 10, 3]),
                                reduction=reduction, inplace_backward=True, impl=impl)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.sum().backward()


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_per_token_losses_can_be_masked_in_place(impl: str) -> None:
    """reduction="none" on the Triton path returned a view made inside the autograd
    Function, which cannot be changed in place (loss.mul_(mask) raised)."""
    logits = torch.randn(5, 9, requires_grad=True)
    target = torch.tensor([0, 3, 8, 1, 2])
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5])
    loss = lmfuse.cross_entropy(logits, target, reduction="none", impl=impl)
    loss.mul_(mask)
    got = torch.autograd.grad(loss.sum(), logits)[0]
    want = torch.autograd.grad((torch.nn.functional.cross_entropy(
        logits, target, reduction="none") * mask).sum(), logits)[0]
    assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("reduction, dtype", [("none", F32), ("mean", torch.float16)])
def test_a_second_backward_after_an_inplace_one_is_refused(reduction: str, dtype) -> None:
    """The deferred Triton path (reduction="none", float16) writes the gradient over the
    saved logits without bumping their version: a second backward (retain_graph=True)
    silently read the gradient as logits. Now it raises, as the other paths do."""
    logits = torch.randn(6, 40).to(dtype).requires_grad_(True)
    x = logits * 1  # a non-leaf, as inplace_backward needs
    loss = lmfuse.cross_entropy(x, torch.randint(0, 40, (6,)), reduction=reduction,
                                inplace_backward=True, impl="triton")
    loss.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.sum().backward()
