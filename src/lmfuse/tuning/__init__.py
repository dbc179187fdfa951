"""Launch parameters per device, read from JSON tables beside this file.

``<device>.json`` (for example ``h100.json``) holds the tuned values for one GPU model;
``default.json`` is the safe fallback every key must exist in. A kernel's ``_config``
function asks :func:`table` for its family's section and derives block sizes from it, so
no tuning constant lives inside a kernel file.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

_HERE = Path(__file__).resolve().parent


def device_key(device: torch.device) -> str:
    """A short key for the GPU model of ``device`` (``"h100"``, ``"h200"``, ...) or ``"cpu"``."""
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device).lower()
    for key in ("h200", "h100", "h800", "h20", "a100", "l40s", "b200", "gb200"):
        if key in name:
            return key
    return "default"


@functools.lru_cache(maxsize=None)
def _load(key: str) -> dict[str, Any]:
    path = _HERE / f"{key}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def table(family: str, device: torch.device) -> dict[str, Any]:
    """The tuning section for ``family`` on ``device``: the device's values over the defaults."""
    merged = dict(_load("default").get(family, {}))
    merged.update(_load(_cached_key(device)).get(family, {}))
    return merged


@functools.lru_cache(maxsize=None)
def _cached_key(device: torch.device) -> str:
    return device_key(device)


def single_block_tile(t: dict[str, Any], length: int) -> tuple[int, int, int] | None:
    """``(rows per tile, width, warps)`` for rows of ``length`` held in one register tile.

    ``width`` is the next power of two >= ``length`` (at least 16). ``None`` when that is
    above the table's ``max_single_block``: such rows are streamed in chunks instead.
    Reads ``max_single_block``, ``tile_elems`` and ``warps_by_block`` of section ``t``.
    """
    width = max(16, 1 << max(length - 1, 0).bit_length())
    if width > t["max_single_block"]:
        return None
    warps = next((w for limit, w in t["warps_by_block"] if width <= limit),
                 t["warps_by_block"][-1][1])
    return max(1, t["tile_elems"] // width), width, warps
