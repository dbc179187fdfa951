"""Benchmark lmfuse's activations against torch eager, torch.compile and Megatron-Core.

Run it as ``lmfuse bench activations [--json PATH] [--plot PATH] [--quick]``. The cases
are bf16, 16384 tokens: bias-SwiGLU and bias-GEGLU on ``x [16384, 2 * 14336]`` with a bias
``[2 * 14336]``; weighted SwiGLU (no bias) on the same ``x`` with float32 per-token weights
``[16384, 1]``; bias-GELU, squared ReLU and weighted squared ReLU on ``x [16384, 14336]``.
Each is timed forward only (no grad) and forward+backward (``torch.autograd.grad`` of the
output, with a fixed random upstream gradient, w.r.t. x and the bias / weights).
bias-SwiGLU is also timed with ``fp8_input_store=True`` (x saved for backward as float8):
its forward as a training step runs it (x requiring grad) and its forward+backward, against
the same call without the fp8 store and Megatron-Core's ``fp8_input_store=True``.

Every case reports the median time, the achieved TB/s over the *minimal* bytes (forward:
read x, the bias and the weights, write the output; forward+backward: that, and read x
and the output's gradient again, write x's gradient (and the bias' / weights' gradients,
reading those once more)), each peer's time as a multiple of lmfuse's, and the peak memory
allocated beyond the inputs. A device-to-device copy moving the bias-SwiGLU forward's bytes,
timed in the same run, is the bandwidth ceiling.

Peers: ``torch`` is the formula with plain torch ops in float32 math (as lmfuse computes),
``torch.compile`` that function compiled with ``fullgraph=True``, ``megatron-core`` its
fused functions (``bias_swiglu_impl``, ``weighted_bias_swiglu_impl``, ``bias_geglu_impl``,
``bias_gelu_impl``, ``weighted_squared_relu_impl``; for plain squared ReLU, which has no
fusion, ``megatron.core.activations.squared_relu``), which its ``jit_fuser`` compiles with
torch.compile. A peer that is not installed or cannot run a case is a row with a note, not
a crash. Each row's result (output forward; gradients forward+backward) is checked once
against lmfuse's: the note gives the relative difference ``||a - b|| / ||b||`` (the largest
over the gradients) and flags one over 1e-2 (bf16/fp16; 1e-5 float32).

The targets, checked at the end for SwiGLU, GEGLU and weighted SwiGLU: forward at least
0.97x the copy's TB/s; forward+backward at least 1.3x faster than Megatron-Core.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F

import lmfuse
from lmfuse.bench.common import (Case, Result, cell, compile_per_shape, dist_version,
                                 dtype_label, finish, measure_copy, print_peers,
                                 relative_differences, run_cases, start, timed_call,
                                 unavailable)

ActFn = Callable[..., torch.Tensor]  # (x, bias or None, weights or None) -> output

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": lambda a: F.gelu(a, approximate="tanh"),
    "squared_relu": lambda a: F.relu(a).square(),
}


def eager_activation(x, bias=None, weights=None, *, activation: str, gated: bool):
    """The unfused expression a user writes (float32 math), also the torch.compile input.

    Gated: ``act(x1) * x2`` with ``x1, x2`` the two halves of ``x + bias``'s last dim."""
    y = x.float()
    if bias is not None:
        y = y + bias.float()
    if gated:
        gate, linear = y.chunk(2, dim=-1)
        out = ACTIVATIONS[activation](gate) * linear
    else:
        out = ACTIVATIONS[activation](y)
    if weights is not None:
        out = out * weights.float()
    return out.to(x.dtype)


_compiled = compile_per_shape(eager_activation)


class Op(NamedTuple):
    """One benchmarked activation: lmfuse's call and the eager formula's switches."""

    lmfuse: ActFn
    activation: str
    gated: bool
    bias: bool
    weighted: bool


