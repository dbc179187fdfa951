"""Probe: programmatic dependent launch (PDL) in the Generator's fused decode step.

``python3 bench/probe_pdl.py [--json F] [--batches 1,16,64] [--variants off,pdl1,pdl2]``,
on a CUDA GPU. The model of ``lmfuse bench generate`` (Llama-like, hidden 2048, 8 layers,
FFN 8192, vocabulary 128256, bf16, prompts of 512, 64 new tokens); for each variant, the
timed decode phase (whole ``step()`` calls, one synchronisation at the end) and a graph
replay alone, per batch, and whether the greedy tokens equal the first ``off`` run's (PDL
changes when kernels start, never what they compute). Variants (``lmfuse._pdl.mode``):
``off``, ``pdl1`` (a kernel lets the next launch once it has waited), ``pdl2`` (when its
programs exit), ``pdl1t2``/``pdl1t0``: pdl1 but the kernels before a cuBLAS launch in mode
2 / without PDL. A variant may repeat (run-to-run spread).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from lmfuse.bench import generate as harness
from lmfuse.serving import fused


def variant(name: str) -> tuple[int, int]:
    """(mode, mode of the kernels before a cuBLAS launch)."""
    modes = {"off": (0, 0), "pdl1": (1, 1), "pdl2": (2, 2), "pdl1t2": (1, 2),
             "pdl1t0": (1, 0)}
    if name not in modes:
        raise SystemExit(f"unknown variant {name!r}: choose from {', '.join(modes)}")
    return modes[name]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--variants", default="off,pdl1,pdl2,off")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("probe_pdl: needs a CUDA GPU", file=sys.stderr)
        return 2
    args, _ = harness.parse([])
    device = torch.device("cuda")
    model = harness.build_model(args, device)
    names = a.variants.split(",")
    settings: dict = {}
    init = fused.FusedDecoder.__init__

    def patched(self, *x, **k):
        init(self, *x, **k)
        if self.pdl:
            self.pdl, self.pdl_tail = settings["pdl"]

    fused.FusedDecoder.__init__ = patched
    rows = []
    for b in [int(x) for x in a.batches.split(",")]:
        g = torch.Generator().manual_seed(b)
        prompts = torch.randint(1, args.vocab, (b, args.context), generator=g).tolist()
        want = None
        for name in names:
            settings["pdl"] = variant(name)
            r = harness.lmfuse_decode(model, prompts, a.new, args, device, None, True)
            same = want is None or r["tokens"] == want
            if want is None and name == "off":
                want = r["tokens"]
            match = sum(x == y for s, t in zip(r["tokens"], want or r["tokens"])
                        for x, y in zip(s, t))
            row = dict(batch=b, variant=name, step_ms=round(r["step_ms"], 4),
                       e2e_ms=round(r["e2e_ms"], 2), note=r["note"], same_tokens=same,
                       matching=match, tokens=b * a.new)
            rows.append(row)
            print(json.dumps(row), flush=True)
            harness.free(device)
    if a.json:
        env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=__import__("triton").__version__)
        with open(a.json, "w") as f:
            json.dump(dict(env=env, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
