"""Pins of the observer parts that a mutation round (s65) found unpinned: ``observe_many``'s
checks of its pairs and its routing of a ``TypeError`` to ``on_error``; the ``imatrix_mse``
observer's defaults, its ``norm`` check, its float32 importance, the error norm of its
search and a Conv1D's input dim given as ``-2``; the state record (sorted keys, the type of
its ``order`` entry, a record saved before its ``absolute`` entry, a zero size in
``observed_shape``, an unobserved state of another layout); the run-time qparams (a
memoryless min-max with options, an MX block holding inf, an empty input, a non-tensor
input, nested 3-D sequences); the overflow error of a compat moving average with
``expand``; the EMA window's two buffers; and the scaled estimate of subnormal-only
histograms (both ends scaled back, one common factor under a global scale). Each test
fails on a small defect of its source that the earlier tests let through."""

from __future__ import annotations

import json

import pytest
import torch

import quantscope as qs
from quantscope import QuantSpec, presets
from quantscope.layout import Channel
from quantscope.observers import get_observer, observe_many, observer_class
from quantscope.observers.record import RECORD

# ---- observe_many: its pairs and its errors -------------------------------------------------

def test_observe_many_refuses_a_triple_as_a_pair():
    """A pair is two things, an observer and a tensor: a third is a ``TypeError`` naming it."""
    o = get_observer("memoryless_minmax")
    with pytest.raises(TypeError, match=r"pairs\[0\] must be an \(Observer, tensor\) pair"):
        observe_many([(o, torch.zeros(2, 3), None)])
    assert not o.has_observed


def test_observe_many_refuses_a_pair_without_an_observer():
    """An observer's name in place of the observer is the pairs' ``TypeError``, not an
    ``AttributeError`` from deep inside."""
    with pytest.raises(TypeError, match=r"pairs\[1\] must be an \(Observer, tensor\) pair"):
        observe_many([(get_observer("minmax"), torch.ones(2, 3)),
                      ("minmax", torch.ones(2, 3))])


class _TypeErrorOnObserve(observer_class("memoryless_mse")):
    """An observer whose forward raises a ``TypeError`` after its input passed the checks."""

    def forward(self, x):
        raise TypeError("refused while observing")


def test_on_error_takes_a_type_error_raised_while_observing():
    """``on_error`` takes a ``TypeError`` of observing a pair as it takes a ``ValueError``;
    the other pairs are observed."""
    bad, good = _TypeErrorOnObserve(), get_observer("memoryless_minmax")
    errors = []
    observe_many([(bad, torch.ones(2, 3)), (good, torch.ones(2, 3))],
                 on_error=lambda i, e: errors.append((i, type(e), str(e))))
    assert errors == [(0, TypeError, "refused while observing")]
    assert good.has_observed
    with pytest.raises(TypeError, match="refused while observing"):
        observe_many([(_TypeErrorOnObserve(), torch.ones(2, 3))])


# ---- imatrix_mse ------------------------------------------------------------------------

def test_imatrix_defaults_are_norm_2_over_factors_1_to_0_81():
    """The docs' grid (benchmarks: "norm 2, factors 1.00 .. 0.81"): ``1 - i / 100`` for
    ``i < 0.2 * 100``, error exponent 2; the range is the last weight's (memoryless)."""
    o = get_observer("imatrix_mse", QuantSpec("int8", Channel(0)))
    assert o.memoryless
    assert o.factors == [1 - i / 100 for i in range(20)]
    assert o.norm == 2.0


@pytest.mark.parametrize("kwargs", [{"norm": 0.0}, {"norm": -1.0}, {"input_dim": 1.5},
                                    {"input_dim": "0"}, {"input_dim": True}])
def test_imatrix_refuses_a_bad_norm_or_input_dim(kwargs):
    """``norm`` is a positive exponent and ``input_dim`` an integer dim: anything else is a
    ``ValueError`` at construction, not a wrong search later."""
    with pytest.raises(ValueError, match="norm|input_dim"):
        get_observer("imatrix_mse", QuantSpec("int8", Channel(0)), **kwargs)


def test_imatrix_importance_is_kept_as_float32():
    """A float64 importance is stored as float32, the state's dtype."""
    o = get_observer("imatrix_mse", QuantSpec("int8", Channel(0)),
                     importance=torch.ones(4, dtype=torch.float64))
    assert o.importance.dtype == torch.float32
    assert torch.equal(o.importance, torch.ones(4))


