"""``python3 bench/decode_attention.py [options]``, from a checkout.

The same as ``lmfuse bench decode_attention``: the harness ships in the package as
``lmfuse.bench.decode_attention`` (src/lmfuse/bench/decode_attention.py). This file runs it, and the
other scripts here may import its names from this module.
"""

from lmfuse.bench import decode_attention as _harness


def __getattr__(name: str):
    return getattr(_harness, name)


if __name__ == "__main__":
    raise SystemExit(_harness.main())
