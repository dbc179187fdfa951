"""Implementation selection, ``explain()``, interpreter detection and shared input checks.

Every public op takes ``impl="auto" | "triton" | "torch"`` and decides once, here, which
path runs:

* ``"torch"`` — the plain-PyTorch reference (float32 math), on any device.
* ``"triton"`` — the Triton kernels; on CUDA tensors, or on CPU tensors when Triton's
  interpreter is on (``TRITON_INTERPRET=1`` set before the first kernel is compiled).
  Asking for it where it cannot run raises; it never falls back silently.
* ``"auto"`` — Triton where it can run, the reference elsewhere.

Each op registers a *planner* (validation + selection, no tensor work) with
:func:`register_planner`; the op calls its planner before running and
:func:`explain` calls the same one, so what ``explain`` says is what runs.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ._launch import FLOAT_DTYPES, ON_OFF, dtype_name, env_setting

IMPLS = ("auto", "triton", "torch")


# Decided once at import: a plain constant is also what torch.compile can trace through.
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """True when the ``triton`` package can be imported."""
    return _HAS_TRITON


# CPython's dict behind os.environ (kept in step with it by os.environ's own methods) and
# the variable's key in it: read directly, a lookup costs 0.05 us against os.environ.get's
# 0.5, which every CPU fast path of the ops pays once a call. Elsewhere, with os.environ
# replaced (a mock), and while torch.compile traces, os.environ.get.
_ENVIRON = os.environ
_ENV_DATA = getattr(os.environ, "_data", None)
_INTERPRET_KEY = (os.environ.encodekey("TRITON_INTERPRET")
                  if _ENV_DATA is not None and hasattr(os.environ, "encodekey") else None)


def interpreter_active() -> bool:
    """True when Triton kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    if (_INTERPRET_KEY is not None and os.environ is _ENVIRON
            and not torch.compiler.is_compiling()):
        raw = _ENV_DATA.get(_INTERPRET_KEY)
        return raw is not None and _truthy(raw)
    # (uncached while tracing: Dynamo warns the user of each lru_cache it traces through)
    return _truthy_uncached(os.environ.get("TRITON_INTERPRET", "0"))


def _interpret_env() -> bool:
    """:func:`interpreter_active` for a caller that knows it runs out of ``torch.compile``
    (the CPU fast paths: one compile check a call, not two)."""
    if _INTERPRET_KEY is not None and os.environ is _ENVIRON:
        raw = _ENV_DATA.get(_INTERPRET_KEY)
        return raw is not None and _truthy(raw)
    return _truthy(os.environ.get("TRITON_INTERPRET", "0"))


def _truthy_uncached(raw: str | bytes) -> bool:
    """Triton's own reading of a boolean variable (``getenv_bool``: no stripping; "1",
    "true", "on", "yes", "y" in any case), so that lmfuse and Triton never disagree on
    whether the interpreter runs (" 1" made lmfuse route CPU tensors to real launches)."""
    if isinstance(raw, bytes):
        raw = raw.decode(errors="replace")
    return raw.lower() in ("1", "true", "on", "yes", "y")


_truthy = functools.lru_cache(maxsize=16)(_truthy_uncached)


# Value checks on device tensors (lmfuse.set_checks / LMFUSE_CHECK=1): see value_checks().
_VALUE_CHECKS = env_setting("LMFUSE_CHECK", "off", ON_OFF) == "on"


def set_checks(enabled: bool) -> None:
    """Turn on (or off) the checks of input *values* on CUDA tensors: out-of-range
    targets, lengths, block ids and capacities raise the same ``ValueError`` as on CPU
    tensors, at the cost of a host synchronisation per call (for debugging; never inside
    CUDA-graph capture or ``torch.compile``). Off by default; ``LMFUSE_CHECK=1`` in the
    environment turns it on at import. On CPU tensors these checks always run."""
    global _VALUE_CHECKS
    if not isinstance(enabled, bool):
        raise TypeError(f"set_checks: enabled must be a bool, got {type(enabled).__name__}")
    _VALUE_CHECKS = enabled


