"""What the split-KV merge costs fp8 decode, and so what folding it away could give at best:
``python3 bench/probe_decode_fp8_merge.py`` (``$OUT`` or the current directory gets
``fp8_parts.json``).

Hq 32, Hkv 8, D 128, one active token, contiguous caches at B16 S8192, B1 S131072 and B64
S4096; each timed as a CUDA-graph replay (median of ``triton.testing.do_bench``): the whole
``decode_attention`` on the bf16 cache and on the fp8 cache (per-head scales), and the fp8
call with the merge launch skipped (its output is then wrong: timing only), i.e. a merge
that costs nothing.
"""
import json
import os
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_attention import as_graph  # noqa: E402

import lmfuse  # noqa: E402
from lmfuse.attention import ops  # noqa: E402

REAL = ops._kernels


class _NoMerge:
    """``ops._kernels()`` with ``merge_kernel`` launches that do nothing."""

    def __init__(self, kernels):
        self.kernels = kernels

    def __getattr__(self, name):
        if name != "merge_kernel":
            return getattr(self.kernels, name)

        class Grid:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: None

        return Grid()


def graph_ms(fn) -> float:
    return do_bench(as_graph(fn), warmup=50, rep=300, return_mode="median")


def probe(B: int, S: int, Hq: int = 32, Hkv: int = 8, D: int = 128) -> dict:
    dev = torch.device("cuda")
    q = torch.randn(B, 1, Hq, D, device=dev, dtype=torch.bfloat16)
    kf = torch.randn(B, S, Hkv, D, device=dev).to(torch.float8_e4m3fn)
    vf = torch.randn(B, S, Hkv, D, device=dev).to(torch.float8_e4m3fn)
    kb, vb = kf.to(torch.bfloat16), vf.to(torch.bfloat16)
    scales = torch.ones(Hkv, device=dev)
    lens = torch.full((B,), S, device=dev, dtype=torch.int32)

    def fp8():
        lmfuse.decode_attention(q, kf, vf, lens, k_scale=scales, v_scale=scales)

    row = {"B": B, "S": S, "bf16_ms": graph_ms(lambda: lmfuse.decode_attention(q, kb, vb, lens)),
           "fp8_ms": graph_ms(fp8)}
    ops._kernels = lambda: _NoMerge(REAL())
    try:
        row["fp8_without_merge_ms"] = graph_ms(fp8)
    finally:
        ops._kernels = REAL
    row["fp8_x_bf16_tokens_per_s"] = row["bf16_ms"] / row["fp8_ms"]
    row["without_merge_x_bf16"] = row["bf16_ms"] / row["fp8_without_merge_ms"]
    return row


def main() -> None:
    name = torch.cuda.get_device_name(torch.device("cuda"))
    out = {"device": name, "torch": torch.__version__, "command":
           "python3 bench/probe_decode_fp8_merge.py", "rows": []}
    for B, S in ((16, 8192), (1, 131072), (64, 4096)):
        out["rows"].append(probe(B, S))
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                          for k, v in out["rows"][-1].items()}), flush=True)
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "fp8_parts.json"), "w"),
              indent=1)


if __name__ == "__main__":
    main()
