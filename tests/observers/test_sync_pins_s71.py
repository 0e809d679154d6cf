"""Pins of ``quantscope.observers.sync`` that the existing tests let through, from a mutation
round (s71): a plan entry of three items, the hint only an observer of another library gets,
the plans' check comparing each buffer's reduction, the group's own rank, the sync mark (saved
and loaded under a module's prefix, two ints, int64), the agreed last shape,
``sync_every_step`` differing in the header and states observed after their sync that still
sync (``AVG``, step-synced histograms). Each test fails on a small defect. No process is
spawned: the ranks are the threads of test_sync_pins_s64.py's ``_World``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import quantscope
from quantscope import comm
from quantscope.observers import record
from quantscope.observers import sync as qsync
from quantscope.spec import QuantSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from test_sync_pins_s64 import _ok, ranks  # noqa: F401 -- ranks: the fixture


class _Planned(quantscope.Observer):
    """A per-tensor min-max state whose ``min_vals`` reduces with the op it is given."""

    def __init__(self, op):
        super().__init__(QuantSpec())
        self._op = op
        self.register_buffer("min_vals", torch.zeros(0))
        self.register_buffer("max_vals", torch.zeros(0))

    def sync_plan(self):
        return {"min_vals": self._op, "max_vals": comm.MAX}

    def _observe(self, units, lo, hi):
        self.min_vals, self.max_vals = lo.clone(), hi.clone()


def _minmax(**kwargs):
    return quantscope.get_observer("static_minmax", QuantSpec(), **kwargs)


# ------------------------------------------------------------------------------ the plan
def test_a_plan_entry_of_three_items_is_refused():
    class Odd(quantscope.Observer):
        def sync_plan(self):
            return [("min_vals", comm.MIN, "extra")]

    with pytest.raises(TypeError, match=r"expected \(buffer, Op\) pairs"):
        qsync._plan(Odd(QuantSpec()))


def test_only_an_observer_of_another_library_is_told_it_is_none_of_quantscopes():
    class Bare(quantscope.Observer):
        def _observe(self, units, lo, hi):
            pass

    with pytest.raises(NotImplementedError, match="does not declare") as own:
        qsync._plan(Bare(QuantSpec()))
    assert "no quantscope Observer" not in str(own.value)
    with pytest.raises(NotImplementedError, match=r"\(it is no quantscope Observer"):
        qsync._plan(torch.nn.Identity())


# ------------------------------------------------------------------------ the plans' check
def test_ranks_reducing_one_buffer_differently_raise_on_every_rank(ranks):  # noqa: F811
    """The check compares each buffer's reduction, not only its name."""
    w = ranks(2)

    def sync(r):
        obs = _Planned(comm.MIN if r == 0 else comm.MAX)
        obs(torch.tensor([1.0, 2.0]))
        qsync.sync_observers([obs])

    for e in w.run(sync):
        assert isinstance(e, ValueError) and "#0 of 1" in str(e), e


# ------------------------------------------------------------------------------ the group
def test_the_rank_is_the_groups_own(ranks, monkeypatch):  # noqa: F811
    """In a group whose ranks are not the default group's (reversed here), the rank that
    observed keeps its state and the idle one takes it."""
    w = ranks(2)
    group = object()
    monkeypatch.setattr(dist, "get_rank",
                        lambda g=None: w.rank() if g is group else 1 - w.rank())

    def sync(r):
        obs = _minmax()
        if r == 0:
            obs(torch.tensor([-3.0, 5.0]))
        qsync.sync_observers([obs], group)
        return float(obs.min_vals), float(obs.max_vals)

    assert _ok(w.run(sync)) == [(-3.0, 5.0)] * 2


# ------------------------------------------------------------------------------ the mark
def test_the_sync_mark_round_trips_through_a_modules_state():
    """Saved under the module's prefix, in the counters' order (tokens, non-finite count)."""
    obs = _minmax(non_finite="ignore")
    obs(torch.tensor([[1.0, float("nan")], [2.0, 3.0], [4.0, 5.0]]))
    obs._synced = {"observed_tokens": torch.tensor(3), "non_finite_count": torch.tensor(1)}
    assert qsync.synced_record(obs) == {"synced": [3, 1]}
    state = torch.nn.ModuleList([obs]).state_dict()
    fresh = torch.nn.ModuleList([_minmax(non_finite="ignore")])
    fresh.load_state_dict(state)
    assert {k: int(v) for k, v in fresh[0]._synced.items()} == {
        "observed_tokens": 3, "non_finite_count": 1}


