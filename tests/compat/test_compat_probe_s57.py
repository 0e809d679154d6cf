"""Where probe s57 found the compat classes differ from their toolkits' (Quark 0.13,
llm-compressor 0.14), run in the peers' venv: Quark's percentile / MSE observers after only
empty batches (a layer, an MoE expert, that no token reached: Quark's calibration calls
``_calculate_qparams`` after every batch), Quark's exception type for a ``ch_axis`` the batch
has no dimension for, llm-compressor's qparams of statistics on the meta device."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings

import pytest
import torch

pytestmark = pytest.mark.peers

pytest.importorskip("quark")
pytest.importorskip("llmcompressor")
with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.observers import Observer as Theirs
from quark_twins import quark_twins

from quantscope.compat.llmcompressor import Observer as Ours
from quantscope.compat.quark import AxisRangeError


def _quiet(fn, *args):
    logging.disable(logging.CRITICAL)  # (Quark's zero-mass warning, through its logger)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return fn(*args)
    finally:
        logging.disable(logging.NOTSET)


@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("name", ["PerTensorPercentileObserver", "PerTensorMSEObserver"])
@pytest.mark.parametrize("dtype", ["int8", "uint8", "int4", "fp8_e4m3"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_qparams_after_empty_batches_only_are_quarks(name, dtype, symmetric):
    # Quark bins an empty batch as zeros (its nudged grid [0, bins * eps], no count) and
    # prices that grid; quantscope's raised "called before any tensor was observed"
    theirs, ours = quark_twins(name, dtype=dtype, symmetric=symmetric)
    for obs in (theirs, ours):
        _quiet(obs, torch.empty(0, 32))
        _quiet(obs, torch.empty(0))
    want, got = _quiet(theirs._calculate_qparams), _quiet(ours._calculate_qparams)
    for a, b in zip(want, got, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (want, got)
    assert torch.equal(theirs.min_val, ours.min_val) and torch.equal(theirs.max_val,
                                                                     ours.max_val)
    ours.reset()  # nothing seen again: Quark's answer before any batch
    with pytest.raises(ValueError, match="before any tensor was observed"):
        ours._calculate_qparams()


@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("name", ["PerTensorPercentileObserver", "PerTensorMSEObserver"])
@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
def test_a_module_cast_after_empty_batches_casts_quarks_grid(name, dtype):
    # re-review s57: Quark's empty batch made a grid, which .half() casts: its search and
    # pricing then run in float16; the empty-only path priced float32 edges
    theirs, ours = quark_twins(name, dtype=dtype, symmetric=True)
    for obs in (theirs, ours):
        _quiet(obs, torch.empty(0, 8))
        obs.half()
    want, got = _quiet(theirs._calculate_qparams), _quiet(ours._calculate_qparams)
    for a, b in zip(want, got, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (want, got)


@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize(("name", "kw", "x"), [
    ("PerChannelMinMaxObserver", {"qscheme": "per_channel", "ch_axis": 1}, torch.randn(8)),
    ("PerChannelMinMaxObserver", {"qscheme": "per_channel", "ch_axis": 0}, torch.tensor(1.5)),
    ("PerGroupMinMaxObserver", {"qscheme": "per_group", "ch_axis": 1, "group_size": 8},
     torch.randn(8)),
])
def test_an_axis_the_batch_lacks_is_an_index_error_as_quarks(name, kw, x):
    theirs, ours = quark_twins(name, dtype="int8", symmetric=True, **kw)
    with pytest.raises(IndexError):
        _quiet(theirs, x)
    with pytest.raises(AxisRangeError, match=f"ch_axis={kw['ch_axis']} is out of range"):
        ours(x)
    assert issubclass(AxisRangeError, ValueError)


@pytest.mark.parametrize("name", ["minmax", "static_minmax", "memoryless_minmax"])
@pytest.mark.parametrize("args", [
    {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "channel"},
    {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 4},
    {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"},
    {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
     "group_size": 4},
])
def test_qparams_of_meta_statistics_are_meta_tensors_as_theirs(name, args):
    # a model built on the meta device: theirs gives qparams of the shapes, ours refused
    out = []
    for cls in (Theirs, Ours):
        obs = cls.load_from_registry(name, base_name="weight", args=QuantizationArgs(**args))
        _quiet(obs, torch.empty(4, 8, device="meta"))
        out.append({k: None if v is None else (v.device.type, v.shape, v.dtype)
                    for k, v in _quiet(obs.get_qparams).items()})
    assert out[0] == out[1] and out[1]["scale"][0] == "meta"
