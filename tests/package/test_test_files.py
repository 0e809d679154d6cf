"""The test files' names are unique: tests/ has no packages (no __init__.py), so pytest
imports each file by its basename, and a second file of the same name stops the whole
collection ("import file mismatch") in `make test`."""

import collections
import pathlib
import re

TESTS = pathlib.Path(__file__).resolve().parents[1]


def test_test_file_names_are_unique():
    names = collections.defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        names[path.name].append(str(path.relative_to(TESTS)))
    assert not {n: p for n, p in names.items() if len(p) > 1}


def test_every_file_with_peers_tests_runs_in_the_peers_venv():
    """A test marked ``peers`` runs only where `make test` names its file (the Makefile's
    PEER_TESTS, run in the peers' venv); the main run deselects it, so a file missing from
    that list is a test that never runs."""
    text = (TESTS.parent / "Makefile").read_text()
    listed = text.split("PEER_TESTS :=", 1)[1].split("\n\n", 1)[0]
    mark = re.compile(r"^\s*@pytest\.mark\.peers\b|^pytestmark\s*=.*\bpeers\b", re.MULTILINE)
    marked = sorted(str(p.relative_to(TESTS.parent)) for p in TESTS.rglob("test_*.py")
                    if mark.search(p.read_text()))
    assert marked and [m for m in marked if m not in listed] == []
