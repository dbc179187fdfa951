"""Cross-entropy on logits, on one rank or vocabulary-parallel (see ``ops.py``)."""

from .ops import cross_entropy, plan_cross_entropy

__all__ = ["cross_entropy", "plan_cross_entropy"]
