"""The parallel forms of decode attention (split by context: ``cp``; by batch: ``kvdp``) and
the KV-cache sharding planner, through ``torch.distributed`` process groups only.

Each name is imported from its submodule on first use, so importing one part (the planner,
which ``import lmfuse`` does) does not import the others and what they build on (the
attention ops). The collectives every parallel op issues (the losses'
vocabulary-parallel forms included) live below the families, in ``lmfuse._collectives``;
``lmfuse.distributed.collectives`` re-exports them.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "cp_cache_append": "cp", "cp_decode_attention": "cp", "cp_shard_seqlens": "cp",
    "kvdp_batch_range": "kvdp", "kvdp_cache_append": "kvdp", "kvdp_decode_attention": "kvdp",
    "ShardingPlan": "planner", "plan_sharding": "planner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
