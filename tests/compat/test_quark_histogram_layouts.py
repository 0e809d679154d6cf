"""Quark's histogram observers are per tensor (Quark's config refuses them per channel or
group): quantscope's refuse such a qspec when built, naming it. Probing: one built and
observed, then ``calculate_qparams`` failed with torch's "shape '[]' is invalid"."""

import pytest

from quantscope.compat import quark as q

NAMES = ["PerTensorHistogramObserver", "PerTensorPercentileObserver", "PerTensorMSEObserver"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("qspec", [
    {"dtype": "int8", "qscheme": "per_channel", "ch_axis": 0, "symmetric": True},
    {"dtype": "int8", "qscheme": "per_group", "ch_axis": 1, "group_size": 32,
     "symmetric": True}],
    ids=["per_channel", "per_group"])
def test_a_histogram_observer_refuses_units_other_than_the_tensor(name, qspec):
    with pytest.raises(ValueError, match=rf"{name}: Quark's histogram observers are per "
                                         rf"tensor .* qscheme '{qspec['qscheme']}'"):
        getattr(q, name)(qspec)
