"""Issue 20's defects, one regression test each: bad input gives a clear error naming the
argument, empty and absent inputs pass through, nothing turns finite input into NaN / inf.
(Row numbers are the issue's table.)"""

import os

import pytest
import torch
from saved_edits import edit_saved
from torch import nn

from quantscope import QuantSpec, presets
from quantscope.calibration import calibrate, calibrate_many, load
from quantscope.layout import Group
from quantscope.observers import get_observer
from quantscope.qdq import dequantize, fake_quantize, quantize
from quantscope.qparams import qparams_from_range


def _lin(d=32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, d))


# 1, 6, 12, 17, 19: options validated where they enter --------------------------------
@pytest.mark.parametrize(("name", "options", "arg"), [
    ("entropy", {"start_bin": -5}, "start_bin"),                        # 1 (a segfault in C)
    ("kl", {"start_bin": -1}, "start_bin"),
    ("histogram_mse", {"start_bin": -5}, "start_bin"),
    ("entropy", {"num_bits": 31}, "num_bits"),                          # 6 (a hang)
    ("entropy", {"num_bits": 64}, "num_bits"),                          # 6 (silently min-max)
    ("entropy", {"num_bits": 1}, "num_bits"),
    ("memoryless_mse", {"grid": 1e9}, "grid"),                          # 6 (a hang)
    ("memoryless_mse", {"grid": float("inf")}, "grid"),
    ("memoryless_mse", {"expand": float("nan")}, "expand"),
    ("histogram", {"dst_nbins": 0}, "dst_nbins"),                       # 12
    ("histogram", {"dst_nbins": -1}, "dst_nbins"),
    ("entropy", {"smooth": -3}, "smooth"),                              # 12
    ("entropy", {"stride": 0}, "stride"),
    ("pow2_mse", {"span": 10000}, "span"),                              # 17 (OverflowError)
    ("mix", {"start_bin": -2}, "start_bin"),
])
def test_bad_options_rejected_at_construction(name, options, arg):
    with pytest.raises(ValueError, match=arg):
        get_observer(name, QuantSpec(), **options)


def test_estimator_entry_points_validate_too():
    from quantscope.estimators import entropy_divergences
    with pytest.raises(ValueError, match="start_bin"):
        entropy_divergences(torch.ones(1, 256, dtype=torch.int64), start_bin=-5)


def test_get_observer_none_is_a_type_error():  # 17
    with pytest.raises(TypeError, match="name"):
        get_observer(None)


def test_group_g_idx_negative():  # 17
    with pytest.raises(ValueError, match="g_idx"):
        Group(2, g_idx=torch.tensor([-1, -1, 0, 0]))


@pytest.mark.parametrize("changes", [{"quant_min": True}, {"quant_max": 1.5},
                                     {"eps": float("inf")}, {"eps": float("nan")},
                                     {"eps": True}])
def test_quantspec_field_types(changes):  # 19
    with pytest.raises(ValueError, match="QuantSpec"):
        QuantSpec(**changes)


def test_histogram_memory_bound():  # 17: block:8 on 1024 x 4096 asked for 8.6 GB
    o = get_observer("histogram", QuantSpec(layout="block:8"))
    with pytest.raises(ValueError, match="GiB"):
        o(torch.zeros(1024, 4096))


# 9, 10: no silent inf -----------------------------------------------------------------
def test_nvfp4_global_amax_inf_rejected():  # 9
    one = torch.ones(4)
    with pytest.raises(ValueError, match="global_amax"):
        qparams_from_range(-one, one, presets.NVFP4, global_amax=torch.tensor(float("inf")))


def test_nvfp4_global_scale_never_zero():  # 9: a search's overflowing amax candidate
    from quantscope.scales import nvfp4_global_scale
    gs = nvfp4_global_scale(torch.tensor(float("inf")), presets.NVFP4.format)
    assert float(gs) > 0
    qp = qparams_from_range(-one_e38(), one_e38(), presets.NVFP4, check_finite=False,
                            global_amax=torch.tensor(float("inf")))
    assert torch.isfinite(qp.effective_scale).all()
    x = torch.tensor([3e38, -1.0] * 8)
    o = get_observer("memoryless_mse", presets.NVFP4)
    o(x)
    assert torch.isfinite(fake_quantize(x, o.calculate_qparams(), o.spec)).all()


def one_e38():
    return torch.full((4,), 3e38)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("observer", ["static_minmax", "minmax", "memoryless_minmax"])
