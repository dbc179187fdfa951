"""Sweep decode attention's launch configs on the GPU (feeds ``tuning/*.json``'s
``decode_attention`` section); prints ms per config and SDPA's time on the same shape.

    python bench/sweep_decode_attention.py [--json PATH]

Cases: bf16 shapes where lmfuse is closest to SDPA (B64 S4096, B1 S131072, B16 S8192 at
D = 64, 128 and 256), the fp8 cache at B16 S8192 and B64 S4096 (D 64 and 128, and paged),
and paged caches (block_len 16) of the first three (``--cases`` picks some by name). Each
candidate (key tile ``block_n``, ``num_warps``, ``num_stages``, ``programs_per_sm`` for
the split count, and for fp8 caches ``widen_v_first``) is laid over the table by
``lmfuse.tuning.overlay`` as a JSON file would, in every section the case's lookup applies,
and timed as the replay of a CUDA graph holding the call (GPU time, no launch overhead, as
``lmfuse bench decode_attention --graphs``). Every candidate's output must match the table
config's within 2e-2 (bf16).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from lmfuse.bench.decode_attention import as_graph, to_fp8, to_paged  # noqa: E402

import lmfuse  # noqa: E402
from lmfuse import tuning  # noqa: E402

# (name, B, Hq, Hkv, S, D, fp8, paged block_len or None)
CASES = [("B64 Hq32 S4096 D128", 64, 32, 8, 4096, 128, False, None),
         ("B1 Hq32 S131072 D128", 1, 32, 8, 131072, 128, False, None),
         ("B16 Hq32 S8192 D128", 16, 32, 8, 8192, 128, False, None),
         ("B16 Hq32 S8192 D64", 16, 32, 8, 8192, 64, False, None),
         ("B16 Hq64 S8192 D64", 16, 64, 8, 8192, 64, False, None),
         ("B16 Hq32 S8192 D128 fp8", 16, 32, 8, 8192, 128, True, None),
         ("B64 Hq32 S4096 D128 fp8", 64, 32, 8, 4096, 128, True, None),
         ("B1 Hq32 S131072 D128 fp8", 1, 32, 8, 131072, 128, True, None),
         ("B64 Hq32 S4096 D64 fp8", 64, 32, 8, 4096, 64, True, None),
         ("B64 Hq32 S4096 D128 fp8 paged16", 64, 32, 8, 4096, 128, True, 16),
         ("B256 Hq32 S1024 D128 fp8 paged16", 256, 32, 8, 1024, 128, True, 16),
         ("B256 Hq32 S1024 D128 paged16", 256, 32, 8, 1024, 128, False, 16),
         ("B64 Hq32 S4096 D64", 64, 32, 8, 4096, 64, False, None),
         ("B16 Hq32 S8192 D256", 16, 32, 8, 8192, 256, False, None),
         ("B64 Hq32 S4096 D256", 64, 32, 8, 4096, 256, False, None),
         ("B1 Hq32 S131072 D128 paged16", 1, 32, 8, 131072, 128, False, 16),
         ("B16 Hq32 S8192 D128 paged16", 16, 32, 8, 8192, 128, False, 16),
         ("B64 Hq32 S4096 D128 paged16", 64, 32, 8, 4096, 128, False, 16),
         # Short contexts: the Generator's decode (16/4 heads, prompts of 512) and Hkv 8.
         ("B64 Hq32 S576 D128 paged16", 64, 32, 8, 576, 128, False, 16),
         ("B64 Hq16 Hkv4 S576 D128 paged16", 64, 16, 4, 576, 128, False, 16),
         ("B16 Hq16 Hkv4 S576 D128 paged16", 16, 16, 4, 576, 128, False, 16),
         ("B1 Hq16 Hkv4 S576 D128 paged16", 1, 16, 4, 576, 128, False, 16),
         ("B128 Hq16 Hkv4 S576 D128 paged16", 128, 16, 4, 576, 128, False, 16),
         ("B32 Hq32 S<=8192 D128 paged16 ragged", 32, 32, 8, 8192, 128, False, 16),
         ("B8 Hq32 Hkv32 S8192 D128", 8, 32, 32, 8192, 128, False, None),
         ("B4 Hq64 S32768 D128 fp8 paged16 4 active", 4, 64, 8, 32768, 128, True, 16),
         ("B4 Hq64 S32768 D128 paged16 4 active", 4, 64, 8, 32768, 128, False, 16),
         ("B16 Hq32 S8192 D128 fp8 paged16", 16, 32, 8, 8192, 128, True, 16),
         ("B1 Hq64 S131072 D128 fp8 paged16", 1, 64, 8, 131072, 128, True, 16)]
# A case named "... N active" decodes N query tokens a sequence (speculative or chunked
# decoding: each sees the keys up to its own position).


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--cases", default="",
                        help="comma-separated substrings of case names ('=NAME': that case only)")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--block-n", default="32,64,128")
    parser.add_argument("--stages", default="2,3,4")
    parser.add_argument("--ppsm", default="1,2,4")
    parser.add_argument("--widen-v-first", default="1",
                        help="fp8 caches: widen V before staging it for the second dot (1), "
                             "or let Triton place the widening (0); e.g. 1,0 for both")
    args = parser.parse_args(argv)
    warps = [int(w) for w in args.warps.split(",")]
    block_ns = [int(n) for n in args.block_n.split(",")]
    stages = [int(n) for n in args.stages.split(",")]
    ppsms = [int(p) for p in args.ppsm.split(",")]
    if any(w not in ("0", "1") for w in args.widen_v_first.split(",")):
        parser.error(f"--widen-v-first takes 0, 1 or 0,1; got {args.widen_v_first!r}")
    widens = [w == "1" for w in args.widen_v_first.split(",")]
    wanted = [w for w in args.cases.split(",") if w]
    if not torch.cuda.is_available():
        print("sweep_decode_attention: needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    base = tuning.table("decode_attention", dev)
    out = {"device": torch.cuda.get_device_name(), "base": base, "cases": []}
    for name, B, Hq, Hkv, S, D, fp8, block_len in CASES:
        if wanted and not any(w[1:] == name if w.startswith("=") else w in name
                              for w in wanted):
            continue
        g = torch.Generator(device="cuda").manual_seed(0)
        words = name.split()
        s_act = int(words[-2]) if words[-1] == "active" else 1
        q = torch.randn(B, s_act, Hq, D, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(B, S, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(B, S, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
        # Ragged: lengths uniform in [1, S] (seeded), as the benchmark's ragged case.
        lengths = (torch.randint(1, S + 1, (B,), generator=torch.Generator().manual_seed(0))
                   .tolist() if "ragged" in name else [S] * B)
        lens = torch.tensor(lengths, dtype=torch.int32, device=dev)
        kw: dict = {}
        if fp8:
            k, ks = to_fp8(k)
            v, vs = to_fp8(v)
            kw = dict(k_scale=ks, v_scale=vs)
        nbytes = 2 * k.numel() * k.element_size()
        if block_len:
            sdpa_k, sdpa_v = k, v
            k, v, table = to_paged(k, v, lengths, block_len)
            kw["block_table"] = table
        want = lmfuse.decode_attention(q, k, v, lens, **kw)
        row = {"case": name, "bytes": nbytes, "configs": []}
        if not fp8 and s_act == 1:
            kt, vt = ((sdpa_k, sdpa_v) if block_len else (k, v))
            kt, vt = kt.transpose(1, 2), vt.transpose(1, 2)  # strided [B, Hkv, S, D]
            kc, vc = kt.contiguous(), vt.contiguous()
            sd = []
            for kk, vv in ((kt, vt), (kc, vc)):
                f = as_graph(lambda kk=kk, vv=vv: F.scaled_dot_product_attention(
                    q.transpose(1, 2), kk, vv, enable_gqa=True))
                sd.append(do_bench(f, warmup=25, rep=100, return_mode="median"))
            row["sdpa_ms"] = min(sd)
            del kc, vc
        table_ms = do_bench(as_graph(lambda: lmfuse.decode_attention(q, k, v, lens, **kw)),
                            warmup=25, rep=100, return_mode="median")
        row["table_ms"] = table_ms
        print(f"{name}: table {table_ms:.4f} ms ({nbytes / table_ms / 1e9:.2f} TB/s)"
              + (f", SDPA {row['sdpa_ms']:.4f} ms" if "sdpa_ms" in row else ""), flush=True)
        # The sections the case's lookup applies, each overridden below.
        sections = (["paged"] if block_len else []) + (["fp8"] if fp8 else []) + (
            ["fp8_paged"] if fp8 and block_len else [])
        for bn, w, st, pp, wv in itertools.product(block_ns, warps, stages, ppsms,
                                                   widens if fp8 else [True]):
            # Every section that could apply to this case is overridden, so that the
            # candidate's values are the ones that run, whichever program regime it is in.
            cand = dict(block_n_by_head_dim=[[1048576, bn]], num_warps=w, num_stages=st,
                        programs_per_sm=pp, few_programs={}, many_programs=None,
                        short_context=None, widen_v_first=wv)
            values = dict(cand)
            for section in sections:
                values[section] = dict(base.get(section, {}), **cand)
            try:
                with tuning.overlay("decode_attention", values):
                    got = lmfuse.decode_attention(q, k, v, lens, **kw)
                    err = float((got.float() - want.float()).abs().max()
                                / want.float().abs().max())
                    ms = do_bench(as_graph(lambda: lmfuse.decode_attention(q, k, v, lens,
                                                                           **kw)),
                                  warmup=25, rep=100, return_mode="median")
                note = "" if err < 2e-2 else f"MISMATCH {err:.2e}"
            except Exception as exc:  # a config that cannot launch is a row, not a crash
                ms, err, note = None, None, f"failed: {type(exc).__name__}: {exc}"[:120]
            row["configs"].append(dict(block_n=bn, warps=w, stages=st, ppsm=pp,
                                       widen_v_first=wv, ms=ms, err=err, note=note))
        done = [c for c in row["configs"] if c["ms"] and not c["note"]]
        done.sort(key=lambda c: c["ms"])
        for c in done[:8]:
            print(f"   block_n {c['block_n']:>3} warps {c['warps']} stages {c['stages']} "
                  f"ppsm {c['ppsm']} widen_v_first {int(c['widen_v_first'])}: "
                  f"{c['ms']:.4f} ms ({nbytes / c['ms'] / 1e9:.2f} TB/s)")
        for c in row["configs"]:
            if c["note"]:
                print(f"   {c}")
        out["cases"].append(row)
        q = k = v = None  # free the case's tensors before the next one's
        kw.clear()
        sdpa_k = sdpa_v = None
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
