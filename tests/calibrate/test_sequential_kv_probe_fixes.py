"""Sequential calibration and a batch carrying a prefix KV cache (probe s14/kvcache): the
blocks are replayed without the cache, so such a batch is refused before any block runs,
naming the argument; an empty cache changes nothing and still equals the whole pass."""

import pytest
import torch

from quantscope.calibration import Recipe, Sequential, calibrate, empty_model

transformers = pytest.importorskip("transformers")

from tiny_models import llama

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

_RECIPE = Recipe((), kv_cache="fp8")


def _prefixed(model, name):
    """One batch of 4 new tokens after an 8-token prefix held in a cache under ``name``."""
    pre, new = torch.randint(0, 100, (1, 8)), torch.randint(0, 100, (1, 4))
    with torch.inference_mode():
        cache = model(pre, use_cache=True).past_key_values
    return [{"input_ids": new, name: cache, "attention_mask": torch.ones(1, 12, dtype=torch.long)}]


@pytest.mark.parametrize("name", ["past_key_values", "cache"])
def test_a_batch_with_a_prefix_cache_is_refused_naming_the_argument(tmp_path, name):
    # it crashed in attention with a bare "size of tensor a (4) must match b (12)": the cache
    # was replaced by None while the 12-token mask was kept
    model, _ = llama()
    model.save_pretrained(tmp_path)
    calibrate(model, _prefixed(model, name), _RECIPE, progress=False)  # the whole pass runs
    with pytest.raises(ValueError, match=rf"argument '{name}' is a KV cache \(past_key_values\) "
                                         rf"already holding 8 tokens.*sequential=False"):
        calibrate(empty_model(tmp_path), _prefixed(model, name), _RECIPE, progress=False,
                  sequential=Sequential(checkpoint=tmp_path))


def test_an_empty_cache_in_a_batch_is_no_prefix():
    model, batches = llama()
    batch = [{"input_ids": b, "past_key_values": transformers.DynamicCache()} for b in batches]
    whole = calibrate(model, batch, _RECIPE, progress=False)
    batch = [{"input_ids": b, "past_key_values": transformers.DynamicCache()} for b in batches]
    seq = calibrate(model, batch, _RECIPE, progress=False, sequential=True)
    assert whole.states.keys() == seq.states.keys() and whole.states
    for layer, roles in whole.states.items():
        for role, st in roles.items():
            assert torch.equal(st.qparams.scale, seq.states[layer][role].qparams.scale)


def test_a_one_token_prefix_is_a_prefix_too():
    """A cache holding a single token is a prefix the new tokens attend to (a chat turn's
    BOS, a one-token prompt), as an 8-token one is: refused before any block is replayed
    without it. Only an empty cache changes nothing."""
    model, _ = llama()
    pre, new = torch.randint(0, 100, (1, 1)), torch.randint(0, 100, (1, 4))
    with torch.inference_mode():
        cache = model(pre, use_cache=True).past_key_values
    assert cache.get_seq_length() == 1
    batch = [{"input_ids": new, "past_key_values": cache,
              "attention_mask": torch.ones(1, 5, dtype=torch.long)}]
    with pytest.raises(ValueError, match=r"argument 'past_key_values' is a KV cache "
                                         r"\(past_key_values\) already holding 1 tokens"):
        calibrate(model, batch, _RECIPE, progress=False, sequential=True)
