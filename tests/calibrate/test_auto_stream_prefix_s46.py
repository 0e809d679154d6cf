"""``auto``'s "model" and "fisher" metrics hold only the scoring prefix of a stream of batches
(a generator, a DataLoader): the later batches are freed as the pass reads them, and every
result is the one of the same batches given as a list."""

import gc
import weakref

import pytest
import torch
from tiny_models import llama

import quantscope
from quantscope.calibration import Auto, Runtime
from quantscope.calibration.choice import auto as auto_mod
from quantscope.calibration.run import session

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

#: batches of 2 x 12 token ids: 24 real tokens each, so 48 scoring tokens are 2 batches
N, PREFIX, TOKENS = 6, 2, 48


def _batches(dicts: bool):
    _, ids = llama()
    ids = ids + [torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(9 + i))
                 for i in range(N - len(ids))]
    return [{"input_ids": t, "attention_mask": torch.ones_like(t)} if dicts else t for t in ids]


class Stream:
    """A DataLoader's shape (a length, read once per iteration): each batch a fresh copy,
    whose tensor is tracked by a weak reference."""

    def __init__(self, batches, sized=True):
        self.batches, self.refs, self.sized = batches, [], sized

    def _fresh(self, b):
        copy = {k: v.clone() for k, v in b.items()} if isinstance(b, dict) else b.clone()
        self.refs.append(weakref.ref(copy["input_ids"] if isinstance(copy, dict) else copy))
        return copy

    def __iter__(self):
        return (self._fresh(b) for b in self.batches)

    def __len__(self):
        if not self.sized:
            raise TypeError("no length")
        return len(self.batches)

    def alive(self) -> list[int]:
        gc.collect()
        return [i for i, r in enumerate(self.refs) if r() is not None]


def _same(a, b):
    assert a.states.keys() == b.states.keys()
    for layer, roles in a.states.items():
        assert roles.keys() == b.states[layer].keys()
        for role, s in roles.items():
            t = b.states[layer][role]
            assert s.observer == t.observer, (layer, role)
            for name in ("scale", "zero_point", "global_scale"):
                x, y = getattr(s.qparams, name, None), getattr(t.qparams, name, None)
                assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), name
    timeless = {k: v for k, v in a.info.get("auto", {}).items() if "seconds" not in k}
    assert timeless == {k: v for k, v in b.info.get("auto", {}).items() if "seconds" not in k}


def _watch(monkeypatch, module, name, stream, seen):
    """Record which of ``stream``'s batches are alive when ``module.name`` is called."""
    real = getattr(module, name)

    def spy(*args, **kwargs):
        seen.append(stream.alive())
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)


@pytest.mark.parametrize("sized", [False, True], ids=["generator", "dataloader-like"])
def test_model_metric_holds_only_the_scoring_prefix(monkeypatch, sized):
    model, _ = llama()
    batches, auto = _batches(False), Auto(score_tokens=TOKENS)
    listed = quantscope.calibrate(model, batches, "w8a8", observer="auto", auto=auto,
                                  progress=False)
    stream, seen = Stream(batches, sized), []
    _watch(monkeypatch, auto_mod, "choose", stream, seen)  # the scoring, after the pass
    streamed = quantscope.calibrate(model, stream if sized else iter(stream), "w8a8",
                                    observer="auto", auto=auto, progress=False)
    assert len(stream.refs) == N  # every batch read once
    assert seen and set(seen[0]) <= set(range(PREFIX)), seen  # the rest freed by then
    _same(streamed, listed)


# distributed=True outside a process group is one process: it holds the prefix alone too
@pytest.mark.parametrize("runtime", [Runtime(), Runtime(distributed=True)], ids=str)
def test_fisher_metric_holds_only_the_scoring_prefix(monkeypatch, runtime):
    model, _ = llama()
    batches, auto = _batches(True), Auto(metric="fisher", score_tokens=TOKENS)
    listed = quantscope.calibrate(model, batches, "w8a8", observer="auto", auto=auto,
                                  progress=False)
    stream, seen = Stream(batches), []
    _watch(monkeypatch, session, "_conclude", stream, seen)  # the choice, after the pass
    streamed = quantscope.calibrate(model, stream, "w8a8", observer="auto", auto=auto,
                                    progress=False, runtime=runtime)
    assert len(stream.refs) == N
    assert seen and set(seen[0]) <= set(range(PREFIX)), seen
    _same(streamed, listed)
    # a generator (no length): listed as before, the sample spread over its number
    again = quantscope.calibrate(model, (b for b in batches), "w8a8", observer="auto",
                                 auto=auto, progress=False)
    _same(again, listed)


def test_dataloader_gives_the_lists_choice():
    model, _ = llama()
    batches = _batches(True)
    for metric in ("model", "fisher"):
        auto = Auto(metric=metric, score_tokens=TOKENS)
        loader = torch.utils.data.DataLoader(batches, batch_size=None)
        got, want = (quantscope.calibrate(model, b, "w8a8", observer="auto", auto=auto,
                                          progress=False) for b in (loader, batches))
        _same(got, want)
