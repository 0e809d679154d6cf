"""Block scales outside what their encoding stores (probe s15/safety).

* An MXFP4 weight scale of 2**-149 (a power of two, but below E8M0's 2**-127) loaded, ran,
  and exported as the E8M0 byte 234 (2**107): load now refuses it, and export refuses any
  block scale its encoding cannot store rather than let compressed-tensors wrap or round it.
* NVFP4 block scales that are no e4m3 value (x1.01) or above 448 (x1000) loaded and ran;
  export wrote them rounded / saturated. quantscope stores the e4m3 block scale itself
  (``encode(amax / 6 * global)``, ``min_scale`` where that is 0, an e4m3 value too), so load
  refuses any other value.
* An NVFP4 ``input_global_scale`` of 1e-38 read as a global amax of inf (save wrote what load
  refused): the reader now refuses it, naming the tensor and the value.
"""

import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from safetensors.torch import load_file, save_file
from tiny_models import llama

from quantscope.calibration import Calibration, calibrate, load
from quantscope.scales import ScaleEncoding, not_encoded

torch.set_num_threads(1)

Q = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def calibrated():
    model, batches = llama()
    return model, {r: calibrate(model, batches, r, progress=False) for r in ("mxfp4", "nvfp4")}


def _edit_saved(cal, tmp_path, key, fn):
    path = tmp_path / "cal"
    cal.save(path)
    f = path / "qparams.safetensors"
    t = load_file(f)
    t[key] = fn(t[key].clone())
    save_file(t, f)
    return path


@pytest.mark.parametrize("value", [2.0 ** -149, 2.0 ** -128])
def test_e8m0_judges_the_exponent_range(value):
    e8m0 = ScaleEncoding("e8m0", "floor")
    ok = torch.tensor([2.0 ** -127, 1.0, 2.0 ** 127])
    assert not not_encoded(ok, e8m0).any()
    assert not_encoded(torch.tensor([value]), e8m0).all()
    assert not not_encoded(torch.tensor([value]), ScaleEncoding("pow2", "floor")).any()


def test_fp8_block_scales_are_judged():
    fp8 = ScaleEncoding("fp8_e4m3")
    ok = torch.tensor([2.0 ** -9, 0.125, 160.0, 448.0])  # subnormal, eps, normal, max
    assert not not_encoded(ok, fp8).any()
    assert not_encoded(torch.tensor([161.6, 160000.0, 2.0 ** -11]), fp8).all()


@pytest.mark.parametrize("value", [2.0 ** -149, 2.0 ** -128])
def test_load_refuses_an_e8m0_scale_outside_its_range(calibrated, tmp_path, value):
    _, cals = calibrated
    key = f"{Q}/weight/scale"
    path = _edit_saved(cals["mxfp4"], tmp_path, key, lambda t: torch.full_like(t, value))
    with pytest.raises(ValueError, match=rf"{key}: holds {value!r}, a value its e8m0:\w+ "
                                         rf"encoding cannot store"):
        load(path)


@pytest.mark.parametrize("factor", [1.01, 1000.0])
def test_load_refuses_an_nvfp4_block_scale_that_is_no_e4m3_value(calibrated, tmp_path, factor):
    _, cals = calibrated
    key = f"{Q}/weight/scale"
    path = _edit_saved(cals["nvfp4"], tmp_path, key, lambda t: t * factor)
    with pytest.raises(ValueError, match=rf"{key}: holds [\d.e+]+, a value its fp8_e4m3 "
                                         rf"encoding cannot store"):
        load(path)


def test_a_saved_nvfp4_calibration_still_loads_and_applies_alike(calibrated, tmp_path):
    model, cals = calibrated
    cals["nvfp4"].save(tmp_path / "cal")
    back = load(tmp_path / "cal")
    assert torch.equal(back.states[Q]["weight"].qparams.scale,
                       cals["nvfp4"].states[Q]["weight"].qparams.scale)
    ids = torch.arange(8).reshape(1, 8)
    with torch.no_grad():
        with cals["nvfp4"].apply(model):
            want = model(input_ids=ids).logits
        with back.apply(model):
            assert torch.equal(model(input_ids=ids).logits, want)


def _edited_in_memory(cal, value_fn):
    """A copy of ``cal`` whose q_proj weight scales are ``value_fn(scale)`` (load refuses
    such a folder: only an in-memory calibration reaches export with them)."""
    import copy
    import dataclasses

    cal = copy.deepcopy(cal)
    st = cal.states[Q]["weight"]
    qp = dataclasses.replace(st.qparams, scale=value_fn(st.qparams.scale))
    cal.states[Q]["weight"] = dataclasses.replace(st, qparams=qp)
    return cal


@pytest.mark.parametrize(("recipe", "value_fn", "shown"), [
    ("mxfp4", lambda s: torch.full_like(s, 2.0 ** -149), repr(2.0 ** -149)),
    ("nvfp4", lambda s: torch.full_like(s, 161.6), "161.6"),
    ("nvfp4", lambda s: torch.full_like(s, 160000.0), "160000.0"),
    ("nvfp4", lambda s: torch.zeros_like(s), "0.0"),  # e4m3 values, but no scale
    ("nvfp4", lambda s: torch.full_like(s, -0.5), "-0.5"),
])
def test_export_refuses_a_block_scale_it_would_write_as_another(calibrated, tmp_path, recipe,
                                                                value_fn, shown):
    model, cals = calibrated
    cal = _edited_in_memory(cals[recipe], value_fn)
    out = tmp_path / "ct"
    with pytest.raises(ValueError, match=rf"layer '{Q}' weight_scale holds {shown}\d*, a value "
                                         rf"its \w+(:\w+)? encoding cannot store"):
        # allow_lossy: MXFP4's floor-rule activations; it never covers a scale written as another
        cal.export(model, out, allow_lossy=True)
    assert not out.exists()


def _nvfp4_export_with_input_global_scale(calibrated, out, value: float) -> str:
    """The NVFP4 export with q_proj's ``input_global_scale`` edited to ``value``; its key."""
    model, cals = calibrated
    cals["nvfp4"].export(model, out)
    key = f"{Q}.input_global_scale"
    (f,) = out.glob("*.safetensors")
    t = load_file(f)
    t[key] = torch.full_like(t[key], value)
    save_file(t, f, metadata={"format": "pt"})
    return key


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_read_refuses_an_nvfp4_global_scale_whose_amax_is_inf(calibrated, tmp_path):
    key = _nvfp4_export_with_input_global_scale(calibrated, tmp_path / "ct", 1e-38)
    with pytest.raises(ValueError, match=rf"{key} = 9\.99\d*e-39 gives an amax of inf"):
        Calibration.from_compressed_tensors(tmp_path / "ct")


def test_read_keeps_the_smallest_global_scale_with_a_finite_amax(calibrated, tmp_path):
    _nvfp4_export_with_input_global_scale(calibrated, tmp_path / "ct",
                                          448 * 6 / torch.finfo(torch.float32).max)
    amax = Calibration.from_compressed_tensors(tmp_path / "ct").states[Q]["input"].global_amax
    assert math.isfinite(float(amax))
