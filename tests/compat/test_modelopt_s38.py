"""ModelOpt compat fixes (s38): ``_axis`` set to the same axis spelled otherwise keeps the
amax; qparams' entropy on fewer than 128 bins and a start_bin leaving no mse candidate are
clear errors; numpy integer options; a non-tensor at MaxCalibrator.collect; unpickled states
checked against their arguments."""

import pickle

import numpy as np
import pytest
import torch

from quantscope.compat.modelopt import HistogramCalibrator, MaxCalibrator
from quantscope.estimators.histogram_mse import histogram_mse_range
from quantscope.spec import QuantSpec


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# 1: the same axis however spelled keeps what was collected; another one starts afresh
@pytest.mark.parametrize(("axis", "again", "shape"), [
    (-1, 1, (4, 3)), (1, -1, (4, 3)), (0, (-2,), (4, 3)), ((0, 1), (1, -3), (2, 3, 5)),
    (None, (), (4, 3)), (0, (0, -1), (5,))])
def test_same_axis_spelled_otherwise_keeps_the_amax(axis, again, shape):
    x = _x(*shape)
    c = MaxCalibrator(axis=axis)
    c.collect(x)
    want = c.compute_amax()
    c._axis = again
    c.collect(x * 0.5)
    assert torch.equal(c.compute_amax(), want)
    assert c.qparams().scale.numel() == max(want.numel(), 1)


@pytest.mark.parametrize(("axis", "again", "shape"), [
    (-1, 0, (4, 3)), (1, (1, -1), (4, 3)), (None, 0, (4, 3)), (0, 5, (4, 3)), (-1, 0, (5,))])
def test_another_axis_starts_afresh(axis, again, shape):
    # (1, -1) and -1 on 1-D view the data otherwise (the layout's units do not follow)
    c = MaxCalibrator(axis=axis)
    c.collect(_x(*shape))
    c._axis = again
    assert c.compute_amax() is None and not c.has_observed


# 2: qparams() estimates by entropy from ModelOpt's start_bin=128: fewer bins, no candidate
def test_qparams_entropy_on_fewer_than_128_bins_names_the_observer_and_num_bins():
    h = HistogramCalibrator(num_bins=64)
    h.collect(_x(1000))
    assert h.compute_amax("entropy", start_bin=8) > 0  # entropy with a fitting start_bin
    assert h.compute_amax("mse", start_bin=8) > 0 and h.compute_amax("percentile") > 0
    with pytest.raises(ValueError, match=r"HistogramCalibrator.*qparams\(\).*start_bin=128.*"
                                         r"64 bins \(num_bins=64\).*num_bins >= 128"):
        h.qparams()
    h.collect(_x(1000, seed=1) * 3)  # grown past 128 bins: ModelOpt's entropy runs there too
    assert h.current_histogram().bins >= 128 and h.qparams().scale.numel() == 1


# 3: numpy integers are integers, bools are not
def test_mse_takes_numpy_integer_start_bin_and_stride():
    h = HistogramCalibrator(num_bins=64)
    h.collect(_x(1000))
    assert torch.equal(h.compute_amax("mse", start_bin=np.int64(3), stride=np.int64(2)),
                       h.compute_amax("mse", start_bin=3, stride=2))
    hist = h.current_histogram()
    for name in ("start_bin", "stride"):
        with pytest.raises(ValueError, match=f"histogram_mse: {name} must be an integer"):
            histogram_mse_range(hist, QuantSpec(), **{name: True})


# 4: mse's candidates are the centres from start_bin: none at start_bin == bins
def test_mse_start_bin_at_the_bins_is_refused_entropy_takes_it():
    h = HistogramCalibrator(num_bins=64)
    h.collect(_x(1000))
    edges = h._calib_bin_edges
    assert float(h.compute_amax("mse", start_bin=63)) == float((edges[-2] + edges[-1]) / 2)
    assert float(h.compute_amax("entropy", start_bin=64)) == float(edges[-1])
    with pytest.raises(ValueError, match=r"compute_amax\('mse'\): start_bin=64 leaves no mse "
                                         r"candidate.*num_bins=64"):
        h.compute_amax("mse", start_bin=64)
    with pytest.raises(ValueError, match=r"compute_amax\('entropy'\): start_bin=65"):
        h.compute_amax("entropy", start_bin=65)


# 5: a non-tensor is the native TypeError, not AttributeError from x.dim()
@pytest.mark.parametrize("x", [[1.0, 2.0], np.ones(3, dtype=np.float32), 3.0])
def test_max_collect_of_a_non_tensor_is_a_type_error(x):
    with pytest.raises(TypeError, match=rf"MaxCalibrator.*expected a torch.Tensor, got "
                                        rf"{type(x).__name__}"):
        MaxCalibrator().collect(x)


# 6: an unpickled state must fit its arguments, as load_state_dict's must
def _unpickled(c, **override):
    state = c.__getstate__()
    state.update(override)
    for k in [k for k, v in override.items() if v is KeyError]:
        del state[k]
    return pickle.loads(pickle.dumps(state)), type(c)


def _load(c, **override):
    state, cls = _unpickled(c, **override)
    n = cls.__new__(cls)
    n.__setstate__(state)
    return n


def _collected(axis, shape, **kw):
    c = MaxCalibrator(axis=axis, **kw)
    c.collect(_x(*shape))
    return c


