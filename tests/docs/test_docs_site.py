"""The docs site (mkdocs.yml, `make docs`) builds in strict mode, and the API reference it
renders from the docstrings covers every public name."""

from __future__ import annotations

import enum
import importlib
import importlib.util
import inspect
import pathlib
import re
import subprocess
import sys
import types

import pytest

import quantscope

ROOT = pathlib.Path(__file__).resolve().parents[2]

#: reference page -> the modules it renders (docs/reference/<page>.md); every name of their
#: ``__all__`` is public API
PAGES = {
    "core": ["spec", "layout", "formats", "scales", "qparams", "qdq", "presets"],
    "observers": ["observers"],
    "calibrate": ["calibration"],
    "export": ["exporters"],
    "distributed": ["distributed"],
}


def _public():
    """(module, name, object) of every public name of the documented modules."""
    for mods in PAGES.values():
        for m in mods:
            mod = importlib.import_module(f"quantscope.{m}")
            for name in mod.__all__:
                yield m, name, getattr(mod, name)


def _undocumented():
    return [f"quantscope.{m}.{n}" for m, n, obj in _public()
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and not inspect.getdoc(obj)]


def test_every_public_function_and_class_has_a_docstring():
    assert not _undocumented(), f"public names without a docstring: {_undocumented()}"


def test_the_docstring_check_can_fail(monkeypatch):
    # a page of its own: patching a real module's function would leak into every module
    # first imported while the patch holds (``from ..qparams import qparams_from_range``)
    def undocumented():
        pass

    page = types.ModuleType("quantscope._undocumented_example")
    page.__all__, page.undocumented = ["undocumented"], undocumented
    monkeypatch.setitem(sys.modules, page.__name__, page)
    monkeypatch.setitem(PAGES, "example", ["_undocumented_example"])
    assert _undocumented() == ["quantscope._undocumented_example.undocumented"]


def test_the_pages_cover_every_top_level_name():
    # each name of ``quantscope.__all__`` is defined in (or is) a module a page renders
    rendered = {m for mods in PAGES.values() for m in mods}
    for name in quantscope.__all__:
        where = quantscope._EXPORTS[name]
        mod = name if where is None else where.split(".")[0]
        assert mod in rendered, f"quantscope.{name} ({where}) is on no reference page"


def test_the_site_builds_and_renders_every_public_name(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    site = tmp_path / "site"
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                          "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
                         check=False, capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    ids = set()
    for page in PAGES:
        html = (site / "reference" / page / "index.html").read_text()
        ids |= set(re.findall(r'id="(quantscope\.[\w.]+)"', html))
        # the docstrings' Sphinx roles rendered as code (docs/sphinx_roles.py), not as typed
        assert not re.findall(r":\w+:<code>[^<]*", html), page
    missing = []
    for m, name, obj in _public():
        if isinstance(obj, (types.ModuleType, enum.Enum)):
            continue  # modules have their own page; enum members (Op.MIN ...) their class's
        # a function defined in a submodule (calibration.results.apply.apply)
        # is rendered under the path of the module that defines it
        where = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"
        if not {f"quantscope.{m}.{name}", f"quantscope.{m}.{name}.{name}", where} & ids:
            missing.append(f"quantscope.{m}.{name}")
    assert not missing, f"public names not in the API reference: {missing}"
    assert (site / "architecture" / "index.html").exists()


def test_the_export_reference_renders_each_formats_exporter():
    # quantscope.export(..., **options) passes its options to the format's exporter: the
    # reference showed export's **options and none of them
    from quantscope.exporters import FORMATS, exporter

    page = (ROOT / "docs" / "reference" / "export.md").read_text()
    for name in FORMATS:
        fn = inspect.unwrap(exporter(name))
        assert f"::: {fn.__module__}.{fn.__qualname__}\n" in page, name


def test_the_preset_table_lists_every_preset():
    # fp8-kv, a preset the command line's help lists, was missing from the guide's table
    from quantscope.calibration.recipe import RECIPES

    text = (ROOT / "docs" / "guide" / "calibrating.md").read_text()
    table = text[text.index("| preset | weights | input activations |"):]
    table = table[:table.index("\n\n")]
    assert sorted(re.findall(r"^\| `([\w-]+)` \|", table, re.MULTILINE)) == sorted(RECIPES)


def test_sphinx_roles_become_the_code_sphinx_shows():
    spec = importlib.util.spec_from_file_location("sphinx_roles", ROOT / "docs" / "sphinx_roles.py")
    roles = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(roles)
    assert roles.plain("see :func:`~quantscope.calibration.calibrate` and :class:`.Spec`, "
                       ":py:meth:`the method <a.B.c>`, :data:`FORMATS`; ``x``") == (
        "see `calibrate` and `Spec`, `the method`, `FORMATS`; ``x``")
    # wrapped across a docstring's lines: the indent is no part of the name (a title keeps
    # one space)
    assert roles.plain(":data:`~.serving.\n    SCHEME_FIELDS`, :meth:`the\n    method <a.b>`") \
        == "`SCHEME_FIELDS`, `the method`"
