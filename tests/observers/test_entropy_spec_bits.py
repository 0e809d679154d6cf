"""The KL's bits and unsigned mode follow the spec, in the entropy observer and in mix's
entropy candidate alike; ``copy_zero_bin`` is checked at construction."""

import pytest
import torch

from quantscope import QuantSpec
from quantscope.estimators.entropy import spec_bits
from quantscope.observers import get_observer


def _heavy(seed=0, n=20000):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) ** 3  # heavy tails: the threshold depends on the bits


@pytest.mark.parametrize("fmt", ["int4", "int8", "uint8"])
def test_mix_entropy_candidate_is_the_entropy_observer(fmt):
    spec = QuantSpec(fmt)
    x = _heavy()
    ent = get_observer("entropy", spec)
    mix = get_observer("mix", spec, candidates=("entropy",))
    ent(x)
    mix(x)
    for got, want in zip(mix.calculate_range(), ent.calculate_range()):
        assert torch.equal(got, want)


def test_symmetric_uint8_is_int8s_quantizer_and_gets_its_kl():
    x = _heavy(1)
    u, s = get_observer("entropy", QuantSpec("uint8")), get_observer("entropy", QuantSpec("int8"))
    u(x)
    s(x)
    assert (u.num_bits, u.unsigned) == (8, False)
    assert torch.equal(u.calculate_range()[1], s.calculate_range()[1])


@pytest.mark.parametrize("fmt,symmetric,want", [
    ("uint8", False, (8, True)),   # codes on one side of zero for non-negative data: unsigned
    ("uint4", False, (4, True)),
    ("uint8", True, (8, False)),   # zero point 128: codes on both sides
    ("int8", False, (8, False)),
    ("int4", True, (4, False)),
    ("fp8_e4m3", True, (8, False)),
])
def test_spec_bits(fmt, symmetric, want):
    spec = QuantSpec(fmt, symmetric=symmetric)
    assert spec_bits(spec) == want
    assert (get_observer("entropy", spec).num_bits, get_observer("entropy", spec).unsigned) == want


def test_asymmetric_uint8_keeps_tensorrts_unsigned_kl():
    x = _heavy(2).abs()  # post-ReLU-like: one-sided
    o = get_observer("entropy", QuantSpec("uint8", symmetric=False))
    o(x)
    assert o.unsigned
    lo, hi = o.calculate_range()
    assert float(lo) >= 0 and float(hi) > 0


@pytest.mark.parametrize("bad", ["no", "0", 0, 1, None, 1.0])
def test_copy_zero_bin_is_checked_at_construction(bad):
    with pytest.raises(ValueError, match=r"EntropyObserver: copy_zero_bin must be True or False"):
        get_observer("entropy", QuantSpec("int8"), copy_zero_bin=bad)


@pytest.mark.parametrize("ok", [True, False])
def test_copy_zero_bin_takes_a_bool(ok):
    o = get_observer("entropy", QuantSpec("int8"), copy_zero_bin=ok)
    o(_heavy(3, 4000))
    assert o.copy_zero_bin is ok
    o.calculate_qparams()
