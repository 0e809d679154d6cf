import pytest
import torch
from op_names import OpNames
from torch import nn

from quantscope.calibration import Sampling, calibrate, preset
from quantscope.calibration.run import observe
from quantscope.calibration.run.samples import RowSample, capacities


def test_row_sample_takes_the_same_rows_as_select_and_cat():
    """Per batch: the first ``take`` of one randperm of the batch's rows, as the list-and-cat
    sampling it replaces drew them (same generator, same draws)."""
    xs = [torch.randn(3, 10, 8) for _ in range(4)]
    s = RowSample(capacity=50, batches=4, generator=torch.Generator().manual_seed(0))
    gen, ref, n = torch.Generator().manual_seed(0), [], 0
    for k, x in enumerate(xs, 1):
        s.add(x)
        rows = x.reshape(-1, 8)
        take = [12, 25, 37, 50][k - 1] - n  # floor(50 k / 4) rows after k batches
        ref.append(rows[torch.randperm(rows.shape[0], generator=gen)[:take]])
        n += take
    assert torch.equal(s.rows(), torch.cat(ref)) and s.count == 50 == n
    assert s.nbytes == 50 * 8 * 4  # one buffer, allocated once


@pytest.mark.parametrize("grad", [False, True])
def test_a_call_dispatches_no_op_that_changes_nothing(grad):
    """A Linear's rows (the last axis, the buffer's dtype, no grad) are taken as they are:
    no detach, no movedim of the last axis onto itself, no dtype promotion (each an op per
    observed call, which a GPU's host pays for); the same rows as the first call's."""
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(3, 10, 8, generator=g).requires_grad_(grad) for _ in range(2)]
    s = RowSample(capacity=40, batches=2, generator=torch.Generator().manual_seed(0))
    s.add(xs[0])
    with OpNames() as seen:
        s.add(xs[1])
    assert not seen.names & {"aten.permute", "aten.promote_types"}
    assert ("aten.detach" in seen.names) == grad
    gen = torch.Generator().manual_seed(0)
    want = [x.detach().reshape(-1, 8)[torch.randperm(30, generator=gen)[:20]] for x in xs]
    assert torch.equal(s.rows(), torch.cat(want)) and not s.rows().requires_grad


def test_row_sample_spreads_over_every_batch():
    """Every batch gives its share (64 rows over 20 batches: 3 or 4 each, none left out); a
    batch with fewer rows than its share leaves the rest to the next."""
    s = RowSample(64, 20, torch.Generator().manual_seed(0))
    taken = []
    for _ in range(20):
        before = s.count
        s.add(torch.randn(2, 10, 4))
        taken.append(s.count - before)
    assert s.count == 64 and set(taken) == {3, 4}
    s = RowSample(8, 2, torch.Generator())
    s.add(torch.randn(1, 4))
    s.add(torch.randn(10, 4))
    assert s.count == 8  # 1 row, then 7
    s = RowSample(16, None, torch.Generator())  # a stream: an eighth per batch
    s.add(torch.randn(10, 4))
    assert s.count == 2


def test_an_empty_batch_leaves_its_share_to_the_next():
    """7 batches for 64 rows, the 4th empty: the batches after it take its share (64 kept,
    as with a 1-row batch there), not a sample one batch short."""
    s = RowSample(64, 7, torch.Generator().manual_seed(0))
    for k in range(7):
        s.add(torch.randn(0 if k == 3 else 40, 16))
        assert s.count == (k if k == 3 else k + 1) * 64 // 7  # floor(64 k / 7) after batch k
    assert s.count == 64


