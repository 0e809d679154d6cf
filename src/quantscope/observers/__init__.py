"""Observers: ``torch.nn.Module`` s that watch tensors and compute qparams."""

from .base import Observer
from .minmax import (
    MemorylessMinMaxObserver,
    MinMaxStateObserver,
    MovingAverageMinMaxObserver,
    PlaceholderObserver,
    StaticMinMaxObserver,
)
from .registry import get_observer, list_observers, observer_class, register

__all__ = [
    "MemorylessMinMaxObserver",
    "MinMaxStateObserver",
    "MovingAverageMinMaxObserver",
    "Observer",
    "PlaceholderObserver",
    "StaticMinMaxObserver",
    "get_observer",
    "list_observers",
    "observer_class",
    "register",
]
