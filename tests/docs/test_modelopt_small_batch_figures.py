"""The speeds the guide (performance.md) and ``compat/modelopt.py``'s doc quote for ModelOpt's
``HistogramCalibrator`` on small batches are the table they cite: "Small batches against
ModelOpt" in bench/results/notes.md, which ``make bench-docs`` copies into docs/benchmarks.md.
A review (s51) found them quoting 1.05-1.13x and 10-13x where the table gives 1.00-1.14x and
9.4-11.0x, and ModelOpt's 51-55 us where it gives 49.5-56.2."""

from __future__ import annotations

import pathlib
import re

from quantscope.compat import modelopt

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: a quoted figure: ``lo-hi`` or ``~value``
RANGE = r"(~?\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?)"


def _table(path: pathlib.Path) -> dict[tuple[str, str], list[list[float]]]:
    """``{(ranges, values): [ModelOpt, quantscope, before, ratio]}``, each the two runs."""
    text = path.read_text()
    start = text.index("**Small batches against ModelOpt**")
    rows = re.findall(r"^\| (fixed|growing), (\w+) \| (.*) \|$", text[start:], re.MULTILINE)
    assert len(rows) == 10, path
    return {(kind, n): [[float(v) for v in cell.split(" / ")] for cell in rest.split(" | ")]
            for kind, n, rest in rows}


def _covers(quoted: str, values: list[float]) -> bool:
    """Whether the quoted ``lo-hi`` (``~value``: both) is ``min(values)-max(values)`` to its
    own decimals."""
    def near(text: str, value: float) -> bool:
        decimals = len(text.partition(".")[2])
        return abs(float(text) - value) <= 0.5 * 10.0 ** -decimals + 1e-9
    lo, _, hi = quoted.lstrip("~").partition("-")
    return near(lo, min(values)) and near(hi or lo, max(values))


def _cells(table, kind: str, sizes: tuple[str, ...], column: int) -> list[float]:
    return [v for n in sizes for v in table[(kind, n)][column]]


def test_the_table_is_the_notes_one():
    assert _table(ROOT / "docs" / "benchmarks.md") == _table(ROOT / "bench" / "results" /
                                                             "notes.md")


def test_the_guide_quotes_the_table():
    table = _table(ROOT / "bench" / "results" / "notes.md")
    text = " ".join((ROOT / "docs" / "guide" / "performance.md").read_text().split())
    found = re.search(rf"{RANGE} us, {RANGE}x ModelOpt's speed, {RANGE}x where every batch "
                      rf"grows the grid, {RANGE}x on 1M values", text)
    assert found, "performance.md: the cached ModelOpt step's figures"
    us, fixed, growing, big = found.groups()
    small = ("256", "1K")
    assert _covers(us, _cells(table, "fixed", small, 1))
    assert _covers(fixed, _cells(table, "fixed", small, 3))
    assert _covers(growing, _cells(table, "growing", small, 3))
    assert _covers(big, _cells(table, "fixed", ("1M",), 3) + _cells(table, "growing", ("1M",), 3))


def test_the_modelopt_doc_quotes_the_table():
    table = _table(ROOT / "bench" / "results" / "notes.md")
    doc = " ".join(modelopt.__doc__.split())
    found = re.search(rf"256-1K values: {RANGE} us a call \(ModelOpt's ``collect``: {RANGE} "
                      rf"us\), {RANGE} us where each batch grows the grid \(ModelOpt's: "
                      rf"{RANGE} us\)", doc)
    assert found, "compat/modelopt.py: the cached step's figures"
    ours, theirs, ours_growing, theirs_growing = found.groups()
    small = ("256", "1K")
    assert _covers(ours, _cells(table, "fixed", small, 1))
    assert _covers(theirs, _cells(table, "fixed", small, 0))
    assert _covers(ours_growing, _cells(table, "growing", small, 1))
    assert _covers(theirs_growing, _cells(table, "growing", small, 0))
