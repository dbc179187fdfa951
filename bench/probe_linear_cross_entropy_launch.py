"""``linear_cross_entropy`` fwd+bwd (bf16, H = 4096) with the cross-entropy table's own
launch for the logits chunks (the config's ``kernel`` null) against the launch the table
made before the whole-row launches, forced through the config's ``kernel``; interleaved,
best of two, one process: ``python3 bench/probe_linear_cross_entropy_launch.py``
(``$OUT`` or the current directory gets ``lce_ab.json``)."""
import json
import os

import torch
import triton

import lmfuse
from lmfuse.cross_entropy import linear

PREVIOUS = {
    128256: {"BLOCK_V": 4096, "num_warps": 8, "programs_per_sm": 8, "slice": 16384, "lag": 3,
             "hints": 1},
    32000: {"BLOCK_V": 8192, "num_warps": 16, "programs_per_sm": 8, "hints": 1},
}
ORIGINAL = linear.config


def with_kernel(kernel):
    """``linear.config`` with its ``kernel`` replaced (``None``: the config as it is)."""
    def config(v_local, device):
        cfg, source = ORIGINAL(v_local, device)
        return (cfg if kernel is None else dict(cfg, kernel=kernel)), source
    return config


def probe(n: int, V: int, H: int = 4096) -> dict:
    dev = torch.device("cuda")
    h = (torch.randn(n, H, device=dev, dtype=torch.bfloat16) * 0.5).requires_grad_()
    w = (torch.randn(V, H, device=dev, dtype=torch.bfloat16) * 0.02).requires_grad_()
    t = torch.randint(0, V, (n,), device=dev)
    t[::20] = -100

    def step():
        torch.autograd.grad(lmfuse.linear_cross_entropy(h, w, t), (h, w))

    res = {"new": [], "previous": []}
    try:
        for _ in range(2):
            for key, kernel in (("new", None), ("previous", PREVIOUS[V])):
                linear.config = with_kernel(kernel)
                res[key].append(triton.testing.do_bench(step, warmup=3,
                                                        rep=300 if n == 8192 else 1500))
    finally:
        linear.config = ORIGINAL
    return {"N": n, "V": V, "new_ms": min(res["new"]), "previous_ms": min(res["previous"]),
            "all": res}


def main() -> None:
    name = torch.cuda.get_device_name(torch.device("cuda"))
    print(name, flush=True)
    out = {"device": name, "torch": torch.__version__, "triton": triton.__version__,
           "command": "python3 bench/probe_linear_cross_entropy_launch.py", "rows": []}
    for n, V in ((8192, 32000), (8192, 128256), (65536, 128256)):
        out["rows"].append(probe(n, V))
        print(json.dumps(out["rows"][-1]), flush=True)
        torch.cuda.empty_cache()
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "lce_ab.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
