"""The seeds' min-max classes: torch.ao bitwise, compressed-tensors' calculate_qparams, and
llm-compressor / Quark themselves (the tests marked ``peers``: ``make test`` runs them with
the peers' venv, ``.peers``, and PYTHONPATH=src; they skip where the peers are not
importable)."""

from __future__ import annotations

import pytest
import torch
from torch.ao import quantization as tq

import quantscope
from quantscope import Block, Channel, Group, QuantSpec, Tensor, presets
from quantscope.compat import horizon, quark, torch_ao
from quantscope.compat import llmcompressor_legacy as llmcompressor  # the seed's API


def batches(shape, n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) * (i + 1) + 0.3 * i for i in range(n)]


def assert_same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a, b), (a, b)


# ---------------------------------------------------------------------- torch.ao
AO_CASES = []
for dtype in (torch.qint8, torch.quint8):
    for sym in (True, False):
        for rr in (False, True):
            if sym and rr and dtype == torch.quint8:
                continue  # torch.ao refuses this combination (tested below)
            AO_CASES.append((dtype, sym, rr))


@pytest.mark.parametrize("dtype,sym,rr", AO_CASES)
@pytest.mark.parametrize("kind,ch_axis", [("MinMaxObserver", None),
                                          ("MovingAverageMinMaxObserver", None),
                                          ("PerChannelMinMaxObserver", 0),
                                          ("PerChannelMinMaxObserver", 1),
                                          ("MovingAveragePerChannelMinMaxObserver", 0),
                                          ("MovingAveragePerChannelMinMaxObserver", 2)])
def test_torch_ao_bitwise(kind, dtype, sym, rr, ch_axis):
    per_channel = ch_axis is not None
    if per_channel:
        qscheme = torch.per_channel_symmetric if sym else torch.per_channel_affine
        kw = {"ch_axis": ch_axis}
    else:
        qscheme = torch.per_tensor_symmetric if sym else torch.per_tensor_affine
        kw = {}
    if "MovingAverage" in kind:
        kw["averaging_constant"] = 0.3
    ours = getattr(torch_ao, kind)(dtype=dtype, qscheme=qscheme, reduce_range=rr, **kw)
    with pytest.warns(UserWarning) if rr else _nothing():
        ref = getattr(tq, kind)(dtype=dtype, qscheme=qscheme, reduce_range=rr, **kw)
    for x in batches((6, 5, 7)):
        assert ours(x) is x
        ref(x)
    s, z = ours.calculate_qparams()
    rs, rz = ref.calculate_qparams()
    assert_same(s, rs)
    assert_same(z, rz)
    assert torch.equal(ours.min_val, ref.min_val) and torch.equal(ours.max_val, ref.max_val)
    assert (ours.quant_min, ours.quant_max) == (ref.quant_min, ref.quant_max)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.parametrize("dtype,qscheme,qmin,qmax", [
    (torch.quint8, torch.per_tensor_symmetric, 0, 255),  # custom range: zp (qmin + qmax) // 2
    (torch.quint8, torch.per_tensor_affine, 0, 127),
    (torch.qint8, torch.per_tensor_symmetric, -100, 100),
    (torch.qint8, torch.per_tensor_affine, -64, 63),
])
def test_torch_ao_custom_ranges(dtype, qscheme, qmin, qmax):
    ours = torch_ao.MinMaxObserver(dtype=dtype, qscheme=qscheme, quant_min=qmin, quant_max=qmax,
                                   eps=1e-4)
    ref = tq.MinMaxObserver(dtype=dtype, qscheme=qscheme, quant_min=qmin, quant_max=qmax, eps=1e-4)
    for x in batches((3, 9)):
        ours(x)
        ref(x)
    for a, b in zip(ours.calculate_qparams(), ref.calculate_qparams()):
        assert_same(a, b)


def test_torch_ao_eps_and_constant_input():
    ours = torch_ao.MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
    ref = tq.MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
    z = torch.zeros(4, 4)
    ours(z)
    ref(z)
    for a, b in zip(ours.calculate_qparams(), ref.calculate_qparams()):
        assert_same(a, b)


