"""Cross-entropy on logits (``ops.py``) and on ``hidden @ weight.T`` without the logits
(``linear.py``), on one rank or vocabulary-parallel."""

from .linear import linear_cross_entropy, plan_linear_cross_entropy
from .ops import cross_entropy, plan_cross_entropy
from .reference import CrossEntropyOutput

__all__ = ["CrossEntropyOutput", "cross_entropy", "linear_cross_entropy", "plan_cross_entropy",
           "plan_linear_cross_entropy"]
