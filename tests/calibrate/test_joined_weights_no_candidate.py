"""A fusion group's joined weights that no ``auto`` candidate takes: calibrate says so, naming
the group and each candidate's error (it raised ``TypeError: 'NoneType' object is not
subscriptable`` before)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from quantscope import presets
from quantscope.calibration import Role
from quantscope.calibration.run import finish


def test_joined_weights_no_candidate_takes_raise_naming_the_group_and_each_error():
    cfg = Role(presets.INT8_PER_TENSOR, "auto")
    slot = SimpleNamespace(observers={}, layer="0.a")
    with pytest.raises(ValueError) as info:
        finish._joined_state(torch.ones(8, 8), cfg, ("no_such_observer", "nor_this_one"), slot)
    message = str(info.value)
    assert "'0.a'" in message and "fusion group" in message
    assert "no_such_observer: " in message and "nor_this_one: " in message