def test_imatrix_input_dim_minus_2_is_input_dim_0():
    """A Conv1D weight ``[in, out]``: ``input_dim=-2`` names the same dim as ``0``, so the
    same range, and the importance of another length is refused as for ``0``."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(6, 5, generator=g)
    imp = torch.rand(6, generator=g) * torch.tensor([9.0, 0.01, 3.0, 0.01, 1.0, 0.2])
    spec = QuantSpec("int4", Channel(1))
    a = get_observer("imatrix_mse", spec, importance=imp, input_dim=0)
    b = get_observer("imatrix_mse", spec, importance=imp, input_dim=-2)
    a(w)
    b(w)
    assert torch.equal(a.min_vals, b.min_vals) and torch.equal(a.max_vals, b.max_vals)
    with pytest.raises(ValueError, match="importance has 6 values"):
        b(torch.randn(5, 6))


def _weighted_error(w, imp, lo, hi, spec, norm):
    """Per unit (rows of a ``Channel(0)`` weight): sum over columns of imp * |qdq - w|^p."""
    qp = qs.qparams_from_range(lo, hi, spec)
    err = (qs.fake_quantize(w, qp.reshape(-1, 1), spec) - w).abs() ** norm
    return (err * imp).sum(1)


@pytest.mark.parametrize("norm", [1.0, 4.0])
def test_imatrix_search_prices_with_its_norm(norm):
    """Each row's range is its min / max times the candidate factor of least
    importance-weighted error under the observer's ``norm`` (brute force over its
    candidates; the rows' choices differ between norms 1, 2 and 4)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(8, 32, generator=g) * torch.linspace(0.5, 2, 32)
    w[:, 3] *= 4  # one large column per row: the norms disagree on clipping it
    imp = torch.rand(32, generator=g) + 0.05
    spec = QuantSpec("int4", Channel(0))
    o = get_observer("imatrix_mse", spec, importance=imp, norm=norm)
    o(w)
    lo, hi = w.amin(1), w.amax(1)
    errors = torch.stack([_weighted_error(w, imp, lo * p, hi * p, spec, norm)
                          for p in o.factors])
    best = torch.tensor(o.factors)[errors.argmin(0)]
    torch.testing.assert_close(o.min_vals, lo * best, rtol=1e-6, atol=0)
    torch.testing.assert_close(o.max_vals, hi * best, rtol=1e-6, atol=0)


# ---- the state record -------------------------------------------------------------------

def _record_tensor(rec: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(rec).encode()), dtype=torch.uint8)


def _saved_percentile(spec=None, **kw):
    o = get_observer("percentile", QuantSpec("int8") if spec is None else spec, bins=256, **kw)
    o(torch.randn(8, 64, generator=torch.Generator().manual_seed(0)))
    return o


def test_equal_records_encode_to_the_same_bytes_in_any_key_order():
    """A record's bytes are its JSON with sorted keys: a state's bytes do not depend on the
    order its entries were written in."""
    from quantscope.observers import record

    a = record.encode({"layout": "tensor", "absolute": True, "ema": False})
    b = record.encode({"ema": False, "absolute": True, "layout": "tensor"})
    assert torch.equal(a, b) and a.dtype == torch.uint8
    assert bytes(a.tolist()) == b'{"absolute": true, "ema": false, "layout": "tensor"}'


@pytest.mark.parametrize("value", [3, None, ["0", "1"]])
def test_a_record_order_entry_of_another_type_is_no_record(value):
    """``order`` (an act-order state's column order) is a string: an entry of another type
    is refused as no record, not compared as a value."""
    state = _saved_percentile().state_dict()
    rec = {**json.loads(bytes(state[RECORD].tolist())), "order": value}
    with pytest.raises(ValueError, match=r"PercentileObserver.*_extra_state is no record"):
        get_observer("percentile", QuantSpec("int8"), bins=256).load_state_dict(
            {**state, RECORD: _record_tensor(rec)})


def test_a_record_saved_before_its_absolute_entry_loads_as_then():
    """A histogram record without ``absolute`` (saved before the entry) loads into a
    symmetric observer (``|x|``) as into an asymmetric one: the entry is not assumed."""
    for symmetric in (True, False):
        spec = QuantSpec("int8", symmetric=symmetric)
        src = _saved_percentile(spec)
        state = src.state_dict()
        rec = json.loads(bytes(state[RECORD].tolist()))
        assert rec.pop("absolute") is symmetric
        back = get_observer("percentile", spec, bins=256)
        back.load_state_dict({**state, RECORD: _record_tensor(rec)})
        assert all(torch.equal(g, w) for g, w in zip(back.calculate_range(),
                                                      src.calculate_range()))


