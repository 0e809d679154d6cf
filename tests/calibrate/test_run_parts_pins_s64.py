"""Pins found by a mutation round (s64) on parts of calibrate's pass, called directly on tiny
inputs: how batches are checked, peeked and walked (``run.batches``), the sampled activation
rows and their memory plan (``run.samples``), the first non-finite batch's bookkeeping and
error (``run.non_finite``), what the outliers' steps count as a batch holding a value
(``run.outliers``), and the warnings for options and rules a run never used
(``run.unused_options``)."""

from __future__ import annotations

import warnings
from collections import OrderedDict, UserDict, namedtuple
from types import SimpleNamespace

import pytest
import torch
from tiny_models import llama
from torch import nn

from quantscope import QuantSpec, presets
from quantscope.calibration.options import MoE, Options, Outliers, Runtime, Sampling
from quantscope.calibration.recipe import Recipe, Role, Rule
from quantscope.calibration.run import non_finite, outliers, unused_options
from quantscope.calibration.run.batches import (
    batch_arguments,
    batch_count,
    check_batches,
    check_length,
    input_name,
    length_checked,
    map_tensors,
    module_input,
    nan_parameter,
    peek,
    tensors_in,
)
from quantscope.calibration.run.disk_names import split_names
from quantscope.calibration.run.samples import Capacity, RowSample, capacities, generator_for

_INT8 = QuantSpec("int8", "channel:0")
_ACT = QuantSpec("int8", "tensor")


# --- batches ----------------------------------------------------------------------------


def test_batch_arguments_name_positions_from_zero_and_a_lone_input_input():
    x, y = torch.ones(1), torch.zeros(1)
    assert [n for n, _ in batch_arguments((x, y))] == ["argument 0", "argument 1"]
    assert batch_arguments(x) == [("input", x)]


def test_check_batches_refuses_one_user_dict_batch():
    """A tokenizer's ``BatchEncoding`` (a ``UserDict``, not a dict) is one batch, not many."""
    with pytest.raises(TypeError, match="got one UserDict"):
        check_batches(UserDict(input_ids=torch.ones(1, 2, dtype=torch.long)))


def test_check_batches_refuses_bytes_and_hints_unbind_for_one_tensor():
    with pytest.raises(TypeError, match="bytes"):
        check_batches(b"abc")
    with pytest.raises(TypeError, match=r"list\(t\.unbind\(0\)\)"):
        check_batches(torch.ones(2, 3))


def test_check_batches_cuts_a_long_repr_to_37_characters_and_dots():
    """A repr of 40 characters is shown whole; a longer one as its first 37 and ``...``."""
    with pytest.raises(TypeError) as whole:
        check_batches(10**39)  # 40 digits
    assert str(whole.value).endswith(f"int {10**39}")
    with pytest.raises(TypeError) as cut:
        check_batches(10**45)
    assert str(cut.value).endswith(f"int {str(10**45)[:37]}...")


def test_length_checked_without_lengths_returns_the_batches_unchecked():
    batches = [torch.zeros(2, 0)]
    assert length_checked(batches, lengths=False) is batches
    with pytest.raises(ValueError):
        length_checked(batches)


def test_a_generator_read_twice_numbers_its_batches_on():
    """A stream read again goes on where the first read stopped: its batch numbers too."""
    stream = length_checked(iter([torch.ones(2, 3), torch.zeros(2, 0)]))
    for _ in stream:
        break
    with pytest.raises(ValueError, match="batch 1's"):
        list(stream)


def test_a_length_checked_stream_is_as_true_as_its_source():
    assert not length_checked(range(0))
    assert length_checked(range(2))


def test_check_length_refuses_empty_sequences_but_not_zero_rows():
    check_length(torch.zeros(0, 5), 0)  # a batch of 0 rows: the model says
    with pytest.raises(ValueError, match=r"dimension 1 is empty \(sequences of 0 tokens\)"):
        check_length(torch.zeros(2, 0), 3)
    with pytest.raises(ValueError) as deeper:
        check_length(torch.zeros(2, 3, 0), 3)
    assert "dimension 2 is empty," in str(deeper.value)


def test_check_length_reads_the_main_input_first_and_only_one_input():
    with pytest.raises(ValueError, match="input_ids"):
        check_length({"attention_mask": torch.ones(2, 3), "input_ids": torch.zeros(2, 0)}, 0)
    check_length((torch.ones(2, 3), torch.zeros(2, 0)), 0)  # the first tensor is the input


