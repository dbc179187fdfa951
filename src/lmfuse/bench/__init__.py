"""The benchmark harnesses behind ``lmfuse bench FAMILY``, shipped with the package.

One module per family (``softmax``, ``cross_entropy``, ``linear_cross_entropy``,
``activations``, ``decode_attention``, ``rms_norm``, ``layer_norm``, ``rope``,
``moe_experts``, ``generate``; and
``host``: every op's host time per eager call), each with ``main(argv) -> exit code``;
``common`` holds the shared harness (timing, the copy ceiling, tables, JSON, plots).
``python -m lmfuse.bench.FAMILY`` runs the same module. The checkout's ``bench/`` keeps the
multi-GPU and tuning-sweep scripts (they import the harness from here) and ``results/``.
"""
