"""Issue 18: the activation rows kept for ``auto`` and the report stay within one total
budget, are drawn into fixed buffers (nothing grows with the number of batches), are
shared by every recipe and observer of one pass, and feed no qparams except ``auto``'s."""

import math

import pytest
import torch

from quantscope import cli
from quantscope.calibration import calibrate, calibrate_many, preset
from quantscope.calibration.options import Sampling
from quantscope.calibration.run import observe
from quantscope.calibration.run.samples import RowSample

transformers = pytest.importorskip("transformers")

OBSERVERS = ("minmax", "mse", "percentile", "histogram_mse")


def llama(layers=6, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=100)
    return transformers.LlamaForCausalLM(cfg).eval()


def batches(n, seed=0):
    return [torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(seed + i))
            for i in range(n)]


@pytest.fixture(scope="module")
def model():
    return llama()


@pytest.fixture
def samples(monkeypatch):
    """Every RowSample the session makes, in order."""
    made = []

    class Spy(RowSample):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(observe, "RowSample", Spy)
    return made


def _qparams(calib):
    out = {}
    for layer, roles in calib.states.items():
        for role, st in roles.items():
            if st is not None and st.qparams is not None:
                out[(layer, role)] = (st.qparams.scale, st.qparams.zero_point)
    return out


def _assert_same_qparams(a, b):
    qa, qb = _qparams(a), _qparams(b)
    assert qa.keys() == qb.keys() and qa
    for k in qa:
        assert torch.equal(qa[k][0], qb[k][0]) and torch.equal(qa[k][1], qb[k][1]), k


def test_samples_respect_a_tiny_budget(model, samples):
    budget_mb = 0.05  # 52 KB for 6 layers x 4 sampled inputs (q/k/v and gate/up fused)
    calib = calibrate(model, batches(4), preset("w8a8", "minmax", ignore=["lm_head"]),
                      progress=False, sample_budget_mb=budget_mb)
    assert len(samples) == 6 * 4  # one per input slot: q/k/v, o, gate/up, down
    total = sum(s.nbytes for s in samples)
    assert 0 < total <= budget_mb * 2**20
    (cap,) = {s.capacity for s in samples}  # the budget divided equally in rows
    assert cap * 4 * 6 * (64 * 3 + 128) > budget_mb * 2**20 - 6 * 4 * 4 * 128  # nearly all of it
    assert all(s.count == cap for s in samples)  # filled: 4 batches x 32 rows > cap
    acts = [r for r in calib.stats if r["role"] == "input"]
    assert acts and all(r["numel"] % cap == 0 and r["numel"] // cap in (64, 128) for r in acts)


def test_default_budget_keeps_sample_tokens_rows_on_a_small_model(model, samples):
    calibrate(model, batches(4), preset("w8a8", "minmax", ignore=["lm_head"]), progress=False,
              sample_tokens=100)
    assert {s.capacity for s in samples} == {100}
    assert {s.count for s in samples} == {100}  # 25 rows of each of the 4 batches of 32


def test_qparams_do_not_depend_on_the_sample(model):
    """Only 'auto' reads the sample: every other observer's qparams are identical whether
    the sample holds 2048 rows per layer or one."""
    recipes = {o: preset("w8a8", o, ignore=["lm_head"]) for o in OBSERVERS}
    big = calibrate_many(model, batches(3), recipes, progress=False, sample_budget_mb=1024)
    tiny = calibrate_many(model, batches(3), recipes, progress=False, sample_budget_mb=1e-6)
    for o in OBSERVERS:
        _assert_same_qparams(big[o], tiny[o])


def test_full_budget_reproduces_the_list_and_cat_sample(model, monkeypatch):
    """With room for ``sample_tokens`` rows the report is the one the list-and-cat code made:
    recompute it from rows drawn the old way (same generator, same order of draws)."""
    recipe = preset("w8a8", "minmax", ignore=["lm_head"])
    calib = calibrate(model, batches(3), recipe, progress=False, sample_tokens=40)
    seen = {}

    def old_hook(slots, input_key=None):  # the sampling this issue replaced, in spirit
        def observe(x):
            for slot in slots:
                if slot.also:
                    from quantscope.calibration.structure import fusion
                    if fusion.same_input(slot.last, x):
                        continue
                    slot.last = x
                for obs in slot.observers.values():
                    obs(x)
                if slot.sample is not None:
                    rows = x.detach().reshape(-1, x.shape[-1])
                    s = slot.sample
                    take = min(rows.shape[0], s._share(), s.capacity - s.count)
                    idx = torch.randperm(rows.shape[0], generator=s.generator)[:take]
                    seen.setdefault(id(slot), []).append(rows.index_select(0, idx))
                    s.count += take
                    s.buffer = torch.cat(seen[id(slot)])  # what _finish concatenated
        return (lambda m, a, k: observe(a[0] if a else k[input_key])), (
            lambda m, a, o: observe(o))

    monkeypatch.setattr(observe, "_hook", old_hook)
    old = calibrate(model, batches(3), recipe, progress=False, sample_tokens=40)
    assert seen and calib.stats == old.stats
    _assert_same_qparams(calib, old)


def test_sample_memory_does_not_grow_with_batches_or_recipes(model, samples):
    recipe = preset("w8a8", "minmax", ignore=["lm_head"])
    calibrate(model, batches(2), recipe, progress=False, sample_tokens=64)
    two = sum(s.nbytes for s in samples)
    samples.clear()
    calibrate(model, batches(20), recipe, progress=False, sample_tokens=64)
    assert sum(s.nbytes for s in samples) == two  # fixed buffers: 20 batches cost no more
    samples.clear()
    # seven observers in seven recipes, one pass: still one sample per input slot
    recipes = {o: preset("w8a8", o, ignore=["lm_head"]) for o in (*OBSERVERS, "auto")}
    calibrate_many(model, batches(2), recipes, progress=False, sample_tokens=64)
    assert len(samples) == 6 * 4 and sum(s.nbytes for s in samples) == two


def test_observers_share_the_layers_activation(model, monkeypatch):
    """Every observer of every recipe gets the layer's own input tensor: no copy per
    recipe or observer."""
    seen = {}
    orig = observe._hook

    def spy(slots, input_key=None):
        pre, post = orig(slots, input_key)

        def pre2(module, args, kwargs):
            for slot in slots:
                for obs in slot.observers.values():
                    ptrs = seen.setdefault(id(slot), set())
                    forward = obs.forward

                    def record(x, _f=forward, _p=ptrs):
                        _p.add(x.data_ptr())
                        return _f(x)

                    obs.forward = record
            pre(module, args, kwargs)
            for slot in slots:
                for obs in slot.observers.values():
                    del obs.forward
        return pre2, post

    monkeypatch.setattr(observe, "_hook", spy)
    recipes = {o: preset("w8a8", o, ignore=["lm_head"]) for o in OBSERVERS}
    calibrate_many(model, batches(1), recipes, progress=False)
    # one batch: each slot's observers (all recipes) saw exactly one tensor, the input itself
    assert seen and all(len(ptrs) == 1 for ptrs in seen.values())


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, "64", True])
def test_bad_budget_is_refused(model, bad):
    with pytest.raises(ValueError, match=r"Sampling.budget_mb \(sample_budget_mb\) must be a "
                                         r"positive number"):
        calibrate(model, batches(1), "w8a8", progress=False, sampling=Sampling(budget_mb=bad))


