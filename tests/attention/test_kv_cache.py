"""lmfuse.PagedKVCache: block allocation, freeing and reuse, all-or-nothing reservations,
fork with copy-on-write, truncation, argument checks, and decode steps end to end (append
through the cache, attention through the cache) against the reference on a contiguous cache
built by hand from the same keys and values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_close, randn

import lmfuse
from lmfuse import KVCacheFullError, PagedKVCache
from lmfuse.attention.kv_cache import DecodeStep
from lmfuse.attention.reference import decode_attention_reference, gather_cache

HKV, HQ, D = 2, 4, 16


def state(cache: PagedKVCache) -> tuple:
    """Everything reserve() may change: free count, and each sequence's length and blocks."""
    return cache.num_free_blocks, {s: (cache.seqlen(s), cache.block_ids(s))
                                   for s in cache.sequences}


def contiguous(rows: list[torch.Tensor]) -> torch.Tensor:
    """``[L_b, Hkv, D]`` per sequence -> a contiguous cache ``[B, S_max, Hkv, D]``."""
    s_max = max(max(r.shape[0] for r in rows), 1)
    out = torch.zeros(len(rows), s_max, *rows[0].shape[1:], dtype=rows[0].dtype)
    for b, r in enumerate(rows):
        out[b, :r.shape[0]] = r
    return out


def test_exports() -> None:
    assert lmfuse.PagedKVCache is lmfuse.attention.PagedKVCache
    assert issubclass(lmfuse.KVCacheFullError, RuntimeError)


def test_allocation_free_and_reuse() -> None:
    cache = PagedKVCache(6, 4, HKV, D, torch.float32)
    assert cache.k_cache().shape == (6, 4, HKV, D) and cache.v_cache().dtype == torch.float32
    a = cache.add_sequence()
    assert (cache.seqlen(a), cache.block_ids(a), cache.num_free_blocks) == (0, [], 6)
    step = cache.reserve([a], 5)
    assert cache.block_ids(a) == [0, 1] and cache.num_free_blocks == 4
    assert step.block_table.tolist() == [[0, 1]]
    assert (step.seqlens_before.tolist(), step.seqlens.tolist()) == ([0], [5])
    for t in step[:3]:
        assert t.dtype == torch.int32 and t.is_contiguous() and t.device == cache.device
    cache.reserve([a], 3)  # fills block 1 exactly: no new block
    assert (cache.seqlen(a), cache.block_ids(a), cache.num_free_blocks) == (8, [0, 1], 4)
    cache.reserve([a], 1)
    assert cache.block_ids(a) == [0, 1, 2] and cache.num_free_blocks == 3
    b = cache.add_sequence()
    cache.reserve(b, 4)
    assert cache.block_ids(b) == [3]
    cache.free(a)
    assert cache.num_free_blocks == 5 and a not in cache and len(cache) == 1
    c = cache.add_sequence()
    assert c not in (a, b) and cache.sequences == [b, c]
    cache.reserve([c], 12)
    assert sorted(cache.block_ids(c)) == [0, 1, 2]  # a's blocks, reused
    assert cache.num_free_blocks == 2
    with pytest.raises(ValueError, match=f"seqlen: unknown sequence id {a}"):
        cache.seqlen(a)


def test_step_and_current_tables() -> None:
    cache = PagedKVCache(16, 2, HKV, D, torch.float16)
    a, b, c = (cache.add_sequence() for _ in range(3))
    step = cache.reserve([b, a, c], [3, 0, 6])  # ragged; listed order = row order
    assert step.block_table.tolist() == [[0, 1, -1], [-1, -1, -1], [2, 3, 4]]
    assert step.seqlens_before.tolist() == [0, 0, 0] and step.seqlens.tolist() == [3, 0, 6]
    assert step.seq_ids == (b, a, c) and step.num_tokens == (3, 0, 6)
    assert torch.equal(cache.block_table([b, a, c]), step.block_table)
    assert torch.equal(cache.seqlens([b, a, c]), step.seqlens)
    padded = cache.reserve([a, c], 1, max_blocks=6)  # fixed width for CUDA graphs
    assert padded.block_table.tolist() == [[5, -1, -1, -1, -1, -1], [2, 3, 4, 6, -1, -1]]
    assert padded.seqlens_before.tolist() == [0, 6] and padded.seqlens.tolist() == [1, 7]
    assert cache.block_table([c], max_blocks=4).tolist() == [[2, 3, 4, 6]]
    with pytest.raises(ValueError, match="max_blocks=3 is less than the 4 blocks"):
        cache.block_table([c], max_blocks=3)
    before = state(cache)
    zero = cache.reserve([a, b], 0)
    assert torch.equal(zero.seqlens_before, zero.seqlens) and state(cache) == before


