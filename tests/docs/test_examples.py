"""Every ```python block of README.md and of docs/**/*.md runs (each on its own, in a fresh
namespace).

A block that imports a toolkit this environment lacks (llm-compressor lives in the peers'
venv) is skipped here; tests/integrations/test_integrations_llmcompressor.py runs those in
the peers' venv. Fence what must not run as ```text or ```py.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```python\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)


def pages() -> list[pathlib.Path]:
    """README.md, then every Markdown page under docs/ (the guide and the background pages)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def python_blocks(page: pathlib.Path) -> list[tuple[str, int]]:
    """``(code, line)`` of each ```python block of ``page``; ``line`` is the block's first."""
    text = page.read_text()
    return [(m.group(1), text.count("\n", 0, m.start(1)) + 1) for m in FENCE.finditer(text)]


def missing_modules(code: str) -> list[str]:
    """Top-level packages ``code`` imports that are not installed."""
    names = re.findall(r"^(?:from|import)\s+([A-Za-z_]\w*)", code, flags=re.MULTILINE)
    return sorted({n for n in names if importlib.util.find_spec(n) is None})


BLOCKS = [(f"{page.relative_to(ROOT)}:{line}", code)
          for page in pages() for code, line in python_blocks(page)]


def test_the_pages_have_examples():
    per_page = {}
    for where, _ in BLOCKS:
        page = where.rsplit(":", 1)[0]
        per_page[page] = per_page.get(page, 0) + 1
    assert per_page.get("README.md", 0) >= 2
    guide = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs" / "guide").glob("*.md"))
    assert guide, "docs/guide/ has no page"
    assert [g for g in guide if per_page.get(g, 0) == 0] == [], "a guide page without an example"


def test_blocks_are_found_with_their_lines(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# t\n\n```python\nx = 1\n```\n\n```py\nnot run\n```\n```python\ny = 2\n```\n")
    assert python_blocks(page) == [("x = 1\n", 4), ("y = 2\n", 11)]


def test_missing_modules_names_only_absent_packages():
    assert missing_modules("import torch\nfrom no_such_pkg_qs import x\n") == ["no_such_pkg_qs"]


# a block that loads a real model (SmolLM2-135M, ~25 s) runs in the extended tier
@pytest.mark.parametrize("where, code", [
    pytest.param(where, code, id=where,
                 marks=[pytest.mark.extended] if "load_model(" in code else [])
    for where, code in BLOCKS])
def test_block_runs(where, code, tmp_path, monkeypatch):
    missing = missing_modules(code)
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    monkeypatch.chdir(tmp_path)  # whatever a block writes stays out of the repository
    exec(compile(code, where, "exec"), {"__name__": "__docs_example__"})  # noqa: S102


LINK = re.compile(r"\]\(([^)\s]+)\)")


def heading_anchors(page: pathlib.Path) -> set[str]:
    """The anchors mkdocs gives ``page``'s headings: Python-Markdown's toc slug of their text
    (code spans and links read as their text; fenced code holds no headings)."""
    from markdown.extensions.toc import slugify

    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    plain = (re.sub(r"\[([^]]*)\]\([^)]*\)|[`*]", r"\1", h)
             for h in re.findall(r"^#{1,6} (.+?)\s*$", text, flags=re.MULTILINE))
    return {slugify(h, "-") for h in plain}


def broken_links(page: pathlib.Path) -> list[str]:
    """The relative links of ``page`` (Markdown ``[text](target)``) whose file does not
    exist, or whose anchor is no heading of a Markdown target (the README's: mkdocs checks
    the anchors of the pages it builds, ``make docs``)."""
    out = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL, or an anchor of the same page
        path, _, anchor = target.partition("#")
        file = page.parent / path
        if not file.exists() or (anchor and file.suffix == ".md"
                                 and anchor not in heading_anchors(file)):
            out.append(target)
    return out


def test_readme_links_point_at_files_and_headings_that_exist(tmp_path):
    pytest.importorskip("markdown")
    assert broken_links(ROOT / "README.md") == []
    page = tmp_path / "p.md"
    page.write_text("# A `b` [c](p.md)\n```\n# not a heading\n```\n"
                    "[a](missing.md#x) [b](p.md) [c](https://example.org) [d](#here) "
                    "[e](p.md#a-b-c) [f](p.md#not-a-heading)")
    assert broken_links(page) == ["missing.md#x", "p.md#not-a-heading"]