def value_checks(t: torch.Tensor) -> bool:
    """Whether an op should check the values of its input ``t`` (a host sync): always on
    CPU tensors, on others when :func:`set_checks` is on; never while compiling or
    capturing a CUDA graph."""
    if torch.compiler.is_compiling():
        return False
    if t.is_cpu:
        return True
    if not _VALUE_CHECKS:
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def once_differentiable(backward: Callable[..., Any]) -> Callable[..., Any]:
    """A backward without derivatives of its own. It runs with grad mode off unless the
    gradient is being taken with ``create_graph=True``; then it raises a ``RuntimeError``
    naming the op, since the gradient it would return carries no graph and anything
    differentiated through it (a gradient penalty, ``gradgradcheck``) would silently lose
    this op's terms. (``torch.autograd.function.once_differentiable`` only marks the
    gradients where the incoming gradient requires grad, and ``autograd.grad`` with
    respect to the op's inputs never reaches the mark: a wrong second derivative, no
    error.)"""
    cls = backward.__qualname__.split(".")[0].strip("_").removesuffix("CPU")
    op = _FUNCTION_OPS.get(cls, cls)

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"{op}: second derivatives are not supported: this op's backward "
                "has no derivative of its own, and a gradient taken through it with "
                "create_graph=True would be missing its terms; run the op through plain "
                "PyTorch where second derivatives are needed (the activation ops and "
                "impl='torch' of fused_softmax, rms_norm and moe_experts have them)")
        return backward(ctx, *grads)

    return wrapper


def _c_apply() -> tuple[Any, Any, Any]:
    """The C++ ``apply`` under ``torch.autograd.Function.apply``, functorch's
    ``unwrap_if_dead`` and its transforms' test, or Nones where this torch lacks one (then
    :func:`apply_function` calls ``Function.apply``)."""
    try:
        return (torch._C._FunctionBase.__dict__["apply"], torch._C._functorch.unwrap_if_dead,
                torch._C._are_functorch_transforms_active)
    except (AttributeError, KeyError):
        return None, None, None


_C_APPLY, _UNWRAP_IF_DEAD, _TRANSFORMS_ACTIVE = _c_apply()
_COMPILING = torch.compiler.is_compiling
_TENSOR = torch.Tensor


def apply_function(fn: type[torch.autograd.Function], *args: Any) -> Any:
    """``fn.apply(*args)`` without the Python wrapper's per-call work, for an autograd
    function of the old style (``forward(ctx, ...)``) or of the new one (``setup_context``)
    given all its arguments (the wrapper would bind the defaults): what the wrapper does in
    eager mode -- each tensor argument unwrapped if it is a dead functorch wrapper, then the
    C++ ``apply`` -- done inline (about 1 us of an op's host time on a fast CPU, 2-3 on a
    slow one). Under ``torch.compile`` and inside functorch transforms it is ``fn.apply``
    itself (what Dynamo traces; what runs a new-style function under the transforms and
    refuses an old-style one)."""
    if _C_APPLY is None or _COMPILING() or _TRANSFORMS_ACTIVE():
        return fn.apply(*args)
    return _C_APPLY.__get__(None, fn)(*[_UNWRAP_IF_DEAD(a) if isinstance(a, _TENSOR) else a
                                        for a in args])


#: The public op of each autograd function whose backward is ``once_differentiable``.
_FUNCTION_OPS = {"Softmax": "fused_softmax", "RMSNorm": "rms_norm", "LayerNorm": "layer_norm",
                 "Rotary": "apply_rotary_pos_emb",
                 "CrossEntropy": "cross_entropy", "LinearCrossEntropy": "linear_cross_entropy",
                 "MoEExperts": "moe_experts", "Fp8StoredExpert": "moe_experts"}


def native_cpu(impl: str, path: str, t: torch.Tensor) -> bool:
    """Whether a call may run PyTorch's own op in place of lmfuse's reference: the default
    path (``impl="auto"``) chose the reference (no Triton here) for float32 CPU tensors, out
    of ``torch.compile``. The op itself checks that PyTorch's op has the options in use;
    ``impl="torch"`` always runs the reference (the tests' oracle)."""
    return (impl == "auto" and path == "torch" and t.device.type == "cpu"
            and t.dtype == torch.float32 and not torch.compiler.is_compiling())


