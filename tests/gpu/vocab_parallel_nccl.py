"""Vocabulary-parallel losses on NCCL ranks: ``cross_entropy(..., tp_group=group)``,
``linear_cross_entropy(..., tp_group=group)`` and ``lmfuse.megatron``'s
``vocab_parallel_cross_entropy`` / ``fused_vocab_parallel_cross_entropy``, the checks of
``tests/distributed/test_vocab_parallel_ce.py`` and ``test_linear_cross_entropy_tp.py``
(gloo, CPU tensors) on 2 or 4 GPUs, one per rank (``cuda:LOCAL_RANK``), at GPU sizes::

    torchrun --nproc_per_node 2 tests/gpu/vocab_parallel_nccl.py --out vp2.json
    torchrun --nproc_per_node 4 tests/gpu/vocab_parallel_nccl.py --out vp4.json

(The script sets ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and
``NVSHMEM_DISABLE_NVLS=1`` before it imports torch: no NVLink multicast.)

Every rank draws the same full problem from one seed on its own GPU and computes the
single-GPU answers there, from the unsharded inputs: lmfuse's Triton path
(``impl="triton"``) and its float32 reference (``impl="torch"``). Rank ``r`` then runs the
parallel op on its share (vocabulary columns, or weight and bias rows,
``[r * V_local, (r + 1) * V_local)``; global targets, among them the first and last id of
every rank's share) and checks, against both answers:

* ``ce``: ``cross_entropy(logits_local, target, tp_group=group)``: the loss, and the gradient
  (``torch.autograd.grad``) against the matching columns of the single-GPU gradient (with
  ``inplace_backward=True`` also the gradient written over the logits). The gloo module's
  ``OPTIONS`` (plain, ignored rows, label smoothing, z-loss, softcap, all at once) for each
  logits dtype (float32, float16, bfloat16), the reductions spread over them, then sizes
  from N = 1 to 4096 tokens and V_local = 1000 and 4099 (not multiples of 16), 32064 and
  64128 (V = 128256 at TP = 2; rows streamed in blocks), the parallel op's torch path,
  int32 targets and batches of ignored targets only; on 4 ranks also cases on the groups
  {0, 1} and {2, 3} (group ranks that are not the global ranks). Collectives: one
  all-gather in the forward, none in the backward.
* ``linear``: ``linear_cross_entropy(hidden, weight_local, target, bias=bias_local,
  tp_group=group)``, hidden replicated: the loss, ``hidden``'s gradient against the whole
  single-GPU one (the op all-reduces it; bit for bit the same on every rank), weight's and
  bias's against rank ``r``'s rows. N = 512 to 2048, H = 256 to 1024, V_local = 4000 to
  32064, bf16, fp16 and fp32, the options with and without bias, the tuning table's chunk
  budget and budgets of a few hundred rows (the single-GPU op then in chunks of as many
  rows, so that both sum the weight gradient over the same chunks), only hidden or only
  weight needing a gradient, a forward under ``no_grad``. Collectives: one all-gather per
  chunk, and hidden's all-reduce in the forward (gradients computed there:
  ``"mean"``/``"sum"``, not float16) or in the backward (``"none"`` and float16: the
  logits recomputed there).
* ``megatron``: both names with the world group (and on 4 ranks the pairs), label
  smoothing 0 and 0.1, against the same name on the whole vocabulary (a one-rank group)
  and against the gloo module's float64 ``megatron_per_token`` (Megatron's formula).

Tolerances, as the gloo tests choose them (``tests/helpers.py``'s ``tol``/``assert_close``:
a whole-tensor relative error and ``max|a - b| / max|b|`` both within it): the loss is
float32 whatever the inputs' dtype, held to float32's tolerance (1e-5); gradients are in
the inputs' dtype and held to that dtype's (1e-5 float32, 2e-3 float16, 1.6e-2 bfloat16).
Upstream gradients: per token (``"none"``) or 0.75, times a loss scale of 1024 for float16
(as fp16 training does; unscaled, ``(p - y) / count`` underflows float16).
``linear_cross_entropy``'s loss meets float32's tolerance in half precision only where the
GEMM rounds each logit alike for ``V_local`` and ``V`` columns: on an H100 (torch 2.11,
cuBLAS of CUDA 13.0) it does for every shape here but bf16 ``V_local = 5003`` (204 of
10^6 logits differ by an ulp), whose case passes at about 8e-6 of 1e-5.

It does not hang: cases run in lockstep with ``tests/gpu/sharded_decode_nccl.py``'s
``Runner``. After each case the ranks exchange their results (the case's name and the
collectives each issued) over a gloo side group with a timeout; a case that fails on some
rank is reported and the run goes on while every rank issued the same collectives;
otherwise, or when a rank does not answer within ``--timeout`` seconds, every rank aborts
(exit code 2). Rank 0 prints one line per case (PASS/FAIL, largest error of each kind and
its tolerance) and the total time, ``--out`` writes a JSON summary (device, versions,
date, world size, every case), and the exit code is 1 when a case failed.
``--sections ce,linear,megatron`` and ``--filter TEXT`` (case names) pick cases.

Dry run on the CPU (gloo ranks, Triton interpreter; small shapes, the same cases)::

    TRITON_INTERPRET=1 torchrun --nproc_per_node 2 tests/gpu/vocab_parallel_nccl.py \\
        --backend gloo --device cpu
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

# No NVLink multicast (SHARP) in NCCL, PyTorch's symmetric memory or NVSHMEM: set before
# torch is imported.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

# tests/gpu, tests/distributed and tests/ for their modules; src/ for lmfuse where it is not
# installed.
_TESTS = Path(__file__).resolve().parent.parent
for _dir in (str(_TESTS / "gpu"), str(_TESTS / "distributed"), str(_TESTS)):
    if _dir not in sys.path:
        sys.path.insert(0, _dir)
sys.path.append(str(_TESTS.parent / "src"))

import test_linear_cross_entropy_tp as lp  # noqa: E402
import test_vocab_parallel_ce as vp  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from sharded_decode_nccl import Checks, Runner, _triton_version, fmt_dtype  # noqa: E402
from spawn import count_collectives  # noqa: E402

import lmfuse  # noqa: E402
from lmfuse import megatron  # noqa: E402
from lmfuse._dispatch import interpreter_active  # noqa: E402
from lmfuse.cross_entropy import plan_linear_cross_entropy  # noqa: E402
from lmfuse.cross_entropy.linear import chunk_rows, linear_cross_entropy_reference  # noqa: E402

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
I32, I64 = torch.int32, torch.int64
SECTIONS = ("ce", "linear", "megatron")
PATHS = ("triton", "torch")  # the single-GPU answers
LOSS_SCALE = 1024.0  # float16's upstream gradients

CE_OPTIONS = {o[0]: o for o in vp.OPTIONS}  # plain, ignore, smoothing, z_loss, softcap, all
LINEAR_OPTIONS = {o[0]: o for o in [
    *lp.OPTIONS,  # "all+ignore" (label smoothing, z-loss, softcap, ignored rows), "plain"
    ("ignore", {}, True),
    ("smoothing", {"label_smoothing": 0.1}, True),
    ("z_loss", {"z_loss": 1e-2}, False),
    ("softcap", {"softcap": 5.0}, False),
]}

# name: ((lead, V_local) on GPUs, (lead, V_local) in the CPU dry run)
CE_SIZES = {
    "sweep": (((128, 4), 1000), ((3, 4), 7)),
    "one": (((1,), 4099), ((1,), 19)),
    "few": (((7,), 4099), ((7,), 19)),
    "mid": (((2048,), 4099), ((4, 3), 19)),
    "wide": (((512, 4), 32064), ((3, 4), 48)),
    # V = 128256 at TP = 2; past the kernels' single-block rows (the CPU's too): streamed
    "llama": (((1024, 4), 64128), ((2, 3), 16385)),
}
# (size, dtype, reduction, option, inplace_backward)
CE_CASES = [
    ("one", BF16, "mean", "z_loss", False),
    ("one", F32, "none", "plain", True),
    ("few", F16, "none", "smoothing", True),
    ("few", F32, "sum", "softcap", False),
    ("mid", BF16, "mean", "all", True),
    ("mid", F16, "sum", "z_loss", False),
    ("wide", BF16, "none", "all", False),
    ("wide", F16, "mean", "softcap", True),
    ("wide", F32, "sum", "smoothing", False),
    ("llama", BF16, "mean", "all", True),
    ("llama", BF16, "none", "plain", False),
    ("llama", F32, "mean", "z_loss", True),
    ("llama", F16, "sum", "ignore", False),
]
# As CE_CASES, plus keyword arguments of ce_case.
CE_EXTRA = [
    ("mid", F32, "mean", "all", False, {"impl": "torch"}),
    ("sweep", BF16, "none", "smoothing", True, {"impl": "torch"}),
    ("wide", F16, "sum", "softcap", False, {"impl": "torch"}),
    ("mid", BF16, "none", "all", False, {"target_dtype": I32}),
    ("sweep", BF16, "mean", "smoothing", False, {"ignore_all": True}),
    ("sweep", F32, "none", "all", True, {"ignore_all": True}),
]
# 4 ranks: on the pairs {0, 1} and {2, 3} at once.
CE_PAIRS = [
    ("sweep", F32, "mean", "all", False, {}),
    ("mid", BF16, "none", "all", True, {}),
    ("wide", F16, "sum", "ignore", False, {}),
]

# name: ((N, H, V_local) on GPUs, (N, H, V_local) in the CPU dry run)
LINEAR_SIZES = {
    "small": ((512, 256, 4000), (11, 8, 13)),
    "odd": ((777, 384, 5003), (7, 8, 11)),
    "mid": ((1024, 512, 16000), (12, 16, 21)),
    "large": ((2048, 1024, 32064), (9, 8, 40)),
}
# (size, dtype, reduction, option, bias, rows a chunk (None: the tuning table's budget);
# rows under or a multiple of 128, the tables' row_multiple, to be the same on one GPU)
LINEAR_CASES = [
    ("small", BF16, "mean", "all+ignore", True, None),
    ("small", BF16, "sum", "plain", False, None),
    ("small", BF16, "none", "softcap", True, None),
    ("small", F16, "mean", "smoothing", False, None),
    ("small", F16, "sum", "all+ignore", True, None),
    ("small", F16, "none", "z_loss", False, None),
    ("small", F32, "mean", "ignore", True, None),
    ("small", F32, "sum", "softcap", False, None),
    ("small", F32, "none", "all+ignore", True, None),
    ("odd", BF16, "mean", "all+ignore", True, 100),
    ("odd", F16, "none", "plain", True, 128),
    ("odd", F32, "sum", "smoothing", False, 384),
    ("mid", BF16, "none", "all+ignore", True, 256),
    ("mid", F16, "mean", "z_loss", True, None),
    ("mid", F32, "mean", "all+ignore", False, 256),
    ("large", BF16, "mean", "all+ignore", True, None),
    ("large", BF16, "sum", "plain", False, 512),
    ("large", F16, "none", "all+ignore", True, None),
    ("large", F32, "mean", "softcap", True, None),
]
# As LINEAR_CASES, plus keyword arguments of linear_case.
LINEAR_EXTRA = [
    ("mid", BF16, "mean", "all+ignore", True, 256, {"impl": "torch"}),
    ("small", F32, "none", "all+ignore", True, None, {"impl": "torch"}),
    ("small", BF16, "mean", "all+ignore", True, 128, {"needs": (True, False)}),
    ("small", F16, "sum", "all+ignore", True, None, {"needs": (False, True)}),
    ("odd", BF16, "none", "all+ignore", True, None, {"no_grad": True}),
]
LINEAR_PAIRS = [
    ("odd", BF16, "mean", "all+ignore", True, 128, {}),
    ("small", F16, "none", "softcap", False, None, {}),
]

MEGATRON_SIZES = {
    "meg": (((256, 4), 32064), ((3, 4), 6)),
    "meg_odd": (((100, 3), 4099), ((3, 4), 5)),
}
# (name, label_smoothing): the gloo module's variants
MEGATRON_VARIANTS = [("fused_vocab_parallel_cross_entropy", 0.0),
                     ("vocab_parallel_cross_entropy", 0.0),
                     ("vocab_parallel_cross_entropy", 0.1)]


# --- inputs ----------------------------------------------------------------------------------


def shape(table: dict[str, tuple], name: str, device: torch.device) -> tuple:
    """A size of ``table``: its GPU entry, or its CPU one for the dry run."""
    return table[name][0 if device.type == "cuda" else 1]


def global_targets(g: torch.Generator, lead: tuple[int, ...], V_local: int, world: int,
                   ignore: int | None, device: torch.device) -> torch.Tensor:
    """Random global ids ``[*lead]``, as the gloo modules' ``make_inputs``: the first tokens
    hold the first and then the last id of every rank's share; with ``ignore``, the last
    token and, past those first ones, the tokens i = 3 (mod 7) are ignored (none when
    N <= 2)."""
    V = V_local * world
    target = torch.randint(0, V, lead, generator=g, device=device)
    flat = target.view(-1)
    n = flat.numel()
    edges = torch.arange(0, V, V_local, device=device)
    fill = torch.cat([edges, edges + V_local - 1])[:n]
    flat[:len(fill)] = fill
    if ignore is not None and n > 2:
        idx = torch.arange(n, device=device)
        flat[((idx % 7 == 3) & (idx >= 2 * world)) | (idx == n - 1)] = ignore
    return target


def upstream(seed: int, lead: tuple[int, ...], reduction: str, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    """The gloo modules' upstream gradient: per token for ``"none"``, 0.75 otherwise; times
    ``LOSS_SCALE`` for float16."""
    g = torch.Generator(device=device).manual_seed(seed + 1)
    dout = (torch.randn(lead, generator=g, device=device) if reduction == "none"
            else torch.tensor(0.75, device=device))
    return dout * LOSS_SCALE if dtype == F16 else dout


def check_calls(c: Checks, what: str, calls: list[str], gathers: int, reduces: int) -> None:
    """``calls``: ``gathers`` all-gathers, then ``reduces`` all-reduces, nothing else."""
    def run() -> None:
        g = [x for x in calls if x in vp.ALL_GATHERS]
        r = [x for x in calls if x in lp.ALL_REDUCES]
        assert len(g) == gathers and len(r) == reduces and len(calls) == gathers + reduces, (
            f"issued {calls}, expected {gathers} all-gather(s) and {reduces} all-reduce(s)")
        assert calls[:gathers] == g, f"an all-reduce before an all-gather: {calls}"

    c.check(f"{what} collectives", run)


def check_equal(what: str, got: Any, want: Any) -> None:
    assert got == want, f"{what}: {got!r} != {want!r}"


# --- cross_entropy(tp_group=...) -------------------------------------------------------------


def ce_case(c: Checks, *, group: Any, device: torch.device, seed: int, size: str,
            dtype: torch.dtype, reduction: str, option: str, inplace: bool,
            impl: str = "triton", target_dtype: torch.dtype = I64,
            ignore_all: bool = False) -> None:
    """One ``cross_entropy(..., tp_group=group)`` case on this rank: loss, gradient and
    collectives against the single-GPU answers on the full logits."""
    _, opts, with_ignore = CE_OPTIONS[option]
    r, world = dist.get_rank(group), dist.get_world_size(group)
    lead, V_local = shape(CE_SIZES, size, device)
    ignore = opts.get("ignore_index", -100)
    g = torch.Generator(device=device).manual_seed(seed)
    full = (torch.randn((*lead, V_local * world), generator=g, device=device) * 2.0).to(dtype)
    target = global_targets(g, lead, V_local, world, ignore if with_ignore else None, device)
    if ignore_all:
        target.fill_(ignore)
    target = target.to(target_dtype)
    dout = upstream(seed, lead, reduction, dtype, device)
    cols = slice(r * V_local, (r + 1) * V_local)

    want = {}
    for path in PATHS:
        x = full.clone().requires_grad_(True)
        loss = lmfuse.cross_entropy(x, target, reduction=reduction, impl=path, **opts)
        (grad,) = torch.autograd.grad(loss, x, dout)
        want[path] = (loss.detach(), grad[..., cols].clone())
        del x, loss, grad

    if inplace:  # a contiguous non-leaf the gradient can overwrite
        leaf = full[..., cols].clone().requires_grad_(True)
        x = leaf.clone()
    else:  # the strided column slice itself
        leaf = x = full[..., cols].detach().requires_grad_(True)
    with count_collectives() as fwd:
        loss = lmfuse.cross_entropy(x, target, reduction=reduction, tp_group=group,
                                    inplace_backward=inplace, impl=impl, **opts)
    with count_collectives() as bwd:
        (grad,) = torch.autograd.grad(loss, leaf, dout)

    check_calls(c, "forward", fwd, 1, 0)
    check_calls(c, "backward", bwd, 0, 0)
    c.check("dtypes and shape", lambda: check_equal(
        "loss dtype, shape; grad dtype", (loss.dtype, tuple(loss.shape), grad.dtype),
        (F32, tuple(lead) if reduction == "none" else (), dtype)))
    for path, (w_loss, w_grad) in want.items():
        c.close(f"loss vs single-GPU {path}", f"loss~{path}", loss.detach(), w_loss, F32)
        c.close(f"grad vs single-GPU {path}", f"grad~{path}", grad, w_grad, dtype)
    if inplace:
        c.close("gradient written over the logits", "grad~inplace", x.detach(),
                want["triton"][1], dtype)


def ce_name(world: int, size: str, device: torch.device, dtype: torch.dtype, reduction: str,
            option: str, inplace: bool, impl: str = "triton", target_dtype: Any = I64,
            ignore_all: bool = False, group: str = "") -> str:
    lead, V_local = shape(CE_SIZES, size, device)
    return (f"ce tp{world}{group} N={math.prod(lead)} V_local={V_local} {fmt_dtype(dtype)} "
            f"{reduction} {option}{' inplace' if inplace else ''}"
            f"{'' if impl == 'triton' else f' impl={impl}'}"
            f"{' int32 target' if target_dtype == I32 else ''}"
            f"{' all ignored' if ignore_all else ''}")


def ce_section(run: Runner, world: int, groups: dict[str, Any], device: torch.device) -> None:
    cases: list[tuple] = []
    # Every option in every dtype, the reductions and inplace_backward spread over them.
    for i, option in enumerate(CE_OPTIONS):
        for j, dtype in enumerate((F32, F16, BF16)):
            cases.append(("sweep", dtype, ("mean", "sum", "none")[(i + j) % 3], option,
                          (3 * i + j) % 2 == 1, {}))
    cases += [(*case, {}) for case in CE_CASES] + CE_EXTRA
    runs = [(case, groups["world"], "") for case in cases]
    if world == 4:
        runs += [(case, groups["pair"], " pairs") for case in CE_PAIRS]
    for n, ((size, dtype, reduction, option, inplace, kw), group, label) in enumerate(runs):
        tp = dist.get_world_size(group)
        name = ce_name(tp, size, device, dtype, reduction, option, inplace, group=label, **kw)
        run.case("ce", name, functools.partial(
            ce_case, group=group, device=device, seed=1000 + n, size=size, dtype=dtype,
            reduction=reduction, option=option, inplace=inplace, **kw))


# --- linear_cross_entropy(tp_group=...) ------------------------------------------------------


def linear_case(c: Checks, *, group: Any, device: torch.device, seed: int, size: str,
                dtype: torch.dtype, reduction: str, option: str, bias: bool,
                rows: int | None, impl: str = "triton",
                needs: tuple[bool, bool] = (True, True), no_grad: bool = False) -> None:
    """One ``linear_cross_entropy(..., tp_group=group)`` case on this rank: loss, gradients
    and collectives against the single-GPU answers with the whole weight (float32: against
    the float64 reference).

    ``rows``: a chunk budget of that many rows of this rank's logits (None: the tuning
    table's). ``needs``: whether hidden, and weight and bias, need a gradient.
    ``no_grad``: the forward alone, under ``torch.no_grad()``."""
    _, opts, with_ignore = LINEAR_OPTIONS[option]
    r, world = dist.get_rank(group), dist.get_world_size(group)
    N, H, V_local = shape(LINEAR_SIZES, size, device)
    V = V_local * world
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn((N, H), generator=g, device=device).to(dtype)
    # Logits with a standard deviation near 3 (so softcap 5 bends them), as the gloo test's.
    weight = (torch.randn((V, H), generator=g, device=device) * (3.0 / H ** 0.5)).to(dtype)
    full_bias = (torch.randn((V,), generator=g, device=device) * 0.5).to(dtype) if bias else None
    target = global_targets(g, (N,), V_local, world, lp.IGNORE if with_ignore else None,
                            device)
    dout = upstream(seed, (N,), reduction, dtype, device)
    own = slice(r * V_local, (r + 1) * V_local)
    # Chunks of ``rows`` tokens on this rank and on the single GPU (a budget world times
    # larger there), so that both sum the weight gradient over the same chunks.
    budget = None if rows is None else rows * V_local * hidden.element_size()
    budget1 = None if rows is None else budget * world

    want = {}
    for path in PATHS:
        args = [hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
        if bias:
            args.append(full_bias.clone().requires_grad_(True))
        with count_collectives() as calls:
            loss = lmfuse.linear_cross_entropy(
                args[0], args[1], target, bias=args[2] if bias else None,
                reduction=reduction, impl=path, max_chunk_bytes=budget1, **opts)
            grads = torch.autograd.grad(loss, args, dout)
        c.check(f"single-GPU {path} collectives", lambda calls=calls: check_equal(
            "tp_group=None issued", calls, []))
        want[path] = (loss.detach(), grads[0], *(t[own].clone() for t in grads[1:]))
        del args, loss, grads
    if dtype == F32:
        # Two float32 answers, each within 1e-5 of the truth, can be 2e-5 apart (hidden's
        # gradient sums the whole vocabulary: 128256 terms on 4 ranks): float32 results are
        # held to the float64 reference instead, as the gloo test holds them.
        args = [t.double().requires_grad_(True) for t in (hidden, weight)]
        if bias:
            args.append(full_bias.double().requires_grad_(True))
        loss = linear_cross_entropy_reference(args[0], args[1], target,
                                              bias=args[2] if bias else None,
                                              reduction=reduction, **opts)
        grads = torch.autograd.grad(loss, args, dout.double())
        want = {"float64": (loss.detach(), grads[0], *(t[own].clone() for t in grads[1:]))}
        del args, loss, grads

    need_h, need_w = needs
    h = hidden.clone().requires_grad_(need_h)
    w = weight[own].clone().requires_grad_(need_w)
    b = full_bias[own].clone().requires_grad_(need_w) if bias else None
    kw = dict(bias=b, reduction=reduction, impl=impl, max_chunk_bytes=budget, **opts)
    plan = plan_linear_cross_entropy(h, w, target, tp_group=group, **kw)
    with count_collectives() as fwd, torch.set_grad_enabled(not no_grad):
        loss = lmfuse.linear_cross_entropy(h, w, target, tp_group=group, **kw)
    grad_needed = (need_h or need_w) and not no_grad
    inputs = [t for t, need in ((h, need_h), (w, need_w), (b, need_w))
              if t is not None and need]
    with count_collectives() as bwd:
        grads = torch.autograd.grad(loss, inputs, dout) if grad_needed else ()

    # One all-gather of the [3, rows] stats per chunk; hidden's gradient all-reduced in the
    # forward when the gradients are computed there ("mean"/"sum", not float16), else in the
    # backward (the logits recomputed there).
    per_chunk = chunk_rows(N, V_local, hidden.element_size(), device, budget)
    chunks = -(-N // per_chunk)
    fused = reduction != "none" and dtype != F16
    reduces = int(need_h and grad_needed)
    check_calls(c, "forward", fwd, chunks, reduces if fused else 0)
    check_calls(c, "backward", bwd, 0, 0 if fused else reduces)
    c.check("plan chunks", lambda: check_equal(
        "plan", plan.details["chunks"].split(";")[0], f"{chunks} x {per_chunk} tokens"))
    c.check("loss dtype and shape", lambda: check_equal(
        "loss", (loss.dtype, tuple(loss.shape)), (F32, (N,) if reduction == "none" else ())))
    c.check("autograd graph", lambda: check_equal(
        "loss.grad_fn is None", loss.grad_fn is None, not grad_needed))
    labels = [label for label, t, need in (("dh", h, need_h), ("dw", w, need_w),
                                           ("db", b, need_w))
              if t is not None and need and grad_needed]
    got = dict(zip(labels, grads, strict=True))
    for path, (w_loss, *w_grads) in want.items():
        src = path if path == "float64" else f"single-GPU {path}"
        c.close(f"loss vs {src}", f"loss~{path}", loss.detach(), w_loss, F32)
        for label, w_grad in zip(("dh", "dw", "db"), w_grads, strict=False):
            if label in got:
                c.close(f"{label} vs {src}", f"{label}~{path}", got[label], w_grad, dtype)
    if grad_needed and need_h:  # one all-reduce: the same bits on every rank
        every = [torch.empty_like(got["dh"]) for _ in range(world)]
        dist.all_gather(every, got["dh"].contiguous(), group=group)
        for other, dh in enumerate(every):
            c.same_bits(f"hidden grad of rank {other} = rank {r}'s", dh, got["dh"])


def linear_section(run: Runner, world: int, groups: dict[str, Any],
                   device: torch.device) -> None:
    runs = [((*case, {}), groups["world"], "") for case in LINEAR_CASES]
    runs += [(case, groups["world"], "") for case in LINEAR_EXTRA]
    if world == 4:
        runs += [(case, groups["pair"], " pairs") for case in LINEAR_PAIRS]
    for n, ((size, dtype, reduction, option, bias, rows, kw), group, label) in enumerate(runs):
        N, H, V_local = shape(LINEAR_SIZES, size, device)
        if rows is not None and device.type != "cuda":  # the same number of chunks, about
            rows = max(2, rows * N // LINEAR_SIZES[size][0][0])
        tp = dist.get_world_size(group)
        name = (f"linear tp{tp}{label} N={N} H={H} V_local={V_local} {fmt_dtype(dtype)} "
                f"{reduction} {option}{' bias' if bias else ''}"
                f"{f' chunks of {rows}' if rows else ''}"
                + "".join(f" {k}={v}" for k, v in kw.items()))
        run.case("linear", name, functools.partial(
            linear_case, group=group, device=device, seed=2000 + n, size=size, dtype=dtype,
            reduction=reduction, option=option, bias=bias, rows=rows, **kw))


# --- lmfuse.megatron -------------------------------------------------------------------------


class _OneRank:
    """A group of one rank as Megatron's tests pass one (only ``size()``)."""

    @staticmethod
    def size() -> int:
        return 1


