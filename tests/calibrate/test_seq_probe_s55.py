"""Probe s55 (sequential calibration): a KV cache object in the batches is copied for every
forward of the whole-model pass as the sequential pass leaves it untouched."""

import dataclasses

import pytest
import torch
from calib_checks import assert_same_qparams

from quantscope.calibration import calibrate, preset

transformers = pytest.importorskip("transformers")

from tiny_models import llama

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


# ---------------------------------------------------------------- a KV cache in the batches
def test_an_empty_cache_gives_the_pass_without_one_and_stays_empty():
    # the fusion detection forward of batch 0 filled the user's cache, so the calibrating
    # forward attended over a stale copy of its own keys: 12 qparams differed from the pass
    # without a cache (and from sequential=True), and the caches were left holding tokens
    model, batches = llama()
    plain = calibrate(model, [{"input_ids": b} for b in batches], "w8a8", progress=False)
    for sequential in (False, True):
        caches = [transformers.DynamicCache() for _ in batches]
        cached = [{"input_ids": b, "past_key_values": c} for b, c in zip(batches, caches)]
        assert_same_qparams(plain, calibrate(model, cached, "w8a8", progress=False,
                                             sequential=sequential))
        assert [c.get_seq_length() for c in caches] == [0] * len(batches)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "graph"])
def test_a_prefix_cache_is_the_same_for_every_forward_and_kept(grad):
    # every forward of the batch (fusion detection, the pass) extended the user's cache: the
    # pass saw the prefix and the detection's 4 tokens, and a second call more still. A
    # prefix computed with gradients holds tensors deepcopy refuses: copied detached
    model, _ = llama()
    pre, new = torch.randint(0, 100, (1, 8)), torch.randint(0, 100, (1, 4))
    with torch.enable_grad() if grad else torch.inference_mode():
        cache = model(pre, use_cache=True).past_key_values
    batch = [{"input_ids": new, "past_key_values": cache,
              "attention_mask": torch.ones(1, 12, dtype=torch.long)}]
    first = calibrate(model, batch, "w8a8", progress=False)
    assert cache.get_seq_length() == 8
    assert_same_qparams(first, calibrate(model, batch, "w8a8", progress=False))
    # the reference: one forward per batch (no fusion detection) on a cache of its own
    fresh = model(pre, use_cache=True).past_key_values
    one = calibrate(model, [{**batch[0], "past_key_values": fresh}],
                    dataclasses.replace(preset("w8a8"), fusion=False), progress=False)
    for layer in ("model.layers.1.self_attn.o_proj", "lm_head"):
        assert torch.equal(first.states[layer]["input"].qparams.scale,
                           one.states[layer]["input"].qparams.scale)
