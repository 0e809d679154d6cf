"""The min-max family on every layout and block format, against formulas computed here."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import quantscope
from quantscope import Block, Channel, Group, QParams, QuantSpec, Tensor, Tile, Token, presets
from quantscope.qparams import qparams_from_range
from quantscope.stats import minmax as stats
from quantscope.stats import minmax_layouts

FAMILIES = {"memoryless_minmax": {}, "static_minmax": {}, "minmax": {"averaging_constant": 0.25}}


def observe(name, spec, xs, **kw):
    obs = quantscope.get_observer(name, spec, **{**FAMILIES.get(name, {}), **kw})
    for x in xs:
        obs(x)
    return obs


def rand(*shape, seed=0, scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


# ------------------------------------------------- llm-compressor's published sequences
SEQ = [torch.tensor([0.0, 0.0]), torch.tensor([-3.0, 1.0]), torch.tensor([-1.0, 3.0])]


@pytest.mark.parametrize("name,kw,mins,maxs", [
    ("memoryless_minmax", {}, [0, -3, -1], [0, 1, 3]),
    ("static_minmax", {}, [0, -3, -3], [0, 1, 3]),
    ("minmax", {"averaging_constant": 0.1}, [0, -0.3, -0.37], [0, 0.1, 0.39]),
])
def test_llmcompressor_published_sequences(name, kw, mins, maxs):
    obs = quantscope.get_observer(name, QuantSpec(), **kw)
    for x, lo, hi in zip(SEQ, mins, maxs):
        obs(x)
        assert obs.min_vals.item() == pytest.approx(lo, abs=1e-6)
        assert obs.max_vals.item() == pytest.approx(hi, abs=1e-6)


def test_ema_default_constant_and_first_call():
    obs = quantscope.get_observer("minmax", QuantSpec())
    assert obs.averaging_constant == 0.01
    obs(torch.tensor([-2.0, 4.0]))  # the first call initialises
    assert obs.min_vals.tolist() == [-2.0] and obs.max_vals.tolist() == [4.0]
    obs(torch.tensor([2.0, 3.0]))  # the zero qparams add is not averaged in: min moves to 2
    assert obs.min_vals.item() == pytest.approx(-2 + 0.01 * 4)


@pytest.mark.parametrize("symmetric,scale,zp", [(True, 1 / 127.5, 0), (False, 1 / 255, -128)])
def test_llmcompressor_reference_qparams(symmetric, scale, zp):
    obs = observe("memoryless_minmax", QuantSpec("int8", symmetric=symmetric), [torch.ones(5)])
    qp = obs.calculate_qparams()
    assert qp.scale.item() == pytest.approx(scale, rel=1e-7) and qp.zero_point.item() == zp


# ---------------------------------------------------------------- every layout
def ref_units_minmax(x, layout):
    """Per-unit min / max by explicit reshapes (independent of layout.to_units)."""
    if isinstance(layout, Tensor):
        return x.min().reshape(1), x.max().reshape(1)
    if isinstance(layout, Channel):
        m = x.movedim(layout.axis, 0).reshape(x.shape[layout.axis], -1)
        return m.min(1).values, m.max(1).values
    if isinstance(layout, Token):
        m = x.reshape(-1, x.shape[-1])
        return m.min(1).values, m.max(1).values
    if isinstance(layout, Group):
        m = x.movedim(layout.axis, -1)
        if layout.g_idx is not None:  # group k holds the columns with g_idx == k
            cols = [torch.nonzero(layout.g_idx == k).flatten()
                    for k in range(int(layout.g_idx.max()) + 1)]
            m = torch.stack([m[..., c] for c in cols], -2)
        else:
            m = m.reshape(*m.shape[:-1], -1, layout.size)
        return m.amin(-1).reshape(-1), m.amax(-1).reshape(-1)
    if isinstance(layout, Block):
        m = x.movedim(layout.axis, -1)
        n = m.shape[-1]
        nb = math.ceil(n / layout.size)
        lo, hi = [], []
        for b in range(nb):  # a reference may loop: blocks that end early, real values only
            blk = m[..., b * layout.size:(b + 1) * layout.size]
            lo.append(blk.amin(-1))
            hi.append(blk.amax(-1))
        return torch.stack(lo, -1).reshape(-1), torch.stack(hi, -1).reshape(-1)
    if isinstance(layout, Tile):
        R, C = x.shape[-2:]
        lead = x.reshape(-1, R, C)
        lo, hi = [], []
        for t in lead:
            for i in range(0, R, layout.rows):
                for j in range(0, C, layout.cols):
                    blk = t[i:i + layout.rows, j:j + layout.cols]  # edge tiles: real values
                    lo.append(blk.min())
                    hi.append(blk.max())
        return torch.stack(lo), torch.stack(hi)
    raise AssertionError(layout)


G_IDX = torch.tensor([1, 0, 2, 1, 0, 2, 2, 0, 1, 1, 0, 2])  # 3 groups of 4 (activation order)
LAYOUTS = [
    (Tensor(), (5, 7)),
    (Channel(0), (6, 10)),
    (Channel(1), (3, 5, 4)),
    (Channel(-1), (2, 3, 6)),
    (Group(4), (3, 12)),
    (Group(4, axis=0), (8, 5)),
    (Group(4, g_idx=G_IDX), (5, 12)),
    (Token(), (2, 3, 8)),
    (Block(8), (4, 20)),  # padded last block
    (Block(4, axis=0), (10, 3)),
    (Tile(3, 4), (7, 10)),  # padded edge tiles
    (Tile(2, 2), (2, 4, 6)),  # leading dim
]


@pytest.mark.parametrize("layout,shape", LAYOUTS, ids=[str(ly) for ly, _ in LAYOUTS])
@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("symmetric", [True, False])
def test_every_layout_every_family(name, layout, shape, symmetric):
    xs = [rand(*shape, seed=s, scale=s + 1) + 0.5 * s for s in range(3)]
    spec = QuantSpec("int8", layout, symmetric=symmetric)
    obs = observe(name, spec, xs)
    c = FAMILIES[name].get("averaging_constant")
    lo, hi = ref_units_minmax(xs[0], layout)
    for x in xs[1:]:
        l2, h2 = ref_units_minmax(x, layout)
        if name == "memoryless_minmax":
            lo, hi = l2, h2
        elif name == "static_minmax":
            lo, hi = torch.minimum(lo, l2), torch.maximum(hi, h2)
        else:
            lo, hi = lo + c * (l2 - lo), hi + c * (h2 - hi)
    assert torch.equal(obs.min_vals, lo) and torch.equal(obs.max_vals, hi)
    qp = obs.calculate_qparams()
    ref = qparams_from_range(lo, hi, spec).reshape(layout.qparam_shape(shape))
    assert torch.equal(qp.scale, ref.scale) and torch.equal(qp.zero_point, ref.zero_point)
    # and the qparams broadcast against the tensor where they should
    if not isinstance(layout, (Group, Block, Tile)):
        torch.broadcast_shapes(qp.scale.shape, shape)


def test_asymmetric_int_formula_and_range_includes_zero():
    x = torch.tensor([[1.0, 3.0], [-4.0, -2.0], [-1.0, 2.0]])
    qp = observe("memoryless_minmax", QuantSpec("uint8", Channel(0), symmetric=False),
                 [x]).calculate_qparams()
    # rows: [0, 3] (zero added), [-4, 0], [-1, 2]
    assert torch.allclose(qp.scale.flatten(), torch.tensor([3 / 255, 4 / 255, 3 / 255]))
    assert qp.zero_point.flatten().tolist() == [0, 255, round(1 / (3 / 255))]


def test_symmetric_unsigned_zero_point_is_mid_range():
    qp = observe("static_minmax", QuantSpec("uint8"), [rand(4, 4)]).calculate_qparams()
    assert qp.zero_point.item() == 128


@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.integers(0, 2 ** 16))
@settings(max_examples=25, deadline=None)
def test_static_equals_memoryless_of_the_concatenation(rows, seed):
    xs = [rand(r, 3, 5, seed=seed + i) for i, r in enumerate(rows)]
    spec = QuantSpec("int4", Channel(1), symmetric=False)
    a = observe("static_minmax", spec, xs).calculate_qparams()
    b = observe("memoryless_minmax", spec, [torch.cat(xs)]).calculate_qparams()
    assert torch.equal(a.scale, b.scale) and torch.equal(a.zero_point, b.zero_point)


# ------------------------------------------------------------------ block formats
def float_pow2(k):
    return torch.tensor([2.0 ** int(v) for v in k.flatten()]).reshape(k.shape)


@pytest.mark.parametrize("fmt,emax", [("fp4_e2m1", 2), ("fp6_e2m3", 2), ("fp6_e3m2", 4),
                                      ("fp8_e4m3", 8), ("fp8_e5m2", 15)])
@pytest.mark.parametrize("mode", ["floor", "ceil", "even", "rceil"])
def test_mx_scales_every_mode(fmt, emax, mode):
    x = rand(4, 96, seed=3, scale=5.0)
    x[0, :32] = 0.0  # an all-zero block
    x[1, 0] = 1.75 * 2.0 ** 3  # mantissa at fp4's rounding threshold
    x[1, 32] = 2.0 ** -3  # an exact power of two
    spec = QuantSpec(fmt, Block(32), scale=f"e8m0:{mode}")
    qp = observe("memoryless_minmax", spec, [x]).calculate_qparams()
    amax = x.abs().reshape(4, 3, 32).amax(-1).double()
    fmax = spec.format.max
    mbits = spec.format.mbits
    safe = amax.clamp(min=1e-300)
    if mode == "floor":
        k = torch.floor(torch.log2(safe)) - emax
    elif mode == "ceil":
        k = torch.ceil(torch.log2(safe)) - emax
    elif mode == "rceil":
        k = torch.ceil(torch.log2(safe / fmax))
    else:  # round amax to the element's mantissa (half away), then floor
        e = torch.floor(torch.log2(safe))
        step = 2.0 ** (e - mbits)
        k = torch.floor(torch.log2(torch.floor(safe / step + 0.5) * step)) - emax
    k = torch.where(amax == 0, torch.full_like(k, -127), k).clamp(-127, 127)
    assert qp.scale.shape == (4, 3)
    assert torch.equal(qp.scale.double(), float_pow2(k)), (mode, qp.scale, float_pow2(k))
    assert qp.global_scale is None and not qp.zero_point.any()


def test_mx_static_keeps_the_running_block_max():
    xs = [rand(2, 64, seed=s, scale=s + 1) for s in range(3)]
    qs = observe("static_minmax", presets.MXFP8, xs).calculate_qparams()
    qm = observe("memoryless_minmax", presets.MXFP8, [torch.cat(xs)]).calculate_qparams()
    amax = torch.stack([x.abs().reshape(2, 2, 32).amax(-1) for x in xs]).amax(0)
    ref = QParams(*observe("memoryless_minmax", presets.MXFP8,
                           [amax.repeat_interleave(32, -1)]).calculate_qparams())
    assert torch.equal(qs.scale, ref.scale)
    assert qm.scale.shape == (6, 2)


@pytest.mark.parametrize("name", FAMILIES)
def test_nvfp4_global_scale_from_whole_tensor_absmax(name):
    x = rand(8, 64, seed=1, scale=2.0)
    x[3, 5] = -37.0  # the tensor absmax is a negative value
    qp = observe(name, presets.NVFP4, [x]).calculate_qparams()
    gs = 448.0 * 6.0 / x.abs().max()
    assert qp.global_scale.shape == (1,) and torch.equal(qp.global_scale, gs.reshape(1))
    block_amax = x.abs().reshape(8, 4, 16).amax(-1)
    ref = (block_amax / 6.0 * gs).to(torch.float8_e4m3fn).float()
    assert torch.equal(qp.scale, ref)
    assert torch.allclose(qp.effective_scale, ref / gs)


@pytest.mark.parametrize("shape", [(256, 512), (64, 48)], ids=str)  # kernel-sized, torch-sized
@pytest.mark.parametrize("sign", [1.0, -1.0, 0.0])
def test_memoryless_nvfp4_global_amax_is_the_forward_pass_s(shape, sign):
    """The memoryless observer takes NVFP4's global amax from the ends its min / max pass
    found; the qparams are bitwise those derived from the ranges."""
    x = rand(*shape, seed=4, scale=3.0).abs() * sign  # one-sided and all-zero tensors too
    obs = observe("memoryless_minmax", presets.NVFP4, [x])
    amax = obs.global_amax()
    assert amax is not None and amax == x.abs().max()
    got = obs.calculate_qparams()
    want = qparams_from_range(obs.min_vals, obs.max_vals, presets.NVFP4)
    for a, b in zip((got.scale, got.global_scale), (want.scale, want.global_scale)):
        assert torch.equal(a.reshape(-1), b.reshape(-1))


def test_memoryless_global_amax_is_dropped_when_the_state_changes():
    x = rand(64, 256, seed=2)
    obs = observe("memoryless_minmax", presets.NVFP4, [x])
    assert obs.global_amax() is not None
    obs.max_vals.mul_(2)  # in place: a new version
    assert obs.global_amax() is None
    derived = qparams_from_range(obs.min_vals, obs.max_vals, presets.NVFP4).global_scale
    assert torch.equal(obs.calculate_qparams().global_scale, derived)  # the new state's
    obs(x)
    assert obs.global_amax() is not None
    state = {k: v.clone() for k, v in obs.state_dict().items()}
    obs.load_state_dict(state)
    assert obs.global_amax() is None
    obs(x)
    obs.reset()
    assert obs.global_amax() is None
    assert observe("memoryless_minmax", QuantSpec("int8"), [x]).global_amax() is None


def test_memoryless_nvfp4_observer_pickles_and_copies():
    import copy
    import io

    obs = observe("memoryless_minmax", presets.NVFP4, [rand(64, 256, seed=8)])
    want = obs.calculate_qparams()
    buf = io.BytesIO()
    torch.save(obs, buf)
    buf.seek(0)
    for other in (copy.deepcopy(obs), torch.load(buf, weights_only=False)):
        assert other.global_amax() is None  # derived from the ranges instead
        got = other.calculate_qparams()
        assert torch.equal(got.scale, want.scale)
        assert torch.equal(got.global_scale, want.global_scale)
    assert obs.global_amax() is not None


def test_memoryless_nvfp4_under_inference_mode():
    """Inference tensors keep no versions: the global amax is derived from the ranges."""
    x = rand(64, 256, seed=3)
    want = observe("memoryless_minmax", presets.NVFP4, [x]).calculate_qparams()
    with torch.inference_mode():
        obs = observe("memoryless_minmax", presets.NVFP4, [x])
        assert obs.global_amax() is None
        got = obs.calculate_qparams()
    assert torch.equal(got.scale, want.scale) and torch.equal(got.global_scale, want.global_scale)


def test_nvfp4_static_global_scale_follows_running_absmax():
    xs = [rand(4, 32, seed=s, scale=1 + 3 * s) for s in range(3)]
    qp = observe("static_minmax", presets.NVFP4, xs).calculate_qparams()
    absmax = torch.stack([x.abs().max() for x in xs]).max()
    assert torch.equal(qp.global_scale, (448.0 * 6.0 / absmax).reshape(1))


def test_bfp16_shared_exponent_with_overflow_check():
    x = rand(3, 24, seed=2, scale=3.0)
    x[0, :8] = torch.tensor([127.4, 1, 2, 3, -4, 5, 6, 7]) / 64  # rounds to 127: no bump
    x[0, 8:16] = torch.tensor([127.6, 1, 2, 3, -4, 5, 6, 7]) / 64  # rounds to 128: bump
    x[1, :8] = 0.0
    qp = observe("memoryless_minmax", presets.BFP16, [x]).calculate_qparams()
    amax = x.abs().reshape(3, 3, 8).amax(-1).double()
    k = torch.floor(torch.log2(amax.clamp(min=1e-300))) - 6
    bump = torch.round(amax / 2.0 ** k) >= 128  # Quark's overflow check
    k = torch.where(amax == 0, torch.full_like(k, -127), k + bump.double())
    assert torch.equal(qp.scale.double(), float_pow2(k))
    assert bump[0, 1] and not bump[0, 0]
    q = quantscope.quantize(x, qp, presets.BFP16)
    assert q.abs().max() <= 127


def test_tile_fp8_block_scales():
    x = rand(200, 260, seed=4)
    spec = QuantSpec("fp8_e4m3", Tile(128, 128))
    qp = observe("memoryless_minmax", spec, [x]).calculate_qparams()
    assert qp.scale.shape == (2, 3)
    assert torch.equal(qp.scale[1, 2], x[128:, 256:].abs().max() / 448.0)


# -------------------------------------------------------------------- placeholder
def test_placeholder_has_unit_scales():
    obs = quantscope.get_observer("placeholder", QuantSpec("int8", Channel(0)))
    obs(rand(5, 3))
    qp = obs.calculate_qparams()
    assert qp.scale.shape == (5, 1) and torch.equal(qp.scale, torch.ones(5, 1))
    assert not qp.zero_point.any()
    with pytest.raises(ValueError, match="before any"):
        quantscope.get_observer("placeholder").calculate_qparams()


def test_placeholder_qparams_of_an_nvfp4_spec_fake_quantize():
    """They lacked the global scale NVFP4 needs: fake_quantize refused them."""
    x = rand(4, 32)
    obs = quantscope.get_observer("placeholder", presets.NVFP4)
    obs(x)
    qp = obs.calculate_qparams()
    assert torch.equal(qp.global_scale, torch.ones(1)) and torch.equal(qp.effective_scale,
                                                                        torch.ones(4, 2))
    want = quantscope.fake_quantize(x, QParams(torch.ones(4, 2), torch.zeros(4, 2,
                                               dtype=torch.int32), torch.ones(1)), presets.NVFP4)
    assert torch.equal(quantscope.fake_quantize(x, qp, presets.NVFP4), want)


# ------------------------------------------------------------- the min / max kernel
def _kernel_or_skip():
    """The compiled min / max library, for the tests that call it directly; a skip where none
    is built (no C compiler: the torch path runs, docs/guide/observers.md)."""
    lib = stats._kernel()
    if lib is None:
        pytest.skip("no compiled kernel")
    return lib


@given(st.integers(2, 300), st.one_of(st.integers(1, 700), st.sampled_from([8, 16, 24, 32, 64])),
       st.integers(0, 2 ** 16), st.booleans())
@settings(max_examples=60, deadline=None)
def test_kernel_equals_torch(U, E, seed, specials):
    old, stats.KERNEL_MIN_NUMEL = stats.KERNEL_MIN_NUMEL, 0  # every size through the kernel
    try:
        _kernel_equals_torch(U, E, seed, specials)
    finally:
        stats.KERNEL_MIN_NUMEL = old


def _kernel_equals_torch(U, E, seed, specials):
    u = rand(U, E, seed=seed, scale=100.0)
    if specials:
        g = torch.Generator().manual_seed(seed)
        idx = torch.randint(0, u.numel(), (6,), generator=g)
        vals = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3e38])
        u.view(-1)[idx] = vals
    lo, hi = stats.unit_minmax(u)
    rlo, rhi = stats.torch_unit_minmax(u)
    assert torch.allclose(lo, rlo, equal_nan=True, atol=0, rtol=0)
    assert torch.allclose(hi, rhi, equal_nan=True, atol=0, rtol=0)
    clo, chi = minmax_layouts.column_minmax(u.t().contiguous())  # the vertical kernel, same answer
    assert torch.allclose(clo, rlo, equal_nan=True, atol=0, rtol=0)
    assert torch.allclose(chi, rhi, equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("E", [8, 16, 24, 32, 64, 128])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
def test_kernel_ends_equal_torch(E, bad, monkeypatch):
    """The smallest min and largest max the kernel finds in its pass (the non-finite check,
    NVFP4's global amax) are torch's amin / amax of its per-row results, NaN included; rows
    in every position of a group of 4, and a tail."""
    monkeypatch.setattr(stats, "KERNEL_MIN_NUMEL", 0)
    for U, at in ((4 * 300 + 3, 0), (4 * 300 + 3, 1), (4 * 300 + 3, 4 * 150 + 2),
                  (4 * 300 + 3, 4 * 300 + 2)):
        u = rand(U, E, seed=U + at, scale=5.0)
        if bad is not None:
            u[at, E - 1 - at % E] = bad
        ends = torch.full((2,), 7.0)
        lo, hi = stats.unit_minmax(u, ends=ends)
        rlo, rhi = stats.torch_unit_minmax(u)
        assert torch.allclose(lo, rlo, equal_nan=True, atol=0, rtol=0)
        assert torch.allclose(hi, rhi, equal_nan=True, atol=0, rtol=0)
        want = torch.stack((rlo.amin(), rhi.amax()))
        assert torch.allclose(ends, want, equal_nan=True, atol=0, rtol=0), (U, at)


@pytest.mark.parametrize("E", [1, 7, 8, 15, 16, 17, 32, 100, 4096])
def test_kernel_on_large_inputs(E, monkeypatch):
    monkeypatch.setattr(stats, "KERNEL_MIN_NUMEL", 0)
    u = rand(max(2, (1 << 17) // E), E, seed=E)
    u[1, E // 2] = float("nan")
    lo, hi = stats.unit_minmax(u)
    rlo, rhi = stats.torch_unit_minmax(u)
    assert torch.allclose(lo, rlo, equal_nan=True, atol=0, rtol=0)
    assert torch.allclose(hi, rhi, equal_nan=True, atol=0, rtol=0)
    assert lo[1].isnan() and hi[1].isnan()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("E", [4, 16, 24, 100])
def test_kernel_blocks_equal_torch(E, dtype, threads, monkeypatch):
    """The kernel stages each share's min / max in blocks (csrc/unit_minmax.c, block_units:
    256 float32 units, whole widening pieces of half rows: 512 units of 4, so the staging
    buffers hold a piece, not 256 units): shares of several blocks and a tail give torch's
    results, a NaN row and the ends too; a fused state update that keeps no lo / hi (the
    cached observer step's call) updates the state as torch's ops do."""
    monkeypatch.setattr(stats, "THREAD_MIN_NUMEL", 1)
    U = 2 * 1000 + 3  # shares of 1001 / 1002 units on 2 threads: blocks and a tail each
    u = rand(U, E, seed=E).to(dtype)
    u[700, 3] = float("nan")  # in the third block of 256
    rlo, rhi = stats.torch_unit_minmax(u)
    slo, shi = rand(U, 1, seed=1).view(U) - 3, rand(U, 1, seed=2).view(U) + 3
    want_lo, want_hi = slo.clone(), shi.clone()
    stats.update_state("min", 0.0, want_lo, want_hi, rlo, rhi)
    lib = _kernel_or_skip()
    ends = torch.empty(2)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        lo, hi = stats.unit_minmax(u, ends=ends)
        lib.qs_unit_minmax(u.data_ptr(), U, E, None, None, ends.data_ptr(), threads,
                           stats.UPDATES["min"], 0.0, slo.data_ptr(), shi.data_ptr(),
                           stats.KERNEL_DTYPES[dtype])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(lo.nan_to_num(7.0), rlo.nan_to_num(7.0))
    assert torch.equal(hi.nan_to_num(7.0), rhi.nan_to_num(7.0))
    assert lo[700].isnan() and ends.isnan().all()
    assert torch.equal(slo.nan_to_num(7.0), want_lo.nan_to_num(7.0))
    assert torch.equal(shi.nan_to_num(7.0), want_hi.nan_to_num(7.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_one_unit_state_update_keeps_no_lo_hi(dtype):
    """One unit split over two threads (a per-tensor range), its state updated with lo / hi
    NULL (the cached step's call): the state as torch's update of the unit's min / max, the
    ends too (one_unit keeps the min / max in locals, not through the NULL pointers)."""
    u = rand(1, 5000, seed=3).to(dtype)
    slo, shi = torch.tensor([-0.5]), torch.tensor([0.5])
    want_lo, want_hi = slo.clone(), shi.clone()
    stats.update_state("ema", 0.25, want_lo, want_hi, *stats.torch_unit_minmax(u))
    ends = torch.empty(2)
    _kernel_or_skip().qs_unit_minmax(u.data_ptr(), 1, 5000, None, None, ends.data_ptr(), 2,
                                     stats.UPDATES["ema"], 0.25, slo.data_ptr(), shi.data_ptr(),
                                     stats.KERNEL_DTYPES[dtype])
    assert torch.equal(slo, want_lo) and torch.equal(shi, want_hi)
    assert torch.equal(ends, torch.stack([u.float().min(), u.float().max()]))


@pytest.mark.parametrize("U, E", [(7, 4096), (64, 16), (3, 100)])
def test_kernel_threads_split_units(U, E, monkeypatch):
    # the split over threads (used from 4M elements) gives the same per-unit results
    monkeypatch.setattr(stats, "KERNEL_MIN_NUMEL", 0)
    monkeypatch.setattr(stats, "THREAD_MIN_NUMEL", 1)
    u = rand(U, E, seed=U)
    u[U // 2, 1] = float("nan")
    ends = torch.empty(2)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        lo, hi = stats.unit_minmax(u, ends=ends)
        clo, chi = minmax_layouts.column_minmax(u.t().contiguous())
    finally:
        torch.set_num_threads(before)
    rlo, rhi = stats.torch_unit_minmax(u)
    for got in ((lo, hi), (clo, chi)):
        assert torch.equal(got[0].nan_to_num(7), rlo.nan_to_num(7))
        assert torch.equal(got[1].nan_to_num(7), rhi.nan_to_num(7))
    assert ends.isnan().all()


def test_kernel_is_built_here():
    # the project machines have a C compiler: the fast path must not silently fall back
    # (where the one the kernels would use, $CC or cc / gcc, is there)
    try:
        if quantscope.kernels.compiler() is None:
            pytest.skip("no C compiler")
    except quantscope.kernels.NoCompiler as e:
        pytest.skip(str(e))
    if quantscope.kernels.disabled():
        pytest.skip("QUANTSCOPE_NO_KERNEL is set")
    assert quantscope.kernels.available("unit_minmax")


def test_non_contiguous_and_other_dtypes_fall_back():
    u = rand(300, 400).t()  # not contiguous
    assert torch.equal(stats.unit_minmax(u)[0], u.amin(1))
    d = rand(300, 400).double()
    assert stats.unit_minmax(d)[1].dtype == torch.float64


@pytest.mark.parametrize("layout,shape", [
    (Channel(-1), (16, 64, 96)), (Channel(1), (8, 48, 256)), (Channel(2), (4, 8, 40, 64)),
    (Channel(1), (300, 400)), (Tile(32, 32), (2, 128, 256)), (Tile(16, 64), (256, 512)),
    (Group(32, 0), (256, 512)), (Group(8, 1), (4, 64, 300)), (Block(16, 0), (128, 1024)),
    (Block(16, -2), (2, 64, 600)),
], ids=str)
def test_layout_minmax_equals_the_units_path(layout, shape):
    x = rand(*shape, seed=7)
    x.view(-1)[1234] = float("nan")
    x.view(-1)[999] = float("inf")
    if stats._kernel() is None:
        pytest.skip("no compiled kernel")
    fast = minmax_layouts.layout_minmax(x, layout)
    assert fast is not None  # read in place, not from a copy of the units
    ref = stats.torch_unit_minmax(layout.to_units(x))
    for a, b in zip(fast, ref):
        assert a.shape == b.shape and torch.allclose(a, b, equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_a_transposed_matrix_reads_its_channels_in_place(axis):
    """Per-channel ranges of ``w.t()`` (found by probing: its strided units took torch's
    aminmax(dim=1), 12x the contiguous weight's time) come from the memory it views, and
    equal the units path's."""
    w = rand(300, 400, seed=3)
    w[7, 11] = float("nan")
    x = w.t()
    fast = minmax_layouts.layout_minmax(x, Channel(axis))
    if stats._kernel() is None:
        pytest.skip("no compiled kernel")
    assert fast is not None
    ref = stats.torch_unit_minmax(Channel(axis).to_units(x.contiguous()))
    for a, b in zip(fast, ref):
        assert a.shape == b.shape and torch.allclose(a, b, equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("out", [False, True])
def test_strided_units_on_the_torch_path_equal_contiguous_ones(out):
    u = rand(300, 400, seed=4)[:, ::3]  # a slice: strided rows
    u[5, 2] = float("nan")
    bufs = (torch.empty(300), torch.empty(300)) if out else None
    got = stats.torch_unit_minmax(u, bufs)
    want = torch.aminmax(u.contiguous(), dim=1)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, equal_nan=True, atol=0, rtol=0)
    if out:
        assert got[0] is bufs[0] and got[1] is bufs[1]


@pytest.mark.parametrize("name", FAMILIES)
def test_observers_agree_with_and_without_the_direct_path(name, monkeypatch):
    spec = QuantSpec("int8", Channel(-1), symmetric=False)
    xs = [rand(8, 32, 300, seed=s) for s in range(3)]
    fast = observe(name, spec, xs).calculate_qparams()
    monkeypatch.setattr(quantscope.observers.base, "layout_minmax", lambda *args: None)
    slow = observe(name, spec, xs).calculate_qparams()
    assert torch.equal(fast.scale, slow.scale) and torch.equal(fast.zero_point, slow.zero_point)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("layout", [Group(32), Channel(0), Channel(-1), Block(16)], ids=str)
def test_non_finite_detected_on_the_kernel_path(bad, layout):
    x = rand(256, 512, seed=5)  # large enough for the compiled kernel
    x[200, 17] = bad
    obs = observe("static_minmax", QuantSpec("int8", layout) if not isinstance(layout, Block)
                  else presets.NVFP4, [rand(256, 512, seed=6), x])
    with pytest.raises(ValueError, match="NaN or inf"):
        obs.calculate_qparams()
    clean = observe("static_minmax", QuantSpec("int8", Group(32)), [rand(256, 512, seed=6)])
    clean.calculate_qparams()


@pytest.mark.parametrize("name,kind", [("static_minmax", "min"), ("minmax", "ema"),
                                       ("llmcompressor:minmax", "ema_lerp")])
def test_fused_state_update_equals_torch(name, kind, monkeypatch):
    """The kernel's fused static / EMA update rounds exactly as update_state's torch ops."""
    xs = [rand(64, 2048, seed=s, scale=s + 1) for s in range(4)]  # kernel-sized
    xs[2][3, 5] = float("nan")

    def run():
        if name.startswith("llmcompressor"):
            obs = quantscope.get_observer(name, base_name="weight", args={
                "strategy": "channel", "observer_kwargs": {"averaging_constant": 0.3}})
        else:
            obs = quantscope.get_observer(name, QuantSpec("int8", Channel(0)),
                                          **({"averaging_constant": 0.3} if kind != "min" else {}))
        for x in xs:
            quantscope.observers.base.Observer.forward(obs, x)
        return obs.min_vals.clone(), obs.max_vals.clone()

    fused = run()
    monkeypatch.setattr(stats, "_use_kernel", lambda x: False)  # torch path throughout
    ref = run()
    for a, b in zip(fused, ref):
        assert torch.allclose(a, b, equal_nan=True, atol=0, rtol=0)
    assert fused[0][3].isnan()
    with pytest.raises(ValueError, match="update_state"):
        stats.update_state("median", 0.0, *fused, *fused)


@pytest.mark.parametrize("name", ["minmax", "static_minmax"])
def test_running_state_under_inductor_equals_eager(name):
    """Under torch.compile (Inductor) the first call's state, a clone of the scratch the
    module caches, got the scratch's own buffer: the next in-place EMA step zeroed it.
    Compiled, the scratch is not cached."""
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    eager = quantscope.get_observer(name, QuantSpec("int8", "tensor"))
    compiled = quantscope.get_observer(name, QuantSpec("int8", "tensor"))
    step = torch.compile(compiled, backend="inductor")
    for i in range(3):
        eager(x * (i + 1))
        step(x * (i + 1))
    assert torch.equal(compiled.min_vals, eager.min_vals)
    assert torch.equal(compiled.max_vals, eager.max_vals)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_any_non_finite_and_extreme_ends_agree_with_isfinite(dtype):
    # the per-call check (x - x is NaN exactly at NaN / inf) against torch's isfinite, on the
    # extremes of each dtype: its max (max - max = 0), subnormals, -0.0, and each bad value
    fi = torch.finfo(dtype)
    values = [0.0, -0.0, fi.max, -fi.max, fi.tiny, fi.tiny / 4, 1.5]
    for bad in (None, float("nan"), float("inf"), -float("inf")):
        for n in (1, 3):  # one unit (cat) and several (amin / amax)
            lo = torch.tensor(values[:n], dtype=dtype)
            hi = torch.tensor(values[-n:], dtype=dtype)
            if bad is not None:
                (lo if bad != float("inf") else hi)[n - 1] = bad
            ends = stats.extreme_ends(lo, hi)
            assert ends.shape == (2,)
            want = bool(~torch.isfinite(torch.cat((lo, hi))).all())
            assert bool(stats.any_non_finite(ends)) == want
            assert bool(stats.any_non_finite(torch.cat((lo, hi)))) == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_holds_non_finite_agrees_with_isfinite(dtype):
    # one aminmax instead of isfinite(x).all(): a NaN or an inf anywhere, a dtype's max,
    # subnormals and -0.0 (all finite), and an empty batch (nothing non-finite)
    fi = torch.finfo(dtype)
    finite = torch.tensor([0.0, -0.0, fi.max, -fi.max, fi.tiny, fi.tiny / 4, 1.5], dtype=dtype)
    assert not stats.holds_non_finite(finite) and not stats.holds_non_finite(finite[:0])
    for bad in (float("nan"), float("inf"), -float("inf")):
        for at in range(len(finite)):
            x = finite.clone()
            x[at] = bad
            assert stats.holds_non_finite(x.reshape(7, 1)), (bad, at)


@pytest.mark.parametrize("shape", [(5, 10), (7, 10), (4, 9)])
@pytest.mark.parametrize("name", FAMILIES)
def test_padded_tiles_of_positive_data_keep_their_own_min(name, shape):
    # the padding of the edge tiles (two tile rows, a partial column) is not data: an
    # all-positive tensor's tile minimums are its values', never the padding's 0
    x = rand(*shape, seed=3).abs() + 1.0
    obs = observe(name, QuantSpec("int8", Tile(3, 4), symmetric=False), [x])
    lo, hi = ref_units_minmax(x, Tile(3, 4))
    assert bool((obs.min_vals >= 1.0).all())
    assert torch.equal(obs.min_vals, lo) and torch.equal(obs.max_vals, hi)
