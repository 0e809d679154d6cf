"""compat.horizon against Horizon observer_v2's formulas (written out here; the plugin is not
installable): the scale of ends a clip crossed (a constant or narrow one-signed batch),
``with_args``, and the ``min_val`` / ``max_val`` / ``eps`` a Horizon state holds."""

from __future__ import annotations

import warnings

import pytest
import torch

from quantscope.compat import horizon as hz

EPS = torch.finfo(torch.float32).eps
MIX_P = [0.999, 0.9995, 0.9999, 0.99993, 0.99995, 0.99997, 0.99999, 0.999995, 0.999999]


# ------------------------------------------------------------------ Horizon's formulas
def horizon_scale(lo, hi, qmin=-128, qmax=127):
    """Horizon's symmetric scale: max(-min_val, max_val) clamped at 0, over (qmax - qmin) / 2."""
    return torch.max(-lo, hi).clamp_min(0).div(float(qmax - qmin) / 2).clamp_min(EPS)


def fake_quant(x, scale):
    return torch.round(x / scale).clamp(-128, 127) * scale


def clipped_ends(x, ps, bins=2048):
    """Per percentile: Horizon's clip (bin centre) and the signed ends it clips,
    ``(max(min, -clip), min(max, clip))``, which cross on one-signed data inside one bin."""
    lo, hi = torch.aminmax(x)
    r = torch.max(-lo, hi)
    h = torch.histc(x.abs(), bins=bins, min=0.0, max=float(r))
    idx = torch.searchsorted(torch.cumsum(h, 0), torch.tensor(ps) * x.numel())
    clips = (torch.unique(idx) + 0.5) * (r / bins)
    return [(torch.max(lo, -c).reshape(1), torch.min(hi, c).reshape(1)) for c in clips]


def percentile_ends(x, p=99.99):
    return clipped_ends(x, [p / 100])[0]


def mix_ends(x):
    """Horizon's MixObserver: the candidate ends with the least L2 error of the batch."""
    best = None
    for lo, hi in clipped_ends(x, MIX_P):
        err = torch.linalg.norm(x - fake_quant(x, horizon_scale(lo, hi)), ord=2)
        if best is None or err < best[0]:
            best = (err, lo, hi)
    return best[1:]


def ema(old, new, c):
    return old + c * (new - old)


NARROW = [torch.ones(100), torch.full((100,), -2.5),
          5 + 0.001 * torch.rand(1000, generator=torch.Generator().manual_seed(0))]


# ------------------------------------------------------------------ crossed ends
@pytest.mark.parametrize("cls, ends", [(hz.PercentileObserver, percentile_ends),
                                       (hz.MixObserver, mix_ends)])
@pytest.mark.parametrize("x", NARROW, ids=["ones", "minus_2.5", "5_plus_narrow"])
def test_constant_or_narrow_batch_gives_horizons_scale(cls, ends, x):
    """The clip lies inside the data's one-signed range: Horizon's ends cross (lo > hi) and
    its scale is max(-lo, hi) / 127.5, not an error (nor Mix's unclipped max)."""
    lo, hi = ends(x)
    assert bool(lo > hi)  # the case: crossed ends
    o = cls()
    o(x)
    assert torch.equal(o.min_val, lo) and torch.equal(o.max_val, hi)
    want = horizon_scale(lo, hi)
    scale, zp = o.calculate_qparams()
    assert torch.equal(scale, want) and zp.tolist() == [0]
    # the native path (model calibration's) takes it too, from an ordered range
    rlo, rhi, qp = o.range_and_qparams()
    assert bool(rlo <= rhi) and torch.equal(qp.scale.reshape(-1), want)


@pytest.mark.parametrize("cls, ends", [(hz.PercentileObserver, percentile_ends),
                                       (hz.MixObserver, mix_ends)])
def test_crossed_ends_average_on_as_horizons(cls, ends):
    """A constant batch's crossed ends are averaged as they are, then a normal batch's."""
    xs = [torch.full((64,), 3.0), torch.randn(64, generator=torch.Generator().manual_seed(1))]
    o = cls(averaging_constant=0.5)
    lo = hi = None
    for x in xs:
        o(x)
        blo, bhi = ends(x)
        lo, hi = (blo, bhi) if lo is None else (ema(lo, blo, 0.5), ema(hi, bhi, 0.5))
    assert o.min_val.item() == pytest.approx(lo.item(), rel=1e-6)
    assert o.max_val.item() == pytest.approx(hi.item(), rel=1e-6)
    assert o.calculate_qparams()[0].item() == pytest.approx(horizon_scale(lo, hi).item(),
                                                            rel=1e-6)


# ------------------------------------------------------------------ with_args
WITH_ARGS = [(hz.MinMaxObserver, {"averaging_constant": 0.5}),
             (hz.MovingAverageMinMaxObserver, {"averaging_constant": 0.25}),
             (hz.MovingAveragePerChannelMinMaxObserver, {"ch_axis": 1}),
             (hz.KLObserver, {"bins": 1024}), (hz.PercentileObserver, {"percentile": 99.9}),
             (hz.MSEObserver, {"stride": 2}), (hz.MixObserver, {"averaging_constant": 0.5})]


