"""``python3 bench/generate.py [options]``, from a checkout.

The same as ``lmfuse bench generate``: the harness ships in the package as
``lmfuse.bench.generate`` (src/lmfuse/bench/generate.py). This file runs it, and the
other scripts here may import its names from this module.
"""

from lmfuse.bench import generate as _harness


def __getattr__(name: str):
    return getattr(_harness, name)


if __name__ == "__main__":
    raise SystemExit(_harness.main())
