"""The kernel cache's key follows nested includes and every spelling of ``#include``
(review s49): a ``.c`` that an included ``.c`` includes in turn, and ``#  include "x.c"``
(spaces after the ``#``, an indented directive), were read by the build but missing from
the key, so an edit to them served the library built from the old text. The key also holds
the CPU that ``-march=native`` compiles for (pinned after s61's mutation round)."""

import ctypes
import shutil

import pytest

from quantscope.kernels import cache

CC = shutil.which("cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler")


def _answer(target) -> int:
    so = ctypes.CDLL(str(target))
    so.answer.restype = ctypes.c_int64
    return so.answer()


@pytest.fixture
def folders(tmp_path, monkeypatch):
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir(mode=0o700)
    monkeypatch.setenv("QUANTSCOPE_CACHE", str(cache_dir))
    include, tests = tmp_path / "csrc", tmp_path / "tests"
    include.mkdir()
    tests.mkdir()
    return include, tests


def _rebuilds_on_edit(wrapper, inner, include):
    inner.write_text("long answer(void) { return 1; }\n")
    first = cache.build("kernel_test", wrapper, [CC], include)
    assert _answer(first) == 1
    inner.write_text("long answer(void) { return 2; }\n")
    second = cache.build("kernel_test", wrapper, [CC], include)
    assert second != first
    assert _answer(second) == 2


def test_a_source_included_by_an_included_source_is_part_of_the_key(folders):
    include, tests = folders
    wrapper = tests / "kernel_test.c"
    wrapper.write_text('#include "middle.c"\n')
    (include / "middle.c").write_text('#define MIDDLE 1\n#include "inner.c"\n')
    _rebuilds_on_edit(wrapper, include / "inner.c", include)


@pytest.mark.parametrize("directive", ['#  include "kernel.c"', '  #include "kernel.c"',
                                       '#\tinclude\t"kernel.c"'],
                         ids=["spaced", "indented", "tabs"])
def test_every_spelling_of_the_directive_is_followed(folders, directive):
    include, tests = folders
    wrapper = tests / "kernel_test.c"
    wrapper.write_text(f"{directive}\n")
    _rebuilds_on_edit(wrapper, include / "kernel.c", include)


def test_sources_that_include_each_other_are_read_once(folders):
    include, tests = folders
    wrapper = tests / "kernel_test.c"
    wrapper.write_text('#include "a.c"\n')
    (include / "a.c").write_text('#ifndef A\n#define A\n#include "b.c"\n#endif\n')
    (include / "b.c").write_text('#include "a.c"\nlong answer(void) { return 1; }\n')
    assert len(cache._texts(wrapper, include)) == 3


def test_another_cpu_is_part_of_the_key(folders, monkeypatch):
    """Pin (s61 mutation): the library is built with ``-march=native``, so the key holds
    the CPU (``cache._cpu_id``: its model and feature flags). A cache shared with another
    kind of CPU (a home folder on NFS, a container image) must build that CPU its own
    library rather than load one that may hold instructions it lacks (SIGILL)."""
    include, tests = folders
    wrapper = tests / "kernel_test.c"
    wrapper.write_text("long answer(void) { return 1; }\n")
    this_cpu = cache._cpu_id
    here = cache.build("kernel_test", wrapper, [CC], include)
    monkeypatch.setattr(cache, "_cpu_id", lambda: "x86_64\nmodel name: another CPU\nflags: sse2")
    there = cache.build("kernel_test", wrapper, [CC], include)
    assert there != here and there.is_file() and _answer(there) == 1
    monkeypatch.setattr(cache, "_cpu_id", this_cpu)  # back here: its library, no third build
    assert cache.build("kernel_test", wrapper, [CC], include) == here