def test_batch_count_of_a_generator_is_none():
    assert batch_count(x for x in range(3)) is None
    assert batch_count([1, 2]) == 2


def test_peek_without_a_wanted_batch_gives_the_first():
    a, b = torch.ones(1), torch.ones(2)
    first, rest = peek([a, b], lambda _: False)
    assert first is a
    first, rest = peek(iter([a, b]), lambda _: False)
    assert first is a and [t.numel() for t in rest] == [1, 2]


def test_a_peeked_stream_keeps_its_sources_length():
    first, rest = peek(range(3))
    assert first == 0 and len(rest) == 3 and list(rest) == [0, 1, 2]


_Pair = namedtuple("_Pair", "a b")


def test_map_tensors_keeps_a_namedtuple_and_makes_a_dict_subclass_a_dict():
    out = map_tensors(lambda t: t + 1, _Pair(torch.zeros(1), 5))
    assert type(out) is _Pair and out.a.item() == 1 and out.b == 5
    out = map_tensors(lambda t: t + 1, OrderedDict(x=torch.zeros(1)))
    assert type(out) is dict and out["x"].item() == 1


def test_tensors_in_a_list_holding_itself_walks_it_once():
    t = torch.ones(1)
    value = [t]
    value.append(value)
    assert list(tensors_in(value)) == [t]


class _Both(nn.Module):
    def forward(self, x, *, y=None):
        return x


class _KeywordOnly(nn.Module):
    def forward(self, *, y):
        return y


def test_input_name_prefers_a_positional_parameter_to_a_keyword_only_one():
    assert input_name(_Both()) == "x"
    assert input_name(_KeywordOnly()) == "y"


def test_module_input_reads_the_keyword_and_keeps_a_nested_tensor_without_rows():
    t = torch.ones(2)
    assert module_input((), {"x": t}, "x") is t
    nested = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(1, 3)])
    assert module_input((nested,), {}, "x", rows=False) is nested
    assert module_input((nested,), {}, "x").shape == (3, 3)


def test_nan_parameter_skips_a_meta_parameter_and_names_the_bad_one():
    model = nn.Sequential(nn.Linear(2, 2, device="meta"), nn.Linear(2, 2))
    assert nan_parameter(model) is None
    with torch.no_grad():
        model[1].bias[0] = float("inf")
    assert nan_parameter(model) == "1.bias"


# --- samples ----------------------------------------------------------------------------


def test_capacities_split_the_budget_equally_where_no_width_is_known():
    caps = capacities({"a": None, "b": None}, 10, 1000)
    assert caps == {"a": 10, "b": 10}
    assert {k: c.budget for k, c in caps.items()} == {"a": 500, "b": 500}


def test_capacities_plan_an_unknown_width_at_the_widest_known_one():
    """(2 + 8 + 8) * 4 bytes a row: 720 bytes keep 10 rows; the unknown one 10 * 8 * 4."""
    caps = capacities({"a": 2, "b": 8, "c": None}, 1000, 720)
    assert caps == {"a": 10, "b": 10, "c": 10}
    assert {k: c.budget for k, c in caps.items()} == {"a": 80, "b": 320, "c": 320}


def test_generator_for_depends_on_the_seed_and_the_name():
    def draw(seed, name):
        return torch.randperm(1000, generator=generator_for(seed, name)).tolist()
    assert draw(0, "a") == draw(0, "a")
    assert draw(0, "a") != draw(1, "a")
    assert draw(0, "a") != draw(0, "b")


def test_a_stream_keeps_at_least_one_row_a_batch_under_eight_rows_of_capacity():
    s = RowSample(4, None, torch.Generator().manual_seed(0))
    s.add(torch.ones(10, 3))
    assert s.count == 1
    s.add(torch.ones(10, 3))
    assert s.count == 2


def test_a_narrow_dtype_is_planned_at_four_bytes_a_value():
    """bfloat16 rows keep what the float32 plan's bytes hold: 400 // (10 * 4) rows."""
    s = RowSample(Capacity(100, 400), 1, torch.Generator().manual_seed(0))
    s.add(torch.ones(200, 10, dtype=torch.bfloat16))
    assert s.count == 10