def _units_state(shape, **buffers):
    state = {"observed_tokens": torch.tensor(1), "observed_shape": torch.tensor(shape)}
    return {**state, **buffers}


def test_check_units_takes_a_zero_size():
    """``observed_shape`` is one size >= 0 per dimension: a size of 0 is a shape (zero
    units of ``Channel(0)``, empty statistics), not refused as no tensor shape."""
    from quantscope.observers import record

    empty = torch.zeros(0)
    record.check_units(_units_state([0, 4], min_vals=empty, max_vals=empty), "", Channel(0),
                       ("min_vals", "max_vals"), "Obs")
    with pytest.raises(ValueError, match=r"observed_shape \[-1, 4\] is no tensor shape"):
        record.check_units(_units_state([-1, 4]), "", Channel(0), ("min_vals",), "Obs")


def test_an_unobserved_state_loads_under_another_layout():
    """A state that observed nothing means nothing of its layout's units: it loads into an
    observer of another layout, which then observes as a fresh one."""
    src = get_observer("minmax", QuantSpec("int8", Channel(0)))
    into, fresh = (get_observer("minmax", QuantSpec("int8")) for _ in range(2))
    into.load_state_dict(src.state_dict())
    x = torch.randn(3, 8)
    into(x)
    fresh(x)
    assert torch.equal(into.min_vals, fresh.min_vals) and torch.equal(into.max_vals,
                                                                      fresh.max_vals)


# ---- run-time qparams -------------------------------------------------------------------

def _role(spec, dynamic=True, observer="memoryless_minmax", options=(), **kw):
    from quantscope.calibration.results.role_state import RoleState

    return RoleState(spec, observer, observer, dynamic, options, **kw)


def test_a_run_time_role_with_observer_options_runs_its_observer():
    """``memoryless_minmax`` with options (``non_finite='ignore'``) is its observer's range,
    not the plain per-token min / max: a token holding NaN keeps a finite scale from its
    finite values (those quantize as a fresh observer's qparams say)."""
    from quantscope.observers.runtime import runtime_qparams

    x = torch.tensor([[1.0, -2.0, float("nan"), 0.5], [0.25, 4.0, -1.0, 3.0]])
    ignoring = _role(presets.INT8_PER_TOKEN, options=(("non_finite", "ignore"),))
    qp = runtime_qparams(x, ignoring)
    # the finite values' ranges: (-2, 1) and (-1, 4)
    want = qs.qparams_from_range(torch.tensor([-2.0, -1.0]), torch.tensor([1.0, 4.0]),
                                 presets.INT8_PER_TOKEN)
    assert torch.equal(qp.scale.flatten(), want.scale)
    plain = runtime_qparams(x, _role(presets.INT8_PER_TOKEN))
    assert torch.isnan(plain.scale.flatten()[0]) and plain.scale.flatten()[1] == want.scale[1]


def test_an_mx_block_holding_inf_keeps_a_finite_scale():
    """Block formats keep their scale rules at run time: an MXFP8 block holding inf gets a
    finite (saturating) scale, not the NaN a per-token scale gets; the other block's scale
    is its own range's."""
    from quantscope.observers.runtime import runtime_qparams

    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 32, generator=g)
    x[0, 3] = float("inf")
    qp = runtime_qparams(x, _role(presets.MXFP8))
    assert bool(torch.isfinite(qp.scale).all())
    want = qs.qparams_from_range(x[1].min().reshape(1), x[1].max().reshape(1), presets.MXFP8)
    assert torch.equal(qp.scale.flatten()[1:], want.scale.flatten())


@pytest.mark.parametrize("dynamic, spec, options", [
    (True, presets.INT8_PER_TOKEN, ()),
    (True, presets.INT8_PER_TOKEN, (("non_finite", "ignore"),)),
    (True, presets.MXFP8, ()),
])
def test_an_empty_tensor_passes_through_a_run_time_role(dynamic, spec, options):
    """An MoE expert no token was routed to: its empty input passes through unchanged (a
    run-time observer would see no value to take a range from)."""
    from quantscope.observers.runtime import qdq_tensor

    x = torch.zeros(0, 64)
    assert qdq_tensor(x, _role(spec, dynamic=dynamic, options=options)) is x


def test_qdq_tensor_refuses_an_x_that_is_no_tensor():
    """``x`` must be a tensor: a ``TypeError`` naming it, not an ``AttributeError`` from
    inside."""
    from quantscope.observers.runtime import qdq_tensor

    with pytest.raises(TypeError, match="qdq_tensor: x must be a torch.Tensor, got list"):
        qdq_tensor([[1.0, 2.0]], _role(presets.INT8_PER_TOKEN))


