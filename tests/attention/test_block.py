"""DecodeAttentionBlock (lmfuse.attention.block) against a plain PyTorch block written out
here from the same weights, over a few generated tokens (Triton through the interpreter,
and the reference path); the fused qk-norm + rope + cache-append stage against its
reference; argument validation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, randn

import lmfuse
from lmfuse.attention.block import (DecodeAttentionBlock, qk_norm_rope_append,
                                    qk_norm_rope_append_reference, rope_inv_freq,
                                    rope_reference)

F64 = torch.float64
FP8 = torch.float8_e4m3fn
HIDDEN, HQ, HKV, D = 32, 4, 2, 16  # GQA group 2; head_dim given (HQ * D != HIDDEN)
BLOCK_LEN = 4


# --- a plain PyTorch block, written out (float64 math) -----------------------------------------


def slot(table: Optional[torch.Tensor], b: int, p: int) -> tuple[int, int]:
    """Where sequence b's position p lives: (row, position) of a contiguous cache, or
    (block id, offset) of a paged one."""
    if table is None:
        return b, p
    return int(table[b, p // BLOCK_LEN]), p % BLOCK_LEN


def rotate(x: torch.Tensor, pos: torch.Tensor, rotary_dim: int, theta: float,
           interleaved: bool) -> torch.Tensor:
    """Rotary embedding of x [B, s, H, D] (float64) as Hugging Face writes it: inv_freq and
    the angle in float32, then cos/sin; ``x * cos + rotate_half(x) * sin`` on the first
    rotary_dim dims (GPT-J's pairs (2j, 2j+1) when interleaved)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float()
                                / rotary_dim))
    angle = (pos.float()[:, :, None] * inv_freq).double()[:, :, None, :]  # [B, s, 1, R/2]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        cos = angle.cos().repeat_interleave(2, -1)
        sin = angle.sin().repeat_interleave(2, -1)
        half = torch.stack((-rot[..., 1::2], rot[..., 0::2]), -1).flatten(-2)
    else:
        cos = torch.cat((angle.cos(), angle.cos()), -1)
        sin = torch.cat((angle.sin(), angle.sin()), -1)
        a, b = rot.chunk(2, -1)
        half = torch.cat((-b, a), -1)
    return torch.cat((rot * cos + half * sin, rest), -1)


