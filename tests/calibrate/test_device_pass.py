"""calibrate's observation pass off the CPU reads nothing back to the host (issue 35 item 3:
statistics stay on the device until the end, so a GPU runs the model and the observers
without waiting on the host).

The ``meta`` device stands in for a GPU: any host read there fails in torch itself. The pass
(every weight observed, every batch run through the model and its observers) must reach its
end, the non-finite check that reads the observers' flags once, before anything reads a
device value.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantscope as qs
from quantscope.calibration import preset
from quantscope.calibration.run import observe


class _PassEnded(Exception):
    """Raised at the end of the observation pass, where the first host read belongs."""


@pytest.mark.parametrize("scheme, observer", [("w8a8", "minmax"), ("w8a8", "histogram"),
                                              ("nvfp4", "minmax"), ("w8a8", "mse"),
                                              ("mxfp4", "minmax")])
def test_the_observation_pass_reads_nothing_back(scheme, observer, monkeypatch):
    reached = []

    def end_of_pass(slots):
        reached.append(len(list(slots)))
        raise _PassEnded

    monkeypatch.setattr(observe, "check_finite", end_of_pass)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 32))
    batches = [torch.empty(4, 128, device="meta") for _ in range(3)]
    with pytest.raises(_PassEnded):
        qs.calibrate(model, batches, preset(scheme, observer), progress=False)
    assert reached and reached[0] > 0  # the pass ran to its end, with observers to check
