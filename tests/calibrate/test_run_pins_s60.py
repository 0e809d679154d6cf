"""Pins found by mutation (s60) on the calibration run: a sequential chain's refusal and its
first input, a fusion group's shared input choice and weights, an NVFP4 input's global amax,
imatrix importance that is not finite, streamed samples' shares and caps, a conv input sample
shared by recipes, static activation layouts, and three layers tied to one weight; and (s61)
blocks called in another order for one batch than for batch 0."""

from __future__ import annotations

import warnings

import pytest
import torch
from tiny_models import SharedInput
from torch import nn

import quantscope
from quantscope import QuantSpec
from quantscope.calibration import Auto, Sampling, calibrate_many, preset
from quantscope.calibration.recipe import Recipe, Role, Rule
from quantscope.calibration.results.apply import qdq_tensor
from quantscope.calibration.run.block_order import NotAChain


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def _input_row(c, layer="0"):
    rows = [r for r in c.stats if r["layer"] == layer and r["role"] == "input"]
    assert len(rows) == 1, c.stats
    return rows[0]


# ---- sequential: the chain ----------------------------------------------------------------------

class _SecondLastReadAgain(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h0 = self.layers[0](x)
        h1 = self.layers[1](h0)
        h2 = self.layers[2](h1)
        return self.head(h2 + 10 * h1)  # h1, the second-to-last block's output, read again


def test_the_second_to_last_blocks_output_read_after_the_chain_is_refused():
    """Blocks whose outputs are read other than by the next block are no chain: replaying
    them one after the other would calibrate ``head`` on other inputs than the model's."""
    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    with pytest.raises(NotAChain, match="needs them to form a chain"):
        _quiet(quantscope.calibrate, _SecondLastReadAgain(), batches, "w8a8", progress=False,
               sequential=True)


class _ReversedOnThreeRows(nn.Module):
    """Blocks called in order, except on a batch of 3 rows: then last to first."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        order = list(self.layers) if x.shape[0] != 3 else list(self.layers)[::-1]
        for blk in order:
            x = blk(x)
        return self.head(x)


def test_blocks_called_in_another_order_for_one_batch_are_refused_naming_both():
    """The replay runs one block order for every batch: a model taking another for batch 1
    would have batch 1's blocks calibrated on inputs its forward never gives them."""
    model = _ReversedOnThreeRows().eval()
    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(0)),
               torch.randn(3, 8, generator=torch.Generator().manual_seed(1))]
    first = list(range(len(model.layers)))
    with pytest.raises(NotAChain) as err:
        _quiet(quantscope.calibrate, model, batches, "w8a8", progress=False,
               sequential="float")
    assert (f"the forward calls them in the order {first[::-1]} for batch 1 but {first} "
            f"for batch 0") in str(err.value)


class _InPlaceAfterBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(8, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        h += 50.0  # in place, after the blocks
        return self.head(h)


def test_the_first_blocks_input_is_kept_as_it_was_before_an_in_place_change():
    """A forward that changes a tensor in place after the blocks does not change what block 0
    is calibrated on: its input scale is the whole-model run's."""
    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    whole = _quiet(quantscope.calibrate, _InPlaceAfterBlocks(), batches, "w8a8", progress=False)
    seq = _quiet(quantscope.calibrate, _InPlaceAfterBlocks(), batches, "w8a8", progress=False,
                 sequential=True)
    got = seq.states["layers.0"]["input"].qparams.scale
    assert torch.equal(got, whole.states["layers.0"]["input"].qparams.scale)
    assert float(got) < 0.2 < 50.0 / 127  # not the +50 the forward added afterwards


# ---- fusion groups ------------------------------------------------------------------------------

_INT4_AUTO_INPUT = Recipe((Rule(("Linear",), weight=Role(QuantSpec("int8", "channel:0"), "minmax"),
                                input=Role(QuantSpec("int4", "tensor"), "auto")),))


class _QKV(nn.Module):
    def __init__(self, big):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(16, 4, bias=False) for _ in range(3))
        with torch.no_grad():
            self.q.weight.zero_()
            self.q.weight[:, 0] = big  # q reads only the outlier channel 0
            for m in (self.k, self.v):
                m.weight.zero_()
                m.weight[:, 1:] = 1.0  # k, v only the others

    def forward(self, x):
        return self.q(x) + self.k(x) + self.v(x)


