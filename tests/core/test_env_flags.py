"""The on / off environment switches read alike (probing: QUANTSCOPE_NO_KERNEL=false turned
the kernels off, and QUANTSCOPE_HEAP took only "0" for off)."""

import pytest

from quantscope import kernels
from quantscope._checks import env_flag
from quantscope.calibration.run import heap


@pytest.mark.parametrize("value, default, want", [
    (None, True, True), (None, False, False), ("", True, True), (" ", False, False),
    ("0", True, False), ("false", True, False), ("No", True, False), (" OFF ", True, False),
    ("1", False, True), ("true", False, True), ("yes", False, True), ("2", False, True),
])
def test_env_flag(monkeypatch, value, default, want):
    if value is None:
        monkeypatch.delenv("QS_TEST_FLAG", raising=False)
    else:
        monkeypatch.setenv("QS_TEST_FLAG", value)
    assert env_flag("QS_TEST_FLAG", default) is want


@pytest.mark.parametrize("value, on", [("false", True), ("0", True), ("1", False)])
def test_the_kernels_switch(monkeypatch, value, on):
    monkeypatch.setenv("QUANTSCOPE_NO_KERNEL", value)
    assert kernels.disabled() is not on


@pytest.mark.parametrize("value, on", [("off", False), ("false", False), ("0", False),
                                       ("1", True), ("", True)])
def test_the_heap_switch(monkeypatch, value, on):
    monkeypatch.setenv("QUANTSCOPE_HEAP", value)
    assert heap._on() is on