def test_a_nested_batch_of_3d_sequences_quantizes_per_token():
    """A nested tensor of ``[B_i, L_i, C]`` components: each token quantized with its own
    per-token qparams, the components' shapes kept."""
    from quantscope.observers.runtime import qdq_tensor

    g = torch.Generator().manual_seed(3)
    parts = [torch.randn(2, 3, 8, generator=g), torch.randn(1, 5, 8, generator=g)]
    state = _role(presets.INT8_PER_TOKEN)
    got = qdq_tensor(torch.nested.as_nested_tensor(parts), state).unbind()
    assert [t.shape for t in got] == [t.shape for t in parts]
    for g_, p in zip(got, parts, strict=True):
        assert torch.equal(g_, qdq_tensor(p, state))


# ---- range overflow ---------------------------------------------------------------------

def _overflow(observer, lo, hi):
    from quantscope.observers.overflow import range_overflow

    return range_overflow(observer, torch.tensor(lo), torch.tensor(hi))


def test_nan_in_a_compat_moving_average_with_expand_names_both_causes():
    """A cause that joins the moving average's to another (compat ``expand``) still names
    the moving average's NaN (``inf - inf``) for a range holding NaN."""
    from quantscope.observers.overflow import EMA_OVERFLOW

    o = get_observer("mse", QuantSpec("int8"), expand=1.5, compat="llmcompressor")
    assert EMA_OVERFLOW in o.overflow_cause and o.overflow_cause != EMA_OVERFLOW
    e = _overflow(o, [float("nan")], [1.0])
    assert isinstance(e, ValueError)
    assert "holds NaN though no NaN / inf was observed" in str(e) and "expand=1.5" in str(e)


# ---- the histogram EMA ------------------------------------------------------------------

def test_a_state_with_half_of_the_window_is_refused():
    """The window's two buffers go together: a state with ``window_lo`` alone misses
    ``window_hi`` (a strict load's error), not both made empty."""
    o = get_observer("percentile", QuantSpec("int8"), bins=256, averaging_constant=0.5,
                     update_interval=2)
    o(torch.randn(2, 256, generator=torch.Generator().manual_seed(4)))
    state = {k: v for k, v in o.state_dict().items() if k != "window_hi"}
    with pytest.raises(RuntimeError, match="Missing key.*window_hi"):
        get_observer("percentile", QuantSpec("int8"), bins=256, averaging_constant=0.5,
                     update_interval=2).load_state_dict(state)


# ---- the scaled estimate of subnormal histograms ----------------------------------------

@pytest.mark.parametrize("spec", [QuantSpec("int8", symmetric=False),
                                  QuantSpec("int8", Channel(0), symmetric=False)], ids=str)
@pytest.mark.parametrize("name", ["percentile", "histogram_mse", "entropy"])
def test_a_subnormal_first_grid_estimates_as_the_data_scaled_up(name, spec):
    """Data all subnormal (``x * 2 ** -135``) on a ``grid="first"`` histogram: the range is
    the estimate of the data scaled into the normal range, scaled back (up to the subnormal
    result's rounding), both ends; not a silent 0 nor an unscaled end."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 512, generator=g) * torch.tensor([[1.0], [0.5], [0.25], [0.8]])
    tiny, normal = (get_observer(name, spec, grid="first") for _ in range(2))
    tiny(x * 2.0 ** -135)
    normal(x)
    for got, want in zip(tiny.calculate_range(), normal.calculate_range(), strict=True):
        torch.testing.assert_close(got.double() * 2.0 ** 135, want.double(), rtol=1e-2,
                                   atol=0)


@pytest.mark.parametrize("name", ["histogram_mse", "mix"])
def test_subnormal_nvfp4_blocks_are_scaled_by_one_common_factor(name):
    """NVFP4 (a global scale over per-block scales): subnormal-only blocks of different
    magnitudes are all scaled by the largest one's factor, so the global amax the search
    prices under keeps its ratio to every block; the range is the normal data's scaled
    back."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 64, generator=g)
    x = x * torch.tensor([1.0, 0.3, 0.05, 0.6]).repeat_interleave(16)
    tiny, normal = (get_observer(name, presets.NVFP4, grid="first") for _ in range(2))
    tiny(x * 2.0 ** -128)
    normal(x)
    for got, want in zip(tiny.calculate_range(), normal.calculate_range(), strict=True):
        torch.testing.assert_close(got.double() * 2.0 ** 128, want.double(), rtol=1e-4,
                                   atol=0)