ONE_RANK = _OneRank()


def megatron_case(c: Checks, *, group: Any, device: torch.device, seed: int, size: str,
                  dtype: torch.dtype, fn: str, label_smoothing: float) -> None:
    """Megatron's names with ``group``: the per-token loss and its gradient against the same
    name on the whole vocabulary and against Megatron's formula in float64."""
    r, world = dist.get_rank(group), dist.get_world_size(group)
    lead, V_local = shape(MEGATRON_SIZES, size, device)
    g = torch.Generator(device=device).manual_seed(seed)
    full = (torch.randn((*lead, V_local * world), generator=g, device=device) * 2.0).to(dtype)
    target = global_targets(g, lead, V_local, world, None, device)
    dout = upstream(seed, lead, "none", dtype, device)
    cols = slice(r * V_local, (r + 1) * V_local)

    def call(x: torch.Tensor, tp_group: Any) -> torch.Tensor:
        if fn == "fused_vocab_parallel_cross_entropy":
            return megatron.fused_vocab_parallel_cross_entropy(x, target, tp_group)
        return megatron.vocab_parallel_cross_entropy(x, target, label_smoothing, tp_group)

    want = {}
    x1 = full.clone().requires_grad_(True)
    # The whole vocabulary on this rank: a group of one rank (an omitted group means
    # Megatron's parallel_state group, which raises here with several ranks).
    loss1 = call(x1, ONE_RANK)
    (grad1,) = torch.autograd.grad(loss1, x1, dout)
    want["single-GPU"] = (loss1.detach(), grad1[..., cols].clone())
    del x1, loss1, grad1
    x64 = full.double().requires_grad_(True)
    loss64 = vp.megatron_per_token(x64, target, label_smoothing)
    (grad64,) = torch.autograd.grad(loss64, x64, dout.double())
    want["float64"] = (loss64.detach(), grad64[..., cols].clone())
    del x64, loss64, grad64

    x = full[..., cols].detach().requires_grad_(True)
    with count_collectives() as fwd:
        loss = call(x, group)
    with count_collectives() as bwd:
        (grad,) = torch.autograd.grad(loss, x, dout)
    check_calls(c, "forward", fwd, 1, 0)
    check_calls(c, "backward", bwd, 0, 0)
    c.check("dtypes and shape", lambda: check_equal(
        "loss dtype, shape; grad dtype", (loss.dtype, tuple(loss.shape), grad.dtype),
        (F32, tuple(lead), dtype)))
    for ref, (w_loss, w_grad) in want.items():
        c.close(f"per-token loss vs {ref}", f"loss~{ref}", loss.detach(), w_loss, F32)
        c.close(f"grad vs {ref}", f"grad~{ref}", grad, w_grad, dtype)


