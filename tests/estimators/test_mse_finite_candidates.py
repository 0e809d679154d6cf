"""mse_tiles.finite_candidates: the one host read that lets the C kernel's search skip the
per-block mask of candidates past float32 (candidate_qparams' NaN scale); that read, one per
search, is the kernel search's only one."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantscope import kernels
from quantscope.estimators.mse import mse_search
from quantscope.estimators.mse_tiles import candidate_qparams, finite_candidates
from quantscope.presets import INT8_PER_TENSOR as INT8
from quantscope.spec import QuantSpec

BIG = torch.finfo(torch.float32).max
ends = st.lists(st.one_of(st.floats(-4.0, 4.0, width=32),
                          st.floats(-BIG, BIG, width=32),
                          st.sampled_from([BIG, -BIG, 0.0, math.nan])), min_size=0, max_size=6)
factors = st.lists(st.floats(0.0, 2.0, width=32), min_size=1, max_size=5)


@settings(max_examples=200, deadline=None)
@given(ends, ends, factors)
def test_finite_candidates_is_every_product_finite(lo, hi, f):
    """The bound max|end| * max|factor| is itself a candidate, so the answer is exact."""
    lo_t, hi_t = torch.tensor(lo, dtype=torch.float32), torch.tensor(hi, dtype=torch.float32)
    f_t = torch.tensor(f, dtype=torch.float32)
    every = all(bool(torch.isfinite(e[None] * f_t[:, None]).all()) for e in (lo_t, hi_t))
    assert finite_candidates((lo_t, hi_t), (f_t,)) == every


def test_unmasked_qparams_equal_masked_ones_where_every_candidate_is_finite():
    lo = torch.tensor([[-3.0, -1e30, 0.0]])
    hi = torch.tensor([[2.0, 1e30, 1e-30]])
    assert finite_candidates((lo, hi), (torch.tensor([1.0, 1.5]),))
    a = candidate_qparams(lo, hi, INT8, None)
    b = candidate_qparams(lo, hi, INT8, None, finite=True)
    assert torch.equal(a.scale, b.scale) and torch.equal(a.zero_point, b.zero_point)
    past = candidate_qparams(lo * 1e9, hi * 1e9, INT8, None)
    assert torch.isnan(past.scale[0, 1]) and not torch.isnan(past.scale[0, 0])


def test_finite_candidates_skip_the_mask():
    """``finite=True`` (the caller has shown every candidate finite) skips the mask, "five
    passes over the candidates" (abs, abs, maximum, eq, masked_fill), which the C kernel's
    search would pay per candidate block; it trusts the caller (pins M04: the mask run
    whatever ``finite`` says)."""
    from op_names import OpNames

    lo = torch.tensor([[-3.0, -1.0, 0.0]]).repeat(4, 1)
    hi = torch.tensor([[2.0, 1.0, 1e-3]]).repeat(4, 1)
    mask = {"aten.maximum", "aten.eq", "aten.masked_fill"}
    with OpNames() as masked:
        candidate_qparams(lo, hi, INT8, None)
    with OpNames() as unmasked:
        candidate_qparams(lo, hi, INT8, None, finite=True)
    assert mask <= masked.names and not mask & unmasked.names, unmasked.calls
    # a range past float32 given as finite keeps qparams_from_range's saturated scale
    past = candidate_qparams(torch.tensor([[-BIG]]) * 2, torch.tensor([[1.0]]), INT8, None,
                             finite=True)
    assert not torch.isnan(past.scale).any()


def test_an_end_given_twice_is_read_once(monkeypatch):
    """The kernel search passes ``(lo, hi, *incumbent)``, the incumbent mostly ``(lo, hi)``
    itself: each tensor's ``|end|`` max is taken once (two passes, not four)."""
    lo, hi, f = torch.tensor([-1.0, -2.0]), torch.tensor([3.0, BIG]), torch.tensor([1.0, 1.5])
    read = []
    abs_ = torch.Tensor.abs
    monkeypatch.setattr(torch.Tensor, "abs", lambda t: read.append(t) or abs_(t))
    assert not finite_candidates((lo, hi, lo, hi), (f,))
    assert [id(t) for t in read if t is not f] == [id(lo), id(hi)]
    read.clear()
    other = hi.clone()  # an incumbent of its own: read too
    assert finite_candidates((lo, hi.clamp(max=1.0), lo, other.clamp(max=1.0)), (f,))
    assert len([t for t in read if t is not f]) == 3


_READS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")


def test_a_view_sharing_an_ends_memory_is_an_end_of_its_own():
    """Only the same tensor is read once: a narrower view of an end starts at its address
    but is not it, so the wider end's overflowing candidate (3e38 * 2) is still seen."""
    x, f = torch.tensor([1.0, 3.0e38]), torch.tensor([0.5, 2.0])
    assert finite_candidates((x[:1],), (f,))
    assert not finite_candidates((x[:1], x), (f,))


@pytest.mark.parametrize(("spec", "grid", "reads"), [
    (QuantSpec("int4", "group:16"), None, 1), (QuantSpec("int8", "channel"), None, 1),
    (QuantSpec("fp4_e2m1", "block:16", scale="fp8_e4m3"), 1, 1),
    (QuantSpec("fp4_e2m1", "block:16", scale="fp8_e4m3"), None, 4)],  # one per global amax
    ids=["int4-g16", "int8-channel", "nvfp4-one-global", "nvfp4"])
@pytest.mark.parametrize("early_stop", [False, True])
def test_kernel_search_reads_the_host_once(monkeypatch, spec, grid, reads, early_stop):
    """The C kernel search (CPU only) reads back one value per search: finite_candidates'
    bool (tests/observers/test_mse.py's no-read-back check runs the torch path, which runs
    off the CPU); early stopping's flags are the kernel's, not a tensor read."""
    if not kernels.available("mse_search"):
        pytest.skip("no compiled kernel")
    units = spec.layout.to_units(torch.randn(64, 128, generator=torch.Generator().manual_seed(0)))
    lo, hi = units.amin(1), units.amax(1)
    seen = []
    for name in _READS:
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda *a, _n=name, _f=real, **k: seen.append(_n) or _f(*a, **k))
    mse_search(units, lo, hi, spec, early_stop=early_stop, backend="kernel", global_grid=grid)
    assert seen == ["__bool__"] * reads


@pytest.mark.parametrize("name", ["memoryless_mse", "mse", "nvfp4_expanded_mse"])
def test_nvfp4_global_amax_candidates_stay_finite(name):
    # probe s57: an amax above float32's max / 2 ** (3 / 4) made the largest global-amax
    # candidate inf; priced as float32's max (the global scale clamps it), it won and was kept
    # as the observer's inf global amax (calculate_qparams raised; mse's average turned NaN)
    import quantscope
    from quantscope import presets

    x = torch.zeros(2, 16)
    x[0, 7], x[1, 4] = -2.673915244169735e38, -1.3671715670810673e37
    obs = quantscope.get_observer(name, presets.NVFP4)
    obs(x)
    obs(x)
    assert bool(torch.isfinite(obs.global_amax_val).all())
    qp = obs.calculate_qparams()
    assert bool(torch.isfinite(qp.scale).all() and torch.isfinite(qp.global_scale).all())