def test_a_groups_shared_input_minimises_the_members_total_output_error():
    """Auto (metric "output") picks a fusion group's one input observer by the least TOTAL
    error over the members, sum ||(qdq(x) - x) W_m^T||^2: computed here from each candidate
    calibrated alone. (This model is one where the least total and least worst member differ.)"""
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        x = torch.randn(64, 16, generator=g)
        x[::16, 0] = 20.0
        batches.append(x)
    model = _QKV(1.82)
    xs = torch.cat(batches)
    errs = {}
    for name in ("minmax", "mse"):
        rec = Recipe((Rule(("Linear",), weight=Role(QuantSpec("int8", "channel:0"), "minmax"),
                           input=Role(QuantSpec("int4", "tensor"), name)),))
        alone = _quiet(quantscope.calibrate, model, batches, rec, progress=False)
        d = qdq_tensor(xs, alone.states["q"]["input"]).float() - xs
        errs[name] = [float((d @ getattr(model, m).weight.detach().T).square().sum())
                      for m in ("q", "k", "v")]
    by_sum = min(errs, key=lambda n: sum(errs[n]))
    assert by_sum != min(errs, key=lambda n: max(errs[n]))  # the model tells them apart
    c = _quiet(quantscope.calibrate, model, batches, _INT4_AUTO_INPUT,
               auto=Auto(metric="output", candidates=("minmax", "mse")), progress=False)
    assert {c.states[m]["input"].observer for m in ("q", "k", "v")} == {by_sum}


def _qk():
    torch.manual_seed(0)
    model = SharedInput(16, 16, bias=False)
    with torch.no_grad():
        model.k.weight.mul_(20.0)  # k's range much wider than q's
    return model


_FP8 = QuantSpec("fp8_e4m3", "tensor")


def test_a_shared_fp8_weight_scale_is_what_each_members_report_row_describes():
    """fp8 per-tensor q/k share one weight scale (the joined weight's amax / 448, k's): q's
    report row is made again from the scale served, not left as q's own min-max."""
    batches = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    model = _qk()
    rec = Recipe((Rule(("Linear",), weight=Role(_FP8, "minmax"), input=Role(_FP8, "minmax")),))
    c = _quiet(quantscope.calibrate, model, batches, rec, progress=False)
    amax = float(torch.cat([model.q.weight, model.k.weight]).detach().abs().max())
    scale = float(c.states["q"]["weight"].qparams.scale)
    assert scale == pytest.approx(amax / 448, rel=1e-5)
    w = model.q.weight.detach()
    d = qdq_tensor(w, c.states["q"]["weight"]).float() - w
    expect = 10 * torch.log10(w.square().sum() / d.square().sum())
    row = next(r for r in c.stats if r["layer"] == "q" and r["role"] == "weight")
    assert row["sqnr_db"] == pytest.approx(float(expect), abs=0.05)


def test_members_whose_weight_roles_differ_keep_scales_of_their_own():
    """q min-max, k mse: no one observer for the joined weight; q's scale is its own amax/448."""
    batches = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    model = _qk()
    rec = Recipe((Rule(("q",), weight=Role(_FP8, "minmax"), input=Role(_FP8, "minmax")),
                  Rule(("k",), weight=Role(_FP8, "mse"), input=Role(_FP8, "minmax"))))
    c = _quiet(quantscope.calibrate, model, batches, rec, progress=False)
    assert c.states["q"]["weight"].observer == "minmax"
    assert c.states["k"]["weight"].observer == "mse"
    assert float(c.states["q"]["weight"].qparams.scale) == pytest.approx(
        float(model.q.weight.detach().abs().max()) / 448, rel=1e-5)


# ---- NVFP4 input: global amax -------------------------------------------------------------------