OPS: dict[str, Op] = {
    "bias_swiglu": Op(lambda x, b, w: lmfuse.swiglu(x, b), "silu", True, True, False),
    "bias_geglu": Op(lambda x, b, w: lmfuse.geglu(x, b), "gelu", True, True, False),
    "weighted_swiglu": Op(lambda x, b, w: lmfuse.weighted_swiglu(x, w), "silu", True, False,
                          True),
    "bias_gelu": Op(lambda x, b, w: lmfuse.bias_gelu(x, b), "gelu", False, True, False),
    "squared_relu": Op(lambda x, b, w: lmfuse.squared_relu(x), "squared_relu", False, False,
                       False),
    "weighted_sqrelu": Op(lambda x, b, w: lmfuse.weighted_squared_relu(x, w), "squared_relu",
                          False, False, True),
}
TARGET_OPS = ("bias_swiglu", "bias_geglu", "weighted_swiglu")
FWD_SHARE_OF_COPY = 0.97  # forward TB/s at least this share of the copy's
FWD_BWD_SPEEDUP = 1.3  # forward+backward at least this much faster than Megatron-Core


def load_megatron() -> tuple[dict[str, tuple[ActFn, str]], str]:
    """Op name -> (Megatron-Core's function as ``(x, bias, weights) -> out``, note), and
    Megatron-Core's version. A function whose import fails becomes a stand-in that raises,
    so its row notes why."""

    def load(module: str, name: str, call: Callable[..., torch.Tensor]) -> tuple[ActFn, str]:
        try:
            fn = getattr(importlib.import_module(f"megatron.core.{module}"), name)
        except Exception as exc:  # not installed, or its import needs what is missing here
            return unavailable(exc), f"unavailable ({type(exc).__name__})"
        return (lambda x, b, w: call(fn, x, b, w)), f"{name}, torch.compile'd"

    fns = {
        "bias_swiglu": load("fusions.fused_bias_swiglu", "bias_swiglu_impl",
                            lambda f, x, b, w: f(x, b)),
        "bias_geglu": load("fusions.fused_bias_geglu", "bias_geglu_impl",
                           lambda f, x, b, w: f(x, b)),
        "weighted_swiglu": load("fusions.fused_bias_swiglu", "weighted_bias_swiglu_impl",
                                lambda f, x, b, w: f(x, None, w)),
        "bias_gelu": load("fusions.fused_bias_gelu", "bias_gelu_impl",
                          lambda f, x, b, w: f(x, b)),
        "squared_relu": load("activations", "squared_relu", lambda f, x, b, w: f(x)),
        "weighted_sqrelu": load("fusions.fused_weighted_squared_relu",
                                "weighted_squared_relu_impl", lambda f, x, b, w: f(x, w)),
        "bias_swiglu_fp8": load("fusions.fused_bias_swiglu", "bias_swiglu_impl",
                                lambda f, x, b, w: f(x, b, True)),
    }
    return fns, dist_version("megatron-core")


class Inputs:
    """An op's inputs, shared by its forward and forward+backward cases: ``x [n, K]``,
    ``bias [K]`` (x's dtype), float32 ``weights [n, 1]`` (all requiring grad), and the
    upstream gradient ``g`` of the output."""

    def __init__(self, op: Op, n: int, K: int, dtype: torch.dtype, device: torch.device):
        self.op, self.n, self.K = op, n, K
        self.x = torch.randn(n, K, dtype=dtype, device=device).requires_grad_(True)
        self.bias = (torch.randn(K, dtype=dtype, device=device).requires_grad_(True)
                     if op.bias else None)
        self.weights = (torch.rand(n, 1, dtype=torch.float32, device=device)
                        .requires_grad_(True) if op.weighted else None)
        self.out_cols = K // 2 if op.gated else K
        self.g = torch.randn(n, self.out_cols, dtype=dtype, device=device)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.x, self.bias, self.weights) if t is not None]

    def minimal_bytes(self, backward: bool) -> int:
        """Forward: read x, bias, weights; write the output. Backward besides: read x, the
        output's gradient, bias and weights; write their gradients."""
        elt = self.x.element_size()
        x_bytes, out_bytes = self.n * self.K * elt, self.n * self.out_cols * elt
        extra = sum(t.numel() * t.element_size() for t in self.tensors()[1:])
        fwd = x_bytes + extra + out_bytes
        return fwd + (x_bytes + out_bytes + x_bytes + 2 * extra if backward else 0)


