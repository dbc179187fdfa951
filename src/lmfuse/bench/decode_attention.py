"""Benchmark ``lmfuse.decode_attention`` against a copy, SDPA and gather + SDPA.

Run it as ``lmfuse bench decode_attention [--json PATH] [--plot PATH] [--quick]
[--cases SUBSTR[,SUBSTR...]]``; ``--cases`` runs only the cases whose name contains one of
the substrings (``--cases B64``, ``--cases paged16,ragged``; ``--cases "B16 Hq32 S8192 s1
contiguous"`` runs the bf16/fp8 pair the fp8 target compares). ``--graphs`` times every call
(lmfuse's and the peers') as the replay of a CUDA graph holding it: GPU time without the
host's launch overhead, as a server that captures its decode step sees it; each replay
still pays the graph's own launch (about 14 us on an H100). ``--graph-calls N`` (with
``--graphs``) captures N calls back to back in each graph and gives a call's share: the
kernels' time without any launch, as ``triton.testing.do_bench_cudagraph`` times (issue
22's own figures were taken so). The cases are
bf16, D = 128,
Hkv = 8, every sequence full (length = capacity = S) unless said otherwise:

  B64 Hq32 S4096 s1      contiguous, contiguous fp8, paged (block_len 16 and 64), paged fp8
  B1 Hq32 S131072 s1     contiguous, contiguous fp8, paged 16 and 64, paged fp8 (one
                         sequence: split-KV); B1 Hq64 paged 16, bf16 and fp8
  B4 Hq64 S32768 s4      contiguous, paged 16, paged 16 fp8 (4 active tokens, causal among
                         themselves)
  B16 Hq32 S8192 s1      contiguous, contiguous fp8 (float8_e4m3fn, k_scale/v_scale [Hkv]),
                         paged 16, paged 16 fp8
  B256 Hq32 S1024 s1     paged 16, paged 16 fp8
  B8 Hq32 Hkv32 S8192    GQA group 1; B16 Hq32 S8192 with D = 64 and D = 256
  B32 Hq32 S<=8192 s1    ragged lengths uniform in [1, 8192], paged 16

A paged cache holds the same keys and values as the contiguous one, its blocks randomly
permuted in the pool (``torch.randperm``); ``block_table`` is int32, padded with -1.

Every case reports the median time and the achieved TB/s over the *minimal* bytes: the K
and V rows read (sum over sequences of ``min(length, capacity) * Hkv * D * 2 * element
size``) plus q read and the output written. Rows:

  lmfuse          ``lmfuse.decode_attention`` (the note gives its split count)
  sdpa            ``F.scaled_dot_product_attention(q, k, v, enable_gqa=True)`` with
                  ``q [B, Hq, s_active, D]`` and k/v the ``[B, Hkv, S, D]`` transposed
                  (strided) views of the contiguous ``[B, S, Hkv, D]`` cache
  sdpa (BHSD)     the same on contiguous ``[B, Hkv, S, D]`` copies, SDPA's best layout
  gather + sdpa   paged caches: ``pool[block_table]`` builds ``[B, S, Hkv, D]``, then SDPA;
                  both steps timed together
  copy            a device-to-device copy moving as many bytes (half read, half written)

With ``s_active > 1`` (or ragged lengths) SDPA gets a boolean ``attn_mask``: token ``i``
sees keys ``<= length - s_active + i`` (bottom-right causal), as decode attention does. The
mask is built once, outside the timing. Before timing, lmfuse's output (and each peer's) is
compared with SDPA's on the same data (dequantised for fp8): the note gives the max relative
difference ``max|a - b| / max|b|`` and flags one over 2e-2 (1e-4 in float32); a flagged
lmfuse row fails every target, so a wrong kernel cannot post a fast time.

The targets, checked at the end (on a GPU): paged at least 0.90x the copy's TB/s at
B64 S4096 and B1 S131072; at least 2.5 TB/s at B4 s4; lmfuse no slower than the faster
SDPA row on every contiguous case; contiguous fp8 at least 1.8x the bf16 tokens/s (``B *
s_active / time``) of the same shape's contiguous bf16 case at B64 S4096, 1.7x at the
split-KV shapes B1 S131072 and B16 S8192; paged fp8 against the same shape's paged bf16
case at least 1.9x at B64 S4096 and B256 S1024, 1.7x at B16 S8192, B1 S131072 and B4 s4.
``--quick`` (the default on CPU) runs the same cases at tiny shapes in float32, through
Triton's interpreter when ``TRITON_INTERPRET=1`` (else the reference).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from functools import partial
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

import lmfuse
from lmfuse._launch import cdiv
from lmfuse.bench.common import (Case, Result, add_copy_rows, as_graph, cell, finish,
                                 measure_copy, run_cases, start)

__all__ = ["as_graph"]  # (its home is common; the sharded and MoE harnesses import it here)
from lmfuse._cli_args import ArgumentParser, int_range

PAGED_SHARE_OF_COPY = 0.90  # paged TB/s at least this share of the copy's (roles below)
PAGED_COPY_ROLES = ("batch", "long")
MULTI_TOKEN_TBPS = 2.5  # TB/s at the s_active = 4 shape
# fp8 tokens/s at least this multiple of the same layout's bf16 tokens/s, per role. Contiguous:
# the batch shape 1.8x, the split-KV ones 1.7x (issue 22's restatement). Paged (issue 22):
# the batch shapes 1.9x, the split-KV and multi-token ones 1.7x.
FP8_SPEEDUP = {"batch": 1.8, "long": 1.7, "fp8": 1.7}
PAGED_FP8_SPEEDUP = {"batch": 1.9, "many": 1.9, "long": 1.7, "multi": 1.7, "fp8": 1.7}
PEERS_SDPA = ("sdpa", "sdpa (BHSD)")


class Shape(NamedTuple):
    """One benchmarked shape and the cache layouts it runs on. ``role`` names what the
    targets judge it by."""

    role: str
    B: int
    Hq: int
    S: int
    s_active: int = 1
    Hkv: int = 8
    D: int = 128
    layouts: tuple[str, ...] = ("contiguous",)  # "contiguous", "contiguous fp8", "pagedN"
    ragged: bool = False  # lengths uniform in [1, S] (else every sequence holds S)

    def name(self, layout: str) -> str:
        heads = f"Hq{self.Hq}" + (f" Hkv{self.Hkv}" if self.Hkv != 8 else "")
        seq = f"S<={self.S}" if self.ragged else f"S{self.S}"
        dim = f" D{self.D}" if self.D != 128 else ""
        return (f"B{self.B} {heads} {seq} s{self.s_active}{dim} {layout}"
                + (" ragged" if self.ragged else ""))


EVERY_LAYOUT = ("contiguous", "contiguous fp8", "paged16", "paged16 fp8", "paged64", "paged64 fp8")
FULL = [
    Shape("batch", B=64, Hq=32, S=4096, layouts=EVERY_LAYOUT),
    Shape("long", B=1, Hq=32, S=131072, layouts=EVERY_LAYOUT),
    Shape("long", B=1, Hq=64, S=131072, layouts=("paged16", "paged16 fp8")),
    Shape("multi", B=4, Hq=64, S=32768, s_active=4,
          layouts=("contiguous", "paged16", "paged16 fp8")),
    Shape("fp8", B=16, Hq=32, S=8192,
          layouts=("contiguous", "contiguous fp8", "paged16", "paged16 fp8")),
    Shape("many", B=256, Hq=32, S=1024, layouts=("paged16", "paged16 fp8")),
    Shape("gqa1", B=8, Hq=32, Hkv=32, S=8192),
    Shape("d_small", B=16, Hq=32, S=8192, D=64),
    Shape("d_large", B=16, Hq=32, S=8192, D=256),
    Shape("ragged", B=32, Hq=32, S=8192, layouts=("paged16",), ragged=True),
]
# The same roles at shapes the CPU (Triton's interpreter) runs in seconds; ``long`` still
# splits its keys (the interpreter counts 4 SMs).
QUICK = [
    Shape("batch", B=2, Hq=8, Hkv=2, S=128, D=32,
          layouts=("contiguous", "paged16", "paged16 fp8", "paged64")),
    Shape("long", B=1, Hq=8, Hkv=2, S=512, D=32, layouts=("contiguous", "paged16", "paged64")),
    Shape("multi", B=2, Hq=16, Hkv=2, S=128, s_active=4, D=32,
          layouts=("contiguous", "paged16")),
    Shape("fp8", B=2, Hq=8, Hkv=2, S=128, D=32, layouts=("contiguous", "contiguous fp8")),
    Shape("gqa1", B=1, Hq=4, Hkv=4, S=128, D=32),
    Shape("d_small", B=1, Hq=8, Hkv=2, S=128, D=16),
    Shape("d_large", B=1, Hq=8, Hkv=2, S=128, D=64),
    Shape("ragged", B=4, Hq=8, Hkv=2, S=128, layouts=("paged16",), ragged=True, D=32),
]


class CaseInfo(NamedTuple):
    """What the targets need to know about a case beyond its results."""

    role: str
    paged: bool
    fp8: bool
    tokens: int  # B * s_active: tokens generated per call
    check_ok: bool  # lmfuse's output matched SDPA's


def _block_len(layout: str) -> Optional[int]:
    base = layout.removesuffix(" fp8")
    return int(base.removeprefix("paged")) if base.startswith("paged") else None


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 2e-2


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
         mask: Optional[torch.Tensor]) -> torch.Tensor:
    """``q [B, s_active, Hq, D]``, ``k``/``v [B, Hkv, S, D]`` (any strides) -> ``[B, s_active,
    Hq, D]`` (a view of SDPA's ``[B, Hq, s_active, D]``)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask,
                                         enable_gqa=True)
    return out.transpose(1, 2)