def test_a_budget_never_raises_the_planned_rows_and_keeps_at_least_one():
    s = RowSample(Capacity(5, 10**6), 1, torch.Generator().manual_seed(0))
    s.add(torch.ones(100, 1))
    assert s.count == 5
    s = RowSample(Capacity(5, 1), 1, torch.Generator().manual_seed(0))
    s.add(torch.ones(100, 10))
    assert s.count == 1 and s.rows().shape == (1, 10)


def test_a_wider_dtype_drops_the_rows_past_its_capacity():
    """8 rows of 4 float32 in 128 bytes; float64 halves them: 6 kept rows become 4."""
    s = RowSample(Capacity(8, 128), 4, torch.Generator().manual_seed(0))
    for _ in range(3):
        s.add(torch.ones(10, 4))
    assert s.count == 6
    s.add(torch.ones(10, 4, dtype=torch.float64))
    assert s.count == 4 and s.rows().shape == (4, 4) and s.rows().dtype == torch.float64


def test_nbytes_counts_bytes_not_values():
    s = RowSample(4, 1, torch.Generator().manual_seed(0))
    assert s.nbytes == 0
    s.add(torch.ones(4, 3, dtype=torch.float64))
    assert s.nbytes == 4 * 3 * 8


# --- non_finite -------------------------------------------------------------------------


def _holder(flag: bool = False):
    return SimpleNamespace(non_finite="error", seen_non_finite=torch.tensor(flag))


def test_first_numbers_the_batch_with_batch_index_and_first_of_none_is_none():
    rows = [non_finite.Watched("a", "input", "minmax", _holder())]
    bad = non_finite.FirstBad(rows, batch_index=lambda k: 10 + k)
    bad.end_batch()
    rows[0].holder.seen_non_finite.fill_(True)
    bad.end_batch()
    assert bad.first() == (0, 11)
    none = non_finite.exchanged(None)
    assert non_finite.first_of([none, none]) is None


def test_the_error_names_the_models_bad_parameter_and_a_dynamic_roles_option():
    rows = [non_finite.Watched("l0", "input", "minmax", _holder()),
            non_finite.Watched("l1", "input", "rt", _holder(), runtime=True)]
    bad = non_finite.FirstBad(rows)
    model = nn.Linear(1, 1)
    with torch.no_grad():
        model.weight.fill_(float("nan"))
    observed = str(bad.error(0, 2, model))
    assert "parameter 'weight' holds NaN or inf" in observed
    assert "dynamic role" not in observed and "'non_finite': 'ignore'" not in observed
    runtime = str(bad.error(1, 2))
    assert "(dynamic role, observer 'rt')" in runtime
    assert "options={'non_finite': 'ignore'}" in runtime


def _slot(observers, runtime_check=None):
    return SimpleNamespace(layer="l", role="input", observers=observers,
                           runtime_check=runtime_check, seen_non_finite=torch.tensor(True))


def test_watched_adds_a_slot_flag_only_where_no_observer_raises():
    observed = _slot({("minmax",): _holder()}, runtime_check=("l", "rt"))
    ignoring = SimpleNamespace(non_finite="ignore", seen_non_finite=torch.tensor(False))
    runtime = _slot({("minmax",): ignoring}, runtime_check=("l", "rt"))
    plain = _slot({("minmax",): ignoring})
    rows = non_finite.watched([observed, runtime, plain])
    assert [(r.observer, r.runtime) for r in rows] == [("minmax", False), ("rt", True)]
    assert observed.seen_non_finite is None and plain.seen_non_finite is None
    assert runtime.seen_non_finite.dtype == torch.bool and not runtime.seen_non_finite


def test_watched_takes_no_holder_without_the_error_mode():
    rows = non_finite.watched([_slot({("x",): SimpleNamespace(seen_non_finite=torch.tensor(0))})])
    assert rows == []


@pytest.mark.parametrize("bad", [float("-inf"), float("nan"), float("inf")])
def test_flag_tensor_sets_the_flag_for_any_non_finite_value(bad):
    slot = SimpleNamespace(seen_non_finite=torch.zeros((), dtype=torch.bool))
    non_finite.flag_tensor(torch.tensor([1.0, 2.0]), slot)
    assert not slot.seen_non_finite
    non_finite.flag_tensor(torch.tensor([1.0, bad, 2.0]), slot)
    assert slot.seen_non_finite


# --- outliers ---------------------------------------------------------------------------


def test_holds_value_reads_a_batch_without_tensors_as_holding_one():
    assert outliers._holds_value({"text": "abc"})
    assert outliers._holds_value((torch.zeros(0, 3), torch.ones(2, 3)))
    assert not outliers._holds_value((torch.zeros(0, 3), torch.zeros(0)))


