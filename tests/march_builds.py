"""A C kernel built for another ``-march`` than the loaded one (``native``): CI machines
without AVX-512 run the AVX2 branches, those without AVX2 the scalar ones, so the tests build
each here and compare it with the native build."""

import ctypes
import shutil
import subprocess
from pathlib import Path

from quantscope import kernels

#: the C compiler (None: none here, the builds' tests skip)
CC = shutil.which("cc") or shutil.which("gcc")


def cpu_has(*flags: str) -> bool:
    """Whether this CPU has every one of ``flags`` (``/proc/cpuinfo``'s names)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(f" {flag}" in text for flag in flags)


def build(name: str, march: str, folder) -> ctypes.CDLL:
    """``csrc/<name>.c`` built with the project's flags for ``-march=<march>``, loaded with
    its ``kernels.SIGNATURES`` (int64 results)."""
    flags = [f if f != "-march=native" else f"-march={march}" for f in kernels.FLAGS]
    out = Path(folder) / f"{name}_{march}.so"
    subprocess.run([CC, *flags, f"-I{kernels.CSRC}", str(kernels.CSRC / f"{name}.c"), "-o",
                    str(out), "-lm"], check=True, capture_output=True, text=True)
    so = ctypes.CDLL(str(out))
    for fn, types in kernels.SIGNATURES[name].items():
        getattr(so, fn).restype, getattr(so, fn).argtypes = ctypes.c_int64, types
    return so
