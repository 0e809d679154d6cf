"""Range choice by error search: the MSE grid searches, vectorized over units.

A search tries candidate ranges ``(lo * f_lo, hi * f_hi)`` for a list of
factors, scores each by the quantization error of the quantizer it defines, and
keeps the best per unit. Every candidate goes through
:func:`~quantscope.qparams.qparams_from_range` (the one place scales are
computed), so an encoded scale (E8M0, fp8 under NVFP4's global scale, power of
two, fp16) is scored as it will run, not as a float32 idealisation.

This module holds the entry points and the choice of candidates; four engines run a
search with the same rules: :mod:`.mse_tiles` in torch (``[candidates, units,
elements]`` tiles, any device); for integer and float element formats on CPU (squared
error, not ``compat``; MX and NVFP4 blocks included), the C kernel :mod:`.mse_kernel`,
which prices candidates unit by unit summing the exact fake-quant error in float64 (only
the candidates' qparams, from ``qparams_from_range``, are computed in torch); for
``compat="llmcompressor"`` (integer formats, float32 CPU units), :mod:`.mse_compat`: a C
kernel prices every candidate with a proven bound on its distance to torch's float32
error, and torch recomputes only the near ties, so the choices are the torch path's bit
for bit; and off the CPU, :mod:`.mse_ops`: the ``quantscope::`` ops (Triton on CUDA) price
every candidate in one pass and select in one op (any norm, ``compat`` included).
``backend="torch"`` forces the tiles.

Selection rules (all evaluated on ``[U]`` vectors, candidate by candidate):

* ``per_unit_patience=True`` (native): a unit stops once it has had ``patience``
  consecutive candidates that did not improve it (candidates whose encoded
  qparams equal the previous candidate's do not count: an E8M0 or fp8 scale is
  flat over many factors, and a plateau is not evidence the search is done)
  *and* the global rule below has stopped: a unit never stops before
  llm-compressor would stop it, so while other units of the tensor still improve
  it goes on, and its result can depend on them. Past the grid (``extend_to``)
  only its own patience counts.
* ``per_unit_patience=False`` (llm-compressor): the search stops after
  ``patience`` consecutive candidates that improved no unit at all.
* ``tie="first"`` keeps the earliest best (strict ``<``); ``"last"`` the latest (``<=``, Horizon).

Native searches start from the min-max range (``f = 1``) as the incumbent, so
their error never exceeds min-max's, on the float32 values of the tensor: candidates are
priced by their float32 fake-quant outputs (observers convert bfloat16 / float16 inputs to
float32), and the rounding of the output to bfloat16 / float16 is not priced, so there the
chosen range can be slightly worse than min-max (measured: +0.7 % on an int8 per-channel
case; fp8 per tensor +2.6 % in one sample, up to +3.9 % over 600 tensors). Each squared
error is exact in float64 (``float64(d) * float64(d)``, every engine): squares rounded to
float32 lose precision below ``|d|`` ~ 1e-19 and underflow to 0 below ~3e-23, where a unit's
candidates tied at 0 and the tie rule, not the error, picked (pow2 / linear were measured up
to 16x / 88x worse than min-max there), and overflow past ~1.8e19. ``float32_squares`` keeps
that arithmetic for the compat classes whose toolkit squares in float32. A non-finite error
(a NaN price) never replaces the best so far, under either ``tie``; nor does a candidate
whose range is not finite (a factor > 1 of values near float32's max:
``mse_tiles.candidate_qparams`` prices it NaN), so no search returns a range past float32.
"""

from __future__ import annotations

import math

import torch

from .._checks import as_number, check_bool, check_int, check_number, check_spec
from ..qdq import fake_quantize_units
from ..qparams import amax_of_range, qparams_from_range
from ..spec import QuantSpec
from ..stats.minmax import unit_minmax
from . import mse_compat, mse_kernel, mse_ops, mse_tiles
from .mse_tiles import norm_sum

__all__ = [
    "DEFAULT_CHUNK_ELEMS",
    "SearchResult",
    "dense_search",
    "linear_search",
    "mse_search",
    "pow2_search",
    "range_error",
    "shrink_factors",
]

