"""Session 49's calibration-API probe: rules that take nothing are warned about, a first batch
of 0 rows no longer leaves SmoothQuant and keep_float nothing to read, and three errors name
what they are about. Session 51 pinned what session 50's mutants showed no test held: the
whole warning text, a glob target that matches, which batch holds a value, and peek."""

import copy
import importlib.util
import warnings

import pytest
import torch
from torch import nn

import quantscope
from quantscope import QuantSpec
from quantscope.calibration import Outliers, Recipe, Role, Rule, calibrate_many
from quantscope.calibration.run.batches import peek
from quantscope.calibration.run.outliers import _holds_value

W8 = Role(QuantSpec("int8", "channel"), "minmax")
W4 = Role(QuantSpec("int4", "channel"), "minmax")


class TwoProj(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.down_proj = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return self.down_proj(torch.relu(self.q_proj(x)))


class Blocked(nn.Module):
    """TwoProj's layers, down_proj inside a container ``Block`` that holds no weight itself."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.block = nn.Linear(16, 16), nn.Sequential(nn.Linear(16, 16))
        self.block.__class__ = type("Block", (nn.Sequential,), {})

    def forward(self, x):
        return self.block(torch.relu(self.q_proj(x)))


def _calibrate(recipe, model=None, batches=None):
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = quantscope.calibrate(model or TwoProj(), batches or [torch.randn(4, 16)], recipe,
                                 progress=False)
    return c, [str(w.message) for w in caught if "recipe" in str(w.message)], caught


@pytest.mark.parametrize("recipe, said", [
    (Recipe((Rule(("q_proj",), weight=W8), Rule(("down_prj",), weight=W4))),
     "targets ['down_prj'] match no module"),
    (Recipe((Rule(("q_proj", "down_prj"), weight=W8),)), "targets ['down_prj'] match no module"),
    (Recipe((Rule(("q_proj",), weight=W8), Rule(("re:.*dwn_proj$",), weight=W4))),
     "targets ['re:.*dwn_proj$'] match no module"),
    (Recipe((Rule(("q_proj",), weight=W8), Rule(("*.dwn*",), weight=W4))),
     "targets ['*.dwn*'] match no module"),
    (Recipe((Rule(("re:.*_proj$", "TwoProj"), weight=W8),)),  # the root is never a layer
     "targets ['TwoProj'] match no module"),
    (Recipe((Rule(("Linear",), weight=W8), Rule(("down_proj",), weight=W4))),
     ("rules[1] (targets ['down_proj']) takes no module: each module it matches is ignored or "
      "taken by an earlier rule")),
    (Recipe((Rule(("q_proj",), weight=W8), Rule(("down_proj",), weight=W4)),
            ignore=("down_proj",)), "rules[1] (targets ['down_proj']) takes no module"),
    # a container class matched: its layers are not its (s50: it was silent beside another rule)
    (Recipe((Rule(("Block",), weight=W4), Rule(("q_proj",), weight=W8))),
     ("rules[0] (targets ['Block']) takes no module: the modules it matches take none of its "
      "roles: 'block' (Block) holds no weight")),
])
def test_a_rule_or_target_taking_nothing_is_warned_naming_it(recipe, said):
    c, told, caught = _calibrate(recipe, Blocked() if "Block" in str(recipe) else None)
    assert sorted(c.states)  # the rest calibrated
    assert len(told) == 1 and said in told[0], told
    assert told[0].startswith("calibrate: recipe 'custom': ")
    assert {w.filename for w in caught if "recipe" in str(w.message)} == {__file__}


@pytest.mark.parametrize("recipe", [
    Recipe((Rule(("down_proj",), weight=W4), Rule(("Linear",), weight=W8))),  # narrower first
    Recipe((Rule(("Linear",), weight=W8),), ignore=("down_prj",)),  # an ignore entry: silent
    "w8a8",
    # a glob or re: target that matches is no misspelt name (a glob is not looked up by name)
    Recipe((Rule(("*_proj",), weight=W8),)),
    Recipe((Rule(("re:.*_proj$",), weight=W8),)),
    Recipe((Rule(("q_pro?",), weight=W8), Rule(("re:down",), weight=W4))),
])
def test_rules_that_all_take_a_module_are_not_warned(recipe):
    c, told, _ = _calibrate(recipe)
    assert told == [] and sorted(c.states) == ["down_proj", "q_proj"]


class TwoBlocks(nn.Module):
    """Two containers ``Block`` (no weight of their own), each holding a Linear."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(16, 16)
        self.a, self.b = nn.Sequential(nn.Linear(16, 16)), nn.Sequential(nn.Linear(16, 16))
        self.a.__class__ = self.b.__class__ = type("Block", (nn.Sequential,), {})

    def forward(self, x):
        return self.b(self.a(self.q_proj(x)))


_TYPO = ("targets {} match no module (a misspelt name? a target is a module's name, a class "
         "name, or a glob / re: pattern)")
_SHADOWED = ("rules[{}] (targets {}) takes no module: each module it matches is ignored or "
             "taken by an earlier rule (the first rule that matches a module takes it: put a "
             "narrower rule first)")


@pytest.mark.parametrize("recipe, model, said", [
    # a rule whose only target is misspelt: said once, as a target, not again as a rule
    (Recipe((Rule(("q_proj",), weight=W8), Rule(("down_prj",), weight=W4))), TwoProj,
     [_TYPO.format(["down_prj"])]),
    # one target misspelt, the other taken by an earlier rule: the rule still takes nothing
    (Recipe((Rule(("Linear",), weight=W8), Rule(("down_proj", "dwn_proj"), weight=W4))),
     TwoProj, [_TYPO.format(["dwn_proj"]), _SHADOWED.format(1, ["down_proj", "dwn_proj"])]),
    # two modules matched in vain: the first is named
    (Recipe((Rule(("Block",), weight=W4), Rule(("Linear",), weight=W8))), TwoBlocks,
     [("rules[0] (targets ['Block']) takes no module: the modules it matches take none of its "
       "roles: 'a' (Block) holds no weight for the weight role (the layers in it do)")]),
])
def test_idle_rules_warning_says_each_thing_once(recipe, model, said):
    """The whole warning (s50's mutants W02 / W04 / W10: a misspelt rule said twice, a rule
    with a misspelt and a shadowed target not said, the last module matched named)."""
    _, told, _ = _calibrate(recipe, model())
    assert told == [f"calibrate: recipe 'custom': {'; '.join(said)}"]


def test_a_recipe_taking_nothing_still_raises_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="no module matches targets"):
            quantscope.calibrate(TwoProj(), [torch.randn(2, 16)],
                                 Recipe((Rule(("k_proj",), weight=W8),)), progress=False)


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(16, 16) for _ in range(3))

    def forward(self, h):
        return self.q_proj(h) * self.k_proj(h).sigmoid() + self.v_proj(h)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.self_attn = nn.LayerNorm(16), Attn()

    def forward(self, x):
        return x + self.self_attn(self.input_layernorm(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks, self.head = nn.Sequential(Block(), Block()), nn.Linear(16, 4)

    def forward(self, x):  # (a dict batch {"x": ...} is passed as keywords)
        return self.head(self.blocks(x))


def _smoothable():
    torch.manual_seed(0)
    return Net().eval()


def _real_batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 16, generator=g) * torch.linspace(0.1, 20, 16) for _ in range(3)]


