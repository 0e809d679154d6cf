"""Every ```python block of README.md runs (each on its own, in a fresh namespace)."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.DOTALL | re.MULTILINE)


def _line(block: str) -> int:
    return README.read_text()[: README.read_text().index(block)].count("\n") + 1


def test_readme_has_examples():
    assert len(BLOCKS) >= 8


@pytest.mark.parametrize("code", BLOCKS, ids=[f"README.md:{_line(b)}" for b in BLOCKS])
def test_readme_block_runs(code, capsys):
    exec(compile(code, f"README.md:{_line(code)}", "exec"), {"__name__": "__readme__"})  # noqa: S102
