"""Public functions and modules have distinct names, so no module swaps its class to keep a
function over a submodule of the same name (issue 36 item 5)."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import types

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "quantscope"


def test_quantize_stays_the_function_after_every_module_loads():
    # importing a submodule sets the package's attribute of its name: ``quantscope.quantize``
    # would become the module if the quantizer module still had that name
    code = (
        "import sys, types, inspect, quantscope\n"
        "import quantscope.qdq, quantscope.calibrate, quantscope.export, quantscope.cli\n"
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
