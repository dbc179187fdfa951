"""Decode attention, the merge, the cache append and the block on the GPU, compiled (not the
interpreter): the NaN/inf rules and the input contract of ``tests/attention/test_contract.py``
where only a GPU can show them.

* NaN and inf: the same cases on CUDA tensors against the float64 reference (including fp8
  caches, whose NaN byte the interpreter widens to 480, and NaN stored into an fp8 cache,
  which the interpreter stores as 384: only the GPU's conversions are checked here).
* The contract: with ``lmfuse.set_checks(True)`` a CUDA call raises the ValueError the CPU
  raises, word for word, before anything is written; with the checks off (the default) the
  same call raises nothing, reads and writes nothing outside the tensors (guard rows hold
  NaN or a sentinel; ``torch.cuda.synchronize()`` surfaces any device fault), and a capture
  into a CUDA graph skips the checks even when they are on.

Run on a CUDA machine with the Triton compiler::

    LMFUSE_GPU_TESTS=1 python -m pytest -q -rA tests/gpu/test_decode_attention_contract.py

For an out-of-bounds audit under compute-sanitizer, see ``attention_bad_inputs.py`` here.
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional

import pytest
import torch

import lmfuse
from lmfuse.attention.block import DecodeAttentionBlock, qk_norm_rope_append
from lmfuse.attention.reference import (decode_attention_reference,
                                        merge_attention_states_reference)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU and the Triton compiler (LMFUSE_GPU_TESTS=1)")

DEV = "cuda"
F32, BF16, F16, FP8 = torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn
I32 = torch.int32
NAN, INF = math.nan, math.inf
TOL = {F32: 1e-5, F16: 2e-3, BF16: 1.6e-2}


@pytest.fixture(autouse=True)
def _checks_restored():
    yield
    lmfuse.set_checks(False)


def rnd(*shape: int, dtype: torch.dtype = F32, g: Optional[torch.Generator] = None,
        scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEV, generator=g) * scale).to(dtype)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Same NaN / +-inf pattern; finite values within the dtype's tolerance (max-relative)."""
    got, want = got.double().cpu(), want.double().cpu()
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN pattern"
    for s in (INF, -INF):
        assert torch.equal(got == s, want == s), f"{what}: {s} pattern"
    fin = torch.isfinite(want)
    if fin.any():
        err = (got[fin] - want[fin]).abs().max() / want[fin].abs().max().clamp(min=1e-30)
        assert err <= TOL[dtype], f"{what}: max error {float(err):.2e} > {TOL[dtype]}"