def test_an_nvfp4_inputs_global_amax_takes_the_larger_side():
    """Inputs whose negative side is the larger (below 0.5, down to about -16): the
    calibrated global amax is max(|lo|, |hi|) of the data, not its max."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16))
    batches = [-(torch.randn(8, 32).abs() * 5) + 0.5 for _ in range(2)]
    amax = max(float(b.abs().max()) for b in batches)
    assert max(float(b.max()) for b in batches) < 0.5
    c = _quiet(quantscope.calibrate, model, batches, "nvfp4", observer="static_minmax",
               progress=False)
    assert float(c.states["0"]["input"].global_amax) == pytest.approx(amax, rel=1e-6)
    c = _quiet(quantscope.calibrate, model, batches, "nvfp4", observer="minmax", progress=False)
    lo = min(float(b.abs().max()) for b in batches)
    assert lo * 0.99 <= float(c.states["0"]["input"].global_amax) <= amax * 1.01


# ---- imatrix_mse importance that is not finite --------------------------------------------------

def _one_linear():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 16))


def test_an_importance_that_overflows_searches_the_weight_unweighted():
    """x^2 of a finite 1e20 overflows float32: the weight is searched unweighted (the mse
    observer's scales), the reason listed, not searched with inf weights."""
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 128, generator=g) for _ in range(2)]
    batches[1][0, 5] = 1e20
    c = _quiet(quantscope.calibrate, _one_linear(), batches, preset("w4a16", "imatrix_mse"),
               progress=False)
    assert c.info["imatrix_unweighted"] == [{"layer": "0",
                                             "reason": "its input brought NaN or inf"}]
    plain = _quiet(quantscope.calibrate, _one_linear(), batches[:1], preset("w4a16", "mse"),
                   progress=False)
    assert torch.equal(c.states["0"]["weight"].qparams.scale,
                       plain.states["0"]["weight"].qparams.scale)


def test_one_recipe_ignoring_nan_weighs_its_importance_as_it_does_alone():
    """Recipe "a" reads NaN as zero (non_finite="ignore"): its importance sums do too, though
    recipe "b"'s observer of the same input does not; "a" among many equals "a" alone."""
    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(8, 128, generator=g) for _ in range(2)]
    batches[1][0, 5] = float("nan")
    a = preset("w4a16", "imatrix_mse", non_finite="ignore")
    alone = _quiet(quantscope.calibrate, _one_linear(), batches, a, progress=False)
    many = _quiet(calibrate_many, _one_linear(), batches, {"a": a, "b": preset("w4a16", "minmax")},
                  progress=False)["a"]
    assert "imatrix_unweighted" not in alone.info
    assert "imatrix_unweighted" not in many.info
    assert torch.equal(many.states["0"]["weight"].qparams.scale,
                       alone.states["0"]["weight"].qparams.scale)


# ---- samples: streamed batches, caps ------------------------------------------------------------

def _stream(n, rows, grow=0):
    g = torch.Generator().manual_seed(1)
    for i in range(n):
        yield torch.randn(rows, 8, generator=g) * (1 + grow * i)


