"""``python3 bench/rms_norm.py [options]``, from a checkout.

The same as ``lmfuse bench rms_norm``: the harness ships in the package as
``lmfuse.bench.rms_norm`` (src/lmfuse/bench/rms_norm.py). This file runs it, and the
other scripts here may import its names from this module.
"""

from lmfuse.bench import rms_norm as _harness


def __getattr__(name: str):
    return getattr(_harness, name)


if __name__ == "__main__":
    raise SystemExit(_harness.main())
