"""Statistics: per-unit state gathered from the tensors an observer sees."""

from . import hist_ops  # noqa: F401 (registers quantscope::hist_add, histogram's op off the CPU)
from .minmax import unit_minmax

__all__ = ["unit_minmax"]
