"""Pins from the s69 mutation round over SmoothQuant (``calibration/choice/smooth.py`` and
``smooth_ranges.py``): behaviour no earlier test held, each checked against its definition
(the docstrings' contracts, the module doc's formula, llm-compressor's default strength):
which pairs ``find_mappings`` refuses, the scales' float32 arithmetic whatever the inputs'
dtypes, the probe's relative tolerance and its refusals, the reasons a mapping is skipped,
``check``'s bounds, ``reapply``'s refusals, and ``channel_ranges``' clean-up."""

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_choice_pins_s63 import _MLP, _Layer, _layer_and_batches
from test_smooth_dataflow import _Norm
from torch import nn

from quantscope.calibration.choice import smooth as sm
from quantscope.calibration.choice.smooth_ranges import channel_ranges

_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


def _attention_block(widths=(8, 8, 8), norm=None):
    """``input_layernorm`` into ``self_attn``'s Linears, one per width (q, k, v)."""
    block = nn.Module()
    block.input_layernorm = norm if norm is not None else _Norm(8)
    block.self_attn = nn.Module()
    for name, width in zip(("q_proj", "k_proj", "v_proj"), widths):
        setattr(block.self_attn, name, nn.Linear(width, 8))
    return block


class _MatrixNorm(nn.Module):
    """``x @ weight``: a 2-D weight that does not scale the output channels one by one."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(n, n))

    def forward(self, x):
        return x @ self.weight


@pytest.mark.parametrize("block", [
    _attention_block(widths=(8, 6, 8)),  # k_proj of another width
    _attention_block(norm=_MatrixNorm(8)),  # not a per-channel norm
], ids=["width", "2-d weight"])
def test_a_pair_that_does_not_fit_is_not_found(block):
    """find_mappings: every balanced Linear takes the previous module's width, and the
    previous module scales its channels one by one (a norm's ``weight [C]``)."""
    assert sm.find_mappings(block) == []


def test_names_match_whole_name_parts():
    """``shared_mlp.up_proj`` ends with the characters of ``mlp.up_proj`` but is not a module
    named ``mlp``'s: MAPPINGS' suffixes are dotted names (``prefix`` a module path)."""
    model = nn.Module()
    model.shared_mlp = _MLP(8, 16)
    assert sm.find_mappings(model) == []


@pytest.mark.parametrize("ranges_dtype, weight_dtype", [
    (torch.float64, torch.float32), (torch.float32, torch.bfloat16),
    (torch.float16, torch.float16)])
def test_scales_are_the_formulas_in_float32_whatever_the_dtypes(ranges_dtype, weight_dtype):
    """``smoothing_scales``: float32, and the formula on the inputs' values (a bf16 weight's
    ``max |W| ** (1 - alpha)`` not rounded to bf16)."""
    g = torch.Generator().manual_seed(0)
    ranges = (torch.rand(16, generator=g) * 50 + 0.5).to(ranges_dtype)
    weights = [(torch.randn(n, 16, generator=g) * 3).to(weight_dtype) for n in (4, 12)]
    s = sm.smoothing_scales(ranges, weights, 0.3)
    w = 2 * torch.stack([x.double().abs().amax(0) for x in weights]).amax(0)
    want = ranges.double().pow(0.3) / w.pow(0.7)
    assert s.dtype == torch.float32
    torch.testing.assert_close(s.double(), want, rtol=1e-6, atol=0)


def test_a_bf16_module_is_smoothed_in_bf16():
    """Parameters stay bf16, divided / multiplied by the scales (the probe checks bf16 with
    its looser bf16 tolerance, on bf16 rows)."""
    model, batches = _layer_and_batches()
    model = model.to(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    info = sm.smooth(model, [x.to(torch.bfloat16) for x in batches], 0.5)
    assert info["smoothed"] == ["post_attention_layernorm", "mlp.up_proj"]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    s = info["scales"]["post_attention_layernorm"]
    torch.testing.assert_close(model.post_attention_layernorm.weight.float(),
                               before["post_attention_layernorm.weight"].float() / s,
                               rtol=1e-2, atol=0)
    torch.testing.assert_close(model.mlp.gate_proj.weight.float(),
                               before["mlp.gate_proj.weight"].float() * s, rtol=1e-2, atol=0)


def _probe(change):
    """``_probe_why`` on an attention block (outputs in the hundreds, no biases) with new
    parameters that smooth nothing (scales 1) but ``change(weight)`` every balanced one."""
    torch.manual_seed(0)
    block = _attention_block()
    new = {"input_layernorm.weight": block.input_layernorm.weight.detach().clone()}
    with torch.no_grad():
        for b in _QKV:
            lin = block.get_submodule(b)
            lin.weight.mul_(100)
            lin.bias.zero_()
            new[f"{b}.weight"] = change(lin.weight.detach().clone())
        mapping = sm.Mapping("input_layernorm", _QKV, "input_layernorm")
        return sm._probe_why(dict(block.named_modules()), mapping, new)


def _nan_at_0(w):
    w[0, 0] = float("nan")
    return w


@pytest.mark.parametrize("change, rejected", [
    (lambda w: w * (1 + 2e-4), False),  # float rounding: relative, however large the outputs
    (lambda w: w * (1 + 5e-3), True),  # a change of 0.5 %: over float32's 1e-3
    (_nan_at_0, True),  # not finite
], ids=["2e-4", "5e-3", "nan"])
def test_the_probe_tolerates_float32_rounding_relative_to_the_outputs(change, rejected):
    got = _probe(change)
    assert got == ("the probe's outputs changed with the new parameters" if rejected else None)


class _BatchedMLP(_MLP):
    """A gated MLP written for ``[batch, seq, hidden]`` only: 2-D rows raise ValueError."""

    def forward(self, x):
        _, _, _ = x.shape
        return super().forward(x)


def test_a_probe_that_raises_value_error_is_named_not_raised():
    torch.manual_seed(0)
    model = _Layer()
    model.mlp = _BatchedMLP(8, 16)
    info = sm.smooth(model, [torch.randn(2, 3, 8) * 4], 0.5)
    assert info["smoothed"] == ["post_attention_layernorm"]
    assert info["why"]["mlp.up_proj"].startswith(
        "the probe could not run mlp on one [8, 8] tensor (ValueError: ")


class _TwoLayers(nn.Module):
    """Two attention blocks; ``l1.extra`` reads ``l0``'s norm output, after ``l1``'s norm ran."""

    def __init__(self):
        super().__init__()
        self.l0, self.l1 = _attention_block(), _attention_block()
        self.l1.extra = nn.Linear(8, 8)

    @staticmethod
    def _attend(block, h):
        a = block.self_attn
        return a.q_proj(h) + a.k_proj(h) + a.v_proj(h)

    def forward(self, x):
        h0 = self.l0.input_layernorm(x)
        y = self._attend(self.l1, self.l1.input_layernorm(self._attend(self.l0, h0)))
        return y + self.l1.extra(h0)


def test_a_read_of_an_earlier_layers_output_is_seen():
    """The data flow follows a norm's output by identity past its own layer: a Linear of the
    next layer reading it is another reader, and the norm is left alone."""
    torch.manual_seed(0)
    model = _TwoLayers()
    x = torch.randn(4, 8) * 5
    with torch.no_grad():
        ref = model(x)
        info = sm.smooth(model, [x], 0.5)
        torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)
    assert info["smoothed"] == ["l1.input_layernorm"]
    assert info["why"]["l0.input_layernorm"].startswith("its output also feeds l1.extra")


def test_a_range_that_saw_inf_is_skipped_for_that_reason():
    """smooth's doc: skipped when it saw NaN *or inf* (an infinite range, not NaN)."""
    model, batches = _layer_and_batches()
    batches[0][1, 2] = float("inf")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    info = sm.smooth(model, batches, 0.5)
    assert info["smoothed"] == []
    assert info["why"]["post_attention_layernorm"] == "saw NaN or inf"
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("alpha", [0, 1, 0.0, 1.0, np.float32(0.25), np.int64(1)])
def test_check_takes_both_ends_and_gives_a_python_float(alpha):
    got = sm.check(alpha)
    assert type(got) is float and got == float(alpha)


def test_smooths_default_alpha_is_llm_compressors_half():
    """``SmoothQuantModifier``'s ``smoothing_strength`` defaults to 0.5, as does smooth's."""
    model, batches = _layer_and_batches()
    ref, _ = _layer_and_batches()
    info = sm.smooth(model, batches)
    assert info["alpha"] == 0.5
    want = sm.smooth(ref, batches, 0.5)["scales"]
    assert all(torch.equal(info["scales"][k], want[k]) for k in want)


def test_a_model_with_no_pair_warns_once():
    """Said once, as having no pair (not also as having seen no batch)."""
    model = nn.Sequential(nn.Linear(4, 4))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        info = sm.smooth(model, [torch.randn(2, 4)], 0.5)
    assert [str(w.message)[:40] for w in seen] == ["smooth: the model has no pair SmoothQuan"]
    assert info["smoothed"] == info["skipped"] == []


def test_reapply_refuses_a_scale_for_a_module_the_model_lacks():
    model, _ = _layer_and_batches()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calib = SimpleNamespace(smoothing={"mlp.up_proj": torch.ones(16), "mlp.nope": torch.ones(8)})
    with pytest.raises(ValueError, match=r"^smooth: the calibration smoothed 'mlp\.nope', "
                                         r"which this model does not have as a smoothable"):
        sm.reapply(model, calib)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_an_empty_batch_is_no_run():
    """A batch of 0 rows gives no range (the mapping never ran), not ``-inf``."""
    model, _ = _layer_and_batches()
    assert channel_ranges(model, [torch.zeros(0, 8)], sm.find_mappings(model)) == {}


def test_a_failed_forward_leaves_no_hook_on_the_model():
    model, _ = _layer_and_batches()
    with pytest.raises(RuntimeError):
        channel_ranges(model, [torch.randn(2, 5)], sm.find_mappings(model), flow={})
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
