"""Reading back attention quantization quantscope does not run (probe s55).

compressed-tensors writes ``q_scale`` beside ``k_scale`` / ``v_scale`` on an attention module a
config group targets (``initialize_attn_qparams``), and vLLM's attention reads ``q_scale`` and
``prob_scale`` (its fp8 attention quantizes the query and the softmax output with them).
quantscope's KV cache quantizes keys and values only: the reader dropped both tensors without
a word, where docs/guide/deploy.md promises "refused, never dropped"."""

import re

import pytest
import torch

from quantscope.calibration import Calibration, calibrate, preset

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from ct_folders import edited
from safetensors.torch import load_file
from tiny_models import llama

torch.set_num_threads(1)

ATTN = "model.layers.{}.self_attn"


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A tiny Llama's fp8 export with a KV cache, and one without."""
    model, batches = llama()
    root = tmp_path_factory.mktemp("ct")
    out = {}
    for name, kv in (("kv", "fp8"), ("plain", None)):
        recipe = preset("fp8", ignore=["lm_head"], kv_cache=kv)
        calibrate(model, batches, recipe, progress=False).export(model, root / name)
        out[name] = root / name
    return out


def _add(leaf):
    def edit(t):
        for i in range(2):
            t[f"{ATTN.format(i)}.{leaf}"] = torch.tensor([0.5])
    return edit


@pytest.mark.parametrize("leaf", ["q_scale", "prob_scale"])
@pytest.mark.parametrize("kind", ["kv", "plain"])
def test_an_attention_query_or_probability_scale_is_refused_not_dropped(exports, tmp_path,
                                                                         leaf, kind):
    folder = edited(exports[kind], tmp_path / "e", _add(leaf))
    with pytest.raises(ValueError) as e:
        Calibration.from_compressed_tensors(folder)
    msg = str(e.value)
    assert f"{folder}: tensor '{ATTN.format(0)}.{leaf}' is " in msg, msg
    assert "quantscope does not run attention quantization" in msg
    assert "refused, not dropped" in msg


@pytest.mark.parametrize("leaf", ["k_zero_point", "v_zero_point", "q_zero_point"])
def test_an_attention_zero_point_is_refused_not_dropped(exports, tmp_path, leaf):
    # compressed-tensors makes these beside the attention's scales; a symmetric fp8 KV cache
    # saves none, and the reader dropped one without a word
    folder = edited(exports["kv"], tmp_path / "e", _add(leaf))
    with pytest.raises(ValueError) as e:
        Calibration.from_compressed_tensors(folder)
    msg = str(e.value)
    assert f"{folder}: tensor '{ATTN.format(0)}.{leaf}' is a zero point" in msg, msg
    assert "refused, not dropped" in msg


def test_the_exports_themselves_still_read(exports):
    back = Calibration.from_compressed_tensors(exports["kv"])
    assert set(back.states[ATTN.format(0)]) == {"key", "value"}
    assert ATTN.format(0) not in Calibration.from_compressed_tensors(exports["plain"]).states
    assert not [k for k in load_file(next(exports["kv"].glob("*.safetensors")))
                if re.search(r"(q|prob)_scale$", k)]


def _attention_group(keep_kv_scheme):
    """A config group on the attention modules, with the KV scheme's args as its input
    activations: the layout llm-compressor's attention quantization writes."""
    def edit(qc):
        args = dict(qc["kv_cache_scheme"])
        qc["config_groups"]["attention"] = {
            "targets": ["re:.*self_attn$"], "weights": None, "input_activations": args,
            "output_activations": None, "format": qc["format"]}
        if not keep_kv_scheme:
            qc.pop("kv_cache_scheme")
    return edit


@pytest.mark.parametrize(("q_scale", "kv_scheme"), [(True, True), (True, False), (False, True)],
                         ids=["q-and-kv-scheme", "q-only", "kv-scheme-only"])
def test_an_attention_config_group_is_refused_naming_the_tensors_written_there(
        exports, tmp_path, q_scale, kv_scheme):
    # it named input_scale ("compressed-tensors writes only ['input_scale'] for this layer's
    # quantization"), which compressed-tensors never writes on an attention module
    folder = edited(exports["kv"], tmp_path / "e", _add("q_scale") if q_scale else None,
                    _attention_group(kv_scheme))
    with pytest.raises(ValueError) as e:
        Calibration.from_compressed_tensors(folder)
    msg = str(e.value)
    assert f"{folder}/config.json: config_groups.attention targets the attention module " \
           f"{ATTN.format(0)} (LlamaAttention)" in msg, msg
    assert "q_scale, k_scale and v_scale on the module" in msg
    assert "quantscope does not run attention quantization" in msg
    assert "input_scale" not in msg


@pytest.mark.parametrize("targets", [["re:.*self_attn$"], ["LlamaAttention"]])
def test_an_attention_group_with_weights_is_refused_too(exports, tmp_path, targets):
    # probe s58: a group with weights as well was matched only where its rule took a role
    # (an attention module holds no weight), so the reader took it without a word
    def edit(qc):
        group = dict(next(iter(qc["config_groups"].values())), targets=targets)
        qc["config_groups"]["attention"] = group
    folder = edited(exports["kv"], tmp_path / "e", None, edit)
    with pytest.raises(ValueError, match=r"config_groups\.attention targets the attention "
                                         r"module .* \(LlamaAttention\)"):
        Calibration.from_compressed_tensors(folder)


@pytest.mark.parametrize("targets", [[r"re:model\.layers\..*"], ["re:.*self_attn.*", "re:.*mlp.*"]])
def test_a_wide_target_over_attention_and_its_linears_reads(exports, tmp_path, targets):
    # s58 re-review: compressed-tensors quantizes attention only where a target matches it
    # narrowly (not its children: is_narrow_match); these take the Linears alone
    def edit(qc):
        for group in qc["config_groups"].values():
            group["targets"] = targets
    folder = edited(exports["kv"], tmp_path / "e", None, edit)
    read = Calibration.from_compressed_tensors(folder)
    assert read.states.keys() == Calibration.from_compressed_tensors(exports["kv"]).states.keys()
