"""Benchmark lmfuse's RMSNorm against torch eager, torch.compile and Liger-Kernel.

Run it as ``lmfuse bench rms_norm [--graphs] [--json PATH] [--plot PATH] [--quick]``.
``--graphs`` times CUDA graph replays of every row: the device time alone (eager calls of
forward+backward through autograd measure the host on a slow host). The cases are
bf16 ``x [16384, 4096]`` and ``x [16384, 8192]`` with a bf16 ``weight [H]``, each timed
forward only (no grad) and forward+backward (``torch.autograd.grad`` of the output, with a
fixed random upstream gradient, w.r.t. x and the weight).

Every row reports the median time, the achieved TB/s over the case's *minimal* bytes
(forward: read x and the weight, write the output; forward+backward: that, and read x, the
output's gradient and the weight again, write x's and the weight's gradients), its time as
a multiple of lmfuse's, and the peak memory allocated beyond the inputs.

Rows: ``lmfuse`` (``lmfuse.rms_norm``), ``torch`` (Hugging Face Llama's formula in eager
PyTorch: float32 statistics, the normalised x rounded to x's dtype, then times the
weight), ``torch.compile`` (that function, ``fullgraph=True``), ``liger-kernel``
(``LigerRMSNormFunction``, Llama casting mode, not in place; a row with a note when it is
not installed or cannot run), and ``copy`` (a device-to-device copy reading and writing as
many bytes as the case's minimum: the bandwidth ceiling). Each peer's result is checked
once against lmfuse's: the note gives ``||a - b|| / ||b||`` (the largest over the
gradients) and flags one over 1e-2 (1e-5 in float32). Hugging Face's formula rounds twice
(before the weight), lmfuse once, so the bf16 rows differ by a few bf16 roundings.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

import lmfuse
from lmfuse.bench.common import (Case, compile_per_shape, copy_case, dist_version,
                                 dtype_label, graphs_option, print_peers, relative_differences,
                                 run_against_copy, start, timed_call, unavailable)

EPS = 1e-6
NormFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, weight) -> y


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Hugging Face Llama's RMSNorm forward, as its users run it unfused."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * h.to(x.dtype)


_compiled = compile_per_shape(hf_rms_norm, 64)


def load_liger() -> tuple[NormFn, str, str]:
    """Liger-Kernel's RMSNorm as ``(x, weight) -> y``, its row's note, and its version; a
    stand-in that raises (so the row notes why) when it cannot be imported."""
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except Exception as exc:  # not installed, or its import needs what is missing here
        return unavailable(exc), f"unavailable ({type(exc).__name__})", "not installed"

    def liger(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # (X, W, eps, offset, casting_mode, in_place): in place would overwrite the
        # benchmark's upstream gradient with dx.
        return LigerRMSNormFunction.apply(x, weight, EPS, 0.0, "llama", False)

    return liger, "LigerRMSNormFunction, llama casting, not in place", \
        dist_version("liger-kernel")


def minimal_bytes(n: int, H: int, elt: int, backward: bool) -> int:
    """Forward: read x and the weight, write y. Backward besides: read x, dy and the
    weight, write dx and the weight's gradient."""
    fwd = (2 * n * H + H) * elt
    return fwd + ((3 * n * H + 2 * H) * elt if backward else 0)


def make_case(n: int, H: int, dtype: torch.dtype, device: torch.device, liger: NormFn,
              liger_note: str, *, backward: bool) -> Case:
    x = torch.randn(n, H, dtype=dtype, device=device)
    w = (1.0 + 0.1 * torch.randn(H, device=device)).to(dtype)
    g = torch.randn(n, H, dtype=dtype, device=device)
    if backward:
        x.requires_grad_(True)
        w.requires_grad_(True)

    timed = partial(timed_call, args=(x, w), backward=backward, wrt=[x, w], grad=g)

    nbytes = minimal_bytes(n, H, x.element_size(), backward)
    impls = {
        "lmfuse": timed(lambda x, w: lmfuse.rms_norm(x, w, eps=EPS)),
        "torch": timed(hf_rms_norm),
        "torch.compile": timed(_compiled),
        "liger-kernel": timed(liger),
    }
    notes = {"torch": "HF Llama formula", "torch.compile": "fullgraph, of the torch row",
             "liger-kernel": liger_note}
    relative_differences(impls, dtype, notes=notes)
    mode = "fwd+bwd" if backward else "fwd"
    return copy_case(f"rms_norm {mode} [{n}, {H}] {dtype_label(dtype)}", nbytes, impls, notes,
                     device)


def main(argv: list[str] | None = None) -> int:
    args, device, quick, env = start("lmfuse bench rms_norm", __doc__, argv,
                                     options=graphs_option)
    liger, liger_note, liger_version = load_liger()
    print_peers(env, {"liger-kernel": liger_version})
    dtype = torch.float32 if quick else torch.bfloat16
    shapes = [(64, 512), (64, 1000)] if quick else [(16384, 4096), (16384, 8192)]
    cases = [make_case(n, H, dtype, device, liger, liger_note, backward=bw)
             for n, H in shapes for bw in (False, True)]
    n, H = shapes[0]
    copy_bytes = minimal_bytes(n, H, torch.finfo(dtype).bits // 8, False) // 2
    return run_against_copy(
        args, device, env, cases, copy_bytes,
        "# TB/s over minimal bytes (fwd: read x and the weight, write y; fwd+bwd also: read "
        "x, dy and the weight, write dx and dweight); x lmfuse = ms / lmfuse ms (> 1: "
        "lmfuse is faster); peak MiB: allocated beyond the inputs", "rms_norm")

if __name__ == "__main__":
    raise SystemExit(main())
