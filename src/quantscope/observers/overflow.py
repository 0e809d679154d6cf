"""Why an observer's range left float32 though every value it observed was finite: its own
arithmetic overflowed (a moving average's update, a search's ``expand``). Named in the error
its qparams raise, in place of the generic "lo and hi must be finite"."""

from __future__ import annotations

import math

import torch

__all__ = ["EMA_OVERFLOW", "range_overflow"]

#: why a moving average of finite ranges can leave float32 (an observer's ``overflow_cause``)
EMA_OVERFLOW = ("its moving average of finite ranges overflowed float32: the update "
                "s + c * (b - s) (torch.ao's, kept bitwise) overflows once b - s does, e.g. "
                "batches near -2e38 then +2e38")


def range_overflow(observer, lo: torch.Tensor, hi: torch.Tensor) -> ValueError | None:
    """The error for an observer whose range ``lo, hi`` is not finite though no NaN / inf was
    observed (its flag is clear): its own arithmetic overflowed float32, as its
    ``overflow_cause`` says; None where the range is finite (another refusal stands) or holds
    NaN but is no moving average. NaN in a moving average's range has two causes that its
    state cannot tell apart, and the error names both: an average that overflowed to inf
    becomes NaN at the next batch's update (inf - inf), or NaN was written into the state
    (``load_state_dict`` of a damaged checkpoint, an edit of its buffers; in other observers
    the only way finite input gives NaN). Only after a refusal: no read-back on the common
    path."""
    ends = torch.stack((lo, hi))
    if bool((ends.abs() < math.inf).all()):
        return None
    cause = getattr(observer, "overflow_cause", "its state overflowed float32")
    if not bool(ends.isnan().any()):
        return ValueError(f"{observer.describe()}: its range is not finite though every value "
                          f"it observed was (|x| near float32's max, 3.4e38): {cause}")
    if EMA_OVERFLOW not in cause:
        return None
    return ValueError(f"{observer.describe()}: its range holds NaN though no NaN / inf was "
                      f"observed (its flag is clear): either {cause}, and the next batch's "
                      f"update made NaN of the infinite average (inf - inf); or NaN was "
                      f"written into its state (load_state_dict of a damaged checkpoint, an "
                      f"edit of its buffers)")
