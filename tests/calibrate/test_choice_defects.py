"""auto's per-layer choices, importance and the layer ranking on fused groups, NVFP4 weights
and Embeddings."""

from __future__ import annotations

import pytest
import torch
from tiny_models import SharedInput
from torch import nn

from quantscope import calibrate, presets
from quantscope.calibration.choice.importance import InputImportance, imatrix_config
from quantscope.calibration.choice.layer_choice import JOINT_ROWS, imatrix_state
from quantscope.calibration.choice.sensitivity import layer_sensitivity
from quantscope.calibration.options import Auto
from quantscope.calibration.recipe import Recipe, Role, Rule
from quantscope.calibration.results.apply import qdq_tensor
from quantscope.calibration.results.result import Calibration, RoleState
from quantscope.estimators.weighted import imatrix_range
from quantscope.qdq import fake_quantize
from quantscope.qparams import qparams_from_range

CANDIDATES = ("minmax", "mse", "percentile")



def _fused(seed):
    torch.manual_seed(seed)
    model = SharedInput(16, 8).eval()
    with torch.no_grad():
        model.k.weight.mul_(torch.rand(16) * 6)  # k weighs the channels q ignores
    g = torch.Generator().manual_seed(seed)
    batches = [torch.randn(16, 16, generator=g) * torch.linspace(0.2, 3, 16) for _ in range(3)]
    batches[1][2, 3] = 25.0  # an outlier: clipping it pays for one member, not the other
    return model, batches


@pytest.mark.parametrize("metric", ["joint", "fisher"])
def test_layer_metrics_give_a_fused_group_one_input(metric):
    # probing: under "joint" / "fisher" each member kept its own input pick although the
    # runtime's fused layer runs one static input scale (fusion_groups said 'shared')
    model, batches = _fused(20)  # a seed where the members alone pick different inputs
    loss = (lambda out, batch: out.square().sum()) if metric == "fisher" else None
    c = calibrate(model, batches, "w8a8", observer="auto", progress=False,
                  auto=Auto(metric=metric, candidates=CANDIDATES, loss=loss))
    assert c.info["fusion_groups"][0]["layers"] == ["q", "k"]
    assert c.info["fusion_groups"][0]["input"] == "shared"
    q, k = c.states["q"]["input"], c.states["k"]["input"]
    assert q.observer == k.observer
    assert torch.equal(q.qparams.scale, k.qparams.scale)
    rows = {r["layer"]: r["observer"] for r in c.stats if r["role"] == "input"}
    assert rows == {"q": q.observer, "k": q.observer}
    if metric == "fisher":
        return
    # the one input: the candidate with the least output error summed over the members,
    # each under its own chosen weight (every row of x: fewer than JOINT_ROWS)
    x = torch.cat(batches)
    assert x.shape[0] <= JOINT_ROWS
    total = {}
    for n in CANDIDATES:
        xs = calibrate(model, batches, "w8a8", observer=n, progress=False).states["q"]["input"]
        xq = qdq_tensor(x, xs).float()
        total[xs.observer] = sum(
            float((x @ w.T - xq @ qdq_tensor(w, c.states[m]["weight"]).float().T)
                  .double().square().sum())
            for m, w in (("q", model.q.weight.detach()), ("k", model.k.weight.detach())))
    assert q.observer == min(total, key=total.get)


def _nvfp4_weight():
    torch.manual_seed(0)
    w = torch.randn(8, 64)
    w[0, 5] = 20.0  # the tensor's absmax, in a channel that barely matters
    imp = torch.rand(64) + 0.5
    imp[5] = 0.0
    return w, imp


def test_imatrix_state_nvfp4_runs_the_global_scale_its_search_priced():
    # probing: the state's qparams took the global scale of the chosen (shrunk) ranges,
    # one the search never priced: its weighted error exceeded the search's own
    spec = presets.NVFP4
    w, imp = _nvfp4_weight()
    units = spec.layout.to_units(w)
    lo0, hi0 = units.min(1, keepdim=True).values, units.max(1, keepdim=True).values
    minmax = qparams_from_range(lo0, hi0, spec).reshape(spec.layout.qparam_shape(w.shape))
    base = RoleState(spec, "memoryless_minmax", "memoryless_minmax", False, (), minmax)
    st = imatrix_state(w, imp, base)
    # NVFP4's global scale: 448 * 6 / the tensor's amax (the min-max range's)
    assert float(st.qparams.global_scale) == pytest.approx(448 * 6 / float(w.abs().max()))

    def werr(qp):
        return float(((fake_quantize(w, qp, spec) - w).double() ** 2 * imp.double()).sum())

    lo, hi = imatrix_range(w, imp, spec)
    priced = qparams_from_range(lo, hi, spec, global_amax=w.abs().max()).reshape(
        spec.layout.qparam_shape(w.shape))
    assert werr(st.qparams) == pytest.approx(werr(priced), rel=1e-9)
    assert werr(st.qparams) <= werr(minmax)


class _Emb(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(50, 16), nn.Linear(16, 8)

    def forward(self, ids):
        return self.fc(self.emb(ids))


def _emb_recipe():
    return Recipe((Rule(("Embedding",), weight=Role(presets.INT8_PER_CHANNEL)),
                   Rule(("Linear",), weight=Role(presets.INT8_PER_CHANNEL),
                        input=Role(presets.INT8_PER_TENSOR))))


def test_layer_sensitivity_ranks_an_embedding_by_its_lookup():
    # probing: the Embedding's weight was ranked as a Linear's (ids.float() @ W^T), and a
    # sequence length other than the embedding dim raised a shape error
    torch.manual_seed(0)
    model = _Emb().eval()
    c = calibrate(model, [torch.randint(0, 50, (2, 16)) for _ in range(2)], _emb_recipe(),
                  progress=False)
    batches = [torch.randint(0, 50, (2, 12)) for _ in range(2)]  # 12 != embedding dim 16
    s = layer_sensitivity(model, batches, c)
    got = {(r["layer"], r["role"]): r["divergence"] for r in s.rows}
    assert set(got) == {("emb", "weight"), ("fc", "weight"), ("fc", "input")}
    w = model.emb.weight.detach()
    wq = qdq_tensor(w, c.states["emb"]["weight"]).float()
    num = sum(float((wq[b] - w[b]).double().square().sum()) for b in batches)
    den = sum(float(w[b].double().square().sum()) for b in batches)
    assert got[("emb", "weight")] == pytest.approx(num / den, rel=1e-6)


def test_input_importance_skips_an_embedding():
    # probing: the Embedding's token ids were taken as its input (importance = mean ids^2)
    # and imatrix_config ran an imatrix search on its weight with them
    torch.manual_seed(0)
    model = _Emb().eval()
    imp = InputImportance(model, ["emb", "fc"])
    seen = []
    hook = model.fc.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach()))
    with imp.counting():
        model(torch.randint(0, 50, (2, 16)))  # sequence length == embedding dim
    hook.remove()
    means = imp.means()
    assert sorted(means) == ["fc"]
    x = seen[0].reshape(-1, 16)
    assert torch.allclose(means["fc"], x.square().mean(0), rtol=1e-5)
    base = calibrate(model, [torch.randint(0, 50, (2, 16))], _emb_recipe(), progress=False)
    assert isinstance(base, Calibration)
    new = imatrix_config(model, base, means)
    assert new.states["emb"]["weight"] is base.states["emb"]["weight"]
    assert new.states["fc"]["weight"].observer == "imatrix"
