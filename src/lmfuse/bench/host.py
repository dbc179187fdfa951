"""The host time of one eager call of every lmfuse op, against plain PyTorch and Liger-Kernel.

Run it as ``lmfuse bench host [--ops OP,...] [--json PATH] [--plot PATH] [--quick]``
(``--ops rms_norm,layer_norm``: those ops' rows only; default: every op). On a GPU a small
call costs what the host spends issuing it -- Python, argument checks, the choice of path,
the launch configuration, the kernel launches, autograd -- not what the device spends
running it: that decides eager decoding and small training steps, and is what this
harness measures.

Method. Every op runs on inputs so small that the device's work is negligible (``[8, 64]``
activations and norms, a vocabulary of 128, decode attention over B1 S64, RoPE over B1 S8;
the header and the JSON's ``environment.inputs`` list them), in bfloat16 on a GPU, float32
on the CPU. A row times K consecutive calls with ``time.perf_counter()``, the device idle
before (``torch.cuda.synchronize()``) and the clock stopped *before* synchronising again, so
the figure is the host's time to issue a call, not the device's to run it. K = 100 keeps the
launch queue from filling (the device runs such kernels faster than the host issues
them; were it slower, the host would wait and the figure would be bounded by device
time). The figure is the median over 15 rounds of K calls, the rows of a case taking
turns round by round (drift hits them alike), Python's garbage collector off while timing
(as ``timeit`` does), in microseconds per call. ``--quick`` (the default on the CPU): 5
rounds of 20. On the CPU the figures include the computation, which there is not
asynchronous; in Triton's interpreter (``TRITON_INTERPRET=1``) each launch runs the kernel
on the CPU, so the run is a smoke test (2 rounds of 1) whose figures say nothing about a
GPU's host time. The CPU runs with one intra-op thread (a parallel region that waits for
a thread the OS has descheduled costs milliseconds on a loaded machine; the setting is
restored after the run).

Modes, per op: ``fwd`` (under ``torch.no_grad()``, inputs not requiring grad: inference),
``fwd (grad)`` (the inputs require grad: the forward builds the autograd graph, which is
dropped with the output) and ``fwd+bwd`` (the forward, then ``.backward()`` of a fixed
upstream gradient, or of the scalar loss, and the inputs' ``.grad`` reset to None, as a
training step's ``zero_grad`` does). ``decode_attention``, ``kv_cache_append`` and
``merge_attention_states`` are inference ops (the Triton path of decode attention has no
backward): ``fwd`` only.

Rows:

  lmfuse               the public op, ``impl="auto"`` (the note gives the path it takes)
  torch                the plain PyTorch formula of the op (the note gives it):
                       ``F.cross_entropy``, ``F.silu(a) * b`` of ``x.chunk(2, -1)``, the
                       three-op RMSNorm, ``F.layer_norm``, transformers' RoPE function,
                       ``masked_fill`` + ``softmax``,
                       ``F.linear`` + ``F.cross_entropy``, SDPA over the cache,
                       ``index_copy_`` into it, the log-sum-exp merge, the experts with
                       their weights gathered per (token, slot) (no host sync)
  liger-kernel         where Liger-Kernel has the op: ``LigerRMSNormFunction``,
                       ``LigerLayerNormFunction``, ``LigerRopeFunction`` (in place, on
                       its own inputs), ``LigerSiLUMulFunction`` /
                       ``LigerGELUMulFunction`` (the two halves
                       as separate tensors, as Liger's MLPs call them),
                       ``liger_cross_entropy``, ``liger_fused_linear_cross_entropy``
                       (both compute the gradient in the forward); a row with a note when
                       it is not installed or cannot run
  lmfuse checks only   ``fwd``: the op's ``_resolve`` (argument checks and the choice of
                       path) alone, and for the losses the target check the op makes (a
                       host check on CPU tensors only, where the default float32 path
                       leaves it to PyTorch's op); ``kv_cache_append`` has none (it checks
                       inline)
  lmfuse launch only   ``fwd`` and ``fwd+bwd``: the op's private launch functions alone,
                       on the same inputs (the forward's, then the backward's, back to
                       back): the tuning-table lookup, the output buffers and the kernel
                       launches, no checks, no path choice, no autograd. Only where the
                       Triton path runs (a GPU, or the interpreter: there the launch is
                       the interpretation, so record it, conclude nothing);
                       ``linear_cross_entropy`` has none (its chunk loop of GEMMs and
                       cross-entropy launches lives in its autograd function)
  lmfuse, Triton's     every mode, on a GPU: the same call with its kernels launched by
  launch               Triton's ``kernel[grid](...)`` instead of ``_launch.FastLaunch``
                       (which calls the compiled kernel's launcher directly after the
                       first launch): what that path saves, measured turn by turn

Every row gives its time as a multiple of lmfuse's call in the same mode (``x lmfuse``;
for the breakdown rows, the share of the call). The breakdown printed at the end, per op:
``fwd = checks + launch + rest`` (rest: the glue between them -- reshapes, contiguity
tests, NVTX ranges; every op launches directly when eager, its ``torch.library`` custom op
being what ``torch.compile`` sees),
``autograd = fwd (grad) - fwd`` (the graph node, the tensors saved for backward), ``over
launches = fwd+bwd - its launch-only row`` (checks, autograd, backward's engine). The
target -- lmfuse's call at most Liger's, in every mode where Liger runs -- is judged only
on a GPU outside the interpreter, and written into lmfuse's note. The JSON's rows carry
``us`` (and ``ms``, the other harnesses' field), ``op`` and ``mode``; its
``environment.breakdown`` holds the split per op.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F

import lmfuse
from lmfuse import _launch
from lmfuse._dispatch import interpreter_active, select_impl, triton_support
from lmfuse.bench.common import (PeerUnavailable, Result, cell, dist_version, failure, finish,
                                 print_peers, start, unavailable)

MODES = ("fwd", "fwd (grad)", "fwd+bwd")
CHECKS = "lmfuse checks only"
LAUNCH = "lmfuse launch only"
TRITON = "lmfuse, Triton's launch"
LIGER = "liger-kernel"
EPS = 1e-6
SCALE = 0.125  # fused_softmax's scale
IGNORE = -100

# The inputs: small enough that the device's work is negligible.
ROWS, HIDDEN, VOCAB = 8, 64, 128
ROPE = dict(B=1, S=8, Hq=4, Hk=2, D=32)
SOFTMAX_SHAPE = (1, 2, 8, 32)  # b, np, sq, sk (causal)
MOE = dict(T=8, H=64, F=32, E=4, k=2)
DECODE = dict(B=1, S=64, Hq=4, Hkv=2, D=32)
MERGE = dict(P=2, R=4, D=32)


@dataclass
class HostResult(Result):
    """A row: ``ms`` (the shared schema) and ``us`` are the median host time per call."""

    op: str = ""
    mode: str = ""
    us: Optional[float] = None


class Call(NamedTuple):
    """``fn(*args)``: the tensors among ``args`` that require grad are the ones
    differentiated (``fwd`` mode gets them detached)."""

    fn: Callable[..., Any]
    args: tuple


@dataclass
class OpSpec:
    """One op: its rows' calls, the upstream gradient (None: a scalar loss) and the
    breakdown's thunks (``launch``: mode -> the launch functions alone)."""

    name: str
    inputs: str
    impls: dict[str, Call]
    notes: dict[str, str]
    grad: Optional[torch.Tensor | tuple[torch.Tensor, ...]]  # a tuple: one per output
    training: bool = True
    checks: Optional[Callable[[], object]] = None
    checks_note: str = ""
    launch: dict[str, Callable[[], object]] = field(default_factory=dict)
    launch_note: str = ""

    @property
    def modes(self) -> tuple[str, ...]:
        return MODES if self.training else ("fwd",)


