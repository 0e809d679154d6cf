"""Error searches weighted by what a tensor does downstream, as pure functions.

* :func:`imatrix_range`: the MSE grid search over a weight's ranges with each input
  channel's error weighted by its importance, the mean ``x^2`` of that channel over the
  calibration activations (llama.cpp's imatrix, llm-compressor's ``imatrix_mse``).
  Weighting the squared error of column ``j`` by ``E[x_j^2]`` makes the score the
  expected squared error of the layer's output under uncorrelated inputs:
  ``E||x (W - Q(W))^T||^2 = sum_ij E[x_j^2] (W - Q(W))_ij^2`` when ``E[x_i x_j] = 0``.
* :func:`output_clip_range`: the activation range, among candidates, that minimises the
  layer's output error ``||X W^T - Q(X) Q(W)^T||^2`` given its quantized weight.

Both go through :func:`~quantscope.qparams.qparams_from_range` and
:func:`~quantscope.qdq.fake_quantize_units`, so a candidate is scored as it runs.
"""

from __future__ import annotations

import torch

from ..qdq import fake_quantize, fake_quantize_units
from ..qparams import qparams_from_range
from ..spec import QuantSpec
from ..stats.minmax import unit_minmax
from .mse import shrink_factors

__all__ = ["imatrix_range", "importance_units", "output_clip_range", "output_error",
           "weighted_search"]


def _check_spec(spec, who):
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"{who}: spec must be a QuantSpec, got {type(spec).__name__}")


