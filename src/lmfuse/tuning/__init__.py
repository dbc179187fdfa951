"""Launch parameters per device, read from JSON tables beside this file and a user cache.

``<device>.json`` (for example ``h100.json``) holds the tuned values for one GPU model;
``default.json`` is the safe fallback every key must exist in. A kernel's ``_config``
function asks :func:`table` for its family's section and derives block sizes from it, so
no tuning constant lives inside a kernel file.

A family may also split its problems into shape buckets: ``"buckets": [[limit, {...}],
...]`` in ``default.json`` (limits ascending, the last one covering everything), each
entry's keys overriding the family's flat keys for problems of size <= limit.
:func:`bucket_config` resolves one, layering ``default.json``, ``<device>.json`` and the
user cache (:func:`user_cache_path`) that ``lmfuse tune`` writes with what it measured on
the GPU at hand; device tables and the cache use ``default.json``'s limits.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._launch import next_pow2

try:
    import fcntl
except ImportError:  # not on Windows: the in-process lock still orders threads
    fcntl = None

_HERE = Path(__file__).resolve().parent


def device_key(device: torch.device) -> str:
    """A short key for the GPU model of ``device`` (``"h100"``, ``"h200"``, ...) or ``"cpu"``."""
    if device.type != "cuda":
        return device.type
    name = _cuda_name(device).lower()
    for key in ("h200", "h100", "h800", "h20", "a100", "l40s", "b200", "gb200"):
        if key in name:
            return key
    return "default"


# Every table is read once, at import: lookups do no I/O, so torch.compile can trace them.
_TABLES: dict[str, dict[str, Any]] = {
    path.stem: json.loads(path.read_text()) for path in sorted(_HERE.glob("*.json"))}


_OVERLAYS: dict[str, dict[str, Any]] = {}  # family -> values laid over every device's


def table(family: str, device: torch.device) -> dict[str, Any]:
    """The tuning section for ``family`` on ``device``: the device's values over the defaults
    (and an :func:`overlay`'s over both while one is active)."""
    merged = dict(_TABLES["default"].get(family, {}))
    merged.update(_TABLES.get(_cached_key(device), {}).get(family, {}))
    if _OVERLAYS:
        merged.update(_OVERLAYS.get(family, {}))
    return merged


@contextlib.contextmanager
def overlay(family: str, values: dict[str, Any]):
    """Lay ``values`` over ``family``'s section (every device's) while the block runs: the
    ops read them through their own lookups, so the sweeps time candidate values on the
    code path users run. Overlays nest; the section is as before once the block ends."""
    global _GENERATION
    before = _OVERLAYS.get(family)
    _OVERLAYS[family] = {**(before or {}), **values}
    _GENERATION += 1
    try:
        yield
    finally:
        if before is None:
            del _OVERLAYS[family]
        else:
            _OVERLAYS[family] = before
        _GENERATION += 1


@functools.lru_cache(maxsize=None)
def _cached_key(device: torch.device) -> str:
    return device_key(device)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``, which persistent grids are sized by; 4 for
    the CPU interpreter (so persistent loops run several tiles per program in tests)."""
    if device.index is not None:  # (a tensor's CUDA device: no device.type string made)
        return _indexed_sm_count(device)
    if device.type != "cuda":
        return 4
    return _cuda_sm_count(torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _indexed_sm_count(device: torch.device) -> int:
    return _cuda_sm_count(device.index) if device.type == "cuda" else 4


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def shared_memory(device: torch.device) -> int | None:
    """Bytes of shared memory one program of ``device`` may use (the opt-in limit: 227 KiB
    on an H100 or H200); ``None`` for the CPU interpreter, which has no such limit."""
    if device.type != "cuda":
        return None
    return _cuda_shared_memory(device.index if device.index is not None else
                               torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_shared_memory(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_block_optin", 0)
               or props.shared_memory_per_block)


@dataclass(frozen=True, slots=True)
class RowTiles:
    """How a row-wise kernel (softmax, RMSNorm, cross-entropy) covers rows of one length:
    ``block_m`` rows of ``block_n`` columns a program with ``num_warps`` warps, the whole row
    in one register tile (``single``) or streamed in ``block_n``-column chunks."""

    block_m: int
    block_n: int
    single: bool
    num_warps: int

    def meta(self) -> dict[str, Any]:
        """The launch's meta-parameters as the row kernels name them (``BLOCK_M``,
        ``BLOCK_N``, ``SINGLE_BLOCK``, ``num_warps``)."""
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, SINGLE_BLOCK=self.single,
                    num_warps=self.num_warps)


def row_tiles(t: dict[str, Any], length: int) -> RowTiles:
    """The tiles for rows of ``length`` from a family's section ``t``.

    One register tile when ``width``, the next power of two >= ``length`` (at least 16), is
    at most the table's ``max_single_block``: ``tile_elems // width`` rows (at least 1) a
    program, the warps of ``warps_by_block``'s first entry whose limit holds ``width``
    (its last entry's past them all). Wider rows are streamed: ``chunk_rows`` (1 when the
    section has none) rows of ``chunk_block`` columns a program, ``chunk_warps`` warps.
    """
    width = next_pow2(length, 16)
    if width > t["max_single_block"]:
        return RowTiles(t.get("chunk_rows", 1), t["chunk_block"], False, t["chunk_warps"])
    warps = by_width(t["warps_by_block"], width, 0)
    return RowTiles(max(1, t["tile_elems"] // width), width, True, warps)


def by_width(entries: Any, width: int, default: Any) -> Any:
    """The value of a table's ``[[limit, value], ...]`` list (limits ascending) for
    ``width``: the first entry whose limit holds it, the last entry's past them all,
    ``default`` for an empty list."""
    for limit, value in entries:  # (a loop, not a generator: this runs at every launch)
        if width <= limit:
            return value
    return entries[-1][1] if entries else default


# --- shape buckets and the user cache ----------------------------------------------------

CACHE_ENV = "LMFUSE_TUNING_CACHE"
CACHE_VERSION = 1


def user_cache_path() -> Path:
    """The JSON file ``lmfuse tune`` records into: ``$LMFUSE_TUNING_CACHE`` if set, else
    ``$XDG_CACHE_HOME/lmfuse/tuning.json``, else ``~/.cache/lmfuse/tuning.json``."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = Path.home() / ".cache"
        except (RuntimeError, KeyError) as exc:  # no $HOME and no passwd entry
            raise RuntimeError(f"lmfuse: the tuning cache has no path: the home directory "
                               f"cannot be determined ({exc}); set ${CACHE_ENV} or "
                               f"$XDG_CACHE_HOME") from None
    return Path(base) / "lmfuse" / "tuning.json"


