"""Pins found by a mutation round (s67) on the custom ops' wrappers (``kernels.ops``), the
MSE search's selection op and its global-rule helpers (``kernels.select_ops``) and the C
kernels' build cache (``kernels.cache``): the argument checks each op makes on the CPU and in
its fake (meta) implementation, the shapes and dtypes the fakes promise, the selection rules
against ``estimators.mse_tiles._State`` (the rules ``mse_select`` says it applies), and what
the cache trusts, keys on and sweeps. Every cache here is a temporary folder."""

from __future__ import annotations

import hashlib
import os
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantscope.estimators.mse_tiles import _State
from quantscope.kernels import cache, ops
from quantscope.kernels.select_ops import beats, improved_rows, stop_after

DEVICES = ["cpu", "meta"]  # meta: the fake implementation, as torch.compile traces it


# ---- unit_minmax ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_unit_minmax_of_half_units_is_float32_lo_then_hi(dtype):
    units = torch.tensor([[1.5, -2.0, 0.25], [4.0, 3.0, -0.5]], dtype=dtype)
    lo, hi = ops.unit_minmax(units)
    assert lo.dtype == hi.dtype == torch.float32
    assert lo.tolist() == [-2.0, -0.5]
    assert hi.tolist() == [1.5, 4.0]


@pytest.mark.parametrize("device", DEVICES)
def test_unit_minmax_refuses_3d_units(device):
    with pytest.raises(ValueError, match=r"quantscope::unit_minmax: units must be"):
        ops.unit_minmax(torch.zeros(2, 3, 4, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(2, 2, 0, 3), (2, 2, 3, 0)])
def test_unit_minmax_refuses_4d_units_without_elements(device, shape):
    with pytest.raises(ValueError, match=r"at least one element per unit"):
        ops.unit_minmax(torch.zeros(shape, device=device))


def test_unit_minmax_of_a_4d_view_with_no_units_is_empty():
    """Zero units of a tile view: two empty float32 results, not a reshape error."""
    lo, hi = ops.unit_minmax(torch.zeros(0, 3, 2, 2, dtype=torch.bfloat16))
    assert lo.shape == hi.shape == (0,)
    assert lo.dtype == hi.dtype == torch.float32


def test_unit_minmax_fake_of_a_4d_view_has_one_float32_value_per_unit():
    lo, hi = ops.unit_minmax(torch.zeros(3, 5, 2, 4, dtype=torch.bfloat16, device="meta"))
    assert lo.shape == hi.shape == (15,)
    assert lo.dtype == hi.dtype == torch.float32


# ---- grouped_unit_minmax -------------------------------------------------------------------

def test_grouped_unit_minmax_refuses_an_empty_list():
    with pytest.raises(ValueError, match=r"grouped_unit_minmax: units must be a non-empty"):
        ops.grouped_unit_minmax([])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("second", [
    lambda d: torch.zeros(2, 3, dtype=torch.bfloat16, device=d),
    lambda d: torch.zeros(2, 0, device=d),
    lambda d: torch.zeros(2, 3, 1, device=d),
], ids=["another-dtype", "no-elements", "not-2d"])
def test_grouped_unit_minmax_refuses_a_bad_tensor_naming_its_index(device, second):
    with pytest.raises(ValueError, match=r"grouped_unit_minmax: units\[1\] must be"):
        ops.grouped_unit_minmax([torch.zeros(4, 3, device=device), second(device)])


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_unit_minmax_refuses_integer_tensors(device):
    t = torch.zeros(2, 3, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"grouped_unit_minmax: units\[0\] must be"):
        ops.grouped_unit_minmax([t, t])


def test_grouped_unit_minmax_gives_lo_then_hi_per_tensor():
    lo, hi = ops.grouped_unit_minmax([torch.tensor([[1.0, -3.0]]),
                                      torch.tensor([[2.0], [-5.0]])])
    assert [t.tolist() for t in lo] == [[-3.0], [2.0, -5.0]]
    assert [t.tolist() for t in hi] == [[1.0], [2.0, -5.0]]


