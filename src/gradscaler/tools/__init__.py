"""Tools built on the public API: ``gradscaler demo``, ``gradscaler bench`` and their toy model.

Nothing in the library imports this package. ``gpt2_shapes`` and ``sleep_cycles`` in
``gradscaler.tools.harness`` are public helpers for ``benchmarks/`` and the CUDA tests.
"""