def device_name(device: torch.device) -> str:
    """The name the user cache files a device under: the CUDA device name, or its type."""
    return _cuda_name(device) if device.type == "cuda" else device.type


def _cuda_name(device: torch.device) -> str:
    # get_device_properties, not get_device_name: torch.compile folds the former to a
    # constant and cannot trace the latter.
    return torch.cuda.get_device_properties(device).name


def _read_cache(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"version": CACHE_VERSION, "devices": {}}
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or \
                not isinstance(data.get("devices"), dict):
            raise ValueError(f"not a version-{CACHE_VERSION} lmfuse tuning cache")
        _check_layout(data["devices"])
        return data
    except (OSError, ValueError) as e:
        warnings.warn(f"lmfuse: ignoring the tuning cache {path}: {e}", stacklevel=2)
        return {"version": CACHE_VERSION, "devices": {}}


def _check_layout(devices: dict) -> None:
    """``{device name: {family: {"buckets": [[limit, {config}], ...], ...}}}`` or ValueError."""
    for name, families in devices.items():
        if not isinstance(families, dict):
            raise ValueError(f"device {name!r}: expected an object of families")
        for family, section in families.items():
            if not isinstance(section, dict):
                raise ValueError(f"{name!r} / {family!r}: expected an object")
            buckets = section.get("buckets", [])
            if not isinstance(buckets, list):
                raise ValueError(f"{name!r} / {family!r}: buckets must be a list of "
                                 f"[limit, {{config}}], got {buckets!r}")
            for b in buckets:
                if not (isinstance(b, list) and len(b) == 2 and isinstance(b[0], int)
                        and isinstance(b[1], dict)):
                    raise ValueError(f"{name!r} / {family!r}: bucket {b!r} is not "
                                     f"[limit, {{config}}]")


