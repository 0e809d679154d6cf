"""Fusion detection and the shared-input observation on odd calls: empty batches, keyword
inputs, forwards that change their input in place, members given fresh views."""

import warnings
from dataclasses import replace

import pytest
import torch
from torch import nn

from quantscope.calibration import calibrate, preset
from quantscope.calibration.structure import fusion

H = 8


def group_layers(calib):
    return [g["layers"] for g in calib.info.get("fusion_groups", [])]


def test_empty_first_batch_groups_no_unrelated_layers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))
    # every empty tensor has data pointer 0: layer 0's and layer 2's inputs looked the same
    assert fusion.find_groups(model, torch.randn(0, 6), ["0", "2"]) == []
    batches = [torch.randn(0, 6), torch.randn(3, 6)]
    calib = calibrate(model, batches, "w8a8", observer="static_minmax", progress=False)
    assert group_layers(calib) == []
    with torch.no_grad():
        h = torch.relu(model[0](batches[1]))
    st = calib.states["2"]["input"]
    assert (float(st.lo), float(st.hi)) == (float(h.min()), float(h.max()))


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (nn.Linear(H, H) for _ in range(3))

    def forward(self, x, scale=None):
        y = self.down_proj(torch.relu(self.gate_proj(x)) * self.up_proj(x))
        return y if scale is None else y * scale


class MoE(nn.Module):
    """Every expert called, with 0 rows where no token is routed to it."""

    def __init__(self, by_keyword=False):
        super().__init__()
        self.experts = nn.ModuleList(Expert() for _ in range(2))
        self.by_keyword = by_keyword

    def forward(self, x):
        route = (x[:, 0] > 0).long()
        out = torch.zeros_like(x)
        for e, ex in enumerate(self.experts):
            idx = (route == e).nonzero().flatten()
            if self.by_keyword:  # another keyword first, of another row count
                out[idx] = ex(scale=torch.ones(1, 1), x=x[idx])
            else:
                out[idx] = ex(x[idx])
        return out


def moe_batches():
    torch.manual_seed(0)
    first = torch.randn(4, H)
    first[:, 0] = -1.0  # batch 0: every token to expert 0, none to expert 1
    return [first] + [torch.randn(16, H) * 3 for _ in range(3)]


def test_expert_without_tokens_in_the_first_batch_keeps_its_own_groups():
    torch.manual_seed(0)
    model = MoE()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calib = calibrate(model, moe_batches(), "w8a8", observer="static_minmax", progress=False)
    # gate / up still read one (empty) tensor object; down_proj reads another
    assert group_layers(calib) == [[f"experts.{e}.{p}" for p in ("gate_proj", "up_proj")]
                                   for e in range(2)]


def test_expert_tokens_counted_from_the_input_keyword():
    torch.manual_seed(0)
    batches = moe_batches()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calib = calibrate(MoE(by_keyword=True), batches, "w8a8", progress=False)
    tokens = {r["expert"]: r["tokens"] for r in calib.info["experts"]}
    routed = [sum(int(((b[:, 0] > 0).long() == e).sum()) for b in batches) for e in range(2)]
    assert tokens == dict(enumerate(routed))


class MaskedLinear(nn.Linear):
    def forward(self, x, mask=None):
        return super().forward(x if mask is None else x * mask)


class KeywordBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.p, self.q = MaskedLinear(4, 4), MaskedLinear(4, 4)

    def forward(self, x, mask):
        h = self.p(mask=mask, x=x)  # the input a keyword, after another one
        return self.q(mask=mask, x=torch.relu(h) * 10)


def test_keyword_input_is_what_detection_compares():
    torch.manual_seed(0)
    model = KeywordBlock()
    batches = [(torch.randn(2, 4), torch.ones(2, 4)) for _ in range(2)]
    assert fusion.find_groups(model, batches[0], ["p", "q"]) == []  # one mask, two inputs
    calib = calibrate(model, batches, "w8a8", observer="static_minmax", progress=False)
    assert group_layers(calib) == []
    with torch.no_grad():
        xs = torch.cat([x for x, _ in batches])
        h = torch.relu(model.p(xs)) * 10
    for layer, seen in (("p", xs), ("q", h)):
        st = calib.states[layer]["input"]
        assert (float(st.lo), float(st.hi)) == pytest.approx((float(seen.min()),
                                                              float(seen.max())), rel=1e-5)


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        x.mul_(2)
        return self.a(x) + self.b(x)


def test_detection_leaves_the_first_batch_to_the_observed_pass():
    batches = [torch.full((2, 4), float(i + 1)) for i in range(3)]
    model = InPlace()
    calib = calibrate(model, batches, "w8a8", observer="static_minmax", progress=False)
    assert group_layers(calib) == [["a", "b"]]
    st = calib.states["a"]["input"]
    assert (float(st.lo), float(st.hi)) == (2.0, 6.0)  # each batch doubled once
    assert [float(b[0, 0]) for b in batches] == [2.0, 4.0, 6.0]  # as one plain pass leaves them
    assert model.calls == 4  # the detection's extra forward (docs/guide/calibrating.md)
    model = InPlace()
    calibrate(model, [torch.ones(2, 4) for _ in range(3)],
              replace(preset("w8a8"), fusion=False), progress=False)
    assert model.calls == 3  # Recipe(fusion=False): no detection forward


class ViewedAttention(nn.Module):
    def __init__(self, view):
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(4, 4), nn.Linear(4, 4)
        self.view = view

    def forward(self, x):
        if self.view:  # each member a fresh view, freed before the next member runs
            return self.q_proj(x.view(-1, 4)) + self.k_proj(x.view(-1, 4))
        return self.q_proj(x) + self.k_proj(x)


def test_shared_input_of_fresh_views_is_observed_once():
    torch.manual_seed(0)
    batches = [torch.randn(3, 4) * (i + 1) for i in range(4)]
    lo = hi = None
    for x in batches:  # the moving average, one update per batch
        if lo is None:
            lo, hi = x.min(), x.max()
        else:
            lo, hi = lo + 0.01 * (x.min() - lo), hi + 0.01 * (x.max() - hi)
    for view in (False, True):
        calib = calibrate(ViewedAttention(view), batches, "w8a8", observer="minmax",
                          progress=False)
        assert group_layers(calib) == [["q_proj", "k_proj"]]
        st = calib.states["q_proj"]["input"]
        assert torch.allclose(st.lo, lo) and torch.allclose(st.hi, hi), view


def test_a_mark_matches_only_the_same_live_data():
    x = torch.randn(3, 4)
    last = fusion.mark(x.view(-1, 4))
    assert fusion.seen(last, x.view(-1, 4))  # a fresh view of live data
    assert not fusion.seen(last, x.view(4, 3)) and not fusion.seen(last, x.clone())
    x.add_(1)  # changed in place: a new input
    assert not fusion.seen(last, x.view(-1, 4))
    last = fusion.mark(x)
    del x  # freed: its memory may hold another tensor now
    assert not fusion.seen(last, torch.randn(3, 4))
    assert fusion.mark(torch.randn(0, 4)) is None
    assert not fusion.seen(fusion.mark(torch.randn(0, 4)), torch.randn(0, 4))
