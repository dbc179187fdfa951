"""Process-group plumbing shared by the parallel ops (``torch.distributed`` only)."""

from .planner import ShardingPlan, plan_sharding  # noqa: F401  (the KV-cache sharding planner)
