"""``lmfuse._launch.FastLaunch`` on a GPU: every family's kernels launch through it, and a
launch it makes directly runs the compilation Triton's own launch would pick.

Run on a CUDA machine with the Triton compiler (not the interpreter)::

    LMFUSE_GPU_TESTS=1 python -m pytest -q -rA tests/gpu/test_fast_launch_gpu.py

(``LMFUSE_FAST_LAUNCH=check`` makes every launch of any suite make that check.)"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import assert_close

import lmfuse
from lmfuse import _launch
from lmfuse._launch import FastLaunch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU and the Triton compiler (LMFUSE_GPU_TESTS=1)")

DEV = "cuda"


@pytest.fixture
def check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_launch, "_CHECK", True)


def test_every_family_launches_through_it() -> None:
    from lmfuse.activations import ops as act
    from lmfuse.attention import ops as attn
    from lmfuse.cross_entropy import ops as ce
    from lmfuse.norm import ops as norm
    from lmfuse.softmax import ops as sm

    for ops, name in ((act, "act_fwd_kernel"), (norm, "norm_fwd_kernel"),
                      (attn, "decode_kernel"), (ce, None), (sm, None)):
        kernels = ops._kernels()
        names = [n for n in dir(kernels._module) if n.endswith("_kernel")]
        assert names and all(isinstance(getattr(kernels, n), FastLaunch) for n in names
                             if type(getattr(kernels._module, n)) is _launch._jit_class())
        if name is not None:
            assert isinstance(getattr(kernels, name), FastLaunch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_launches_by_alignment_and_size_pick_triton_s_compilation(check, dtype) -> None:
    """Offsets of one element (addresses not multiples of 16), sizes of 1 and of multiples of
    16 and not: each direct launch checked against Triton's pick, each result against the
    reference."""
    g = torch.Generator(DEV).manual_seed(0)
    base = torch.randn(70, 130, generator=g, device=DEV, dtype=dtype)
    w = torch.randn(64, generator=g, device=DEV, dtype=dtype)
    for _ in range(2):  # the second round launches every key directly
        for rows in (1, 16, 33):
            for offset in (0, 1):
                x = base[:rows, offset:offset + 128]
                what = f"{dtype} rows {rows} offset {offset}"
                y = lmfuse.swiglu(x)
                ref = torch.nn.functional.silu(x[:, :64].float()) * x[:, 64:].float()
                assert_close(y.float(), ref, dtype, f"swiglu {what}")
                h = base[:rows, offset:offset + 64]
                n = lmfuse.rms_norm(h, w, eps=1e-6)
                hf = h.float()
                ref = hf * torch.rsqrt(hf.square().mean(-1, keepdim=True) + 1e-6) * w.float()
                assert_close(n.float(), ref, dtype, f"rms_norm {what}")


def test_backward_and_cross_entropy_through_it(check) -> None:
    g = torch.Generator(DEV).manual_seed(1)
    for rows in (1, 16, 40):
        x = torch.randn(rows, 96, generator=g, device=DEV, requires_grad=True)
        t = torch.randint(0, 96, (rows,), generator=g, device=DEV)
        for _ in range(2):
            loss = lmfuse.cross_entropy(x, t)
            (dx,) = torch.autograd.grad(loss, x)
            xr = x.detach().requires_grad_(True)
            ref = torch.nn.functional.cross_entropy(xr, t)
            (dr,) = torch.autograd.grad(ref, xr)
            torch.testing.assert_close(loss, ref)
            torch.testing.assert_close(dx, dr)
