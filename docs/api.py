"""Render quantscope's API reference from its docstrings to one markdown file.

    python docs/api.py OUT.md

Every name of ``quantscope.__all__`` gets a section (signature and docstring); a name that
is a module gets its docstring and one subsection per name of its ``__all__``. Standard
library only (``inspect``): mkdocs + mkdocstrings would render the same docstrings to HTML
if added to the dev extra. Exits 1 naming every public name without a docstring.
"""

from __future__ import annotations

import inspect
import sys
import types


def _signature(obj) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""


def _entry(name: str, obj, level: int, missing: list[str]) -> list[str]:
    doc = inspect.getdoc(obj) if not isinstance(obj, (dict, tuple, list, str, int)) else None
    kind = ("class" if inspect.isclass(obj) else "function" if callable(obj)
            else "module" if isinstance(obj, types.ModuleType) else "data")
    head = f"{'#' * level} `{name}{_signature(obj) if kind in ('class', 'function') else ''}`"
    out = [head, "", f"*{kind}*", ""]
    if kind == "data":
        out += [f"`{type(obj).__name__}`" + (f" of {len(obj)} entries" if hasattr(obj, "__len__")
                                             else ""), ""]
    elif doc:
        out += [doc, ""]
    else:
        missing.append(name)
    return out


#: documented modules that are not in ``quantscope.__all__`` (README names them)
EXTRA_MODULES = ("distributed", "observers")


def render() -> tuple[str, list[str], list[str]]:
    """(markdown, names covered, public names without a docstring)."""
    import quantscope

    lines = ["# quantscope API reference", "",
             "Generated from the docstrings by `make docs` (docs/api.py); do not edit.", ""]
    covered, missing = [], []
    import importlib

    for name in [*sorted(quantscope.__all__), *EXTRA_MODULES]:
        obj = (importlib.import_module(f"quantscope.{name}") if name in EXTRA_MODULES
               else getattr(quantscope, name))
        if isinstance(obj, types.ModuleType) and hasattr(obj, "__all__"):
            lines += _entry(f"quantscope.{name}", obj, 2, missing)
            for sub in sorted(obj.__all__):
                lines += _entry(f"quantscope.{name}.{sub}", getattr(obj, sub), 3, missing)
        else:
            lines += _entry(f"quantscope.{name}", obj, 2, missing)
        covered.append(name)
    return "\n".join(lines) + "\n", covered, missing


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    text, covered, missing = render()
    with open(argv[0], "w") as f:
        f.write(text)
    print(f"{argv[0]}: {len(covered)} public names, {text.count(chr(10))} lines")
    if missing:
        print("no docstring: " + ", ".join(missing), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
