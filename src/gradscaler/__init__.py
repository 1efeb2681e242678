"""gradscaler: dynamic loss scaling for float16 training, a drop-in for ``torch.amp.GradScaler``.

Only the names in ``__all__`` are API; module paths below this package may change between releases.
"""

from gradscaler.drop_in import is_torch_patched, patch_torch, unpatch_torch
from gradscaler.errors import ScaleCollapseError, ScaleCollapseWarning
from gradscaler.monitor import JsonLinesLogger, TensorBoardLogger
from gradscaler.reporting import report
from gradscaler.scaler import GradScaler, OptState

__version__ = "0.1.0"

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
]
