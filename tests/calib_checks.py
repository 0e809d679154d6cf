"""Comparisons of two calibrations that several test files make."""

import torch


def assert_same_qparams(a, b) -> None:
    """``a`` and ``b`` (Calibrations) hold the same layers and roles, and bitwise the same
    scales and zero points (and there is something to compare)."""
    assert a.states.keys() == b.states.keys() and a.states
    for layer, roles in a.states.items():
        assert roles.keys() == b.states[layer].keys(), layer
        for role, st in roles.items():
            qa, qb = st.qparams, b.states[layer][role].qparams
            assert torch.equal(qa.scale, qb.scale), (layer, role)
            assert torch.equal(qa.zero_point, qb.zero_point), (layer, role)