def test_torch_ao_bf16_input_and_signature_errors():
    x = batches((4, 8))[0].bfloat16()
    ours = torch_ao.PerChannelMinMaxObserver(ch_axis=1, dtype=torch.qint8,
                                             qscheme=torch.per_channel_symmetric)
    ref = tq.PerChannelMinMaxObserver(ch_axis=1, dtype=torch.qint8,
                                      qscheme=torch.per_channel_symmetric)
    ours(x)
    ref(x.float())
    assert_same(ours.calculate_qparams()[0], ref.calculate_qparams()[0])
    with pytest.raises(NotImplementedError):
        torch_ao.MinMaxObserver(dtype=torch.quint8, qscheme=torch.per_tensor_symmetric,
                                reduce_range=True)
    with pytest.raises(NotImplementedError, match="use PerChannelMinMaxObserver"):
        torch_ao.MinMaxObserver(qscheme=torch.per_channel_affine)
    for cls in (torch_ao.PerChannelMinMaxObserver, torch_ao.MovingAveragePerChannelMinMaxObserver):
        with pytest.raises(NotImplementedError, match="per-channel qscheme"):
            cls(qscheme=torch.per_tensor_affine)
    with pytest.raises(ValueError, match="dtype"):
        torch_ao.MinMaxObserver(dtype=torch.float16)


def test_torch_ao_positional_signature_and_registry():
    obs = torch_ao.MovingAverageMinMaxObserver(0.5, torch.qint8, torch.per_tensor_symmetric)
    assert obs.averaging_constant == 0.5 and obs.dtype == torch.qint8
    obs = quantscope.get_observer("torch.ao:MovingAveragePerChannelMinMaxObserver", ch_axis=2,
                                  averaging_constant=0.2)
    assert obs.spec.layout == Channel(2) and obs.averaging_constant == 0.2
    obs(torch.randn(2, 3, 4))
    assert obs.calculate_qparams()[0].shape == (4,)
    obs.reset_min_max_vals()  # torch.ao's per-channel reset: empty buffers
    assert not obs.has_observed and obs.min_val.numel() == 0


# ---------------------------------------------------------------------- horizon
@pytest.mark.parametrize("cls,ao,kw", [
    (horizon.MinMaxObserver, tq.MovingAverageMinMaxObserver, {}),
    (horizon.MovingAverageMinMaxObserver, tq.MovingAverageMinMaxObserver, {}),
    (horizon.MovingAveragePerChannelMinMaxObserver, tq.MovingAveragePerChannelMinMaxObserver,
     {"ch_axis": 1}),
])
def test_horizon_matches_torch_ao_symmetric_qint8(cls, ao, kw):
    ours = cls(averaging_constant=0.2, **kw)
    per_channel = "ch_axis" in kw
    qscheme = torch.per_channel_symmetric if per_channel else torch.per_tensor_symmetric
    ref = ao(averaging_constant=0.2, dtype=torch.qint8, qscheme=qscheme, **kw)
    for x in batches((5, 6, 3)):
        ours(x)
        ref(x)
    s, z = ours.calculate_qparams()
    rs, rz = ref.calculate_qparams()
    assert_same(s, rs)
    assert torch.equal(z, rz.to(z.dtype)) and z.dtype == torch.int64


def test_horizon_min_max_per_channel_by_ch_axis_and_errors():
    obs = horizon.MinMaxObserver(ch_axis=0, dtype="qint16", qscheme=torch.per_channel_symmetric)
    obs(torch.randn(3, 4))
    s, _ = obs.calculate_qparams()
    assert s.shape == (3,) and obs.quant_min == -32768
    assert horizon.MinMaxObserver().spec.layout == Tensor()
    with pytest.raises(ValueError, match="symmetric only"):
        horizon.MinMaxObserver(qscheme=torch.per_tensor_affine)
    with pytest.raises(ValueError, match="dtype"):
        horizon.MinMaxObserver(dtype="quint8")


