"""Tools built on the public API: ``gradscaler demo``, ``gradscaler bench`` and their toy model.

Nothing in the library imports this package. ``gpt2_shapes`` and ``sleep_cycles`` in
``gradscaler.tools.harness`` are public helpers for ``benchmarks/`` and the CUDA tests.
"""


def __getattr__(name: str) -> object:
    """``gradscaler.tools.demo`` without importing it first: a submodule imports on first use."""
    import importlib
    import importlib.util

    if not name.startswith("__") and name.isidentifier() and importlib.util.find_spec(f"{__name__}.{name}"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