def test_streamed_batches_each_add_their_share_of_the_sample():
    """Batches of unknown number (a generator): each adds up to capacity // 8 rows, counted
    from where its own batch began: 3 batches of 64 rows, tokens=64 give 8 rows from each."""
    torch.manual_seed(0)
    c = _quiet(quantscope.calibrate, nn.Sequential(nn.Linear(8, 8)), _stream(3, 64, grow=10),
               "w8a8", progress=False, sampling=Sampling(tokens=64))
    assert _input_row(c)["numel"] == 3 * (64 // 8) * 8


def test_streamed_batches_with_a_sample_under_eight_rows_still_fill_it():
    """tokens=4 (capacity // 8 == 0): each batch still adds max(1, 0) = 1 row, so the input's
    report row exists, made from 3 rows of width 8."""
    torch.manual_seed(0)
    c = _quiet(quantscope.calibrate, nn.Sequential(nn.Linear(8, 8)), _stream(3, 16), "w8a8",
               progress=False, sampling=Sampling(tokens=4))
    assert _input_row(c)["numel"] == 3 * 8


def test_a_conv_sample_of_unknown_width_keeps_at_most_the_rows_asked_for():
    """A conv input sampled along its last dim (width 16, known only at the first batch) keeps
    at most Sampling(tokens=16) rows: 16 x 16 values, never more for its byte budget."""
    torch.manual_seed(0)
    rec = Recipe((Rule(("Conv2d",), weight=Role(QuantSpec("int8", "channel:0"), "minmax"),
                       input=Role(QuantSpec("int8", "channel:1"), "memoryless_minmax",
                                  dynamic=True)),))
    batches = [torch.randn(4, 3, 16, 16) for _ in range(2)]
    c = _quiet(quantscope.calibrate, nn.Sequential(nn.Conv2d(3, 4, 3)), batches, rec,
               progress=False, sampling=Sampling(tokens=16))
    assert _input_row(c)["numel"] == 16 * 16


def test_a_conv_input_shared_by_two_recipes_is_sampled_alike_in_either_order():
    """A per-tensor static recipe and a dynamic per-channel one share a conv's input slot:
    recipe "t"'s report row does not depend on the order the recipes are given in."""
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 4, 3))
    w = Role(QuantSpec("int8", "channel:0"), "minmax")
    t = Recipe((Rule(("Conv2d",), weight=w, input=Role(QuantSpec("int8", "tensor"), "minmax")),),
               name="t")
    ch = Recipe((Rule(("Conv2d",), weight=w, input=Role(QuantSpec("int8", "channel:1"),
                                                        "memoryless_minmax", dynamic=True)),),
                name="c")
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(2, 3, 8, 8 + 4 * i, generator=g) * (1 + 3 * i) for i in range(3)]
    rows = []
    for order in (("t", "c"), ("c", "t")):
        out = _quiet(calibrate_many, model(), batches, {k: {"t": t, "c": ch}[k] for k in order},
                     progress=False)
        rows.append(_input_row(out["t"]))
    assert rows[0]["numel"] == rows[1]["numel"]
    assert rows[0]["sqnr_db"] == pytest.approx(rows[1]["sqnr_db"], abs=1e-6)


# ---- static layouts, tied weights, a fusion group's NaN -----------------------------------------

def test_a_static_input_one_scale_per_token_row_is_refused_before_any_forward():
    """'channel:0' on a Linear's input is one scale per batch row: refused as a static role."""
    calls = []
    model = nn.Sequential(nn.Linear(8, 8))
    model.register_forward_hook(lambda *a: calls.append(1))
    rec = Recipe((Rule(("Linear",), weight=Role(QuantSpec("int8", "channel:0"), "minmax"),
                       input=Role(QuantSpec("int8", "channel:0"), "minmax")),))
    with pytest.raises(ValueError, match=r"do not depend on the batch \(tensor, or channel:-1\)"):
        _quiet(quantscope.calibrate, model, [torch.randn(4, 8)], rec, progress=False)
    assert calls == []


class _ThreeTied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.b.weight = self.a.weight
        self.c.weight = self.a.weight
        self.forwards = 0

    def forward(self, x):
        self.forwards += 1
        return self.c(self.b(self.a(x)))


def test_the_third_of_three_tied_layers_with_another_weight_role_is_refused_first():
    """a, b per channel; c (the same Parameter) per tensor: refused before any forward,
    naming a and c and the roles that differ."""
    ch = Role(QuantSpec("int8", "channel:0"), "minmax")
    rec = Recipe((Rule(("a", "b"), weight=ch),
                  Rule(("c",), weight=Role(QuantSpec("int8", "tensor"), "minmax"))))
    m = _ThreeTied()
    with pytest.raises(ValueError, match=r"a\.weight and c\.weight are one weight .* their "
                                         r"weight roles differ"):
        _quiet(quantscope.calibrate, m, [torch.randn(4, 8)], rec, progress=False)
    assert m.forwards == 0
