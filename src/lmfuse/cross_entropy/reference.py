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

A token is described by three numbers, which is what lets the vocabulary be split over
ranks: ``lse``, ``x_t`` and ``sum_j x_j``. Each rank computes them over its own columns
(``x_t = 0`` where it does not hold the target) and :func:`merge_token_stats` combines
them: log-sum-exp of the ``lse``, sums of the other two.

NaN and inf follow ``F.cross_entropy`` (its max-shifted log-softmax): a NaN logit, or a
+inf one (``inf - inf``), makes the token's ``lse``, loss and whole gradient row NaN;
-inf logits are legitimate (masked vocabulary: ``p = 0`` there), and a row of nothing but
-inf has ``lse = -inf``, so a loss and gradient of NaN. An ignored token's loss is 0
whatever its logits (it never poisons a mean); its gradient row is ``0 * p``, NaN where
``p`` is, as PyTorch's. With a softcap, ``+-inf`` logits cap to ``+-c`` (finite, gradient
0 there).
"""

from __future__ import annotations

import torch


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
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Reference loss for ``logits [..., V]`` and ``target [...]`` (see the module docstring).

    Differentiable in ``logits`` through autograd. Targets must be ``ignore_index`` or in
    ``[0, V)``. The result is float32 (float64 for float64 logits): a scalar, or
    ``target``'s shape for ``reduction="none"``.
    """
    V = logits.shape[-1]
    t = target.reshape(-1)
    stats = local_token_stats(logits.reshape(-1, V), t, 0, softcap)
    loss = token_loss(stats, t, vocab_size=V, ignore_index=ignore_index,
                      label_smoothing=label_smoothing, z_loss=z_loss)
    if reduction == "none":
        return loss.view(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (t != ignore_index).sum().clamp(min=1)


# --- the pieces the fused and vocabulary-parallel paths are built from ------------------


def local_token_stats(logits: torch.Tensor, target: torch.Tensor, vocab_start: int,
                      softcap: float | None) -> torch.Tensor:
    """``[3, N]`` float32: ``lse``, ``x_t`` and ``sum_j x_j`` over this rank's columns.

    ``logits [N, V_local]`` holds global columns ``[vocab_start, vocab_start + V_local)``;
    ``x_t`` is 0 on rows whose target is not among them.
    """
    x = softcapped(logits, softcap)
    V_local = x.shape[-1]
    t_local = target.long() - vocab_start
    mine = (t_local >= 0) & (t_local < V_local)
    x_t = x.gather(1, torch.where(mine, t_local, 0)[:, None])[:, 0]
    x_t = torch.where(mine, x_t, torch.zeros_like(x_t))
    stats = torch.stack([logsumexp(x), x_t, x.sum(dim=-1)])
    return stats.float() if stats.dtype != torch.float64 else stats


def merge_token_stats(gathered: torch.Tensor) -> torch.Tensor:
    """``[world, 3, N]`` per-rank stats to ``[3, N]`` stats over the whole vocabulary."""
    lse = logsumexp(gathered[:, 0].T)
    return torch.stack([lse, gathered[:, 1].sum(dim=0), gathered[:, 2].sum(dim=0)])


def token_loss(stats: torch.Tensor, target: torch.Tensor, *, vocab_size: int,
               ignore_index: int, label_smoothing: float, z_loss: float) -> torch.Tensor:
    """Per-token loss ``[N]`` from the whole-vocabulary stats (0 where ignored).

    A target that is neither ``ignore_index`` nor in ``[0, vocab_size)`` gives ``+inf``:
    the fused paths do not stop to check targets on the GPU, so a bad one is made loud.
    """
    lse, x_t, sum_x = stats
    t = target.long()
    valid = t != ignore_index
    loss = (1.0 - label_smoothing) * (lse - x_t)
    if label_smoothing:
        loss = loss + label_smoothing * (lse - sum_x / vocab_size)
    if z_loss:
        loss = loss + z_loss * lse * lse
    bad = valid & ((t < 0) | (t >= vocab_size))
    loss = torch.where(bad, torch.full_like(loss, float("inf")), loss)
    return torch.where(valid, loss, torch.zeros_like(loss))


def logits_grad(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                weight: torch.Tensor, *, vocab_start: int, vocab_size: int, ignore_index: int,
                label_smoothing: float, z_loss: float, softcap: float | None) -> torch.Tensor:
    """``d loss / d logits`` for this rank's columns, in ``logits.dtype``.

    ``lse [N]`` is the whole-vocabulary log-sum-exp, ``weight [N]`` (or a scalar) each
    token's upstream gradient. Ignored and out-of-range targets get a zero row.
    """
    x = softcapped(logits, softcap)
    t = target.long()
    ok = (t != ignore_index) & (t >= 0) & (t < vocab_size)
    p = torch.exp(x - lse[:, None])
    g = p * (1.0 + 2.0 * z_loss * lse[:, None]) - label_smoothing / vocab_size
    cols = torch.arange(x.shape[-1], device=x.device) + vocab_start
    g = g - (1.0 - label_smoothing) * (cols[None, :] == t[:, None]).to(g.dtype)
    if softcap is not None:
        g = g * (1.0 - (x / softcap) ** 2)
    w = torch.as_tensor(weight, dtype=g.dtype, device=g.device).expand(x.shape[0])
    g = g * torch.where(ok, w, torch.zeros_like(w))[:, None]
    return g.to(logits.dtype)
