"""``python3 bench/moe_experts.py [options]``, from a checkout.

The same as ``lmfuse bench moe_experts``: the harness ships in the package as
``lmfuse.bench.moe_experts`` (src/lmfuse/bench/moe_experts.py). This file runs it, and the
other scripts here may import its names from this module.
"""

from lmfuse.bench import moe_experts as _harness


def __getattr__(name: str):
    return getattr(_harness, name)


if __name__ == "__main__":
    raise SystemExit(_harness.main())
