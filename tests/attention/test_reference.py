"""The decode-attention reference (lmfuse.attention.reference) against a naive float64
computation written out per (sequence, token, head, key), and its properties: paged equals
contiguous whatever the block order, partial results over split key ranges merge exactly."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import to_paged

from lmfuse.attention.reference import (decode_attention_reference, gather_cache,
                                        merge_attention_states_reference)

F64 = torch.float64


def naive(q, k, v, lens, *, scale, window=None, sinks=None):
    """Per (b, i, h): explicit loops over the keys a token sees. k, v: [B, S, Hkv, D]."""
    B, s_active, Hq, D = q.shape
    group = Hq // k.shape[2]
    out = torch.zeros(B, s_active, Hq, D, dtype=F64)
    lse = torch.full((B, s_active, Hq), -math.inf, dtype=F64)
    for b in range(B):
        L = int(lens[b])
        for i in range(s_active):
            p = L - s_active + i
            keys = [j for j in range(L) if j <= p and (window is None or j >= p - window)]
            for h in range(Hq):
                kh = h // group
                logits = [float(q[b, i, h] @ k[b, j, kh]) * scale for j in keys]
                extra = [float(sinks[h])] if sinks is not None else []
                if not logits + extra:
                    continue
                m = max(logits + extra)
                denom = sum(math.exp(x - m) for x in logits + extra)
                lse[b, i, h] = m + math.log(denom)
                for x, j in zip(logits, keys):
                    out[b, i, h] += math.exp(x - lse[b, i, h]) * v[b, j, kh]
    return out, lse


@pytest.mark.parametrize("s_active", [1, 3, 8])
@pytest.mark.parametrize("Hq, Hkv", [(2, 2), (4, 1), (8, 2)])
@pytest.mark.parametrize("window, use_sinks", [(None, False), (3, False), (None, True),
                                               (2, True)])
def test_against_naive(s_active: int, Hq: int, Hkv: int, window, use_sinks: bool) -> None:
    g = torch.Generator().manual_seed(s_active * 100 + Hq * 10 + Hkv)
    B, S, D = 4, 13, 8
    lens = torch.tensor([0, 1, 7, 13])  # empty, shorter than s_active, ragged, full
    q = torch.randn(B, s_active, Hq, D, generator=g, dtype=F64)
    k = torch.randn(B, S, Hkv, D, generator=g, dtype=F64)
    v = torch.randn(B, S, Hkv, D, generator=g, dtype=F64)
    sinks = torch.randn(Hq, generator=g, dtype=F64) if use_sinks else None
    out, lse = decode_attention_reference(q, k, v, lens, scale=0.3, window_size=window,
                                          sinks=sinks, return_lse=True)
    want, want_lse = naive(q, k, v, lens, scale=0.3, window=window, sinks=sinks)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-12)
    if not use_sinks:  # a token that sees nothing: zeros and -inf
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert torch.isinf(lse[0]).all()


@pytest.mark.parametrize("block_len", [1, 4, 5, 16])
def test_paged_equals_contiguous(block_len: int) -> None:
    g = torch.Generator().manual_seed(block_len)
    B, S, Hkv, D, s_active = 3, 11, 2, 8, 2
    lens = torch.tensor([11, 2, 6])
    q = torch.randn(B, s_active, 4, D, generator=g)
    k = torch.randn(B, S, Hkv, D, generator=g)
    v = torch.randn(B, S, Hkv, D, generator=g)
    (kp, vp), table = to_paged((k, v), lens, block_len, extra_columns=2, spare_blocks=3,
                               fill=0.0, generator=g)
    want = decode_attention_reference(q, k, v, lens)
    got = decode_attention_reference(q, kp, vp, lens, block_table=table)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for b in range(B):
        assert torch.equal(gather_cache(kp, table, int(lens[b]), b), k[b, :int(lens[b])])


def test_minus_one_inside_the_used_blocks_raises() -> None:
    cache = torch.zeros(4, 2, 1, 8)
    table = torch.tensor([[0, -1, 1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="has -1 among its first 2 blocks"):
        gather_cache(cache, table, 3, 0)


def test_fp8_cache_dequantised_per_kv_head() -> None:
    g = torch.Generator().manual_seed(0)
    B, S, Hkv, D = 2, 9, 2, 16
    lens = torch.tensor([9, 4])
    q = torch.randn(B, 1, 4, D, generator=g)
    k = torch.randn(B, S, Hkv, D, generator=g)
    v = torch.randn(B, S, Hkv, D, generator=g)
    k_scale, v_scale = torch.tensor([0.5, 2.0]), torch.tensor([0.25, 3.0])
    k8 = (k / k_scale[None, None, :, None]).to(torch.float8_e4m3fn)
    v8 = (v / v_scale[None, None, :, None]).to(torch.float8_e4m3fn)
    got = decode_attention_reference(q, k8, v8, lens, k_scale=k_scale, v_scale=v_scale)
    want = decode_attention_reference(q, k8.float() * k_scale[None, None, :, None],
                                      v8.float() * v_scale[None, None, :, None], lens)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert got.dtype == q.dtype


@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_split_keys_merge_exactly(parts: int) -> None:
    """Attention over a key range split in parts (each a shorter cache seen by all tokens),
    merged with the LSE rule, equals attention over the whole range; the sink counts once."""
    g = torch.Generator().manual_seed(parts)
    B, S, Hkv, Hq, D = 2, 12, 1, 2, 8
    q = torch.randn(B, 1, Hq, D, generator=g, dtype=F64)
    k = torch.randn(B, S, Hkv, D, generator=g, dtype=F64)
    v = torch.randn(B, S, Hkv, D, generator=g, dtype=F64)
    sinks = torch.randn(Hq, generator=g, dtype=F64)
    lens = torch.tensor([S, S])
    want, want_lse = decode_attention_reference(q, k, v, lens, sinks=sinks, return_lse=True)
    bounds = torch.linspace(0, S, parts + 1).round().long().tolist()
    outs, lses = [], []
    for n, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        # the part's keys, all visible to the (last-position) token: a cache of hi - lo rows
        o, lse_part = decode_attention_reference(q, k[:, lo:hi], v[:, lo:hi],
                                                 torch.tensor([hi - lo] * B),
                                                 sinks=sinks if n == 0 else None,
                                                 return_lse=True)
        outs.append(o)
        lses.append(lse_part)
    out, lse = merge_attention_states_reference(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-12)


def test_merge_of_empty_partials() -> None:
    outs = torch.zeros(3, 2, 4)
    lses = torch.full((3, 2), -math.inf)
    lses[1, 0] = 0.5
    outs[1, 0] = torch.arange(4.0)
    out, lse = merge_attention_states_reference(outs, lses)
    assert torch.equal(out[0], torch.arange(4.0)) and lse[0] == 0.5
    assert torch.equal(out[1], torch.zeros(4)) and torch.isinf(lse[1])


@pytest.mark.parametrize("s_active, window", [(1, 3), (2, None)])
def test_unseen_nan_keys_reach_no_gradient(s_active: int, window) -> None:
    """A NaN key and value that token 0 does not see (outside its window; token 1's own
    with s_active = 2) reach neither its output nor the gradients of a loss on it: they
    equal plain attention's over the visible keys only. (With s_active = 2, token 1 sees
    the NaN: its part of the k/v gradients is 0 * NaN, so only q's is compared there.)"""
    g = torch.Generator().manual_seed(s_active)
    S, L, Hq, Hkv, D = 10, 8, 4, 2, 8
    q = torch.randn(1, s_active, Hq, D, generator=g, dtype=F64)
    k = torch.randn(1, S, Hkv, D, generator=g, dtype=F64)
    v = torch.randn(1, S, Hkv, D, generator=g, dtype=F64)
    p = L - s_active  # token 0's position
    visible = list(range(0 if window is None else p - window, p + 1))
    unseen = 0 if window is not None else L - 1
    k[0, unseen], v[0, unseen] = math.nan, math.nan
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = decode_attention_reference(*leaves, torch.tensor([L]), window_size=window)
    out[:, 0].sum().backward()
    plain = [t.clone().requires_grad_() for t in (q, k, v)]
    kk = plain[1][0, visible].repeat_interleave(Hq // Hkv, dim=1)  # [n, Hq, D]
    vv = plain[2][0, visible].repeat_interleave(Hq // Hkv, dim=1)
    s = torch.einsum("hd,nhd->hn", plain[0][0, 0], kk) / math.sqrt(D)
    want = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), vv)
    want.sum().backward()
    torch.testing.assert_close(out[0, 0], want, rtol=1e-10, atol=1e-12)
    assert torch.isfinite(leaves[0].grad[:, 0]).all()
    torch.testing.assert_close(leaves[0].grad[:, 0], plain[0].grad[:, 0], rtol=1e-10,
                               atol=1e-12)
    if s_active == 1:
        for got, ref in zip(leaves[1:], plain[1:]):
            assert torch.isfinite(got.grad).all()
            torch.testing.assert_close(got.grad, ref.grad, rtol=1e-10, atol=1e-12)
