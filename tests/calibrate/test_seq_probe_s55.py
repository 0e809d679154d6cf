"""Probe s55 (sequential calibration): a KV cache object in the batches is copied for every
forward of the whole-model pass as the sequential pass leaves it untouched; SIGTERM removes
the spill folder as Ctrl-C does, and still ends the process."""

import collections
import dataclasses
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping

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


def test_a_cache_given_positionally_is_copied_as_a_keyword_one():
    # a tuple batch, model(*batch): LlamaForCausalLM's fourth argument is its cache
    model, batches = llama()
    plain = calibrate(model, [(b,) for b in batches], "w8a8", progress=False)
    caches = [transformers.DynamicCache() for _ in batches]
    cached = [(b, None, None, c) for b, c in zip(batches, caches)]
    assert_same_qparams(plain, calibrate(model, cached, "w8a8", progress=False))
    assert [c.get_seq_length() for c in caches] == [0] * len(batches)


def test_a_static_cache_written_in_place_keeps_its_prefix():
    # a StaticCache is written in place (index_copy_): a copy sharing its tensors' storage
    # would write the calibration batch's keys into the user's prefix
    model, _ = llama()
    cfg = model.config
    pre, new = torch.randint(0, 100, (1, 8)), torch.randint(0, 100, (1, 4))
    cache = transformers.StaticCache(config=cfg, max_cache_len=16)
    with torch.inference_mode():
        model(pre, past_key_values=cache, use_cache=True)
    keys = [layer.keys.clone() for layer in cache.layers]
    calibrate(model, [{"input_ids": new, "past_key_values": cache,
                       "attention_mask": torch.ones(1, 12, dtype=torch.long)}], "w8a8",
              progress=False)
    assert cache.get_seq_length() == 8
    assert all(torch.equal(k, layer.keys) for k, layer in zip(keys, cache.layers))


def test_fishers_default_loss_leaves_the_cache_empty():
    # Auto(metric="fisher") without Auto.loss ran model(**batch, labels=...) itself, past
    # forward_batch: the caches filled, and 22 qparams differed from the pass without one
    from quantscope.calibration import Auto

    model, batches = llama()
    auto = Auto(metric="fisher", candidates=("minmax", "mse"))
    plain = calibrate(model, [{"input_ids": b} for b in batches], "w8a8", observer="auto",
                      auto=auto, progress=False)
    caches = [transformers.DynamicCache() for _ in batches]
    cached = [{"input_ids": b, "past_key_values": c} for b, c in zip(batches, caches)]
    assert_same_qparams(plain, calibrate(model, cached, "w8a8", observer="auto", auto=auto,
                                         progress=False))
    assert [c.get_seq_length() for c in caches] == [0] * len(batches)


def test_a_cache_inside_an_argument_is_copied_too():
    # a wrapper whose forward takes the tokenizer's dict positionally: the cache inside that
    # argument was not copied, and the user's filled
    from quantscope.calibration.run.batches import forward_batch

    class Wrapper(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, inputs):
            return self.model(**inputs) if isinstance(inputs, Mapping) else self.model(*inputs)

    model, batches = llama()
    cache = transformers.DynamicCache()
    arg = {"input_ids": batches[0], "past_key_values": cache}
    positional = (batches[0], None, None, cache)
    for batch in ((arg,), [arg], {"inputs": arg}, (positional,), ([*positional],)):
        forward_batch(Wrapper(model), batch)
        assert cache.get_seq_length() == 0
    # a namedtuple batch keeps its type (built by position)
    Args = collections.namedtuple("Args", "input_ids attention_mask position_ids cache")
    forward_batch(model, Args(*positional))
    assert cache.get_seq_length() == 0
    # a BatchEncoding argument holding one is copied as a BatchEncoding (a wrapper reads
    # inputs.input_ids); with no cache, nothing is copied
    enc = transformers.BatchEncoding({"input_ids": batches[0], "past_key_values": cache})
    (got,) = forward_batch(lambda *a: a, (enc,))
    assert type(got) is transformers.BatchEncoding and got.input_ids is batches[0]
    assert got["past_key_values"] is not cache and enc["past_key_values"] is cache
    enc = transformers.BatchEncoding({"input_ids": batches[0]})
    for plain in ((batches[0],), (enc,), ({"x": enc},)):
        assert forward_batch(lambda *a: a, plain)[0] is plain[0]


