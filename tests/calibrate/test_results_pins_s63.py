"""Pins from the s63 mutation round over ``calibration/results`` (apply, save / load):
behaviour no earlier test held, each checked against its definition."""

import pytest
import torch
from torch import nn

from quantscope import QuantSpec, qparams_from_range
from quantscope.calibration import calibrate
from quantscope.calibration.results.apply import apply
from quantscope.calibration.results.io import TENSORS, load
from quantscope.calibration.results.role_state import RoleState
from quantscope.layout import Tensor


def test_an_applied_output_role_keeps_a_bfloat16_modules_dtype_and_values():
    """``qdq_tensor`` returns ``x`` fake-quantized in ``x``'s dtype: the output hook of a
    bfloat16 module must hand the next layer bfloat16 (a float32 output would make its
    matmul fail), holding ``(clamp(round(y / s) + z, qmin, qmax) - z) * s``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)).to(torch.bfloat16)
    spec = QuantSpec("int8", Tensor())
    qp = qparams_from_range(torch.tensor([-0.25]), torch.tensor([0.25]), spec)
    state = RoleState(spec, "minmax", "minmax", qparams=qp)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = model[0](x)
        with apply(model, {"0": {"output": state}}):
            first, last = model[0](x), model(x)
    s, z = qp.scale.float(), qp.zero_point.float()
    codes = ((ref.float() / s).round() + z).clamp(spec.qmin, spec.qmax)
    assert first.dtype == torch.bfloat16 and last.dtype == torch.bfloat16
    assert torch.equal(first, ((codes - z) * s).to(torch.bfloat16))
    assert bool((ref.float().abs() > 0.25).any())  # some outputs were clipped


def _weight_state(w: torch.Tensor) -> RoleState:
    spec = QuantSpec("int8", Tensor())
    amax = w.detach().abs().max().reshape(1)
    return RoleState(spec, "minmax", "minmax", qparams=qparams_from_range(-amax, amax, spec),
                     shape=tuple(w.shape))


def test_apply_refuses_two_weights_sharing_only_one_element():
    """Two Parameters over slices of one tensor whose spans meet in a single element (the
    last of one is the first of the other) overlap: QDQ in place would quantize that value
    twice, so apply refuses them, as any overlap (spans are inclusive: ``extent`` is the
    storage index of the last element)."""
    base = torch.randn(31)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[0].weight = nn.Parameter(base[0:16].view(4, 4))
    model[1].weight = nn.Parameter(base[15:31].view(4, 4))
    states = {str(k): {"weight": _weight_state(model[k].weight)} for k in range(2)}
    before = base.clone()
    with pytest.raises(ValueError, match=r"0\.weight and 1\.weight share some of their values"):
        apply(model, states)
    assert torch.equal(base, before)


def _saved(tmp_path):
    """A w8a8 calibration of a small MLP, saved to ``tmp_path / "calib"``: its path."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    calibration = calibrate(model, [torch.randn(4, 8)], "w8a8", progress=False)
    return calibration.save(tmp_path / "calib")


def _edit_tensors(tmp_path, edit):
    from safetensors.torch import load_file, save_file

    file = tmp_path / "calib" / TENSORS
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def test_a_weight_row_of_zeros_saves_and_loads_its_empty_range(tmp_path):
    """A range is ``lo <= hi`` (load's check): an all-zero weight row has ``lo == hi == 0``,
    a valid range that load must take back (a strict check refused a calibration save had
    just written)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    with torch.no_grad():
        model[0].weight[3] = 0.0
    calibration = calibrate(model, [torch.randn(4, 8)], "w8a8", progress=False)
    st = load(calibration.save(tmp_path / "calib")).states["0"]["weight"]
    assert float(st.lo.flatten()[3]) == 0.0 == float(st.hi.flatten()[3])


def test_load_refuses_zero_points_shaped_otherwise_than_their_scales(tmp_path):
    """Each scale has its zero point: zero points ``[1, 8]`` beside scales ``[8, 1]`` would
    broadcast into an ``[8, 8]`` grid of qparams, so load refuses the shape."""
    path = _saved(tmp_path)

    def transpose_zero_points(tensors):
        key = "0/weight/zero_point"
        tensors[key] = tensors[key].reshape(1, 8).contiguous()

    _edit_tensors(tmp_path, transpose_zero_points)
    with pytest.raises(ValueError, match=r"0/weight/zero_point: shape \(1, 8\) differs from the "
                                         r"scale's \(8, 1\)"):
        load(path)


def test_load_refuses_a_local_roles_global_amax_of_two_values(tmp_path):
    """NVFP4's input (``dynamic="local"``) stores one whole-tensor amax, its global scale's:
    two values (an edit) are refused, not broadcast over the tensor."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    calibration = calibrate(model, [torch.randn(4, 32)], "nvfp4", progress=False)
    assert calibration.states["0"]["input"].dynamic == "local"
    path = calibration.save(tmp_path / "calib")

    def two_values(tensors):
        tensors["0/input/global_amax"] = tensors["0/input/global_amax"].reshape(1).repeat(2)

    _edit_tensors(tmp_path, two_values)
    with pytest.raises(ValueError, match=r"0/input/global_amax: expected one value, got 2"):
        load(path)
