"""``lmfuse plan``'s cost model against the measured sharded-decode rows, and its predictions
past the machine the results came from.

    python3 bench/plan_vs_measured.py bench/results/h100x2-2026-11-25-decode_sharded.json \\
        [--json PATH] [--ranks 8,16,64]

The model is fitted to the file's ``"calibration"`` (``bench/decode_sharded.py --calibrate``:
1-GPU decode sizes, collectives alone, the merge; see ``lmfuse/distributed/cost_model.py``).
Every sharded row of the file (``n >= 2``) is then predicted from its shape and split alone,
as the op runs it: KVDP rows gather q over the group and the outputs back (all-gathers, or
all-to-alls for the ``a2a`` rows); CP rows take q whole (no q exchange: the benchmark's CP
rows pass every head on every rank), all-gather the float32 partials and merge; KVDP x CP
rows both. The table gives predicted and measured ms and the error; the 1-GPU rows are the
read term itself, shown for reference.

Then, by model: the seed's example (q heads 64, kv heads 8, head dim 64, 80 layers, 128K
context, bf16) at B = 1, 2, 4, 8, 16 on ``--ranks`` GPUs with the planner's default split
(``TP = min(kv heads, ranks)``): the recommended split's predicted layer time. Group sizes
the file did not measure take the nearest measured size's rate and a latency scaled by
``(n - 1) / (m - 1)`` (cost_model.py says why that is a guess).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from lmfuse.distributed.cost_model import CostModel  # noqa: E402
from lmfuse.distributed.planner import plan_sharding  # noqa: E402

SEED = {"q_heads": 64, "kv_heads": 8, "context_len": 131072, "head_dim": 64, "n_layers": 80,
        "dtype": "bf16", "hbm_gib": 75.0}


def shape_of(case: str) -> dict[str, int]:
    """``"splits B4 Hq64 Hkv8 S131072 D128"`` -> ``{"B": 4, "Hq": 64, ...}``."""
    out = {}
    for word in case.split()[1:]:
        key = word.rstrip("0123456789")
        out[key] = int(word[len(key):])
    return out


def predict_row(model: CostModel, row: dict) -> dict[str, float]:
    s = shape_of(row["case"])
    n, kvdp, cp = row["n"], row["kvdp"], row["cp"]
    elt = 2  # bf16 caches and activations
    kv_bytes = row["kv_bytes"] / n
    exchange = row.get("exchange") or "all_gather"
    return model.layer_ms(kvdp=kvdp, cp=cp, batch=s["B"], s_active=1,
                          q_local=s["Hq"] // kvdp, h_attn=s["Hq"], head_dim=s["D"],
                          kv_bytes=kv_bytes, act_bytes=elt, q_gather=kvdp > 1,
                          exchange=exchange)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", help="a bench/decode_sharded.py --calibrate JSON")
    p.add_argument("--ranks", default="8,16,64", help="GPU counts to predict the seed at")
    p.add_argument("--json", help="write the comparison and predictions here")
    args = p.parse_args(argv)
    data = json.loads(Path(args.results).read_text())
    model = CostModel.from_calibration(data["calibration"], args.results)
    print(model.summary())
    env = data["environment"]
    print(f"# {env['device']} x{env['world_size']}, torch {env['torch']}, NCCL "
          f"{env.get('nccl')}, {env['date']}")
    rows = []
    print(f"{'case':<36} {'impl':<30} {'pred ms':>8} {'meas ms':>8} {'error':>7}  parts")
    for r in data["results"]:
        if r.get("n", 1) < 2:
            continue
        parts = predict_row(model, r)
        err = parts["total"] / r["ms"] - 1
        rows.append({"case": r["case"], "impl": r["impl"], "split": r.get("split"),
                     "predicted_ms": parts["total"], "measured_ms": r["ms"], "error": err,
                     "parts": parts})
        shown = ", ".join(f"{k} {v:.4f}" for k, v in parts.items() if k != "total" and v)
        print(f"{r['case']:<36} {r['impl']:<30} {parts['total']:8.4f} {r['ms']:8.4f} "
              f"{100 * err:+6.1f}%  {shown}")
    worst = max(abs(r["error"]) for r in rows) if rows else float("nan")
    within = sum(abs(r["error"]) <= 0.15 for r in rows)
    print(f"# {within} of {len(rows)} rows within 15% (worst {100 * worst:.1f}%)")

    ranks = [int(x) for x in args.ranks.split(",") if x]
    predictions = []
    print(f"\n# the seed's example by model ({SEED}), recommended split per layer:")
    print(f"{'ranks':>5} {'B':>3} {'split':<20} {'KV/rank GiB':>11} {'fits':>4} "
          f"{'pred ms/layer':>13} {'pred ms/step':>12}  parts")
    for n in ranks:
        for b in (1, 2, 4, 8, 16):
            plan = plan_sharding(b, ranks=n, cost_model=model, **SEED)
            o = plan.recommended
            parts = o.predicted_layer_ms
            predictions.append({"ranks": n, "batch": b, "split": plan.split,
                                "kv_bytes_per_rank": o.kv_bytes_per_rank, "fits": o.fits,
                                "predicted_layer_ms": parts,
                                "predicted_step_ms": o.predicted_step_ms})
            shown = ", ".join(f"{k} {v:.4f}" for k, v in parts.items() if k != "total" and v)
            print(f"{n:>5} {b:>3} {plan.split:<20} {o.kv_bytes_per_rank / 2**30:11.2f} "
                  f"{'yes' if o.fits else 'NO':>4} {parts['total']:13.4f} "
                  f"{o.predicted_step_ms:12.3f}  {shown}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "source": args.results, "model": model.summary(), "environment": env,
            "rows": rows, "within_15pct": within, "worst_error": worst, "seed": SEED,
            "predictions": predictions}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
