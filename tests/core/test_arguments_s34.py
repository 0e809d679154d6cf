"""Argument checks of probe s34: a str is no bool flag (``bool("no")`` is True), numpy
scalars are numbers, a bool is no integer, and a wrong-type argument is a ``TypeError``
naming the call and the argument (not torch's ``new(): invalid data type 'str'``)."""

from __future__ import annotations

import math
import pathlib

import numpy as np
import pytest
import torch
from torch import nn

import quantscope as q
from quantscope import comm
from quantscope import observers as o
from quantscope.estimators.mse import linear_search, mse_search
from quantscope.exporters.atomic import atomic_file, check_writable_target

SPEC = q.QuantSpec("int8")
NOT_BOOLS = ["no", 0, 1, None]


@pytest.fixture(scope="module")
def small():
    """A two-Linear model and its w8a8 calibration."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)).eval()
    batches = [torch.randn(8, 32) for _ in range(2)]
    return model, batches, q.calibrate(model, batches, "w8a8", progress=False)


# 1. a non-bool flag is refused before anything is written

@pytest.mark.parametrize("flag", NOT_BOOLS)
def test_check_writable_target_refuses_a_non_bool_overwrite(tmp_path, flag):
    with pytest.raises(ValueError, match=r"overwrite must be True or False"):
        check_writable_target(tmp_path / "new", overwrite=flag)
    for ok in (True, False, np.bool_(False)):
        assert check_writable_target(tmp_path / "new", overwrite=ok) == str(tmp_path / "new")


def test_atomic_file_keeps_the_file_on_a_str_overwrite(tmp_path):
    path = tmp_path / "report.txt"
    path.write_text("earlier")
    with pytest.raises(ValueError, match=r"overwrite must be True or False, got 'no'"), \
            atomic_file(path, overwrite="no") as tmp:
        pathlib.Path(tmp).write_text("later")
    assert path.read_text() == "earlier"


def test_save_refuses_a_str_overwrite_and_keeps_the_calibration(small, tmp_path):
    _, _, calib = small
    path = tmp_path / "cal"
    calib.save(path)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    for flag in NOT_BOOLS:
        with pytest.raises(ValueError, match=r"save: overwrite must be True or False"):
            calib.save(path, overwrite=flag)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before


def test_save_checks_overwrite_on_every_rank(small, tmp_path, monkeypatch):
    monkeypatch.setattr(comm, "is_main", lambda: False)  # a rank that writes nothing
    with pytest.raises(ValueError, match=r"save: overwrite must be True or False"):
        small[2].save(tmp_path / "cal", overwrite="no")


def _onnx():
    pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")


def test_onnx_export_refuses_a_str_overwrite_and_keeps_the_file(small, tmp_path):
    _onnx()
    model, batches, calib = small
    path = tmp_path / "m.onnx"
    q.export(calib, model, path, format="onnx", example_inputs=batches[0])
    before = path.read_bytes()
    with pytest.raises(ValueError, match=r"onnx export: overwrite must be True or False"):
        q.export(calib, model, path, format="onnx", example_inputs=batches[0], overwrite="no")
    assert path.read_bytes() == before


@pytest.mark.parametrize("flag", NOT_BOOLS)
def test_onnx_export_refuses_a_non_bool_uint8_before_writing(small, tmp_path, flag):
    _onnx()
    model, batches, calib = small
    path = tmp_path / "u.onnx"
    with pytest.raises(ValueError, match=r"onnx export: uint8 must be True or False"):
        q.export(calib, model, path, format="onnx", example_inputs=batches[0], uint8=flag)
    assert not path.exists()


def test_onnx_flags_are_checked_on_every_rank(small, tmp_path, monkeypatch):
    _onnx()
    model, batches, calib = small
    monkeypatch.setattr(comm, "is_main", lambda: False)
    for flag in ("overwrite", "uint8"):
        with pytest.raises(ValueError, match=rf"onnx export: {flag} must be True or False"):
            q.export(calib, model, tmp_path / "m.onnx", format="onnx",
                     example_inputs=batches[0], **{flag: "no"})


@pytest.mark.parametrize("flag", ["overwrite", "allow_lossy"])
def test_compressed_tensors_export_refuses_a_str_flag_before_writing(tmp_path, flag):
    pytest.importorskip("compressed_tensors")
    pytest.importorskip("transformers")
    from tiny_models import llama

    model, batches = llama()
    calib = q.calibrate(model, batches, q.calibrate.preset("w8a8", ignore=["lm_head"]),
                        progress=False)
    with pytest.raises(ValueError,
                       match=rf"export compressed-tensors: {flag} must be True or False"):
        q.export(calib, model, tmp_path / "ct", **{flag: "no"})
    assert not (tmp_path / "ct").exists()


# 2. numpy scalars are numbers, kept as Python ones

def test_int_format_takes_numpy_bits_as_a_python_int():
    for bits in (np.int64(8), np.int32(4)):
        fmt = q.IntFormat(bits)
        assert type(fmt.bits) is int and fmt == q.IntFormat(int(bits))
        assert (fmt.qmin, fmt.qmax) == (-(2 ** (int(bits) - 1)), 2 ** (int(bits) - 1) - 1)


def test_float_format_takes_numpy_fields_and_rounds_as_torch_e4m3():
    fmt = q.FloatFormat("e4m3", np.int64(4), np.int32(3), np.float32(448.0))
    assert (type(fmt.ebits), type(fmt.mbits), type(fmt.max)) == (int, int, float)
    assert fmt == q.FloatFormat("e4m3", 4, 3, 448.0)
    x = torch.linspace(-500, 500, 4001)
    ref = x.clamp(-448, 448).to(torch.float8_e4m3fn).float()  # the peer: torch's cast
    assert torch.equal(fmt.round(x), ref)
    with pytest.raises(ValueError, match=r"FloatFormat.ebits must be an integer"):
        q.FloatFormat("x", np.float32(4), 3, 448.0)


@pytest.mark.parametrize("name", ["moving_average_minmax", "mse", "linear_mse", "histogram"])
def test_averaging_constant_takes_a_numpy_float(name):
    obs = o.get_observer(name, SPEC, averaging_constant=np.float32(0.5))
    assert type(obs.averaging_constant) is float and obs.averaging_constant == 0.5
    with pytest.raises(ValueError, match=r"averaging_constant.* must be a finite number in "
                                         r"\(0, 1\], got 1.5"):
        o.get_observer(name, SPEC, averaging_constant=1.5)


def test_moving_average_with_a_numpy_constant_is_the_ema():
    obs = o.get_observer("moving_average_minmax", SPEC, averaging_constant=np.float32(0.5))
    obs(torch.tensor([[-2.0, 4.0]]))
    obs(torch.tensor([[-4.0, 2.0]]))
    lo, hi = obs.calculate_range()  # state + c * (batch - state), c = 0.5
    assert (lo.item(), hi.item()) == (-2 + 0.5 * (-4 + 2), 4 + 0.5 * (2 - 4))


def test_histogram_keeps_bins_and_update_interval_as_python_ints():
    obs = o.get_observer("histogram", SPEC, bins=np.int64(64), update_interval=np.int64(2),
                         averaging_constant=0.25)
    assert (type(obs.bins), type(obs.update_interval)) == (int, int)
    assert (obs.bins, obs.update_interval) == (64, 2)
    assert "bins=64," in repr(obs)


def test_mse_search_takes_numpy_patience_and_expand_as_python_values():
    units = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    ref = mse_search(units, None, None, SPEC, patience=5, expand=1.5)
    got = mse_search(units, None, None, SPEC, patience=np.int64(5), expand=np.float32(1.5))
    assert torch.equal(got.lo, ref.lo) and torch.equal(got.hi, ref.hi)
    ranges = []
    for patience, expand in ((5, 1.5), (np.int64(5), np.float32(1.5))):
        obs = o.get_observer("memoryless_mse", SPEC, patience=patience, expand=expand)
        obs(units)
        ranges.append(obs.calculate_range())
    assert all(torch.equal(a, b) for a, b in zip(*ranges))


def test_compat_patience_takes_a_numpy_float_as_the_next_integer():
    # llm-compressor stops once no_improve >= patience: 4.5 acts as 5
    units = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    ref = mse_search(units, None, None, SPEC, patience=5, compat="llmcompressor")
    got = mse_search(units, None, None, SPEC, patience=np.float32(4.5), compat="llmcompressor")
    assert torch.equal(got.lo, ref.lo) and torch.equal(got.hi, ref.hi)


# 3. a bool is no integer

@pytest.mark.parametrize("name", ["memoryless_mse", "mse"])
def test_patience_refuses_a_bool(name):
    with pytest.raises(ValueError, match=r"patience .*must be an integer >= 1, got True"):
        o.get_observer(name, SPEC, patience=True)
    o.get_observer(name, SPEC, patience=None)  # None: try every candidate


def test_compat_patience_refuses_a_bool():
    units = torch.randn(4, 32)
    with pytest.raises(ValueError, match=r"patience .*must be an integer >= 1, got True"):
        mse_search(units, None, None, SPEC, patience=True, compat="llmcompressor")


def test_linear_stride_refuses_a_bool_and_takes_numpy():
    o.get_observer("linear_mse", SPEC, stride=1)  # validated once: True (== 1) is checked too
    with pytest.raises(ValueError, match=r"stride must be an integer in \[1, 94\], got True"):
        o.get_observer("linear_mse", SPEC, stride=True)
    units = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    ref = linear_search(units, None, None, SPEC, stride=2)
    got = linear_search(units, None, None, SPEC, stride=np.int64(2))
    assert torch.equal(got.hi, ref.hi)
    with pytest.raises(ValueError, match=r"stride must be an integer in \[1, 94\], got 95"):
        linear_search(units, None, None, SPEC, stride=95)


# 4. list_observers' prefix

@pytest.mark.parametrize("prefix", [3, b"torch.ao", ["torch.ao"]])
def test_list_observers_refuses_a_non_str_prefix(prefix):
    with pytest.raises(TypeError, match=r"list_observers: prefix must be a str .*or None"):
        q.list_observers(prefix)


def test_list_observers_prefix_keeps_one_toolkit():
    names = q.list_observers("torch.ao")
    assert names and all(n.startswith("torch.ao:") for n in names)
    assert set(names) == {n for n in q.list_observers() if n.startswith("torch.ao:")}


# 5. tensor arguments torch cannot convert

@pytest.mark.parametrize("lo, hi, name", [("a", 1.0, "lo"), (None, 1.0, "lo"),
                                          (-1.0, None, "hi"), (-1.0, "b", "hi")])
def test_qparams_from_range_names_a_wrong_type_bound(lo, hi, name):
    with pytest.raises(TypeError, match=rf"qparams_from_range: {name} must be a tensor or a "
                                        rf"real number, got"):
        q.qparams_from_range(lo, hi, SPEC)


def test_qparams_from_range_still_takes_numbers():
    # symmetric int8, torch.ao's rule: amax / ((qmax - qmin) / 2)
    qp = q.qparams_from_range(-1.0, 1.0, SPEC)
    assert math.isclose(qp.scale.item(), 1.0 / 127.5, rel_tol=1e-6)
    assert qp.zero_point.item() == 0
    qp = q.qparams_from_range(np.float32(-2.0), torch.tensor(2.0), SPEC)
    assert math.isclose(qp.scale.item(), 2.0 / 127.5, rel_tol=1e-6)


def test_group_names_a_wrong_type_g_idx():
    with pytest.raises(TypeError, match=r"Group: g_idx must be a 1-D integer tensor, got str"):
        q.Group(2, g_idx="ab")
    g = q.Group(2, g_idx=[1, 0, 1, 0])  # a list converts: columns 1, 3 form group 0
    x = torch.tensor([[1.0, 10.0, 2.0, 20.0]])
    assert torch.equal(g.g_idx, torch.tensor([1, 0, 1, 0]))
    assert torch.equal(g.to_units(x), torch.tensor([[10.0, 20.0], [1.0, 2.0]]))


def test_imatrix_names_a_wrong_type_importance():
    with pytest.raises(TypeError, match=r"importance must be a tensor .*or None, got str 'x'"):
        o.get_observer("imatrix_mse", SPEC, importance="x")
    obs = o.get_observer("imatrix_mse", SPEC, importance=[1.0, 2.0])
    assert torch.equal(obs.importance, torch.tensor([1.0, 2.0]))
