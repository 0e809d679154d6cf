"""Dense permuted inputs to the min-max family on the CPU: a transposed matrix (GPT-OSS's
experts, ``w[e].t()``), channels_last activations and weights, permuted key / value states.
Their per-unit min / max are read from the memory they view (``stats.minmax_layouts``),
where ``layout.to_units`` had copied them first (6-18x a contiguous tensor's time, found by
probing); every result must equal the copy path's bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from op_names import Copies

import quantscope
from quantscope import Block, Channel, Group, QuantSpec, Tensor, Tile, presets
from quantscope.stats import minmax as stats
from quantscope.stats import minmax_layouts

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

pytestmark = pytest.mark.skipif(stats._kernel() is None, reason="no compiled kernel")


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s float32 bit patterns, NaN as one value (the kernel returns its own NaN)."""
    return t.float().nan_to_num(7.0).view(torch.int32)


def permuted(shape, order, dtype=torch.float32, seed=0, bad=()):
    """A tensor of ``shape`` whose memory holds its dims in ``order`` (outermost first), no
    zeros (a -0.0 / +0.0 tie may come back either way), ``bad`` values at a few places."""
    g = torch.Generator().manual_seed(seed)
    mem = torch.rand([shape[d] for d in order], generator=g).add_(0.5)
    mem *= torch.randint(0, 2, mem.shape, generator=g) * 2 - 1.0
    for i, v in enumerate(bad):
        mem.view(-1)[(i * 7919) % mem.numel()] = v
    return mem.to(dtype).permute([order.index(d) for d in range(len(shape))])


def copy_path(x, layout):
    """Per-unit ``(lo, hi)`` from the units ``to_units`` builds (a copy of a permuted x)."""
    return stats.torch_unit_minmax(layout.to_units(x))


@st.composite
def cases(draw):
    """A dense permuted tensor and a layout that fits it (runs dividing their axis)."""
    n = draw(st.integers(2, 4))
    shape = draw(st.lists(st.sampled_from([1, 2, 3, 8, 16, 24, 48, 64]), min_size=n, max_size=n))
    order = draw(st.permutations(range(n)))
    a = draw(st.integers(-n, n - 1))
    kinds = ["tensor", "channel"] + ["run"] * (shape[a] % 2 == 0) + ["tile"] * (n == 2)
    kind = draw(st.sampled_from(kinds))
    if kind == "run":
        size = draw(st.sampled_from([s for s in (2, 4, 8, 16) if shape[a] % s == 0]))
        layout = draw(st.sampled_from([Group(size, a), Block(size, a)]))
    else:
        layout = {"tensor": Tensor(), "channel": Channel(a),
                  "tile": Tile(draw(st.integers(1, 20)), draw(st.integers(1, 20)))}[kind]
    dtype = draw(st.sampled_from(DTYPES))
    bad = draw(st.sampled_from([(), (float("nan"),), (float("inf"), -float("inf"))]))
    return permuted(shape, order, dtype, draw(st.integers(0, 99)), bad), layout


@settings(max_examples=80, deadline=None)
@given(cases())
def test_a_permuted_tensor_read_in_place_equals_the_copy_path(case):
    x, layout = case
    assume(not x.is_contiguous())
    got = minmax_layouts.layout_minmax(x, layout)
    if got is None:  # no in-place path for these units: forward builds them
        return
    want = copy_path(x, layout)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32 and a.shape == b.shape
        assert torch.equal(bits(a), bits(b))


def test_memory_order_views_the_same_memory_contiguously():
    x = torch.empty(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    assert minmax_layouts.memory_order(x) == [0, 2, 3, 1]
    assert minmax_layouts.memory_order(torch.empty(6, 4).t()) == [1, 0]
    assert minmax_layouts.memory_order(torch.empty(6, 4)[:, :3]) is None  # gaps: no view
    assert minmax_layouts.memory_order(torch.empty(6, 4)[::2].t()) is None


CL = (4, 32, 24, 24)  # a channels_last conv activation
#: (what, x's shape, its memory order, spec): the probe's cases, each read in place
IN_PLACE = [
    ("expert w[e].t()", (256, 640), [1, 0], QuantSpec("int4", "group:64")),
    ("expert w[e].t()", (256, 640), [1, 0], presets.NVFP4),
    ("expert w[e].t()", (256, 640), [1, 0], presets.MXFP4),
    ("expert w[e].t()", (256, 640), [1, 0], QuantSpec("fp8_e4m3", "tensor")),
    ("expert w[e].t()", (256, 640), [1, 0], QuantSpec("int8", "channel")),
    ("expert w[e].t()", (256, 640), [1, 0], QuantSpec("int4", Group(32, 0))),
    ("expert w[e].t()", (256, 640), [1, 0], QuantSpec("fp8_e4m3", Tile(128, 64))),
    ("channels_last activation", CL, [0, 2, 3, 1], QuantSpec("fp8_e4m3", "tensor")),
    ("channels_last activation", CL, [0, 2, 3, 1], QuantSpec("int8", "channel:1")),
    ("channels_last weight", (256, 64, 3, 3), [0, 2, 3, 1], QuantSpec("int8", "channel")),
    ("permuted value states", (2, 8, 128, 64), [0, 2, 1, 3], QuantSpec("fp8_e4m3", "tensor")),
    ("permuted value states", (2, 8, 128, 64), [0, 2, 1, 3], QuantSpec("int8", "channel:1")),
]


@pytest.mark.parametrize("name", ["memoryless_minmax", "static_minmax"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("what,shape,order,spec", IN_PLACE,
                         ids=lambda v: str(getattr(v, "layout", v)) if not isinstance(v, list)
                         else "")
def test_observers_read_a_permuted_tensor_in_place(what, shape, order, spec, dtype, name):
    """No copy of the input (old code: ``to_units`` copied it), the copy's results."""
    x = permuted(shape, order, dtype, seed=1, bad=(float("inf"),))
    assert not x.is_contiguous() and math.prod(shape) >= stats.KERNEL_MIN_NUMEL
    got, want = quantscope.get_observer(name, spec), quantscope.get_observer(name, spec)
    with Copies(x) as copies:
        got(x)
    assert copies.found == [], f"{what}: copied by {copies.found}"
    want(x.contiguous())
    assert torch.equal(bits(got.min_vals), bits(want.min_vals))
    assert torch.equal(bits(got.max_vals), bits(want.max_vals))


@pytest.mark.parametrize("spec", [QuantSpec("int4", "group:64"), presets.NVFP4,
                                  QuantSpec("fp8_e4m3", "tensor")], ids=str)
def test_transposed_expert_qparams_equal_the_contiguous_copys(spec):
    """The qparams (NVFP4's global scale from the pass's ends too) and the non-finite
    check, on a GPT-OSS expert view."""
    x = permuted((256, 640), [1, 0], seed=2)
    got, want = quantscope.get_observer("memoryless_minmax", spec), \
        quantscope.get_observer("memoryless_minmax", spec)
    got(x)
    want(x.contiguous())
    a, b = got.calculate_qparams(), want.calculate_qparams()
    for f in ("scale", "zero_point", "global_scale"):
        if getattr(b, f, None) is not None:
            assert torch.equal(getattr(a, f), getattr(b, f)), f
    got(permuted((256, 640), [1, 0], seed=2, bad=(float("nan"),)))
    with pytest.raises(ValueError, match="NaN or inf"):
        got.calculate_qparams()