def test_a_cache_copy_is_detached_at_any_depth():
    # a cache holding tensors a graph made (a prefix computed with gradients), in attributes
    # and in a dict: deepcopy refuses such a tensor, and a copy keeping its graph would let
    # the calibration's forwards extend the user's
    from quantscope.calibration.run.batches import _copy_cache

    w = torch.randn(4, 4, requires_grad=True)
    cache = transformers.DynamicCache()
    cache.extra, cache.plain = {"prefix": w @ w}, w * 2
    copy = _copy_cache(cache)
    assert copy.extra["prefix"] is not cache.extra["prefix"]
    for got, was in ((copy.extra["prefix"], cache.extra["prefix"]), (copy.plain, cache.plain)):
        assert got.grad_fn is None and not got.requires_grad and torch.equal(got, was)


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


# ---------------------------------------------------------------- SIGTERM and the spill folder
_CHILD = """
import os, signal, sys, torch, transformers
from quantscope.calibration import Sequential, calibrate
torch.manual_seed(0)
cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
model = transformers.LlamaForCausalLM(cfg).eval()
model.model.layers[1].register_forward_pre_hook(lambda *a: os.kill(os.getpid(), signal.SIGTERM))
calibrate(model, [torch.randint(0, 100, (2, 16)) for _ in range(3)], "w8a8", progress=False,
          sequential=Sequential(cache_budget_mb=0, cache_dir=sys.argv[1]))
print("not stopped")
"""


def _spilling(tmp_path, model, batches, hook):
    """A spilling sequential run whose block 1 calls ``hook`` (the spill folder full by then)."""
    from quantscope.calibration import Sequential

    handle = model.model.layers[1].register_forward_pre_hook(lambda *a: hook(tmp_path))
    try:
        return calibrate(model, batches, "w8a8", progress=False,
                         sequential=Sequential(cache_budget_mb=0, cache_dir=tmp_path))
    finally:
        handle.remove()


def test_sigterm_removes_the_spill_folder_and_still_ends_the_process(tmp_path):
    # the folder (the size of the cached activations) was left behind: only SIGINT unwound
    (tmp_path / "mine.pt").write_bytes(b"kept")
    done = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == -signal.SIGTERM, done.stderr[-2000:]
    assert "not stopped" not in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.pt"]


def test_a_handler_of_the_programs_own_decides_and_is_kept(tmp_path):
    class Stop(Exception):
        pass

    def own(signum, frame):
        raise Stop

    def send(folder):
        assert list(folder.glob("quantscope-seq-*/*.pt"))  # spilled by now
        os.kill(os.getpid(), signal.SIGTERM)

    model, batches = llama()
    before = signal.signal(signal.SIGTERM, own)
    try:
        with pytest.raises(Stop):
            _spilling(tmp_path, model, batches, send)
        assert signal.getsignal(signal.SIGTERM) is own
    finally:
        signal.signal(signal.SIGTERM, before)
    assert not list(tmp_path.iterdir())


def test_the_default_handler_is_back_after_a_run_and_a_thread_runs_without_one(tmp_path):
    model, batches = llama()
    seen = []
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (whatever the test runner set)
    try:
        _spilling(tmp_path, model, batches,
                  lambda folder: seen.append(signal.getsignal(signal.SIGTERM)))
        assert seen and seen[0] is not signal.SIG_DFL  # the run's own, while it held the folder
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before)
    errors = []

    def run():
        try:
            _spilling(tmp_path, model, batches, lambda folder: None)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert not errors and not list(tmp_path.iterdir())


# ---------------------------------------------------------------- sequences of 0 tokens
def _batch_kinds(ids):
    return {"tensor": (ids, "input"), "dict": ({"input_ids": ids}, "input_ids"),
            "tuple": ((ids,), "argument 0")}