def test_symmetric_int_saturates_at_dtype_max(dtype, observer):  # 10
    big = torch.finfo(dtype).max
    x = torch.tensor([-big, 1.0, big], dtype=dtype)
    o = get_observer(observer, QuantSpec())
    o(x)
    qp = o.calculate_qparams()
    out = fake_quantize(x, qp, o.spec)
    assert torch.isfinite(out).all()
    assert float(out[0]) == -big  # code -128 saturates at the dtype's max
    back = dequantize(quantize(x, qp, o.spec), qp, o.spec, dtype=dtype)
    assert torch.isfinite(back).all()


# 4, 5, 15: histograms ------------------------------------------------------------------
@pytest.mark.parametrize("value", [1e9, -1e9, 3e7, -3e7])
def test_torch_ao_histogram_constant_huge(value):  # 4: torch.ao gives (3921568.75, 0) at 1e9
    from torch.ao.quantization import HistogramObserver
    ref = HistogramObserver()
    ref(torch.full((16,), value))
    o = get_observer("torch.ao:HistogramObserver")
    o(torch.full((16,), value))
    scale, zp = o.calculate_qparams()
    rs, rz = ref.calculate_qparams()
    assert torch.equal(scale, rs) and torch.equal(zp.int(), rz.int())


def test_quark_histogram_constant_huge():  # 4
    from quantscope.compat.quark import PerTensorHistogramObserverPro
    o = PerTensorHistogramObserverPro({"dtype": "int8", "qscheme": "per_tensor",
                                       "symmetric": True, "round_method": "half_even"})
    o(torch.full((16,), -1e9))
    scale, _ = o.calculate_qparams()
    assert torch.isfinite(scale).all() and (scale > 0).all()


@pytest.mark.parametrize("first", [[1.0, float("inf"), 2.0], [float("-inf"), 0.0],
                                   [float("nan"), 1.0]])
def test_compat_histogram_non_finite_first_batch(first):  # 5: as torch.ao (issue 34)
    from torch.ao.quantization import HistogramObserver
    ref, o = HistogramObserver(), get_observer("torch.ao:HistogramObserver")
    x = torch.tensor(first)
    if x.isnan().any():  # NaN: torch's histc refuses the range in forward
        for obs in (ref, o):
            with pytest.raises(RuntimeError, match="not finite"):
                obs(x)
        return
    for obs in (ref, o):  # inf: dropped with a warning
        with pytest.warns(UserWarning, match="torch.inf detected"):
            obs(x)
    assert torch.equal(o.histogram, ref.histogram) and torch.equal(o.min_val, ref.min_val)
    for a, b in zip(o.calculate_qparams(), ref.calculate_qparams()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["histogram", "percentile", "mix", "entropy"])
def test_histogram_huge_finite_input_message(name):  # 15
    o = get_observer(name, QuantSpec())
    o(torch.tensor([1e38, -1e38, 1.0]))
    try:
        lo, hi = o.calculate_range()
    except ValueError as e:
        assert "2**126" in str(e)
    else:
        assert torch.isfinite(lo).all() and torch.isfinite(hi).all()


# 2, 3, 8, 16: model calibration ---------------------------------------------------------
PRESETS = ["w8a8", "w8a8-dynamic", "w4a16", "w4a8", "fp8", "mxfp4", "nvfp4"]


@pytest.mark.parametrize("preset", PRESETS)
def test_empty_rows_pass_through(preset):  # 2, deliverable 2
    m = nn.Sequential(nn.Linear(128, 128))
    empty = torch.empty(0, 128)
    c = calibrate(m, [torch.randn(4, 128), empty], preset, progress=False)
    with c.apply(m):
        out = m(empty)
        assert out.shape == (0, 128)
        assert torch.isfinite(m(torch.randn(3, 128))).all()


@pytest.mark.parametrize("layout", ["channel", "tile:4x4", "token", "block:8", "group:4"])
def test_fake_quantize_empty(layout):  # 17
    spec = QuantSpec(layout=layout)
    x = torch.empty(0, 8)
    n = spec.layout.num_units(x.shape)
    qp = qparams_from_range(torch.zeros(n), torch.zeros(n), spec)
    assert fake_quantize(x, qp.reshape(spec.layout.qparam_shape(x.shape)), spec).shape == x.shape


