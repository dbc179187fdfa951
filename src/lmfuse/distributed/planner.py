"""How to shard a decode KV cache over ranks: vanilla TP, KV data parallelism, context
parallelism, or a mix of the last two (``lmfuse.plan_sharding``, ``lmfuse plan``).

A pure model, no tensors and no process groups: it counts bytes.

Notation: ``B`` sequences, ``Hq`` query and ``Hkv`` KV heads, ``N`` ranks, ``S`` cached
tokens per sequence (``context_len``), head dim ``D``, ``L`` layers, ``s`` active tokens
per step, ``e`` bytes per cache element (``dtype``), ``a`` bytes per activation element
(``act_dtype``: the cache dtype, or bfloat16 for an fp8 cache).

Every option keeps the projections tensor-parallel over all ``N`` ranks: each rank
computes ``q_local = Hq / N`` query heads for all ``B`` sequences, and the out-projection
is row-parallel over the same split. Its all-reduce is the same for every option and is
left out; only the collectives *inside* attention are counted.

KV bytes per rank (the busiest rank, for an uneven split)::

    2 (K and V) * L * tokens_held * kv_heads_held * D * e * sequences_held

* **vanilla TP** (``TP = N``): ``kv_heads_held = max(1, Hkv / N)``, all ``B`` sequences,
  all ``S`` tokens. When ``N > Hkv`` the ``N / Hkv`` ranks whose query heads share a KV
  head each hold a full copy of it: ``replication = N / Hkv``. No collective in attention.
* **TP x KVDP x CP** (``TP = min(Hkv, N)``, ``KVDP * CP = r = N / TP``): the ``r`` ranks
  that share KV head(s) ``Hkv / TP`` split the batch ``KVDP`` ways and each sequence's
  context ``CP`` ways: ``sequences_held = ceil(B / KVDP)``, ``tokens_held = ceil(S / CP)``,
  no replica (``replication = 1``). Attention on a rank runs over the whole query group of
  its KV head(s), ``h_attn = Hq / TP = r * q_local`` heads. Per layer and decode step, with
  ``b = ceil(B / KVDP)`` (all-gathers pad the batch to ``KVDP * b``):

  ================================  =========  ==============================================
  collective                        group      bytes received per rank
  ================================  =========  ==============================================
  all-gather q (if ``r > 1``)       r ranks    ``(r - 1) * B * s * q_local * D * a``
  all-gather out + lse (``CP > 1``) CP ranks   ``(CP - 1) * b * s * h_attn * (D + 1) * 4``
  all-gather out (``KVDP > 1``)     KVDP ranks ``(KVDP - 1) * b * s * h_attn * D * a``
  ================================  =========  ==============================================

  The q all-gather brings each rank the query heads of its whole group for every sequence
  (the rank then keeps its ``b`` sequences, or all of them under CP); gathering over CP
  first and then inside ``kvdp_decode_attention`` over KVDP moves the same bytes in two
  calls (``(CP - 1) + CP * (KVDP - 1) = r - 1`` shards). CP's partial outputs
  and their log-sum-exps travel in float32 for the exact merge, modelled as the all-gather
  ``cp_decode_attention`` issues (an all-to-all that sent each rank only its own heads'
  partials would move up to ``CP`` times fewer bytes), given the global lengths as
  ``cache_seqlens`` (a scheduler knows them; without them the op adds an all-reduce of
  ``b`` int64 lengths over CP, left out here). KVDP's merged outputs are
  all-gathered over the batch and each rank keeps its own ``q_local`` heads.
  "Bytes received" is ``(g - 1) / g`` of the gathered tensor, what a ring all-gather moves
  into each rank. Per step = per layer * ``L``.

The recommendation (``TP = min(Hkv, N)``, ``r = N / TP``): if ``B >= r``, ``KVDP = r``
and ``CP = 1``; else ``KVDP`` = the largest divisor of ``r`` not above ``B`` and
``CP = r / KVDP``. When ``B`` does not split evenly over that ``KVDP``, the busiest rank
holds more than its share; only if that split then does not fit in ``hbm_gib`` does the
plan take, among the divisors ``k <= B`` of ``r``, the one whose busiest rank holds the
fewest ``sequences * tokens`` (the larger ``KVDP`` on a tie, since its output all-gather
is cheaper than CP's float32 partials), and the reason says so.

``fits`` compares the KV cache alone with ``hbm_gib`` GiB (2**30 bytes): pass the HBM
left per rank after weights and activations. Sizes are those of a contiguous cache; a
paged cache rounds each sequence up to whole blocks, and fp8 per-head scales are ignored.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from .._dispatch import check_int, check_number
from .._launch import DTYPE_NAMES, dtype_name, dtype_named

OP = "plan_sharding"
MAX_ACTIVE = 8  # the regime decode_attention is designed and tuned for (it takes more)
LSE_BYTES = 4  # partial outputs and log-sum-exps are merged in float32

_SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
          torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


@dataclass(frozen=True)
class Collective:
    """One collective inside attention, per layer and decode step."""

    name: str  # "all-gather q", "all-gather out+lse", "all-gather out"
    group: str  # which ranks: "KVDP", "CP" or "KVDP x CP"
    group_size: int
    count: int  # calls per layer per decode step
    bytes_per_rank: int  # received by each rank, per call


@dataclass(frozen=True)
class ShardingOption:
    """One way to shard the KV cache, and what it costs each rank."""

    name: str  # "vanilla TP", "KVDP", "CP", "recommended"
    split: str  # "TP8 x KVDP2 x CP4"
    tp: int
    kvdp: int
    cp: int
    kv_heads_held: int
    sequences_held: int  # on the busiest rank
    tokens_held: int  # per held sequence
    kv_bytes_per_rank: int
    fits: bool
    replication: int  # ranks holding a copy of each cached (token, KV head)
    collectives: tuple[Collective, ...]  # per layer per decode step
    collectives_per_step: int  # calls per decode step, all layers
    collective_bytes_per_step: int  # received per rank per decode step, all layers
    # With a cost model (``plan_sharding(cost_model=...)``): one layer's predicted ms by part
    # (q, read, cp, out, total; see ``cost_model.py``), and a whole step's (all layers).
    predicted_layer_ms: dict[str, float] | None = None
    predicted_step_ms: float | None = None


@dataclass(frozen=True)
class ShardingPlan:
    """The recommended split (its fields repeated at the top), every option compared,
    the inputs, and why. ``str(plan)`` is the table ``lmfuse plan`` prints."""

    tp: int
    kvdp: int
    cp: int
    kv_bytes_per_rank: int
    fits: bool
    replication: int
    collectives: tuple[Collective, ...]
    collective_bytes_per_step: int
    options: tuple[ShardingOption, ...]  # vanilla TP, KVDP, CP, recommended
    reason: str
    inputs: dict[str, Any] = field(default_factory=dict)
    cost_model: str | None = None  # the cost model's summary, when one was given

    @property
    def recommended(self) -> ShardingOption:
        return self.options[-1]

    @property
    def split(self) -> str:
        return self.recommended.split

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every field, options and collectives as nested dicts."""
        out = asdict(self)
        out["split"] = self.split
        return out

    def __str__(self) -> str:
        p = self.inputs
        head = (f"KV-cache sharding plan: batch {p['batch']}, {p['q_heads']} q / "
                f"{p['kv_heads']} kv heads, head_dim {p['head_dim']}, {p['n_layers']} layers, "
                f"context {p['context_len']}, {p['dtype']} cache, s_active {p['s_active']}, "
                f"{p['ranks']} ranks of {p['hbm_gib']:g} GiB")
        cols = ("option", "split", "KV/rank", "fits", "replicas", "coll/layer",
                "bytes/rank/layer", "coll/step", "bytes/rank/step")
        predicted = self.cost_model is not None
        if predicted:
            cols += ("pred ms/layer", "pred ms/step")
        rows = [cols]
        for o in self.options:
            per_layer = sum(c.count * c.bytes_per_rank for c in o.collectives)
            row = (o.name, o.split, format_bytes(o.kv_bytes_per_rank),
                   "yes" if o.fits else "NO", f"{o.replication}x",
                   str(sum(c.count for c in o.collectives)), format_bytes(per_layer),
                   str(o.collectives_per_step), format_bytes(o.collective_bytes_per_step))
            if predicted:
                row += (f"{o.predicted_layer_ms['total']:.4f}", f"{o.predicted_step_ms:.3f}")
            rows.append(row)
        widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
        lines = [head, ""]
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        lines += ["", (f"recommended {self.split}: collectives per layer per decode step, "
                       "bytes received per rank")]
        if not self.collectives:
            lines.append("  none inside attention")
        for c in self.collectives:
            lines.append(f"  {c.name} over {c.group} ({c.group_size} ranks): "
                         f"{c.count} x {format_bytes(c.bytes_per_rank)}")
        lines += ["", "why: " + self.reason]
        if predicted:
            parts = self.recommended.predicted_layer_ms
            lines += ["", f"predicted layer of {self.split}: " + ", ".join(
                f"{k} {v:.4f} ms" for k, v in parts.items()), self.cost_model]
        return "\n".join(lines)