#: The tensor types the CPU fast paths take as they are: plain tensors and parameters (a
#: module's weights); any other subclass takes the full path, whose checks apply.
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def cpu_fast(t: torch.Tensor) -> bool:
    """Whether an ``impl="auto"`` call on ``t`` takes :func:`native_cpu`'s path for sure: a
    float32 CPU tensor, out of ``torch.compile``, Triton's interpreter off (so the choice is
    the reference, which PyTorch's op stands in for). The ops' CPU fast paths ask this
    before any other work: with every option at its default, such a call is PyTorch's op
    after a few checks of its own, at the plain op's host cost."""
    return (type(t) in PLAIN_TENSORS and t.is_cpu and t.dtype is _F32
            and not _COMPILING() and not (_HAS_TRITON and _interpret_env()))


# (a module attribute: each lookup through ``torch.`` costs a CPU fast path 0.03 us)
_F32 = torch.float32

#: Whether a torch function mode is active (one that should see ``torch.nn.functional``'s
#: ops, which the CPU fast paths otherwise call beneath their Python wrappers).
function_mode_active = torch._C._is_torch_function_mode_enabled


def transforms_active() -> bool:
    """Whether a ``torch.func`` transform (vmap, grad, jvp, ...) is active: no tensor's
    value may be read as a Python number there."""
    if _TRANSFORMS_ACTIVE is not None:
        return _TRANSFORMS_ACTIVE()
    return torch._C._functorch.peek_interpreter_stack() is not None


def triton_support(device: torch.device) -> tuple[bool, str]:
    """Whether the Triton path can run on ``device``, and why (or why not)."""
    if not triton_available():
        return False, "the triton package is not installed"
    if device.type == "cuda":
        return True, "CUDA tensor and triton is installed"
    if device.type == "cpu" and interpreter_active():
        return True, "CPU tensor and TRITON_INTERPRET=1 (Triton interpreter)"
    if device.type == "cpu":
        return False, "CPU tensor and Triton's interpreter is off (set TRITON_INTERPRET=1)"
    return False, f"device type {device.type!r} has no Triton backend in lmfuse"


class ResolvedCall:
    """Base of the ops' resolved calls. Each op's ``_resolve`` checks its arguments once and
    returns a frozen dataclass of this type (``SoftmaxCall``, ``DecodeCall``, ...), defined in
    the family's ops module, that its launches and its planner both read; a call that needs
    a field changed makes a new one with ``dataclasses.replace``."""

    __slots__ = ()

    def as_dict(self) -> dict[str, Any]:
        """The fields by name, as a new dict (the values themselves, not copies)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass
class Plan:
    """What an op will do for a given call: the path, the reason, and op-specific facts.

    ``call`` is the op's resolved call (the object its launches read); ``args`` its fields
    as a dict, filled from ``call`` when not given."""

    op: str
    impl: str
    reason: str
    details: dict[str, Any] = field(default_factory=dict)
    args: dict[str, Any] = field(default_factory=dict, repr=False)  # resolved arguments
    call: Any = field(default=None, repr=False, compare=False)  # the call behind ``args``

    def __post_init__(self) -> None:
        if not self.args and isinstance(self.call, ResolvedCall):
            self.args = self.call.as_dict()

    def __str__(self) -> str:
        extra = "".join(f"\n  {k}: {v}" for k, v in self.details.items())
        return f"{self.op}: {self.impl} ({self.reason}){extra}"


def select_impl(op: str, impl: str, device: torch.device) -> tuple[str, str]:
    """Resolve ``impl`` for a call on ``device`` into ``("triton" | "torch", reason)``.

    Eager calls take the answer from a cache keyed by what decides it (the op, ``impl``, the
    device type, ``TRITON_INTERPRET``): the choice and its reason cost about 1.5 us a call
    to form, a tenth of a small op's time on the CPU."""
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {IMPLS}, got {impl!r}")
    if torch.compiler.is_compiling():
        return _select_impl(op, impl, device)
    # CUDA tensors: keyed on the device object itself, with no environment read (the
    # interpreter changes nothing for them) and no ``device.type`` string made (together a
    # microsecond of a small call).
    choice = _select_cuda(op, impl, device)
    if choice is not None:
        return choice
    return _select_cached(op, impl, device.type, os.environ.get("TRITON_INTERPRET", "0"))


