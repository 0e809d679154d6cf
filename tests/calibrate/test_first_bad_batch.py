"""The batch that first brought NaN / inf, named with two ops per batch (issue 35: on a GPU
the host pays for every op of an observer call; the flags are read at each batch's end, not
counted per call), in memory that does not grow with the batches."""

import random
from types import SimpleNamespace

import pytest
import torch
from op_names import OpNames
from torch import nn

from quantscope.calibration import calibrate
from quantscope.calibration.run import non_finite, observe
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
    bad = FirstBad(watched, lambda k: 10 + k)
    for rows in ([], [2], [], [1]):  # batches 10 .. 13
        for i in rows:
            watched[i][3].seen_non_finite = torch.ones((), dtype=torch.bool)  # a new tensor
        bad.end_batch()
    assert bad.first() == (1, 13)
    with pytest.raises(ValueError, match=r"layer 'layer1' input: calibration batch 13 .*"
                                         r"observer 'minmax'"):
        bad.check()
    assert FirstBad(_watched(2)).first() is None  # no batch: nothing to name
    clean = FirstBad(_watched(2))
    clean.end_batch()
    assert clean.first() is None
    clean.check()


def test_end_batch_reads_every_flag_in_two_ops():
    watched = _watched(50)
    bad = FirstBad(watched)
    for first in (True, False):  # (the first batch makes the counts)
        with OpNames() as seen:
            bad.end_batch()
        assert seen.calls == {"aten.stack": 1, "aten.add_": 1, **({"aten.zeros": 1} if first else {})}
    with OpNames() as seen:
        FirstBad([]).end_batch()
    assert not seen.calls


def test_what_it_keeps_does_not_grow_with_the_batches():
    """One int64 per flag (it kept every batch's stacked flags and their row lists: 1.3 KB a
    batch on an 8-layer Llama, 22 KB with auto's 774 observers); the answer is the same
    whatever the batch flags were set after, and observers that move device keep theirs."""
    watched = _watched(4)
    bad = FirstBad(watched)
    for k in range(300):
        if k in (120, 250):  # row 3, then row 1
            watched[3 if k == 120 else 1][3].seen_non_finite = torch.ones((), dtype=torch.bool)
        if k == 135:
            watched[3][3].seen_non_finite = torch.ones((), dtype=torch.bool)  # a new tensor
        bad.end_batch()
        assert [t.numel() for _, t in bad.counts.values()] == [4] and not bad.settled
    assert bad.first() == (1, 250)
    assert bad.first() == (1, 250)  # asked twice (the ranks' exchange, then the error)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_observers_moving_device_keep_the_batch_their_flag_was_set_after():
    watched = _watched(3)
    bad = FirstBad(watched)
    for k in range(8):
        if k == 2:
            watched[2][3].seen_non_finite = torch.ones((), dtype=torch.bool)
        if k in (4, 6):  # rows 1 and 2 move to the GPU, then row 1 back
            for i in ((1, 2) if k == 4 else (1,)):
                flag = watched[i][3].seen_non_finite
                watched[i][3].seen_non_finite = flag.to("cuda" if k == 4 else "cpu")
        if k == 5:
            watched[1][3].seen_non_finite.fill_(True)
        bad.end_batch()
    assert bad.first() == (1, 5)
    watched = _watched(3)
    bad = FirstBad(watched)
    for k in range(4):
        if k == 1:
            watched[2][3].seen_non_finite = torch.ones((), dtype=torch.bool, device="cuda")
        bad.end_batch()
    assert bad.first() == (2, 1)


class _Flag:
    """An observer's ``seen_non_finite`` 'on' ``device`` (a name: CPU CI has one device)."""

    def __init__(self, value: bool, device: str):
        self.t, self.device = torch.tensor(value), device


class _Counts:
    """FirstBad's int64 counts 'on' a device; each read back (on a GPU, a host sync) listed."""

    def __init__(self, n: int, device: str, reads: list):
        self.t, self.device, self.reads = torch.zeros(n, dtype=torch.int64), device, reads

    def add_(self, flags):
        self.t.add_(flags)
        return self

    def tolist(self):
        self.reads.append(self.device)
        return self.t.tolist()


@pytest.fixture
def devices(monkeypatch) -> list:
    """FirstBad's torch ops on named fake devices (:class:`_Flag`, :class:`_Counts`): the
    reads of the counts, listed."""
    reads: list = []
    fake = SimpleNamespace(zeros=lambda n, dtype, device: _Counts(n, device, reads),
                           stack=lambda flags: torch.stack([f.t for f in flags]),
                           int64=torch.int64)
    monkeypatch.setattr(non_finite, "torch", fake)
    return reads


def _holders(devices_of):
    return [SimpleNamespace(seen_non_finite=_Flag(False, d)) for d in devices_of]


def _move(holder, device):  # observe.py's obs.to(x.device): a new flag, its value kept
    holder.seen_non_finite = _Flag(bool(holder.seen_non_finite.t), device)


