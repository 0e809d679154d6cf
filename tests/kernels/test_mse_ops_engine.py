"""The MSE search run as ``quantscope::`` ops (estimators.mse_ops, issue 35 item 2): every
candidate priced in one pass and then selected chooses what the early-stopping engines
choose. On the CPU the ops price with the C kernel, so this engine's ranges, errors and
indices equal the C engine's bit for bit (and the torch tiles', which price alike); on a GPU
the same engine runs the Triton kernels (tests/kernels/test_triton_*.py prove those against
the torch path under the interpreter)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from op_names import OpNames

from quantscope import kernels, presets
from quantscope.estimators import mse_search
from quantscope.estimators.mse import range_error
from quantscope.layout import Channel, Group
from quantscope.observers import get_observer
from quantscope.qdq import fake_quantize_units
from quantscope.qparams import qparams_from_range
from quantscope.spec import QuantSpec

pytestmark = pytest.mark.skipif(not kernels.available("mse_search"),
                                reason="no C compiler (or QUANTSCOPE_NO_KERNEL): no engine to "
                                       "compare with")

SPECS = {
    "int4-channel": QuantSpec("int4", Channel(0)),
    "int4-group32-asym": QuantSpec("int4", Group(32), symmetric=False),
    "int8-channel": QuantSpec("int8", Channel(0)),
    "uint3-channel-asym": QuantSpec("uint3", Channel(0), symmetric=False),
    "nvfp4": presets.NVFP4,
    "mxfp4": presets.MXFP4,
    "mxfp8": presets.MXFP8,
    "mxint8": presets.MXINT8,  # E8M0 scales over int elements: priced as integer formats
    "bfp16": presets.BFP16,
}
OPTIONS = {
    "native": {},
    "no-patience": {"patience": None},
    "global-rule": {"per_unit_patience": False},
    "tie-last": {"tie": "last"},
    "grid-only": {"extend_to": None},
    "wide": {"maxshrink": 0.5, "grid": 20, "patience": 2},
    "expanded": {"maxshrink": 1 - 0.8 / 1.8, "grid": 200, "patience": 1000, "expand": 1.8},
}


def weight(rows=24, cols=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g).add_(0.05)
    w[1, 3], w[5, -1] = 9.0, -7.0
    w[2, :32] = 0.0  # all-zero units
    w[3, :32] = 0.75  # all-equal units
    return w


def units_of(spec, w):
    return spec.layout.to_units(w).contiguous()


def assert_same(a, b):
    for name in ("lo", "hi", "error", "index"):
        x, y = getattr(a, name), getattr(b, name)
        assert torch.equal(x, y), f"{name}: {x} != {y}"
    assert (a.global_amax is None) == (b.global_amax is None)
    if a.global_amax is not None:
        assert torch.equal(torch.as_tensor(a.global_amax), torch.as_tensor(b.global_amax))


@pytest.mark.parametrize("opt", list(OPTIONS))
@pytest.mark.parametrize("name", list(SPECS))
def test_ops_engine_is_the_kernel_engine(name, opt):
    spec = SPECS[name]
    u = units_of(spec, weight())
    ours = mse_search(u, None, None, spec, backend="ops", **OPTIONS[opt])
    assert_same(ours, mse_search(u, None, None, spec, backend="kernel", **OPTIONS[opt]))


@pytest.mark.parametrize("name", ["int4-group32-asym", "nvfp4"])
def test_chunks_of_units_do_not_change_the_answer(name):
    spec = SPECS[name]
    u = units_of(spec, weight(rows=40, seed=1))
    whole = mse_search(u, None, None, spec, backend="ops")
    # 64 elements per chunk budget: a few units per [candidates, units] block of qparams
    assert_same(mse_search(u, None, None, spec, backend="ops", chunk_elems=64), whole)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2 ** 16), rows=st.integers(6, 12), name=st.sampled_from(list(SPECS)),
       opt=st.sampled_from(["native", "global-rule", "tie-last", "wide"]),
       log_scale=st.floats(-20, 20))
def test_ops_engine_property(seed, rows, name, opt, log_scale):
    spec = SPECS[name]
    u = units_of(spec, weight(rows=rows, seed=seed) * 2.0 ** log_scale)
    assert_same(mse_search(u, None, None, spec, backend="ops", **OPTIONS[opt]),
                mse_search(u, None, None, spec, backend="kernel", **OPTIONS[opt]))


@pytest.mark.parametrize("name, price", [("int4-channel", "quantscope.mse_price_int"),
                                         ("mxfp4", "quantscope.mx_mse"),
                                         ("mxfp8", "quantscope.mx_mse"),
                                         ("mxint8", "quantscope.mx_mse"),
                                         ("nvfp4", "quantscope.nvfp4_mse")])
def test_the_search_calls_the_ops(name, price):
    spec = SPECS[name]
    u = units_of(spec, weight())
    with OpNames() as seen:
        mse_search(u, None, None, spec, backend="ops")
    assert price in seen.names
    # the block-scale ops select too, from the errors they never write out
    assert ("quantscope.mse_select" in seen.names) == (name == "int4-channel")


EXPANDED = OPTIONS["expanded"]


@pytest.mark.parametrize(("opt", "fused"), [("expanded", True), ("no-patience", True),
                                            ("native", False), ("tie-last", False),
                                            ("global-rule", False)])
def test_nvfp4_searches_without_patience_run_fused(opt, fused):
    """NVFP4 searches whose rule keeps the first lowest error (no patience stops them:
    ``nvfp4_expanded_mse``'s 1000 over 111 candidates, or none) are one op,
    ``quantscope::nvfp4_search``; the others are ``quantscope::nvfp4_mse``, no pricing of
    their own."""
    spec = SPECS["nvfp4"]
    with OpNames() as seen:
        mse_search(units_of(spec, weight()), None, None, spec, backend="ops", **OPTIONS[opt])
    assert ("quantscope.nvfp4_search" in seen.names) == fused
    assert ("quantscope.nvfp4_mse" in seen.names) != fused
    assert not {"quantscope.mse_price_fp", "quantscope.mse_select"} & seen.names


def test_off_the_cpu_the_nvfp4_search_is_one_op():
    """Off the CPU (meta: shapes only, through the fake implementations) the expanded NVFP4
    search makes no ``[candidates, units]`` pricing: one fused op per global amax tried, as
    a search with patience."""
    spec = SPECS["nvfp4"]
    u = units_of(spec, weight()).to("meta")
    with OpNames() as seen:
        res = mse_search(u, None, None, spec, **EXPANDED)
    assert "quantscope.nvfp4_search" in seen.names
    assert not {"quantscope.nvfp4_mse", "quantscope.mse_select"} & seen.names
    assert res.lo.device.type == "meta" and res.lo.shape == (u.shape[0],)
    with OpNames() as seen:
        res = mse_search(u, None, None, spec, **OPTIONS["native"])
    assert "quantscope.nvfp4_mse" in seen.names
    assert not {"quantscope.nvfp4_qparams", "quantscope.mse_price_fp",
                "quantscope.mse_select"} & seen.names
    assert res.lo.device.type == "meta" and res.lo.shape == (u.shape[0],)


def test_off_the_cpu_the_mx_search_is_one_op():
    """Off the CPU (meta) the MX search is ``quantscope::mx_mse`` alone: no
    ``[candidates, units]`` qparams or pricing."""
    spec = SPECS["mxfp4"]
    u = units_of(spec, weight()).to("meta")
    with OpNames() as seen:
        res = mse_search(u, None, None, spec)
    assert "quantscope.mx_mse" in seen.names
    assert not {"quantscope.e8m0_block_scales", "quantscope.mse_price_fp",
                "quantscope.mse_select"} & seen.names
    assert res.lo.device.type == "meta" and res.lo.shape == (u.shape[0],)


def test_off_the_cpu_the_ops_engine_is_the_default():
    """On a device other than the CPU (meta here: shapes only, through the ops' fake
    implementations) the default search runs the ops, with no host read-back."""
    spec = SPECS["int4-channel"]
    u = units_of(spec, weight()).to("meta")
    with OpNames() as seen:
        res = mse_search(u, None, None, spec)
    assert "quantscope.mse_select" in seen.names
    assert res.lo.device.type == "meta" and res.lo.shape == (u.shape[0],)


def test_an_observer_off_the_cpu_calls_the_ops():
    """The native MSE observer on a device other than the CPU (meta: shapes only) takes its
    per-unit min / max and its search from the ops."""
    obs = get_observer("mse", SPECS["int4-channel"]).to("meta")
    with OpNames() as seen:
        obs(weight().to("meta"))  # the search runs in forward (qparams read a flag back)
    assert {"quantscope.unit_minmax", "quantscope.mse_price_int",
            "quantscope.mse_select"} <= seen.names
    assert obs.min_vals.device.type == "meta" and obs.min_vals.numel() == 24


def test_what_the_ops_engine_refuses():
    u = weight()
    with pytest.raises(ValueError, match="backend='ops' needs .* without autograd"):
        mse_search(u.requires_grad_(), None, None, SPECS["int4-channel"], backend="ops")
    with pytest.raises(ValueError, match="backend must be one of"):
        mse_search(u, None, None, SPECS["int4-channel"], backend="triton")


# ---- llm-compressor's search (compat) and other norms on the ops ---------------------------

COMPAT = {"memoryless": {}, "patience-2": {"patience": 2, "maxshrink": 0.5, "grid": 20},
          "expanded": {"maxshrink": 1 - 0.8 / 1.8, "grid": 200, "patience": 1000,
                       "expand": 1.8}}


def _compat_reference(u, spec, norm, maxshrink=0.2, grid=100.0, patience=5, expand=1.0):
    """llm-compressor's rules, written out on float64 sums of torch's float32 ``|d| ** norm``
    (the ops' prices, computed here independently): each candidate ``(lo * expand) * p``
    in order; a unit's running minimum from float32's max (strict ``<``); stop after
    ``patience`` candidates that improved no unit. Returns each unit's index and range."""
    lo, hi = torch.aminmax(u, dim=1)
    lo, hi = lo * expand, hi * expand
    best = torch.full((u.shape[0],), torch.finfo(torch.float32).max, dtype=torch.float64)
    idx, stale = torch.zeros(u.shape[0], dtype=torch.int64), 0
    best_lo, best_hi = lo.clone(), hi.clone()
    for i in range(int(maxshrink * grid)):
        p = torch.tensor(1 - i / grid)  # float32, as the search's factors
        qp = qparams_from_range(lo * p, hi * p, spec)
        d = fake_quantize_units(u, qp.effective_scale.expand_as(lo)[:, None],
                                qp.zero_point.float().expand_as(lo)[:, None], spec) - u
        err = (d.square() if norm == 2 else d.abs().pow(norm)).double().sum(1)
        better = err < best
        best, idx = torch.where(better, err, best), torch.where(better, i, idx)
        best_lo, best_hi = torch.where(better, lo * p, best_lo), torch.where(better, hi * p, best_hi)
        stale = 0 if bool(better.any()) else stale + 1
        if stale >= patience:
            break
    return idx, best_lo, best_hi


@pytest.mark.parametrize("opt", list(COMPAT))
@pytest.mark.parametrize("norm", [2.4, 2.0, 1.0])
@pytest.mark.parametrize("name", ["int4-channel", "int4-group32-asym", "uint3-channel-asym",
                                  "nvfp4"])
def test_compat_on_the_ops_is_llmcompressors_rules(name, norm, opt):
    """``compat="llmcompressor"`` on the ops (the default off the CPU): its choices are
    llm-compressor's rules applied to the ops' float64 prices, written out independently;
    NVFP4 as they search it (float32 scales, no global scale)."""
    spec = SPECS[name]
    u = units_of(spec, weight(rows=30, seed=2))
    with OpNames() as seen:
        res = mse_search(u, None, None, spec, backend="ops", compat="llmcompressor", norm=norm,
                         **COMPAT[opt])
    assert "quantscope.mse_select" in seen.names
    idx, lo, hi = _compat_reference(u, spec.replace(scale="fp32") if name == "nvfp4" else spec,
                                    norm, **COMPAT[opt])
    assert torch.equal(res.index, idx)
    assert torch.equal(res.lo, lo) and torch.equal(res.hi, hi)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2 ** 16), rows=st.integers(6, 12),
       name=st.sampled_from(["int4-channel", "int4-group32-asym", "uint3-channel-asym"]),
       norm=st.sampled_from([2.4, 2.0, 1.5]), opt=st.sampled_from(list(COMPAT)),
       log_scale=st.floats(-20, 20))
