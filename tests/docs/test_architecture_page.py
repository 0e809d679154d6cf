"""docs/architecture.md names every module of the calibration subpackages (its table went stale
as modules were added: a probe found three of run/ and three of structure/ missing)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
CALIBRATION = ROOT / "src" / "quantscope" / "calibration"


def _table_modules(page: str) -> dict[str, set[str]]:
    """``{"run": {"session", ...}, ...}`` from the rows ``| `run/` | job | `a`, `b` |``."""
    rows = re.findall(r"^\| `(\w+)/` \| [^|]+ \| ([^|]+) \|$", page, flags=re.MULTILINE)
    return {pkg: set(re.findall(r"`(\w+)`", names)) for pkg, names in rows}


def test_the_calibration_table_names_every_module():
    table = _table_modules((ROOT / "docs" / "architecture.md").read_text())
    packages = sorted(p.name for p in CALIBRATION.iterdir() if (p / "__init__.py").exists())
    assert sorted(table) == packages
    for pkg in packages:
        files = {f.stem for f in (CALIBRATION / pkg).glob("*.py") if f.stem != "__init__"}
        assert table[pkg] == files, pkg


def test_the_table_reader_sees_a_missing_module():
    page = "| `run/` | the pass | `session`, `observe` |\n| `choice/` | ranges | `auto` |\n"
    assert _table_modules(page) == {"run": {"session", "observe"}, "choice": {"auto"}}
