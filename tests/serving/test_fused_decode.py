"""The Generator's fused decode layers (``lmfuse.serving.fused``): the rotary + cache-append
kernel and the GEMV kernel against their references (Triton's interpreter, float32 and
float16), the decode-path option, and the chunked greedy argmax."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy, tiny_causal_lm

from lmfuse.serving import Generator
from lmfuse.serving.fused_ops import gemv as _gemv
from lmfuse.serving.fused_ops import launch_rope_append as _launch_rope_append
from lmfuse.serving.fused_reference import (gemv_reference, prenorm_reference,
                                            rope_append_reference)
from lmfuse.serving.sampling import argmax_rows, greedy

HQ, HKV, D, BL, NB = 4, 2, 16, 4, 12


def _rope_case(dtype: torch.dtype, cache_dtype: torch.dtype, norm: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = 4
    qkv = torch.randn(n, (HQ + 2 * HKV) * D, generator=g).to(dtype)
    angles = torch.randn(40, D // 2, generator=g, dtype=torch.float64)
    cos, sin = angles.cos().float(), angles.sin().float()
    pos = torch.tensor([0, 5, 13, 0], dtype=torch.int32)
    table = torch.tensor([[3, -1, -1, -1], [7, 2, -1, -1], [1, 4, 9, 0], [-1, -1, -1, -1]],
                         dtype=torch.int32)  # the last row pads: it writes nothing
    qn = torch.randn(D, generator=g) if norm else None
    kn = torch.randn(D, generator=g) if norm else None
    fp8 = cache_dtype == torch.float8_e4m3fn
    ks = torch.rand(HKV, generator=g) + 0.5 if fp8 else None
    vs = torch.rand(HKV, generator=g) + 0.5 if fp8 else None
    return qkv, cos, sin, pos, table, qn, kn, ks, vs


# fp8 without the q/k norm only: the norm's sums round in another order in the two, and a
# 1-ulp difference may round to another e4m3 value; without it the bytes must be equal.
@pytest.mark.parametrize("rows_from", [64, 0], ids=["row-a-program", "rows-a-program"])
@pytest.mark.parametrize("dtype,cache_dtype,norm", [
    (torch.float32, torch.float32, False), (torch.float32, torch.float32, True),
    (torch.float16, torch.float16, False), (torch.float16, torch.float16, True),
    (torch.float32, torch.float8_e4m3fn, False)])
def test_rope_append_kernel_matches_reference(dtype, cache_dtype, norm, rows_from,
                                              monkeypatch) -> None:
    """A row a program (decode steps) or several (past ``_ROPE_ROWS_FROM`` rows, here
    any: the 4 rows in one program of 16, its other slots masked): the GPU's programs, not
    the interpreter's one per head."""
    import lmfuse.serving.fused_ops as fused_ops

    monkeypatch.setattr(fused_ops, "_ROPE_ROWS_FROM", rows_from)
    monkeypatch.setattr(fused_ops, "_GPU_TILES_IN_INTERPRETER", True)
    qkv, cos, sin, pos, table, qn, kn, ks, vs = _rope_case(dtype, cache_dtype, norm)
    caches = []
    outs = []
    for run in (_launch_rope_append, rope_append_reference):
        kc = torch.zeros(NB, BL, HKV, D).to(cache_dtype)
        vc = torch.zeros(NB, BL, HKV, D).to(cache_dtype)
        outs.append(run(qkv, cos, sin, pos, table, kc, vc, qn, kn, 1e-6, ks, vs, HQ, HKV, D))
        caches.append((kc.float(), vc.float()))
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=tol, atol=tol)
    for a, b in zip(caches[0], caches[1]):
        if cache_dtype == torch.float8_e4m3fn:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    # Exactly the three real rows' slots were written (the padding row wrote nothing).
    written = (caches[0][0].abs().sum(dim=(2, 3)) > 0).nonzero().tolist()
    assert sorted(written) == [[0, 1], [2, 1], [3, 0]]
    assert not torch.equal(outs[0][1], qkv[1, :HQ * D].view(HQ, D).to(outs[0].dtype))


