"""Options of the estimator functions that used to pass unchecked (session 39's probe):
each is refused naming the argument, where before it priced nothing, fell back silently,
or failed in torch's own words."""
import math

import pytest
import torch

from quantscope.estimators import entropy_amax, entropy_divergences, histogram_error, mse_search
from quantscope.estimators.percentile import percentile_range, percentile_value
from quantscope.spec import QuantSpec
from quantscope.stats.histogram import Hist


def _hist():
    c = torch.zeros(2, 64, dtype=torch.int64)
    c[:, 10:50] = 3
    return Hist(c, torch.zeros(2), torch.full((2,), 64.0), True)


@pytest.mark.parametrize("backend", [None, "torch"])
@pytest.mark.parametrize("points", [0, -1, 2.5, "2"])
def test_histogram_error_points(points, backend):
    h = _hist()
    lo, hi = torch.zeros(2, 3), torch.full((2, 3), 40.0)
    with pytest.raises(ValueError, match="points must be an integer >= 1"):
        histogram_error(h, lo, hi, QuantSpec("int8", "tensor"), points=points, backend=backend)


@pytest.mark.parametrize("backend", [None, "torch"])
@pytest.mark.parametrize("value", ["no", None, 0, 1])
def test_entropy_copy_zero_bin(value, backend):
    c = torch.zeros(1, 256, dtype=torch.int64)
    c[0, 0], c[0, 130:200] = 10000, 5
    with pytest.raises(ValueError, match="copy_zero_bin must be True or False"):
        entropy_divergences(c, copy_zero_bin=value, backend=backend)
    with pytest.raises(ValueError, match="copy_zero_bin must be True or False"):
        entropy_amax(Hist(c, torch.zeros(1), torch.tensor([256.0]), True), copy_zero_bin=value)


def _units():
    return torch.randn(16, 128, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name,value", [("chunk_candidates", 0), ("chunk_candidates", -1),
                                        ("chunk_candidates", 2.5), ("chunk_candidates", "4"),
                                        ("ends_grid", 0), ("ends_grid", -3),
                                        ("ends_grid", 2.5)])
def test_mse_search_counts(name, value):
    x = _units()
    with pytest.raises(ValueError, match=f"{name} must be an integer >= 1"):
        mse_search(x, x.amin(-1), x.amax(-1), QuantSpec("int4", "channel", symmetric=False),
                   independent_ends=True,
                   **{name: value})


def test_mse_search_chunk_candidates_one_prices_every_candidate():
    # the smallest chunk searches as the default chunk does
    x = _units()
    spec = QuantSpec("int4", "channel", symmetric=False)
    a = mse_search(x, x.amin(-1), x.amax(-1), spec, chunk_candidates=1, backend="torch")
    b = mse_search(x, x.amin(-1), x.amax(-1), spec, backend="torch")
    assert torch.equal(a.hi, b.hi) and bool((a.index >= 0).any())


@pytest.mark.parametrize("factors", [[math.nan], [math.inf], [0.9, math.nan], [-0.5]])
@pytest.mark.parametrize("incumbent", [True, False])
def test_mse_search_factors_finite(factors, incumbent):
    x = _units()
    with pytest.raises(ValueError, match="factors must be positive finite numbers"):
        mse_search(x, x.amin(-1), x.amax(-1), QuantSpec("int4", "channel", symmetric=False),
                   factors=factors,
                   incumbent=incumbent)


@pytest.mark.parametrize("percent", [150.0, -5.0, 0.0, math.nan, torch.tensor(150.0),
                                     torch.tensor(math.nan), torch.tensor([[50.0, 101.0]])])
def test_percentile_value_range(percent):
    counts = torch.ones(1, 16, dtype=torch.int64)
    with pytest.raises(ValueError, match="percent must be in"):
        percentile_value(counts, torch.zeros(1), torch.ones(1), percent)


@pytest.mark.parametrize("percentile", ["99", ["99"], [99.0, "50"]])
def test_percentile_range_names_a_string(percentile):
    with pytest.raises(TypeError, match="percentile must be a number"):
        percentile_range(_hist(), percentile)


def test_entropy_numpy_integers_read_as_python_ints():
    # check_int accepts numpy integers; a numpy num_bits has no bit_length (the kernel's call)
    np = pytest.importorskip("numpy")
    from quantscope.observers import EntropyObserver
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    spec = QuantSpec("int8", "tensor")
    kw = {"start_bin": 128, "stride": 1, "num_bits": 8, "smooth": 1}
    ref, obs = EntropyObserver(spec, **kw), EntropyObserver(
        spec, **{k: np.int64(v) for k, v in kw.items()})
    assert all(type(getattr(obs, k)) is int for k in kw)
    ref(x), obs(x)
    assert torch.equal(ref.qparams().scale, obs.qparams().scale)
    c = torch.zeros(1, 256, dtype=torch.int64)
    c[0, 0], c[0, 130:200] = 10000, 5
    h = Hist(c, torch.zeros(1), torch.tensor([256.0]), True)
    assert torch.equal(entropy_amax(h, num_bits=np.int64(8), start_bin=np.int64(128)),
                       entropy_amax(h))


