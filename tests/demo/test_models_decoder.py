"""The decoder demo path: task from config, pad token, perplexity; atomic writes."""

import json
import math
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from tiny_models import llama_folder

from quantscope.demo import models
from quantscope.exporters.atomic import MARKER, atomic_dir, atomic_file, check_writable_target


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return llama_folder(tmp_path_factory.mktemp("tiny-llama"), hidden_size=32,
                        intermediate_size=64)


def test_task_follows_the_config(tmp_path, llama_dir):
    assert models.model_task(llama_dir) == "causal-lm"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    assert models.model_task(tmp_path) == "embedding"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    assert models.model_task(tmp_path) == "causal-lm"


def test_load_causal_lm_pads_with_eos(llama_dir):
    model, tok = models.load_model(llama_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert tok.pad_token == tok.eos_token == "</s>" and tok.padding_side == "right"
    enc = tok(["the cat sat", "a dog ran far away home"], padding=True, return_tensors="pt")
    assert enc["attention_mask"].sum().item() == 3 + 6
    base, _ = models.load_model(llama_dir, task="embedding")  # --task overrides
    assert type(base).__name__ == "LlamaModel"
    with pytest.raises(ValueError, match="task must be one of"):
        models.load_model(llama_dir, task="vision")


def test_perplexity_equals_the_direct_computation(llama_dir):
    model, tok = models.load_model(llama_dir)
    docs = ["the cat sat on the mat", "a dog ran", "the big dog ran far away home fast"]
    nll, n = 0.0, 0
    with torch.inference_mode():  # one document at a time: no padding at all
        for d in docs:
            ids = tok(d, return_tensors="pt")["input_ids"]
            logits = model(ids).logits[0, :-1].double()
            nll -= float(torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None]).sum())
            n += ids.shape[1] - 1
    ref = math.exp(nll / n)
    for bs in (1, 3):  # batched with padding: padded positions must not count
        assert models.perplexity(model, tok, docs, batch_size=bs) == pytest.approx(ref, 1e-5)
    lp = models.next_token_logprobs(model, tok, docs, batch_size=2)
    assert sum(t.shape[0] for t in lp) == n
    with pytest.raises(ValueError, match="no token to predict"):
        models.perplexity(model, tok, ["cat"])


def test_documents_without_a_next_token_count_nothing_at_any_batch_size(llama_dir):
    """An empty document alone in a batch reached the model as zero tokens (a reshape error
    inside its attention); it predicts nothing, as a one-token document."""
    model, tok = models.load_model(llama_dir)
    docs = ["the cat sat on the mat", "a dog ran"]
    ref = models.perplexity(model, tok, docs, batch_size=2)
    for bs in (1, 2, 4):
        assert models.perplexity(model, tok, ["", *docs, ""], batch_size=bs) == \
            pytest.approx(ref, 1e-6)
        lp = models.next_token_logprobs(model, tok, ["", *docs], batch_size=bs)
        assert sum(t.shape[0] for t in lp) == sum(t.shape[0] for t in
                                                 models.next_token_logprobs(model, tok, docs))


def test_a_perplexity_past_float64_is_inf_not_an_overflow_error(llama_dir):
    model, tok = models.load_model(llama_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(1e6)  # mean NLL far past log(float64 max) ~ 709.8 nats
    assert models.perplexity(model, tok, ["the cat sat on the mat"]) == math.inf


def test_resolve_model_path_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        models.resolve_model_path(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        models.resolve_model_path(tmp_path)


def test_atomic_dir_replaces_on_success_and_leaves_nothing_on_failure(tmp_path):
    out = tmp_path / "run"
    with atomic_dir(out) as d:
        Path(d, "a.txt").write_text("1")
        assert not out.exists()  # nothing visible until the end
    assert (out / "a.txt").read_text() == "1"
    with pytest.raises(ValueError, match="exists and is not empty"), atomic_dir(out):
        pass
    with pytest.raises(RuntimeError, match="boom"), atomic_dir(out, overwrite=True) as d:
        Path(d, "b.txt").write_text("2")
        raise RuntimeError("boom")
    assert sorted(os.listdir(tmp_path)) == ["run"] and sorted(os.listdir(out)) == [MARKER, "a.txt"]
    with atomic_dir(out, overwrite=True) as d:
        Path(d, "b.txt").write_text("2")
    assert sorted(os.listdir(tmp_path)) == ["run"] and sorted(os.listdir(out)) == [MARKER, "b.txt"]


def test_atomic_file_and_unwritable_targets(tmp_path):
    f = tmp_path / "m.onnx"
    with pytest.raises(OSError, match="disk"), atomic_file(f) as t:
        Path(t).write_text("half")
        raise OSError("disk full")
    assert os.listdir(tmp_path) == []
    with atomic_file(f) as t:
        Path(t).write_text("whole")
    assert f.read_text() == "whole"
    with pytest.raises(ValueError, match="is a file, not a folder"):
        check_writable_target(f / "sub")
    with pytest.raises(ValueError, match="exists and is not a folder"):
        check_writable_target(f)
    if os.path.isdir("/sys/kernel"):  # read-only for everyone, root included
        with pytest.raises(PermissionError, match="not writable"):
            check_writable_target("/sys/kernel/quantscope-out")
    if os.geteuid() != 0:  # root writes anywhere else
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        with pytest.raises(PermissionError, match="not writable"):
            check_writable_target(ro / "out")