def float64_fallback(op: str, impl: str, path: str, reason: str, dtype: torch.dtype, name: str,
                     fallback: str = "the reference") -> tuple[str, str]:
    """``(path, reason)`` from :func:`select_impl` for the families whose kernels compute in
    float32/float16/bfloat16: a float64 argument ``name`` (``dtype``) takes the ``fallback``
    path instead of Triton, and raises ``TypeError`` when ``impl="triton"`` asked for it."""
    if path == "triton" and dtype == torch.float64:
        if impl == "triton":
            raise TypeError(f"{op}: the Triton path takes float32/float16/bfloat16 {name}, "
                            f"got float64; use impl='torch'")
        return "torch", f"float64 input: {fallback} (the kernels are for fp32/16)"
    return path, reason


@functools.lru_cache(maxsize=1024)
def _select_cuda(op: str, impl: str, device: torch.device) -> tuple[str, str] | None:
    """:func:`_select_cached`'s answer for a CUDA device; None for any other device."""
    if device.type != "cuda":
        return None
    return _select_cached(op, impl, "cuda", "")


@functools.lru_cache(maxsize=1024)
def _select_cached(op: str, impl: str, device_type: str, interpret: str) -> tuple[str, str]:
    # (``interpret`` is only part of the key: triton_support reads the environment itself.)
    return _select_impl(op, impl, torch.device(device_type))


def _select_impl(op: str, impl: str, device: torch.device) -> tuple[str, str]:
    ok, why = triton_support(device)
    if impl == "torch":
        return "torch", "impl='torch' requested: plain-PyTorch reference"
    if impl == "triton":
        if not ok:
            raise RuntimeError(f"{op}: impl='triton' cannot run here: {why}")
        return "triton", f"impl='triton' requested; {why}"
    if ok:
        return "triton", f"auto: {why}"
    return "torch", f"auto: reference path because {why}"


_PLANNERS: dict[str, Callable[..., Plan]] = {}


def register_planner(name: str) -> Callable[[Callable[..., Plan]], Callable[..., Plan]]:
    """Register ``fn(*args, **kwargs) -> Plan`` as the planner of public op ``name``."""

    def wrap(fn: Callable[..., Plan]) -> Callable[..., Plan]:
        _PLANNERS[name] = fn
        return fn

    return wrap


def planner_of(fn: Callable[..., Any]) -> Callable[[Callable[..., Plan]], Callable[..., Plan]]:
    """Register the decorated ``plan(**arguments) -> Plan`` as the planner of public op ``fn``.
    The planner takes ``fn``'s own arguments, bound by ``fn``'s signature with its defaults
    filled in, so it accepts and refuses what the op does (a ``TypeError`` prefixed with the
    op's name) and the op's signature is written once."""
    sig = inspect.signature(fn)

    def wrap(body: Callable[..., Plan]) -> Callable[..., Plan]:
        @functools.wraps(body)
        def plan(*args: Any, **kwargs: Any) -> Plan:
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError as e:
                raise TypeError(f"{fn.__name__}: {e}") from None
            bound.apply_defaults()
            return body(**bound.arguments)

        plan.__signature__ = sig.replace(return_annotation=Plan)  # the op's, for help()
        return register_planner(fn.__name__)(plan)

    return wrap


def registered_ops() -> list[str]:
    return sorted(_PLANNERS)


def explain(op: str | Callable, *args: Any, **kwargs: Any) -> Plan:
    """Say which implementation ``op(*args, **kwargs)`` would run, and why, without running it.

    ``op`` is a public lmfuse function (``lmfuse.fused_softmax``) or its name. Inputs are
    validated exactly as the op itself would, so bad input raises here too.

    >>> print(lmfuse.explain(lmfuse.fused_softmax, scores, causal=True))
    fused_softmax: triton (auto: CUDA tensor and triton is installed) ...
    """
    name = op if isinstance(op, str) else getattr(op, "__name__", repr(op))
    if name not in _PLANNERS:
        raise ValueError(f"explain: unknown op {name!r}; known ops: {registered_ops()}")
    return _PLANNERS[name](*args, **kwargs)


