"""Vocabulary-parallel cross-entropy (``cross_entropy(..., tp_group=group)``) on gloo ranks.

Every rank builds the same full logits ``[..., V]`` from one seed and keeps its columns
``[r * V_local, (r + 1) * V_local)``. Each rank's loss must equal the single-rank loss on
the full logits (``impl="torch"``, and the float64 reference), and its gradient the
matching columns of the single-rank gradient, for both paths (the Triton one in the
interpreter), float32 and bfloat16 logits, every reduction and option. Around each call
the rank counts collectives: one all-gather in the forward, none in the backward.

Each spawn costs seconds of process start and imports, so one spawn runs a whole sweep
and reports every failing case at once. The loss is float32 whatever the logits' dtype
(float32 math on the same inputs), so it is held to float32's tolerance; gradients are
in the logits' dtype and held to that dtype's.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import assert_close
from spawn import AGREEMENT_CHECKS, Failures, count_collectives, spawn_gloo

import lmfuse
from lmfuse import megatron, tuning
from lmfuse.cross_entropy.reference import cross_entropy_reference

F32, BF16 = torch.float32, torch.bfloat16
LEAD = (3, 4)  # tokens as [s, b]
ALL_GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_single", "allgather",
               "_allgather_base")

# (name, options, rows with ignore_index)
OPTIONS: list[tuple[str, dict[str, Any], bool]] = [
    ("plain", {}, False),
    ("ignore", {}, True),
    ("smoothing", {"label_smoothing": 0.1}, True),
    ("z_loss", {"z_loss": 1e-3}, False),
    ("softcap", {"softcap": 3.0}, True),
    ("all", {"label_smoothing": 0.2, "z_loss": 1e-2, "softcap": 4.0, "ignore_index": -1}, True),
]


def make_inputs(seed: int, V: int, dtype: torch.dtype, ignore_index: int | None,
                shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full logits ``[*LEAD, V]`` and targets, identical on every rank for one seed.

    Targets include the first and last column of every ``shard``-wide block (the edges of
    each rank's columns) and, with ``ignore_index``, three ignored rows.
    """
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn((*LEAD, V), generator=g) * 2.0).to(dtype)
    target = torch.randint(0, V, LEAD, generator=g)
    flat = target.view(-1)
    edges = torch.arange(0, V, shard)
    flat[: len(edges)] = edges
    flat[len(edges): 2 * len(edges)] = edges + shard - 1
    if ignore_index is not None:
        flat[[-4, -2, -1]] = ignore_index
    return logits, target


def upstream(seed: int, reduction: str) -> torch.Tensor:
    """The upstream gradient: per token for ``"none"``, a scalar (not 1) otherwise."""
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(LEAD, generator=g) if reduction == "none" else torch.tensor(0.75)


def single_rank(full: torch.Tensor, target: torch.Tensor, reduction: str, dout: torch.Tensor,
                opts: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                               torch.Tensor]:
    """Loss and gradient on the whole vocabulary: lmfuse's torch path, and float64."""
    x = full.detach().clone().requires_grad_(True)
    loss = lmfuse.cross_entropy(x, target, reduction=reduction, impl="torch", **opts)
    loss.backward(dout)
    x64 = full.detach().double().requires_grad_(True)
    loss64 = cross_entropy_reference(x64, target, reduction=reduction, **opts)
    loss64.backward(dout.double())
    return loss.detach(), x.grad, loss64.detach(), x64.grad


