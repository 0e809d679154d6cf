"""ModelOpt's histogram grid grown in Python floats (compat/modelopt_grid.py): the bin count
``ceil(top / w)`` and the grown grid's last edge ``arange(0, top + w, w)[-1]`` computed from
floats where ModelOpt (and the code before) used float32 tensor ops, the first grid's
``linspace`` kept per (max ``|x|``, bins, default dtype). Each is checked against the tensor
formula it stands for."""

from __future__ import annotations

import math
import random

import pytest
import torch

from quantscope import kernels
from quantscope.compat.modelopt import HistogramCalibrator
from quantscope.compat.modelopt_grid import _float32, bins_for


def _f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


def test_bins_for_is_torch_float32_ceil_of_the_quotient():
    rng = random.Random(0)
    widths = [0.0, 1e-45, 3e-39, 1e-30, 7e-3, 0.1, 1.0, 3e7]
    for _ in range(4000):
        w = _f32(rng.choice(widths) * rng.uniform(0.5, 2.0))
        top = _f32(w * rng.uniform(0.5, 5000.0) if w else rng.choice([0.0, 1.0]))
        if rng.random() < 0.05:
            top = _f32(rng.uniform(1e37, 3e38))  # quotients past float32: inf
        want = torch.ceil(torch.tensor([top]) / torch.tensor(w)).max()
        got = bins_for(top, w)
        if bool(want.isfinite()):
            assert got == float(want), (top, w)
        else:
            assert not math.isfinite(got) and math.isnan(got) == bool(want.isnan()), \
                (top, w, got, want)


def test_grown_edge_is_the_tensor_arange():
    """arange(0, float32(top + w), w) from floats is arange(0, top_t + w_t, w_t) of 0-d
    float32 tensors, every element, the last edge among them."""
    rng = random.Random(1)
    for _ in range(3000):
        first = _f32(rng.uniform(1e-3, 1e3) * 10.0 ** rng.randint(-15, 15))
        bins = rng.choice([2, 16, 128, 2048])
        edges = torch.linspace(0, first, bins + 1)
        w = edges[1] - edges[0]
        top = _f32(first * rng.uniform(1.0, 64.0))
        want = torch.arange(0, torch.tensor(top) + w, w)
        got = torch.arange(0, _float32(top + float(w)), float(w))
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("cached", [True, False])
def test_growing_grid_as_the_tensor_formulas(cached):
    """After each growing batch: the bins, the kept top and last edge are the tensor formulas'
    (the general path and the cached step both grow by _grow_to)."""
    cal = HistogramCalibrator(num_bins=64)
    cal.cached_cpu_step = cached
    g = torch.Generator().manual_seed(3)
    cal.collect(torch.randn(500, generator=g))
    edges = torch.linspace(0, float(cal.hist_hi[0]), 65)
    w = edges[1] - edges[0]
    grown = 0
    for scale in (1.2, 1.5, 1.5, 2.0, 7.0, 20.0):
        x = torch.randn(500, generator=g) * scale
        amax, top = x.abs().max(), float(cal._linear_top())
        before = cal.hist_counts.shape[1]
        cal.collect(x)
        if float(amax) <= top:
            continue  # inside the grid: nothing grew
        grown += 1
        need = int(torch.ceil(amax.reshape(1) / w).max())
        assert cal.hist_counts.shape[1] == max(need, before)
        assert cal._grown_top.shape == () and float(cal._grown_top) == float(amax)
        assert torch.equal(cal._grown_edge, torch.arange(0, cal._grown_top + w, w)[-1:])
        assert torch.equal(cal._calib_bin_edges, torch.arange(0, cal._grown_top + w, w))
    assert grown >= 3 and cal._linear


def test_first_grid_follows_the_first_batch_and_the_default_dtype():
    cal = HistogramCalibrator(num_bins=16)
    cal.collect(torch.tensor([1.0, -3.0]))
    edges = cal._calib_bin_edges
    assert torch.equal(edges, torch.linspace(0, 3.0, 17))
    edges.fill_(0)  # a copy: the kept grid stays
    assert torch.equal(cal._calib_bin_edges, torch.linspace(0, 3.0, 17))
    cal.reset()
    cal.collect(torch.tensor([5.0]))
    assert torch.equal(cal._calib_bin_edges, torch.linspace(0, 5.0, 17))
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert cal._calib_bin_edges.dtype == torch.float64  # linspace's, as ModelOpt's
        cal.collect(torch.tensor([8.0]))  # grows by the tensor formulas (a float64 width)
        w = torch.linspace(0, 5.0, 17)
        w = w[1] - w[0]
        assert cal.hist_counts.shape[1] == int(torch.ceil(torch.tensor([8.0]) / w).max())
        assert torch.equal(cal._grown_edge, torch.arange(0, cal._grown_top + w, w)[-1:])
    finally:
        torch.set_default_dtype(before)


def _state(cal) -> dict:
    """Every buffer (bits, shape, version), the grown top and edge, ModelOpt's attributes and
    amaxes, read on the CPU."""
    out = {k: (b.dtype, tuple(b.shape), b._version, b.cpu().tolist())
           for k, b in cal._buffers.items()}
    for name in ("_grown_top", "_grown_edge", "_calib_hist", "_calib_bin_edges"):
        v = getattr(cal, name)
        out[name] = None if v is None else (v.dtype, v.cpu().tolist())
    out["amax"] = [float(cal.compute_amax(m, start_bin=1)) for m in ("percentile", "mse")]
    return out


