"""transformers' Conv1D (GPT-2's c_attn / c_proj / c_fc): a Linear holding ``W^T``, weight
``[in, out]``. Its weight takes a rule's layout transposed (per channel: the output features,
axis 1; groups: along the input features, axis 0), so it calibrates as the Linear holding
``W.T`` does, and the features that multiply ``x W^T`` (joint choice, imatrix, the layer
ranking) read it as that Linear."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.ao.quantization import PerChannelMinMaxObserver

import quantscope
from quantscope import QuantSpec
from quantscope.calibration import Recipe, Role, Rule, preset
from quantscope.calibration.choice.importance import InputImportance
from quantscope.calibration.choice.layer_choice import imatrix_state
from quantscope.calibration.choice.sensitivity import layer_sensitivity
from quantscope.calibration.options import Auto
from quantscope.layout import Channel, Group

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D

CANDIDATES = ("minmax", "mse", "percentile")


def _pair(nx=8, nf=6, seed=0):
    """A Conv1D model and its Linear twin (weight ``W.T``, the same bias)."""
    torch.manual_seed(seed)
    conv = nn.Sequential(Conv1D(nf, nx)).eval()
    with torch.no_grad():
        conv[0].bias.normal_()
    lin = nn.Sequential(nn.Linear(nx, nf)).eval()
    with torch.no_grad():
        lin[0].weight.copy_(conv[0].weight.T)
        lin[0].bias.copy_(conv[0].bias)
    return conv, lin


def _batches(nx=8):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(3, 5, nx, generator=g) for _ in range(2)]


def _applied(calib, model, x):
    with torch.no_grad(), calib.apply(model):
        return model(x)


def test_per_channel_weight_scales_are_the_output_features():
    """``w8a8`` per channel on a Conv1D: one scale per output feature (axis 1 of ``[in, out]``),
    bit for bit torch.ao's PerChannelMinMaxObserver(ch_axis=1) and the Linear twin's."""
    conv, lin = _pair()
    batches = _batches()
    c = quantscope.calibrate(conv, batches, preset("w8a8", targets=["Conv1D"]), progress=False)
    t = quantscope.calibrate(lin, batches, preset("w8a8"), progress=False)
    st = c.states["0"]["weight"]
    assert st.spec.layout == Channel(1)
    assert tuple(st.qparams.scale.shape) == (1, 6)
    ao = PerChannelMinMaxObserver(ch_axis=1, dtype=torch.qint8,
                                  qscheme=torch.per_channel_symmetric)
    ao(conv[0].weight.detach())
    assert torch.equal(st.qparams.scale.flatten(), ao.calculate_qparams()[0])
    assert torch.equal(st.qparams.scale.flatten(), t.states["0"]["weight"].qparams.scale.flatten())
    assert torch.equal(c.states["0"]["input"].qparams.scale, t.states["0"]["input"].qparams.scale)
    x = torch.randn(2, 4, 8)
    torch.testing.assert_close(_applied(c, conv, x), _applied(t, lin, x), rtol=0, atol=1e-6)


def test_group_weights_run_along_the_input_features(tmp_path):
    """int4 groups of 4 on a Conv1D: groups of input features (axis 0), the Linear twin's
    scales bit for bit, its applied output, through save / load."""
    conv, lin = _pair()
    rule = {"weight": Role(QuantSpec("int4", "group:4"), "memoryless_minmax")}
    c = quantscope.calibrate(conv, _batches(), Recipe(Rule(("Conv1D",), **rule)), progress=False)
    t = quantscope.calibrate(lin, _batches(), Recipe(Rule(("Linear",), **rule)), progress=False)
    st, ts = c.states["0"]["weight"], t.states["0"]["weight"]
    assert st.spec.layout == Group(4, axis=0)
    assert torch.equal(st.qparams.scale, ts.qparams.scale)  # (out, in / 4) both
    assert torch.equal(st.qparams.zero_point, ts.qparams.zero_point)
    row = next(r for r in c.report().rows if r["layer"] == "0" and r["role"] == "weight")
    assert row["units"] == 6 * 8 // 4
    x = torch.randn(2, 4, 8)
    expected = _applied(t, lin, x)
    torch.testing.assert_close(_applied(c, conv, x), expected, rtol=0, atol=1e-6)
    c.save(tmp_path / "q")
    back = quantscope.calibrate.load(tmp_path / "q")
    assert back.states["0"]["weight"].spec == st.spec
    torch.testing.assert_close(_applied(back, conv, x), expected, rtol=0, atol=1e-6)


def test_activation_width_is_checked():
    """A Conv1D has no in_features: its input width (``nx``) comes from the weight."""
    conv, _ = _pair()
    rec = Recipe(Rule(("Conv1D",), input=Role(QuantSpec("int8", "group:3"), dynamic=True)))
    with pytest.raises(ValueError, match=r"layer '0' input of width 8 cannot take"):
        quantscope.calibrate(conv, _batches(), rec, progress=False)


@pytest.mark.parametrize("layout", ["channel", "group:4"])
def test_imatrix_state_is_the_linear_twins(layout):
    """The importance-weighted search weighs a Conv1D's input features (its axis 0)."""
    conv, lin = _pair()
    spec = QuantSpec("int4", layout)
    cs = quantscope.calibrate(conv, _batches(), Recipe(Rule(("Conv1D",), weight=Role(spec))),
                              progress=False).states["0"]["weight"]
    ls = quantscope.calibrate(lin, _batches(), Recipe(Rule(("Linear",), weight=Role(spec))),
                              progress=False).states["0"]["weight"]
    imp = torch.rand(8) * torch.linspace(0.1, 5, 8)
    a = imatrix_state(conv[0].weight.detach(), imp, cs, conv1d=True)
    b = imatrix_state(lin[0].weight.detach(), imp, ls)
    assert a.qparams.scale.shape == cs.qparams.scale.shape
    assert torch.equal(a.qparams.scale.flatten(), b.qparams.scale.flatten())
    assert torch.equal(a.lo, b.lo) and torch.equal(a.hi, b.hi)


