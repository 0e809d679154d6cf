"""The test files' names are unique: tests/ has no packages (no __init__.py), so pytest
imports each file by its basename, and a second file of the same name stops the whole
collection ("import file mismatch") in `make test`."""

import collections
import pathlib

TESTS = pathlib.Path(__file__).resolve().parents[1]


def test_test_file_names_are_unique():
    names = collections.defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        names[path.name].append(str(path.relative_to(TESTS)))
    assert not {n: p for n, p in names.items() if len(p) > 1}