_USER: dict[str, Any] = {}  # the user cache as read: {"path": Path | None, "data": dict}
_GENERATION = 0  # bumped by each read of the user cache and each overlay's start and end


def generation() -> int:
    """A number that changes whenever the user cache is read again (:func:`reload`) and
    when an :func:`overlay` begins or ends: what a cache of configs derived from the
    tables is keyed on."""
    return _GENERATION


def _user_section(family: str, device: torch.device) -> dict[str, Any]:
    devices = _USER["data"]["devices"]
    return devices.get(device_name(device), {}).get(family, {})


def reload() -> None:
    """Read the user cache again, from the path the environment gives now (after
    ``lmfuse tune``, a hand edit, or a change of ``$LMFUSE_TUNING_CACHE``). It is read at
    import and by this only, so that lookups do no I/O."""
    global _GENERATION
    try:
        path = user_cache_path()
    except RuntimeError:  # no home directory (a container's uid): no user cache to read
        _USER.update(path=None, name="(none: no home directory)",
                     data={"version": CACHE_VERSION, "devices": {}})
    else:
        _USER.update(path=path, name=str(path), data=_read_cache(path))
    _GENERATION += 1


def bucket_limits(family: str) -> list[int]:
    """The ascending bucket limits of ``family`` (from ``default.json``)."""
    return [int(limit) for limit, _ in _TABLES["default"][family]["buckets"]]


def bucket_of(family: str, size: int) -> int:
    """The limit of the bucket holding problems of ``size``."""
    limits = bucket_limits(family)
    return next((limit for limit in limits if size <= limit), limits[-1])


def bucket_config(family: str, device: torch.device, size: int) -> tuple[dict[str, Any], str]:
    """``(config, source)`` for a problem of ``size`` in ``family``'s buckets.

    The config is the family's flat keys with the bucket's entry laid over them, from
    ``default.json``, then ``<device>.json``, then the user cache: the last that has the
    bucket wins. ``source`` names the layers that contributed (for messages and plans).
    The ``"measured"`` record the cache keeps beside a tuned entry is left out.
    """
    limit = bucket_of(family, size)
    key = _cached_key(device)
    layers = [("default.json", _TABLES["default"].get(family, {}))]
    if key not in ("default", "cpu"):
        layers.append((f"{key}.json", _TABLES.get(key, {}).get(family, {})))
    layers.append(("user cache " + _USER["name"], _user_section(family, device)))
    config: dict[str, Any] = {}
    sources = []
    for name, section in layers:
        flat = {k: v for k, v in section.items() if k != "buckets"}
        entry = next((e for lim, e in section.get("buckets", []) if int(lim) == limit), None)
        if flat or entry:
            sources.append(name)
        config.update(flat)
        if entry:
            config.update({k: v for k, v in entry.items() if k != "measured"})
    return config, f"{' + '.join(sources)}, bucket <= {limit}"


def record(family: str, device: torch.device, size: int, config: dict[str, Any],
           measured: dict[str, Any], path: Path | None = None) -> Path:
    """Write ``config`` as the user cache's entry for ``size``'s bucket on ``device``, with
    ``measured`` (time, shape, versions) kept beside it; returns the file written.

    Safe against concurrent writers (threads or processes): the read-modify-write holds an
    exclusive lock on ``<cache>.lock``, and the new file replaces the old one atomically.
    """
    path = user_cache_path() if path is None else path
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.with_name(path.name + ".lock")):
        data = _read_cache(path)
        section = data["devices"].setdefault(device_name(device), {}).setdefault(family, {})
        limit = bucket_of(family, size)
        buckets = [b for b in section.get("buckets", []) if int(b[0]) != limit]
        measured = dict(measured, date=datetime.date.today().isoformat())
        buckets.append([limit, dict(config, measured=measured)])
        section["buckets"] = sorted(buckets, key=lambda b: int(b[0]))
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, path)
    reload()
    return path


@contextlib.contextmanager
def _locked(lock_path: Path):
    with _THREAD_LOCK, open(lock_path, "a") as fh:
        if fcntl is not None:
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(fh, fcntl.LOCK_UN)


_THREAD_LOCK = threading.Lock()


reload()