@pytest.mark.parametrize("mark", [[4, 1, 0], [4]])
def test_a_sync_mark_of_another_length_is_damaged(mark):
    state = {record.RECORD: record.encode({"synced": mark})}
    with pytest.raises(ValueError, match="damaged sync mark"):
        qsync.loaded_mark(_minmax(), state, "")


def test_a_loaded_sync_mark_keeps_counts_past_32_bits():
    """The counters are int64: a mark of 2**40 tokens loads as it was saved."""
    state = {record.RECORD: record.encode({"synced": [2 ** 40, 2 ** 33]})}
    got = qsync.loaded_mark(_minmax(), state, "")
    assert {k: (v.dtype, int(v)) for k, v in got.items()} == {
        "observed_tokens": (torch.int64, 2 ** 40), "non_finite_count": (torch.int64, 2 ** 33)}


# ------------------------------------------------------------------------ what is agreed
def test_the_agreed_last_shape_is_the_last_ranks(ranks):  # noqa: F811
    """As one process that saw rank 0's batch and then rank 1's."""
    w = ranks(2)

    def sync(r):
        obs = _minmax()
        obs(torch.ones(2 + r, 4))
        qsync.sync_observers([obs])
        return obs.shape

    assert _ok(w.run(sync)) == [(3, 4)] * 2


def test_sync_every_step_set_on_one_rank_after_its_batches_raises(ranks):  # noqa: F811
    """Set after the last step (so no step exchange met it): the header tells."""
    w = ranks(2)

    def sync(r):
        obs = quantscope.get_observer("minmax", QuantSpec())
        obs(torch.tensor([1.0, 2.0]))
        obs.sync_every_step = r == 0
        qsync.sync_observers([obs])

    for e in w.run(sync):
        assert isinstance(e, ValueError), e
        assert "has sync_every_step set on some ranks only" in str(e)


# ------------------------------------------------------------------------ syncing again
def test_an_avg_state_observed_after_its_sync_syncs_again(ranks):  # noqa: F811
    """Only SUM states and histograms are refused: rank 0's further batch averages in."""
    w = ranks(2)
    xs = [torch.tensor([-1.0, 1.0]), torch.tensor([-3.0, 3.0])]

    def twice(r):
        obs = quantscope.get_observer("minmax", QuantSpec())
        obs(xs[r])
        qsync.sync_observers([obs])
        if r == 0:
            obs(torch.tensor([-2.0, 10.0]))
        qsync.sync_observers([obs])
        return obs.max_vals.item(), int(obs.observed_tokens)

    c = quantscope.get_observer("minmax", QuantSpec()).averaging_constant
    mean = (1.0 + 3.0) / 2
    want = (mean + (mean + c * (10.0 - mean))) / 2
    for hi, tokens in _ok(w.run(twice)):
        assert hi == pytest.approx(want) and tokens == 3


def test_a_step_synced_histogram_observed_after_its_sync_syncs_again(ranks):  # noqa: F811
    """Its counts are already global after every step: a sync after more steps is no error
    and leaves them those of one process that saw every batch."""
    w = ranks(2)
    xs = [[torch.tensor([[0.5, -2.0]]), torch.tensor([[3.0, 1.0]])],
          [torch.tensor([[1.5, 4.0]]), torch.tensor([[-0.25, 2.0]])]]  # [rank][step]
    ref = quantscope.get_observer("percentile", QuantSpec(), bins=64)
    for s in range(2):
        ref(torch.cat([xs[0][s], xs[1][s]], 1))

    def steps(r):
        obs = quantscope.get_observer("percentile", QuantSpec(), bins=64)
        obs.sync_every_step = True
        for x in xs[r]:
            obs(x)
            qsync.sync_observers([obs])
        return obs.hist_counts.clone()

    for counts in _ok(w.run(steps)):
        assert torch.equal(counts, ref.hist_counts)