@pytest.mark.parametrize(("axis", "shape", "config", "field"), [
    (0, (4, 3), (8, None, False), "min_vals"), (None, (4, 3), (8, 0, False), "min_vals"),
    (0, (4, 3), (8, 1, False), "min_vals"), ((0, 1), (2, 3, 5), (8, 0, False), "_amax_shape")])
def test_a_state_relabelled_to_another_axis_is_refused(axis, shape, config, field):
    with pytest.raises(ValueError, match=rf"MaxCalibrator.*{field}"):
        _load(_collected(axis, shape), _config=config)


@pytest.mark.parametrize(("axis", "amax_shape"), [(None, None), (None, (4, 1)), (0, (2, 2)),
                                                  (0, (4, 3)), (0, [4, 1]), (None, (1,))])
def test_an_amax_shape_out_of_step_with_the_state_is_refused(axis, amax_shape):
    with pytest.raises(ValueError, match=r"MaxCalibrator.*_amax_shape"):
        _load(_collected(axis, (4, 3)), _amax_shape=amax_shape)


def test_an_amax_shape_without_data_is_refused():
    with pytest.raises(ValueError, match=r"MaxCalibrator.*_amax_shape"):
        _load(MaxCalibrator(), _amax_shape=())


@pytest.mark.parametrize("field", ["_config", "_amax_shape", "_amaxs"])
def test_a_state_missing_a_field_names_it(field):
    c = _collected(None, (3,), track_amax=True)
    with pytest.raises(ValueError, match=rf"MaxCalibrator: cannot unpickle a state without "
                                         rf"{field}"):
        _load(c, **{field: KeyError})
    with pytest.raises(ValueError, match=r"_config is \(8, None\)"):
        _load(c, _config=(8, None))


@pytest.mark.parametrize(("axis", "shape"), [(None, (4, 3)), (0, (4, 3)), (-1, (4, 3)),
                                             ((0, 1), (2, 3, 5)), ((0, 1), (1, 1, 5))])
def test_whole_states_still_round_trip(axis, shape):
    c = _collected(axis, shape)
    for n in (pickle.loads(pickle.dumps(c)), pickle.loads(pickle.dumps(MaxCalibrator(axis=axis)))):
        assert (n.compute_amax() is None) == (not n.has_observed)
    n = pickle.loads(pickle.dumps(c))
    assert torch.equal(n.compute_amax(), c.compute_amax())
    assert torch.equal(n.qparams().scale, c.qparams().scale)
    h = HistogramCalibrator(num_bins=16)
    h.collect(_x(100))
    assert torch.equal(pickle.loads(pickle.dumps(h)).compute_amax("mse", start_bin=4),
                       h.compute_amax("mse", start_bin=4))


# 7: an axis one past the last dim is ModelOpt's own range error, not the layout's later
def test_max_collect_with_an_axis_at_the_dims_is_out_of_range():
    with pytest.raises(ValueError, match=r"modelopt MaxCalibrator: axis 2 is out of range for "
                                         r"a tensor of 2 dims"):
        MaxCalibrator(axis=2).collect(_x(4, 8))


# 8: meta data sets the dims too: the same axis spelled otherwise keeps the meta amax
def test_meta_collect_keeps_its_amax_when_the_axis_is_respelled():
    c = MaxCalibrator(axis=1)
    c.collect(torch.empty(4, 8, device="meta"))
    assert c._meta_amax is not None
    c._axis = -1
    assert c._meta_amax is not None and c._meta_amax.shape == (1, 8)


# 9: each clause of the unpickled _amax_shape check: units, int sizes, the dims collected
@pytest.mark.parametrize("override", [
    {"_amax_shape": (8, 1)},  # 8 values for 4 units
    {"_amax_shape": (4.0, 1)},  # a float size
    {"_ndim": 3},  # (4, 1) from 2-D data labelled 3-D
])
def test_an_amax_shape_failing_one_clause_is_refused(override):
    c = _collected(0, (4, 8))
    assert c._amax_shape == (4, 1) and c._ndim == 2
    with pytest.raises(ValueError, match=r"MaxCalibrator.*cannot unpickle a state whose "
                                         r"_amax_shape"):
        _load(c, **override)


# ---- probe s41: the mse candidates of small data scored with a clamped scale ----------------

@pytest.mark.parametrize("num_bits", [8, (4, 3), (5, 2)])
def test_mse_amax_is_the_same_at_any_magnitude(num_bits):
    # ModelOpt's quantizer takes amax / bound unclamped; scored with float32's eps as the
    # least scale, every candidate under bound * eps (e5m2: 6.8e-3) tied and the first bin
    # (start_bin's, clipping ~94 %) won. The data scaled by a power of two: the amax scales
    x = torch.randn(20000, generator=torch.Generator().manual_seed(0))
    amax = {}
    for k in (0, 12, 20, 30):
        cal = HistogramCalibrator(num_bits, None, False)
        cal.collect(x * 2.0 ** -k)
        amax[k] = float(cal.compute_amax("mse")) * 2.0 ** k
    assert amax[0] > 0.8 * float(x.abs().max()) / 2  # no clipping to a start bin
    assert amax[12] == pytest.approx(amax[0], rel=1e-6)
    assert amax[20] == pytest.approx(amax[0], rel=1e-6)
    # but under amax 2**-24 ModelOpt's quantizer is one degenerate one (int: all zeros; fp8:
    # amax 1): every candidate ties there, and the first (start_bin's) wins, as in ModelOpt
    assert amax[30] < amax[0] / 4
