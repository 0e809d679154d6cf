"""bf16 / fp16 batches to the native-grid histogram observers on the CPU: the per-unit min /
max read them as they are (csrc/unit_minmax.c) and the C binning widens them a piece at a
time into one cached float32 scratch (``hist_kernel.HALF_PIECE``), where forward took a
float32 copy of the whole batch (4x the float32 batch's time: the copy's fresh pages). The
state must equal the float32 copy's bit for bit: every bf16 / fp16 value is a float32."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import each_value
from torch.utils._python_dispatch import TorchDispatchMode

import quantscope
from quantscope import Block, Channel, Group, QuantSpec, Tensor, Token
from quantscope.stats import hist_kernel

HALVES = (torch.bfloat16, torch.float16)
STATE = ("hist_counts", "hist_exp", "hist_first", "hist_lo", "hist_hi", "min_vals", "max_vals")
SPECS = [QuantSpec("int8", Tensor()), QuantSpec("uint8", Tensor(), symmetric=False),
         QuantSpec("int8", Channel(0)), QuantSpec("int8", Channel(-1)),
         QuantSpec("int4", Group(8)), QuantSpec("int8", Token()),
         QuantSpec("int8", Block(24, -1))]  # 40 columns: the last block padded

pytestmark = pytest.mark.skipif(hist_kernel._kernel() is None, reason="no compiled kernel")


def batches(dtype, seed=0, specials=False):
    """Three growing batches of 6 x 40 (the grid widens), with signed zeros, subnormals of
    the half type and (``specials``) a large value (fp16's near 65504; bf16's below the
    histograms' limit of 2 ** 126)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(3):
        x = torch.randn(6, 40, generator=g) * 4.0 ** k
        x.view(-1)[:4] = torch.tensor([0.0, -0.0, 6e-8, -1e-39])
        if specials:
            x.view(-1)[5] = 60000.0 if dtype == torch.float16 else 2e37
        out.append(x.to(dtype))
    return out


def states(name, spec, xs, **kw):
    obs = quantscope.get_observer(name, spec, **kw)
    for x in xs:
        obs(x)
    return [getattr(obs, n) for n in STATE], obs.calculate_qparams()


def assert_same(half, single):
    for a, b in zip(half[0], single[0], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for a, b in zip(half[1], single[1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("name", "kw", "spec", "dtype", "piece"), each_value(
    [("histogram", {}), ("percentile", {}), ("kl", {}), ("histogram_mse", {}), ("mix", {}),
     ("percentile", {"skip_zeros": True})], SPECS, HALVES, [7, 40, 1 << 18],
    ids=lambda v: str(v).replace(" ", "")))  # piece: the C binning's widening piece
def test_half_batches_bin_as_their_float32_values(name, kw, spec, dtype, piece, monkeypatch):
    """Pieces of 7 values (inside a row), 40 (one row) and the default: the same state and
    qparams as the float32 copy's."""
    monkeypatch.setattr(hist_kernel, "HALF_PIECE", piece)
    xs = batches(dtype, specials=name == "histogram")
    assert_same(states(name, spec, xs, **kw), states(name, spec, [x.float() for x in xs], **kw))


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_half_batches_bin_as_their_float32_values_without_the_kernel(dtype, monkeypatch):
    """The torch reference (no compiled kernel) reads the half units exactly as well."""
    xs = batches(dtype)
    want = states("histogram", QuantSpec("int8", Channel(0)), [x.float() for x in xs])
    monkeypatch.setattr(hist_kernel, "_kernel", lambda: None)
    assert_same(states("histogram", QuantSpec("int8", Channel(0)), xs), want)


class Float32Copies(TorchDispatchMode):
    """The sizes of the float32 tensors the ops dispatched under it return."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.sizes.append(t.numel())
        return out


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("spec", [QuantSpec("int8", Tensor()), QuantSpec("int8", Channel(0)),
                                  QuantSpec("int8", Channel(-1))], ids=str)
def test_no_float32_copy_of_the_batch(spec, dtype, monkeypatch):
    """Forward makes no float32 tensor of the batch's size: pieces of HALF_PIECE values."""
    monkeypatch.setattr(hist_kernel, "HALF_PIECE", 1000)
    obs = quantscope.get_observer("histogram", spec)
    x = torch.randn(64, 128).to(dtype)
    obs(x)
    with Float32Copies() as seen:
        obs(x * 2)
    assert max(seen.sizes) <= 1000, sorted(seen.sizes)[-3:]


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), cols=st.integers(1, 70), piece=st.integers(1, 90),
       seed=st.integers(0, 2 ** 16), half=st.sampled_from(HALVES),
       absolute=st.booleans(), threads=st.sampled_from([1, 3]))
def test_bin_values_pieces_add_up_to_the_whole(rows, cols, piece, seed, half, absolute,
                                               threads):
    """``hist_kernel.bin_values`` on half units in pieces of any size (rows whole or split)
    counts what the float32 units count, on one and several threads."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=g) * 50).to(half)
    exp = torch.full((rows,), -3, dtype=torch.int64)
    first = torch.full((rows,), 0 if absolute else -96, dtype=torch.int64)
    want = torch.zeros(rows, 192, dtype=torch.int64)
    assert hist_kernel.bin_values(want, x.float(), exp, first, absolute, threads)
    old, hist_kernel.HALF_PIECE = hist_kernel.HALF_PIECE, piece
    try:
        got = torch.zeros_like(want)
        assert hist_kernel.bin_values(got, x, exp, first, absolute, threads)
    finally:
        hist_kernel.HALF_PIECE = old
    assert torch.equal(got, want)
