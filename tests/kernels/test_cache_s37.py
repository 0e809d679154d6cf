"""Probe s37, the kernel cache and its compiler: a cache folder reached through a link is
checked where it leads (not refused as the link's "owner"); a ``$CC`` whose program is
missing is named, never replaced by cc / gcc; a compiler that exits 0 and writes nothing is
said as such (not as "no C compiler"); ``python -m quantscope.kernels`` takes no arguments.
Every cache here is a temporary folder (``QUANTSCOPE_CACHE``)."""

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from quantscope import kernels

ROOT = Path(__file__).resolve().parents[2]
CC = shutil.which("cc") or shutil.which("gcc")
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler")
MISSING = "qs-no-such-cc-s37"  # a $CC program on no PATH


def _said(name="int_qparams", **kw) -> str:
    """The one warning that loading ``name`` gives (it must give one, and no library)."""
    with pytest.warns(kernels.KernelWarning) as record:
        assert kernels.load(name, kernels.SIGNATURES.get(name, {}), **kw) is None
    assert len(record) == 1
    return str(record[0].message)


# ---------------------------------------------------------------- D1
@needs_cc
@pytest.mark.parametrize("slash", ["", "/"])
def test_cache_folder_through_a_link_is_checked_where_it_leads(fresh, monkeypatch, tmp_path,
                                                               slash):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    monkeypatch.setenv("QUANTSCOPE_CACHE", str(tmp_path / "link") + slash)
    with warnings.catch_warnings():
        warnings.simplefilter("error", kernels.KernelWarning)  # a refused cache warns
        assert kernels.lib("int_qparams") is not None
    assert len(list(real.glob("int_qparams-*.so"))) == 1


@needs_cc
def test_link_to_a_folder_others_can_write_is_refused_naming_it(fresh, monkeypatch, tmp_path):
    real = tmp_path / "shared"
    real.mkdir()
    real.chmod(0o777)  # the folder's mode, not the link's (always lrwxrwxrwx), decides
    (tmp_path / "link").symlink_to(real)
    monkeypatch.setenv("QUANTSCOPE_CACHE", str(tmp_path / "link"))
    said = _said()
    assert "it is not yours alone" in said and repr(str(real)) in said, said
    assert "drwxrwxrwx" in said and not list(real.glob("*.so"))


# ---------------------------------------------------------------- D2
def test_cc_naming_a_missing_program_is_named_not_replaced(fresh, monkeypatch):
    monkeypatch.setenv("CC", f"{MISSING} -O2")
    said = _said()
    assert f"$CC='{MISSING} -O2'" in said and "not found on the PATH" in said, said
    assert "never cc or gcc" in said
    with pytest.raises(kernels.cache.NoCompiler, match="not found on the PATH"):
        kernels.compiler()  # not cc or gcc, which are on the PATH


def test_kernels_command_names_the_missing_cc(fresh, monkeypatch, capsys):
    from quantscope.kernels.__main__ import main

    monkeypatch.setenv("CC", MISSING)
    with pytest.warns(kernels.KernelWarning):
        assert main([]) == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"compiler: none: $CC='{MISSING}'") and "PATH" in first, first


# ---------------------------------------------------------------- D3
@needs_cc
@pytest.mark.parametrize("cc", [f"{CC} -fsyntax-only", "true"])
def test_compiler_that_writes_no_library_is_said_as_such(fresh, monkeypatch, cc):
    if shutil.which(cc.split()[0]) is None:
        pytest.skip(f"no {cc.split()[0]}")
    monkeypatch.setenv("CC", cc)
    said = _said()
    assert "the compiler wrote no library" in said and cc.split()[-1] in said, said
    assert "no C compiler" not in said and "No such file" not in said, said
    assert not list(fresh.glob("*.so"))


def test_a_missing_source_is_no_missing_compiler(fresh, tmp_path):
    said = _said("s37_missing", source=tmp_path / "s37_missing.c")
    assert "no C compiler" not in said and "s37_missing.c" in said, said


# ---------------------------------------------------------------- python -m quantscope.kernels
def test_kernels_command_has_help_and_refuses_arguments(fresh, capsys):
    from quantscope.kernels.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "usage: python -m quantscope.kernels" in capsys.readouterr().out
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "CC": MISSING}  # builds nothing
    r = subprocess.run([sys.executable, "-m", "quantscope.kernels", "--bogus"], env=env,
                       capture_output=True, text=True, check=False, timeout=120)
    assert r.returncode == 2 and "unrecognized arguments: --bogus" in r.stderr, r.stderr
    assert "compiler:" not in r.stdout

