"""Probe: where a fused decode step's time goes (CUDA GPU).

``python3 bench/probe_decode_profile.py [--batches 1,64] [--pdl 0,1]``: the model of
``lmfuse bench generate``; for each batch, the widest captured decode graph replayed under
``torch.profiler``: per kernel name the GPU microseconds per replay and the count, their sum
against the replay's wall time (the rest: gaps between kernels and launch latency).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from lmfuse.bench import generate as harness
from lmfuse.serving import Generator


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,64")
    p.add_argument("--pdl", default="0,1")
    a = p.parse_args()
    args, _ = harness.parse([])
    device = torch.device("cuda")
    model = harness.build_model(args, device)
    for b in [int(x) for x in a.batches.split(",")]:
        for pdl in [x == "1" for x in a.pdl.split(",")]:
            g = torch.Generator().manual_seed(b)
            prompts = torch.randint(1, args.vocab, (b, args.context), generator=g).tolist()
            gen = Generator(model, block_len=16, num_blocks=b * 40 + 8, max_batch=256)
            if gen.runner.fused is not None:
                gen.runner.fused.pdl = gen.runner.fused.pdl and pdl
            gen.generate(prompts, max_new_tokens=8, eos_token_id=[])
            graphs = [x for x in gen.runner._graphs.values() if x.batch >= b]
            gr = max(graphs, key=lambda x: (-x.batch, x.width)).graph
            for _ in range(5):
                gr.replay()
            torch.cuda.synchronize()
            walls = []
            for _ in range(20):
                t = time.perf_counter()
                gr.replay()
                torch.cuda.synchronize()
                walls.append((time.perf_counter() - t) * 1e3)
            reps = 10
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(reps):
                    gr.replay()
                torch.cuda.synchronize()
            per = collections.defaultdict(float)
            cnt = collections.Counter()
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    per[e.name] += e.device_time_total
                    cnt[e.name] += 1
            total = sum(per.values()) / reps
            print(f"== batch {b} pdl {pdl}: replay wall {statistics.median(walls)*1e3:.1f} us, "
                  f"kernels {total:.1f} us per replay")
            for name, us in sorted(per.items(), key=lambda kv: -kv[1]):
                print(f"  {us / reps:8.1f} us  x{cnt[name] // reps:3d}  {name[:110]}")
            del gen, gr, graphs
            harness.free(device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
