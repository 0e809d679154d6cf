"""List the modules over 500 lines and the functions over 60 lines of a source tree.

    python docs/sizes.py [src/quantscope]     (make sizes)

The project's size rule (issue 21): no module over 500 lines, no function over ~60. A
function's size is its code: its docstring is not counted (documenting every argument of a
public entry point, as ``calibrate_many`` does for twenty, is not what the rule limits).
tests/package/test_sizes.py holds the tree to the rule.
"""

from __future__ import annotations

import ast
import pathlib
import sys

MODULE_LINES, FUNCTION_LINES = 500, 60


def function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The lines of a function from its ``def`` to its end, less its docstring."""
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
            and isinstance(first.value.value, str):
        lines -= first.end_lineno - first.lineno + 1
    return lines


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
                lines = function_lines(node)
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
