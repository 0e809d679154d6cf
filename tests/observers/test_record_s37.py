"""A hostile ``_extra_state`` record is a ValueError naming the observer and the entry: one
nested past the JSON parser's depth was a bare RecursionError, a malformed layout a bare
"Group: size must be ..." naming neither."""

import pytest
import torch

from quantscope import QuantSpec, get_observer


def _record(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)


@pytest.mark.parametrize("text, said", [
    ("[" * 100000 + "]" * 100000, "_extra_state is no record"),
    ('{"layout": "group:0"}', "_extra_state holds no layout: Group"),
    ('{"layout": "nonsense"}', "_extra_state holds no layout"),
])
def test_a_hostile_record_names_the_observer_and_the_entry(text, said):
    spec = QuantSpec("int8", "channel")
    saved = get_observer("minmax", spec)
    saved(torch.randn(4, 16))
    into = get_observer("minmax", spec)
    with pytest.raises(ValueError, match=r"MovingAverageMinMaxObserver\(.*" + said):
        into.load_state_dict({**saved.state_dict(), "_extra_state": _record(text)})
    assert not into.has_observed  # nothing loaded
