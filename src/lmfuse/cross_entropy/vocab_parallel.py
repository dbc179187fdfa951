"""Vocabulary parallelism for cross-entropy: one collective per forward.

Each rank reduces its own columns to three float32 numbers per token (``lse``, ``x_t``,
``sum x``; see ``reference.py``); one all-gather of that ``[3, N]`` block gives every rank
every rank's numbers, and a log-sum-exp merge turns them into the whole-vocabulary stats.
Megatron-Core needs two all-reduces for the same (the max, then the sums). The backward
needs no communication: the gradient of a rank's columns depends only on the merged lse.
"""

from __future__ import annotations

from typing import Any

import torch

from ..distributed.collectives import all_gather_stacked
from .reference import merge_token_stats


def gather_token_stats(local: torch.Tensor, group: Any) -> torch.Tensor:
    """``[3, N]`` local stats to whole-vocabulary stats, with one all-gather over ``group``."""
    return merge_token_stats(all_gather_stacked(local, group))