def make_case(data: Inputs, name: str, megatron: tuple[ActFn, str], *, backward: bool
              ) -> Case:
    op = data.op
    inputs = data.tensors()
    if backward:
        x, bias, weights = data.x, data.bias, data.weights
    else:
        x, bias, weights = (t.detach() if t is not None else None
                            for t in (data.x, data.bias, data.weights))

    timed = partial(timed_call, args=(x, bias, weights), backward=backward, wrt=inputs,
                    grad=data.g)

    formula = {"activation": op.activation, "gated": op.gated}
    megatron_fn, megatron_note = megatron
    impls = {
        "lmfuse": timed(op.lmfuse),
        "torch": timed(lambda x, b, w: eager_activation(x, b, w, **formula)),
        "torch.compile": timed(lambda x, b, w: _compiled(x, b, w, **formula)),
        "megatron-core": timed(megatron_fn),
    }
    notes = {"torch": "float32 math", "torch.compile": "fullgraph, of the torch row",
             "megatron-core": megatron_note}
    relative_differences(impls, x.dtype, notes=notes)
    mode = "fwd+bwd" if backward else "fwd"
    dtype = dtype_label(x.dtype)
    return Case(f"{name} {mode} [{data.n}, {data.K}] {dtype}", data.minimal_bytes(backward),
                impls, notes)


def make_fp8_store_cases(data: Inputs, megatron: tuple[ActFn, str]) -> list[Case]:
    """bias-SwiGLU with ``fp8_input_store=True``: the forward that saves x for backward (x
    requires grad; the output and what it saves are dropped after each call) and
    forward+backward. Minimal bytes: the forward's, plus x written as float8 (1 byte an
    element); forward+backward reads that float8 copy instead of x."""
    x, bias, g = data.x, data.bias, data.g
    n, K, elt = data.n, data.K, data.x.element_size()
    fwd = n * K * elt + K * elt + n * data.out_cols * elt + n * K
    fwd_bwd = fwd + n * K + n * data.out_cols * elt + n * K * elt + 2 * K * elt
    megatron_fn, megatron_note = megatron
    calls = {
        "lmfuse": lambda x, b: lmfuse.swiglu(x, b, fp8_input_store=True),
        "lmfuse (no fp8 store)": lambda x, b: lmfuse.swiglu(x, b),
        "megatron-core": lambda x, b: megatron_fn(x, b, None),
    }
    notes = {"lmfuse (no fp8 store)": "fp8_input_store=False (its TB/s counts the fp8 bytes "
                                      "it does not move)",
             "megatron-core": f"{megatron_note}, fp8_input_store=True"}
    dtype = dtype_label(x.dtype)
    cases = []
    for mode, nbytes in (("fwd-saving", fwd), ("fwd+bwd", fwd_bwd)):
        if mode == "fwd-saving":
            impls = {k: (lambda f=f: f(x, bias)) for k, f in calls.items()}
        else:
            impls = {k: (lambda f=f: torch.autograd.grad(f(x, bias), [x, bias], g))
                     for k, f in calls.items()}
        case_notes = relative_differences(impls, x.dtype, notes=dict(notes))
        plain = "lmfuse (no fp8 store)"  # its gradients are not rounded through fp8
        case_notes[plain] = case_notes[plain].replace(", CHECK", ", the fp8 store's rounding")
        cases.append(Case(f"bias_swiglu-fp8-store {mode} [{n}, {K}] {dtype}", nbytes, impls,
                          case_notes))
    return cases


