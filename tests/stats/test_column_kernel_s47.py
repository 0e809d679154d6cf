"""The C column kernel (``qs_col_minmax`` in csrc/unit_minmax.c: a channel along the last axis,
groups / blocks along an axis before the last, a transposed weight's channels and runs) against
a torch reference bit for bit, ties of -0.0 / +0.0 included, in each of its builds (the native
one, and where this CPU runs them the AVX2 and the scalar one): ragged column tails, one column,
more than 2048 columns, half inputs, several slabs, their results in unit order, any threads.

Its loops were rewritten for speed (from 2048 columns the per-row update of 3C running floats
took 2.8x the row kernel's time; a transposed weight's groups and blocks 2.5-3.6x the
contiguous weight's), with every result kept as it was; the reference states the tie rule it
keeps (see the kernel's comment)."""

from __future__ import annotations

import ctypes
import itertools
import math
import shutil
import subprocess

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from march_builds import cpu_has
from op_names import OpNames
from tiers import each_value

from quantscope import Block, Channel, Group, kernels
from quantscope.stats import minmax as stats
from quantscope.stats import minmax_layouts

CC = shutil.which("cc") or shutil.which("gcc")
CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
COLUMNS = [1, 3, 7, 8, 9, 31, 32, 33, 40, 100, 257, 2047, 2048, 2049, 2056, 4100]

pytestmark = pytest.mark.skipif(stats._kernel() is None, reason="no compiled kernel")


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, tuple[ctypes.CDLL, bool]]:
    """``{name: (library, vector)}``: the loaded native build and, where this CPU runs them
    and a compiler is here, the AVX2 and the scalar ones; ``vector``: the build reduces whole
    8-column vectors (AVX2 and F16C), whose columns keep a share's last tying value."""
    out = {"native": (stats._kernel(), cpu_has("avx2", "f16c"))}
    for march, vector in (("haswell", True), ("x86-64", False)):
        if CC is None or not cpu_has("avx2", "f16c" if vector else "sse2"):
            continue
        flags = [f if f != "-march=native" else f"-march={march}" for f in kernels.FLAGS]
        so = tmp_path_factory.mktemp("colkernel") / f"unit_minmax_{march}.so"
        subprocess.run([CC, *flags, f"-I{kernels.CSRC}", str(kernels.CSRC / "unit_minmax.c"),
                        "-o", str(so), "-lm"], check=True, capture_output=True, text=True)
        lib = ctypes.CDLL(str(so))
        for fn, types in kernels.SIGNATURES["unit_minmax"].items():
            getattr(lib, fn).restype, getattr(lib, fn).argtypes = ctypes.c_int64, types
        out[march] = (lib, vector)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _pick(part: torch.Tensor, low: bool, vector_columns: int) -> torch.Tensor:
    """Per column of ``part [runs, n, C]`` (NaN aside): its min (``low``) or max, as the value
    of the last row holding it in the first ``vector_columns`` columns, of the first row in
    the others (-0.0 and +0.0 tie: which one comes back is the rule)."""
    vals = torch.where(part.isnan(), math.inf if low else -math.inf, part)
    ext = vals.amin(1, keepdim=True) if low else vals.amax(1, keepdim=True)
    n, C = part.shape[1], part.shape[2]
    row = torch.arange(n).view(1, n, 1).expand_as(vals)
    last = torch.where(vals == ext, row, -1).amax(1)
    first = torch.where(vals == ext, row, n).amin(1)
    i = torch.where(torch.arange(C) < vector_columns, last, first)
    return vals.gather(1, i.unsqueeze(1)).squeeze(1)


