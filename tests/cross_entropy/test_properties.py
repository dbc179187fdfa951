"""Property tests (hypothesis) of ``cross_entropy`` and ``linear_cross_entropy``, NaN and
inf included, and the special values one by one, on both paths and every launch.

Oracles, in float64: ``F.cross_entropy`` of the logits as stored (for the linear op, of the
logits ``hidden @ weight.T + bias`` formed by the same GEMM in the inputs' dtype, as the op
forms them) where it has the options; ``cross_entropy_reference`` where it has not (z-loss,
softcap, and a mean over no token, which lmfuse defines as 0). Their NaN semantics are
``F.cross_entropy``'s (``test_property_reference_matches_torch``): a NaN or +inf logit
makes its token's loss and whole gradient row NaN, -inf logits are masked classes, a row of
-inf is NaN, an ignored token's loss is 0 (it never poisons a mean) and its gradient row
is NaN where its softmax is. Results must hold NaN, +inf and -inf exactly where the oracle
(rounded to their dtype) does, and their finite values within ``helpers.TOL`` (the loss,
float32, at float32's; gradients at their dtype's).

Drawn: shapes (``N`` 0, 1 and more; ``V`` 1, primes, rows over several chunks of the forced
small-chunk launches), float32/float16/bfloat16, int32/int64 targets, strided and offset
views (their padding NaN: the kernels must never read it), every option, upstream
gradients, the launch (each kernel variant the dispatcher can pick, forced through
``ops._config`` as in ``test_ops.py``), NaN/inf injections, and the vocabulary-parallel
path (``tp_group``) simulated in one process: every rank's collective is replaced by the
stats the other ranks' kernels give, so the merge kernel and the gradient kernels at a
vocabulary offset run as on a real group (``tests/distributed`` runs real gloo groups).

``LMFUSE_TEST_SCALE=n`` multiplies the drawn sizes (0 and 1 stay as they are), for a GPU
run (``LMFUSE_GPU_TESTS=1``: tensors on CUDA). Under Triton's interpreter numpy must raise
no floating-point warning (overflow, division by zero, invalid operation), except the
invalid operations by which a NaN arises from non-NaN inputs, as in PyTorch: a row of
nothing but -inf (``-inf - -inf``), and label smoothing's ``sum x`` over +inf and -inf.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import SCALE, assert_close, ce_config
from helpers import TEST_DEVICE as DEVICE
from hypothesis import given, settings
from hypothesis import strategies as st

import lmfuse
from lmfuse.cross_entropy import linear, ops, vocab_parallel
from lmfuse.cross_entropy import reference as ref

# The interpreter reduces tl.max with np.nanmax, which warns on an all-NaN slice (a row or
# chunk of NaN); the GPU's max.f32 reduction just gives NaN. Not a floating-point error of
# the kernels' arithmetic (those are checked with np.errstate below).
pytestmark = pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
NAN, INF = math.nan, math.inf
IGNORE = -100
REDUCTIONS = ("mean", "sum", "none")




def scaled(n: int) -> int:
    """A drawn size times ``SCALE``; 0 and 1 are edge cases and stay."""
    return n if n <= 1 else n * SCALE


# --- launches --------------------------------------------------------------------------

# Forced streamed launches chunk rows in BLOCK columns (16 here: V = 37 is three chunks, the
# last masked; larger with LMFUSE_TEST_SCALE, so GPU rows are not cut in thousands).
BLOCK = 16 * min(1 << (SCALE.bit_length() - 1), 256)
STREAMED = dict(BLOCK_M=1, BLOCK_V=BLOCK, SINGLE_BLOCK=False, num_warps=4)
# The stats-and-gradient pass of streamed rows (``fused``): every variant of the kernels.
FUSED = {
    "stream": dict(BLOCK_V=BLOCK, num_warps=4, programs_per_sm=2),
    "stream-hints": dict(BLOCK_V=BLOCK, num_warps=4, programs_per_sm=2, hints=1),
    "slices": dict(BLOCK_V=BLOCK, num_warps=4, programs_per_sm=2, slice=2 * BLOCK, lag=1),
    "slices-hints": dict(BLOCK_V=BLOCK, num_warps=4, programs_per_sm=2, slice=2 * BLOCK,
                         lag=2, hints=1),
    "vec-prefetch": dict(BLOCK_V=BLOCK, num_warps=4, programs_per_sm=1, hints=1, vec=8,
                         prefetch=1),
    "vec": dict(BLOCK_V=2 * BLOCK, num_warps=2, programs_per_sm=2, vec=4),
}
# "table": the device's tuning table (on the CPU: a single-block tile of 64 rows, so a
# tail tile); "tile-*": rows in registers, 1 or 4 a tile; the rest: streamed rows.
LAUNCHES = ("table", "tile-1row", "tile-4rows", *FUSED)


def launch_config(name: str, V: int) -> dict[str, Any] | None:
    """The ``ops._config`` result forced for launch ``name`` (None: the table's)."""
    if name == "table" or (name.startswith("tile") and V > 4096):
        return None
    if name.startswith("tile"):
        return dict(BLOCK_M=1 if name == "tile-1row" else 4,
                    BLOCK_V=max(16, 1 << (V - 1).bit_length()), SINGLE_BLOCK=True,
                    num_warps=4)
    return dict(STREAMED, fused=FUSED[name])


def force(mp: pytest.MonkeyPatch, config: dict[str, Any] | None) -> None:
    if config is not None:
        forced = ce_config(config)
        mp.setattr(ops, "_config", lambda V, device, softcap=False, itemsize=2, aligned=True:
                   forced)


def numpy_errors(forms_nan: bool):
    """The interpreter computes in numpy: overflow, division by zero and invalid operations
    raise, except invalid operations where the inputs make a NaN from non-NaN values."""
    return np.errstate(over="raise", divide="raise",
                       invalid="ignore" if forms_nan else "raise")


def forms_nan(x: torch.Tensor, target: torch.Tensor, kw: dict[str, Any],
              world: int = 1) -> bool:
    """Whether logits ``x [..., V]`` (``world`` ranks' shards of them) make a NaN out of
    non-NaN values, as PyTorch does too: a row (or shard) of -inf (``-inf - -inf``), +inf
    and -inf in one row (or shard) summed by label smoothing, or label smoothing 1 on a
    target logit of -inf (``0 * inf``). Softcapped logits are finite."""
    if kw.get("softcap") is not None or x.numel() == 0:
        return False
    x = x.detach().reshape(-1, x.shape[-1])
    t = target.reshape(-1).long()
    ls = kw.get("label_smoothing", 0.0)
    valid = t != kw.get("ignore_index", IGNORE)
    x_t = x.gather(1, torch.where(valid, t, 0)[:, None])[:, 0]
    if ls == 1.0 and ((x_t == -INF) & valid).any():
        return True
    for part in (x, *(x.chunk(world, dim=-1) if world > 1 else ())):
        if (part == -INF).all(dim=-1).any():
            return True
        if ls > 0 and ((part == INF).any(dim=-1) & (part == -INF).any(dim=-1)).any():
            return True
    return False


# --- comparison ------------------------------------------------------------------------


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, what: str,
                   tol_dtype: torch.dtype | None = None, pattern_only: bool = False) -> None:
    """NaN, +inf and -inf of ``actual`` exactly where ``expected`` (float64, rounded to
    ``actual``'s dtype) has them; unless ``pattern_only``, the finite values within
    ``TOL[tol_dtype]`` (default: ``actual``'s dtype)."""
    assert actual.shape == expected.shape, (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    got, want = actual.detach().cpu(), expected.detach().cpu().to(actual.dtype)
    for name, where in (("NaN", torch.isnan), ("+inf", torch.isposinf),
                        ("-inf", torch.isneginf)):
        a, e = where(got), where(want)
        if not torch.equal(a, e):
            at = (a != e).nonzero()[:4].tolist()
            raise AssertionError(
                f"{what}: {name} pattern differs at {at}: got "
                f"{[got[tuple(i)].item() for i in at]}, expected "
                f"{[expected[tuple(i)].item() for i in at]}")
    if pattern_only:
        return
    fin = torch.isfinite(want)
    assert_close(got[fin], want[fin], tol_dtype or actual.dtype, what)


def ce_options(kw: dict[str, Any]) -> dict[str, Any]:
    keep = ("ignore_index", "label_smoothing", "z_loss", "softcap", "reduction")
    return {k: v for k, v in kw.items() if k in keep}


def oracle_loss(x: torch.Tensor, target: torch.Tensor, kw: dict[str, Any]) -> torch.Tensor:
    """The float64 loss of logits ``x [..., V]`` (float64, in the autograd graph)."""
    o = dict(dict(ignore_index=IGNORE, label_smoothing=0.0, z_loss=0.0, softcap=None,
                  reduction="mean"), **ce_options(kw))
    counted = int((target != o["ignore_index"]).sum())
    if o["z_loss"] or o["softcap"] is not None or (o["reduction"] == "mean" and not counted):
        return ref.cross_entropy_reference(x, target, **o)
    V = x.shape[-1]
    loss = F.cross_entropy(x.reshape(-1, V), target.reshape(-1).long(),
                           ignore_index=o["ignore_index"],
                           label_smoothing=o["label_smoothing"], reduction=o["reduction"])
    return loss.view(target.shape) if o["reduction"] == "none" else loss


def ce_oracle(values: torch.Tensor, target: torch.Tensor, grad_out: torch.Tensor,
              kw: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 loss and gradient for the logits as stored."""
    x = values.detach().to(F64).requires_grad_(True)
    loss = oracle_loss(x, target, kw)
    (dx,) = torch.autograd.grad(loss, x, grad_out.to(F64))
    return loss.detach(), dx


# --- inputs ----------------------------------------------------------------------------

# name -> (N, V) -> (base shape, base -> logits view); padding the view skips is NaN.
LAYOUTS: dict[str, Callable[[int, int], tuple[tuple[int, ...], Callable]]] = {
    "contiguous": lambda n, v: ((n, v), lambda t: t),
    "3d": lambda n, v: ((n, v), lambda t: t.unsqueeze(0)),
    "row-stride": lambda n, v: ((n, v + 5), lambda t: t[:, :v]),
    "offset": lambda n, v: ((n, v + 3), lambda t: t[:, 2:v + 2]),
    "column-step": lambda n, v: ((n, 2 * v), lambda t: t[:, ::2]),
    "transposed": lambda n, v: ((v, n), lambda t: t.t()),
}

KINDS = ("nan", "nan-target", "+inf", "+inf-target", "-inf", "-inf-target", "-inf-row",
         "ignored-nan", "ignored-+inf", "ignored--inf-row")


def inject(x: torch.Tensor, target: torch.Tensor, kinds: list[str], gen: torch.Generator,
           ignore: int = IGNORE) -> None:
    """Put each special value of ``kinds`` into a random row of ``x [N, V]``, in place:
    ``nan``, ``+inf`` at a column that is not the target (``*-target``: at the target),
    ``-inf`` in a third of the columns (never the target), ``-inf-row`` in all of them;
    ``ignored-*`` also sets that row's target to ``ignore``."""
    N, V = x.shape
    for kind in kinds if N else ():
        row = int(torch.randint(0, N, (), generator=gen))
        col = int(torch.randint(0, V, (), generator=gen))
        if kind.startswith("ignored-"):
            target[row] = ignore
            kind = kind[len("ignored-"):]
        t = int(target[row])
        t = IGNORE if t == ignore else t
        at_target = kind.endswith("-target")
        kind = kind.removesuffix("-target")
        if kind == "-inf-row":
            x[row] = -INF
        elif kind == "-inf" and not at_target:
            dead = torch.arange(V) % 3 == col % 3
            if t != IGNORE:
                dead[t] = False
            x[row, dead] = -INF
        elif at_target and t != IGNORE:
            x[row, t] = {"nan": NAN, "+inf": INF, "-inf": -INF}[kind]
        elif not at_target and (t == IGNORE or V > 1):
            x[row, (col + 1) % V if col == t else col] = {"nan": NAN, "+inf": INF}[kind]


def make_target(N: int, V: int, every: int, dtype: torch.dtype, gen: torch.Generator,
                ignore: int = IGNORE) -> torch.Tensor:
    """Random class ids, every ``every``-th ignored (none for 0)."""
    t = torch.randint(0, V, (N,), generator=gen)
    if every:
        t[1::every] = ignore
    return t.to(dtype)


def logits_values(N: int, V: int, magnitude: float, gen: torch.Generator) -> torch.Tensor:
    """float32 [N, V] logits, never exactly 0. For V = 1 shifted up by 2: the gradient is
    then 2 z lse (z-loss is on), not a cancellation to ~1e-8 (see ``test_ops.py``)."""
    x = torch.randn(N, V, generator=gen) * magnitude
    x = torch.where(x == 0, torch.full_like(x, 1e-3), x)
    return x + 2.0 if V == 1 else x


# --- cross_entropy ---------------------------------------------------------------------


def run_ce(impl: str, base: torch.Tensor, view: Callable, target: torch.Tensor,
           grad_out: torch.Tensor, kw: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and gradient of the base tensor, on fresh leaves (``inplace_backward``: the
    logits passed are a non-leaf, which the op may overwrite)."""
    leaf = base.detach().clone().requires_grad_(True)
    x = view(leaf * 1 if kw.get("inplace_backward") else leaf)
    loss = lmfuse.cross_entropy(x, target.view(x.shape[:-1]), impl=impl, **kw)
    (g,) = torch.autograd.grad(loss, leaf, grad_out.view(loss.shape))
    return loss.detach(), g


def check_ce(what: str, base: torch.Tensor, view: Callable, target: torch.Tensor,
             grad_out: torch.Tensor, kw: dict[str, Any], *, launch: str | None,
             impls: tuple[str, ...] = ("triton", "torch")) -> None:
    """Both paths against the float64 oracle, loss and gradient; padding outside the view
    gets an exact zero gradient; no unexplained numpy warning in the interpreter."""
    values = view(base)
    values2d = values.reshape(-1, values.shape[-1])
    loss_ref, dx_ref = ce_oracle(values2d, target, grad_out, kw)
    nan_forming = forms_nan(values2d, target, kw)
    for impl in impls:
        tag = f"{what} [{impl}]"
        with pytest.MonkeyPatch.context() as mp:
            force(mp, launch_config(launch, values.shape[-1]) if impl == "triton" else None)
            with numpy_errors(nan_forming):
                loss, g = run_ce(impl, base, view, target, grad_out, kw)
        assert loss.dtype == F32, f"{tag}: loss dtype {loss.dtype}"
        assert_matches(loss.reshape(loss_ref.shape), loss_ref, f"{tag}: loss")
        inside = torch.zeros_like(base, dtype=torch.bool)
        view(inside).fill_(True)
        assert torch.equal(g[~inside], torch.zeros_like(g[~inside])), f"{tag}: padding"
        dx = view(g).reshape(dx_ref.shape)
        assert dx.dtype == base.dtype
        assert_matches(dx, dx_ref, f"{tag}: d logits")


@st.composite
def ce_problems(draw: st.DrawFn) -> dict[str, Any]:
    V = scaled(draw(st.sampled_from([1, 2, 3, 5, 7, 13, 16, 17, 31, 37, 64, 67])))
    N = scaled(draw(st.sampled_from([0, 1, 2, 3, 5, 8, 13])))
    kw = dict(reduction=draw(st.sampled_from(REDUCTIONS)),
              label_smoothing=draw(st.sampled_from([0.0, 0.0, 0.1, 1.0])),
              z_loss=draw(st.sampled_from([0.0, 0.0, 1e-3, 0.1])),
              softcap=draw(st.sampled_from([None, None, 3.0, 15.0])),
              inplace_backward=draw(st.booleans()))
    # ignore_index: the default, a negative one, or a real class id (then also ignored)
    ignore = draw(st.sampled_from([None, None, -1, 2]))
    if ignore is not None:
        kw["ignore_index"] = ignore
    if V == 1:
        kw["z_loss"] = max(kw["z_loss"], 0.05)
    kinds = draw(st.lists(st.sampled_from(KINDS), max_size=3))
    if kw["softcap"] == 15.0:  # a target capped to 15 against logits of ~1 is certain to
        # float32's precision: its loss and gradient (~1e-7) would be rounding alone
        kinds = [k.replace("+inf-target", "+inf") for k in kinds]
    return dict(N=N, V=V, kw=kw, dtype=draw(st.sampled_from([F32, F32, F16, BF16])),
                target_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
                every=draw(st.sampled_from([0, 3])),
                layout=draw(st.sampled_from(sorted(LAYOUTS))),
                launch=draw(st.sampled_from(LAUNCHES)),
                # Moderate logits: a near-certain token's p - 1 carries float32 rounding
                # that is large relative to itself (N = 1 has no other token to dilute it).
                magnitude=draw(st.sampled_from([0.5, 1.0] if N <= 1 else [0.5, 1.0, 2.0])),
                kinds=kinds, upstream=draw(st.sampled_from([1.0, 3.5])),
                seed=draw(st.integers(0, 2**31 - 1)))


# Twice the profile's examples (ci: 50, the same every run): many options and launches.
@settings(max_examples=2 * settings.default.max_examples)
@given(p=ce_problems())
def test_property_cross_entropy(p: dict[str, Any]) -> None:
    """Both paths, forward and backward, against the float64 oracle."""
    gen = torch.Generator().manual_seed(p["seed"])
    N, V, kw = p["N"], p["V"], p["kw"]
    ignore = kw.get("ignore_index", IGNORE)
    target = make_target(N, V, p["every"], torch.int64, gen, ignore)
    values = logits_values(N, V, p["magnitude"], gen)
    inject(values, target, p["kinds"], gen, ignore)
    base_shape, view = LAYOUTS[p["layout"]](N, V)
    base = torch.full(base_shape, NAN)
    view(base).copy_(values.view(view(base).shape))
    base = base.to(DEVICE, p["dtype"])
    target = target.to(DEVICE, p["target_dtype"])
    grad_out = (torch.randn(N, generator=gen) if kw["reduction"] == "none"
                else torch.tensor(p["upstream"])).to(DEVICE)
    check_ce(str(p), base, view, target, grad_out, kw, launch=p["launch"])


# --- vocabulary parallel, simulated in one process --------------------------------------


def simulate_group(mp: pytest.MonkeyPatch, world: int, rank: int,
                   others: Callable[[int], torch.Tensor]) -> Any:
    """A ``tp_group`` for ``rank`` of ``world``: the ops see that group, and its all-gather
    returns this rank's stats among ``others(k)``, the stats rank ``k``'s kernels give (the
    all-reduce of ``hidden``'s gradient is left to the caller, which sums the ranks'); the
    shard agreement check is left out."""
    mp.setattr(ops, "group_size", lambda group: 1 if group is None else world)
    mp.setattr(ops, "group_rank", lambda group: 0 if group is None else rank)
    mp.setattr(vocab_parallel, "all_gather_stacked",
               lambda t, group: torch.stack([t if k == rank else others(k)
                                             for k in range(world)]))
    mp.setattr(linear, "all_reduce_sum_", lambda t, group: t)
    # The ranks' sizes agree by construction (the agreement check is a collective).
    mp.setattr(ops, "check_agreed_once", lambda *args, **kwargs: None)
    return dist.ProcessGroup(dist.HashStore(), rank, world)


def local_stats(impl: str, logits: torch.Tensor, target: torch.Tensor, vocab_start: int,
                vocab_size: int, kw: dict[str, Any]) -> torch.Tensor:
    """A rank's ``[3, N]`` stats of its columns, as its forward computes them."""
    cap = kw.get("softcap")
    if impl == "torch":
        return ref.local_token_stats(logits, target, vocab_start, cap)
    ignore = kw.get("ignore_index", IGNORE)
    count = torch.sum(target != ignore, dtype=torch.float32)
    return ops._launch_fwd(logits.contiguous(), target, count, None, vocab_start, vocab_size,
                           ignore, kw.get("label_smoothing", 0.0), kw.get("z_loss", 0.0), cap,
                           False)[:3]


@st.composite
def tp_problems(draw: st.DrawFn) -> dict[str, Any]:
    p = draw(ce_problems())
    p["world"] = draw(st.sampled_from([2, 3]))
    p["kw"].pop("inplace_backward")
    p["inplace"] = draw(st.booleans())
    return p


# Half the profile's examples (ci: 12): each runs every rank of a group, on both paths.
@settings(max_examples=max(1, settings.default.max_examples // 2))
@given(p=tp_problems())
def test_property_cross_entropy_vocab_parallel(p: dict[str, Any]) -> None:
    """Every rank of a simulated group gets the single-rank loss, and the gradient of its
    own columns, on both paths (Triton: stats kernel at a vocabulary offset, the merge
    kernel, the gradient kernel)."""
    gen = torch.Generator().manual_seed(p["seed"])
    N, V_local, world, kw = p["N"], p["V"], p["world"], p["kw"]
    V = V_local * world
    ignore = kw.get("ignore_index", IGNORE)
    target = make_target(N, V, p["every"], torch.int64, gen, ignore)
    values = logits_values(N, V, p["magnitude"], gen)
    inject(values, target, p["kinds"], gen, ignore)
    logits = values.to(DEVICE, p["dtype"])
    target = target.to(DEVICE, p["target_dtype"])
    grad_out = (torch.randn(N, generator=gen) if kw["reduction"] == "none"
                else torch.tensor(p["upstream"])).to(DEVICE)
    loss_ref, dx_ref = ce_oracle(logits, target, grad_out, kw)
    nan_forming = forms_nan(logits, target, kw, world)
    shards = [s.contiguous() for s in logits.split(V_local, dim=-1)]
    for impl in ("triton", "torch"):
        with pytest.MonkeyPatch.context() as mp:
            force(mp, launch_config(p["launch"], V_local) if impl == "triton" else None)
            with numpy_errors(nan_forming):
                stats = [local_stats(impl, s, target, k * V_local, V, kw)
                         for k, s in enumerate(shards)]
                for rank in range(world):
                    group = simulate_group(mp, world, rank, stats.__getitem__)
                    leaf = shards[rank].clone().requires_grad_(True)
                    x = leaf * 1 if p["inplace"] else leaf
                    loss = lmfuse.cross_entropy(x, target, tp_group=group, impl=impl,
                                                inplace_backward=p["inplace"], **kw)
                    (g,) = torch.autograd.grad(loss, leaf, grad_out)
                    tag = f"{p} [{impl}, rank {rank}]"
                    assert_matches(loss, loss_ref, f"{tag}: loss")
                    cols = slice(rank * V_local, (rank + 1) * V_local)
                    assert_matches(g, dx_ref[:, cols], f"{tag}: d logits")


# --- linear_cross_entropy ----------------------------------------------------------------


def gemm(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The logits as the op forms them: one GEMM in the inputs' dtype."""
    return h @ w.T if b is None else torch.addmm(b, h, w.T)


def linear_oracle(h, w, b, target, grad_out, kw):
    """Float64 loss and gradients (hidden, weight, bias) through the logits the op forms
    (``F.linear``'s backward: ``G @ W``, ``G.T @ h``, ``sum G``, with ``G`` the float64
    gradient of those logits)."""
    x = gemm(h, w, b).to(F64).requires_grad_(True)
    loss = oracle_loss(x, target, kw)
    (g,) = torch.autograd.grad(loss, x, grad_out.to(F64))
    grads = [g @ w.to(F64), g.T @ h.to(F64), g.sum(0) if b is not None else None]
    return loss.detach(), grads, x.detach()


LINEAR_KINDS = ("nan-weight-row", "+inf-weight-row", "nan-hidden-row", "nan-bias",
                "+inf-bias", "-inf-bias", "ignored-nan-hidden-row")


def inject_linear(h, w, b, target, kinds, gen, ignore: int) -> None:
    N, V = h.shape[0], w.shape[0]
    for kind in kinds:
        v = int(torch.randint(0, V, (), generator=gen))
        if kind.endswith("weight-row"):
            w[v, int(torch.randint(0, w.shape[1], (), generator=gen))] = (
                NAN if kind.startswith("nan") else INF)
        elif kind.endswith("bias") and b is not None:
            b[v] = {"nan-bias": NAN, "+inf-bias": INF, "-inf-bias": -INF}[kind]
        elif kind.endswith("hidden-row") and N:
            row = int(torch.randint(0, N, (), generator=gen))
            h[row, int(torch.randint(0, h.shape[1], (), generator=gen))] = NAN
            if kind.startswith("ignored"):
                target[row] = ignore


@st.composite
def linear_problems(draw: st.DrawFn) -> dict[str, Any]:
    p = draw(ce_problems())
    p["H"] = draw(st.sampled_from([1, 3, 8, 16]))
    # V = 1 has the bias (shifted by 2, see logits_values): the gradient 2 z lse is then
    # not the float32 rounding of 1 + 2 z lse - 1 at lse ~ 0
    p["bias"] = draw(st.booleans()) or p["V"] == 1
    p["kw"].pop("inplace_backward")
    p["chunk_rows"] = draw(st.sampled_from([1, 3, None]))
    p["override"] = draw(st.booleans())  # the launch as linear's kernel config
    p["kinds"] = draw(st.lists(st.sampled_from(LINEAR_KINDS), max_size=2))
    p["magnitude"] = draw(st.sampled_from([0.5, 1.0]))
    return p


def linear_inputs(p, V: int, gen: torch.Generator):
    N, H = p["N"], p["H"]
    h = torch.randn(N, H, generator=gen) * p["magnitude"]
    w = torch.randn(V, H, generator=gen) / H ** 0.5
    b = torch.randn(V, generator=gen) if p["bias"] else None
    if V == 1 and b is not None:
        b = b + 2.0  # see logits_values
    ignore = p["kw"].get("ignore_index", IGNORE)
    target = make_target(N, V, p["every"], torch.int64, gen, ignore)
    inject_linear(h, w, b, target, p["kinds"], gen, ignore)
    dt = p["dtype"]
    return (h.to(DEVICE, dt), w.to(DEVICE, dt), None if b is None else b.to(DEVICE, dt),
            target.to(DEVICE, p["target_dtype"]))


def run_linear(impl: str, h, w, b, target, grad_out, kw, max_chunk_bytes, cfg=None):
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None
              for t in (h, w, b)]
    if cfg is None:
        loss = lmfuse.linear_cross_entropy(leaves[0], leaves[1], target, bias=leaves[2],
                                           impl=impl, max_chunk_bytes=max_chunk_bytes, **kw)
    else:
        o = dict(dict(ignore_index=IGNORE, label_smoothing=0.0, z_loss=0.0, softcap=None,
                      reduction="mean"), **kw)
        loss = linear._apply(leaves[0], leaves[1], target, leaves[2], o["ignore_index"],
                             o["label_smoothing"], o["z_loss"], o["softcap"], o["reduction"],
                             kw.get("tp_group"), impl, max_chunk_bytes, cfg)
    need = [t for t in leaves if t is not None]
    grads = list(torch.autograd.grad(loss, need, grad_out.view(loss.shape)))
    return loss.detach(), grads + [None] * (3 - len(grads))


def check_grads(tag: str, grads, grads_ref, dtype) -> None:
    """The gradients' NaN/inf patterns, and in float32 their values. In float16/bfloat16
    each is a GEMM of ``G`` rounded to that dtype (on the interpreter, bfloat16 rounds
    toward zero), which cancels (``G``'s rows sum to 0, ``dh = G @ W``) and, for the
    weight, is rounded once per chunk: the values are ``test_linear.py``'s business."""
    for name, g, r in zip(("hidden", "weight", "bias"), grads, grads_ref):
        if r is None:
            continue
        assert g.dtype == dtype, f"{tag}: d {name} dtype {g.dtype}"
        assert_matches(g, r, f"{tag}: d {name}", pattern_only=dtype != F32)


@settings(max_examples=2 * settings.default.max_examples)
@given(p=linear_problems())
def test_property_linear_cross_entropy(p: dict[str, Any]) -> None:
    """The chunked op (chunks of 1 or 3 rows, or all) against F.cross_entropy of the same
    logits, forward and the gradients of hidden, weight and bias, NaN/inf included (a NaN
    weight row poisons every token, a -inf bias masks a class)."""
    gen = torch.Generator().manual_seed(p["seed"])
    V, kw = p["V"], p["kw"]
    h, w, b, target = linear_inputs(p, V, gen)
    N = h.shape[0]
    grad_out = (torch.randn(N, generator=gen) if kw["reduction"] == "none"
                else torch.tensor(p["upstream"])).to(DEVICE)
    loss_ref, grads_ref, logits = linear_oracle(h, w, b, target, grad_out, kw)
    rows = p["chunk_rows"]
    budget = None if rows is None else rows * V * h.element_size()
    config = launch_config(p["launch"], V)
    cfg = None
    if p["override"] and config is not None and "fused" in config:
        cfg = dict(chunk_bytes=2**28, row_multiple=1, kernel=config["fused"])
    nan_forming = forms_nan(logits, target, kw)
    for impl in ("triton", "torch"):
        tag = f"{p} [{impl}]"
        with pytest.MonkeyPatch.context() as mp:
            force(mp, config if impl == "triton" else None)
            with numpy_errors(nan_forming):
                loss, grads = run_linear(impl, h, w, b, target, grad_out, kw, budget, cfg)
        assert loss.dtype == F32
        assert_matches(loss, loss_ref, f"{tag}: loss", tol_dtype=p["dtype"])
        check_grads(tag, grads, grads_ref, p["dtype"])


@settings(max_examples=max(1, settings.default.max_examples // 2))
@given(p=linear_problems())
def test_property_linear_cross_entropy_vocab_parallel(p: dict[str, Any]) -> None:
    """Two or three simulated ranks, each with its shard of weight and bias rows: every
    rank's loss is the single-rank loss, its weight and bias gradients are its rows of the
    single-rank ones, and the ranks' hidden gradients sum to the single-rank one."""
    gen = torch.Generator().manual_seed(p["seed"])
    world = 2 + p["seed"] % 2
    V_local, kw = p["V"], p["kw"]
    V = V_local * world
    h, w, b, target = linear_inputs(p, V, gen)
    N = h.shape[0]
    grad_out = (torch.randn(N, generator=gen) if kw["reduction"] == "none"
                else torch.tensor(p["upstream"])).to(DEVICE)
    loss_ref, (dh_ref, dw_ref, db_ref), logits = linear_oracle(h, w, b, target, grad_out, kw)
    w_shards = w.split(V_local)
    b_shards = b.split(V_local) if b is not None else [None] * world
    nan_forming = forms_nan(logits, target, kw, world)
    for impl in ("triton", "torch"):
        with pytest.MonkeyPatch.context() as mp:
            force(mp, launch_config(p["launch"], V_local) if impl == "triton" else None)
            with numpy_errors(nan_forming):
                stats = [local_stats(impl, gemm(h, w_shards[k], b_shards[k]), target,
                                     k * V_local, V, kw) for k in range(world)]
                dh = torch.zeros_like(h, dtype=F64)
                for rank in range(world):
                    group = simulate_group(mp, world, rank, stats.__getitem__)
                    loss, (g_h, g_w, g_b) = run_linear(
                        impl, h, w_shards[rank], b_shards[rank], target, grad_out,
                        dict(kw, tp_group=group), None)
                    tag = f"{p} [{impl}, rank {rank} of {world}]"
                    assert_matches(loss, loss_ref, f"{tag}: loss", tol_dtype=p["dtype"])
                    rows = slice(rank * V_local, (rank + 1) * V_local)
                    check_grads(tag, [None, g_w, g_b], [None, dw_ref[rows],
                                                        None if b is None else db_ref[rows]],
                                p["dtype"])
                    dh += g_h.to(F64)
        assert_matches(dh.to(p["dtype"]), dh_ref, f"{p} [{impl}]: sum of d hidden",
                       pattern_only=p["dtype"] != F32)


# --- the reference itself ---------------------------------------------------------------


@settings(max_examples=2 * settings.default.max_examples)
@given(p=ce_problems())
def test_property_reference_matches_torch(p: dict[str, Any]) -> None:
    """``cross_entropy_reference`` in float64 is ``F.cross_entropy``, NaN and inf
    included (the options both have; a mean over at least one token)."""
    gen = torch.Generator().manual_seed(p["seed"])
    N, V = p["N"], p["V"]
    kw = dict(p["kw"], z_loss=0.0, softcap=None)
    kw.pop("inplace_backward")
    ignore = kw.get("ignore_index", IGNORE)
    target = make_target(N, V, p["every"], torch.int64, gen, ignore)
    x = logits_values(N, V, 3.0, gen).to(F64)
    inject(x, target, p["kinds"], gen, ignore)
    grad = torch.randn(N, generator=gen, dtype=F64) if kw["reduction"] == "none" else \
        torch.tensor(2.5, dtype=F64)
    counted = bool((target != ignore).any())
    if kw["reduction"] == "mean" and not counted:
        return  # F.cross_entropy: 0 / 0; the reference: 0 (test_ops.py)
    a = x.clone().requires_grad_(True)
    b = x.clone().requires_grad_(True)
    loss = ref.cross_entropy_reference(a, target, **ce_options(kw))
    want = F.cross_entropy(b, target, **{k: v for k, v in ce_options(kw).items()
                                         if k not in ("z_loss", "softcap")})
    assert_matches(loss, want, f"{p}: loss")
    (ga,) = torch.autograd.grad(loss, a, grad)
    (gb,) = torch.autograd.grad(want, b, grad)
    assert_matches(ga, gb, f"{p}: d logits")


# --- the special values one by one, on every launch ---------------------------------------


def special_batch(V: int = 37) -> tuple[torch.Tensor, torch.Tensor]:
    """[10, V] float32 logits, one special case a row (row: case): 0 NaN not at the target,
    1 +inf not at the target, 2 NaN at the target, 3 every logit -inf, 4 a third of the
    logits -inf (not the target), 5 -inf at the target, 6 ignored with a NaN, 7 ignored
    with +inf, 8 ignored and all -inf, 9 plain."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10, V, generator=gen)
    t = torch.randint(0, V, (10,), generator=gen)
    other = (t + 1) % V
    x[0, other[0]] = NAN
    x[1, other[1]] = INF
    x[2, t[2]] = NAN
    x[3] = -INF
    x[4, torch.arange(V) % 3 == 0] = -INF
    x[4, t[4]] = 1.0
    x[5, t[5]] = -INF
    x[6, 3], x[7, 4], x[8] = NAN, INF, -INF
    t[6:9] = IGNORE
    return x, t


SPECIAL_OPTIONS = [
    pytest.param(dict(reduction="none"), id="none"),
    pytest.param(dict(reduction="mean", label_smoothing=0.1), id="mean-ls"),
    pytest.param(dict(reduction="sum", z_loss=0.01, inplace_backward=True), id="sum-z-inplace"),
    pytest.param(dict(reduction="none", softcap=3.0, label_smoothing=0.1), id="none-cap-ls"),
]
PATHS = [pytest.param("torch", None, id="torch"),
         *(pytest.param("triton", name, id=f"triton-{name}") for name in LAUNCHES)]


@pytest.mark.parametrize("impl, launch", PATHS)
@pytest.mark.parametrize("kw", SPECIAL_OPTIONS)
def test_special_values(impl: str, launch: str | None, kw: dict[str, Any]) -> None:
    """The issue's cases, each kernel variant: NaN not at the target gives NaN (was -inf on
    the Triton path), +inf gives NaN (was -inf on Triton, +inf on torch), a row of -inf is
    NaN, -inf columns are masked classes, ignored rows stay 0; gradients as PyTorch's."""
    x, t = special_batch()
    x, t = x.to(DEVICE), t.to(DEVICE)
    grad_out = torch.linspace(0.5, 2.0, 10, device=DEVICE) if kw["reduction"] == "none" \
        else torch.tensor(1.5, device=DEVICE)
    check_ce(f"{impl} {launch} {kw}", x, lambda a: a, t, grad_out, kw, launch=launch,
             impls=(impl,))
    if kw["reduction"] == "none":  # what the oracle says, spelled out
        with pytest.MonkeyPatch.context() as mp:
            force(mp, launch_config(launch, 37) if impl == "triton" else None)
            with np.errstate(invalid="ignore"):
                loss = lmfuse.cross_entropy(x, t, impl=impl, **kw)
        assert loss[[0, 2]].isnan().all(), loss  # NaN: NaN, softcapped or not
        if kw.get("softcap") is not None:  # +-inf cap to +-c
            assert torch.isfinite(loss[[1, 3, 4, 5]]).all(), loss
        else:
            assert loss[[1, 3]].isnan().all() and loss[5] == INF, loss
            assert loss[4] == INF if kw.get("label_smoothing") else torch.isfinite(loss[4])
        assert torch.equal(loss[6:9], torch.zeros(3, device=DEVICE)), loss
        assert torch.isfinite(loss[9])


@pytest.mark.parametrize("impl, launch", PATHS)
def test_mean_ignores_nan_rows_that_are_ignored(impl: str, launch: str | None) -> None:
    """A NaN, +inf or -inf row whose target is ignore_index leaves the mean finite."""
    x, t = special_batch()
    keep = [4, 6, 7, 8, 9]
    x, t = x[keep].to(DEVICE), t[keep].to(DEVICE)
    with pytest.MonkeyPatch.context() as mp:
        force(mp, launch_config(launch, 37) if impl == "triton" else None)
        with np.errstate(invalid="ignore"):
            loss = lmfuse.cross_entropy(x, t, impl=impl)
    want = F.cross_entropy(x.double(), t, ignore_index=IGNORE)
    assert torch.isfinite(loss)
    assert_matches(loss, want, f"{impl} {launch}: mean over the non-ignored rows")


@pytest.mark.parametrize("impl, launch", [pytest.param("torch", None, id="torch"),
                                          pytest.param("triton", "table", id="triton-table"),
                                          pytest.param("triton", "slices", id="triton-slices"),
                                          pytest.param("triton", "vec-prefetch",
                                                       id="triton-vec-prefetch")])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_nan_weight_row_poisons_every_token(impl: str, launch: str,
                                                   reduction: str) -> None:
    """One NaN in one weight row: every token's loss and every gradient is NaN (was -inf
    on the Triton path), in chunks of 3 tokens."""
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(7, 8, generator=gen).to(DEVICE).requires_grad_(True)
    w = torch.randn(37, 8, generator=gen).to(DEVICE)
    w[11, 5] = NAN
    w.requires_grad_(True)
    t = torch.randint(0, 37, (7,), generator=gen).to(DEVICE)
    with pytest.MonkeyPatch.context() as mp:
        force(mp, launch_config(launch, 37) if impl == "triton" else None)
        with numpy_errors(False):
            loss = lmfuse.linear_cross_entropy(h, w, t, impl=impl, reduction=reduction,
                                               max_chunk_bytes=3 * 37 * 4)
            loss.sum().backward()
    assert loss.isnan().all() and h.grad.isnan().all() and w.grad.isnan().all()


@pytest.mark.parametrize("impl, launch", PATHS)
def test_finite_inputs_raise_no_floating_point_warning(impl: str, launch: str | None) -> None:
    """Logits of 1e4 (softcap: exp(2 x / c) past float32's range), -inf columns, tail rows
    and tail chunks, z-loss: no numpy warning, and finite results equal to the oracle."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, 37, generator=gen) * 3.0
    x[:, 1::4] = -1e4
    x[:, 5] = 1e4
    x[2, ::3] = -INF
    t = torch.randint(0, 37, (7,), generator=gen)
    t[2] = 1
    t[4] = IGNORE
    for kw in (dict(softcap=30.0, z_loss=1e-4, label_smoothing=0.1),
               dict(z_loss=1e-4, reduction="none")):
        check_ce(f"{impl} {launch} {kw}", x.to(DEVICE), lambda a: a, t.to(DEVICE),
                 torch.tensor(2.0, device=DEVICE) if "reduction" not in kw else
                 torch.ones(7, device=DEVICE), kw, launch=launch, impls=(impl,))
