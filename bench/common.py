"""The shared benchmark harness, for the scripts here that ``from common import ...``.

It ships in the package as ``lmfuse.bench.common`` (src/lmfuse/bench/common.py); new
scripts import it from there. This module hands out the same objects.
"""

from lmfuse.bench import common as _harness


def __getattr__(name: str):
    return getattr(_harness, name)
