"""Error searches weighted by what a tensor does downstream, as pure functions.

* :func:`imatrix_range`: the MSE grid search over a weight's ranges with each input
  channel's error weighted by its importance, the mean ``x^2`` of that channel over the
  calibration activations (llama.cpp's imatrix, llm-compressor's ``imatrix_mse``);
  :func:`imatrix_qparams` also gives the qparams that run what it priced.
  Weighting the squared error of column ``j`` by ``E[x_j^2]`` makes the score the
  expected squared error of the layer's output under uncorrelated inputs:
  ``E||x (W - Q(W))^T||^2 = sum_ij E[x_j^2] (W - Q(W))_ij^2`` when ``E[x_i x_j] = 0``.
* :func:`output_clip_range`: the activation range, among candidates, that minimises the
  layer's output error ``||X W^T - Q(X) Q(W)^T||^2`` given its quantized weight.

Both go through :func:`~quantscope.qparams.qparams_from_range` and
:func:`~quantscope.qdq.fake_quantize_units`, so a candidate is scored as it runs.
"""

from __future__ import annotations

import math

import torch

from .._checks import check_int, check_number, check_spec
from .._numerics import expansion_overflow
from ..formats import tensor_arg
from ..kernels import ops
from ..qdq import fake_quantize, fake_quantize_units
from ..qparams import amax_of_range, qparams_from_range
from ..spec import QuantSpec
from ..stats.minmax import unit_minmax
from . import mse_ops
from .mse import DEFAULT_CHUNK_ELEMS, shrink_factors

__all__ = ["check_importance", "imatrix_qparams", "imatrix_range", "importance_units",
           "incumbent_global_amax", "output_clip_range", "output_error", "weighted_search"]


