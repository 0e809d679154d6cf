"""A saved state records what it means (layout; whether a histogram bins |x|): a state of
another meaning with as many units is a ValueError naming both, not silently wrong qparams."""

from __future__ import annotations

import io

import pytest
import torch

from quantscope import QuantSpec
from quantscope.observers import get_observer

RECORD = "_extra_state"


def _matrix():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 8, generator=g) * torch.arange(1, 9.0)  # columns of growing scale


def _observed(name, spec, x):
    obs = get_observer(name, spec)
    obs(x)
    return obs


def _state(obs):
    return {k: v.clone() for k, v in obs.state_dict().items()}


def _same_state(a, b):
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), a


def test_channel_state_of_another_axis_is_a_value_error():
    x = _matrix()
    saved = _observed("static_minmax", QuantSpec("int8", "channel:0"), x)
    other = _observed("static_minmax", QuantSpec("int8", "channel:1"), x * 2)
    before = _state(other)
    with pytest.raises(ValueError, match=r"StaticMinMaxObserver.*saved under layout "
                                         r"'channel:0'.*layout is 'channel:1'"):
        other.load_state_dict(saved.state_dict())
    _same_state(before, _state(other))  # checked before anything was copied


@pytest.mark.parametrize("saved, into", [("group:4:0", "group:4"), ("block:4:0", "block:4"),
                                         ("tile:2x4", "tile:4x2")])
def test_runs_along_another_axis_are_a_value_error_though_the_qparam_shape_agrees(saved, into):
    """On a square matrix groups down the columns have the qparam shape of groups along the
    rows, but other units: their ranges would land on the wrong values."""
    x = _matrix()
    src = _observed("static_minmax", QuantSpec("int8", saved), x)
    dst = get_observer("static_minmax", QuantSpec("int8", into))
    with pytest.raises(ValueError, match=rf"saved under layout '{saved}'.*layout is '{into}'"):
        dst.load_state_dict(src.state_dict())


@pytest.mark.parametrize("name", ["percentile", "histogram_mse", "mix"])
@pytest.mark.parametrize("saved_symmetric", [True, False])
def test_histogram_of_abs_x_into_one_of_x_is_a_value_error(name, saved_symmetric):
    x = _matrix()
    sym, asym = QuantSpec("int8"), QuantSpec("uint8", symmetric=False)
    saved = _observed(name, sym if saved_symmetric else asym, x)
    into = get_observer(name, asym if saved_symmetric else sym)
    match = r"\|x\| \(symmetric\).*of x \(asymmetric\)" if saved_symmetric else \
        r"of x \(asymmetric\).*of \|x\| \(symmetric\)"
    with pytest.raises(ValueError, match=type(into).__name__ + ".*" + match):
        into.load_state_dict(saved.state_dict())


@pytest.mark.parametrize("name, kwargs", [("percentile", {}), ("percentile", {"grid": "first"}),
                                          ("horizon:KLObserver", {})])
def test_histogram_of_other_bins_is_a_value_error(name, kwargs):
    """The bins are the constructor's: a state of other bins loaded silently went on with the
    saved bins (or crashed on the next batch, on the linear grid)."""
    spec = {} if name.startswith("horizon") else {"spec": QuantSpec("int8")}
    saved = get_observer(name, bins=512, **spec, **kwargs)
    saved(_matrix())
    into = get_observer(name, bins=1024, **spec, **kwargs)
    with pytest.raises(ValueError, match=r"histogram of 512 bins into one of bins=1024"):
        into.load_state_dict(saved.state_dict())
    fresh = get_observer(name, bins=1024, **spec, **kwargs)
    _same_state(into.state_dict(), fresh.state_dict())  # refused before anything changed
    unobserved = get_observer(name, bins=512, **spec, **kwargs)
    into.load_state_dict(unobserved.state_dict())  # an empty state has no bins to disagree