def test_full_raises_and_changes_nothing() -> None:
    cache = PagedKVCache(4, 2, HKV, D, torch.float32)
    a, b, c = (cache.add_sequence() for _ in range(3))
    with pytest.raises(KVCacheFullError, match=r"5 blocks needed \(5 new, 0 copy-on-write\) "
                       r"for 9 tokens in 1 sequences, but only 4 of 4 are free"):
        cache.reserve([a], 9)
    assert state(cache) == (4, {a: (0, []), b: (0, []), c: (0, [])})
    cache.reserve([a], 4)
    before = state(cache)
    # b and c fit one at a time but not together: neither is reserved.
    with pytest.raises(KVCacheFullError, match="4 blocks needed .* only 2 of 4 are free"):
        cache.reserve([b, c], 3)
    assert state(cache) == before
    with pytest.raises(KVCacheFullError, match="3 blocks needed"):
        cache.reserve([b, a], [3, 1])  # 2 blocks for b, and a's 5th token needs a third
    assert state(cache) == before
    cache.reserve([b], 3)
    assert cache.num_free_blocks == 0 and cache.seqlen(b) == 3


def test_extend_is_reserve_without_the_step() -> None:
    """Same blocks, lengths and copy-on-write copies as reserve, all or nothing."""
    caches = [PagedKVCache(8, 2, HKV, D, torch.float32) for _ in range(2)]
    for cache in caches:
        a = cache.add_sequence()
        cache.reserve(a, 3)
        cache.k_caches[0].copy_(torch.arange(cache.k_caches[0].numel()).view_as(
            cache.k_caches[0]))
        cache.fork(a)
    caches[0].reserve([0, 1], [2, 3])
    assert caches[1].extend([0, 1], [2, 3]) is None
    assert state(caches[0]) == state(caches[1])
    assert torch.equal(caches[0].k_caches[0], caches[1].k_caches[0])  # the copied block
    before = state(caches[1])
    with pytest.raises(KVCacheFullError, match=r"PagedKVCache.extend: 6 blocks needed"):
        caches[1].extend([0, 1], 6)
    assert state(caches[1]) == before


def test_full_counts_copy_on_write() -> None:
    cache = PagedKVCache(3, 4, HKV, D, torch.float32)
    a = cache.add_sequence()
    cache.reserve([a], 2)
    b = cache.fork(a)
    before = state(cache)
    # 2 new blocks fit the 2 free ones, but a must first copy the shared partial block.
    with pytest.raises(KVCacheFullError, match=r"3 blocks needed \(2 new, 1 copy-on-write\)"):
        cache.reserve([a, b], 3)
    assert state(cache) == before
    cache.reserve([a, b], 2)  # no new block: a copies once, then b is the block's only user
    assert cache.block_ids(b) == [0] and cache.block_ids(a) == [1]
    assert cache.num_free_blocks == 1


