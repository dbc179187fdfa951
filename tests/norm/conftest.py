"""Fixtures shared by the norm tests."""

from __future__ import annotations

from typing import Iterator

import pytest

from lmfuse import tuning
from lmfuse.norm import ops as norm_ops


@pytest.fixture
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[list]:
    """The norm kernels' tiles at most 2 x 32 elements, rows wider than 32 streamed in
    16-column tiles 2 rows at a time, 1 backward program per (interpreter) SM: short rows
    and few of them exercise every loop of both kernels, RMSNorm's and LayerNorm's.
    Yields the list receiving each backward launch's ``(programs, rows_per_program,
    single tile)``."""
    small = dict(max_single_block=32, tile_elems=64, chunk_block=16, chunk_rows=2,
                 bwd_programs_per_sm=1, chunk_bwd_programs_per_sm=1)
    launches: list = []
    real_bwd = norm_ops._bwd

    def spy(x, *rest):
        tiles, per_sm, _ = norm_ops._config(x.shape[1], x.device)
        launches.append((*norm_ops._bwd_grid(x.shape[0], tiles.block_m, per_sm, x.device),
                         tiles.single))
        return real_bwd(x, *rest)

    monkeypatch.setattr(norm_ops, "_bwd", spy)
    with tuning.overlay("rms_norm", small):
        yield launches
