"""The MSE search's C kernel on float element formats (MX, NVFP4 blocks; issue 35 item 6)
against the torch path: the elementwise fake-quant error bit for bit (FloatFormat.round),
the error sums against a float64 reference, and whole searches (the NVFP4 expanded range,
the fp8 block-scale plateaus, NVFP4's global-scale grid, per-unit and global patience)
choosing the same ranges bit for bit, with the same errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantscope import kernels, presets
from quantscope.estimators import mse_kernel, mse_search
from quantscope.layout import Block, Channel
from quantscope.observers import get_observer
from quantscope.qdq import fake_quantize_units
from quantscope.qparams import qparams_from_range
from quantscope.spec import QuantSpec
from quantscope.stats.minmax import unit_minmax

pytestmark = pytest.mark.skipif(not kernels.available("mse_search"),
                                reason="no C compiler (or QUANTSCOPE_NO_KERNEL): torch path only")

SPECS = {
    "nvfp4": presets.NVFP4,
    "mxfp4": presets.MXFP4,
    "mxfp6-e2m3": presets.MXFP6_E2M3,
    "mxfp6-e3m2": presets.MXFP6_E3M2,
    "mxfp8": presets.MXFP8,
    "fp8-e5m2-channel": QuantSpec("fp8_e5m2", Channel(0)),
    "nvfp4-block-7": QuantSpec("fp4_e2m1", Block(7), scale="fp8_e4m3"),  # scalar tails
}
#: llm-compressor's nvfp4_expanded_mse grid (our NVFP4ExpandedMSEObserver's defaults)
EXPANDED = {"maxshrink": 1 - 0.8 / 1.8, "grid": 200, "patience": 1000, "expand": 1.8}


def weight(shape=(12, 224), seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g).add_(0.05)
    w[1, 3], w[5, -1] = 9.0, -7.0
    w[2, :32] = 0.0                      # all-zero blocks
    w[3, :32] = 0.75                     # all-equal blocks
    w[4, :32] = torch.randn(32, generator=g) * 1e-39  # float32 subnormals
    return w


def units_of(spec, w):
    u = spec.layout.to_units(w.contiguous())
    return (u, *unit_minmax(u))


def torch_dq(x, s, spec):
    return fake_quantize_units(x[None], torch.tensor([[s]]), torch.zeros(1, 1), spec)[0] - x


@pytest.mark.parametrize("name", sorted(SPECS))
def test_elementwise_error_is_torch_bit_for_bit(name):
    spec, fmt = SPECS[name], SPECS[name].format
    g = torch.Generator().manual_seed(1)
    for n in (1, 7, 16, 33, 77):  # vector bodies and scalar tails
        x = torch.randn(n, generator=g) * 3
        x[: n // 4] = 0.0
        for s in (0.37, 2.5e-3, 1.0, 1e-30, 3e38):
            # half-way points between codes (ties to even), the largest code, past it
            t = torch.tensor([0.25, 0.75, 1.25, 2.5, -3.5, fmt.max, fmt.max * 1.1, -1e6, 1e-41])
            # x / s overflowing to inf (s = 1e-30): saturates at the largest code, as torch
            xx = torch.cat((x, t * s, torch.tensor([3e38, -3e38])))
            got = mse_kernel.dq(xx, s, 0.0, spec)
            assert torch.equal(got.view(torch.int32), torch_dq(xx, s, spec).view(torch.int32))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_prices_are_the_float64_sums_of_exact_squares(name):
    spec = SPECS[name]
    u, lo, hi = units_of(spec, weight())
    f = torch.tensor([1.3, 1.0, 0.8])
    qp = qparams_from_range(lo[None] * f[:, None], hi[None] * f[:, None], spec)
    scale = qp.effective_scale.expand(3, u.shape[0])
    got = mse_kernel.price(u, scale, qp.zero_point, spec)
    d = fake_quantize_units(u[None], scale[..., None], qp.zero_point[..., None].float(), spec)
    ref = (d - u[None]).double().square().sum(-1)  # each square exact in float64
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=0.0)


def assert_same_search(u, lo, hi, spec, **kw):
    ref = mse_search(u, lo, hi, spec, backend="torch", **kw)
    got = mse_search(u, lo, hi, spec, backend="kernel", **kw)
    assert torch.equal(got.index, ref.index)
    assert torch.equal(got.lo, ref.lo) and torch.equal(got.hi, ref.hi)
    if ref.global_amax is None:
        assert got.global_amax is None
    else:
        assert torch.equal(torch.as_tensor(got.global_amax), torch.as_tensor(ref.global_amax))
    torch.testing.assert_close(got.error, ref.error, rtol=1e-6, atol=0.0)
    return got


OPTIONS = [
    {},                                                  # native grid, per-unit patience
    EXPANDED,                                            # nvfp4_expanded_mse
    {**EXPANDED, "patience": 3},                         # plateaus not counted
    {"patience": 2, "per_unit_patience": False},         # llm-compressor's global rule
    {"patience": None, "global_grid": 1},                # every candidate
    {"tie": "last", "patience": None, "global_grid": 2},
    {"factors": [1.0, 0.9, 0.9, 1.2, 0.5], "patience": 1},
]


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("opt", range(len(OPTIONS)))
def test_search_is_the_torch_path(name, opt):
    spec = SPECS[name]
    u, lo, hi = units_of(spec, weight())
    assert mse_kernel.usable(u, spec, 2.0)
    assert_same_search(u, lo, hi, spec, **OPTIONS[opt])


@pytest.mark.parametrize("opt", [1, 3])
def test_search_over_several_kernel_chunks(opt):
    """Units in many chunks and candidates in several blocks: the global rule's two passes."""
    spec = presets.NVFP4
    u, lo, hi = units_of(spec, weight((40, 512), seed=3))
    ref = assert_same_search(u, lo, hi, spec, **OPTIONS[opt])
    small = mse_search(u, lo, hi, spec, backend="kernel", chunk_elems=300, **OPTIONS[opt])
    assert torch.equal(small.index, ref.index) and torch.equal(small.lo, ref.lo)