def weighted_search(units: torch.Tensor, weights: torch.Tensor | None, spec: QuantSpec, *,
                    factors=None, norm: float = 2.0, expand: float = 1.0,
                    patience: int | None = None, float32_sums: bool = False,
                    ranges: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-unit ``(lo, hi)`` among the min-max range times ``expand``, shrunk by ``factors``,
    minimising ``sum weights * |Q(u) - u|^norm`` (``units`` and ``weights`` both ``[U, E]``;
    ``weights`` None: uniform). The range times ``expand`` (factor 1) is the incumbent
    (strict ``<`` keeps the earliest best).

    ``expand`` (> 0): the base range is ``(lo * expand, hi * expand)``, each candidate
    ``(lo * expand) * f`` (llm-compressor's order), so candidates can exceed the min-max
    range. ``patience``: llm-compressor's global rule, stop after ``patience`` consecutive
    factors that improved no unit (reads flags back to the host once per block of factors
    priced); None tries every factor.

    The arithmetic: sums of ``float64(w) * (float64(d) * float64(d))`` in float64, ``d`` the
    float32 fake-quant error and its square exact in float64 (the unweighted native search's
    terms, weighted; another norm: torch's float32 ``|d| ** norm``), priced by
    ``quantscope::mse_price_int`` / ``mse_price_fp`` a block of factors at a time (on CPU
    the C kernel for norm 2, the same formula in torch otherwise; Triton on CUDA).
    ``float32_sums`` (llm-compressor's arithmetic, for its compat class) sums
    ``w * |d|^norm`` in float32 instead, one factor at a time. A format with a global scale
    (NVFP4) prices every candidate under the incumbent's global scale (its qparams' own).
    ``ranges``: the units' per-unit ``(min, max)`` where the caller has them (an observer's
    forward found them), so the units are not read for them again.

    Off the CPU, without patience or ``float32_sums``, the search is the MSE engine's
    (:func:`_engine_search`): the same prices and choices, in one op where the format has
    block scales (on CUDA each distinct block scale of a unit priced once).
    """
    expand, patience = _check_options(norm, expand, patience)
    factors = shrink_factors() if factors is None else list(factors)
    if not factors or any(not (0 <= f <= 1) for f in factors):
        raise ValueError(f"imatrix_range: factors must be in [0, 1], got {factors!r}")
    _check_weights(units, weights)
    lo0, hi0 = unit_minmax(units) if ranges is None else ranges
    past = expansion_overflow(lo0, hi0, expand)
    if past is not None:  # every candidate would be inf: the search would return inf
        raise ValueError(f"weighted_search: expand={expand} takes the units' range past "
                         f"{past[1]}'s max (max |x| = {past[0]:.3g})")
    if expand != 1.0:
        lo0, hi0 = lo0 * expand, hi0 * expand
    if not float32_sums and patience is None and units.device.type != "cpu":
        units = units.float().contiguous()
        if mse_ops.usable(units, spec, norm):
            return _engine_search(units, weights, spec, lo0, hi0, factors, float(norm))
    factors = [1.0, *factors]
    if float32_sums:
        errors = float32_errors(units, weights, spec, lo0, hi0, factors, norm)
    else:
        errors = _float64_errors(units, weights, spec, lo0, hi0, factors, float(norm))
    return select_candidates(errors, lo0, hi0, factors, patience)


def _check_weights(units: torch.Tensor, weights: torch.Tensor | None) -> None:
    if weights is not None and (not isinstance(weights, torch.Tensor)
                                or tuple(weights.shape) != tuple(units.shape)):
        raise ValueError(f"weighted_search: weights must be None or a tensor of units' shape "
                         f"{tuple(units.shape)} (one weight per element), got "
                         f"{getattr(weights, 'shape', type(weights).__name__)}")


def _engine_search(units, weights, spec, lo0, hi0, factors, norm):
    """:func:`weighted_search` as the MSE engine of the ops runs it (``mse_ops.search``): the
    incumbent ``(lo0, hi0)``, candidates ``(lo0 * f, hi0 * f)`` under the incumbent's global
    scale, the first lowest error kept, NaN never chosen; :func:`select_candidates`'s rules
    without patience, on the same prices (tests compare the two bit for bit)."""
    weights = None if weights is None else weights.float().contiguous()
    lo, hi, _, _ = mse_ops.search(
        units, lo0, hi0, spec, factors, factors, patience=None, per_unit=False, tie="first",
        incumbent=(lo0, hi0), global_amax=incumbent_global_amax(lo0, hi0, spec),
        chunk_elems=DEFAULT_CHUNK_ELEMS, norm=norm, weights=weights)
    return lo, hi


def incumbent_global_amax(lo0, hi0, spec):
    """NVFP4's global amax of the incumbent range (what its qparams derive), or None.

    Every candidate is priced under this one global scale: a global scale derived per
    factor (``f * amax``) moves with the block scales and cancels their fp8 rounding, so the
    search would price ranges that do not run (measured on NVFP4 1024 x 4096 with
    importance: error / min-max 0.542 per-factor, 0.495 under the incumbent's)."""
    if not spec.scale.has_global_scale:
        return None
    return amax_of_range(lo0.clamp(max=0), hi0.clamp(min=0)).max()


def _candidate_qparams(lo0, hi0, f, spec, global_amax=None):
    """``(scale, zero_point)`` per unit ``[U, 1]`` of the range ``(lo0 * f, hi0 * f)``."""
    lo = lo0 * f
    # candidates scale the min-max range, whose finiteness the observer's qparams check
    # once: no per-candidate check (it would read back to the host in forward)
    qp = qparams_from_range(lo, hi0 * f, spec, global_amax=global_amax, check_finite=False)
    return (qp.effective_scale.expand_as(lo).reshape(-1, 1),
            qp.zero_point.expand_as(lo).reshape(-1, 1))


def float32_errors(units, weights, spec, lo0, hi0, factors, norm):
    """Each factor's ``sum w * |d|^norm`` in float32 (llm-compressor's arithmetic), as
    blocks of one factor."""
    # every candidate's error in one buffer: a fresh multi-megabyte tensor per candidate costs
    # its page faults again once calibration has fixed the mmap threshold (calibration/run/heap.py)
    buf = torch.empty_like(units, dtype=torch.float32)
    ga = incumbent_global_amax(lo0, hi0, spec)
    for f in factors:
        scale, zp = _candidate_qparams(lo0, hi0, f, spec, ga)
        d = fake_quantize_units(units, scale, zp.float(), spec, out=buf).sub_(units).abs_()
        d = d.pow_(norm)
        yield (d if weights is None else d.mul_(weights)).sum(1)[None]


#: a block of factors' qparams ``[k, U]`` holds at most this many candidates (the kernel
#: prices the block unit by unit, so each unit is read from the cache for all k)
_BLOCK_CANDIDATES = 1 << 21


def _float64_errors(units, weights, spec, lo0, hi0, factors, norm):
    """Each factor's ``sum float64(w) * float64(d) ** 2`` (``norm``: ``|d| ** norm``): blocks
    of factors priced by the ops (Triton on CUDA; on the CPU the C kernel for norm 2, else
    their torch path), yielded ``[k, U]``."""
    units = units.float().contiguous()
    weights = None if weights is None else weights.float().contiguous()
    k = max(1, _BLOCK_CANDIDATES // max(1, units.shape[0]))
    ga = incumbent_global_amax(lo0, hi0, spec)
    for i in range(0, len(factors), k):
        qps = [_candidate_qparams(lo0, hi0, f, spec, ga) for f in factors[i:i + k]]
        scale = torch.stack([s.reshape(-1) for s, _ in qps])
        if spec.is_float:
            fmt = spec.format
            err = ops.mse_price_fp(units, scale, float(fmt.max), int(fmt.min_exp),
                                   int(fmt.mbits), weights, norm)
        else:
            zp = torch.stack([z.reshape(-1) for _, z in qps]).to(torch.int32)
            err = ops.mse_price_int(units, scale, zp, float(spec.qmin), float(spec.qmax),
                                    weights, norm)
        yield err


def select_candidates(blocks, lo0, hi0, factors, patience):
    """The first best factor per unit (the first, factor 1, the incumbent; strict ``<``),
    stopping after ``patience`` factors in a row improve no unit (None: never).

    ``blocks``: the errors ``[k, U]`` of consecutive factors. Within a block the rules run on
    whole rows: the first minimum of the rows is the sequential walk's choice (it moves only
    on a strict decrease; NaN never wins), and the global rule reads "some unit improved at
    row j" from the running minimum, one read back per block."""
    best = idx = None
    stale, i0 = 0, 0
    for err in blocks:
        if best is None:  # the incumbent's row
            best, idx = err[0], torch.zeros(err.shape[1], dtype=torch.int64, device=err.device)
            err, i0 = err[1:], 1
        if err.shape[0]:
            err = err.nan_to_num(nan=math.inf, posinf=math.inf)  # a NaN never wins
            stop = _global_stop(err, best, patience, stale) if patience is not None else None
            if stop is not None:
                stale, rows = stop
                err = err[:rows]
            m, j = err.min(0)
            better = m < best
            best = torch.where(better, m, best)
            idx = torch.where(better, j + i0, idx)
            i0 += err.shape[0]
            if stop is not None and stale >= patience:
                break
    if hasattr(blocks, "close"):
        blocks.close()
    f = torch.tensor(factors, dtype=torch.float32, device=lo0.device)[idx].reshape(lo0.shape)
    return lo0 * f, hi0 * f


def _global_stop(err, best, patience, stale):
    """llm-compressor's global rule over a block: ``(stale, rows)``, the counter after the
    block's first ``rows`` rows (all, or up to the one that stops the search)."""
    improved = ops.improved_rows(err, best).tolist()
    for j, any_better in enumerate(improved):
        stale = 0 if any_better else stale + 1
        if stale >= patience:
            return stale, j + 1
    return stale, len(improved)


def _check_options(norm, expand, patience) -> tuple[float, int | None]:
    """``(expand, patience)`` as Python numbers (numpy's accepted, a bool refused)."""
    check_number("imatrix_range", "norm", norm, 0.0, lo_open=True)
    expand = check_number("imatrix_range", "expand", expand, 0.0, lo_open=True)
    if patience is not None:
        patience = check_int("imatrix_range", "patience (or None)", patience, 1)
    return expand, patience


def check_importance(who: str, importance: torch.Tensor) -> None:
    """Raise ``ValueError`` naming ``who`` unless ``importance`` is finite and non-negative
    (reads the values back: once per importance, never per forward)."""
    if not importance.is_meta and (not bool(torch.isfinite(importance).all())
                                   or bool((importance < 0).any())):
        raise ValueError(f"{who}: importance must be finite and non-negative in float32 "
                         f"(at most 3.4e38)")


def importance_units(importance: torch.Tensor | None, shape, spec: QuantSpec,
                     device=None, *, checked: bool = False) -> torch.Tensor:
    """``importance`` (one value per input channel, the last dim of ``shape``) as the
    ``[U, E]`` per-element weights of ``spec``'s layout; ones if None. ``checked``: the
    values were validated already (:func:`check_importance`), so no read-back here."""
    shape = tuple(shape)
    if importance is None:
        return spec.layout.to_units(torch.ones(shape, dtype=torch.float32, device=device))
    importance = tensor_arg("imatrix_range", "importance", importance,
                            "a tensor of one value per input channel")
    if importance.is_complex() or importance.dtype == torch.bool:  # .float() dropped the
        raise TypeError(f"imatrix_range: importance must be real numbers, got "  # imag part
                        f"{importance.dtype}")
    importance = importance.detach().float().to(device).flatten()
    if importance.numel() != shape[-1]:
        raise ValueError(f"imatrix_range: importance must have one value per input channel "
                         f"({shape[-1]}), got {importance.numel()}")
    if not checked:
        check_importance("imatrix_range", importance)
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
    return _imatrix(w, importance, spec, factors, norm)[:2]


def imatrix_qparams(w: torch.Tensor, importance: torch.Tensor | None, spec: QuantSpec, *,
                    factors=None, norm: float = 2.0):
    """:func:`imatrix_range`'s ``(lo, hi)`` and the ``QParams`` (per unit) that run what the
    search priced: NVFP4 under the min-max range's global scale (:func:`incumbent_global_amax`),
    not the chosen ranges' own, which would move every block scale."""
    lo, hi, lo0, hi0 = _imatrix(w, importance, spec, factors, norm)
    return lo, hi, qparams_from_range(lo, hi, spec,
                                      global_amax=incumbent_global_amax(lo0, hi0, spec))


def _imatrix(w, importance, spec, factors, norm):
    """``(lo, hi, lo0, hi0)``: the search's ranges and the min-max ones it started from."""
    check_spec("imatrix_range", spec)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ValueError(f"imatrix_range: w must be a 2-D weight [out, in], got "
                         f"{getattr(w, 'shape', type(w).__name__)}")
    w = w.detach().float()
    weights = importance_units(importance, w.shape, spec, w.device)
    units = spec.layout.to_units(w)
    lo0, hi0 = unit_minmax(units)
    if not bool(torch.stack((lo0, hi0)).isfinite().all()):  # one read, per weight
        raise ValueError("imatrix_range: w must be finite (got NaN or inf)")
    lo, hi = weighted_search(units, weights, spec, factors=factors, norm=norm,
                             ranges=(lo0, hi0))
    return lo, hi, lo0, hi0


def output_error(x: torch.Tensor, w_q: torch.Tensor, spec: QuantSpec, lo: torch.Tensor,
                 hi: torch.Tensor, *, reference: torch.Tensor | None = None,
                 out_weights: torch.Tensor | None = None) -> float:
    """``sum_o c_o ||reference - Q(x) w_q^T||_o^2`` for the activation range ``(lo, hi)``.

    ``reference`` defaults to ``x w_q^T`` (the error the activation's quantization alone
    adds); ``out_weights`` ``c`` (one per output feature, e.g. Fisher ``g^2``) default 1.
    """
    qp = qparams_from_range(lo, hi, spec).reshape(spec.layout.qparam_shape(x.shape))
    y = fake_quantize(x, qp, spec, check=False) @ w_q.T
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
    check_spec("output_clip_range", spec)
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
