"""This process's peak resident memory over a block, for tests that bound a computation's
temporaries (never a timing): ``/proc/self/clear_refs`` resets VmHWM to the current resident
size, so the peak after the block less the one before is what the block added at most."""

from __future__ import annotations

import contextlib
import re

import pytest


def _peak_kb() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1))


@contextlib.contextmanager
def extra_peak_mb():
    """``with extra_peak_mb() as extra: ...``, then ``extra()``: the MB the block's peak
    rose above the resident size at its start; skips the test where /proc cannot say."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _peak_kb()
    except OSError:
        pytest.skip("no /proc/self/clear_refs to reset the peak resident size")
    after = []
    yield lambda: (after[0] - before) / 1024
    after.append(_peak_kb())
