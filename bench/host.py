"""``python3 bench/host.py [options]``, from a checkout.

The same as ``lmfuse bench host``: the harness ships in the package as
``lmfuse.bench.host`` (src/lmfuse/bench/host.py). This file runs it, and the
other scripts here may import its names from this module.
"""

from lmfuse.bench import host as _harness


def __getattr__(name: str):
    return getattr(_harness, name)


if __name__ == "__main__":
    raise SystemExit(_harness.main())
