"""compat.quark against AMD Quark 0.13 where tensors change shape, blocks are zero and batches
are constant: padded MX blocks, static states that start over when the unit layout changes,
BFP16's eps for a zero block, the histogram family's nudged top edge for constant input and
its ``min_val`` / ``max_val``.

The tests marked ``peers`` import Quark and compare with its classes (the peers' venv).
"""

from __future__ import annotations

import pytest
import torch

from quantscope.compat import quark

HISTOGRAMS = ["PerTensorHistogramObserver", "PerTensorPercentileObserver",
              "PerTensorMSEObserver"]


def twins(name, **kw):
    """Quark's class and ours on one ``QTensorConfig`` (it takes our class as observer_cls)."""
    from quark.torch.quantization.config.config import QTensorConfig
    from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType, ScaleType
    from quark.torch.quantization.observer import observer as qo

    kw = {"qscheme": "per_tensor", "round_method": RoundType.half_even,
          "scale_type": ScaleType.float, "is_dynamic": False, **kw}
    kw["dtype"], kw["qscheme"] = Dtype(kw["dtype"]), QSchemeType(kw["qscheme"])
    c = QTensorConfig(observer_cls=getattr(quark, name), **kw)
    return getattr(qo, name)(c), getattr(quark, name)(c)


def feed(observers, xs):
    for o in observers:
        for x in xs:
            o(x)