def test_compat_on_the_ops_property(seed, rows, name, norm, opt, log_scale):
    spec = SPECS[name]
    u = units_of(spec, weight(rows=rows, seed=seed) * 2.0 ** log_scale)
    res = mse_search(u, None, None, spec, backend="ops", compat="llmcompressor", norm=norm,
                     **COMPAT[opt])
    assert torch.equal(res.index, _compat_reference(u, spec, norm, **COMPAT[opt])[0])


@pytest.mark.parametrize("name", ["int4-channel", "int8-channel", "nvfp4"])
def test_compat_on_the_ops_differs_from_torch_only_at_near_ties(name):
    """Against the torch path (float32 sums, llm-compressor's own arithmetic on the CPU):
    the same candidate wherever torch's errors of the two choices are not within float32
    rounding of each other (n * 2^-24 relatively, n a unit's elements)."""
    spec = SPECS[name]
    u = units_of(spec, weight(rows=60, seed=5))
    kw = {"compat": "llmcompressor", "norm": 2.4}
    ours = mse_search(u, None, None, spec, backend="ops", **kw)
    torch_path = mse_search(u, None, None, spec, backend="torch", **kw)
    assert (ours.index == torch_path.index).float().mean() > 0.9
    blind = spec.replace(scale="fp32") if name == "nvfp4" else spec
    a = range_error(u, ours.lo, ours.hi, blind, 2.4).double()
    b = range_error(u, torch_path.lo, torch_path.hi, blind, 2.4).double()
    near = (a - b).abs() <= u.shape[1] * 2.0 ** -24 * torch.maximum(a, b)
    assert bool((near | (ours.index == torch_path.index)).all())


