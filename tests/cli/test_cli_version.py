"""The version has one place (``quantscope.__version__``): the command line, the package
metadata and the export marker read it."""

import json
import sys
from pathlib import Path

import quantscope
from quantscope.cli import main

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_version_flag(capsys):
    assert main(["--version"]) == 0  # (main returns argparse's exit code)
    assert capsys.readouterr().out.strip() == f"quantscope {quantscope.__version__}"


def test_pyproject_reads_the_package_version():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "quantscope.__version__"


def test_export_marker_version(tmp_path):
    from quantscope.exporters.atomic import MARKER, atomic_dir

    with atomic_dir(tmp_path / "out", what="test") as tmp:
        (Path(tmp) / "a.txt").write_text("x")
    marker = json.loads((tmp_path / "out" / MARKER).read_text())
    assert marker["version"] == quantscope.__version__
