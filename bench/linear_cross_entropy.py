"""``python3 bench/linear_cross_entropy.py [options]``, from a checkout.

The same as ``lmfuse bench linear_cross_entropy``: the harness ships in the package as
``lmfuse.bench.linear_cross_entropy`` (src/lmfuse/bench/linear_cross_entropy.py). This
file runs it, and the other scripts here may import its names from this module.
"""

from lmfuse.bench import linear_cross_entropy as _harness


def __getattr__(name: str):
    return getattr(_harness, name)


if __name__ == "__main__":
    raise SystemExit(_harness.main())
