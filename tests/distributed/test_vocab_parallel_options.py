"""The Liger options with ``tp_group`` (vocabulary parallel) on gloo ranks: class weights
(each rank its ``[V_local]`` shard), ``return_z_loss``, ``return_token_accuracy`` and
``return_predicted_tokens`` on ``cross_entropy`` and ``linear_cross_entropy`` (there also
``use_token_scaling``), both paths (Triton in the interpreter).

Every rank builds the same full inputs from one seed and keeps its columns (its rows of the
projection). Each rank's loss, returned fields and gradients must equal lmfuse's
single-rank results on the full inputs and the float64 reference's. The argmax is global:
each rank's max and first column are combined, the first index among equal maxima, NaN
largest (special rows: ties across ranks, NaN on a later rank, NaN on two ranks, +inf, a
row of -inf). ``cross_entropy``'s forward still issues one collective (the options' rows
ride in the one all-gather), its backward none; ``linear_cross_entropy`` one all-gather per
chunk, plus, with class weights, one all-reduce of two floats before the chunks (the
weighted mean's divisor, which the forward's gradients need from the first chunk on), plus
the hidden gradient's all-reduce.

One spawn per world size runs the whole sweep and reports every failing case at once.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import assert_close
from spawn import Failures, count_collectives, spawn_gloo

import lmfuse
from lmfuse.cross_entropy import CrossEntropyOutput
from lmfuse.cross_entropy.linear import linear_cross_entropy_reference
from lmfuse.cross_entropy.reference import cross_entropy_reference

F32, F64 = torch.float32, torch.float64
IGNORE = -100
ALL_GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_single", "allgather",
               "_allgather_base")
ALL_REDUCES = ("all_reduce", "allreduce")
RETURNS = dict(return_z_loss=True, return_token_accuracy=True, return_predicted_tokens=True)
OPTIONS = dict(label_smoothing=0.1, z_loss=1e-2, softcap=5.0)
# (name, class weights, the three returns)
VARIANTS = [("weights", True, False), ("returns", False, True), ("weights+returns", True, True)]


def fields(out: Any) -> CrossEntropyOutput:
    return out if isinstance(out, CrossEntropyOutput) else CrossEntropyOutput(out)


def compare_outputs(what: str, got: CrossEntropyOutput, want: CrossEntropyOutput,
                    want64: CrossEntropyOutput) -> None:
    """Every field against the single-rank result and the float64 reference."""
    for name in ("loss", "z_loss", "token_accuracy"):
        g, w, w64 = getattr(got, name), getattr(want, name), getattr(want64, name)
        assert (g is None) == (w is None), f"{what}: {name} {g}"
        if g is not None:
            assert g.dtype == F32, f"{what}: {name} dtype {g.dtype}"
            assert_close(g.detach(), w.detach(), F32, f"{what}: {name} vs single rank")
            assert_close(g.detach(), w64.detach().float(), F32, f"{what}: {name} vs float64")
    if want.predicted_tokens is not None:
        assert torch.equal(got.predicted_tokens, want.predicted_tokens), (
            f"{what}: predicted {got.predicted_tokens} != {want.predicted_tokens}")
        assert torch.equal(got.predicted_tokens, want64.predicted_tokens), what
    else:
        assert got.predicted_tokens is None, what


# --- cross_entropy ---------------------------------------------------------------------


def ce_inputs(seed: int, V_local: int, world: int):
    """Full logits ``[12, V]`` (targets at every shard's edges, three ignored), the class
    weights ``[V]`` in [0.2, 2.2], and a tie for the max across the first and last shard
    in row 4 (its target the tie's second column: predicted wrong)."""
    V = V_local * world
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn((12, V), generator=g) * 2.0
    target = torch.randint(0, V, (12,), generator=g)
    edges = torch.arange(0, V, V_local)
    target[: world] = edges
    target[world: 2 * world] = edges + V_local - 1
    target[[-4, -2, -1]] = IGNORE
    logits[-3] *= 4.0  # a sharp row: some tokens predicted right
    target[-3] = int(logits[-3].argmax())
    logits[4, [1, V - 2]] = logits[4].max() + 1.0
    target[4] = V - 2
    weight = torch.rand((V,), generator=g) * 2.0 + 0.2
    return logits, target, weight


def check_ce_case(f: Failures, group: Any, *, impl: str, reduction: str,
                  variant: tuple[str, bool, bool], V_local: int, seed: int) -> None:
    name, weighted, returns = variant
    r, world = dist.get_rank(group), dist.get_world_size(group)
    what = f"cross_entropy {impl} {reduction} {name} tp={world}"
    full, target, weight = ce_inputs(seed, V_local, world)
    cols = slice(r * V_local, (r + 1) * V_local)
    kw = dict(OPTIONS, reduction=reduction, impl=impl, **(RETURNS if returns else {}))
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn((12,), generator=g) if reduction == "none" else torch.tensor(0.75)

    x = full[:, cols].clone().requires_grad_(True)
    with count_collectives() as fwd_calls:
        out = fields(lmfuse.cross_entropy(x, target, tp_group=group,
                                          weight=weight[cols] if weighted else None, **kw))
    with count_collectives() as bwd_calls:
        out.loss.backward(dout)
    x1 = full.clone().requires_grad_(True)
    want = fields(lmfuse.cross_entropy(x1, target, weight=weight if weighted else None, **kw))
    want.loss.backward(dout)
    x64 = full.double().requires_grad_(True)
    kw64 = {k: v for k, v in kw.items() if k != "impl"}
    want64 = fields(cross_entropy_reference(x64, target, **kw64,
                                            weight=weight.double() if weighted else None))
    want64.loss.backward(dout.double())

    def compare() -> None:
        assert len(fwd_calls) == 1 and fwd_calls[0] in ALL_GATHERS, (
            f"forward issued {fwd_calls}, expected one all-gather")
        assert bwd_calls == [], f"backward issued {bwd_calls}, expected none"
        compare_outputs(what, out, want, want64)
        if returns:
            assert out.predicted_tokens[4] == 1, out.predicted_tokens  # the tie's first
        assert_close(x.grad, x1.grad[:, cols], F32, f"{what}: grad vs single rank")
        assert_close(x.grad, x64.grad[:, cols].float(), F32, f"{what}: grad vs float64")

    f.check(what, compare)


def special_rows(V_local: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[7, V] logits, one argmax case a row: 0 equal maxima on the first and last shard,
    1 a NaN on the last shard only, 2 NaN on the last two shards (the earlier wins),
    3 +inf on two shards, 4 every logit -inf (column 0), 5 -inf but one column on the last
    shard, 6 the max at the last column."""
    V = V_local * world
    g = torch.Generator().manual_seed(world)
    x = torch.randn((7, V), generator=g)
    x[0, [2, V - 3]] = 9.0
    x[1, V - 1] = float("nan")
    x[2, [V - V_local - 1, V - 2]] = float("nan")
    x[3, [V_local + 1, V - 1]] = float("inf")
    x[4] = float("-inf")
    x[5] = float("-inf")
    x[5, V - 2] = 0.0
    x[6, V - 1] = 9.0
    return x, torch.tensor([2, 0, 0, 0, 0, V - 2, V - 1])


def check_special_predictions(f: Failures, group: Any, *, impl: str, V_local: int) -> None:
    """Forward only: the global argmax of the special rows is ``torch.argmax``'s."""
    r, world = dist.get_rank(group), dist.get_world_size(group)
    what = f"cross_entropy {impl} special rows tp={world}"
    full, target = special_rows(V_local, world)
    cols = slice(r * V_local, (r + 1) * V_local)
    out = lmfuse.cross_entropy(full[:, cols].contiguous(), target, tp_group=group, impl=impl,
                               return_predicted_tokens=True, return_token_accuracy=True)
    want = full.argmax(dim=-1)

    def compare() -> None:
        assert torch.equal(out.predicted_tokens, want), (out.predicted_tokens, want)
        assert out.token_accuracy.item() == pytest.approx((want == target).float().mean())

    f.check(what, compare)


# --- linear_cross_entropy --------------------------------------------------------------


N, H = 11, 8
ROWS = 4  # tokens per chunk: 3 chunks


def linear_inputs(seed: int, V_local: int, world: int):
    V = V_local * world
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn((N, H), generator=g)
    weight = torch.randn((V, H), generator=g)
    bias = torch.randn((V,), generator=g) * 0.5
    target = torch.randint(0, V, (N,), generator=g)
    target[: world] = torch.arange(0, V, V_local)
    target[[5, -1]] = IGNORE
    target[2] = int((hidden[2] @ weight.T + bias).argmax())  # a right guess
    ce_weight = torch.rand((V,), generator=g) * 2.0 + 0.2
    return hidden, weight, bias, target, ce_weight


def check_linear_case(f: Failures, group: Any, *, impl: str, reduction: str, scaling: bool,
                      V_local: int, seed: int) -> None:
    r, world = dist.get_rank(group), dist.get_world_size(group)
    what = f"linear_cross_entropy {impl} {reduction} scaling={scaling} tp={world}"
    hidden, weight, bias, target, ce_weight = linear_inputs(seed, V_local, world)
    rows_of = slice(r * V_local, (r + 1) * V_local)
    kw = dict(OPTIONS, reduction=reduction, impl=impl, use_token_scaling=scaling, **RETURNS)
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn((N,), generator=g) if reduction == "none" else torch.tensor(0.75)
    budget = V_local * 4 * ROWS

    h = hidden.clone().requires_grad_(True)
    w = weight[rows_of].clone().requires_grad_(True)
    b = bias[rows_of].clone().requires_grad_(True)
    with count_collectives() as fwd_calls:
        out = lmfuse.linear_cross_entropy(h, w, target, bias=b, tp_group=group,
                                          ce_weight=ce_weight[rows_of],
                                          max_chunk_bytes=budget, **kw)
    with count_collectives() as bwd_calls:
        out.loss.backward(dout)
    one = [x.clone().requires_grad_(True) for x in (hidden, weight, bias)]
    want = lmfuse.linear_cross_entropy(one[0], one[1], target, bias=one[2],
                                       ce_weight=ce_weight, max_chunk_bytes=budget * world,
                                       **kw)
    want.loss.backward(dout)
    ref = [x.double().requires_grad_(True) for x in (hidden, weight, bias)]
    kw64 = {k: v for k, v in kw.items() if k != "impl"}
    want64 = linear_cross_entropy_reference(ref[0], ref[1], target, bias=ref[2],
                                            ce_weight=ce_weight.double(), **kw64)
    want64.loss.backward(dout.double())
    chunks = math.ceil(N / ROWS)
    fused = reduction != "none"

    def compare() -> None:
        gathers = [c for c in fwd_calls if c in ALL_GATHERS]
        reduces = [c for c in fwd_calls if c in ALL_REDUCES]
        assert len(gathers) == chunks and len(reduces) == 1 + fused, fwd_calls
        assert fwd_calls[0] in ALL_REDUCES, f"the weights' sums first: {fwd_calls}"
        assert len(bwd_calls) == (not fused), bwd_calls
        compare_outputs(what, out, want, want64)
        assert_close(h.grad, one[0].grad, F32, f"{what}: d hidden vs single rank")
        assert_close(h.grad, ref[0].grad.float(), F32, f"{what}: d hidden vs float64")
        for name, mine, single, r64 in (("weight", w, one[1], ref[1]),
                                        ("bias", b, one[2], ref[2])):
            assert_close(mine.grad, single.grad[rows_of], F32, f"{what}: d {name}")
            assert_close(mine.grad, r64.grad[rows_of].float(), F32, f"{what}: d {name} f64")

    f.check(what, compare)


# --- rank function and tests -----------------------------------------------------------


def _options_rank(rank: int, world_size: int) -> None:
    """On 2 ranks every impl x reduction x variant; on 4 (two ranks share a core) a
    lighter sweep. Then the special argmax rows and the linear op's sweep."""
    f = Failures(rank)
    world = dist.group.WORLD
    reductions = ("mean", "sum", "none") if world_size == 2 else ("mean", "none")
    variants = VARIANTS if world_size == 2 else VARIANTS[2:]
    for i, (impl, reduction, variant) in enumerate(itertools.product(
            ("triton", "torch"), reductions, variants)):
        check_ce_case(f, world, impl=impl, reduction=reduction, variant=variant, V_local=6,
                      seed=100 + i)
    for impl in ("triton", "torch"):
        check_special_predictions(f, world, impl=impl, V_local=5)
    cases = itertools.product(("triton", "torch"), ("mean", "none"), (False, True))
    for i, (impl, reduction, scaling) in enumerate(cases):
        if world_size == 4 and scaling != (reduction == "mean"):
            continue
        check_linear_case(f, world, impl=impl, reduction=reduction, scaling=scaling,
                          V_local=5, seed=200 + i)
    f.raise_if_any()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", [2, 4])
def test_options_vocab_parallel_match_single_rank(world_size: int) -> None:
    spawn_gloo(world_size, _options_rank, timeout=120)


# --- the merge kernel alone --------------------------------------------------------------


# Row 7 has no finite logit on any rank (lse -inf): its loss is NaN, and numpy makes that
# NaN as -inf + inf (the interpreter's warning is the expected NaN arising).
@pytest.mark.filterwarnings("ignore:invalid value encountered in add:RuntimeWarning")
@pytest.mark.parametrize("mean", [False, True])
def test_merge_kernel_with_weights_and_argmax(mean: bool) -> None:
    """``ce_merge_kernel`` with ``HAS_WEIGHT`` and ``ARGMAX`` (in the interpreter) against
    the reference merge: weighted loss (smoothing, z-loss; a mean over ``sum w_t`` and the
    count), the argmax from every rank's max and column with ties across ranks, NaN on a
    later rank, NaN on two ranks; more rows than one program's block."""
    from lmfuse.cross_entropy import reference as ref
    from lmfuse.cross_entropy.vocab_parallel import _launch_merge

    world, n, V_local = 3, 1500, 50
    V, ls, z = world * V_local, 0.1, 1e-2
    g = torch.Generator().manual_seed(3)
    parts = torch.randn(world, 6, n, generator=g) * 4.0
    parts[0, 0, ::5] = float("-inf")
    parts[:, 0, 7] = float("-inf")
    target = torch.randint(0, V, (n,), generator=g)
    target[::11] = IGNORE
    owner = torch.div(target.clamp(min=0), V_local, rounding_mode="floor")
    for k in range(world):  # x_t and w_t only on the target's owner
        parts[k, 1] = torch.where(owner == k, parts[k, 1], torch.zeros(n))
        parts[k, 3] = torch.where((owner == k) & (target != IGNORE), parts[k, 3].abs() + 0.2,
                                  torch.zeros(n))
        parts[k, 5] = (k * V_local + torch.randint(0, V_local, (n,), generator=g)).float()
    parts[2, 4, ::3] = parts[0, 4, ::3]  # ties: rank 0's column wins
    parts[1, 4, 1::7] = float("nan")
    parts[2, 4, 1::14] = float("nan")  # NaN on ranks 1 and 2: rank 1's
    w_local = torch.rand(world, generator=g) * 10.0
    gathered = torch.cat([parts.reshape(world, -1), w_local[:, None]], dim=1).contiguous()
    count = torch.sum(target != IGNORE, dtype=F32)
    wt = parts[:, 3].sum(0)
    wstat = torch.stack([w_local.sum(), wt.sum()])
    stats = _launch_merge(gathered, target, count, V, IGNORE, ls, z, mean, wt, wstat, True)

    want = ref.merge_token_stats(parts[:, :3])
    ce, zl = ref.token_terms(want, target, vocab_size=V, ignore_index=IGNORE,
                             label_smoothing=ls, z_loss=z, weight=torch.ones(V_local),
                             target_weight=wt, weight_sum=wstat[0])
    loss = ce / wstat[1] + zl / count if mean else ce + zl
    assert_close(stats[:3], want, F32, "merged stats")
    finite = loss.isfinite()
    assert torch.equal(stats[3].isfinite(), finite)
    assert_close(stats[3][finite], loss[finite], F32, "weighted token loss")
    pred = ref.merge_predictions(parts[:, 4], parts[:, 5])
    assert torch.equal(stats[4].long(), pred)
    assert (pred[1::14] == parts[1, 5, 1::14].long()).all()  # the first NaN's rank
    ties = torch.arange(n)[::3]
    no_nan = ~parts[1:, 4, ::3].isnan().any(0) & (parts[0, 4, ::3] >= parts[1, 4, ::3])
    assert (pred[ties[no_nan]] == parts[0, 5, ties[no_nan]].long()).all()
