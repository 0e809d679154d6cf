"""A histogram observer's EMA mode (``averaging_constant``) is part of what its state means:
right after an estimate an EMA state's histogram is empty (the range lives in ``ema_lo`` /
``ema_hi``), so loaded into an accumulating observer it gave a range of ~0 (-0.0 for
entropy), silently; a plain state's histogram holds every batch, which an EMA observer would
read as one interval. Either way is a ``ValueError`` naming both modes; a state saved before
the record's ``ema`` entry is told by its buffers where they tell it."""

import json

import pytest
import torch

from quantscope import QuantSpec
from quantscope.observers import get_observer

RECORD = "_extra_state"
SPEC = QuantSpec("int8")


def _batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(8, 64, generator=g) * s for s in (1, 3, 0.5)]


def _observed(name, ema, batches=None, **kw):
    o = get_observer(name, SPEC, bins=256, **({"averaging_constant": ema} if ema else {}), **kw)
    for b in _batches() if batches is None else batches:
        o(b)
    return o


def _without_entry(state):
    """The state as saved before the record had an ``ema`` entry."""
    rec = json.loads(bytes(state[RECORD].tolist()))
    assert "ema" in rec
    del rec["ema"]
    return {**state, RECORD: torch.tensor(list(json.dumps(rec).encode()), dtype=torch.uint8)}


MODES = [(0.3, None), (None, 0.3)]  # (saved, into)


@pytest.mark.parametrize("name", ["percentile", "entropy", "histogram_mse"])
@pytest.mark.parametrize("saved, into", MODES)
def test_a_state_of_the_other_ema_mode_is_refused_naming_both(name, saved, into):
    state = _observed(name, saved).state_dict()
    fresh = get_observer(name, SPEC, bins=256,
                         **({"averaging_constant": into} if into else {}))
    with pytest.raises(ValueError, match=r"cannot load a histogram state (in the EMA mode|"
                                         r"accumulating).* into this one, (accumulating|in "
                                         r"the EMA mode)"):
        fresh.load_state_dict(state)


@pytest.mark.parametrize("saved, into", MODES)
def test_an_old_state_without_the_entry_is_told_by_its_buffers(saved, into):
    state = _without_entry(_observed("percentile", saved).state_dict())
    fresh = get_observer("percentile", SPEC, bins=256,
                         **({"averaging_constant": into} if into else {}))
    with pytest.raises(ValueError, match="cannot load a histogram state"):
        fresh.load_state_dict(state)
    # and one without any record alike
    with pytest.raises(ValueError, match="cannot load a histogram state"):
        fresh.load_state_dict({k: v for k, v in state.items() if k != RECORD})


@pytest.mark.parametrize("ema", [None, 0.3])
@pytest.mark.parametrize("strip", ["entry", "record"])
def test_old_states_of_the_same_mode_load_as_before(ema, strip):
    src = _observed("percentile", ema)
    state = _without_entry(src.state_dict())
    if strip == "record":
        state = {k: v for k, v in state.items() if k != RECORD}
    back = get_observer("percentile", SPEC, bins=256,
                        **({"averaging_constant": ema} if ema else {}))
    back.load_state_dict(state)
    for got, want in zip(back.calculate_range(), src.calculate_range()):
        assert torch.equal(got, want)


def test_same_mode_other_constant_and_empty_states_load():
    """The constant is a setting, not a meaning; an EMA state mid-interval (no estimate
    yet, one batch pending) is EMA by its buffers too."""
    src = _observed("percentile", 0.3)
    get_observer("percentile", SPEC, bins=256, averaging_constant=0.5).load_state_dict(
        src.state_dict())
    pending = _observed("percentile", 0.3, batches=_batches()[:1], update_interval=2)
    assert pending.ema_lo.numel() == 0
    with pytest.raises(ValueError, match="cannot load a histogram state in the EMA mode"):
        get_observer("percentile", SPEC, bins=256).load_state_dict(
            _without_entry(pending.state_dict()))
    # nothing observed: either mode's empty state loads, old or new
    empty = get_observer("percentile", SPEC, bins=256, averaging_constant=0.3).state_dict()
    get_observer("percentile", SPEC, bins=256).load_state_dict(_without_entry(empty))


def test_a_damaged_ema_entry_is_no_record():
    state = _observed("percentile", None).state_dict()
    rec = json.loads(bytes(state[RECORD].tolist()))
    rec["ema"] = "no"
    state[RECORD] = torch.tensor(list(json.dumps(rec).encode()), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"PercentileObserver.*_extra_state is no record"):
        get_observer("percentile", SPEC, bins=256).load_state_dict(state)


@pytest.mark.parametrize("name", ["percentile", "histogram_mse"])
def test_an_empty_state_loads_in_either_mode(name):
    """A state that observed nothing is either mode's empty state, with the record's ema
    entry too (the EMA mode is no meaning without data)."""
    for src_c, dst_c in ((0.5, None), (None, 0.5)):
        src = get_observer(name, averaging_constant=src_c)
        dst = get_observer(name, averaging_constant=dst_c)
        dst.load_state_dict(src.state_dict())
        x = torch.randn(64)
        fresh = get_observer(name, averaging_constant=dst_c)
        dst(x)
        fresh(x)
        assert torch.equal(dst.calculate_qparams().scale, fresh.calculate_qparams().scale)
