"""bench/demo_tables.py (`make demo-readme`) rewrites the demo block of the guide's page."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _demo_tables():
    spec = importlib.util.spec_from_file_location("demo_tables", ROOT / "bench" / "demo_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_default_page_holds_the_block():
    dt = _demo_tables()
    text = (ROOT / dt.PAGE).read_text()
    assert text.count(dt.BEGIN) == 1 and text.count(dt.END) == 1
    assert text.index(dt.BEGIN) < text.index(dt.END)


def test_rewrite_replaces_only_the_block():
    dt = _demo_tables()
    text = f"head\n{dt.BEGIN}\nold table\n{dt.END}\ntail\n"
    assert dt.rewrite(text, "new table") == f"head\n{dt.BEGIN}\nnew table\n{dt.END}\ntail\n"
    with pytest.raises(SystemExit, match="no <!-- demo-tables:begin -->"):
        dt.rewrite("no markers here", "x", "page.md")


def test_machine_line_names_cpu_isa_and_threads():
    dt = _demo_tables()
    cpu, isa = dt.cpu_and_isa()
    line = dt.machine(2)
    assert cpu in line and isa in line and "2 torch threads" in line
