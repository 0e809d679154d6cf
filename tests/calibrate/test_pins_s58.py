"""Pins for what this session's mutants survived (probe s58): gpt-oss experts' biases under
``apply`` (the per-expert views' forward), a config group whose targets also match a module
that takes no role (a norm), and the batch walks' edge cases."""

from __future__ import annotations

import collections
import json
import warnings

import pytest
import torch

from quantscope.calibration import Calibration, calibrate, preset
from quantscope.calibration.run.batches import map_tensors, tensors_in

transformers = pytest.importorskip("transformers")
from tiny_models import gpt_oss, llama


def test_gpt_oss_expert_biases_run_under_apply():
    model, _ = gpt_oss()
    with torch.no_grad():  # biases that matter (the default init is small)
        for name, p in model.named_parameters():
            if name.endswith("_bias") and "experts" in name:
                p.normal_(0, 1.0)
    assert model.model.layers[0].mlp.experts.has_bias
    batches = [torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(i))
               for i in range(3)]
    with torch.no_grad():
        ref = model(batches[0]).logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calib = calibrate(model, batches, "w8a8", progress=False)
    with calib.apply(model), torch.no_grad():
        got = model(batches[0]).logits
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 0.05  # without biases: ~1.3


def test_a_norm_the_targets_also_match_is_left_out_by_the_reader(tmp_path):
    model, batches = llama()
    folder = tmp_path / "ct"
    calibrate(model, batches, preset("w8a8", ignore=["lm_head"]), progress=False).export(
        model, str(folder))
    cfg = json.loads((folder / "config.json").read_text())
    group = next(iter(cfg["quantization_config"]["config_groups"].values()))
    group["targets"] = [*group["targets"], "LlamaRMSNorm"]  # compressed-tensors skips norms
    (folder / "config.json").write_text(json.dumps(cfg))
    read = Calibration.from_compressed_tensors(folder)
    assert read.states and not any("norm" in layer for layer in read.states)


def test_a_namedtuple_holding_itself_is_walked_once():
    NT = collections.namedtuple("NT", "x extra")
    batch = NT(torch.ones(2, 3), [])
    batch.extra.append(batch)
    out = map_tensors(lambda t: t * 2, batch)
    assert type(out) is NT and torch.equal(out.x, torch.full((2, 3), 2.0))
    assert len(list(tensors_in(batch))) == 1


def test_an_object_with_keys_but_no_getitem_is_a_leaf():
    class Meta:
        def keys(self):
            return ["a"]

    batch = {"input_ids": torch.ones(1, 3, dtype=torch.long), "meta": Meta()}
    assert len(list(tensors_in(batch))) == 1
    assert map_tensors(torch.clone, batch)["meta"] is batch["meta"]
