"""Import structure: every module imports alone, and no module imports a higher layer.

The layers (docs/architecture.md), lowest first; a module may import its own layer and
those below, at module level or inside a function; and no module imports another in a
circle, whether the imports run at load time or inside functions. ``quantscope.distributed`` is the public
facade of data-parallel sync (it re-exports from comm, stats, observers and calibration), so it
sits at the top beside the CLI.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "quantscope"

LAYERS = [
    ("core", ["_checks", "_plainchecks", "_jsonfile", "_numerics", "_oplib", "_versions", "_locks", "formats", "scales", "layout", "spec", "qparams", "qdq",
              "presets", "comm", "kernels", "exporters.atomic", "exporters.atomic_swap",
              "exporters.registry",
              "exporters.moe_slots"]),
    ("stats", ["stats"]),
    ("estimators", ["estimators"]),
    ("observers", ["observers"]),
    ("compat", ["compat", "integrations"]),
    ("calibration", ["calibration"]),
    ("top", ["exporters", "cli", "distributed", "demo", "__main__"]),
]

# Upward imports kept on purpose (none today): each would be a convenience entry point that
# delegates to a higher layer at call time. A new one fails the test: move the code down
# instead (as exporters.registry did for Calibration.export), or add it here with the reason.
ALLOWED_UPWARD: set[tuple[str, str]] = set()


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        yield ".".join(parts), path


def _layer(mod: str) -> int:
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    if best is None:
        raise AssertionError(f"module quantscope.{mod} is in no layer: add it to LAYERS")
    return best


def _imports(mod: str, path: pathlib.Path, is_pkg: bool):
    """(imported quantscope module, line) of every import in the file, nested ones too."""
    return _imports_tree(mod, ast.parse(path.read_text()), is_pkg)


def _imports_tree(mod: str, tree, is_pkg: bool):
    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[:len(pkg) - node.level + 1] if node.level > 1 else pkg
                base = [b for b in base if b]
                target = ".".join([*base, node.module] if node.module else base)
            elif node.module and node.module.startswith("quantscope"):
                target = node.module[len("quantscope."):] if "." in node.module else ""
            else:
                continue
            names = [a.name for a in node.names]
            for n in names:  # ``from . import x`` may name a submodule
                sub = f"{target}.{n}" if target else n
                if (SRC / sub.replace(".", "/")).with_suffix(".py").exists() or \
                        (SRC / sub.replace(".", "/") / "__init__.py").exists():
                    yield sub, node.lineno
                elif target:
                    yield target, node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("quantscope."):
                    yield a.name[len("quantscope."):], node.lineno


def _module_level_graph():
    """``{module: {module it imports at module level}}`` (function-level imports left out:
    those run at call time, when every module is loaded)."""
    graph = {}
    for mod, path in _modules():
        tree = ast.parse(path.read_text())
        top = ast.Module(body=[n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))],
                         type_ignores=[])
        tmp = path.with_name(path.name)  # same package position
        graph[mod] = {t for t, _ in _imports_tree(mod, top, tmp.name == "__init__.py") if t}
    return graph


def _upward():
    bad = []
    for mod, path in _modules():
        if not mod:
            continue  # the top-level package maps public names to every layer
        me = _layer(mod)
        for target, line in _imports(mod, path, path.name == "__init__.py"):
            if not target or (mod, target) in ALLOWED_UPWARD:
                continue
            if _layer(target) > me:
                bad.append(f"quantscope.{mod}:{line} imports quantscope.{target} "
                           f"({LAYERS[me][0]} -> {LAYERS[_layer(target)][0]})")
    return bad


def test_no_upward_import():
    bad = _upward()
    assert not bad, "upward imports:\n" + "\n".join(bad)


def _cycles(graph):
    """Import circles among modules at module level (each found once, as a path)."""
    out, state = [], {}

    def visit(m, stack):
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            # importing ``a.b`` runs ``a``'s __init__ first
            for dep in [".".join(t.split(".")[:i]) for i in range(1, t.count(".") + 2)]:
                if dep not in graph or dep == m:
                    continue
                if state.get(dep) == 1 and dep in stack:
                    out.append(stack[stack.index(dep):] + [dep])
                elif dep not in state:
                    visit(dep, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    return out


def test_no_import_circle_at_module_level():
    # a package importing its own submodules (``calibration`` -> ``calibration.results.apply``)
    # is not a circle; a submodule importing its package's __init__ back is
    cycles = [c for c in _cycles(_module_level_graph())
              if not all(x == c[0] or x.startswith(c[0] + ".") for x in c)]
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _full_graph():
    """``{module: {module it imports}}``, imports inside functions included (an import that
    runs at call time is still a dependency: issue 36 item 5)."""
    return {mod: {t for t, _ in _imports(mod, path, path.name == "__init__.py") if t}
            for mod, path in _modules()}


def _own_package_circles(graph):
    """A submodule that imports its own package (an ancestor's ``__init__``) while that
    package reaches the submodule back: ``(submodule, package)`` pairs."""
    out = []
    for mod, targets in graph.items():
        for pkg in sorted(targets):
            if pkg == mod or not (pkg == "" or mod.startswith(pkg + ".")):
                continue
            seen, todo = set(), [pkg]
            while todo:
                m = todo.pop()
                for t in graph.get(m, ()):
                    if t not in seen:
                        seen.add(t)
                        todo.append(t)
            if mod in seen:
                out.append((mod, pkg or "quantscope"))
    return out


def test_no_import_circle_at_all():
    # a package importing its own submodules is not a circle; a submodule importing its
    # package back while the package (at any depth, at call time too) imports the submodule is
    graph = _full_graph()
    cycles = [c for c in _cycles(graph)
              if not all(x == c[0] or x.startswith(c[0] + ".") for x in c)]
    cycles += [[m, p, m] for m, p in _own_package_circles(graph)]
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_own_package_circle_check_can_fail():
    graph = {"obs": {"obs.reg", "obs.minmax"}, "obs.reg": {"obs"}, "obs.minmax": {"obs.reg"}}
    assert ("obs.reg", "obs") in _own_package_circles(graph)
    assert _own_package_circles({"obs": {"obs.reg"}, "obs.reg": set()}) == []


def test_circle_check_catches_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_layering_check_catches_an_upward_import(tmp_path, monkeypatch):
    # the check itself can fail: a stats module importing an observer is reported
    fake = tmp_path / "quantscope"
    (fake / "stats").mkdir(parents=True)
    (fake / "observers").mkdir()
    (fake / "stats" / "__init__.py").write_text("")
    (fake / "observers" / "__init__.py").write_text("")
    (fake / "observers" / "base.py").write_text("")
    (fake / "stats" / "bad.py").write_text("def f():\n    from ..observers import base\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", fake)
    assert any("stats.bad:2 imports quantscope.observers.base" in b for b in _upward())


@pytest.mark.extended  # an interpreter importing every module afresh
def test_every_module_imports_alone():
    """Each module imported first in a fresh interpreter (one subprocess for all: a child
    per module would cost a torch import each). ``sys.modules`` is cleared of quantscope
    between modules, so an import circle that depends on import order shows."""
    mods = ["quantscope" + (f".{m}" if m else "") for m, _ in _modules()
            if not m.endswith("__main__")]
    code = (
        "import importlib, sys, traceback\n"
        f"mods = {mods!r}\n"
        "bad = []\n"
        "for m in mods:\n"
        "    for k in [k for k in sys.modules if k == 'quantscope' or "
        "k.startswith('quantscope.')]:\n"
        "        del sys.modules[k]\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except ModuleNotFoundError as e:\n"
        "        if (e.name or '').startswith('quantscope'):\n"
        "            bad.append(m + ': ' + traceback.format_exc(limit=3))\n"
        "    except Exception:\n"
        "        bad.append(m + ': ' + traceback.format_exc(limit=3))\n"
        "print('\\n'.join(bad))\n"
        "sys.exit(1 if bad else 0)\n"
    )
    src = str(SRC.parent)
    env = {"PYTHONPATH": src, "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=600, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("mod", ["stats.histogram_sync", "calibration.run.gather",
                                 "observers.sync"])
def test_layers_of_the_sync_modules(mod):
    assert _layer(mod) < _layer("distributed")