def weighted_search(units: torch.Tensor, weights: torch.Tensor | None, spec: QuantSpec, *,
                    factors=None, norm: float = 2.0, expand: float = 1.0,
                    patience: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-unit ``(lo, hi)`` among the min-max range times ``expand``, shrunk by ``factors``,
    minimising ``sum weights * |Q(u) - u|^norm`` (``units`` and ``weights`` both ``[U, E]``;
    ``weights`` None: uniform). The range times ``expand`` (factor 1) is the incumbent
    (strict ``<`` keeps the earliest best).

    ``expand`` (> 0): the base range is ``(lo * expand, hi * expand)``, each candidate
    ``(lo * expand) * f`` (llm-compressor's order), so candidates can exceed the min-max
    range. ``patience``: llm-compressor's global rule, stop after ``patience`` consecutive
    factors that improved no unit (reads one flag back to the host per factor); None tries
    every factor.
    """
    _check_options(norm, expand, patience)
    factors = shrink_factors() if factors is None else list(factors)
    if not factors or any(not (0 <= f <= 1) for f in factors):
        raise ValueError(f"imatrix_range: factors must be in [0, 1], got {factors!r}")
    lo0, hi0 = unit_minmax(units)
    if expand != 1.0:
        lo0, hi0 = lo0 * expand, hi0 * expand
    best, stale = None, 0
    # every candidate's error in one buffer: a fresh multi-megabyte tensor per candidate costs
    # its page faults again once calibration has fixed the mmap threshold (calibration/run/heap.py)
    buf = torch.empty_like(units, dtype=torch.float32)
    for f in [1.0, *factors]:
        lo, hi = lo0 * f, hi0 * f
        # candidates scale the min-max range, whose finiteness the observer's qparams check
        # once: no per-candidate check (it would read back to the host in forward)
        qp = qparams_from_range(lo, hi, spec, check_finite=False)
        scale = qp.effective_scale.expand_as(lo).reshape(-1, 1)
        zp = qp.zero_point.float().expand_as(lo).reshape(-1, 1)
        d = fake_quantize_units(units, scale, zp, spec, out=buf).sub_(units).abs_().pow_(norm)
        err = (d if weights is None else d.mul_(weights)).sum(1)
        if best is None:
            best = [err, lo.clone(), hi.clone()]
            continue
        better = err < best[0]
        best[0] = torch.where(better, err, best[0])
        best[1] = torch.where(better.reshape(lo.shape), lo, best[1])
        best[2] = torch.where(better.reshape(hi.shape), hi, best[2])
        if patience is not None:
            stale = 0 if bool(better.any()) else stale + 1
            if stale >= patience:
                break
    return best[1], best[2]


def _check_options(norm, expand, patience) -> None:
    if not (isinstance(norm, (int, float)) and norm > 0):
        raise ValueError(f"imatrix_range: norm must be a positive number, got {norm!r}")
    if isinstance(expand, bool) or not isinstance(expand, (int, float)) \
            or not 0 < expand < float("inf"):
        raise ValueError(f"imatrix_range: expand must be a finite positive number, "
                         f"got {expand!r}")
    if patience is not None and (isinstance(patience, bool) or not isinstance(patience, int)
                                 or patience < 1):
        raise ValueError(f"imatrix_range: patience must be a positive integer or None, "
                         f"got {patience!r}")


def importance_units(importance: torch.Tensor | None, shape, spec: QuantSpec,
                     device=None) -> torch.Tensor:
    """``importance`` (one value per input channel, the last dim of ``shape``) as the
    ``[U, E]`` per-element weights of ``spec``'s layout; ones if None."""
    shape = tuple(shape)
    if importance is None:
        return spec.layout.to_units(torch.ones(shape, device=device))
    importance = importance.detach().float().to(device).flatten()
    if importance.numel() != shape[-1]:
        raise ValueError(f"imatrix_range: importance must have one value per input channel "
                         f"({shape[-1]}), got {importance.numel()}")
    if not torch.isfinite(importance).all() or (importance < 0).any():
        raise ValueError("imatrix_range: importance must be finite and non-negative")
    return spec.layout.to_units(importance.expand(shape).contiguous())


def imatrix_range(w: torch.Tensor, importance: torch.Tensor | None, spec: QuantSpec, *,
                  factors=None, norm: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-unit ``(lo, hi)`` of ``w`` minimising ``sum_j imp_j |Q(w) - w|_j^norm``.

    Args:
        w: a Linear weight ``[out, in]`` (any layout of ``spec`` that maps it to units).
        importance: ``[in]`` non-negative weights of the input channels (mean ``x^2``);
            None gives the unweighted search.
        spec: the weight's quantization spec.
        factors: shrink factors of the min-max range tried (default llm-compressor's MSE
            grid, ``1.00 .. 0.81``); the min-max range (factor 1) is always the incumbent,
            so the weighted error never exceeds min-max's.
        norm: the error exponent.
    """
    _check_spec(spec, "imatrix_range")
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ValueError(f"imatrix_range: w must be a 2-D weight [out, in], got "
                         f"{getattr(w, 'shape', type(w).__name__)}")
    w = w.detach().float()
    weights = importance_units(importance, w.shape, spec, w.device)
    return weighted_search(spec.layout.to_units(w), weights, spec, factors=factors, norm=norm)


def output_error(x: torch.Tensor, w_q: torch.Tensor, spec: QuantSpec, lo: torch.Tensor,
                 hi: torch.Tensor, *, reference: torch.Tensor | None = None,
                 out_weights: torch.Tensor | None = None) -> float:
    """``sum_o c_o ||reference - Q(x) w_q^T||_o^2`` for the activation range ``(lo, hi)``.

    ``reference`` defaults to ``x w_q^T`` (the error the activation's quantization alone
    adds); ``out_weights`` ``c`` (one per output feature, e.g. Fisher ``g^2``) default 1.
    """
    qp = qparams_from_range(lo, hi, spec).reshape(spec.layout.qparam_shape(x.shape))
    y = fake_quantize(x, qp, spec) @ w_q.T
    ref = x @ w_q.T if reference is None else reference
    e = (y - ref).square()
    if out_weights is not None:
        e = e * out_weights
    return float(e.double().sum())


def output_clip_range(x: torch.Tensor, w_q: torch.Tensor, spec: QuantSpec, candidates, *,
                      reference: torch.Tensor | None = None,
                      out_weights: torch.Tensor | None = None):
    """The activation range among ``candidates`` with the lowest output error.

    Args:
        x: a sample of the layer's inputs ``[tokens, in]``.
        w_q: the layer's quantized (fake-quant) weight ``[out, in]``.
        spec: the activation spec (per tensor, or per input channel).
        candidates: an iterable of ``(lo, hi)`` per-unit ranges, e.g. the ranges of several
            observers, or one range shrunk by several factors.
        reference: the output to match (default ``x w_q^T``; pass ``x w^T`` for the error
            against the float layer).
        out_weights: per-output-feature weights of the squared error.

    Returns ``(index, lo, hi, errors)``: the first best candidate, its range and every
    candidate's error.
    """
    _check_spec(spec, "output_clip_range")
    x = x.detach().float().reshape(-1, x.shape[-1])
    w_q = w_q.detach().float()
    if w_q.dim() != 2 or w_q.shape[1] != x.shape[1]:
        raise ValueError(f"output_clip_range: w_q must be [out, {x.shape[1]}], got "
                         f"{tuple(w_q.shape)}")
    candidates = list(candidates)
    if reference is None:
        reference = x @ w_q.T
    errors = [output_error(x, w_q, spec, lo, hi, reference=reference, out_weights=out_weights)
              for lo, hi in candidates]
    if not errors:
        raise ValueError("output_clip_range: candidates is empty")
    i = min(range(len(errors)), key=errors.__getitem__)
    return i, candidates[i][0], candidates[i][1], errors
