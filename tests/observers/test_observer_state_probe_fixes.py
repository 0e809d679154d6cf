"""Observer state across batches: Block / Tile padding in moving averages and running ranges,
state made under ``torch.inference_mode()`` observed outside it."""

import pytest
import torch

import quantscope
from quantscope import Block, Channel, QuantSpec, Tensor, Tile

# ---- padding is no data: a padded unit's range (and its average) is its real values' ----

B1, B2 = torch.tensor([-4.0, 1.0, 1.0]), torch.tensor([0.5, 1.0, 1.0])  # B2 all positive
PADDED = [(Block(4), (3,)), (Tile(2, 4), (1, 3))]  # one unit: 3 values, the rest zeros


@pytest.mark.parametrize("name", ["minmax", "mse", "static_minmax", "memoryless_minmax",
                                  "memoryless_mse"])
@pytest.mark.parametrize("layout, shape", PADDED, ids=["block", "tile"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_padded_unit_state_is_that_of_its_real_values(name, layout, shape, symmetric):
    kw = {"averaging_constant": 0.5} if name in ("minmax", "mse") else {}
    pad = quantscope.get_observer(name, QuantSpec("int8", layout, symmetric=symmetric), **kw)
    ref = quantscope.get_observer(name, QuantSpec("int8", symmetric=symmetric), **kw)
    for b in (B1, B2):
        pad(b.reshape(shape))
        ref(b.reshape(shape))
    assert torch.equal(pad.min_vals.flatten(), ref.min_vals.flatten())
    assert torch.equal(pad.max_vals.flatten(), ref.max_vals.flatten())
    qp, qr = pad.calculate_qparams(), ref.calculate_qparams()
    assert torch.equal(qp.scale.flatten(), qr.scale.flatten())
    assert torch.equal(qp.zero_point.flatten(), qr.zero_point.flatten())


def test_ema_formula_on_the_real_values():
    """The probe's numbers: min = -4 + 0.5 * (0.5 - -4) = -1.75, scale 1.75 / 127.5."""
    for name in ("minmax", "mse"):
        obs = quantscope.get_observer(name, QuantSpec("int8", Block(4)), averaging_constant=0.5)
        obs(B1)
        obs(B2)
        assert obs.min_vals.item() == -1.75
        assert obs.calculate_qparams().scale.item() == pytest.approx(1.75 / 127.5)


def real_ranges(x, layout):
    """Each unit's real min / max, sliced from ``x`` itself, in the layout's unit order."""
    if isinstance(layout, Block):
        lines = x.reshape(-1, x.shape[-1])
        parts = [line[s:s + layout.size] for line in lines
                 for s in range(0, x.shape[-1], layout.size)]
    else:
        R, C = x.shape[-2:]
        parts = [m[r:r + layout.rows, c:c + layout.cols] for m in x.reshape(-1, R, C)
                 for r in range(0, R, layout.rows) for c in range(0, C, layout.cols)]
    return (torch.stack([p.min() for p in parts]), torch.stack([p.max() for p in parts]))


@pytest.mark.parametrize("layout, shape", [(Block(256), (256, 300)), (Tile(64, 64), (130, 300))],
                         ids=["block", "tile"])
@pytest.mark.parametrize("name", ["minmax", "static_minmax", "memoryless_minmax"])
def test_large_padded_batches(name, layout, shape):
    """Large enough for the C kernel, which fuses the state update into its pass where the
    units carry no padding: never the padded units' raw min / max."""
    c = 0.25
    obs = quantscope.get_observer(name, QuantSpec("int8", layout),
                                  **({"averaging_constant": c} if name == "minmax" else {}))
    gen = torch.Generator().manual_seed(0)
    lo = hi = None
    for _ in range(3):
        x = torch.rand(shape, generator=gen) + 0.5  # all positive: the padding would be the min
        obs(x)
        blo, bhi = real_ranges(x, layout)
        if lo is None or name == "memoryless_minmax":
            lo, hi = blo, bhi
        elif name == "static_minmax":
            lo, hi = torch.minimum(lo, blo), torch.maximum(hi, bhi)
        else:  # torch.ao's expression
            lo, hi = lo + c * (blo - lo), hi + c * (bhi - hi)
    assert bool((obs.min_vals > 0).all())
    torch.testing.assert_close(obs.min_vals, lo, rtol=0, atol=1e-6)
    torch.testing.assert_close(obs.max_vals, hi, rtol=0, atol=1e-6)


# ---- state made under torch.inference_mode(), observed outside it --------------------------

STATEFUL = ["static_minmax", "minmax", "memoryless_minmax", "mse", "memoryless_mse",
            "percentile", "histogram", "imatrix_mse"]


def _batches():
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(8, 64, generator=gen) * s for s in (1.0, 2.0, 0.5)]


@pytest.mark.parametrize("reset", [False, True], ids=["continues", "reset"])
@pytest.mark.parametrize("name", STATEFUL)
def test_state_made_in_inference_mode_goes_on_outside(name, reset):
    """Observed under inference_mode, then outside it: the state continues as if observed
    outside all along, and reset() gives a fresh observer."""
    spec = QuantSpec("int8", "channel:0")
    xs = _batches()
    obs, ref = quantscope.get_observer(name, spec), quantscope.get_observer(name, spec)
    with torch.inference_mode():
        obs(xs[0])
        obs(xs[1])
    if reset:
        obs.reset()
    else:
        ref(xs[0])
        ref(xs[1])
    obs(xs[2])
    ref(xs[2])
    assert not any(b.is_inference() for b in obs.buffers())
    assert torch.equal(obs.calculate_qparams().scale, ref.calculate_qparams().scale)
    assert int(obs.observed_tokens) == int(ref.observed_tokens)


def test_load_after_inference_mode():
    spec = QuantSpec("int8", "channel:0")
    xs = _batches()
    src, obs = quantscope.get_observer("minmax", spec), quantscope.get_observer("minmax", spec)
    src(xs[0])
    with torch.inference_mode():
        obs(xs[1])
    obs.load_state_dict(src.state_dict())
    assert torch.equal(obs.min_vals, src.min_vals)
    obs(xs[2])
    src(xs[2])
    assert torch.equal(obs.max_vals, src.max_vals)


def test_observing_inside_inference_mode_is_unchanged():
    """Inside inference mode nothing is cloned: the state stays the tensors it updates."""
    obs = quantscope.get_observer("minmax", QuantSpec("int8", "channel:0"))
    xs = _batches()
    with torch.inference_mode():
        obs(xs[0])
        before = obs.min_vals
        obs(xs[1])
        assert obs.min_vals is before


@pytest.mark.parametrize("fmt, symmetric", [("int8", False), ("int4", True), ("fp8_e4m3", True)])
@pytest.mark.parametrize("name", ["mse", "memoryless_mse", "static_minmax", "memoryless_minmax"])
def test_tile_cut_to_a_short_dim_scores_the_rows_blocks(name, fmt, symmetric):
    # a [B, 1, C] batch under Tile(128, 128): each unit is one row's 128 columns (the last
    # one 44, padded), the units of Block(128) on the [B, C] rows, and scored as those
    # (the MSE search's global patience reads every unit: the same units, the same result)
    x = torch.randn(3, 1, 300, generator=torch.Generator().manual_seed(1)) * 3
    got, want = (quantscope.get_observer(name, QuantSpec(fmt, lay, symmetric=symmetric))
                 for lay in (Tile(128, 128), Block(128)))
    got(x)
    want(x.reshape(3, 300))
    qp, ref = got.calculate_qparams(), want.calculate_qparams()
    assert qp.scale.shape == (3, 1, 3)
    assert torch.equal(qp.scale.reshape(-1), ref.scale.reshape(-1))
    assert torch.equal(qp.zero_point.reshape(-1), ref.zero_point.reshape(-1))


# ---- probe s41: a first-batch grid's state read as a power-of-two one; load errors' key ----

@pytest.mark.parametrize("name", ["percentile", "histogram_mse", "entropy", "histogram", "mix"])
def test_a_first_grid_state_is_refused_by_a_native_grid_observer(name):
    # its linear counts read as power-of-two bins gave every scale eps, without a word
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 8
    first = quantscope.get_observer(name, QuantSpec("int8"), grid="first")
    first(x)
    native = quantscope.get_observer(name, QuantSpec("int8"))
    with pytest.raises(ValueError, match=r"cannot load linear_grid: the state's histogram is on "
                                         r"a first-batch grid \(grid='first'\)"):
        native.load_state_dict(first.state_dict())
    again = quantscope.get_observer(name, QuantSpec("int8"), grid="first")
    again.load_state_dict(first.state_dict())  # into its own grid, as before
    assert torch.equal(again.calculate_qparams().scale, first.calculate_qparams().scale)
    native(x)  # and the other way: a native state loads into a first-grid observer
    again.load_state_dict(native.state_dict())
    assert torch.equal(again.hist_counts, native.hist_counts) and not bool(again.linear_grid)


def test_a_load_error_names_the_submodule():
    # as torch's size mismatches name the key: which of a model's observers refused its state
    def parent(layout):
        return torch.nn.ModuleDict({n: quantscope.get_observer(
            "static_minmax", QuantSpec("int8", layout if n == "layer2" else Tensor()))
            for n in ("layer1", "layer2")})
    src = parent(Channel(0))
    for obs in src.values():
        obs(torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"StaticMinMaxObserver\('static_minmax', int8 tensor "
                                         r"sym\) at 'layer2': cannot load a state whose min_vals"):
        parent(Tensor()).load_state_dict(src.state_dict())


def _layer2_refuses(make, make_layer2, alter=None):
    """The error of loading a ModuleDict's state (layer1, layer2: ``make()``, fed a batch)
    into one whose layer2 is ``make_layer2()``; ``alter`` edits the state first."""
    src = torch.nn.ModuleDict({"layer1": make(), "layer2": make()})
    for obs in src.values():
        obs(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))
    sd = src.state_dict()
    if alter is not None:
        alter(sd)
    dst = torch.nn.ModuleDict({"layer1": make(), "layer2": make_layer2()})
    with pytest.raises(ValueError) as err:
        dst.load_state_dict(sd)
    return str(err.value)


