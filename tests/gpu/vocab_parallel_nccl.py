"""Vocabulary-parallel losses on NCCL ranks: ``cross_entropy(..., tp_group=group)``,
``linear_cross_entropy(..., tp_group=group)`` and ``lmfuse.megatron``'s
``vocab_parallel_cross_entropy`` / ``fused_vocab_parallel_cross_entropy``, the checks of
``tests/distributed/test_vocab_parallel_ce.py``, ``test_linear_cross_entropy_tp.py`` and
``test_vocab_parallel_options.py`` (gloo, CPU tensors) on 2 or 4 GPUs, one per rank
(``cuda:LOCAL_RANK``), at GPU sizes::

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
* ``options`` (every name holds "opt": ``--filter opt`` runs them alone): the loss options
  added later, as ``test_vocab_parallel_options.py`` checks them on gloo, through the
  ``ce`` and ``linear`` cases above with an ``OPT_VARIANTS`` variant: class weights
  (``weight=``, ``ce_weight=``: the single GPU gets the whole ``[V]``, rank ``r`` its
  ``[V_local]`` share, as both docstrings ask under ``tp_group``; the whole ``[V]`` on a
  rank must raise ``ValueError``), ``return_z_loss``, ``return_token_accuracy`` and
  ``return_predicted_tokens``, alone and together (the returned ``CrossEntropyOutput``'s
  fields, present as asked, against the single-GPU ones: z-loss and accuracy at float32's
  tolerance, predicted tokens equal), and ``linear_cross_entropy``'s
  ``use_token_scaling``; every reduction and dtype, both parallel paths, streamed rows,
  int32 targets, all ignored, on 4 ranks the pairs. A third of the tokens has its argmax
  as its target (an accuracy near 1/3, not 1/V) and one a tie for its max across the first
  and the last rank's share (the first column must win); and the gloo module's special
  rows (NaN on one or two ranks, +-inf, ties), a forward, against ``torch.argmax``.
  ``linear_cross_entropy``'s ranks and single GPU round the logits in GEMMs of their
  own: there a predicted token may differ by a near tie (both columns within the dtype's
  tolerance of the row's largest float64 logit), at most 1% of them, and the accuracy by
  their share (printed as "flips"). Collectives: cross_entropy's still one all-gather
  (the options' rows ride in it); linear_cross_entropy's with class weights one
  all-reduce of their two sums (a weighted mean's divisor) before the chunks'
  all-gathers, with or without gradients.

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
``--sections ce,linear,megatron,options`` and ``--filter TEXT`` (case names) pick cases.

Dry run on the CPU (gloo ranks, Triton interpreter; small shapes, the same cases)::

    TRITON_INTERPRET=1 torchrun --nproc_per_node 2 tests/gpu/vocab_parallel_nccl.py \\
        --backend gloo --device cpu

(108 cases on 2 ranks, 118 on 4, each run well under a minute; ``--filter opt``: 38 and
41 of them.)
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
import test_vocab_parallel_options as vo  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from helpers import tol  # noqa: E402
from sharded_decode_nccl import Checks, Runner, _triton_version, fmt_dtype  # noqa: E402
from spawn import count_collectives  # noqa: E402

import lmfuse  # noqa: E402
from lmfuse import megatron  # noqa: E402
from lmfuse._dispatch import interpreter_active  # noqa: E402
from lmfuse.cross_entropy import CrossEntropyOutput, plan_linear_cross_entropy  # noqa: E402
from lmfuse.cross_entropy.linear import linear_cross_entropy_reference  # noqa: E402
from lmfuse.cross_entropy.linear_config import chunk_rows  # noqa: E402

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
I32, I64 = torch.int32, torch.int64
SECTIONS = ("ce", "linear", "megatron", "options")
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

# The loss options added later (the gloo module test_vocab_parallel_options.py's): name ->
# (class weights, fields returned, use_token_scaling). Fields: "z" return_z_loss, "acc"
# return_token_accuracy, "pred" return_predicted_tokens. Token scaling is
# linear_cross_entropy's alone.
RETURN_FLAGS = {"z": "return_z_loss", "acc": "return_token_accuracy",
                "pred": "return_predicted_tokens"}
ALL_RETURNS = ("z", "acc", "pred")
OPT_VARIANTS = {
    "weight": (True, (), False),
    "ret_z": (False, ("z",), False),
    "ret_acc": (False, ("acc",), False),
    "ret_pred": (False, ("pred",), False),
    "returns": (False, ALL_RETURNS, False),
    "weight+returns": (True, ALL_RETURNS, False),
    "scaling": (False, (), True),
    "weight+returns+scaling": (True, ALL_RETURNS, True),
}
# As CE_EXTRA, the variant before the keyword arguments of ce_case. The options' rows ride
# in the one all-gather; every CE_SIZES size, so the single-block and streamed kernels.
CE_OPT_CASES = [
    ("sweep", F32, "mean", "smoothing", False, "weight", {}),
    ("sweep", BF16, "sum", "all", True, "weight", {}),
    ("sweep", F16, "none", "ignore", False, "weight", {}),
    ("sweep", F32, "none", "z_loss", True, "ret_z", {}),
    ("sweep", F16, "mean", "all", False, "ret_z", {}),
    ("sweep", BF16, "sum", "softcap", False, "ret_acc", {}),
    ("sweep", BF16, "none", "all", False, "ret_pred", {}),
    ("sweep", F16, "mean", "plain", True, "ret_pred", {}),
    ("one", F32, "mean", "all", False, "weight+returns", {}),
    ("mid", BF16, "mean", "all", True, "weight+returns", {}),
    ("mid", F16, "sum", "all", False, "weight+returns", {}),
    ("mid", F32, "none", "all", False, "weight+returns", {}),
    ("wide", BF16, "none", "z_loss", True, "returns", {}),
    ("llama", BF16, "mean", "all", False, "weight+returns", {}),
    ("llama", F16, "none", "smoothing", True, "weight+returns", {}),
    ("sweep", BF16, "mean", "all", False, "weight+returns", {"impl": "torch"}),
    ("mid", F32, "none", "all", True, "weight+returns", {"impl": "torch"}),
    ("sweep", F32, "mean", "all", False, "weight+returns", {"ignore_all": True}),
    ("mid", BF16, "sum", "all", False, "weight+returns", {"target_dtype": I32}),
]
CE_OPT_PAIRS = [
    ("sweep", BF16, "mean", "all", False, "weight+returns", {}),
    ("mid", F32, "none", "smoothing", True, "weight+returns", {}),
]
# The argmax's special rows (ties across ranks, NaN, +-inf; the gloo module's), forward
# only: (dtype, impl, the CE_SIZES size whose V_local they take; "llama": streamed rows).
SPECIAL_CASES = [(F32, "triton", "mid"), (BF16, "triton", "llama"), (F32, "torch", "mid")]
# As LINEAR_EXTRA, the variant before the keyword arguments of linear_case. No bf16 "odd"
# with the argmax: its GEMM rounds a few logits apart on V_local and V columns (above).
LINEAR_OPT_CASES = [
    ("small", BF16, "mean", "all+ignore", True, None, "weight", {}),
    ("small", F16, "sum", "plain", False, None, "weight", {}),
    ("small", F32, "none", "all+ignore", True, None, "weight", {}),
    ("small", BF16, "none", "z_loss", False, None, "returns", {}),
    ("small", F32, "sum", "all+ignore", True, None, "returns", {}),
    ("small", F16, "mean", "smoothing", True, None, "scaling", {}),
    ("small", BF16, "sum", "softcap", False, None, "scaling", {}),
    ("small", F32, "none", "all+ignore", False, None, "scaling", {}),
    ("mid", BF16, "mean", "all+ignore", True, 256, "weight+returns+scaling", {}),
    ("mid", F16, "none", "all+ignore", True, None, "weight+returns+scaling", {}),
    ("mid", F32, "mean", "all+ignore", False, 256, "weight+returns+scaling", {}),
    ("large", BF16, "sum", "all+ignore", True, None, "weight+returns+scaling", {}),
    ("small", BF16, "mean", "all+ignore", True, 128, "weight+returns+scaling",
     {"impl": "torch"}),
    ("small", F16, "mean", "all+ignore", True, None, "weight+returns",
     {"needs": (True, False)}),
    ("small", BF16, "none", "all+ignore", True, 128, "weight+returns+scaling",
     {"needs": (False, True)}),
    ("odd", F32, "mean", "all+ignore", True, None, "weight+returns+scaling",
     {"no_grad": True}),
]
LINEAR_OPT_PAIRS = [
    ("small", BF16, "mean", "all+ignore", True, 128, "weight+returns+scaling", {}),
]


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


def check_sequence(c: Checks, what: str, calls: list[str], want: list[str]) -> None:
    """``calls`` are the collectives of ``want`` ("all-gather", "all-reduce"), in its order
    (class weights put an all-reduce before linear_cross_entropy's all-gathers)."""
    kinds = ["all-gather" if x in vp.ALL_GATHERS else "all-reduce" if x in lp.ALL_REDUCES
             else x for x in calls]
    c.check(f"{what} collectives", lambda: check_equal(f"{what} issued {calls}", kinds, want))


# --- the loss options (section "options") --------------------------------------------------


def variant_options(variant: str | None) -> tuple[bool, dict[str, bool], bool]:
    """``(class weights, the return_* flags, use_token_scaling)`` of an ``OPT_VARIANTS``
    name; none of them for ``None`` (the other sections' cases)."""
    weighted, returns, scaling = OPT_VARIANTS[variant] if variant else (False, (), False)
    return weighted, {RETURN_FLAGS[k]: True for k in returns}, scaling


def class_weights(g: torch.Generator, V: int, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """Class weights ``[V]`` in [0.2, 2.2] (the gloo module's), in the inputs' dtype as a
    model would keep them (the ops use them in float32)."""
    return (torch.rand((V,), generator=g, device=device) * 2.0 + 0.2).to(dtype)


def predict_some(target: torch.Tensor, world: int, ignore: int, argmax_of: Any) -> None:
    """Every third token from ``2 * world`` on (past those with the shards' edge ids) that is
    not ignored gets its argmax ``argmax_of(idx)`` as its target, in place: predicted right,
    so that the token accuracy is near 1/3, not near 1/V."""
    flat = target.view(-1)
    if flat.numel() <= 2 * world:
        return
    idx = torch.arange(2 * world, flat.numel(), 3, device=flat.device)
    idx = idx[flat[idx] != ignore]
    if idx.numel():
        flat[idx] = argmax_of(idx).to(flat.dtype)


def tie_row(n: int, world: int) -> int | None:
    """The token given a tie for its max across the first and the last rank's share
    (columns 1 and V - 2) and the second column as its target (predicted wrong: the first
    maximum wins, as ``torch.argmax``'s); None where there are too few tokens."""
    row = 2 * world + 1  # (not one of predict_some's)
    return row if row < n else None


def check_fields(c: Checks, out: Any, flags: dict[str, bool], reduction: str,
                 lead: tuple[int, ...]) -> CrossEntropyOutput:
    """``out`` as returned: the loss alone without ``return_*`` flags, else a
    ``CrossEntropyOutput`` with just the fields asked for (the z-loss and the accuracy
    float32 and reduced as the loss, the predicted tokens int64 per token, none of them
    differentiable). ``out`` as a ``CrossEntropyOutput``."""
    def run() -> None:
        if not flags:
            assert isinstance(out, torch.Tensor), f"returned a {type(out).__name__}"
            return
        assert isinstance(out, CrossEntropyOutput), f"returned a {type(out).__name__}"
        reduced = tuple(lead) if reduction == "none" else ()
        for name, flag, dtype, shp in (("z_loss", "return_z_loss", F32, reduced),
                                       ("token_accuracy", "return_token_accuracy", F32,
                                        reduced),
                                       ("predicted_tokens", "return_predicted_tokens", I64,
                                        tuple(lead))):
            t = getattr(out, name)
            if not flags.get(flag):
                assert t is None, f"{name} returned, not asked for"
                continue
            assert t is not None, f"{name} asked for, not returned"
            check_equal(f"{name} dtype, shape, requires_grad",
                        (t.dtype, tuple(t.shape), t.requires_grad), (dtype, shp, False))

    c.check("returned fields", run)
    return vo.fields(out)


def near_ties(got: torch.Tensor, want: torch.Tensor, near: Any,
              dtype: torch.dtype) -> torch.Tensor:
    """``[N]`` bool: the tokens whose predictions ``got`` and ``want`` differ only by a near
    tie, both columns within ``tol(dtype)`` of the row's largest float64 logit (``near(idx)``
    gives tokens ``idx``'s ``[len(idx), V]``): a flip that the GEMMs' own rounding of the
    logits can make. None of them without ``near``."""
    g, w = got.reshape(-1), want.reshape(-1)
    excused = torch.zeros(g.shape, dtype=torch.bool, device=g.device)
    idx = ((g != w) & (g >= 0) & (w >= 0)).nonzero()[:, 0]
    if near is None or not idx.numel():
        return excused
    x = near(idx)
    top = x.amax(dim=-1)
    window = tol(dtype) * x.abs().amax(dim=-1)
    a, b = x.gather(1, g[idx, None])[:, 0], x.gather(1, w[idx, None])[:, 0]
    excused[idx] = (top - a <= window) & (top - b <= window)
    return excused


def check_extras(c: Checks, got: CrossEntropyOutput, want: dict[str, CrossEntropyOutput],
                 reduction: str, count: int, near: Any = None,
                 dtype: torch.dtype = F32) -> None:
    """The returned fields against every single-GPU answer of ``want`` (by path; "float64":
    the reference): the z-loss and the accuracy within float32's tolerance, the predicted
    tokens equal. With ``near`` (linear_cross_entropy, whose ranks and single GPU each round
    their own GEMM's logits) a token may differ by a near tie (:func:`near_ties`), at most
    1% of them, and the accuracy by those tokens' share of the ``count`` counted ones; the
    share flipped is noted as the error "flips". cross_entropy's ranks read the single
    GPU's logits bit for bit: no token may differ."""
    for path, w in want.items():
        src = path if path == "float64" else f"single-GPU {path}"
        if got.z_loss is not None:
            c.close(f"z_loss vs {src}", f"zloss~{path}", got.z_loss, w.z_loss, F32)
        excused: dict[str, torch.Tensor] = {}

        def predictions(w: CrossEntropyOutput = w, excused: dict = excused) -> None:
            g, x = got.predicted_tokens.reshape(-1), w.predicted_tokens.reshape(-1)
            excused["mask"] = ex = near_ties(g, x, near, dtype)
            wrong = (g != x) & ~ex
            at = wrong.nonzero()[:4, 0]
            assert not wrong.any(), (f"{int(wrong.sum())} of {g.numel()} tokens differ, at "
                                     f"{at.tolist()}: {g[at].tolist()} != {x[at].tolist()}")
            limit = 1 + g.numel() // 100
            assert int(ex.sum()) <= limit, f"{int(ex.sum())} near ties flipped (> {limit})"

        if got.predicted_tokens is not None:
            c.check(f"predicted tokens vs {src}", predictions)
            if near is not None and "mask" in excused:
                c.errors[f"flips~{path}"] = (float(excused["mask"].float().mean()), 0.01)
        if got.token_accuracy is None:
            continue
        ex = excused.get("mask")
        what = f"token accuracy vs {src}"
        if ex is None or not ex.any():
            c.close(what, f"acc~{path}", got.token_accuracy, w.token_accuracy, F32)
        elif reduction == "none":  # the other tokens' 1.0 and 0.0
            c.close(what, f"acc~{path}", got.token_accuracy.reshape(-1)[~ex],
                    w.token_accuracy.reshape(-1)[~ex], F32)
        else:
            def accuracy(w: CrossEntropyOutput = w, ex: torch.Tensor = ex) -> None:
                diff = float((got.token_accuracy - w.token_accuracy).abs())
                limit = int(ex.sum()) / max(count, 1) + tol(F32) * float(w.token_accuracy)
                assert diff <= limit, f"{what}: differs by {diff:.3e} > {limit:.3e}"

            c.check(what, accuracy)


def check_refused(c: Checks, what: str, call: Any, match: str) -> None:
    """``call()`` raises a ``ValueError`` saying ``match`` (in the argument checks, before
    any collective)."""
    def run() -> None:
        try:
            call()
        except ValueError as e:
            assert match in str(e), f"ValueError({str(e)!r}) does not say {match!r}"
            return
        raise AssertionError("no ValueError")

    c.check(what, run)


# --- cross_entropy(tp_group=...) -------------------------------------------------------------


def ce_case(c: Checks, *, group: Any, device: torch.device, seed: int, size: str,
            dtype: torch.dtype, reduction: str, option: str, inplace: bool,
            impl: str = "triton", target_dtype: torch.dtype = I64,
            ignore_all: bool = False, variant: str | None = None) -> None:
    """One ``cross_entropy(..., tp_group=group)`` case on this rank: loss, gradient and
    collectives against the single-GPU answers on the full logits.

    ``variant``: an ``OPT_VARIANTS`` name, the loss options: class weights (the single GPU
    the whole ``[V]``, each rank its ``[V_local]`` share; the whole refused with
    ``tp_group``) and the returned fields, those against the single GPU's too. The argmax
    has tokens predicted right (:func:`predict_some`) and a tie across ranks
    (:func:`tie_row`)."""
    _, opts, with_ignore = CE_OPTIONS[option]
    weighted, flags, _ = variant_options(variant)
    argmax = "return_token_accuracy" in flags or "return_predicted_tokens" in flags
    r, world = dist.get_rank(group), dist.get_world_size(group)
    lead, V_local = shape(CE_SIZES, size, device)
    V = V_local * world
    ignore = opts.get("ignore_index", -100)
    g = torch.Generator(device=device).manual_seed(seed)
    full = (torch.randn((*lead, V), generator=g, device=device) * 2.0).to(dtype)
    target = global_targets(g, lead, V_local, world, ignore if with_ignore else None, device)
    rows, tie = full.view(-1, V), None
    if argmax:
        predict_some(target, world, ignore, lambda idx: rows[idx].argmax(dim=-1))
        tie = tie_row(rows.shape[0], world)
        if tie is not None:
            rows[tie, [1, V - 2]] = rows[tie].max() + 1
            target.view(-1)[tie] = V - 2
    if ignore_all:
        target.fill_(ignore)
    target = target.to(target_dtype)
    cw = class_weights(g, V, dtype, device) if weighted else None
    dout = upstream(seed, lead, reduction, dtype, device)
    cols = slice(r * V_local, (r + 1) * V_local)

    want = {}
    for path in PATHS:
        x = full.clone().requires_grad_(True)
        out = vo.fields(lmfuse.cross_entropy(x, target, reduction=reduction, impl=path,
                                             weight=cw, **flags, **opts))
        (grad,) = torch.autograd.grad(out.loss, x, dout)
        want[path] = (out._replace(loss=out.loss.detach()), grad[..., cols].clone())
        del x, out, grad

    if inplace:  # a contiguous non-leaf the gradient can overwrite
        leaf = full[..., cols].clone().requires_grad_(True)
        x = leaf.clone()
    else:  # the strided column slice itself
        leaf = x = full[..., cols].detach().requires_grad_(True)
    with count_collectives() as fwd:
        out = lmfuse.cross_entropy(x, target, reduction=reduction, tp_group=group,
                                   inplace_backward=inplace, impl=impl,
                                   weight=None if cw is None else cw[cols], **flags, **opts)
    got = check_fields(c, out, flags, reduction, lead)
    loss = got.loss
    with count_collectives() as bwd:
        (grad,) = torch.autograd.grad(loss, leaf, dout)

    # The options' rows ride in the one all-gather.
    check_calls(c, "forward", fwd, 1, 0)
    check_calls(c, "backward", bwd, 0, 0)
    c.check("dtypes and shape", lambda: check_equal(
        "loss dtype, shape; grad dtype", (loss.dtype, tuple(loss.shape), grad.dtype),
        (F32, tuple(lead) if reduction == "none" else (), dtype)))
    for path, (w_out, w_grad) in want.items():
        c.close(f"loss vs single-GPU {path}", f"loss~{path}", loss.detach(), w_out.loss, F32)
        c.close(f"grad vs single-GPU {path}", f"grad~{path}", grad, w_grad, dtype)
    if inplace:
        c.close("gradient written over the logits", "grad~inplace", x.detach(),
                want["triton"][1], dtype)
    if flags:
        count = int((target != ignore).sum())
        check_extras(c, got, {path: w_out for path, (w_out, _) in want.items()}, reduction,
                     count)
    if tie is not None and not ignore_all and got.predicted_tokens is not None:
        c.check("the tie's first column predicted", lambda: check_equal(
            "predicted", int(got.predicted_tokens.view(-1)[tie]), 1))
    if weighted:
        check_refused(c, "a whole [V] weight refused", lambda: lmfuse.cross_entropy(
            full[..., cols], target, tp_group=group, impl=impl, weight=cw), "must be 1-D")


def ce_name(world: int, size: str, device: torch.device, dtype: torch.dtype, reduction: str,
            option: str, inplace: bool, impl: str = "triton", target_dtype: Any = I64,
            ignore_all: bool = False, group: str = "", variant: str | None = None) -> str:
    lead, V_local = shape(CE_SIZES, size, device)
    return (f"ce{' opt' if variant else ''} tp{world}{group} N={math.prod(lead)} "
            f"V_local={V_local} {fmt_dtype(dtype)} {reduction} {option}"
            f"{f' {variant}' if variant else ''}{' inplace' if inplace else ''}"
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
    add_ce_cases(run, "ce", runs, device, 1000)


def add_ce_cases(run: Runner, section: str, runs: list[tuple], device: torch.device,
                 seed: int) -> None:
    """``runs``: ((size, dtype, reduction, option, inplace, ce_case's keywords), group,
    label); seeds from ``seed`` on."""
    for n, ((size, dtype, reduction, option, inplace, kw), group, label) in enumerate(runs):
        tp = dist.get_world_size(group)
        name = ce_name(tp, size, device, dtype, reduction, option, inplace, group=label, **kw)
        run.case(section, name, functools.partial(
            ce_case, group=group, device=device, seed=seed + n, size=size, dtype=dtype,
            reduction=reduction, option=option, inplace=inplace, **kw))


# --- linear_cross_entropy(tp_group=...) ------------------------------------------------------


def linear_case(c: Checks, *, group: Any, device: torch.device, seed: int, size: str,
                dtype: torch.dtype, reduction: str, option: str, bias: bool,
                rows: int | None, impl: str = "triton",
                needs: tuple[bool, bool] = (True, True), no_grad: bool = False,
                variant: str | None = None) -> None:
    """One ``linear_cross_entropy(..., tp_group=group)`` case on this rank: loss, gradients
    and collectives against the single-GPU answers with the whole weight (float32: against
    the float64 reference).

    ``rows``: a chunk budget of that many rows of this rank's logits (None: the tuning
    table's). ``needs``: whether hidden, and weight and bias, need a gradient.
    ``no_grad``: the forward alone, under ``torch.no_grad()``. ``variant``: an
    ``OPT_VARIANTS`` name, the loss options: ``ce_weight`` (the single GPU the whole
    ``[V]``, each rank its ``[V_local]`` share; the whole refused with ``tp_group``), the
    returned fields (those against the single GPU's too) and ``use_token_scaling``. The
    argmax has tokens predicted right (:func:`predict_some`) and a tie across ranks
    (:func:`tie_row`: two equal rows of the weight and bias)."""
    _, opts, with_ignore = LINEAR_OPTIONS[option]
    weighted, flags, scaling = variant_options(variant)
    argmax = "return_token_accuracy" in flags or "return_predicted_tokens" in flags
    if scaling:
        opts = dict(opts, use_token_scaling=True)
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

    def logits64(idx: torch.Tensor) -> torch.Tensor:
        """Tokens ``idx``'s logits, exact (float64) from the rounded inputs."""
        x = hidden[idx].double() @ weight.double().T
        return x if full_bias is None else x + full_bias.double()

    tie = None
    if argmax:
        tie = tie_row(N, world)
        if tie is not None:  # rows 1 and V - 2 alike: both logits near 20, the others ~3
            ht = hidden[tie].double()
            weight[1] = weight[V - 2] = (ht * (20.0 / ht.dot(ht))).to(dtype)
            if bias:
                full_bias[V - 2] = full_bias[1]
            target[tie] = V - 2
        predict_some(target, world, lp.IGNORE, lambda idx: logits64(idx).argmax(dim=-1))
    cw = class_weights(g, V, dtype, device) if weighted else None
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
            out = vo.fields(lmfuse.linear_cross_entropy(
                args[0], args[1], target, bias=args[2] if bias else None,
                reduction=reduction, impl=path, max_chunk_bytes=budget1, ce_weight=cw,
                **flags, **opts))
            grads = torch.autograd.grad(out.loss, args, dout)
        c.check(f"single-GPU {path} collectives", lambda calls=calls: check_equal(
            "tp_group=None issued", calls, []))
        want[path] = (out._replace(loss=out.loss.detach()), grads[0],
                      *(t[own].clone() for t in grads[1:]))
        del args, out, grads
    if dtype == F32:
        # Two float32 answers, each within 1e-5 of the truth, can be 2e-5 apart (hidden's
        # gradient sums the whole vocabulary: 128256 terms on 4 ranks): float32 results are
        # held to the float64 reference instead, as the gloo test holds them.
        args = [t.double().requires_grad_(True) for t in (hidden, weight)]
        if bias:
            args.append(full_bias.double().requires_grad_(True))
        out = vo.fields(linear_cross_entropy_reference(
            args[0], args[1], target, bias=args[2] if bias else None, reduction=reduction,
            ce_weight=None if cw is None else cw.double(), **flags, **opts))
        grads = torch.autograd.grad(out.loss, args, dout.double())
        want = {"float64": (out._replace(loss=out.loss.detach()), grads[0],
                            *(t[own].clone() for t in grads[1:]))}
        del args, out, grads

    need_h, need_w = needs
    h = hidden.clone().requires_grad_(need_h)
    w = weight[own].clone().requires_grad_(need_w)
    b = full_bias[own].clone().requires_grad_(need_w) if bias else None
    kw = dict(bias=b, reduction=reduction, impl=impl, max_chunk_bytes=budget,
              ce_weight=None if cw is None else cw[own], **flags, **opts)
    plan = plan_linear_cross_entropy(h, w, target, tp_group=group, **kw)
    with count_collectives() as fwd, torch.set_grad_enabled(not no_grad):
        out = lmfuse.linear_cross_entropy(h, w, target, tp_group=group, **kw)
    got = check_fields(c, out, flags, reduction, (N,))
    loss = got.loss
    grad_needed = (need_h or need_w) and not no_grad
    inputs = [t for t, need in ((h, need_h), (w, need_w), (b, need_w))
              if t is not None and need]
    with count_collectives() as bwd:
        grads = torch.autograd.grad(loss, inputs, dout) if grad_needed else ()

    # One all-gather of the [3, rows] stats per chunk (the options' rows ride in it); hidden's
    # gradient all-reduced in the forward when the gradients are computed there ("mean"/
    # "sum", not float16), else in the backward (the logits recomputed there). Class
    # weights first all-reduce their two sums (a weighted mean's divisor, which the
    # forward's gradients need from the first chunk on), with or without gradients.
    per_chunk = chunk_rows(N, V_local, hidden.element_size(), device, budget)
    chunks = -(-N // per_chunk)
    fused = reduction != "none" and dtype != F16
    reduces = int(need_h and grad_needed)
    check_sequence(c, "forward", fwd, ["all-reduce"] * weighted + ["all-gather"] * chunks
                   + ["all-reduce"] * (reduces if fused else 0))
    check_sequence(c, "backward", bwd, ["all-reduce"] * (0 if fused else reduces))
    c.check("plan chunks", lambda: check_equal(
        "plan", plan.details["chunks"].split(";")[0], f"{chunks} x {per_chunk} tokens"))
    c.check("loss dtype and shape", lambda: check_equal(
        "loss", (loss.dtype, tuple(loss.shape)), (F32, (N,) if reduction == "none" else ())))
    c.check("autograd graph", lambda: check_equal(
        "loss.grad_fn is None", loss.grad_fn is None, not grad_needed))
    labels = [label for label, t, need in (("dh", h, need_h), ("dw", w, need_w),
                                           ("db", b, need_w))
              if t is not None and need and grad_needed]
    got_grads = dict(zip(labels, grads, strict=True))
    for path, (w_out, *w_grads) in want.items():
        src = path if path == "float64" else f"single-GPU {path}"
        c.close(f"loss vs {src}", f"loss~{path}", loss.detach(), w_out.loss, F32)
        for label, w_grad in zip(("dh", "dw", "db"), w_grads, strict=False):
            if label in got_grads:
                c.close(f"{label} vs {src}", f"{label}~{path}", got_grads[label], w_grad,
                        dtype)
    if flags:
        count = int((target != lp.IGNORE).sum())
        check_extras(c, got, {path: w_out for path, (w_out, *_) in want.items()}, reduction,
                     count, logits64, dtype)
    if tie is not None and got.predicted_tokens is not None:
        # One of the tie's columns: the first only where this rank's and the last one's
        # GEMMs round the two equal rows' logits alike (cross_entropy holds that rule).
        c.check("the tie predicted", lambda: check_equal(
            "predicted in (1, V - 2)", int(got.predicted_tokens[tie]) in (1, V - 2), True))
    if weighted:
        check_refused(c, "a whole [V] ce_weight refused", lambda: lmfuse.linear_cross_entropy(
            h.detach(), w.detach(), target, tp_group=group, bias=None if b is None else
            b.detach(), impl=impl, ce_weight=cw), "must be 1-D")
    if grad_needed and need_h:  # one all-reduce: the same bits on every rank
        every = [torch.empty_like(got_grads["dh"]) for _ in range(world)]
        dist.all_gather(every, got_grads["dh"].contiguous(), group=group)
        for other, dh in enumerate(every):
            c.same_bits(f"hidden grad of rank {other} = rank {r}'s", dh, got_grads["dh"])


def linear_section(run: Runner, world: int, groups: dict[str, Any],
                   device: torch.device) -> None:
    runs = [((*case, {}), groups["world"], "") for case in LINEAR_CASES]
    runs += [(case, groups["world"], "") for case in LINEAR_EXTRA]
    if world == 4:
        runs += [(case, groups["pair"], " pairs") for case in LINEAR_PAIRS]
    add_linear_cases(run, "linear", runs, device, 2000)


def add_linear_cases(run: Runner, section: str, runs: list[tuple], device: torch.device,
                     seed: int) -> None:
    """``runs``: ((size, dtype, reduction, option, bias, rows, linear_case's keywords),
    group, label); seeds from ``seed`` on."""
    for n, ((size, dtype, reduction, option, bias, rows, kw), group, label) in enumerate(runs):
        N, H, V_local = shape(LINEAR_SIZES, size, device)
        if rows is not None and device.type != "cuda":  # the same number of chunks, about
            rows = max(2, rows * N // LINEAR_SIZES[size][0][0])
        tp = dist.get_world_size(group)
        variant = kw.get("variant")
        name = (f"linear{' opt' if variant else ''} tp{tp}{label} N={N} H={H} "
                f"V_local={V_local} {fmt_dtype(dtype)} {reduction} {option}"
                f"{f' {variant}' if variant else ''}{' bias' if bias else ''}"
                f"{f' chunks of {rows}' if rows else ''}"
                + "".join(f" {k}={v}" for k, v in kw.items() if k != "variant"))
        run.case(section, name, functools.partial(
            linear_case, group=group, device=device, seed=seed + n, size=size, dtype=dtype,
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


# --- the loss options: class weights, returned fields, token scaling ------------------------


def special_case(c: Checks, *, group: Any, device: torch.device, size: str,
                 dtype: torch.dtype, impl: str) -> None:
    """The argmax alone (a forward, no gradient) on the gloo module's special rows
    (``special_rows``: equal maxima on the first and the last rank's share, a NaN on the
    last rank, NaN on two ranks, +inf on two, a row of -inf, -inf but one column, the max
    in the last column): the predicted tokens against ``torch.argmax`` of the whole rows
    (on the CPU) and the single-GPU op's, the accuracy against theirs."""
    r, world = dist.get_rank(group), dist.get_world_size(group)
    _, V_local = shape(CE_SIZES, size, device)
    full, target = vo.special_rows(V_local, world)
    full = full.to(dtype)
    want = full.float().argmax(dim=-1)
    right = (want == target).float().mean()
    full, target = full.to(device), target.to(device)
    flags = {"return_predicted_tokens": True, "return_token_accuracy": True}
    cols = slice(r * V_local, (r + 1) * V_local)
    with count_collectives() as fwd:
        out = lmfuse.cross_entropy(full[:, cols].contiguous(), target, tp_group=group,
                                   impl=impl, **flags)
    single = vo.fields(lmfuse.cross_entropy(full, target, impl=impl, **flags))
    check_calls(c, "forward", fwd, 1, 0)
    got = check_fields(c, out, flags, "mean", tuple(target.shape))
    c.check("predicted tokens vs torch.argmax", lambda: check_equal(
        "predicted", got.predicted_tokens.tolist(), want.tolist()))
    c.check("predicted tokens vs single-GPU", lambda: check_equal(
        "predicted", got.predicted_tokens.tolist(), single.predicted_tokens.tolist()))
    c.close("token accuracy vs torch.argmax", "acc~argmax", got.token_accuracy.cpu(), right,
            F32)
    c.close("token accuracy vs single-GPU", f"acc~{impl}", got.token_accuracy,
            single.token_accuracy, F32)


def options_section(run: Runner, world: int, groups: dict[str, Any],
                    device: torch.device) -> None:
    """The loss options on both ops (``ce_case`` and ``linear_case`` with a ``variant``)
    and the argmax's special rows; every name holds "opt" (``--filter opt``)."""
    runs = [((*case[:5], dict(case[6], variant=case[5])), groups["world"], "")
            for case in CE_OPT_CASES]
    if world == 4:
        runs += [((*case[:5], dict(case[6], variant=case[5])), groups["pair"], " pairs")
                 for case in CE_OPT_PAIRS]
    add_ce_cases(run, "options", runs, device, 4000)
    for dtype, impl, size in SPECIAL_CASES:
        group = groups["world"]
        name = (f"ce opt tp{dist.get_world_size(group)} special rows "
                f"V_local={shape(CE_SIZES, size, device)[1]} {fmt_dtype(dtype)}"
                f"{'' if impl == 'triton' else f' impl={impl}'}")
        run.case("options", name, functools.partial(
            special_case, group=group, device=device, size=size, dtype=dtype, impl=impl))
    runs = [((*case[:6], dict(case[7], variant=case[6])), groups["world"], "")
            for case in LINEAR_OPT_CASES]
    if world == 4:
        runs += [((*case[:6], dict(case[7], variant=case[6])), groups["pair"], " pairs")
                 for case in LINEAR_OPT_PAIRS]
    add_linear_cases(run, "options", runs, device, 5000)


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
    sections = {"ce": ce_section, "linear": linear_section, "megatron": megatron_section,
                "options": options_section}
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