def test_grouped_unit_minmax_fake_has_one_float32_value_per_row():
    lo, hi = ops.grouped_unit_minmax([torch.zeros(3, 7, dtype=torch.float16, device="meta"),
                                      torch.zeros(5, 2, dtype=torch.float16, device="meta")])
    assert [t.shape for t in lo] == [t.shape for t in hi] == [(3,), (5,)]
    assert {t.dtype for t in lo + hi} == {torch.float32}


# ---- fake_quant_int ------------------------------------------------------------------------

def _fq_args(device, U=3, E=5):
    return (torch.zeros(U, E, device=device), torch.ones(U, device=device),
            torch.zeros(U, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_fake_quant_int_refuses_3d_units(device):
    _, scale, zp = _fq_args(device)
    with pytest.raises(ValueError, match=r"quantscope::fake_quant_int: units must be a 2-D"):
        ops.fake_quant_int(torch.zeros(3, 5, 1, device=device), scale, zp, -8.0, 7.0)


@pytest.mark.parametrize("device", DEVICES)
def test_fake_quant_int_wants_one_scale_and_zero_point_per_unit_not_per_element(device):
    units, scale, zp = _fq_args(device)
    with pytest.raises(ValueError, match=r"fake_quant_int: scale must be a float32 tensor of "
                                         r"shape \(3,\)"):
        ops.fake_quant_int(units, torch.ones(5, device=device), zp, -8.0, 7.0)
    with pytest.raises(ValueError, match=r"fake_quant_int: zero_point must be a float32 tensor "
                                         r"of shape \(3,\)"):
        ops.fake_quant_int(units, scale, torch.zeros(5, device=device), -8.0, 7.0)


def test_fake_quant_int_clamps_to_qmin_and_qmax():
    units = torch.tensor([[10.0, -10.0, 2.0]])
    out = ops.fake_quant_int(units, torch.ones(1), torch.zeros(1), -8.0, 7.0)
    assert out.tolist() == [[7.0, -8.0, 2.0]]


def test_fake_quant_int_of_strided_bf16_units_is_contiguous_float32():
    units = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=torch.bfloat16).t()
    out = ops.fake_quant_int(units, torch.ones(2), torch.zeros(2), -8.0, 7.0)
    assert out.dtype == torch.float32 and out.is_contiguous()
    assert out.tolist() == [[1.0, 3.0, 5.0], [2.0, 4.0, 6.0]]


def test_fake_quant_int_fake_is_float32_of_the_units_shape():
    units = torch.zeros(3, 5, dtype=torch.bfloat16, device="meta")
    out = ops.fake_quant_int(units, torch.ones(3, device="meta"), torch.zeros(3, device="meta"),
                             -8.0, 7.0)
    assert out.shape == (3, 5) and out.dtype == torch.float32


# ---- beats, improved_rows, stop_after ------------------------------------------------------

def test_beats_takes_ties_only_with_tie_last_and_never_an_infinite_error():
    inf = float("inf")
    err, best = torch.tensor([1.0, 1.0, inf, 0.5]), torch.tensor([1.0, 2.0, inf, inf])
    assert beats(err, best, False).tolist() == [False, True, False, True]
    assert beats(err, best, True).tolist() == [True, True, False, True]


def test_improved_rows_compares_each_row_with_the_running_best():
    """Row 2 (3) improves on neither the running best 1 nor any unit: only row 0 counts."""
    err = torch.tensor([[1.0], [5.0], [3.0]])
    assert improved_rows(err, torch.tensor([10.0])).tolist() == [True, False, False]


def test_improved_rows_skips_a_nan_error_as_the_running_best():
    err = torch.tensor([[float("nan")], [5.0], [4.0]])
    assert improved_rows(err, torch.tensor([10.0])).tolist() == [False, True, True]


def test_improved_rows_counts_a_row_improving_any_one_unit():
    err = torch.tensor([[1.0, 20.0], [2.0, 20.0]])
    assert improved_rows(err, torch.tensor([10.0, 10.0])).tolist() == [True, False]


def test_improved_rows_counts_ties_with_tie_last():
    err, best = torch.tensor([[10.0], [10.0]]), torch.tensor([10.0])
    assert improved_rows(err, best, True).tolist() == [True, True]
    assert improved_rows(err, best, False).tolist() == [False, False]


@pytest.mark.parametrize(("improved", "patience", "after"), [
    ([True, True, False, False, False], 2, 3),  # two candidates after the last improving one
    ([False, False, False], 2, 1),  # none improved: the second candidate already stops it
    ([False, False, False], 5, 3),  # never: len(improved)
    ([True, False, False], 0, 0),  # patience 0: the first candidate
    ([False, True], -1, 2),  # no rule
])
def test_stop_after(improved, patience, after):
    assert stop_after(torch.tensor(improved), patience).tolist() == [after]


# ---- mse_select ----------------------------------------------------------------------------

def _select_args(K=3, U=2, dtype=torch.float64, device="cpu"):
    err = torch.zeros(K, U, dtype=dtype, device=device)
    return err, torch.zeros(K, U, dtype=torch.bool, device=device), err[0].clone()


@pytest.mark.parametrize("device", DEVICES)
def test_mse_select_checks_err_same_and_incumbent(device):
    err, same, inc = _select_args(device=device)
    with pytest.raises(ValueError, match=r"mse_select: err must be"):
        ops.mse_select(err[None], same, inc, 0, 1, True, True, False)
    with pytest.raises(ValueError, match=r"mse_select: same must be a bool tensor"):
        ops.mse_select(err, same.to(torch.uint8), inc, 0, 1, True, True, False)
    with pytest.raises(ValueError, match=r"mse_select: incumbent must be a torch.float64"):
        ops.mse_select(err, same, inc.float(), 0, 1, True, True, False)


@pytest.mark.parametrize("device", DEVICES)
def test_mse_select_ext_start_in_zero_to_candidates(device):
    err, same, inc = _select_args(device=device)
    for ext_start in (0, 3):
        idx, best = ops.mse_select(err, same, inc, ext_start, 1, True, True, False)
        assert idx.shape == best.shape == (2,)
        assert idx.dtype == torch.int64 and best.dtype == torch.float64
    for ext_start in (-1, 4):
        with pytest.raises(ValueError, match=r"mse_select: ext_start must be in \[0, 3\]"):
            ops.mse_select(err, same, inc, ext_start, 1, True, True, False)


def test_mse_select_fake_best_has_err_dtype():
    err, same, inc = _select_args(dtype=torch.float32, device="meta")
    idx, best = ops.mse_select(err, same, inc, 3, 1, False, True, False)
    assert idx.dtype == torch.int64 and best.dtype == torch.float32


@pytest.mark.parametrize(("per_unit", "want"), [(False, ([2], [1.0])), (True, ([0], [5.0]))])
def test_mse_select_extension_rows_skip_the_global_rule_but_keep_the_per_unit_one(per_unit,
                                                                                  want):
    """Grid rows 0-1, extension row 2, patience 1: the global rule stops after row 1, yet the
    extension row still runs; a unit its own rule stopped after row 1 tries no extension row."""
    err = torch.tensor([[5.0], [6.0], [1.0]], dtype=torch.float64)
    same = torch.zeros(3, 1, dtype=torch.bool)
    idx, best = ops.mse_select(err, same, torch.tensor([10.0], dtype=torch.float64), 2, 1,
                               per_unit, True, False)
    assert (idx.tolist(), best.tolist()) == want


def _one_select(errs, incumbent, patience, per_unit, use_global, same=None):
    err = torch.tensor(errs, dtype=torch.float64)
    same = torch.zeros(err.shape, dtype=torch.bool) if same is None else torch.tensor(same)
    idx, best = ops.mse_select(err, same, torch.tensor(incumbent, dtype=torch.float64),
                               err.shape[0], patience, per_unit, use_global, False)
    return idx.tolist(), best.tolist()


def test_mse_select_patience_0_global_rule_still_takes_the_first_candidate():
    assert _one_select([[1.0], [0.5]], [5.0], 0, False, True) == ([0], [1.0])


def test_mse_select_a_unit_stopped_by_its_own_rule_runs_on_until_the_global_rule_stops():
    """Per unit and global: unit 0 stops itself after row 1, but unit 1 keeps improving, so
    the global rule has not stopped and unit 0 still takes row 2."""
    errs = [[5.0, 5.0], [6.0, 4.0], [1.0, 3.0]]
    assert _one_select(errs, [10.0, 10.0], 1, True, True) == ([2, 2], [1.0, 3.0])


def test_mse_select_a_plateau_does_not_count_toward_per_unit_patience():
    same = [[False], [True], [False]]
    assert _one_select([[5.0], [6.0], [1.0]], [10.0], 1, True, False, same) == ([2], [1.0])
    assert _one_select([[5.0], [6.0], [1.0]], [10.0], 1, True, False) == ([0], [5.0])


def _state_reference(err, same, incumbent, patience, per_unit, use_global, tie_last):
    """``mse_tiles._State`` stepped candidate by candidate; a new encoded scale where
    ``same`` is False (a plateau where True)."""
    K, U = err.shape
    zeros = torch.zeros(U)
    state = _State(zeros, zeros, incumbent.clone(), None)
    sc = torch.zeros(U)
    for i in range(K):
        sc = torch.where(same[i], sc, sc + 1) if i else sc
        state.step(i, err[i], zeros, zeros, sc, torch.zeros(U, dtype=torch.int32),
                   patience=None if patience < 0 else patience, per_unit=per_unit,
                   tie="last" if tie_last else "first", use_global=use_global)
    return state.idx, state.err


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 3), st.integers(-1, 3), st.booleans(), st.booleans(),
       st.booleans(), st.data())