def visibility_mask(lengths: list[int], s_active: int, S: int, device: torch.device
                    ) -> Optional[torch.Tensor]:
    """SDPA's boolean ``attn_mask`` (True: attend): token ``i`` of sequence ``b`` sees keys
    ``<= lengths[b] - s_active + i``. None when every token sees every key; ``[s_active, S]``
    when all sequences are full; else ``[B, 1, s_active, S]``."""
    pos = torch.arange(S, device=device)
    tokens = torch.arange(s_active, device=device)
    if all(L == S for L in lengths):
        return None if s_active == 1 else pos[None, :] <= (S - s_active + tokens)[:, None]
    last = torch.tensor(lengths, device=device)[:, None] - s_active + tokens[None, :]
    return (pos[None, None, :] <= last[:, :, None])[:, None]


def to_paged(k: torch.Tensor, v: torch.Tensor, lengths: list[int], block_len: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The blocks of ``k``/``v [B, S, Hkv, D]`` that hold each sequence's ``lengths[b]`` rows,
    in random order in a pool ``[num_blocks, block_len, Hkv, D]``, and ``block_table [B,
    S / block_len]`` int32 padded with -1."""
    B, S, Hkv, D = k.shape
    assert S % block_len == 0, (S, block_len)
    per_seq = S // block_len
    used = torch.tensor([cdiv(L, block_len) for L in lengths])
    held = torch.arange(per_seq)[None, :] < used[:, None]  # [B, per_seq]
    n = int(held.sum())
    perm = torch.randperm(n)
    table = torch.full((B, per_seq), -1, dtype=torch.int32)
    table[held] = perm.to(torch.int32)  # row-major, as ``ids`` below
    ids = held.flatten().nonzero().squeeze(1).to(k.device)
    perm = perm.to(k.device)
    pools = []
    for cache in (k, v):
        blocks = cache.view(B * per_seq, block_len, Hkv, D)
        pool = cache.new_empty((n, block_len, Hkv, D))
        pool[perm] = blocks if n == B * per_seq else blocks[ids]
        pools.append(pool)
    return pools[0], pools[1], table.to(k.device)


def to_fp8(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cache`` as float8_e4m3fn with a per-KV-head scale ``[Hkv]`` (its amax maps to 448)."""
    scale = cache.abs().amax(dim=(0, 1, 3)).float().clamp(min=1e-12) / 448.0
    return (cache.float() / scale[:, None]).to(torch.float8_e4m3fn), scale


def dequantised(cache8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (cache8.float() * scale[:, None]).to(dtype)


def max_rel_diff(got: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.float()
    return float((got.float() - expected).abs().max() / expected.abs().max().clamp(min=1e-30))


def checked(fn: Callable[[], torch.Tensor], expected: torch.Tensor, tol: float
            ) -> tuple[str, bool]:
    """Runs ``fn`` once: (a note with its max relative difference from ``expected``, whether
    within ``tol``). A failure here is noted; the timing then fails the same way."""
    try:
        rel = max_rel_diff(fn(), expected)
    except Exception as exc:
        return f"check failed: {type(exc).__name__}", False
    ok = math.isfinite(rel) and rel <= tol
    return f"max rel diff vs sdpa {rel:.1e}" + ("" if ok else f" > {tol:.0e}, CHECK"), ok


def _lmfuse_call(q, k_cache, v_cache, seqlens, expected: torch.Tensor, tol: float,
                 against: str = "", **kwargs) -> tuple[Callable[[], object], str, bool]:
    """The timed lmfuse call, its note (its path: the split count on the Triton path; then
    ``against``, and its check against ``expected``), and whether the check passed."""
    plan = lmfuse.explain(lmfuse.decode_attention, q, k_cache, v_cache, seqlens, **kwargs)
    how = (f"{plan.call.launch.splits} split(s)" if plan.impl == "triton" else "reference path")

    def call():
        return lmfuse.decode_attention(q, k_cache, v_cache, seqlens, **kwargs)

    note, ok = checked(call, expected, tol)
    return call, f"{how}; {against}{note}", ok


def build_shape(shape: Shape, layouts: list[str], dtype: torch.dtype, device: torch.device
                ) -> tuple[list[Case], dict[str, CaseInfo]]:
    """The cases of ``shape`` on ``layouts`` (one shared set of keys and values)."""
    B, Hq, Hkv, S, s, D = shape.B, shape.Hq, shape.Hkv, shape.S, shape.s_active, shape.D
    lengths = (torch.randint(1, S + 1, (B,)).tolist() if shape.ragged else [S] * B)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    q = torch.randn(B, s, Hq, D, dtype=dtype, device=device)
    k = torch.randn(B, S, Hkv, D, dtype=dtype, device=device)
    v = torch.randn(B, S, Hkv, D, dtype=dtype, device=device)
    mask = visibility_mask(lengths, s, S, device)
    expected = sdpa(q, k.transpose(1, 2), v.transpose(1, 2), mask)
    tol = _tolerance(dtype)
    qo_bytes = 2 * q.numel() * q.element_size()  # q read, the output written
    cases, info = [], {}
    for layout in layouts:
        name = shape.name(layout)
        block_len, fp8 = _block_len(layout), layout.endswith("fp8")
        impls: dict[str, Callable[[], object]] = {}
        notes: dict[str, str] = {}
        if fp8:
            k8, k_scale = to_fp8(k)
            v8, v_scale = to_fp8(v)
            want = sdpa(q, dequantised(k8, k_scale, dtype).transpose(1, 2),
                        dequantised(v8, v_scale, dtype).transpose(1, 2), mask)
            paging = {}
            if block_len is not None:  # the same blocks as the bf16 pool's layout, as bytes
                k8, v8, table = to_paged(k8.view(torch.uint8), v8.view(torch.uint8), lengths,
                                         block_len)
                k8, v8 = k8.view(torch.float8_e4m3fn), v8.view(torch.float8_e4m3fn)
                paging = {"block_table": table}
            impls["lmfuse"], notes["lmfuse"], ok = _lmfuse_call(
                q, k8, v8, seqlens, want, tol, "sdpa on the dequantised cache; ",
                k_scale=k_scale, v_scale=v_scale, **paging)
        elif block_len is None:
            impls["lmfuse"], notes["lmfuse"], ok = _lmfuse_call(q, k, v, seqlens, expected, tol)
            k_view, v_view = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, S, D] views
            impls["sdpa"] = partial(sdpa, q, k_view, v_view, mask)
            notes["sdpa"] = "k/v [B, Hkv, S, D] strided views" + (
                ", bool mask" if mask is not None else "")
            impls["sdpa (BHSD)"] = partial(sdpa, q, k_view.contiguous(), v_view.contiguous(),
                                           mask)
            note, _ = checked(impls["sdpa (BHSD)"], expected, tol)
            notes["sdpa (BHSD)"] = f"contiguous [B, Hkv, S, D] copies; {note}"
        else:
            k_pool, v_pool, table = to_paged(k, v, lengths, block_len)
            impls["lmfuse"], notes["lmfuse"], ok = _lmfuse_call(
                q, k_pool, v_pool, seqlens, expected, tol, block_table=table)

            def gather_sdpa(q=q, k_pool=k_pool, v_pool=v_pool, table=table):
                # -1 padding indexes the pool's last block: read, then masked out
                kg = k_pool[table].flatten(1, 2)  # [B, S, Hkv, D]
                vg = v_pool[table].flatten(1, 2)
                return sdpa(q, kg.transpose(1, 2), vg.transpose(1, 2), mask)

            impls["gather + sdpa"] = gather_sdpa
            note, _ = checked(gather_sdpa, expected, tol)
            notes["gather + sdpa"] = f"pool[block_table] -> [B, S, Hkv, D], then sdpa; {note}"
        kv_elt = 1 if fp8 else k.element_size()
        kv_bytes = sum(min(L, S) for L in lengths) * Hkv * D * 2 * kv_elt
        cases.append(Case(name, kv_bytes + qo_bytes, impls, notes))
        info[name] = CaseInfo(shape.role, block_len is not None, fp8, B * s, ok)
    return cases, info


def _wanted(name: str, filters: list[str]) -> bool:
    return not filters or any(f in name for f in filters)


def build_cases(device: torch.device, quick: bool, filters: list[str]
                ) -> tuple[list[Case], dict[str, CaseInfo]]:
    dtype = torch.float32 if quick else torch.bfloat16
    cases, info = [], {}
    for shape in QUICK if quick else FULL:
        layouts = [lay for lay in shape.layouts if _wanted(shape.name(lay), filters)]
        if layouts:
            c, i = build_shape(shape, layouts, dtype, device)
            cases += c
            info.update(i)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the build's temporaries (fp8 casts, references)
    add_copy_rows(cases, device)
    return cases, info


def check_targets(results: list[Result], info: dict[str, CaseInfo], copy_bw: float,
                  judge: bool) -> None:
    """Prints, per case, lmfuse's TB/s as a share of the copy's, the fastest peer's time as
    a multiple of lmfuse's and the tokens per second; the targets that apply to the case and,
    when ``judge`` (on a GPU), whether each is met, which is added to lmfuse's note (and so
    to the JSON). A case whose lmfuse output did not match SDPA's misses all its targets."""
    print(f"\n# lmfuse against its targets: paged >= {PAGED_SHARE_OF_COPY:.2f}x the copy's "
          f"TB/s at the {' and '.join(PAGED_COPY_ROLES)} shapes; >= {MULTI_TOKEN_TBPS} TB/s at "
          f"the s_active = 4 shape; no slower than sdpa (its faster row) on every contiguous "
          f"case; fp8 >= 1.7x-1.9x bf16 tokens/s (by shape)")
    print(f"{'case':<44} {'TB/s':>6} {'x copy':>6} {'fastest peer':<14} {'x lmfuse':>8} "
          f"{'ktok/s':>9}  targets")
    rows: dict[str, dict[str, Result]] = {}
    for r in results:
        rows.setdefault(r.case, {})[r.impl] = r
    tally = {"met": 0, "MISSED": 0}
    for name, by_impl in rows.items():
        ours, meta = by_impl.get("lmfuse"), info[name]
        if ours is None:
            continue
        ran = ours.ms is not None
        share = ours.tbps / copy_bw if (ran and copy_bw) else None
        tokens = meta.tokens / ours.ms * 1e3 if ran else None
        peers = [r for impl, r in by_impl.items() if impl not in ("lmfuse", "copy") and r.ratio]
        fastest = min(peers, key=lambda r: r.ratio, default=None)
        goals: list[tuple[str, Optional[bool]]] = []
        if meta.paged and meta.role in PAGED_COPY_ROLES:
            goals.append((f"paged >= {PAGED_SHARE_OF_COPY:.2f}x copy",
                          share is not None and share >= PAGED_SHARE_OF_COPY))
        if meta.role == "multi":
            goals.append((f">= {MULTI_TOKEN_TBPS} TB/s",
                          ran and ours.tbps >= MULTI_TOKEN_TBPS))
        if not meta.paged and not meta.fp8:
            sdpa_rows = [by_impl[p] for p in PEERS_SDPA if p in by_impl and by_impl[p].ratio]
            best = min((r.ratio for r in sdpa_rows), default=None)
            goals.append(("no slower than sdpa", best is not None and best >= 1.0))
        if meta.fp8:
            goal = (PAGED_FP8_SPEEDUP if meta.paged else FP8_SPEEDUP).get(meta.role, 1.8)
            twin = rows.get(name.replace(" fp8", ""), {}).get("lmfuse")
            if twin is not None and twin.ms and ran:
                speedup = twin.ms / ours.ms  # equal tokens per call: the time ratio
                goals.append((f"fp8 {speedup:.2f}x bf16 tokens/s >= {goal}x",
                              speedup >= goal))
            else:
                goals.append((f"fp8 >= {goal}x bf16 tokens/s (no bf16 time)", False))
        texts = []
        for text, ok in goals:
            if not judge:
                texts.append(f"{text}: not judged off the GPU")
                continue
            if not meta.check_ok:
                ok, text = False, f"{text} (output check failed)"
            verdict = "met" if ok else "MISSED"
            tally[verdict] += 1
            texts.append(f"{text}: {verdict}")
        if judge and texts:
            ours.note = f"{ours.note}; target " + "; ".join(texts)
        peer_s = (f"{fastest.impl:<14} {fastest.ratio:8.2f}" if fastest
                  else f"{'-':<14} {'-':>8}")
        print(f"{name:<44} {cell(ours.tbps if ran else None, '6.2f')} {cell(share, '6.2f')} "
              f"{peer_s} {cell(tokens and tokens / 1e3, '9.1f')}  " + "; ".join(texts))
    if judge:
        print(f"# targets: {tally['met']} met, {tally['MISSED']} missed")


def main(argv: list[str] | None = None) -> int:
    # --cases is this benchmark's own; the shared start parses the rest.
    pre = ArgumentParser(prog="lmfuse bench decode_attention", add_help=False)
    pre.add_argument("--cases", action="append", default=[])
    pre.add_argument("--graphs", action="store_true")
    pre.add_argument("--graph-calls", type=int_range(1, 1000), default=None)
    own, rest = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
    if own.graph_calls is not None and not own.graphs:
        pre.error("argument --graph-calls: needs --graphs (calls per CUDA graph)")
    own.graph_calls = own.graph_calls or 1
    filters = [f.strip() for text in own.cases for f in text.split(",") if f.strip()]
    args, device, quick, env = start("lmfuse bench decode_attention", __doc__, rest)
    if filters:
        env["cases"] = ",".join(filters)
    graphs = own.graphs and device.type == "cuda"
    calls = own.graph_calls if graphs else 1
    env["timing"] = ("eager calls (GPU time or host time, whichever is longer)" if not graphs
                     else "CUDA-graph replay of each call (GPU time, no host overhead)"
                     if calls == 1 else f"CUDA graphs of {calls} calls back to back, a "
                     "call's share (GPU time, no launch)")
    shapes = QUICK if quick else FULL
    names = [s.name(lay) for s in shapes for lay in s.layouts]
    if not any(_wanted(n, filters) for n in names):
        print(f"--cases {','.join(filters)} matches no case; the cases are:\n  "
              + "\n  ".join(names), file=sys.stderr)
        return 2
    # read and written: as many bytes as the B64 S4096 cache (K and V) holds
    first = shapes[0]
    elt = 4 if quick else 2
    copy = measure_copy(first.B * first.S * first.Hkv * first.D * 2 * elt // 2, device)
    print("# TB/s over minimal bytes (K and V rows up to each length, q, the output); x "
          "lmfuse = ms / lmfuse ms (> 1: lmfuse is faster); peak MiB: allocated beyond the "
          "inputs")
    with torch.no_grad():
        cases, info = build_cases(device, quick, filters)
        if graphs:
            print("# --graphs: every call timed as the replay of a CUDA graph holding it"
                  + (f" ({calls} back to back, a call's share)" if calls > 1 else ""))
            for case in cases:
                case.impls = {impl: as_graph(fn, calls) for impl, fn in case.impls.items()}
                case.calls = calls
        if device.type == "cuda":
            print(f"# inputs: {torch.cuda.memory_allocated(device) / 2**30:.1f} GiB on the GPU")
        results = run_cases(cases, device)
    check_targets(results, info, copy["tbps"], judge=device.type == "cuda")
    return finish(args, env, copy, results,
                  f"decode_attention on {env['device']} (copy: {copy['tbps']:.2f} TB/s)")


if __name__ == "__main__":
    raise SystemExit(main())
