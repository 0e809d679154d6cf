"""Auto's scoring pieces (probe s58): a dict batch with a KV cache holding a prefix was cut by
rows with its cache whole, so the first 1-row piece met a 2-row cache in the model
(transformers' bare size mismatch). A batch is cut only where every argument is a tensor or
holds none; else it is scored whole."""

from __future__ import annotations

import pytest
import torch

import quantscope
from quantscope.calibration.choice.score_set import rows_of, score_plan

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100)
    return transformers.LlamaForCausalLM(config).eval()


def test_a_batch_with_a_prefix_cache_is_scored_whole():
    model = _llama()
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():  # a 4-token prefix of each of 2 rows
        model(torch.randint(0, 100, (2, 4)), past_key_values=cache, use_cache=True)
    batches = [{"input_ids": torch.randint(0, 100, (2, 6)), "past_key_values": cache}] * 2
    assert rows_of(batches[0]) is None and rows_of({"input_ids": batches[0]["input_ids"]}) == 2
    calib = quantscope.calibrate(model, batches, "w8a8", observer="auto", progress=False)
    assert calib.info["auto"]["score_forwards"] > 0
    assert cache.get_seq_length() == 4  # the user's cache as it was


def test_a_batch_whose_argument_nests_tensors_is_not_cut():
    ids = torch.ones(4, 5, dtype=torch.long)
    assert rows_of({"input_ids": ids, "extra": {"pixels": torch.zeros(4, 3)}}) is None
    assert rows_of({"input_ids": ids, "extra": {"flag": True}, "n": 3}) == 4
    plan = score_plan([{"input_ids": ids, "extra": [torch.zeros(4, 3)]}], 1024)
    assert plan == [(0, 0, None)]
