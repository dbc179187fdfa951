"""Mixture-of-experts MLP: routed tokens through each expert's gate/up projection, the
(router-weighted) activation and the down projection, forward and backward."""

from .ops import moe_experts, plan_moe_experts
from .reference import moe_experts_reference

__all__ = ["moe_experts", "moe_experts_reference", "plan_moe_experts"]