def check_parallel_case(f: Failures, group: Any, *, impl: str, dtype: torch.dtype,
                        reduction: str, option: tuple[str, dict[str, Any], bool],
                        inplace: bool, V_local: int, seed: int,
                        target_dtype: torch.dtype = torch.int64,
                        ignore_all: bool = False) -> None:
    """One case on ``group``: this rank's loss, gradient and collective counts."""
    name, opts, with_ignore = option
    r, world = dist.get_rank(group), dist.get_world_size(group)
    V = V_local * world
    what = (f"{impl} {str(dtype)[6:]} {reduction} {name} inplace={inplace} "
            f"tp={world} V_local={V_local} target {str(target_dtype)[6:]}"
            + (" all ignored" if ignore_all else ""))
    ignore = opts.get("ignore_index", -100) if with_ignore else None
    full, target = make_inputs(seed, V, dtype, ignore, V_local)
    if ignore_all:
        target.fill_(opts.get("ignore_index", -100))
    target = target.to(target_dtype)
    dout = upstream(seed, reduction)
    cols = slice(r * V_local, (r + 1) * V_local)

    if inplace:  # a contiguous non-leaf the gradient can overwrite
        leaf = full[..., cols].clone().requires_grad_(True)
        x = leaf.clone()
    else:  # the strided column slice itself
        leaf = x = full[..., cols].detach().requires_grad_(True)
    with count_collectives() as fwd_calls:
        loss = lmfuse.cross_entropy(x, target, reduction=reduction, tp_group=group,
                                    inplace_backward=inplace, impl=impl, **opts)
    with count_collectives() as bwd_calls:
        loss.backward(dout)

    exp_loss, exp_grad, loss64, grad64 = single_rank(full, target, reduction, dout, opts)

    def compare() -> None:
        assert len(fwd_calls) == 1 and fwd_calls[0] in ALL_GATHERS, (
            f"forward issued {fwd_calls}, expected one all-gather")
        assert bwd_calls == [], f"backward issued {bwd_calls}, expected none"
        assert loss.dtype == F32, loss.dtype
        assert_close(loss, exp_loss, F32, f"{what}: loss vs single rank")
        assert_close(loss, loss64, F32, f"{what}: loss vs float64 reference")
        assert leaf.grad.dtype == dtype, leaf.grad.dtype
        assert_close(leaf.grad, exp_grad[..., cols], dtype, f"{what}: grad vs single rank")
        assert_close(leaf.grad, grad64[..., cols], dtype, f"{what}: grad vs float64")
        if inplace:
            assert_close(x.detach(), exp_grad[..., cols], dtype,
                         f"{what}: gradient written over the logits")

    f.check(what, compare)


def check_single_member_group(f: Failures, group: Any, *, impl: str, dtype: torch.dtype,
                              reduction: str, option: tuple[str, dict[str, Any], bool],
                              seed: int) -> None:
    """A group of one rank holds the whole vocabulary and issues no collective."""
    name, opts, with_ignore = option
    what = f"{impl} {str(dtype)[6:]} {reduction} {name} group of 1"
    ignore = opts.get("ignore_index", -100) if with_ignore else None
    full, target = make_inputs(seed, 12, dtype, ignore, 12)
    dout = upstream(seed, reduction)
    x = full.clone().requires_grad_(True)
    with count_collectives() as calls:
        loss = lmfuse.cross_entropy(x, target, reduction=reduction, tp_group=group, impl=impl,
                                    **opts)
        loss.backward(dout)
    exp_loss, exp_grad, _, _ = single_rank(full, target, reduction, dout, opts)

    def compare() -> None:
        assert calls == [], f"a group of one issued {calls}"
        assert_close(loss, exp_loss, F32, f"{what}: loss")
        assert_close(x.grad, exp_grad, dtype, f"{what}: grad")

    f.check(what, compare)


# --- rank functions ------------------------------------------------------------------------