@pytest.mark.parametrize("kind", ["tensor", "dict", "tuple"])
@pytest.mark.parametrize("stream", [False, True], ids=["list", "generator"])
@pytest.mark.parametrize("sequential", [False, True], ids=["whole", "sequential"])
def test_a_batch_of_empty_sequences_is_refused_naming_it_before_any_forward(
        kind, stream, sequential):
    # sequential=False met "cannot reshape tensor of 0 elements" in the attention, and
    # sequential=True an IndexError in transformers' packed-sequence check: neither named
    # the batch
    model, batches = llama()
    good, where = _batch_kinds(batches[0])[kind]
    empty, _ = _batch_kinds(torch.zeros(2, 0, dtype=torch.long))[kind]
    given = [good, empty]
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=rf"calibrate: batch 1's {where} has shape \(2, "
                                             rf"0\): its dimension 1 is empty"):
            calibrate(model, iter(given) if stream else given, "w8a8", progress=False,
                      sequential=sequential)
    finally:
        handle.remove()
    # a list is checked before any forward; a stream's batch before its own (the stream's
    # first batch forwarded once by fusion detection and once by the pass, or traced)
    assert len(calls) <= (2 if stream else 0)


def test_a_stream_read_in_two_goes_numbers_its_batches_on():
    # auto's scoring reads a generator's head, then the pass the rest: the refusal names the
    # empty batch's place in the stream, not its place in the second read
    from quantscope.calibration.run.batches import length_checked

    good, empty = torch.ones(2, 4, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long)
    stream = length_checked(b for b in [good, good, empty])
    assert next(iter(stream)) is good
    with pytest.raises(ValueError, match=r"^calibrate: batch 2's input has shape \(2, 0\)"):
        list(stream)


def test_a_checked_stream_is_true_as_its_source_is():
    # bool() fell back to __len__, which a generator lacks: a TypeError
    from quantscope.calibration.run.batches import length_checked

    assert bool(length_checked(b for b in []))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(0, 4)))
    assert not length_checked(loader) and len(length_checked(loader)) == 0


@pytest.mark.parametrize(("batch", "said"), [
    (torch.zeros(0, 0, dtype=torch.long), None),  # 0 rows: the model decides
    ((torch.ones(2, 4), torch.zeros(2, 0)), None),  # only the input (first tensor) is read
    (torch.nested.nested_tensor([torch.ones(3), torch.ones(5)]), None),  # no sizes to read
    (torch.zeros(2, 12, 0), r"input has shape \(2, 12, 0\): its dimension 2 is empty, so"),
    (torch.zeros(2, 0, 8), r"input has shape \(2, 0, 8\): its dimension 1 is empty \(seq"),
    # a dict's main input wherever it sits (s59: the mask first was read in its place)
    ({"attention_mask": torch.ones(2, 8), "input_ids": torch.zeros(2, 0)},
     r"input_ids has shape \(2, 0\)"),
    ({"attention_mask": torch.ones(2, 8), "inputs_embeds": torch.zeros(2, 0, 4)},
     r"inputs_embeds has shape \(2, 0, 4\)"),
    ({"attention_mask": torch.zeros(2, 0), "input_ids": torch.ones(2, 8)}, None),
], ids=["0x0", "second-argument", "nested", "empty-features", "empty-sequences",
        "ids-after-mask", "embeds-after-mask", "mask-alone-empty"])
def test_the_length_check_reads_the_input_alone(batch, said):
    from quantscope.calibration.run.batches import check_length

    if said is None:
        check_length(batch, 3)
    else:
        with pytest.raises(ValueError, match=rf"^calibrate: batch 3's {said}"):
            check_length(batch, 3)


def test_a_batch_of_zero_rows_is_still_passed_over():
    # 0 rows (a plain module passes them through) are not empty sequences: no new refusal
    lin = torch.nn.Sequential(torch.nn.Linear(8, 8))
    batches = [torch.randn(4, 8), torch.randn(0, 8)]
    assert_same_qparams(calibrate(lin, batches, "w8a8", progress=False),
                        calibrate(lin, batches[:1], "w8a8", progress=False))
