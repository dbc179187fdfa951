"""Launch tables (``lmfuse.tuning``)."""

from __future__ import annotations

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
def test_single_block_tile(length: int, expected: tuple[int, int, int]) -> None:
    assert tuning.single_block_tile(TABLE, length) == expected


def test_single_block_tile_none_past_the_limit() -> None:
    assert tuning.single_block_tile(TABLE, 4097) is None


def test_cpu_tables_have_every_family_key() -> None:
    cpu = torch.device("cpu")
    assert tuning.device_key(cpu) == "cpu"
    for family in ("softmax", "cross_entropy"):
        t = tuning.table(family, cpu)
        for key in ("max_single_block", "tile_elems", "warps_by_block"):
            assert key in t, (family, key)
