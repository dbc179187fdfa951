"""linear_cross_entropy's launch configs: the shape-bucket lookup, the guard that rejects a
config before anything launches, the CE kernel override reaching the kernels, and
``lmfuse tune`` (its sweep timed by a fake timer here; on the GPU by CUDA events)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import lmfuse
from lmfuse import cli, tuning
from lmfuse.cross_entropy import linear, linear_config, ops
from lmfuse.cross_entropy import tune as ce_tune
from lmfuse.cross_entropy.linear import linear_cross_entropy_reference
from lmfuse.cross_entropy.linear_config import check_config, chunk_rows
from lmfuse.tuning import sweep

CPU = torch.device("cpu")
GOOD = {"chunk_bytes": 1 << 20, "row_multiple": 1, "kernel": None}
KERNEL = {"BLOCK_V": 4096, "num_warps": 8, "programs_per_sm": 4}



# --- the guard ---------------------------------------------------------------------------


@pytest.mark.parametrize("change, match", [
    (dict(chunk_bytes=0), "chunk_bytes must be a positive int, got 0"),
    (dict(chunk_bytes=1.5), "chunk_bytes must be a positive int"),
    (dict(row_multiple=True), "row_multiple must be a positive int"),
    (dict(kernel=[4096]), "kernel must be null or an object"),
    (dict(kernel={"BLOCK_V": 4096}), r"missing \['num_warps', 'programs_per_sm'\]"),
    (dict(kernel=dict(KERNEL, stages=3)), r"unknown \['stages'\]"),
    (dict(kernel=dict(KERNEL, BLOCK_V=3000)), "BLOCK_V must be a power of two"),
    (dict(kernel=dict(KERNEL, num_warps=64)), "at most 1024 threads"),
    (dict(kernel=dict(KERNEL, num_warps=3)), "num_warps must be 1, 2, 4, 8, 16 or 32"),
    (dict(kernel=dict(KERNEL, BLOCK_V=65536, num_warps=4)),
     "puts 512 fp32 values in each thread's registers; at most 64"),
    (dict(kernel=dict(KERNEL, programs_per_sm=0)), "programs_per_sm must be in"),
    (dict(kernel=dict(KERNEL, slice=6000)), "slice must be a multiple of BLOCK_V=4096"),
    (dict(kernel=dict(KERNEL, slice=8192, lag=0)), "lag must be a positive int"),
    (dict(kernel=dict(KERNEL, lag=2)), "lag is only meaningful with slice"),
    (dict(kernel=dict(KERNEL, vec=3)), "vec must be 0 or a power of two <= BLOCK_V"),
    (dict(kernel=dict(KERNEL, vec=8, slice=8192)), "vec must be .* without slice"),
    (dict(kernel=dict(KERNEL, prefetch=1)), "prefetch is only meaningful with vec"),
    (dict(kernel=dict(KERNEL, vec=8, prefetch=2)), "prefetch must be 0 or 1"),
])
def test_guard_rejects(change: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=f"tuning config from here: .*{match}"):
        check_config(dict(GOOD, **change), "here")


def test_guard_accepts_a_whole_row_kernel() -> None:
    kernel = dict(KERNEL, vec=8, prefetch=1, hints=1)
    assert check_config(dict(GOOD, kernel=kernel))["kernel"] == kernel


def test_guard_accepts_and_fills_lag() -> None:
    assert check_config(GOOD) == GOOD
    cfg = check_config(dict(GOOD, kernel=dict(KERNEL, slice=16384)))
    assert cfg["kernel"]["lag"] == 1
    # the largest per-thread load that still fits
    check_config(dict(GOOD, kernel=dict(KERNEL, BLOCK_V=65536, num_warps=32)))


def test_bad_cache_entry_is_rejected_before_any_launch(tuning_cache, monkeypatch) -> None:
    """A hand-edited cache entry that could not launch raises a ValueError naming the
    cache, and no kernel (nor GEMM) runs."""
    tuning.record("linear_cross_entropy", CPU, 1000, dict(
        GOOD, kernel=dict(KERNEL, BLOCK_V=65536, num_warps=2)), {"ms": 1.0})

    def no_launch():
        raise AssertionError("a kernel was reached")

    monkeypatch.setattr(ops, "_kernels", no_launch)
    monkeypatch.setattr(linear, "_logits", lambda *a, **k: no_launch())
    h = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(1000, 8, requires_grad=True)
    t = torch.zeros(4, dtype=torch.long)
    for impl in ("triton", "torch"):
        with pytest.raises(ValueError, match=r"tuning config from .*user cache .*tuning\.json"
                                             r".*1024 fp32 values"):
            lmfuse.linear_cross_entropy(h, w, t, impl=impl)


# --- the lookup --------------------------------------------------------------------------


def test_row_multiple_rounds_chunks_down() -> None:
    cfg = linear_config.LCEConfig.of(dict(GOOD, chunk_bytes=1000 * 4 * 10, row_multiple=4))
    assert chunk_rows(100, 1000, 4, CPU, None, cfg) == 8
    assert chunk_rows(5, 1000, 4, CPU, None, cfg) == 5       # at most n
    assert chunk_rows(100, 1000, 4, CPU, 1000 * 4 * 3, cfg) == 3  # fewer than 4: as is
    assert chunk_rows(100, 10**6, 4, CPU, None, cfg) == 1     # at least one


def test_cache_entry_drives_the_chunking(tuning_cache, monkeypatch) -> None:
    """An entry recorded for V's bucket sets the chunk rows; explain() names its source."""
    V, H, n = 50, 8, 23
    tuning.record("linear_cross_entropy", CPU, V, dict(GOOD, chunk_bytes=V * 4 * 7,
                                                       row_multiple=2), {"ms": 1.0})
    formed = []
    real = linear._logits
    monkeypatch.setattr(linear, "_logits",
                        lambda h, w, b, out: (formed.append(h.shape[0]), real(h, w, b, out)))
    h = torch.randn(n, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    t = torch.randint(0, V, (n,))
    lmfuse.linear_cross_entropy(h, w, t, impl="torch").backward()
    assert formed == [6, 6, 6, 5]
    plan = lmfuse.explain(lmfuse.linear_cross_entropy, h, w, t)
    assert "rows a multiple of 2" in plan.details["config"]
    assert "user cache" in plan.details["config"] and "bucket <= 16384" in plan.details["config"]
    # another bucket keeps the table's config
    w2 = torch.randn(20000, H)
    plan = lmfuse.explain(lmfuse.linear_cross_entropy, h, w2, t)
    assert "user cache" not in plan.details["config"]


def test_kernel_override_reaches_the_streamed_kernel(streamed_short_rows) -> None:
    """The config's ``kernel`` replaces the CE table's launch of streamed rows (shrunk
    here so short rows stream), and the result still matches the reference."""
    launched = streamed_short_rows
    kernel = {"BLOCK_V": 16, "num_warps": 1, "programs_per_sm": 2, "slice": 32, "lag": 1}
    V, H, n = 70, 16, 9
    h = torch.randn(n, H, dtype=torch.float64).float().requires_grad_(True)
    w = torch.randn(V, H).div(4).requires_grad_(True)
    t = torch.randint(0, V, (n,))
    loss = linear._apply(h, w, t, None, -100, 0.1, 0.0, None, "mean", None, "triton", None,
                         dict(GOOD, kernel=kernel))
    dh, dw = torch.autograd.grad(loss, (h, w))
    assert launched and launched[0] == ops.StreamLaunch.of(kernel)
    h64, w64 = h.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    ref = linear_cross_entropy_reference(h64, w64, t, label_smoothing=0.1)
    rdh, rdw = torch.autograd.grad(ref, (h64, w64))
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dh.double(), rdh, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(dw.double(), rdw, rtol=1e-4, atol=1e-6)


# --- the sweep ---------------------------------------------------------------------------


def test_coordinate_sweep_picks_fastest_and_never_runs_rejected() -> None:
    ran = []

    def run(cfg):
        assert cfg["a"] != "bad", "a rejected config ran"
        ran.append(dict(cfg))

    def check(cfg):
        if cfg["a"] == "bad":
            raise ValueError("cannot launch")
        return cfg

    cost = {("x", 1): 5.0, ("y", 1): 3.0, ("y", 2): 2.0, ("y", 3): 4.0, ("z", 1): 9.0}

    def timer(fn):
        fn()
        return cost[(ran[-1]["a"], ran[-1]["b"])]

    out = sweep.coordinate_sweep({"a": "x", "b": 1}, [("a", ["y", "bad", "z"]), ("b", [1, 2, 3])],
                                 run, check, timer)
    assert out.best == {"a": "y", "b": 2} and out.ms == 2.0
    assert [t.rejected for t in out.trials if t.rejected] == ["cannot launch"]
    # start, a=y, a=z, then b=2 and b=3 on a=y: {"a": "y", "b": 1} is not timed twice
    assert [(c["a"], c["b"]) for c in ran] == [("x", 1), ("y", 1), ("z", 1), ("y", 2), ("y", 3)]


def test_coordinate_sweep_records_failures_and_needs_one_success() -> None:
    def boom(cfg):
        raise RuntimeError("out of resources")

    with pytest.raises(RuntimeError, match="no candidate ran"):
        sweep.coordinate_sweep({"a": 1}, [("a", [2])], boom, lambda c: c, lambda fn: fn())


def test_tune_records_the_fastest_per_bucket(tuning_cache) -> None:
    """tune() on tiny CPU shapes with a fake timer: every stage swept, the fastest config
    recorded for V's bucket with its time, and then used by the op."""
    calls = []

    def timer(fn):
        fn()  # the op really runs (fwd + bwd) on each candidate
        calls.append(fn)
        return 1.0 + (len(calls) * 3 % 7) * 0.25  # a fixed, non-monotonic sequence

    logs = []
    results = ce_tune.tune([(12, 8, 40)], torch.float32, CPU, max_chunk_bytes=256 * 2**20,
                          timer=timer, impl="torch", log=logs.append)
    (res,) = results
    assert res["shape"] == [12, 8, 40] and res["bucket"] == 16384
    timed = [t for t in res["trials"] if t["ms"] is not None]
    assert res["ms"] == min(t["ms"] for t in timed)
    keys = {k for t in res["trials"] for k in t["config"]}
    assert keys == {"chunk_bytes", "row_multiple", "kernel"}
    budgets = {t["config"]["chunk_bytes"] for t in res["trials"]}
    assert budgets == {64 * 2**20, 128 * 2**20, 256 * 2**20}
    data = json.loads(tuning_cache.read_text())
    (entry,) = data["devices"]["cpu"]["linear_cross_entropy"]["buckets"]
    assert entry[0] == 16384
    assert {k: entry[1][k] for k in res["best"]} == res["best"]
    assert entry[1]["measured"]["ms"] == round(res["ms"], 4)
    assert entry[1]["measured"]["shape"] == [12, 8, 40]
    assert linear_config.config(40, CPU)[0] == linear_config.LCEConfig.of(res["best"])
    assert any("recorded in" in line for line in logs)


def test_tune_streamed_rows_sweep_the_kernel() -> None:
    stages = dict(ce_tune.tune_stages(128256, CPU, 512 * 2**20))
    assert stages["chunk_bytes"] == [64 * 2**20, 128 * 2**20, 256 * 2**20, 512 * 2**20]
    assert None in stages["kernel"] and len(stages["kernel"]) > 3
    for k in stages["kernel"]:  # every built-in candidate passes the guard
        check_config(dict(GOOD, kernel=k))
    assert "kernel" not in dict(ce_tune.tune_stages(1000, CPU, 512 * 2**20))


def test_tune_needs_a_timer_off_cuda() -> None:
    with pytest.raises(ValueError, match="timing needs a CUDA device"):
        ce_tune.tune([(4, 4, 4)], torch.float32, CPU)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message")
def test_cli_tune_without_cuda(capsys) -> None:
    assert cli.main(["tune", "linear_cross_entropy"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_cli_tune_bad_shape(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["tune", "linear_cross_entropy", "--shape", "8192,4096"])
    assert "expected N,H,V" in capsys.readouterr().err


def test_coordinate_sweep_prefers_within_tolerance() -> None:
    """Within the tolerance of the fastest, the preferred (smaller budget) config wins."""
    cost = {64: 10.05, 128: 10.0, 256: 9.0, 512: 8.96}
    cfg_of = []

    def timer(fn):
        fn()
        return cost[cfg_of[-1]]

    def run(cfg):
        cfg_of.append(cfg["budget"])

    out = sweep.coordinate_sweep({"budget": 64}, [("budget", [128, 256, 512])], run,
                                 lambda c: c, timer, prefer=lambda c: c["budget"],
                                 tolerance=0.01)
    assert out.best == {"budget": 256} and out.ms == 9.0
    out = sweep.coordinate_sweep({"budget": 64}, [("budget", [128, 256, 512])], run,
                                 lambda c: c, timer)
    assert out.best == {"budget": 512}


def test_coordinate_sweep_confirms_the_leaders_by_median() -> None:
    """A config that was fast once by luck loses when the leaders are timed again."""
    seq = {"lucky": iter([1.0, 5.0, 5.0, 5.0]), "steady": iter([2.0, 2.0, 2.0, 2.0]),
           "slow": iter([3.0, 3.0, 3.0, 3.0]), "worst": iter([9.0])}
    order = []

    def run(cfg):
        order.append(cfg["c"])

    def timer(fn):
        fn()
        return next(seq[order[-1]])

    out = sweep.coordinate_sweep({"c": "lucky"}, [("c", ["steady", "slow", "worst"])], run,
                                 lambda c: c, timer, confirm=3)
    assert out.best == {"c": "steady"} and out.ms == 2.0
    # the re-timings go in turns over the three leaders; "worst" is not re-timed
    assert order[4:] == ["lucky", "steady", "slow"] * 3
