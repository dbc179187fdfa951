"""Programmatic dependent launch (lmfuse._pdl): the kernels' wait-first rule and the modes.

A kernel launched early that touched memory before its ``pdl_wait`` would read its
predecessor's output half written; on the GPU that shows only as wrong tokens now and then.
Here every kernel taking a ``PDL`` flag is read: its first statement that loads, stores or
calls a helper must be the wait, then the start signal.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch

from lmfuse import _pdl
from lmfuse.attention import decode_kernels
from lmfuse.norm import kernels as norm_kernels
from lmfuse.serving import kernels as serving_kernels

KERNELS = [
    (mod, name) for mod in (norm_kernels, decode_kernels, serving_kernels)
    for name, obj in vars(mod).items()
    if hasattr(obj, "arg_names") and "PDL" in obj.arg_names
    and obj.fn.__module__ == mod.__name__  # not the helpers imported from lmfuse._pdl
]


def _body(fn) -> list[ast.stmt]:
    src = textwrap.dedent(inspect.getsource(fn.fn))
    func = ast.parse(src).body[0]
    body = func.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return body


def _call_name(stmt: ast.stmt) -> str | None:
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        f = stmt.value.func
        return f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
    return None


def test_the_pdl_kernels_are_found():
    names = {name for _, name in KERNELS}
    assert {"norm_fwd_kernel", "decode_kernel", "merge_kernel", "gemv_kernel",
            "rope_append_kernel"} <= names


@pytest.mark.parametrize("mod,name", KERNELS, ids=[n for _, n in KERNELS])
def test_each_pdl_kernel_waits_before_anything_else(mod, name):
    body = _body(getattr(mod, name))
    first, second = (_call_name(s) for s in body[:2])
    assert (first, second) == ("pdl_wait", "pdl_start"), (
        f"{name}: the first two statements must be pdl_wait(PDL), pdl_start(PDL); "
        f"got {ast.unparse(body[0])!r}, {ast.unparse(body[1])!r}")
    for stmt in body[:2]:
        args = stmt.value.args
        assert len(args) == 1 and isinstance(args[0], ast.Name) and args[0].id == "PDL"


def test_mode_is_off_where_pdl_cannot_run(monkeypatch):
    assert _pdl.mode(torch.device("cpu")) == 0
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _pdl.mode(torch.device("cuda")) == 0  # interpreted kernels have no grid control


def test_launch_options():
    assert _pdl.launch_options(0) == {}
    assert _pdl.launch_options(1) == {"launch_pdl": True}
    assert _pdl.launch_options(2) == {"launch_pdl": True}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("env,want", [("0", 0), ("2", 2), ("1", 1), (" 2 ", 2), ("junk", 1)])
def test_mode_follows_the_environment_on_hopper(monkeypatch, env, want):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("LMFUSE_PDL", env)
    dev = torch.device("cuda")
    if torch.cuda.get_device_capability(dev)[0] < 9:
        assert _pdl.mode(dev) == 0
        return
    if env == "junk":
        with pytest.warns(UserWarning, match="ignoring LMFUSE_PDL='junk'"):
            assert _pdl.mode(dev) == want
    else:
        assert _pdl.mode(dev) == want
