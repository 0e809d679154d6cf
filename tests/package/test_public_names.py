"""Public functions and modules have distinct names, so no module swaps its class to keep a
function over a submodule of the same name (issue 36 item 5)."""

from __future__ import annotations

import importlib
import pathlib
import subprocess
import sys
import types

import pytest

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "quantscope"


def test_quantize_stays_the_function_after_every_module_loads():
    # importing a submodule sets the package's attribute of its name: ``quantscope.quantize``
    # would become the module if the quantizer module still had that name
    code = (
        "import sys, types, inspect, quantscope\n"
        "import quantscope.qdq, quantscope.calibration, quantscope.exporters, quantscope.cli\n"
        "assert type(sys.modules['quantscope']) is types.ModuleType, type(quantscope)\n"
        "for name in ('quantize', 'dequantize', 'fake_quantize'):\n"
        "    assert inspect.isfunction(getattr(quantscope, name)), name\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={"PYTHONPATH": str(SRC.parent), "PATH": "/usr/bin:/bin",
                            "OMP_NUM_THREADS": "1"}, timeout=600, check=False)
    assert r.returncode == 0, r.stderr


def test_top_level_package_is_a_plain_module():
    import quantscope

    assert type(quantscope) is types.ModuleType


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PYTHONPATH": str(SRC.parent), "PATH": "/usr/bin:/bin",
                               "OMP_NUM_THREADS": "1"}, timeout=600, check=False)


#: documented attribute spellings of the public functions (README, docs/guide)
FUNCTION_ATTRIBUTES = {
    "calibrate": ("calibration", ["load", "save", "preset", "apply", "sensitivity", "empty_model",
                                  "Recipe", "Role", "Rule", "Calibration", "RECIPES", "PRESETS",
                                  "Sequential", "Auto", "fallback_curve", "calibrate_many"]),
    "export": ("exporters", ["register", "FORMATS", "check", "exporter"]),
}


def test_public_functions_keep_their_documented_attributes():
    import inspect

    import quantscope

    for name, (package, attributes) in FUNCTION_ATTRIBUTES.items():
        function = getattr(quantscope, name)
        assert inspect.isfunction(function), name
        module = importlib.import_module(f"quantscope.{package}")
        assert function is getattr(module, name)
        for attribute in attributes:
            # the same object the package exports, not a copy
            assert getattr(function, attribute) is getattr(module, attribute), attribute
        assert set(module.__all__) <= set(vars(function)), name


def test_the_documented_module_attributes_load_on_first_use():
    """distributed.md writes ``quantscope.distributed.sync_observers(...)`` after a plain
    ``import quantscope``: that raised AttributeError (session 33)."""
    r = _run("import quantscope\n"
             "assert callable(quantscope.distributed.sync_observers)\n"
             "assert callable(quantscope.distributed.gather_samples)\n"
             "assert quantscope.presets.NVFP4 is not None and quantscope.scales.ScaleEncoding\n")
    assert r.returncode == 0, r.stderr


@pytest.mark.extended  # an interpreter importing every module
def test_no_module_swaps_its_class_after_every_module_loads():
    # every module of the package imported, then each is a plain module and the public
    # functions are still functions (a submodule import cannot shadow them: distinct names)
    code = (
        "import importlib, inspect, pkgutil, sys, types, quantscope\n"
        "for m in pkgutil.walk_packages(quantscope.__path__, 'quantscope.'):\n"
        "    if m.name.endswith('__main__'):\n"
        "        continue\n"
        "    try:\n"
        "        importlib.import_module(m.name)\n"
        "    except ModuleNotFoundError as e:  # an optional toolkit (compat/) not installed\n"
        "        if (e.name or '').startswith('quantscope'):\n"
        "            raise\n"
        "odd = [k for k, v in sys.modules.items() if (k == 'quantscope' or\n"
        "       k.startswith('quantscope.')) and type(v) is not types.ModuleType]\n"
        "assert not odd, odd\n"
        f"for name in {sorted(FUNCTION_ATTRIBUTES)!r}:\n"
        "    assert inspect.isfunction(getattr(quantscope, name)), name\n"
        "print(sum(k.startswith('quantscope.') for k in sys.modules))\n"
    )
    r = _run(code)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.split()[-1]) > 50  # the walk did import the package's modules


def test_reading_a_checkpoint_imports_no_compressed_tensors():
    # compressed-tensors takes ~3 s to import: the reader (quantscope check / export) needs only
    # its spec translation, not compat.llmcompressor's observers (which subclass its
    # InternalModule)
    r = _run("import sys, quantscope.exporters.read, quantscope.cli\n"
             "print('compressed_tensors' in sys.modules)\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-1] == "False"
