"""Offloaded models: refused where a write into the weights would be lost, naming the
offload; never a silent no-op."""

import copy

import pytest
import torch
from tiny_models import llama

import quantscope
from quantscope.calibration.options import Outliers

WEIGHT = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def calibrated():
    model, batches = llama()
    return model, batches, quantscope.calibrate(model, batches, "w8a8", progress=False)


def test_remove_refuses_a_model_offloaded_by_accelerate_after_apply(calibrated):
    """remove() copied the float values into meta tensors (a no-op) and returned: the
    offload's store kept the fake-quantized weights for good."""
    accelerate = pytest.importorskip("accelerate")
    model, _, calib = calibrated
    m = copy.deepcopy(model)
    handle = calib.apply(m)
    accelerate.cpu_offload(m, execution_device="cpu")
    with pytest.raises(ValueError, match=rf"remove: {WEIGHT} was offloaded after apply\(\) "
                                         r"\(accelerate.*call remove\(\) before offloading"):
        handle.remove()
    assert handle.active  # nothing undone: remove() is all or nothing


def _offload_to_disk(model, folder):
    from compressed_tensors.offload import offload_module

    for module in model.modules():
        if list(module.parameters(recurse=False)) or list(module.buffers(recurse=False)):
            offload_module(module, "cpu", "disk", offload_dir=str(folder))
    return model


@pytest.mark.parametrize("call", ["calibrate", "smooth", "apply", "export"])
def test_compressed_tensors_disk_offload_is_refused_by_name(calibrated, tmp_path, call):
    """Each read of a weight under compressed-tensors' disk offload is a fresh copy: smoothing
    wrote into copies (the smoothing scales reported, the model never smoothed) and apply /
    the export blamed a parametrization and advised removing one the model does not have."""
    pytest.importorskip("compressed_tensors.offload")
    model, batches, calib = calibrated
    (tmp_path / "offload").mkdir()
    m = _offload_to_disk(copy.deepcopy(model), tmp_path / "offload")
    run = {"calibrate": lambda: quantscope.calibrate(m, batches, "w8a8", progress=False),
           "smooth": lambda: quantscope.calibrate(m, batches, "w8a8", progress=False,
                                                  outliers=Outliers(smooth=0.5)),
           "apply": lambda: calib.apply(m),
           "export": lambda: quantscope.export(calib, m, tmp_path / "out")}[call]
    with pytest.raises(ValueError, match=r"offloaded by compressed-tensors \(DiskCache "
                                         r"offloading to disk: each read loads a copy"):
        run()
    assert not (tmp_path / "out").exists()


def test_compressed_tensors_offload_where_reads_are_the_tensors_calibrates_as_plain(
        calibrated, tmp_path):
    """A cache that onloads to where it offloads (CPU to CPU) hands out the tensors it holds:
    calibrated, applied and removed as the plain model, bit for bit."""
    pytest.importorskip("compressed_tensors.offload")
    from compressed_tensors.offload import offload_module

    model, batches, calib = calibrated
    m = copy.deepcopy(model)
    for module in m.modules():
        if list(module.parameters(recurse=False)):
            offload_module(module, "cpu", "cpu")
    got = quantscope.calibrate(m, batches, "w8a8", progress=False)
    layer = WEIGHT.rpartition(".")[0]
    assert torch.equal(got.states[layer]["weight"].qparams.scale,
                       calib.states[layer]["weight"].qparams.scale)
    with calib.apply(m):
        pass
    assert torch.equal(m.get_parameter(WEIGHT), model.get_parameter(WEIGHT))


class _Store(dict):
    """A module's ``_parameters`` of another type, as an offload cache is."""

    def __init__(self, items, on=None, off=None, copies=False):
        super().__init__(items)
        if on is not None:
            self.onload_device, self.offload_device = on, off
        self.copies = copies

    def __getitem__(self, key):
        v = super().__getitem__(key)
        return v.clone() if self.copies and v is not None else v


@pytest.mark.parametrize("store, copies", [
    (_Store({"weight": torch.ones(2)}, "cuda", "cuda:0"), False),  # found by review: refused
    (_Store({"weight": torch.ones(2)}, "cuda:1", "cuda:0"), True),
    (_Store({"weight": torch.ones(2)}, "cuda", "cpu"), True),
    (_Store({"weight": torch.ones(2)}, "cpu", "disk"), True),
    (_Store({"bias": None, "weight": torch.ones(2)}, copies=True), True),  # None read first
    (_Store({"bias": None, "weight": torch.ones(2)}), False),
])
def test_loaded_copies_tells_a_store_that_copies(store, copies):
    from quantscope.calibration.structure.placement import loaded_copies

    module = torch.nn.Module()
    module._parameters = store
    assert (loaded_copies(module) is not None) == copies
