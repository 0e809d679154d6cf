"""Observers under ``torch.set_default_dtype(torch.float64)`` give the qparams they give under
float32 (found by review: buffers the C kernels write float32 into took torch's default
dtype, so min / max and histograms came back as garbage, without an error)."""

import warnings

import pytest
import torch

from quantscope import QuantSpec
from quantscope.observers.registry import get_observer, list_observers

NAMES = [n for n in list_observers() if ":" not in n and n != "placeholder"]
HISTOGRAMS = {"histogram", "histogram_mse", "l2_histogram", "entropy", "kl", "percentile", "mix"}
SPECS = {"channel:0": QuantSpec("int8", "channel:0"), "group:32": QuantSpec("int4", "group:32"),
         "group:128:0": QuantSpec("int8", "group:128:0"),
         "nvfp4": QuantSpec("fp4_e2m1", "block:16", scale="fp8_e4m3")}


def _qparams(name, spec, xs):
    obs = get_observer(name, spec)
    for x in xs:
        obs(x)
    return obs.calculate_qparams()


@pytest.mark.parametrize("spec", list(SPECS), ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_default_dtype_float64_changes_nothing(name, spec):
    if name in HISTOGRAMS and spec in ("nvfp4", "group:32"):
        pytest.skip("histograms of many units (slow): their kernels run on channel, group:128:0")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(128, 512, generator=g)  # large enough for the C kernels
    xs = [w, w.t().contiguous().t() * 2]  # the second a transposed view
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            want = _qparams(name, SPECS[spec], xs)
        except (ValueError, TypeError) as e:  # a spec the observer refuses
            pytest.skip(f"{name} refuses {spec}: {e}")
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            got = _qparams(name, SPECS[spec], xs)
        finally:
            torch.set_default_dtype(default)
    assert torch.equal(got.scale.double(), want.scale.double())
    assert torch.equal(got.zero_point, want.zero_point)
