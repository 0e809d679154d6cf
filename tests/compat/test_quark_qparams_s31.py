"""compat.quark's integer qparams call: for a symmetric spec the native qparams come in Quark's
shape (no reshape, no view) and the compat part casts only where a dtype changes; and its
values, dtypes and shapes are Quark 0.13's bit for bit on the dtype corners the shortcut
touches: input / module-cast dtypes, ``scale_type``, 0-dim (per tensor) against 1-dim+
ranges, symmetric and asymmetric (the peers' venv)."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from quantscope.compat import quark

SYMMETRIC = [
    ("PerTensorMinMaxObserver", {"dtype": "int8"}),
    ("PerChannelMinMaxObserver", {"dtype": "int8", "qscheme": "per_channel", "ch_axis": 0}),
    ("PerGroupMinMaxObserver", {"dtype": "int4", "qscheme": "per_group", "ch_axis": -1,
                                "group_size": 32}),
]


def _aten_ops(fn) -> collections.Counter:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::"))


@pytest.mark.parametrize(("name", "qspec"), SYMMETRIC)
def test_symmetric_qparams_come_in_quarks_shape(name, qspec):
    obs = getattr(quark, name)({**qspec, "symmetric": True})
    obs(torch.randn(8, 64, generator=torch.Generator().manual_seed(0)))
    ops = _aten_ops(obs._calculate_qparams)
    # the kernel makes the qparams in Quark's shape; Quark's zeros need no range (a signed
    # format's: the native's)
    assert ops["aten::reshape"] == ops["aten::view"] == ops["aten::zeros_like"] == 0, ops
    ops.subtract(_aten_ops(obs.range_and_qparams))  # the compat part
    # float32 input, no scale_type: every cast would be a no-op
    assert ops["aten::to"] == 0 and ops["aten::result_type"] == 0, ops


# ---------------------------------------------------------------- against Quark (peers)
CLASSES = [*SYMMETRIC, ("PerTensorMinMaxObserver", {"dtype": "uint8"}),
           ("PerChannelMinMaxObserver", {"dtype": "uint4", "qscheme": "per_channel",
                                         "ch_axis": 1})]
INPUTS = [torch.float32, torch.float16, torch.bfloat16, torch.int16]
# a module cast after float32 data rounds Quark's range buffers: its scale divides the rounded
# range (symmetric too: the amax), one rounding more than a float32 scale cast
CASTS = [None, torch.float16, torch.bfloat16]


def _twins(name, qspec, symmetric, scale_type):
    qo = pytest.importorskip("quark.torch.quantization.observer.observer")
    from quark.torch.quantization.config.config import QTensorConfig
    from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType, ScaleType

    kw = {"qscheme": "per_tensor", **qspec}
    c = QTensorConfig(dtype=Dtype(kw["dtype"]), qscheme=QSchemeType(kw["qscheme"]),
                      ch_axis=kw.get("ch_axis"), group_size=kw.get("group_size"),
                      symmetric=symmetric, round_method=RoundType.half_even,
                      scale_type=ScaleType(scale_type), is_dynamic=False,
                      observer_cls=getattr(quark, name))
    return getattr(qo, name)(c), getattr(quark, name)(c)


def _same(ours, theirs):
    for a, b in zip(ours, theirs, strict=True):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), (a, b)
        assert torch.equal(a, b), (a, b)


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize(("name", "qspec"), CLASSES)
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("scale_type", ["float", "float16", "bfloat16", "float32"])
@pytest.mark.parametrize("cast", CASTS)
def test_int_qparams_bitwise_as_quark(name, qspec, symmetric, scale_type, cast):
    for dtype in INPUTS:
        theirs, ours = _twins(name, qspec, symmetric, scale_type)
        g = torch.Generator().manual_seed(len(name) + INPUTS.index(dtype))
        for i in range(2):  # two batches: the running range
            x = torch.randn(6, 64, generator=g) * (3 + 40 * (dtype == torch.int16)) + i
            theirs(x.to(dtype))
            ours(x.to(dtype))
        if cast is not None:
            theirs.to(cast)
            ours.to(cast)
        _same(ours._calculate_qparams(), theirs._calculate_qparams())
        # a given range: 0-dim, and in two dtypes (the result type prices it)
        lo, hi = theirs.min_val, theirs.max_val
        for rng in ((lo, hi), (lo.reshape(-1)[0], hi.reshape(-1)[0]),
                    (lo.float(), hi.to(torch.bfloat16))):
            _same(ours.calculate_int_quant_params(*rng), theirs.calculate_int_quant_params(*rng))
