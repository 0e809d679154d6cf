"""Session 34's own fixes, read again: a dynamic role fed some non-float calls is kept (its
float calls run), apply() beside a live nested handle touching other layers is taken (only
a copy's marks are refused), numpy arrays reach torch as arrays (a reversed view too), and
ModelOpt's float bits refuse ``unsigned`` by name."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import quantscope
from quantscope import Group, QuantSpec
from quantscope.calibration import Recipe, Role, Rule, Runtime, apply
from quantscope.compat.modelopt_spec import modelopt_spec


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        return F.linear(x.float(), self.weight)


def test_a_dynamic_role_with_some_float_calls_is_kept():
    model = nn.Sequential(_Layer()).eval()
    batches = [torch.randn(4, 8), torch.randint(0, 5, (4, 8))]  # a float call, an integer one
    recipe = Recipe((Rule(("_Layer",), weight=Role(QuantSpec("int8", "channel"),
                                                   "memoryless_minmax"),
                          input=Role(QuantSpec("int8", "token"), "memoryless_minmax", True)),))
    calib = quantscope.calibrate(model, batches, recipe, runtime=Runtime(missing="error"),
                                 progress=False)
    assert set(calib.states["0"]) == {"weight", "input"}


def test_apply_beside_a_live_nested_handle_on_other_layers_is_taken():
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(8, 8))
    outer = nn.Sequential(inner, nn.Linear(8, 8)).eval()
    calib = quantscope.calibrate(outer, [torch.randn(4, 8) for _ in range(2)], "w8a8",
                                 progress=False)
    floats = {k: v.clone() for k, v in outer.state_dict().items()}
    first = apply(inner, {"0": calib.states["0.0"]})
    second = apply(outer, {"1": calib.states["1"]})  # no weight of the first reached
    second.remove()
    first.remove()
    assert all(torch.equal(v, floats[k]) for k, v in outer.state_dict().items())


def test_a_reversed_numpy_array_is_taken_as_its_values():
    g_idx = np.array([0, 0, 1, 1])[::-1]  # negative strides: torch refuses the view as is
    assert Group(2, g_idx=g_idx).g_idx.tolist() == [1, 1, 0, 0]


def test_a_wrong_type_names_torchs_reason_too():
    with pytest.raises(TypeError, match=r"g_idx must be a 1-D integer tensor, got list "
                                        r"\[None\] \(Could not infer dtype of NoneType\)"):
        Group(2, g_idx=[None])


@pytest.mark.parametrize("bits", [(4, 3), [4, 3]])
def test_modelopt_float_bits_take_no_unsigned_and_a_list_as_a_tuple(bits):
    assert str(modelopt_spec(bits).format.name) == "fp8_e4m3"
    with pytest.raises(ValueError, match="float format, which takes no unsigned=True"):
        modelopt_spec(bits, unsigned=True)
