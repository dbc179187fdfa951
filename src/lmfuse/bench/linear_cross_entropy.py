"""Benchmark ``lmfuse.linear_cross_entropy`` against the three GEMMs it cannot avoid, torch
eager, torch.compile, Liger-Kernel and Apple's Cut Cross-Entropy.

Run it as ``lmfuse bench linear_cross_entropy [--json PATH] [--plot PATH] [--quick]`` or
``python -m lmfuse.bench.linear_cross_entropy ...``. Each case is bf16 hidden states
``[N, H]``, H = 4096, a classifier ``weight [V, H]``, targets random with about 5% ignored
(-100), ``reduction="mean"``, timed forward+backward: ``torch.autograd.grad(loss, [hidden,
weight])`` (the upstream gradient 1 of ``loss.backward()``). Shapes: N = 8192 with
V = 32000, 128256 and 262144, and N = 65536 with V = 128256. ``--quick`` (the default
without CUDA) runs tiny float32 shapes, N = 64, H = 32, V = 1000 and 5000: a smoke test,
whose figures are not GPU performance.

Rows, one per implementation:

* ``lmfuse``: ``lmfuse.linear_cross_entropy`` with its default chunk budget;
* ``floor (3 GEMMs)``: the three cuBLAS GEMMs every implementation must do, back to back,
  ``L = x @ W.T`` ``[N, V]``, ``dX = G @ W`` and ``dW = G.T @ x``, where ``G`` is an
  ``[N, V]`` tensor in the inputs' dtype allocated before timing (so its allocation is not
  timed), each GEMM as ``A @ B`` or ``(B.T @ A.T).T``, whichever cuBLAS runs faster (the
  note lists the swapped ones). This is the time ceiling: the target is lmfuse <= 1.05 x
  floor. Its peak memory is L, dX and dW but not G (N V x 2 B), so it is *not* what a usable
  op would need;
* ``torch``: ``F.cross_entropy((x @ W.T).float(), target)``, the expression users write;
* ``torch.compile``: that function compiled with ``fullgraph=True``;
* ``liger``: ``liger_kernel.transformers.functional.liger_fused_linear_cross_entropy``
  (its defaults: logits chunks of about N x H elements, the weight gradient summed over
  chunks in the weight's dtype, a host sync per call);
* ``cut-cross-entropy``: ``cut_cross_entropy.linear_cross_entropy(hidden, weight, target)``
  with its default ``filter_eps`` (``"auto"`` in its current sources, ``"high"`` in the
  25.1.1 release; the note says which: it skips gradient blocks it judges negligible), and
  ``cce(filter_eps=None)``: the same with no filtering (exact gradient).

A peer that is not installed is a row noted "unavailable", and one that cannot run a case
(on CPU, say, or out of GPU memory: torch's ``[N, V]`` float32 logits at N = 65536 are
32 GiB, and autograd keeps more) a row noted "failed" with the exception, not a crash.
``common.run_cases`` catches it, ``torch.OutOfMemoryError`` included, and empties the CUDA
cache after every row.

Reported per row: the median time; the ``TB/s`` column (and ``tbps`` in the JSON) holds
**TFLOP/s** over the three GEMMs' 6 N V H flops, the work every row does at least, since
this op is compute-bound; the time as a multiple of lmfuse's (> 1: lmfuse is faster); and
the peak memory allocated beyond the inputs, gradients included. Only one case's tensors
are alive at a time (made on the case's first, untimed, call), and ``G`` only while the
floor row runs, so no case or row pays for another's memory.

Correctness, once per case: lmfuse's loss against the torch row's loss, computed apart in
chunks of tokens without autograd (so also where the torch row runs out of memory), is in
lmfuse's note; every other row's loss is checked against lmfuse's and a relative
difference over 1e-4 is noted. A summary then gives lmfuse against its targets: its time
as a multiple of the floor's (target <= 1.05), and its peak memory against Cut
Cross-Entropy's and against its own budget, ``dhidden + dweight + one logits chunk``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F

import lmfuse
from lmfuse._launch import cdiv, dtype_name
from lmfuse.bench.common import (Case, LossCheck, Result, bench_ms, cell, compile_per_shape,
                                 dist_version, finish, print_peers, run_cases, start, unavailable)
from lmfuse.cross_entropy.linear_config import chunk_rows

IGNORE = -100
FLOOR = "floor (3 GEMMs)"
CCE = "cut-cross-entropy"
TIME_TARGET = 1.05  # lmfuse time / floor time

# (hidden [N, H], weight [V, H], target [N]) -> scalar loss
LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def eager_linear_cross_entropy(hidden, weight, target):
    """The unfused expression a user writes (float32 softmax), also the torch.compile input."""
    return F.cross_entropy((hidden @ weight.T).float(), target, ignore_index=IGNORE)


_compiled = compile_per_shape(eager_linear_cross_entropy)


def _liger() -> tuple[LossFn, str]:
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except Exception as exc:  # not installed, or its import needs what is missing here
        return unavailable(exc), f"unavailable ({type(exc).__name__})"

    def loss(h, w, t):
        return liger_fused_linear_cross_entropy(h, w, t, ignore_index=IGNORE, reduction="mean")

    return loss, dist_version("liger-kernel")


def _cut_cross_entropy() -> tuple[LossFn, LossFn, str, str]:
    """Cut Cross-Entropy with its default ``filter_eps`` and without gradient filtering, its
    version, and that default (``"auto"`` in recent sources, ``"high"`` in 25.1.1)."""
    try:
        from cut_cross_entropy import linear_cross_entropy as cce
    except Exception as exc:  # not installed, or its import needs what is missing here
        fail = unavailable(exc)
        return fail, fail, f"unavailable ({type(exc).__name__})", "?"
    param = inspect.signature(cce).parameters.get("filter_eps")
    default_eps = repr(param.default) if param is not None else "?"

    def default(h, w, t):
        return cce(h, w, t, ignore_index=IGNORE, reduction="mean")

    def exact(h, w, t):
        return cce(h, w, t, ignore_index=IGNORE, reduction="mean", filter_eps=None)

    return default, exact, dist_version("cut-cross-entropy"), default_eps


def load_peers() -> tuple[dict[str, LossFn], dict[str, str], dict[str, str]]:
    """(row name -> loss function, distribution -> version, row name -> note)."""
    liger, liger_version = _liger()
    cce, cce_exact, cce_version, cce_eps = _cut_cross_entropy()
    return ({"liger": liger, CCE: cce, "cce(filter_eps=None)": cce_exact},
            {"liger": liger_version, CCE: cce_version},
            {"liger": "dW summed over chunks in the weight dtype; host sync per call",
             CCE: f"filter_eps={cce_eps} (its default)",
             "cce(filter_eps=None)": "no gradient filtering"})


class Inputs:
    """One case's hidden ``[n, H]`` and weight ``[V, H]`` (both requiring grad) and targets
    ``[n]`` (~5% ignored), from a generator seeded by the shape (reproducible in any order).
    The weight is scaled by ``H ** -0.5`` so that the logits are about unit variance."""

    def __init__(self, n: int, H: int, V: int, dtype: torch.dtype, device: torch.device):
        gen = torch.Generator(device=device)
        gen.manual_seed(1_000_003 * n + 1009 * H + V)
        self.n, self.H, self.V = n, H, V
        self.hidden = torch.randn(n, H, generator=gen, dtype=dtype, device=device)
        self.hidden.requires_grad_(True)
        self.weight = torch.randn(V, H, generator=gen, dtype=dtype, device=device)
        self.weight.mul_(H ** -0.5).requires_grad_(True)
        self.target = torch.randint(0, V, (n,), generator=gen, device=device)
        ignored = torch.rand(n, generator=gen, device=device) < 0.05
        self.target[ignored] = IGNORE


class Workspace:
    """The tensors of one case at a time: a case's first call (untimed: ``bench_ms`` warms up
    first) makes its inputs and frees the previous case's; the floor's ``G`` lives only
    until another row asks for the inputs."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.dtype, self.device = dtype, device
        self.key: tuple[int, int, int] | None = None
        self.data: Inputs | None = None
        self._grad: torch.Tensor | None = None

    def inputs(self, n: int, H: int, V: int, keep_grad: bool = False) -> Inputs:
        if not keep_grad:
            self._grad = None
        if self.key != (n, H, V):
            self.data = self._grad = None  # free the previous case's before allocating
            self.data = Inputs(n, H, V, self.dtype, self.device)
            self.key = (n, H, V)
        return self.data

    def logits_grad(self) -> torch.Tensor:
        """The floor's stand-in ``G [n, V]`` for the current case, made once: values of a
        real gradient's magnitude (about 1 / V), so the GEMMs see no trivial bits."""
        if self._grad is None:
            d = self.data
            self._grad = torch.empty(d.n, d.V, dtype=self.dtype, device=self.device)
            self._grad.normal_(0.0, 1.0 / d.V)
        return self._grad


