"""The small helpers every family's launcher uses: ceiling division and powers of two for
grids and block sizes, dtype names for messages, the shared dtype sets, the saturating fp8
cast and whether a GPU's kernels can convert to fp8, the lazy import of a family's Triton
kernels (each kernel launched through :class:`FastLaunch`, which skips Triton's per-launch
binding once a specialisation has compiled), and :func:`kernel_op`, the one way a launch is
called: directly when eager, through its ``torch.library`` custom op under
``torch.compile``.

It sits below every other module (it imports torch alone) and never imports ``triton`` at
import time: ``import lmfuse`` works where Triton is absent (the reference path still runs);
a family's kernels module (and Triton) is imported on its first launch.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import warnings
from types import ModuleType
from typing import Any, Callable, Iterator, Optional

import torch

__all__ = ["FLOAT_DTYPES", "KERNEL_DTYPES", "INDEX_DTYPES", "FP8_DTYPES", "cdiv", "next_pow2",
           "is_pow2", "dtype_name", "DTYPE_NAMES", "dtype_named", "lazy_kernels", "kernel_op",
           "to_e4m3", "fp8_capable", "env_setting", "ON_OFF"]

#: The floating dtypes the ops take (``check_tensor``'s default).
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
#: The dtypes the Triton kernels compute on (float64 inputs take the reference path).
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Integer dtypes taken for indices and lengths (block tables, positions, targets).
INDEX_DTYPES = (torch.int32, torch.int64)
#: The fp8 format the kernels store and read (KV caches, saved activations).
FP8_DTYPES = (torch.float8_e4m3fn,)


#: The words lmfuse's on/off settings take (any case, surrounding spaces ignored).
ON_OFF = {"1": "on", "true": "on", "on": "on", "yes": "on",
          "0": "off", "false": "off", "off": "off", "no": "off"}


def env_setting(name: str, default: str, choices: dict[str, str]) -> str:
    """The environment variable ``name`` as lmfuse reads its settings: one of the words of
    ``choices`` in any case, spaces around it ignored, given as its meaning there; unset or
    empty: ``default``; any other value warns (naming the variable, the value and the words
    it takes) and gives ``default``."""
    raw = os.environ.get(name, "")
    word = raw.strip().lower()
    if not word:
        return default
    if word in choices:
        return choices[word]
    warnings.warn(f"lmfuse: ignoring {name}={raw!r} (expected one of "
                  f"{', '.join(choices)}); using {default!r}", stacklevel=2)
    return default


#: Softcaps above this take tanh's series for small arguments in the kernels (``HAS_SOFTCAP``
#: 2, not 1): the cheaper form's absolute error, ~cap * ulp(1) in a capped value, stays a few
#: 1e-6 up to here (the models' caps: 30, 50), and the series costs instructions.
SOFTCAP_SERIES_ABOVE = 64.0


def softcap_mode(softcap: float | None) -> int:
    """The kernels' ``HAS_SOFTCAP``: 0 without a cap, 1 for one up to
    :data:`SOFTCAP_SERIES_ABOVE`, 2 above it."""
    if softcap is None:
        return 0
    return 2 if softcap > SOFTCAP_SERIES_ABOVE else 1


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints (``b > 0``), without going through floats."""
    return -(-a // b)


def next_pow2(n: int, minimum: int = 1) -> int:
    """The smallest power of two ``>= n``, and at least ``minimum`` (1 for ``n <= 1``)."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


def is_pow2(v: Any) -> bool:
    """True for a positive ``int`` (not a bool) that is a power of two."""
    return isinstance(v, int) and not isinstance(v, bool) and v > 0 and v & (v - 1) == 0


#: The names a dtype may be given by (command lines, the planner, the Generator's
#: ``kv_dtype``), lower case; ``"fp8"`` is ``float8_e4m3fn``. Each user takes the subset it
#: accepts.
DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn, "e4m3": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2, "fp8_e5m2": torch.float8_e5m2, "float8_e5m2": torch.float8_e5m2,
}


def dtype_named(text: str) -> torch.dtype | None:
    """The dtype :data:`DTYPE_NAMES` gives ``text`` (any case, ``"torch."`` allowed), or
    None."""
    return DTYPE_NAMES.get(text.strip().lower().removeprefix("torch."))


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: a dtype as messages and tables spell it."""
    return str(dtype).replace("torch.", "")


def to_e4m3(t: torch.Tensor) -> torch.Tensor:
    """``t`` as float8_e4m3fn, saturated at +-448 as the kernels' own fp8 stores are (torch's
    CUDA cast turns magnitudes above 464 into NaN); NaN stays NaN (clamp keeps it)."""
    return t.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


@functools.lru_cache(maxsize=None)
def fp8_capable(device: torch.device) -> bool:
    """A CUDA device on which Triton compiles float8_e4m3fn conversions and loads (compute
    capability 8.9 and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def lazy_kernels(module: str, package: str) -> Callable[[], Any]:
    """A function returning the kernels module ``package.module``, imported on its first call
    and kept. Triton reads ``TRITON_INTERPRET`` when a kernel is defined, and ``lmfuse``
    must import without triton: so no family imports its kernels at import time.

    A family binds it once, ``_kernels = lazy_kernels("kernels", __package__)``, and
    launches ``_kernels().some_kernel[grid](...)`` (tests may replace ``_kernels``). What it
    returns reads as the module; its JIT kernels launch through :class:`FastLaunch`."""
    loaded: Any = None

    def kernels() -> Any:
        nonlocal loaded
        if loaded is None:
            loaded = _Kernels(importlib.import_module(f".{module}", package))
        return loaded

    return kernels


class _Kernels:
    """A kernels module as the launchers see it: each attribute the module's own, but a
    ``triton.jit`` kernel wrapped in :class:`FastLaunch` (looked up once, then kept here)."""

    def __init__(self, module: ModuleType) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        if _ENABLED and _jit_class() is not None and type(value) is _jit_class():
            value = FastLaunch(value)
        setattr(self, name, value)
        return value


# --- the launch's host path ------------------------------------------------------------------
#
# Triton's ``kernel[grid](...)`` binds and specialises every argument, builds its cache key,
# reads its settings and launch hooks, then calls the compiled kernel's launcher: about 32
# us a launch on an H100 host (2026-11-27, triton 3.6), of which the launcher itself is 11.
# FastLaunch keeps each compiled kernel under a key of what Triton specialises on and calls
# the launcher directly after the first launch.

#: ``LMFUSE_FAST_LAUNCH=0``: kernels are not wrapped at all; ``check``: each fast launch is
#: compared with Triton's own binding (the tests' mode).
_FAST_LAUNCH = env_setting("LMFUSE_FAST_LAUNCH", "on", dict(ON_OFF, check="check"))
_ENABLED = _FAST_LAUNCH != "off"
#: Off inside :func:`triton_launches`: the wrapped kernels launch through Triton.
_FAST = _ENABLED
_CHECK = _FAST_LAUNCH == "check"
_MISSING = object()


@functools.lru_cache(maxsize=None)
def _jit_class() -> Any:
    """Triton's ``JITFunction`` when its ``run`` launches the compiled kernel the way
    :class:`FastLaunch` does (checked in its source once), else None (plain launches)."""
    try:
        import inspect

        from triton.runtime.jit import JITFunction

        source = inspect.getsource(JITFunction.run)
    except Exception:  # no triton, or no source to check: the plain launch
        return None
    if ("kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata,"
            " launch_metadata" not in " ".join(source.split())):
        return None
    return JITFunction


def fast_launches() -> bool:
    """Whether kernels launch through :class:`FastLaunch` (on, and the installed Triton
    launches the way it expects)."""
    return _FAST and _jit_class() is not None


@contextlib.contextmanager
def triton_launches() -> Iterator[None]:
    """Inside, every kernel launches through Triton's own ``kernel[grid](...)`` (what
    ``lmfuse bench host`` compares :class:`FastLaunch` against)."""
    global _FAST
    before, _FAST = _FAST, False
    try:
        yield
    finally:
        _FAST = before


@functools.lru_cache(maxsize=None)
def _runtime_knobs() -> Any:
    from triton import knobs

    return knobs.runtime


def _runtime_hooks() -> tuple[Any, Any]:
    runtime = _runtime_knobs()
    return runtime.launch_enter_hook, runtime.launch_exit_hook


def _hooked() -> bool:
    """Whether a launch hook is set (a profiler's): then launches take Triton's path. Triton
    keeps them as None or as chains of calls (``knobs.HookChain``), empty when unset."""
    enter, exit_ = _runtime_hooks()
    return bool((enter is not None and getattr(enter, "calls", True))
                or (exit_ is not None and getattr(exit_, "calls", True)))


def _current_device() -> int:
    return torch.cuda.current_device()


def _raw_stream(device: int) -> int:
    """The current CUDA stream's handle on ``device`` (what Triton's own launch takes)."""
    return torch._C._cuda_getCurrentRawStream(device)


class FastLaunch:
    """A ``triton.jit`` kernel launched as ``kernel[grid](*args, **kwargs)``, as Triton's own,
    but with the compiled kernel kept under a key of what Triton specialises a launch on:
    each constexpr's value; a tensor's dtype and whether its address is a multiple of 16; an
    int's kind (32 or 64 bits), whether it is 1 and whether a multiple of 16; the type of a
    float; None; a bool's value; the launch options (``num_warps``, ...); the current
    device. The first launch of a key goes through Triton (which compiles), the next ones
    straight to the compiled kernel's launcher on the current stream. The key is never
    coarser than Triton's specialisation (``LMFUSE_FAST_LAUNCH=check`` asserts, on every
    launch, that the kernel it picks is the one Triton would; ``=0`` turns the path off).
    An argument of another type, a missing one, a callable grid or a launch hook set (a
    profiler's) take Triton's path."""

    __slots__ = ("kernel", "_names", "_constexpr", "_defaults", "_plans", "_compiled")

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        params = kernel.params
        self._names = tuple(p.name for p in params)
        self._constexpr = tuple(bool(p.is_constexpr) for p in params)
        self._defaults = tuple(p.default if p.has_default else _MISSING for p in params)
        # (positional count, keyword names) -> the function making (key, values) for such a
        # call, or None where Triton's path must take it (a name given twice, one missing).
        self._plans: dict[tuple, Any] = {}
        self._compiled: dict[tuple, Any] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def key(self, args: tuple, kwargs: dict) -> tuple[Optional[tuple], Any]:
        """``(key, values)``: the cache key (None: a call this path does not take, for
        Triton's path) and every parameter's value in order. A parameter left to its
        default is not in the key: which ones are is (the count of positional arguments
        and the names given)."""
        shape = (len(args), tuple(kwargs))
        plan = self._plans.get(shape, _MISSING)
        if plan is _MISSING:
            plan = self._plans[shape] = self._plan(*shape)
        if plan is None:
            return None, ()
        try:
            return plan(args, kwargs, _current_device())
        except _Unknown:
            return None, ()

    def _plan(self, n: int, given: tuple[str, ...]) -> Any:
        """The function making ``(key, values)`` for calls of ``n`` positional arguments and
        the keywords ``given``: its source written here and compiled once, each argument's
        part of the key inline (no loop, no call for a tensor or an int), as Triton's own
        binder is made."""
        names, constexpr = self._names, self._constexpr
        if n > len(names) or any(names.index(g) < n for g in given if g in names):
            return None
        def part(v: str, const: bool) -> str:
            return v if const else (
                f"(({v}.dtype, not {v}.data_ptr() & 15) if type({v}) is T else "
                f"(-2147483648 <= {v} <= 2147483647, {v} == 1, not {v} & 15, {v} >= 1 << 63) "
                f"if type({v}) is I else {v} if {v} is None or type({v}) is B else S({v}))")

        local = {g: f"k{j}" for j, g in enumerate(given)}
        key = [part(f"a{i}", constexpr[i]) for i in range(n)]
        for g in given:  # a launch option (num_warps, ...) as it is
            i = names.index(g) if g in names else None
            key.append(part(local[g], i is None or constexpr[i]))
        values = [f"a{i}" for i in range(n)]
        env: dict[str, Any] = {"T": torch.Tensor, "B": bool, "I": int, "S": _spec}
        for i in range(n, len(names)):
            if names[i] in given:
                values.append(local[names[i]])
            elif self._defaults[i] is _MISSING:
                return None  # missing: Triton's error
            else:
                env[f"d{i}"] = self._defaults[i]
                values.append(f"d{i}")
        lines = ["def plan(a, k, dev):"]
        if n:
            lines.append(f"    {''.join(f'a{i}, ' for i in range(n))}= a")
        lines += [f"    {local[g]} = k[{g!r}]" for g in given]
        lines.append(f"    return (dev, {n}, {given!r}, {''.join(p + ', ' for p in key)}), "
                     f"({''.join(v + ', ' for v in values)})")
        source = "\n".join(lines) + "\n"
        exec(source, env)  # noqa: S102 - code made here, from the kernel's parameter names
        return env["plan"]

    def launch(self, grid: Any, args: tuple, kwargs: dict) -> Any:
        if not _FAST or callable(grid) or _hooked() or self.kernel.pre_run_hooks:
            return self.kernel[grid](*args, **kwargs)
        key, values = self.key(args, kwargs)
        try:
            compiled = self._compiled.get(key) if key is not None else None
        except TypeError:  # an unhashable constexpr
            key = compiled = None
        if compiled is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if key is not None and compiled is not None:
                self._compiled[key] = compiled
            return compiled
        if _CHECK:  # Triton's own launch, which must have picked the same compilation
            used = self.kernel[grid](*args, **kwargs)
            assert used is compiled, (f"FastLaunch keeps another compilation of "
                                      f"{self.kernel.fn.__name__} than Triton picks")
            return compiled
        n = len(grid)
        compiled.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1,
                     _raw_stream(key[0]), compiled.function, compiled.packed_metadata, None,
                     None, None, *values)
        return compiled


class _Unknown(Exception):
    """An argument of a type :func:`_spec` does not know how Triton specialises."""


def _spec(v: Any) -> Any:
    """What Triton specialises a non-constexpr argument on (raises ``_Unknown`` for a type it
    is not known here how Triton takes)."""
    kind = type(v)
    if kind is torch.Tensor:
        return v.dtype, not v.data_ptr() & 15
    if kind is int:
        return -2147483648 <= v <= 2147483647, v == 1, not v & 15, v >= 1 << 63
    if kind is float:
        return float
    if v is None or kind is bool:
        return v
    if isinstance(v, torch.Tensor):
        return v.dtype, not v.data_ptr() & 15
    raise _Unknown


def kernel_op(name: str, fake: Callable[..., Any], *,
              mutates_args: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], Any]:
    """Register a launch function as the custom op ``lmfuse::name`` and return what the ops
    call in its place: the launch itself when eager (the dispatcher costs tens of
    microseconds a call), the custom op while ``torch.compile`` traces (an opaque node, so
    the graph does not break). ``fake`` computes the outputs' shapes for tracing;
    ``mutates_args`` names the arguments written in place.

    The launch takes what a custom op can (tensors, optional tensors, numbers, bools,
    strings, dtypes), fully annotated, and returns new tensors (or None); the same body runs
    both ways, so eager and compiled calls compute alike. The result keeps the custom op as
    ``.op`` (for ``torch.library.opcheck``) and the plain function as ``.launch``::

        @kernel_op("rms_norm_fwd", fake=lambda x, w, eps: ...)
        def _launch_fwd(x: torch.Tensor, w: Optional[torch.Tensor], eps: float) -> ...:
            ...
    """

    def register(launch: Callable[..., Any]) -> Callable[..., Any]:
        op = torch.library.custom_op(f"lmfuse::{name}", launch, mutates_args=mutates_args)
        op.register_fake(fake)

        @functools.wraps(launch)
        def call(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                return op(*args, **kwargs)
            return launch(*args, **kwargs)

        call.op, call.launch = op, launch
        return call

    return register
