"""Act-order groups (``Group(size, g_idx=...)``) hold other columns than plain groups of the
same size: they are not the same units, and a state saved under one g_idx is a ValueError
naming both layouts when loaded under another (or none), not groups merged with the wrong
columns. The saved state records a short digest of g_idx (``Group.order``), not g_idx itself;
the layout's name stays the plain groups'."""

from __future__ import annotations

import pytest
import torch

from quantscope import Group, QuantSpec
from quantscope.observers import get_observer

RECORD = "_extra_state"
C = 32
EVEN_ODD = torch.arange(C) % 2  # group 0 = even columns, group 1 = odd columns
SHIFTED = (torch.arange(C) + 8) // 16 % 2  # another order: columns 8..23 form group 1


def _batches():
    x = torch.zeros(4, C)
    x[:, :16] = 10.0  # plain groups: 10 and 0; even / odd groups: 10 and 10
    return x, torch.full((4, C), 1.0)


def _named(order):
    """How the refusal names a ``group:16`` layout of that column order (None: as it is)."""
    return "'group:16'" + (rf" \(g_idx column order {order}\)" if order else "(;|$)")


def _observer(g_idx, name="static_minmax"):
    return get_observer(name, QuantSpec("int8", Group(16, g_idx=g_idx)))


@pytest.mark.parametrize("a, b", [(None, EVEN_ODD), (EVEN_ODD, None), (EVEN_ODD, SHIFTED)])
def test_groups_of_another_column_order_are_not_the_same_units(a, b):
    assert not Group(16, g_idx=a).same_units(Group(16, g_idx=b), (4, C))


def test_groups_of_the_same_column_order_are_the_same_units():
    assert Group(16, g_idx=EVEN_ODD).same_units(Group(16, g_idx=EVEN_ODD.clone().int()), (4, C))
    in_place = torch.arange(C) // 16  # g_idx that keeps every column in place: plain groups
    assert Group(16, g_idx=in_place).same_units(Group(16), (4, C))
    assert Group(16, g_idx=in_place).order is None and Group(16, g_idx=EVEN_ODD).order


@pytest.mark.parametrize("name", ["static_minmax", "minmax", "percentile"])
@pytest.mark.parametrize("saved, into", [(None, EVEN_ODD), (EVEN_ODD, None),
                                         (EVEN_ODD, SHIFTED)])
def test_state_of_another_g_idx_is_a_value_error_naming_both(name, saved, into):
    x, _ = _batches()
    obs = _observer(saved, name)
    obs(x)
    into_obs = _observer(into, name)
    names = [_named(Group(16, g_idx=g).order) for g in (saved, into)]
    with pytest.raises(ValueError, match=".*".join(names)):
        into_obs.load_state_dict(obs.state_dict())


@pytest.mark.parametrize("name", ["static_minmax", "percentile"])
def test_state_of_the_same_g_idx_loads_and_resumes_as_uninterrupted(name):
    x, y = _batches()
    saved = _observer(EVEN_ODD, name)
    saved(x)
    resumed = _observer(EVEN_ODD.clone(), name)
    resumed.load_state_dict(saved.state_dict())
    resumed(y)
    fresh = _observer(EVEN_ODD, name)
    fresh(x)
    fresh(y)
    assert torch.equal(resumed.calculate_qparams().scale, fresh.calculate_qparams().scale)


def test_plain_group_state_with_its_record_of_before_still_loads():
    x, _ = _batches()
    saved = _observer(None)
    saved(x)
    state = saved.state_dict()
    assert bytes(state[RECORD].tolist()).decode().find('"group:16"') >= 0  # name unchanged
    _observer(None).load_state_dict(state)


def test_state_saved_before_the_order_record_is_refused_by_act_order_groups():
    """A record without ``order`` (saved before it, or by plain groups) means column order:
    refused where this observer's groups follow a g_idx (column order loads, above)."""
    x, _ = _batches()
    saved = _observer(None)
    saved(x)
    with pytest.raises(ValueError, match="'group:16';.*g_idx column order"):
        _observer(EVEN_ODD).load_state_dict(saved.state_dict())


def test_names_and_specs_keep_no_g_idx_digest():
    spec = QuantSpec("int8", Group(16, axis=0, g_idx=EVEN_ODD))
    assert spec.layout.spec_name() == "group:16:0" and "@" not in str(spec)
    assert QuantSpec.from_dict(spec.to_dict()).layout.g_idx is None


def test_equality_and_hash_still_ignore_g_idx():
    assert Group(16, g_idx=EVEN_ODD) == Group(16) == Group(16, g_idx=SHIFTED)
    assert hash(Group(16, g_idx=EVEN_ODD)) == hash(Group(16))
