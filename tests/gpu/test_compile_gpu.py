"""Every public op under ``torch.compile(fullgraph=True)`` with Inductor on the GPU: the
cases of ``test_cuda_graphs.py`` (forward, and backward where the op has one), compiled and
compared with the eager call on the same data.

The CPU suite compiles every op too (``tests/test_compile_coverage.py`` and the families'
``test_compile.py``), with ``backend="aot_eager"`` and the kernels in Triton's interpreter;
this file is what a GPU user runs: Inductor's own code for the PyTorch ops around lmfuse's
(reshapes, GEMMs, casts) and lmfuse's Triton kernels compiled for the device, reached
through their ``torch.library`` custom ops (``lmfuse._launch.kernel_op``). Inductor may
fuse or reorder the PyTorch ops around a custom op, so results are compared within the
rounding of the inputs' dtype rather than bit for bit; in-place writes (the cache appends)
are compared too, from the same starting state.

Run on a CUDA machine with the Triton compiler::

    LMFUSE_GPU_TESTS=1 python -m pytest -q -rA tests/gpu/test_compile_gpu.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import lmfuse

# The cases are test_cuda_graphs.py's (pytest imports test files by path, not as modules:
# this folder goes on the path for the one import).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_cuda_graphs import (CASES, Case, _outputs, _refresh_params, bits,  # noqa: E402
                              pytestmark)

__all__ = ["pytestmark"]  # the CUDA-only skip, as test_cuda_graphs.py's

# Inductor recompiles per case (each is its own function); the default cache of 8 is too
# small for a long parametrised run in one process.
torch._dynamo.config.cache_size_limit = 64


def _tolerance(t: torch.Tensor) -> float:
    return {torch.float32: 1e-4, torch.float16: 4e-3}.get(t.dtype, 2e-2)


def _run(case: Case, fn, inputs: list, module, leaves: list, upstream: list) -> list:
    if not case.backward:
        with torch.no_grad():
            outs = _outputs(fn(*inputs) if module is None else fn(module, *inputs))
        return [o.detach() for o in outs]
    outs = _outputs(fn(*inputs) if module is None else fn(module, *inputs))
    grads = torch.autograd.grad(outs, leaves, upstream)
    return [o.detach() for o in outs] + list(grads)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_op_compiles_like_eager(case: Case) -> None:
    torch._dynamo.reset()
    inputs = case.fresh()
    for i in case.wrt:
        inputs[i].requires_grad_(True)
    module = case.module() if case.module is not None else None
    _refresh_params(module)
    trained = module if case.module_grads else None
    leaves = [inputs[i] for i in case.wrt] + (
        [p for p in trained.parameters()] if trained is not None else [])
    upstream: list[torch.Tensor] = []
    if case.backward:
        with torch.no_grad():
            first = _outputs(case.fn(*inputs) if module is None else case.fn(module, *inputs))
            upstream.extend(torch.randn_like(o) for o in first)
    start = [inputs[i].detach().clone() for i in case.mutated]

    want = _run(case, case.fn, inputs, module, leaves, upstream)
    want += [inputs[i].detach().clone() for i in case.mutated]
    with torch.no_grad():
        for i, s in zip(case.mutated, start):
            inputs[i].copy_(s)
    compiled = torch.compile(case.fn, fullgraph=True)
    got = _run(case, compiled, inputs, module, leaves, upstream)
    got += [inputs[i].detach().clone() for i in case.mutated]

    assert len(got) == len(want)
    for k, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{case.id}: tensor {k}"
        if a.dtype in (torch.float8_e4m3fn, torch.int32, torch.int64, torch.bool):
            assert torch.equal(bits(a), bits(b)), f"{case.id}: tensor {k} differs"
            continue
        tol = _tolerance(a)
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol, equal_nan=True,
                                   msg=lambda m: f"{case.id}: tensor {k}: {m}")


@pytest.mark.parametrize("op", ["swiglu", "geglu"])
def test_fp8_input_store_compiles_like_eager(op: str) -> None:
    """``fp8_input_store=True``: the forward kernel writes x's float8 copy into a buffer its
    custom op mutates (``lmfuse::act_fwd_x8``); compiled, the gradients equal eager's."""
    torch._dynamo.reset()
    x = (torch.randn(512, 688, device="cuda") * 2).to(torch.bfloat16).requires_grad_(True)
    g = torch.randn(512, 344, device="cuda").to(torch.bfloat16)

    def f(t):
        return getattr(lmfuse, op)(t, fp8_input_store=True)

    want = torch.autograd.grad(f(x), x, g)[0]
    got = torch.autograd.grad(torch.compile(f, fullgraph=True)(x), x, g)[0]
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