def _sweep_rank(rank: int, world_size: int) -> None:
    """On 2 ranks every impl x dtype x reduction x option x inplace, and rows streamed in
    chunks; on 4 ranks (slower: two ranks share a core) a lighter sweep, and two groups of
    2 whose group ranks are not the global ranks."""
    f = Failures(rank)
    world = dist.group.WORLD
    if world_size == 2:
        cases = itertools.product(("triton", "torch"), (F32, BF16), ("mean", "sum", "none"),
                                  OPTIONS, (False, True))
        for i, (impl, dtype, reduction, option, inplace) in enumerate(cases):
            check_parallel_case(f, world, impl=impl, dtype=dtype, reduction=reduction,
                                option=option, inplace=inplace, V_local=6, seed=1000 + i)
        # Rows longer than one block: the kernels stream them in chunks (see ops._config).
        streamed = tuning.table("cross_entropy", torch.device("cpu"))["max_single_block"] + 1
        for i, (dtype, reduction) in enumerate([(F32, "none"), (BF16, "mean")]):
            check_parallel_case(f, world, impl="triton", dtype=dtype, reduction=reduction,
                                option=OPTIONS[-1], inplace=False, V_local=streamed,
                                seed=3000 + i)
    else:
        cases = itertools.product(("triton", "torch"), (F32, BF16), ("mean", "sum", "none"),
                                  (OPTIONS[1], OPTIONS[-1]))
        for i, (impl, dtype, reduction, option) in enumerate(cases):
            check_parallel_case(f, world, impl=impl, dtype=dtype, reduction=reduction,
                                option=option, inplace=i % 3 == 0, V_local=5, seed=1000 + i)
        # new_group is collective over the world: every rank creates both, in one order.
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        for i, (impl, reduction) in enumerate(itertools.product(("triton", "torch"),
                                                                ("mean", "none"))):
            check_parallel_case(f, pairs[rank // 2], impl=impl, dtype=F32,
                                reduction=reduction, option=OPTIONS[-1], inplace=False,
                                V_local=7, seed=2000 + i)
    f.raise_if_any()


def megatron_per_token(full: torch.Tensor, target: torch.Tensor,
                       label_smoothing: float) -> torch.Tensor:
    """Megatron-Core's vocab_parallel_cross_entropy formula, float64, whole vocabulary."""
    V = full.shape[-1]
    log_probs = torch.log_softmax(full.double(), dim=-1)
    nll = -log_probs.gather(-1, target[..., None])[..., 0]
    if label_smoothing == 0:
        return nll
    smoothing = label_smoothing * V / (V - 1)
    return (1.0 - smoothing) * nll - smoothing * log_probs.mean(dim=-1)


def _megatron_and_edges_rank(rank: int, world_size: int) -> None:
    """Megatron's names on the world group, groups of one rank, int32 targets, all-ignored
    and empty batches, and targets outside the vocabulary."""
    f = Failures(rank)
    world = dist.group.WORLD
    V_local = 6
    V = V_local * world_size
    cols = slice(rank * V_local, (rank + 1) * V_local)

    calls_by_name = {
        "fused_vocab_parallel_cross_entropy": lambda x, t, ls: (
            megatron.fused_vocab_parallel_cross_entropy(x, t, world)),
        "vocab_parallel_cross_entropy": lambda x, t, ls: (
            megatron.vocab_parallel_cross_entropy(x, t, ls, world)),
    }
    variants = [("fused_vocab_parallel_cross_entropy", 0.0),
                ("vocab_parallel_cross_entropy", 0.0), ("vocab_parallel_cross_entropy", 0.1)]
    for i, ((name, ls), dtype) in enumerate(itertools.product(variants, (F32, BF16))):
        what = f"megatron.{name} ls={ls} {str(dtype)[6:]}"
        full, target = make_inputs(4000 + i, V, dtype, None, V_local)
        dout = upstream(4000 + i, "none")
        x = full[..., cols].detach().requires_grad_(True)
        with count_collectives() as fwd_calls:
            loss = calls_by_name[name](x, target, ls)
        with count_collectives() as bwd_calls:
            loss.backward(dout)
        x64 = full.detach().double().requires_grad_(True)
        expected = megatron_per_token(x64, target, ls)
        expected.backward(dout.double())

        def compare(loss=loss, x=x, expected=expected, x64=x64, fwd_calls=fwd_calls,
                    bwd_calls=bwd_calls, what=what, dtype=dtype) -> None:
            assert len(fwd_calls) == 1 and fwd_calls[0] in ALL_GATHERS, fwd_calls
            assert bwd_calls == [], bwd_calls
            assert loss.shape == LEAD, f"{what}: shape {tuple(loss.shape)}"
            assert_close(loss, expected.detach(), F32, f"{what}: per-token loss")
            assert_close(x.grad, x64.grad[..., cols], dtype, f"{what}: grad")

        f.check(what, compare)

    # new_group is collective over the world: every rank creates every group, in one order.
    singles = [dist.new_group([r]) for r in range(world_size)]
    for i, (impl, dtype, reduction, option) in enumerate(itertools.product(
            ("triton", "torch"), (F32, BF16), ("mean", "none"), (OPTIONS[0], OPTIONS[-1]))):
        check_single_member_group(f, singles[rank], impl=impl, dtype=dtype,
                                  reduction=reduction, option=option, seed=5000 + i)

    # int32 targets; a batch whose every token is ignored ("mean" is then 0, gradients 0).
    for i, (impl, reduction) in enumerate(itertools.product(("triton", "torch"),
                                                            ("mean", "none"))):
        check_parallel_case(f, world, impl=impl, dtype=F32, reduction=reduction,
                            option=OPTIONS[-1], inplace=False, V_local=V_local,
                            seed=7000 + i, target_dtype=torch.int32)
        check_parallel_case(f, world, impl=impl, dtype=BF16, reduction=reduction,
                            option=OPTIONS[2], inplace=False, V_local=V_local,
                            seed=7100 + i, ignore_all=True)

    # An empty batch: empty or zero loss, an empty gradient, on every rank.
    for impl, reduction in itertools.product(("triton", "torch"), ("mean", "sum", "none")):
        x = torch.randn(0, V_local, requires_grad=True)
        loss = lmfuse.cross_entropy(x, torch.zeros(0, dtype=torch.long), reduction=reduction,
                                    tp_group=world, impl=impl)
        loss.sum().backward()

        def empty(loss=loss, x=x, reduction=reduction) -> None:
            assert loss.shape == ((0,) if reduction == "none" else ()), loss.shape
            assert reduction == "none" or loss.item() == 0.0, loss
            assert x.grad is not None and x.grad.shape == (0, V_local), x.grad

        f.check(f"{impl} {reduction} empty batch", empty)

    # Targets outside the global vocabulary raise on every rank, before any collective.
    # A target in another rank's columns is fine (the sweeps have them on every rank).
    for impl, bad in itertools.product(("triton", "torch"), (V, V + 7, -3)):
        what = f"{impl} target {bad}"
        full, target = make_inputs(6000, V, F32, None, V_local)
        target.view(-1)[5] = bad
        x = full[..., cols].detach().requires_grad_(True)

        def raises(x=x, target=target, impl=impl, bad=bad) -> None:
            with count_collectives() as calls:
                with pytest.raises(ValueError, match=rf"target holds {bad}\b"):
                    lmfuse.cross_entropy(x, target, tp_group=world, impl=impl)
            assert calls == [], f"collectives before the error: {calls}"

        f.check(what, raises)
    f.raise_if_any()


# --- tests ---------------------------------------------------------------------------------


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_parallel_matches_single_rank_with_one_collective(world_size: int) -> None:
    spawn_gloo(world_size, _sweep_rank, timeout=120)


@pytest.mark.timeout(120)
def test_megatron_names_groups_of_one_and_edge_cases() -> None:
    spawn_gloo(2, _megatron_and_edges_rank, timeout=90)


# Row 7 has no finite logit on any rank: its loss is NaN, as F.cross_entropy's, and with
# smoothing and z-loss numpy makes that NaN as -inf + inf (the interpreter's warning is the
# expected NaN arising, nothing else).
@pytest.mark.filterwarnings("ignore:invalid value encountered in add:RuntimeWarning")
@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("mean", [False, True])
@pytest.mark.parametrize("opts", [{}, {"label_smoothing": 0.1, "z_loss": 1e-2}])
def test_merge_kernel_matches_the_reference_merge(world: int, mean: bool,
                                                  opts: dict[str, Any]) -> None:
    """``ce_merge_kernel`` (in the interpreter) against the reference merge and token loss,
    with ranks that hold no finite logit of a row (lse -inf), rows with no finite logit
    anywhere, ignored, bad and edge targets, and more rows than one program's block."""
    from lmfuse.cross_entropy import reference as ref
    from lmfuse.cross_entropy.vocab_parallel import _launch_merge

    n, V = 1500, 50 * world
    g = torch.Generator().manual_seed(world)
    gathered = torch.randn(world, 3, n, generator=g) * 4.0
    gathered[0, 0, ::5] = float("-inf")
    gathered[:, 0, 7] = float("-inf")
    target = torch.randint(0, V, (n,), generator=g)
    target[::11] = -100
    target[1:4] = torch.tensor([V, -3, V - 1])
    count = torch.sum(target != -100, dtype=torch.float32)
    stats = _launch_merge(gathered, target, count, V, -100, opts.get("label_smoothing", 0.0),
                          opts.get("z_loss", 0.0), mean)
    want = ref.merge_token_stats(gathered)
    loss = ref.token_loss(want, target, vocab_size=V, ignore_index=-100,
                          label_smoothing=opts.get("label_smoothing", 0.0),
                          z_loss=opts.get("z_loss", 0.0))
    if mean:
        loss = loss / count
    assert_close(stats[:3], want, F32, "merged stats")
    assert torch.equal(stats[3].isinf(), loss.isinf())
    assert stats[0, 7] == float("-inf") and stats[3, 2] == float("inf")
    finite = loss.isfinite()
    assert_close(stats[3][finite], loss[finite], F32, "token loss")


def _disagreeing_sizes_rank(rank: int, world_size: int) -> None:
    """Shards of different widths (the ranks' columns would be placed at rank * V_local:
    wrong losses, no error) or different token counts (the stats' all-gather would abort
    inside gloo) raise a ValueError on every rank, at an op's first call with the group
    (a sharding set up wrongly); once they have agreed, the op checks that group no more."""
    f = Failures(rank)
    world = dist.group.WORLD
    g = torch.Generator().manual_seed(0)
    for impl in ("triton", "torch"):
        cases = {"uneven vocabulary": (4, 5 - rank, "classes per rank"),
                 "different token counts": (4 + rank, 6, "tokens")}
        for what, (n, v_local, named) in cases.items():
            x = torch.randn(n, v_local, generator=g, requires_grad=True)
            target = torch.zeros(n, dtype=torch.long)

            def raises(x=x, target=target, impl=impl, named=named) -> None:
                with pytest.raises(ValueError, match=rf"cross_entropy: every rank .*{named}"
                                                     r".*rank 0: .*rank 1: "):
                    lmfuse.cross_entropy(x, target, tp_group=world, impl=impl)

            f.check(f"{impl} {what}", raises)
        h = torch.randn(3, 8, generator=g)
        w = torch.randn(5 - rank, 8, generator=g)

        def raises_linear(h=h, w=w, impl=impl) -> None:
            with pytest.raises(ValueError, match="linear_cross_entropy: every rank .*classes"):
                lmfuse.linear_cross_entropy(h, w, torch.zeros(3, dtype=torch.long),
                                            tp_group=world, impl=impl)

        f.check(f"{impl} linear uneven vocabulary", raises_linear)
    # Sizes that agree: checked by the first call only (its check listed apart from the
    # op's one all-gather), then nothing more.
    x = torch.randn(7, 3, generator=g)
    target = torch.zeros(7, dtype=torch.long)
    seen = len(AGREEMENT_CHECKS)
    for _ in range(2):
        with count_collectives() as calls:
            lmfuse.cross_entropy(x, target, tp_group=world)

        def one(calls=calls) -> None:
            assert len(calls) == 1 and calls[0] in ALL_GATHERS, calls

        f.check("agreeing sizes: the op's own all-gather", one)

    def checked_once() -> None:
        assert len(AGREEMENT_CHECKS) == seen + 1, AGREEMENT_CHECKS

    f.check("agreeing sizes: checked once", checked_once)
    f.raise_if_any()


@pytest.mark.timeout(90)
def test_ranks_with_disagreeing_sizes_raise_on_every_rank() -> None:
    spawn_gloo(2, _disagreeing_sizes_rank, timeout=60)
