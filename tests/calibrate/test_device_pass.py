"""calibrate's observation pass off the CPU reads nothing back to the host (issue 35 item 3:
statistics stay on the device until the end, so a GPU runs the model and the observers
without waiting on the host).

The ``meta`` device stands in for a GPU: any host read there fails in torch itself. The pass
(every weight observed, every batch run through the model and its observers) must reach its
end, the non-finite check that reads the observers' flags (stacked once a batch) once,
before anything reads a device value. Nor does it upload anything blocking (a pageable
host-to-device copy with ``non_blocking=False`` makes the host wait for the GPU as a read
does): batches of changing shapes, whose observers record each new shape, and the row
samples kept for the report.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import quantscope as qs
from quantscope.calibration import preset
from quantscope.calibration.run.non_finite import FirstBad
from tests.op_names import BlockingUploads


class _PassEnded(Exception):
    """Raised at the end of the observation pass, where the first host read belongs."""


@pytest.mark.parametrize("scheme, observer", [("w8a8", "minmax"), ("w8a8", "histogram"),
                                              ("nvfp4", "minmax"), ("w8a8", "mse"),
                                              ("mxfp4", "minmax")])
def test_the_observation_pass_reads_nothing_back(scheme, observer, monkeypatch, meta_as_device):
    reached, uploads = [], BlockingUploads()
    real_tensor = torch.tensor

    def tensor(data, *args, device=None, **kwargs):  # made on the host, then copied
        if device is not None and torch.device(device).type != "cpu":
            uploads.found.append("torch.tensor")
        return real_tensor(data, *args, device=device, **kwargs)

    def end_of_pass(bad, model=None):
        reached.append(len(bad.watched))
        raise _PassEnded

    monkeypatch.setattr(FirstBad, "check", end_of_pass)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 32))
    # patched after a device context has run: the first one caches torch's factory functions
    # (torch.utils._device), and a cached wrapper would leave the real torch.tensor out of
    # every later `with torch.device(...)` in the process (transformers' meta init of the
    # rotary tables then ran on the CPU: from_pretrained gave uninitialised inv_freq)
    from torch.utils import _device

    _device._device_constructors()
    monkeypatch.setattr(torch, "tensor", tensor)
    batches = [torch.empty(shape, device="meta") for shape in ((4, 128), (3, 128), (2, 5, 128))]
    with pytest.raises(_PassEnded), uploads:
        qs.calibrate(model, batches, preset(scheme, observer), progress=False)
    # the pass ran to its end, with the activations' flags to check (MX inputs, scaled at
    # run time: their own, set by the hook)
    assert reached and reached[0] > 0
    assert uploads.found == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("scheme, observer", [("w8a8", "minmax"), ("w8a8", "histogram"),
                                              ("nvfp4", "minmax")])
def test_cuda_calibration_gives_the_cpus_qparams(scheme, observer):
    """calibrate on CUDA (the weights in grouped launches, the activations through the ops):
    the weights' qparams are the CPU's bit for bit; the activations' agree to the models'
    own difference (CUDA's matmuls round otherwise than the CPU's)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 64))
    batches = [torch.randn(4, 16, 128) for _ in range(3)]
    cals = [qs.calibrate(m, [b.to(device) for b in batches], preset(scheme, observer),
                         progress=False)
            for m, device in ((model, "cpu"), (copy.deepcopy(model).cuda(), "cuda"))]
    for layer, roles in cals[0].states.items():
        for role, want in roles.items():
            got = cals[1].states[layer][role].qparams
            if want.qparams is None:  # a role with no static qparams (dynamic)
                assert got is None, (layer, role)
                continue
            a, b = want.qparams.scale, got.scale.cpu()
            if role == "weight":
                assert torch.equal(a, b), (layer, role)
                assert torch.equal(want.qparams.zero_point, got.zero_point.cpu())
            else:
                torch.testing.assert_close(b, a, rtol=1e-3, atol=0)
