"""Bad targets through the cross-entropy and linear cross-entropy kernels with the value
checks off, for an out-of-bounds audit under compute-sanitizer: every load and store must
stay inside its tensors whatever the targets say (out of the vocabulary, negative, int64
huge, the ignore index, a tensor-parallel rank's column range), on every launch the
dispatcher can pick (rows that fit one tile, streamed rows, row slices over several
programs), forward and backward, with every option::

    compute-sanitizer --tool memcheck --error-exitcode 1 --leak-check no \\
        python tests/gpu/cross_entropy_bad_inputs.py

Each case runs once and is synchronised, so a fault is reported against its case; one line
per case; a non-zero exit on any Python error. The logits are exact-size allocations (a read
past the end is a read past the allocation). A bad target's loss is +inf on the GPU (the
documented CUDA behaviour with the checks off); this script only looks at the memory.
"""

from __future__ import annotations

import itertools
import sys

import torch

import lmfuse

DEV = "cuda"
TARGETS = {"past vocab": lambda V: [V, V + 7, 2**31 - 1], "negative": lambda V: [-1, -5, -(2**31)],
           "int64 huge": lambda V: [2**40, -(2**40), 3], "ignored": lambda V: [-100, -100, -100]}
OPTIONS = [dict(), dict(label_smoothing=0.1, z_loss=1e-4, softcap=30.0)]


def run(fn, name: str) -> bool:
    try:
        fn()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - a Python error is a failure of the audit
        print(f"ERROR {name}: {type(e).__name__}: {e}", flush=True)
        return False
    print(f"ok    {name}", flush=True)
    return True


def main() -> int:
    torch.manual_seed(0)
    ok = True
    lmfuse.set_checks(False)
    for V, (tname, targets), opts, dtype in itertools.product(
            (1000, 40000, 262144), TARGETS.items(), OPTIONS, (torch.bfloat16, torch.float32)):
        N = 3
        t = torch.tensor(targets(V), dtype=torch.int64, device=DEV)

        def ce():
            x = torch.randn(N, V, device=DEV, dtype=dtype, requires_grad=True)
            loss = lmfuse.cross_entropy(x, t, reduction="none", **opts)
            loss.backward(torch.ones_like(loss))

        ok &= run(ce, f"cross_entropy V={V} {tname} {dtype} {sorted(opts)}")
    for V, (tname, targets), dtype in itertools.product(
            (1000, 50000), TARGETS.items(), (torch.bfloat16, torch.float16)):
        N, H = 3, 256
        t = torch.tensor(targets(V), dtype=torch.int64, device=DEV)

        def lce():
            h = torch.randn(N, H, device=DEV, dtype=dtype, requires_grad=True)
            w = torch.randn(V, H, device=DEV, dtype=dtype, requires_grad=True)
            loss = lmfuse.linear_cross_entropy(h, w, t, reduction="sum")
            loss.backward()

        ok &= run(lce, f"linear_cross_entropy V={V} {tname} {dtype}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
