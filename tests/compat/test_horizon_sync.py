"""compat.horizon's ``is_sync_quantize`` on 2 gloo ranks against Horizon observer_v2's rule,
written out here: ``forward`` is local (each rank's own EMA of its own ends), and
``calculate_qparams`` all-reduces those averaged ends in place (min: MIN, max: MAX) before the
symmetric scale, so later batches average into the merged ends. A rank with no ends yet
returns the default scale 1.0 (KL before its first ``update_interval``) without syncing.

The ranks' data lean to opposite sides, swapping every batch, so the EMA of each rank's ends
then MIN / MAX differs from an EMA of the ranks' MIN / MAX (the per-step sync this replaced).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from ports import rank_results, spawn_ranks
from test_horizon_exact import kl_observer_amax, mse_ends, percentile_ends

from quantscope.compat import horizon as hz

# the tests of the spawned ranks are extended (they spawn their own process group)
pytestmark = pytest.mark.dist

TIMEOUT = 30  # seconds a collective waits for a peer
W, C = 2, 0.3
MIX_PS = (99.9, 99.95, 99.99, 99.993, 99.995, 99.997, 99.999, 99.9995, 99.9999)


def data(step, rank):
    """Rank 0 leans negative on even steps, rank 1 on odd ones (and the reverse)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(64, 96, generator=g) * (0.5 + 0.3 * step)
    return x + (3.0 if (step + rank) % 2 else -3.0) * (1 + 0.5 * step)


def kl_data(step, rank):
    """Intervals of two batches whose first holds the range (Horizon's interval histogram is
    then that of the two batches concatenated)."""
    x = data(step - step % 2, rank)
    return x if step % 2 == 0 else x.flip(0) * 0.6


def mix_data(step, rank):
    """Ramps whose wider one swaps ranks every batch; on them the histogram's error ranks
    Mix's percentile candidates as Horizon's exact L2 error does (a known difference)."""
    x = torch.linspace(-1.0, 10.0, 1001) if rank == 0 else torch.linspace(-0.5, 4.0, 1001)
    return x * (1 + 0.3 * step) * (3.0 if (step + rank) % 2 else 1.0)


def minmax_ends(x):
    return x.amin(), x.amax()


def per_channel_ends(x):  # ch_axis 1
    return x.amin(0), x.amax(0)


def kl_ends(x):
    a = kl_observer_amax(x)
    return -a, a


def mix_ends(x):
    """get_min_max_of_percentile_observer, then the least L2 error (Horizon's MixObserver)."""
    cands = [percentile_ends(x, p) for p in MIX_PS]
    err = [torch.linalg.norm(x - torch.round(x / s).clamp(-128, 127) * s)
           for s in (torch.max(-lo, hi) / 127.5 for lo, hi in cands)]
    return cands[int(np.argmin(err))]


# name: (make, ends of one interval's batches, batches, update_interval, reads after batch)
CASES = {
    "minmax_end": (lambda: hz.MinMaxObserver(averaging_constant=C, is_sync_quantize=True),
                   minmax_ends, data, 1, (3,)),
    "minmax_each": (lambda: hz.MinMaxObserver(averaging_constant=C, is_sync_quantize=True),
                    minmax_ends, data, 1, (0, 1, 2, 3)),
    "per_channel": (lambda: hz.MovingAveragePerChannelMinMaxObserver(
        averaging_constant=C, ch_axis=1, is_sync_quantize=True), per_channel_ends, data, 1,
        (1, 3)),
    "percentile": (lambda: hz.PercentileObserver(averaging_constant=C, is_sync_quantize=True),
                   percentile_ends, data, 1, (1, 3)),
    "mse": (lambda: hz.MSEObserver(averaging_constant=C, is_sync_quantize=True),
            mse_ends, data, 1, (3,)),
    "kl": (lambda: hz.KLObserver(averaging_constant=C, update_interval=2,
                                 is_sync_quantize=True), kl_ends, kl_data, 2, (0, 1, 2, 3)),
    "mix": (lambda: hz.MixObserver(averaging_constant=C, is_sync_quantize=True),
            mix_ends, mix_data, 1, (0, 1, 2, 3)),
}
STEPS = 4