def test_cli_refuses_a_bad_budget(capsys):
    assert cli.main(["calibrate", "--sample-budget-mb", "0"]) == 2
    assert "--sample-budget-mb must be a positive number" in capsys.readouterr().err


def test_batches_are_streamed_from_an_iterator(model):
    """A generator of batches is read one batch at a time (the fusion detection peeks at the
    first without listing the rest) and gives the qparams of the same batches as a list."""
    pulled, at_forward = [0], []

    def gen():
        for b in batches(5):
            pulled[0] += 1
            yield b

    recipe = preset("w8a8", "minmax", ignore=["lm_head"])
    h = model.register_forward_pre_hook(lambda m, a: at_forward.append(pulled[0]))
    try:
        streamed = calibrate(model, gen(), recipe, progress=False)
    finally:
        h.remove()
    assert streamed.info["batches"] == 5
    assert at_forward == [1, 1, 2, 3, 4, 5]  # the detection forward, then one batch each
    _assert_same_qparams(streamed, calibrate(model, batches(5), recipe, progress=False))


def test_a_dataloader_is_sampled_as_its_list(model, samples):
    """A DataLoader has a length: its sample is spread over every batch as a list's is
    (the fusion detection's peek kept the length), not drawn from the first batches."""
    from torch.utils.data import DataLoader

    recipe = preset("w8a8", "minmax", ignore=["lm_head"])
    listed = calibrate(model, batches(20), recipe, progress=False, sample_tokens=40)
    loader = DataLoader(batches(20), batch_size=None)
    loaded = calibrate(model, loader, recipe, progress=False, sample_tokens=40)
    assert loaded.stats == listed.stats
    assert {s.batches for s in samples} == {20}


@pytest.mark.parametrize("fusion", [True, False])
def test_a_dataloader_without_a_length_is_a_stream(model, fusion):
    """A DataLoader over an IterableDataset has ``__len__`` but raises on it: it is read as
    a generator is (it failed in the fusion detection's peek, and without fusion groups)."""
    from dataclasses import replace

    from torch.utils.data import DataLoader, IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(batches(4))

    recipe = replace(preset("w8a8", "minmax", ignore=["lm_head"]), fusion=fusion)
    streamed = calibrate(model, DataLoader(Stream(), batch_size=None), recipe, progress=False)
    assert streamed.info["batches"] == 4
    _assert_same_qparams(streamed, calibrate(model, batches(4), recipe, progress=False))


def test_smoothing_keeps_a_dataloaders_length(model, samples):
    """SmoothQuant's peek at the first batch kept no length either (session's own copy of
    the peek): the sample of a DataLoader was drawn as a generator's."""
    from torch.utils.data import DataLoader

    recipe = preset("w8a8", "minmax", ignore=["lm_head"])
    calibrate(model, DataLoader(batches(20), batch_size=None), recipe, progress=False,
              sample_tokens=40, smooth=0.5)
    assert {s.batches for s in samples} == {20}
