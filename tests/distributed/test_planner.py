"""The KV-cache sharding planner (``lmfuse/distributed/planner.py``) and ``lmfuse plan``.

A pure byte model, so every number here is worked out by hand from the formulas in the
planner's module docstring. The small case: B=4, Hq=8, Hkv=2, N=8 ranks, S=16 tokens,
D=4, L=2 layers, fp16 (2-byte cache and activations): TP=2, r=N/TP=4, q_local=Hq/N=1,
h_attn=Hq/TP=4, one sequence's one KV head = 2*L*S*D*2 = 512 bytes.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_cli

import lmfuse
from lmfuse.distributed import ShardingPlan
from lmfuse.distributed.planner import format_bytes, plan_sharding, resolve_dtype

GIB = 2**30
SMALL = {"q_heads": 8, "kv_heads": 2, "ranks": 8, "context_len": 16, "head_dim": 4,
         "n_layers": 2, "dtype": torch.float16, "hbm_gib": 1.0}
# GPT-OSS-120B-like, the CLI defaults.
GPT_OSS = {"batch": 16, "q_heads": 64, "kv_heads": 8, "ranks": 64, "context_len": 131072,
           "head_dim": 64, "n_layers": 80, "dtype": "bf16", "hbm_gib": 141}


def options(plan: ShardingPlan) -> dict:
    return {o.name: o for o in plan.options}


# --- formulas on the small case --------------------------------------------------------


def test_small_case_batch_at_least_r_takes_kvdp_and_every_number_matches() -> None:
    plan = plan_sharding(4, **SMALL)
    assert (plan.tp, plan.kvdp, plan.cp) == (2, 4, 1)
    assert plan.split == "TP2 x KVDP4"
    opts = options(plan)
    assert list(opts) == ["vanilla TP", "KVDP", "CP", "recommended"]

    vanilla = opts["vanilla TP"]
    # 4 sequences x 16 tokens of one (replicated) KV head: 4 * 512.
    assert (vanilla.tp, vanilla.kv_heads_held, vanilla.sequences_held) == (8, 1, 4)
    assert vanilla.kv_bytes_per_rank == 2 * 2 * 16 * 1 * 4 * 2 * 4 == 2048
    assert vanilla.replication == 4  # N / Hkv ranks hold each KV head
    assert vanilla.collectives == () and vanilla.collective_bytes_per_step == 0

    kvdp = opts["KVDP"]
    assert kvdp.kv_bytes_per_rank == 512 and kvdp.sequences_held == 1
    assert kvdp.replication == 1
    # q: (r-1) * B * s * q_local * D * a = 3*4*1*1*4*2; out: (k-1) * b * s * h_attn * D * a.
    assert [(c.name, c.group_size, c.bytes_per_rank) for c in kvdp.collectives] == [
        ("all-gather q", 4, 96), ("all-gather out", 4, 3 * 1 * 1 * 4 * 4 * 2)]
    assert kvdp.collectives_per_step == 2 * 2
    assert kvdp.collective_bytes_per_step == 2 * (96 + 96)

    cp = opts["CP"]
    # Every sequence, a quarter of its tokens.
    assert (cp.sequences_held, cp.tokens_held, cp.kv_bytes_per_rank) == (4, 4, 512)
    # out+lse in float32: (c-1) * b * s * h_attn * (D+1) * 4.
    assert [(c.name, c.group_size, c.bytes_per_rank) for c in cp.collectives] == [
        ("all-gather q", 4, 96), ("all-gather out+lse", 4, 3 * 4 * 1 * 4 * 5 * 4)]
    assert cp.collective_bytes_per_step == 2 * (96 + 960)

    best = opts["recommended"]
    assert best.split == kvdp.split and best.kv_bytes_per_rank == plan.kv_bytes_per_rank
    assert plan.collectives == kvdp.collectives
    assert plan.collective_bytes_per_step == 384 and plan.replication == 1
    assert "B=4 >= ranks/kv_heads=4" in plan.reason and "KVDP=4" in plan.reason


def test_s_active_and_fp8_cache_scale_their_own_terms() -> None:
    plan = plan_sharding(4, **{**SMALL, "dtype": "fp8"}, s_active=3)
    kvdp = options(plan)["KVDP"]
    assert kvdp.kv_bytes_per_rank == 256  # 1-byte cache
    # Activations stay 2 bytes (bf16) for an fp8 cache; every collective scales with s.
    assert [c.bytes_per_rank for c in kvdp.collectives] == [3 * 96, 3 * 96]
    assert plan.inputs["act_dtype"] == "bf16" and plan.inputs["dtype"] == "fp8_e4m3"
    fp32_wire = plan_sharding(4, **SMALL, act_dtype=torch.float32)
    assert [c.bytes_per_rank for c in options(fp32_wire)["KVDP"].collectives] == [192, 192]


def test_uneven_context_rounds_up_for_the_busiest_rank() -> None:
    plan = plan_sharding(1, **{**SMALL, "context_len": 17})
    assert (plan.kvdp, plan.cp) == (1, 4)
    assert plan.recommended.tokens_held == 5  # ceil(17 / 4)
    assert plan.kv_bytes_per_rank == 2 * 2 * 5 * 1 * 4 * 2 * 1


# --- the recommendation rule -----------------------------------------------------------


@pytest.mark.parametrize("batch, split", [
    (1, "TP2 x CP4"),             # B < r: CP only
    (2, "TP2 x KVDP2 x CP2"),     # B < r: the largest divisor of r not above B, CP the rest
    (4, "TP2 x KVDP4"),           # B = r: KVDP
    (8, "TP2 x KVDP4"),           # B > r, even
])
def test_rule_kvdp_when_batch_covers_r_else_cp_or_a_mix(batch: int, split: str) -> None:
    plan = plan_sharding(batch, **SMALL)
    assert plan.split == split
    assert plan.tp * plan.kvdp * plan.cp == SMALL["ranks"]
    # No replica: each rank holds exactly 1/N of the whole cache.
    assert plan.kv_bytes_per_rank * SMALL["ranks"] == 2 * 2 * 16 * 2 * 4 * 2 * batch
    assert "plain rule" not in plan.reason


def test_batch_below_r_explains_cp() -> None:
    plan = plan_sharding(1, **SMALL)
    assert plan.reason.startswith("B=1 < ranks/kv_heads=4")
    assert "TP2 x CP4" in plan.reason


def test_uneven_batch_follows_the_rule_when_it_fits() -> None:
    # B=3, r=4: DESIGN's rule (KVDP=2 x CP=2) holds whenever it fits, even though CP=4 would
    # spread the rows more evenly.
    plan = plan_sharding(3, **SMALL)
    assert plan.split == "TP2 x KVDP2 x CP2"
    assert "plain rule" not in plan.reason
    plan = plan_sharding(6, **SMALL)
    assert plan.split == "TP2 x KVDP4"


def test_uneven_batch_departs_from_the_rule_only_when_it_does_not_fit_and_says_why() -> None:
    # B=3, r=4: the rule's KVDP=2 leaves one rank 2 sequences x 8 tokens = 16 rows (512
    # bytes), CP=4 gives every rank 3 x 4 = 12 (384 bytes); with 400 bytes of HBM only the
    # balanced split fits.
    plan = plan_sharding(3, **{**SMALL, "hbm_gib": 400 / 2**30})
    assert plan.split == "TP2 x CP4" and plan.fits
    assert plan.kv_bytes_per_rank == 3 * 4 * 2 * 2 * 4 * 2
    assert "plain rule would take TP2 x KVDP2 x CP2, which does not fit" in plan.reason
    # B=6 >= r=4 but not a multiple: KVDP=4 leaves a rank 2 sequences (32 rows, 1024
    # bytes); KVDP=2 x CP=2 gives 3 x 8 = 24 (768 bytes).
    plan = plan_sharding(6, **{**SMALL, "hbm_gib": 800 / 2**30})
    assert plan.split == "TP2 x KVDP2 x CP2" and plan.fits
    assert plan.reason.startswith("B=6 >= ranks/kv_heads=4")
    assert "plain rule would take TP2 x KVDP4" in plan.reason


def test_fewer_ranks_than_kv_heads_is_plain_tp() -> None:
    plan = plan_sharding(4, **{**SMALL, "ranks": 1})
    assert (plan.tp, plan.kvdp, plan.cp, plan.replication) == (1, 1, 1, 1)
    assert plan.recommended.kv_heads_held == 2
    assert plan.collectives == ()
    assert options(plan)["vanilla TP"].replication == 1
    assert "nothing is left to split" in plan.reason


def test_kvdp_and_cp_compose_on_64_ranks() -> None:
    plan = plan_sharding(**{**GPT_OSS, "batch": 2})
    assert plan.split == "TP8 x KVDP2 x CP4"
    assert [(c.name, c.group, c.group_size) for c in plan.collectives] == [
        ("all-gather q", "KVDP x CP", 8), ("all-gather out+lse", "CP", 4),
        ("all-gather out", "KVDP", 2)]
    assert plan.kv_bytes_per_rank == 640 * 2**20  # 2 sequences x 2.5 GiB / 8


# --- fits ------------------------------------------------------------------------------


def test_fits_against_hbm() -> None:
    # 1536 bytes: the 512-byte splits fit, vanilla TP's 2048 does not.
    plan = plan_sharding(4, **{**SMALL, "hbm_gib": 1536 / GIB})
    assert plan.fits
    assert not options(plan)["vanilla TP"].fits and options(plan)["CP"].fits
    assert "It fits" in plan.reason


def test_nothing_fits_is_reported() -> None:
    plan = plan_sharding(4, **{**SMALL, "hbm_gib": 500 / GIB})
    assert not plan.fits and not any(o.fits for o in plan.options)
    assert "Nothing fits" in plan.reason and "fp8 cache" in plan.reason
    assert "NO" in str(plan)


# --- the GPT-OSS-120B-like default -----------------------------------------------------


def test_gpt_oss_like_default() -> None:
    plan = plan_sharding(**GPT_OSS)
    opts = options(plan)
    # One sequence's KV head over 128K tokens and 80 layers: 2*80*131072*64*2 = 2.5 GiB.
    assert opts["vanilla TP"].kv_bytes_per_rank == 40 * GIB  # 16 sequences, 1 head
    assert opts["vanilla TP"].replication == 8
    assert opts["KVDP"].kv_bytes_per_rank == opts["CP"].kv_bytes_per_rank == 5 * GIB
    assert (plan.tp, plan.kvdp, plan.cp) == (8, 8, 1) and plan.fits
    # Per layer: q and out all-gathers of 7 * 16 * 64 * 2 = 14336 bytes each; x 80 layers.
    assert [c.bytes_per_rank for c in plan.collectives] == [14336, 14336]
    assert plan.collective_bytes_per_step == 80 * 2 * 14336
    # CP: the same q all-gather + float32 partials 7 * 16 * 8 * 65 * 4.
    assert opts["CP"].collective_bytes_per_step == 80 * (14336 + 232960)


def test_str_renders_the_table() -> None:
    text = str(plan_sharding(**GPT_OSS))
    for needle in ("vanilla TP", "TP64", "40.00 GiB", "8x", "TP8 x CP8", "18.87 MiB",
                   "recommended  TP8 x KVDP8", "all-gather q over KVDP (8 ranks): 1 x 14.00 KiB",
                   "why: B=16 >= ranks/kv_heads=8"):
        assert needle in text, needle


def test_exports_and_dtype_names() -> None:
    assert lmfuse.plan_sharding is plan_sharding
    assert "plan_sharding" in lmfuse.__all__
    for name, dtype in (("bf16", torch.bfloat16), ("float16", torch.float16),
                        ("torch.float32", torch.float32), ("FP8", torch.float8_e4m3fn),
                        ("e5m2", torch.float8_e5m2), (torch.bfloat16, torch.bfloat16)):
        assert resolve_dtype(name) == dtype
    assert format_bytes(1023) == "1023 B" and format_bytes(1536) == "1.50 KiB"


# --- bad input -------------------------------------------------------------------------


@pytest.mark.parametrize("change, error, match", [
    ({"batch": 0}, ValueError, "batch must be >= 1"),
    ({"batch": 2.0}, TypeError, "batch must be an int"),
    ({"ranks": True}, TypeError, "ranks must be an int"),
    ({"q_heads": 12, "kv_heads": 8}, ValueError,
     r"q_heads \(12\) must be a multiple of kv_heads \(8\)"),
    ({"ranks": 3, "q_heads": 6}, ValueError, r"ranks \(3\) and kv_heads \(2\) must divide"),
    ({"ranks": 16}, ValueError, r"q_heads \(8\) must be a multiple of ranks \(16\)"),
    ({"context_len": 0}, ValueError, "context_len must be >= 1"),
    ({"head_dim": -1}, ValueError, "head_dim must be >= 1"),
    ({"n_layers": None}, TypeError, "n_layers must be an int"),
    ({"hbm_gib": 0}, ValueError, r"hbm_gib must be in \(0, 2\*\*40\], got 0"),
    ({"hbm_gib": 1e300}, ValueError, r"hbm_gib must be in \(0, 2\*\*40\]"),  # (overflowed)
    ({"hbm_gib": "80"}, TypeError, "hbm_gib must be a float"),
    ({"hbm_gib": float("inf")}, ValueError, "hbm_gib must be finite"),
    ({"dtype": "int8"}, ValueError, "unknown dtype 'int8'"),
    ({"dtype": torch.int8}, TypeError, "dtype must be a floating dtype"),
    ({"dtype": 2}, TypeError, "dtype must be a torch.dtype or a string"),
    ({"s_active": 9}, ValueError, r"s_active must be 1\.\.8"),
    ({"act_dtype": "nope"}, ValueError, "unknown act_dtype"),
])
def test_bad_inputs_raise_naming_the_argument(change: dict, error: type, match: str) -> None:
    kwargs = {**SMALL, "batch": 4, **change}
    with pytest.raises(error, match=match):
        plan_sharding(**kwargs)


# --- the CLI ---------------------------------------------------------------------------


def test_cli_plan_defaults_print_the_recommendation(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "plan")
    assert code == 0, err
    assert out.rstrip("\n") == str(plan_sharding(**GPT_OSS))
    assert "recommended TP8 x KVDP8" in out


def test_cli_plan_options_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "plan", "--batch", "2", "--dtype", "fp8", "--hbm-gib", "80",
                             "--json")
    assert code == 0, err
    data = json.loads(out)
    assert (data["tp"], data["kvdp"], data["cp"]) == (8, 2, 4)
    assert data["split"] == "TP8 x KVDP2 x CP4"
    assert data["inputs"]["dtype"] == "fp8_e4m3" and data["inputs"]["hbm_gib"] == 80
    assert [o["name"] for o in data["options"]] == ["vanilla TP", "KVDP", "CP", "recommended"]
    assert data["kv_bytes_per_rank"] == 320 * 2**20 and data["fits"] is True


def test_cli_plan_bad_input_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "plan", "--ranks", "12")
    assert code == 2 and out == ""
    assert "lmfuse plan: --ranks (12) and --kv-heads (8) must divide" in err


# --- tp, and the cost model ----------------------------------------------------------------


def test_tp_one_splits_the_group_over_all_kv_heads() -> None:
    """``tp=1``: every rank of the group holds all KV heads of its sequences (the layout of
    bench/decode_sharded.py): two ranks split B=2 by KVDP, B=1 by CP; bytes by hand."""
    kw = {**SMALL, "ranks": 2, "tp": 1}
    plan = plan_sharding(2, **kw)
    assert (plan.tp, plan.kvdp, plan.cp) == (1, 2, 1) and plan.split == "TP1 x KVDP2"
    # One sequence of both KV heads: 2 * L * S * Hkv * D * e = 2 * 2 * 16 * 2 * 4 * 2.
    assert plan.kv_bytes_per_rank == 1024
    # q: (r-1) * B * s * (Hq/N) * D * a = 1*2*1*4*4*2; out: (k-1) * b * s * Hq * D * a.
    assert [c.bytes_per_rank for c in plan.collectives] == [64, 1 * 1 * 1 * 8 * 4 * 2]
    assert plan.reason.startswith("B=2 >= ranks/TP=2: with TP=1,")
    one = plan_sharding(1, **kw)
    assert (one.kvdp, one.cp) == (1, 2) and one.split == "TP1 x CP2"
    assert one.kv_bytes_per_rank == 512  # both KV heads of half of one sequence


@pytest.mark.parametrize("tp, match", [(3, r"tp \(3\) must divide ranks \(8\) and kv_heads"),
                                       (0, "tp must be >= 1"), (1.5, "tp must be an int")])
def test_tp_bad_values(tp, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        plan_sharding(4, **SMALL, tp=tp)


# A calibration as bench/decode_sharded.py --calibrate writes it, with round numbers: read
# 10 us + 2 TB/s, all-gather x2 20 us + 100 GB/s, all-to-all x2 15 us + 50 GB/s, merge
# 4 us + 1 TB/s.
CALIBRATION = {
    "copy_tbps": 3.0,
    "decode": [{"bytes": b, "ms": 0.010 + b / 2e9} for b in (2**24, 2**28, 2**30)],
    "merge": [{"P": 2, "rows": r, "D": 127, "ms": 0.004 + (2 * r * 128 * 4 + r * 127 * 4)
               / 1e9} for r in (64, 4096)],
    "collectives": [{"kind": k, "n": 2, "bytes_per_rank": b,
                     "ms": f + (b if k == "all_gather" else b / 2) / g}
                    for k, f, g in (("all_gather", 0.020, 1e8), ("all_to_all", 0.015, 5e7))
                    for b in (2**10, 2**20, 2**24)],
}


def test_cost_model_fits_lines_and_predicts_each_part(tmp_path) -> None:
    from lmfuse.distributed.cost_model import CostModel, fit_line

    line = fit_line([(0.0, 1.0), (10.0, 3.0), (20.0, 5.0)])
    assert line.fixed_ms == pytest.approx(1.0) and line.gbps == pytest.approx(5e-6)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"environment": {}, "calibration": CALIBRATION}))
    model = CostModel.load(path)
    assert model.read.fixed_ms == pytest.approx(0.010) and model.read.gbps == pytest.approx(2e3)
    assert model.merge.fixed_ms == pytest.approx(0.004)
    ag = model.collective("all_gather", 2)
    assert ag.fixed_ms == pytest.approx(0.020) and ag.gbps == pytest.approx(100)
    # An unmeasured group size: the nearest one's rate, latency x (n - 1) / (m - 1).
    assert model.collective("all_gather", 8).fixed_ms == pytest.approx(0.140)
    # CP2 over B=1, Hq=8 heads of D=127 (tp=1): read + partials' all-gather + merge.
    parts = model.layer_ms(kvdp=1, cp=2, batch=1, s_active=1, q_local=4, h_attn=8,
                           head_dim=127, kv_bytes=2**26, act_bytes=2, q_gather=False)
    rows = 8
    assert parts["q"] == 0 and parts["out"] == 0
    assert parts["read"] == pytest.approx(0.010 + 2**26 / 2e9)
    assert parts["cp"] == pytest.approx(0.020 + rows * 128 * 4 / 1e8
                                        + 0.004 + (2 * rows * 128 * 4 + rows * 127 * 4) / 1e9)
    assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"))
    # KVDP2 with the all-to-all exchange: q rows of the rank's one sequence, its heads out.
    a2a = model.layer_ms(kvdp=2, cp=1, batch=2, s_active=1, q_local=4, h_attn=8,
                         head_dim=127, kv_bytes=2**26, act_bytes=2, exchange="all_to_all")
    assert a2a["q"] == pytest.approx(0.015 + 1 * 1 * 4 * 127 * 2 / 5e7)
    assert a2a["out"] == pytest.approx(0.015 + 0.5 * 8 * 127 * 2 / 5e7)


@pytest.mark.parametrize("part, i, field, value", [
    ("decode", 0, "ms", "fast"), ("decode", 1, "ms", None), ("decode", 1, "ms", float("nan")),
    ("decode", 0, "bytes", -1), ("merge", 0, "P", 0), ("collectives", 0, "n", 0),
    ("collectives", 2, "ms", float("inf")), ("collectives", 1, "bytes_per_rank", True)])
def test_calibration_values_are_checked(tmp_path, part: str, i: int, field: str,
                                        value) -> None:
    """A value that is no finite number (a string or null where a time belongs, NaN, a
    group of 0 ranks) is refused by name; it gave a bare TypeError, or a plan of NaN ms."""
    from lmfuse.distributed.cost_model import CostModel

    cal = json.loads(json.dumps(CALIBRATION))
    cal[part][i][field] = value
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"calibration": cal}))
    with pytest.raises(ValueError, match=rf"{part} entry {i}'s '{field}' must be a finite "
                                         "number"):
        CostModel.load(path)


def test_plan_with_a_cost_model_predicts_every_option(tmp_path) -> None:
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"calibration": CALIBRATION}))
    plan = plan_sharding(2, **{**SMALL, "ranks": 2, "tp": 1}, cost_model=str(path))
    for o in plan.options:
        assert o.predicted_layer_ms is not None
        assert o.predicted_step_ms == pytest.approx(o.predicted_layer_ms["total"] * 2)
    kvdp = plan.recommended.predicted_layer_ms
    assert kvdp["read"] == pytest.approx(0.010 + 1024 / 2 / 2e9)  # per layer: L = 2
    assert kvdp["q"] == pytest.approx(0.020 + 64 / 1e8) and kvdp["cp"] == 0
    assert "pred ms/layer" in str(plan) and "cost model (" in str(plan)
    assert plan_sharding(2, **SMALL).options[0].predicted_layer_ms is None


def test_cli_plan_calibrate(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"calibration": CALIBRATION}))
    code, out, err = run_cli(capsys, "plan", "--ranks", "2", "--tp", "1", "--batch", "1",
                             "--calibrate", str(path))
    assert code == 0, err
    assert "recommended  TP1 x CP2" in out and "pred ms/step" in out
    code, out, err = run_cli(capsys, "plan", "--calibrate", str(tmp_path / "missing.json"))
    assert code == 2 and "calibration file" in err
    (tmp_path / "bad.json").write_text(json.dumps({"calibration": {"decode": []}}))
    code, out, err = run_cli(capsys, "plan", "--calibrate", str(tmp_path / "bad.json"))
    assert code == 2 and "no 'decode' measurements" in err
