"""An act-order ``Group`` in messages (probe s33): its dataclass repr printed every column's
group (a 4096-column weight's refusal held 4096 numbers); and a bool ``g_idx`` was taken as
groups 0 and 1 though the message asks for integers."""

import pytest
import torch

from quantscope import Group


def test_repr_summarizes_g_idx():
    g = torch.arange(4096) % 32  # a column order that moves columns
    r = repr(Group(128, g_idx=g))
    assert r.startswith("Group(size=128, axis=-1, g_idx=<4096 columns, order ")
    assert "tensor" not in r and len(r) < 90
    assert Group(128, g_idx=g).order in r
    assert repr(Group(2, g_idx=torch.tensor([0, 0, 1, 1]))) == (
        "Group(size=2, axis=-1, g_idx=<4 columns, column order>)")
    assert repr(Group(16, 0)) == "Group(size=16, axis=0)"


def test_a_bool_g_idx_is_refused():
    with pytest.raises(ValueError, match="g_idx must be a 1-D integer tensor, got torch.bool"):
        Group(2, g_idx=torch.tensor([True, False, True, False]))
