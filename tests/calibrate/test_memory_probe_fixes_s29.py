"""Probe s29 (memory): the activation sample's budget holds for modules of unknown width and
for any dtype; the fusion detection forward keeps no activation alive past a plain forward's."""

import weakref

import pytest
import torch
from torch import nn

import quantscope
from quantscope import QuantSpec
from quantscope.calibration import Recipe, Role, Rule
from quantscope.calibration.options import Sampling
from quantscope.calibration.run import samples
from quantscope.calibration.run.samples import RowSample, capacities
from quantscope.calibration.structure import fusion

MIB = 2**20
WIDTH = 256


@pytest.fixture
def made(monkeypatch):
    """Every RowSample calibration makes."""
    out, init = [], samples.RowSample.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        out.append(self)
    monkeypatch.setattr(samples.RowSample, "__init__", record)
    return out


def _calibrate(model, batches, recipe, budget_mb):
    quantscope.calibrate(model, batches, recipe, sampling=Sampling(budget_mb=budget_mb),
                         progress=False)


def test_budget_binds_modules_of_unknown_width(made):
    """8 LayerNorm inputs (no width before the first batch): 1 MiB in all, an eighth each,
    so budget / 8 / (width x 4 bytes) rows each, not every token of every batch."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.LayerNorm(WIDTH) for _ in range(8)])
    batches = [torch.randn(8, 64, WIDTH) for _ in range(4)]
    recipe = Recipe((Rule(("LayerNorm",), input=Role(QuantSpec("int8"), "minmax")),))
    budget_mb = 0.25
    _calibrate(model, batches, recipe, budget_mb)
    assert len(made) == 8
    rows = int(budget_mb * MIB) // 8 // (WIDTH * 4)
    assert [s.count for s in made] == [rows] * 8
    assert sum(s.nbytes for s in made) <= budget_mb * MIB


def test_unknown_width_planned_at_widest_known_keeps_within_its_part():
    """A key of unknown width, planned at the widest known width, whose real width is 4x
    that: it keeps a quarter of the rows, within the bytes planned for it."""
    caps = capacities({"a": 64, "b": None}, 2048, 2**16)
    rows = 2**16 // ((64 + 64) * 4)
    assert caps == {"a": rows, "b": rows}
    s = RowSample(caps["b"], 1, torch.Generator().manual_seed(0))
    s.add(torch.randn(1000, 256))
    assert s.count == rows * 64 // 256
    assert s.nbytes <= rows * 64 * 4


def test_budget_binds_a_float64_model(made):
    """float64 activations: the rows are fitted at 8 bytes a value, so half float32's."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(8)]).double()
    batches = [torch.randn(8, 64, WIDTH, dtype=torch.float64) for _ in range(4)]
    budget_mb = 0.25
    _calibrate(model, batches, "w8a8", budget_mb)
    assert made and all(s.buffer.dtype == torch.float64 for s in made)
    rows = int(budget_mb * MIB) // (len(made) * WIDTH * 8)
    assert {s.count for s in made} == {rows}
    assert sum(s.nbytes for s in made) <= budget_mb * MIB


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_narrower_dtypes_keep_the_planned_rows(dtype):
    """The docs count rows at float32's 4 bytes: bfloat16 keeps the same rows, in fewer bytes."""
    budget = 2**15
    (cap,) = capacities({"a": 64}, 2048, budget).values()
    assert cap == budget // (64 * 4)
    s = RowSample(cap, 1, torch.Generator().manual_seed(0))
    s.add(torch.randn(1000, 64).to(dtype))
    assert s.count == cap
    assert s.nbytes == cap * 64 * torch.empty((), dtype=dtype).element_size()


def test_promotion_to_a_wider_dtype_stays_within_the_budget():
    """float32 rows, then float64 ones: the promoted buffer keeps the rows 8 bytes allow."""
    budget = 100 * 64 * 4
    (cap,) = capacities({"a": 64}, 100, budget).values()
    s = RowSample(cap, 4, torch.Generator().manual_seed(0))
    s.add(torch.randn(30, 64))
    assert s.count == 25
    s.add(torch.randn(30, 64, dtype=torch.float64))
    s.add(torch.randn(30, 64, dtype=torch.float64))
    assert s.buffer.dtype == torch.float64
    assert s.count == budget // (64 * 8)
    assert s.nbytes <= budget


def _live_inputs_at_last_layer(model, run):
    """How many of the earlier layers' outputs are alive when the last layer is called."""
    outs, alive = [], []
    layers = list(model)
    handles = [m.register_forward_hook(
        lambda m, a, out: outs.append(weakref.ref(out.untyped_storage()))) for m in layers[:-1]]
    handles.append(layers[-1].register_forward_pre_hook(
        lambda m, a: alive.append(sum(r() is not None for r in outs))))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return alive[0]


def test_detection_forward_keeps_no_more_activations_than_a_plain_forward():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    x = torch.randn(4, 16, 64)
    names = [str(i) for i in range(8)]

    def plain():
        with torch.inference_mode():
            model(x)
    expected = _live_inputs_at_last_layer(model, plain)
    assert expected == 1  # the last layer's own input
    assert _live_inputs_at_last_layer(model, lambda: fusion.find_groups(model, x, names)) \
        == expected


class _Reads(nn.Module):
    """a / b read the same tensor, c / d equal values in two tensors (the first freed before
    the second is made, which may take its address), e / f one empty tensor."""

    def __init__(self):
        super().__init__()
        for n in "abcdef":
            setattr(self, n, nn.Linear(8, 8))

    def forward(self, x):
        y = self.a(x) + self.b(x.view(x.shape))
        y = y + self.c(x * 2)
        y = y + self.d(x * 2)
        empty = x[:0]
        return y.sum() + self.e(empty).sum() + self.f(empty).sum()


def test_detection_groups_same_inputs_only():
    model = _Reads()
    x = torch.randn(4, 8)
    assert fusion.find_groups(model, x, list("abcdef")) == [("a", "b"), ("e", "f")]