@pytest.mark.parametrize("name", ["mxfp4", "int4-group32-asym"])
def test_native_norms_on_the_ops_are_the_torch_paths_but_near_ties(name):
    """A native search of norm 2.4 (per-unit patience, the extension, the incumbent) on the
    ops against the torch tiles (float32 sums): the same ranges but where two candidates'
    errors lie within float32 rounding, so the same total error to float32's precision.
    (Ranges, not indices: the tiles price the incumbent and candidate 0, the same qparams
    under MX, in tiles of other shapes, and their float32 sums can differ in the last bit.)"""
    spec = SPECS[name]
    u = units_of(spec, weight(rows=60, seed=7))
    ours = mse_search(u, None, None, spec, backend="ops", norm=2.4)
    torch_path = mse_search(u, None, None, spec, backend="torch", norm=2.4)
    same = (ours.lo == torch_path.lo) & (ours.hi == torch_path.hi)
    assert same.float().mean() > 0.9
    a = range_error(u, ours.lo, ours.hi, spec, 2.4).double()
    b = range_error(u, torch_path.lo, torch_path.hi, spec, 2.4).double()
    torch.testing.assert_close(a.sum(), b.sum(), rtol=u.shape[1] * 2.0 ** -24, atol=0)


def test_other_norms_run_on_the_ops_off_the_cpu():
    """Off the CPU (meta: shapes only) native and compat searches of any norm price on the
    ops, with no host read; the block-scale ops price squares only, so NVFP4 at norm 2.4
    prices every candidate."""
    u = units_of(SPECS["nvfp4"], weight()).to("meta")
    for kw in ({"norm": 2.4}, {"norm": 2.4, "compat": "llmcompressor"}):
        with OpNames() as seen:
            res = mse_search(u, None, None, SPECS["nvfp4"], **kw)
        assert {"quantscope.mse_price_fp", "quantscope.mse_select"} <= seen.names
        assert not {"quantscope.nvfp4_mse", "quantscope.nvfp4_search"} & seen.names
        assert res.lo.device.type == "meta" and res.lo.shape == (u.shape[0],)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name, opt", [("int4-channel", "native"), ("nvfp4", "native"),
                                       ("nvfp4", "expanded"), ("mxfp4", "native"),
                                       ("mxfp8", "global-rule")])