class Inputs:
    """Random inputs on the run's device and dtype."""

    def __init__(self, device: torch.device, dtype: torch.dtype, triton: tuple[bool, str]):
        self.device, self.dtype = device, dtype
        self.triton, self.triton_why = triton

    def randn(self, *shape: int, scale: float = 1.0, grad: bool = False,
              dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        t = torch.randn(*shape, device=self.device).mul_(scale).to(dtype or self.dtype)
        return t.requires_grad_(grad)


def _detached(args: tuple) -> tuple:
    return tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)


def _spec(inp: Inputs, name: str, inputs: str, ours: Call, plain: Call, formula: str,
          grad: Optional[torch.Tensor | tuple[torch.Tensor, ...]], training: bool = True
          ) -> OpSpec:
    """Op ``name``'s ``lmfuse`` row (noted with the path it takes here) and ``torch`` row."""
    return OpSpec(name, inputs, {"lmfuse": ours, "torch": plain},
                  {"lmfuse": "path " + select_impl(name, "auto", inp.device)[0],
                   "torch": formula}, grad, training)


# --- Liger-Kernel --------------------------------------------------------------------------


def load_liger() -> tuple[dict[str, tuple[Callable[..., Any], str]], str]:
    """Op -> (Liger-Kernel's function, taking the arguments of that op's ``liger-kernel``
    call, and its row's note), and Liger-Kernel's version. A function whose import fails is
    a stand-in that raises, so its rows note why."""

    def load(module: str, name: str, wrap: Callable[[Any], Callable[..., Any]], note: str
             ) -> tuple[Callable[..., Any], str]:
        try:
            obj = getattr(importlib.import_module(f"liger_kernel.{module}"), name)
        except Exception as exc:  # not installed, or its import needs what is missing here
            return unavailable(exc), f"{module}.{name}"
        return wrap(obj), note

    fns = {
        "rms_norm": load("ops.rms_norm", "LigerRMSNormFunction",
                         # (X, W, eps, offset, casting_mode, in_place)
                         lambda f: lambda x, w: f.apply(x, w, EPS, 0.0, "llama", False),
                         "LigerRMSNormFunction, llama casting, not in place"),
        "layer_norm": load("ops.layer_norm", "LigerLayerNormFunction",
                           # (X, W, B, eps)
                           lambda f: lambda x, w, b: f.apply(x, w, b, EPS),
                           "LigerLayerNormFunction"),
        "rope": load("ops.rope", "LigerRopeFunction",
                     # as liger_rotary_pos_emb: (q, k, cos, sin, position_ids, unsqueeze_dim)
                     lambda f: lambda q, k, c, s: f.apply(q, k, c, s, None, 1),
                     "LigerRopeFunction, in place (on its own q and k)"),
        "swiglu": load("ops.swiglu", "LigerSiLUMulFunction",
                       lambda f: lambda a, b, _w: f.apply(a, b),
                       "LigerSiLUMulFunction(a, b): the halves as two tensors"),
        "geglu": load("ops.geglu", "LigerGELUMulFunction",
                      lambda f: lambda a, b, _w: f.apply(a, b),
                      "LigerGELUMulFunction(a, b): the halves as two tensors"),
        "cross_entropy": load("transformers.functional", "liger_cross_entropy",
                              lambda f: lambda x, t: f(x, t, ignore_index=IGNORE),
                              "liger_cross_entropy: gradient computed in the forward"),
        "linear_cross_entropy": load(
            "transformers.functional", "liger_fused_linear_cross_entropy",
            lambda f: lambda h, w, t: f(h, w, t, ignore_index=IGNORE, reduction="mean"),
            "liger_fused_linear_cross_entropy: gradients computed in the forward"),
    }
    return fns, dist_version("liger-kernel")


