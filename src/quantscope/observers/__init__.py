"""Observers: ``torch.nn.Module`` s that watch tensors and compute qparams."""

from .base import Observer
from .histogram import (
    EntropyObserver,
    HistogramMSEObserver,
    HistogramObserverBase,
    L2HistogramObserver,
    MixObserver,
    PercentileObserver,
)
from .minmax import (
    MemorylessMinMaxObserver,
    MinMaxStateObserver,
    MovingAverageMinMaxObserver,
    PlaceholderObserver,
    StaticMinMaxObserver,
)
from .registry import get_observer, list_observers, observer_class, register

__all__ = [
    "EntropyObserver",
    "HistogramMSEObserver",
    "HistogramObserverBase",
    "L2HistogramObserver",
    "MemorylessMinMaxObserver",
    "MinMaxStateObserver",
    "MixObserver",
    "MovingAverageMinMaxObserver",
    "Observer",
    "PercentileObserver",
    "PlaceholderObserver",
    "StaticMinMaxObserver",
    "get_observer",
    "list_observers",
    "observer_class",
    "register",
]
