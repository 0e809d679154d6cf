"""quantscope.kernels: the C sources compile without a warning, the loader builds from
them, survives odd compilers and corrupt caches, and says once when it cannot build."""

import ast
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
from tiers import each_value

from quantscope import kernels, presets, qparams
from quantscope.stats import minmax

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the test extra's backport
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(kernels.CSRC.glob("*.c")) + sorted((ROOT / "tests" / "kernels" / "csrc").glob("*.c"))
CC = shutil.which("cc") or shutil.which("gcc")
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler")


def _compiles(march: str) -> bool:
    r = subprocess.run([CC, f"-march={march}", "-x", "c", "-c", "-", "-o", os.devnull],
                       input="int x;", capture_output=True, text=True, check=False)
    return r.returncode == 0


@needs_cc
@pytest.mark.parametrize(("name", "march"),
                         each_value([p.name for p in SOURCES],
                                    ["native", "x86-64", "haswell", "skylake-avx512"]))
def test_every_source_compiles_without_warnings(name, march, tmp_path):
    """CI's -Werror build, on each SIMD branch (scalar, AVX2, AVX-512) the sources hold."""
    source = next(p for p in SOURCES if p.name == name)
    if march != "native" and not _compiles(march):
        pytest.skip(f"{CC} cannot target -march={march} here")
    flags = [f if f != "-march=native" else f"-march={march}" for f in kernels.FLAGS]
    r = subprocess.run([CC, *flags, "-Wall", "-Wextra", "-Werror", f"-I{kernels.CSRC}", "-c",
                        str(source), "-o", str(tmp_path / "k.o")],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr


def test_signatures_name_every_source_and_exported_function():
    names = {p.stem for p in kernels.CSRC.glob("*.c")}
    assert names == set(kernels.SIGNATURES)
    for name, fns in kernels.SIGNATURES.items():
        text = (kernels.CSRC / f"{name}.c").read_text()
        exported = set(re.findall(r"^(?:int64_t|void|int) (qs_\w+)\(", text, re.MULTILINE))
        assert exported == set(fns), name


def test_no_c_source_in_python_strings():
    for path in (ROOT / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert "#include" not in node.value, path


def test_pyproject_ships_the_sources_as_package_data():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = conf["tool"]["setuptools"]["package-data"]["quantscope"]
    shipped = {p for pat in patterns for p in (ROOT / "src" / "quantscope").glob(pat)}
    assert set(kernels.CSRC.glob("*.[ch]")) <= shipped


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache and a loader that has loaded nothing and warned about nothing."""
    monkeypatch.setenv("QUANTSCOPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("QUANTSCOPE_NO_KERNEL", raising=False)
    monkeypatch.setattr(kernels, "_libs", {})
    monkeypatch.setattr(kernels, "_warned", False)
    return tmp_path / "cache"


def _qparams_work():
    """The tests of the loader and its cache build int_qparams (their paths are every
    library's; it builds in 0.2 s, unit_minmax in 6 s): it loads and computes what
    qparams_from_range's torch branch computes."""
    assert kernels.lib("int_qparams") is not None
    lo, hi, int8 = -torch.rand(64), torch.rand(64), presets.get("int8")
    got = qparams._int_qparams_kernel(lo, hi, int8)
    with mock.patch.object(qparams, "_int_qparams_kernel", lambda *a, **k: None):
        want = qparams.qparams_from_range(lo, hi, int8)
    assert torch.equal(got.scale, want.scale) and torch.equal(got.zero_point, want.zero_point)


@needs_cc
def test_cc_with_arguments_builds(fresh, monkeypatch):
    """$CC is a shell word list (``ccache gcc``, ``gcc -m64``), not one executable name."""
    monkeypatch.setenv("CC", f"'{CC}' -DQS_UNUSED=1")
    assert kernels.compiler() == [CC, "-DQS_UNUSED=1"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", kernels.KernelWarning)
        _qparams_work()


@needs_cc
@pytest.mark.parametrize("damage", ["corrupt", "truncated"])
def test_damaged_cached_library_is_rebuilt(fresh, monkeypatch, damage):
    """A damaged cache entry (a crash mid-copy, a full disk: bytes that are no library, or
    a library cut short) is built again, silently, not mapped: ctypes loads a truncated file
    and the process dies (SIGBUS) when it runs the missing code. Checked in a new process,
    as this one keeps the library it loaded (dlopen reuses it by path), and a crash there
    fails the test, not pytest."""
    monkeypatch.setenv("CC", CC)
    _qparams_work()
    (built,) = fresh.glob("int_qparams-*.so")
    good = built.read_bytes()
    built.unlink()  # a new file under the name: this process still maps the old one
    built.write_bytes(b"not a shared object" if damage == "corrupt" else good[:len(good) // 2])
    code = ("import warnings, torch; from quantscope import kernels, presets, qparams; "
            "warnings.simplefilter('error'); lib = kernels.lib('int_qparams'); "
            "lo, hi = -torch.rand(64), torch.rand(64); "
            "got = qparams._int_qparams_kernel(lo, hi, presets.get('int8')); "
            "print(lib is not None and got is not None)")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       check=False, timeout=300)
    assert (r.returncode, r.stdout.strip()) == (0, "True"), r.stderr
    rebuilt = built.read_bytes()
    assert rebuilt[:4] == b"\x7fELF" and len(rebuilt) == len(good)


@needs_cc
def test_failed_build_is_said_once(fresh, monkeypatch):
    monkeypatch.setenv("CC", f"{CC} -DQS_NOT_DEFINED -include /nonexistent/header.h")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        libs = kernels.lib("unit_minmax"), kernels.lib("hist_kernel")
    assert libs == (None, None)
    assert len(record) == 1 and issubclass(record[0].category, kernels.KernelWarning)
    assert "could not build" in str(record[0].message)
    x = torch.randn(4, 1 << 16)  # and the callers run their torch path
    lo, hi = minmax.unit_minmax(x)
    assert torch.equal(lo, x.amin(1)) and torch.equal(hi, x.amax(1))


def test_no_compiler_is_said_once(fresh, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/bin/cc")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        libs = kernels.lib("unit_minmax"), kernels.lib("entropy")
    assert libs == (None, None)
    assert len(record) == 1 and issubclass(record[0].category, kernels.KernelWarning)
    assert "no C compiler" in str(record[0].message)


def test_a_cc_that_does_not_split_is_said_once(fresh, monkeypatch):
    # shlex's "No closing quotation" escaped to the caller: calibrate failed naming a layer
    monkeypatch.setenv("CC", 'gcc "-O2')
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert kernels.lib("unit_minmax") is None
    assert len(record) == 1 and issubclass(record[0].category, kernels.KernelWarning)
    assert "$CC='gcc \"-O2' is no command line" in str(record[0].message)
    x = torch.randn(4, 1 << 16)  # and the callers run their torch path
    lo, hi = minmax.unit_minmax(x)
    assert torch.equal(lo, x.amin(1)) and torch.equal(hi, x.amax(1))


def test_no_kernel_switch_is_silent(fresh, monkeypatch):
    monkeypatch.setenv("QUANTSCOPE_NO_KERNEL", "1")
    monkeypatch.setenv("CC", "/nonexistent/bin/cc")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.lib("unit_minmax") is None


@needs_cc
def test_cache_key_has_no_host_name(fresh, monkeypatch):
    """The key names what the code depends on (sources, flags, compiler, CPU), not the host."""
    import platform

    monkeypatch.setenv("CC", CC)
    kernels.lib("entropy")
    first = {p.name for p in fresh.glob("entropy-*.so")}
    monkeypatch.setattr(platform, "node", lambda: "another-host")
    monkeypatch.setattr(kernels, "_libs", {})
    kernels.lib("entropy")
    assert {p.name for p in fresh.glob("entropy-*.so")} == first


def _unwritable_cache(kind, tmp_path):
    if kind == "proc":  # mkdir there fails with FileNotFoundError, as a missing compiler does
        if not os.path.isdir("/proc/self"):
            pytest.skip("no /proc")
        return "/proc/quantscope-cache"
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a folder")
    return str(blocker / "cache")


@needs_cc
@pytest.mark.parametrize("kind", ["proc", "under_a_file"])
def test_unwritable_cache_folder_is_named_once(fresh, monkeypatch, tmp_path, kind):
    """An unusable $QUANTSCOPE_CACHE is said as such (not as a missing compiler), once, and
    the callers run their torch path."""
    folder = _unwritable_cache(kind, tmp_path)
    monkeypatch.setenv("QUANTSCOPE_CACHE", folder)
    monkeypatch.setenv("CC", CC)
    said = f"cannot write its kernel cache folder {re.escape(repr(folder))}"
    with pytest.warns(kernels.KernelWarning, match=said) as record:
        libs = kernels.lib("unit_minmax"), kernels.lib("entropy")
    assert libs == (None, None)
    assert len(record) == 1 and "no C compiler" not in str(record[0].message)
    x = torch.randn(4, 1 << 16)
    lo, hi = minmax.unit_minmax(x)
    assert torch.equal(lo, x.amin(1)) and torch.equal(hi, x.amax(1))
