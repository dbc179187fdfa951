"""Self-check harness behind ``lmfuse check``: each op against its reference, per dtype.

A family contributes :class:`CheckCase` objects (from ``checks(device)`` in its
``ops.py``). The harness runs the op the way a user would (``impl="auto"``) and the
reference on float64 copies of the same inputs, then compares the output and the
gradient of every differentiable input under one random upstream gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from ._dispatch import Plan
from ._launch import dtype_name

# Relative-error bounds (‖out − ref‖ / ‖ref‖ against a float64 reference) by dtype: the
# output's own rounding dominates for 16-bit types. Where merely storing the exact answer in
# the dtype already costs more (fp16 subnormals: softmax rows of 10^4+ keys), the bound is
# twice that storage error instead; see :func:`bound`.
TOLERANCE = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ in float64 (absolute error when ‖expected‖ is 0)."""
    a, e = actual.detach().double(), expected.detach().double()
    if torch.isnan(a).any() or torch.isinf(a).any() != torch.isinf(e).any():
        return float("inf")
    den = e.norm().item()
    num = (a - e).norm().item()
    return num / den if den > 0 else num


def bound(expected: torch.Tensor, dtype: torch.dtype) -> float:
    """The error allowed for an output whose exact value is ``expected``, stored in ``dtype``."""
    return max(TOLERANCE[dtype], 2 * rel_err(expected.to(dtype), expected))


@dataclass
class CheckCase:
    """``call(impl, *inputs) -> Tensor``; inputs that require grad get gradients checked.

    ``plan(*inputs)`` is the op's planner on the same call, to report the path taken.
    """

    op: str
    label: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    inputs: Callable[[], Sequence[torch.Tensor]]
    call: Callable[..., torch.Tensor]
    plan: Callable[..., Plan]


def op_case(op: str, label: str, dtype: torch.dtype, shape: tuple[int, ...],
            inputs: Callable[[], Sequence[torch.Tensor]], fn: Callable[..., torch.Tensor],
            planner: Callable[..., Plan], *args: Any, keywords: Sequence[str] = (),
            **kwargs: Any) -> CheckCase:
    """The :class:`CheckCase` of ``fn(*inputs, *args, impl=impl, **kwargs)``, planned by
    ``planner(*inputs, *args, **kwargs)``: the op's inputs first, then what stays fixed.
    ``keywords``: the names of the last inputs, which go by keyword."""

    def split(xs: Sequence[torch.Tensor]) -> tuple[Sequence[torch.Tensor], dict[str, Any]]:
        n = len(xs) - len(keywords)
        return xs[:n], dict(zip(keywords, xs[n:]), **kwargs)

    def call(impl: str, *xs: torch.Tensor) -> torch.Tensor:
        given, named = split(xs)
        return fn(*given, *args, impl=impl, **named)

    def plan(*xs: torch.Tensor) -> Plan:
        given, named = split(xs)
        return planner(*given, *args, **named)

    return CheckCase(op, label, dtype, shape, inputs, call, plan)


@dataclass
class CheckResult:
    op: str
    label: str
    dtype: str
    shape: str
    impl: str
    fwd_err: float
    grad_err: Optional[float]  # None: the op has no gradient to check (no input needs one)
    ok: bool


def run_case(case: CheckCase) -> CheckResult:
    inputs = list(case.inputs())
    ref_inputs = [
        t.detach().double().requires_grad_(t.requires_grad) if t.is_floating_point() else t
        for t in inputs
    ]
    out = case.call("auto", *inputs)
    ref = case.call("torch", *ref_inputs)
    fwd = rel_err(out, ref)
    ok = fwd <= bound(ref, case.dtype)
    grad = None
    diff = [i for i, t in enumerate(inputs) if t.requires_grad]
    if diff:
        # One upstream gradient, representable in the op's dtype, for both sides.
        g = torch.randn(out.shape, device=out.device).to(out.dtype)
        gs = torch.autograd.grad(out, [inputs[i] for i in diff], g)
        rs = torch.autograd.grad(ref, [ref_inputs[i] for i in diff], g.double())
        errs = [rel_err(a, b) for a, b in zip(gs, rs)]
        grad = max(errs)
        ok &= all(e <= bound(r, case.dtype) for e, r in zip(errs, rs))
    return CheckResult(
        case.op, case.label, dtype_name(case.dtype), "x".join(map(str, case.shape)),
        case.plan(*inputs).impl, fwd, grad, ok,
    )


def run_all(cases: Sequence[CheckCase], out=print) -> bool:
    """Run every case, one table row each as it finishes (columns as wide as the longest
    entry); True when all pass. An op without a gradient shows ``-`` in that column."""
    widths = [max([len(title)] + [len(f(c)) for c in cases]) for title, f in (
        ("op", lambda c: c.op), ("case", lambda c: c.label),
        ("dtype", lambda c: dtype_name(c.dtype)), ("shape", lambda c: "x".join(map(str, c.shape))))]

    def row(op: str, label: str, dtype: str, shape: str, impl: str, fwd: str, grad: str,
            result: str) -> str:
        cells = (f"{x:<{w}}" for x, w in zip((op, label, dtype, shape), widths))
        return f"{' '.join(cells)} {impl:<7} {fwd:>11} {grad:>12}  {result}"

    out(row("op", "case", "dtype", "shape", "impl", "fwd rel err", "grad rel err", "result"))
    ok = True
    for case in cases:
        r = run_case(case)
        ok &= r.ok
        grad = "-" if r.grad_err is None else f"{r.grad_err:.2e}"
        out(row(r.op, r.label, r.dtype, r.shape, r.impl, f"{r.fwd_err:.2e}", grad,
                "pass" if r.ok else "FAIL"))
    return ok
