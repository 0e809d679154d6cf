"""Pins from the s68 mutation round of ``src/quantscope/kernels/__init__.py``: the loader's
once-per-process result and its one rebuild of a library that does not load, the failed
build's message, the output buffers and ``flat_f32``, the :func:`real` rule
under make_fx, and the in-place helpers (``write`` / ``add`` and their version counters).
Each test kills a mutant the existing tests let through, and checks the rule the module doc
or the docstring states, never printed output."""

import ctypes
import warnings

import pytest
import torch
from test_kernels_build import needs_cc
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from quantscope import kernels


def test_a_failed_load_is_remembered_not_retried(fresh, monkeypatch):
    """``load`` builds a library "once per process": a library that could not be had is
    remembered as None, not tried again on each call."""
    calls = []
    real_open = kernels._open

    def counting_open(*args):
        calls.append(args[0])
        return real_open(*args)

    monkeypatch.setenv("CC", "/nonexistent/bin/cc")
    monkeypatch.setattr(kernels, "_open", counting_open)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kernels.KernelWarning)
        assert kernels.lib("entropy") is None
        assert kernels.lib("entropy") is None
        assert kernels.available("entropy") is False
    assert calls == ["entropy"]


@needs_cc
def test_a_cached_library_that_does_not_load_is_removed_and_built_again(fresh, monkeypatch,
                                                                        tmp_path):
    """A cached library ctypes cannot load is removed and built again, once, silently: here
    the first build hands back a file that is no library."""
    bad = tmp_path / "int_qparams-bad.so"
    bad.write_bytes(b"not a shared object")
    real_build = kernels.build
    built = []

    def build(*args):
        built.append(args[0])
        return bad if len(built) == 1 else real_build(*args)

    monkeypatch.setattr(kernels, "build", build)
    with warnings.catch_warnings():
        warnings.simplefilter("error", kernels.KernelWarning)
        so = kernels.lib("int_qparams")
    assert so is not None and built == ["int_qparams", "int_qparams"]
    assert not bad.exists()  # the damaged file is gone, not left for the next process


@needs_cc
def test_every_loaded_function_returns_int64_and_takes_its_declared_arguments():
    """:data:`SIGNATURES` declares each exported function's arguments, "all of which return
    ``int64``": the loaded functions carry exactly that (a C ``int`` result would cut a
    64-bit count or status)."""
    for name, fns in kernels.SIGNATURES.items():
        so = kernels.lib(name)
        assert so is not None, name
        for fn, types in fns.items():
            f = getattr(so, fn)
            assert f.restype is ctypes.c_int64, fn
            assert list(f.argtypes or []) == types, fn


@needs_cc
def test_a_failed_build_quotes_the_compilers_last_lines(fresh, monkeypatch, tmp_path):
    """A compiler error is said with the compiler and its exit status, and the last three
    lines of what it wrote (where the error is), not its first ones."""
    script = tmp_path / "badcc"
    script.write_text("#!/bin/sh\nfor i in 1 2 3 4 5 6; do echo \"line$i\" >&2; done\nexit 3\n")
    script.chmod(0o755)
    monkeypatch.setenv("CC", str(script))
    with pytest.warns(kernels.KernelWarning) as record:
        assert kernels.lib("entropy") is None
    (said,) = [str(w.message) for w in record]
    assert f"{script} exited 3: line4 | line5 | line6)" in said
    assert "line3" not in said