# ------------------------------------------------------------------ GPT-2
def _gpt2():
    cfg = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=100,
                                  n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    g = torch.Generator().manual_seed(2)
    return model, [torch.randint(0, 100, (2, 16), generator=g) for _ in range(3)]


def _linear_twin(model):
    """``model`` with every Conv1D replaced by the Linear holding ``W.T``."""
    twin = copy.deepcopy(model)
    for name, m in list(twin.named_modules()):
        if isinstance(m, Conv1D):
            lin = nn.Linear(m.weight.shape[0], m.weight.shape[1])
            with torch.no_grad():
                lin.weight.copy_(m.weight.T)
                lin.bias.copy_(m.bias)
            parent, _, child = name.rpartition(".")
            setattr(twin.get_submodule(parent), child, lin)
    return twin


def _conv1d_layers(model):
    return [n for n, m in model.named_modules() if isinstance(m, Conv1D)]


@pytest.mark.parametrize("metric", ["joint", "model", "output"])
def test_gpt2_auto_picks_as_the_linear_twin(metric):
    """``auto`` (per-layer joint error with its imatrix candidate; the model's output with the
    imatrix weights) on GPT-2's Conv1D layers picks what it picks for the Linear twin."""
    model, batches = _gpt2()
    twin = _linear_twin(model)
    kw = {"observer": "auto", "progress": False,
          "auto": Auto(metric=metric, candidates=CANDIDATES)}
    c = quantscope.calibrate(model, batches, preset("w8a8", targets=["Conv1D"]), **kw)
    t = quantscope.calibrate(twin, batches, preset("w8a8", ignore=["lm_head"]), **kw)
    layers = _conv1d_layers(model)
    assert sorted(c.states) == sorted(layers) and sorted(t.states) == sorted(layers)
    for layer in layers:
        for role in ("weight", "input"):
            a, b = c.states[layer][role], t.states[layer][role]
            assert a.observer == b.observer, (layer, role)
            torch.testing.assert_close(a.qparams.scale.reshape(b.qparams.scale.shape),
                                       b.qparams.scale, rtol=1e-5, atol=0)