def _obs(name, layout=None, **kw):
    return lambda: quantscope.get_observer(name, QuantSpec("int8", layout or Tensor()), **kw)


def _kl(bins):
    from quantscope.compat.horizon import KLObserver

    return lambda: KLObserver(bins=bins, update_interval=4)


def _negated_importance(sd):
    sd["layer2.importance"] = -sd["layer2.importance"]


@pytest.mark.parametrize("make, layer2, alter, says", [
    (_obs("static_minmax", Channel(0)), _obs("static_minmax", Channel(1)), None,
     "cannot load a state saved under layout 'channel:0'"),
    (_obs("percentile", bins=128), _obs("percentile", bins=256), None,
     "cannot load a histogram of 128 bins into one of bins=256"),
    (_kl(512), _kl(256), None,
     "cannot load a histogram of 512 bins into one of bins=256"),
    (_obs("imatrix_mse", Channel(0), importance=torch.ones(8)), None, _negated_importance,
     "importance must be finite and non-negative"),
], ids=["record", "histogram_bins", "horizon_bins", "imatrix_importance"])
def test_every_load_check_names_the_submodule(make, layer2, alter, says):
    # each check of a saved state, not only the sizes' (s42's mutants): which of a model's
    # observers refused its state
    got = _layer2_refuses(make, layer2 or make, alter)
    assert f"at 'layer2': {says}" in got, got
