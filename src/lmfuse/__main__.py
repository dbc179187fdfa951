"""``python -m lmfuse ...``: the ``lmfuse`` command (:mod:`lmfuse.cli`)."""

from lmfuse.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
