"""The kernel cache runs only what the user built: a folder or library others can write is
refused (the torch path runs), built libraries are private whatever the umask, and a
``$CC`` asking for fast-math cannot take IEEE NaN handling away from the kernels."""

import os
import shutil

import pytest
import torch

from quantscope import kernels, presets, qparams
from quantscope.kernels import cache

CC = shutil.which("cc") or shutil.which("gcc")
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler")


def _nan_range_reported() -> bool:
    """``qs_int_qparams`` on a range holding NaN says so (returns 1)."""
    lib = kernels.lib("int_qparams")
    assert lib is not None
    lo, hi = torch.tensor([float("nan")]), torch.tensor([1.0])
    consts = torch.tensor([-128.0, 127.0, 1e-8, 0.0, 0.0], dtype=torch.float64)
    scale, zp = torch.empty(1), torch.empty(1, dtype=torch.int32)
    return lib.qs_int_qparams(lo.data_ptr(), hi.data_ptr(), 1, consts.data_ptr(),
                              scale.data_ptr(), zp.data_ptr()) == 1


@needs_cc
@pytest.mark.parametrize("flag", ["-ffast-math", "-Ofast", "-ffinite-math-only"])
def test_fast_math_in_cc_keeps_nan_checks(fresh, monkeypatch, flag):
    monkeypatch.setenv("CC", f"{CC} {flag}")
    assert _nan_range_reported()


def _refused():
    """int_qparams (the quickest library to build: these paths are every library's) is
    refused, and qparams_from_range runs its torch branch."""
    lo, hi = -torch.rand(8), torch.rand(8)
    with pytest.warns(kernels.KernelWarning, match="it is not yours alone"):
        assert kernels.lib("int_qparams") is None
    assert qparams._int_qparams_kernel(lo, hi, presets.get("int8")) is None
    assert qparams.qparams_from_range(lo, hi, presets.get("int8")).scale.shape == (8,)


@needs_cc
def test_world_writable_cache_folder_is_refused(fresh):
    fresh.mkdir()
    fresh.chmod(0o777)  # a shared folder: anyone could plant a library under the key's name
    _refused()
    assert not list(fresh.glob("*.so"))


@needs_cc
def test_cached_library_others_can_write_is_not_loaded(fresh, monkeypatch):
    assert kernels.lib("int_qparams") is not None
    (built,) = fresh.glob("int_qparams-*.so")
    built.chmod(0o666)
    monkeypatch.setattr(kernels, "_libs", {})
    _refused()


@needs_cc
def test_built_libraries_are_private_whatever_the_umask(fresh):
    old = os.umask(0o000)
    try:
        assert kernels.lib("int_qparams") is not None
    finally:
        os.umask(old)
    (built,) = fresh.glob("int_qparams-*.so")
    assert fresh.stat().st_mode & 0o077 == 0
    assert built.stat().st_mode & 0o077 == 0


def test_others_write_allows_only_the_users_private_group(tmp_path):
    path = tmp_path / "f"
    path.write_text("")
    path.chmod(0o600)
    assert not cache.others_write(path.stat())
    path.chmod(0o602)
    assert cache.others_write(path.stat())
    path.chmod(0o620)
    import grp
    import pwd

    group = grp.getgrgid(os.getgid())
    own = path.stat().st_gid == os.getgid() and not group.gr_mem and (
        group.gr_name == pwd.getpwuid(os.getuid()).pw_name)
    assert cache.others_write(path.stat()) is not own


def test_a_shared_primary_group_without_members_is_not_private(tmp_path, monkeypatch):
    """``nogroup`` lists no members, yet is the primary group of several accounts: only a
    group named as the user (a user private group) counts as the user's own."""
    import grp
    import pwd

    path = tmp_path / "f"
    path.write_text("")
    path.chmod(0o620)
    gid = path.stat().st_gid
    monkeypatch.setattr(os, "getgid", lambda: gid)
    for name, shared in (("nogroup", True), (pwd.getpwuid(os.getuid()).pw_name, False)):
        monkeypatch.setattr(grp, "getgrgid", lambda g, n=name: grp.struct_group(
            (n, "x", g, [])))
        assert cache.others_write(path.stat()) is shared


@needs_cc
def test_a_build_removes_the_scratch_folders_killed_builds_left(fresh):
    fresh.mkdir(mode=0o700)
    old = 2 * cache._BUILD_TIMEOUT + 60  # seconds: older than any build can run
    dead, running = fresh / f"{cache._SCRATCH}dead", fresh / f"{cache._SCRATCH}running"
    others = [fresh / "tmpkeep", fresh / "notes"]  # not a build's: never touched
    for folder in (dead, running, others[0]):
        folder.mkdir()
        (folder / "half.so").write_bytes(b"\0")
    others[1].mkdir()
    for folder in (dead, others[0], others[1]):
        os.utime(folder, (os.path.getmtime(folder) - old,) * 2)
    assert kernels.lib("int_qparams") is not None  # builds into the cache
    assert not dead.exists()
    assert running.exists() and all(p.exists() for p in others)
    assert not [p for p in fresh.glob(f"{cache._SCRATCH}*") if p not in (running,)]