@pytest.mark.parametrize("observer", ["minmax", "static_minmax", "mse"])
def test_nvfp4_batches_of_different_token_counts(observer):  # 3
    m = _lin()
    batches = [torch.randn(4, 32), torch.randn(5, 32) * 3]
    c = calibrate(m, batches, "nvfp4", observer=observer, progress=False)
    gam = float(c.states["0"]["input"].global_amax)
    a0, a1 = (float(b.abs().max()) for b in batches)
    if observer == "static_minmax":  # the global amax covers every batch
        assert gam == max(a0, a1)
    elif observer == "minmax":  # moving averages of min and max (constant 0.01)
        (l0, l1), (h0, h1) = ([float(f(b)) for b in batches] for f in (torch.min, torch.max))
        ema = max(-(l0 + 0.01 * (l1 - l0)), h0 + 0.01 * (h1 - h0))
        assert gam == pytest.approx(ema, rel=1e-5)
    else:
        assert 0 < gam <= max(a0, a1)


class _Keyword(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(input=x)


def test_keyword_input_calibrated_and_quantized():  # 8
    torch.manual_seed(0)
    m, x = _Keyword(), torch.randn(16, 8)
    c = calibrate(m, [x], "w8a8", progress=False, missing="error")
    assert "input" in c.states["lin"]
    ref = nn.Sequential(nn.Linear(8, 8))
    ref[0].load_state_dict(m.lin.state_dict())
    c_ref = calibrate(ref, [x], "w8a8", progress=False)
    assert torch.equal(c.states["lin"]["input"].qparams.scale,
                       c_ref.states["0"]["input"].qparams.scale)
    with c.apply(m), c_ref.apply(ref):
        assert torch.equal(m(x), ref(x))  # the keyword input is QDQ'd too


def test_zero_rows_only_is_missing_not_never_called():  # 16
    m = _lin()
    with pytest.raises(ValueError, match="saw no tokens"):
        calibrate(m, [torch.empty(0, 32)], "w8a8", progress=False, missing="error")


@pytest.mark.parametrize("missing", ["skip", "float"])
def test_missing_policy(missing):  # deliverable 2: an MoE expert no token reached
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    m.forward = lambda x: m[0](x)  # the second layer is never called
    with pytest.warns(UserWarning, match="saw no tokens"):
        c = calibrate(m, [torch.randn(4, 8)], "w8a8", progress=False, missing=missing)
    assert c.info["missing"] == [{"layer": "1", "role": "input", "calls": 0,
                                  "fallback": "float layer" if missing == "float"
                                  else "input not quantized"}]
    assert ("1" in c.states) == (missing == "skip")
    if missing == "skip":
        assert list(c.states["1"]) == ["weight"]  # its weight-only scheme
    # the report says so (its input row was absent without a word)
    runs = "float layer" if missing == "float" else "input not quantized"
    assert f"| 1 | input | 0 | {runs} |" in c.report().to_markdown()


@pytest.mark.parametrize("recipe", ["w8a8", "w8a8-dynamic", "fp8-dynamic", "mxfp4"])
def test_an_embeddings_token_ids_are_no_input_role(recipe):
    """An Embedding's input is token ids: a rule's input role skips it. Dynamic recipes kept it
    and apply() failed on the ids; static ones reported it missing (missing='error' raised,
    'float' left the whole Embedding in float)."""
    import warnings

    from quantscope.calibration import Runtime, preset

    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(50, 32), nn.Linear(32, 16)).eval()
    batches = [torch.randint(0, 50, (2, 8)) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing reported missing
        c = calibrate(m, batches, preset(recipe, targets=("Linear", "Embedding")),
                      progress=False, runtime=Runtime(missing="error"))
    assert list(c.states["0"]) == ["weight"] and "input" in c.states["1"]
    ids, seen = batches[0], []
    w = c.states["0"]["weight"]
    hook = m[0].register_forward_hook(lambda mod, args, out: seen.append(out))
    with torch.no_grad(), c.apply(m):
        out = m(ids)
    hook.remove()
    assert torch.equal(seen[0], fake_quantize(m[0].weight, w.qparams, w.spec)[ids])
    assert torch.isfinite(out).all() and out.shape == (2, 8, 16)


def test_missing_policy_validated():
    with pytest.raises(ValueError, match="missing"):
        calibrate(_lin(), [torch.randn(2, 32)], "w8a8", progress=False, missing="ignore")


def test_missing_error_never_called():
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    m.forward = lambda x: m[0](x)
    with pytest.raises(ValueError, match="never called"):
        calibrate(m, [torch.randn(4, 8)], "w8a8", progress=False, missing="error")


def test_calibrate_many_missing_in_info():
    m = _lin()
    with pytest.warns(UserWarning):
        out = calibrate_many(m, [torch.empty(0, 32)], ["w8a8", "fp8"], progress=False)
    assert all(c.info["missing"][0]["calls"] == 1 for c in out.values())


# 7, 13: files ---------------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    m = _lin(16)
    c = calibrate(m, [torch.randn(4, 16)], "w8a8", progress=False)
    path = str(tmp_path / "calib")
    c.save(path)
    return path


@pytest.mark.parametrize(("meta", "tensors", "where"), [
    (lambda d: d.update(version=99), None, "version"),                         # 7
    (lambda d: d.update(version="abc"), None, "version"),
    (lambda d: d.pop("version"), None, "version"),
    (lambda d: d.pop("layers"), None, "layers"),                               # 13 KeyError
    (lambda d: d["layers"]["0"]["input"].update(dynamic="yes"), None, "dynamic"),
    (lambda d: d["layers"]["0"]["weight"].update(spec={"format": "int99"}), None, "spec"),
    (lambda d: d["layers"]["0"]["weight"].update(shape=[16, -1]), None, "shape"),
    (None, lambda t: t["0/weight/scale"].fill_(float("nan")), "0/weight/scale"),
    (None, lambda t: t["0/weight/scale"].fill_(0), "0/weight/scale"),
    (None, lambda t: t["0/input/scale"].fill_(-1), "0/input/scale"),
    (None, lambda t: t["0/input/zero_point"].fill_(1000), "0/input/zero_point"),
    (None, lambda t: t.pop("0/weight/scale"), "0/weight/scale"),               # 13
    (None, lambda t: t.update({"0/weight/scale": torch.ones(3),
                               "0/weight/zero_point": torch.zeros(3, dtype=torch.int32)}),
     "0/weight/scale"),
    (None, lambda t: t.update({"0/weight/zero_point": torch.zeros(16)}), "zero_point"),
    # probing: a per-tensor activation scale of 3 values loaded, and failed in apply()
    (None, lambda t: t.update({"0/input/scale": torch.ones(3), "0/input/zero_point":
                               torch.zeros(3, dtype=t["0/input/zero_point"].dtype)}),
     r"0/input/scale: 3 values, but Tensor\(\) has one unit"),
    # probing: a NaN / zero SmoothQuant scale loaded, and reapply() wrote NaN weights
    (None, lambda t: t.update({"#smooth/norm": torch.tensor([1.0, float("nan")])}),
     "#smooth/norm: must be finite and > 0"),
    (None, lambda t: t.update({"#smooth/norm": torch.tensor([1.0, 0.0])}), "#smooth/norm"),
    (None, lambda t: t.update({"#smooth/norm": torch.ones(2, 2)}), "#smooth/norm: expected a 1-D"),
])
def test_damaged_calibration_named(saved, meta, tensors, where):
    edit_saved(saved, meta, tensors)
    with pytest.raises(ValueError, match=where) as e:
        load(saved)
    assert saved in str(e.value)  # the file is named


def test_truncated_safetensors_named(saved):  # 13: raw SafetensorError before
    p = os.path.join(saved, "qparams.safetensors")
    with open(p, "r+b") as f:
        f.truncate(50)
    with pytest.raises(ValueError, match="qparams.safetensors"):
        load(saved)


def test_bad_json_named(saved):
    with open(os.path.join(saved, "quantscope.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="quantscope.json"):
        load(saved)


def _contents(path):
    out = {}
    for n in os.listdir(path):
        with open(os.path.join(path, n), "rb") as f:
            out[n] = f.read()
    return out


def test_save_is_atomic(saved, monkeypatch):
    before = _contents(saved)
    c = load(saved)
    import safetensors.torch

    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        c.save(saved)
    assert _contents(saved) == before  # the old calibration is intact, no temporary left beside it
    assert not [n for n in os.listdir(os.path.dirname(saved)) if n.endswith(".tmp")]


@pytest.mark.parametrize("recipe", ["w4a16", "w8a8-dynamic", "mxfp4"])
def test_a_nan_weight_is_an_error_naming_its_layer(recipe):
    # probing: the weight observer's error named no layer (an activation's does)
    m = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128)).eval()
    with torch.no_grad():
        m[2].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"calibrate: layer '2' weight: .*NaN or inf"):
        calibrate(m, [torch.randn(4, 128)], recipe, progress=False)


def test_apply_to_a_module_without_a_weight_names_it():
    # probing: a hand-edited calibration's weight role on an activation: a bare AttributeError
    import dataclasses

    m = nn.Sequential(nn.Linear(32, 32), nn.ReLU()).eval()
    c = calibrate(m, [torch.randn(4, 32)], "w8a8", progress=False)
    c.states = {"1": {"weight": dataclasses.replace(c.states["0"]["weight"], shape=None)}}
    with pytest.raises(ValueError, match=r"apply: 1 \(ReLU\) has no weight tensor"):
        c.apply(m)
