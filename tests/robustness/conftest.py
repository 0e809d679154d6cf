"""The property tests' counts (fuzzing.STATS), written once per test process at its end."""

import os

import pytest
from fuzzing import write_stats


@pytest.fixture(scope="session", autouse=True)
def _report_fuzz_stats():
    yield
    path = os.environ.get("QUANTSCOPE_FUZZ_STATS")
    if path:
        write_stats(path)