def _with_liger(spec: OpSpec, liger: dict, args: tuple) -> OpSpec:
    fn, note = liger[spec.name]
    spec.impls[LIGER] = Call(fn, args)
    spec.notes[LIGER] = note
    return spec


# --- the ops --------------------------------------------------------------------------------


def _launch_rows(spec: OpSpec, inp: Inputs, build: Callable[[], dict[str, Callable]],
                 names: str) -> OpSpec:
    """The launch-only thunks where the Triton path runs (built here, so a private function
    that moved is a note, not a crash)."""
    if not inp.triton:
        spec.launch_note = f"not run: the Triton path does not run here ({inp.triton_why})"
        return spec
    try:
        spec.launch = build()
        spec.launch_note = names
    except Exception as exc:
        spec.launch_note = f"not reachable: {type(exc).__name__}: {exc}"[:160]
    return spec


def rms_norm_spec(inp: Inputs, liger: dict) -> OpSpec:
    from lmfuse.norm import ops

    n, H = ROWS, HIDDEN
    x = inp.randn(n, H, grad=True)
    w = (1.0 + 0.1 * torch.randn(H, device=inp.device)).to(inp.dtype).requires_grad_(True)
    g = inp.randn(n, H)

    def plain(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w

    spec = _spec(inp, "rms_norm", f"x [{n}, {H}], weight [{H}]",
                 Call(lambda x, w: lmfuse.rms_norm(x, w, eps=EPS), (x, w)), Call(plain, (x, w)),
                 "x * rsqrt(x.pow(2).mean(-1) + eps) * w", g)
    _with_liger(spec, liger, (x.detach().clone().requires_grad_(True),
                              w.detach().clone().requires_grad_(True)))
    xd, wd = x.detach(), w.detach()
    spec.checks = lambda: ops._resolve(xd, wd, EPS, 0.0, "auto")
    spec.checks_note = "norm.ops._resolve"

    def build():
        def fwd_bwd():
            _, rstd = ops.launch_rms_norm(xd, wd, EPS, 0.0)
            return ops._launch_bwd(xd, g, rstd, wd, 0.0, True)

        return {"fwd": lambda: ops.launch_rms_norm(xd, wd, EPS, 0.0), "fwd+bwd": fwd_bwd}

    return _launch_rows(spec, inp, build, "norm.ops.launch_rms_norm (+ _launch_bwd)")


def layer_norm_spec(inp: Inputs, liger: dict) -> OpSpec:
    from lmfuse.norm import ops

    n, H = ROWS, HIDDEN
    x = inp.randn(n, H, grad=True)
    w = (1.0 + 0.1 * torch.randn(H, device=inp.device)).to(inp.dtype).requires_grad_(True)
    b = inp.randn(H, scale=0.1, grad=True)
    g = inp.randn(n, H)

    def plain(x, w, b):
        return F.layer_norm(x, (H,), w, b, EPS)

    spec = _spec(inp, "layer_norm", f"x [{n}, {H}], weight [{H}], bias [{H}]",
                 Call(lambda x, w, b: lmfuse.layer_norm(x, w, b, eps=EPS), (x, w, b)),
                 Call(plain, (x, w, b)), "F.layer_norm(x, (H,), w, b, eps)", g)
    _with_liger(spec, liger, tuple(t.detach().clone().requires_grad_(True) for t in (x, w, b)))
    xd, wd, bd = x.detach(), w.detach(), b.detach()
    spec.checks = lambda: ops._resolve_ln(xd, wd, bd, EPS, 0.0, "auto")
    spec.checks_note = "norm.ops._resolve_ln"

    def build():
        def fwd_bwd():
            _, stats = ops.launch_layer_norm(xd, wd, bd, EPS, 0.0)
            return ops._launch_ln_bwd(xd, g, stats, wd, 0.0, True, True)

        return {"fwd": lambda: ops.launch_layer_norm(xd, wd, bd, EPS, 0.0), "fwd+bwd": fwd_bwd}

    return _launch_rows(spec, inp, build, "norm.ops.launch_layer_norm (+ _launch_ln_bwd)")


def rope_spec(inp: Inputs, liger: dict) -> OpSpec:
    from lmfuse.bench.rope import load_transformers
    from lmfuse.rope import ops

    B, S, Hq, Hk, D = ROPE.values()

    def heads(H: int) -> torch.Tensor:  # transformers' layout: [B, S, H, D] transposed
        return inp.randn(B, S, H, D).transpose(1, 2)

    q, k = heads(Hq).requires_grad_(True), heads(Hk).requires_grad_(True)
    angle = torch.rand(B, S, D // 2, device=inp.device) * 6.3
    cos, sin = (f(torch.cat((angle, angle), -1)).to(inp.dtype) for f in (torch.cos, torch.sin))
    # contiguous upstream gradients: Liger's backward, which rotates them in place, copies
    # them first (its transposed view of them is not contiguous), so the rows share them
    g = (inp.randn(B, Hq, S, D), inp.randn(B, Hk, S, D))
    plain, formula, _ = load_transformers()
    spec = _spec(inp, "rope", f"q [{B}, {Hq}, {S}, {D}], k [{B}, {Hk}, {S}, {D}] (transposed "
                 f"[B, S, H, D] views), cos, sin [{B}, {S}, {D}]",
                 Call(lmfuse.apply_rotary_pos_emb, (q, k, cos, sin)),
                 Call(plain, (q, k, cos, sin)), formula, g)
    _with_liger(spec, liger, (q.detach().clone().requires_grad_(True),
                              k.detach().clone().requires_grad_(True), cos, sin))
    qd, kd = q.detach(), k.detach()
    spec.checks = lambda: ops._check(qd, kd, cos, sin, 1, "auto")
    spec.checks_note = "rope.ops._check"

    dtypes = (qd.dtype, kd.dtype)

    def build():
        def fwd_bwd():
            ops.launch_rotary(qd, kd, cos, sin, 1, False, *dtypes)
            return ops.launch_rotary(*g, cos, sin, 1, True, *dtypes)

        return {"fwd": lambda: ops.launch_rotary(qd, kd, cos, sin, 1, False, *dtypes),
                "fwd+bwd": fwd_bwd}

    return _launch_rows(spec, inp, build, "rope.ops.launch_rotary (+ its backward launch)")


def _quick_gelu(a: torch.Tensor) -> torch.Tensor:
    return a * torch.sigmoid(1.702 * a)


class Act(NamedTuple):
    """An activation op: lmfuse's call ``(x, bias, weights)``, the kernels' activation and
    gating, which inputs it takes, the torch formula's activation and its text."""

    call: Callable[..., torch.Tensor]
    activation: str
    gated: bool
    bias: bool
    weighted: bool
    plain: Callable[[torch.Tensor], torch.Tensor]
    formula: str


ACTS: dict[str, Act] = {
    "swiglu": Act(lambda x, b, w: lmfuse.swiglu(x), "silu", True, False, False, F.silu,
                  "F.silu(a) * b, (a, b) = x.chunk(2, -1)"),
    "geglu": Act(lambda x, b, w: lmfuse.geglu(x), "gelu", True, False, False,
                 lambda a: F.gelu(a, approximate="tanh"), "F.gelu(a, 'tanh') * b of chunk"),
    "quick_geglu": Act(lambda x, b, w: lmfuse.quick_geglu(x), "quick_gelu", True, False,
                       False, _quick_gelu, "a * sigmoid(1.702 a) * b of chunk"),
    "bias_gelu": Act(lambda x, b, w: lmfuse.bias_gelu(x, b), "gelu", False, True, False,
                     lambda a: F.gelu(a, approximate="tanh"), "F.gelu(x + bias, 'tanh')"),
    "squared_relu": Act(lambda x, b, w: lmfuse.squared_relu(x), "squared_relu", False, False,
                        False, lambda a: F.relu(a).square(), "F.relu(x).square()"),
    "weighted_swiglu": Act(lambda x, b, w: lmfuse.weighted_swiglu(x, w), "silu", True, False,
                           True, F.silu, "F.silu(a) * b * weights of chunk"),
    "weighted_quick_geglu": Act(lambda x, b, w: lmfuse.weighted_quick_geglu(x, w),
                                "quick_gelu", True, False, True, _quick_gelu,
                                "a * sigmoid(1.702 a) * b * weights of chunk"),
    "weighted_squared_relu": Act(lambda x, b, w: lmfuse.weighted_squared_relu(x, w),
                                 "squared_relu", False, False, True,
                                 lambda a: F.relu(a).square(), "F.relu(x).square() * weights"),
}


def activation_spec(name: str, inp: Inputs, liger: dict) -> OpSpec:
    from lmfuse.activations import ops

    act = ACTS[name]
    n, f = ROWS, HIDDEN
    K = 2 * f if act.gated else f
    x = inp.randn(n, K, grad=True)
    b = inp.randn(K, grad=True) if act.bias else None
    w = inp.randn(n, 1, grad=True) if act.weighted else None
    g = inp.randn(n, f)

    def plain(x, b, w):
        if b is not None:
            x = x + b
        if act.gated:
            gate, up = x.chunk(2, -1)
            y = act.plain(gate) * up
        else:
            y = act.plain(x)
        return y if w is None else y * w

    shapes = f"x [{n}, {K}]" + (f", bias [{K}]" if b is not None else "") + (
        f", weights [{n}, 1]" if w is not None else "")
    spec = _spec(inp, name, shapes, Call(act.call, (x, b, w)), Call(plain, (x, b, w)),
                 act.formula, g)
    if name in liger:
        _with_liger(spec, liger, (inp.randn(n, f, grad=True), inp.randn(n, f, grad=True), None))
    xd, bd, wd = _detached((x, b, w))

    def resolve():
        return ops._resolve(name, xd, bd, wd, act.activation, act.gated, 0.0, None, False,
                            False, "auto")

    spec.checks, spec.checks_note = resolve, "activations.ops._resolve"

    def build():
        a = resolve()[2].kernel_args()

        def fwd_bwd():
            ops._launch_fwd(xd, bd, wd, *a)
            return ops._launch_bwd(xd, g, bd, wd, *a, xd.dtype, bd is not None)

        return {"fwd": lambda: ops._launch_fwd(xd, bd, wd, *a), "fwd+bwd": fwd_bwd}

    return _launch_rows(spec, inp, build, "activations.ops._launch_fwd (+ _launch_bwd)")


def softmax_spec(inp: Inputs, liger: dict) -> OpSpec:
    from lmfuse.softmax import ops

    b, np_, sq, sk = SOFTMAX_SHAPE
    s = inp.randn(b, np_, sq, sk, grad=True)
    g = inp.randn(b, np_, sq, sk)
    hidden = torch.ones(sq, sk, dtype=torch.bool, device=inp.device).triu_(sk - sq + 1)

    def plain(s):
        return torch.softmax((s * SCALE).masked_fill(hidden, float("-inf")), -1)

    spec = _spec(inp, "fused_softmax", f"scores [{b}, {np_}, {sq}, {sk}], causal, scale {SCALE}",
                 Call(lambda s: lmfuse.fused_softmax(s, scale=SCALE, causal=True), (s,)),
                 Call(plain, (s,)), "softmax((s * scale).masked_fill(causal, -inf), -1)", g)
    sd = s.detach()

    def resolve():
        return ops._resolve(sd, SCALE, None, True, None, None, True, "auto")

    spec.checks, spec.checks_note = resolve, "softmax.ops._resolve"

    def build():
        a = resolve()[2]
        left, right = a.left, a.right

        def fwd_bwd():
            y, lse = ops._launch_fwd(sd, None, None, SCALE, left, right)
            return ops._launch_bwd(g, y, lse, None, SCALE, left, right, False)

        return {"fwd": lambda: ops._launch_fwd(sd, None, None, SCALE, left, right),
                "fwd+bwd": fwd_bwd}

    return _launch_rows(spec, inp, build, "softmax.ops._launch_fwd (+ _launch_bwd)")


def cross_entropy_spec(inp: Inputs, liger: dict) -> OpSpec:
    from lmfuse.cross_entropy import ops

    n, V = ROWS, VOCAB
    x = inp.randn(n, V, grad=True)
    t = torch.randint(0, V, (n,), device=inp.device)
    spec = _spec(inp, "cross_entropy", f"logits [{n}, {V}], target [{n}]",
                 Call(lmfuse.cross_entropy, (x, t)), Call(F.cross_entropy, (x, t)),
                 "F.cross_entropy(logits, target)", None)
    # Liger writes the gradient over its logits: its own copy.
    _with_liger(spec, liger, (x.detach().clone().requires_grad_(True), t))
    xd = x.detach()

    def checks():
        o = ops._resolve(xd, t, IGNORE, 0.0, 0.0, None, "mean", None, False, "auto")[2]
        ops._check_targets(t, o)

    spec.checks, spec.checks_note = checks, "cross_entropy.ops._resolve + _check_targets"

    def build():
        count = torch.sum(t != IGNORE, dtype=torch.float32)
        one = torch.ones(1, dtype=torch.float32, device=inp.device)

        def fwd_bwd():  # the fused path: stats and gradient in the forward, scaled in backward
            _, grad = ops._fwd_grad(xd, t, count, IGNORE, 0.0, 0.0, None, True)
            ops._launch_scale(grad, one)
            return grad

        return {"fwd": lambda: ops._launch_fwd(xd, t, count, None, 0, V, IGNORE, 0.0, 0.0, None,
                                               True),
                "fwd+bwd": fwd_bwd}

    return _launch_rows(spec, inp, build,
                        "cross_entropy.ops._launch_fwd (fwd+bwd: _fwd_grad + _launch_scale)")


def linear_cross_entropy_spec(inp: Inputs, liger: dict) -> OpSpec:
    from lmfuse.cross_entropy import linear, ops

    n, H, V = ROWS, HIDDEN, VOCAB
    h = inp.randn(n, H, grad=True)
    w = inp.randn(V, H, scale=H ** -0.5, grad=True)
    t = torch.randint(0, V, (n,), device=inp.device)
    spec = _spec(inp, "linear_cross_entropy",
                 f"hidden [{n}, {H}], weight [{V}, {H}], target [{n}]",
                 Call(lmfuse.linear_cross_entropy, (h, w, t)),
                 Call(lambda h, w, t: F.cross_entropy(F.linear(h, w), t), (h, w, t)),
                 "F.cross_entropy(F.linear(hidden, weight), target)", None)
    _with_liger(spec, liger, (h.detach().clone().requires_grad_(True),
                              w.detach().clone().requires_grad_(True), t))
    hd, wd = h.detach(), w.detach()

    def checks():
        o = linear._resolve(hd, wd, t, None, IGNORE, 0.0, 0.0, None, "mean", None, "auto",
                            None)[2]
        ops._check_targets(t, o.loss)

    spec.checks = checks
    spec.checks_note = "cross_entropy.linear._resolve + _check_targets"
    spec.launch_note = ("none: no single launch function (the chunk loop of GEMMs and "
                        "cross-entropy launches lives in its autograd function)")
    return spec


def moe_spec(inp: Inputs, liger: dict) -> OpSpec:
    from lmfuse.moe import ops

    T, H, Fd, E, k = (MOE[key] for key in ("T", "H", "F", "E", "k"))
    hidden = inp.randn(T, H, grad=True)
    top = torch.randn(T, E, device=inp.device).topk(k, dim=-1)
    ids = top.indices
    rw = torch.softmax(top.values, -1).to(inp.dtype).requires_grad_(True)
    wgu = inp.randn(E, 2 * Fd, H, scale=H ** -0.5, grad=True)
    wdn = inp.randn(E, H, Fd, scale=Fd ** -0.5, grad=True)
    g = inp.randn(T, H)

    def plain(h, ids, rw, wgu, wdn):
        gate, up = torch.einsum("th,tkfh->tkf", h, wgu[ids]).chunk(2, -1)
        y = torch.einsum("tkf,tkhf->tkh", F.silu(gate) * up, wdn[ids])
        return (y * rw.unsqueeze(-1)).sum(1)

    args = (hidden, ids, rw, wgu, wdn)
    spec = _spec(inp, "moe_experts",
                 f"hidden [{T}, {H}], expert_ids [{T}, {k}], E {E}, F {Fd}, swiglu",
                 Call(lmfuse.moe_experts, args), Call(plain, args),
                 "einsum with w[expert_ids] gathered per (token, slot), no host sync", g)
    hd, _, rwd, wgud, wdd = _detached(args)

    def resolve():
        return ops._resolve(hd, ids, rwd, wgud, wdd, None, None, "swiglu", 0.0, None, "halves",
                            "auto")

    spec.checks, spec.checks_note = resolve, "moe.ops._resolve"

    def build():
        s = resolve()[2]
        needs = (True, True, True, True, False, False)

        def fwd_bwd():
            _, h, perm, token, offsets, inv, weights = ops._forward(
                hd, ids, rwd, wgud, wdd, None, None, s, True)
            return ops._backward(g, hd, wgud, wdd, None, None, h, perm, token, offsets, inv,
                                 weights, s, needs)

        return {"fwd": lambda: ops._forward(hd, ids, rwd, wgud, wdd, None, None, s, False),
                "fwd+bwd": fwd_bwd}

    return _launch_rows(spec, inp, build, "moe.ops._forward (+ _backward)")


def decode_spec(inp: Inputs, liger: dict) -> OpSpec:
    from lmfuse.attention import ops

    B, S, Hq, Hkv, D = (DECODE[key] for key in ("B", "S", "Hq", "Hkv", "D"))
    q = inp.randn(B, 1, Hq, D)
    kc, vc = inp.randn(B, S, Hkv, D), inp.randn(B, S, Hkv, D)
    lens = torch.full((B,), S, dtype=torch.int32, device=inp.device)

    def plain(q, kc, vc):  # every sequence full: the one new token sees every key
        return F.scaled_dot_product_attention(q.transpose(1, 2), kc.transpose(1, 2),
                                              vc.transpose(1, 2), enable_gqa=Hq != Hkv
                                              ).transpose(1, 2)

    spec = _spec(inp, "decode_attention",
                 f"q [{B}, 1, {Hq}, {D}], caches [{B}, {S}, {Hkv}, {D}] full",
                 Call(lmfuse.decode_attention, (q, kc, vc, lens)), Call(plain, (q, kc, vc)),
                 "SDPA over the cache's transposed views (enable_gqa)", None, training=False)

    def resolve():
        return ops._resolve(q, kc, vc, lens, None, None, None, None, None, None, False, None,
                            "auto")

    spec.checks, spec.checks_note = resolve, "attention.ops._resolve (value checks included)"

    def build():
        s = resolve()
        return {"fwd": lambda: ops._launch_decode(q, kc, vc, lens, None, None, None, None, s)}

    return _launch_rows(spec, inp, build, "attention.ops._launch_decode")


def append_spec(inp: Inputs, liger: dict) -> OpSpec:
    from lmfuse.attention import ops

    B, S, Hkv, D = (DECODE[key] for key in ("B", "S", "Hkv", "D"))
    kc, vc = inp.randn(B, S, Hkv, D), inp.randn(B, S, Hkv, D)
    kn, vn = inp.randn(B, 1, Hkv, D), inp.randn(B, 1, Hkv, D)
    lens = torch.full((B,), S // 2, dtype=torch.int32, device=inp.device)
    pos = lens.long()

    def plain(kc, vc, kn, vn):  # as a static cache writes (B = 1: one position)
        kc.index_copy_(1, pos, kn)
        vc.index_copy_(1, pos, vn)

    spec = _spec(inp, "kv_cache_append",
                 f"k_new, v_new [{B}, 1, {Hkv}, {D}] into caches [{B}, {S}, {Hkv}, {D}]",
                 Call(lmfuse.kv_cache_append, (kc, vc, kn, vn, lens)),
                 Call(plain, (kc, vc, kn, vn)),
                 "k_cache.index_copy_(1, pos, k_new), the same for v", None, training=False)
    spec.checks_note = ("none: kv_cache_append checks inline (no separate resolve "
                        "function)")

    def build():
        return {"fwd": lambda: ops._launch_append(kc, vc, kn, vn, lens, None, None, None, S)}

    return _launch_rows(spec, inp, build, "attention.ops._launch_append")


def merge_spec(inp: Inputs, liger: dict) -> OpSpec:
    from lmfuse.attention import ops

    P, R, D = (MERGE[key] for key in ("P", "R", "D"))
    outs = inp.randn(P, R, D, dtype=torch.float32)
    lses = inp.randn(P, R, dtype=torch.float32)

    def plain(outs, lses):
        lse = torch.logsumexp(lses, 0)
        return (torch.exp(lses - lse).unsqueeze(-1) * outs).sum(0), lse

    spec = _spec(inp, "merge_attention_states", f"outs [{P}, {R}, {D}], lses [{P}, {R}] float32",
                 Call(lmfuse.merge_attention_states, (outs, lses)), Call(plain, (outs, lses)),
                 "logsumexp over the partials, exp-weighted sum", None, training=False)
    spec.checks = lambda: ops._resolve_merge(outs, lses, "auto")
    spec.checks_note = "attention.ops._resolve_merge"

    def build():
        return {"fwd": lambda: ops._launch_merge(outs, lses, torch.float32)}

    return _launch_rows(spec, inp, build, "attention.ops._launch_merge")


#: Op name -> the function making its rows, in the order they run.
SPECS: dict[str, Callable[[Inputs, dict], OpSpec]] = {
    "rms_norm": rms_norm_spec, "layer_norm": layer_norm_spec, "rope": rope_spec,
    **{name: partial(activation_spec, name) for name in ACTS},
    "fused_softmax": softmax_spec, "cross_entropy": cross_entropy_spec,
    "linear_cross_entropy": linear_cross_entropy_spec, "moe_experts": moe_spec,
    "decode_attention": decode_spec, "kv_cache_append": append_spec,
    "merge_attention_states": merge_spec,
}


def build_specs(inp: Inputs, liger: dict, ops: Optional[tuple[str, ...]] = None
                ) -> list[OpSpec]:
    """The rows of ``ops`` (None: every op), in :data:`SPECS`' order."""
    return [make(inp, liger) for name, make in SPECS.items() if ops is None or name in ops]


def op_names(text: str) -> tuple[str, ...]:
    """An argparse ``type``: comma-separated names of :data:`SPECS`."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in SPECS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            (f"unknown {', '.join(unknown)}" if unknown else f"no op in {text!r}")
            + f"; choose from {', '.join(SPECS)}")
    return names


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ops", type=op_names, default=None, metavar="OP,...",
                   help="time these ops only, comma-separated (default: every op)")


# --- timing ---------------------------------------------------------------------------------


def thunk(call: Call, mode: str, grad: Optional[torch.Tensor | tuple[torch.Tensor, ...]]
          ) -> Callable[[], object]:
    """One call of ``call`` in ``mode`` (the timing loop sets the grad mode)."""
    fn, args = call
    if mode == "fwd":
        args = _detached(args)
        return lambda: fn(*args)
    if mode == "fwd (grad)":
        return lambda: fn(*args)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]

    def fwd_bwd():
        out = fn(*args)
        if isinstance(out, tuple):  # several outputs (rope's q and k): a gradient for each
            torch.autograd.backward(out, grad)
        else:
            out.backward(grad)
        for t in leaves:
            t.grad = None

    return fwd_bwd


class Timing(NamedTuple):
    rounds: int
    calls: int  # K, per round
    warmup: int


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _why(exc: Exception) -> str:
    if isinstance(exc, PeerUnavailable):
        return f"unavailable: {' '.join(str(exc).split())}"[:160]
    return failure(exc)


def time_rows(thunks: dict[str, Callable[[], object]], device: torch.device, grad: bool,
              timing: Timing) -> dict[str, float | str]:
    """Row -> median host microseconds per call, or why it did not run. The rows take turns
    round by round; each round: the device idle, K calls timed, the clock stopped before
    the device is synchronised again."""
    out: dict[str, float | str] = {}
    live: dict[str, Callable[[], object]] = {}
    samples: dict[str, list[float]] = {}
    with torch.set_grad_enabled(grad):
        for name, fn in thunks.items():
            try:
                for _ in range(timing.warmup):
                    fn()
                _sync(device)
                live[name], samples[name] = fn, []
            except Exception as exc:  # a peer that cannot run is a row with a note
                out[name] = _why(exc)
        for _ in range(timing.rounds):
            for name, fn in list(live.items()):
                _sync(device)
                collecting = gc.isenabled()
                gc.disable()
                try:
                    t0 = time.perf_counter()
                    for _ in range(timing.calls):
                        fn()
                    t1 = time.perf_counter()
                except Exception as exc:
                    out[name] = _why(exc)
                    del live[name]
                    continue
                finally:
                    if collecting:
                        gc.enable()
                _sync(device)
                samples[name].append((t1 - t0) / timing.calls * 1e6)
    for name in live:
        out[name] = statistics.median(samples[name])
    return out


def _triton_launch(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with lmfuse's kernels launched through Triton's own path, not ``FastLaunch``."""

    def call() -> object:
        with _launch.triton_launches():
            return fn()

    return call


def run_op(spec: OpSpec, mode: str, device: torch.device, timing: Timing
           ) -> list[HostResult]:
    """The rows of one op in one mode; a row that does not run says why."""
    thunks = {impl: thunk(call, mode, spec.grad) for impl, call in spec.impls.items()}
    notes = dict(spec.notes)
    extra = {"fwd": [CHECKS, LAUNCH], "fwd+bwd": [LAUNCH]}.get(mode, [])
    if CHECKS in extra:
        notes[CHECKS] = spec.checks_note
        if spec.checks is not None:
            thunks[CHECKS] = spec.checks
    if LAUNCH in extra:
        notes[LAUNCH] = spec.launch_note
        if mode in spec.launch:
            thunks[LAUNCH] = spec.launch[mode]
    if device.type == "cuda" and _launch.fast_launches():
        extra.append(TRITON)
        notes[TRITON] = "the same call, its kernels launched by Triton's kernel[grid](...)"
        thunks[TRITON] = _triton_launch(thunks["lmfuse"])
    timed = time_rows(thunks, device, grad=mode != "fwd", timing=timing)
    base = timed.get("lmfuse")
    base = base if isinstance(base, float) else None
    rows = []
    for impl in [*spec.impls, *extra]:
        got = timed.get(impl)
        us = got if isinstance(got, float) else None
        note = notes.get(impl, "")
        if isinstance(got, str):  # it failed, or is not available here
            note = f"{got}; {note}" if note else got
        rows.append(HostResult(f"{spec.name} {mode}", impl, us / 1e3 if us else None, None,
                               us / base if (us and base) else None, None, note,
                               op=spec.name, mode=mode, us=us))
    return rows


def print_rows(rows: list[HostResult], header: bool) -> None:
    if header:
        print(f"{'case':<36} {'impl':<20} {'us/call':>9} {'x lmfuse':>8}  note")
    for r in rows:
        print(f"{r.case:<36} {r.impl:<20} {cell(r.us, '9.1f')} {cell(r.ratio, '8.2f')}  "
              f"{r.note}", flush=True)


# --- the breakdown and the target -------------------------------------------------------------


def breakdown(results: list[HostResult], specs: list[OpSpec], judge: bool) -> dict[str, dict]:
    """Per op, lmfuse's host time split (see the module docstring), printed; against Liger
    where it ran, the target (lmfuse's call at most Liger's, every mode), written into
    lmfuse's notes when ``judge``."""
    by = {(r.op, r.mode, r.impl): r for r in results}

    def us(op: str, mode: str, impl: str = "lmfuse") -> Optional[float]:
        r = by.get((op, mode, impl))
        return r.us if r is not None else None

    def diff(a: Optional[float], *b: Optional[float]) -> Optional[float]:
        return None if a is None or any(v is None for v in b) else a - sum(b)

    print("\n# lmfuse's host time per call, split (us): fwd = checks + launch + rest; "
          "autograd = fwd (grad) - fwd; over = fwd+bwd - its launches; torch, liger: their "
          "fwd+bwd (fwd for inference ops); target: lmfuse <= liger-kernel in every mode")
    cols = ("fwd", "checks", "launch", "rest", "autograd", "fwd+bwd", "launches", "over",
            "torch", "liger")
    print(f"{'op':<24}" + "".join(f" {c:>8}" for c in cols) + "  target")
    out = {}
    for spec in specs:
        op = spec.name
        fwd, checks, launch = us(op, "fwd"), us(op, "fwd", CHECKS), us(op, "fwd", LAUNCH)
        grad_fwd, fb, fb_launch = us(op, "fwd (grad)"), us(op, "fwd+bwd"), us(op, "fwd+bwd",
                                                                            LAUNCH)
        last = spec.modes[-1]
        d = dict(fwd=fwd, checks=checks, launch=launch, rest=diff(fwd, checks, launch),
                 autograd=diff(grad_fwd, fwd), fwd_bwd=fb, fwd_bwd_launches=fb_launch,
                 fwd_bwd_over_launches=diff(fb, fb_launch), torch=us(op, last, "torch"),
                 liger=us(op, last, LIGER))
        verdict = ""
        if LIGER in spec.impls:
            pairs = [(m, us(op, m), us(op, m, LIGER)) for m in spec.modes]
            ran = [(m, a, b) for m, a, b in pairs if a is not None and b is not None]
            if not ran:
                verdict = "liger-kernel did not run"
            elif not judge:
                verdict = "at most liger-kernel's: not judged off the GPU"
            else:
                missed = [m for m, a, b in ran if a > b]
                verdict = ("at most liger-kernel's: "
                           + (f"MISSED ({', '.join(missed)})" if missed else "met"))
                for m, _, _ in ran:
                    r = by[(op, m, "lmfuse")]
                    r.note = f"{r.note}; target {'MISSED' if m in missed else 'met'}"
        d["target"] = verdict
        out[op] = d
        values = (fwd, checks, launch, d["rest"], d["autograd"], fb, fb_launch,
                  d["fwd_bwd_over_launches"], d["torch"], d["liger"])
        print(f"{op:<24}" + "".join(f" {cell(v, '8.1f')}" for v in values)
              + f"  {verdict or '-'}")
    return out


def main(argv: list[str] | None = None) -> int:
    args, device, quick, env = start("lmfuse bench host", __doc__, argv,
                                     plot_what="host microseconds per call", options=_options)
    triton = triton_support(device)
    smoke = triton[0] and interpreter_active()
    timing = (Timing(2, 1, 1) if smoke else Timing(5, 20, 3) if quick else
              Timing(15, 100, 5))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    liger, liger_version = load_liger()
    print_peers(env, {"liger-kernel": liger_version})
    specs = build_specs(Inputs(device, dtype, triton), liger, args.ops)
    env.update(smoke=smoke, rounds=timing.rounds, calls_per_round=timing.calls,
               dtype=_launch.dtype_name(dtype),
               inputs={s.name: s.inputs for s in specs})
    for s in specs:
        print(f"# {s.name}: {s.inputs}")
    print(f"# host time per call: median over {timing.rounds} rounds of {timing.calls} calls, "
          f"the clock stopped before the device sync; {env['dtype']}; x lmfuse = us / "
          "lmfuse's us in the same mode (> 1: lmfuse's call is cheaper)")
    if smoke:
        print("# SMOKE RUN: Triton's interpreter runs every kernel on the CPU inside its "
              "launch: these figures are NOT the host time of a GPU call")
    results: list[HostResult] = []
    threads = torch.get_num_threads()
    if device.type == "cpu":  # (restored after: the caller's process keeps its setting)
        torch.set_num_threads(1)
        env["cpu_threads"] = 1
    try:
        for spec in specs:
            for mode in spec.modes:
                rows = run_op(spec, mode, device, timing)
                print_rows(rows, header=not results)
                results += rows
    finally:
        torch.set_num_threads(threads)
    env["breakdown"] = breakdown(results, specs, judge=device.type == "cuda" and not smoke)
    # The plot: host microseconds per call of every case, lmfuse, torch and Liger-Kernel.
    return finish(args, env, {}, results, f"host time per call on {env['device']}",
                  value=lambda r: r.us, ylabel="host us per call",
                  impls=["lmfuse", "torch", LIGER], case_width=0.5)


if __name__ == "__main__":
    raise SystemExit(main())