@pytest.mark.parametrize("cls, kw", WITH_ARGS, ids=[c.__name__ for c, _ in WITH_ARGS])
def test_with_args_is_a_constructor_as_horizons(cls, kw):
    ctor = cls.with_args(**kw)
    a, b = ctor(), ctor()
    assert type(a) is cls and a is not b
    assert all(getattr(a, k) == v for k, v in kw.items())
    assert ctor.__name__ == cls.__name__
    nested = ctor.with_args(dtype="qint16")()  # as torch.ao's: the keywords add up
    assert nested.quant_max == 32767 and all(getattr(nested, k) == v for k, v in kw.items())


def test_with_args_fills_a_torch_ao_qconfig():
    from torch.ao.quantization import QConfig
    qconfig = QConfig(activation=hz.MinMaxObserver.with_args(averaging_constant=0.5),
                      weight=hz.MovingAveragePerChannelMinMaxObserver.with_args(ch_axis=0))
    act = qconfig.activation()
    assert isinstance(act, hz.MinMaxObserver) and act.averaging_constant == 0.5


# ------------------------------------------------------------------ Horizon's state names
def test_min_val_max_val_eps_read_as_horizons():
    xs = [torch.tensor([-2.0, 1.0]), torch.tensor([-1.0, 3.0])]
    o = hz.MinMaxObserver(averaging_constant=0.5)
    assert o.min_val.numel() == 0 and o.max_val.numel() == 0  # Horizon's empty buffers
    for x in xs:
        o(x)
    assert torch.equal(o.min_val, torch.tensor([ema(-2.0, -1.0, 0.5)]))
    assert torch.equal(o.max_val, torch.tensor([ema(1.0, 3.0, 0.5)]))
    assert torch.equal(o.eps, torch.tensor([EPS]))
    with pytest.raises(AttributeError):
        o.min_val = torch.zeros(1)  # read-only: a state comes from observing (or a load)
    pc = hz.MovingAveragePerChannelMinMaxObserver(ch_axis=1)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    pc(x)
    assert torch.equal(pc.min_val, x.amin(0)) and torch.equal(pc.max_val, x.amax(0))


def horizon_state(lo, hi):
    return {"min_val": torch.tensor(lo), "max_val": torch.tensor(hi), "eps": torch.tensor([EPS])}


def test_a_horizon_state_loads_strictly_and_averages_on():
    o = hz.MinMaxObserver(averaging_constant=0.5)
    o.load_state_dict(horizon_state([-3.0], [2.0]))
    assert torch.equal(o.min_val, torch.tensor([-3.0]))
    assert torch.equal(o.calculate_qparams()[0], horizon_scale(torch.tensor(-3.0),
                                                               torch.tensor(2.0)).reshape(1))
    o(torch.tensor([-1.0, 4.0]))
    assert o.min_val.item() == ema(-3.0, -1.0, 0.5) and o.max_val.item() == ema(2.0, 4.0, 0.5)
    # nested, 0-dim per tensor ends (as a module's state_dict holds them)
    m = torch.nn.Sequential(hz.MinMaxObserver())
    m.load_state_dict({f"0.{k}": v.reshape(()) for k, v in horizon_state([-1.0], [3.0]).items()})
    assert torch.equal(m[0].calculate_qparams()[0], torch.tensor([3.0]) / 127.5)


def test_a_horizon_state_loads_per_channel_and_into_the_histogram_classes():
    pc = hz.MovingAveragePerChannelMinMaxObserver(ch_axis=1, averaging_constant=0.5)
    pc.load_state_dict(horizon_state([-1.0, -4.0, -2.0], [2.0, 1.0, 0.5]))
    want = horizon_scale(torch.tensor([-1.0, -4.0, -2.0]), torch.tensor([2.0, 1.0, 0.5]))
    assert torch.equal(pc.calculate_qparams()[0], want)
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(2))
    pc(x)
    assert torch.allclose(pc.min_val, ema(torch.tensor([-1.0, -4.0, -2.0]), x.amin(0), 0.5))
    # Percentile: loaded ends, then a batch's clipped ends averaged in, as Horizon's
    x = torch.randn(256, generator=torch.Generator().manual_seed(3))
    o = hz.PercentileObserver(averaging_constant=0.5)
    o.load_state_dict(horizon_state([-2.0], [2.5]))
    o(x)
    blo, bhi = percentile_ends(x)
    assert o.min_val.item() == pytest.approx(ema(-2.0, blo.item(), 0.5), rel=1e-6)
    assert o.max_val.item() == pytest.approx(ema(2.5, bhi.item(), 0.5), rel=1e-6)


def test_an_empty_or_partial_horizon_state():
    o = hz.MinMaxObserver()
    o.load_state_dict(horizon_state([], []))  # saved before data: a new observer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert o.calculate_qparams()[0].tolist() == [1.0]
    with pytest.raises(RuntimeError, match="min_vals"):  # not Horizon's either: torch's error
        hz.MinMaxObserver().load_state_dict({"min_val": torch.tensor([1.0])})
