"""MSE search estimators and observers: llm-compressor's reference values and exact mode, the
native rules' guarantees (never worse than min-max, than global patience, than an
encoding-blind search), the dense reference and tiling (llm-compressor itself on the same
tensors: tests/compat/test_llmc_mse_differential.py, in the peers' venv)."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import quantscope.estimators.mse as mse_mod
from quantscope import presets
from quantscope.compat import horizon
from quantscope.compat import llmcompressor_legacy as llmcompressor  # the seed's API
from quantscope.estimators import (
    dense_search,
    linear_search,
    mse_search,
    mse_tiles,
    pow2_search,
    range_error,
)
from quantscope.layout import Channel, Group, Tensor, Tile, Token
from quantscope.observers import get_observer, list_observers
from quantscope.qdq import fake_quantize, fake_quantize_units
from quantscope.qparams import qparams_from_range
from quantscope.spec import QuantSpec
from quantscope.stats.minmax import unit_minmax

# llm-compressor's tests/llmcompressor/observers/test_mse.py: x = arange(24).reshape(6, 4) / 24,
# int8, observer "mse", sum((x - qdq(x)) ** 2) / numel, to 1e-10
REFERENCE = [("tensor", True, 4.8103e-06), ("tensor", False, 1.1258e-06),
             ("channel", True, 2.5675e-06), ("channel", False, 2.3696e-07),
             ("group", True, 3.1282e-06), ("group", False, 1.3794e-07),
             ("block", True, 2.8968e-06), ("block", False, 5.6068e-07)]
LAYOUTS = {"tensor": Tensor(), "channel": Channel(0), "group": Group(2), "block": Tile(3, 2)}


def weight(shape=(48, 256), seed=0, outliers=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g).add_(0.1)
    if outliers:
        w[1, 3] = 9.0
        w[5, -1] = -7.0
    return w


SPECS = {
    "int4-channel": QuantSpec("int4", Channel(0)),
    "int4-g32": QuantSpec("int4", Group(32)),
    "int4-g32-asym": QuantSpec("int4", Group(32), symmetric=False),
    "uint8-tensor-asym": QuantSpec("uint8", Tensor(), symmetric=False),
    "int8-tile": QuantSpec("int8", Tile(16, 32)),
    "int8-token": QuantSpec("int8", Token()),
    "fp8-channel": QuantSpec("fp8_e4m3", Channel(0)),
    "int4-pow2": QuantSpec("int4", Group(32), scale="pow2:round"),
    "int8-fp16": QuantSpec("int8", Channel(0), scale="fp16"),
    "mxfp4": presets.MXFP4,
    "mxfp8": presets.MXFP8,
    "mxint8": presets.MXINT8,
    "nvfp4": presets.NVFP4,
    "bfp16": presets.BFP16,
}


def units_of(spec, w):
    u = spec.layout.to_units(w)
    lo, hi = unit_minmax(u)
    return u, lo, hi


def err_of(u, res, spec):
    """Per-unit squared error of the quantizer that runs for a search result."""
    return range_error(u, res[0], res[1], spec, global_amax=res.global_amax)


# ------------------------------------------------------------------ llm-compressor's values
@pytest.mark.parametrize("strategy,symmetric,expected", REFERENCE)
def test_llmcompressor_reference_values(strategy, symmetric, expected):
    x = torch.arange(24).reshape(6, 4) / 24
    spec = QuantSpec("int8", LAYOUTS[strategy], symmetric=symmetric)
    native = get_observer("mse", spec, compat="llmcompressor")
    args = {"num_bits": 8, "strategy": strategy, "symmetric": symmetric,
            "group_size": 2 if strategy == "group" else None,
            "block_structure": [3, 2] if strategy == "block" else None, "observer": "mse"}
    compat = llmcompressor.Observer.load_from_registry("mse", base_name="weight", args=args)
    assert isinstance(compat, llmcompressor.MovingAverageMSEObserver)
    assert compat.options["norm"] == 2.4 and not compat.options["per_unit_patience"]
    for obs in (native, compat):
        obs(x)
        q = fake_quantize(x, obs.qparams(), obs.spec)
        loss = torch.sum((x - q).abs().pow(2)) / x.numel()
        assert abs(loss.item() - expected) <= 1e-10, (type(obs).__name__, loss.item())
    # the native search on the same tensor: never worse than min-max
    ours = get_observer("mse", spec)
    ours(x)
    mm = get_observer("memoryless_minmax", spec)
    mm(x)
    loss = [torch.sum((x - fake_quantize(x, o.qparams(), spec)) ** 2).item() for o in (ours, mm)]
    assert loss[0] <= loss[1]


def llmcompressor_loop(u, spec, *, maxshrink=0.2, grid=100.0, norm=2.4, patience=5, expand=1.0):
    """llm-compressor's eager ``_grid_search_mse``, line by line, on quantscope's primitives."""
    min_val, max_val = unit_minmax(u)
    min_val, max_val = min_val * expand, max_val * expand
    best_error = torch.full_like(min_val, torch.finfo(min_val.dtype).max)
    best_min, best_max = min_val.clone(), max_val.clone()
    no_improve = 0
    search_spec = spec.replace(scale="fp32") if spec.scale.has_global_scale else spec
    for i in range(int(maxshrink * grid)):
        p = 1 - i / grid
        smin, smax = min_val * p, max_val * p
        qp = qparams_from_range(smin, smax, search_spec, global_amax=torch.tensor(1.0))
        scale = qp.effective_scale if not spec.scale.has_global_scale else qp.scale
        q = fake_quantize_units(u, scale[:, None], qp.zero_point.float()[:, None], search_spec)
        err = torch.sum((q - u).abs().pow(norm), dim=-1)
        improved = err < best_error
        if torch.any(improved):
            best_error[improved] = err[improved]
            best_min[improved], best_max[improved] = smin[improved], smax[improved]
            no_improve = 0
        else:
            no_improve += 1
            if no_improve >= patience:
                break
    return best_min, best_max


@pytest.mark.parametrize("name", ["int4-channel", "int4-g32", "int4-g32-asym",
                                  "uint8-tensor-asym", "int8-tile", "fp8-channel", "nvfp4"])
def test_compat_search_is_their_loop(name):
    spec = SPECS[name]
    for seed, kw in ((0, {}), (1, {"patience": 1}), (2, {"expand": 1.8, "grid": 200,
                                                          "maxshrink": 1 - 0.8 / 1.8})):
        w = weight(shape=(16, 128), seed=seed)
        u, lo, hi = units_of(spec, w)
        ref = llmcompressor_loop(u, spec, **kw)
        ours = mse_search(u, lo, hi, spec, compat="llmcompressor", norm=2.4,
                          chunk_elems=4096, **kw)
        assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1]), (name, kw)
        assert ours.global_amax is None


def test_compat_nvfp4_global_scale_from_chosen_ranges():
    w = weight()
    obs = get_observer("memoryless_mse", presets.NVFP4, compat="llmcompressor")
    obs(w)
    lo, hi = obs.calculate_range()
    qp = obs.qparams()
    expected = qparams_from_range(lo, hi, presets.NVFP4, global_amax=torch.maximum(-lo, hi).max())
    assert torch.equal(qp.global_scale, expected.global_scale)


# ------------------------------------------------------------------ native guarantees
@pytest.mark.parametrize("name", sorted(SPECS))
def test_native_never_worse_than_minmax(name):
    spec = SPECS[name]
    w = weight(shape=(32, 256))
    u, lo, hi = units_of(spec, w)
    res = mse_search(u, lo, hi, spec)
    ga = res.global_amax
    ours = range_error(u, res[0], res[1], spec, global_amax=ga)
    minmax = range_error(u, lo, hi, spec, global_amax=ga)
    assert (ours <= minmax * (1 + 1e-5) + 1e-12).all()
    if spec.scale.has_global_scale:  # the global search includes the observed amax
        observed = range_error(u, lo, hi, spec)
        assert ours.sum() <= observed.sum() * (1 + 1e-5)
    # the observer runs the same search and yields the same quantizer
    obs = get_observer("memoryless_mse", spec)
    obs(w)
    got = torch.sum((fake_quantize(w, obs.qparams(), spec) - w) ** 2)
    assert torch.allclose(got, ours.sum(), rtol=1e-4)


@pytest.mark.parametrize("name", ["int4-channel", "int4-g32", "int4-g32-asym", "mxfp4",
                                  "nvfp4", "int4-pow2", "fp8-channel"])
def test_per_unit_patience_never_worse_than_global(name):
    spec = SPECS[name]
    for seed in range(2):
        u, lo, hi = units_of(spec, weight(shape=(16, 256), seed=seed))
        for patience in (1, 5):
            per_unit = mse_search(u, lo, hi, spec, patience=patience, global_grid=1)
            glob = mse_search(u, lo, hi, spec, patience=patience, global_grid=1,
                              per_unit_patience=False)
            a, b = err_of(u, per_unit, spec), err_of(u, glob, spec)
            assert (a <= b * (1 + 1e-5) + 1e-12).all(), (name, patience)


@pytest.mark.parametrize("name", ["mxfp4", "mxfp8", "mxint8", "bfp16", "nvfp4", "int4-pow2",
                                  "int8-fp16"])
def test_encoding_aware_never_worse_than_blind(name):
    spec = SPECS[name]
    u, lo, hi = units_of(spec, weight())
    aware = mse_search(u, lo, hi, spec)
    blind = mse_search(u, lo, hi, spec, encoding_aware=False)
    a, b = err_of(u, aware, spec), err_of(u, blind, spec)
    if spec.scale.has_global_scale:  # one global scale for all blocks: compare totals
        assert a.sum() <= b.sum() * (1 + 1e-5)
    else:
        assert (a <= b * (1 + 1e-5) + 1e-12).all()


def test_blind_search_can_lose_to_minmax_on_mx():
    """Why the search must be encoding-aware: a blind MXFP4 search shrinks ranges whose
    E8M0 scale then drops a binade (llm-compressor issue #2094's failure)."""
    spec = presets.MXFP4
    u, lo, hi = units_of(spec, weight())
    blind = mse_search(u, lo, hi, spec, encoding_aware=False)
    assert err_of(u, blind, spec).sum() > range_error(u, lo, hi, spec).sum()


@pytest.mark.parametrize("name", ["int4-channel", "int4-g32", "int4-g32-asym", "int8-tile"])
def test_dense_reference_gap(name):
    spec = SPECS[name]
    u, lo, hi = units_of(spec, weight(outliers=False))
    dense = err_of(u, dense_search(u, lo, hi, spec, candidates=400), spec).sum()
    native = err_of(u, mse_search(u, lo, hi, spec), spec).sum()
    grid_only = err_of(u, mse_search(u, lo, hi, spec, extend_to=None), spec).sum()
    assert dense <= native * (1 + 1e-4)  # 400 candidates from 1.0 down: at least as good
    assert native <= dense * 1.03  # and the native search is close to it
    assert native <= grid_only * (1 + 1e-5)


def test_independent_ends_search_contains_the_diagonal():
    spec = SPECS["int4-g32-asym"]
    u, lo, hi = units_of(spec, weight())
    one = mse_search(u, lo, hi, spec, patience=None, extend_to=None)
    two = mse_search(u, lo, hi, spec, independent_ends=True)
    assert (err_of(u, two, spec) <= err_of(u, one, spec) * (1 + 1e-5) + 1e-12).all()


def test_linear_and_pow2_searches_follow_their_loops():
    w = weight()
    spec = QuantSpec("int8", Channel(0))
    u, lo, hi = units_of(spec, w)
    amax = torch.maximum(-lo, hi)
    best, best_c = torch.full_like(amax, float("inf")), amax.clone()
    for i in range(0, 95, 3):  # Horizon: last minimum
        c = amax * (1 - 0.01 * i)
        e = range_error(u, -c, c, spec)
        take = e <= best * (1 + 1e-6)
        best, best_c = torch.where(take, e, best), torch.where(take, c, best_c)
    res = linear_search(u, lo, hi, spec, stride=3)
    assert torch.allclose(res[1], best_c) and torch.equal(res[0], -res[1])
    spec2 = QuantSpec("int8", Channel(0), scale="pow2:round")
    base = qparams_from_range(lo, hi, spec2).scale
    res2 = pow2_search(u, lo, hi, spec2)
    got = qparams_from_range(res2[0], res2[1], spec2).scale
    ratio = torch.log2(got / base)
    assert ((ratio >= -2) & (ratio <= 2) & (ratio == ratio.round())).all()
    errs = torch.stack([range_error(u, lo * 2.0 ** k, hi * 2.0 ** k, spec2) for k in range(2, -3, -1)])
    assert torch.allclose(err_of(u, res2, spec2), errs.min(0).values)


# ------------------------------------------------------------------ tiling and memory
def test_tiles_are_bounded_and_do_not_change_the_answer(monkeypatch):
    """The torch path's tiles (the kernel has none: it walks units in place)."""
    seen = []
    real = mse_tiles._tile_error

    def spy(x, scale, *a):
        seen.append(scale.shape[0] * x.numel())
        return real(x, scale, *a)

    monkeypatch.setattr(mse_tiles, "_tile_error", spy)
    for spec in (SPECS["int4-g32"], SPECS["int4-channel"], SPECS["nvfp4"]):
        u, lo, hi = units_of(spec, weight(shape=(16, 256)))
        ref = mse_search(u, lo, hi, spec, backend="torch", chunk_elems=1 << 22)
        for chunk in (2048, 20000):
            seen.clear()
            res = mse_search(u, lo, hi, spec, backend="torch", chunk_elems=chunk)
            assert max(seen) <= max(chunk, u.shape[1])
            assert torch.equal(res[0], ref[0]) and torch.equal(res[1], ref[1])
    # per tensor: one unit larger than a tile is split along its elements
    spec = QuantSpec("int8", Tensor())
    u, lo, hi = units_of(spec, weight(shape=(16, 256)))
    seen.clear()
    res = mse_search(u, lo, hi, spec, backend="torch", chunk_elems=1024)
    assert max(seen) <= 1024
    full = mse_search(u, lo, hi, spec, backend="torch", chunk_elems=1 << 22)
    assert torch.allclose(err_of(u, res, spec), err_of(u, full, spec), rtol=1e-5)


def test_default_tile_is_within_twice_the_input():
    u = torch.randn(4096, 128)
    chunk = min(mse_mod.DEFAULT_CHUNK_ELEMS, max(u.numel() // 2, mse_mod._MIN_CHUNK_ELEMS))
    assert 3 * chunk <= 2 * u.numel()  # the error kernel keeps at most ~3 tile-sized temporaries


# ------------------------------------------------------------------ observers
def test_registry_and_compat_names():
    names = list_observers()
    for n in ("memoryless_mse", "mse", "nvfp4_expanded_mse", "linear_mse", "pow2_mse",
              "llmcompressor:mse", "llmcompressor:memoryless_mse", "horizon:MSEObserver"):
        assert n in names
    obs = get_observer("nvfp4_expanded_mse", presets.NVFP4)
    assert obs.options["expand"] == 1.8 and obs.options["grid"] == 200
    assert obs.options["patience"] == 1000 and obs.options["norm"] == 2.0
    lc = llmcompressor.Observer.load_from_registry(
        "memoryless_mse", base_name="weight", args={"num_bits": 4, "strategy": "channel"},
        norm=2.0, triton_error_buffer=0.3)
    assert lc.options["norm"] == 2.0 and lc.compat == "llmcompressor"


def test_moving_average_mse_is_an_ema_of_the_searches():
    spec = SPECS["int4-g32"]
    xs = [weight(seed=s) for s in range(3)]
    ema = get_observer("mse", spec, averaging_constant=0.25)
    one = get_observer("memoryless_mse", spec)
    lo = hi = None
    for x in xs:
        ema(x)
        one(x)
        blo, bhi = one.calculate_range()
        lo = blo.clone() if lo is None else lo + 0.25 * (blo - lo)
        hi = bhi.clone() if hi is None else hi + 0.25 * (bhi - hi)
    got = ema.calculate_range()
    assert torch.allclose(got[0], lo) and torch.allclose(got[1], hi)
    fresh = get_observer("mse", spec, averaging_constant=0.25)
    fresh.load_state_dict(ema.state_dict())
    assert torch.equal(fresh.qparams().scale, ema.qparams().scale)
    with pytest.raises(ValueError, match="unit count"):
        ema(weight(shape=(8, 256)))


def test_compat_moving_average_mse_is_llmcompressors_lerp():
    """``compat="llmcompressor"`` averages with their ``lerp``, ``s * (1 - c) + b * c`` in
    float32 (the module doc), not torch.ao's ``s + c * (b - s)``: the two round differently,
    so the state is bitwise the lerp of the compat searches."""
    spec, c = SPECS["int4-g32"], 0.01
    ema = get_observer("mse", spec, averaging_constant=c, compat="llmcompressor")
    one = get_observer("memoryless_mse", spec, compat="llmcompressor")
    lo = hi = None
    for x in (weight(seed=0), weight(seed=1) * 3):
        ema(x)
        one(x)
        blo, bhi = one.calculate_range()
        lo = blo.clone() if lo is None else lo * (1 - c) + blo * c
        hi = bhi.clone() if hi is None else hi * (1 - c) + bhi * c
    assert torch.equal(ema.min_vals, lo) and torch.equal(ema.max_vals, hi)


def test_moving_average_mse_averages_the_nvfp4_global_amax_like_the_ranges():
    """The class promise: "NVFP4's global amax is averaged the same way" as the ranges. The
    first call takes the search's global amax, each later one moves it ``c`` of the way to
    the batch's (torch.ao's ``s + c * (b - s)``), so a second batch of ten times the amax
    shows in it."""
    spec, c = SPECS["nvfp4"], 0.25
    ema = get_observer("mse", spec, averaging_constant=c)
    one = get_observer("memoryless_mse", spec)
    batches, want = [], None
    for x in (weight(seed=0), weight(seed=1) * 10):
        ema(x)
        one(x)
        batch = one.global_amax()
        batches.append(batch.clone())
        want = batch.clone() if want is None else want + c * (batch - want)
    assert torch.equal(ema.global_amax(), want)
    assert float(want) > 2 * float(batches[0])  # far from the first batch's alone


def test_horizon_compat_mse_observer():
    """Horizon's MSEObserver: per batch the native linear search's factor ``f`` of each
    channel, then an EMA of each signed end times it (``min * f``, ``max * f``)."""
    h = horizon.MSEObserver(stride=2, averaging_constant=0.5, ch_axis=0,
                            qscheme=torch.per_channel_symmetric)
    lo = hi = amax = None
    for s in range(2):
        w = weight(seed=s)
        h(w)
        one = get_observer("linear_mse", QuantSpec("int8", Channel(0)), stride=2)
        one(w)
        a = one.calculate_range()[1]
        f = a / w.abs().amax(1)
        ends = (w.amin(1) * f, w.amax(1) * f)
        lo, hi = ends if lo is None else (lo + 0.5 * (ends[0] - lo), hi + 0.5 * (ends[1] - hi))
        amax = a if amax is None else amax + 0.5 * (a - amax)
    scale, zp = h.calculate_qparams()
    assert scale.shape == (w.shape[0],) and zp.dtype == torch.int64 and (zp == 0).all()
    assert torch.allclose(scale, torch.maximum(-lo, hi) / 127.5, rtol=1e-6)
    assert not torch.allclose(scale, amax / 127.5, rtol=1e-6)  # not an EMA of max |x| * f


def test_bad_arguments_are_named():
    u = torch.randn(4, 8)
    spec = QuantSpec("int8")
    for kw, word in (({"norm": 0}, "norm"), ({"patience": 0}, "patience"),
                     ({"expand": 0.5}, "expand"), ({"grid": 0}, "grid"),
                     ({"maxshrink": 2}, "maxshrink"), ({"compat": "quark"}, "compat"),
                     ({"tie": "middle"}, "tie"), ({"extend_to": 1.5}, "extend_to")):
        with pytest.raises(ValueError, match=word):
            mse_search(u, None, None, spec, **kw)
    with pytest.raises(ValueError, match="expand"):
        get_observer("mse", spec, expand=0.9)
    with pytest.raises(ValueError, match="compat"):
        get_observer("memoryless_mse", spec, compat="horizon")
    with pytest.raises(ValueError, match="units"):
        mse_search(torch.randn(8), None, None, spec)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 6), cols=st.sampled_from([32, 64]), scale=st.floats(1e-3, 1e3),
       shift=st.floats(-1, 1), name=st.sampled_from(sorted(SPECS)), seed=st.integers(0, 99))
def test_property_never_worse_than_minmax_and_inside_the_range(rows, cols, scale, shift, name,
                                                                seed):
    spec = SPECS[name]
    if isinstance(spec.layout, Tile):
        spec = spec.replace(layout=Tile(2, 8))
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, cols, generator=g) + shift) * scale
    u, lo, hi = units_of(spec, w)
    res = mse_search(u, lo, hi, spec)
    ours = err_of(u, res, spec)
    minmax = range_error(u, lo, hi, spec, global_amax=res.global_amax)
    assert torch.isfinite(ours).all()
    assert (ours <= minmax * (1 + 1e-5) + 1e-30).all()
    assert (res[0].abs() <= lo.abs()).all() and (res[1].abs() <= hi.abs()).all()  # shrinks
    assert (res[0] * lo >= 0).all() and (res[1] * hi >= 0).all()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


