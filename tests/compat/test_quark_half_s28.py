"""Probe s28: a module cast to float16 (``.half()``, ``.to(torch.float16)``) of a Quark
histogram observer that has seen ``|x|`` past float16's max turns Quark's state (its bin
edges, or counts past 65504) into inf. Quark 0.13's classes then fail at their next batch
(``torch.histc: range of [0, inf] is not finite``); quantscope's refuse that batch, and
qparams read from that state, with a ``StateOverflowError`` naming the class and float16
(before: an unnamed ``qparams_from_range`` error, a silent batch, or the torch.ao child's
unnamed ``ao_histc`` error), leaving the state as it was. bfloat16 holds the values."""

import warnings

import pytest
import torch

from quantscope.compat import quark
from quantscope.compat.torch_ao import StateOverflowError

CLASSES = ["PerTensorHistogramObserver", "PerTensorPercentileObserver", "PerTensorMSEObserver",
           "PerTensorHistogramObserverPro"]
CASTS = {"half": lambda o: o.half(), "to": lambda o: o.to(torch.float16)}


def observer(name: str, symmetric: bool, big: float = 70000.0):
    qspec = {"dtype": "int8", "qscheme": "per_tensor", "is_dynamic": False,
             "symmetric": symmetric, "round_method": "half_even", "scale_type": "float"}
    o = getattr(quark, name)(qspec)
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(1))
    x[0, 0] = big
    o(x)
    return o


def batch():
    return torch.randn(16, 512, generator=torch.Generator().manual_seed(2))


def state(o):
    return {k: v.clone() for k, v in o.state_dict().items()}


@pytest.mark.parametrize("cast", list(CASTS))
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("name", CLASSES)
def test_the_batch_after_an_overflowing_cast_is_refused_naming_why(name, symmetric, cast):
    o = CASTS[cast](observer(name, symmetric))
    before = state(o)
    with pytest.raises(StateOverflowError, match=rf"{name}\(.*float16"):
        o(batch())
    after = state(o)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before), name  # left as it was


@pytest.mark.parametrize("name", CLASSES[1:])
def test_qparams_of_the_overflowed_state_are_refused_naming_why(name):
    o = observer(name, True).half()
    with pytest.raises(StateOverflowError, match=rf"{name}\(.*overflowed its state"):
        o.calculate_qparams()


def test_the_recorder_prices_its_own_range_after_the_cast():
    # its qparams read the data's min / max (quantscope's), not Quark's edges
    scale, _ = observer(CLASSES[0], True).half().calculate_qparams()
    assert torch.isfinite(scale).all()


@pytest.mark.parametrize("name", CLASSES)
def test_bfloat16_and_a_range_inside_float16_cast_as_before(name):
    o = observer(name, True).bfloat16()
    o(batch())
    assert torch.isfinite(o.calculate_qparams()[0].float()).all()
    o = observer(name, True, big=30000.0).half()
    o(batch())
    assert torch.isfinite(o.calculate_qparams()[0].float()).all()


def test_mse_centres_past_float16s_max_are_refused():
    # edges past 32752: Quark's centres (a + b) / 2 overflow in float16 (its scale is inf)
    o = observer("PerTensorMSEObserver", True, big=60000.0).half()
    o(batch())  # the state holds (60000 < 65504)
    with pytest.raises(StateOverflowError, match=r"PerTensorMSEObserver\(.*float16"):
        o.calculate_qparams()


@pytest.mark.parametrize("name", CLASSES[1:3])
def test_counts_past_float16s_max_are_refused(name):
    o = getattr(quark, name)({"dtype": "int8", "qscheme": "per_tensor", "is_dynamic": False,
                              "symmetric": True, "round_method": "half_even",
                              "scale_type": "float"})
    o(torch.cat([torch.full((70000,), 1.0), torch.linspace(-2, 2, 101)]))  # one bin: 70000
    o = o.half()
    with pytest.raises(StateOverflowError, match="float16"):
        o.calculate_qparams()


@pytest.mark.parametrize("name", CLASSES)
def test_reset_observes_again(name):
    o = observer(name, True).half()
    o.reset()
    o(batch())
    assert torch.isfinite(o.calculate_qparams()[0].float()).all()


@pytest.mark.parametrize("name", CLASSES[:3])
def test_a_cast_back_to_float32_observes_again(name):
    # the native state never left float32: Quark's edges and counts are float32 again
    o = observer(name, True).half().float()
    o(batch())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.isfinite(o.calculate_qparams()[0]).all()


def test_the_pro_s_torch_ao_child_keeps_its_overflow_after_a_cast_back():
    # torch.ao's state itself overflowed (as in Quark's): still refused, still named
    o = observer(CLASSES[3], True).half().float()
    with pytest.raises(StateOverflowError, match=r"PerTensorHistogramObserverPro\(.*cast"):
        o(batch())
