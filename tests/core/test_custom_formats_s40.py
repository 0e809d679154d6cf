"""Probe s40: a custom float format went to the ops by its name, which the ops look up again:
off the CPU (and in the MSE ops engine) an unknown name raised, and a custom format bearing a
built-in one's name (e3m2 values called "fp4_e2m1") was priced and exported as the built-in."""

import pytest
import torch

from quantscope import QuantSpec
from quantscope.estimators.mse import mse_search
from quantscope.formats import FP4_E2M1, FloatFormat, get_format, named
from quantscope.layout import Block
from quantscope.qparams import qparams_from_range

CUSTOM = FloatFormat("my_e3m3", 3, 3, 30.0)
IMPOSTOR = FloatFormat("fp4_e2m1", 3, 2, 28.0)  # fp6 e3m2's grid under fp4's name


def test_named_is_the_registry_reading_the_name_back():
    assert named(FP4_E2M1) and named(get_format("int4")) and named(get_format("uint8"))
    assert not named(CUSTOM) and not named(IMPOSTOR)


@pytest.mark.parametrize("fmt", [CUSTOM, IMPOSTOR])
@pytest.mark.parametrize("scale,size", [("e8m0:floor", 32), ("fp8_e4m3", 16)])
def test_block_qparams_off_the_cpu_use_the_specs_own_format(fmt, scale, size):
    # meta dispatches as CUDA does (the ops); the CPU runs the C kernel on the format's fields
    spec = QuantSpec(fmt, Block(size), scale=scale)
    lo, hi = -torch.rand(8) * 10, torch.rand(8) * 10
    cpu = qparams_from_range(lo, hi, spec)
    meta = qparams_from_range(lo.to("meta"), hi.to("meta"), spec, check_finite=False)
    assert meta.scale.shape == cpu.scale.shape and meta.scale.dtype == cpu.scale.dtype


@pytest.mark.parametrize("fmt", [CUSTOM, IMPOSTOR])
@pytest.mark.parametrize("scale,size", [("e8m0:floor", 32), ("fp8_e4m3", 16)])
def test_the_ops_engine_searches_the_specs_own_format(fmt, scale, size):
    torch.manual_seed(0)
    units = torch.randn(64, size)
    spec = QuantSpec(fmt, Block(size), scale=scale)
    lo, hi = units.amin(1), units.amax(1)
    torch_path = mse_search(units, lo, hi, spec, backend="torch")
    ops = mse_search(units, lo, hi, spec, backend="ops")
    assert torch.equal(ops.lo, torch_path.lo) and torch.equal(ops.hi, torch_path.hi)
    assert torch.equal(ops.error, torch_path.error)


def test_compressed_tensors_refuses_a_custom_format_bearing_fp4s_name():
    from quantscope.exporters.compressed_tensors import _element_args

    assert _element_args(QuantSpec(FP4_E2M1, Block(16), scale="fp8_e4m3"), "l", "weight") == {
        "num_bits": 4, "type": "float"}
    with pytest.raises(ValueError, match="element format fp4_e2m1"):
        _element_args(QuantSpec(IMPOSTOR, Block(16), scale="fp8_e4m3"), "l", "weight")