def test_lowest_holder_is_the_lowest_rank_holding_most_and_none_where_none_does(monkeypatch):
    held = {}
    monkeypatch.setattr(outliers.qd, "group_device", lambda group: "cpu")
    monkeypatch.setattr(outliers.qd, "all_gather", lambda t, group: torch.tensor(held["v"]))
    held["v"] = [[1], [2], [2]]
    assert outliers._lowest_holder(1, None) == 1
    held["v"] = [[0], [0]]
    assert outliers._lowest_holder(0, None) is None


def test_a_run_that_raises_leaves_the_weights_unsmoothed():
    model, batches = llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def boom(_):
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        outliers.around(model, batches, boom, Outliers(smooth=0.5), Runtime())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# --- unused options ---------------------------------------------------------------------


def _weight_only(kv_cache=None):
    return {"w": Recipe((Rule(("Linear",), weight=Role(_INT8)),), kv_cache=kv_cache)}


def _messages(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught]


def test_weight_only_warns_of_a_sample_budget_and_a_missing_policy():
    opts = Options(sampling=Sampling(budget_mb=1.0), runtime=Runtime(missing="error"))
    said = _messages(lambda: unused_options.warn_unused_activation_options(_weight_only(), opts))
    assert len(said) == 2
    assert "budget_mb=1.0" in said[0] and "Runtime(missing='error')" in said[1]


def test_a_kv_cache_role_is_an_activation_role():
    opts = Options(sampling=Sampling(tokens=16))
    said = _messages(lambda: unused_options.warn_unused_activation_options(
        _weight_only(kv_cache=Role(QuantSpec("fp8_e4m3", "tensor"))), opts))
    assert said == []


def test_moe_without_experts_is_said_once():
    said = _messages(lambda: unused_options.warn_unused_moe(_weight_only(), MoE(min_tokens=3),
                                                             has_experts=False))
    assert len(said) == 1 and "no mixture-of-experts layer" in said[0]


def test_a_local_dynamic_role_has_a_static_range_for_min_tokens():
    local = {"n": Recipe((Rule(("Linear",), weight=Role(_INT8),
                               input=Role(presets.NVFP4, dynamic="local")),))}
    said = _messages(lambda: unused_options.warn_unused_moe(local, MoE(min_tokens=3), True))
    assert said == []
    said = _messages(lambda: unused_options.warn_unused_moe(_weight_only(), MoE(min_tokens=3),
                                                             True))
    assert len(said) == 1 and "min_tokens shrinks" in said[0]


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)
        self.n1, self.n2 = nn.LayerNorm(2), nn.LayerNorm(2)


def test_idle_rules_say_a_lost_target_once_and_name_the_first_roleless_module():
    rec = Recipe((Rule(("Linear",), weight=Role(_INT8)), Rule(("nope",), weight=Role(_INT8)),
                  Rule(("LayerNorm",), weight=Role(_INT8))), name="r")
    said = _messages(lambda: unused_options.warn_idle_rules(_Two(), {"r": rec}))
    assert len(said) == 1
    assert said[0].count("nope") == 1 and "rules[1]" not in said[0]
    assert "rules[2]" in said[0] and "'n1' (LayerNorm)" in said[0] and "'n2'" not in said[0]


def test_idle_rules_say_nothing_of_a_recipe_that_takes_no_module():
    rec = Recipe((Rule(("nope",), weight=Role(_INT8)),), name="r")
    assert _messages(lambda: unused_options.warn_idle_rules(_Two(), {"r": rec})) == []


# --- disk names -------------------------------------------------------------------------


def test_split_names_reads_only_the_tensors_of_a_layers_quantized_roles():
    """PhiMoE's router: ``gate.weight`` on disk, its input's tensors under ``router``; a layer
    with no weight or input role written (a dynamic input only) writes no such tensor."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.PhimoeConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1,
                                    num_local_experts=2, vocab_size=64)
    model = transformers.PhimoeForCausalLM(cfg)
    router = "model.layers.0.mlp.router"
    assert split_names(model, {router: set()}) == {}
    assert split_names(model, {router: {"output"}}) == {}
    disk = "model.layers.0.block_sparse_moe"
    assert split_names(model, {router: {"input"}}) == {router: (f"{disk}.gate", f"{disk}.router")}
