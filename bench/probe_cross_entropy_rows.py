"""Launches of cross-entropy's fused pass (stats + gradient in one launch) across V, on one
GPU: ``python3 bench/probe_cross_entropy_rows.py [--vocab 32000,128256] [--dtype bfloat16]
[--kinds plain,softcap]`` (``$OUT`` or the current directory gets ``ce_rows.json``).

``[8192, V]`` logits (5% of targets ignored, ``reduction="mean"``), each candidate
``fused`` launch of ``lmfuse.cross_entropy.ops._launch_fwd`` timed by
``triton.testing.do_bench`` in one process, next to the device table's own choice
(``table``), the launch the tables made before the whole-row launches (``previous``) and a
copy of the logits. ``softcap`` is label smoothing 0.1 + z-loss 1e-4 + softcap 30.

Candidates: ``row32k`` / ``row16k``: one 32-warp program per SM streams a whole row in
32768 / 16384-column chunks with the barrier-free stats loop (``vec`` 16, prefetch), then
writes its gradient last chunk first (mostly L1 hits); ``two16``: two 16-warp programs per
SM; ``four``: four 8-warp programs per SM, 4096-column chunks. Chunk sizes are for 2-byte
logits (halved for float32, as the tables' entries are).
"""
import argparse
import json
import os

import torch
import triton

from lmfuse.cross_entropy import ops

CANDIDATES = {
    "row32k": dict(BLOCK_V=32768, num_warps=32, programs_per_sm=1, hints=1, vec=16, prefetch=1),
    "row16k": dict(BLOCK_V=16384, num_warps=32, programs_per_sm=1, hints=1, vec=16, prefetch=1),
    "two16": dict(BLOCK_V=16384, num_warps=16, programs_per_sm=2, hints=1, vec=16, prefetch=1),
    "four": dict(BLOCK_V=4096, num_warps=8, programs_per_sm=4, hints=1, vec=8, prefetch=1),
}
# The tables' launches before the whole-row ones (tuning/default.json; rows in 2-byte
# elements): streamed rows up to 65536 columns, 16384-column slices above.
PREVIOUS = [(65536, dict(BLOCK_V=8192, num_warps=16, programs_per_sm=8, hints=1)),
            (1 << 40, dict(BLOCK_V=4096, num_warps=8, programs_per_sm=8, slice=16384, lag=3,
                           hints=1))]
KINDS = {"plain": (0.0, 0.0, None), "softcap": (0.1, 1e-4, 30.0)}


def probe_vocab(V: int, n: int, dtype: torch.dtype, kinds: list[str]) -> list[dict]:
    dev = torch.device("cuda")
    x = torch.randn(n, V, device=dev, dtype=dtype)
    t = torch.randint(0, V, (n,), device=dev)
    t[::20] = -100
    g = torch.empty_like(x)
    count = (t != -100).sum().float()
    src, dst = torch.empty_like(x), torch.empty_like(x)
    copy = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=60)
    src = dst = None
    size = x.element_size()
    previous = next(f for limit, f in PREVIOUS if V * size // 2 <= limit)
    rows = []
    for kind in kinds:
        row = {"V": V, "dtype": str(dtype).replace("torch.", ""), "kind": kind,
               "copy_ms": copy, "table_launch": ops._config(
                   V, dev, kind == "softcap", size, ops._aligned(x))["fused"]}
        # ops._launch_fwd fits a vec candidate to the rows as it does a table's entry
        # (BLOCK_V halves for float32; unaligned rows get the plain stats loop).
        launches = [("table", None), ("previous", previous), *CANDIDATES.items()]
        for key, f in launches:
            row[key] = triton.testing.do_bench(
                lambda: ops._launch_fwd(x, t, count, g, 0, V, -100, *KINDS[kind], True,
                                        fused=f), warmup=10, rep=60)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                          for k, v in row.items()}), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", default="20000,32000,65536,128256,151936,200064,262144")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--kinds", default="plain,softcap")
    p.add_argument("--tokens", type=int, default=8192)
    args = p.parse_args()
    name = torch.cuda.get_device_name(torch.device("cuda"))
    print(name, flush=True)
    out = {"device": name, "torch": torch.__version__, "triton": triton.__version__,
           "command": "python3 bench/probe_cross_entropy_rows.py " + " ".join(
               f"--{k} {v}" for k, v in vars(args).items()), "rows": []}
    for V in (int(v) for v in args.vocab.split(",")):
        out["rows"] += probe_vocab(V, args.tokens, getattr(torch, args.dtype),
                                   args.kinds.split(","))
    path = os.path.join(os.environ.get("OUT", "."), "ce_rows.json")
    json.dump(out, open(path, "w"), indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