def reference(x: torch.Tensor, shares: int, vector: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-column ``(lo, hi)`` ``[runs, C]`` of every slab of ``x [runs, R, C]`` (float32
    values): NaN where the column holds one; each slab's rows cut into ``shares`` (``R * k //
    shares``), each share's value by :func:`_pick`, the shares merged in order (the first wins
    a tie)."""
    R, C = x.shape[1], x.shape[2]
    cuts = [R * k // shares for k in range(shares + 1)]
    parts = [x[:, a:b] for a, b in itertools.pairwise(cuts) if b > a]
    vector_columns = C // 8 * 8 if vector else 0
    out = []
    for low in (True, False):
        got = _pick(parts[0], low, vector_columns)
        for part in parts[1:]:
            new = _pick(part, low, vector_columns)
            got = torch.where(new < got if low else new > got, new, got)
        out.append(torch.where(x.isnan().any(1), math.nan, got))
    return out[0], out[1]


def values(shape, dtype, kind: str, seed: int) -> torch.Tensor:
    """``shape`` values of ``dtype``: mostly zeros of both signs among positive (``"zero
    min"``) or negative (``"zero max"``) values, where a zero min / max ties often; or
    holding NaN / inf; or plain."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if kind in ("zero min", "zero max"):
        x = x.abs() if kind == "zero min" else -x.abs()
        zero = torch.where(torch.rand(shape, generator=g) < 0.5, 0.0, -0.0)
        x = torch.where(torch.rand(shape, generator=g) < 0.6, zero, x)
    elif kind == "nan":
        x[torch.rand(shape, generator=g) < 0.01] = math.nan
    elif kind == "inf":
        x[torch.rand(shape, generator=g) < 0.05] = math.inf
        x[torch.rand(shape, generator=g) < 0.05] = -math.inf
    return x.to(dtype)


def _call(lib, x, threads: int, shares: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``qs_col_minmax`` of ``x [runs, R, C]``, its unit-order results back as ``[runs, C]``."""
    # x, runs, R, C, lo, hi, work, threads, shares, group, dtype (ctypes passes extra
    # arguments on to a function declared with fewer: check the declaration first)
    assert len(lib.qs_col_minmax.argtypes) == 11
    runs, R, C = x.shape
    lo, hi = torch.full((runs * C,), 7.0), torch.full((runs * C,), 7.0)
    work = torch.empty(max(threads, 1) * 5 * C)
    assert lib.qs_col_minmax(x.data_ptr(), runs, R, C, lo.data_ptr(), hi.data_ptr(),
                             work.data_ptr(), threads, shares, group, CODES[x.dtype]) == 0
    back = lambda t: t.view(runs // group, C, group).transpose(1, 2).reshape(runs, C)
    return back(lo), back(hi)


@settings(max_examples=30, deadline=None)
@given(dtype=st.sampled_from(list(CODES)), runs=st.sampled_from([1, 2, 3, 16, 20]),
       R=st.sampled_from([1, 2, 3, 7, 8, 9, 16, 17, 33]), C=st.sampled_from(COLUMNS),
       kind=st.sampled_from(["zero min", "zero max", "nan", "inf", "plain"]),
       shares=st.integers(1, 4), threads=st.integers(1, 3), group=st.integers(1, 20),
       seed=st.integers(0, 99))
def test_the_column_kernel_is_its_reference_bit_for_bit(builds, dtype, runs, R, C, kind, shares,
                                                        threads, group, seed):
    """Every build, any threads (over slabs, or over the shares of one), any group: the
    reference's bits, zeros' signs and NaN included."""
    runs = runs if runs * R * C <= 300_000 else 2  # (bounded work an example)
    group = math.gcd(runs, group)
    x = values((runs, R, C), dtype, kind, seed)
    for name, (lib, vector) in builds.items():
        want = reference(x.float(), shares, vector)
        got = _call(lib, x, threads, shares, group)
        for a, b in zip(got, want):
            assert torch.equal(bits(a), bits(b)), name


@pytest.mark.parametrize(("dtype", "C", "kind"),
                         each_value(list(CODES), [1, 9, 40, 2049, 4100], ["zero min", "zero max"]))
def test_transposed_weights_are_their_reference_in_unit_order(dtype, C, kind, monkeypatch):
    """Through ``stats.minmax_layouts`` (a transposed weight ``m.t()``: its channels, its
    groups and blocks where a slab has 16 columns or more; ``column_minmax``), on two threads
    taking slabs and shares: the reference's bits in the units' order, each slab cut into the
    shares ``_threads`` gives one slab (the sign of a zero follows it, not the threads)."""
    monkeypatch.setattr(stats, "KERNEL_MIN_NUMEL", 0)  # the kernel, and threads, from small
    monkeypatch.setattr(stats, "THREAD_MIN_NUMEL", 64)  # inputs on
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    vector = cpu_has("avx2", "f16c")
    m = values((64, C), dtype, kind, seed=C)  # m.t(): a transposed weight of [C, 64]
    for size in (2, 16, 64) if C >= 16 else ():
        slabs = m.float().view(64 // size, size, C)
        lo, hi = reference(slabs, stats._threads(size * C, size), vector)
        for layout in (Group(size), Block(size)):
            got = minmax_layouts.layout_minmax(m.t(), layout)
            assert torch.equal(bits(got[0]), bits(lo.t().reshape(-1)))
            assert torch.equal(bits(got[1]), bits(hi.t().reshape(-1)))
    lo, hi = reference(m.float()[None], stats._threads(64 * C, 64), vector)
    found = [minmax_layouts.column_minmax(m)]
    if C > 1:  # (m.t() of one column is contiguous: its channels are rows)
        found.append(minmax_layouts.layout_minmax(m.t(), Channel(0)))
    for got in found:
        assert torch.equal(bits(got[0]), bits(lo[0])) and torch.equal(bits(got[1]), bits(hi[0]))


class Spy:
    """The kernel library, counting the column kernel's calls."""

    def __init__(self, lib):
        self.lib, self.calls = lib, 0

    def __getattr__(self, name):
        self.calls += name == "qs_col_minmax"
        return getattr(self.lib, name)


@pytest.mark.parametrize("dtype", list(CODES), ids=str)
def test_a_transposed_weights_blocks_take_one_kernel_call_and_no_reordering_copy(dtype,
                                                                                monkeypatch):
    """NVFP4-like blocks of ``w.t()`` (256 runs of 16 rows of ``w``): one C call for every run
    (one call a run cost ~1.5 us each), whose results come in the units' order (a transpose
    of them after the call took up to 2x the kernel's own time)."""
    w = values((4096, 64), dtype, "plain", seed=5)
    spy = Spy(stats._kernel())
    monkeypatch.setattr(minmax_layouts, "_kernel", lambda: spy)
    with OpNames() as ops:
        lo, hi = minmax_layouts.layout_minmax(w.t(), Block(16))
    assert spy.calls == 1
    assert not ops.names & {"aten.clone", "aten.copy_", "aten._to_copy", "aten.cat"}, ops.names
    units = w.t().float().reshape(-1, 16)
    assert torch.equal(lo, units.amin(1)) and torch.equal(hi, units.amax(1))
