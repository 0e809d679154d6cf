"""A griffe extension for the API reference (``mkdocs.yml``): the docstrings' Sphinx roles
(``:func:`~quantscope.calibrate```, ``:class:`.Calibration```), which Markdown would show as
written, become the code spans Sphinx shows: the target without its leading dots, its last
name where it starts with ``~``, an explicit title (``:func:`title <target>```) as given."""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|data|mod|exc|obj|const)"
                   r":`(?P<text>[^`<]+?)(?P<target>\s*<[^`>]+>)?`")


def plain(text: str) -> str:
    """``text`` with each Sphinx role as a Markdown code span."""
    def span(m: re.Match) -> str:
        shown = " ".join(m["text"].split())  # (a role wrapped across a docstring's lines)
        if m["target"] is None:  # a target has no spaces: the line break's indent goes
            shown = shown.replace(" ", "").lstrip(".")
        if shown.startswith("~"):
            shown = shown[1:].rpartition(".")[2]
        return f"`{shown}`"
    return _ROLE.sub(span, text)


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain(obj.docstring.value)
