"""Benchmark ``lmfuse.cross_entropy`` against torch eager, torch.compile, Liger-Kernel and
Megatron-Core.

Run it as ``lmfuse bench cross_entropy [--json PATH] [--plot PATH] [--quick]``. The cases
are bf16 logits ``[8192, V]`` for V = 32000, 128256 and 262144, targets random with about
5% ignored (-100), ``reduction="mean"``: forward+backward (``torch.autograd.grad(loss,
logits)``, the upstream gradient 1 of ``loss.backward()``) and forward only (no grad).
For V = 128256 also ``inplace_backward=True``, and label smoothing 0.1 + z-loss 1e-4 +
softcap 30 against the peers that take those options.

Every case reports the median time, the achieved TB/s over the *minimal* bytes (forward
+ backward: one read of the logits and one write of the gradient, 2 N V x 2 B; forward:
one read), each peer's time as a multiple of lmfuse's, and the peak memory allocated
beyond the inputs: lmfuse's target is the gradient buffer and nothing more (nothing at
all with ``inplace_backward`` or forward only). A device-to-device copy of the V = 128256
logits, timed in the same run, is the bandwidth ceiling.

An op that overwrites its logits (lmfuse with ``inplace_backward=True`` and Liger write
the gradient over them; Megatron its softmax, but only over float32 logits: bf16 ones
it copies to float32 first) gets a scratch tensor that each timed call first restores
from the logits with ``copy_``. That copy is timed alone and subtracted (``Case.overhead``;
the note gives its time), and as it writes into a buffer allocated beforehand it adds
nothing to the peak memory. (The op then also pays for writing back the copy's last
dirty L2 lines, at most the L2 size: about 1% of the bytes of the V = 128256 case.)

Peers: ``torch`` is ``F.cross_entropy(logits.float(), target)`` (the float32 math users
write), ``torch(bf16)`` the same on the bf16 logits, ``torch.compile`` the first compiled
with ``fullgraph=True``, ``liger`` ``liger_kernel.transformers.functional.
liger_cross_entropy``, ``megatron-core`` ``fused_vocab_parallel_cross_entropy`` on a
one-rank group (a one-rank torch.distributed group is made if none exists; logits viewed
as ``[s, b, V] = [N, 1, V]``; it has no ignore_index, so its per-token loss is masked and
averaged over the valid tokens, as Megatron's loss function does; it takes no smoothing,
z-loss or softcap, and keeps a float32 softmax ``[N, V]`` for backward, 2x the bf16
logits, in its peak memory). A peer that is not installed or
cannot run a case is a row with a note, not a crash. Each row's loss is checked once
against lmfuse's; a relative difference over 1e-4 is noted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

import lmfuse
from lmfuse._launch import cdiv, dtype_name
from lmfuse.bench.common import (Case, LossCheck, Result, cell, compile_per_shape, dist_version,
                                 finish, measure_copy, print_peers, run_cases, start, unavailable)

IGNORE = -100
OPTIONS = {"label_smoothing": 0.1, "z_loss": 1e-4, "softcap": 30.0}

LossFn = Callable[[torch.Tensor, torch.Tensor, dict], torch.Tensor]


def eager_cross_entropy(logits, target, label_smoothing=0.0, z_loss=0.0, softcap=None):
    """The unfused expression a user writes (float32 math), also the torch.compile input."""
    x = logits.float()
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    if not z_loss:
        return F.cross_entropy(x, target, ignore_index=IGNORE, label_smoothing=label_smoothing)
    valid = target != IGNORE
    loss = F.cross_entropy(x, target, ignore_index=IGNORE, label_smoothing=label_smoothing,
                           reduction="none")
    loss = loss + z_loss * torch.logsumexp(x, dim=-1).square() * valid
    return loss.sum() / valid.sum().clamp(min=1)


_compiled = compile_per_shape(eager_cross_entropy)


def _liger() -> tuple[LossFn, str]:
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy
    except Exception as exc:  # not installed, or its import needs what is missing here
        return unavailable(exc), f"unavailable ({type(exc).__name__})"

    def loss(x, t, opts):
        return liger_cross_entropy(
            x, t, ignore_index=IGNORE, label_smoothing=opts.get("label_smoothing", 0.0),
            lse_square_scale=opts.get("z_loss", 0.0), softcap=opts.get("softcap"))

    return loss, dist_version("liger-kernel")


def _megatron(device: torch.device) -> tuple[LossFn, str]:
    try:
        import torch.distributed as dist
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                    store=dist.HashStore(), rank=0, world_size=1)
        if dist.get_world_size() != 1:
            raise RuntimeError("the benchmark runs in one process; found a larger world")
        group = dist.group.WORLD
    except Exception as exc:  # not installed, or no process group can be made here
        return unavailable(exc), f"unavailable ({type(exc).__name__})"

    def loss(x, t, opts):
        n, V = x.shape
        valid = t != IGNORE
        per_token = fused_vocab_parallel_cross_entropy(x.view(n, 1, V), t.view(n, 1), group)
        return (per_token.view(n) * valid).sum() / valid.sum().clamp(min=1)

    return loss, dist_version("megatron-core")


def load_peers(device: torch.device) -> dict[str, tuple[LossFn, str]]:
    """Peer name -> (loss function ``(logits [N, V], target [N], options) -> loss``, version).

    Megatron needs torch.distributed: a one-rank group is made here if none exists."""
    return {"liger": _liger(), "megatron-core": _megatron(device)}


class Inputs:
    """Logits ``[n, V]`` (requires grad) and targets ``[n]`` (~5% ignored), shared by a V's
    cases, and a scratch tensor for the ops that overwrite their logits."""

    def __init__(self, n: int, V: int, dtype: torch.dtype, device: torch.device):
        self.n, self.V = n, V
        self.logits = torch.randn(n, V, dtype=dtype, device=device).requires_grad_(True)
        self.target = torch.randint(0, V, (n,), device=device)
        self.target[torch.rand(n, device=device) < 0.05] = IGNORE

    @functools.cached_property
    def scratch(self) -> torch.Tensor:
        return torch.empty_like(self.logits).requires_grad_(True)

    def restore(self) -> None:
        with torch.no_grad():
            self.scratch.copy_(self.logits)


class CECase(Case):
    """A case with lmfuse's memory target: the gradient buffer (0 in place or forward only)."""

    def __init__(self, *args, target_mib: float = 0.0, state_mib: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.target_mib = target_mib
        self.state_mib = state_mib  # O(N) per-token state the op may keep besides


def make_case(data: Inputs, peers: dict, *, kind: str, backward: bool) -> CECase:
    n, V, dtype = data.n, data.V, data.logits.dtype
    opts = OPTIONS if kind == "smooth+z+cap" else {}
    logits = data.logits if backward else data.logits.detach()
    impls: dict[str, Callable[[], object]] = {}
    notes: dict[str, str] = {}
    overhead: dict[str, Callable[[], object]] = {}
    check = LossCheck(notes)

    def add(impl: str, loss_fn: LossFn, note: str = "", overwrites_logits: bool = False):
        """Time ``loss_fn`` as ``impl``; one that overwrites its logits runs on the scratch
        copy, restored before each call, and the restore's time is subtracted."""
        x, restore = logits, None
        if overwrites_logits:
            x, restore = (data.scratch if backward else data.scratch.detach()), data.restore
            overhead[impl] = restore

        def run():
            if restore is not None:
                restore()
            if backward:
                loss = loss_fn(x, data.target, opts)
                out = torch.autograd.grad(loss, x)
            else:
                with torch.no_grad():
                    loss = out = loss_fn(x, data.target, opts)
            check(impl, loss)
            return out

        impls[impl] = run
        if note:
            notes[impl] = note

    def ours(inplace: bool) -> LossFn:
        return lambda x, t, o: lmfuse.cross_entropy(x, t, inplace_backward=inplace, **o)

    liger, _ = peers["liger"]
    liger_note = ("gradient over the logits in forward; host sync (.item()) per call"
                  if backward else "host sync (.item()) per call")
    if kind == "inplace":
        add("lmfuse", ours(True), "inplace_backward=True", overwrites_logits=True)
        add("lmfuse(out-of-place)", ours(False))
        add("liger", liger, liger_note, overwrites_logits=backward)
    else:
        add("lmfuse", ours(False))
        add("torch", lambda x, t, o: eager_cross_entropy(x, t, **o),
            "F.cross_entropy(logits.float())")
        if kind == "plain" and dtype != torch.float32:
            add("torch(bf16)", lambda x, t, o: F.cross_entropy(x, t, ignore_index=IGNORE),
                "F.cross_entropy on the bf16 logits")
        add("torch.compile", lambda x, t, o: _compiled(x, t, **o), "fullgraph, of the torch row")
        add("liger", liger, liger_note, overwrites_logits=backward)
        if kind == "plain":
            # Its in-place softmax lands on a float32 copy of bf16 logits, on float32 ones
            # themselves (the CPU --quick run).
            megatron, _ = peers["megatron-core"]
            add("megatron-core", megatron, "tp=1; float32 softmax [N, V] kept for backward",
                overwrites_logits=dtype == torch.float32)

    mode = "fwd+bwd" if backward else "fwd"
    name = f"{kind} {mode} [{n}, {V}] {dtype_name(dtype)}"
    elt = data.logits.element_size()
    nbytes = n * V * elt * (2 if backward else 1)
    target_mib = n * V * elt / 2**20 if backward and kind != "inplace" else 0.0
    # The issue allows O(N) per-token state: [4, N] float32 stats and, for rows cut in
    # slices, 16 bytes per token and slice (a slice is at least 16384 columns: under 0.05%
    # of bf16 logits), rounded up to the caching allocator's 2 MiB segments.
    state_bytes = 16 * n * (1 + cdiv(V, 16384))
    state_mib = 2.0 * cdiv(state_bytes, 2**21)
    return CECase(name, nbytes, impls, notes, overhead, target_mib=target_mib,
                  state_mib=state_mib)


def build_cases(device: torch.device, quick: bool, peers: dict) -> list[CECase]:
    dtype = torch.float32 if quick else torch.bfloat16
    n, vocabs = (32, (1000, 5000)) if quick else (8192, (32000, 128256, 262144))
    cases = []
    for V in vocabs:
        data = Inputs(n, V, dtype, device)
        cases += [make_case(data, peers, kind="plain", backward=True),
                  make_case(data, peers, kind="plain", backward=False)]
        if V == vocabs[1]:
            cases += [make_case(data, peers, kind="inplace", backward=True),
                      make_case(data, peers, kind="smooth+z+cap", backward=True)]
    return cases


def print_targets(cases: list[CECase], results: list[Result], copy_bw: float) -> None:
    """lmfuse per case: share of the copy ceiling, its fastest peer, memory against target."""
    print("\n# lmfuse against its targets: TB/s as a share of the copy's; the fastest peer's "
          "time as a multiple of lmfuse's (> 1: lmfuse is faster); peak extra memory against "
          "the gradient buffer (0 in place or forward only) plus O(N) per-token state")
    print(f"{'case':<44} {'TB/s':>6} {'% copy':>6}  {'fastest peer':<20} {'x lmfuse':>8} "
          f"{'peak MiB':>9} {'target':>9}")
    for case in cases:
        rows = [r for r in results if r.case == case.name]
        ours = next((r for r in rows if r.impl == "lmfuse"), None)
        if ours is None or ours.ms is None:
            print(f"{case.name:<44} lmfuse did not run")
            continue
        share = f"{100 * ours.tbps / copy_bw:5.0f}%" if copy_bw else "-"
        others = [r for r in rows if not r.impl.startswith("lmfuse") and r.ms]
        best = min(others, key=lambda r: r.ms, default=None)
        peer = f"{best.impl:<20} {best.ratio:8.2f}" if best else f"{'-':<20} {'-':>8}"
        mem, target = ours.peak_extra_mib, case.target_mib
        verdict = ("" if mem is None else
                   "  ok" if mem <= target + case.state_mib else "  OVER")
        print(f"{case.name:<44} {ours.tbps:6.2f} {share:>6}  {peer} {cell(mem, '9.1f')} "
              f"{target:9.1f}{verdict}")


def main(argv: list[str] | None = None) -> int:
    args, device, quick, env = start("lmfuse bench cross_entropy", __doc__, argv)
    owns_group = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    peers = load_peers(device)
    print_peers(env, {name: v for name, (_, v) in peers.items()})
    copy = measure_copy(8192 * 128256 * 2 if not quick else 32 * 5000 * 4, device)
    print("# TB/s over minimal bytes (fwd+bwd: read logits + write gradient; fwd: read "
          "logits); x lmfuse = ms / lmfuse ms (> 1: lmfuse is faster); peak MiB: allocated "
          "beyond the inputs")
    try:
        cases = build_cases(device, quick, peers)
        results = run_cases(cases, device)
        print_targets(cases, results, copy["tbps"])
    finally:
        if owns_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return finish(args, env, copy, results,
                  f"cross_entropy on {env['device']} (copy: {copy['tbps']:.2f} TB/s)")


if __name__ == "__main__":
    raise SystemExit(main())