# ---- probe s39 (argument types): counts past their range, truthy strings, numpy options
def _h256():
    c = torch.zeros(1, 256, dtype=torch.int64)
    c[0, 0], c[0, 130:200] = 10000, 5
    return Hist(c, torch.zeros(1), torch.tensor([256.0]), True)


@pytest.mark.parametrize("name", ["stride", "smooth", "start_bin"])
def test_entropy_counts_past_int32_are_refused(name):
    # stride 2 ** 64 wrapped to 0 in the kernel's int64: a SIGFPE killed the process
    from quantscope.observers import EntropyObserver

    with pytest.raises(ValueError, match=rf"{name} must be an integer in \[\d+, 2147483647\]"):
        EntropyObserver(QuantSpec("int8", "tensor"), **{name: 2**64})
    with pytest.raises(ValueError, match=rf"{name} must be an integer in"):
        entropy_amax(_h256(), **{name: 2**64})


@pytest.mark.parametrize("call", [
    lambda: entropy_amax(_h256(), trim="no"),
    lambda: entropy_amax(_h256(), unsigned="no"),
    lambda: entropy_amax(_h256(), unsigned=None),
    lambda: percentile_range(_hist(), 99.0, symmetric="no"),
])
def test_truthy_strings_are_not_flags(call):
    with pytest.raises(ValueError, match="must be True or False"):
        call()


def test_mse_search_and_mix_flags_are_bools():
    from quantscope.estimators import mix_range

    x = _units()
    with pytest.raises(ValueError, match="early_stop must be True or False"):
        mse_search(x, x.amin(-1), x.amax(-1), QuantSpec("int4", "channel"), early_stop="no")
    with pytest.raises(ValueError, match="return_choice must be True or False"):
        mix_range(_hist(), QuantSpec("int8", "tensor"), return_choice="no")


@pytest.mark.parametrize("kw,said", [({"candidates": True}, "candidates must be an integer"),
                                     ({"candidates": 10**400}, "candidates must be an integer"),
                                     ({"min_factor": None}, r"min_factor must be a number in"),
                                     ({"min_factor": 1.0}, r"min_factor must be a number in")])
def test_dense_search_options(kw, said):
    from quantscope.estimators import dense_search

    x = _units()
    with pytest.raises(ValueError, match=said):
        dense_search(x, x.amin(-1), x.amax(-1), QuantSpec("int4", "channel"), **kw)


def test_polish_and_bins_counts():
    np = pytest.importorskip("numpy")
    from quantscope.observers import EntropyObserver, L2HistogramObserver

    spec = QuantSpec("int8", "channel")
    with pytest.raises(ValueError, match="polish must be an integer >= 0, got True"):
        L2HistogramObserver(spec, polish=True)
    assert type(L2HistogramObserver(spec, polish=np.int64(3)).polish) is int
    with pytest.raises(ValueError, match=r"bins must be an integer in \[16, 2147483647\]"):
        EntropyObserver(spec, bins=10**400)


def test_qparams_from_range_check_finite_and_huge_ends():
    from quantscope.qparams import qparams_from_range

    spec = QuantSpec("int8", "tensor")
    for off in (0, None):
        with pytest.raises(ValueError, match="check_finite must be True or False"):
            qparams_from_range(math.nan, 1.0, spec, check_finite=off)
    with pytest.raises(TypeError, match="lo must be a tensor or a real number"):
        qparams_from_range(-10**400, 1.0, spec)


def test_global_grid_is_bounded():
    # 2 ** 64 global amaxes were listed in memory before any search (the process was killed)
    from quantscope.observers import get_observer
    from quantscope.presets import NVFP4

    with pytest.raises(ValueError, match=r"global_grid must be an integer in \[1, 65536\]"):
        get_observer("nvfp4_expanded_mse", NVFP4, global_grid=2**64)


def test_percentile_value_refuses_a_zero_tensor_percent():
    counts = torch.ones(1, 16, dtype=torch.int64)
    with pytest.raises(ValueError, match="percent must be in"):
        percentile_value(counts, torch.zeros(1), torch.ones(1), torch.tensor(0.0))


def test_horizon_entropy_reads_numpy_integers():
    np = pytest.importorskip("numpy")
    from quantscope.estimators.entropy import horizon_entropy_amax

    h = _h256()
    assert torch.equal(horizon_entropy_amax(h, num_bits=np.int64(8), start_bin=np.int64(128),
                                            stride=np.int64(1), smooth=np.int64(9)),
                       horizon_entropy_amax(h))


def test_percentile_range_takes_numpy_percentiles():
    # (reviewer) the string check refused an ndarray torch.as_tensor had taken
    np = pytest.importorskip("numpy")
    want = percentile_range(_hist(), [99.0, 99.9])
    got = percentile_range(_hist(), np.array([99.0, 99.9]))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