def test_observers_moving_device_are_not_read_until_the_pass_ends(devices):
    """A GPU pass moves each observer to its data's device at its first call (an MoE expert
    first routed in a later batch): the counts of a device whose rows changed are kept, not
    read back then (a host sync per such batch: 24 in 64 batches of a 24-layer, 64-expert
    top-2 model), and read with the others by first()."""
    holders = _holders(["cpu"] * 6)
    bad = FirstBad([Watched(f"expert{i}", "input", "minmax", h) for i, h in enumerate(holders)])
    for k in range(6):
        _move(holders[k], "cuda")  # expert k first routed in batch k
        if k == 3:
            holders[1].seen_non_finite.t.fill_(True)  # on the GPU since batch 1
        bad.end_batch()
    assert devices == []  # nothing read during the pass
    assert bad.first() == (1, 3)
    reads = len(devices)
    assert set(devices) == {"cpu", "cuda"}
    assert bad.first() == (1, 3) and len(devices) == reads  # asked twice: read once


def test_observers_moving_device_keep_the_batch_their_flag_was_set_after_on_the_cpu(devices):
    """Rows moving between devices (named: the CPU test of what the CUDA one checks) before,
    after and in the batch their flag is set, with and without a batch number mapping: each
    row's first set batch is the one a per-batch record gives."""
    for seed in range(400):
        assert _scenario(seed), seed


def _scenario(seed: int) -> bool:
    rng = random.Random(seed)
    names = ["cpu", "cuda:0", "cuda:1"][:rng.randint(1, 3)]
    holders = _holders(rng.choice(names) for _ in range(rng.randint(1, 6)))
    number = (lambda k: 3 * k + 1) if seed % 2 else None
    bad = FirstBad([Watched(f"l{i}", "input", "minmax", h) for i, h in enumerate(holders)],
                   number)
    first_set: dict[int, int] = {}
    for k in range(rng.randint(0, 12)):
        for i, h in enumerate(holders):
            r = rng.random()
            if r < 0.08:
                h.seen_non_finite.t.fill_(True)
            elif r < 0.3:
                _move(h, rng.choice(names))
            if bool(h.seen_non_finite.t):
                first_set.setdefault(i, k)
        bad.end_batch()
    want = None if not first_set else (min(first_set), first_set[min(first_set)])
    if want is not None and number is not None:
        want = (want[0], number(want[1]))
    return bad.first() == want


def test_the_pass_tracks_non_finite_values_once_per_batch_not_per_call(monkeypatch):
    """Four observed layers, three batches: the flags are counted once per batch, and no
    counter is added to per observer call (the CPU observers count their tokens through
    memory: no ``add_`` but the flags' count)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    forward, ends = observe.forward_batch, []
    calls = OpNames()

    def counted(model, batch):
        with calls:
            forward(model, batch)
    monkeypatch.setattr(observe, "forward_batch", counted)
    end_batch = FirstBad.end_batch

    def counted_end(self):
        ends.append(self.ended)
        with calls:
            end_batch(self)
    monkeypatch.setattr(FirstBad, "end_batch", counted_end)
    calibrate(model, [torch.randn(4, 16) for _ in range(3)], "w8a8", progress=False)
    assert ends == [0, 1, 2]
    assert calls.calls["aten.stack"] == calls.calls["aten.add_"] == 3


def test_first_of_the_ranks_answers_is_one_process_answer():
    """Each rank's (row, batch) over its own batches: the least row wins, then the least batch
    of it (rank 1's batch 1 brought NaN to a later row only: rank 0's batch 2 is named)."""
    watched = [_watched(3) for _ in range(2)]  # each rank's own observers
    ranks = [FirstBad(w, lambda k, rank=rank: 2 * k + rank) for rank, w in enumerate(watched)]
    for rank, rows in ((0, []), (1, [2]), (0, [0, 2]), (1, [0])):  # batches 0 .. 3
        for i in rows:
            watched[rank][i][3].seen_non_finite = torch.ones((), dtype=torch.bool)
        ranks[rank].end_batch()
    answers = [exchanged(r.first()) for r in ranks]
    assert answers == [[0, 2], [0, 3]]
    assert first_of(answers) == (0, 2)
    assert first_of([[NONE, NONE], [2, 1]]) == (2, 1)
    assert first_of([exchanged(None)] * 2) is None


def test_first_of_prefers_the_least_row_to_an_earlier_batch_of_a_later_row():
    """One process names the first watched row (the layers' order) that saw NaN / inf, at
    that row's first bad batch, not the first bad batch of any row: a rank whose answer is
    an earlier batch of a later row loses to another rank's earlier row."""
    one = _watched(3)
    whole = FirstBad(one)
    for rows in ([], [2], [0], []):  # batches 0 .. 3: batch 1 reaches row 2 only, 2 row 0
        for i in rows:
            one[i][3].seen_non_finite = torch.ones((), dtype=torch.bool)
        whole.end_batch()
    assert whole.first() == (0, 2)
    watched = [_watched(3) for _ in range(2)]  # rank r forwards batches 2 k + r
    ranks = [FirstBad(w, lambda k, rank=rank: 2 * k + rank) for rank, w in enumerate(watched)]
    for rank, rows in ((0, []), (1, [2]), (0, [0]), (1, [])):
        for i in rows:
            watched[rank][i][3].seen_non_finite = torch.ones((), dtype=torch.bool)
        ranks[rank].end_batch()
    answers = [exchanged(r.first()) for r in ranks]
    assert answers == [[0, 2], [2, 1]]
    assert first_of(answers) == first_of(answers[::-1]) == whole.first()
