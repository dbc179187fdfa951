"""Vocabulary-parallel ``linear_cross_entropy(..., tp_group=group)`` on gloo ranks.

Every rank builds the same full ``hidden [N, H]``, ``weight [V, H]``, ``bias [V]`` and
global ``target [N]`` from one seed, and passes rows ``[r * V_local, (r + 1) * V_local)``
of weight and bias. Each rank's loss must equal the single-rank loss on the full weight
(lmfuse's same path with ``tp_group=None``, and the float64
``linear_cross_entropy_reference``); ``hidden.grad`` on every rank must be the whole
single-rank hidden gradient (the op all-reduces it), and ``weight.grad`` / ``bias.grad``
rank ``r``'s rows of the single-rank gradients. Both paths (Triton in the interpreter),
every reduction, all the loss options, with and without bias, ignored targets, and a
chunk budget that splits the tokens into several chunks.

Around each call the rank counts collectives: per forward one all-gather of the
``[3, rows]`` stats per chunk; and when hidden needs a gradient one all-reduce of it, in
the forward when the gradients are computed there (``"mean"``/``"sum"``), in the backward
when the logits are recomputed there (``"none"``). ``tp_group=None`` or a group of one
issues none.

Each spawn costs seconds of process start and imports, so one spawn runs a whole sweep
and reports every failing case at once. Inputs and results are float32, held to float32's
tolerance.
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
from lmfuse.cross_entropy import plan_linear_cross_entropy
from lmfuse.cross_entropy.linear import linear_cross_entropy_reference

F32 = torch.float32
N, H = 11, 8
IGNORE = -100
ROWS = 4  # tokens per chunk under the budget below: ceil(11 / 4) = 3 chunks
ALL_GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_single", "allgather",
               "_allgather_base")
ALL_REDUCES = ("all_reduce", "allreduce")

ALL_OPTIONS = {"label_smoothing": 0.1, "z_loss": 1e-2, "softcap": 5.0}
# (name, options, rows with ignore_index)
OPTIONS: list[tuple[str, dict[str, Any], bool]] = [
    ("all+ignore", ALL_OPTIONS, True),
    ("plain", {}, False),
]


def make_inputs(seed: int, V_local: int, world: int, with_ignore: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full ``hidden [N, H]``, ``weight [V, H]``, ``bias [V]``, ``target [N]``, identical on
    every rank for one seed.

    Logits come out with a standard deviation near 3, so softcap 5 bends them. Targets
    include the first and last row of every rank's shard and, with ``with_ignore``, two
    ignored tokens (in the last, partial chunk) and one in the middle chunk.
    """
    V = V_local * world
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn((N, H), generator=g)
    weight = torch.randn((V, H), generator=g)
    bias = torch.randn((V,), generator=g) * 0.5
    target = torch.randint(0, V, (N,), generator=g)
    edges = torch.arange(0, V, V_local)
    target[: world] = edges
    target[world: 2 * world] = edges + V_local - 1
    if with_ignore:
        target[[-3, -1]] = IGNORE
        if world == 2:
            target[5] = IGNORE
    return hidden, weight, bias, target


def upstream(seed: int, reduction: str) -> torch.Tensor:
    """The upstream gradient: per token for ``"none"``, a scalar (not 1) otherwise."""
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn((N,), generator=g) if reduction == "none" else torch.tensor(0.75)


def chunk_budget(V_local: int) -> int:
    """``max_chunk_bytes`` holding ``ROWS`` float32 rows of ``V_local`` logits."""
    return V_local * 4 * ROWS


