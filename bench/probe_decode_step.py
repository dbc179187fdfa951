"""Where a Generator decode step's time goes: the ``lmfuse bench generate`` model (Llama-shaped,
hidden 2048, 8 layers, FFN 8192, 16/4 heads, vocabulary 128256, bf16, random weights),
prompts of 512 tokens, whole ``step()`` calls and graph replays timed, then one profiled
stretch of steps: the GPU kernels per step (name, count, microseconds) and the host time.

    python bench/probe_decode_step.py [--batches 1,64] [--decode-path model,fused] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from lmfuse.bench.generate import build_model, parse
from lmfuse.serving import Generator


def step_ms(gen: Generator, prompts: list[list[int]], steps: int) -> tuple[list[float], list]:
    rids = {gen.add_request(p, max_new_tokens=steps + 4, eos_token_id=[]) for p in prompts}
    started: set[int] = set()
    while started != rids:
        started.update(r for r, _, _ in gen.step())
    torch.cuda.synchronize()  # the decode phase timed whole: steps may run one ahead
    t0 = time.perf_counter()
    for _ in range(steps):
        gen.step()
    torch.cuda.synchronize()
    return [(time.perf_counter() - t0) * 1e3 / steps], sorted(rids)


def host_split(gen: Generator, prompts: list[list[int]], steps: int) -> dict[str, float]:
    """Median host microseconds per decode step in: the scheduler, the runner's decode call
    (input copies and the replay's launch; not called by steps that run ahead), and the
    whole step."""
    spent: dict[str, list[float]] = {"schedule": [], "decode_call": [], "step": []}

    def timed(name, fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            spent[name].append((time.perf_counter() - t0) * 1e6)
            return out
        return run

    sched, dec = gen.scheduler.schedule, gen.runner.decode
    gen.scheduler.schedule = timed("schedule", sched)
    gen.runner.decode = timed("decode_call", dec)
    rids = {gen.add_request(p, max_new_tokens=steps + 2, eos_token_id=[]) for p in prompts}
    started: set[int] = set()
    while started != rids:
        started.update(r for r, _, _ in gen.step())
    for v in spent.values():
        v.clear()
    spent["step"] = []
    step = timed("step", gen.step)
    for _ in range(steps):
        step()
    while gen.has_unfinished():
        gen.step()
    gen.scheduler.schedule, gen.runner.decode = sched, dec
    return {f"host_{k}_us": statistics.median(v) for k, v in spent.items() if v}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--decode-path", default="model,fused")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    args, _ = parse([])
    dev = torch.device("cuda")
    model = build_model(args, dev)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for path in a.decode_path.split(","):
        for B in (int(b) for b in a.batches.split(",")):
            g = torch.Generator().manual_seed(B)
            prompts = torch.randint(0, args.vocab, (B, args.context), generator=g).tolist()
            kw = {"decode_path": path}
            gen = Generator(model, num_blocks=B * 48 + 64, max_batch=256, **kw)
            gen.generate(prompts, max_new_tokens=8, eos_token_id=[])  # captures
            times, _ = step_ms(gen, prompts, a.steps)
            while gen.has_unfinished():
                gen.step()
            host = host_split(gen, prompts, a.steps)
            graphs = [gg for gg in gen.runner._graphs.values() if gg.batch >= B]
            replay = []
            if graphs:
                gr = graphs[0].graph
                for _ in range(20):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    gr.replay()
                    torch.cuda.synchronize()
                    replay.append((time.perf_counter() - t0) * 1e3)
            # profile 10 steps
            rids = {gen.add_request(p, max_new_tokens=16, eos_token_id=[]) for p in prompts}
            started: set[int] = set()
            while started != rids:
                started.update(r for r, _, _ in gen.step())
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            n = 10
            with torch.profiler.profile(activities=acts) as prof:
                for _ in range(n):
                    gen.step()
                torch.cuda.synchronize()
            while gen.has_unfinished():
                gen.step()
            cpu = sorted(((e.key, e.count / n, e.self_cpu_time_total / n)
                          for e in prof.key_averages()), key=lambda r: -r[2])
            print(f"-- host (CPU self time per step, us) {path} B{B}:")
            for k, c, u in cpu[:25]:
                print(f"  {u:8.1f} us  x{c:5.1f}  {k[:90]}")
            kernels: dict[str, list[float]] = {}
            for ev in prof.events():
                if ev.device_type == torch.autograd.DeviceType.CUDA:
                    kernels.setdefault(ev.name, []).append(ev.device_time)
            table = sorted(((k, len(v) / n, sum(v) / n) for k, v in kernels.items()),
                           key=lambda r: -r[2])
            total = sum(r[2] for r in table)
            row = {"path": path, "batch": B, "step_ms": statistics.median(times), **host,
                   "replay_ms": statistics.median(replay) if replay else None,
                   "kernels_per_step": sum(r[1] for r in table),
                   "kernel_us_per_step": total,
                   "kernels": [{"name": k[:90], "per_step": c, "us": u} for k, c, u in table]}
            report["rows"].append(row)
            print(f"\n== {path} B{B}: step {row['step_ms']:.3f} ms, replay "
                  f"{row['replay_ms']} ms, {row['kernels_per_step']:.0f} kernels/step, "
                  f"kernel time {total:.1f} us/step; host us: " + ", ".join(
                      f"{k} {v:.0f}" for k, v in host.items()))
            for k, c, u in table[:30]:
                print(f"  {u:8.1f} us  x{c:5.1f}  {k[:100]}")
            del gen
            torch.cuda.empty_cache()
    with open(os.path.join(a.out, "probe_decode_step.json"), "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