def test_fork_shares_and_copy_on_write_copies_exactly() -> None:
    cache = PagedKVCache(12, 4, HKV, D, torch.float32, num_layers=2)
    a = cache.add_sequence()
    step = cache.reserve([a], 6)
    kv = [(randn([1, 6, HKV, D]), randn([1, 6, HKV, D])) for _ in range(2)]
    for layer, (k, v) in enumerate(kv):
        cache.append([a], k, v, layer=layer, step=step, impl="torch")
    free = cache.num_free_blocks
    b = cache.fork(a)
    assert cache.block_ids(b) == cache.block_ids(a) and cache.seqlen(b) == 6
    assert cache.num_free_blocks == free  # nothing allocated at fork time
    pools = [p.clone() for p in cache.k_caches + cache.v_caches]
    step = cache.reserve([b], 1)
    full, partial = cache.block_ids(a)
    assert cache.block_ids(b)[0] == full  # full blocks stay shared
    copy = cache.block_ids(b)[1]
    assert copy not in (full, partial) and cache.num_free_blocks == free - 1
    for pool in cache.k_caches + cache.v_caches:  # every layer, K and V, bit for bit
        assert torch.equal(pool[copy], pool[partial])
    new = [(randn([1, 1, HKV, D]), randn([1, 1, HKV, D])) for _ in range(2)]
    for layer, (k, v) in enumerate(new):
        cache.append([b], k, v, layer=layer, step=step, impl="torch")
    for pool, old in zip(cache.k_caches + cache.v_caches, pools):
        assert torch.equal(pool[:copy], old[:copy]) and torch.equal(pool[copy + 1:],
                                                                    old[copy + 1:])
    for layer in range(2):
        seen = gather_cache(cache.k_cache(layer), step.block_table, 7, 0)
        assert torch.equal(seen, torch.cat([kv[layer][0][0], new[layer][0][0]]))
    cache.reserve([a], 1)  # a's partial block is a's alone now: written in place
    assert cache.block_ids(a) == [full, partial] and cache.num_free_blocks == free - 1


def test_forks_reserving_together_copy_once_per_extra_user() -> None:
    cache = PagedKVCache(8, 4, HKV, D, torch.float8_e4m3fn,
                         k_scale=torch.tensor([0.5, 2.0]), v_scale=torch.tensor([1.0, 3.0]))
    a = cache.add_sequence()
    step = cache.reserve([a], 3)
    cache.append([a], randn([1, 3, HKV, D]), randn([1, 3, HKV, D]), step=step, impl="torch")
    b, c = cache.fork(a), cache.fork(a)
    cache.reserve([a, b, c], 1)
    ids = [cache.block_ids(s)[0] for s in (a, b, c)]
    assert ids[2] == 0 and len(set(ids)) == 3 and cache.num_free_blocks == 5
    for pool in (cache.k_cache(), cache.v_cache()):  # fp8 blocks copied bit for bit
        assert torch.equal(pool[ids[0]].view(torch.uint8), pool[0].view(torch.uint8))
        assert torch.equal(pool[ids[1]].view(torch.uint8), pool[0].view(torch.uint8))


def test_free_of_a_fork_keeps_shared_blocks() -> None:
    cache = PagedKVCache(8, 2, HKV, D, torch.float16)
    a = cache.add_sequence()
    cache.reserve([a], 5)
    b = cache.fork(a)
    cache.free(b)
    assert cache.num_free_blocks == 5 and cache.block_ids(a) == [0, 1, 2]
    b = cache.fork(a)
    cache.reserve([b], 1)  # b copies the partial block 2
    private = cache.block_ids(b)[2]
    cache.free(a)
    assert cache.num_free_blocks == 5 and cache.block_ids(b) == [0, 1, private]
    cache.free(b)
    assert cache.num_free_blocks == 8 and len(cache) == 0