def check_parallel_case(f: Failures, group: Any, *, impl: str, reduction: str,
                        option: tuple[str, dict[str, Any], bool], use_bias: bool,
                        V_local: int, seed: int, needs: tuple[bool, bool] = (True, True),
                        budget: int | None = -1, no_grad: bool = False,
                        ignore_all: bool = False) -> None:
    """One case on ``group``: this rank's loss, gradients and collective counts.

    ``needs``: whether hidden, and weight (and bias), require grad. ``budget``: the
    ``max_chunk_bytes`` (-1: ``ROWS`` rows per chunk). ``no_grad``: the forward alone,
    under ``torch.no_grad()``. ``ignore_all``: every target ignored (loss and gradients 0).
    """
    name, opts, with_ignore = option
    r, world = dist.get_rank(group), dist.get_world_size(group)
    if budget == -1:
        budget = chunk_budget(V_local)
    what = (f"{impl} {reduction} {name} bias={use_bias} tp={world} V_local={V_local} "
            f"needs={needs} budget={budget}" + (" no_grad" if no_grad else "")
            + (" all ignored" if ignore_all else ""))
    hidden, weight, bias, target = make_inputs(seed, V_local, world, with_ignore)
    if ignore_all:
        target.fill_(IGNORE)
    dout = upstream(seed, reduction)
    rows_of = slice(r * V_local, (r + 1) * V_local)
    need_h, need_w = needs
    grad_needed = (need_h or need_w) and not no_grad

    # This rank's call: the same full hidden, its rows of weight and bias.
    h = hidden.clone().requires_grad_(need_h)
    w = weight[rows_of].clone().requires_grad_(need_w)
    b = bias[rows_of].clone().requires_grad_(need_w) if use_bias else None
    kw = dict(bias=b, reduction=reduction, impl=impl, max_chunk_bytes=budget, **opts)
    plan = plan_linear_cross_entropy(h, w, target, tp_group=group, **kw)
    with count_collectives() as fwd_calls, torch.set_grad_enabled(not no_grad):
        loss = lmfuse.linear_cross_entropy(h, w, target, tp_group=group, **kw)
    with count_collectives() as bwd_calls:
        if grad_needed:
            loss.backward(dout)

    # Single rank, the whole weight: lmfuse's same path, and the float64 reference.
    h1 = hidden.clone().requires_grad_(True)
    w1 = weight.clone().requires_grad_(True)
    b1 = bias.clone().requires_grad_(True) if use_bias else None
    with count_collectives() as single_calls:
        loss1 = lmfuse.linear_cross_entropy(h1, w1, target, bias=b1, reduction=reduction,
                                            impl=impl, max_chunk_bytes=budget, **opts)
        loss1.backward(dout)
    h64 = hidden.double().requires_grad_(True)
    w64 = weight.double().requires_grad_(True)
    b64 = bias.double().requires_grad_(True) if use_bias else None
    loss64 = linear_cross_entropy_reference(h64, w64, target, bias=b64, reduction=reduction,
                                            **opts)
    loss64.backward(dout.double())

    rows = max(1, min(N, (budget or 1 << 40) // (V_local * 4)))
    chunks = math.ceil(N / rows)
    fused = reduction != "none"
    exp_fwd_reduces = int(need_h and grad_needed and fused)
    exp_bwd_reduces = int(need_h and grad_needed and not fused)

    def compare() -> None:
        gathers = [c for c in fwd_calls if c in ALL_GATHERS]
        reduces = [c for c in fwd_calls if c in ALL_REDUCES]
        assert len(gathers) == chunks and len(reduces) == exp_fwd_reduces and (
            len(fwd_calls) == chunks + exp_fwd_reduces), (
            f"forward issued {fwd_calls}, expected {chunks} all-gather(s) and "
            f"{exp_fwd_reduces} all-reduce(s)")
        assert fwd_calls[:chunks] == gathers, f"all-reduce before an all-gather: {fwd_calls}"
        assert len(bwd_calls) == exp_bwd_reduces and all(c in ALL_REDUCES for c in bwd_calls), (
            f"backward issued {bwd_calls}, expected {exp_bwd_reduces} all-reduce(s)")
        assert single_calls == [], f"tp_group=None issued {single_calls}"
        assert plan.details["chunks"].startswith(f"{chunks} x {rows} tokens"), plan.details
        assert loss.dtype == F32, loss.dtype
        assert loss.shape == ((N,) if reduction == "none" else ()), loss.shape
        assert_close(loss.detach(), loss1.detach(), F32, f"{what}: loss vs single rank")
        assert_close(loss.detach(), loss64.detach(), F32, f"{what}: loss vs float64 reference")
        if not grad_needed:
            assert loss.grad_fn is None
            return
        if need_h:
            assert_close(h.grad, h1.grad, F32, f"{what}: hidden grad vs single rank")
            assert_close(h.grad, h64.grad, F32, f"{what}: hidden grad vs float64")
        else:
            assert h.grad is None
        if need_w:
            assert_close(w.grad, w1.grad[rows_of], F32, f"{what}: weight grad vs single rank")
            assert_close(w.grad, w64.grad[rows_of], F32, f"{what}: weight grad vs float64")
            if use_bias:
                assert_close(b.grad, b1.grad[rows_of], F32, f"{what}: bias grad vs single rank")
                assert_close(b.grad, b64.grad[rows_of], F32, f"{what}: bias grad vs float64")
        else:
            assert w.grad is None and (b is None or b.grad is None)

    f.check(what, compare)


def check_same_hidden_grad_everywhere(f: Failures, group: Any, *, impl: str,
                                      reduction: str, seed: int) -> None:
    """Every rank ends with the same ``hidden.grad`` (bit for bit: it is one all-reduce)
    and together the ranks' weight gradients are the whole single-rank weight gradient."""
    world = dist.get_world_size(group)
    V_local = 9
    hidden, weight, bias, target = make_inputs(seed, V_local, world, True)
    r = dist.get_rank(group)
    rows_of = slice(r * V_local, (r + 1) * V_local)
    h = hidden.clone().requires_grad_(True)
    w = weight[rows_of].clone().requires_grad_(True)
    loss = lmfuse.linear_cross_entropy(h, w, target, tp_group=group, reduction=reduction,
                                       impl=impl, max_chunk_bytes=chunk_budget(V_local),
                                       **ALL_OPTIONS)
    loss.backward(upstream(seed, reduction))
    hs = [torch.empty_like(h.grad) for _ in range(world)]
    ws = [torch.empty_like(w.grad) for _ in range(world)]
    dist.all_gather(hs, h.grad, group=group)
    dist.all_gather(ws, w.grad, group=group)
    w1 = weight.clone().requires_grad_(True)
    loss1 = lmfuse.linear_cross_entropy(hidden, w1, target, reduction=reduction, impl=impl,
                                        **ALL_OPTIONS)
    loss1.backward(upstream(seed, reduction))

    def compare() -> None:
        for other, g in enumerate(hs):
            assert torch.equal(g, h.grad), f"hidden.grad differs between ranks {r} and {other}"
        assert_close(torch.cat(ws), w1.grad, F32,
                     f"{impl} {reduction}: ranks' weight grads stacked vs single rank")

    f.check(f"{impl} {reduction} same hidden grad on every rank", compare)


def check_empty_batch(f: Failures, group: Any, *, impl: str, reduction: str,
                      V_local: int) -> None:
    """No tokens: no chunk, so no all-gather, but still the one all-reduce of hidden's
    (empty) gradient on every rank; a zero or empty loss and zero weight gradients."""
    h = torch.randn(0, H, requires_grad=True)
    w = torch.randn(V_local, H, requires_grad=True)
    b = torch.randn(V_local, requires_grad=True)
    with count_collectives() as calls:
        loss = lmfuse.linear_cross_entropy(h, w, torch.zeros(0, dtype=torch.long), bias=b,
                                           tp_group=group, reduction=reduction, impl=impl)
        loss.sum().backward()

    def compare() -> None:
        assert len(calls) == 1 and calls[0] in ALL_REDUCES, (
            f"issued {calls}, expected one all-reduce")
        assert loss.shape == ((0,) if reduction == "none" else ()), loss.shape
        assert reduction == "none" or loss.item() == 0.0, loss
        assert h.grad is not None and h.grad.shape == (0, H), h.grad
        assert torch.equal(w.grad, torch.zeros_like(w)), w.grad
        assert torch.equal(b.grad, torch.zeros_like(b)), b.grad

    f.check(f"{impl} {reduction} empty batch", compare)


def check_groups_of_one(f: Failures, rank: int, world_size: int) -> None:
    """A group of one rank holds the whole vocabulary: the single-rank result and no
    collective (``tp_group=None`` is checked in every case of the sweep)."""
    # new_group is collective over the world: every rank creates every group, in one order.
    singles = [dist.new_group([r]) for r in range(world_size)]
    for i, (impl, reduction) in enumerate(itertools.product(("triton", "torch"),
                                                            ("mean", "none"))):
        what = f"{impl} {reduction} group of 1"
        hidden, weight, bias, target = make_inputs(4000 + i, 10, 1, True)
        dout = upstream(4000 + i, reduction)
        results = []
        for group in (singles[rank], None):
            h = hidden.clone().requires_grad_(True)
            w = weight.clone().requires_grad_(True)
            b = bias.clone().requires_grad_(True)
            with count_collectives() as calls:
                loss = lmfuse.linear_cross_entropy(h, w, target, bias=b, tp_group=group,
                                                   reduction=reduction, impl=impl,
                                                   max_chunk_bytes=chunk_budget(10),
                                                   **ALL_OPTIONS)
                loss.backward(dout)
            results.append((calls, loss.detach(), h.grad, w.grad, b.grad))

        def compare(results=results, what=what) -> None:
            (calls, *got), (calls_none, *expected) = results
            assert calls == [], f"a group of one issued {calls}"
            assert calls_none == [], f"tp_group=None issued {calls_none}"
            for name, a, e in zip(("loss", "hidden grad", "weight grad", "bias grad"),
                                  got, expected):
                assert_close(a, e, F32, f"{what}: {name}")

        f.check(what, compare)


# --- rank functions ------------------------------------------------------------------------


def _sweep_rank(rank: int, world_size: int) -> None:
    """impl x reduction x (options, bias) with several chunks on the world group; on 2
    ranks also the cases where only hidden, or only weight and bias, need a gradient, a
    forward under no_grad, one token per chunk, one chunk for all, every target ignored,
    an empty batch, and groups of one rank."""
    f = Failures(rank)
    world = dist.group.WORLD
    V_local = 13 if world_size == 2 else 9
    pairs = list(itertools.product(("triton", "torch"), ("mean", "sum", "none")))
    if world_size == 2:
        variants = [(OPTIONS[0], True), (OPTIONS[0], False), (OPTIONS[1], True)]
        cases = [(*p, *v) for p in pairs for v in variants]
    else:  # slower: two ranks share a core; each (impl, reduction) once, bias alternating
        cases = [(*p, OPTIONS[0], j % 2 == 0) for j, p in enumerate(pairs)]
    for i, (impl, reduction, option, use_bias) in enumerate(cases):
        check_parallel_case(f, world, impl=impl, reduction=reduction, option=option,
                            use_bias=use_bias, V_local=V_local, seed=1000 + i)
    same = (list(itertools.product(("triton", "torch"), ("mean", "none")))
            if world_size == 2 else [("triton", "mean"), ("torch", "none")])
    for i, (impl, reduction) in enumerate(same):
        check_same_hidden_grad_everywhere(f, world, impl=impl, reduction=reduction,
                                          seed=3000 + i)
    if world_size == 2:
        extra = [
            dict(impl="torch", reduction="mean", needs=(True, False)),
            dict(impl="torch", reduction="none", needs=(True, False)),
            dict(impl="torch", reduction="mean", needs=(False, True)),
            dict(impl="triton", reduction="none", needs=(False, True)),
            dict(impl="triton", reduction="sum", no_grad=True),
            dict(impl="torch", reduction="none", budget=V_local * 4),  # 1 token per chunk
            dict(impl="torch", reduction="sum", budget=None),  # tuning table: one chunk
            dict(impl="triton", reduction="mean", budget=1 << 20),  # one chunk
            dict(impl="torch", reduction="mean", ignore_all=True),
            dict(impl="triton", reduction="none", ignore_all=True),
        ]
        for i, kw in enumerate(extra):
            check_parallel_case(f, world, option=OPTIONS[0], use_bias=True, V_local=V_local,
                                seed=2000 + i, **kw)
        for impl, reduction in itertools.product(("triton", "torch"), ("mean", "none")):
            check_empty_batch(f, world, impl=impl, reduction=reduction, V_local=V_local)
        check_groups_of_one(f, rank, world_size)
    f.raise_if_any()


# --- tests ---------------------------------------------------------------------------------


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", [2, 4])
def test_linear_vocab_parallel_matches_single_rank(world_size: int) -> None:
    spawn_gloo(world_size, _sweep_rank, timeout=120)


def _differing_budgets_rank(rank: int, world_size: int) -> None:
    # Rank 0 holds 3 tokens a chunk, rank 1 the tuning table's (all 11 in one): their
    # per-chunk all-gathers would not pair up (a gloo abort, or a garbage loss).
    torch.manual_seed(0)
    h, w = torch.randn(11, 8), torch.randn(7, 8)
    t = torch.zeros(11, dtype=torch.long)
    with pytest.raises(ValueError, match="every rank of the group must pass the same .*"
                                         "tokens per chunk"):
        lmfuse.linear_cross_entropy(h, w, t, tp_group=dist.group.WORLD,
                                    max_chunk_bytes=7 * 4 * 3 if rank == 0 else None)


@pytest.mark.timeout(90)
def test_ranks_chunking_differently_raise_on_every_rank() -> None:
    """The chunk budget comes from each rank's own tuning tables (or ``max_chunk_bytes``):
    ranks that chunk differently are refused by the first call's agreement check, on every
    rank, instead of mismatched collectives."""
    spawn_gloo(2, _differing_budgets_rank, timeout=60)