def horizon_scales(ends_of, batches, interval, reads):
    """Horizon's rule on W ranks: every ``interval`` batches each rank averages in the ends of
    its own batches of the interval (the first initialises); at a read every rank's ends
    become the ranks' MIN / MAX and the scale is computed from them (1.0 before any ends)."""
    state = [None] * W
    out = []
    for s in range(STEPS):
        if (s + 1) % interval == 0:
            for r in range(W):
                lo, hi = (torch.as_tensor(e, dtype=torch.float64) for e in ends_of(
                    torch.cat([batches(k, r) for k in range(s + 1 - interval, s + 1)])))
                if state[r] is not None:
                    lo, hi = state[r][0] + C * (lo - state[r][0]), state[r][1] + C * (hi -
                                                                                    state[r][1])
                state[r] = (lo, hi)
        if s in reads:
            if state[0] is None:
                out.append(torch.ones(1, dtype=torch.float64))
                continue
            lo = torch.stack([st[0] for st in state]).amin(0)
            hi = torch.stack([st[1] for st in state]).amax(0)
            state = [(lo, hi)] * W
            out.append(torch.maximum(-lo, hi).reshape(-1) / 127.5)
    return out


def _scenarios(r, out):
    for name, (make, _, batches, _, reads) in CASES.items():
        o, got = make(), []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for s in range(STEPS):
                o(batches(s, r))
                if s in reads:
                    got.append(o.calculate_qparams())
        out[name] = got
        out[name + "/warned"] = sum("default scale" in str(w.message) for w in caught)


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_scenarios, W, TIMEOUT)


@pytest.mark.extended
@pytest.mark.parametrize("name", list(CASES))
def test_sync_is_the_min_max_of_each_ranks_averaged_ends_at_read(ranks, name):
    _, ends_of, batches, interval, reads = CASES[name]
    want = horizon_scales(ends_of, batches, interval, reads)
    for r, got in enumerate(rank_results(ranks, name)):
        assert len(got) == len(want)
        for k, ((scale, zp), w) in enumerate(zip(got, want)):
            torch.testing.assert_close(scale.double(), w, rtol=1e-5, atol=0,
                                       msg=f"rank {r}, read {k} of {name}")
            assert zp.dtype == torch.int64 and not zp.any() and zp.shape == scale.shape


def test_the_rule_tells_the_per_rank_average_from_an_average_of_the_merged_ends():
    """The data make the order matter: syncing every batch before the EMA gives another scale."""
    _, ends_of, batches, _, _ = CASES["minmax_end"]
    merged = []
    for s in range(STEPS):
        e = [ends_of(batches(s, r)) for r in range(W)]
        merged.append((min(float(a) for a, _ in e), max(float(b) for _, b in e)))
    lo, hi = merged[0]
    for a, b in merged[1:]:
        lo, hi = lo + C * (a - lo), hi + C * (b - hi)
    want = float(horizon_scales(ends_of, batches, 1, (3,))[0])
    assert abs(max(-lo, hi) / 127.5 - want) > 1e-3 * want


@pytest.mark.extended
def test_kl_before_its_first_interval_returns_the_default_with_a_warning(ranks):
    # read 0 of "kl" came before any interval finished: no ends on any rank, no all-reduce
    for got, warned in zip(rank_results(ranks, "kl"), rank_results(ranks, "kl/warned")):
        assert torch.equal(got[0][0], torch.ones(1)) and warned == 1


def test_a_read_without_ends_warns_in_one_process():
    o = hz.KLObserver(update_interval=2, is_sync_quantize=True)
    o(data(0, 0))
    with pytest.warns(UserWarning, match="default scale"):
        scale, zp = o.calculate_qparams()
    assert torch.equal(scale, torch.ones(1)) and torch.equal(zp, torch.zeros(1, dtype=torch.int64))
    o(data(1, 0))  # the read left the interval open: it closes on its second batch
    assert int(o.pending) == 0 and o.ema_lo.numel() == 1
