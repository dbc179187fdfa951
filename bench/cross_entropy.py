"""``python3 bench/cross_entropy.py [options]``, from a checkout.

The same as ``lmfuse bench cross_entropy``: the harness ships in the package as
``lmfuse.bench.cross_entropy`` (src/lmfuse/bench/cross_entropy.py). This file runs it, and the
other scripts here may import its names from this module.
"""

from lmfuse.bench import cross_entropy as _harness


def __getattr__(name: str):
    return getattr(_harness, name)


if __name__ == "__main__":
    raise SystemExit(_harness.main())
