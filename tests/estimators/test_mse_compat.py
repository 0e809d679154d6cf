"""The compat MSE search's kernel engine (:mod:`quantscope.estimators.mse_compat`) against
the torch path: the |d| ** p approximation and the interval bound against float64, and the
search's choices (and errors) bit for bit, including near ties and a bound made loose on
purpose so that most decisions go through torch's recomputation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantscope import kernels
from quantscope.estimators import mse_compat, mse_search, mse_tiles
from quantscope.layout import Channel, Group
from quantscope.qdq import fake_quantize_units
from quantscope.qparams import qparams_from_range
from quantscope.spec import QuantSpec
from quantscope.stats.minmax import unit_minmax

pytestmark = pytest.mark.skipif(not kernels.available("mse_pnorm"),
                                reason="no C compiler (or QUANTSCOPE_NO_KERNEL): torch path only")

NORMS = (2.4, 1.5, 2.0, 3.0, 1.0)
#: whether the bounds of norms 2.4 and 1.5 were measured on this torch and CPU; elsewhere the
#: engine steps aside for them, and the tests check that
SCANNED = mse_compat.scanned()
scanned_only = pytest.mark.skipif(
    not SCANNED, reason=f"the bound of norms 2.4 and 1.5 was measured on torch "
                        f"{mse_compat._SCANNED[0]}x only")
FORMATS = ("int2", "int4", "int8", "uint4", "uint8")
CSRC = Path(__file__).resolve().parents[1] / "kernels" / "csrc"


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread (the benches'): the engine then applies wherever rows allow, so
    backend="kernel" is a fair demand; tests of other thread counts set their own."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _variant(name):
    """The library built with its AVX2 or scalar branch (``name``), or the shipped one."""
    if name == "native":
        return kernels.lib("mse_pnorm")
    return kernels.load(f"pnorm_{name}_test", kernels.SIGNATURES["mse_pnorm"],
                        source=CSRC / f"pnorm_{name}_test.c")


@pytest.fixture(params=("native", "avx2", "scalar"))
def variant(request, monkeypatch):
    """Run the engine on each branch of the kernel (the machine's, AVX2, scalar)."""
    lib = _variant(request.param)
    if lib is None:
        pytest.skip(f"the {request.param} build did not load")
    real = kernels.lib
    monkeypatch.setattr(kernels, "lib", lambda name: lib if name == "mse_pnorm" else real(name))
    return lib


def _pow(x, p, scalar, lib=None):
    out = torch.empty_like(x)
    (lib or kernels.lib("mse_pnorm")).qs_pnorm_pow(x.data_ptr(), x.numel(), float(p),
                                                   int(scalar), out.data_ptr())
    return out


def _kappa(p):
    return 2.0 ** -18 * (1 + p)


@pytest.mark.parametrize("p", NORMS)
@pytest.mark.parametrize("scalar", (0, 1))
def test_pow_approximation_within_kappa(p, scalar, variant):
    g = torch.Generator().manual_seed(int(p * 10) + scalar)
    # every float32 mantissa of a few binades, and random values over the whole range
    m = torch.arange(0x3F800000, 0x40000000, 97, dtype=torch.int32).view(torch.float32)
    xs = [m * 2.0 ** e for e in (-60, -20, -7, -1, 0, 3, 30)]
    xs.append(torch.randint(1, 0x7F000000, (1 << 18,), generator=g, dtype=torch.int32)
              .view(torch.float32))
    x = torch.cat(xs + [torch.tensor([1.0, 0.75, 1.5, 2.0, 2.0 ** -149, 2.0 ** -126])])
    x = torch.cat((x, -x[:1000]))  # |x|
    got = _pow(x, p, scalar, variant).double()
    ref = x.double().abs() ** p
    fin = ref < 2.0 ** 127
    normal = fin & (ref >= 2.0 ** -126)
    rel = ((got - ref).abs() / ref)[normal]
    assert rel.max() <= _kappa(p) / 4, rel.max()  # the bound used is 4x what is seen
    assert ((got - ref).abs()[~normal & fin]).max() <= 2.0 ** -140
    special = _pow(torch.tensor([0.0, -0.0, float("inf"), float("nan")] * 5), p, scalar,
                   variant)
    assert special[0] == 0 and special[1] == 0
    assert not special[2:4].isfinite().any()  # the search's torch fallback


def _units(fmt, shape, seed, symmetric=True, kind="gauss"):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g).add_(0.05)
    if kind == "outliers":
        w[:, 0] *= 20
    elif kind == "tiny":
        w *= 1e-30
    elif kind == "special":
        w[0] = 0.0  # a row of zeros: every candidate's error is 0
        if shape[0] > 1:
            w[1] = 0.3  # a constant row
        if shape[0] > 2:
            w[2, ::2] = 0.0  # half zeros
        if shape[0] > 3:
            w[3] = torch.tensor([-1.0, 1.0]).repeat(shape[1] // 2 + 1)[: shape[1]]
    spec = QuantSpec(fmt, Channel(0), symmetric=symmetric)
    u = spec.layout.to_units(w)
    return (u, *unit_minmax(u), spec)


def _same(a, b):
    return (torch.equal(a.lo, b.lo) and torch.equal(a.hi, b.hi)
            and torch.equal(a.index, b.index) and torch.equal(a.error, b.error))


def _check(u, lo, hi, spec, backend="kernel", engine=True, **kw):
    if not SCANNED and kw["norm"] not in mse_compat._TILE_FREE:
        backend, engine = None, False  # the engine must step aside: the torch path's answer
    ref = mse_search(u, lo, hi, spec, compat="llmcompressor", backend="torch", **kw)
    mse_compat.STATS["units"] = 0
    got = mse_search(u, lo, hi, spec, compat="llmcompressor", backend=backend, **kw)
    assert _same(got, ref), kw
    if engine:  # the kernel engine ran (not its fallback to the torch path)
        assert mse_compat.STATS["units"] == u.shape[0]
    return got


@settings(max_examples=60, deadline=None)
@given(fmt=st.sampled_from(FORMATS), norm=st.sampled_from(NORMS),
       symmetric=st.booleans(), tie=st.sampled_from(("first", "last")),
       patience=st.sampled_from((1, 2, 3, 5, None)),
       grid=st.sampled_from(((0.2, 100), (0.5, 20), (0.9, 50), (0.05, 100))),
       rows=st.integers(1, 40), cols=st.sampled_from((64, 128, 192, 256, 1024)),
       kind=st.sampled_from(("gauss", "outliers", "special", "tiny")),
       seed=st.integers(0, 10_000))
def test_search_is_the_torch_path_bit_for_bit(fmt, norm, symmetric, tie, patience, grid, rows,
                                              cols, kind, seed):
    u, lo, hi, spec = _units(fmt, (rows, cols), seed, symmetric, kind)
    _check(u, lo, hi, spec, norm=norm, tie=tie, patience=patience, maxshrink=grid[0],
           grid=grid[1])


@pytest.mark.parametrize("norm", NORMS)
def test_strided_units_search_as_their_contiguous_copy(norm):
    """A transposed view of the units: the torch path summed in its memory order (974 of
    2000 errors and one choice differed from the kernel's, which reads a copy)."""
    u = torch.randn(128, 2000, generator=torch.Generator().manual_seed(5)).t()
    spec = QuantSpec("int4", Channel(), symmetric=False)
    got = _check(u, None, None, spec, backend=None, engine=False, norm=norm)
    assert _same(got, mse_search(u.contiguous(), None, None, spec, compat="llmcompressor",
                                 backend="torch", norm=norm))


@pytest.mark.parametrize("threads", (2, 3, 4))
@settings(max_examples=15, deadline=None)
@given(norm=st.sampled_from((2.4, 1.5, 2.0)), rows=st.integers(1, 80),
       cols=st.sampled_from((64, 128, 320, 2048)), tie=st.sampled_from(("first", "last")),
       seed=st.integers(0, 10_000))
def test_other_thread_counts(threads, norm, rows, cols, tie, seed):
    """Under other thread counts torch's tiles split differently; where its pow could
    take the scalar tail the engine steps aside (backend None), else it must agree."""
    u, lo, hi, spec = _units("int4", (rows, cols), seed, kind="special" if seed % 2 else "gauss")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check(u, lo, hi, spec, backend=None, engine=False, norm=norm, tie=tie)
    finally:
        torch.set_num_threads(before)


@settings(max_examples=25, deadline=None)
@given(norm=st.sampled_from((2.0, 3.0, 1.0)), rows=st.integers(1, 30),
       cols=st.integers(1, 300), tie=st.sampled_from(("first", "last")),
       seed=st.integers(0, 10_000))
def test_exact_pow_norms_take_any_row_length(norm, rows, cols, tie, seed):
    u, lo, hi, spec = _units("int4", (rows, cols), seed, kind="special" if seed % 2 else "gauss")
    _check(u, lo, hi, spec, norm=norm, tie=tie)


@pytest.mark.parametrize("norm", (2.4, 1.5, 2.0, 3.0))
def test_every_branch_of_the_kernel(variant, norm):
    """The AVX2 and scalar branches (other machines) choose as the torch path too."""
    for seed, kind in enumerate(("gauss", "special", "outliers", "tiny")):
        for cols in (64, 320) if norm in (2.4, 1.5) else (1, 13, 64, 77):
            u, lo, hi, spec = _units("int4", (24, cols), seed, symmetric=seed % 2 == 0,
                                     kind=kind)
            for tie in ("first", "last"):
                _check(u, lo, hi, spec, norm=norm, tie=tie, patience=2)


@pytest.mark.parametrize("tie", ("first", "last"))
@pytest.mark.parametrize("norm", (2.4, 2.0))
def test_a_loose_bound_settles_everything_in_torch(monkeypatch, tie, norm):
    """With a bound 10 % wide nearly every decision is unsure: the answers must not move."""
    if norm == 2.4 and not SCANNED:
        pytest.skip(scanned_only.kwargs["reason"])
    monkeypatch.setattr(mse_compat, "tolerance", lambda n, p: (0.1, 1e-30))
    for seed in range(6):
        u, lo, hi, spec = _units("int4", (48, 128), seed, symmetric=seed % 2 == 0,
                                 kind=("gauss", "special", "outliers")[seed % 3])
        for patience in (1, 3, None):
            _check(u, lo, hi, spec, norm=norm, tie=tie, patience=patience)
            assert mse_compat.STATS["recomputed"] > 0


def test_equal_errors_at_two_candidates():
    """Rows whose errors are exactly equal at several candidates (exact ties)."""
    spec = QuantSpec("int4", Channel(0))
    # values on the integer grid of every candidate's scale: the error is 0 at several
    base = torch.tensor([-8.0, -4.0, 0.0, 4.0, 7.0]).repeat(26)[:128]
    u = torch.stack([base, base * 0.5, torch.zeros(128), base.sign()])
    lo, hi = unit_minmax(u)
    for tie in ("first", "last"):
        for norm in (2.4, 2.0):
            for patience in (1, 2, None):
                _check(u, lo, hi, spec, norm=norm, tie=tie, patience=patience)


@pytest.mark.parametrize("p", NORMS)
def test_bound_holds_against_torch_and_float64(p, variant):
    """torch's float32 T in [L, H] around the kernel's K; K within kappa + float64 of the
    exact sum of |d| ** p."""
    for seed, kind in enumerate(("gauss", "outliers", "special", "tiny")):
        u, lo, hi, spec = _units("int4", (32, 1024), seed, kind=kind)
        f = torch.tensor([1.0, 0.93, 0.8, 0.61, 0.3])[:, None]
        qp = qparams_from_range(lo[None] * f, hi[None] * f, spec)
        sc, zp = qp.effective_scale.expand(5, 32), qp.zero_point.float()
        k = mse_compat.price(u, sc, zp, spec, p)
        d = fake_quantize_units(u[None], sc[..., None], zp[..., None], spec) - u[None]
        exact = (d.double().abs() ** p).sum(-1)
        assert ((k - exact).abs() <= (_kappa(p) + 1024 * 2.0 ** -52) * exact + 2.0 ** -130).all()
        t = d.abs().pow(p).sum(-1).double()
        tol, a = mse_compat.tolerance(1024, p)
        assert ((t >= k * (1 - tol) - a) & (t <= k * (1 + tol) + a)).all()


def test_tolerance_composes_the_bounds():
    tol, a = mse_compat.tolerance(4096, 2.4)
    g32 = 4095 * 2.0 ** -24
    assert g32 + 2.0 ** -16 < tol < 1.01 * (g32 + 2.0 ** -16 + _kappa(2.4)) + 1e-9
    assert mse_compat.tolerance(1, 2.0)[0] < 2e-5 and 0 < a < 1e-30


def test_tile_numels_are_the_torch_paths(monkeypatch):
    """tile_numels predicts the tiles mse_tiles computes (its pow must be vector only)."""
    seen = []
    real = mse_tiles._tile_error

    def spy(x, scale, zp, spec, norm, exact, *rest):
        seen.append(scale.shape[0] * x.shape[0] * x.shape[1])
        return real(x, scale, zp, spec, norm, exact, *rest)

    monkeypatch.setattr(mse_tiles, "_tile_error", spy)
    for rows, cols, chunk, grid, cc in ((37, 128, 4096, (0.2, 100), None),
                                        (300, 64, 1 << 16, (0.5, 100), None),
                                        (5, 256, 1 << 20, (0.2, 100), 3),
                                        (64, 64, 64 * 7, (0.9, 50), None)):
        u, lo, hi, spec = _units("int4", (rows, cols), 0)
        seen.clear()
        mse_search(u, lo, hi, spec, compat="llmcompressor", backend="torch", patience=None,
                   maxshrink=grid[0], grid=grid[1], chunk_elems=chunk, chunk_candidates=cc)
        total = int(grid[0] * grid[1])
        assert set(seen) == mse_tiles.tile_numels(rows, cols, total, chunk, cc)


def test_rows_sum_alike_in_any_tile_and_thread_count():
    """The recomputation's premise: a row's float32 error does not depend on the tile."""
    u, lo, hi, spec = _units("int4", (64, 1024), 3, kind="outliers")
    qp = qparams_from_range(lo * 0.9, hi * 0.9, spec)
    sc, zp = qp.effective_scale[None], qp.zero_point.float()[None]
    threads = torch.get_num_threads()
    try:
        ref = None
        for t in (1, 2, 3, 4):
            torch.set_num_threads(t)
            full = mse_tiles._tile_error(u, sc, zp, spec, 2.4, True)[0]
            one = torch.stack([mse_tiles._tile_error(u[i:i + 1], sc[:, i:i + 1], zp[:, i:i + 1],
                                                     spec, 2.4, True)[0, 0] for i in range(64)])
            assert torch.equal(full, one)
            ref = full if ref is None else ref
            assert torch.equal(full, ref)
    finally:
        torch.set_num_threads(threads)


@scanned_only
def test_where_it_applies_and_backends(monkeypatch):
    u, lo, hi, spec = _units("int4", (16, 128), 0)
    assert mse_compat.applies(u, spec, 2.4, 20, 1 << 20, None)
    assert not mse_compat.applies(u, spec, 2.5, 20, 1 << 20, None)  # no bound for it
    assert not mse_compat.applies(u[:, :100], spec, 2.4, 20, 1 << 20, None)  # pow tails
    assert mse_compat.applies(u[:, :100], spec, 2.0, 20, 1 << 20, None)
    assert not mse_compat.applies(u.double(), spec, 2.4, 20, 1 << 20, None)
    g32 = QuantSpec("int4", Group(32))
    assert not mse_compat.applies(u, QuantSpec("fp8_e4m3", Channel(0)), 2.4, 20, 1 << 20, None)
    big = torch.zeros(2, 32768)
    assert not mse_compat.applies(big, spec, 2.0, 20, 1 << 20, None)  # a row over the grain
    with monkeypatch.context() as m:  # another torch: its pow was not scanned
        m.setattr(torch, "__version__", "2.99.0")
        assert not mse_compat.applies(u, spec, 2.4, 20, 1 << 20, None)
        assert mse_compat.applies(u, spec, 2.0, 20, 1 << 20, None)
    with pytest.raises(ValueError, match="backend='kernel'"):
        mse_search(u, lo, hi, spec, compat="llmcompressor", norm=2.5, backend="kernel")
    ug = g32.layout.to_units(torch.randn(8, 64))
    _check(ug, *unit_minmax(ug), g32, norm=2.0)
    assert mse_compat.engine(u, spec, {"norm": 2.4, "chunk_elems": 1 << 20,
                                       "chunk_candidates": None}, 20, None) is not None
    scalar = _variant("scalar")
    if scalar is not None:  # the scalar build runs only when asked for (slower than torch)
        assert scalar.qs_pnorm_lanes() == 0
        with monkeypatch.context() as m:
            m.setattr(kernels, "lib", lambda name: scalar)
            kw = {"norm": 2.4, "chunk_elems": 1 << 20, "chunk_candidates": None}
            assert mse_compat.engine(u, spec, kw, 20, None) is None
            assert mse_compat.engine(u, spec, kw, 20, "kernel") is mse_compat.search
    calls = []
    monkeypatch.setattr(mse_compat, "search", lambda *a, **k: calls.append(1) or 1 / 0)
    mse_search(u, lo, hi, spec, compat="llmcompressor", norm=2.4, backend="torch")
    assert not calls  # backend="torch": the torch path
    monkeypatch.setattr(kernels, "lib", lambda name: None)  # no kernel (QUANTSCOPE_NO_KERNEL)
    mse_search(u, lo, hi, spec, compat="llmcompressor", norm=2.4)
    assert not calls


def test_non_finite_errors_fall_back_to_torch():
    u, lo, hi, spec = _units("int8", (4, 64), 1)
    u = u * 1e30  # |d| ** 2.4 overflows float32: torch's errors are inf
    lo, hi = unit_minmax(u)
    _check(u, lo, hi, spec, norm=2.4, engine=False)


@scanned_only
def test_error_is_computed_on_first_access():
    u, lo, hi, spec = _units("int4", (8, 128), 2)
    ref = mse_search(u, lo, hi, spec, compat="llmcompressor", norm=2.4, backend="torch")
    got = mse_search(u, lo, hi, spec, compat="llmcompressor", norm=2.4, backend="kernel")
    assert torch.equal(got.error, ref.error) and got.error is got.error  # computed once
    late = mse_search(u, lo, hi, spec, compat="llmcompressor", norm=2.4, backend="kernel")
    u.mul_(2)  # the units change before the error is read: no stale answer
    with pytest.raises(RuntimeError, match="changed in place"):
        _ = late.error


@pytest.mark.parametrize("norm", NORMS)
def test_units_made_under_inference_mode_search_as_others(norm):
    """An inference tensor keeps no version counter: reading it for the stale-units guard
    raised 'Inference tensors do not track version counter' (llm-compressor's own observer
    takes such a weight)."""
    u, lo, hi, spec = _units("int8", (8, 128), 3)
    with torch.inference_mode():
        frozen = u.clone()
    ref = mse_search(u, lo, hi, spec, compat="llmcompressor", norm=norm, backend="torch")
    got = mse_search(frozen, lo, hi, spec, compat="llmcompressor", norm=norm)
    assert _same(got, ref)


@pytest.mark.parametrize(("numel", "threads"), ((98368, 3), (131072, 3), (65664, 2),
                                                (131072, 4), (196608, 2)))
def test_vector_only_is_where_torch_pow_has_no_scalar_tail(numel, threads):
    """_vector_only's model of at::parallel_for: where it says every element goes through
    torch's vector pow, torch's result equals the all-vector one; where it says not, the
    scalar tails show (they round differently at some of their elements)."""
    x = torch.rand(numel, generator=torch.Generator().manual_seed(numel)) + 0.5
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        vec = torch.pow(x.view(-1, 64), 2.4).reshape(-1)  # one thread: every element vector
        torch.set_num_threads(threads)
        got = torch.pow(x, 2.4)
        assert torch.equal(got, vec) == mse_compat._vector_only(numel)
    finally:
        torch.set_num_threads(before)
