"""The kernel cache's key covers every file a build reads: a source that includes another
``.c`` by name (the tests build ``mse_search.c`` under other SIMD flags through such wrappers)
is rebuilt when the included file changes. The key had hashed the wrapper and the headers
only, so the test builds ran the library of an older ``mse_search.c``."""

import ctypes
import shutil
import subprocess

import pytest

from quantscope.kernels import cache

CC = shutil.which("cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler")


def _answer(target) -> int:
    so = ctypes.CDLL(str(target))
    so.answer.restype = ctypes.c_int64
    return so.answer()


@pytest.mark.parametrize("beside", [False, True], ids=["from_include", "beside_source"])
def test_an_included_source_is_part_of_the_key(tmp_path, monkeypatch, beside):
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir(mode=0o700)
    monkeypatch.setenv("QUANTSCOPE_CACHE", str(cache_dir))
    include, tests = tmp_path / "csrc", tmp_path / "tests"
    include.mkdir()
    tests.mkdir()
    (include / "kernel.c").write_text("long answer(void) { return 1; }\n")
    wrapper = tests / "kernel_test.c"
    wrapper.write_text('#define FLAVOUR 1\n#include "kernel.c"\n')
    inner = (tests if beside else include) / "kernel.c"
    inner.write_text("long answer(void) { return 1; }\n")
    first = cache.build("kernel_test", wrapper, [CC], include)
    assert _answer(first) == 1
    inner.write_text("long answer(void) { return 2; }\n")
    second = cache.build("kernel_test", wrapper, [CC], include)
    assert second != first
    assert _answer(second) == 2


def test_an_included_source_found_nowhere_is_the_compilers_error(tmp_path, monkeypatch):
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir(mode=0o700)
    monkeypatch.setenv("QUANTSCOPE_CACHE", str(cache_dir))
    wrapper = tmp_path / "kernel_test.c"
    wrapper.write_text('#include "missing.c"\n')
    with pytest.raises(subprocess.CalledProcessError):
        cache.build("kernel_test", wrapper, [CC], tmp_path)
