"""Launch tables (``lmfuse.tuning``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmfuse import tuning

TABLE = {"max_single_block": 4096, "tile_elems": 2048,
         "warps_by_block": [[1024, 4], [4096, 8]]}


@pytest.mark.parametrize("length, expected", [
    (1, (128, 16, 4)),        # at least 16 wide
    (16, (128, 16, 4)),
    (17, (64, 32, 4)),        # next power of two
    (1024, (2, 1024, 4)),
    (1025, (1, 2048, 8)),     # the next warps bucket
    (4096, (1, 4096, 8)),     # rows wider than tile_elems still get one row per tile
])
def test_row_tiles_single(length: int, expected: tuple[int, int, int]) -> None:
    assert tuning.row_tiles(TABLE, length) == tuning.RowTiles(*expected[:2], True, expected[2])


def test_row_tiles_streamed_past_the_limit() -> None:
    streamed = dict(TABLE, chunk_block=1024, chunk_warps=8)
    assert tuning.row_tiles(streamed, 4097) == tuning.RowTiles(1, 1024, False, 8)
    assert tuning.row_tiles(dict(streamed, chunk_rows=4), 4097) == tuning.RowTiles(
        4, 1024, False, 8)
    assert tuning.row_tiles(streamed, 4097).meta() == dict(
        BLOCK_M=1, BLOCK_N=1024, SINGLE_BLOCK=False, num_warps=8)


def test_by_width_takes_the_first_limit_that_holds_the_width() -> None:
    entries = [[1024, "a"], [8192, "b"]]
    assert [tuning.by_width(entries, w, "d") for w in (16, 1024, 1025, 8192, 16384)] == [
        "a", "a", "b", "b", "b"]  # past every limit: the last entry's
    assert tuning.by_width([], 4096, "d") == "d"


def test_cpu_tables_have_every_family_key() -> None:
    cpu = torch.device("cpu")
    assert tuning.device_key(cpu) == "cpu"
    for family in ("softmax", "cross_entropy"):
        t = tuning.table(family, cpu)
        for key in ("max_single_block", "tile_elems", "warps_by_block"):
            assert key in t, (family, key)


# --- shape buckets and the user cache ----------------------------------------------------

FAMILY = "linear_cross_entropy"
CPU = torch.device("cpu")



def test_user_cache_path_from_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(tuning.CACHE_ENV, str(tmp_path / "x.json"))
    assert tuning.user_cache_path() == tmp_path / "x.json"
    monkeypatch.delenv(tuning.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tuning.user_cache_path() == tmp_path / "lmfuse" / "tuning.json"


@pytest.mark.parametrize("size, limit", [(1, 16384), (16384, 16384), (16385, 65536),
                                         (128256, 196608), (262144, 2**40), (2**40, 2**40),
                                         (2**50, 2**40)])
def test_bucket_of(size: int, limit: int) -> None:
    assert tuning.bucket_of(FAMILY, size) == limit


def test_bucket_config_defaults(tuning_cache) -> None:
    cfg, source = tuning.bucket_config(FAMILY, CPU, 128256)
    assert cfg == {"chunk_bytes": 256 * 2**20, "row_multiple": 128, "kernel": None}
    assert source == "default.json, bucket <= 196608"


def test_bucket_config_layers(tuning_cache, monkeypatch) -> None:
    """default.json < <device>.json < user cache, per bucket; other buckets untouched."""
    tables = {
        "default": {FAMILY: {"chunk_bytes": 100, "row_multiple": 1, "kernel": None,
                             "buckets": [[10, {}], [100, {"row_multiple": 4}]]}},
        "h100": {FAMILY: {"chunk_bytes": 200, "buckets": [[100, {"chunk_bytes": 300}]]}},
    }
    monkeypatch.setattr(tuning, "_TABLES", tables)
    monkeypatch.setattr(tuning, "_cached_key", lambda device: "h100")
    assert tuning.bucket_config(FAMILY, CPU, 5)[0] == {
        "chunk_bytes": 200, "row_multiple": 1, "kernel": None}
    cfg, source = tuning.bucket_config(FAMILY, CPU, 50)
    assert cfg == {"chunk_bytes": 300, "row_multiple": 4, "kernel": None}
    assert source == "default.json + h100.json, bucket <= 100"
    tuning.record(FAMILY, CPU, 60, {"chunk_bytes": 400, "kernel": {"BLOCK_V": 16}},
                  {"ms": 1.5})
    cfg, source = tuning.bucket_config(FAMILY, CPU, 50)
    assert cfg == {"chunk_bytes": 400, "row_multiple": 4, "kernel": {"BLOCK_V": 16}}
    assert source.startswith("default.json + h100.json + user cache ")
    assert tuning.bucket_config(FAMILY, CPU, 5)[0]["chunk_bytes"] == 200


def test_record_keeps_measurements_and_replaces_the_bucket(tuning_cache) -> None:
    tuning.record(FAMILY, CPU, 128256, {"chunk_bytes": 1}, {"ms": 2.0, "shape": [1, 2, 3]})
    tuning.record(FAMILY, CPU, 32000, {"chunk_bytes": 2}, {"ms": 3.0})
    tuning.record(FAMILY, CPU, 150000, {"chunk_bytes": 3}, {"ms": 1.0})  # same bucket as 128256
    data = json.loads(tuning_cache.read_text())
    buckets = data["devices"]["cpu"][FAMILY]["buckets"]
    assert [b[0] for b in buckets] == [65536, 196608]
    assert buckets[1][1]["chunk_bytes"] == 3
    assert buckets[1][1]["measured"]["ms"] == 1.0 and "date" in buckets[1][1]["measured"]
    assert tuning.bucket_config(FAMILY, CPU, 128256)[0]["chunk_bytes"] == 3


def test_broken_cache_is_ignored_with_a_warning(tuning_cache) -> None:
    tuning_cache.write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring the tuning cache"):
        tuning.reload()
    cfg, _ = tuning.bucket_config(FAMILY, CPU, 1000)
    assert cfg["chunk_bytes"] == 256 * 2**20
    tuning_cache.write_text('{"version": 99, "devices": {}}')
    with pytest.warns(UserWarning, match="not a version-1 lmfuse tuning cache"):
        tuning.reload()


def test_device_tables_use_the_default_limits() -> None:
    """A device table's buckets must be default.json's, or they would never be found."""
    here = Path(tuning.__file__).parent
    default = json.loads((here / "default.json").read_text())
    for path in here.glob("*.json"):
        for family, section in json.loads(path.read_text()).items():
            if "buckets" in section:
                limits = [b[0] for b in default[family]["buckets"]]
                assert all(b[0] in limits for b in section["buckets"]), (path.name, family)


def test_device_decode_sections_state_every_regime_of_the_default() -> None:
    """A device table's decode-attention section replaces default.json's whole (the merge
    is one level deep), so each one it overrides must name every key the default's has
    (``null`` to turn a regime off): a regime added to default.json later (the paged
    ``many_programs``, say) is then not lost on that device without anyone choosing so."""
    here = Path(tuning.__file__).parent
    default = json.loads((here / "default.json").read_text())["decode_attention"]
    for path in here.glob("*.json"):
        section = json.loads(path.read_text()).get("decode_attention", {})
        if path.name == "default.json":
            continue
        for key, value in section.items():
            if isinstance(default.get(key), dict) and value is not None:
                missing = sorted(set(default[key]) - set(value))
                assert not missing, (path.name, key, missing)


@pytest.mark.parametrize("text", [
    '{"version": 1, "devices": {"cpu": []}}',
    '{"version": 1, "devices": {"cpu": {"linear_cross_entropy": {"buckets": [[65536]]}}}}',
    '{"version": 1, "devices": {"cpu": {"linear_cross_entropy": []}}}',
    # (a TypeError at import, out of every CLI verb, before buckets were checked to be a list)
    '{"version": 1, "devices": {"cpu": {"linear_cross_entropy": {"buckets": null}}}}',
    '{"version": 1, "devices": {"h100": {"softmax": {"buckets": 3}}}}',
])
def test_malformed_cache_is_ignored_with_a_warning(tuning_cache, text: str) -> None:
    tuning_cache.write_text(text)
    with pytest.warns(UserWarning, match="ignoring the tuning cache"):
        tuning.reload()
    assert tuning.bucket_config(FAMILY, CPU, 1000)[0]["chunk_bytes"] == 256 * 2**20


def test_concurrent_records_keep_every_bucket(tuning_cache) -> None:
    """Threads recording different buckets at once: none is lost, none fails."""
    import threading

    errors = []

    def write(size):
        try:
            for _ in range(5):
                tuning.record(FAMILY, CPU, size, {"chunk_bytes": size}, {"ms": 1.0})
        except Exception as e:  # noqa: BLE001 - collected for the assert
            errors.append(e)

    threads = [threading.Thread(target=write, args=(s,)) for s in (100, 20000, 100000, 300000)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    data = json.loads(tuning_cache.read_text())
    limits = [b[0] for b in data["devices"]["cpu"][FAMILY]["buckets"]]
    assert limits == [16384, 65536, 196608, 2**40]
    assert not list(tuning_cache.parent.glob("*.tmp"))


def test_overlay_lays_values_over_a_section_while_active() -> None:
    cpu = torch.device("cpu")
    before = tuning.table("softmax", cpu)
    with tuning.overlay("softmax", {"chunk_block": 512, "new_key": 1}):
        assert tuning.table("softmax", cpu) == {**before, "chunk_block": 512, "new_key": 1}
        with tuning.overlay("softmax", {"chunk_warps": 2}):
            assert tuning.table("softmax", cpu)["chunk_block"] == 512
            assert tuning.table("softmax", cpu)["chunk_warps"] == 2
        assert tuning.table("softmax", cpu)["chunk_warps"] == before["chunk_warps"]
        assert "new_key" not in tuning.table("cross_entropy", cpu)  # other families: as before
    assert tuning.table("softmax", cpu) == before
    with pytest.raises(RuntimeError), tuning.overlay("softmax", {"chunk_block": 64}):
        raise RuntimeError("the block fails")
    assert tuning.table("softmax", cpu) == before
