"""The specification of cross-entropy on logits, in plain PyTorch (float32 math).

For one token with logits ``l [V]``, target ``t`` and options ``softcap = c``,
``label_smoothing = s``, ``z_loss = z``:

    x    = c * tanh(l / c)            (x = l when softcap is None)
    lse  = log(sum_j exp(x_j))
    loss = (1 - s) * (lse - x_t) + s * (lse - mean_j x_j) + z * lse**2

which is ``torch.nn.functional.cross_entropy``'s loss (its label smoothing spreads ``s``
uniformly over all V classes) plus the z-loss. A token whose target is ``ignore_index``
has loss 0 and gradient 0. ``reduction="mean"`` divides the sum by the number of
non-ignored tokens (an all-ignored batch gives 0), ``"sum"`` sums, ``"none"`` returns
the per-token losses.

The gradient with respect to ``x_j`` is, for a non-ignored token,

    p_j * (1 + 2 z lse) - s / V - (1 - s) * [j == t],      p_j = exp(x_j - lse)

times ``1 - (x_j / c)**2`` when softcapped, times the token's upstream gradient.

With class weights ``w [V]`` (``weight``, PyTorch's and Liger's meaning), ``W = sum_j w_j``:

    loss = w_t (1 - s) (lse - x_t) + (s / V) (W lse - sum_j w_j x_j) + z * lse**2

(the first two terms are ``F.cross_entropy(weight=w, label_smoothing=s)``'s; the z-loss is
not weighted, as Liger's), with gradient

    p_j (w_t (1 - s) + s W / V + 2 z lse) - (s / V) w_j - w_t (1 - s) [j == t].

``reduction="mean"`` then divides the weighted terms by ``sum w_t`` over non-ignored tokens
(``F.cross_entropy``'s weighted mean) and the z-loss by their count (Liger's).

Also returned on request (:class:`CrossEntropyOutput`, Liger's names): ``z_loss``, the
z-loss term reduced as the loss is; ``token_accuracy``, the fraction of non-ignored tokens
whose prediction is their target (per token, 1.0 or 0.0, for ``reduction="none"``);
``predicted_tokens``, each token's ``argmax_j x_j`` (the first maximum, as ``torch.argmax``:
a NaN logit is the maximum; the softcapped logits when ``softcap`` is set), -1 where
ignored. None of them is differentiable.

``use_token_scaling`` (Liger-Kernel's option of its fused linear cross-entropy, here on
the reference of both ops): each token's loss, z-loss included, is multiplied by its
probability of its target ``p_t = exp(x_t - lse)``, detached (a constant to autograd), so
the gradient is the unscaled one times ``p_t``; the mean's divisors stay the same, and the
returned z-loss is scaled as well.

A token is described by three numbers, which is what lets the vocabulary be split over
ranks: ``lse``, ``x_t`` and ``sum_j x_j``. Each rank computes them over its own columns
(``x_t = 0`` where it does not hold the target) and :func:`merge_token_stats` combines
them: log-sum-exp of the ``lse``, sums of the other two (with class weights the third is
``sum_j w_j x_j``). With class weights each rank also gives ``w_t`` (0 where it does not
hold the target) and the sum of its shard's weights, both summed; for the predictions,
its max logit and that max's first column (:func:`local_top`), which
:func:`merge_predictions` combines into the first maximum of the whole row.

NaN and inf follow ``F.cross_entropy`` (its max-shifted log-softmax): a NaN logit, or a
+inf one (``inf - inf``), makes the token's ``lse``, loss and whole gradient row NaN;
-inf logits are legitimate (masked vocabulary: ``p = 0`` there), and a row of nothing but
-inf has ``lse = -inf``, so a loss and gradient of NaN. An ignored token's loss is 0
whatever its logits (it never poisons a mean); its gradient row is ``0 * p``, NaN where
``p`` is, as PyTorch's. With a softcap, ``+-inf`` logits cap to ``+-c`` (finite, gradient
0 there).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class CrossEntropyOutput(NamedTuple):
    """What ``cross_entropy`` returns when any ``return_*`` option is set; the fields not
    asked for are None. ``loss`` is differentiable, the others are not."""

    loss: torch.Tensor
    z_loss: Optional[torch.Tensor] = None
    token_accuracy: Optional[torch.Tensor] = None
    predicted_tokens: Optional[torch.Tensor] = None


def softcapped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap * tanh(logits / softcap)`` in float32 (float64 for float64); or a cast."""
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(compute)
    return x if softcap is None else softcap * torch.tanh(x / softcap)


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """``log(sum_j exp(x_j))`` over the last dim, max-shifted as ``F.log_softmax`` is:
    NaN where a row holds NaN or +inf (``exp(inf - inf)``), -inf for a row of -inf (its
    shift is 0, not -inf). ``torch.logsumexp`` would give +inf for a +inf logit."""
    m = x.detach().amax(dim=-1, keepdim=True)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    return (m + torch.log(torch.exp(x - m).sum(dim=-1, keepdim=True))).squeeze(-1)


