"""Patches that put lmfuse's fused ops into models of other libraries.

* :mod:`lmfuse.integrations.transformers`: :func:`~lmfuse.integrations.transformers.apply_lmfuse`
  patches a loaded Hugging Face ``transformers`` causal LM (Llama, Mistral, Qwen2, Qwen3,
  Gemma, Gemma2, Gemma3, and the families its docstring lists) in place;
* :mod:`lmfuse.integrations.megatron_core`: :func:`~lmfuse.integrations.megatron_core.patch`
  (``lmfuse.megatron.patch``) patches a Megatron-Core ``GPTModel`` built with the local spec.

Nothing here is imported by ``import lmfuse``, and each integration imports its library only
when it is called. What both patches share is below: the object a patched method becomes,
and the call a patched LayerNorm makes (what the module gives, dtype included).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from ..norm import layer_norm as _layer_norm


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

    def __getstate__(self) -> tuple[Any, torch.nn.Module]:
        return self.fn, self.module

    def __setstate__(self, state: tuple[Any, torch.nn.Module]) -> None:
        # A patch whose function keeps process state (the rotary's re-bound forwards)
        # builds it again as the model is unpickled or copied: not later, in a call
        # torch.compile traces.
        self.fn, self.module = state
        restored = getattr(self.fn, "lmfuse_restored", None)
        if restored is not None:
            restored(self.module)


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


_HALF = (torch.float16, torch.bfloat16)


def _native_layer_norm_dtypes(x: torch.Tensor, *params: torch.Tensor | None) -> bool:
    """``F.layer_norm`` takes ``x`` with these parameters outside autocast: all of x's
    dtype, or all float32 for a 16-bit x (its "mixed type"); x of a dtype lmfuse's kernels
    take. (A float32 x with 16-bit parameters is PyTorch's error, which the module's own
    forward then raises.)"""
    dtypes = {p.dtype for p in params if p is not None}
    return (x.dtype in (*_HALF, torch.float32)
            and (dtypes <= {x.dtype} or (x.dtype in _HALF and dtypes == {torch.float32})))


def _layer_norm_like(m: torch.nn.Module, x: Any, *, autocast: str, weight_offset: float = 0.0,
                     impl: str = "auto") -> torch.Tensor | None:
    """What LayerNorm module ``m`` gives for ``x``, ``F.layer_norm(x, m.normalized_shape,
    m.weight + weight_offset, m.bias, m.eps)``, computed by :func:`lmfuse.layer_norm` (a
    ``normalized_shape`` of several dims as one flattened row); None for a call it does not
    stand in for (another shape, a float64 tensor, a dtype mix PyTorch refuses, an autocast
    whose casts are not known here): the caller runs the module's own forward then.

    The output dtype is the module's. ``autocast`` says what the module does under autocast:
    ``"fp32"``, ``torch.nn.LayerNorm.forward``'s ``F.layer_norm``, which autocast runs in
    float32 on CUDA (its float32 list; a float32 output) and leaves alone on the CPU (no
    policy there); ``"cast"``, Nemotron's LayerNorm1P, which under CUDA's autocast (the
    ``torch.is_autocast_enabled()`` it asks) casts x, weight and bias to the autocast dtype
    of x's device and normalises there (an output of that dtype); ``"none"``, unknown: no
    call under any autocast. lmfuse's math is float32 whatever the parameters' dtype, so
    under a 16-bit autocast the scale and shift are not rounded to it first as the module
    rounds them (outputs within one rounding)."""
    shape = tuple(getattr(m, "normalized_shape", ()))
    eps = getattr(m, "eps", None)
    k = len(shape)
    if not (isinstance(x, torch.Tensor) and k >= 1 and x.dim() >= k
            and tuple(x.shape[-k:]) == shape and isinstance(eps, (int, float))
            and not isinstance(eps, bool) and 0 <= eps < float("inf")):
        return None
    weight, bias = getattr(m, "weight", None), getattr(m, "bias", None)
    device = x.device.type
    if autocast == "cast":
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled() else None
    elif autocast != "fp32":
        if torch.is_autocast_enabled() or torch.is_autocast_enabled(device):
            return None
        dtype = None
    elif not torch.is_autocast_enabled(device) or device == "cpu":
        dtype = None
    elif device == "cuda":
        dtype = torch.float32
    else:
        return None  # (another device's autocast policy)
    if dtype is None:
        if not _native_layer_norm_dtypes(x, weight, bias):
            return None
    elif any(t is not None and t.dtype == torch.float64 for t in (x, weight, bias)):
        return None  # (autocast leaves float64 tensors as they are)
    else:
        x = x.to(dtype)  # autocast's cast (the op takes the parameters as they are)
    n = math.prod(shape)
    flat = x if k == 1 else x.reshape(*x.shape[:-k], n)
    if k > 1:
        weight = weight.reshape(n) if weight is not None else None
        bias = bias.reshape(n) if bias is not None else None
    off = contextlib.nullcontext() if not torch.is_autocast_enabled(device) else \
        torch.autocast(device, enabled=False)
    with off:  # (the op's torch path must not be cast again)
        y = _layer_norm(flat, weight, bias, eps=float(eps), weight_offset=weight_offset, impl=impl)
    return y if k == 1 else y.reshape(x.shape)