#: elements of one [candidates, units, elements] tile: ~4 MB per temporary, cache-friendly
DEFAULT_CHUNK_ELEMS = 1 << 20
_MIN_CHUNK_ELEMS = 1 << 16
BACKENDS = (None, "torch", "kernel", "ops")


class SearchResult(tuple):
    """``(lo, hi)`` of the chosen ranges, with the search's by-products as attributes.

    ``error`` is each unit's error at its chosen range (the search's own measure, float32;
    the compat kernel engine, :mod:`.mse_compat`, computes it on first access, from the units
    searched, which must not have changed in place since);
    ``global_amax`` the NVFP4 global amax the ranges were chosen under (None
    otherwise); ``index`` the chosen candidate per unit.
    """

    def __new__(cls, lo, hi, error=None, global_amax=None, index=None):
        self = super().__new__(cls, (lo, hi))
        self.lo, self.hi, self.error, self.global_amax, self.index = (
            lo, hi, error, global_amax, index)
        return self

    @property
    def error(self):
        if callable(self._error):  # computed on first use (mse_compat: a torch pass)
            self._error = self._error()
        return self._error

    @error.setter
    def error(self, value):  # the engines' float64 errors, kept as float32
        self._error = value.float() if isinstance(value, torch.Tensor) else value


#: the most candidates one search tries (llm-compressor's grid has 20, the expanded NVFP4
#: grid 111): a bound so that a mistyped grid is an error rather than an hour-long search
MAX_CANDIDATES = 10_000
#: pow2_search's widest span: factors ``2 ** +-span`` stay far inside float32
MAX_SPAN = 32


def shrink_factors(maxshrink: float = 0.2, grid: float = 100, expand: float = 1.0, *,
                   none_ok: bool = False) -> list[float]:
    """llm-compressor's candidates ``p = 1 - i / grid`` for ``i < int(maxshrink * grid)``.

    The range searched is ``(lo * expand) * p``; ``expand`` is applied to the base range.
    ``none_ok``: llm-compressor's compat search, which takes ``maxshrink`` 0 and
    ``maxshrink * grid < 1`` (no candidate: their search keeps the min-max range). Both
    searches stop at :data:`MAX_CANDIDATES` (theirs sets no bound, but candidates of a finer
    grid lie closer than float32 errors tell apart, and settling their near ties costs
    quadratic time: grid 1e5, 20,000 candidates, took 65 s on a 16 x 64 weight).
    """
    grid = check_number("mse_search", "grid", grid, 0, lo_open=True)
    maxshrink = check_number("mse_search", "maxshrink", maxshrink, 0, 1, lo_open=not none_ok)
    check_number("mse_search", "expand", expand, 0, lo_open=True)
    steps, least = int(maxshrink * grid), 0 if none_ok else 1
    if not least <= steps <= MAX_CANDIDATES:
        raise ValueError(f"mse_search: maxshrink * grid = {maxshrink * grid} gives {steps} "
                         f"candidates; need {least} to {MAX_CANDIDATES} (a coarser grid)")
    return [1 - i / grid for i in range(steps)]


def compat_patience(patience):
    """llm-compressor's patience as an integer: it stops once ``no_improve >= patience``,
    a count from 1, so any number up to 1 acts as 1 and 4.5 as 5; inf or NaN never stop."""
    number = as_number(patience)  # numpy's too; not a bool
    if number is None:
        return patience  # None: try all; other values: refused by _check_options
    if math.isnan(number) or number == math.inf:
        return None
    return max(1, math.ceil(number))


def _check(units, lo, hi, spec, norm):
    check_spec("mse_search", spec)
    if not isinstance(units, torch.Tensor) or units.dim() != 2:
        raise ValueError(f"mse_search: units must be a 2-D [units, elements] tensor, got "
                         f"{getattr(units, 'shape', type(units).__name__)}")
    check_number("mse_search", "norm", norm, 0.0, lo_open=True)
    # contiguous: the torch tiles' float32 sums follow the memory order, the kernels copy
    units = units.float().contiguous()
    if lo is None or hi is None:  # an end not given is the units' own, a given one is kept
        lo, hi = (m if v is None else v for v, m in zip((lo, hi), unit_minmax(units)))
    lo = torch.as_tensor(lo, dtype=torch.float32, device=units.device).reshape(-1)
    hi = torch.as_tensor(hi, dtype=torch.float32, device=units.device).reshape(-1)
    if lo.numel() != units.shape[0] or hi.numel() != units.shape[0]:
        raise ValueError(f"mse_search: lo and hi need one value per unit ({units.shape[0]}), "
                         f"got {lo.numel()} and {hi.numel()}")
    return units, lo, hi