def format_bytes(n: int) -> str:
    """``1536`` -> ``"1.50 KiB"``; binary units."""
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.2f} {unit}"
    return f"{n / 1024:.2f} TiB"


def resolve_dtype(dtype: Any, name: str = "dtype") -> torch.dtype:
    """A floating torch dtype, or one of its names (``"bf16"``, ``"fp8"``, ``"float16"``,
    ``"torch.bfloat16"``, ...; ``"fp8"`` is ``float8_e4m3fn``)."""
    if isinstance(dtype, str):
        named = dtype_named(dtype)
        if named is None:
            raise ValueError(f"{OP}: unknown {name} {dtype!r}; choose a torch floating dtype "
                             f"or one of {', '.join(DTYPE_NAMES)}")
        return named
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{OP}: {name} must be a torch.dtype or a string such as 'bf16', "
                        f"got {type(dtype).__name__} {dtype!r}")
    if not dtype.is_floating_point:
        raise TypeError(f"{OP}: {name} must be a floating dtype, got {dtype}")
    return dtype


def plan_sharding(batch: int, q_heads: int, kv_heads: int, ranks: int, context_len: int,
                  head_dim: int, n_layers: int, dtype: torch.dtype | str, hbm_gib: float, *,
                  s_active: int = 1,
                  act_dtype: torch.dtype | str | None = None,
                  tp: int | None = None,
                  cost_model: Any = None) -> ShardingPlan:
    """Recommend how ``ranks`` ranks should shard a decode KV cache, and compare options.

    Args:
        batch: sequences decoded together (``B``).
        q_heads, kv_heads: query and KV heads (``q_heads % kv_heads == 0``).
        ranks: ranks in the tensor-parallel group (``N``). ``ranks`` and ``kv_heads`` must
            divide one another, and ``ranks`` must divide ``q_heads`` (the projections are
            split by heads over all ranks).
        context_len: cached tokens per sequence (``S``).
        head_dim: ``D``. n_layers: attention layers (``L``).
        dtype: the KV cache's dtype (a torch dtype or ``"bf16"``, ``"fp16"``, ``"fp8"``...).
        hbm_gib: GiB per rank the cache may use.
        s_active: tokens decoded per step (1..8).
        act_dtype: dtype of q and outputs on the wire; default the cache dtype, bfloat16
            for a 1-byte cache.
        tp: how many ways attention's KV heads are split (``TP``); default
            ``min(kv_heads, ranks)``. ``tp=1``: every rank of the group holds every KV head
            of its sequences (attention data parallel over the group, as
            ``bench/decode_sharded.py`` runs it); ``tp`` must divide ``ranks`` and
            ``kv_heads``.
        cost_model: a :class:`~lmfuse.distributed.cost_model.CostModel` (or the path of a
            results file to fit one to: ``lmfuse plan --calibrate``); each option then
            carries its predicted layer and step time.

    Returns a :class:`ShardingPlan`; the module docstring gives every formula.
    Raises TypeError / ValueError naming the argument.
    """
    batch = check_int(OP, "batch", batch, minimum=1)
    q_heads = check_int(OP, "q_heads", q_heads, minimum=1)
    kv_heads = check_int(OP, "kv_heads", kv_heads, minimum=1)
    ranks = check_int(OP, "ranks", ranks, minimum=1)
    context_len = check_int(OP, "context_len", context_len, minimum=1)
    head_dim = check_int(OP, "head_dim", head_dim, minimum=1)
    n_layers = check_int(OP, "n_layers", n_layers, minimum=1)
    s_active = check_int(OP, "s_active", s_active, minimum=1)
    if s_active > MAX_ACTIVE:
        raise ValueError(f"{OP}: s_active must be 1..{MAX_ACTIVE} (the planner models the "
                         f"decode regime of 1-{MAX_ACTIVE} active tokens), got {s_active}")
    hbm = check_number(OP, "hbm_gib", hbm_gib, allow_none=False)
    if not 0 < hbm <= 2.0**40:  # (so that int(hbm * 2**30) is a finite byte count)
        raise ValueError(f"{OP}: hbm_gib must be in (0, 2**40], got {hbm_gib}")
    cache_dtype = resolve_dtype(dtype)
    wire_dtype = (resolve_dtype(act_dtype, "act_dtype") if act_dtype is not None
                  else torch.bfloat16 if cache_dtype.itemsize == 1 else cache_dtype)
    if q_heads % kv_heads:
        raise ValueError(f"{OP}: q_heads ({q_heads}) must be a multiple of kv_heads "
                         f"({kv_heads}) (grouped-query attention)")
    if ranks % kv_heads and kv_heads % ranks:
        raise ValueError(
            f"{OP}: ranks ({ranks}) and kv_heads ({kv_heads}) must divide one another: "
            f"ranks a multiple of kv_heads (ranks/kv_heads ranks per KV head) or a divisor "
            f"of it (kv_heads/ranks KV heads per rank)")
    if q_heads % ranks:
        raise ValueError(f"{OP}: q_heads ({q_heads}) must be a multiple of ranks ({ranks}): "
                         f"the projections are tensor-parallel over all ranks, q_heads/ranks "
                         f"query heads each")

    if tp is None:
        tp = min(kv_heads, ranks)
    tp = check_int(OP, "tp", tp, minimum=1)
    if ranks % tp or kv_heads % tp:
        raise ValueError(f"{OP}: tp ({tp}) must divide ranks ({ranks}) and kv_heads "
                         f"({kv_heads})")
    m = _Model(batch, q_heads, kv_heads, ranks, context_len, head_dim, n_layers, s_active,
               cache_dtype.itemsize, wire_dtype.itemsize, int(hbm * 2**30), tp)
    r = ranks // tp
    rule_kvdp = r if batch >= r else max(k for k in _divisors(r) if k <= batch)
    # DESIGN's rule, unless its split does not fit in HBM while the most balanced one does
    # (an uneven batch split leaves its busiest rank holding more).
    balanced = min((k for k in _divisors(r) if k <= batch),
                   key=lambda k: (m.cells(k, r // k), -k))
    kvdp = rule_kvdp
    if (not m.split("rule", rule_kvdp, r // rule_kvdp).fits
            and m.split("balanced", balanced, r // balanced).fits):
        kvdp = balanced
    cp = r // kvdp

    options = (m.vanilla(), m.split("KVDP", r, 1), m.split("CP", 1, r),
               m.split("recommended", kvdp, cp))
    from .cost_model import CostModel

    model = CostModel.load(cost_model) if isinstance(cost_model, (str, Path)) else cost_model
    if not (model is None or isinstance(model, CostModel)):
        raise TypeError(f"{OP}: cost_model must be a CostModel, a results file's path or None, "
                        f"got {type(cost_model).__name__}")
    if model is not None:  # each option's predicted layer (and step) time
        parts = [model.layer_ms(kvdp=o.kvdp, cp=o.cp, batch=m.B, s_active=m.s,
                                q_local=m.Hq // m.N, h_attn=m.Hq // o.tp, head_dim=m.D,
                                kv_bytes=o.kv_bytes_per_rank / m.L, act_bytes=m.a)
                 for o in options]
        options = tuple(replace(o, predicted_layer_ms=p, predicted_step_ms=p["total"] * m.L)
                        for o, p in zip(options, parts))
    best = options[-1]
    reason = _reason(m, options, tp, r, rule_kvdp, hbm)
    inputs = {"batch": batch, "q_heads": q_heads, "kv_heads": kv_heads, "ranks": ranks,
              "context_len": context_len, "head_dim": head_dim, "n_layers": n_layers,
              "dtype": _dtype_name(cache_dtype), "hbm_gib": hbm, "s_active": s_active,
              "act_dtype": _dtype_name(wire_dtype)}
    return ShardingPlan(tp=best.tp, kvdp=best.kvdp, cp=best.cp,
                        kv_bytes_per_rank=best.kv_bytes_per_rank, fits=best.fits,
                        replication=best.replication, collectives=best.collectives,
                        collective_bytes_per_step=best.collective_bytes_per_step,
                        options=options, reason=reason, inputs=inputs,
                        cost_model=None if model is None else model.summary())


def _dtype_name(dtype: torch.dtype) -> str:
    return _SHORT.get(dtype, dtype_name(dtype))


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass(frozen=True)
class _Model:
    B: int
    Hq: int
    Hkv: int
    N: int
    S: int
    D: int
    L: int
    s: int
    e: int  # bytes per cache element
    a: int  # bytes per activation element on the wire
    hbm_bytes: int
    tp: int  # ways the KV heads are split

    def cells(self, kvdp: int, cp: int) -> int:
        """Sequences x tokens on the busiest rank of a KVDP x CP split."""
        return math.ceil(self.B / kvdp) * math.ceil(self.S / cp)

    def kv_bytes(self, heads: int, seqs: int, tokens: int) -> int:
        return 2 * self.L * tokens * heads * self.D * self.e * seqs

    def _option(self, name: str, split: str, tp: int, kvdp: int, cp: int, heads: int,
                seqs: int, tokens: int, replication: int,
                collectives: tuple[Collective, ...]) -> ShardingOption:
        kv = self.kv_bytes(heads, seqs, tokens)
        return ShardingOption(
            name=name, split=split, tp=tp, kvdp=kvdp, cp=cp, kv_heads_held=heads,
            sequences_held=seqs, tokens_held=tokens, kv_bytes_per_rank=kv,
            fits=kv <= self.hbm_bytes, replication=replication, collectives=collectives,
            collectives_per_step=self.L * sum(c.count for c in collectives),
            collective_bytes_per_step=self.L * sum(c.count * c.bytes_per_rank
                                                   for c in collectives))

    def vanilla(self) -> ShardingOption:
        heads = max(1, self.Hkv // self.N)
        return self._option("vanilla TP", f"TP{self.N}", self.N, 1, 1, heads, self.B, self.S,
                            max(1, self.N // self.Hkv), ())

    def split(self, name: str, kvdp: int, cp: int) -> ShardingOption:
        tp = self.tp
        r = kvdp * cp
        q_local = self.Hq // self.N
        h_attn = self.Hq // tp
        b = math.ceil(self.B / kvdp)
        group = "KVDP" if cp == 1 else "CP" if kvdp == 1 else "KVDP x CP"
        collectives: list[Collective] = []
        if r > 1:
            collectives.append(Collective(
                "all-gather q", group, r, 1, (r - 1) * self.B * self.s * q_local * self.D * self.a))
        if cp > 1:
            collectives.append(Collective(
                "all-gather out+lse", "CP", cp, 1,
                (cp - 1) * b * self.s * h_attn * (self.D + 1) * LSE_BYTES))
        if kvdp > 1:
            collectives.append(Collective(
                "all-gather out", "KVDP", kvdp, 1,
                (kvdp - 1) * b * self.s * h_attn * self.D * self.a))
        text = " x ".join([f"TP{tp}"] + [f"{n}{k}" for n, k in (("KVDP", kvdp), ("CP", cp))
                                         if k > 1])
        return self._option(name, text, tp, kvdp, cp, self.Hkv // tp, b,
                            math.ceil(self.S / cp), 1, tuple(collectives))


def _reason(m: _Model, options: tuple[ShardingOption, ...], tp: int, r: int, rule_kvdp: int,
            hbm: float) -> str:
    vanilla, kvdp_only, cp_only, best = options
    gib = format_bytes
    default_tp = tp == min(m.Hkv, m.N)
    per_head = f"ranks/kv_heads={r}" if default_tp else f"ranks/TP={r}"
    with_tp = f"TP=kv_heads={tp}" if default_tp and tp == m.Hkv else f"TP={tp}"
    if r == 1:
        why = (f"ranks={m.N} <= kv_heads={m.Hkv}: TP={tp} gives every rank "
               f"{m.Hkv // tp} whole KV head(s), no KV head is replicated and nothing is left "
               f"to split, so KVDP and CP do not apply.")
    else:
        if m.B >= r:
            why = (f"B={m.B} >= {per_head}: with {with_tp}, the {r} ranks "
                   f"sharing a KV head can split the batch (KVDP={r}).")
        else:
            why = (f"B={m.B} < {per_head}: with {with_tp}, too few sequences "
                   f"for KVDP={r} alone (its busiest rank would hold a whole {m.S}-token "
                   f"sequence, {gib(kvdp_only.kv_bytes_per_rank)}, while others of its group "
                   f"sit idle).")
        if best.kvdp != rule_kvdp:
            ruled = m.split("rule", rule_kvdp, r // rule_kvdp)
            why += (f" The plain rule would take {ruled.split}, which does not fit: B={m.B} "
                    f"does not split evenly over KVDP={rule_kvdp}, so its busiest rank would hold "
                    f"{ruled.sequences_held} sequence(s) x {ruled.tokens_held} tokens "
                    f"({gib(ruled.kv_bytes_per_rank)}), against {best.sequences_held} x "
                    f"{best.tokens_held} ({gib(best.kv_bytes_per_rank)}) with {best.split}.")
        if best.cp == 1:
            why += (f" {best.split}: each rank holds {best.sequences_held} whole sequence(s) "
                    f"of its KV head; 2 all-gathers per layer (q in, outputs back), "
                    f"{gib(best.collective_bytes_per_step)} per rank per step, against "
                    f"{gib(cp_only.collective_bytes_per_step)} for CP={r} (float32 partials).")
        else:
            held = (f"{best.sequences_held} sequence(s), each" if best.kvdp > 1
                    else "every sequence,")
            why += (f" {best.split}: each rank holds {held} as a {best.tokens_held}-token "
                    f"slice of its KV head; {len(best.collectives)} all-gathers per layer, "
                    f"{gib(best.collective_bytes_per_step)} per rank per step.")
        why += (f" Vanilla TP over {m.N} ranks would replicate every KV head "
                f"{vanilla.replication}x: {gib(vanilla.kv_bytes_per_rank)} per rank against "
                f"{gib(best.kv_bytes_per_rank)}.")
    if best.fits:
        fit = f" It fits: {gib(best.kv_bytes_per_rank)} of KV cache per rank of {hbm:g} GiB."
    else:
        total = m.kv_bytes(m.Hkv, m.B, m.S)
        fp8 = " or an fp8 cache" if m.e > 1 else ""
        fit = (f" Nothing fits: even {best.split} needs {gib(best.kv_bytes_per_rank)} of KV "
               f"cache per rank, more than hbm_gib={hbm:g} (the whole cache is {gib(total)}, "
               f"{gib(math.ceil(total / m.N))} per rank at best); use more ranks, a shorter "
               f"context, a smaller batch{fp8}.")
    return why + fit