def test_truncate() -> None:
    cache = PagedKVCache(8, 4, HKV, D, torch.float32)
    a = cache.add_sequence()
    cache.reserve([a], 10)
    cache.truncate(a, 8)
    assert (cache.seqlen(a), cache.block_ids(a), cache.num_free_blocks) == (8, [0, 1], 6)
    cache.truncate(a, 5)
    assert cache.block_ids(a) == [0, 1]
    cache.truncate(a, 0)
    assert cache.block_ids(a) == [] and cache.num_free_blocks == 8
    with pytest.raises(ValueError, match="length must be <= the sequence's 0 tokens, got 1"):
        cache.truncate(a, 1)
    with pytest.raises(ValueError, match="length must be >= 0, got -1"):
        cache.truncate(a, -1)
    # A truncated fork turns a full shared block into a partial one: the next write into it
    # must copy it, or it would overwrite tokens the other sequence still has.
    step = cache.reserve([a], 8)
    k = randn([1, 8, HKV, D])
    cache.append([a], k, k, step=step, impl="torch")
    b = cache.fork(a)
    cache.truncate(b, 5)
    step = cache.reserve([b], 1)
    cache.append([b], randn([1, 1, HKV, D]), randn([1, 1, HKV, D]), step=step, impl="torch")
    assert cache.block_ids(b)[1] != cache.block_ids(a)[1]
    assert torch.equal(gather_cache(cache.k_cache(), cache.block_table([a]), 8, 0), k[0])


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(num_blocks=0), ValueError, "PagedKVCache: num_blocks must be >= 1, got 0"),
    (dict(block_len=2.5), TypeError, "block_len must be an int, got float 2.5"),
    (dict(kv_heads=True), TypeError, "kv_heads must be an int, got bool"),
    (dict(num_layers=0), ValueError, "num_layers must be >= 1, got 0"),
    (dict(dtype=torch.int8), TypeError, r"dtype must be one of \(float32, float16, bfloat16, "
     r"float8_e4m3fn\), got torch.int8"),
    (dict(dtype="float16"), TypeError, "dtype must be one of .* got 'float16'"),
    (dict(device="gpu0"), ValueError, "device must be .* got 'gpu0'"),
    (dict(k_scale=torch.ones(HKV)), ValueError, "k_scale applies to float8_e4m3fn caches "
     "only; this cache is float16"),
    (dict(dtype=torch.float8_e4m3fn, v_scale=torch.ones(3)), ValueError,
     r"v_scale\[0\] must be \[kv_heads=2\] \(one scale per KV head\), got \(3,\)"),
    (dict(dtype=torch.float8_e4m3fn, k_scale=torch.tensor([1.0, -1.0])), ValueError,
     r"k_scale\[0\] must be finite and > 0, got \[1.0, -1.0\]"),
    (dict(dtype=torch.float8_e4m3fn, k_scale=[torch.ones(2)] * 3, num_layers=2), TypeError,
     "k_scale must be a .* or a list of num_layers=2 of them, got list of 3"),
    (dict(dtype=torch.float8_e4m3fn, k_scale=torch.ones(2, dtype=torch.int32)), TypeError,
     r"k_scale\[0\] must have dtype in"),
])
def test_bad_constructor_arguments(kwargs, error, match) -> None:
    args = dict(num_blocks=4, block_len=2, kv_heads=HKV, head_dim=D, dtype=torch.float16)
    with pytest.raises(error, match=match):
        PagedKVCache(**{**args, **kwargs})


