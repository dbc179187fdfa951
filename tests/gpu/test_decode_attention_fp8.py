"""Decode attention over fp8 caches, compiled for the GPU: the launches the tables pick there
(one-warp programs, V widened before it is staged for the second dot) against a float64
reference, and against the same kernel with Triton placing the widening itself.

Run on a CUDA machine with the Triton compiler (not the interpreter)::

    LMFUSE_GPU_TESTS=1 python -m pytest -q -rA tests/gpu

The CPU suite runs the same kernel in the interpreter, where the widening cannot be pinned
(no PTX there) and every launch takes the table's CPU values: only here do the GPU's
launch choices run.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import to_paged

import lmfuse
from lmfuse import tuning
from lmfuse.attention.reference import decode_attention_reference

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU and the Triton compiler (LMFUSE_GPU_TESTS=1)")

DEV = "cuda"
FP8 = torch.float8_e4m3fn


def _fp8(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = cache.abs().amax(dim=(0, 1, 3)).float().clamp(min=1e-12) / 448.0
    return (cache.float() / scale[:, None]).to(FP8), scale


CASES = [  # D, group, s_active, paged block_len, window, sinks, forced splits, query dtype
    (128, 4, 1, None, None, False, None, torch.bfloat16),
    (128, 4, 1, 16, None, False, None, torch.bfloat16),
    (64, 4, 1, None, None, False, None, torch.bfloat16),
    (256, 4, 1, None, None, False, None, torch.bfloat16),
    (80, 8, 2, 8, 300, True, 3, torch.bfloat16),
    (128, 1, 4, 64, None, False, 5, torch.float16),
    (128, 8, 8, None, 1000, True, None, torch.float16),
    (64, 4, 3, 16, None, True, 16, torch.bfloat16),
    (128, 4, 1, None, None, False, 1, torch.bfloat16),
]


@pytest.mark.parametrize("regime", ["few programs", "programs fill the GPU"])
@pytest.mark.parametrize("D,group,s_active,block_len,window,sinks,splits,qdt", CASES)
def test_fp8_cache_matches_reference(monkeypatch: pytest.MonkeyPatch, regime, D, group,
                                     s_active, block_len, window, sinks, splits, qdt) -> None:
    """Ragged lengths (0 and 1 included), both program regimes (B * Hkv = 12 programs fill
    no real GPU; a GPU of one SM is pretended for the other: the tables' main entries), forced
    splits and not, the table's launch with and without the pinned widening: within
    bf16/fp16 rounding of a float64 reference on the dequantised cache, and the two launches
    within rounding of each other."""
    if regime == "programs fill the GPU":
        monkeypatch.setattr(tuning, "sm_count", lambda device: 1)
    g = torch.Generator(device=DEV).manual_seed(0)
    B, Hkv, S = 6, 2, 2560
    Hq = Hkv * group
    q = torch.randn(B, s_active, Hq, D, device=DEV, generator=g).to(qdt)
    k = torch.randn(B, S, Hkv, D, device=DEV, generator=g) * 3
    v = torch.randn(B, S, Hkv, D, device=DEV, generator=g) * 3
    lengths = [S, 0, 1, 17, 1999, 2048]
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    k8, ks = _fp8(k)
    v8, vs = _fp8(v)
    kw = dict(k_scale=ks, v_scale=vs, window_size=window, num_splits=splits)
    if sinks:
        kw["sinks"] = torch.randn(Hq, device=DEV, generator=g)
    kd = k8.double() * ks.double()[:, None]
    vd = v8.double() * vs.double()[:, None]
    want = decode_attention_reference(q.double(), kd, vd, lens, window_size=window,
                                      sinks=kw.get("sinks"))
    if block_len:
        (k8, v8), table = to_paged((k8.cpu(), v8.cpu()), lengths, block_len)
        k8, v8, kw["block_table"] = k8.to(DEV), v8.to(DEV), table.to(DEV)
    real = tuning.table
    outs = {}
    for pinned in (True, False):
        monkeypatch.setattr(tuning, "table", lambda family, device, pinned=pinned: (
            dict(real(family, device), widen_v_first=pinned) if family == "decode_attention"
            else real(family, device)))
        plan = lmfuse.explain(lmfuse.decode_attention, q, k8, v8, lens, **kw)
        assert plan.call.launch.WIDEN_V_FIRST is pinned
        outs[pinned] = lmfuse.decode_attention(q, k8, v8, lens, impl="triton", **kw)
    monkeypatch.setattr(tuning, "table", real)
    scale = want.abs().max().item()
    for pinned, got in outs.items():
        assert got.dtype == qdt
        err = (got.double() - want).abs().max().item() / scale
        assert err < 1e-2, (pinned, err)
    diff = (outs[True].double() - outs[False].double()).abs().max().item() / scale
    assert diff < 5e-3, diff
    assert not outs[True][1].any()  # the empty sequence gives zeros