def paged(caches, lens, block_len: int, g: torch.Generator):
    """Pools with shuffled blocks, NaN in every row no sequence holds, -1 after each
    sequence's blocks."""
    B, S, H, D = caches[0].shape
    per = -(-S // block_len)
    N = B * per + 2
    order = torch.randperm(N, device="cpu", generator=torch.Generator().manual_seed(1))
    pools = [torch.full((N, block_len, H, D), NAN, device=DEV).to(c.dtype) for c in caches]
    table = torch.full((B, per + 1), -1, dtype=I32)
    for b, n in enumerate(lens):
        for j in range(-(-n // block_len)):
            blk = int(order[b * per + j])
            table[b, j] = blk
            for pool, c in zip(pools, caches):
                rows = c[b, j * block_len:(j + 1) * block_len]
                pool[blk, :rows.shape[0]] = rows
    return pools, table.to(DEV)


# --- NaN and inf --------------------------------------------------------------------------------


NAN_CASES = ["q-head", "key-seen", "value-seen", "key-after-token", "before-window",
             "nan-sink", "inf-sink", "inf-key", "fp8-nan-key"]


@pytest.mark.parametrize("splits", [None, 1, 4])
@pytest.mark.parametrize("layout", [None, 16])
@pytest.mark.parametrize("qdt", [BF16, F16])
@pytest.mark.parametrize("case", NAN_CASES)
def test_nan_and_inf_follow_the_reference(case: str, qdt, layout, splits) -> None:
    g = torch.Generator(device=DEV).manual_seed(0)
    B, S, Hkv, G, D, L = 3, 2, 2, 4, 128, [700, 333, 0]
    Smax = max(L)
    fp8 = case.startswith("fp8")
    q = rnd(B, S, Hkv * G, D, g=g)
    k, v = rnd(B, Smax, Hkv, D, g=g), rnd(B, Smax, Hkv, D, g=g)
    for b, n in enumerate(L):
        k[b, n:], v[b, n:] = NAN, NAN
    window, sinks = None, None
    if case == "q-head":
        q[1, 0, 5] = NAN
    elif case in ("key-seen", "fp8-nan-key"):
        k[0, 100, 1, 7] = NAN
    elif case == "value-seen":
        v[1, 40, 0, 3] = NAN
    elif case == "key-after-token":
        k[0, L[0] - 1, 0, 0] = NAN
    elif case == "before-window":
        window = 50
        k[0, :L[0] - S - window], v[0, :L[0] - S - window] = NAN, NAN
    elif case == "nan-sink":
        sinks = rnd(Hkv * G, g=g)
        sinks[3] = NAN
    elif case == "inf-sink":
        sinks = rnd(Hkv * G, g=g)
        sinks[2] = INF
    elif case == "inf-key":
        q = q.abs()
        k[0, 10, 0] = INF
    ks = vs = None
    if fp8:
        ks, vs = torch.tensor([0.5, 2.0], device=DEV), torch.tensor([1.5, 0.25], device=DEV)
        k, v = (k / ks[:, None]).to(FP8), (v / vs[:, None]).to(FP8)
    else:
        k, v = k.to(qdt), v.to(qdt)
    q = q.to(qdt)
    table = None
    if layout:
        (k, v), table = paged((k, v), L, layout, g)
    lens = torch.tensor(L, dtype=I32, device=DEV)
    kw = dict(block_table=table, window_size=window, sinks=sinks, k_scale=ks, v_scale=vs)
    out, lse = lmfuse.decode_attention(q, k, v, lens, **kw, return_lse=True, num_splits=splits)
    ref_kw = {n: (t.double() if n in ("sinks", "k_scale", "v_scale") and t is not None else t)
              for n, t in kw.items()}
    want, want_lse = decode_attention_reference(q.double(), k, v, lens, **ref_kw,
                                                return_lse=True)
    what = f"{case} {qdt} paged={layout} splits={splits}"
    close(out, want, qdt, f"{what}: out")
    close(lse, want_lse, F32, f"{what}: lse")
    if case != "before-window":
        assert want.isnan().any(), f"{what}: the case injects nothing the reference sees"


def test_merge_nan_and_inf() -> None:
    outs, lses = rnd(3, 7, 64), rnd(3, 7, scale=2.0)
    lses[1, 0] = NAN
    lses[2, 1] = INF
    lses[0, 2], lses[1, 2] = NAN, INF
    lses[:, 3], outs[:, 3] = -INF, NAN
    lses[0, 4], outs[0, 4] = -INF, NAN
    lses[:, 5] = torch.tensor([0.0, -300.0, 1.0], device=DEV)
    outs[1, 5, 2] = NAN
    for dtype in (F32, BF16):
        out, lse = lmfuse.merge_attention_states(outs.to(dtype), lses)
        want, want_lse = merge_attention_states_reference(outs.to(dtype).double(), lses.double())
        close(out, want, dtype, f"merge {dtype}: out")
        close(lse, want_lse, F32, f"merge {dtype}: lse")


@pytest.mark.parametrize("layout", [None, 16])
@pytest.mark.parametrize("dtype", [BF16, FP8])
def test_append_into_heads_major_caches(layout, dtype) -> None:
    """A heads-major cache (``[B, Hkv, S, D]`` passed transposed): the compiled append writes
    the bytes the reference writes into a token-major cache, and decode reads both alike."""
    B, S, H, D, Hq = 3, 64, 4, 128, 16
    g = torch.Generator(device=DEV).manual_seed(5)
    k, v = rnd(B, S, H, D, g=g), rnd(B, S, H, D, g=g)
    table = None
    if layout:
        (k, v), table = paged((k, v), [S] * B, layout, g)
        k, v = k.nan_to_num(0), v.nan_to_num(0)
    k, v = k.to(dtype), v.to(dtype)
    scales = dict(k_scale=torch.tensor([0.5, 2.0, 1.0, 0.25], device=DEV),
                  v_scale=torch.tensor([1.5, 0.5, 1.0, 4.0], device=DEV)) if dtype == FP8 else {}
    km, vm = (c.transpose(1, 2).contiguous().transpose(1, 2) for c in (k, v))
    new_k, new_v = rnd(B, 3, H, D, dtype=BF16, g=g), rnd(B, 3, H, D, dtype=BF16, g=g)
    lens = torch.tensor([0, 17, S - 3], dtype=I32, device=DEV)
    lmfuse.kv_cache_append(km, vm, new_k, new_v, lens, block_table=table, **scales)
    lmfuse.kv_cache_append(k, v, new_k, new_v, lens, block_table=table, impl="torch", **scales)
    for got, want in ((km, k), (vm, v)):
        assert torch.equal(got.contiguous().view(torch.uint8), want.view(torch.uint8))
    q = rnd(B, 1, Hq, D, dtype=BF16, g=g)
    out = lmfuse.decode_attention(q, km, vm, lens + 3, block_table=table, **scales)
    assert torch.equal(out, lmfuse.decode_attention(q, k, v, lens + 3, block_table=table,
                                                    **scales))


@pytest.mark.parametrize("layout", [None, 4])
def test_fp8_append_and_fused_stage_store_nan(layout) -> None:
    """NaN new rows are stored as the e4m3 NaN byte (the hardware conversion), inf saturates;
    the fused stage (qk-norm + rope + append) too: the clamp alone would store -448."""
    B, S, H, D = 2, 8, 2, 64
    k = torch.zeros(B, S, H, D, device=DEV).to(FP8)
    v = k.clone()
    table = None
    if layout:
        (k, v), table = paged((k.float(), v.float()), [S, S], layout, None)
        k, v = k.nan_to_num(0).to(FP8), v.nan_to_num(0).to(FP8)
    new = rnd(B, 1, H, D)
    new[0, 0, 0, :3] = torch.tensor([NAN, INF, -INF], device=DEV)
    lens = torch.tensor([2, 5], dtype=I32, device=DEV)
    ks = torch.tensor([0.5, 2.0], device=DEV)
    kt, vt, kr, vr = k.clone(), v.clone(), k.clone(), v.clone()
    lmfuse.kv_cache_append(kt, vt, new, new, lens, block_table=table, k_scale=ks, v_scale=ks)
    lmfuse.kv_cache_append(kr, vr, new, new, lens, block_table=table, k_scale=ks, v_scale=ks,
                           impl="torch")
    assert torch.equal(kt.view(torch.uint8), kr.view(torch.uint8))
    Hq = 4
    qkv = rnd(B, 1, (Hq + 2 * H) * D)
    qkv[0, 0, (Hq + 1) * D + 3] = NAN
    kt, vt, kr, vr = k.clone(), v.clone(), k.clone(), v.clone()
    for impl, kc, vc in (("triton", kt, vt), ("torch", kr, vr)):
        qk_norm_rope_append(qkv, kc, vc, lens, num_heads=Hq, num_kv_heads=H,
                            q_norm_weight=torch.ones(D, device=DEV),
                            k_norm_weight=torch.ones(D, device=DEV), block_table=table,
                            k_scale=ks, v_scale=ks, impl=impl)
    nan_t = (kt.view(torch.uint8) & 0x7F) == 0x7F
    nan_r = (kr.view(torch.uint8) & 0x7F) == 0x7F
    assert nan_r.any() and torch.equal(nan_t, nan_r)


# --- the contract ---------------------------------------------------------------------------


def _decode_case(paged_: bool) -> dict[str, Any]:
    g = torch.Generator(device=DEV).manual_seed(2)
    B, S, H, D = 2, 64, 2, 64
    k, v = rnd(B, S, H, D, g=g), rnd(B, S, H, D, g=g)
    kw: dict[str, Any] = dict(q=rnd(B, 1, 4, D, g=g), lens=torch.tensor([10, S], dtype=I32,
                                                                        device=DEV))
    if paged_:
        (k, v), table = paged((k, v), [S, S], 16, g)
        kw["block_table"] = table
    kw["k"], kw["v"] = k, v
    return kw


BAD = {  # name: (paged, change(kw))
    "seqlens-negative": (False, lambda kw: kw["lens"].fill_(-1)),
    "seqlens-past-capacity": (False, lambda kw: kw["lens"].add_(1)),
    "block--1": (True, lambda kw: kw["block_table"].__setitem__((1, 1), -1)),
    "block-past-pool": (True, lambda kw: kw["block_table"].__setitem__((1, 0), 10**6)),
}


def _decode(kw: dict[str, Any], impl: str = "auto"):
    return lmfuse.decode_attention(kw["q"], kw["k"], kw["v"], kw["lens"],
                                   block_table=kw.get("block_table"), impl=impl)


def _cpu(kw: dict[str, Any]) -> dict[str, Any]:
    return {n: t.cpu() for n, t in kw.items()}


@pytest.mark.parametrize("name", list(BAD))
def test_decode_checks_on_raise_the_cpu_error(name: str) -> None:
    paged_, change = BAD[name]
    kw = _decode_case(paged_)
    change(kw)
    with pytest.raises(ValueError) as cpu:
        _decode(_cpu(kw), impl="torch")
    lmfuse.set_checks(True)
    with pytest.raises(ValueError) as gpu:
        _decode(kw)
    assert str(gpu.value) == str(cpu.value)


@pytest.mark.parametrize("name", list(BAD))
@pytest.mark.parametrize("splits", [None, 3])
def test_decode_checks_off_stay_in_bounds(name: str, splits) -> None:
    """No error, no device fault, no NaN from the guard rows around the caches."""
    paged_, change = BAD[name]
    kw = _decode_case(paged_)
    k, v = kw["k"], kw["v"]
    guard_k = torch.full((k.shape[0] + 2, *k.shape[1:]), NAN, device=DEV)
    guard_v = guard_k.clone()
    guard_k[1:-1], guard_v[1:-1] = k, v
    kw["k"], kw["v"] = guard_k[1:-1], guard_v[1:-1]
    change(kw)
    out = lmfuse.decode_attention(kw["q"], kw["k"], kw["v"], kw["lens"],
                                  block_table=kw.get("block_table"), num_splits=splits)
    torch.cuda.synchronize()
    assert not out.isnan().any(), f"{name}: a guard row was read"


def test_append_checks_on_and_off() -> None:
    B, H, D = 2, 2, 64
    pool = torch.full((6, 4, H, D), 5.0, device=DEV)
    k = pool[1:5]  # blocks 0..3; the pool's rows 0 and 5 are guards
    v = k.clone()
    table = torch.tensor([[0, -1], [2, 9]], dtype=I32, device=DEV)
    new = rnd(B, 3, H, D)
    lens = torch.tensor([2, 3], dtype=I32, device=DEV)  # both reach an unmapped block
    with pytest.raises(ValueError) as cpu:
        lmfuse.kv_cache_append(k.cpu(), v.cpu(), new.cpu(), new.cpu(), lens.cpu(),
                               block_table=table.cpu(), impl="torch")
    lmfuse.set_checks(True)
    before = pool.clone()
    with pytest.raises(ValueError) as gpu:
        lmfuse.kv_cache_append(k, v, new, new, lens, block_table=table)
    assert str(gpu.value) == str(cpu.value)
    assert torch.equal(pool, before)
    lmfuse.set_checks(False)
    lmfuse.kv_cache_append(k, v, new, new, lens, block_table=table)
    torch.cuda.synchronize()
    assert (pool[0] == 5).all() and (pool[5] == 5).all(), "a guard block was written"


def test_zero_fp8_scale_checked_only_with_checks_on() -> None:
    k = torch.zeros(1, 4, 2, 64, device=DEV).to(FP8)
    new = rnd(1, 1, 2, 64)
    scale = torch.tensor([0.0, 1.0], device=DEV)
    lmfuse.set_checks(True)
    with pytest.raises(ValueError, match=r"k_scale must be finite and > 0"):
        lmfuse.kv_cache_append(k, k.clone(), new, new, torch.zeros(1, dtype=I32, device=DEV),
                               k_scale=scale)
    lmfuse.set_checks(False)
    lmfuse.kv_cache_append(k, k.clone(), new, new, torch.zeros(1, dtype=I32, device=DEV),
                           k_scale=scale)
    assert torch.equal(k[0, 0, 0].float().abs(), torch.full((64,), 448.0, device=DEV))


def test_capture_skips_the_checks() -> None:
    """Inside CUDA-graph capture the checks never run (they would synchronise): bad lengths
    are captured as they are and replay in bounds."""
    kw = _decode_case(False)
    lmfuse.set_checks(True)
    _decode(kw)  # warm-up (compiles)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _decode(kw)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _decode(kw)
    kw["lens"].fill_(10**6)  # past the capacity: unchecked in the replay
    graph.replay()
    torch.cuda.synchronize()
    assert not out.isnan().any()


def test_block_checks_on_match_cpu() -> None:
    torch.manual_seed(0)
    blk = DecodeAttentionBlock(64, 4, 2, 32, impl="auto").to(DEV)
    k = torch.zeros(2, 4, 2, 32, device=DEV)
    lens = torch.tensor([1, 4], dtype=I32, device=DEV)  # sequence 1: no room for its token
    x = rnd(2, 1, 64)
    with torch.no_grad(), pytest.raises(ValueError) as cpu:
        blk.cpu()(x.cpu(), k.cpu(), k.cpu(), lens.cpu())
    blk.to(DEV)
    lmfuse.set_checks(True)
    with torch.no_grad(), pytest.raises(ValueError) as gpu:
        blk(x, k, k.clone(), lens)
    assert str(gpu.value) == str(cpu.value)
    lmfuse.set_checks(False)
    with torch.no_grad():
        blk(x, k, k.clone(), lens)
    torch.cuda.synchronize()


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("group,s_active,B", [(2, 1, 1), (8, 8, 2), (8, 1, 64)])
def test_every_dtype_fits_shared_memory(dtype, paged: bool, D: int, group: int,
                                        s_active: int, B: int) -> None:
    """The tables' tiles are measured with 2-byte caches; float32 caches in the same tiles
    needed more shared memory than a program may have (on 4 H200s: contiguous head dim 128
    with one program a sequence, paged head dim 64 with 64 query rows). Every dtype, both
    layouts, head dims 64-256, few programs and many: the launch fits and equals the
    float64 reference."""
    torch.manual_seed(0)
    Hkv, S = 2, 700
    q = torch.randn(B, s_active, group * Hkv, D, device=DEV).to(dtype)
    k = torch.randn(B, S, Hkv, D, device=DEV).to(dtype)
    v = torch.randn(B, S, Hkv, D, device=DEV).to(dtype)
    lens = torch.randint(s_active, S + 1, (B,), device=DEV, dtype=torch.int32)
    sinks = torch.randn(group * Hkv, device=DEV)
    want = decode_attention_reference(q.double(), k.double(), v.double(), lens,
                                      sinks=sinks.double())
    kw: dict[str, Any] = {}
    if paged:
        block = 32
        nb = S // block + 1
        perm = torch.randperm(B * nb, device=DEV)
        table = perm.view(B, nb).to(torch.int32)
        kp = torch.zeros(B * nb, block, Hkv, D, device=DEV, dtype=dtype)
        vp = torch.zeros_like(kp)
        kpad = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, nb * block - S))
        vpad = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, nb * block - S))
        kp[table.flatten().long()] = kpad.reshape(B * nb, block, Hkv, D)
        vp[table.flatten().long()] = vpad.reshape(B * nb, block, Hkv, D)
        k, v, kw = kp, vp, {"block_table": table}
    got = lmfuse.decode_attention(q, k, v, lens, sinks=sinks, impl="triton", **kw)
    torch.cuda.synchronize()
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert err <= {F32: 1e-5, F16: 2e-3, BF16: 1.6e-2}[dtype], (err, dtype)
