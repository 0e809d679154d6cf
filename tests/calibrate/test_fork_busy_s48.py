"""A process forked while ``calibrate`` held a model (s48, after test_fork_busy_s47): a model in
the child that holds any module the parent's call held is refused with the fork's reason, not
only one made of such modules alone (a new container around the held model, a wider model
sharing one of its layers)."""

from __future__ import annotations

from test_fork_busy_s47 import _enter, _in_child, pytestmark  # noqa: F401 (the skip)
from torch import nn

from quantscope.calibration.run.exclusive import calibrating


def test_a_child_refuses_a_model_holding_one_held_module_among_others():
    held, free = nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2)
    with calibrating(held):
        wrapped = _in_child(lambda: _enter(nn.Sequential(held, nn.Linear(2, 2))))
        sharing = _in_child(lambda: _enter(nn.Sequential(free, held[0])))
        alone = _in_child(lambda: _enter(nn.Sequential(free, nn.Linear(2, 2))))
    assert "forked from its parent" in wrapped, wrapped
    assert "forked from its parent" in sharing, sharing
    assert alone == "ok"