def megatron_section(run: Runner, world: int, groups: dict[str, Any],
                     device: torch.device) -> None:
    runs = []
    for i, ((fn, ls), dtype) in enumerate((v, d) for v in MEGATRON_VARIANTS
                                          for d in (F32, F16, BF16)):
        runs.append(("meg" if i % 2 == 0 else "meg_odd", dtype, fn, ls, groups["world"], ""))
    if world == 4:
        runs += [("meg_odd", BF16, *MEGATRON_VARIANTS[0], groups["pair"], " pairs"),
                 ("meg", F32, *MEGATRON_VARIANTS[2], groups["pair"], " pairs")]
    for n, (size, dtype, fn, ls, group, label) in enumerate(runs):
        lead, V_local = shape(MEGATRON_SIZES, size, device)
        name = (f"megatron.{fn} tp{dist.get_world_size(group)}{label} ls={ls} "
                f"N={math.prod(lead)} V_local={V_local} {fmt_dtype(dtype)}")
        run.case("megatron", name, functools.partial(
            megatron_case, group=group, device=device, seed=3000 + n, size=size, dtype=dtype,
            fn=fn, label_smoothing=ls))


# --- main ------------------------------------------------------------------------------------


class VocabRunner(Runner):
    """The decode harness's runner, its summary naming this script."""

    def summary(self, aborted: str | None = None) -> dict[str, Any]:
        return dict(super().summary(aborted), script="tests/gpu/vocab_parallel_nccl.py")


