"""The benchmark harnesses behind ``lmfuse bench FAMILY``, shipped with the package.

One module per family (``softmax``, ``cross_entropy``, ``linear_cross_entropy``,
``activations``, ``decode_attention``, ``rms_norm``, ``moe_experts``, ``generate``; and
``host``: every op's host time per eager call), each with ``main(argv) -> exit code``;
``common`` holds the shared harness (timing, the copy ceiling, tables, JSON, plots). From a
checkout, ``python3 bench/FAMILY.py`` runs the same module; the checkout's ``bench/`` also
keeps the multi-GPU, sweep and probe scripts and ``results/``.
"""
