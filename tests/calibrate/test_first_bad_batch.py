"""The batch that first brought NaN / inf, named with one op per batch (issue 35: on a GPU
the host pays for every op of an observer call; the flags are stacked at each batch's end,
not counted per call)."""

from types import SimpleNamespace

import pytest
import torch
from op_names import OpNames
from torch import nn

from quantscope.calibration import calibrate
from quantscope.calibration.run import observe
from quantscope.calibration.run.non_finite import NONE, FirstBad, Watched, exchanged, first_of


def _watched(n):
    return [Watched(f"layer{i}", "input", "minmax",
                    SimpleNamespace(seen_non_finite=torch.zeros((), dtype=torch.bool)))
            for i in range(n)]


def test_first_names_the_first_row_and_the_batch_its_flag_was_set_after():
    """Rows in ``watched``'s order (the layers'), each at the first batch after which its
    flag was set, however many batches later it stays set; a moved observer's new flag
    tensor is read."""
    watched = _watched(3)
    bad = FirstBad(watched)
    for batch, rows in ((10, []), (11, [2]), (12, []), (13, [1])):
        for i in rows:
            watched[i][3].seen_non_finite = torch.ones((), dtype=torch.bool)  # a new tensor
        bad.end_batch(batch)
    assert bad.first() == (1, 13)
    with pytest.raises(ValueError, match=r"layer 'layer1' input: calibration batch 13 .*"
                                         r"observer 'minmax'"):
        bad.check()
    assert FirstBad(_watched(2)).first() is None  # no batch: nothing to name
    clean = FirstBad(_watched(2))
    clean.end_batch(0)
    assert clean.first() is None
    clean.check()


def test_end_batch_stacks_every_flag_in_one_op():
    watched = _watched(50)
    bad = FirstBad(watched)
    with OpNames() as seen:
        bad.end_batch(0)
    assert seen.calls == {"aten.stack": 1}
    with OpNames() as seen:
        FirstBad([]).end_batch(0)
    assert not seen.calls


def test_the_pass_tracks_non_finite_values_once_per_batch_not_per_call(monkeypatch):
    """Four observed layers, three batches: the flags are stacked once per batch, and no
    counter is added to per observer call (the CPU observers count their tokens through
    memory: no ``add_`` at all)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    forward, ends = observe.forward_batch, []
    calls = OpNames()

    def counted(model, batch):
        with calls:
            forward(model, batch)
    monkeypatch.setattr(observe, "forward_batch", counted)
    end_batch = FirstBad.end_batch

    def counted_end(self, batch):
        ends.append(batch)
        with calls:
            end_batch(self, batch)
    monkeypatch.setattr(FirstBad, "end_batch", counted_end)
    calibrate(model, [torch.randn(4, 16) for _ in range(3)], "w8a8", progress=False)
    assert ends == [0, 1, 2]
    assert calls.calls["aten.stack"] == 3
    assert "aten.add_" not in calls.calls


def test_first_of_the_ranks_answers_is_one_process_answer():
    """Each rank's (row, batch) over its own batches: the least row wins, then the least batch
    of it (rank 1's batch 1 brought NaN to a later row only: rank 0's batch 2 is named)."""
    watched = [_watched(3) for _ in range(2)]  # each rank's own observers
    ranks = [FirstBad(w) for w in watched]
    for batch, rank, rows in ((0, 0, []), (1, 1, [2]), (2, 0, [0, 2]), (3, 1, [0])):
        for i in rows:
            watched[rank][i][3].seen_non_finite = torch.ones((), dtype=torch.bool)
        ranks[rank].end_batch(batch)
    answers = [exchanged(r.first()) for r in ranks]
    assert answers == [[0, 2], [0, 3]]
    assert first_of(answers) == (0, 2)
    assert first_of([[NONE, NONE], [2, 1]]) == (2, 1)
    assert first_of([exchanged(None)] * 2) is None
    assert first_of([exchanged((1, None)), [NONE, NONE]]) == (1, None)