def parse_args() -> Any:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write a JSON summary here (rank 0)")
    ap.add_argument("--backend", default="nccl", help="process group backend (default nccl)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cuda: cuda:LOCAL_RANK (default); cpu: a dry run with --backend gloo "
                         "and TRITON_INTERPRET=1, small shapes")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds a collective (and the per-case exchange) may wait")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"which of {','.join(SECTIONS)} to run")
    ap.add_argument("--filter", default="", help="only cases whose name contains this")
    args = ap.parse_args()
    args.sections = [x for x in args.sections.split(",") if x]
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}")
    return args


def main() -> int:
    args = parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if world not in (2, 4):
        print(f"[rank {rank}] run with 2 or 4 ranks, not {world}", file=sys.stderr)
        return 2
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 GEMMs stay float32
    else:
        device = torch.device("cpu")
        if not interpreter_active():
            print(f"[rank {rank}] --device cpu runs the Triton path in the interpreter: set "
                  f"TRITON_INTERPRET=1", file=sys.stderr)
            return 2
    timeout = datetime.timedelta(seconds=args.timeout)
    extra = {"device_id": device} if args.backend == "nccl" else {}
    dist.init_process_group(args.backend, timeout=timeout, **extra)
    # Every rank creates every group, in one order (new_group is collective over the world).
    status = dist.new_group(backend="gloo", timeout=timeout)
    groups: dict[str, Any] = {"world": dist.group.WORLD}
    if world == 4:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        groups["pair"] = pairs[rank // 2]
    run = VocabRunner(rank, world, status, args, device)
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(f"vocabulary-parallel losses on {world} x {name}, backend {args.backend}, "
              f"torch {torch.__version__}, triton {_triton_version()}", flush=True)
    sections = {"ce": ce_section, "linear": linear_section, "megatron": megatron_section}
    for section in SECTIONS:
        if section in args.sections:
            run.section(section, functools.partial(sections[section], run, world, groups,
                                                   device))
    failed = [r for r in run.results if r["status"] == "FAIL"]
    if rank == 0:
        print(f"{len(run.results) - len(failed)} of {len(run.results)} cases passed on "
              f"{world} ranks in {time.perf_counter() - run.start:.1f} s"
              + (f"; FAILED: {len(failed)}" if failed else ""), flush=True)
    run.write()
    dist.barrier(group=status)
    dist.destroy_process_group()
    return 1 if failed or not run.results else 0


if __name__ == "__main__":
    sys.exit(main())