@pytest.mark.parametrize("name", ["entropy", "l2_histogram"])
def test_histogram_of_one_kind_whatever_the_symmetry_loads(name):
    """entropy bins |x| and l2_histogram x for either symmetry: a state of the other loads."""
    x = _matrix()
    saved = _observed(name, QuantSpec("int8"), x)
    into = get_observer(name, QuantSpec("uint8", symmetric=False))
    into.load_state_dict(saved.state_dict())
    want = _observed(name, QuantSpec("uint8", symmetric=False), x)
    for a, b in zip(into.range_and_qparams()[:2], want.range_and_qparams()[:2]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("saved, into", [("channel:-1", "channel:1"), ("token", "channel:0"),
                                         ("group:4", "group:4:1"), ("group:4", "block:4:1")])
def test_another_name_for_the_same_units_loads(saved, into):
    x = _matrix()
    src = _observed("static_minmax", QuantSpec("int8", saved), x)
    dst = get_observer("static_minmax", QuantSpec("int8", into))
    dst.load_state_dict(src.state_dict())
    want = _observed("static_minmax", QuantSpec("int8", into), x)
    assert torch.equal(dst.qparams().scale, want.qparams().scale)


def test_state_saved_without_the_record_loads_strictly_as_before():
    x = _matrix()
    saved = _observed("static_minmax", QuantSpec("int8", "channel:0"), x)
    old = {k: v for k, v in saved.state_dict().items() if k != RECORD}
    same = get_observer("static_minmax", QuantSpec("int8", "channel:0"))
    same.load_state_dict(old)  # strict: the missing record is no missing key
    assert torch.equal(same.qparams().scale, saved.qparams().scale)
    get_observer("static_minmax", QuantSpec("int8", "channel:1")).load_state_dict(old)


def test_record_is_a_tensor_saved_by_safetensors_and_weights_only_load():
    from safetensors.torch import load, save

    x = _matrix()
    saved = _observed("percentile", QuantSpec("int8", "channel:1"), x)
    state = saved.state_dict()
    assert state[RECORD].dtype == torch.uint8
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    for loaded in (load(save(dict(state))), torch.load(buf, weights_only=True)):
        back = get_observer("percentile", QuantSpec("int8", "channel:1"))
        back.load_state_dict(loaded)
        assert torch.equal(back.qparams().scale, saved.qparams().scale)


@pytest.mark.parametrize("name", ["static_minmax", "percentile"])
@pytest.mark.parametrize("record", [bytes([255, 0, 1]), b'{"layout": "tensor", "absolute": "no"}',
                                    b'{"layout": "tensor", "absolute": 2}', b'{"layout": 5}'])
def test_a_damaged_record_is_a_value_error_naming_the_observer(name, record):
    saved = _observed(name, QuantSpec("int8"), _matrix())
    state = saved.state_dict()
    state[RECORD] = torch.tensor(list(record), dtype=torch.uint8)
    into = get_observer(name, QuantSpec("int8"))
    with pytest.raises(ValueError, match=type(into).__name__ + r".*_extra_state is no record"):
        into.load_state_dict(state)


@pytest.mark.parametrize("name", ["static_minmax", "mse", "percentile", "entropy"])
def test_a_partial_state_of_an_observed_tensor_is_refused_even_not_strict(name):
    """strict=False loaded the rest and left a sized buffer empty: the observer then failed
    in torch (IndexError, amax of an empty tensor) naming neither it nor the buffer."""
    saved = _state(_observed(name, QuantSpec("int8", "channel:0"), _matrix()))
    sized = get_observer(name, QuantSpec("int8", "channel:0"))._sized_buffers()
    assert sized
    for lost in sized:
        fresh = get_observer(name, QuantSpec("int8", "channel:0"))
        with pytest.raises(RuntimeError, match=rf"a partial state: it observed data but lacks "
                                               rf"{lost}; load a whole state_dict"):
            fresh.load_state_dict({k: v for k, v in saved.items() if k != lost}, strict=False)
    unobserved = _state(get_observer(name, QuantSpec("int8", "channel:0")))
    fresh = get_observer(name, QuantSpec("int8", "channel:0"))
    fresh.load_state_dict({k: v for k, v in unobserved.items() if k not in sized},
                          strict=False)  # nothing observed: nothing lost
    assert not fresh.has_observed


@pytest.mark.parametrize("name", ["histogram", "histogram_mse", "mix", "percentile", "minmax"])
@pytest.mark.parametrize("key", ["hist_exp", "hist_first", "hist_counts", "hist_lo", "min_vals"])
def test_an_observed_state_with_an_emptied_statistic_is_a_value_error(name, key):
    # accepted before (0 entries passed for any sized buffer): the histogram's C kernel then
    # read past the empty hist_exp / hist_first (a segmentation fault), others raised bare
    saved = _state(_observed(name, QuantSpec("int8"), _matrix()))
    if key not in saved:
        pytest.skip(f"{name} keeps no {key}")
    saved[key] = saved[key][:0]
    with pytest.raises(ValueError, match=rf"cannot load a state whose {key} has 0 units"):
        get_observer(name, QuantSpec("int8")).load_state_dict(saved)


def test_an_averaging_window_emptied_beside_its_other_end_is_a_value_error():
    # s57 mutants: the EMA mode's window (window_lo, window_hi) is one group: with window_lo
    # alone emptied, the load went on and the next interval's scale was 0.0109, not 0.0802
    def observer():
        return get_observer("histogram", QuantSpec("int8"), averaging_constant=0.1,
                            update_interval=4)
    obs, g = observer(), torch.Generator().manual_seed(0)
    obs(torch.randn(8, 8, generator=g) * 3)
    obs(torch.randn(8, 8, generator=g))
    saved = _state(obs)
    assert saved["window_lo"].numel() and saved["window_hi"].numel()
    saved["window_lo"] = saved["window_lo"][:0]
    with pytest.raises(ValueError, match=r"cannot load a state whose window_lo has 0 units"):
        observer().load_state_dict(saved)


@pytest.mark.parametrize(("key", "edit", "said"), [
    ("hist_exp", lambda t: t[None], r"hist_exp has shape \[1, 1\]: it holds 1 dimension"),
    ("hist_counts", lambda t: t[:, None], r"hist_counts has shape \[1, 1, \d+\]: it holds 2 "),
    ("observed_shape", lambda t: t[None], r"observed_shape \[\[8, 8\]\] is no tensor shape"),
    ("observed_shape", lambda t: -t - 1, r"observed_shape \[-9, -9\] is no tensor shape"),
    ("observed_shape", lambda t: t + 0.5, r"observed_shape \[8.5, 8.5\] is no tensor shape"),
])
def test_a_statistic_of_another_rank_is_a_value_error(key, edit, said):
    saved = _state(_observed("histogram", QuantSpec("int8"), _matrix()))
    saved[key] = edit(saved[key])
    with pytest.raises(ValueError, match=said):
        get_observer("histogram", QuantSpec("int8")).load_state_dict(saved)


@pytest.mark.parametrize("name", ["histogram", "mse", "memoryless_minmax", "static_minmax"])
def test_a_whole_state_still_loads_with_its_empty_optional_statistics(name):
    spec = QuantSpec("int8", "channel:0")
    saved = _observed(name, spec, _matrix())
    fresh = get_observer(name, spec)
    fresh.load_state_dict(_state(saved))
    _same_state(_state(fresh), _state(saved))
