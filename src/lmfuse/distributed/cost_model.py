"""Predicted time of one decode-attention layer for each split the planner weighs
(``lmfuse plan --calibrate FILE``).

Each term is a line, ``ms = fixed + bytes / rate``, fitted (least squares) to measurements
of one GPU kind and interconnect that ``bench/decode_sharded.py --calibrate`` writes into
its JSON (``"calibration"``):

* **read**: ``decode_attention`` on one GPU over a cache of ``bytes`` (K and V), at the
  seed's heads and several context lengths: the rank's local attention. Its rate is the
  kernel's achieved copy rate; its fixed part the launch, the split-KV merge and the
  ramp of a short step.
* **collectives**: an all-gather and an all-to-all over groups of ``n`` ranks, alone, at
  per-rank sizes from 1 KiB to 16 MiB; ``bytes`` is what a rank receives (``(n - 1)`` shards
  for an all-gather, ``(n - 1) / n`` of the buffer for an all-to-all). A group size that was
  not measured takes the nearest measured one's rate and its fixed latency scaled by
  ``(n - 1) / (m - 1)`` (a ring's ``n - 1`` steps): within one NVLink domain a pessimistic
  guess, across nodes an optimistic one; the prediction says which sizes were measured.
* **merge**: ``merge_attention_states`` of ``P`` float32 partials (bytes read and written).

A split's layer (``kvdp`` sequence groups x ``cp`` context slices over ``r`` ranks sharing
a KV head group) is predicted as the sum of its parts, in the order the ops run them::

    [all-gather q over r] + read(KV bytes per rank per layer)
        + [CP > 1: all-gather of float32 partials over CP + merge of CP partials]
        + [KVDP > 1: all-gather of outputs over KVDP]

Nothing overlaps in these ops, so the sum is the model; host time is not in it (the
calibration, like a server's decode step, runs under CUDA graphs).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LSE_BYTES = 4  # float32 partials


@dataclass(frozen=True)
class Line:
    """``ms = fixed_ms + bytes / (gbps * 1e6)``."""

    fixed_ms: float
    gbps: float  # GB/s (1e9 bytes a second)

    def ms(self, nbytes: float) -> float:
        return self.fixed_ms + nbytes / (self.gbps * 1e6)


def _check_measure(source: Any, key: str, i: int, field: str, value: Any) -> None:
    """A calibration entry's number: finite, >= 1 for a count of ranks or partials (``n``,
    ``P``), >= 0 otherwise; ``ValueError`` naming where it is."""
    low = 1 if field in ("n", "P") else 0
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value >= low):
        raise ValueError(f"calibration {source}: {key} entry {i}'s {field!r} must be a finite "
                         f"number >= {low}, got {value!r}")


def fit_line(points: list[tuple[float, float]]) -> Line:
    """Least-squares line through ``(bytes, ms)`` points (at least two sizes); the fixed
    part is kept >= 0 (refitted through the origin otherwise)."""
    if len({x for x, _ in points}) < 2:
        raise ValueError(f"fit_line: need two sizes or more, got {points}")
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    fixed = my - slope * mx
    if fixed < 0 or slope <= 0:
        fixed = max(0.0, fixed) if slope > 0 else my
        slope = (max(sum(x * y for x, y in points) / sum(x * x for x, _ in points), 1e-12)
                 if fixed == 0 else 1e-12)
    return Line(fixed_ms=fixed, gbps=1.0 / (slope * 1e6))


@dataclass(frozen=True)
class CostModel:
    """Fitted terms of one machine (see the module docstring)."""

    read: Line
    merge: Line
    collectives: dict[str, dict[int, Line]]  # kind ("all_gather", "all_to_all") -> n -> line
    source: str = ""
    notes: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_calibration(cls, cal: dict[str, Any], source: str = "") -> CostModel:
        """From the ``"calibration"`` object ``bench/decode_sharded.py --calibrate``
        writes."""
        for key in ("decode", "collectives", "merge"):
            if not cal.get(key):
                raise ValueError(f"calibration {source or ''}: no {key!r} measurements")
        def entries(key: str, *fields: str) -> list[dict[str, Any]]:
            """``cal[key]``'s measurements, each an object with ``fields``."""
            got = cal[key]
            if not isinstance(got, list):
                raise ValueError(f"calibration {source}: {key!r} must be a list of "
                                 f"measurements, got {type(got).__name__}")
            for i, e in enumerate(got):
                if not isinstance(e, dict):
                    raise ValueError(f"calibration {source}: {key} entry {i} is "
                                     f"{type(e).__name__} {e!r}, not an object")
                missing = [f for f in fields if f not in e]
                if missing:
                    raise ValueError(f"calibration {source}: {key} entry {i} has no "
                                     f"{missing[0]!r}")
                for f in fields:
                    if f != "kind":
                        _check_measure(source, key, i, f, e[f])
            return got

        read = fit_line([(d["bytes"], d["ms"]) for d in entries("decode", "bytes", "ms")])
        merge = fit_line([(m["P"] * m["rows"] * (m["D"] + 1) * LSE_BYTES
                           + m["rows"] * m["D"] * LSE_BYTES, m["ms"])
                          for m in entries("merge", "P", "rows", "D", "ms")])
        points: dict[str, dict[int, list[tuple[float, float]]]] = {}
        for i, c in enumerate(entries("collectives", "n", "bytes_per_rank", "kind")):
            if c.get("ms") is None:
                continue  # (not measured)
            _check_measure(source, "collectives", i, "ms", c["ms"])
            n, b = int(c["n"]), float(c["bytes_per_rank"])
            got = (n - 1) * b if c["kind"] == "all_gather" else (n - 1) / n * b
            points.setdefault(c["kind"], {}).setdefault(n, []).append((got, c["ms"]))
        colls = {kind: {n: fit_line(p) for n, p in by_n.items()} for kind, by_n in
                 points.items()}
        if "all_gather" not in colls:
            raise ValueError(f"calibration {source or ''}: no all-gather measurements")
        return cls(read, merge, colls, source,
                   {"measured_group_sizes": sorted(colls["all_gather"])})

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """From a results file: the ``"calibration"`` object of a ``decode_sharded.py`` JSON
        (or a file holding that object alone)."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"calibration file {path}: {e}") from None
        cal = data.get("calibration", data) if isinstance(data, dict) else None
        if not isinstance(cal, dict):
            raise ValueError(f"calibration file {path}: no 'calibration' object")
        return cls.from_calibration(cal, str(path))

    def collective(self, kind: str, n: int) -> Line:
        """The line of a ``kind`` collective over ``n`` ranks (scaled from the nearest
        measured group size when ``n`` was not measured)."""
        by_n = self.collectives.get(kind) or self.collectives["all_gather"]
        if n in by_n:
            return by_n[n]
        m = min(by_n, key=lambda k: (abs(k - n), -k))
        line = by_n[m]
        return Line(line.fixed_ms * (n - 1) / max(m - 1, 1), line.gbps)

    def collective_ms(self, kind: str, n: int, received_bytes: float) -> float:
        return 0.0 if n <= 1 else self.collective(kind, n).ms(received_bytes)

    def layer_ms(self, *, kvdp: int, cp: int, batch: int, s_active: int, q_local: int,
                 h_attn: int, head_dim: int, kv_bytes: float, act_bytes: int,
                 q_gather: bool = True, exchange: str = "all_gather") -> dict[str, float]:
        """One layer's predicted ms, by part: ``q`` (the query all-gather over the ``kvdp *
        cp`` ranks, if ``q_gather``), ``read`` (``kv_bytes`` of the rank's cache), ``cp``
        (the partials' all-gather over CP and their merge), ``out`` (the outputs'
        all-gather over KVDP) and ``total``. ``exchange="all_to_all"``: KVDP's two
        exchanges as all-to-alls (``kvdp_decode_attention``'s option)."""
        r = kvdp * cp
        b = math.ceil(batch / kvdp)
        D, s = head_dim, s_active
        parts = {"q": 0.0, "read": self.read.ms(kv_bytes), "cp": 0.0, "out": 0.0}
        if q_gather and r > 1:
            shard = batch * s * q_local * D * act_bytes
            if exchange == "all_to_all" and cp == 1:
                # Each rank receives its sequences' rows of every other rank's heads.
                parts["q"] = self.collective_ms("all_to_all", r,
                                                (r - 1) * b * s * q_local * D * act_bytes)
            else:
                parts["q"] = self.collective_ms("all_gather", r, (r - 1) * shard)
        if cp > 1:
            rows = b * s * h_attn
            parts["cp"] = (self.collective_ms("all_gather", cp,
                                              (cp - 1) * rows * (D + 1) * LSE_BYTES)
                           + self.merge.ms(cp * rows * (D + 1) * LSE_BYTES
                                           + rows * D * LSE_BYTES))
        if kvdp > 1:
            local = b * s * h_attn * D * act_bytes
            if exchange == "all_to_all":
                parts["out"] = self.collective_ms("all_to_all", kvdp,
                                                  (kvdp - 1) / kvdp * local)
            else:
                parts["out"] = self.collective_ms("all_gather", kvdp, (kvdp - 1) * local)
        parts["total"] = sum(parts.values())
        return parts

    def summary(self) -> str:
        cols = "; ".join(f"{kind} x{n}: {line.fixed_ms * 1e3:.1f} us + {line.gbps:.0f} GB/s"
                         for kind, by_n in self.collectives.items()
                         for n, line in sorted(by_n.items()))
        return (f"cost model ({self.source or 'given'}): read {self.read.fixed_ms * 1e3:.1f} us"
                f" + {self.read.gbps / 1e3:.2f} TB/s; merge {self.merge.fixed_ms * 1e3:.1f} us"
                f" + {self.merge.gbps / 1e3:.2f} TB/s; {cols}")
