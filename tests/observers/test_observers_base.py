"""The observer API: forward / calculate_qparams / reset, state, devices, dtypes, bad input, registry."""

from __future__ import annotations

import io
import math
import warnings

import pytest
import torch

import quantscope
from quantscope import Channel, Group, QuantSpec, Tensor, Tile, Token, presets
from quantscope.observers import Observer, register
from quantscope.observers.registry import observer_class

FAMILIES = {"memoryless_minmax": {}, "static_minmax": {}, "minmax": {"averaging_constant": 0.3}}
SPECS = [
    QuantSpec("int8", Tensor()),
    QuantSpec("int8", Channel(0), symmetric=False),
    QuantSpec("uint8", Channel(1)),
    QuantSpec("int4", Group(8), symmetric=False),
    QuantSpec("int8", Token()),
    QuantSpec("int8", Tile(3, 5)),
    presets.MXFP4,
    presets.NVFP4,
    presets.BFP16,
]
IDS = ["tensor", "channel0", "channel1", "group8", "token", "tile", "mxfp4", "nvfp4", "bfp16"]


def make(name, spec, **kw):
    return quantscope.get_observer(name, spec, **FAMILIES.get(name, {}), **kw)


def batches(n=3, shape=(4, 6, 16), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) * (i + 1) for i in range(n)]


def same_qparams(a, b):
    assert torch.equal(a.scale, b.scale) and torch.equal(a.zero_point, b.zero_point)
    assert (a.global_scale is None) == (b.global_scale is None)
    if a.global_scale is not None:
        assert torch.equal(a.global_scale, b.global_scale)


# ------------------------------------------------------------------ the module API
def test_forward_returns_input_and_works_as_hook():
    obs = make("static_minmax", QuantSpec("int8", Channel(-1)))
    x = torch.randn(3, 5)
    assert obs(x) is x
    lin = torch.nn.Linear(5, 7)
    obs.reset()
    lin.register_forward_hook(lambda m, i, o: obs(o))  # returns o: the output is unchanged
    y = lin(x)
    assert torch.equal(obs.calculate_range()[1], y.detach().amax(0))
    assert isinstance(obs, torch.nn.Module) and isinstance(obs, Observer)


def test_forward_does_not_track_gradients():
    obs = make("static_minmax", QuantSpec())
    x = torch.randn(4, 4, requires_grad=True)
    obs(x)
    assert not obs.min_vals.requires_grad
    (x * 2).sum().backward()  # the graph is untouched


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@pytest.mark.parametrize("name", FAMILIES)
def test_qparams_shaped_for_layout(name, spec):
    obs = make(name, spec)
    x = batches(1)[0]
    obs(x)
    qp = obs.calculate_qparams()
    shape = spec.layout.qparam_shape(x.shape)
    assert qp.scale.shape == shape and qp.zero_point.shape == shape
    assert qp.scale.dtype == torch.float32 and qp.zero_point.dtype == torch.int32
    assert (qp.global_scale is not None) == spec.scale.has_global_scale


def test_reset_forgets_everything():
    obs = make("static_minmax", QuantSpec("int8", Channel(0)))
    obs(torch.randn(4, 3))
    obs.reset()
    assert not obs.has_observed and int(obs.observed_tokens) == 0
    with pytest.raises(ValueError, match="before any tensor"):
        obs.calculate_qparams()
    obs(torch.randn(7, 3))  # a new unit count is fine after reset
    assert obs.calculate_qparams().scale.shape == (7, 1)


def test_observed_tokens_counts_rows():
    obs = make("memoryless_minmax", QuantSpec())
    obs(torch.randn(2, 5, 8))
    assert int(obs.observed_tokens) == 10
    obs(torch.randn(3, 8))
    assert int(obs.observed_tokens) == 13
    obs(torch.randn(8))  # a 1-D tensor is one row
    obs(torch.tensor(2.0))  # a scalar too
    assert int(obs.observed_tokens) == 15
    obs(torch.empty(0, 8))  # empty: nothing
    assert int(obs.observed_tokens) == 15
    assert obs.observed_tokens.dtype == torch.int64