@pytest.mark.parametrize("shape,axis", [((3, 5, 7), -3), ((3, 9), -2)], ids=["conv2d", "conv1d"])
def test_an_unbatched_conv_input_gives_channel_rows(shape, axis):
    """A conv's rows run along its channel axis (-3 for Conv2d, -2 for Conv1d), also for an
    unbatched input ([C, H, W] / [C, L], which torch's convolutions take), whose dim is
    -axis: the channels moved last, one row per position, not the last dim read as rows."""
    x = torch.randn(*shape)
    s = RowSample(capacity=1000, batches=1, generator=torch.Generator().manual_seed(0), axis=axis)
    s.add(x)
    rows, want = s.rows(), x.movedim(0, -1).reshape(-1, shape[0])
    assert rows.shape == want.shape
    # every position once (the sample took them all), in some order
    assert torch.equal(rows[rows[:, 0].argsort()], want[want[:, 0].argsort()])


def test_a_conv2d_called_unbatched_samples_its_channels():
    """calibrate on [C, H, W] images: the per-tensor input's sample is of channel rows (width
    C), as for batched [N, C, H, W] ones, not rows of width W (then skipped: another width)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3)).eval()
    images = [torch.randn(3, 8, 6) for _ in range(2)]
    recipe = preset("w8a8", "static_minmax", targets=["Conv2d"])

    def input_row(xs):
        cal = calibrate(model, xs, recipe, sampling=Sampling(tokens=100_000), progress=False)
        return next(r for r in cal.report().rows if r["layer"] == "0" and r["role"] == "input")

    row, ref = input_row(images), input_row([x[None] for x in images])
    assert row["numel"] == ref["numel"] == 2 * 3 * 8 * 6  # every value of both images
    assert row["sqnr_db"] == pytest.approx(ref["sqnr_db"], rel=1e-6)


def test_row_sample_empty_and_width_change():
    s = RowSample(4, 1, torch.Generator())
    s.add(torch.empty(0, 5))
    assert s.rows() is None and s.nbytes == 0
    s.add(torch.randn(2, 5))
    with pytest.raises(ValueError, match="width 6 after rows of width 5"):
        s.add(torch.randn(2, 6))


def test_capacities_share_one_budget():
    widths = {"a": 576, "b": 576, "c": 1536, "d": None}
    assert set(capacities(widths, 2048, 10**12).values()) == {2048}
    caps = capacities(widths, 2048, 16 * 2**20)
    (rows,) = set(caps.values())
    assert rows * (576 * 2 + 1536 * 2) * 4 <= 16 * 2**20 < (rows + 1) * (576 * 2 + 1536 * 2) * 4
    assert set(capacities(widths, 2048, 1).values()) == {1}
    with pytest.raises(ValueError, match="must be positive"):
        capacities(widths, 0, 1)


def test_calls_from_one_batch_share_its_rows():
    """A layer called 3 times per forward: the batch each call names, not the call count,
    marks a new batch, so 60 rows over 6 batches are 10 from each (not 30, 30, then none);
    the stream's eighth is per batch too."""
    s = RowSample(60, 6, torch.Generator().manual_seed(0))
    taken = []
    for b in range(6):
        before = s.count
        for _ in range(3):
            s.add(torch.randn(64, 4), batch=b)
        taken.append(s.count - before)
    assert taken == [10] * 6
    s = RowSample(16, None, torch.Generator())
    for _ in range(3):
        s.add(torch.randn(10, 4), batch=0)
    assert s.count == 2


def test_a_layer_called_several_times_is_sampled_from_every_batch(monkeypatch):
    """End to end: the sample of a Linear called 3 times per forward holds rows of all 6
    batches (docs/memory.md: spread evenly over all of them)."""
    made = []

    class Spy(RowSample):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    class Thrice(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = nn.Linear(4, 4)

        def forward(self, x):
            return self.cell(x) + self.cell(x) + self.cell(x)

    monkeypatch.setattr(observe, "RowSample", Spy)
    # batch k's rows are all k (plus noise), so a sampled row tells its batch
    data = [torch.full((64, 4), float(k)) + 0.01 * torch.randn(64, 4) for k in range(6)]
    calibrate(Thrice(), data, "w8a8", sampling=Sampling(tokens=60), progress=False)
    (sample,) = made
    batch_of_row = sample.rows()[:, 0].round().long()
    assert torch.bincount(batch_of_row, minlength=6).tolist() == [10] * 6