def cross_entropy_reference(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    weight: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    reduction: str = "mean",
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False,
    use_token_scaling: bool = False,
) -> torch.Tensor | CrossEntropyOutput:
    """Reference loss for ``logits [..., V]`` and ``target [...]`` (see the module docstring).

    Differentiable in ``logits`` through autograd. Targets must be ``ignore_index`` or in
    ``[0, V)``. The result is float32 (float64 for float64 logits): a scalar, or
    ``target``'s shape for ``reduction="none"``; a :class:`CrossEntropyOutput` when any
    ``return_*`` is set.
    """
    V = logits.shape[-1]
    t = target.reshape(-1)
    x2d = logits.reshape(-1, V)
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    w = None if weight is None else weight.to(compute)
    stats = local_token_stats(x2d, t, 0, softcap, w)
    ce, zl = token_terms(stats, t, vocab_size=V, ignore_index=ignore_index,
                         label_smoothing=label_smoothing, z_loss=z_loss, weight=w)
    scale = None
    if use_token_scaling:
        scale = target_probability(stats.detach(), t, vocab_size=V, ignore_index=ignore_index)
        ce, zl = ce * scale, zl * scale
    count = (t != ignore_index).sum()
    loss = reduce_terms(ce, zl, t, count, reduction, ignore_index, w)
    if reduction == "none":
        loss = loss.view(target.shape)
    if not (return_z_loss or return_token_accuracy or return_predicted_tokens):
        return loss
    pred = predicted_tokens(x2d, t, ignore_index, softcap)
    extra = token_extras(stats[0], pred, t, count, z_loss=z_loss, ignore_index=ignore_index,
                         reduction=reduction, token_scale=scale)
    zl, right = (x.view(target.shape) if reduction == "none" else x for x in extra)
    return CrossEntropyOutput(loss, zl if return_z_loss else None,
                              right if return_token_accuracy else None,
                              pred.view(target.shape) if return_predicted_tokens else None)