@pytest.mark.parametrize("name", ["memoryless_mse", "mse"])
@pytest.mark.parametrize("spec", [QuantSpec("int4", "group:16"), QuantSpec("int8", "channel"),
                                  QuantSpec("fp4_e2m1", "block:16", scale="fp8_e4m3")],
                         ids=["int4-g16", "int8-channel", "nvfp4"])
def test_search_in_forward_has_no_host_sync(name, spec, forbid_host_sync):
    # the search runs inside forward. Off the CPU it must stay on the device (early stopping,
    # which reads a flag back once per chunk, is on for CPU only, where reading back is free):
    # on the meta device any data-dependent read fails in torch itself.
    obs = get_observer(name, spec).to("meta")
    for i in range(2):
        obs(torch.randn(64, 128, generator=torch.Generator().manual_seed(i)).to("meta"))
    # and with early stopping off, no Python-level read-back on the CPU either, on the torch
    # path that runs off the CPU (the C kernel runs on the host only: it reads the ends once,
    # mse_tiles.finite_candidates)
    units = spec.layout.to_units(torch.randn(64, 128, generator=torch.Generator().manual_seed(0)))
    lo, hi = units.amin(1), units.amax(1)
    forbid_host_sync()
    mse_mod.mse_search(units, lo, hi, spec, early_stop=False, backend="torch")
