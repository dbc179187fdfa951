"""Process-group plumbing shared by the parallel ops (``torch.distributed`` only)."""

from .cp import cp_cache_append, cp_decode_attention, cp_shard_seqlens  # noqa: F401
from .kvdp import kvdp_batch_range, kvdp_cache_append, kvdp_decode_attention  # noqa: F401
from .planner import ShardingPlan, plan_sharding  # noqa: F401  (the KV-cache sharding planner)
