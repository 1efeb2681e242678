"""gradscaler: dynamic loss scaling for float16 training, a drop-in for ``torch.amp.GradScaler``."""

from gradscaler.errors import ScaleCollapseError
from gradscaler.errors import ScaleCollapseWarning
from gradscaler.monitor import JsonLinesLogger
from gradscaler.scaler import GradScaler
from gradscaler.scaler import OptState

__version__ = "0.1.0"

__all__ = [
    "GradScaler",
    "JsonLinesLogger",
    "OptState",
    "ScaleCollapseError",
    "ScaleCollapseWarning",
]
