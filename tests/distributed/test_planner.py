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
    ({"hbm_gib": 0}, ValueError, "hbm_gib must be > 0"),
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
    assert "lmfuse plan: plan_sharding: ranks (12) and kv_heads (8) must divide" in err
