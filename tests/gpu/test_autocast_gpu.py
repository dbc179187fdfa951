"""Ops whose dtypes follow CUDA autocast as PyTorch's do, on the GPU (the CPU suite cannot
enter CUDA autocast): ``lmfuse.layer_norm`` and ``lmfuse.LayerNorm`` as ``F.layer_norm``
and ``nn.LayerNorm`` (autocast's float32 list: a 16-bit x normalised in float32, a float32
output), and ``apply_rotary_pos_emb`` with bf16 q and k and float32 tables (what a model
under autocast passes it) as transformers' formula (float32 out, bf16 gradients).

    LMFUSE_GPU_TESTS=1 python -m pytest -q tests/gpu/test_autocast_gpu.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import lmfuse

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helpers
sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import assert_close  # noqa: E402
from test_cuda_graphs import pytestmark  # noqa: E402

__all__ = ["pytestmark"]  # the CUDA-only skip, as test_cuda_graphs.py's

DEV = "cuda"
BF16, F32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize("x_dtype", [BF16, torch.float16, F32])
@pytest.mark.parametrize("impl", ["auto", "torch"])
def test_layer_norm_under_autocast_is_f_layer_norms(x_dtype, impl) -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 96, device=DEV).to(x_dtype).requires_grad_(True)
    w = (torch.rand(96, device=DEV) + 0.5).requires_grad_(True)
    b = torch.randn(96, device=DEV).requires_grad_(True)
    g = torch.randn(64, 96, device=DEV)
    with torch.autocast(DEV, BF16):
        want = F.layer_norm(x, (96,), w, b, 1e-5)
        got = lmfuse.layer_norm(x, w, b, eps=1e-5, impl=impl)
    assert got.dtype == want.dtype == F32
    assert_close(got, want, F32, "output")
    for a, e, name in zip(torch.autograd.grad(got, (x, w, b), g),
                          torch.autograd.grad(want, (x, w, b), g), ("dx", "dw", "db")):
        assert a.dtype == e.dtype, name
        assert_close(a, e, x_dtype if name == "dx" else F32, name)
    module = lmfuse.LayerNorm(96).to(DEV)
    with torch.autocast(DEV, BF16):
        assert module(x).dtype == torch.nn.LayerNorm(96).to(DEV)(x).dtype == F32


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_rotary_with_float32_tables_is_the_formulas(impl) -> None:
    pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama as llama

    torch.manual_seed(0)
    q = torch.randn(2, 9, 4, 64, device=DEV, dtype=BF16).transpose(1, 2).requires_grad_(True)
    k = torch.randn(2, 9, 2, 64, device=DEV, dtype=BF16).transpose(1, 2).requires_grad_(True)
    angle = torch.rand(2, 9, 32, device=DEV) * 6.3
    angle = torch.cat((angle, angle), -1)
    cos, sin = angle.cos(), angle.sin()
    got = lmfuse.apply_rotary_pos_emb(q, k, cos, sin, impl=impl)
    want = llama.apply_rotary_pos_emb(q, k, cos, sin)
    gs = [torch.randn_like(t) for t in want]
    for a, e in zip(got, want):
        assert a.dtype == e.dtype == F32
        assert_close(a, e, F32, "q_embed, k_embed")
    for a, e in zip(torch.autograd.grad(got, (q, k), gs), torch.autograd.grad(want, (q, k), gs)):
        assert a.dtype == e.dtype == BF16
        assert_close(a, e, BF16, "dq, dk")
