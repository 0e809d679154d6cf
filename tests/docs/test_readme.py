"""Every ```python block of README.md runs (each on its own, in a fresh namespace).

A block that imports a toolkit this environment lacks (llm-compressor lives in the peers'
venv) is skipped here; tests/integrations/test_integrations_llmcompressor.py runs those in the peers' venv.
"""

import importlib.util
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.DOTALL | re.MULTILINE)


def missing_modules(code: str) -> list[str]:
    """Top-level packages ``code`` imports that are not installed."""
    names = re.findall(r"^(?:from|import)\s+([A-Za-z_]\w*)", code, flags=re.MULTILINE)
    return sorted({n for n in names if importlib.util.find_spec(n) is None})


def _line(block: str) -> int:
    return README.read_text()[: README.read_text().index(block)].count("\n") + 1


def test_readme_has_examples():
    assert len(BLOCKS) >= 8


@pytest.mark.parametrize("code", BLOCKS, ids=[f"README.md:{_line(b)}" for b in BLOCKS])
def test_readme_block_runs(code, capsys):
    missing = missing_modules(code)
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    exec(compile(code, f"README.md:{_line(code)}", "exec"), {"__name__": "__readme__"})  # noqa: S102
