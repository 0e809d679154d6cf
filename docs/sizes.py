"""List the modules over 500 lines and the functions over 60 lines of a source tree.

    python docs/sizes.py [src/quantscope]     (make sizes)

The project's size rule (issue 21): no module over 500 lines, no function over ~60.
"""

from __future__ import annotations

import ast
import pathlib
import sys

MODULE_LINES, FUNCTION_LINES = 500, 60


def sizes(root: pathlib.Path) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """``(modules, functions)`` over the limits, each ``(lines, where)``, largest first."""
    mods, funcs = [], []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(root)
        n = text.count("\n")
        if n > MODULE_LINES:
            mods.append((n, str(rel)))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > FUNCTION_LINES:
                    funcs.append((lines, f"{rel}:{node.lineno} {node.name}"))
    return sorted(mods, reverse=True), sorted(funcs, reverse=True)


def main(argv: list[str]) -> int:
    root = pathlib.Path(argv[0] if argv else "src/quantscope")
    mods, funcs = sizes(root)
    print(f"modules over {MODULE_LINES} lines:")
    for n, where in mods:
        print(f"  {n:5d}  {where}")
    print(f"functions over {FUNCTION_LINES} lines:")
    for n, where in funcs:
        print(f"  {n:5d}  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
