"""gradscaler: dynamic loss scaling for float16 training, a drop-in for ``torch.amp.GradScaler``.

Only the names in ``__all__`` are API; module paths below this package may change between releases.

The public names load on first use (``__getattr__``): ``import gradscaler`` alone does not import
torch, so that ``gradscaler --help`` and the command line's argument errors answer at once. The
first public name you touch loads all of them, and from then on the package is what an eager
import would have made it; a submodule (``gradscaler.frameworks``, ``gradscaler.masters``) imports
on first use too, whichever name came first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers and readers see; ``_FACE`` says the same to ``__getattr__``
    from gradscaler.drop_in import is_torch_patched, patch_torch, unpatch_torch
    from gradscaler.errors import ScaleCollapseError, ScaleCollapseWarning
    from gradscaler.masters.standalone import with_master_weights
    from gradscaler.record.monitor import JsonLinesLogger, TensorBoardLogger
    from gradscaler.record.reporting import report
    from gradscaler.scaler import GradScaler, OptState

__version__ = "0.1.0"

_FACE = {
    "GradScaler": "gradscaler.scaler",
    "JsonLinesLogger": "gradscaler.record.monitor",
    "OptState": "gradscaler.scaler",
    "ScaleCollapseError": "gradscaler.errors",
    "ScaleCollapseWarning": "gradscaler.errors",
    "TensorBoardLogger": "gradscaler.record.monitor",
    "is_torch_patched": "gradscaler.drop_in",
    "patch_torch": "gradscaler.drop_in",
    "report": "gradscaler.record.reporting",
    "unpatch_torch": "gradscaler.drop_in",
    "with_master_weights": "gradscaler.masters.standalone",
}
"""Each public name and the module that defines it (tests/test_layers.py holds it equal to the block above)."""

__all__ = [
    "GradScaler",
    "JsonLinesLogger",
    "OptState",
    "ScaleCollapseError",
    "ScaleCollapseWarning",
    "TensorBoardLogger",
    "is_torch_patched",
    "patch_torch",
    "report",
    "unpatch_torch",
    "with_master_weights",
]


def __getattr__(name: str) -> object:
    """A submodule (``gradscaler.frameworks``) imports alone, before or after the face has loaded;
    any other missing name loads every public name (and with them torch), once."""
    import importlib
    import importlib.util

    namespace = globals()
    if name.startswith("__"):
        raise AttributeError(f"module 'gradscaler' has no attribute {name!r}")
    if name not in _FACE and name.isidentifier() and importlib.util.find_spec(f"gradscaler.{name}") is not None:
        # also ``from gradscaler import grads`` inside a module the face is still loading: that module only
        return importlib.import_module(f"gradscaler.{name}")
    if not namespace.get("_loaded"):
        for public, module in _FACE.items():
            namespace[public] = getattr(importlib.import_module(module), public)
        namespace["_loaded"] = True
    if name in namespace:
        return namespace[name]
    raise AttributeError(f"module 'gradscaler' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