def test_degenerate_blocks():
    """Zeros, all-equal, subnormal and single-element inputs: finite errors, the torch path."""
    for spec in (presets.NVFP4, presets.MXFP4):
        for w in (torch.zeros(3, 64), torch.full((2, 64), -1.5), torch.full((1, 32), 3e-42),
                  torch.randn(1, 1).expand(1, 32)):
            u, lo, hi = units_of(spec, w.contiguous())
            res = assert_same_search(u, lo, hi, spec, **EXPANDED)
            assert torch.isfinite(res.error).all()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 9), cols=st.integers(1, 100),
       name=st.sampled_from(sorted(SPECS)), opt=st.integers(0, len(OPTIONS) - 1),
       log_scale=st.floats(-30, 30))
def test_search_property(seed, rows, cols, name, opt, log_scale):
    spec = SPECS[name]
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 2.0 ** log_scale
    w[torch.rand(rows, cols, generator=g) < 0.1] = 0.0
    u, lo, hi = units_of(spec, w)
    assert_same_search(u, lo, hi, spec, **OPTIONS[opt])


def test_observer_runs_the_kernel(monkeypatch):
    """nvfp4_expanded_mse takes the kernel by default; its ranges are the torch path's."""
    w = weight((16, 256), seed=5)
    calls = []
    search = mse_kernel.search
    monkeypatch.setattr(mse_kernel, "search", lambda *a, **k: calls.append(1) or search(*a, **k))
    obs = get_observer("nvfp4_expanded_mse", presets.NVFP4)
    obs(w)
    assert calls
    monkeypatch.setattr(mse_kernel, "usable", lambda *a: False)
    ref = get_observer("nvfp4_expanded_mse", presets.NVFP4)
    ref(w)
    assert torch.equal(obs.min_vals, ref.min_vals) and torch.equal(obs.max_vals, ref.max_vals)
    assert torch.equal(obs.global_amax_val, ref.global_amax_val)


def test_kernel_refuses_what_it_does_not_score():
    u, lo, hi = units_of(presets.NVFP4, weight())
    assert not mse_kernel.usable(u, presets.NVFP4, 2.4)
    assert not mse_kernel.usable(u.double(), presets.NVFP4, 2.0)
    with pytest.raises(ValueError, match="backend='kernel'"):
        mse_search(u, lo, hi, presets.NVFP4, backend="kernel", norm=2.4)
