"""Entry points that read the batches more than once take a generator as a list."""

import pytest
import torch

from quantscope.calibration import sensitivity

transformers = pytest.importorskip("transformers")


def test_sensitivity_of_a_generator_is_that_of_its_list():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (2, 8), generator=g) for _ in range(3)]
    listed = sensitivity(model, batches, "w8a8")
    # calibrated, then measured, on the same generator (it said "batches is empty")
    streamed = sensitivity(model, (b for b in batches), "w8a8")
    assert streamed.rows == listed.rows and listed.rows
