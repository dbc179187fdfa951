"""Fused rotary position embedding for training and prefill: ``apply_rotary_pos_emb``, with
Hugging Face's signature (queries and keys rotated together, one kernel each way)."""

from .ops import apply_rotary_pos_emb

__all__ = ["apply_rotary_pos_emb"]
