"""Statistics: per-unit state gathered from the tensors an observer sees."""

from .minmax import unit_minmax

__all__ = ["unit_minmax"]