def test_buffer_is_float32_on_the_cpu_whatever_torchs_defaults(monkeypatch):
    """``buffer`` is a float32 CPU tensor "whatever torch's default dtype and device"."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        b = kernels.buffer(2, 3)
    finally:
        torch.set_default_dtype(before)
    assert b.dtype == torch.float32 and b.shape == (2, 3) and b.device.type == "cpu"
    with torch.device("meta"):
        b = kernels.buffer(4, zero=True)
    assert b.device.type == "cpu" and b.dtype == torch.float32


def test_buffer_zero_is_zero_filled_even_where_fresh_memory_is_not(monkeypatch):
    """``buffer(..., zero=True)`` is zero-filled; without ``zero`` it is fresh memory."""
    monkeypatch.setattr(torch, "empty", lambda *a, **k: torch.full(a[0], float("nan"), **k))
    assert torch.equal(kernels.buffer(5, zero=True), torch.zeros(5))
    assert kernels.buffer(5).isnan().all()


def test_out_buffers_refuses_the_callers_tensors_that_are_not_real():
    """``out_buffers`` takes the caller's pair only where it is :func:`real`: a negative view
    (its memory holds ``-x``) is flat float32 yet gets two new buffers."""
    a, b = torch.zeros(4), torch.zeros(4)
    theirs = a._neg_view(), b._neg_view()
    assert kernels.flat_f32(4, *theirs)
    lo, hi = kernels.out_buffers(4, lambda n: theirs)
    assert lo is not theirs[0] and hi is not theirs[1]
    assert kernels.flat_f32(4, lo, hi)
    mine = torch.zeros(4), torch.zeros(4)
    got = kernels.out_buffers(4, lambda n: mine)
    assert got[0] is mine[0] and got[1] is mine[1]


def test_flat_f32_is_no_meta_tensor():
    """``flat_f32(n, t)``: a contiguous ``[n]`` float32 CPU tensor; a meta one has no memory
    for the C kernel (strided and float64 ones: the existing tests)."""
    t = torch.zeros(3, device="meta")
    assert kernels.flat_f32(3, torch.zeros(3))
    assert not kernels.flat_f32(3, t)
    assert not kernels.flat_f32(3, torch.zeros(3), t)


def test_contiguous_converts_the_dtype():
    """``contiguous(t, dtype)`` is ``t`` as a contiguous tensor of ``dtype``; ``t`` itself
    where it already is one."""
    t = torch.arange(6, dtype=torch.int64).reshape(2, 3).t()
    got = kernels.contiguous(t)
    assert got.dtype == torch.float32 and got.is_contiguous()
    assert torch.equal(got, t.float())
    f = torch.zeros(3)
    assert kernels.contiguous(f) is f


def test_write_and_add_bump_the_version_as_in_place_ops_do():
    """``write`` and ``add`` change ``t`` through its memory and bump its version counter, as
    an in-place torch op would."""
    t = torch.zeros(3)
    v = t._version
    kernels.write(t, 1.5, 2.5)
    assert t.tolist() == [1.5, 2.5, 0.0] and t._version > v
    n = torch.zeros(1, dtype=torch.int64)
    v = n._version
    assert kernels.add(n, 4) is True
    assert n.item() == 4 and n._version > v


def test_add_without_context_test_works_inside_a_fake_mode():
    """``add(t, value, context=False)``: the caller tested the context, only ``t`` is tested
    (a real int64 counter made outside a FakeTensorMode is added to inside it); with the
    context tested, the fake mode makes it False and nothing is done."""
    n = torch.zeros(1, dtype=torch.int64)
    with FakeTensorMode():
        assert kernels.add(n, 1) is False
        assert kernels.add(n, 3, context=False) is True
    assert n.tolist() == [3]


def test_add_to_an_empty_counter_does_nothing():
    """An empty int64 tensor has no first element: ``add`` returns False and writes nothing
    (not the memory after it, here its base's)."""
    base = torch.zeros(2, dtype=torch.int64)
    assert kernels.add(base[1:1], 5) is False
    assert base.tolist() == [0, 0]


@needs_cc
def test_lib_is_none_while_a_trace_would_miss_the_c_call():
    """``lib(name)`` is None where the context is not :func:`real` (a fake mode, make_fx),
    for callers that check only their inputs' device; outside it, the library."""
    assert kernels.lib("int_qparams") is not None
    with FakeTensorMode():
        assert kernels.lib("int_qparams") is None
    seen = []
    make_fx(lambda u: seen.append(kernels.lib("int_qparams")) or u + 1)(torch.zeros(2))
    assert seen == [None]
