"""Two reductions of ``sync_observers`` that were wrong for states an observer declares in
its ``sync_plan`` (no built-in observer holds such a state): a plain ``SUM`` state fed
again after its sync counted the synced state once per rank in the next sync (now refused,
as a histogram's counts are); ``MIN`` of a bool, unsigned or signed integer state, folded
into ``MAX`` by negation, lost a False (uint8's ``-0 == 0``) and int8's -128 (``-(-128)``
overflows): now by ``~v``. The ranks are threads of this process (``_World`` of
test_sync_pins_s64.py). Found by session 64's mutation round.
"""

from __future__ import annotations

import pytest
import torch
from test_sync_pins_s64 import _ok, ranks  # noqa: F401 -- ranks: the fixture

import quantscope
from quantscope import comm
from quantscope.observers import sync as qsync
from quantscope.spec import QuantSpec


class _OneState(quantscope.Observer):
    """One state ``name`` of ``dtype`` reducing with ``op``: each batch's ``step(units, lo)``
    folded into it with ``fold``."""

    def __init__(self, spec, name, dtype, op, step, fold):
        super().__init__(spec)
        self._state, self._op, self._step, self._fold = name, op, step, fold
        self.register_buffer(name, torch.zeros(0, dtype=dtype))

    def sync_plan(self):
        return {self._state: self._op}

    def _observe(self, units, lo, hi):
        old = getattr(self, self._state)
        new = self._step(units, lo).to(old.dtype)
        setattr(self, self._state, new if old.numel() == 0 else self._fold(old, new))


def _tally():
    """Counts the values it saw above zero (one SUM state, as token counts reduce)."""
    return _OneState(QuantSpec(), "above", torch.int64, comm.SUM,
                     lambda units, lo: (units > 0).sum(1), torch.add)


def _flags():
    """Per unit: whether every value seen was positive (a bool state reducing with MIN)."""
    return _OneState(QuantSpec(), "positive", torch.bool, comm.MIN,
                     lambda units, lo: lo > 0, torch.logical_and)


def _least(dtype):
    """Per channel: the least value seen, kept in ``dtype`` (a MIN state of an integer type)."""
    return _OneState(QuantSpec("int8", "channel"), "least", dtype, comm.MIN,
                     lambda units, lo: lo, torch.minimum)


def test_a_sum_state_fed_after_its_sync_is_refused(ranks):  # noqa: F811
    w = ranks(2)

    def twice(r):
        obs = _tally()
        obs(torch.tensor([1.0, 2.0, -1.0]))  # 2 above zero on each rank
        qsync.sync_observers([obs])
        first = int(obs.above)
        obs(torch.tensor([3.0]))  # 1 more on each rank
        with pytest.raises(ValueError, match=r"observed after its last sync; its SUM state "
                                             r"'above' would be counted once per rank"):
            qsync.sync_observers([obs])
        return first

    assert _ok(w.run(twice)) == [4, 4]  # one process that saw both ranks' first batches


def test_a_sum_state_not_fed_since_its_sync_syncs_again_unchanged(ranks):  # noqa: F811
    w = ranks(2)

    def twice(r):
        obs = _tally()
        obs(torch.tensor([1.0, 2.0, -1.0]))
        qsync.sync_observers([obs])
        qsync.sync_observers([obs])
        return int(obs.above)

    assert _ok(w.run(twice)) == [4, 4]


def test_a_bool_min_state_is_the_and_over_the_ranks(ranks):  # noqa: F811
    """MIN of bools is AND: a rank that saw a non-positive value makes it False everywhere
    (the sync folds MIN into MAX by negation, in uint8 for bools, where -1 is 255)."""
    w = ranks(2)
    xs = [torch.tensor([1.0, 2.0]), torch.tensor([-1.0, 2.0])]

    def sync(r):
        obs = _flags()
        obs(xs[r])
        qsync.sync_observers([obs])
        return obs.positive.tolist()

    assert _ok(w.run(sync)) == [[False], [False]]


@pytest.mark.parametrize("dtype, values", [
    (torch.int8, [[-128.0, 5.0], [3.0, -7.0]]),  # -(-128) is -128 in int8
    (torch.uint8, [[0.0, 200.0], [9.0, 255.0]]),  # -0 is 0, the least uint8 once negated
    (torch.int64, [[-(2.0 ** 62), 1.0], [2.0, 0.0]]),
], ids=["int8", "uint8", "int64"])
def test_an_integer_min_state_is_the_least_over_the_ranks(ranks, dtype, values):  # noqa: F811
    w = ranks(2)
    xs = [torch.tensor(v)[:, None] for v in values]  # two units of one element a rank

    def sync(r):
        obs = _least(dtype)
        obs(xs[r])
        qsync.sync_observers([obs])
        return obs.least.tolist()

    want = torch.minimum(*(x[:, 0].to(dtype) for x in xs)).tolist()
    assert _ok(w.run(sync)) == [want, want]


def test_an_idle_ranks_bool_min_identity_leaves_the_others_false(ranks):  # noqa: F811
    w = ranks(2)

    def sync(r):
        obs = _flags()
        if r == 0:
            obs(torch.tensor([-1.0, 2.0]))
        qsync.sync_observers([obs])
        return obs.positive.tolist()

    assert _ok(w.run(sync)) == [[False], [False]]
