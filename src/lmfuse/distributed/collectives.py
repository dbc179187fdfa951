"""The collectives every parallel op issues, under the name DESIGN.md's layout gives them
(benchmarks, tests and outside code import them from here). They live in
``lmfuse._collectives``, below the families, which take them from there; this module only
re-exports the public names, so patch ``lmfuse._collectives`` to change what the ops call.
"""

from __future__ import annotations

from .._collectives import (all_gather_stacked, all_reduce_sum, all_reduce_sum_,
                            all_to_all_stacked, group_rank, group_size)

__all__ = ["all_gather_stacked", "all_reduce_sum", "all_reduce_sum_", "all_to_all_stacked",
           "group_rank", "group_size"]