@pytest.mark.parametrize("norm", [False, True])
def test_rope_append_kernel_many_rows_a_program(norm: bool) -> None:
    """A prefill's rows (here 70, past ``_ROPE_ROWS_FROM``: programs of 16 rows, the last
    one part full), each a position of one of three sequences, some rows padding (block
    -1): the reference's queries and cache, bitwise in float32."""
    g = torch.Generator().manual_seed(5)
    n, nb, bl = 70, 40, 4
    qkv = torch.randn(n, (HQ + 2 * HKV) * D, generator=g)
    angles = torch.randn(80, D // 2, generator=g, dtype=torch.float64)
    cos, sin = angles.cos().float(), angles.sin().float()
    seq = torch.arange(n) % 3
    pos = (torch.arange(n) // 3).to(torch.int32)
    blocks = torch.randperm(nb, generator=g)[:3 * 8].view(3, 8).to(torch.int32)
    table = blocks[seq]
    table[n - 5:] = -1  # padding rows
    qn = torch.randn(D, generator=g) if norm else None
    kn = torch.randn(D, generator=g) if norm else None
    caches, outs = [], []
    for run in (_launch_rope_append, rope_append_reference):
        kc, vc = torch.zeros(nb, bl, HKV, D), torch.zeros(nb, bl, HKV, D)
        outs.append(run(qkv, cos, sin, pos, table, kc, vc, qn, kn, 1e-6, None, None, HQ,
                        HKV, D))
        caches.append((kc, vc))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)
    for a, b in zip(caches[0], caches[1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert int((caches[0][0].abs().sum(dim=(2, 3)) > 0).sum()) == n - 5


def test_rope_append_reference_is_the_rotate_half_formula() -> None:
    """Against transformers' rotate-half rotary on the same angles (no norm)."""
    qkv, cos, sin, pos, table, *_ = _rope_case(torch.float32, torch.float32, False)
    kc = torch.zeros(NB, BL, HKV, D)
    vc = torch.zeros(NB, BL, HKV, D)
    q = rope_append_reference(qkv, cos, sin, pos, table, kc, vc, None, None, 1e-6, None,
                              None, HQ, HKV, D)
    c = torch.cat([cos, cos], -1)[pos.long()][:, None]
    s = torch.cat([sin, sin], -1)[pos.long()][:, None]
    x = qkv.view(4, HQ + 2 * HKV, D)[:, :HQ]
    half = torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1)
    torch.testing.assert_close(q, x * c + half * s, rtol=0, atol=1e-6)
    k = qkv.view(4, HQ + 2 * HKV, D)[1, HQ:HQ + HKV]
    k_half = torch.cat([-k[..., D // 2:], k[..., :D // 2]], -1)
    torch.testing.assert_close(kc[2, 1], k * c[1] + k_half * s[1], rtol=0, atol=1e-6)
    torch.testing.assert_close(vc[2, 1], qkv.view(4, -1, D)[1, HQ + HKV:], rtol=0, atol=0)


def _gemv_case(kind: str, rows: int, dtype: torch.dtype, seed: int):
    """``(x, weights, biases, residual, gated, t)`` of a GEMV test case (``t(*shape)``: more
    random values from the case's generator)."""
    g = torch.Generator().manual_seed(seed)

    def t(*shape):
        return (torch.randn(*shape, generator=g) / 4).to(dtype)

    K = 40 if kind == "uneven_k" else 64
    x = t(rows, K)
    residual, biases, gated = None, None, kind == "gated"
    if kind == "qkv_bias":
        ws = (t(64, K), t(32, K), t(32, K))
        biases = (t(64), t(32), t(32))
    elif gated:
        ws = (t(64, K), t(64, K))
    else:
        ws = (t(32, K),)
        residual = t(rows, 32) if kind == "residual" else None
    return x, ws, biases, residual, gated, t


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("kind", ["qkv_bias", "gated", "residual", "uneven_k"])
def test_gemv_kernel_matches_reference(kind: str, rows: int, dtype: torch.dtype) -> None:
    x, ws, biases, residual, gated, _ = _gemv_case(kind, rows, dtype, rows)
    want = gemv_reference(x, ws, biases, residual=residual, gated=gated)
    before = None if residual is None else residual.clone()
    got = _gemv(x, ws, biases, residual=residual, gated=gated)
    if residual is not None:
        assert got.data_ptr() == residual.data_ptr()  # updated in place
        ref = gemv_reference(x, ws, None).float() + before.float()
        torch.testing.assert_close(want.float(), ref.to(dtype).float(), rtol=2e-3, atol=2e-3)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    if not gated and residual is None:  # against plain F.linear too
        full = torch.cat([torch.nn.functional.linear(x.float(), w.float(),
                                                     None if biases is None else b.float())
                          for w, b in zip(ws, biases or (None,) * len(ws))], -1)
        torch.testing.assert_close(got.float(), full, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 17])
@pytest.mark.parametrize("kind", ["qkv_bias", "gated", "uneven_k"])
def test_gemv_with_the_rms_norm_inside_matches_the_norm_then_the_gemv(
        kind: str, rows: int, dtype: torch.dtype) -> None:
    """``norm=(g, eps)``: the kernel RMS-norms its rows on the way in (the sum of squares in
    the same pass over K), the reference's result: lmfuse's RMSNorm then the GEMV, in
    float32. Rows of very different scales each get their own factor."""
    from lmfuse.norm.reference import rms_norm_reference

    x, ws, biases, _, gated, t = _gemv_case(kind, rows, dtype, rows + 11)
    x = x * torch.logspace(-2, 2, rows).to(dtype)[:, None]
    w_norm = 1 + t(x.shape[1])
    eps = 1e-5
    want = gemv_reference(x, ws, biases, gated=gated, norm=(w_norm, eps))
    normed = rms_norm_reference(x.float(), w_norm.float(), eps=eps)
    torch.testing.assert_close(
        want.float(), gemv_reference(normed, ws, biases, gated=gated).to(dtype).float(),
        rtol=1e-5 if dtype == torch.float32 else 2e-3, atol=1e-5)
    got = _gemv(x, ws, biases, gated=gated, norm=(w_norm, eps))
    # float16: the kernel rounds the scaled operand x * g to float16 for the dot, which the
    # float32 reference does not (the plain GEMV's x is float16 already): 2^-11 of each
    # term, over K = 64 random-sign terms of |w| ~ 1/4, times silu's and the up factor's
    # magnitude (~2) when gated, is up to ~4e-3 of the output.
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="does not split K"):
        _gemv(x, ws[:1], norm=(w_norm, eps), split_k=2)


@pytest.mark.parametrize("split", [2, 3, 4])
@pytest.mark.parametrize("rows", [1, 17])
@pytest.mark.parametrize("kind", ["qkv_bias", "residual", "uneven_k"])
def test_split_k_gemv_matches_reference(kind: str, rows: int, split: int) -> None:
    """K split over programs (their float32 partials summed in split order by each tile's
    last program): the reference's result, bitwise the same on a second launch (the same
    sum whichever program comes last), the counts back to zero."""
    import lmfuse.serving.fused_ops as fused_ops

    g = torch.Generator().manual_seed(rows + split)

    def t(*shape):
        return torch.randn(*shape, generator=g) / 4

    K = 200 if kind == "uneven_k" else 256
    x = t(rows, K)
    residual, biases = None, None
    if kind == "qkv_bias":
        ws = (t(64, K), t(32, K), t(32, K))
        biases = (t(64), t(32), t(32))
    else:
        ws = (t(32, K),)
        residual = t(rows, 32) if kind == "residual" else None
    want = gemv_reference(x, ws, biases, residual=residual, gated=False)
    first = None
    for _ in range(2):
        r = None if residual is None else residual.clone()
        got = _gemv(x, ws, biases, residual=r, split_k=split)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert first is None or torch.equal(got, first)
        first = got
    assert all(int(count.abs().sum()) == 0 for _, count in fused_ops._SPLIT_BUFFERS.values())
    with pytest.raises(ValueError, match="does not split K"):
        _gemv(x, (ws[0], ws[0]), gated=True, split_k=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,split,H", [(3, 1, 128), (3, 4, 128), (17, 1, 128),
                                          (17, 2, 128), (40, 3, 128), (5, 1, 40)])
def test_residual_gemv_leaves_the_next_norm_to_the_gemv_after_it(
        rows: int, split: int, H: int, dtype: torch.dtype) -> None:
    """``prenorm=(g, eps)``: the residual GEMV (K split or not) also returns ``h * g`` and
    its tiles' sums of squares of the h it stored, whose factors ``rsqrt(mean(h^2) +
    eps)`` are the reference's (bitwise the same on a second launch); the GEMVs that take
    them (``row_scale``: plain with biases, gated) give the GEMV of ``rms_norm(h)``, rows
    of very different scales each with their own factor. H = 40 (not whole feature tiles):
    the residual GEMV's float32 fallback, whose one sum a row the kernel after it reads."""
    from lmfuse.norm.reference import rms_norm_reference

    g = torch.Generator().manual_seed(rows * 10 + split)

    def t(*shape):
        return (torch.randn(*shape, generator=g) / 4).to(dtype)

    K, eps = 96, 1e-5
    x, w = t(rows, K), t(H, K)
    h0 = t(rows, H) * torch.logspace(-2, 2, rows).to(dtype)[:, None]
    gain = 1 + t(H)
    first = None
    for _ in range(2):
        h = h0.clone()
        got_h, xw, rn = _gemv(x, (w,), residual=h, prenorm=(gain, eps), split_k=split)
        rs = rn.scale()
        assert got_h.data_ptr() == h.data_ptr()
        torch.testing.assert_close(got_h, gemv_reference(x, (w,), residual=h0),
                                   rtol=1e-5 if dtype == torch.float32 else 2e-3, atol=1e-5)
        want_xw, want_rs = prenorm_reference(got_h, gain, eps)
        assert torch.equal(xw, want_xw) and rs.dtype == torch.float32
        torch.testing.assert_close(rs, want_rs, rtol=1e-6, atol=0)
        assert first is None or (torch.equal(rn.ss, first[0]) and torch.equal(got_h, first[1]))
        first = (rn.ss, got_h)
    normed = rms_norm_reference(got_h.float(), gain.float(), eps=eps)
    for ws, biases, gated in (((t(64, H), t(32, H)), (t(64), t(32)), False),
                              ((t(64, H), t(64, H)), None, True)):
        got = _gemv(xw, ws, biases, gated=gated, row_scale=rn)
        want = gemv_reference(xw, ws, biases, gated=gated, row_scale=rs)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
        if dtype == torch.float32:  # the GEMV of the norm's output (float16 rounds x * g)
            torch.testing.assert_close(got, gemv_reference(normed, ws, biases, gated=gated),
                                       rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="prenorm takes a residual"):
        _gemv(x, (w,), prenorm=(gain, eps))
    with pytest.raises(ValueError, match="row_scale takes neither"):
        _gemv(xw, (w.t().contiguous(),), norm=(gain, eps), row_scale=rn)


def test_split_norm_keeps_nan_and_inf_rows_as_the_norm_does() -> None:
    """A row of h holding +inf or NaN: the GEMV after ``prenorm`` gives that row NaN, as the
    RMSNorm then the GEMV do (an infinite mean square makes the factor 0, and inf * 0 is
    NaN); the other rows are untouched."""
    from lmfuse.norm.reference import rms_norm_reference

    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(4, 64, generator=g) / 4, torch.randn(128, 64, generator=g) / 8
    h0 = torch.randn(4, 128, generator=g)
    h0[1, 5], h0[2, 9] = float("inf"), float("nan")
    gain, eps = 1 + torch.randn(128, generator=g) / 4, 1e-5
    h = h0.clone()
    got_h, xw, rn = _gemv(x, (w,), residual=h, prenorm=(gain, eps))
    wg = torch.randn(64, 128, generator=g) / 8
    got = _gemv(xw, (wg,), row_scale=rn)
    want = gemv_reference(rms_norm_reference(got_h, gain, eps=eps), (wg,))
    assert got[1:3].isnan().all() and want[1:3].isnan().all()
    torch.testing.assert_close(got[[0, 3]], want[[0, 3]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,H", [(1, 64), (5, 40), (3, 2600)])
def test_embedding_gather_leaves_the_first_norm_to_the_gemv_after_it(
        rows: int, H: int, dtype: torch.dtype) -> None:
    """``_embed``: the step's rows ``table[ids]`` in a new tensor (ids repeated, in any
    order), with ``prenorm`` also ``h * g`` and a RowNorm whose factors are the
    reference's, so the GEMV after it gives the GEMV of ``rms_norm(h)``; H = 2600 loops
    over two feature blocks, H = 40 masks a partial one."""
    from lmfuse.norm.reference import rms_norm_reference
    from lmfuse.serving.fused_ops import embed as _embed
    from lmfuse.serving.fused_reference import embed_prenorm_reference

    g = torch.Generator().manual_seed(rows * 7 + H)
    table = (torch.randn(11, H, generator=g) * torch.logspace(-2, 2, 11)[:, None]).to(dtype)
    ids = torch.tensor([3, 10, 3, 0, 7][:rows], dtype=torch.int64)
    gain, eps = (1 + torch.randn(H, generator=g) / 4).to(dtype), 1e-5
    h = _embed(ids, table)
    assert torch.equal(h, table[ids]) and h.data_ptr() != table.data_ptr()
    assert torch.equal(_embed(torch.stack([ids, ids.flip(0)], 1)[:, 0], table), table[ids])
    h, xw, rn = _embed(ids.to(torch.int32), table, (gain, eps))
    want_h, want_xw, want_rs = embed_prenorm_reference(ids, table, gain, eps)
    assert torch.equal(h, want_h) and torch.equal(xw, want_xw)
    assert rn.ss.shape == (rows, 1) and rn.ss.dtype == torch.float32 and rn.features == H
    torch.testing.assert_close(rn.scale(), want_rs, rtol=1e-6, atol=0)
    w = (torch.randn(32, H, generator=g) / 8).to(dtype)
    got = _gemv(xw, (w,), row_scale=rn)
    want = gemv_reference(rms_norm_reference(h.float(), gain.float(), eps=eps), (w,))
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    # a table with strided columns, and no rows: the same outputs without the kernel
    strided = torch.empty(11, 2 * H, dtype=dtype)[:, ::2].copy_(table)
    h2, xw2, rn2 = _embed(ids, strided, (gain, eps))
    assert torch.equal(h2, h) and torch.equal(xw2, xw)
    torch.testing.assert_close(rn2.scale(), rn.scale(), rtol=1e-6, atol=0)
    h0, xw0, rn0 = _embed(ids[:0], table, (gain, eps))
    assert h0.shape == xw0.shape == (0, H) and rn0.ss.shape == (0, 1)


def test_several_row_steps_launch_no_rms_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several sequences (the LM head on the GEMV): a step launches no RMSNorm; the first
    layer's input norm rides in the embedding gather, the others in the residual GEMVs
    before them (``prenorm``), and all in the GEMVs after them (``row_scale``). The tokens
    stay model.generate's."""
    import lmfuse.serving.fused as fused
    import lmfuse.serving.fused_ops as fused_ops

    monkeypatch.setattr(fused_ops, "LM_HEAD_MIN_FEATURES", 128)
    model = tiny_causal_lm("llama", vocab_size=256)
    norms, steps, scaled, prefills = [], [], [], []
    real_norm, real_forward, real_gemv = (fused._launch_rms_norm, fused.FusedDecoder.forward,
                                          fused_ops.gemv)

    def norm_spy(h, *args, **kwargs):
        if not prefills[-1:] == [True]:
            norms.append(h.shape[0])
        return real_norm(h, *args, **kwargs)

    def forward_spy(self, ids, *args, **kwargs):
        prefill = kwargs.get("prefill") is not None  # the prompts' forward
        prefills.append(prefill)
        try:
            if not prefill:
                steps.append(ids.shape[0])
            return real_forward(self, ids, *args, **kwargs)
        finally:
            prefills[-1] = False

    def gemv_spy(x, weights, *args, **kwargs):
        if kwargs.get("row_scale") is not None and not prefills[-1:] == [True]:
            scaled.append(len(weights))
        return real_gemv(x, weights, *args, **kwargs)

    monkeypatch.setattr(fused, "_launch_rms_norm", norm_spy)
    monkeypatch.setattr(fused.FusedDecoder, "forward", forward_spy)
    monkeypatch.setattr(fused_ops, "gemv", gemv_spy)
    gen = Generator(model, block_len=4, num_blocks=48, impl="triton")
    got = gen.generate(PROMPTS, max_new_tokens=4, eos_token_id=[])
    assert got == [hf_greedy(model, p, 4) for p in PROMPTS]
    layers = model.config.num_hidden_layers
    assert steps and set(steps) == {len(PROMPTS)} and norms == []
    # per step: every QKV (3 matrices), every gate/up (2), the LM head (1)
    assert sorted(scaled) == sorted(([3] * layers + [2] * layers + [1]) * len(steps))


def _rope_gemv_splits(call):
    """``call()``'s result and the ``(elements, tiles)`` of the split workspaces it asked
    for; every split count is back at zero after it."""
    import lmfuse.serving.fused_ops as fused_ops

    asked, real = [], fused_ops.split_buffers

    def spy(device, elements, tiles, workspace=None):
        asked.append((elements, tiles))
        return real(device, elements, tiles, workspace)

    fused_ops.split_buffers = spy
    try:
        out = call()
    finally:
        fused_ops.split_buffers = real
    assert all(int(c.abs().sum()) == 0 for _, c in fused_ops._SPLIT_BUFFERS.values())
    return out, asked


def _rope_workspace(rows: int, n_out: int, K: int, split: int, itemsize: int) -> tuple:
    """The split workspace's ``(elements, tiles)`` of the rotating GEMV: two accumulators
    of every tile for every split."""
    import lmfuse.serving.fused_ops as fused_ops

    bm = fused_ops.row_tile(rows)
    bn, bk = fused_ops.gemv_config(n_out, K, bm, False, itemsize, None, True)[:2]
    k_split = -(-(-(-K // split)) // bk) * bk
    split = -(-K // k_split)  # as the launch counts them: no empty split
    tiles = n_out // (2 * bn) * -(-rows // bm)
    return 2 * split * tiles * bm * bn, tiles


@pytest.mark.parametrize("rows,split", [(3, None), (17, None), (3, 3), (17, 2)])
@pytest.mark.parametrize("dtype,cache_dtype,bias", [
    (torch.float32, torch.float32, False), (torch.float32, torch.float32, True),
    (torch.float16, torch.float16, True), (torch.float32, torch.float8_e4m3fn, False)])
def test_qkv_gemv_rotates_and_appends_itself(rows: int, split, dtype: torch.dtype,
                                             cache_dtype: torch.dtype, bias: bool) -> None:
    """``rope=``: the QKV GEMV's epilogue does ``rope_append``'s work (heads of 32 dims, so
    a program's 16 dims of each half pair up): the queries and the written cache slots are
    the reference's (the float32 projections rotated, as the kernel does not round them
    between), a padding row (block -1) writes nothing, nothing else is touched. With K
    split over programs (``split``, K long enough for several K tiles a split) the tile's
    last program rotates the summed halves, and the split counts are left at zero."""
    from lmfuse.serving.fused_ops import RopeAppend

    hq, hkv, d, bl = 4, 2, 32, 4
    K = 64 if split is None else 512 * split  # the table's K tiles (128 here), four a split
    nb = 3 * rows  # every row's blocks its own
    g = torch.Generator().manual_seed(rows)

    def t(*shape):
        return (torch.randn(*shape, generator=g) / 4).to(dtype)

    x = t(rows, K)
    ws = (t(hq * d, K), t(hkv * d, K), t(hkv * d, K))
    biases = (t(hq * d), t(hkv * d), t(hkv * d)) if bias else None
    angles = torch.randn(40, d // 2, generator=g, dtype=torch.float64)
    cos, sin = angles.cos().float(), angles.sin().float()
    pos = torch.randint(0, 3 * bl, (rows,), generator=g, dtype=torch.int32)
    table = torch.randperm(nb, generator=g).view(rows, 3).to(torch.int32)
    table[1] = -1  # a padding row
    fp8 = cache_dtype == torch.float8_e4m3fn
    ks = torch.rand(hkv, generator=g) + 0.5 if fp8 else None
    vs = torch.rand(hkv, generator=g) + 0.5 if fp8 else None
    got_caches, want_caches = [], []
    for caches in (got_caches, want_caches):
        caches += [torch.full((nb, bl, hkv, d), 0.25).to(cache_dtype) for _ in range(2)]
    r = RopeAppend(cos, sin, pos, table, *got_caches, ks, vs, hq, hkv, d)
    q, asked = _rope_gemv_splits(lambda: _gemv(x, ws, biases, rope=r, split_k=split))
    assert asked == ([] if split is None else
                     [_rope_workspace(rows, (hq + 2 * hkv) * d, K, split, x.element_size())])
    qkv = gemv_reference(x.float(), ws, biases)
    want = rope_append_reference(qkv, cos, sin, pos, table, *want_caches, None, None, 0.0,
                                 ks, vs, hq, hkv, d).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(q.view(rows, hq, d), want, rtol=tol, atol=tol)
    for a, b in zip(got_caches, want_caches):
        if fp8:  # the float32 sums add in another order: where one lies on a rounding
            # boundary of e4m3 the two may store neighbours (2^-3 apart, relative, at most)
            assert (a.float() == b.float()).float().mean() > 0.95
            torch.testing.assert_close(a.float(), b.float(), rtol=0.125, atol=0)
        else:
            torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
    written = (got_caches[0].float() != 0.25).any(-1).any(-1).nonzero()  # (block, slot)
    assert len(written) == rows - 1  # every real row's slot, and not the padding row's
    with pytest.raises(ValueError, match="takes Wq, Wk, Wv"):
        _gemv(x, ws[:2], rope=r)


@pytest.mark.parametrize("rows,split", [(5, 2), (40, 3)])
def test_split_rotating_gemv_takes_the_row_norm_bias_and_uneven_k(rows: int, split: int) -> None:
    """The rotating GEMV as the decode step calls it at several rows (``row_scale``: the
    previous GEMV's row norm), with biases, K split over programs and K not a multiple of
    the K tile: the reference's queries and cache slots."""
    from lmfuse.serving.fused_ops import RopeAppend, RowNorm

    hq, hkv, d, bl, K = 4, 2, 32, 4, 1000
    g = torch.Generator().manual_seed(rows)

    def t(*shape):
        return torch.randn(*shape, generator=g) / 4

    x = t(rows, K)
    ws = (t(hq * d, K), t(hkv * d, K), t(hkv * d, K))
    biases = (t(hq * d), t(hkv * d), t(hkv * d))
    rn = RowNorm(torch.rand(rows, 3, generator=g) * 40 + 1, 96, 1e-5)
    angles = torch.randn(40, d // 2, generator=g, dtype=torch.float64)
    cos, sin = angles.cos().float(), angles.sin().float()
    pos = torch.randint(0, 3 * bl, (rows,), generator=g, dtype=torch.int32)
    table = torch.randperm(3 * rows, generator=g).view(rows, 3).to(torch.int32)
    got_c, want_c = ([torch.zeros(3 * rows, bl, hkv, d) for _ in range(2)] for _ in range(2))
    r = RopeAppend(cos, sin, pos, table, *got_c, None, None, hq, hkv, d)
    q, asked = _rope_gemv_splits(lambda: _gemv(x, ws, biases, rope=r, row_scale=rn,
                                                 split_k=split))
    assert asked == [_rope_workspace(rows, (hq + 2 * hkv) * d, K, split, 4)]
    qkv = gemv_reference(x.float(), ws, biases, row_scale=rn.scale())
    want = rope_append_reference(qkv, cos, sin, pos, table, *want_c, None, None, 0.0, None,
                                 None, hq, hkv, d)
    torch.testing.assert_close(q.view(rows, hq, d), want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_c, want_c):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert (got_c[0] != 0).any(-1).any(-1).sum() == rows


@pytest.mark.parametrize("kind", ["qkv_bias", "gated", "residual", "uneven_k"])
def test_one_row_gemv_gpu_tiles_equal_the_interpreters(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """At one row the interpreter widens the GEMV's feature tiles (fewer programs for it to
    run one by one); the GPU's (two features a program) run the same code to the same
    bits: plain, with the RMSNorm inside, and (one matrix) with the argmax."""
    import lmfuse.serving.fused_ops as fused_ops

    x, ws, biases, residual, gated, t = _gemv_case(kind, 1, torch.float32, 5)
    g = (1 + t(x.shape[1]), 1e-5)
    runs = []
    for gpu in (False, True):
        monkeypatch.setattr(fused_ops, "_GPU_TILES_IN_INTERPRETER", gpu)
        r = None if residual is None else residual.clone()
        got = [_gemv(x, ws, biases, residual=r, gated=gated).clone()]
        if residual is None:
            got.append(_gemv(x, ws, biases, gated=gated, norm=g))
        if len(ws) == 1 and residual is None:
            got.extend(_gemv(x, ws, argmax=True))
        runs.append(got)
    want = gemv_reference(x, ws, biases, residual=residual, gated=gated)
    torch.testing.assert_close(runs[0][0], want, rtol=1e-5, atol=1e-5)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["gated", "residual"])
def test_one_row_gemv_walks_a_long_k(kind: str) -> None:
    """One row takes the no-dot path with K tiles of 2048: a K of two tiles and a ragged
    third (the down projection of a decode step is such a K)."""
    g = torch.Generator().manual_seed(7)
    K = 2 * 2048 + 24
    x = torch.randn(1, K, generator=g) / 8
    if kind == "gated":
        ws = (torch.randn(4, K, generator=g) / 8, torch.randn(4, K, generator=g) / 8)
        got = _gemv(x, ws, gated=True)
        want = gemv_reference(x, ws, gated=True)
    else:
        ws = (torch.randn(6, K, generator=g) / 8,)
        r = torch.randn(1, 6, generator=g)
        want = gemv_reference(x, ws, residual=r)
        got = _gemv(x, ws, residual=r)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_lm_head_runs_the_gemv_at_one_row_with_the_norm_inside(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One sequence: the LM head's GEMV (256-feature tiles) takes the residual stream with
    the final RMSNorm inside and gives the greedy tokens from its tiles; no RMSNorm is
    launched in a decode step; the tokens stay model.generate's."""
    import lmfuse.serving.fused as fused
    import lmfuse.serving.fused_ops as fused_ops

    monkeypatch.setattr(fused_ops, "LM_HEAD_MIN_FEATURES", 128)
    model = tiny_causal_lm("llama", vocab_size=256)
    assert fused_ops.gemv_config(256, 64, 1, False)[:3] == (256, 128, 16)
    assert fused_ops.gemv_config(384, 64, 1, False)[:3] == (64, 128, 8)  # not 256 x k
    heads, norms, stepping = [], [], []
    real_gemv, real_norm, real_forward = (fused_ops.gemv, fused._launch_rms_norm,
                                          fused.FusedDecoder.forward)

    def gemv_spy(x, weights, *args, **kwargs):
        if weights[0] is model.lm_head.weight:
            heads.append((x.shape[0], kwargs.get("norm") is not None, kwargs.get("argmax")))
        return real_gemv(x, weights, *args, **kwargs)

    def norm_spy(h, *args, **kwargs):
        if stepping[-1:] == [True]:
            norms.append(h.shape[0])
        return real_norm(h, *args, **kwargs)

    def forward_spy(self, ids, *args, **kwargs):
        stepping.append(kwargs.get("prefill") is None)
        return real_forward(self, ids, *args, **kwargs)

    monkeypatch.setattr(fused_ops, "gemv", gemv_spy)
    monkeypatch.setattr(fused, "_launch_rms_norm", norm_spy)
    monkeypatch.setattr(fused.FusedDecoder, "forward", forward_spy)
    gen = Generator(model, block_len=4, num_blocks=48, impl="triton")
    got = gen.generate(PROMPTS[:1], max_new_tokens=4, eos_token_id=[])
    assert got == [hf_greedy(model, PROMPTS[0], 4)]
    assert (1, True, True) in heads and norms == []


def test_lm_head_runs_the_gemv_at_several_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A vocabulary counted as an LM head (the threshold lowered to this tiny one's 256)
    runs the GEMV's 128-feature tiles at several rows: the tokens stay model.generate's,
    and the GEMV did compute the logits."""
    import lmfuse.serving.fused_ops as fused_ops

    monkeypatch.setattr(fused_ops, "LM_HEAD_MIN_FEATURES", 128)
    model = tiny_causal_lm("llama", vocab_size=256)
    assert fused_ops.gemv_config(256, 64, 16, False)[0] == 128
    heads = []
    real = fused_ops.gemv

    def spy(x, weights, *args, **kwargs):
        if weights[0] is model.lm_head.weight:
            heads.append(x.shape[0])
        return real(x, weights, *args, **kwargs)

    monkeypatch.setattr(fused_ops, "gemv", spy)
    gen = Generator(model, block_len=4, num_blocks=48, impl="triton")
    got = gen.generate(PROMPTS, max_new_tokens=4, eos_token_id=[])
    assert got == [hf_greedy(model, p, 4) for p in PROMPTS]
    assert heads and set(heads) == {len(PROMPTS)}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_one_row_steps_norm_inside_the_gemv(family: str, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    """One sequence: the QKV (Qwen2: with biases) and gate/up GEMVs take the residual stream
    and RMS-norm it themselves; the tokens stay model.generate's."""
    import lmfuse.serving.fused_ops as fused_ops

    model = tiny_causal_lm(family)
    normed = []
    real = fused_ops.gemv

    def spy(x, weights, *args, **kwargs):
        if kwargs.get("norm") is not None:
            normed.append((x.shape[0], len(weights)))
        return real(x, weights, *args, **kwargs)

    monkeypatch.setattr(fused_ops, "gemv", spy)
    gen = Generator(model, block_len=4, num_blocks=48, impl="triton")
    prompt = PROMPTS[2]
    assert gen.generate([prompt], max_new_tokens=4, eos_token_id=[]) == [
        hf_greedy(model, prompt, 4)]
    layers = model.config.num_hidden_layers
    assert normed.count((1, 3)) == normed.count((1, 2)) >= 3 * layers  # QKV, gate/up


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_several_row_steps_rotate_and_append_in_the_qkv_gemv(
        family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Several sequences, heads of 32 dims: the QKV GEMV (Qwen2: with biases) rotates q and
    k and writes k and v to the cache itself, no rope_append launch; the tokens stay
    model.generate's."""
    import lmfuse.serving.fused_ops as fused_ops

    model = tiny_causal_lm(family, head_dim=32)
    appends, rotating = [], []
    real_append, real_gemv = fused_ops.launch_rope_append, fused_ops.gemv

    def append_spy(qkv, *args, **kwargs):
        appends.append(qkv.shape[0])
        return real_append(qkv, *args, **kwargs)

    def gemv_spy(x, weights, *args, **kwargs):
        if kwargs.get("rope") is not None:
            rotating.append(x.shape[0])
        return real_gemv(x, weights, *args, **kwargs)

    monkeypatch.setattr(fused_ops, "launch_rope_append", append_spy)
    monkeypatch.setattr(fused_ops, "gemv", gemv_spy)
    gen = Generator(model, block_len=4, num_blocks=48, impl="triton")
    got = gen.generate(PROMPTS, max_new_tokens=4, eos_token_id=[])
    assert got == [hf_greedy(model, p, 4) for p in PROMPTS]
    assert rotating and all(n > 1 for n in rotating) and all(n == 1 for n in appends)


_models: dict[str, object] = {}


def _model(family: str):
    if family not in _models:
        _models[family] = tiny_causal_lm(family)
    return _models[family]


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3], list(range(20, 34))]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_model_decode_path_still_gives_hf_tokens(family: str) -> None:
    """decode_path="model" (the model's own forward with lmfuse's paged attention) for
    families the fused layers take by default."""
    model = _model(family)
    gen = Generator(model, block_len=4, num_blocks=48, impl="torch", decode_path="model")
    assert gen.runner.decode_path == "model" and gen.runner.fused is None
    got = gen.generate(PROMPTS, max_new_tokens=6, eos_token_id=[])
    assert got == [hf_greedy(model, p, 6) for p in PROMPTS]


def _prefills(gen: Generator, monkeypatch: pytest.MonkeyPatch) -> tuple[list, dict]:
    """Serve a prompt, then three more (one extending the first: its full blocks shared) on
    ``gen``: (each prefill step's logits, each prompt's new tokens)."""
    import lmfuse.serving.engine as engine_module

    seen, real = [], engine_module.sample

    def spy(logits, params, counters, histories=None):
        if not seen or len(seen) < 2 and gen.stats["prefill_steps"] == 2:
            seen.append(logits.detach().float().clone())
        return real(logits, params, counters, histories)

    monkeypatch.setattr(engine_module, "sample", spy)
    gen.lookahead = False
    first = list(range(20, 34))
    prompts = [first, first + [40, 41, 42], [7, 8, 9], [11, 12]]
    out: dict[int, list[int]] = {}
    rids = [gen.add_request(prompts[0], max_new_tokens=4, eos_token_id=[])]
    out.update((rid, toks) for rid, toks, _ in gen.step())  # the first prompt's prefill
    rids += [gen.add_request(p, max_new_tokens=4, eos_token_id=[]) for p in prompts[1:]]
    while gen.has_unfinished():
        for rid, toks, _ in gen.step():
            out[rid] = out.get(rid, []) + toks
    assert gen.stats["prefill_steps"] == 2 and gen.scheduler.shared_tokens == 12
    return seen, {i: out[rid] for i, rid in enumerate(rids)} | {"prompts": prompts}


@pytest.mark.parametrize("family,impl,pad,chunk", [
    ("llama", "torch", False, None), ("llama", "triton", True, None),
    ("llama", "triton", False, 3)] + [
    (family, "triton", pad, chunk) for family in ("llama", "qwen3", "mistral")
    for pad, chunk in ((False, None), (True, 3))])
def test_prefill_runs_the_fused_layers_with_the_models_logits(
        family: str, impl: str, pad: bool, chunk: int | None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill runs the fused layers on the Triton path (a row per prompt token over its
    sequence's blocks, the queries in chunks; the rows padded to a CUDA graph's buckets or
    not: padding rows and sequences write and read nothing) and gives the logits of the
    model's own forward (mistral: a window of 6 keys); a prompt whose first blocks another
    sequence holds reads them from the cache; the LM head's GEMV takes the kept rows. The
    tokens stay model.generate's."""
    import lmfuse.serving.fused as fused
    import lmfuse.serving.fused_ops as fused_ops

    monkeypatch.setattr(fused_ops, "LM_HEAD_MIN_FEATURES", 128)
    key = f"{family}-v256"
    if key not in _models:
        _models[key] = tiny_causal_lm(family, vocab_size=256)
    model = _models[key]
    kept = []
    real_forward = fused.FusedDecoder.forward

    def forward_spy(self, ids, *args, **kwargs):
        if kwargs.get("prefill") is not None:
            pf = kwargs["prefill"]
            kept.append((ids.shape[0], pf.keep.shape[0], pf.lengths.shape[0]))
        return real_forward(self, ids, *args, **kwargs)

    monkeypatch.setattr(fused.FusedDecoder, "forward", forward_spy)
    ref = Generator(model, block_len=4, num_blocks=48, impl="torch", decode_path="model")
    want, _ = _prefills(ref, monkeypatch)
    assert kept == []
    gen = Generator(model, block_len=4, num_blocks=48, impl=impl)
    gen.runner.pad_prefill = pad
    if chunk is not None:  # several chunks a prompt, the first reaching before its tokens
        gen.runner.fused.chunk = chunk
    got, tokens = _prefills(gen, monkeypatch)
    # 14 tokens, then 5 + 3 + 2 (12 of the second prompt's cached), in chunks of 64 / 2 (the
    # query heads a KV head serves) = 32 positions: padded to 16 rows, 1 and 4 sequences and
    # 16 / 32 + sequences chunks; else as they are. The torch path: the model's forward.
    # With chunks of 3: 5, then 2 + 1 + 1 chunks; padded: 16 // 3 + sequences.
    if chunk is None:
        assert kept == ([] if impl == "torch" else [(16, 1, 1), (16, 4, 4)] if pad
                        else [(14, 1, 1), (10, 3, 3)])
    else:
        assert kept == ([(16, 1, 6), (16, 4, 9)] if pad else [(14, 1, 5), (10, 3, 4)])
    assert len(got) == len(want) == 2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    prompts = tokens.pop("prompts")
    assert [tokens[i] for i in range(4)] == [hf_greedy(model, p, 4) for p in prompts]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_rows_past_the_gemv_run_cublas_with_fused_epilogues(
        family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forwards of more rows than the GEMV takes (long prefills; here any over 2) run the
    projections' GEMMs into one buffer (qwen2: with the QKV biases), the residual adds in
    the GEMMs and the MLP through lmfuse's swiglu: the prefill logits of the model's own
    forward and model.generate's tokens, prefills and decode steps alike."""
    import lmfuse.serving.fused as fused
    import lmfuse.serving.fused_ops as fused_ops

    monkeypatch.setattr(fused_ops, "GEMV_MAX_ROWS", 2)
    model = tiny_causal_lm(family, vocab_size=256)
    torch.manual_seed(3)
    with torch.no_grad():  # biases that matter (a fresh model's are zeros)
        for layer in model.model.layers:
            for proj in ("q_proj", "k_proj", "v_proj"):
                bias = getattr(layer.self_attn, proj).bias
                if bias is not None:
                    bias.normal_(0.0, 0.5)
    calls = {"swiglu": 0, "linears": 0}
    for name in calls:
        real = getattr(fused, name if name == "swiglu" else "_linears")

        def spy(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(fused, name if name == "swiglu" else "_linears", spy)
    ref = Generator(model, block_len=4, num_blocks=48, impl="torch", decode_path="model")
    want, _ = _prefills(ref, monkeypatch)
    assert calls == {"swiglu": 0, "linears": 0}
    gen = Generator(model, block_len=4, num_blocks=48, impl="triton")
    got, tokens = _prefills(gen, monkeypatch)
    layers = model.config.num_hidden_layers
    assert calls["swiglu"] >= 2 * layers and calls["linears"] == 2 * calls["swiglu"]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    prompts = tokens.pop("prompts")
    assert [tokens[i] for i in range(4)] == [hf_greedy(model, p, 4) for p in prompts]


def test_a_failed_prefill_capture_leaves_decode_graphs_on(monkeypatch) -> None:
    """A prefill graph that cannot be captured turns off the prefills' graphs alone, with
    a warning that says so; the decode steps keep theirs."""
    gen = Generator(_model("llama"), block_len=4, num_blocks=16, impl="triton")
    runner = gen.runner
    runner.graphs_on = True  # as on a GPU
    runner._pool = object()  # (a CPU build has no graph pools: the retry's new one stubbed)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", object)

    def broken(pool):
        raise RuntimeError("no capture here")

    with pytest.warns(RuntimeWarning, match="a prefill could not be captured in a CUDA "
                                            "graph .*no capture here.*prefilling eagerly"):
        assert runner._graph(("prefill", 16, 1, 1, 1), broken) is None
    assert runner.graphs_on and not runner.prefill_graphs_on
    assert runner.graph_failures == 1 and gen.stats["graph_failures"] == 1


@pytest.mark.parametrize("family,path", [("llama", "fused"), ("mistral", "fused"),
                                         ("qwen2", "fused"), ("qwen3", "fused"),
                                         ("gemma", "model"), ("gemma2", "model"),
                                         ("gpt_oss", "model")])
def test_auto_decode_path_per_family(family: str, path: str) -> None:
    gen = Generator(_model(family), block_len=4, num_blocks=16, impl="torch")
    assert gen.runner.decode_path == path


def test_decode_path_option_is_checked() -> None:
    with pytest.raises(ValueError, match="decode_path must be one of"):
        Generator(_model("llama"), block_len=4, num_blocks=16, decode_path="fast")
    with pytest.raises(ValueError, match="decode_path='fused' cannot run this model: "
                                         "model type 'gemma'"):
        Generator(_model("gemma"), block_len=4, num_blocks=16, decode_path="fused")


class _BiasedHead(torch.nn.Linear):
    """An LM head whose forward adds a logit bias (a subclass the fused layers cannot read)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).index_add(-1, torch.tensor([3]),
                                            x.new_full((*x.shape[:-1], 1), 100.0))


def _bias_3(module, args, out):
    return out.index_add(-1, torch.tensor([3]), out.new_full((*out.shape[:-1], 1), 100.0))


def _head_subclass(m):
    head = _BiasedHead(m.lm_head.in_features, m.lm_head.out_features, bias=False)
    head.weight = m.lm_head.weight
    m.lm_head = head


def _steer(module, args):  # a steering vector on the first layer's input
    return (args[0] + 0.5, *args[1:])


@pytest.mark.parametrize("change, reason", [
    (lambda m: m.lm_head.register_forward_hook(_bias_3), "forward hooks on lm_head"),
    (lambda m: m.model.layers[1].mlp.register_forward_hook(
        lambda mod, a, out: out * 3.0), "forward hooks on model.layers.1.mlp"),
    (lambda m: m.model.layers[0].register_forward_pre_hook(_steer),
     "forward hooks on model.layers.0"),
    (_head_subclass, "an LM head of type _BiasedHead"),
    (lambda m: setattr(m.model.norm, "forward", lambda x: x * 2.0),
     "a forward set on model.norm itself"),
])
def test_modules_the_fused_layers_cannot_stand_in_for(change, reason: str) -> None:
    """Hooks, subclassed modules and forwards set on an instance change what the model
    computes; the fused layers read only the weights, so "auto" decodes through the model's
    forward (which honours them: ``model.generate``'s tokens) and "fused" says why not."""
    model = tiny_causal_lm("llama")
    change(model)
    want = [hf_greedy(model, p, 5) for p in PROMPTS]
    gen = Generator(model, block_len=4, num_blocks=32, impl="torch")
    assert gen.runner.decode_path == "model"
    assert gen.generate(PROMPTS, max_new_tokens=5, eos_token_id=[]) == want
    with pytest.raises(ValueError, match=f"decode_path='fused' cannot run this model: {reason}"):
        Generator(model, block_len=4, num_blocks=32, decode_path="fused")


def test_a_hook_registered_after_the_generator_was_made_is_refused() -> None:
    """The fused layers are chosen when the Generator is made: a hook added later would be
    skipped silently (other tokens than model.generate); generate() now refuses, and a new
    Generator takes the model's forward."""
    model = tiny_causal_lm("llama")
    gen = Generator(model, block_len=4, num_blocks=32, impl="torch")
    assert gen.runner.decode_path == "fused"
    handle = model.lm_head.register_forward_hook(_bias_3)
    with pytest.raises(ValueError, match=r"the model changed since this Generator chose its "
                                         r"fused decode layers \(forward hooks on lm_head\)"):
        gen.generate(PROMPTS, max_new_tokens=3, eos_token_id=[])
    again = Generator(model, block_len=4, num_blocks=32, impl="torch")
    assert again.runner.decode_path == "model"
    assert again.generate(PROMPTS, max_new_tokens=3, eos_token_id=[]) == [
        hf_greedy(model, p, 3) for p in PROMPTS]
    handle.remove()
    assert gen.generate(PROMPTS[:1], max_new_tokens=2, eos_token_id=[]) == [
        hf_greedy(model, PROMPTS[0], 2)]


@pytest.mark.parametrize("prepare", [
    lambda m: torch.compile(m),  # OptimizedModule: its forward sits on the instance
    lambda m: (m(torch.tensor([[1, 2, 3]]), output_hidden_states=True), m)[1],
    lambda m: (m.gradient_checkpointing_enable(), m)[1],
], ids=["torch.compile", "after-output_hidden_states", "gradient-checkpointing"])
def test_what_leaves_the_values_alone_keeps_the_fused_layers(prepare) -> None:
    """transformers' own output-capture hooks (installed by a forward with
    output_hidden_states) and enable_input_require_grads' hook, and torch.compile's wrapper,
    change nothing the fused layers skip: they still decode (they were refused)."""
    model = prepare(tiny_causal_lm("llama"))
    gen = Generator(model, block_len=4, num_blocks=32, impl="torch")
    assert gen.runner.decode_path == "fused"


@pytest.mark.parametrize("n,V,block", [(5, 256, 16), (1, 1000, 64), (3, 1, 16),
                                       (2, 4099, 32), (70, 40, 16)])
def test_argmax_rows_is_torch_argmax_with_ties_nan_and_inf(n: int, V: int, block: int) -> None:
    """The Triton argmax of the greedy step (interpreted here) against torch.argmax: many
    ties, NaN (the first one wins), +inf, rows all -inf, one column, chunks of several
    tiles (V = 4099 at block 32 over 1024 programs' worth of chunks) and a ragged last one."""
    g = torch.Generator().manual_seed(V)
    x = torch.randint(-3, 4, (n, V), generator=g).float()
    if n > 1:
        x[1] = float("-inf")
    if n > 2 and V > 3:
        x[2, V // 2] = float("nan")
        x[2, V - 1] = float("nan")
        x[2, 1] = float("inf")
    if n > 3:
        x[3, -1] = float("inf")
        x[3, 0] = float("inf")
    want = torch.argmax(x, -1)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(argmax_rows(x.to(dtype), block=block), want)
    assert torch.equal(greedy(x.bfloat16()), want)  # the CPU path: torch.argmax


def test_lookahead_runs_ahead_and_gives_the_same_tokens() -> None:
    """Greedy decode steps run one ahead (the next launched before this one is read): the
    same tokens as without lookahead and as HF's; a step is in flight between calls."""
    model = _model("llama")
    want = [hf_greedy(model, p, 6) for p in PROMPTS]
    for lookahead in (True, False):
        gen = Generator(model, block_len=4, num_blocks=48, impl="torch")
        gen.lookahead = lookahead
        rids = [gen.add_request(p, max_new_tokens=6, eos_token_id=[]) for p in PROMPTS]
        got = {r: [] for r in rids}
        ahead = 0
        while gen.has_unfinished():
            for rid, toks, _ in gen.step():
                got[rid] += toks
            ahead += gen._inflight is not None
        assert [got[r] for r in rids] == want
        assert (ahead > 0) == lookahead
        assert gen.cache.num_free_blocks == 48


def test_a_step_dropped_unread_waits_for_its_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """The request ends on an end-of-sequence token while the next step runs ahead: that
    step is dropped unread, and when it is collected it waits for its event first (on a
    GPU its pinned input and token buffers may still be in use by its copy kernels); a
    step that was read does not wait again."""
    import lmfuse.serving.engine as engine

    waited = []

    class Event:  # what torch.cuda.Event gives a step on a GPU
        def synchronize(self):
            waited.append(self)

    launch = engine._Inflight.launch

    def launch_with_event(requests, tokens, keep=None):
        step = launch(requests, tokens, keep)
        step.event, step.host = Event(), tokens.clone()
        return step

    monkeypatch.setattr(engine._Inflight, "launch", staticmethod(launch_with_event))
    model = _model("llama")
    full = hf_greedy(model, PROMPTS[0], 8)
    eos = full[2]
    gen = Generator(model, block_len=4, num_blocks=48, impl="torch")
    launched = []
    real_chain = gen._chain
    monkeypatch.setattr(gen, "_chain", lambda cur: launched.append(real_chain(cur)) or
                        launched[-1])
    assert gen.generate([PROMPTS[0]], max_new_tokens=8, eos_token_id=eos) == [full[:3]]
    assert gen._inflight is None
    steps = [s for s in launched if s is not None]
    dropped = [s for s in steps if not s.read_done]
    assert len(dropped) == 1 and len(steps) > 1  # the step after the end-of-sequence token
    events = [s.event for s in steps]
    assert [waited.count(e) for e in events] == [0 if s in dropped else 1 for s in steps]
    launched.clear()
    del steps, dropped
    assert [waited.count(e) for e in events] == [1] * len(events)  # the dropped one waited


def test_abort_and_eos_while_a_step_runs_ahead() -> None:
    """A request aborted, and one ending on an end-of-sequence token, while the next step
    is already launched: their extra tokens are dropped, the others' tokens are HF's, and
    every block comes back."""
    model = _model("qwen3")
    full = [hf_greedy(model, p, 8) for p in PROMPTS]
    eos = full[0][2]  # request 0 stops at its third token
    gen = Generator(model, block_len=4, num_blocks=48, impl="torch")
    rids = [gen.add_request(p, max_new_tokens=8, eos_token_id=eos) for p in PROMPTS]
    got = {r: [] for r in rids}
    aborted = False
    while gen.has_unfinished():
        for rid, toks, _ in gen.step():
            got[rid] += toks
        if not aborted and gen._inflight is not None and len(got[rids[1]]) >= 2:
            gen.abort(rids[1])
            aborted = True
    assert aborted
    assert got[rids[0]] == full[0][:full[0].index(eos) + 1]
    assert got[rids[1]] == full[1][:len(got[rids[1]])] and len(got[rids[1]]) < 8
    stop = full[2].index(eos) + 1 if eos in full[2] else 8
    assert got[rids[2]] == full[2][:stop]
    assert gen.cache.num_free_blocks == 48 and not gen.has_unfinished()


def test_aborting_every_request_while_a_step_runs_ahead_leaves_it_idle() -> None:
    """Aborting the last running request while its next step is already launched: the
    Generator is idle at once (nothing unfinished, no step left to read), every block is
    back and generate() runs, with HF's tokens."""
    model = _model("llama")
    gen = Generator(model, block_len=4, num_blocks=48, impl="torch")
    rid = gen.add_request(PROMPTS[0], max_new_tokens=8, eos_token_id=[])
    for _ in range(4):  # the prefill, then greedy steps run ahead
        gen.step()
        if gen._inflight is not None:
            break
    assert gen._inflight is not None
    gen.abort(rid)
    assert not gen.has_unfinished() and gen._inflight is None
    assert gen.cache.num_free_blocks == 48 and gen.step() == []
    assert gen.generate([PROMPTS[1]], max_new_tokens=4, eos_token_id=[]) == [
        hf_greedy(model, PROMPTS[1], 4)]


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_lm_head_gemv_gives_torch_argmax_of_its_logits(rows: int) -> None:
    """``argmax=True``: the logits as without it, and each row's argmax from the tiles as
    they are stored: torch.argmax's, with ties across and within tiles, NaN (it wins) and
    inf."""
    g = torch.Generator().manual_seed(rows)
    K, V = 32, 512  # several feature tiles (the interpreter's 64 at one row, else 128)
    x = torch.randn(rows, K, generator=g)
    w = torch.randn(V, K, generator=g) / 4
    w[300] = w[17]  # the same logits in columns 17 and 300 (a tie across tiles)...
    w[18] = w[17]  # ...and 18 (within one)
    x[0] = w[17] * 8  # row 0's best: column 17 (the first of the three)
    w[450, :] = 0.0
    y_plain = _gemv(x, (w,))
    y, tokens = _gemv(x, (w,), argmax=True)
    torch.testing.assert_close(y, y_plain, rtol=0, atol=0)
    assert tokens.dtype == torch.int64 and tokens.tolist() == torch.argmax(y, -1).tolist()
    assert tokens[0] == 17
    x2 = x.clone()
    x2[-1, 0] = float("nan")  # a NaN input: every logit of the last row NaN, argmax column 0
    w2 = w.clone()
    w2[200, 0] = float("inf")  # row 2: +inf at 200 (or NaN where x[2, 0] is 0 or < 0)
    y2, t2 = _gemv(x2, (w2,), argmax=True)
    assert t2.tolist() == torch.argmax(y2, -1).tolist()
    # tokens=: written into the given buffer (a decode graph's ids, the next step's input)
    buf = torch.full((rows, 1), -1, dtype=torch.int64)
    _, t3 = _gemv(x2, (w2,), argmax=True, tokens=buf[:, 0])
    assert t3.data_ptr() == buf.data_ptr() and buf[:, 0].tolist() == t2.tolist()
    assert greedy(y2, out=buf[:, 0]).data_ptr() == buf.data_ptr()
    assert buf[:, 0].tolist() == t2.tolist()
    for bad in (torch.empty(rows, 2, dtype=torch.int64)[:, 0],
                torch.empty(rows, dtype=torch.int32), torch.empty(rows + 1, dtype=torch.int64)):
        with pytest.raises(ValueError, match="merge_argmax: out must be"):
            _gemv(x2, (w2,), argmax=True, tokens=bad)
    with pytest.raises(ValueError, match="argmax"):
        _gemv(x, (w, w), argmax=True)


@pytest.mark.parametrize("n,dtype", [(1, torch.int64), (37, torch.int32), (2500, torch.int32)])
def test_bus_copy_copies_flat_tensors(n: int, dtype: torch.dtype) -> None:
    """``bus_copy`` (the decode step's copies to and from pinned host memory on the GPU's
    compute queue; here in the interpreter): the elements copied, several programs where
    the tensor is long; tensors of other sizes or dtypes, or strided, are refused."""
    from lmfuse.serving.runner import bus_copy

    src = torch.randint(-5, 1 << 20, (n,), dtype=dtype)
    dst = torch.full((n,), -1, dtype=dtype)
    assert bus_copy(dst, src) is dst and torch.equal(dst, src)
    strided = [torch.zeros(2 * n, dtype=dtype)[::2]] if n > 1 else []
    for bad in [torch.zeros(n + 1, dtype=dtype), torch.zeros(n, dtype=torch.float32)] + strided:
        with pytest.raises(ValueError, match="bus_copy"):
            bus_copy(bad, src)


# (n_out, K, row tile, gated) -> (the tiles, the K split) on the default table: one case per
# entry of its ``gemv`` section (the H100's measured choices).
GEMV_TABLE_CASES = [
    ((2048, 2048, 1, False), (2, 2048, 4, 3), 1),      # one row, no dot tile
    ((8192, 2048, 1, True), (2, 2048, 4, 3), 1),
    ((128256, 2048, 1, False), (256, 128, 16, 3), 1),  # LM head, one row
    ((128064, 2048, 1, False), (64, 128, 8, 3), 1),    # ... not a multiple of 256
    ((128256, 2048, 16, False), (128, 256, 4, 3), 1),
    ((128256, 2048, 64, False), (128, 128, 4, 2), 1),
    ((8192, 2048, 16, True), (32, 128, 4, 3), 1),      # gate/up
    ((8192, 2048, 64, True), (64, 128, 4, 3), 1),
    ((2048, 2048, 16, False), (64, 128, 4, 4), 4),     # Wo: K split in 4
    ((2048, 8192, 16, False), (32, 128, 4, 4), 4),     # Wd
    ((6144, 2048, 16, False), (32, 256, 4, 4), 1),     # QKV
    ((2048, 8192, 64, False), (32, 256, 4, 4), 2),
    ((6144, 2048, 64, False), (32, 256, 4, 4), 1),
    ((6144, 2048, 32, False), (32, 128, 4, 3), 1),
]


@pytest.mark.parametrize("args, tiles, split", GEMV_TABLE_CASES)
def test_gemv_tiles_from_the_tuning_table(args, tiles, split) -> None:
    import lmfuse.serving.fused_ops as fused_ops

    assert fused_ops.gemv_config(*args) == tiles
    assert fused_ops.gemv_split(*args) == split


def test_gemv_tiles_fit_shared_memory_and_follow_an_overlay() -> None:
    """The stages fit the device's shared memory (block_k, then stages, shrink); the rotary
    GEMV takes 16 features; values laid over the table are read at the next call (the
    lookup's cache is keyed on the tables' generation)."""
    import lmfuse.serving.fused_ops as fused_ops
    from lmfuse import tuning

    assert fused_ops.gemv_config(6144, 2048, 16, False, 2, None, True) == (16, 256, 4, 4)
    assert fused_ops.gemv_config(8192, 2048, 64, True, 2, 49152) == (64, 64, 4, 2)
    only = [{"kind": ["plain", "gated", "lm_head"], "block_n": 8, "block_k": 64, "warps": 2,
             "stages": 2}]
    with tuning.overlay("gemv", {"tiles": only, "split_k": []}):
        assert fused_ops.gemv_config(2048, 2048, 16, False) == (8, 64, 2, 2)
        assert fused_ops.gemv_split(2048, 2048, 16, False) == 1
    assert fused_ops.gemv_config(2048, 2048, 16, False) == (64, 128, 4, 4)
    assert fused_ops.gemv_split(2048, 2048, 16, False) == 4


def test_gemv_extra_tiles_are_searched_first() -> None:
    """A device table's ``extra_tiles`` come before the default ``tiles``: the H200's 32-row
    entries (gated at 4 stages, plain at 256-wide K tiles) change the 32-row GEMVs only."""
    import json
    from pathlib import Path

    import lmfuse.serving.fused_ops as fused_ops
    from lmfuse import tuning

    h200 = json.loads((Path(tuning.__file__).parent / "h200.json").read_text())["gemv"]
    before = {m: (fused_ops.gemv_config(8192, 2048, m, True),
                  fused_ops.gemv_config(6144, 2048, m, False)) for m in (16, 32, 64)}
    with tuning.overlay("gemv", {"extra_tiles": h200["extra_tiles"]}):
        assert fused_ops.gemv_config(8192, 2048, 32, True) == (64, 128, 4, 4)
        assert fused_ops.gemv_config(6144, 2048, 32, False) == (32, 256, 4, 3)
        assert fused_ops.gemv_config(6144, 2048, 32, False, 2, None, True) == (16, 256, 4, 3)
        for m in (16, 64):
            assert (fused_ops.gemv_config(8192, 2048, m, True),
                    fused_ops.gemv_config(6144, 2048, m, False)) == before[m]
    assert before[32] == ((64, 128, 4, 3), (32, 128, 4, 3))  # the default's generic entries
    assert fused_ops.gemv_config(8192, 2048, 32, True) == before[32][0]


def test_rope_split_follows_the_table() -> None:
    """The rotating QKV GEMV splits K where the ``gemv`` section's ``rope_split_k`` says
    (row tile and shortest K), and nowhere by default; its tile entry follows that split,
    not the plain GEMV's (a QKV of 1536 outputs at 16 rows: the plain one would split it
    in 4 and take a split entry's 128-wide K tiles)."""
    from lmfuse import tuning
    from lmfuse.serving.fused_ops import gemv_config, gemv_split, rope_split

    assert {rope_split(K, m) for K in (2048, 8192) for m in (16, 32, 64)} == {1}
    assert gemv_split(1536, 1024, 16, False) == 4
    assert gemv_config(1536, 1024, 16, False, 2, None, True) == (16, 256, 4, 4)
    with tuning.overlay("gemv", {"rope_split_k": [{"rows": [16], "min_k": 1024, "split": 2}]}):
        assert rope_split(1024, 16) == 2 and rope_split(8192, 16) == 2
        assert rope_split(512, 16) == 1 and rope_split(4096, 32) == 1
        assert gemv_config(1536, 1024, 16, False, 2, None, True) == (16, 128, 4, 4)
    assert rope_split(4096, 16) == 1


def test_l2_prefetch_ranges_take_wo_then_gate_and_up_alike() -> None:
    """The one-row step's L2 prefetch asks for Wo first, then equal leading bytes of gate
    and up, within the budget, in whole 16-byte units of contiguous, aligned tensors."""
    from lmfuse.serving.fused_ops import prefetch_ranges

    o = torch.zeros(64, 32, dtype=torch.bfloat16)  # 4096 bytes
    gate, up = torch.zeros(128, 32, dtype=torch.bfloat16), torch.zeros(128, 32,
                                                                        dtype=torch.bfloat16)

    def sizes(budget, *ws):
        return [(r[0].data_ptr(), r[1]) for r in prefetch_ranges(*ws, budget)]

    assert sizes(10000, o, gate, up) == [(o.data_ptr(), 4096), (gate.data_ptr(), 2944),
                                         (up.data_ptr(), 2944)]
    assert sizes(3000, o, gate, up) == [(o.data_ptr(), 2992)]  # Wo alone, 16-byte units
    assert sizes(1 << 30, o, gate, up) == [(o.data_ptr(), 4096), (gate.data_ptr(), 8192),
                                           (up.data_ptr(), 8192)]  # never past a tensor
    assert sizes(0, o, gate, up) == []
    # A strided view or an unaligned start is left out (the bulk prefetch takes neither).
    assert sizes(10000, o.t(), gate, up)[0] == (gate.data_ptr(), 4992)
    odd = torch.zeros(64 * 32 + 1, dtype=torch.bfloat16)[1:].view(64, 32)
    assert [p for p, _ in sizes(10000, odd, gate, up)] == [gate.data_ptr(), up.data_ptr()]


def test_cpu_decoder_prefetches_nothing() -> None:
    """No PDL (CPU, the interpreter): no L2 prefetch, no side stream."""
    model = tiny_causal_lm("llama")
    gen = Generator(model, block_len=4, num_blocks=16)
    fused = gen.runner.fused
    assert fused is not None and fused.l2_prefetch == 0 and fused._side is None


def test_l2_prefetch_budget_comes_from_the_gemv_table() -> None:
    """The budget is the device table's (H200: 16 MiB, measured; elsewhere 0 until
    measured), and an overlay moves it."""
    from lmfuse import tuning
    from lmfuse.serving.fused_ops import l2_prefetch_bytes

    cpu = torch.device("cpu")
    assert l2_prefetch_bytes(cpu) == 0
    assert tuning._TABLES["h200"]["gemv"]["l2_prefetch_bytes"] == 16 << 20
    with tuning.overlay("gemv", {"l2_prefetch_bytes": 1 << 20}):
        assert l2_prefetch_bytes(cpu) == 1 << 20


def test_each_generator_keeps_its_own_split_k_buffers() -> None:
    """Two Generators' split-K GEMVs (every plain GEMV split in 2 here) keep their partials
    and counts in their own decoders' workspaces: no buffer shared between them (two
    Generators stepping on two streams would otherwise add into each other's partials) and
    none taken from the process's; each decodes model.generate's tokens."""
    import lmfuse.serving.fused_ops as fused_ops
    from lmfuse import tuning

    model = tiny_causal_lm("llama", vocab_size=256)
    split = [{"kind": ["plain", "lm_head"], "rows": [16, 32, 64], "max_features": 1 << 20,
              "split": 2}]
    tiles = [{"kind": ["plain", "gated", "lm_head"], "block_n": 16, "block_k": 16,
              "warps": 2, "stages": 2}]  # (K tiles short enough to split the tiny model's K)
    before = dict(fused_ops._SPLIT_BUFFERS)
    with tuning.overlay("gemv", {"split_k": split, "tiles": tiles}):
        gens = [Generator(model, block_len=4, num_blocks=48, impl="triton") for _ in range(2)]
        for gen in gens:
            assert gen.generate(PROMPTS, max_new_tokens=3, eos_token_id=[]) == [
                hf_greedy(model, p, 3) for p in PROMPTS]
    spaces = [gen.runner.fused.split_buffers for gen in gens]
    assert all(spaces) and spaces[0] is not spaces[1]
    ptrs = [{t.data_ptr() for pair in s.values() for t in pair} for s in spaces]
    assert not ptrs[0] & ptrs[1]
    assert fused_ops._SPLIT_BUFFERS == before
    assert all(int(c.abs().sum()) == 0 for s in spaces for _, c in s.values())