# -------------------------------------------------------------------- state
@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@pytest.mark.parametrize("name", FAMILIES)
def test_state_dict_round_trip_exact(name, spec):
    xs = batches(4)
    a = make(name, spec)
    for x in xs[:2]:
        a(x)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = make(name, spec)  # fresh: sized buffers are still empty
    b.load_state_dict(torch.load(buf))
    assert b.shape == a.shape and int(b.observed_tokens) == int(a.observed_tokens)
    same_qparams(a.calculate_qparams(), b.calculate_qparams())
    for x in xs[2:]:  # and both continue identically
        a(x)
        b(x)
    same_qparams(a.calculate_qparams(), b.calculate_qparams())
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k


def test_state_dict_of_fresh_observer_loads_as_unobserved():
    a = make("static_minmax", QuantSpec("int8", Channel(0)))
    b = make("static_minmax", QuantSpec("int8", Channel(0)))
    b(torch.randn(3, 3))
    b.load_state_dict(a.state_dict())
    assert not b.has_observed


def test_state_dict_keys_are_buffers_only():
    obs = make("minmax", QuantSpec("int8", Channel(0)))
    obs(torch.randn(3, 4))
    keys = set(obs.state_dict())
    assert {"min_vals", "max_vals", "observed_tokens", "observed_shape"} <= keys
    assert all(isinstance(v, torch.Tensor) for v in obs.state_dict().values())


def test_scalar_tensor_round_trip():
    a = make("static_minmax", QuantSpec())
    a(torch.tensor(-3.0))
    b = make("static_minmax", QuantSpec())
    b.load_state_dict(a.state_dict())
    assert b.shape == () and b.has_observed
    same_qparams(a.calculate_qparams(), b.calculate_qparams())


def devices():
    out = ["cpu", "meta"]
    if torch.cuda.is_available():
        out.append("cuda")
    return out


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("name", FAMILIES)
def test_to_device_moves_state(name, device):
    spec = QuantSpec("int8", Group(8))
    obs = make(name, spec)
    x = batches(1)[0]
    obs(x)
    obs.to(device)
    assert all(b.device.type == device for b in obs.buffers())
    obs(x.to(device))  # observing on the new device works (meta: no data, no host sync)
    assert all(b.device.type == device for b in obs.buffers())
    if device != "meta":
        qp = obs.calculate_qparams()
        assert qp.scale.device.type == device
        ref = make(name, spec)
        ref(x)
        ref(x)
        same_qparams(qp.to("cpu"), ref.calculate_qparams())


def test_fresh_observer_on_meta_observes_meta():
    obs = make("minmax", presets.NVFP4).to("meta")
    obs(torch.empty(8, 64, device="meta"))
    obs(torch.empty(8, 64, device="meta"))
    assert obs.min_vals.shape == (32,) and obs.min_vals.is_meta


# ------------------------------------------------------------------ dtypes
@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_equal_float32(name, spec, dtype):
    xs = [x.to(dtype) for x in batches(3)]
    lo_p, hi_p = make(name, spec), make(name, spec)
    for x in xs:
        lo_p(x)
        hi_p(x.float())  # the same values held in float32
    assert lo_p.min_vals.dtype == torch.float32
    same_qparams(lo_p.calculate_qparams(), hi_p.calculate_qparams())


def test_float64_input_is_observed_in_float32():
    obs = make("static_minmax", QuantSpec())
    obs(torch.tensor([1.0, -2.0], dtype=torch.float64))
    assert obs.min_vals.dtype == torch.float32 and obs.min_vals.item() == -2.0


