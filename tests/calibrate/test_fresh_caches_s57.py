"""Review s57 of the KV-cache copy (``batches._fresh``): a mapping whose shallow copy shares
the user's storage (a MutableMapping keeping its items in an attribute) had the copied cache
written back into the user's batch, so each forward started from the cache the one before
filled (12 of 30 roles of a tiny Llama's w8a8 calibration differed from the dict batch's); a
batch holding itself recursed without end; a ModelOutput holding a cache refused update()."""

import types
from collections.abc import MutableMapping

import pytest
import torch

from quantscope.calibration.run.batches import forward_batch, map_tensors

transformers = pytest.importorskip("transformers")


class Record(MutableMapping):
    """A dataset's record type: its items in an attribute (copy.copy shares them)."""

    def __init__(self, **items):
        self._items = dict(items)

    def __getitem__(self, k):
        return self._items[k]

    def __setitem__(self, k, v):
        self._items[k] = v

    def __delitem__(self, k):
        del self._items[k]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)


def _fills(input_ids, past_key_values):
    """A decoder's step: the cache length it starts from, then the cache extended."""
    start = past_key_values.get_seq_length()
    kv = torch.zeros(1, 1, input_ids.shape[1], 4)
    past_key_values.update(kv, kv, 0)
    return start


def _batch(wrap):
    return wrap(input_ids=torch.ones(1, 3, dtype=torch.long),
                past_key_values=transformers.DynamicCache())


@pytest.mark.parametrize("wrap", [dict, Record, lambda **kw: transformers.BatchEncoding(kw)])
def test_each_forward_starts_from_the_cache_as_given(wrap):
    batch = _batch(wrap)
    cache = batch["past_key_values"]
    assert [forward_batch(_fills, batch) for _ in range(3)] == [0, 0, 0]
    assert batch["past_key_values"] is cache and cache.get_seq_length() == 0
    # the same mapping as a wrapper model's positional argument
    assert [forward_batch(lambda b: _fills(**b), (batch,)) for _ in range(2)] == [0, 0]
    assert batch["past_key_values"] is cache and cache.get_seq_length() == 0


def test_copies_keep_a_type_only_where_the_copy_has_its_own_storage():
    cache = transformers.DynamicCache()
    out = transformers.modeling_outputs.CausalLMOutputWithPast(
        logits=torch.ones(1), past_key_values=cache)
    (got,) = forward_batch(lambda *a: a, (out,))  # a ModelOutput refuses update()
    assert type(got) is type(out) and got.past_key_values is not cache
    assert got["past_key_values"] is got.past_key_values and out.past_key_values is cache
    (got,) = forward_batch(lambda *a: a, (Record(c=cache),))
    assert type(got) is dict and got["c"] is not cache
    (got,) = forward_batch(lambda *a: a, (types.MappingProxyType({"c": cache}),))
    assert type(got) is dict and got["c"] is not cache


def test_a_batch_holding_itself_is_walked_once():
    loop = [1, 2]
    loop.append(loop)
    batch = {"x": torch.ones(1), "meta": loop}
    assert forward_batch(lambda **kw: kw["meta"], batch) is loop
    loop.append(transformers.DynamicCache())  # a cache beside the loop: copied, loop kept
    got = forward_batch(lambda **kw: kw["meta"], batch)
    assert got[2] is loop and got[3] is not loop[3]


def test_map_tensors_never_writes_into_the_users_mapping():
    record = Record(x=torch.ones(2))
    got = map_tensors(torch.zeros_like, record)
    assert type(got) is dict and torch.equal(got["x"], torch.zeros(2))
    assert torch.equal(record["x"], torch.ones(2))
    enc = transformers.BatchEncoding({"x": torch.ones(2)})
    got = map_tensors(torch.zeros_like, enc)
    assert type(got) is transformers.BatchEncoding and torch.equal(enc["x"], torch.ones(2))


def test_a_keys_only_batch_gets_a_copy_of_its_cache():
    # s57 mutants: what has keys() and [] but is no Mapping is read as ** reads it
    class KeysOnly:
        def __init__(self, **items):
            self.items = items

        def keys(self):
            return self.items.keys()

        def __getitem__(self, k):
            return self.items[k]

    batch = _batch(KeysOnly)
    cache = batch["past_key_values"]
    assert [forward_batch(_fills, batch) for _ in range(2)] == [0, 0]
    assert cache.get_seq_length() == 0


def test_a_dict_batch_holding_itself_is_walked_once():
    # s58 mutants: the mapping branch keeps the ids above it too (the loop above is a list)
    batch = {"x": torch.ones(1)}
    batch["self"] = batch
    assert forward_batch(lambda **kw: kw["self"], batch) is batch
    batch["cache"] = transformers.DynamicCache()
    got = forward_batch(lambda **kw: kw, batch)
    assert got["self"] is batch and got["cache"] is not batch["cache"]


def test_a_spilled_model_output_reads_back_as_a_dict(tmp_path):
    # s58 mutants: map_tensors gives a dict subclass (a ModelOutput) as a dict: the spill
    # file's weights_only load refuses other classes
    from transformers.modeling_outputs import BaseModelOutput

    from quantscope.calibration.run.seq_cache import Cache

    out = BaseModelOutput(last_hidden_state=torch.ones(2, 3))
    assert type(map_tensors(torch.Tensor.detach, out)) is dict
    cache = Cache([0], str(tmp_path), "t")  # budget 0: every value spilled to a file
    cache.put(0, out)
    got = cache.get(0)
    assert type(got) is dict and torch.equal(got["last_hidden_state"], torch.ones(2, 3))
