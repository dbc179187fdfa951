"""Vocabulary parallelism for cross-entropy: one collective per forward.

Each rank reduces its own columns to three float32 numbers per token (``lse``, ``x_t``,
``sum x``; see ``reference.py``); one all-gather of that ``[3, N]`` block gives every rank
every rank's numbers, and a log-sum-exp merge turns them into the whole-vocabulary stats
(on the Triton path one kernel, ``ce_merge_kernel``, which also forms the token loss).
Megatron-Core needs two all-reduces for the same (the max, then the sums). The backward
needs no communication: the gradient of a rank's columns depends only on the merged lse.

The options ride in the same all-gather: with class weights (each rank its ``[V_local]``
shard) a rank adds a row of its targets' weights (0 where it does not hold the target)
and one float, its shard's sum of weights; for the predicted tokens it adds two rows, its
max logit and that max's first global column (float32, exact below 2^24 classes), merged
into the first maximum of the whole row. Still one collective.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Optional

import torch

from .._launch import cdiv, kernel_op, lazy_kernels
from .._collectives import all_gather_stacked
from . import reference as ref

if TYPE_CHECKING:  # (ops imports this module: the annotation only)
    from .ops import CrossEntropyCall


class Merged(NamedTuple):
    """The whole-vocabulary result of :func:`gather_stats`: ``stats`` (``[3, N]`` on the
    torch path; ``[4, N]`` on the Triton path, the token loss last), and with class
    weights the tokens' ``target_weight [N]`` and ``wstat [2]`` (the sum of all weights,
    the sum of the non-ignored targets'), with the argmax ``pred [N]`` int64."""

    stats: torch.Tensor
    target_weight: Optional[torch.Tensor] = None
    wstat: Optional[torch.Tensor] = None
    pred: Optional[torch.Tensor] = None


_kernels = lazy_kernels("kernels", __package__)


def scalars(vocab_size: int, label_smoothing: float, z_loss: float,
            softcap: Optional[float]) -> tuple:
    """The loss kernels' float arguments: ``label_smoothing / V``, ``1 - label_smoothing``,
    ``2 z_loss`` and the softcap (1 when off). Here, below ``ops``, which takes them too."""
    return (label_smoothing / vocab_size, 1.0 - label_smoothing, 2.0 * z_loss,
            1.0 if softcap is None else softcap)


def _merge_fake(gathered, target, count, vocab_size, ignore_index, label_smoothing, z_loss,
                mean, target_weight=None, wstat=None, argmax=False):
    return gathered.new_empty((5 if argmax else 4, target.shape[0]), dtype=torch.float32)


@kernel_op("ce_merge", _merge_fake)
def _launch_merge(gathered: torch.Tensor, target: torch.Tensor, count: torch.Tensor,
                  vocab_size: int, ignore_index: int, label_smoothing: float, z_loss: float,
                  mean: bool, target_weight: Optional[torch.Tensor] = None,
                  wstat: Optional[torch.Tensor] = None, argmax: bool = False) -> torch.Tensor:
    """``[4, N]`` whole-vocabulary stats and token loss from every rank's ``[world, 3, N]``
    (``[world, S * N (+ 1)]`` with the options' rows: see ``ce_merge_kernel``); with
    ``argmax`` ``[5, N]``, the predicted class (float32) last. The custom op
    ``lmfuse::ce_merge`` (:func:`lmfuse._launch.kernel_op`)."""
    weighted = target_weight is not None
    rows = 3 + weighted + 2 * argmax
    world, n = gathered.shape[0], target.shape[0]
    stats = torch.empty((5 if argmax else 4, n), dtype=torch.float32, device=gathered.device)
    if n:
        block = 1024
        extra = {} if not (weighted or argmax) else dict(
            wt_ptr=target_weight, wstat_ptr=wstat, HAS_WEIGHT=weighted, ARGMAX=argmax,
            STATS=rows)
        _kernels().ce_merge_kernel[(cdiv(n, block),)](
            gathered, target, stats, count, n, world, vocab_size, ignore_index,
            *scalars(vocab_size, label_smoothing, z_loss, None)[:3],
            HAS_SMOOTHING=label_smoothing > 0, MEAN=mean, BLOCK=block, num_warps=4, **extra)
    return stats


def gather_stats(stats: torch.Tensor, target: torch.Tensor, count: torch.Tensor,
                 o: CrossEntropyCall, mean: bool, weight: Optional[torch.Tensor] = None,
                 top: Optional[torch.Tensor] = None) -> Merged:
    """Whole-vocabulary stats from this rank's ``stats[:3]``, with one all-gather over
    ``o.tp_group``. Triton path: the merge and the token loss (scaled by ``1 / count``
    when ``mean``; with class weights, the weighted terms by ``1 / sum w_t``) in one
    launch, ``[4, N]`` like the forward kernels' stats; torch path: the reference merge,
    ``[3, N]``.

    ``weight``: this rank's class weights ``[V_local]`` (``stats[2]`` then holds
    ``sum w x``). ``top``: this rank's ``[2, N]`` max logit and its first global column
    (:func:`reference.local_top`), for the argmax of the whole row.
    """
    n = target.shape[0]
    rows = [stats[0], stats[1], stats[2]]
    if weight is not None:
        rows.append(ref.target_weights(weight, target, o.ignore_index,
                                       o.vocab_start).to(stats.dtype))
    if top is not None:
        rows += [top[0].to(stats.dtype), top[1].to(stats.dtype)]
    local = torch.stack(rows)
    if weight is not None:  # one float more: this shard's sum of weights
        local = torch.cat([local.reshape(-1), weight.sum().to(stats.dtype).reshape(1)])
    gathered = all_gather_stacked(local, o.tp_group)
    S = len(rows)
    parts = gathered if weight is None else gathered[:, :S * n].view(gathered.shape[0], S, n)
    target_weight = wstat = None
    if weight is not None:
        target_weight = parts[:, 3].sum(dim=0)
        valid = target.long() != o.ignore_index
        wstat = torch.stack([gathered[:, S * n].sum(), ref.weighted_mean_divisor(
            torch.where(valid, target_weight, torch.zeros_like(target_weight)).sum(),
            valid.any())])
    if o.path != "triton":
        pred = None if top is None else ref.merge_predictions(parts[:, S - 2], parts[:, S - 1])
        return Merged(ref.merge_token_stats(parts[:, :3]), target_weight, wstat, pred)
    if weight is not None:
        target_weight, wstat = target_weight.float().contiguous(), wstat.float()
    args = (gathered, target, count, o.vocab_size, o.ignore_index,
            o.label_smoothing, o.z_loss, mean)
    if weight is not None or top is not None:
        args += (target_weight, wstat, top is not None)
    merged = _launch_merge(*args)
    return Merged(merged[:4], target_weight, wstat,
                  merged[4].long() if top is not None else None)
