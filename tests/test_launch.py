"""``lmfuse._launch.FastLaunch``: the launch path that calls a compiled kernel's launcher
directly after Triton's first launch. Triton's interpreter (the suite's) has no compiled
kernels, so these tests drive it with a stand-in JIT kernel that specialises as Triton does;
the GPU suites run every real kernel through it (and ``LMFUSE_FAST_LAUNCH=check`` asserts
there that it keeps the compilation Triton picks)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from lmfuse import _launch
from lmfuse._launch import FastLaunch


class Param:
    def __init__(self, p: inspect.Parameter) -> None:
        self.name = p.name
        self.is_constexpr = p.name in ("B", "EXTRA")  # the stand-in kernel's constexprs
        self.has_default = p.default is not inspect.Parameter.empty
        self.default = p.default


class Compiled:
    """A compiled kernel: records the launcher's calls."""

    def __init__(self, key: tuple) -> None:
        self.key, self.calls = key, []
        self.function, self.packed_metadata = object(), object()

    def run(self, *args: Any) -> None:
        self.calls.append(args)


def triton_key(values: list, constexpr: list, options: dict) -> tuple:
    """What Triton specialises a launch on (as its binder does)."""
    key = []
    for v, c in zip(values, constexpr):
        if c or v is None or isinstance(v, bool):
            key.append(repr(v) if isinstance(v, list) else v)
        elif isinstance(v, torch.Tensor):
            key.append((v.dtype, v.data_ptr() % 16 == 0))
        elif isinstance(v, int):
            key.append(("i32" if -2**31 <= v < 2**31 else "i64", v == 1, v % 16 == 0))
        else:
            key.append(type(v).__name__)
    return tuple(key) + tuple(sorted(options.items()))