def torch_loss(d: Inputs, max_chunk_bytes: int = 2**30) -> float:
    """The torch row's loss, ``F.cross_entropy((x @ W.T).float(), t)``, by chunks of tokens
    whose float32 logits fit ``max_chunk_bytes``, without autograd: it fits any N."""
    rows = max(1, max_chunk_bytes // (4 * d.V))
    x, w = d.hidden.detach(), d.weight.detach()
    with torch.no_grad():
        total = torch.zeros((), dtype=torch.float64, device=x.device)
        for r0 in range(0, d.n, rows):
            logits = (x[r0:r0 + rows] @ w.T).float()
            total += F.cross_entropy(logits, d.target[r0:r0 + rows], ignore_index=IGNORE,
                                     reduction="sum").double()
        count = (d.target != IGNORE).sum().clamp(min=1)
        return float(total / count)


class LCECase(Case):
    """A case with what the summary needs: the shape, the floor's ``G`` size and lmfuse's
    memory budget (the gradients of hidden and weight plus one logits chunk)."""

    def __init__(self, *args, n: int, H: int, V: int, g_mib: float, budget_mib: float,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.n, self.H, self.V = n, H, V
        self.g_mib = g_mib
        self.budget_mib = budget_mib


def make_case(ws: Workspace, peers: dict[str, LossFn], peer_notes: dict[str, str], n: int,
              H: int, V: int) -> LCECase:
    dtype, device = ws.dtype, ws.device
    impls: dict[str, Callable[[], object]] = {}
    notes: dict[str, str] = {}
    check = LossCheck(notes, lambda: torch_loss(ws.inputs(n, H, V)))

    def add(impl: str, loss_fn: LossFn, note: str = "") -> None:
        """Time ``loss_fn`` forward+backward as ``impl``: the gradients of hidden and weight."""

        def run():
            d = ws.inputs(n, H, V)
            loss = loss_fn(d.hidden, d.weight, d.target)
            grads = torch.autograd.grad(loss, [d.hidden, d.weight])
            check(impl, loss)
            return grads

        impls[impl] = run
        if note:
            notes[impl] = note

    # Each floor GEMM as A @ B or as (B.T @ A.T).T, whichever cuBLAS runs faster here
    # (chosen on the floor's first, untimed, call): the same flops and bytes, but cuBLAS's
    # heuristics pick different kernels for the two layouts, and at some shapes one of them
    # is far off (H100, V = 128256: the plain floor measured slower than torch.compile).
    forms: dict[str, bool] = {}

    def gemm(name: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if name not in forms:
            plain = bench_ms(lambda: a @ b, device, warmup=10, rep=150)
            swapped = bench_ms(lambda: (b.T @ a.T).T, device, warmup=10, rep=150)
            forms[name] = swapped < plain
        return (b.T @ a.T).T if forms[name] else a @ b

    def floor():
        d = ws.inputs(n, H, V, keep_grad=True)
        g = ws.logits_grad()
        x, w = d.hidden.detach(), d.weight.detach()
        logits = gemm("L", x, w.T)
        del logits  # a fused op consumes its logits: only the gradients are returned
        return gemm("dX", g, w), gemm("dW", g.T, x)

    elt = torch.empty((), dtype=dtype).element_size()
    g_mib = n * V * elt / 2**20
    rows = chunk_rows(n, V, elt, device)
    add("lmfuse", lambda h, w, t: lmfuse.linear_cross_entropy(h, w, t, ignore_index=IGNORE),
        f"{cdiv(n, rows)} chunk(s) of {rows} tokens")
    impls[FLOOR] = floor
    notes[FLOOR] = lambda: (f"peak excludes G [N, V] ({g_mib:.1f} MiB, preallocated); as "
                            "(B.T @ A.T).T: " + (", ".join(k for k, v in forms.items() if v)
                                                 or "none"))
    add("torch", eager_linear_cross_entropy, "F.cross_entropy((x @ W.T).float())")
    add("torch.compile", _compiled, "fullgraph, of the torch row")
    for peer, loss_fn in peers.items():
        add(peer, loss_fn, peer_notes[peer])

    name = f"fwd+bwd N={n} H={H} V={V} {dtype_name(dtype)}"
    flops = 6 * n * V * H  # three [N, V, H] GEMMs, 2 flops per multiply-add
    budget_mib = ((n + V) * H + rows * V) * elt / 2**20
    return LCECase(name, flops, impls, notes, n=n, H=H, V=V, g_mib=g_mib,
                   budget_mib=budget_mib)


def build_cases(device: torch.device, quick: bool, peers: dict[str, LossFn],
                peer_notes: dict[str, str]) -> list[LCECase]:
    if quick:
        dtype, H, shapes = torch.float32, 32, [(64, 1000), (64, 5000)]
    else:
        dtype, H = torch.bfloat16, 4096
        shapes = [(8192, 32000), (8192, 128256), (8192, 262144), (65536, 128256)]
    ws = Workspace(dtype, device)
    return [make_case(ws, peers, peer_notes, n, H, V) for n, V in shapes]


def print_targets(cases: list[LCECase], results: list[Result]) -> None:
    """lmfuse per case: time against the floor's, peak memory against its budget and CCE's."""
    print(f"\n# lmfuse against its targets: time as a multiple of the floor's (the three "
          f"GEMMs; target <= {TIME_TARGET}); peak extra memory against its budget (dhidden + "
          f"dweight + one logits chunk, plus O(N) per-token state) and against "
          f"{CCE}'s (default filter_eps)")
    print(f"{'case':<44} {'ms':>9} {'floor ms':>9} {'x floor':>7} {'':<4} {'peak MiB':>9} "
          f"{'budget':>9} {'cce MiB':>9} {'x cce':>6}")
    for case in cases:
        rows = {r.impl: r for r in results if r.case == case.name}
        ours, floor, cce = rows.get("lmfuse"), rows.get(FLOOR), rows.get(CCE)
        if ours is None or ours.ms is None:
            print(f"{case.name:<44} lmfuse did not run")
            continue
        floor_ms = floor.ms if floor else None
        x_floor = ours.ms / floor_ms if floor_ms else None
        verdict = "" if x_floor is None else "ok" if x_floor <= TIME_TARGET else "OVER"
        mem = ours.peak_extra_mib
        cce_mem = cce.peak_extra_mib if cce and cce.ms else None
        x_cce = mem / cce_mem if (mem is not None and cce_mem) else None
        print(f"{case.name:<44} {ours.ms:9.4f} {cell(floor_ms, '9.4f')} "
              f"{cell(x_floor, '7.3f')} {verdict:<4} {cell(mem, '9.1f')} "
              f"{case.budget_mib:9.1f} {cell(cce_mem, '9.1f')} {cell(x_cce, '6.2f')}")


def main(argv: list[str] | None = None) -> int:
    args, device, quick, env = start("lmfuse bench linear_cross_entropy", __doc__, argv,
                                     plot_what="achieved TFLOP/s")
    peers, versions, peer_notes = load_peers()
    print_peers(env, versions)
    env["tbps"] = "TFLOP/s over the three GEMMs' 6 N V H flops (this op is compute-bound)"
    print("# forward+backward (grads of hidden and weight); the TB/s column is TFLOP/s over "
          "6 N V H flops; x lmfuse = ms / lmfuse ms (> 1: lmfuse is faster); peak MiB: "
          "allocated beyond the inputs, gradients included")
    cases = build_cases(device, quick, peers, peer_notes)
    results = run_cases(cases, device)
    print_targets(cases, results)
    # No copy ceiling for this compute-bound op: the floor row is its ceiling.
    return finish(args, env, {}, results,
                  f"linear_cross_entropy fwd+bwd on {env['device']}: bars are TFLOP/s over "
                  "6 N V H flops (axis label says TB/s)")


if __name__ == "__main__":
    raise SystemExit(main())