def test_bad_call_arguments() -> None:
    cache = PagedKVCache(8, 2, HKV, D, torch.float32, num_layers=2)
    a, b = cache.add_sequence(), cache.add_sequence()
    with pytest.raises(ValueError, match=r"reserve: unknown sequence id 7 \(live ids: \[0, 1\]"):
        cache.reserve([a, 7], 1)
    with pytest.raises(TypeError, match="a sequence id must be an int, got str 'a'"):
        cache.fork("a")
    with pytest.raises(TypeError, match="seq_ids must be a list of sequence ids, got str"):
        cache.reserve("ab", 1)
    with pytest.raises(ValueError, match=r"seq_ids must be distinct, got \[0, 0\]"):
        cache.reserve([a, a], 1)
    with pytest.raises(ValueError, match="num_tokens must be >= 0, got -1"):
        cache.reserve([a], -1)
    with pytest.raises(ValueError, match="num_tokens must be one int or a list of one per "
                       r"sequence \(2\), got a list of 1"):
        cache.reserve([a, b], [1])
    with pytest.raises(ValueError, match="k_cache: layer must be < num_layers=2, got 2"):
        cache.k_cache(2)
    assert state(cache) == (8, {a: (0, []), b: (0, [])})
    step = cache.reserve([a, b], [2, 1])
    k = randn([2, 2, HKV, D])
    with pytest.raises(ValueError, match=r"seq_ids \[1, 0\] are not the step's \[0, 1\]"):
        cache.append([b, a], k, k, step=step)
    with pytest.raises(ValueError, match=r"k_new has 2 new tokens per sequence but the step "
                       r"reserved \[2, 1\]"):
        cache.append([a, b], k, k, step=step)
    with pytest.raises(TypeError, match="step must be the DecodeStep from reserve"):
        cache.append([a, b], k, k, step=tuple(step))
    q = randn([2, 1, HQ, D])
    with pytest.raises(TypeError, match=r"\['block_table'\] come from the cache"):
        cache.attention(q, step, block_table=step.block_table)
    with pytest.raises(ValueError, match="layer must be < num_layers=2, got 5"):
        cache.attention(q, step, layer=5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_steps_end_to_end(dtype: torch.dtype) -> None:
    """Ragged sequences written through cache.append over several steps (one and several
    tokens at once, freed and re-added sequences, a truncation, a fork), read back through
    cache.attention (Triton and reference) against the reference on a contiguous cache."""
    layers = 2
    cache = PagedKVCache(40, 3, HKV, D, dtype, num_layers=layers)
    keys: list[dict[int, torch.Tensor]] = [{} for _ in range(layers)]
    vals: list[dict[int, torch.Tensor]] = [{} for _ in range(layers)]

    def add() -> int:
        s = cache.add_sequence()
        for table in keys + vals:
            table[s] = torch.zeros(0, HKV, D, dtype=dtype)
        return s

    def write(ids: list[int], n: int) -> DecodeStep:
        step = cache.reserve(ids, n)
        for layer in range(layers):
            k, v = randn([len(ids), n, HKV, D], dtype), randn([len(ids), n, HKV, D], dtype)
            cache.append(ids, k, v, layer=layer, step=step, impl="torch")
            for b, s in enumerate(ids):
                keys[layer][s] = torch.cat([keys[layer][s], k[b]])
                vals[layer][s] = torch.cat([vals[layer][s], v[b]])
        return step

    checks = [0]

    def check(ids: list[int], step: DecodeStep, s_active: int, **kwargs) -> None:
        checks[0] += 1
        for layer in range(layers):
            for b, s in enumerate(ids):  # the pool holds exactly what was appended
                got = gather_cache(cache.k_cache(layer), step.block_table, cache.seqlen(s), b)
                assert torch.equal(got, keys[layer][s])
            q = randn([len(ids), s_active, HQ, D], dtype)
            want = decode_attention_reference(
                q, contiguous([keys[layer][s] for s in ids]),
                contiguous([vals[layer][s] for s in ids]), step.seqlens)
            assert torch.equal(cache.attention(q, step, layer=layer, impl="torch"), want)
            if layer == checks[0] % layers:  # the interpreter is slow: one layer per step
                out = cache.attention(q, step, layer=layer, impl="triton", **kwargs)
                assert_close(out, want, dtype, f"paged cache, layer {layer}, {s_active} active")

    ids = [add() for _ in range(5)]
    write([ids[0]], 5)
    write([ids[1], ids[2]], 2)
    write([ids[3]], 7)
    recycled = cache.block_ids(ids[1])
    cache.free(ids[1])  # its blocks return to the pool and are handed out again
    cache.free(ids[4])
    for s in (ids[1], ids[4]):
        for table in keys + vals:
            del table[s]
    live = [ids[3], add(), ids[0], ids[2]]
    write([live[1]], 4)
    assert recycled[0] in cache.block_ids(live[1])
    for _ in range(3):
        check(live, write(live, 1), 1)
    check(live, write(live, 3), 3)
    cache.truncate(live[0], cache.seqlen(live[0]) - 2)  # 2 rejected speculative tokens
    for table in keys + vals:
        table[live[0]] = table[live[0]][:-2]
    check(live, write(live, 1), 1)
    live.append(cache.fork(live[2]))
    for table in keys + vals:
        table[live[-1]] = table[live[2]].clone()
    check(live, write(live, 2), 2, num_splits=2)


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.float32])
def test_fp8_cache_with_scales(q_dtype: torch.dtype) -> None:
    k_scale = [torch.tensor([0.5, 2.0]), torch.tensor([0.25, 1.0])]
    v_scale = [torch.tensor([1.5, 0.125]), torch.tensor([3.0, 0.5])]
    cache = PagedKVCache(10, 4, HKV, D, torch.float8_e4m3fn, num_layers=2,
                         k_scale=k_scale, v_scale=v_scale)
    ids = [cache.add_sequence() for _ in range(3)]
    cache.free(ids[0])
    ids = [ids[2], cache.add_sequence(), ids[1]]
    written = {layer: ([], []) for layer in range(2)}
    for n in (3, 2):
        step = cache.reserve(ids, n)
        for layer in range(2):
            k, v = (randn([3, n, HKV, D], q_dtype, scale=4.0) for _ in range(2))
            cache.append(ids, k, v, layer=layer, step=step, impl="torch")
            written[layer][0].append(k)
            written[layer][1].append(v)

    def dequantised(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        stored = (x.float() / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        return stored.float() * scale[:, None]

    for layer in range(2):
        k = dequantised(torch.cat(written[layer][0], 1), k_scale[layer])
        v = dequantised(torch.cat(written[layer][1], 1), v_scale[layer])
        raw = torch.cat(written[layer][0], 1).float()
        # e4m3: 3 mantissa bits; subnormals below 2**-6 in steps of 2**-9 (times the scale)
        assert ((k - raw).abs() <= raw.abs() / 16 + k_scale[layer][:, None] * 2**-10).all()
        for b in range(3):
            got = gather_cache(cache.k_cache(layer), step.block_table, 5, b).float()
            assert torch.equal(got * k_scale[layer][:, None], k[b])
        q = randn([3, 2, HQ, D], q_dtype)
        want = decode_attention_reference(q, k, v, step.seqlens)
        out = cache.attention(q, step, layer=layer, impl="triton")
        assert_close(out, want, q_dtype, f"fp8 cache, layer {layer}")
        assert_close(cache.attention(q, step, layer=layer, impl="torch"), want, q_dtype,
                     f"fp8 cache, reference path, layer {layer}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn])
def test_append_triton_matches_torch(dtype: torch.dtype) -> None:
    caches = [PagedKVCache(8, 3, HKV, D, dtype) for _ in range(2)]
    for cache, impl in zip(caches, ("torch", "triton")):
        a, b = cache.add_sequence(), cache.add_sequence()
        cache.reserve([a], 2)
        c = cache.fork(a)
        torch.manual_seed(0)
        for n in (1, 3, 2):
            step = cache.reserve([c, b, a], n)
            k = randn([3, n, HKV, D], torch.float16, scale=3.0)
            cache.append([c, b, a], k, -k, step=step, impl=impl)
    assert torch.equal(caches[0].k_cache().view(torch.uint8),
                       caches[1].k_cache().view(torch.uint8))
    assert torch.equal(caches[0].v_cache().view(torch.uint8),
                       caches[1].v_cache().view(torch.uint8))


def test_blocks_needed_counts_what_reserve_takes() -> None:
    """New blocks plus copy-on-write copies, for several sequences at once; nothing is
    reserved by asking."""
    cache = PagedKVCache(16, 4, 1, 8, torch.float32, "cpu")
    a = cache.add_sequence()
    cache.reserve(a, 6)  # 2 blocks, the second partial
    b = cache.fork(a)  # shares both
    assert cache.blocks_needed([a, b], [1, 1]) == 1  # one copy of the shared partial block
    assert cache.blocks_needed(a, 3) == 1 + 1 and cache.blocks_needed([a], [0]) == 0
    free = cache.num_free_blocks
    assert cache.blocks_needed([a, b], [3, 7]) == (1 + 1) + (2 + 0)
    assert cache.num_free_blocks == free
    cache.reserve([a, b], [3, 7])
    assert cache.num_free_blocks == free - 4


def test_reserve_writes_its_step_into_a_given_buffer() -> None:
    """``out``: the step's table, lengths before and after land in the caller's buffer (a
    decode graph's inputs), the step's tensors views of it, the same values as without;
    a buffer of another size, dtype or kind is refused before anything changes."""
    cache = PagedKVCache(num_blocks=8, block_len=4, kv_heads=1, head_dim=4,
                         dtype=torch.float32, device="cpu", num_layers=1)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.reserve([a, b], [5, 2])
    twin = PagedKVCache(num_blocks=8, block_len=4, kv_heads=1, head_dim=4,
                        dtype=torch.float32, device="cpu", num_layers=1)
    ta, tb = twin.add_sequence(), twin.add_sequence()
    twin.reserve([ta, tb], [5, 2])
    for bad in (torch.zeros(9, dtype=torch.int32), torch.zeros(10, dtype=torch.int64),
                torch.zeros(2, 5, dtype=torch.int32), [0] * 10):
        with pytest.raises(ValueError, match="out must be"):
            cache.reserve([a, b], 1, max_blocks=3, out=bad)
    assert cache.seqlen(a) == 5 and cache.seqlen(b) == 2  # nothing reserved
    out = torch.full((10,), -7, dtype=torch.int32)
    step = cache.reserve([a, b], 1, max_blocks=3, out=out)
    want = twin.reserve([ta, tb], 1, max_blocks=3)
    for got, ref in zip(step[:3], want[:3]):
        assert torch.equal(got, ref)
        assert got.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    assert out.tolist()[-4:] == [5, 2, 6, 3]


def test_a_stale_step_is_refused() -> None:
    """A step stays valid until one of its sequences is reserved again, truncated, forked
    or freed: append and attention refuse it after that (a step kept past a free wrote
    into blocks the pool had handed to another sequence; one kept past a fork wrote the
    parent's token into a block the child shares and counts)."""
    cache = PagedKVCache(8, 4, HKV, D, torch.float32)
    a, b = cache.add_sequence(), cache.add_sequence()
    k = randn([1, 1, HKV, D])
    q = randn([1, 1, HQ, D])
    for change, what in [(lambda: cache.free(a), "freed"),
                         (lambda: cache.fork(b), "reserved again, truncated or forked"),
                         (lambda: cache.truncate(b, 0), "reserved again, truncated or forked"),
                         (lambda: cache.reserve(b, 1), "reserved again, truncated or forked")]:
        s = a if what == "freed" else b
        step = cache.reserve(s, 1)
        change()
        with pytest.raises(ValueError, match=rf"the step is stale: sequence {s} was {what}"):
            cache.append(s, k, k, step=step)
        with pytest.raises(ValueError, match="the step is stale"):
            cache.attention(q, step)
    step = cache.reserve(b, 1)  # a current step works, with a NumPy id too
    cache.append(np.int64(b), k, k, step=step)
    assert cache.attention(q, step).shape == (1, 1, HQ, D)


def test_append_writes_exactly_the_reserved_tokens() -> None:
    """``reserve(ids, [2, 1])`` then one ``[n, s_new]`` append cannot fill both: the
    unwritten slot would be read by attention as the sequence's token (a freed
    sequence's old values)."""
    cache = PagedKVCache(8, 4, HKV, D, torch.float32)
    a, b = cache.add_sequence(), cache.add_sequence()
    step = cache.reserve([a, b], [2, 1])
    with pytest.raises(ValueError, match=r"k_new has 1 new tokens per sequence but the step "
                                         r"reserved \[2, 1\]; append exactly"):
        cache.append([a, b], randn([2, 1, HKV, D]), randn([2, 1, HKV, D]), step=step)
