"""Mutation round s47 on ``smooth_ranges._Flow``: the data-flow check holds the outputs of one
decoder layer only (compared bit for bit with what later Linears read); holding every
layer's would keep a norm output per layer alive for the whole forward (memory growing
with depth, found by mutating the scope rule: no test saw it)."""

from collections import Counter

import pytest
import torch

from quantscope.calibration.choice import smooth as sm
from quantscope.calibration.choice import smooth_ranges

transformers = pytest.importorskip("transformers")


def test_flow_holds_one_decoder_layers_outputs():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=100)
    model = transformers.LlamaForCausalLM(cfg).eval()
    mappings = sm.find_mappings(model)
    per_layer = max(Counter(m.prefix for m in mappings).values())
    assert len(mappings) > per_layer  # several layers hold mappings
    seen = []
    real = smooth_ranges._Flow._wrote

    def wrote(self, prev):
        f = real(self, prev)

        def g(*args):
            f(*args)
            seen.append(len(self.held))
        return g

    batch = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    smooth_ranges._Flow._wrote = wrote
    try:
        flow = {}
        ranges = smooth_ranges.channel_ranges(model, [batch], mappings, flow=flow)
    finally:
        smooth_ranges._Flow._wrote = real
    assert ranges.keys() == {m.previous for m in mappings}
    assert seen and max(seen) <= per_layer, seen
