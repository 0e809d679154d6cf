"""Mix: per unit, the candidate range with the lowest quantization error on the histogram.

Candidates (Horizon's MixObserver tries the percentiles; quantscope adds the
other estimators): the percentiles 99.9, 99.99, 99.999 and 99.9999, the min / max,
the histogram-MSE range, the entropy (KL) range (the entropy observer's bits and unsigned
mode for the spec, :func:`~quantscope.estimators.entropy.spec_bits`), and torch.ao's L2
search with the ``histogram`` observer's polish (its three finalists): 10 ranges per unit.
All are scored by the one scoring function,
:func:`~quantscope.estimators.error.histogram_error` (one prepared
:class:`~quantscope.estimators.scorer.HistogramScorer`), with each bin's count spread over
4 points inside it.
"""

from __future__ import annotations

import torch

from .._checks import check_bool
from ..spec import QuantSpec
from ..stats.histogram import Hist, fold_abs
from .entropy import entropy_range, spec_bits
from .histogram_mse import histogram_mse_range, occupied_range
from .l2 import default_dst_nbins, l2_finalists
from .percentile import check_convention, check_percentile, percentile_range
from .scorer import HistogramScorer, tensor_amax

__all__ = ["MIX_CANDIDATES", "MIX_PERCENTILES", "check_options", "mix_range"]

MIX_PERCENTILES = (99.9, 99.99, 99.999, 99.9999)
MIX_CANDIDATES = ("percentile", "minmax", "mse", "entropy", "l2")


def check_options(who: str = "mix", *, candidates=MIX_CANDIDATES, percentiles=MIX_PERCENTILES,
                  convention: str = "center") -> tuple[tuple, tuple[float, ...]]:
    """``(candidates, percentiles)`` as tuples, or an error naming the bad argument (observers
    check at construction, not after calibration)."""
    try:
        if isinstance(candidates, str) or isinstance(percentiles, str):  # not chars
            raise TypeError
        candidates, percentiles = tuple(candidates), tuple(percentiles)
    except TypeError:
        raise TypeError(f"{who}: candidates and percentiles must be sequences, got "
                        f"{candidates!r} and {percentiles!r}") from None
    if not candidates or not set(candidates) <= set(MIX_CANDIDATES):
        raise ValueError(f"{who}: candidates must be a non-empty subset of {MIX_CANDIDATES}, "
                         f"got {candidates!r}")
    if set(candidates) == {"percentile"} and not percentiles:  # no range left to choose from
        raise ValueError(f"{who}: percentiles must not be empty when 'percentile' is the only "
                         f"candidate")
    percentiles = tuple(check_percentile(who, "percentiles", p) for p in percentiles)
    check_convention(who, convention)
    return candidates, percentiles


def mix_range(hist: Hist, spec: QuantSpec, *, lo: torch.Tensor | None = None,
              hi: torch.Tensor | None = None, percentiles=MIX_PERCENTILES,
              candidates=MIX_CANDIDATES, convention: str = "center",
              start_bin: int = 128, return_choice: bool = False, global_amax=None):
    """Per-unit ``(lo, hi)`` of the best candidate; ``lo``, ``hi`` are the data's min / max
    (each by default the occupied bins' edge). With ``return_choice`` also the index ``[U]``
    of the winner in the candidate list (percentiles first, then the others in order).
    ``global_amax``: a global-scale spec's tensor-wide ``max |x|`` the candidates are scored
    under (default: ``lo``, ``hi``'s)."""
    candidates, percentiles = check_options(candidates=candidates, percentiles=percentiles,
                                            convention=convention)
    return_choice = check_bool("mix", "return_choice", return_choice)
    if lo is None or hi is None:  # an end not given is the occupied bins', a given one is kept
        lo, hi = (e if v is None else v for v, e in zip((lo, hi), occupied_range(hist)))
    if global_amax is None:
        global_amax = tensor_amax(spec, lo, hi)
    los, his = [], []
    # fold once for every |x| estimator (a folded histogram folds to itself)
    habs = fold_abs(hist) if spec.symmetric or "entropy" in candidates else hist
    own = habs if spec.symmetric else hist  # what percentile and MSE look at
    if "percentile" in candidates and len(percentiles):
        plo, phi = percentile_range(own, list(percentiles), symmetric=spec.symmetric,
                                    convention=convention)
        los.append(plo)
        his.append(phi)
    four = HistogramScorer(hist, spec, points=4, global_amax=global_amax)  # values spread in bins
    one = []
    if "minmax" in candidates:
        one.append((lo, hi))
    if "mse" in candidates:
        one.append(histogram_mse_range(own, spec, start_bin=start_bin, bounds=(lo, hi),
                                       global_amax=global_amax))
    if "entropy" in candidates:
        bits, unsigned = spec_bits(spec)  # the entropy observer's KL for this spec
        one.append(entropy_range(habs, num_bits=bits, unsigned=unsigned, start_bin=start_bin))
    for a, b in one:
        los.append(a[:, None])
        his.append(b[:, None])
    n = sum(t.shape[1] for t in los)
    if "l2" in candidates:  # l2_polished_range's finalists
        a, b = l2_finalists(hist, spec, default_dst_nbins(spec), bounds=(lo, hi),
                            global_amax=global_amax)
        los.append(a)
        his.append(b)
    clo = torch.maximum(torch.cat(los, 1), lo[:, None])
    chi = torch.minimum(torch.cat(his, 1), hi[:, None])
    err = four(clo, chi)
    best = err.argmin(1, keepdim=True)  # first minimum: the earlier candidate on ties
    out = clo.gather(1, best)[:, 0], chi.gather(1, best)[:, 0]
    return (*out, best[:, 0].clamp(max=n)) if return_choice else out