def test_mse_select_applies_the_state_rules(K, U, patience, per_unit, use_global, tie_last,
                                            data):
    """On the grid alone (ext_start = K), ``mse_select`` equals ``_State``'s steps, small
    integer errors making ties and plateaus common."""
    err = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, 4), min_size=U, max_size=U),
                                          min_size=K, max_size=K)), dtype=torch.float64)
    same = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=U, max_size=U),
                                           min_size=K, max_size=K)))
    same[0] = False  # the first candidate has no previous one
    incumbent = torch.tensor(data.draw(st.lists(st.integers(1, 5), min_size=U, max_size=U)),
                             dtype=torch.float64)
    idx, best = ops.mse_select(err, same, incumbent, K, patience, per_unit, use_global,
                               tie_last)
    ref_idx, ref_best = _state_reference(err, same, incumbent, patience, per_unit, use_global,
                                         tie_last)
    assert idx.tolist() == ref_idx.tolist()
    assert best.tolist() == ref_best.tolist()


# ---- the build cache -----------------------------------------------------------------------

def test_cache_dir_is_xdg_cache_home_quantscope(monkeypatch, tmp_path):
    monkeypatch.delenv("QUANTSCOPE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.cache_dir() == tmp_path / "quantscope"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.cache_dir() == tmp_path / "home" / ".cache" / "quantscope"


def test_a_blank_cc_is_unset(monkeypatch):
    monkeypatch.setenv("CC", "   ")
    monkeypatch.setattr(cache.shutil, "which", lambda name: f"/bin/{name}")
    assert cache.compiler() == ["/bin/cc"]


def test_cc_is_preferred_to_gcc_on_the_path(monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(cache.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert cache.compiler() == ["/usr/bin/cc"]


@pytest.mark.parametrize(("cc", "where"), [("qs-missing-cc-s67", "not found on the PATH"),
                                           ("/qs/missing/cc-s67", "no executable file")])
def test_a_missing_cc_says_where_it_was_looked_for(monkeypatch, cc, where):
    monkeypatch.setenv("CC", cc)
    with pytest.raises(cache.NoCompiler, match=where):
        cache.compiler()


def test_the_seal_records_size_and_sha256(tmp_path):
    lib = tmp_path / "k.so"
    lib.write_bytes(b"abc")
    assert cache._digest(lib) == ("3 ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f2"
                                  "0015ad")


def test_a_library_without_its_seal_is_not_intact(tmp_path):
    lib = tmp_path / "k.so"
    lib.write_bytes(b"abc")
    assert not cache._intact(lib)


def _stat(mode, gid=None):
    st = os.stat(".")
    return os.stat_result((mode, st.st_ino, st.st_dev, st.st_nlink, os.getuid(),
                           os.getgid() if gid is None else gid, 0, 0, 0, 0))


def test_others_write_reads_the_world_and_group_write_bits():
    assert cache.others_write(_stat(0o40702))  # world-writable, not group-writable
    assert not cache.others_write(_stat(0o40740))  # group may read only
    assert not cache.others_write(_stat(0o40700))


def test_others_write_refuses_a_group_write_bit_of_an_unknown_group(monkeypatch):
    def unknown(gid):
        raise KeyError(gid)
    monkeypatch.setattr("grp.getgrgid", unknown)
    assert cache.others_write(_stat(0o40770))


@pytest.mark.parametrize(("name", "members", "shared"), [
    ("me", [], False),  # the user's private group
    ("me", ["other"], True),  # a group with members
    ("staff", [], True),  # a group named otherwise (a shared primary group)
])
def test_others_write_of_a_group_writable_folder(monkeypatch, name, members, shared):
    import grp
    import pwd

    group = grp.struct_group((name, "x", os.getgid(), members))
    me = pwd.struct_passwd(("me", "x", os.getuid(), os.getgid(), "", "/", "/bin/sh"))
    monkeypatch.setattr(grp, "getgrgid", lambda gid: group)
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: me)
    assert cache.others_write(_stat(0o40770)) is shared
    assert cache.others_write(_stat(0o40720)) is shared  # the write bit, not the read bit


def test_a_link_is_refused_where_it_is_checked(tmp_path):
    real = tmp_path / "k.so"
    real.write_bytes(b"abc")
    real.chmod(0o700)
    (tmp_path / "link.so").symlink_to(real)
    with pytest.raises(cache.CacheError, match=r"is not yours alone"):
        cache._check_private(tmp_path / "link.so")


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_a_file_of_another_user_is_refused(tmp_path):
    lib = tmp_path / "k.so"
    lib.write_bytes(b"abc")
    lib.chmod(0o700)
    os.chown(lib, os.getuid() + 4242, os.getgid())
    with pytest.raises(cache.CacheError, match=rf"owner uid {os.getuid() + 4242}"):
        cache._check_private(lib)


def test_the_error_names_the_link_only_where_it_leads_elsewhere(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(cache.CacheError) as caught:
        cache._check_private(shared, shared)
    assert "leads" not in str(caught.value)


def test_a_new_cache_folder_is_private(tmp_path):
    old = os.umask(0)
    try:
        real = cache._cache_folder(tmp_path / "a" / "cache")
    finally:
        os.umask(old)
    assert real.stat().st_mode & 0o777 == 0o700


def test_sweep_removes_only_scratch_folders_older_than_twice_the_build_timeout(tmp_path):
    now = time.time()
    ages = {"old": 2 * cache._BUILD_TIMEOUT + 60, "running": 1.5 * cache._BUILD_TIMEOUT,
            "new": 0}
    for name, age in ages.items():
        d = tmp_path / f"{cache._SCRATCH}{name}"
        d.mkdir()
        os.utime(d, (now - age, now - age))
    target = tmp_path / "elsewhere"
    target.mkdir()
    os.utime(target, (now - 10_000, now - 10_000))
    (tmp_path / f"{cache._SCRATCH}link").symlink_to(target)
    cache._sweep(tmp_path)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["elsewhere", f"{cache._SCRATCH}link", f"{cache._SCRATCH}new",
                           f"{cache._SCRATCH}running"])
    assert target.is_dir()


def test_texts_follow_indented_includes_once_and_beside_the_includer_first(tmp_path):
    src, inc = tmp_path / "src", tmp_path / "include"
    src.mkdir()
    inc.mkdir()
    (src / "main.c").write_bytes(b'  #  include "a.c"\n')
    (src / "a.c").write_bytes(b'/* a beside */\n#include "main.c"\n#include "a.c"\n')
    (inc / "a.c").write_bytes(b"/* a in -I */\n")
    (inc / "q.h").write_bytes(b"/* header */\n")
    assert cache._texts(src / "main.c", inc) == [
        b'  #  include "a.c"\n', b"/* header */\n",
        b'/* a beside */\n#include "main.c"\n#include "a.c"\n']


def test_cpu_id_keeps_the_model_and_flags_of_the_first_cpu(monkeypatch):
    import io
    import platform

    text = ("processor\t: 0\nmodel name\t: M\nflags\t\t: avx2 fma\n\n"
            "processor\t: 1\nmodel name\t: N\nflags\t\t: sse\n\n")
    monkeypatch.setattr(cache, "open", lambda path: io.StringIO(text), raising=False)
    assert cache._cpu_id() == f"{platform.machine()}\nmodel name\t: M\nflags\t\t: avx2 fma"


#: a "compiler" that writes ``LIB`` (no C compiled) to the file after ``-o``
FAKE_CC = ["sh", "-c", 'for a; do [ "$p" = -o ] && printf LIB > "$a"; p=$a; done', "sh"]


@pytest.fixture
def sources(monkeypatch, tmp_path):
    """A C source and an include folder, and an empty private cache."""
    monkeypatch.setenv("QUANTSCOPE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "include").mkdir()
    (tmp_path / "k.c").write_bytes(b"int k;\n")
    return tmp_path / "k.c", tmp_path / "include"


def test_build_leaves_a_private_library_and_its_seal(sources):
    target = cache.build("k", sources[0], FAKE_CC, sources[1])
    assert target.read_bytes() == b"LIB"
    assert target.stat().st_mode & 0o777 == 0o700
    assert cache._seal(target).read_text() == f"3 {hashlib.sha256(b'LIB').hexdigest()}"


def test_a_cached_library_others_can_write_is_refused(sources):
    target = cache.build("k", sources[0], FAKE_CC, sources[1])
    target.chmod(0o702)
    with pytest.raises(cache.CacheError, match=r"is not yours alone"):
        cache.build("k", sources[0], FAKE_CC, sources[1])


def test_a_compiler_that_writes_nothing_is_a_build_error(sources):
    with pytest.raises(cache.BuildError, match=r"the compiler wrote no library"):
        cache.build("k", sources[0], ["true"], sources[1])


def test_the_key_has_the_cpu_and_the_headers(sources, monkeypatch):
    source, include = sources
    first = cache.build("k", source, FAKE_CC, include)
    monkeypatch.setattr(cache, "_cpu_id", lambda: "another cpu")
    other_cpu = cache.build("k", source, FAKE_CC, include)
    (include / "k.h").write_bytes(b"#define K 1\n")
    other_header = cache.build("k", source, FAKE_CC, include)
    assert len({first, other_cpu, other_header}) == 3