def plain_step(blk: DecodeAttentionBlock, x, k_cache, v_cache, lens, table, k_scale, v_scale,
               positions=None):
    """One step of the block from blk's weights, in float64, rounding to x's dtype where the
    block keeps a tensor in it (norm, qkv, q, attention, output) and k into the cache from
    its exact value. Writes the caches; returns y."""
    dt, (B, s, _) = x.dtype, x.shape

    def f(t):
        return None if t is None else t.detach().to(F64)

    eps = blk.norm_eps
    h = x
    if blk.input_norm_weight is not None:
        h = F.rms_norm(f(x), (HIDDEN,), f(blk.input_norm_weight), eps).to(dt)
    qkv = F.linear(f(h), f(blk.qkv.weight), f(blk.qkv.bias)).to(dt)
    q, k, v = f(qkv).split([HQ * D, HKV * D, HKV * D], -1)
    q, k, v = q.view(B, s, HQ, D), k.view(B, s, HKV, D), v.view(B, s, HKV, D)
    if blk.q_norm_weight is not None:
        q = F.rms_norm(q, (D,), f(blk.q_norm_weight), eps)
        k = F.rms_norm(k, (D,), f(blk.k_norm_weight), eps)
    if blk.rope:
        pos = (lens.long()[:, None] + torch.arange(s)) if positions is None else positions
        q = rotate(q, pos, blk.rotary_dim, blk.rope_theta, blk.rope_interleaved)
        k = rotate(k, pos, blk.rotary_dim, blk.rope_theta, blk.rope_interleaved)
    q = q.to(dt)

    fp8 = k_cache.dtype == FP8
    ks = torch.ones(HKV) if k_scale is None else k_scale.float()
    vs = torch.ones(HKV) if v_scale is None else v_scale.float()
    for b in range(B):
        for i in range(s):
            at = slot(table, b, int(lens[b]) + i)
            if fp8:  # the block quantises k from float32
                k_cache[at] = (k[b, i].float() / ks[:, None]).clamp(-448, 448).to(FP8)
                v_cache[at] = (v[b, i].float() / vs[:, None]).clamp(-448, 448).to(FP8)
            else:
                k_cache[at] = k[b, i].to(k_cache.dtype)
                v_cache[at] = v[b, i].to(v_cache.dtype)

    scale = 1.0 / math.sqrt(D)
    out = torch.zeros(B, s, HQ, D, dtype=F64)
    for b in range(B):
        n = int(lens[b]) + s
        keys = torch.stack([k_cache[slot(table, b, j)] for j in range(n)]).to(F64)
        vals = torch.stack([v_cache[slot(table, b, j)] for j in range(n)]).to(F64)
        keys = (keys * ks.to(F64)[:, None]).repeat_interleave(HQ // HKV, 1)  # [n, HQ, D]
        vals = (vals * vs.to(F64)[:, None]).repeat_interleave(HQ // HKV, 1)
        for i in range(s):
            p = int(lens[b]) + i
            j = torch.arange(n)
            visible = j <= p
            if blk.window_size is not None:
                visible &= j >= p - blk.window_size
            logits = torch.einsum("hd,nhd->hn", q[b, i].to(F64), keys) * scale
            logits = logits.masked_fill(~visible, -math.inf)
            if blk.sinks is not None:
                logits = torch.cat((logits, f(blk.sinks)[:, None]), 1)
            prob = torch.softmax(logits, -1)[:, :n]
            out[b, i] = torch.einsum("hn,nhd->hd", prob, vals)
    attn = out.to(dt).to(F64).reshape(B, s, HQ * D)
    return F.linear(attn, f(blk.out.weight), f(blk.out.bias)).to(dt)


# --- caches -----------------------------------------------------------------------------------


def make_cache(lens: list[int], final: list[int], dtype: torch.dtype, paged: bool):
    """Caches holding random keys/values at positions < lens[b], NaN (never to be read) past
    them, room up to final[b]. Paged: blocks of 4 shuffled over a pool with spare blocks, -1
    in the table past the last block a sequence reaches."""
    B, S = len(lens), max(final)
    k, v = randn((B, S, HKV, D)), randn((B, S, HKV, D))
    for b, n in enumerate(lens):
        k[b, n:], v[b, n:] = math.nan, math.nan
    k, v = k.to(dtype), v.to(dtype)
    if not paged:
        return k, v, None
    per_seq = -(-S // BLOCK_LEN)
    order = torch.randperm(B * per_seq + 2)
    table = torch.full((B, per_seq + 1), -1, dtype=torch.int32)
    kp = torch.full((B * per_seq + 2, BLOCK_LEN, HKV, D), math.nan).to(dtype)
    vp = kp.clone()
    for b in range(B):
        for n in range(-(-final[b] // BLOCK_LEN)):
            blk = int(order[b * per_seq + n])
            table[b, n] = blk
            rows = slice(n * BLOCK_LEN, min((n + 1) * BLOCK_LEN, S))
            kp[blk, :rows.stop - rows.start] = k[b, rows]
            vp[blk, :rows.stop - rows.start] = v[b, rows]
    return kp, vp, table


def rows(cache: torch.Tensor, table, lens) -> torch.Tensor:
    """The first lens[b] rows of every sequence, concatenated (float64)."""
    return torch.cat([torch.stack([cache[slot(table, b, p)] for p in range(int(n))])
                      for b, n in enumerate(lens)]).to(F64)


def fp8_flips(actual: torch.Tensor, expected: torch.Tensor) -> int:
    """Elements of two fp8 tensors that differ, after checking each differs by at most one
    e4m3 step (a value near a rounding boundary, computed in a different order)."""
    a, e = actual.view(torch.uint8).int(), expected.view(torch.uint8).int()
    differ = a != e
    # Neighbouring e4m3 values of one sign have neighbouring bit patterns.
    assert ((a - e).abs()[differ] == 1).all(), "fp8 cache rows differ by more than one step"
    return int(differ.sum())


def randomize(blk: DecodeAttentionBlock) -> None:
    """Norm weights around 1, sinks and biases random (the defaults would hide them)."""
    with torch.no_grad():
        for name, p in blk.named_parameters():
            if "norm_weight" in name:
                p.copy_(1.0 + 0.2 * randn(p.shape))
            elif name in ("sinks", "qkv.bias", "out.bias"):
                p.copy_(0.5 * randn(p.shape))


# --- the block over generated tokens ------------------------------------------------------------


@dataclass
class Case:
    id: str
    dtype: torch.dtype
    s_active: int
    paged: bool
    flags: dict[str, Any] = field(default_factory=dict)
    fp8: bool = False
    scales: bool = False
    positions: bool = False
    num_splits: Optional[int] = None
    impl: str = "triton"


CASES = [
    Case("fp32-contiguous-s1-defaults", torch.float32, 1, False),
    Case("fp16-paged-s2-everything-on", torch.float16, 2, True,
         dict(qk_norm=True, qkv_bias=True, out_bias=True, window_size=4, sinks=True)),
    Case("fp16-contiguous-s2-everything-off", torch.float16, 2, False,
         dict(input_norm=False, rope=False)),
    Case("fp32-paged-s1-qknorm-gptj-partial-rope-window-splits", torch.float32, 1, True,
         dict(input_norm=False, qk_norm=True, rope_interleaved=True, rotary_dim=8,
              window_size=3), num_splits=2),
    Case("fp32-contiguous-s2-fp8-scales-positions-sinks", torch.float32, 2, False,
         dict(qk_norm=True, sinks=True, rope_theta=500000.0), fp8=True, scales=True,
         positions=True),
    Case("fp16-paged-s1-fp8-bias-partial-rope", torch.float16, 1, True,
         dict(qkv_bias=True, rotary_dim=12, window_size=2), fp8=True),
    Case("bf16-contiguous-s1-qknorm", torch.bfloat16, 1, False, dict(qk_norm=True)),
    Case("fp32-paged-s2-reference-path", torch.float32, 2, True,
         dict(qk_norm=True, sinks=True, out_bias=True), impl="torch"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_generation_equals_plain_block(case: Case) -> None:
    """Prefilled caches, then decode steps feeding the block's output back as the next input
    (of both: each step is compared on one input, so a half-precision rounding difference of
    one step does not snowball through the next ones): every step's output and the cache rows
    written equal the plain block's."""
    dt, s = case.dtype, case.s_active
    blk = DecodeAttentionBlock(HIDDEN, HQ, HKV, D, dtype=dt, impl=case.impl, **case.flags)
    randomize(blk)
    steps = 4 if s == 1 else 3
    lens0 = [3, 6]
    final = [n + steps * s for n in lens0]
    cache_dt = FP8 if case.fp8 else dt
    k_cache, v_cache, table = make_cache(lens0, final, cache_dt, case.paged)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    k_scale = v_scale = None
    if case.scales:
        k_scale, v_scale = 0.5 + torch.rand(HKV), 0.5 + torch.rand(HKV)
    lens = torch.tensor(lens0, dtype=torch.int32)
    x = randn((2, s, HIDDEN), dt)
    flips = 0
    for step in range(steps):
        positions = None
        if case.positions:  # rotary positions of their own (say, after left padding)
            positions = lens.long()[:, None] + torch.arange(s) + 5 * step + 11
        with torch.no_grad():
            y = blk(x, k_cache, v_cache, lens, block_table=table, k_scale=k_scale,
                    v_scale=v_scale, positions=positions, num_splits=case.num_splits)
        want = plain_step(blk, x, k_ref, v_ref, lens, table, k_scale, v_scale, positions)
        what = f"{case.id}, step {step}"
        assert_close(y, want, dt, what)
        written = lens + s
        if case.fp8:
            flips += fp8_flips(rows(k_cache, table, written).to(FP8),
                               rows(k_ref, table, written).to(FP8))
            # Attend over the same stored values from here on (see fp8_flips).
            k_ref.copy_(k_cache)
            v_ref.copy_(v_cache)
        else:
            assert_close(rows(k_cache, table, written), rows(k_ref, table, written), dt,
                         f"{what}: keys in the cache")
            assert_close(rows(v_cache, table, written), rows(v_ref, table, written), dt,
                         f"{what}: values in the cache")
        x, lens = y, written
    if case.fp8:
        assert flips <= 2, f"{case.id}: {flips} fp8 cache elements one step off"


def test_reference_path_is_differentiable() -> None:
    blk = DecodeAttentionBlock(HIDDEN, HQ, HKV, D, qk_norm=True, sinks=True, impl="torch")
    k_cache, v_cache, _ = make_cache([2, 3], [3, 4], torch.float32, False)
    x = randn((2, 1, HIDDEN), requires_grad=True)
    blk(x, k_cache, v_cache, torch.tensor([2, 3])).sum().backward()
    for name, p in [("x", x), *blk.named_parameters()]:
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("paged", [False, True])
def test_reference_path_compiles_with_gradients(paged: bool) -> None:
    """The torch path under torch.compile(fullgraph=True) with gradients (no opaque op: it
    has no autograd) traces the forms of the append and the attention that read nothing on
    the host: one graph, the eager gradients and cache rows."""
    torch.manual_seed(0)
    blk = DecodeAttentionBlock(32, 4, 2, qk_norm=True, window_size=3, impl="torch")
    table = torch.tensor([[0, 3, 5], [1, 2, 4]], dtype=torch.int32) if paged else None

    def caches():
        shape = (6, 4, 2, 8) if paged else (2, 12, 2, 8)
        return torch.randn(shape), torch.randn(shape)

    def step(x, k_cache, v_cache, lens):
        return blk(x, k_cache, v_cache, lens, block_table=table).square().sum()

    x = torch.randn(2, 2, 32, requires_grad=True)
    lens = torch.tensor([3, 7])
    params = [x, *blk.parameters()]
    (k1, v1), (k2, v2) = caches(), caches()
    k2.copy_(k1)
    v2.copy_(v1)
    got = torch.autograd.grad(torch.compile(step, fullgraph=True)(x, k1, v1, lens), params)
    want = torch.autograd.grad(step(x, k2, v2, lens), params)
    for a, b in zip(got, want):
        assert_close(a, b, torch.float32, "gradient")
    assert_close(k1, k2, torch.float32, "k cache")
    assert_close(v1, v2, torch.float32, "v cache")


def test_inv_freq_is_float32_whatever_the_module_dtype() -> None:
    blk = DecodeAttentionBlock(HIDDEN, HQ, HKV, D, rope_theta=1e6, rotary_dim=10).half()
    want = 1.0 / (1e6 ** (torch.arange(0, 10, 2, dtype=torch.int64).float() / 10))
    got = blk.inv_freq(torch.device("cpu"))
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(rope_inv_freq(10, 1e6), want)


def test_exported() -> None:
    assert lmfuse.DecodeAttentionBlock is DecodeAttentionBlock
    assert lmfuse.attention.DecodeAttentionBlock is DecodeAttentionBlock
    assert "hidden_size=32" in repr(DecodeAttentionBlock(32, 4, 2, sinks=True))


# --- the fused stage alone ----------------------------------------------------------------------


STAGE_CASES = [
    # id, dtype, cache dtype, paged, qk_norm, rotary (None / "neox" / "gptj"), rotary_dim,
    # scales, positions
    ("fp32-contiguous-norm-neox", torch.float32, None, False, True, "neox", D, False, False),
    ("fp16-paged-gptj-partial-positions", torch.float16, None, True, False, "gptj", 6, False,
     True),
    ("bf16-paged-norm-no-rope", torch.bfloat16, None, True, True, None, 0, False, False),
    ("fp32-paged-fp8-scales-norm-neox", torch.float32, FP8, True, True, "neox", D, True,
     False),
    ("fp16-contiguous-fp8-partial-large-positions", torch.float16, FP8, False, True, "neox",
     10, False, True),
]


@pytest.mark.parametrize("case", STAGE_CASES, ids=[c[0] for c in STAGE_CASES])
def test_fused_stage_equals_reference(case) -> None:
    name, dt, cache_dt, paged, qk_norm, rotary, rotary_dim, scales, use_pos = case
    cache_dt = cache_dt or dt
    B, s = 3, 2
    lens0 = [0, 5, 2]
    k_cache, v_cache, table = make_cache(lens0, [n + s for n in lens0], cache_dt, paged)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    # A view with a row stride wider than the row: the kernel reads strided rows.
    qkv = randn((B, s, (HQ + 2 * HKV) * D + 8), dt)[..., 8:]
    kw: dict[str, Any] = dict(num_heads=HQ, num_kv_heads=HKV, eps=1e-5, block_table=table)
    if qk_norm:
        kw.update(q_norm_weight=1.0 + 0.2 * randn((D,), dt),
                  k_norm_weight=1.0 + 0.2 * randn((D,), dt))
    if rotary:
        kw.update(inv_freq=rope_inv_freq(rotary_dim, 10000.0),
                  rope_interleaved=rotary == "gptj")
    if scales:
        kw.update(k_scale=0.5 + torch.rand(HKV), v_scale=0.5 + torch.rand(HKV))
    if use_pos:  # far positions: the float32 angle's rounding matters
        kw["positions"] = torch.randint(0, 100000, (B, s))
    q = qk_norm_rope_append(qkv, k_cache, v_cache, torch.tensor(lens0), impl="triton", **kw)
    want = qk_norm_rope_append_reference(qkv, k_ref, v_ref, torch.tensor(lens0), **kw)
    assert_close(q, want, dt, f"{name}: q")
    written = torch.tensor(lens0) + s
    if cache_dt == FP8:
        for c, r in ((k_cache, k_ref), (v_cache, v_ref)):
            assert fp8_flips(rows(c, table, written).to(cache_dt),
                             rows(r, table, written).to(cache_dt)) <= 1, name
    else:
        assert_close(rows(k_cache, table, written), rows(k_ref, table, written), dt,
                     f"{name}: k")
        assert torch.equal(rows(v_cache, table, written), rows(v_ref, table, written)), name


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_fused_stage_skips_rows_without_a_slot(paged: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows past the capacity (contiguous) or in a -1 block (paged) raise the same error on
    both paths, before anything is written; with the value checks off (an unchecked CUDA
    call) the kernel writes the rows that have a slot and nothing else."""
    qkv = randn((2, 2, (HQ + 2 * HKV) * D))
    if paged:  # seq 0: one block, then -1; seq 1: two blocks, then -1
        lens0, lens = [2, 4], torch.tensor([3, 8])  # seq 0 writes 3 and (-1 block) 4
        k_cache, v_cache, table = make_cache(lens0, [4, 8], torch.float32, True)
        message = (r"qk_norm_rope_append: block_table\[0, 1\] = -1, but sequence 0's new "
                   r"tokens go to positions 3..4")
    else:  # 8 rows per sequence: seq 1 writes 7 and (past the capacity) 8
        lens0, lens = [2, 4], torch.tensor([6, 7])
        k_cache, v_cache, table = make_cache(lens0, [8, 8], torch.float32, False)
        message = (r"qk_norm_rope_append: sequence 1 holds cache_seqlens\[1\] = 7 tokens; its "
                   r"2 new one\(s\) go up to position 8, past the capacity of 8 rows")
    before = k_cache.clone()
    kw: dict[str, Any] = dict(num_heads=HQ, num_kv_heads=HKV, block_table=table)
    errors = set()
    for impl in ("torch", "triton"):
        with pytest.raises(ValueError, match=message) as info:
            qk_norm_rope_append(qkv, k_cache, v_cache, lens, impl=impl, **kw)
        errors.add(str(info.value))
        assert torch.equal(k_cache.nan_to_num(7.0), before.nan_to_num(7.0)), impl
    assert len(errors) == 1, errors
    monkeypatch.setattr(lmfuse.attention.ops, "value_checks", lambda t: False)
    qk_norm_rope_append(qkv, k_cache, v_cache, lens, impl="triton", **kw)
    changed = (k_cache.nan_to_num(7.0) != before.nan_to_num(7.0)).any(-1).any(-1)
    if paged:
        want = torch.zeros_like(changed)
        want[int(table[0, 0]), 3] = True
    else:
        want = torch.zeros_like(changed)
        want[0, 6:8] = True
        want[1, 7] = True
    assert torch.equal(changed, want)


# --- validation -------------------------------------------------------------------------------


def _call(blk_kw=None, **over):
    """Run a small block (Triton path) on good arguments with some replaced (``over``)."""
    blk = DecodeAttentionBlock(HIDDEN, HQ, HKV, D, impl="triton", **(blk_kw or {}))
    k_cache, v_cache, _ = make_cache([2, 3], [4, 4], torch.float32, False)
    args = dict(x=randn((2, 1, HIDDEN)), k_cache=k_cache, v_cache=v_cache,
                cache_seqlens=torch.tensor([2, 3], dtype=torch.int32))
    kwargs: dict[str, Any] = {}
    for key, value in over.items():
        (args if key in args else kwargs)[key] = value
    with torch.no_grad():
        blk(*args.values(), **kwargs)


BAD_CALLS = [
    ("x-dtype", dict(x=randn((2, 1, HIDDEN), torch.float16)), TypeError, "x is float16"),
    ("x-width", dict(x=randn((2, 1, HIDDEN + 1))), ValueError, "hidden_size=32"),
    ("x-2d", dict(x=randn((2, HIDDEN))), ValueError, "x must be 3-D"),
    ("kv-heads", dict(k_cache=torch.zeros(2, 4, 1, D), v_cache=torch.zeros(2, 4, 1, D)),
     ValueError, "KV heads"),
    ("head-dim", dict(k_cache=torch.zeros(2, 4, HKV, 8), v_cache=torch.zeros(2, 4, HKV, 8)),
     ValueError, "head dim"),
    ("cache-dtypes", dict(k_cache=torch.zeros(2, 4, HKV, D, dtype=FP8)), TypeError,
     "v_cache is float32"),
    ("seqlens-dtype", dict(cache_seqlens=torch.tensor([2.0, 3.0])), TypeError,
     "cache_seqlens"),
    ("seqlens-shape", dict(cache_seqlens=torch.tensor([2, 3, 4])), ValueError,
     "cache_seqlens"),
    ("positions-shape", dict(positions=torch.zeros(2, 2, dtype=torch.long)), ValueError,
     "positions must be"),
    ("positions-dtype", dict(positions=torch.zeros(2, 1)), TypeError, "positions"),
    ("scale-without-fp8", dict(k_scale=torch.ones(HKV)), ValueError, "k_scale"),
    ("table-batch", dict(block_table=torch.zeros(3, 2, dtype=torch.int32)), ValueError,
     "block_table"),
    ("num-splits", dict(num_splits=0), ValueError, "num_splits"),
]


@pytest.mark.parametrize("over, error, match", [c[1:] for c in BAD_CALLS],
                         ids=[c[0] for c in BAD_CALLS])
def test_forward_rejects(over, error, match) -> None:
    with pytest.raises(error, match=match):
        _call(**over)


def test_refused_call_leaves_the_cache_alone() -> None:
    blk = DecodeAttentionBlock(HIDDEN, HQ, HKV, D, impl="triton")
    k_cache, v_cache, _ = make_cache([2, 3], [4, 4], torch.float32, False)
    before = k_cache.clone()
    with torch.no_grad(), pytest.raises(ValueError, match="num_splits"):
        blk(randn((2, 1, HIDDEN)), k_cache, v_cache, torch.tensor([2, 3]), num_splits=0)
    assert torch.equal(k_cache.nan_to_num(), before.nan_to_num())


def test_triton_path_is_inference_only() -> None:
    blk = DecodeAttentionBlock(HIDDEN, HQ, HKV, D, impl="triton")
    k_cache, v_cache, _ = make_cache([2, 3], [4, 4], torch.float32, False)
    with pytest.raises(ValueError, match="inference-only"):
        blk(randn((2, 1, HIDDEN)), k_cache, v_cache, torch.tensor([2, 3]))
    with pytest.raises(ValueError, match="no backward"):
        qk_norm_rope_append(randn((2, 1, (HQ + 2 * HKV) * D), requires_grad=True), k_cache,
                            v_cache, torch.tensor([2, 3]), num_heads=HQ, num_kv_heads=HKV,
                            impl="triton")


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_fused_append_fp8_stores_nan_as_nan(impl: str) -> None:
    """A NaN in the k or v of the fused stage reads back from a float8_e4m3fn cache as NaN
    (0x7F) on both paths, under Triton's interpreter too (whose own conversion gives 384)."""
    qkv = randn((1, 1, (HQ + 2 * HKV) * D))
    qkv[0, 0, HQ * D + 1] = math.nan  # k head 0, dim 1
    qkv[0, 0, (HQ + HKV) * D + 2] = math.nan  # v head 0, dim 2
    k, v = (torch.zeros(1, 2, HKV, D, dtype=torch.float8_e4m3fn) for _ in range(2))
    with torch.no_grad():
        qk_norm_rope_append(qkv, k, v, torch.tensor([0]), num_heads=HQ, num_kv_heads=HKV,
                            impl=impl)
    for cache, dim in ((k, 1), (v, 2)):
        nan = cache[0, 0].float().isnan()
        assert nan[0, dim] and int(nan.sum()) == 1, nan
        assert (cache.view(torch.uint8)[0, 0, 0, dim] & 0x7F) == 0x7F


BAD_BLOCKS = [
    ("gqa", dict(num_heads=3), ValueError, "multiple of num_kv_heads"),
    ("hidden-not-divisible", dict(hidden_size=30, head_dim=None), ValueError, "pass head_dim"),
    ("head-dim-type", dict(head_dim=16.0), TypeError, "head_dim must be an int"),
    ("rotary-odd", dict(rotary_dim=7), ValueError, "rotary_dim must be even"),
    ("rotary-too-wide", dict(rotary_dim=2 * D), ValueError, "rotary_dim"),
    ("rotary-without-rope", dict(rope=False, rotary_dim=8), ValueError, "rope=True"),
    ("theta", dict(rope_theta=0.0), ValueError, "rope_theta"),
    ("flag-type", dict(qk_norm=1), TypeError, "qk_norm must be a bool"),
    ("window", dict(window_size=-1), ValueError, "window_size"),
    ("impl", dict(impl="cuda"), ValueError, "impl must be one of"),
]


@pytest.mark.parametrize("over, error, match", [c[1:] for c in BAD_BLOCKS],
                         ids=[c[0] for c in BAD_BLOCKS])
def test_constructor_rejects(over, error, match) -> None:
    kw: dict[str, Any] = dict(hidden_size=HIDDEN, num_heads=HQ, num_kv_heads=HKV, head_dim=D)
    kw.update(over)
    with pytest.raises(error, match=match):
        DecodeAttentionBlock(kw.pop("hidden_size"), kw.pop("num_heads"),
                             kw.pop("num_kv_heads"), kw.pop("head_dim"), **kw)


def test_fused_stage_rejects() -> None:
    k_cache, v_cache, _ = make_cache([1, 1], [4, 4], torch.float32, False)
    lens = torch.tensor([1, 1])
    good = randn((2, 1, (HQ + 2 * HKV) * D))
    kw: dict[str, Any] = dict(num_heads=HQ, num_kv_heads=HKV, impl="triton")
    with pytest.raises(ValueError, match="num_heads \\+ 2 \\* num_kv_heads"):
        qk_norm_rope_append(randn((2, 1, 7)), k_cache, v_cache, lens, **kw)
    with pytest.raises(ValueError, match="both q_norm_weight and k_norm_weight"):
        qk_norm_rope_append(good, k_cache, v_cache, lens, q_norm_weight=torch.ones(D), **kw)
    with pytest.raises(ValueError, match="k_norm_weight must be"):
        qk_norm_rope_append(good, k_cache, v_cache, lens, q_norm_weight=torch.ones(D),
                            k_norm_weight=torch.ones(D + 1), **kw)
    with pytest.raises(TypeError, match="inv_freq"):
        qk_norm_rope_append(good, k_cache, v_cache, lens,
                            inv_freq=torch.ones(4, dtype=F64), **kw)
    with pytest.raises(ValueError, match="inv_freq must be"):
        qk_norm_rope_append(good, k_cache, v_cache, lens, inv_freq=torch.ones(D), **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_reference_takes_cos_and_sin_of_the_float32_angle(dtype: torch.dtype) -> None:
    """At large positions a half-precision x still rotates by its float32 angle: the result
    is the float64 rotation rounded once to x's dtype, not a rotation by an angle rounded
    to x's dtype first (off by up to 16 rad at position 4000 in bfloat16)."""
    x = randn((1, 3, 2, 16), torch.float32).to(dtype)
    positions = torch.tensor([[5, 1000, 4000]])
    inv_freq = rope_inv_freq(16)
    got = rope_reference(x, positions, inv_freq)
    angle = positions.to(torch.float32)[:, :, None, None] * inv_freq.float()
    c, s = angle.double().cos(), angle.double().sin()
    x1, x2 = x.double().chunk(2, -1)
    want = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    assert got.dtype == dtype
    assert torch.equal(got, want.to(dtype)) or (got.double() - want).abs().max() <= (
        2 * torch.finfo(dtype).eps * want.abs().max())


@pytest.mark.parametrize("name", ["qkv", "q_norm_weight", "k_cache", "v_cache", "k_scale"])
def test_fused_stage_triton_path_refuses_inputs_that_require_grad(name: str) -> None:
    """The fused stage's Triton path has no backward: any tensor input that requires grad
    under grad mode is refused by name (the caches and scales too, whose gradients it would
    drop silently); under no_grad it runs."""
    lens0 = [0, 3]
    fp8 = name == "k_scale"
    k_cache, v_cache, table = make_cache(lens0, [n + 1 for n in lens0],
                                         FP8 if fp8 else torch.float32, False)
    kw: dict[str, Any] = dict(num_heads=HQ, num_kv_heads=HKV, eps=1e-5, block_table=table,
                              q_norm_weight=1.0 + 0.2 * randn((D,)),
                              k_norm_weight=1.0 + 0.2 * randn((D,)))
    if fp8:
        kw.update(k_scale=0.5 + torch.rand(HKV), v_scale=0.5 + torch.rand(HKV))
    args = {"qkv": randn((2, 1, (HQ + 2 * HKV) * D)), "k_cache": k_cache, "v_cache": v_cache}
    target = args[name] if name in args else kw[name]
    target.requires_grad_()
    with pytest.raises(ValueError, match=rf"qk_norm_rope_append: the Triton path has no "
                                         rf"backward .* but {name} requires grad"):
        qk_norm_rope_append(args["qkv"], args["k_cache"], args["v_cache"],
                            torch.tensor(lens0), impl="triton", **kw)
    with torch.no_grad():
        qk_norm_rope_append(args["qkv"], args["k_cache"], args["v_cache"],
                            torch.tensor(lens0), impl="triton", **kw)


def test_a_cache_of_another_dtype_names_x() -> None:
    """The block's caller passes ``x``, not queries: the cache-dtype error says whose
    dtype the caches must have."""
    block = lmfuse.DecodeAttentionBlock(32, 4, 2, 16)
    cache = torch.zeros(2, 4, 2, 16, dtype=torch.float16)
    with pytest.raises(TypeError, match=r"k_cache must have x's dtype float32 or be "
                                        r"float8_e4m3fn, got float16"):
        block(torch.randn(2, 1, 32), cache, cache, torch.tensor([1, 2], dtype=torch.int32))