# ---------------------------------------------------------------------------------------
# Input checks shared by every op. Each raises TypeError / ValueError naming the argument,
# what was given and what is expected.


def checked_once(check: Callable[..., Any], *args: Any) -> Any:
    """``check(*args)`` through its ``functools.lru_cache``: the scalar options of a training
    loop repeat, so they are checked once, not every call. Under ``torch.compile``, and for
    a bad type or an unhashable value (the cache raises TypeError), the check runs uncached:
    it returns the same answer or raises its own error."""
    if torch.compiler.is_compiling():
        return check.__wrapped__(*args)
    try:
        return check(*args)
    except TypeError:
        return check.__wrapped__(*args)


def check_tensor(
    op: str,
    name: str,
    t: Any,
    *,
    ndim: int | Sequence[int] | None = None,
    dtypes: Sequence[torch.dtype] | None = FLOAT_DTYPES,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout is not torch.strided or t.is_nested:  # (about 0.1 us)
        kind = "nested" if t.is_nested else str(t.layout).replace("torch.", "")
        raise TypeError(f"{op}: {name} must be a dense (strided) tensor, got a {kind} tensor; "
                        "convert it with .to_dense() (or .to_padded_tensor() for a nested one)")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            if isinstance(ndim, range) and ndim.step == 1 and len(ndim) > 2:
                want = (f"at least {ndim.start}-D" if t.dim() < ndim.start
                        else f"at most {ndim[-1]}-D")
            else:
                want = " or ".join(f"{n}-D" for n in allowed)
            raise ValueError(
                f"{op}: {name} must be {want}, got {t.dim()}-D with shape {tuple(t.shape)}"
            )
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(dtype_name(d) for d in dtypes)
        raise TypeError(f"{op}: {name} must have dtype in ({names}), got {t.dtype}")
    return t


def check_same_device(op: str, ref_name: str, ref: torch.Tensor, **others: Any) -> None:
    for name, t in others.items():
        if isinstance(t, torch.Tensor) and t.device != ref.device:
            raise ValueError(
                f"{op}: {name} is on {t.device} but {ref_name} is on {ref.device}; "
                "move them to one device"
            )


def check_number(op: str, name: str, value: Any, *, allow_none: bool = True) -> float | None:
    """``value`` as a finite float: a Python or NumPy real number (not a bool)."""
    if value is None and allow_none:
        return None
    if type(value) is not float and (isinstance(value, bool)
                                     or not isinstance(value, numbers.Real)):
        raise TypeError(f"{op}: {name} must be a float, got {type(value).__name__} {value!r}")
    value = float(value)
    # (Comparisons, not math.isfinite: torch.compile traces a float that changes between
    # calls as a symbol, which compares but has no isfinite; NaN fails both.)
    if not -math.inf < value < math.inf:
        raise ValueError(f"{op}: {name} must be finite, got {value}")
    return value


FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max


def check_float32(op: str, name: str, value: float | None) -> float | None:
    """A checked number (:func:`check_number`'s) that the kernels take as a float32
    argument: beyond float32's range it would be inf there (and the result NaN)."""
    if value is not None and abs(value) > FLOAT32_MAX:
        raise ValueError(f"{op}: {name} must be within float32's range (|{name}| <= "
                         f"{FLOAT32_MAX:.4g}), got {value}")
    return value


def check_int(op: str, name: str, value: Any, *, minimum: int | None = None) -> int:
    """``value`` as an int: a Python or NumPy integer (not a bool)."""
    if type(value) is not int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__} "
                            f"{value!r}")
        value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{op}: {name} must be >= {minimum}, got {value}")
    return value


def check_choice(op: str, name: str, value: Any, choices: Sequence[str]) -> str:
    """``value`` if it is one of the strings ``choices``, else ``ValueError`` naming them."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{op}: {name} must be one of {tuple(choices)}, got {value!r}")
    return value