def test_gpt2_importance_and_layer_ranking():
    """Input importance is gathered per Conv1D input feature (``nx`` of them); the layer
    ranking's output errors are the Linear twin's."""
    model, batches = _gpt2()
    twin = _linear_twin(model)
    imp = InputImportance(model, _conv1d_layers(model))
    with imp.counting(), torch.no_grad():
        for b in batches:
            model(b)
    means = imp.means()
    assert {n: v.numel() for n, v in means.items()} == {
        n: model.get_submodule(n).weight.shape[0] for n in _conv1d_layers(model)}
    rec = preset("w8a8", targets=["Conv1D"])
    c = quantscope.calibrate(model, batches, rec, progress=False)
    t = quantscope.calibrate(twin, batches, preset("w8a8"), progress=False)
    t.states = {k: v for k, v in t.states.items() if k in c.states}
    a = {(r["layer"], r["role"]): r["divergence"] for r in layer_sensitivity(model, batches, c).rows}
    b = {(r["layer"], r["role"]): r["divergence"] for r in layer_sensitivity(twin, batches, t).rows}
    assert a.keys() == b.keys()
    for k, v in a.items():
        assert v == pytest.approx(b[k], rel=1e-4), k


class _TwoReaders(nn.Module):
    """Two Conv1D of different widths reading one tensor (no runtime fuses Conv1D)."""

    def __init__(self):
        super().__init__()
        self.q, self.k = Conv1D(16, 8), Conv1D(8, 8)

    def forward(self, x):
        return self.q(x)[..., :8] + self.k(x)


def test_conv1d_is_no_fusion_group_member():
    torch.manual_seed(0)
    model = _TwoReaders().eval()
    c = quantscope.calibrate(model, _batches(), preset("fp8", targets=["Conv1D"]),
                             progress=False)
    assert not c.info.get("fusion_groups")
    assert sorted(c.states) == ["k", "q"]


def test_exports_refuse_conv1d(tmp_path):
    """compressed-tensors (vLLM) and this ONNX writer have no Conv1D form: refused by name."""
    model, batches = _gpt2()
    c = quantscope.calibrate(model, batches, preset("w8a8", targets=["Conv1D"]), progress=False)
    with pytest.raises(ValueError, match=r"layer 'transformer.h.0.attn.c_attn' module: module "
                                         r"type Conv1D"):
        quantscope.exporters.export(c, model, tmp_path / "ct")
    pytest.importorskip("onnx")
    with pytest.raises(ValueError, match=r"onnx export: layer 'transformer.h.0.attn.c_attn' is "
                                         r"a transformers Conv1D"):
        quantscope.exporters.export(c, model, tmp_path / "m.onnx", "onnx",
                                    example_inputs=(batches[0],))


def test_cli_group_size_check_reads_the_input_features():
    """The command line's indivisible-width check reads a Conv1D's input features (axis 0):
    with groups of 128 on GPT-2 (n_embd 64), c_fc ([64, 256]) is indivisible and the MLP's
    c_proj ([256, 64]) is not."""
    from quantscope.cli.recipes import _indivisible

    model, _ = _gpt2()
    rec = preset("w4a16", targets=["Conv1D"])
    kept = _indivisible(rec, model, "float").ignore
    assert sorted(kept) == sorted(n for n in _conv1d_layers(model)
                                  if model.get_submodule(n).weight.shape[0] % 128)
    assert "transformer.h.0.mlp.c_fc" in kept and "transformer.h.0.mlp.c_proj" not in kept
