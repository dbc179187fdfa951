"""Vocabulary parallelism for cross-entropy: one collective per forward.

Each rank reduces its own columns to three float32 numbers per token (``lse``, ``x_t``,
``sum x``; see ``reference.py``); one all-gather of that ``[3, N]`` block gives every rank
every rank's numbers, and a log-sum-exp merge turns them into the whole-vocabulary stats
(on the Triton path one kernel, ``ce_merge_kernel``, which also forms the token loss).
Megatron-Core needs two all-reduces for the same (the max, then the sums). The backward
needs no communication: the gradient of a rank's columns depends only on the merged lse.
"""

from __future__ import annotations

from typing import Any

import torch

from .._dispatch import eager
from ..distributed.collectives import all_gather_stacked
from . import reference as ref


def _launch_merge(gathered, target, count, vocab_size, ignore_index, label_smoothing, z_loss,
                  mean):
    """``[4, N]`` whole-vocabulary stats and token loss from every rank's ``[world, 3, N]``."""
    from . import ops  # (which imports this module) its kernels and scalars, on first use

    world, _, n = gathered.shape
    stats = torch.empty((4, n), dtype=torch.float32, device=gathered.device)
    if n:
        block = 1024
        ops._kernels().ce_merge_kernel[(ops._cdiv(n, block),)](
            gathered, target, stats, count, n, world, vocab_size, ignore_index,
            *ops._scalars(vocab_size, label_smoothing, z_loss, None)[:3],
            HAS_SMOOTHING=label_smoothing > 0, MEAN=mean, BLOCK=block, num_warps=4)
    return stats


@torch.library.custom_op("lmfuse::ce_merge", mutates_args=())
def _ce_merge(gathered: torch.Tensor, target: torch.Tensor, count: torch.Tensor,
              vocab_size: int, ignore_index: int, label_smoothing: float, z_loss: float,
              mean: bool) -> torch.Tensor:
    return _launch_merge(gathered, target, count, vocab_size, ignore_index, label_smoothing,
                         z_loss, mean)


@_ce_merge.register_fake
def _(gathered, target, count, vocab_size, ignore_index, label_smoothing, z_loss, mean):
    return gathered.new_empty((4, gathered.shape[2]), dtype=torch.float32)


def gather_stats(stats: torch.Tensor, target: torch.Tensor, count: torch.Tensor,
                 o: dict[str, Any], mean: bool) -> torch.Tensor:
    """Whole-vocabulary stats from this rank's ``stats[:3]``, with one all-gather over
    ``o["tp_group"]``. Triton path: the merge and the token loss (scaled by ``1 / count``
    when ``mean``) in one launch, ``[4, N]`` like the forward kernels' stats; torch path:
    the reference merge, ``[3, N]``."""
    gathered = all_gather_stacked(stats[:3], o["tp_group"])
    if o["path"] != "triton":
        return ref.merge_token_stats(gathered)
    args = (gathered, target, count, o["vocab_size"], o["ignore_index"],
            o["label_smoothing"], o["z_loss"], mean)
    return _launch_merge(*args) if eager() else torch.ops.lmfuse.ce_merge(*args)
