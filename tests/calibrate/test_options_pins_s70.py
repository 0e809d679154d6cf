"""Pins of the calibration option objects (quantscope.calibration.options) that a second
mutation round (session 70) found unpinned: an ``Auto.candidates`` name auto cannot run is
refused when the object is made, ``Auto.score_tokens`` below its default is refused as
above it where the metric reads none, a sequential keyword beside others still needs
``sequential=``, a ``Sequential.device`` of no device type is named as that field, and
``check_device`` takes the CPU whatever its index (torch does)."""

from __future__ import annotations

import pytest
import torch

from quantscope.calibration import Auto, Sequential
from quantscope.calibration.options import Options, check_device, from_keywords


@pytest.mark.parametrize(("name", "why"), [
    ("nosuch", "unknown observer"),
    ("torch.ao:MinMaxObserver", "a compat class"),
])
def test_a_candidate_auto_cannot_run_is_refused_when_auto_is_made(name, why):
    """"Refused now, not dropped later": the object itself names it, before any pass."""
    with pytest.raises(ValueError, match=rf"Auto\.candidates names '{name}': {why}"):
        Auto(candidates=["minmax", name])


def test_a_sequential_keyword_beside_others_still_needs_sequential():
    """Any one sequential keyword without ``sequential=`` is the TypeError that says so."""
    with pytest.raises(TypeError, match="options of sequential calibration; pass "
                                        "sequential=True"):
        from_keywords(Options(), {"seed": 1, "blocks": "model.layers"})


@pytest.mark.parametrize("device", [3.5, ["cpu"]])
def test_a_device_of_the_wrong_type_is_named_as_the_field(device):
    """Not torch's own TypeError: the ValueError naming ``Sequential.device``."""
    with pytest.raises(ValueError, match=r"Sequential\.device must be a torch device such "
                                         r"as 'cpu'"):
        Sequential(device=device, checkpoint="ckpt")


@pytest.mark.parametrize("device", ["cpu:1", "cpu:3"])
def test_the_cpu_is_always_there(device):
    """The CPU "runs here": no count is checked for it, whatever its index."""
    assert check_device(torch.device(device), "who") is None  # no ValueError


@pytest.mark.parametrize("metric", ["joint", "tensor", "output"])
@pytest.mark.parametrize("n", [1, 1023])
def test_score_tokens_off_its_default_is_refused_where_the_metric_reads_none(metric, n):
    """Below the default as above it: any value set is ignored there."""
    with pytest.raises(ValueError, match=rf"Auto\.score_tokens \({n}\) is read only by "
                                         rf"metric 'model' or 'fisher'; metric='{metric}'"):
        Auto(metric=metric, score_tokens=n)