def _outcome(batches, outliers):
    model = _smoothable()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = quantscope.calibrate(model, batches, "w8a8", outliers=outliers, progress=False)
    return (c.info.get("smooth"), c.info.get("keep_float"),
            {k: v.tolist() for k, v in c.smoothing.items()},
            {(n, r): s.qparams and s.qparams.scale.tolist() for n, rs in c.states.items()
             for r, s in rs.items()})


@pytest.mark.parametrize("outliers", [Outliers(smooth=0.5), Outliers(keep_float=2)])
@pytest.mark.parametrize("empty", [torch.randn(0, 16), (torch.randn(0, 16),),
                                   {"x": torch.randn(0, 16)}])
@pytest.mark.parametrize("stream", [False, True])
def test_leading_batches_of_zero_rows_do_not_empty_smoothing_or_keep_float(outliers, empty,
                                                                           stream):
    real = _real_batches()
    want = _outcome(real, outliers)
    head = [copy.deepcopy(empty), copy.deepcopy(empty)]
    if isinstance(empty, dict):  # a model called with a dict batch takes its keys
        real = [{"x": b} for b in real]
        want = _outcome(real, outliers)
    batches = head + real
    got = _outcome(iter(batches) if stream else batches, outliers)
    assert got == want
    assert (want[0] or {}).get("skipped", []) == [] and (want[2] or want[1]["tensors"])


@pytest.mark.parametrize("stream", [False, True])
def test_only_zero_row_batches_read_the_first_as_before(stream):
    zeros = [torch.randn(0, 16)] * 2
    # nothing to measure anywhere: smoothing skips every pair as it did
    c = _outcome(iter(zeros) if stream else zeros, Outliers(smooth=0.5))
    assert c[0]["smoothed"] == [] and c[2] == {}
    # keep_float ranks on the first one, a list as a stream (s50's mutant O11: a list of them
    # raised "keep_float needs a batch")
    c = _outcome(iter(zeros) if stream else zeros, Outliers(keep_float=2))
    assert c[1]["tensors"] == [] and c[2] == {}


