"""The API reference (docs/api.py, `make docs`) builds and covers every public name."""

from __future__ import annotations

import importlib.util
import pathlib

import quantscope

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "api.py"


def _api():
    spec = importlib.util.spec_from_file_location("quantscope_docs_api", DOCS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_api_reference_covers_every_public_name(tmp_path):
    api = _api()
    text, covered, missing = api.render()
    assert not missing, f"public names without a docstring: {missing}"
    assert set(covered) >= set(quantscope.__all__) | set(quantscope._EXPORTS)
    for name in quantscope.__all__:
        assert f"## `quantscope.{name}" in text
    # the members of the public modules too (e.g. quantscope.distributed.sync_observers)
    assert "### `quantscope.distributed.sync_observers(" in text
    assert "### `quantscope.calibrate.Recipe(" in text
    out = tmp_path / "api.md"
    assert api.main([str(out)]) == 0 and out.read_text() == text


def test_api_reference_reports_a_missing_docstring(monkeypatch):
    api = _api()

    def undocumented():
        pass

    monkeypatch.setattr(quantscope, "qparams_from_range", undocumented)
    _, _, missing = api.render()
    assert "quantscope.qparams_from_range" in missing