class Jit:
    """A stand-in ``triton.jit`` kernel: ``kernel[grid](...)`` binds, specialises, compiles
    once per key and launches (recorded in ``slow``)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.signature = inspect.signature(fn)
        self.params = [Param(p) for p in self.signature.parameters.values()]
        self.cache: dict[tuple, Compiled] = {}
        self.slow: list = []
        self.pre_run_hooks: list = []

    def __getitem__(self, grid: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Compiled:
            options = {k: kwargs.pop(k) for k in list(kwargs) if k in ("num_warps", "launch_pdl")}
            bound = self.signature.bind(*args, **kwargs)
            bound.apply_defaults()
            values = list(bound.arguments.values())
            key = triton_key(values, [p.is_constexpr for p in self.params], options)
            compiled = self.cache.setdefault(key, Compiled(key))
            self.slow.append((grid, values))
            return compiled

        return run


def kernel(X, Y, n, scale, flag, B: int = 4, EXTRA=None):  # noqa: N803 - Triton's style
    pass


@pytest.fixture
def fast(monkeypatch: pytest.MonkeyPatch) -> tuple[FastLaunch, Jit, list]:
    streams: list = []
    monkeypatch.setattr(_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(_launch, "_raw_stream", lambda d: streams.append(d) or 1234)
    monkeypatch.setattr(_launch, "_runtime_hooks", lambda: (None, None))
    jit = Jit(kernel)
    return FastLaunch(jit), jit, streams


def test_first_launch_through_triton_then_the_launcher_directly(fast) -> None:
    f, jit, streams = fast
    x, y = torch.zeros(64), torch.zeros(64)
    first = f[(3,)](x, y, 40, 0.5, True, B=8, num_warps=2)
    assert len(jit.slow) == 1 and first.calls == []
    again = f[(5, 2)](x, y, 56, 0.25, True, B=8, num_warps=2)
    assert again is first and len(jit.slow) == 1  # n 40 and 56: neither 1 nor a multiple of 16
    (call,) = first.calls
    assert call[:9] == (5, 2, 1, 1234, first.function, first.packed_metadata, None, None, None)
    assert list(call[9:]) == [x, y, 56, 0.25, True, 8, None]  # every parameter, in order
    assert streams == [0]


@pytest.mark.parametrize("change", [
    "dtype", "unaligned", "one", "multiple_of_16", "int64", "constexpr", "option", "default",
    "flag", "none", "by_name"])
def test_a_launch_triton_would_specialise_otherwise_goes_through_triton(fast, change) -> None:
    f, jit, _ = fast
    x, y = torch.zeros(64), torch.zeros(64)
    args = dict(X=x, Y=y, n=40, scale=0.5, flag=True)
    kw = dict(B=8, num_warps=2)
    f[(1,)](*args.values(), **kw)
    f[(1,)](*args.values(), **kw)
    assert len(jit.slow) == 1
    if change == "dtype":
        args["X"] = torch.zeros(64, dtype=torch.float16)
    elif change == "unaligned":
        args["Y"] = y[1:]
    elif change == "one":
        args["n"] = 1
    elif change == "multiple_of_16":
        args["n"] = 32
    elif change == "int64":
        args["n"] = 2**40 + 8
    elif change == "constexpr":
        kw["B"] = 16
    elif change == "option":
        kw["num_warps"] = 4
    elif change == "default":
        kw.pop("B")
    elif change == "flag":
        args["flag"] = False
    elif change == "none":
        args["X"] = None
    elif change == "by_name":  # a tensor given by name, unaligned
        kw["EXTRA"], args["flag"] = 3, True
        new = f[(1,)](x, y, 40, 0.5, flag=True, B=8, num_warps=2)
        assert len(jit.slow) == 2
        assert f[(1,)](x, y, 40, 0.5, flag=True, B=8, num_warps=2) is new
        assert f[(1,)](x, y, 40, 0.5, flag=False, B=8, num_warps=2) is not new
        return
    new = f[(1,)](*args.values(), **kw)
    assert len(jit.slow) == 2, "a launch Triton specialises otherwise must compile its own"
    assert new is not next(iter(jit.cache.values()))
    f[(1,)](*args.values(), **kw)
    assert len(jit.slow) == 2 and len(new.calls) == 1  # and is kept under its own key


def test_floats_values_and_unaligned_pointers_by_the_same_key_share_a_compilation(fast) -> None:
    f, jit, _ = fast
    x, y = torch.zeros(64), torch.zeros(64)
    f[(1,)](x[1:], y, 7, 0.5, True)
    f[(1,)](x[3:], y, 9, -3.0, True)  # both unaligned, both ints plain i32
    assert len(jit.slow) == 1 and len(jit.cache) == 1


def test_every_argument_by_name_or_by_position(fast) -> None:
    f, jit, _ = fast
    x, y = torch.zeros(64), torch.zeros(64)
    by_name = f[(1,)](X=x, Y=y, n=40, scale=0.5, flag=True, B=8)
    assert f[(2,)](X=x, Y=y, n=56, scale=0.25, flag=True, B=8) is by_name
    assert list(by_name.calls[0][9:]) == [x, y, 56, 0.25, True, 8, None]
    positional = f[(1,)](x, y, 40, 0.5, True, 8, 3)  # the constexprs too, by position
    assert f[(1,)](x, y, 56, 0.5, True, 8, 3) is positional
    assert f[(1,)](x, y, 56, 0.5, True, 8, 4) is not positional  # EXTRA: a constexpr's value
    assert len(positional.calls) == 1 and len(jit.slow) == 3


def test_what_it_does_not_take_goes_through_triton(fast, monkeypatch) -> None:
    f, jit, _ = fast
    x, y = torch.zeros(64), torch.zeros(64)
    for _ in range(2):
        f[lambda meta: (1,)](x, y, 40, 0.5, True)  # a callable grid
    for _ in range(2):
        f[(1,)](x, y, "forty", 0.5, True)  # a type the key does not know
    with pytest.raises(TypeError):
        f[(1,)](x, y, 40, 0.5)  # a missing argument: Triton's own error
    with pytest.raises(TypeError):
        f[(1,)](x, y, 40, 0.5, True, n=3)  # given twice
    for _ in range(2):
        f[(1,)](x, y, 40, 0.5, True, EXTRA=[1, 2])  # an unhashable constexpr
    assert len(jit.slow) == 6
    chain = type("HookChain", (), {"calls": []})()  # Triton 3.6's unset hooks: empty chains
    monkeypatch.setattr(_launch, "_runtime_hooks", lambda: (chain, chain))
    f[(1,)](x, y, 40, 0.5, True)
    f[(1,)](x, y, 40, 0.5, True)
    assert len(jit.slow) == 7
    chain.calls.append(print)  # a profiler's hook
    f[(1,)](x, y, 40, 0.5, True)
    monkeypatch.setattr(_launch, "_runtime_hooks", lambda: (None, print))
    f[(1,)](x, y, 40, 0.5, True)
    monkeypatch.setattr(_launch, "_runtime_hooks", lambda: (None, None))
    jit.pre_run_hooks.append(print)
    f[(1,)](x, y, 40, 0.5, True)
    assert len(jit.slow) == 10


def test_check_mode_asserts_the_compilation_triton_picks(fast, monkeypatch) -> None:
    f, jit, _ = fast
    x, y = torch.zeros(64), torch.zeros(64)
    monkeypatch.setattr(_launch, "_CHECK", True)
    first = f[(1,)](x, y, 40, 0.5, True)
    assert f[(1,)](x, y, 40, 0.5, True) is first and len(jit.slow) == 2  # Triton launched it
    jit.cache.clear()  # Triton now compiles anew: another compilation than the kept one
    with pytest.raises(AssertionError, match="another compilation"):
        f[(1,)](x, y, 40, 0.5, True)


def test_kernels_modules_wrap_only_jit_kernels(monkeypatch) -> None:
    import types

    monkeypatch.setattr(_launch, "_jit_class", lambda: Jit)
    module = types.ModuleType("fake_kernels")
    module.k, module.BLOCK, module.helper = Jit(kernel), 128, len
    monkeypatch.setitem(__import__("sys").modules, "lmfuse.fake_kernels", module)
    loaded = _launch.lazy_kernels("fake_kernels", "lmfuse")()
    assert isinstance(loaded.k, FastLaunch) and loaded.k.kernel is module.k
    assert loaded.k is loaded.k  # wrapped once
    assert loaded.BLOCK == 128 and loaded.helper is len
    assert _launch.lazy_kernels("fake_kernels", "lmfuse")() is not loaded  # one per binding
    with _launch.triton_launches():  # looked up first in there: wrapped all the same
        assert isinstance(_launch.lazy_kernels("fake_kernels", "lmfuse")().k, FastLaunch)
    monkeypatch.setattr(_launch, "_ENABLED", False)  # LMFUSE_FAST_LAUNCH=0
    assert _launch.lazy_kernels("fake_kernels", "lmfuse")().k is module.k


def test_the_installed_triton_launches_as_fast_launch_expects() -> None:
    """The source check passes on the installed Triton (3.9 on the CPU, 3.6 on the GPU image:
    the GPU suites run its real launches), and the interpreter's kernels are not wrapped."""
    pytest.importorskip("triton")
    assert _launch._jit_class() is not None
    from lmfuse.activations import ops

    assert not isinstance(ops._kernels().act_fwd_kernel, FastLaunch)


def test_switched_off_after_wrapping_launches_through_triton(fast) -> None:
    """Inside ``triton_launches()`` (``lmfuse bench host``'s comparison row) every launch is
    Triton's; after it, direct again."""
    f, jit, _ = fast
    x, y = torch.zeros(64), torch.zeros(64)
    first = f[(1,)](x, y, 40, 0.5, True)
    with _launch.triton_launches():
        f[(1,)](x, y, 40, 0.5, True)
    assert len(jit.slow) == 2 and first.calls == []
    f[(1,)](x, y, 40, 0.5, True)
    assert len(jit.slow) == 2 and len(first.calls) == 1


def test_dtype_names_one_map() -> None:
    from lmfuse._launch import DTYPE_NAMES, dtype_named

    assert dtype_named(" BF16 ") is torch.bfloat16 and dtype_named("torch.float16") is torch.float16
    assert dtype_named("fp8") is torch.float8_e4m3fn and dtype_named("int8") is None
    assert all(dtype_named(name) is dtype for name, dtype in DTYPE_NAMES.items())
