"""``quantscope export``'s options in the guide's lists of them: deploy.md's synopsis of the
command names each one, and command-line.md's "Options that other pages explain" the export
ones it leaves to deploy.md. A review (s51) found ``--external-data`` in the prose only."""

from __future__ import annotations

import argparse
import pathlib
import re

from quantscope.cli import build_parser

ROOT = pathlib.Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guide"


def _export_options() -> set[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {o for a in sub.choices["export"]._actions for o in a.option_strings
            if o.startswith("--") and o != "--help"}


def test_the_deploy_synopsis_names_every_export_option():
    text = (GUIDE / "deploy.md").read_text()
    # the command's line and the comment lines under it
    found = re.search(r"^quantscope export runs/smol .*\n(?:\s+#.*\n)*", text, re.MULTILINE)
    assert found, "deploy.md: the export synopsis"
    named = set(re.findall(r"--[a-z][a-z-]*", found.group(0)))
    assert _export_options() - named == set()


def test_the_command_line_page_lists_the_onnx_options():
    text = " ".join((GUIDE / "command-line.md").read_text().split())
    start = text.index("Options that other pages explain")
    paragraph = text[start:text.index("## ", start)]
    for option in ("--format onnx", "--external-data", "--no-external-data", "--allow-lossy"):
        assert f"`{option}`" in paragraph, option
