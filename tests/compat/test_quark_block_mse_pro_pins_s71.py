"""compat.quark's block observers (quark_block.py) and Quark's histogram-Pro wrapper
(quark_pro.py) where the s71 mutation round found behaviour no test pinned: a static MX
amax merging a batch of another shape row by row in Quark's order (and left as it was when
that batch is refused), and the Pro's ``-inf`` dropped as torch.ao drops it (tokens counted
once). Expected values come from Quark 0.13's observer code (quoted in the docstrings) and
compat.quark's docstrings; nothing imports Quark."""

from __future__ import annotations

import pytest
import torch
from test_quark_pins_s65 import _mx

from quantscope.compat import quark


def _quark_rows_amax(x: torch.Tensor, axis: int, size: int = 32) -> torch.Tensor:
    """Quark's block amax: the axis swapped with the last dim, rows of blocks of ``size``."""
    t = x.transpose(axis, -1)
    return t.reshape(-1, t.shape[-1] // size, size).abs().amax(-1)


def _batches() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 6, generator=g), torch.randn(64, 2, 3, generator=g) / 8


def test_static_mx_merges_a_batch_of_another_shape_in_quarks_row_order():
    """Quark's static amax is ``torch.max(amax, batch's)`` of ``(rows, blocks)`` tensors, each
    the batch with its axis swapped to the last dim: (64, 6) and (64, 2, 3) on axis 0 both
    give (6, 2), merged position by position in that order (other native units)."""
    a, b = _batches()
    obs = _mx(is_dynamic=False, ch_axis=0)
    obs(a)
    obs(b)
    want = torch.maximum(_quark_rows_amax(a, 0), _quark_rows_amax(b, 0))
    assert obs.amax.shape == (6, 2)
    assert torch.equal(obs.amax, want)


def test_static_mx_keeps_its_amax_when_a_batch_of_another_shape_is_refused():
    """A refused batch leaves the state as it was, as Quark's (its ``torch.max`` never ran)."""
    a, b = _batches()
    obs = _mx(is_dynamic=False, ch_axis=0)
    obs(a)
    with pytest.raises(NotImplementedError, match="fails on torch.bool input"):
        obs(b.bool())
    assert torch.equal(obs.amax, _quark_rows_amax(a, 0))


def _pro(**kw) -> quark.PerTensorHistogramObserverPro:
    return quark.PerTensorHistogramObserverPro({"dtype": "int8", "symmetric": True}, **kw)


def test_pro_drops_minus_inf_as_torch_ao():
    """torch.ao's ``HistogramObserver`` drops ``-inf`` (warning "torch.inf detected") and bins
    the rest: the qparams are those of the batch without it, the tokens the batch's rows."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    with_inf, finite = _pro(), _pro()
    y = x.clone()
    y[1, 2] = -float("inf")
    with pytest.warns(UserWarning, match="inf detected"):
        with_inf(y)
    finite(torch.cat([x.flatten()[:10], x.flatten()[11:]]))
    for got, want in zip(with_inf.calculate_qparams(), finite.calculate_qparams(), strict=True):
        assert torch.equal(got, want)
    assert int(with_inf.observed_tokens) == 4
