"""Observers: ``torch.nn.Module`` s that watch tensors and compute qparams."""

from .base import Observer
from .grouped import observe_many
from .histogram import (
    EntropyObserver,
    HistogramMSEObserver,
    HistogramObserverBase,
    L2HistogramObserver,
    MixObserver,
    PercentileObserver,
)
from .imatrix import IMatrixMSEObserver
from .minmax import (
    MemorylessMinMaxObserver,
    MinMaxStateObserver,
    MovingAverageMinMaxObserver,
    PlaceholderObserver,
    StaticMinMaxObserver,
)
from .mse import (
    LinearMSEObserver,
    MemorylessMSEObserver,
    MovingAverageMSEObserver,
    NVFP4ExpandedMSEObserver,
    Pow2MSEObserver,
)
from .registry import get_observer, list_observers, observer_class, register

__all__ = [
    "EntropyObserver",
    "HistogramMSEObserver",
    "HistogramObserverBase",
    "IMatrixMSEObserver",
    "L2HistogramObserver",
    "LinearMSEObserver",
    "MemorylessMSEObserver",
    "MemorylessMinMaxObserver",
    "MinMaxStateObserver",
    "MixObserver",
    "MovingAverageMSEObserver",
    "MovingAverageMinMaxObserver",
    "NVFP4ExpandedMSEObserver",
    "Observer",
    "PercentileObserver",
    "PlaceholderObserver",
    "Pow2MSEObserver",
    "StaticMinMaxObserver",
    "get_observer",
    "list_observers",
    "observe_many",
    "observer_class",
    "register",
]