@pytest.mark.parametrize("name", ["static_minmax", "memoryless_mse", "histogram", "percentile"])
@pytest.mark.parametrize("non_finite", ["error", "ignore"])
def test_float64_values_past_float32_are_refused_not_read_as_inf(name, non_finite):
    """They turned inf in float32: 'observed NaN or inf' for finite input, and ignore mode
    dropped them as if NaN / inf (the range of the rest, a warning about NaN / inf)."""
    x = torch.randn(8, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x[3, 3] = 1e300
    obs = make(name, QuantSpec(), non_finite=non_finite)
    with pytest.raises(ValueError, match=r"float64 values beyond float32's range .* 1e\+300"):
        obs(x)
    assert not obs.has_observed
    x[3, 3] = math.inf  # inf itself is non-finite input, as before
    obs(x)
    assert obs.has_observed


@pytest.mark.parametrize("beside", [None, math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("big", [1e300, -1e300, 3.5e38])
def test_the_float64_range_check_sees_past_nan_and_inf(big, beside):
    """The check's one-pass range (aminmax: NaN propagates) leaves NaN and inf to the exact
    check, which still finds a finite value past float32's range beside them."""
    from quantscope._checks import check_float32_range

    x = torch.randn(4, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x[1, 2] = big
    if beside is not None:
        x[2, 5] = beside
    with pytest.raises(ValueError, match=r"float64 values beyond float32's range"):
        check_float32_range("t", x)
    x[1, 2] = torch.finfo(torch.float32).max  # float32's own max is held
    check_float32_range("t", x)


# --------------------------------------------------------------- no host sync
# the forbid_host_sync fixture lives in conftest.py (the MSE and histogram tests use it too)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@pytest.mark.parametrize("name", [*FAMILIES, "placeholder"])
@pytest.mark.parametrize("non_finite", ["error", "ignore"])
def test_no_host_sync_in_forward(name, spec, non_finite, forbid_host_sync, monkeypatch):
    xs = batches(3, shape=(32, 48, 48))  # large enough for the compiled kernel path
    xs[1][0, 0, 0] = float("nan")
    obs = make(name, spec, non_finite=non_finite)
    forbid_host_sync()
    for x in xs:
        assert obs(x) is x
    monkeypatch.undo()
    # the same on the meta device, where any data-dependent read fails in torch itself
    meta = make(name, spec, non_finite=non_finite).to("meta")
    for x in xs:
        meta(x.to("meta"))


# ------------------------------------------------------------------- bad input
def test_calculate_before_observe():
    obs = make("minmax", QuantSpec())
    with pytest.raises(ValueError, match=r"MovingAverageMinMaxObserver.*before any tensor"):
        obs.calculate_qparams()


@pytest.mark.parametrize("x", [torch.arange(6), torch.ones(3, dtype=torch.bool),
                               torch.ones(3, dtype=torch.complex64),
                               torch.ones(2, dtype=torch.uint8)])
def test_non_float_input_is_type_error(x):
    obs = make("static_minmax", QuantSpec())
    with pytest.raises(TypeError, match=str(x.dtype).removeprefix("torch.")):
        obs(x)
    assert not obs.has_observed


def test_non_tensor_is_type_error():
    with pytest.raises(TypeError, match="list"):
        make("static_minmax", QuantSpec())([1.0, 2.0])


def test_empty_tensor_is_skipped():
    obs = make("static_minmax", QuantSpec("int8", Channel(0)))
    e = torch.empty(0, 5)
    assert obs(e) is e and not obs.has_observed
    obs(torch.randn(3, 5))
    before = {k: v.clone() for k, v in obs.state_dict().items()}
    obs(torch.empty(3, 0))
    assert all(torch.equal(v, obs.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("spec,shape,words", [
    (QuantSpec("int8", Channel(2)), (4, 6), ["Channel", "axis 2", "(4, 6)"]),
    (QuantSpec("int8", Channel(-3)), (4, 6), ["Channel", "axis -3", "(4, 6)"]),
    (QuantSpec("int4", Group(128)), (4, 100), ["Group", "128", "100", "(4, 100)"]),
    (QuantSpec("int4", Group(16, axis=0)), (20, 32), ["Group", "16", "20", "(20, 32)"]),
    (QuantSpec("int8", Tile(2, 2)), (5,), ["Tile", "(5,)"]),
])
def test_layout_mismatch_names_layout_and_shape(spec, shape, words):
    obs = make("memoryless_minmax", spec)
    with pytest.raises(ValueError) as e:
        obs(torch.randn(shape))
    for w in [*words, "MemorylessMinMaxObserver"]:
        assert w in str(e.value), (w, str(e.value))


def test_g_idx_length_mismatch():
    g = torch.arange(8) // 4
    obs = make("static_minmax", QuantSpec("int4", Group(4, g_idx=g)))
    with pytest.raises(ValueError, match=r"g_idx has 8 entries.*\(3, 12\)"):
        obs(torch.randn(3, 12))


def test_unit_count_must_not_change_for_accumulating_observers():
    obs = make("static_minmax", QuantSpec("int8", Token()))
    obs(torch.randn(2, 4, 8))
    with pytest.raises(ValueError, match="unit count must not change"):
        obs(torch.randn(2, 5, 8))
    mem = make("memoryless_minmax", QuantSpec("int8", Token()))
    mem(torch.randn(2, 4, 8))
    mem(torch.randn(2, 5, 8))  # dynamic per-token: fine
    assert mem.calculate_qparams().scale.shape == (2, 5, 1)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("name", FAMILIES)
def test_non_finite_is_an_error_naming_the_observer(name, bad):
    obs = make(name, QuantSpec("int8", Channel(0)))
    x = torch.randn(4, 8)
    x[2, 3] = bad
    obs(x)  # recorded, not raised: forward does not read the device
    obs(torch.randn(4, 8))  # and it sticks, even after clean batches
    with pytest.raises(ValueError, match=rf"{type(obs).__name__}\('{name}'.*NaN or inf"):
        obs.calculate_qparams()


@pytest.mark.parametrize("name", FAMILIES)
def test_non_finite_ignore_warns_and_skips(name):
    spec = QuantSpec("int8", Channel(0), symmetric=False)
    xs = batches(2, shape=(4, 8))
    dirty = [x.clone() for x in xs]
    dirty[0][1, 2] = float("nan")
    dirty[1][3, 0] = float("inf")
    dirty[1][0, 0] = -float("inf")
    obs, ref = make(name, spec, non_finite="ignore"), make(name, spec)
    for d, x in zip(dirty, xs):
        obs(d)
        ref(torch.where(torch.isfinite(d), x, torch.zeros_like(x)))  # ignored values read as 0
    with pytest.warns(UserWarning, match="ignored 3 NaN / inf"):
        qp = obs.calculate_qparams()
    same_qparams(qp, ref.calculate_qparams())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ref.calculate_qparams()  # a clean observer does not warn


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="non_finite"):
        make("static_minmax", QuantSpec(), non_finite="skip")
    with pytest.raises(TypeError, match="QuantSpec"):
        quantscope.get_observer("static_minmax", "int8")
    with pytest.raises(ValueError, match="averaging_constant"):
        quantscope.get_observer("minmax", QuantSpec(), averaging_constant=0)


# ------------------------------------------------------------------- registry
def test_registry_native_names():
    names = quantscope.list_observers()
    for n in ("memoryless_minmax", "static_minmax", "minmax", "placeholder"):
        assert n in names
    assert type(quantscope.get_observer("MinMax", QuantSpec())).__name__ == \
        "MovingAverageMinMaxObserver"
    assert quantscope.get_observer("static_minmax").spec == QuantSpec()
    obs = quantscope.get_observer("minmax", QuantSpec(), averaging_constant=0.5)
    assert obs.averaging_constant == 0.5


def test_registry_prefixes_and_errors():
    for prefix, cls in [("llmcompressor", "llmcompressor:minmax"),
                        ("quark", "quark:PerBlockMXObserver"),
                        ("horizon", "horizon:MinMaxObserver"),
                        ("torch.ao", "torch.ao:PerChannelMinMaxObserver")]:
        listed = quantscope.list_observers(prefix)
        assert cls in listed and all(n.startswith(prefix + ":") for n in listed)
    obs = quantscope.get_observer("torch.ao:PerChannelMinMaxObserver", ch_axis=1)
    assert obs.spec.layout == Channel(1)
    with pytest.raises(ValueError, match="compat class"):
        quantscope.get_observer("torch.ao:MinMaxObserver", QuantSpec())
    with pytest.raises(ValueError, match=r"unknown observer 'nope'.*static_minmax"):
        quantscope.get_observer("nope", QuantSpec())


def test_register_refuses_a_taken_name():
    with pytest.raises(ValueError, match="taken"):
        @register("static_minmax")
        class Other(Observer):
            pass
    assert observer_class("static_minmax").__name__ == "StaticMinMaxObserver"


def test_the_sync_guard_catches_a_sync(forbid_host_sync):
    obs = make("static_minmax", QuantSpec())
    obs(torch.randn(4))
    forbid_host_sync()
    with pytest.raises(AssertionError, match="host sync"):
        obs.calculate_qparams()  # reads the NaN flag: a sync, allowed here but caught
