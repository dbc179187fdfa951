"""Benchmark lmfuse's LayerNorm against torch eager, torch.compile and Liger-Kernel.

Run it as ``lmfuse bench layer_norm [--graphs] [--json PATH] [--plot PATH] [--quick]``.
``--graphs`` times CUDA graph replays of every row: the device time alone (eager calls of
forward+backward through autograd measure the host on a slow host). The cases are
bf16 ``x [16384, 4096]`` and ``x [16384, 8192]`` with a bf16 ``weight [H]`` and ``bias [H]``,
and float32 ``x [16384, 4096]`` with float32 ones, each timed forward only (no grad) and
forward+backward (``torch.autograd.grad`` of the output, with a fixed random upstream
gradient, w.r.t. x, the weight and the bias). ``--quick`` (the default on the CPU): float32
``x [64, 512]`` and ``x [64, 1000]``.

Every row reports the median time, the achieved TB/s over the case's *minimal* bytes
(forward: read x, the weight and the bias, write the output; forward+backward: that, and
read x, the output's gradient and the weight again, write x's, the weight's and the bias's
gradients; the row statistics a forward may save for its backward, 8 bytes a row, are not
counted: an implementation may recompute them), its time as a multiple of lmfuse's, and the
peak memory allocated beyond the inputs.

Rows: ``lmfuse`` (``lmfuse.layer_norm``), ``torch`` (``F.layer_norm`` in eager PyTorch: on
CUDA, PyTorch's own fused kernels, forward and backward), ``torch.compile`` (that call,
``fullgraph=True``), ``liger-kernel`` (``LigerLayerNormFunction``; a row with a note when it
is not installed or cannot run), and ``copy`` (a device-to-device copy reading and writing
as many bytes as the case's minimum: the bandwidth ceiling). Each peer's result is checked
once against lmfuse's: the note gives ``||a - b|| / ||b||`` (the largest over the gradients)
and flags one over 1e-2 (1e-5 in float32). All four compute in float32 and round the output
once, so the bf16 rows differ by a bf16 rounding at most.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

import lmfuse
from lmfuse.bench.common import (Case, compile_per_shape, copy_case, dist_version,
                                 dtype_label, graphs_option, print_peers, relative_differences,
                                 run_against_copy, start, timed_call, unavailable)

EPS = 1e-5  # torch.nn.LayerNorm's
NormFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (x, w, b) -> y


def torch_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
                     ) -> torch.Tensor:
    """PyTorch's LayerNorm over the last dim, as ``nn.LayerNorm`` calls it."""
    return F.layer_norm(x, x.shape[-1:], weight, bias, EPS)


_compiled = compile_per_shape(torch_layer_norm, 64)


def load_liger() -> tuple[NormFn, str, str]:
    """Liger-Kernel's LayerNorm as ``(x, weight, bias) -> y``, its row's note, and its
    version; a stand-in that raises (so the row notes why) when it cannot be imported."""
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    except Exception as exc:  # not installed, or its import needs what is missing here
        return unavailable(exc), f"unavailable ({type(exc).__name__})", "not installed"

    def liger(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        # (X, W, B, eps): the weight and the bias are required
        return LigerLayerNormFunction.apply(x, weight, bias, EPS)

    return liger, "LigerLayerNormFunction", dist_version("liger-kernel")


def minimal_bytes(n: int, H: int, x_elt: int, param_elt: int, backward: bool) -> int:
    """Forward: read x, the weight and the bias, write y. Backward besides: read x, dy and
    the weight, write dx and the weight's and the bias's gradients. ``x_elt``: bytes per
    element of x, y, dy and dx; ``param_elt``: of the weight, the bias and their
    gradients."""
    fwd = 2 * n * H * x_elt + 2 * H * param_elt
    return fwd + (3 * n * H * x_elt + 3 * H * param_elt if backward else 0)


def make_case(n: int, H: int, dtype: torch.dtype, device: torch.device, liger: NormFn,
              liger_note: str, *, backward: bool) -> Case:
    x = torch.randn(n, H, dtype=dtype, device=device)
    w = (1.0 + 0.1 * torch.randn(H, device=device)).to(dtype)
    b = (0.1 * torch.randn(H, device=device)).to(dtype)
    g = torch.randn(n, H, dtype=dtype, device=device)
    if backward:
        for t in (x, w, b):
            t.requires_grad_(True)

    timed = partial(timed_call, args=(x, w, b), backward=backward, wrt=[x, w, b], grad=g)

    nbytes = minimal_bytes(n, H, x.element_size(), w.element_size(), backward)
    impls = {
        "lmfuse": timed(lambda x, w, b: lmfuse.layer_norm(x, w, b, eps=EPS)),
        "torch": timed(torch_layer_norm),
        "torch.compile": timed(_compiled),
        "liger-kernel": timed(liger),
    }
    notes = {"torch": "F.layer_norm", "torch.compile": "fullgraph, of the torch row",
             "liger-kernel": liger_note}
    relative_differences(impls, dtype, notes=notes)
    mode = "fwd+bwd" if backward else "fwd"
    return copy_case(f"layer_norm {mode} [{n}, {H}] {dtype_label(dtype)}", nbytes, impls,
                     notes, device)


def main(argv: list[str] | None = None) -> int:
    args, device, quick, env = start("lmfuse bench layer_norm", __doc__, argv,
                                     options=graphs_option)
    liger, liger_note, liger_version = load_liger()
    print_peers(env, {"liger-kernel": liger_version})
    fp32, bf16 = torch.float32, torch.bfloat16
    shapes = ([(64, 512, fp32), (64, 1000, fp32)] if quick else
              [(16384, 4096, bf16), (16384, 8192, bf16), (16384, 4096, fp32)])
    cases = [make_case(n, H, dtype, device, liger, liger_note, backward=bw)
             for n, H, dtype in shapes for bw in (False, True)]
    n, H, dtype = shapes[0]
    elt = torch.finfo(dtype).bits // 8
    return run_against_copy(
        args, device, env, cases, minimal_bytes(n, H, elt, elt, False) // 2,
        "# TB/s over minimal bytes (fwd: read x, the weight and the bias, write y; fwd+bwd "
        "also: read x, dy and the weight, write dx, dweight and dbias); x lmfuse = ms / "
        "lmfuse ms (> 1: lmfuse is faster); peak MiB: allocated beyond the inputs",
        "layer_norm")

if __name__ == "__main__":
    raise SystemExit(main())