def _default_global_amax(lo, hi, spec, global_amax):
    if not spec.scale.has_global_scale:
        return None
    if global_amax is None:
        return amax_of_range(lo, hi).max().clamp(min=0).reshape(())
    return torch.as_tensor(global_amax, dtype=torch.float32, device=lo.device).reshape(())


def mse_search(units: torch.Tensor, lo: torch.Tensor | None, hi: torch.Tensor | None,
               spec: QuantSpec, *, maxshrink: float = 0.2, grid: float = 100, norm: float = 2.0,
               patience: int | None = 5, expand: float = 1.0, per_unit_patience: bool = True,
               encoding_aware: bool = True, independent_ends: bool = False,
               ends_grid: int | None = None, global_amax: torch.Tensor | None = None,
               global_grid: int | None = None, factors: list[float] | None = None,
               tie: str = "first", compat: str | None = None,
               extend_to: float | None = 0.5, chunk_elems: int | None = None,
               chunk_candidates: int | None = None, early_stop: bool | None = None,
               backend: str | None = None, incumbent: bool = True,
               float32_squares: bool = False) -> SearchResult:
    """Per-unit range minimizing ``sum(|fake_quant(x) - x| ** norm)`` over shrink candidates.

    Args:
        units: float ``[U, E]`` (a layout's units view); ``lo``, ``hi``: its per-unit
            min / max (None: computed).
        spec: the quantizer; candidates are scored as it runs.
        maxshrink, grid, expand: candidates ``(lo * expand) * p``, ``p = 1 - i / grid``,
            ``i < int(maxshrink * grid)`` (llm-compressor's grid); ``factors`` replaces it.
        norm: error exponent (2: MSE; llm-compressor's default is 2.4).
        patience: stop after this many non-improving candidates (None: try all).
        per_unit_patience: per-unit stopping (True) or llm-compressor's global rule.
        encoding_aware: score candidates with the spec's scale encoding (True) or with
            float32 scales (False: what llm-compressor does for NVFP4).
        independent_ends: asymmetric specs try every ``(f_lo, f_hi)`` pair of a small
            2-D grid (``ends_grid`` factors per end, default all of the 1-D grid).
        global_amax: NVFP4's whole-tensor amax (default: from ``lo``, ``hi``).
        global_grid: NVFP4: also try global amax ``* 2 ** (k / global_grid)`` for
            ``k < global_grid`` and keep the best total (default 4 native, 1 compat; at most
            :data:`MAX_GLOBAL_GRID`).
        tie: ``"first"`` or ``"last"`` best candidate.
        extend_to: with per-unit patience, units still improving at the end of the grid
            go on along it (``p = 1 - i / grid``) while ``p > 1 - extend_to`` (0.51 at the
            defaults) until they stop improving (None: the grid only). llm-compressor's
            20-step grid ends at 0.81x, short of the int4 optimum of Gaussian rows (~0.75x).
        compat: ``"llmcompressor"``: their exact search (global patience, their error sum,
            no min-max incumbent, fp32 scales without the global scale for NVFP4, other
            scale encodings as encoded; ``encoding_aware`` is then ignored).
        chunk_elems: elements per ``[candidates, units, elements]`` tile.
        early_stop: break once every unit stopped (default: on CPU; elsewhere the same
            answer is computed without a host sync).
        backend: None (default): the C kernel (:mod:`.mse_kernel`) where it applies
            (integer formats without a global scale, or float element formats such as MX
            and NVFP4; ``norm=2``, float32 CPU units, not ``compat``), else torch;
            ``"torch"`` forces the torch tiles; ``"kernel"`` requires the kernel;
            ``"ops"`` the ``quantscope::`` ops (:mod:`.mse_ops`: every candidate priced in
            one pass, then selected; any norm, ``compat`` included; the default off the
            CPU, Triton on CUDA). The
            kernel scores ``sum((fake_quant(x) - x) ** 2)`` summed in float64; torch
            scores the same quantizer in float32 by a rounding identity.
            With ``compat="llmcompressor"`` the kernel is :mod:`.mse_compat`'s (integer
            formats, float32 CPU units, norms 1, 1.5, 2, 2.4, 3, rows under 32768
            elements; 1.5 and 2.4 rows a multiple of 64): the torch path's choices and
            errors bit for bit; ``error`` is then computed on first access.
        incumbent: native searches start from the min-max range as the best so far
            (index -1; True); False: the first candidate is the first best, as in Quark's
            power-of-two search (:func:`pow2_search`, whose candidates include factor 1);
            the torch tiles or the ops then search (the C kernel needs the incumbent).
        float32_squares: each squared error ``d * d`` rounded to float32, not exact in
            float64: the arithmetic of a toolkit a compat class imitates (Horizon's
            ``linalg.norm``; ``compat="llmcompressor"`` always; module doc).

    Returns:
        :class:`SearchResult` ``(lo, hi)`` with ``.error``, ``.global_amax``, ``.index``.
    """
    units, lo, hi = _check(units, lo, hi, spec, norm)
    if compat == "llmcompressor":
        patience = compat_patience(patience)
    patience, expand = _check_options(
        compat, tie, patience, expand, backend, chunk_elems, global_grid,
        chunk_candidates=chunk_candidates, ends_grid=ends_grid,
        per_unit_patience=per_unit_patience, encoding_aware=encoding_aware,
        independent_ends=independent_ends, incumbent=incumbent,
        float32_squares=float32_squares)
    exact = compat == "llmcompressor"
    search = _engine(units, spec, norm, exact, backend, incumbent)
    if exact:  # their search: global patience, their grid; NVFP4's block scales in float32
        # without the global scale (llm-compressor drops tensor_group's scale_dtype to search);
        # other encodings (MX's E8M0, bf16 scales) are priced as encoded, as theirs are
        per_unit_patience, independent_ends, extend_to = False, False, None
        encoding_aware = not spec.scale.has_global_scale
    f_lo, f_hi, patience_used, extend = _candidates(
        factors, maxshrink, grid, expand, extend_to, per_unit_patience, patience,
        independent_ends and not spec.symmetric, ends_grid, exact)
    if not f_lo:  # llm-compressor's search without steps: the (expanded) min-max range
        return SearchResult(lo * expand, hi * expand,
                            torch.full_like(lo, torch.finfo(torch.float32).max), None,
                            torch.full(lo.shape, -1, dtype=torch.int64, device=lo.device))
    base_lo, base_hi = lo, hi  # min-max itself: (lo * expand) / expand can be an ulp off
    if expand != 1.0:
        lo, hi = lo * expand, hi * expand  # llm-compressor's order: (lo * expand) * p
    if chunk_elems is None:
        chunk_elems = min(DEFAULT_CHUNK_ELEMS, max(units.numel() // 2, _MIN_CHUNK_ELEMS))
    if early_stop is None:
        early_stop = units.device.type == "cpu"
    early_stop = check_bool("mse_search", "early_stop", early_stop)
    ga0 = _default_global_amax(base_lo, base_hi, spec, global_amax)
    gas = _global_amaxes(ga0, spec, encoding_aware, global_grid)
    kw = {"norm": float(norm), "patience": patience_used, "per_unit": per_unit_patience,
          "tie": tie, "exact": exact, "chunk_elems": int(chunk_elems),
          "chunk_candidates": chunk_candidates, "early_stop": early_stop,
          "incumbent": None if exact or not incumbent else (base_lo, base_hi),
          "extend": extend, "float32_squares": float32_squares or exact}
    search_spec = spec if encoding_aware else _blind(spec)
    if exact and search is mse_tiles.search:  # the kernel prices, torch settles near ties
        search = mse_compat.engine(units, search_spec, kw, len(f_lo), backend) or search
    results = [search(units, lo, hi, search_spec, f_lo, f_hi, global_amax=ga, **kw)
               for ga in gas]
    if len(results) == 1:
        blo, bhi, berr, bidx = results[0]
        ga = ga0 if gas[0] is None and not exact else gas[0]
        return SearchResult(blo, bhi, berr, ga, bidx)
    return _lowest_total(results, gas)


def _engine(units, spec, norm, exact, backend, incumbent=True):
    """The search engine: on the CPU the C kernel (native with the incumbent, squared
    error), off it the ops (the formats they price, any norm, compat included), else the
    torch tiles; ``backend`` forces one. For compat on the CPU, ``mse_compat.engine`` may
    take over from the tiles (:func:`mse_search`)."""
    native = not exact and incumbent  # the kernel's searches
    if backend == "torch" or (not native and backend == "kernel"):
        return mse_tiles.search
    if backend in (None, "kernel") and native and mse_kernel.usable(units, spec, norm):
        return mse_kernel.search
    if backend in (None, "ops") and mse_ops.usable(units, spec, norm) \
            and (backend == "ops" or units.device.type != "cpu"):
        return mse_ops.search
    if backend is not None:
        kernel = "; norm=2, no compat, on the CPU, and a C compiler" if backend == "kernel" \
            else ""
        raise ValueError(f"mse_search: backend={backend!r} needs an integer format without a "
                         f"global scale or a float element format, float32 units without "
                         f"autograd{kernel}")
    return mse_tiles.search


def _check_chunk(who, chunk_elems):
    # a tile of zero or fewer elements prices nothing (or loops with step 0)
    if chunk_elems is not None:
        check_int(who, "chunk_elems", chunk_elems, 1)


#: the most global amaxes an NVFP4 search tries (``global_grid``; default 4)
MAX_GLOBAL_GRID = 1 << 16


def _check_options(compat, tie, patience, expand, backend, chunk_elems=None, global_grid=None,
                   chunk_candidates=None, ends_grid=None, **flags) -> tuple[int | None, float]:
    """Refuse a wrong option; ``(patience, expand)`` as Python numbers (numpy's accepted)."""
    counts = {"global_grid": global_grid, "chunk_candidates": chunk_candidates,
              "ends_grid": ends_grid}
    for name, value in flags.items():  # a string such as "no" would be silently truthy
        if not isinstance(value, bool):
            raise TypeError(f"mse_search: {name} must be a bool, got {type(value).__name__} "
                            f"{value!r}")
    _check_chunk("mse_search", chunk_elems)
    for name, value in counts.items():  # int() would cut 1.5 to 1 and read True as 1; a
        if value is not None:  # chunk of 0 or fewer candidates prices none (min-max returned)
            # (the global amaxes are a Python list, each a whole search: 2 ** 64 ran out of
            # memory listing them)
            check_int("mse_search", name, value, 1, MAX_GLOBAL_GRID if name == "global_grid"
                      else None)
    if compat not in (None, "llmcompressor"):
        raise ValueError(f"mse_search: compat must be None or 'llmcompressor', got {compat!r}")
    if tie not in ("first", "last"):
        raise ValueError(f"mse_search: tie must be 'first' or 'last', got {tie!r}")
    if backend not in BACKENDS:
        raise ValueError(f"mse_search: backend must be one of {BACKENDS}, got {backend!r}")
    if patience is not None:  # check_int refuses a bool (True would read as patience 1)
        patience = check_int("mse_search", "patience (or None)", patience, 1)
    return patience, check_number("mse_search", "expand", expand, 1.0)


def _candidates(factors, maxshrink, grid, expand, extend_to, per_unit, patience, two_ends,
                ends_grid, exact=False):
    """``(f_lo, f_hi, patience, extend)``: each candidate's factor per end, the patience
    that applies to them, and the factors of the per-unit extension (see ``extend_to``)."""
    extend = []
    if factors is None and exact:
        factors = shrink_factors(maxshrink, grid, expand, none_ok=True)
    elif factors is None:
        factors = shrink_factors(maxshrink, grid, expand)
        if extend_to is not None and per_unit and patience is not None:
            if not (isinstance(extend_to, (int, float)) and 0 < extend_to < 1):
                raise ValueError(f"mse_search: extend_to must be in (0, 1) or None, "
                                 f"got {extend_to!r}")
            extend = [1 - i / grid for i in range(len(factors), int(extend_to * grid))]
    else:
        factors = [float(f) for f in factors]
        if not factors or not all(0 < f < math.inf for f in factors):  # NaN fails too
            raise ValueError(f"mse_search: factors must be positive finite numbers, "
                             f"got {factors!r}")
    if two_ends:  # every (f_lo, f_hi) pair: a 2-D grid has no order to be patient along
        ends = factors if ends_grid is None else factors[:: max(1, len(factors) // ends_grid)]
        return [a for a in ends for _ in ends], [b for _ in ends for b in ends], None, []
    return factors, factors, patience, extend


def _global_amaxes(ga0, spec, encoding_aware, global_grid):
    """NVFP4's global amaxes to search, none past float32's max (``[None]``: none, or blind)."""
    if ga0 is None or (spec.scale.has_global_scale and not encoding_aware):
        return [None]
    g = 4 if global_grid is None else global_grid  # an integer >= 1 (_check_options)
    return [(ga0 * 2 ** (k / g)).clamp(max=torch.finfo(torch.float32).max) for k in range(g)]


def _lowest_total(results, gas):
    """The result under the global amax with the lowest total error (of the engines' float64
    errors: float32 ones of tiny units underflow to 0 and tie), picked by indexing, not by a
    Python branch on a tensor value (no device read-back); argmin keeps the first of equal
    totals."""
    k = torch.stack([r[2].sum() for r in results]).argmin().reshape(1)

    def pick(parts):
        return torch.stack(parts).index_select(0, k).squeeze(0)

    blo, bhi, berr, bidx = (pick(parts) for parts in zip(*results))
    return SearchResult(blo, bhi, berr, pick([torch.as_tensor(g) for g in gas]), bidx)


def _blind(spec: QuantSpec) -> QuantSpec:
    """The spec with float32 scales: what an encoding-blind search scores."""
    if spec.scale.kind == "fp32":
        return spec
    return spec.replace(scale="fp32")


# ----------------------------------------------------------------------------- the others
def range_error(units: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, spec: QuantSpec,
                norm: float = 2, *, global_amax: torch.Tensor | None = None,
                chunk_elems: int | None = None) -> torch.Tensor:
    """Per-unit ``sum(|fake_quant(x) - x| ** norm)`` of the quantizer of ranges ``lo, hi``.

    The quantizer is exactly what ``qparams_from_range(lo, hi, spec, global_amax)``
    gives and ``fake_quantize_units`` runs (NVFP4: the global amax defaults to
    the largest of ``|lo|, |hi|``).
    """
    units, lo, hi = _check(units, lo, hi, spec, norm)
    _check_chunk("range_error", chunk_elems)
    if chunk_elems is None:
        chunk_elems = min(DEFAULT_CHUNK_ELEMS, max(units.numel() // 2, _MIN_CHUNK_ELEMS))
    qp = qparams_from_range(lo, hi, spec, global_amax=global_amax)
    scale = qp.effective_scale.expand_as(lo)[None]
    zp = qp.zero_point.float()[None]
    n_units, n_elems = units.shape
    err = lo.new_zeros(n_units)
    if n_elems <= chunk_elems:
        step = max(1, chunk_elems // n_elems)
        for a in range(0, n_units, step):
            x = units[a:a + step]
            d = fake_quantize_units(x, scale[0, a:a + step, None], zp[0, a:a + step, None],
                                    spec).sub_(x)
            err[a:a + step] = norm_sum(d, float(norm))
    else:
        for a in range(0, n_elems, chunk_elems):
            x = units[:, a:a + chunk_elems]
            d = fake_quantize_units(x, scale[0, :, None], zp[0, :, None], spec).sub_(x)
            err += norm_sum(d, float(norm))
    return err


def dense_search(units: torch.Tensor, lo: torch.Tensor | None, hi: torch.Tensor | None,
                 spec: QuantSpec, *, candidates: int = 1000, expand: float = 1.0,
                 min_factor: float = 0.0, norm: float = 2.0, chunk_elems: int | None = None,
                 global_amax: torch.Tensor | None = None) -> SearchResult:
    """The optimality reference: ``candidates`` factors evenly from ``expand`` down to
    ``min_factor`` (``expand * (1 - i / candidates)`` by default), no early stop.

    The best range per unit on a dense grid from ``expand`` times the min-max
    range down to nearly zero (the min-max range included), scored as the spec
    runs; benchmarks and tests report other searches' error relative to it.
    """
    # a Python list of the factors: bounded (True is no count; numpy's integers are)
    candidates = check_int("dense_search", "candidates", candidates, 1, 1 << 24)
    given, min_factor = min_factor, as_number(min_factor)
    if min_factor is None or not 0 <= min_factor < 1:  # NaN too
        raise ValueError(f"dense_search: min_factor must be a number in [0, 1), got {given!r}")
    span = 1 - min_factor
    return mse_search(units, lo, hi, spec,
                      factors=[1 - span * i / candidates for i in range(candidates)],
                      expand=expand, norm=norm, patience=None, global_amax=global_amax,
                      global_grid=1, chunk_elems=chunk_elems)


def linear_search(units: torch.Tensor, lo: torch.Tensor | None, hi: torch.Tensor | None,
                  spec: QuantSpec, *, stride: int = 1, norm: float = 2.0,
                  chunk_elems: int | None = None,
                  float32_squares: bool = False) -> SearchResult:
    """Horizon's MSE search: ``amax * (1 - 0.01 i)`` for ``i`` in ``range(0, 95, stride)``.

    Symmetric ranges ``(-c, c)`` around zero, L2 error, the last minimum wins
    (``float32_squares``: :func:`mse_search`'s; Horizon's compat class sets it)."""
    stride = check_int("linear_search", "stride", stride, 1, 94)  # not a bool
    units, lo, hi = _check(units, lo, hi, spec, norm)
    amax = amax_of_range(lo, hi).clamp(min=0)
    return mse_search(units, -amax, amax, spec, norm=norm, patience=None, tie="last",
                      factors=[1 - 0.01 * i for i in range(0, 95, stride)], global_grid=1,
                      chunk_elems=chunk_elems, float32_squares=float32_squares)


def pow2_search(units: torch.Tensor, lo: torch.Tensor | None, hi: torch.Tensor | None,
                spec: QuantSpec, *, span: int = 2, norm: float = 2.0,
                chunk_elems: int | None = None) -> SearchResult:
    """Quark's power-of-two min-MSE: the min-max scale's exponent ``pos - span .. pos + span``.

    Scaling the range by ``2 ** k`` moves a power-of-two scale by exactly ``k``
    binades, so the candidates are the factors ``4, 2, 1, 1/2, 1/4`` (span 2), the
    first strict minimum winning as in Quark (which tries the largest scale first): no
    separate min-max incumbent, factor 1 (min-max) is the middle candidate, so the (priced)
    result is still never worse than min-max. Where no candidate's error is below float32's
    largest value (the search's first best, 3.4e38: values past ~1e19), min-max stands, as
    in Quark, whose float32 errors overflow there and whose best starts as min-max with an
    infinite error (the first candidate would be 4x it); a candidate whose range overflows
    float32 (x2, x4 of values near its max) is never chosen.
    """
    check_int("pow2_search", "span", span, 0, MAX_SPAN)
    units, lo, hi = _check(units, lo, hi, spec, norm)
    res = mse_search(units, lo, hi, spec,
                     factors=[math.ldexp(1.0, -k) for k in range(-span, span + 1)], norm=norm,
                     patience=None, global_grid=1, chunk_elems=chunk_elems, incumbent=False)
    unpriced = res.index < 0  # the initial best stood (a float32 error can round up to it)
    return SearchResult(torch.where(unpriced, lo, res.lo), torch.where(unpriced, hi, res.hi),
                        res.error, res.global_amax,
                        torch.where(unpriced, span, res.index))