def same(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert torch.equal(a, b), (a, b)


def randn(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def mx(scale_format="e8m0", **kw):
    return {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "ch_axis": -1,
            "scale_format": scale_format, **kw}


# ------------------------------------------------------------- without the peer
def test_per_group_minmax_still_refuses_a_group_size_that_does_not_divide():
    # only the block observers pad (Quark's per-group one raises ValueError too)
    obs = quark.PerGroupMinMaxObserver(mx("float32", dtype="int8"))
    with pytest.raises(ValueError, match="size 32 does not divide 40"):
        obs(torch.randn(4, 40))


def test_mx_float32_scale_of_a_padded_block_is_its_real_absmax():
    x = randn(4, 40)
    obs = quark.PerBlockMXObserver(mx("float32"))
    obs(x)
    scale, _ = obs._calculate_qparams()
    want = torch.stack([x[:, :32].abs().amax(1), x[:, 32:].abs().amax(1)], 1) / 6.0
    assert torch.equal(scale, want)  # fp4's largest value 6; the padding zeros add nothing


def test_static_per_channel_keeps_its_token_count_when_it_starts_over():
    obs = quark.PerChannelMinMaxObserver({"dtype": "int8", "qscheme": "per_channel",
                                          "ch_axis": 0, "is_dynamic": False})
    obs(torch.ones(2, 16))
    obs(torch.full((4, 16), 2.0))
    assert obs._num_observed_tokens == 6
    assert torch.equal(obs.max_val, torch.full((4,), 2.0))


# ------------------------------------------------------- against the installed Quark
@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("scale_format", ["float32", "e8m0", "e5m3"])
@pytest.mark.parametrize("shape, axis", [((4, 40), -1), ((3, 50, 2), 1), ((8, 7), -1)])
def test_mx_pads_the_last_block_as_quark(scale_format, shape, axis):
    pytest.importorskip("quark.torch.quantization.observer.observer")
    theirs, ours = twins("PerBlockMXObserver", **mx(scale_format, ch_axis=axis))
    feed((theirs, ours), [randn(*shape) * 3, randn(*shape, seed=1)])
    same(ours.amax, theirs.amax)
    for a, b in zip(ours._calculate_qparams(), theirs._calculate_qparams(), strict=True):
        same(a, b)


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("shapes", [[(2, 16), (4, 16)], [(4, 16), (4, 8), (2, 16)],
                                    [(4, 16), (4, 16), (3, 16)]])
@pytest.mark.parametrize("dtype, symmetric", [("int8", True), ("uint8", False),
                                              ("fp8_e4m3", True)])
def test_static_per_channel_starts_over_when_the_channels_change_as_quark(shapes, dtype,
                                                                           symmetric):
    pytest.importorskip("quark.torch.quantization.observer.observer")
    theirs, ours = twins("PerChannelMinMaxObserver", dtype=dtype, qscheme="per_channel",
                         ch_axis=0, symmetric=symmetric)
    feed((theirs, ours), [randn(*s, seed=i) * (i + 1) for i, s in enumerate(shapes)])
    same(ours.min_val, theirs.min_val)
    same(ours.max_val, theirs.max_val)
    for a, b in zip(ours._calculate_qparams(), theirs._calculate_qparams(), strict=True):
        same(a, b)


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("shapes", [[(2, 32), (4, 32)], [(2, 64), (4, 32)],
                                    [(4, 32), (4, 32), (2, 40)], [(2, 3, 32), (6, 32)]])
@pytest.mark.parametrize("scale_format, mode", [("e8m0", "even"), ("e8m0", "floor"),
                                                ("float32", "even")])
def test_static_mx_starts_over_when_its_blocks_change_as_quark(shapes, scale_format, mode):
    # (2, 64) -> (4, 32): as many blocks, but Quark's amax (rows, blocks) changes shape;
    # (2, 3, 32) -> (6, 32): the same (6, 1) amax, so Quark keeps the running max
    pytest.importorskip("quark.torch.quantization.observer.observer")
    theirs, ours = twins("PerBlockMXObserver", **mx(scale_format, scale_calculation_mode=mode))
    feed((theirs, ours), [randn(*s, seed=i) * (3 - i) for i, s in enumerate(shapes)])
    same(ours.amax, theirs.amax)
    for a, b in zip(ours._calculate_qparams(), theirs._calculate_qparams(), strict=True):
        same(a, b)


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("axis", [1, -1])
@pytest.mark.parametrize("dynamic", [False, True])
def test_bfp_zero_block_scale_is_eps_as_quark(axis, dynamic):
    pytest.importorskip("quark.torch.quantization.observer.observer")
    theirs, ours = twins("PerBlockBFPObserver", dtype="bfp16", qscheme="per_group",
                         ch_axis=axis, group_size=8, is_dynamic=dynamic)
    x = randn(4, 32)
    x[1] = 0.0  # zero blocks beside ordinary ones
    x[2, 8:16] = 0.0
    feed((theirs, ours), [torch.zeros(4, 32), x] if dynamic else [torch.zeros(4, 32)])
    for a, b in zip(ours._calculate_qparams(), theirs._calculate_qparams(), strict=True):
        same(a, b)
    assert (ours._calculate_qparams()[0] == torch.finfo(torch.float32).eps).any()


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("name", HISTOGRAMS)
@pytest.mark.parametrize("dtype, symmetric", [("uint8", False), ("int8", True)])
@pytest.mark.parametrize("value", [1.0, -3.0, 0.25, 0.0, 1e6])
def test_constant_batches_bin_as_quark(name, dtype, symmetric, value):
    # Quark nudges x_max when x_min == x_max, so its bin edges stay strictly increasing
    pytest.importorskip("quark.torch.quantization.observer.observer")
    theirs, ours = twins(name, dtype=dtype, symmetric=symmetric)
    feed((theirs, ours), [torch.full((16, 4), value)] * 2)
    same(ours.calib_bin_edges, theirs.calib_bin_edges)
    same(ours.calib_hist, theirs.calib_hist)
    if name == "PerTensorHistogramObserver":
        return  # Quark's recorder prices no range (scale 1); ours the data's (documented)
    if name == "PerTensorMSEObserver" and not symmetric and value < 0:
        return  # Quark asserts; ours raises ValueError (test_quark_exact)
    for a, b in zip(ours._calculate_qparams(), theirs._calculate_qparams(), strict=True):
        assert torch.equal(a.to(b.dtype), b), (a, b)


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("name", ["PerTensorPercentileObserver", "PerTensorMSEObserver"])
@pytest.mark.parametrize("dtype, symmetric", [("uint8", False), ("int8", True)])
@pytest.mark.parametrize("data", ["randn", "zeros"])
def test_histogram_min_val_max_val_as_quark(name, dtype, symmetric, data):
    pytest.importorskip("quark.torch.quantization.observer.observer")
    theirs, ours = twins(name, dtype=dtype, symmetric=symmetric)
    for o in (theirs, ours):
        assert "min_val" not in o.state_dict() and "max_val" not in o.state_dict()
    same(ours.min_val, theirs.min_val)  # inf / -inf before the qparams
    same(ours.max_val, theirs.max_val)
    x = randn(64, 32) + 0.5 if data == "randn" else torch.zeros(64, 32)
    feed((theirs, ours), [x])
    if name == "PerTensorMSEObserver" and data == "zeros" and not symmetric:
        return  # Quark asserts on the candidates of an all-zero asymmetric histogram
    theirs._calculate_qparams()
    ours._calculate_qparams()
    same(ours.min_val, theirs.min_val)  # the range the qparams priced
    same(ours.max_val, theirs.max_val)
    for o in (theirs, ours):
        o.reset_min_max_vals()
        assert o.min_val == float("inf") and o.max_val == float("-inf")


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("name", ["PerTensorHistogramObserver", "PerTensorHistogramObserverPro"])
def test_recorder_and_pro_min_val_max_val_as_quark(name):
    pytest.importorskip("quark.torch.quantization.observer.observer")
    theirs, ours = twins(name, dtype="uint8", symmetric=False)
    same(ours.min_val, theirs.min_val)
    same(ours.max_val, theirs.max_val)
    feed((theirs, ours), [randn(64, 32)])
    if name == "PerTensorHistogramObserverPro":  # its own never change (torch.ao's do)
        theirs._calculate_qparams()
        ours._calculate_qparams()
        same(ours.min_val, theirs.min_val)
        same(ours.max_val, theirs.max_val)


@pytest.mark.parametrize("dtype, bits", [("int8", 8), ("int4", 4), ("uint8", 8), ("uint4", 4)])
def test_quant_min_max_are_the_integer_range(dtype, bits):
    o = quark.PerTensorMinMaxObserver({"dtype": dtype, "symmetric": False})
    signed = not dtype.startswith("u")
    want = (-2 ** (bits - 1), 2 ** (bits - 1) - 1) if signed else (0, 2 ** bits - 1)
    assert (o.quant_min, o.quant_max) == want and type(o.quant_min) is int


@pytest.mark.parametrize("name, qspec", [
    ("PerTensorMinMaxObserver", {"dtype": "fp8_e4m3"}),
    ("PerChannelMinMaxObserver", {"dtype": "int8", "qscheme": "per_channel", "ch_axis": 0}),
    ("PerTensorMSEObserver", {"dtype": "int8"})])
def test_eps_buffer_is_float32_eps_kept_by_reset_and_never_saved(name, qspec):
    """Quark's eps buffer: float32 ``finfo.eps``, not in the state dict (empty, as Quark's),
    kept by a reset, moved by ``.to()``."""
    o = getattr(quark, name)(qspec)
    assert o.eps.dtype == torch.float32 and o.eps.item() == torch.finfo(torch.float32).eps
    o(randn(4, 16))
    assert "eps" in dict(o.named_buffers()) and o.state_dict() == {}
    o.reset()
    assert o.eps.item() == torch.finfo(torch.float32).eps
    assert o.to("meta").eps.is_meta
