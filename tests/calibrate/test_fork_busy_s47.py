"""A process forked while ``calibrate`` held a model: the child's copy of the model carries
that call's hooks (and its in-place changes), but the call itself does not exist there, so
"wait until it returns" (the in-process error) can never be met. The child says why instead;
a model the parent's call did not hold calibrates there as anywhere."""

from __future__ import annotations

import os
import sys

import pytest
from torch import nn

from quantscope.calibration.run.exclusive import calibrating

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "darwin",
                                reason="needs os.fork")


def _in_child(check) -> str:
    """``check()``'s outcome in a forked child (no torch kernels run there: a child of a
    process whose OpenMP pool ran can hang in it)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave without running pytest's teardown
        try:
            check()
            out = "ok"
        except ValueError as e:
            out = str(e)
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    return out


def _enter(model):
    with calibrating(model):
        pass


def test_a_child_says_its_model_was_held_at_the_fork():
    held, free = nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2)
    with calibrating(held):
        held_out = _in_child(lambda: _enter(held[0]))
        free_out = _in_child(lambda: _enter(free))
        with pytest.raises(ValueError, match="being calibrated by a call that has not"):
            _enter(held)  # in the parent the call exists: wait for it
    assert "forked from its parent" in held_out, held_out
    assert free_out == "ok"
    _enter(held)  # returned: free again in the parent