def build_cases(device: torch.device, quick: bool, megatron: dict) -> tuple[list[Case], int]:
    """The cases, and the bytes of the bias-SwiGLU forward (the copy moves as many)."""
    dtype = torch.float32 if quick else torch.bfloat16
    n, ffn = (64, 128) if quick else (16384, 14336)
    cases, swiglu_fwd_bytes = [], 0
    for name, op in OPS.items():
        data = Inputs(op, n, 2 * ffn if op.gated else ffn, dtype, device)
        cases += [make_case(data, name, megatron[name], backward=bw) for bw in (False, True)]
        if name == "bias_swiglu":
            swiglu_fwd_bytes = data.minimal_bytes(backward=False)
            cases += make_fp8_store_cases(data, megatron["bias_swiglu_fp8"])
    return cases, swiglu_fwd_bytes


def check_targets(results: list[Result], copy_bw: float, judge: bool) -> None:
    """Prints lmfuse's TB/s as a share of the copy's and Megatron-Core's time as a multiple
    of lmfuse's, per case; for SwiGLU, GEGLU and weighted SwiGLU also the target and, when
    ``judge`` (on a GPU), whether it is met, which is added to lmfuse's note (and so to the
    JSON)."""
    print(f"\n# lmfuse against its targets ({', '.join(TARGET_OPS)}): forward TB/s >= "
          f"{FWD_SHARE_OF_COPY:.2f}x the copy's; forward+backward >= {FWD_BWD_SPEEDUP}x "
          "faster than megatron-core (x lmfuse = its ms / lmfuse ms)")
    print(f"{'case':<44} {'TB/s':>6} {'x copy':>6} {'megatron x lmfuse':>17}  target")
    for ours in (r for r in results if r.impl == "lmfuse"):
        if ours.ms is None:
            print(f"{ours.case:<44} lmfuse did not run")
            continue
        name, mode = ours.case.split()[:2]
        megatron = next((r for r in results if r.case == ours.case and r.impl ==
                         "megatron-core"), None)
        speedup = megatron.ratio if megatron is not None else None
        share = ours.tbps / copy_bw if copy_bw else None
        verdict = ""
        if name in TARGET_OPS and mode == "fwd":
            ok = share is not None and share >= FWD_SHARE_OF_COPY
            verdict = f"fwd >= {FWD_SHARE_OF_COPY:.2f}x copy: {'met' if ok else 'MISSED'}"
        elif name in TARGET_OPS:
            ok = speedup is not None and speedup >= FWD_BWD_SPEEDUP
            verdict = (f"fwd+bwd >= {FWD_BWD_SPEEDUP}x megatron-core: "
                       + ("met" if ok else "MISSED" if speedup else "no megatron-core time"))
        if verdict and not judge:
            verdict = verdict.split(":")[0] + ": not judged off the GPU"
        elif verdict:
            ours.note = f"{ours.note}; target {verdict}".lstrip("; ")
        print(f"{ours.case:<44} {ours.tbps:6.2f} {cell(share, '6.2f')} "
              f"{cell(speedup, '17.2f')}  {verdict}")


def main(argv: list[str] | None = None) -> int:
    args, device, quick, env = start("lmfuse bench activations", __doc__, argv)
    megatron, megatron_version = load_megatron()
    print_peers(env, {"megatron-core": megatron_version})
    cases, swiglu_fwd_bytes = build_cases(device, quick, megatron)
    # read and written: the bias-SwiGLU forward's bytes
    copy = measure_copy(swiglu_fwd_bytes // 2, device)
    print("# TB/s over minimal bytes (fwd: read x, bias, weights, write the output; fwd+bwd "
          "also: read x, the output's gradient, write the gradients); x lmfuse = ms / lmfuse "
          "ms (> 1: lmfuse is faster); peak MiB: allocated beyond the inputs")
    results = run_cases(cases, device)
    check_targets(results, copy["tbps"], judge=device.type == "cuda")
    return finish(args, env, copy, results,
                  f"activations on {env['device']} (copy: {copy['tbps']:.2f} TB/s)")


if __name__ == "__main__":
    raise SystemExit(main())