def reduce_terms(ce: torch.Tensor, zl: torch.Tensor, target: torch.Tensor,
                 count: torch.Tensor, reduction: str, ignore_index: int,
                 weight: Optional[torch.Tensor],
                 target_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The loss from the per-token weighted terms ``ce`` and z-loss ``zl`` (see
    :func:`token_terms`): per token, summed, or their mean: ``sum ce / sum w_t + sum zl /
    count`` over non-ignored tokens (``sum w_t`` = count without weights), 0 when every
    token is ignored. ``target_weight [N]``: the tokens' ``w_t`` when ``weight`` is only
    this rank's shard (vocabulary parallel)."""
    if reduction == "none":
        return ce + zl
    if reduction == "sum":
        return (ce + zl).sum()
    n = count.clamp(min=1)
    if weight is None:
        return (ce + zl).sum() / n
    if target_weight is None:
        target_weight = target_weights(weight, target, ignore_index)
    valid = target.long() != ignore_index
    w_sum = weighted_mean_divisor(
        torch.where(valid, target_weight, torch.zeros_like(target_weight)).sum(), count > 0)
    return ce.sum() / torch.where(count > 0, w_sum, torch.ones_like(w_sum)) + zl.sum() / n


def weighted_mean_divisor(target_weight_sum: torch.Tensor, any_counted: torch.Tensor
                          ) -> torch.Tensor:
    """A weighted mean's divisor, ``sum w_t`` over the non-ignored targets, made NaN where
    there are such targets and their weights sum to 0: PyTorch's weighted mean is then
    ``0 / 0``, NaN (with label smoothing too, whose term alone would give ``x / 0 = inf``),
    and so are its gradients. No host sync."""
    zero = any_counted & (target_weight_sum == 0)
    return torch.where(zero, torch.full_like(target_weight_sum, float("nan")),
                       target_weight_sum)


def target_weights(weight: torch.Tensor, target: torch.Tensor, ignore_index: int,
                   vocab_start: int = 0) -> torch.Tensor:
    """``w_t [N]`` for the targets among ``weight``'s columns ``[vocab_start, vocab_start +
    len(weight))``: 0 where ignored, out of range or on another rank."""
    t = target.long() - vocab_start
    ok = (target.long() != ignore_index) & (t >= 0) & (t < weight.shape[0])
    w_t = weight.gather(0, torch.where(ok, t, torch.zeros_like(t)))
    return torch.where(ok, w_t, torch.zeros_like(w_t))


def target_probability(stats: torch.Tensor, target: torch.Tensor, *, vocab_size: int,
                       ignore_index: int) -> torch.Tensor:
    """``p_t = exp(x_t - lse) [N]`` from whole-vocabulary ``stats``: each token's
    probability of its target (softcapped logits), the factor of ``use_token_scaling``;
    1 where the target is ignored or out of range (whose loss is 0, or +inf, whatever the
    factor)."""
    lse, x_t = stats[0], stats[1]
    t = target.long()
    ok = (t != ignore_index) & (t >= 0) & (t < vocab_size)
    return torch.where(ok, torch.exp(x_t - lse), torch.ones_like(lse))


def predicted_tokens(logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
                     softcap: float | None) -> torch.Tensor:
    """``[N]`` int64: each token's ``torch.argmax`` of its (softcapped) logits, in the
    float32 (float64) compute dtype: the first maximum, a NaN counting as the maximum;
    -1 where ignored."""
    pred = softcapped(logits, softcap).argmax(dim=-1)
    return torch.where(target.long() != ignore_index, pred, torch.full_like(pred, -1))


def token_extras(lse: torch.Tensor, pred: torch.Tensor, target: torch.Tensor,
                 count: torch.Tensor, *, z_loss: float, ignore_index: int,
                 reduction: str, token_scale: Optional[torch.Tensor] = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z_loss, token_accuracy)`` from the whole-vocabulary ``lse [N]`` and
    ``predicted_tokens [N]``: per token for ``reduction="none"`` (0 where ignored);
    otherwise the z-loss reduced as the loss's (summed, or over ``count``) and the
    fraction of the ``count`` non-ignored tokens predicted right (0 when there is none).
    ``token_scale [N]``: each token's z-loss times it (``use_token_scaling``)."""
    valid = target.long() != ignore_index
    zero = torch.zeros_like(lse)
    zl = torch.where(valid, z_loss * lse * lse, zero) if z_loss else zero
    if token_scale is not None and z_loss:
        zl = torch.where(valid, zl * token_scale.to(zl.dtype), zero)
    right = (valid & (pred == target.long())).to(lse.dtype)
    if reduction == "none":
        return zl, right
    n = count.clamp(min=1).to(lse.dtype)
    return (zl.sum() / n if reduction == "mean" else zl.sum()), right.sum() / n


# --- the pieces the fused and vocabulary-parallel paths are built from ------------------


def local_token_stats(logits: torch.Tensor, target: torch.Tensor, vocab_start: int,
                      softcap: float | None,
                      weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[3, N]`` float32: ``lse``, ``x_t`` and ``sum_j x_j`` (``sum_j w_j x_j`` with class
    weights ``weight [V_local]``) over this rank's columns.

    ``logits [N, V_local]`` holds global columns ``[vocab_start, vocab_start + V_local)``;
    ``x_t`` is 0 on rows whose target is not among them.
    """
    x = softcapped(logits, softcap)
    V_local = x.shape[-1]
    t_local = target.long() - vocab_start
    mine = (t_local >= 0) & (t_local < V_local)
    x_t = x.gather(1, torch.where(mine, t_local, 0)[:, None])[:, 0]
    x_t = torch.where(mine, x_t, torch.zeros_like(x_t))
    sum_x = x.sum(dim=-1) if weight is None else (x * weight.to(x.dtype)).sum(dim=-1)
    stats = torch.stack([logsumexp(x), x_t, sum_x])
    return stats.float() if stats.dtype != torch.float64 else stats


def merge_token_stats(gathered: torch.Tensor) -> torch.Tensor:
    """``[world, 3, N]`` per-rank stats to ``[3, N]`` stats over the whole vocabulary."""
    lse = logsumexp(gathered[:, 0].T)
    return torch.stack([lse, gathered[:, 1].sum(dim=0), gathered[:, 2].sum(dim=0)])


def local_top(logits: torch.Tensor, vocab_start: int, softcap: float | None) -> torch.Tensor:
    """``[2, N]`` (float32; float64 for float64): each row's max (softcapped) logit among
    this rank's columns, NaN if it holds one, and the global column of its first maximum
    (``torch.argmax``'s: a NaN first)."""
    x = softcapped(logits, softcap)
    index = x.argmax(dim=-1)
    value = x.gather(1, index[:, None])[:, 0]
    return torch.stack([value, (index + vocab_start).to(value.dtype)])


def merge_predictions(values: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``[N]`` int64, the first maximum of the whole row from every rank's ``[world, N]``
    max and its first column (:func:`local_top`, ranks in column order): the largest max,
    a NaN largest of all, the lowest rank among equal ones, as ``torch.argmax`` of the
    whole row."""
    best, column = values[0], columns[0]
    for value, col in zip(values[1:], columns[1:]):
        take = (value > best) | (value.isnan() & ~best.isnan())
        best = torch.where(take, value, best)
        column = torch.where(take, col, column)
    return column.long()


def token_loss(stats: torch.Tensor, target: torch.Tensor, *, vocab_size: int,
               ignore_index: int, label_smoothing: float, z_loss: float,
               weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-token loss ``[N]`` from the whole-vocabulary stats (0 where ignored).

    A target that is neither ``ignore_index`` nor in ``[0, vocab_size)`` gives ``+inf``:
    the fused paths do not stop to check targets on the GPU, so a bad one is made loud.
    """
    ce, zl = token_terms(stats, target, vocab_size=vocab_size, ignore_index=ignore_index,
                         label_smoothing=label_smoothing, z_loss=z_loss, weight=weight)
    return ce + zl


def token_terms(stats: torch.Tensor, target: torch.Tensor, *, vocab_size: int,
                ignore_index: int, label_smoothing: float, z_loss: float,
                weight: Optional[torch.Tensor] = None,
                target_weight: Optional[torch.Tensor] = None,
                weight_sum: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token loss in two terms ``[N]``: the (class-weighted) cross-entropy with its
    smoothing, and the z-loss; both 0 where ignored, the first +inf for a bad target (see
    :func:`token_loss`). ``weight [vocab_size]``: class weights; ``stats[2]`` then holds
    ``sum_j w_j x_j``. Vocabulary parallel, where ``weight`` is this rank's shard:
    ``target_weight [N]`` the tokens' ``w_t`` and ``weight_sum`` the whole vocabulary's
    sum of weights, in place of those taken from ``weight``."""
    lse, x_t, sum_x = stats
    t = target.long()
    valid = t != ignore_index
    if weight is None:
        loss = (1.0 - label_smoothing) * (lse - x_t)
        if label_smoothing:
            loss = loss + label_smoothing * (lse - sum_x / vocab_size)
    else:
        w_t = target_weights(weight, t, ignore_index) if target_weight is None else target_weight
        w_sum = weight.sum() if weight_sum is None else weight_sum
        loss = w_t * (1.0 - label_smoothing) * (lse - x_t)
        if label_smoothing:
            loss = loss + label_smoothing / vocab_size * (w_sum * lse - sum_x)
    zero = torch.zeros_like(loss)
    zl = torch.where(valid, z_loss * lse * lse, zero) if z_loss else zero
    bad = valid & ((t < 0) | (t >= vocab_size))
    loss = torch.where(bad, torch.full_like(loss, float("inf")), loss)
    return torch.where(valid, loss, zero), zl


def logits_grad(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                weight: torch.Tensor, *, vocab_start: int, vocab_size: int, ignore_index: int,
                label_smoothing: float, z_loss: float, softcap: float | None,
                class_weight: Optional[torch.Tensor] = None,
                z_weight: Optional[torch.Tensor] = None,
                target_weight: Optional[torch.Tensor] = None,
                weight_sum: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``d loss / d logits`` for this rank's columns, in ``logits.dtype``.

    ``lse [N]`` is the whole-vocabulary log-sum-exp, ``weight [N]`` (or a scalar) each
    token's upstream gradient. Ignored and out-of-range targets get a zero row.

    ``class_weight [V_local]``: class weights of this rank's columns; ``weight`` then
    scales the weighted terms and ``z_weight`` (default ``weight``) the z-loss's (they
    differ for a mean). Vocabulary parallel: ``target_weight [N]`` and ``weight_sum`` as
    in :func:`token_terms`.
    """
    x = softcapped(logits, softcap)
    t = target.long()
    ok = (t != ignore_index) & (t >= 0) & (t < vocab_size)
    p = torch.exp(x - lse[:, None])
    cols = torch.arange(x.shape[-1], device=x.device) + vocab_start
    onehot = (cols[None, :] == t[:, None]).to(p.dtype)
    w = torch.as_tensor(weight, dtype=p.dtype, device=p.device).expand(x.shape[0])
    w = torch.where(ok, w, torch.zeros_like(w))
    if class_weight is None:
        g = p * (1.0 + 2.0 * z_loss * lse[:, None]) - label_smoothing / vocab_size
        g = g - (1.0 - label_smoothing) * onehot
        if softcap is not None:
            g = g * (1.0 - (x / softcap) ** 2)
        g = g * w[:, None]
    else:
        cw = class_weight.to(p.dtype)
        w_z = w if z_weight is None else torch.where(
            ok, torch.as_tensor(z_weight, dtype=p.dtype, device=p.device).expand(x.shape[0]),
            torch.zeros_like(w))
        w_t = (target_weights(cw, t, ignore_index, vocab_start) if target_weight is None
               else target_weight.to(p.dtype))[:, None] * (1.0 - label_smoothing)
        w_sum = cw.sum() if weight_sum is None else weight_sum.to(p.dtype)
        s_v = label_smoothing / vocab_size
        g = (p * (w_t + s_v * w_sum) - s_v * cw - w_t * onehot) * w[:, None]
        g = g + p * (2.0 * z_loss * lse[:, None]) * w_z[:, None]
        if softcap is not None:
            g = g * (1.0 - (x / softcap) ** 2)
    return g.to(logits.dtype)


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    reduction: str = "mean",
    ce_weight: Optional[torch.Tensor] = None,
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False,
    use_token_scaling: bool = False,
) -> torch.Tensor | CrossEntropyOutput:
    """The specification: :func:`cross_entropy_reference`
    of the float32 (float64 for float64) logits ``hidden @ weight.T + bias``, all at once,
    with class weights ``ce_weight``. Differentiable in ``hidden``, ``weight`` and ``bias``."""
    compute = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logits = hidden.to(compute) @ weight.to(compute).T
    if bias is not None:
        logits = logits + bias.to(compute)
    return cross_entropy_reference(logits, target, weight=ce_weight,
                                   ignore_index=ignore_index,
                                   label_smoothing=label_smoothing, z_loss=z_loss,
                                   softcap=softcap, reduction=reduction,
                                   return_z_loss=return_z_loss,
                                   return_token_accuracy=return_token_accuracy,
                                   return_predicted_tokens=return_predicted_tokens,
                                   use_token_scaling=use_token_scaling)
