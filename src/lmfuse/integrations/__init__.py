"""Patches that put lmfuse's fused ops into models of other libraries.

* :mod:`lmfuse.integrations.transformers`: :func:`~lmfuse.integrations.transformers.apply_lmfuse`
  patches a loaded Hugging Face ``transformers`` causal LM (Llama, Mistral, Qwen2, Qwen3,
  Gemma, Gemma2, Gemma3, and the families its docstring lists) in place;
* :mod:`lmfuse.integrations.megatron_core`: :func:`~lmfuse.integrations.megatron_core.patch`
  (``lmfuse.megatron.patch``) patches a Megatron-Core ``GPTModel`` built with the local spec.

Nothing here is imported by ``import lmfuse``, and each integration imports its library only
when it is called. What both patches share is below: the object a patched method becomes.
"""

from __future__ import annotations

from typing import Any

import torch


class _Forward:
    """A patched module's ``forward`` (or other method): calls ``fn(module, *args, **kwargs)``.

    An object of a module-level class, not a bound method or a closure, so that a patched
    model deep-copies (the copy's attribute is bound to the copy's module) and pickles.
    """

    __slots__ = ("fn", "module")

    def __init__(self, fn: Any, module: torch.nn.Module) -> None:
        self.fn, self.module = fn, module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(self.module, *args, **kwargs)


def _instance_attr(m: torch.nn.Module, name: str = "forward") -> Any:
    """What ``m``'s instance attribute ``name`` runs: the function of an lmfuse patch, another
    library's replacement as it is, or ``None`` (the class's method runs)."""
    attr = m.__dict__.get(name)
    return attr.fn if isinstance(attr, _Forward) else attr


def _activation_name(act: Any) -> str:
    return getattr(act, "__name__", None) or type(act).__name__


def _check_flags(op: str, **flags: Any) -> None:
    """``TypeError`` naming the first flag that is not a bool."""
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"{op}: {name} must be a bool, got {flag!r}")
