"""Patches that put lmfuse's fused ops into models of other libraries.

* :mod:`lmfuse.integrations.transformers`: :func:`~lmfuse.integrations.transformers.apply_lmfuse`
  patches a loaded Hugging Face ``transformers`` causal LM (Llama, Mistral, Qwen2, Qwen3,
  Gemma, Gemma2, Gemma3) in place.

Nothing here is imported by ``import lmfuse``, and each integration imports its library only
when it is called.
"""
