"""Weights that are not a dense float tensor of their own, as users bring them: each is
quantized as the plain weight would be, or refused naming the layer, and never left in
float or fake-quantized twice without a word.

* sparse weights: refused by calibrate (they failed inside torch, naming nothing); a sparse
  input to an observer too (torchao-quantized weights: test_placement.py).
* a weight computed at each forward (pruning, a parametrization): refused by the export as by
  apply (the export failed in its deepcopy or in compressed-tensors).
* an expanded weight (its elements share memory): refused by apply (torch's write error).
* distinct Parameters over one memory (``load_state_dict(..., assign=True)`` of an applied
  model's weights; two layers given one tensor): one weight, QDQ'd once, held once (apply
  accepted the second model and saved its fake-quantized values as float; two layers with
  different qparams compounded both QDQs); calibrate refuses roles giving it two states.
* Parameters over overlapping slices of one tensor: refused by apply (the shared values were
  QDQ'd twice); slices that only interleave (a split of columns) quantize as copies would."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import prune

import quantscope
from quantscope.calibration import Recipe, Role, Rule
from quantscope.observers.runtime import qdq_tensor

BATCHES = [torch.randn(4, 128)]


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128)).eval()


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sparse_weights_and_inputs_are_refused():
    model = _mlp()
    model[0].weight = nn.Parameter(model[0].weight.detach().to_sparse_csr())
    with pytest.raises(ValueError, match=r"'0\.weight' is a tensor of type Parameter "
                                         r"\(torch\.sparse_csr\)"):
        quantscope.calibrate(model, BATCHES, "w8a8", progress=False)
    obs = quantscope.get_observer("memoryless_minmax", quantscope.QuantSpec("int8", "channel"))
    with pytest.raises(TypeError, match=r"expected a dense tensor, got torch\.sparse_coo; "
                                        r"pass x\.to_dense\(\)"):
        obs(torch.eye(4).to_sparse())


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=50)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_export_refuses_a_computed_weight_before_writing(tmp_path):
    model = _tiny_llama()
    calibration = quantscope.calibrate(model, [torch.randint(0, 50, (1, 6))], "w8a8",
                                       progress=False)
    prune.l1_unstructured(model.model.layers[0].mlp.down_proj, "weight", amount=0.5)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"export compressed-tensors: model\.layers\.0\.mlp\."
                                         r"down_proj\.weight \(Linear\) is computed at each "
                                         r"forward"):
        quantscope.export(calibration, model, out)
    assert not out.exists()


def test_apply_refuses_an_expanded_weight():
    model = _mlp()
    model[0].weight = nn.Parameter(torch.randn(1, 128).expand(128, 128))
    calibration = quantscope.calibrate(model, BATCHES, "w8a8", progress=False)
    before = _state(model)
    with pytest.raises(ValueError, match=r"apply: 0\.weight has elements sharing memory "
                                         r"\(an expanded tensor, stride \(0, 1\)\)"):
        calibration.apply(model)
    assert _same(before, _state(model))


def test_a_model_over_an_applied_models_memory_is_refused():
    a = _mlp()
    float_a = _state(a)
    calibration = quantscope.calibrate(a, BATCHES, "w8a8", progress=False)
    handle = calibration.apply(a)
    b = _mlp(seed=1)
    b.load_state_dict(a.state_dict(), assign=True)  # other Parameters, a's memory
    assert b[0].weight is not a[0].weight
    with pytest.raises(ValueError, match=r"already fake-quantized by another apply\(\)"):
        calibration.apply(b)
    with pytest.raises(ValueError, match=r"calibrate: the model has quantscope QDQ applied"):
        quantscope.calibrate(b, BATCHES, "w8a8", progress=False)
    handle.remove()
    assert _same(float_a, _state(a))  # before: b's "float" copy was a's QDQ values


def test_two_layers_over_one_memory_are_one_weight():
    model = _mlp()
    model[2].weight = nn.Parameter(model[0].weight.detach())  # another Parameter, one memory
    float_w = model[0].weight.detach().clone()
    mixed = Recipe((Rule(("0",), weight=Role(quantscope.QuantSpec("int8", "channel"),
                                              "memoryless_minmax")),
                    Rule(("2",), weight=Role(quantscope.QuantSpec("fp8_e4m3", "channel"),
                                             "memoryless_minmax"))))
    # calibrate refuses them before the pass (it gave what apply refuses); apply still
    # refuses such states, made on the model untied
    with pytest.raises(ValueError, match=r"calibrate: recipe 'custom': 0\.weight and 2\.weight "
                                         r"are one weight .* their weight roles differ"):
        quantscope.calibrate(model, BATCHES, mixed, progress=False)
    untied = copy.deepcopy(model)  # the same weights, each its own memory
    untied[2].weight = nn.Parameter(untied[0].weight.detach().clone())
    calibration = quantscope.calibrate(untied, BATCHES, mixed, progress=False)
    with pytest.raises(ValueError, match=r"apply: 0\.weight and 2\.weight are one weight "
                                         r"\(a tied Parameter, or one memory\)"):
        calibration.apply(model)
    assert torch.equal(model[0].weight, float_w)
    same = quantscope.calibrate(model, BATCHES, "w8a8", progress=False)
    with same.apply(model):  # alike qparams: QDQ'd once, not twice
        want = qdq_tensor(float_w, same.states["0"]["weight"])
        assert torch.equal(model[0].weight, want) and torch.equal(model[2].weight, want)
    assert torch.equal(model[0].weight, float_w)
    handle = same.apply(model)
    model.to(torch.float64)  # each Parameter gets memory of its own: both are restored
    handle.remove()
    assert torch.equal(model[0].weight, float_w.double())
    assert torch.equal(model[2].weight, float_w.double())


def _sliced(base, first, second):
    model = _mlp()
    model[0].weight, model[2].weight = nn.Parameter(base[:, first]), nn.Parameter(base[:, second])
    return model


def test_overlapping_slices_of_one_tensor_are_refused():
    base = torch.randn(128, 192)
    model = _sliced(base, slice(0, 128), slice(64, 192))  # 64 columns in both
    calibration = quantscope.calibrate(model, BATCHES, "w8a8", progress=False)
    before = base.clone()
    with pytest.raises(ValueError, match=r"apply: 0\.weight and 2\.weight share some of their "
                                         r"values .*\.clone\(\)"):
        calibration.apply(model)
    assert torch.equal(base, before) and not model[0]._forward_pre_hooks


def test_interleaved_slices_of_one_tensor_quantize_as_their_copies():
    base = torch.randn(128, 256)
    model = _sliced(base, slice(0, 256, 2), slice(1, 256, 2))  # even / odd columns
    copies = _mlp()
    copies[0].weight = nn.Parameter(base[:, 0::2].clone())
    copies[2].weight = nn.Parameter(base[:, 1::2].clone())
    calibration = quantscope.calibrate(model, BATCHES, "w8a8", progress=False)
    with calibration.apply(model), calibration.apply(copies):
        assert torch.equal(model[0].weight, copies[0].weight)
        assert torch.equal(model[2].weight, copies[2].weight)
    assert torch.equal(model[0].weight, base[:, 0::2])
