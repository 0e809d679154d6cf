"""``sequential=True`` where the first block is weight-only and a later one quantizes inputs
(probe s33): the weight-only block's calibration ran no forward, so nothing wrote its outputs,
and the next block read a cache file that did not exist (``FileNotFoundError``). The block's
own pass now runs whenever the calibration's forwards did not give every batch's output."""

import pytest
import torch

from quantscope import Group, QuantSpec, calibrate
from quantscope.calibration.recipe import Recipe, Role, Rule

transformers = pytest.importorskip("transformers")


def _model_and_batches():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)).eval()
    g = torch.Generator().manual_seed(1)
    return model, [{"input_ids": torch.randint(0, 128, (2, 12), generator=g)} for _ in range(3)]


W4 = Role(QuantSpec("int4", Group(16)), "minmax")
A8 = Role(QuantSpec("int8"), "minmax")


@pytest.mark.parametrize("budget", [None, 0])  # 0: every block output spilled to a file
@pytest.mark.parametrize("weight_only", [(0,), (0, 1), (1,)])
def test_weight_only_blocks_before_activation_ones(budget, weight_only):
    model, batches = _model_and_batches()
    rules = [Rule(targets=(rf"re:model\.layers\.{i}\..*_proj$",), weight=W4,
                  input=None if i in weight_only else A8) for i in range(3)]
    recipe = Recipe(rules, ignore=("lm_head",))
    full = calibrate(model, batches, recipe, progress=False)
    seq = calibrate(model, batches, recipe, sequential=True, cache_budget_mb=budget,
                    progress=False)
    assert seq.quantizes_like(full)
    for layer, roles in full.states.items():
        for role, st in roles.items():
            got = seq.states[layer][role].qparams
            assert torch.equal(got.scale, st.qparams.scale), (layer, role)
