"""The compressed-tensors export warns for a fused layer only partly quantized (probe s55).

An ignore list that holds some shards of a fused layer (``k_proj`` but not ``q_proj`` /
``v_proj``) leaves shards of two schemes in one ``qkv_proj``: vLLM refuses the checkpoint.
``quantscope check`` reported it, the export wrote the folder without a word, though it warns
for the other layouts vLLM does not serve (docs/guide/deploy.md, "Serving with vLLM"). The
warning is ``check``'s line for the first such fused layer (one rule,
:func:`~quantscope.exporters.consistency.split_problems`), and the folder is the same.
"""

import json
import warnings

import pytest
import torch

from quantscope.calibration import calibrate, preset
from quantscope.exporters import check
from quantscope.exporters.consistency import format_problems

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from safetensors.torch import load_file
from tiny_models import llama

torch.set_num_threads(1)


def _export(tmp_path, ignore, name="e"):
    model, batches = llama()
    calib = calibrate(model, batches, preset("nvfp4", ignore=ignore), progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calib.export(model, tmp_path / name)
    return tmp_path / name, [str(w.message) for w in caught]


def _split(warned):
    return [w for w in warned if "quantize all of the group's shards or none" in w]


def test_a_partly_quantized_fused_layer_warns_at_export_as_check_reports_it(tmp_path):
    folder, warned = _export(tmp_path, ("lm_head", "re:.*k_proj$"))
    problems = [p for p in check(folder) if p.get("float")]
    assert [p["group"] for p in problems] == [f"model.layers.{i}.self_attn.qkv_proj"
                                              for i in range(2)]
    (line,) = _split(warned)  # one warning: the first fused layer and how many more
    assert line == (f"export compressed-tensors: {format_problems(problems[:1])} (and 1 more "
                    f"fused layers); transformers and compressed-tensors load it")
    assert "model.layers.0.self_attn.q_proj, model.layers.0.self_attn.v_proj quantized but " \
           "model.layers.0.self_attn.k_proj float" in line and "vLLM refuses" in line


def test_the_warning_leaves_the_folder_as_it_was_and_whole_groups_quiet(tmp_path):
    split, _ = _export(tmp_path, ("lm_head", "re:.*k_proj$"), "split")
    t = load_file(next(split.glob("*.safetensors")))
    assert "model.layers.0.self_attn.k_proj.weight" in t
    assert not [k for k in t if k.startswith("model.layers.0.self_attn.k_proj.weight_")]
    cfg = json.loads((split / "config.json").read_text())["quantization_config"]
    assert "model.layers.1.self_attn.k_proj" in cfg["ignore"]
    for name, ignore in (("whole", ("lm_head",)), ("none", ("lm_head", "re:.*[qkv]_proj$"))):
        folder, warned = _export(tmp_path, ignore, name)
        assert _split(warned) == [], warned
        assert not [p for p in check(folder) if p.get("float")]