def test_cuda_search_prices_as_the_cpu(name, opt):
    """On CUDA the default engine is the ops' (Triton): the C kernel's terms summed in another
    order, so the same choices but for an exact tie broken by the last bits of a float64
    sum; the chosen errors agree to 1e-12."""
    spec = SPECS[name]
    u = units_of(spec, weight(rows=64, cols=256))
    cpu = mse_search(u, None, None, spec, backend="kernel", **OPTIONS[opt])
    cuda = mse_search(u.cuda(), None, None, spec, **OPTIONS[opt])
    torch.testing.assert_close(cuda.error.cpu(), cpu.error, rtol=1e-12, atol=0)
    assert (cuda.index.cpu() == cpu.index).float().mean() > 0.99


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["int4-channel", "nvfp4"])
@pytest.mark.parametrize("opt", ["memoryless", "expanded"])
def test_cuda_compat_search_is_the_ops_on_the_cpu(name, opt):
    """llm-compressor's search on CUDA: the ops' choices on the CPU (the same rules on the
    same prices: CUDA's powf is within an ulp of the CPU's pow, so all but near ties)."""
    spec = SPECS[name]
    u = units_of(spec, weight(rows=64, cols=256))
    kw = {"compat": "llmcompressor", "norm": 2.4, **COMPAT[opt]}
    cpu = mse_search(u, None, None, spec, backend="ops", **kw)
    cuda = mse_search(u.cuda(), None, None, spec, **kw)
    assert (cuda.index.cpu() == cpu.index).float().mean() > 0.95
    torch.testing.assert_close(cuda.error.cpu(), cpu.error, rtol=1e-5, atol=0)
