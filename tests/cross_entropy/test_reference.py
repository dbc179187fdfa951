"""The cross-entropy reference against ``torch.nn.functional.cross_entropy`` (float64).

``cross_entropy_reference`` is the spec the Triton and torch paths are tested against, so
it is checked here against an independent construction: ``F.cross_entropy`` for the loss
and its label smoothing, plus the z-loss and softcap written out by hand. The pieces the
fused and vocabulary-parallel paths are built from (per-column-block stats, their merge,
the loss from stats, the gradient from the merged lse) must rebuild the whole-vocabulary
reference exactly, for any split of the columns.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, randn

from lmfuse.cross_entropy.reference import (
    cross_entropy_reference,
    local_token_stats,
    logits_grad,
    merge_token_stats,
    softcapped,
    token_loss,
)

F64 = torch.float64
REDUCTIONS = ("mean", "sum", "none")


def make_target(shape: tuple[int, ...], V: int, ignore_index: int | None,
                every: int = 3) -> torch.Tensor:
    """Random class ids; every ``every``-th token is ``ignore_index`` (when given)."""
    t = torch.randint(0, V, shape)
    if ignore_index is not None:
        t.view(-1)[::every] = ignore_index
    return t


# ignore_index used, and whether any target holds it: -100 (the default, outside the
# classes) or 2, a real class id, which F.cross_entropy then ignores as well.
IGNORES = [
    pytest.param(-100, False, id="no-ignored"),
    pytest.param(-100, True, id="ignore=-100"),
    pytest.param(2, True, id="ignore=class2"),
]


@pytest.mark.parametrize("ignore_index, present", IGNORES)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1, 1.0], ids=lambda s: f"ls{s}")
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_matches_torch_cross_entropy(reduction: str, label_smoothing: float, ignore_index: int,
                                     present: bool) -> None:
    V = 7
    logits = randn((2, 3, V), F64, scale=2.0, requires_grad=True)
    target = make_target((2, 3), V, ignore_index if present else None)
    if not present:
        target[target == ignore_index] = 0
    loss = cross_entropy_reference(logits, target, ignore_index=ignore_index,
                                   label_smoothing=label_smoothing, reduction=reduction)
    x = logits.detach().clone().requires_grad_(True)
    expected = F.cross_entropy(x.view(-1, V), target.view(-1), ignore_index=ignore_index,
                               label_smoothing=label_smoothing, reduction=reduction)
    if reduction == "none":
        expected = expected.view(target.shape)
    what = f"reduction={reduction} ls={label_smoothing} ignore={ignore_index} present={present}"
    assert loss.dtype == F64 and loss.shape == expected.shape, what
    assert_close(loss, expected, F64, f"{what}: loss")
    g = randn(loss.shape, F64)
    (dx,) = torch.autograd.grad(loss, logits, g)
    (dx_expected,) = torch.autograd.grad(expected, x, g)
    assert_close(dx, dx_expected, F64, f"{what}: d logits")
    if present:
        ignored = target == ignore_index
        assert torch.equal(dx[ignored], torch.zeros_like(dx[ignored])), f"{what}: ignored rows"


def test_z_loss_and_softcap_by_hand() -> None:
    """loss = F.cross_entropy(c * tanh(l / c)) + z * logsumexp(c * tanh(l / c))**2."""
    V, c, z = 9, 2.5, 0.03
    logits = randn((5, V), F64, scale=4.0)
    target = make_target((5,), V, -100)
    x = c * torch.tanh(logits / c)
    expected = (F.cross_entropy(x, target, label_smoothing=0.2, reduction="none")
                + z * torch.logsumexp(x, -1) ** 2 * (target != -100))
    loss = cross_entropy_reference(logits, target, label_smoothing=0.2, z_loss=z, softcap=c,
                                   reduction="none")
    assert_close(loss, expected, F64, "z_loss + softcap")
    assert_close(softcapped(logits, c), x, F64, "softcapped")
    assert torch.equal(softcapped(logits, None), logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=lambda d: str(d).replace("torch.", ""))
def test_float32_math_for_every_input_dtype(dtype: torch.dtype) -> None:
    V = 11
    logits = randn((4, V), dtype, scale=6.0)
    target = make_target((4,), V, -100)
    loss = cross_entropy_reference(logits, target, label_smoothing=0.1, reduction="none")
    assert loss.dtype == torch.float32
    expected = F.cross_entropy(logits.double(), target, label_smoothing=0.1, reduction="none")
    assert_close(loss, expected.float(), torch.float32, f"reference on {dtype} logits")


def test_all_ignored_mean_is_zero_where_torch_gives_nan() -> None:
    logits = randn((3, 5), F64, requires_grad=True)
    target = torch.full((3,), -100)
    loss = cross_entropy_reference(logits, target, label_smoothing=0.1, z_loss=0.1)
    assert torch.isnan(F.cross_entropy(logits.detach(), target))  # the spec differs here
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing, z_loss, softcap", [
    pytest.param(0.0, 0.1, None, id="z"),
    pytest.param(0.0, 0.0, 1.5, id="softcap"),
    pytest.param(0.2, 0.05, 2.0, id="ls+z+softcap"),
])
def test_gradcheck(reduction: str, label_smoothing: float, z_loss: float,
                   softcap: float | None) -> None:
    logits = randn((4, 6), F64, scale=2.0, requires_grad=True)
    target = torch.tensor([1, -100, 5, 0])

    def f(x):
        return cross_entropy_reference(x, target, label_smoothing=label_smoothing,
                                       z_loss=z_loss, softcap=softcap, reduction=reduction)

    assert torch.autograd.gradcheck(f, (logits,))
    assert torch.autograd.gradgradcheck(f, (logits,))


# --- the pieces -----------------------------------------------------------------------


def column_blocks(V: int, n_blocks: int) -> list[tuple[int, int]]:
    """``n_blocks`` uneven ``(start, stop)`` column ranges covering ``[0, V)``."""
    cuts = {1: [], 2: [V // 3], 3: [1, V - 4]}[n_blocks]
    bounds = [0, *cuts, V]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


OPTIONS = [
    pytest.param(dict(), id="plain"),
    pytest.param(dict(label_smoothing=0.1), id="ls"),
    pytest.param(dict(z_loss=0.02), id="z"),
    pytest.param(dict(softcap=3.0), id="softcap"),
    pytest.param(dict(label_smoothing=0.3, z_loss=0.01, softcap=2.0), id="ls+z+softcap"),
]


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("n_blocks", [1, 2, 3])
def test_pieces_rebuild_the_whole_vocabulary(n_blocks: int, options: dict) -> None:
    N, V = 6, 13
    logits = randn((N, V), F64, scale=3.0, requires_grad=True)
    target = make_target((N,), V, -100, every=4)
    target[1] = V - 1  # a target in the last (short) block
    target[2] = 0  # and in the first
    blocks = column_blocks(V, n_blocks)
    assert len(blocks) == n_blocks and all(b > a for a, b in blocks)
    what = f"{n_blocks} block(s) {blocks} {options}"
    softcap = options.get("softcap")
    ls, z = options.get("label_smoothing", 0.0), options.get("z_loss", 0.0)

    local = torch.stack([local_token_stats(logits.detach()[:, a:b], target, a, softcap)
                         for a, b in blocks])
    stats = merge_token_stats(local)
    assert stats.shape == (3, N) and stats.dtype == F64
    x = softcapped(logits.detach(), softcap)
    valid = target != -100
    assert_close(stats[0], torch.logsumexp(x, -1), F64, f"{what}: lse")
    x_t = x.gather(1, target.clamp(min=0)[:, None])[:, 0]
    assert_close(stats[1][valid], x_t[valid], F64, f"{what}: x_t")
    assert_close(stats[2], x.sum(-1), F64, f"{what}: sum x")

    loss = token_loss(stats, target, vocab_size=V, ignore_index=-100, label_smoothing=ls,
                      z_loss=z)
    expected = cross_entropy_reference(logits, target, reduction="none", **options)
    assert_close(loss, expected, F64, f"{what}: token_loss")

    weight = randn((N,), F64)
    (dx_expected,) = torch.autograd.grad(expected, logits, weight)
    grads = [logits_grad(logits.detach()[:, a:b], target, stats[0], weight, vocab_start=a,
                         vocab_size=V, ignore_index=-100, label_smoothing=ls, z_loss=z,
                         softcap=softcap)
             for a, b in blocks]
    assert_close(torch.cat(grads, dim=1), dx_expected, F64, f"{what}: logits_grad")


def test_logits_grad_scalar_weight_and_dtype() -> None:
    N, V = 4, 6
    logits = randn((N, V), torch.bfloat16)
    target = torch.tensor([0, 5, -100, 3])
    lse = torch.logsumexp(logits.float(), -1)
    g = logits_grad(logits, target, lse, torch.tensor(0.5), vocab_start=0, vocab_size=V,
                    ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None)
    assert g.dtype == torch.bfloat16
    expected = 0.5 * (torch.softmax(logits.double(), -1) - F.one_hot(target.clamp(min=0), V))
    expected[2] = 0
    assert_close(g, expected.to(torch.bfloat16), torch.bfloat16, "scalar weight")


def test_out_of_range_target_gives_inf_loss_and_zero_grad() -> None:
    """The pieces do not check targets (the GPU paths cannot): a bad one is loud, not silent."""
    N, V = 4, 5
    logits = randn((N, V), F64)
    target = torch.tensor([1, V, -1, -100])
    stats = local_token_stats(logits, target, 0, None)
    loss = token_loss(stats, target, vocab_size=V, ignore_index=-100, label_smoothing=0.1,
                      z_loss=0.0)
    assert torch.isfinite(loss[0]) and loss[3] == 0
    assert loss[1] == float("inf") and loss[2] == float("inf")
    g = logits_grad(logits, target, stats[0], torch.ones(N, dtype=F64), vocab_start=0,
                    vocab_size=V, ignore_index=-100, label_smoothing=0.1, z_loss=0.0,
                    softcap=None)
    assert torch.equal(g[1:], torch.zeros(3, V, dtype=F64))
    assert (g[0] != 0).all()


def test_local_stats_target_outside_the_block_has_zero_x_t() -> None:
    logits = randn((3, 8), F64)
    target = torch.tensor([0, 5, 7])
    stats = local_token_stats(logits[:, 4:], target, 4, None)
    expected_xt = torch.stack([torch.zeros((), dtype=F64), logits[1, 5], logits[2, 7]])
    assert torch.equal(stats[1], expected_xt)
    assert stats.dtype == F64