def test_a_batch_holds_a_value_where_any_of_its_tensors_does():
    """s50's mutants O01 / O02: one tensor holding elements is enough (an empty extra input
    beside the real one); a batch holding no tensor has nothing to tell by and counts as
    holding one."""
    real, empty = torch.randn(4, 16), torch.zeros(0, 3)
    assert _holds_value((real, empty)) and _holds_value((empty, real))
    assert _holds_value({"input_ids": torch.ones(2, 8, dtype=torch.long), "extra": empty})
    assert not _holds_value((torch.zeros(0, 16), {"x": empty}))
    assert _holds_value({"text": ["a prompt"]}) and _holds_value([])
    first, rest = peek([{"x": empty}, {"x": empty, "y": real}, {"x": real}], _holds_value)
    assert first.keys() == {"x", "y"} and len(rest) == 3


def test_peek_reads_a_stream_no_further_than_the_first_batch_holding_a_value():
    pulled = []

    def stream():
        for i in range(1000):
            pulled.append(i)
            yield {"text": [f"prompt {i}"]}  # no tensor: the first one is read (s50's O01)

    first, rest = peek(stream(), _holds_value)
    assert first == {"text": ["prompt 0"]} and pulled == [0]
    assert next(iter(rest)) is first and pulled == [0]


def test_peek_keeps_a_streams_batches_before_the_first_holding_a_value():
    """Every batch read past comes back, in order (s50's O12 dropped the 0-row ones)."""
    z0, z1, a, b = torch.zeros(0, 16), torch.zeros(0, 16), torch.ones(2, 16), torch.ones(3, 16)
    first, rest = peek(iter([z0, z1, a, b]), _holds_value)
    assert first is a
    assert [id(x) for x in rest] == [id(z0), id(z1), id(a), id(b)]


@pytest.mark.parametrize("stream", [False, True])
def test_a_nan_batch_after_zero_row_ones_is_named_by_its_place(stream):
    """The leading 0-row batches are calibrated too, so a batch is numbered as in the list."""
    real = _real_batches()
    real[1][0, 0] = float("nan")
    batches = [torch.randn(0, 16), torch.randn(0, 16), *real]
    with pytest.raises(ValueError, match=r"calibration batch 3 \(counting from 0\) brought NaN"):
        _outcome(iter(batches) if stream else batches, Outliers(keep_float=2))


def test_calibrate_many_names_recipes_of_a_wrong_type():
    for bad in (None, 5):
        with pytest.raises(TypeError, match=r"calibrate: recipes must be a preset name, a "
                                            r"Recipe, a list of them or a dict .* got "
                                            + type(bad).__name__):
            calibrate_many(TwoProj(), [torch.randn(2, 16)], bad, progress=False)
    got = calibrate_many(TwoProj(), [torch.randn(2, 16)], (r for r in ["w8a8"]),
                         progress=False)  # any iterable of recipes, as before
    assert list(got) == ["w8a8"]


def test_auto_is_read_in_any_case_as_the_other_observer_names():
    batches = [torch.randn(8, 16) for _ in range(2)]
    torch.manual_seed(0)
    want = quantscope.calibrate(TwoProj(), batches, "w8a8", observer="auto", progress=False)
    for spelt in ("AUTO", "Auto"):
        torch.manual_seed(0)
        got = quantscope.calibrate(TwoProj(), batches, "w8a8", observer=spelt, progress=False)
        assert got.info["auto"]["chose"] == want.info["auto"]["chose"]
        assert got.info["auto"]["scores"] == want.info["auto"]["scores"]
    assert Role(QuantSpec("int8", "tensor"), "AuTo").observer == "auto"


def test_auto_in_any_case_builds_the_recipes_auto_builds():
    """preset(), scheme() and Recipe.with_observer() read "AUTO" as "auto" (they compared
    the name with AUTO before any Role folded its case: "unknown observer 'AUTO'")."""
    from quantscope.calibration.recipe import preset, scheme

    builders = [lambda o: preset("w8a8", o), lambda o: preset("w8a8", o, kv_cache="fp8"),
                lambda o: preset("w8a8").with_observer(o)]
    if importlib.util.find_spec("compressed_tensors"):
        builders.append(lambda o: scheme("W8A8", o))
    for build in builders:
        assert build("AUTO") == build("Auto") == build("auto")


def test_an_option_object_of_the_wrong_kind_is_named_as_its_class():
    from quantscope.calibration import Sampling

    with pytest.raises(TypeError, match=r"calibrate: auto must be Auto\(\.\.\.\), got Sampling"):
        quantscope.calibrate(TwoProj(), [torch.randn(2, 16)], "w8a8", auto=Sampling(),
                             progress=False)
