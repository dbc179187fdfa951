"""Generation for Hugging Face causal LMs on lmfuse's paged KV cache:
:class:`Generator` (continuous batching, prefix sharing, preemption, CUDA graphs).

Layout (one file per role): ``request.py`` (a request and its sampling options),
``scheduler.py`` (admission, growth, preemption, prefix sharing over the block pool),
``attention.py`` (the model's attention layers over the paged cache), ``runner.py`` (the
model's prefill and decode forwards, CUDA graphs), ``sampling.py`` (greedy / top-k /
top-p with per-request counter-based noise), ``engine.py`` (:class:`Generator`).
"""

from .engine import SUPPORTED_MODEL_TYPES, Generator  # noqa: F401
from .request import SamplingParams  # noqa: F401

__all__ = ["SUPPORTED_MODEL_TYPES", "Generator", "SamplingParams"]
