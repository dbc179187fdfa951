"""``python3 bench/activations.py [options]``, from a checkout.

The same as ``lmfuse bench activations``: the harness ships in the package as
``lmfuse.bench.activations`` (src/lmfuse/bench/activations.py). This file runs it, and the
other scripts here may import its names from this module.
"""

from lmfuse.bench import activations as _harness


def __getattr__(name: str):
    return getattr(_harness, name)


if __name__ == "__main__":
    raise SystemExit(_harness.main())