# ---------------------------------------------------------- compressed-tensors
ct = pytest.importorskip("compressed_tensors.quantization")
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

QArgs = ct.QuantizationArgs

CT_CASES = [
    ({"num_bits": 8, "strategy": "tensor"}, "weight"),
    ({"num_bits": 8, "strategy": "tensor", "symmetric": False}, "weight"),
    ({"num_bits": 8, "type": "float", "strategy": "tensor"}, "weight"),
    ({"num_bits": 8, "strategy": "channel"}, "weight"),
    ({"num_bits": 8, "strategy": "channel", "symmetric": False}, "weight"),
    ({"num_bits": 4, "strategy": "group", "group_size": 16}, "weight"),
    ({"num_bits": 4, "strategy": "group", "group_size": 16, "symmetric": False}, "weight"),
    ({"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [4, 32]}, "weight"),
    ({"num_bits": 8, "strategy": "token", "dynamic": True}, "input"),
    ({"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}, "input"),
]


def ct_minmax(x, args):
    """Per-unit min / max as compressed-tensors' example reshapes them (independent of ours)."""
    s = getattr(args.strategy, "value", args.strategy)
    if s == "tensor":
        return x.amin(), x.amax()
    if s == "channel":
        return x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    if s in ("group", "tensor_group"):
        g = x.unflatten(-1, (-1, args.group_size))
        return g.amin(-1), g.amax(-1)
    if s == "block":
        bh, bw = args.block_structure
        R, C = x.shape
        b = x.reshape(R // bh, bh, C // bw, bw).transpose(1, 2)
        return b.amin((-1, -2)), b.amax((-1, -2))
    if s == "token":
        return x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    raise AssertionError(s)


@pytest.mark.parametrize("fields,base", CT_CASES, ids=[str(f) for f, _ in CT_CASES])
@pytest.mark.parametrize("as_dict", [False, True])
def test_compressed_tensors_calculate_qparams(fields, base, as_dict):
    args = QArgs(**fields)
    x = batches((2, 8, 64) if base == "input" else (16, 64))[1]
    obs = llmcompressor.MemorylessMinMaxObserver(base, dict(fields) if as_dict else args)
    scale, zp = obs(x)
    rs, rz = calculate_qparams(*ct_minmax(x, args), args)
    assert scale.shape == rs.shape and torch.equal(scale, rs), (scale, rs)
    assert zp.dtype == rz.dtype and torch.equal(zp.float(), rz.float())


def test_compressed_tensors_nvfp4():
    fields = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
              "scale_dtype": torch.float8_e4m3fn}
    args = QArgs(**fields)
    w = batches((8, 64))[2]
    obs = llmcompressor.MemorylessMinMaxObserver("weight", args)
    scale, zp = obs(w)
    gs = generate_gparam(w.min(), w.max())
    rs, rz = calculate_qparams(*ct_minmax(w, args), args, global_scale=gs)
    assert torch.equal(scale, rs) and torch.equal(obs.get_global_scale(), gs)
    assert zp.dtype == rz.dtype == torch.float8_e4m3fn
    assert torch.equal(obs.get_qparams()["global_scale"], gs)


@pytest.mark.parametrize("bits", [4, 6])
def test_compressed_tensors_mx(bits):
    fields = {"num_bits": bits, "type": "float", "strategy": "group", "group_size": 32,
              "scale_dtype": torch.uint8}
    try:
        args = QArgs(**fields)
        ref = calculate_qparams(*ct_minmax(torch.ones(1, 32), args), args)
    except (ValueError, NotImplementedError, TypeError) as e:  # FP6 from compressed-tensors 0.20
        pytest.skip(f"compressed-tensors cannot: {e}")
    del ref
    w = batches((8, 128))[3]
    w[0, :32] *= 1.75 / w[0, :32].abs().max() * 4  # a block amax right at the rounding threshold
    obs = llmcompressor.MemorylessMinMaxObserver("weight", args)
    scale, _ = obs(w)
    rs, _ = calculate_qparams(*ct_minmax(w, args), args)
    assert torch.equal(scale, rs)
    assert obs.spec.scale.kind == "e8m0"


def test_llmcompressor_sequences_through_compat():
    args = {"num_bits": 8, "strategy": "tensor", "observer_kwargs": {"averaging_constant": 0.1}}
    obs = llmcompressor.Observer.load_from_registry("minmax", base_name="input", args=args)
    lo = hi = None
    for v in ([0.0, 0.0], [-3.0, 1.0], [-1.0, 3.0]):
        t = torch.tensor(v)
        obs(t)
        if lo is None:
            lo, hi = t.min(), t.max()
        else:  # llm-compressor's lerp: old * (1 - c) + new * c
            lo, hi = lo * (1 - 0.1) + t.min() * 0.1, hi * (1 - 0.1) + t.max() * 0.1
        assert torch.equal(obs.min_vals, lo.reshape(1)) and torch.equal(obs.max_vals,
                                                                         hi.reshape(1))
    assert obs.min_vals.item() == pytest.approx(-0.37) and obs.max_vals.item() == pytest.approx(0.39)
    stat = quantscope.get_observer("llmcompressor:static_minmax", base_name="weight", args=args)
    assert stat.is_weight_obs and stat.spec == QuantSpec("int8", Tensor())


def test_llmcompressor_translation():
    spec = llmcompressor.llmcompressor_spec
    assert spec({"strategy": "channel"}).layout == Channel(0)
    assert spec({"group_size": 128}).layout == Group(128)
    assert spec({"num_bits": 4, "type": "float", "strategy": "tensor_group",
                 "group_size": 16}).scale.kind == "fp8_e4m3"
    assert spec({"strategy": "block", "block_structure": "128x64"}).layout.cols == 64
    assert spec({"strategy": "attn_head"}, "q").layout == Channel(1)
    g = torch.tensor([1, 0, 1, 0])
    lin = torch.nn.Linear(4, 2)
    lin.weight_g_idx = g
    obs = llmcompressor.StaticMinMaxObserver("weight", {"num_bits": 4, "strategy": "group",
                                                        "group_size": 2}, module=lin)
    assert torch.equal(obs.spec.layout.g_idx, g)
    with pytest.raises(ValueError, match="strategy"):
        spec({"strategy": "diagonal"})
    with pytest.raises(ValueError, match="group_size"):
        spec({"strategy": "group"})


def test_llmcompressor_placeholder_g_idx_is_column_order():
    """compressed-tensors registers ``weight_g_idx`` as -1s until GPTQ fills it, which
    llm-compressor reads as column order (``-1 in g_idx``): the scales of groups of columns."""
    torch.manual_seed(0)
    w = torch.randn(4, 32)
    args = {"num_bits": 4, "strategy": "group", "group_size": 8}
    expect = w.reshape(4, 4, 8).abs().amax(-1) / 7.5  # symmetric int4: absmax / ((7 - -8) / 2)
    lin = torch.nn.Linear(32, 4, bias=False)
    lin.weight_g_idx = torch.full((32,), -1, dtype=torch.int32)
    for obs, call in ((llmcompressor.StaticMinMaxObserver("weight", args, module=lin), {}),
                      (llmcompressor.StaticMinMaxObserver("weight", args),
                       {"g_idx": lin.weight_g_idx})):
        scale, _ = obs(w, **call)
        torch.testing.assert_close(scale, expect, rtol=0, atol=1e-7)


# ----------------------------------------------------------------------- quark
def qk(**kw):
    base = {"dtype": "int8", "qscheme": "per_tensor", "symmetric": True, "is_dynamic": False}
    return {**base, **kw}


def test_quark_int_per_tensor_channel_group():
    x = batches((8, 64))[1]
    amax = x.abs().max()
    obs = quark.PerTensorMinMaxObserver(qk())
    assert obs(x) is x
    s, z = obs._calculate_qparams()
    assert torch.equal(s, amax / 127.5) and z.dtype == torch.int32  # 0-dim, as Quark
    s2, _ = obs.calculate_qparams(x.min(), x.max())  # Quark's (min_val, max_val) form
    assert torch.equal(s2, amax / 127.5)
    obs = quark.PerChannelMinMaxObserver(qk(qscheme="per_channel", ch_axis=0))
    obs(x)
    s, z = obs._calculate_qparams()
    assert s.shape == (8,) and torch.equal(s, x.abs().amax(1) / 127.5)
    obs = quark.PerGroupMinMaxObserver(qk(dtype="uint4", qscheme="per_group", ch_axis=-1,
                                          group_size=16, symmetric=False))
    obs(x)
    s, z = obs._calculate_qparams()
    g = x.unflatten(-1, (4, 16))
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    assert s.shape == (8, 4) and torch.equal(s, (hi - lo) / 15)
    assert torch.equal(z, (0 - torch.round(lo / s)).clamp(0, 15).to(torch.int32))


def test_quark_dynamic_is_memoryless_static_accumulates():
    xs = batches((4, 32))
    dyn = quark.PerTensorMinMaxObserver(qk(is_dynamic=True))
    sta = quark.PerTensorMinMaxObserver(qk())
    for x in xs:
        dyn(x)
        sta(x)
    assert torch.equal(dyn.min_val, xs[-1].min())
    assert torch.equal(sta.min_val, torch.stack([x.min() for x in xs]).min())
    assert sta._num_observed_tokens == 16


@pytest.mark.parametrize("mode", [None, "even", "floor", "ceil"])
def test_quark_mx_equals_native_preset(mode):
    x = batches((4, 96))[2]
    q = {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "ch_axis": -1,
         "scale_format": "e8m0", "scale_calculation_mode": mode, "is_dynamic": False}
    obs = quark.PerBlockMXObserver(q)
    obs(x)
    s, z = obs.calculate_qparams()
    native = quantscope.get_observer("memoryless_minmax",
                                     presets.MXFP4.replace(scale=f"e8m0:{mode or 'even'}"))
    native(x)
    assert s.shape == (4, 3) and torch.equal(s, native.calculate_qparams().scale)
    assert z.dtype == s.dtype and not z.any()
    mx = quark.quark_spec({"dtype": "mx", "mx_element_dtype": "fp8_e4m3", "group_size": 32})
    assert mx.format.name == "fp8_e4m3" and mx.layout == Block(32)


def test_quark_bfp16_and_placeholder_and_errors():
    x = batches((3, 40))[0]
    obs = quark.PerBlockBFPObserver({"dtype": "bfp16", "ch_axis": -1, "group_size": 8})
    obs(x)
    s, _ = obs.calculate_qparams()
    native = quantscope.get_observer("memoryless_minmax", presets.BFP16)
    native(x)
    assert s.shape == (3, 5) and torch.equal(s, native.calculate_qparams().scale)
    ph = quark.PlaceholderObserver({"dtype": "bfloat16"})
    assert ph(x) is x and ph._calculate_qparams() is None
    with pytest.raises(ValueError, match="dtype"):
        quark.quark_spec({"dtype": "int7"})
    with pytest.raises(ValueError, match="round_method"):
        quark.quark_spec(qk(round_method="floor"))
    assert quantscope.get_observer("quark:PerTensorMinMaxObserver", qspec=qk()).spec == \
        QuantSpec("int8", Tensor())


# ------------------------------------------- the real peers (the peers' venv only)
@pytest.mark.peers
def test_against_llmcompressor_observers():
    lc = pytest.importorskip("llmcompressor.observers")
    cases = [({"num_bits": 8, "strategy": "channel"}, "weight", (16, 64)),
             ({"num_bits": 4, "strategy": "group", "group_size": 16, "symmetric": False},
              "weight", (16, 64)),
             ({"num_bits": 8, "strategy": "tensor"}, "input", (2, 8, 64)),
             ({"num_bits": 8, "type": "float", "strategy": "tensor"}, "input", (2, 8, 64)),
             ({"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
               "scale_dtype": torch.float8_e4m3fn}, "weight", (16, 64))]
    for name in ("memoryless_minmax", "static_minmax", "minmax"):
        for fields, base, shape in cases:
            if base == "weight" and name != "memoryless_minmax":
                continue  # llm-compressor observes a weight once
            kw = {"averaging_constant": 0.2} if name == "minmax" else {}
            theirs = lc.Observer.load_from_registry(name, base_name=base, args=QArgs(**fields),
                                                    **kw)
            ours = llmcompressor.Observer.load_from_registry(name, base_name=base,
                                                             args=QArgs(**fields), **kw)
            for x in batches(shape, n=1 if base == "weight" else 4):
                theirs(x)
                ours(x)
            a, b = ours.get_qparams(), theirs.get_qparams()
            assert torch.equal(a["scale"], b["scale"].reshape(a["scale"].shape)), (name, fields)
            assert torch.equal(a["zero_point"].float(),
                               b["zero_point"].reshape(a["zero_point"].shape).float())
            if b["global_scale"] is not None:
                assert torch.equal(a["global_scale"], b["global_scale"])


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
def test_against_quark_observers():
    pytest.importorskip("quark.torch.quantization.observer.observer")
    from quark.torch.quantization.config.config import QTensorConfig
    from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType, ScaleType
    from quark.torch.quantization.observer import observer as qo

    def cfg(cls, **kw):
        base = {"dtype": Dtype.int8, "observer_cls": cls, "qscheme": QSchemeType.per_tensor,
                "symmetric": True, "round_method": RoundType.half_even,
                "scale_type": ScaleType.float, "is_dynamic": False}
        return QTensorConfig(**{**base, **kw})

    cases = [("PerTensorMinMaxObserver", {}),
             ("PerTensorMinMaxObserver", {"symmetric": False, "dtype": Dtype.uint8}),
             ("PerTensorMinMaxObserver", {"dtype": Dtype.fp8_e4m3}),
             ("PerChannelMinMaxObserver", {"qscheme": QSchemeType.per_channel, "ch_axis": 0}),
             ("PerGroupMinMaxObserver", {"qscheme": QSchemeType.per_group, "ch_axis": -1,
                                         "group_size": 16, "dtype": Dtype.int4})]
    for mode in ("even", "floor", "ceil"):
        cases.append(("PerBlockMXObserver", {
            "dtype": Dtype.fp4, "symmetric": None, "scale_format": "e8m0",
            "qscheme": QSchemeType.per_group, "group_size": 32, "ch_axis": -1,
            "scale_calculation_mode": mode}))
    for name, kw in cases:
        c = cfg(getattr(qo, name), **kw)
        theirs, ours = getattr(qo, name)(c), getattr(quark, name)(c)
        for x in batches((16, 64)):
            theirs(x)
            ours(x)
        if name == "PerBlockMXObserver":
            (s, z), (rs, rz) = ours.calculate_qparams(), theirs.calculate_qparams()
        else:
            (s, z), (rs, rz) = ours._calculate_qparams(), theirs._calculate_qparams()
        assert torch.equal(s, rs.reshape(s.shape).to(s.dtype)), (name, kw, s, rs)
        assert torch.equal(z.float(), rz.reshape(z.shape).float()), (name, kw)
    # BFP16, one call (Quark doubles its running amax on every overflowing call)
    c = QTensorConfig(dtype=Dtype.bfp16, observer_cls=qo.PerBlockBFPObserver, ch_axis=-1,
                      group_size=8)
    x = batches((16, 64))[2]
    x[0, :8] = torch.tensor([127.6, 1, 2, 3, -4, 5, 6, 7]) / 64  # overflows: exponent bumps
    theirs, ours = qo.PerBlockBFPObserver(c), quark.PerBlockBFPObserver(c)
    theirs(x)
    ours(x)
    (s, _), (rs, _) = ours.calculate_qparams(), theirs.calculate_qparams()
    assert torch.equal(s, rs.reshape(s.shape).to(s.dtype))
