"""An observer's state stays where ``.to(device)`` put it (docs/guide/observers.md): input
on another device is a ``ValueError`` naming the observer, both devices and the move, before
anything is recorded (it was the internal op's 'seen must be one bool on meta, got ... on
cpu'). The meta device stands in for an accelerator here."""

from __future__ import annotations

import pytest
import torch

import quantscope

NAMES = ["minmax", "static_minmax", "memoryless_minmax", "mse", "percentile", "histogram"]


@pytest.mark.parametrize("name", NAMES)
def test_input_on_another_device_is_named(name):
    obs = quantscope.get_observer(name, quantscope.QuantSpec("int8", "channel"))
    with pytest.raises(ValueError, match=rf"^\w+\('{name}', .*\): input on meta, the "
                                         r"observer's state on cpu; move the observer first: "
                                         r"\.to\('meta'\)$"):
        obs(torch.empty(16, 64, device="meta"))
    assert not obs.has_observed


def test_moved_observer_takes_the_input():
    obs = quantscope.get_observer("static_minmax", quantscope.QuantSpec("int8", "channel"))
    obs.to("meta")
    obs(torch.empty(16, 64, device="meta"))
    assert obs.has_observed and obs.min_vals.device.type == "meta"
