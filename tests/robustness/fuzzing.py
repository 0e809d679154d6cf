"""What every property test of ``make fuzz`` shares (tests/robustness/test_fuzz*.py).

Budgets: the ``ci`` profile (default; ``make test``) runs a fixed, derandomized set of
cases in a few seconds per test; ``HYPOTHESIS_PROFILE=fuzz`` (``make fuzz``) runs many
more, randomized. Each test counts its cases (:func:`start`) and outcomes (:func:`count`:
``clear_errors`` or ``ok``); with ``QUANTSCOPE_FUZZ_STATS=path`` the counts are appended to
``path`` as JSON lines at the end of the session (conftest.py), one line per test.
"""

import json
import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True,
                          suppress_health_check=list(HealthCheck), print_blob=True)
settings.register_profile("fuzz", max_examples=1000, deadline=None,
                          suppress_health_check=list(HealthCheck), print_blob=True)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
FUZZ = settings.get_profile(PROFILE if PROFILE in ("ci", "fuzz") else "ci")

#: the exceptions the public API documents for bad input (anything else fails a property)
DOCUMENTED = (ValueError, TypeError, NotImplementedError)
STATS: dict = {}


def start(test: str):
    """One more case of ``test`` (call it after the case's last draw: an aborted generation
    is no case)."""
    STATS.setdefault(test, {"cases": 0, "clear_errors": 0, "ok": 0})["cases"] += 1


def count(test: str, outcome: str):
    """The case of ``test`` ended in ``outcome`` (``clear_errors`` or ``ok``)."""
    STATS[test][outcome] += 1


def write_stats(path: str):
    # a case that neither passed nor raised a documented error failed the property (an
    # undocumented exception or a NaN / inf result; hypothesis then reports it)
    lines = [json.dumps({"profile": PROFILE, "test": test, **c,
                         "failed": c["cases"] - c["clear_errors"] - c["ok"]}) + "\n"
             for test, c in STATS.items()]
    with open(path, "a") as f:
        f.writelines(lines)


def clear(e: BaseException, documented=DOCUMENTED) -> bool:
    """A documented exception with a message that says something."""
    return isinstance(e, documented) and len(str(e)) > 10


JSON_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40),
                        st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
                        st.just([]), st.just({}), st.just("yes"), st.just(99),
                        st.just("local"))


def mutate_json(value, draw):
    """One random change somewhere in a JSON tree."""
    if isinstance(value, dict) and value:
        key = draw(st.sampled_from(sorted(value)))
        action = draw(st.sampled_from(["drop", "replace", "recurse", "recurse"]))
        if action == "drop":
            value.pop(key)
        elif action == "replace":
            value[key] = draw(JSON_VALUES)
        else:
            value[key] = mutate_json(value[key], draw)
        return value
    if isinstance(value, list) and value:
        i = draw(st.integers(0, len(value) - 1))
        value[i] = mutate_json(value[i], draw)
        return value
    return draw(JSON_VALUES)
