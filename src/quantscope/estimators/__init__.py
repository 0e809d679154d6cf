"""Estimators: pure functions from data (or per-unit statistics) to per-unit ranges."""

from .entropy import entropy_amax, entropy_divergences, entropy_range
from .error import histogram_error
from .histogram_mse import histogram_mse_range
from .l2 import l2_range
from .mix import mix_range
from .mse import (
    SearchResult,
    dense_search,
    linear_search,
    mse_search,
    pow2_search,
    range_error,
    shrink_factors,
)
from .percentile import percentile_range

__all__ = [
    "SearchResult",
    "dense_search",
    "entropy_amax",
    "entropy_divergences",
    "entropy_range",
    "histogram_error",
    "histogram_mse_range",
    "l2_range",
    "linear_search",
    "mix_range",
    "mse_search",
    "percentile_range",
    "pow2_search",
    "range_error",
    "shrink_factors",
]
