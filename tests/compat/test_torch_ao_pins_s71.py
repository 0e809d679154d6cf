"""compat.torch_ao (its histogram steps and ops too) where s71's mutants of ``torch_ao.py``,
``torch_ao_steps.py`` and ``integrations/torchao.py`` changed behaviour no test saw (the file
came from a mutation round): the per-channel twin a moving average's refusal names, ``reset``
of a one-channel per-channel observer (empty buffers, as a new one), ``qparams`` in float32 /
int32 after ``.double()``, ``has_observed`` after a per-channel batch of only infinities, a
loaded inf in a float64 state named as loaded, the observe op's default upsample rate
(torch.ao's 16), torch.ao's own search for a state with any buffer not float32, the sync
view's spec telling ch_axis and state dtype apart, and the histogram's declared
``non_finite``. Values and exceptions as torch.ao's, or as the docstrings say."""

from __future__ import annotations

import math

import pytest
import torch
from test_torch_ao_args_rate_bins import _growing
from torch.ao import quantization as tq

from quantscope.compat import torch_ao as qa


def test_a_moving_average_refusing_a_per_channel_qscheme_names_its_per_channel_twin():
    with pytest.raises(NotImplementedError,
                       match=r"; use MovingAveragePerChannelMinMaxObserver$"):
        qa.MovingAverageMinMaxObserver(qscheme=torch.per_channel_affine)


@pytest.mark.parametrize("cls", [qa.PerChannelMinMaxObserver,
                                 qa.MovingAveragePerChannelMinMaxObserver])
def test_reset_of_a_one_channel_observer_empties_its_buffers_as_a_new_one(cls):
    """One channel's min_val has one element but is no per-tensor 0-dim buffer."""
    fresh, obs = cls(), cls()
    obs(torch.tensor([[-1.0, 2.0, 0.5]]))  # ch_axis 0: one channel
    assert obs.min_val.shape == (1,)
    obs.reset()
    assert not obs.has_observed
    for name in ("min_val", "max_val"):
        assert getattr(obs, name).shape == getattr(fresh, name).shape == (0,), name


@pytest.mark.parametrize("cls", [qa.MinMaxObserver, qa.PerChannelMinMaxObserver,
                                 qa.HistogramObserver])
def test_qparams_of_a_double_state_are_float32_scales_and_int32_zero_points(cls):
    """torch.ao's calculate_qparams gives float64 scales after .double(); QParams holds
    float32 scales (its documented dtype), equal to the float64 ones rounded."""
    obs = cls().double()
    obs(torch.linspace(-1.0, 3.0, 12, dtype=torch.float64).reshape(3, 4))
    scale, zero_point = obs.calculate_qparams()
    qp = obs.qparams()
    assert qp.scale.dtype == torch.float32 and qp.zero_point.dtype == torch.int32
    assert torch.equal(qp.scale, scale.reshape(-1).float())
    assert torch.equal(qp.zero_point, zero_point.reshape(-1).int())


def test_a_per_channel_batch_of_only_infinities_is_observed():
    """Channel 0 only +inf (min_val stays +inf), channel 1 only -inf (max_val stays -inf):
    a batch was observed, so qparams says NaN / inf, not "before any tensor"."""
    obs = qa.PerChannelMinMaxObserver()
    obs(torch.tensor([[math.inf] * 3, [-math.inf] * 3]))
    assert obs.has_observed
    with pytest.raises(ValueError, match="observed NaN or inf"):
        obs.qparams()


@pytest.mark.parametrize("end", ["min_val", "max_val"])
def test_a_loaded_infinite_float64_end_is_named_as_loaded_not_as_a_cast(end):
    """A float64 state (after .double()) holding inf was loaded so, not overflowed by a cast
    to float64 (float64 holds every float32 range)."""
    obs = qa.HistogramObserver().double()
    state = {"histogram": torch.ones(2048, dtype=torch.float64),
             "min_val": torch.tensor(-1.0, dtype=torch.float64),
             "max_val": torch.tensor(1.0, dtype=torch.float64), "eps": obs.eps.clone()}
    state[end] = torch.tensor(-math.inf if end == "min_val" else math.inf, dtype=torch.float64)
    obs.load_state_dict(state)
    with pytest.raises(qa.StateOverflowError, match="a loaded min_val / max_val held inf"):
        obs.calculate_qparams()


def test_the_observe_op_rebins_at_torch_aos_default_upsample_rate():
    """quantscope::ao_histogram_observe called without a rate re-bins a widening range as a
    torch.ao HistogramObserver does by default (its upsample_rate, 16)."""
    ref = tq.HistogramObserver(bins=64)
    hist, lo, hi = torch.zeros(64), torch.tensor(math.inf), torch.tensor(-math.inf)
    for x in _growing(5):
        ref(x)
        torch.ops.quantscope.ao_histogram_observe(x, hist, lo, hi)
    for got, want in ((hist, ref.histogram), (lo, ref.min_val), (hi, ref.max_val)):
        assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("dtypes", [(torch.float64, torch.float32, torch.float32),
                                    (torch.float32, torch.float32, torch.float64)],
                         ids=["float64-histogram", "float64-max"])
def test_a_state_not_all_float32_searches_as_torch_aos_loop(dtypes):
    """One buffer not float32 is enough for torch.ao's own search (its dtypes, its prices)."""
    g = torch.Generator().manual_seed(3)
    counts = torch.rand(256, generator=g) * torch.linspace(0.0, 9.0, 256).exp()
    hist, lo, hi = (t.to(d) for t, d in zip((counts, torch.tensor(-1.3), torch.tensor(2.7)),
                                            dtypes, strict=True))
    ref = tq.HistogramObserver(bins=256)
    ref.histogram, ref.min_val, ref.max_val = hist, lo, hi
    want = ref._non_linear_param_search()
    got = torch.ops.quantscope.ao_histogram_search(hist, lo, hi, 256)
    for a, b in zip(want, got, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), (a, b)


def test_the_sync_view_spec_tells_apart_what_the_ranks_must_agree_on():
    """Ranks whose observers differ in ch_axis or in their state's dtype must not sync as
    the same observer: the view's spec (what sync compares) differs."""
    def spec(obs):
        return obs._sync_view().spec

    base = spec(qa.PerChannelMinMaxObserver(ch_axis=0))
    assert spec(qa.PerChannelMinMaxObserver(ch_axis=0)) == base
    assert spec(qa.PerChannelMinMaxObserver(ch_axis=1)) != base
    assert spec(qa.PerChannelMinMaxObserver(ch_axis=0).double()) != base


def test_the_histogram_declares_that_it_drops_non_finite_values():
    """Calibration reads ``non_finite`` (``"ignore"``: the layer's importance sums read NaN /
    inf as zero too); torch.ao's histogram drops inf with a warning, it does not raise."""
    obs = qa.HistogramObserver()
    assert obs.non_finite == "ignore"
    with pytest.warns(UserWarning):
        obs(torch.tensor([1.0, math.inf, -2.0]))
    assert (float(obs.min_val), float(obs.max_val)) == (-2.0, 1.0)
