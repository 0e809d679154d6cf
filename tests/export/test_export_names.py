"""The exported config selects, under compressed-tensors' own matching (vLLM's rules), exactly
the layers quantscope quantized (found by probing: a Linear subclass beside a plain Linear left
in float, and a layer named like a regex, made it select others)."""

import json
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")

import quantscope
from quantscope.calibration import Calibration, Recipe, Role, Rule, calibrate

torch.set_num_threads(1)


def _selected(model, folder) -> dict[str, list[str]]:
    """``{module: [config groups]}`` as compressed-tensors reads the folder's config."""
    from compressed_tensors.utils.match import match_named_modules

    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    out: dict[str, list[str]] = {}
    for group, scheme in qc["config_groups"].items():
        for name, _ in match_named_modules(model, scheme["targets"], qc.get("ignore", [])):
            out.setdefault(name, []).append(group)
    return out


def test_a_float_linear_beside_linear_subclasses_is_listed_as_ignored(tmp_path):
    """Falcon's layers are FalconLinear (an nn.Linear subclass), its lm_head a plain Linear:
    compressed-tensors listed only float layers of a quantized layer's exact class, so the
    ignored lm_head loaded as quantized with uninitialised scales."""
    torch.manual_seed(0)
    cfg = transformers.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    vocab_size=100, new_decoder_architecture=False)
    model = transformers.FalconForCausalLM(cfg).eval()
    batches = [torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(i))
               for i in range(2)]
    cal = calibrate(model, batches, quantscope.calibrate.preset("w8a8", ignore=["lm_head"]),
                    progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantscope.export(cal, model, tmp_path / "ct")
    assert set(_selected(model, tmp_path / "ct")) == set(cal.states)
    assert set(Calibration.from_compressed_tensors(tmp_path / "ct").states) == set(cal.states)


class _Config(transformers.PretrainedConfig):
    model_type = "quantscope-names-test"


class _Model(transformers.PreTrainedModel):
    config_class = _Config

    def __init__(self, config):
        super().__init__(config)
        self.body = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
        self.add_module("re:b", nn.Linear(32, 32))  # names compressed-tensors reads otherwise:
        self.add_module("Embedding", nn.Linear(32, 32))  # a regex, a class name

    def forward(self, x):
        return self.get_submodule("Embedding")(self.get_submodule("re:b")(self.body(x)))


def test_layer_names_read_as_patterns_are_written_as_exact_regexes(tmp_path):
    torch.manual_seed(0)
    model = _Model(_Config()).eval()
    w8 = Role(quantscope.presets.INT8_PER_CHANNEL, "memoryless_minmax")
    w4 = Role(quantscope.QuantSpec("int4", quantscope.Group(16)), "memoryless_minmax")
    # two schemes: config groups by exact layer names
    recipe = Recipe((Rule(("body.0",), weight=w4), Rule(("Linear",), weight=w8)))
    cal = calibrate(model, [torch.randn(3, 32) for _ in range(2)], recipe, progress=False)
    quantscope.export(cal, model, tmp_path / "ct")
    selected = _selected(model, tmp_path / "ct")
    assert selected.keys() == cal.states.keys()
    assert all(len(groups) == 1 for groups in selected.values())
    assert selected["body.0"] != selected["re:b"] == selected["Embedding"] == selected["body.1"]


def test_a_layer_saved_under_two_names_is_refused_and_ignoring_it_reads_back(tmp_path):
    """PhiMoE's router (an nn.Linear subclass, so the Linear presets take it): transformers
    saves ``router.weight`` as ``gate.weight`` but leaves the scales compressed-tensors adds
    under ``router``; the folder did not read back (found by probing)."""
    from quantscope.calibration.recipe import preset

    torch.manual_seed(0)
    cfg = transformers.PhimoeConfig(vocab_size=100, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=1, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=64,
                                    num_local_experts=4, num_experts_per_tok=2)
    model = transformers.PhimoeForCausalLM(cfg).eval()
    batches = [torch.randint(2, 100, (2, 12), generator=torch.Generator().manual_seed(i))
               for i in range(2)]
    cal = calibrate(model, batches, "w8a8", progress=False)
    with pytest.raises(ValueError, match=r"layer 'model\.layers\.0\.mlp\.router': transformers "
                                         r"saves it under two names .*block_sparse_moe\.gate"):
        quantscope.export(cal, model, tmp_path / "a")
    assert not (tmp_path / "a").exists()
    cal = calibrate(model, batches, preset("w8a8", ignore=["lm_head", "re:.*router"]),
                    progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantscope.export(cal, model, tmp_path / "b")
    assert set(Calibration.from_compressed_tensors(tmp_path / "b").states) == set(cal.states)
