"""Sweep cross_entropy launch configs on the GPU; prints ms per config (feeds tuning/*.json).

    python bench/sweep_cross_entropy.py [--json PATH] [--quick] [--vocab 32000,128256]

For bf16 logits ``[8192, V]`` (V = 32000, 128256, 262144; targets ~5% ignored) it times
``lmfuse.cross_entropy`` forward+backward (``autograd.grad(loss, logits)``: the fused
pass) and forward only (the stats pass), each under values of the ``cross_entropy``
tuning table laid over the device's (``lmfuse.tuning.overlay``, so ``_config``
derives the launch exactly as it would from a JSON file):

* single block, the row held in registers (where ``next_pow2(V) <= 65536``):
  ``max_single_block`` = that width, ``warps_by_block`` warps in (8, 16, 32);
* streamed (``max_single_block`` below the width), every combination of:
  fwd+bwd: the ``fused`` bucket dict of the bucket V falls in, replaced by
  stream (``ce_stream_kernel``, one row per program): (``BLOCK_V``, ``num_warps``) in
  (2048, 4), (4096, 8), (8192, 16), (16384, 32) x ``programs_per_sm`` in (2, 4, 8);
  slices (``ce_slices_kernel``, rows cut in slices): the same pairs but 16384 x
  ``slice`` in (16384, 32768) x ``lag`` in (1, 2) x ``programs_per_sm`` in (2, 4);
  fwd: (``chunk_block``, ``chunk_warps``) over the same pairs x ``programs_per_sm`` in
  (4, 8, 16).

At N = 8192 that is 36 fused + 12 stats streamed configs per V, plus the single-block ones
and the table itself: about 160 timings for the three V, 1-2 minutes on an H100 with the
compiles. The table as it is is timed first and is the reference: every other config's
loss and a sample of its gradient rows must match it (else WRONG). A config that resolves
to a launch already timed is not timed again. A config that fails to compile or launch
(registers, shared memory) is recorded with its error and the sweep goes on. Prints the
best config per case, single block against streamed, the streamed values best over all V,
and per V the best ``fused`` bucket dict and stats values as JSON to paste into
``tuning/<device>.json``; the JSON, rewritten after every case so a cut-short run keeps
what it measured, holds every measurement with the launch config it resolved to. Without
CUDA it runs tiny shapes and few configs in Triton's interpreter (``--quick``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before lmfuse defines its kernels

from lmfuse.bench.common import bench_ms, environment  # noqa: E402

import lmfuse  # noqa: E402
from lmfuse import tuning  # noqa: E402
from lmfuse.cross_entropy import ops  # noqa: E402

IGNORE = -100
FAMILY = "cross_entropy"
BUCKET_KEYS = ("BLOCK_V", "num_warps", "programs_per_sm", "slice", "lag")  # print order
STATS_KEYS = ("chunk_block", "chunk_warps", "programs_per_sm")


class Grid:
    """The values swept (``quick``: a few the interpreter gets through)."""

    def __init__(self, quick: bool):
        self.single_warps = (4,) if quick else (8, 16, 32)
        pairs = ((256, 4), (1024, 4)) if quick else ((2048, 4), (4096, 8), (8192, 16),
                                                     (16384, 32))
        # fwd+bwd: the fused bucket dict for V. Stream variant (no slice/lag keys:
        # ce_stream_kernel, one row per program), then slices variant (ce_slices_kernel).
        self.fused = [dict(BLOCK_V=b, num_warps=w, programs_per_sm=p)
                      for (b, w), p in itertools.product(pairs, (1, 2) if quick else (2, 4, 8))]
        self.fused += [dict(BLOCK_V=b, num_warps=w, programs_per_sm=p, slice=sl, lag=lag)
                       for (b, w), sl, lag, p in itertools.product(
                           pairs[:1] if quick else pairs[:-1],
                           (512,) if quick else (16384, 32768), (1, 2),
                           (2,) if quick else (2, 4))]
        # fwd (stats only): the table's chunk_block / chunk_warps / programs_per_sm.
        self.stats = [dict(chunk_block=b, chunk_warps=w, programs_per_sm=p)
                      for (b, w), p in itertools.product(pairs, (1, 2) if quick else (4, 8, 16))]


def _width(V: int) -> int:
    return max(16, 1 << (V - 1).bit_length())


def single_points(V: int, grid: Grid) -> list[dict]:
    width = _width(V)
    if width > 65536:
        return []
    return [{"max_single_block": width, "warps_by_block": [[width, w]]}
            for w in grid.single_warps]


def with_bucket(fused: list, V: int, bucket: dict) -> list:
    """The table's ``fused`` list with the dict of the bucket ``V`` falls in replaced."""
    out = [[limit, dict(f)] for limit, f in fused]
    i = next((i for i, (limit, _) in enumerate(out) if V <= limit), None)
    if i is None:
        out.append([V, dict(bucket)])
    else:
        out[i][1] = dict(bucket)
    return out