def _off_the_cpu_sequence(device: str) -> None:
    """A batch whose grown grid ends past float32 (first max 1e37, 16 bins: 544 bins to
    3.4e38, whose end overflows), then batches inside and past the grid: ModelOpt's
    RuntimeError with nothing changed (the counts had been padded to 544 bins and the top
    kept before arange failed, every later call failing too), collect and forward alike; the
    grown states as a CPU calibrator's that never saw it."""
    for how in ("collect", "forward"):
        cal, never = HistogramCalibrator(num_bins=16), HistogramCalibrator(num_bins=16)
        first = torch.tensor([1e37, 5e36])
        cal.collect(first.to(device))
        never.collect(first)
        before = _state(cal)
        huge = torch.tensor([3.4e38, 2.0], device=device)
        with pytest.raises(RuntimeError, match="^unsupported range: 0 -> inf"):
            cal.collect(huge) if how == "collect" else cal(huge)
        assert _state(cal) == before
        for x in ([2e37, 1.0], [5e36, 2.0], [9e37, 3.0]):  # grows to 32 bins, then 144
            cal.collect(torch.tensor(x, device=device))
            never.collect(torch.tensor(x))
            assert _state(cal) == _state(never)
        assert cal.hist_counts.shape == (1, 144) and cal.hist_counts.device.type == device


def test_off_the_cpu_growth_refuses_with_nothing_changed(monkeypatch):
    """The off-CPU branch of _append_bins, simulated on the CPU: kernels.first_value reads
    None, as for a CUDA tensor (the general path then; the max |x| read with float)."""
    monkeypatch.setattr(kernels, "first_value", lambda t, dtype=torch.float32: None)
    _off_the_cpu_sequence("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_growth_refuses_with_nothing_changed():
    _off_the_cpu_sequence("cuda")


@pytest.mark.peers
@pytest.mark.parametrize(("first", "huge"), [
    ([1.0, 0.5], torch.finfo(torch.float32).max), ([1e-3, 2e-4], 1e38),
    ([1e-40, 3e-41], 0.5)])
def test_bin_count_past_float32_fails_as_modelopts(first, huge):
    """A bin count past float32's range: ModelOpt's OverflowError, then the same histogram,
    edges and percentile amax as ModelOpt 0.47's after later batches, inside the grid and
    growing it (its mse amax is its first candidate: a documented difference)."""
    calib = pytest.importorskip("modelopt.torch.quantization.calib")
    ours, theirs = HistogramCalibrator(num_bins=16), calib.HistogramCalibrator(num_bins=16)
    errors = []
    for c in (ours, theirs):
        c.collect(torch.tensor(first))
        with pytest.raises(OverflowError) as e:
            c.collect(torch.tensor([huge, first[1]]))
        errors.append((e.type, str(e.value).split(" (")[0]))
        for y in (torch.tensor(first) * 0.5, torch.tensor(first) * 2):
            c.collect(y)
    assert errors[0] == errors[1]
    assert torch.equal(ours._calib_hist, theirs._calib_hist)
    assert torch.equal(ours._calib_bin_edges, theirs._calib_bin_edges)
    for p in (60.0, 90.0, 99.0):  # (no whole count: the documented cdf difference)
        assert torch.equal(ours.compute_amax("percentile", percentile=p),
                           theirs.compute_amax("percentile", percentile=p)), p


@pytest.mark.parametrize("how", ["collect", "forward"])
@pytest.mark.parametrize("first", [[1e-44, 0.0], [1.4e-45]])
def test_a_first_grid_of_width_zero_moves_as_an_all_zero_one(first, how):
    """A first batch so small that its width ``max |x| / num_bins`` rounds to 0 in float32
    (below ``num_bins * 2 ** -150``: 1.1e-44 at 16 bins) holds no later data, as a first
    batch of only zeros: the next batch past it moves the calibrator to quantscope's grid,
    the zeros case's state. ModelOpt 0.47 raises its OverflowError there, on every later
    batch past the grid (the module's documented difference; the peers test below)."""
    assert _f32(torch.linspace(0, first[0], 17)[1].item()) == 0.0
    tiny, zeros = HistogramCalibrator(num_bins=16), HistogramCalibrator(num_bins=16)
    for x in (first, [1.0, 0.5], [0.25]):
        for cal, batch in ((tiny, x), (zeros, [0.0] * len(x) if x is first else x)):
            (cal.collect if how == "collect" else cal)(torch.tensor(batch))
    assert not tiny._linear and not zeros._linear
    assert torch.equal(tiny._calib_hist, zeros._calib_hist)
    assert torch.equal(tiny._calib_bin_edges, zeros._calib_bin_edges)
    assert tiny.compute_amax("percentile", percentile=99.0) == 1.0


@pytest.mark.peers
def test_a_first_grid_of_width_zero_is_modelopts_overflow():
    """The difference pinned: ModelOpt 0.47 refuses the batch after a width-0 first grid
    with its ``int(inf)`` OverflowError and keeps its first histogram (quantscope moves)."""
    calib = pytest.importorskip("modelopt.torch.quantization.calib")
    theirs = calib.HistogramCalibrator(num_bins=16)
    theirs.collect(torch.tensor([1e-44, 0.0]))
    for x in ([1.0, 0.5], [0.25]):
        with pytest.raises(OverflowError, match="cannot convert float infinity to integer"):
            theirs.collect(torch.tensor(x))
    assert float(theirs._calib_hist.sum()) == 2.0
