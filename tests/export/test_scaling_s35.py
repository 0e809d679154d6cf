"""Exporting and reading back a compressed-tensors checkpoint cost time linear in layers
(found by probing, s35): reading scanned every tensor of the folder for each layer, and a
mixed-precision config (each scheme's group names its layers, hundreds of targets) was
matched module by target, and resolved module by one-target rule, on both sides. The costs
are counted (tensors looked at, name / class tests), not timed; the answers are checked
against compressed-tensors' own matching."""

import json
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")

import quantscope
from quantscope import QuantSpec
from quantscope.calibration import Calibration, Recipe, Role, Rule, calibrate
from quantscope.exporters import read as read_mod

torch.set_num_threads(1)


def _llama(layers: int):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=layers, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=50, head_dim=8)
    return transformers.LlamaForCausalLM(cfg).eval()


def _export(model, recipe, folder):
    cal = calibrate(model, None, recipe, progress=False)  # weights only: no data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantscope.export(cal, model, folder)
    return cal


_MIXED = Recipe((Rule(("re:.*self_attn.*",), weight=Role(QuantSpec("int8", "channel"), "minmax")),
                 Rule(("re:.*mlp.*",), weight=Role(QuantSpec("int8", "tensor"), "minmax"))))


class _Counting(dict):
    """The folder's tensors, counting the entries any pass over them looks at."""

    seen = 0

    def _count(self, it):
        for x in it:
            type(self).seen += 1
            yield x

    def items(self):
        return self._count(super().items())

    def keys(self):
        return self._count(super().keys())

    def values(self):
        return self._count(super().values())

    def __iter__(self):
        return self._count(super().__iter__())


def _tensors_looked_at(monkeypatch, folder) -> tuple[int, int]:
    """``(tensor entries looked at, tensors)`` while reading ``folder`` back."""
    monkeypatch.undo()  # the reader's own loader, not a counted one of an earlier call
    load = read_mod.load_checked_tensors
    held = {}

    def counted(*a, **k):
        held["t"] = _Counting(load(*a, **k))
        return held["t"]

    monkeypatch.setattr(read_mod, "load_checked_tensors", counted)
    _Counting.seen = 0
    Calibration.from_compressed_tensors(folder)
    return _Counting.seen, len(held["t"])


def test_reading_back_looks_at_each_tensor_a_few_times_not_once_per_layer(tmp_path,
                                                                         monkeypatch):
    """Each layer's tensors were found by a scan of the whole folder: layers x tensors."""
    seen = {}
    for n in (3, 6):
        _export(_llama(n), "w8a8-dynamic", tmp_path / f"ct{n}")
        seen[n] = _tensors_looked_at(monkeypatch, tmp_path / f"ct{n}")
    (small, small_tensors), (big, big_tensors) = seen[3], seen[6]
    assert big_tensors >= 1.8 * small_tensors
    assert big <= 2.2 * small, seen  # old code: about 4x
    assert big <= 6 * big_tensors, seen  # a few passes over the folder


class _Tests:
    """Counts the single name / class tests of compressed-tensors' matching
    (``match_name``, ``_match_class``) and quantscope's (``matches``), and regex runs."""

    def __init__(self, monkeypatch):
        import compressed_tensors.utils.match as ct

        from quantscope.calibration import recipe, recipe_dict

        self.n = 0
        for mod, name in ((ct, "match_name"), (ct, "_match_class"), (recipe_dict, "matches"),
                          (recipe, "matches")):
            monkeypatch.setattr(mod, name, self._counted(getattr(mod, name)))

    def _counted(self, fn):
        def wrapped(*a, **k):
            self.n += 1
            return fn(*a, **k)
        return wrapped


def test_a_mixed_precision_export_and_read_back_match_in_linear_time(tmp_path, monkeypatch):
    """Two schemes by layer: each group's targets name its layers. The export's ignore list
    tested each module against every target, the reader each module against every target
    and every one-target rule: layers^2 tests."""
    tests = _Tests(monkeypatch)
    count = {}
    for n in (4, 8):
        model = _llama(n)
        cal = calibrate(model, None, _MIXED, progress=False)
        tests.n = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantscope.export(cal, model, tmp_path / f"ct{n}")
        exported, tests.n = tests.n, 0
        back = Calibration.from_compressed_tensors(tmp_path / f"ct{n}")
        count[n] = (exported, tests.n)
        assert set(back.states) == set(cal.states)
        targets = [t for g in json.loads((tmp_path / f"ct{n}" / "config.json").read_text())[
            "quantization_config"]["config_groups"].values() for t in g["targets"]]
        assert len(targets) == len(cal.states) == 7 * n  # every layer named
    (export4, read4), (export8, read8) = count[4], count[8]
    assert export8 <= 2.2 * export4, count  # old code: about 4x
    assert read8 <= 2.2 * read4, count


# -- the answers are compressed-tensors' ------------------------------------------------------


class LinearBase(nn.Linear):  # vLLM's base class, which compressed-tensors reads as Linear
    pass


class _Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = LinearBase(2, 2)
        self.Linear = nn.Linear(2, 2)  # a module named like a class
        self.emb = nn.Embedding(3, 2)


def _odd_model():
    return nn.Sequential(nn.Linear(2, 2), _Odd(), nn.ModuleDict({"re:x": nn.Linear(2, 2)}))


_TARGET_LISTS = [
    [], ["Linear"], ["LinearBase"], ["Embedding", "0"], ["re:.*inner$"], ["re:1\\."],
    ["1.Linear", "re:2"], ["re:x"], ["Module"], ["_Odd", "re:.*emb"], ["re:1", "Linear"],
    ["nomatch", "re:nomatch"], ["re:(?:0|2)"],
]


@pytest.mark.parametrize("targets", _TARGET_LISTS)
@pytest.mark.parametrize("ignore", [None, [], ["1.inner"], ["re:.*Linear"], ["Embedding"]])
def test_targets_and_match_named_select_what_compressed_tensors_selects(targets, ignore):
    from compressed_tensors.utils.match import is_match, match_named_modules

    from quantscope.exporters.ct_match import Targets, match_named

    model = _odd_model()
    take = Targets(targets)
    for name, module in model.named_modules():
        assert take(name, module) == is_match(name, module, targets), (name, targets)
    assert [n for n, _ in match_named(model, targets, ignore)] == \
        [n for n, _ in match_named_modules(model, targets, ignore)]


def test_the_exported_ignore_list_is_the_one_compressed_tensors_matching_gives(tmp_path):
    """The completed ignore list, in order, as compressed-tensors' ``is_match`` finds it."""
    from compressed_tensors.utils.match import is_match

    from quantscope.exporters.ct_compress import _complete_ignore

    class _Config:
        def __init__(self, targets, ignore):
            self.config_groups = {"g": type("S", (), {"targets": targets})()}
            self.ignore = ignore

    model = _odd_model()
    model[0].quantization_scheme = object()  # quantized: never listed
    for targets in _TARGET_LISTS:
        for ignore in (None, ["1.emb"], ["2.re:x", "2.re:x"]):
            cfg = _Config(targets, list(ignore) if ignore else ignore)
            _complete_ignore(cfg, model)
            want = list(ignore or [])
            for name, module in model.named_modules():
                if (name and name not in want and not hasattr(module, "quantization_scheme")
                        and is_match(name, module, targets)):
                    want.append(name)
            assert cfg.ignore == want, (targets, ignore)