def streamed_points(V: int, backward: bool, grid: Grid, table: dict) -> list[dict]:
    """Table overrides for the streamed configs of one case."""
    streamed = {"max_single_block": min(table["max_single_block"], _width(V) // 2)}
    if backward:
        return [{**streamed, "fused": with_bucket(table["fused"], V, b)} for b in grid.fused]
    return [{**streamed, **p} for p in grid.stats]


def launch_record(cfg: ops.CEConfig) -> dict:
    """What the op launches (``ops._config``'s answer) as this sweep's JSON records it."""
    t = cfg.tiles
    rec = dict(BLOCK_M=t.block_m, BLOCK_V=t.block_n, SINGLE_BLOCK=t.single,
               num_warps=t.num_warps)
    if not t.single:
        rec.update(programs_per_sm=cfg.programs_per_sm, fused=cfg.fused.entry())
    return rec


def effective(launch: dict, backward: bool):
    """What the launch of one case depends on (two configs equal here time the same)."""
    if launch["SINGLE_BLOCK"]:
        return ("single", launch["BLOCK_M"], launch["BLOCK_V"], launch["num_warps"])
    if backward:
        return ("fused", json.dumps(launch["fused"], sort_keys=True))
    return ("stats", launch["BLOCK_V"], launch["num_warps"], launch["programs_per_sm"])


class Sweep:
    """Times one (V, mode) under table overrides; the unmodified table is the reference."""

    def __init__(self, n: int, V: int, dtype: torch.dtype, backward: bool,
                 device: torch.device):
        self.V, self.backward, self.device = V, backward, device
        self.mode = "fwd+bwd" if backward else "fwd"
        self.x = torch.randn(n, V, dtype=dtype, device=device).requires_grad_(backward)
        self.target = torch.randint(0, V, (n,), device=device)
        self.target[torch.rand(n, device=device) < 0.05] = IGNORE
        self.sample = slice(None, None, max(1, n // 64))  # gradient rows compared
        self.nbytes = n * V * self.x.element_size() * (2 if backward else 1)
        self.records: list[dict] = []
        self.base = tuning.table(FAMILY, device)
        loss, grad = self.call()
        self.ref_loss = float(loss.detach())
        self.ref_rows = grad[self.sample].float() if backward else None

    def call(self):
        if self.backward:
            loss = lmfuse.cross_entropy(self.x, self.target)
            return loss, torch.autograd.grad(loss, self.x)[0]
        with torch.no_grad():
            return lmfuse.cross_entropy(self.x, self.target), None

    def measure(self, overrides: dict, reference: bool = False) -> dict:
        table = {**self.base, **overrides}
        rec: dict = {"table": overrides, "values": table, "reference": reference}
        try:
            with tuning.overlay(FAMILY, overrides):
                try:
                    rec["launch"] = launch_record(ops._config(self.V, self.device))
                except Exception as exc:  # a table _config cannot read
                    rec.update(ms=None, tbps=None, ok=False,
                               error=f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300])
                else:
                    key = effective(rec["launch"], self.backward)
                    seen = next((r for r in self.records if r.get("launch") and
                                 effective(r["launch"], self.backward) == key), None)
                    if seen is not None:  # resolves to a launch already timed
                        return seen
                    self._time(rec)
        finally:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        rec["desc"] = describe(rec.get("launch"), self.backward, reference)
        self.records.append(rec)
        result = (f"{rec['ms']:9.4f} ms {rec['tbps']:5.2f} TB/s" + ("" if rec["ok"] else
                  "  WRONG") if rec["ms"] is not None else f"failed: {rec['error'][:90]}")
        print(f"V={self.V:<7} {self.mode:<7} {rec['desc']:<46} {result}", flush=True)
        return rec

    def _time(self, rec: dict) -> None:
        try:
            loss, grad = self.call()  # compiles here: an infeasible config raises
            rel = abs(float(loss.detach()) - self.ref_loss) / max(abs(self.ref_loss), 1e-30)
            ok = rel <= 1e-4
            if self.backward:
                diff = (grad[self.sample].float() - self.ref_rows).abs().max().item()
                ok = ok and diff <= 1e-2 * self.ref_rows.abs().max().item() + 1e-6
            del loss, grad
            ms = bench_ms(self.call, self.device, warmup=25, rep=100)
            rec.update(ms=ms, tbps=self.nbytes / ms / 1e9, ok=ok, loss_rel_diff=rel)
        except Exception as exc:  # an infeasible config (registers, shared memory)
            rec.update(ms=None, tbps=None, ok=False,
                       error=f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300])


def describe(launch: dict | None, backward: bool, reference: bool) -> str:
    tag = " (table)" if reference else ""
    if launch is None:
        return "?" + tag
    if launch.get("SINGLE_BLOCK"):
        return f"single {launch['BLOCK_M']}x{launch['BLOCK_V']} w{launch['num_warps']}{tag}"
    if backward:
        f = launch["fused"]
        per_sm = f.get("programs_per_sm", launch["programs_per_sm"])
        if f.get("slice"):
            return (f"slices b{f['BLOCK_V']} w{f['num_warps']} slice{f['slice']} "
                    f"lag{f['lag']} {per_sm}/SM{tag}")
        return f"stream b{f['BLOCK_V']} w{f['num_warps']} {per_sm}/SM{tag}"
    return (f"stats b{launch['BLOCK_V']} w{launch['num_warps']} "
            f"{launch['programs_per_sm']}/SM{tag}")


def _good(recs: list[dict]) -> list[dict]:
    return [r for r in recs if r["ms"] is not None and r["ok"]]


def _streamed(recs: list[dict]) -> list[dict]:
    return [r for r in recs if r.get("launch") and not r["launch"]["SINGLE_BLOCK"]]


def run_case(s: Sweep, grid: Grid) -> list[dict]:
    s.measure({}, reference=True)
    for point in single_points(s.V, grid):
        s.measure(point)
    for point in streamed_points(s.V, s.backward, grid, s.base):
        s.measure(point)
    return s.records


def bucket(launch: dict) -> dict:
    """The fused bucket dict of a streamed fwd+bwd launch, keys in table order."""
    f = launch["fused"]
    f = {**f, "programs_per_sm": f.get("programs_per_sm", launch["programs_per_sm"])}
    return {k: f[k] for k in BUCKET_KEYS if k in f} | {k: v for k, v in f.items()
                                                        if k not in BUCKET_KEYS}


def stats_values(launch: dict) -> dict:
    return dict(chunk_block=launch["BLOCK_V"], chunk_warps=launch["num_warps"],
                programs_per_sm=launch["programs_per_sm"])


def _values(r: dict, backward: bool) -> dict:
    return bucket(r["launch"]) if backward else stats_values(r["launch"])


def _rank(results: dict[str, list[dict]], backward: bool) -> list[dict]:
    """Streamed configs by the geometric mean of ms / each case's best streamed ms, over
    the cases each was measured in; a config that failed or was wrong anywhere is out."""
    scores: dict[str, list[float]] = {}
    out: set[str] = set()
    for key, recs in results.items():
        if key.endswith("fwd+bwd") != backward:
            continue
        streamed = _streamed(recs)
        good = _good(streamed)
        values = {id(r): json.dumps(_values(r, backward)) for r in streamed}
        out.update(values[id(r)] for r in streamed if r not in good)
        if good:
            best = min(r["ms"] for r in good)
            for r in good:
                scores.setdefault(values[id(r)], []).append(r["ms"] / best)
    ranking = sorted((-len(v), math.exp(sum(map(math.log, v)) / len(v)), k)
                     for k, v in scores.items() if k not in out)
    return [dict(values=json.loads(k), score=s, cases=-c) for c, s, k in ranking]


def _paste(values: dict) -> str:
    return json.dumps(values, separators=(", ", ": "))


def paste_report(results: dict[str, list[dict]], vocabs: list[int], table: dict) -> dict:
    """Per V: the best fused bucket dict and stats values, as JSON for tuning/*.json."""
    out: dict = {"per_vocab": {}}
    print("\nbest streamed values per V (JSON, for the cross_entropy section):")
    buckets = []
    for V in vocabs:
        entry: dict = {}
        for backward in (True, False):
            recs = results.get(f"V={V} {'fwd+bwd' if backward else 'fwd'}", [])
            good = _good(_streamed(recs))
            ref = next((r for r in recs if r["reference"] and r["ms"] is not None), None)
            if not good:
                print(f"  V={V:<7} {'fused' if backward else 'stats'}: no streamed config ran")
                continue
            best = min(good, key=lambda r: r["ms"])
            vs = f" ({ref['ms'] / best['ms']:.2f}x the table)" if ref else ""
            if backward:
                entry["fused"] = bucket(best["launch"])
                print(f"  V={V:<7} fused bucket: {_paste(entry['fused'])}  "
                      f"{best['ms']:.4f} ms{vs}")
                for name, slices in (("stream", False), ("slices", True)):
                    kind = [r for r in good if bool(r["launch"]["fused"].get("slice")) == slices]
                    if kind:
                        b = min(kind, key=lambda r: r["ms"])
                        print(f"      best {name:<6} {_paste(bucket(b['launch']))}  "
                              f"{b['ms']:.4f} ms")
                buckets.append([V, entry["fused"]])
            else:
                entry["stats"] = stats_values(best["launch"])
                print(f"  V={V:<7} stats: {_paste(entry['stats'])[1:-1]}  "
                      f"{best['ms']:.4f} ms{vs}")
        out["per_vocab"][V] = entry
    if buckets:
        # One bucket per swept V, up to that V; the last keeps the table's top limit.
        top = max([limit for limit, _ in table.get("fused", [])] + [buckets[-1][0]])
        buckets[-1][0] = top
        merged: list = []
        for limit, b in buckets:
            if merged and merged[-1][1] == b:
                merged[-1][0] = limit
            else:
                merged.append([limit, b])
        out["fused"] = merged
        print('  suggested (limits = the swept V; a V between two goes to the upper one):\n'
              '  "fused": [' + ",\n            ".join(f"[{limit}, {_paste(b)}]"
                                                     for limit, b in merged) + "]")
    return out


def summarize(results: dict[str, list[dict]], vocabs: list[int], table: dict) -> dict:
    summary: dict = {"best": {}, "single_vs_streamed": {}}
    print(f"\n{'case':<20} {'best config':<46} {'ms':>9} {'TB/s':>5} {'table ms':>9} "
          f"{'x':>5}")
    for key, recs in results.items():
        good = _good(recs)
        if not good:
            print(f"{key:<20} no config ran")
            continue
        best = min(good, key=lambda r: r["ms"])
        ref = next((r for r in recs if r["reference"]), None)
        t_ms = ref["ms"] if ref else None
        gain = f"{t_ms / best['ms']:5.2f}" if t_ms else f"{'-':>5}"
        t_s = f"{t_ms:9.4f}" if t_ms else f"{'-':>9}"
        print(f"{key:<20} {best['desc']:<46} {best['ms']:9.4f} {best['tbps']:5.2f} {t_s} "
              f"{gain}")
        summary["best"][key] = best
        single = [r for r in good if r["launch"]["SINGLE_BLOCK"]]
        streamed = [r for r in good if not r["launch"]["SINGLE_BLOCK"]]
        if single and streamed:
            a, b = min(single, key=lambda r: r["ms"]), min(streamed, key=lambda r: r["ms"])
            width = a["launch"]["BLOCK_V"]
            verdict = (f"single block wins: max_single_block >= {width}" if a["ms"] <= b["ms"]
                       else f"streaming wins: max_single_block < {width}")
            print(f"  {a['desc']} {a['ms']:.4f} ms vs {b['desc']} {b['ms']:.4f} ms: {verdict}")
            summary["single_vs_streamed"][key] = {"single": a, "streamed": b,
                                                  "verdict": verdict}
    for backward in (True, False):
        ranking = _rank(results, backward)
        summary["fused_ranking" if backward else "stats_ranking"] = ranking
        if ranking:
            print(f"\nstreamed {'fwd+bwd (fused bucket)' if backward else 'fwd (stats)'} "
                  "values, geometric mean of ms / each case's best streamed ms:")
            for r in ranking[:5]:
                print(f"  {_paste(r['values'])}  {r['score']:.3f} over "
                      f"{r['cases']}/{len(vocabs)} V")
    summary["paste"] = paste_report(results, vocabs, table)
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write every measurement here (after each case)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, few configs (on CPU)")
    p.add_argument("--vocab", help="comma-separated vocabulary sizes to sweep")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quick = args.quick or device.type != "cuda"
    n, dtype = (16, torch.float32) if quick else (8192, torch.bfloat16)
    vocabs = ([int(v) for v in args.vocab.split(",")] if args.vocab else
              [300, 3000] if quick else [32000, 128256, 262144])
    grid = Grid(quick)
    torch.manual_seed(0)
    env = environment(device)
    env["table"] = tuning.table(FAMILY, device)
    print(f"# {env['device']} | torch {env['torch']} | triton {env['triton']} | {env['date']}"
          f" | logits [{n}, V] {str(dtype).replace('torch.', '')}")
    print(f"# cross_entropy table here: {json.dumps(env['table'])}")
    count = sum(1 + len(single_points(V, grid)) + len(grid.fused if bw else grid.stats)
                for V in vocabs for bw in (True, False))
    print(f"# up to {count} configs to time (fewer where two resolve to one launch)")
    start = time.perf_counter()
    results: dict[str, list[dict]] = {}

    def dump(extra: dict | None = None) -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"environment": env, "tokens": n, "results": results,
                           **(extra or {})}, f, indent=1)

    for V in vocabs:
        for backward in (True, False):
            s = Sweep(n, V, dtype, backward, device)
            results[f"V={V} {s.mode}"] = run_case(s, grid)
            del s
            print(f"# V={V} {'fwd+bwd' if backward else 'fwd'} done, "
                  f"{time.perf_counter() - start:.0f} s so far", flush=True)
            dump()
    summary = summarize(results, vocabs, env["table"])
    dump({"summary": summary})
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
