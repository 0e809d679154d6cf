"""Pins from mutation round s68 (letter K) on ``calibration/role_observers.py``,
``_jsonfile.py`` and ``_numerics.py``: which observer and options a role keeps when a recipe is
built from one observer name (``folded``, ``weight_observer``, ``unknown_options``,
``observed``, ``check_taken``, ``ct_observer``), the reader's errors and messages
(``read_json``, ``parse_json``, ``parser_limit``), and the device-independent arithmetic
(``as_float32``'s signs and subnormals, ``expansion_overflow``'s answer, ``true_div``,
``upload``'s dtype). Each test fails on a mutant that no earlier test killed."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from quantscope import presets
from quantscope._jsonfile import NotJSON, parse_json, parser_limit, read_json
from quantscope._numerics import as_float32, expansion_overflow, true_div, upload
from quantscope.calibration.recipe import Role
from quantscope.calibration.role_observers import (
    check_taken,
    ct_observer,
    folded,
    observed,
    unknown_options,
    weight_observer,
)

_SPEC = presets.INT8_PER_TENSOR


# --- role_observers -----------------------------------------------------------------------


def test_folded_spells_auto_and_registry_names_as_registered():
    """``auto`` in any case is AUTO, a registry name its registered spelling; a name the
    registry does not know, and a non-string, stay as given (refused where made)."""
    assert folded("AUTO") == folded("Auto") == "auto"
    assert folded("MinMax") == "minmax"
    assert folded("TORCH.AO:minmaxobserver") == "torch.ao:MinMaxObserver"
    assert folded("NoSuchObserver") == "NoSuchObserver"
    assert folded(None) is None


@pytest.mark.parametrize("name, weight", [("minmax", "memoryless_minmax"),
                                          ("mse", "memoryless_mse"),
                                          ("memoryless_mse", "memoryless_mse"),
                                          ("percentile", "memoryless_minmax"),
                                          ("auto", "auto")])
def test_weight_observer_takes_the_memoryless_variant(name, weight):
    assert weight_observer(name) == weight


def test_unknown_options_are_sorted_and_only_keyword_only_arguments_count():
    options = {"zeta": 1, "spec": 2, "non_finite": "ignore", "alpha": 3}
    assert unknown_options("minmax", options) == ["alpha", "spec", "zeta"]


def test_a_histogram_observers_weights_keep_only_the_shared_options():
    role = Role(_SPEC, "minmax")
    got = observed(role, "weight", "percentile", {"bins": 64, "non_finite": "ignore"})
    assert got.observer == "memoryless_minmax"
    assert dict(got.options) == {"non_finite": "ignore"}


def test_a_role_drops_its_own_options_the_new_observer_does_not_take():
    role = Role(_SPEC, "mse", options={"maxshrink": 0.5, "non_finite": "ignore"})
    got = observed(role, "input", "minmax", {})
    assert got.observer == "minmax"
    assert dict(got.options) == {"non_finite": "ignore"}


def test_the_recipes_option_wins_over_the_roles_own():
    role = Role(_SPEC, "minmax", options={"non_finite": "error"})
    got = observed(role, "input", "mse", {"non_finite": "ignore"})
    assert (got.observer, dict(got.options)) == ("mse", {"non_finite": "ignore"})


def test_a_run_time_role_keeps_its_observer_and_takes_the_recipes_option():
    role = Role(presets.INT8_PER_TOKEN, "memoryless_minmax", dynamic=True,
                options={"non_finite": "error"})
    got = observed(role, "input", "mse", {"non_finite": "ignore", "maxshrink": 0.5})
    assert (got.observer, dict(got.options)) == ("memoryless_minmax", {"non_finite": "ignore"})


def test_a_local_role_is_calibrated_so_it_runs_the_recipes_observer():
    role = Role(presets.NVFP4, "minmax", dynamic="local")
    assert observed(role, "input", "mse", {}).observer == "mse"


def test_only_a_kv_cache_role_keeps_its_observer_under_auto():
    assert observed(Role(_SPEC, "minmax"), "input", "auto", {}).observer == "auto"
    assert observed(Role(_SPEC, "minmax"), "key", "auto", {}).observer == "minmax"
    assert observed(Role(_SPEC, "minmax"), "key", "mse", {}).observer == "mse"


def test_check_taken_says_an_option_no_role_keeps_would_be_dropped():
    with pytest.raises(ValueError, match=r"^w: option 'bins' .*'memoryless_minmax'.*"
                                         r"it would be dropped$"):
        check_taken("w", [("weight", Role(_SPEC), "percentile")], {"bins": 64})


def test_check_taken_says_an_option_a_role_keeps_would_fail_calibrate():
    with pytest.raises(ValueError, match=r"^w: option 'bogus' .*calibrate would fail on it$"):
        check_taken("w", [("input", Role(_SPEC), "minmax")], {"bogus": 1})


def test_check_taken_names_a_run_time_role_as_such():
    role = Role(presets.INT8_PER_TOKEN, "memoryless_minmax", dynamic=True)
    with pytest.raises(ValueError, match="run-time input observer 'memoryless_minmax'"):
        check_taken("w", [("input", role, "minmax")], {"bogus": 1})


def test_check_taken_refuses_an_option_one_role_takes_and_another_would_fail_on():
    runs = [("input", Role(_SPEC), "percentile"), ("output", Role(_SPEC), "minmax")]
    with pytest.raises(ValueError, match="option 'bins' is not one the output observer "
                                         "'minmax' takes"):
        check_taken("w", runs, {"bins": 64})


def test_check_taken_leaves_a_toolkit_classes_options_to_it():
    assert check_taken("w", [("input", Role(_SPEC), "some.toolkit:Observer")],
                       {"anything": 1}) is None  # unchecked: no error


def test_check_taken_says_when_no_role_is_calibrated():
    with pytest.raises(ValueError, match=r"\(none is calibrated\); it would be dropped"):
        check_taken("w", [], {"non_finite": "ignore"})


def test_ct_observer_defaults_to_minmax_and_refuses_an_unknown_name():
    assert ct_observer("k", "weights", None) == "minmax"
    assert ct_observer("k", "weights", "mse") == "mse"
    with pytest.raises(ValueError, match="scheme 'k': its weights observer 'nope' is not one"):
        ct_observer("k", "weights", "nope")


# --- _jsonfile ---------------------------------------------------------------------------


def test_read_json_reads_utf8_and_passes_the_hook(tmp_path):
    path = tmp_path / "a.json"
    path.write_bytes(json.dumps({"k": "é", "n": 1}, ensure_ascii=False).encode("utf-8"))
    assert read_json(path, "who") == {"k": "é", "n": 1}
    assert read_json(path, "who", object_pairs_hook=list) == [("k", "é"), ("n", 1)]
    assert parse_json('{"a": 1}', "w", object_pairs_hook=list) == [("a", 1)]


def test_read_json_errors_name_the_caller_and_the_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_json(tmp_path / "missing.json", "who")
    with pytest.raises(ValueError, match=f"^who: {tmp_path} cannot be read"):
        read_json(tmp_path, "who")  # a directory: an OSError other than not-found
    bad = tmp_path / "latin.json"
    bad.write_bytes(b'{"k": "\xe9"}')
    with pytest.raises(ValueError, match=f"^who: {bad} is not valid JSON \\(not UTF-8 text"):
        read_json(bad, "who")


def test_a_syntax_error_is_not_json_carrying_the_decoders_error():
    with pytest.raises(NotJSON, match="^w is not valid JSON") as info:
        parse_json("{", "w")
    assert isinstance(info.value.error, json.JSONDecodeError)


def test_parser_limits_and_long_integers_are_value_errors_naming_the_file():
    assert str(parser_limit("w", MemoryError())) == (
        "w cannot be read: its data is too large to parse (MemoryError)")
    assert str(parser_limit("w", RecursionError())) == (
        "w cannot be read: its data is nested too deeply to parse (RecursionError)")
    with pytest.raises(ValueError, match="^w cannot be read: its data is nested too deeply"):
        parse_json("[" * 100_000, "w")
    with pytest.raises(ValueError, match="^w cannot be read: ") as info:
        parse_json("1" * 5000, "w")
    assert not isinstance(info.value, NotJSON)


# --- _numerics ---------------------------------------------------------------------------


def test_as_float32_keeps_the_sign_past_the_range():
    assert as_float32(-(10 ** 400)) == -math.inf
    assert as_float32(-1e39) == -math.inf
    assert as_float32(1e39) == math.inf
    assert as_float32(-float(np.finfo(np.float32).max)) == -float(np.finfo(np.float32).max)


def test_as_float32_rounds_subnormals_to_the_nearest_even_step():
    step = 2.0 ** -149
    assert as_float32(step / 2) == 0.0  # a tie, to the even 0
    assert as_float32(-3 * step / 2) == -2 * step  # a tie, to the even 2 steps
    assert as_float32(0.75 * step) == step


def test_expansion_overflow_is_none_where_expand_is_one():
    lo, hi = torch.tensor([-1e39], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64)
    assert expansion_overflow(lo, hi, 1.0) is None


def test_expansion_overflow_reads_both_ends_and_names_the_limit():
    big = float(np.finfo(np.float32).max) / 1.5
    lo = torch.tensor([-big, -1.0], dtype=torch.float32)
    hi = torch.tensor([1.0, math.inf], dtype=torch.float32)
    assert expansion_overflow(lo, hi, 2.0) == (as_float32(big), "float32")
    lo64 = torch.tensor([-1e38], dtype=torch.float64)
    assert expansion_overflow(lo64, torch.zeros(1, dtype=torch.float64), 10.0) == (
        1e38, "float32")


def test_expansion_overflow_of_integer_ranges():
    lo, hi = torch.tensor([-5, -2]), torch.tensor([7, 3])
    assert expansion_overflow(lo, hi, 2.0) is None


def test_true_div_is_one_ieee_division_in_the_tensors_dtype():
    t = torch.arange(1, 2001, dtype=torch.float32)
    for c in (3.0, 10.0, 0.1):
        want = (t.numpy().astype(np.float64) / np.float64(np.float32(c))).astype(np.float32)
        assert np.array_equal(true_div(t, c).numpy(), want)
    assert true_div(torch.ones(1, dtype=torch.float64), 0.1).item() == 1 / 0.1


def test_upload_builds_and_converts_in_the_given_dtype():
    got = upload([0.1, 1 / 3], "cpu", torch.float64)
    assert got.dtype == torch.float64 and got.tolist() == [0.1, 1 / 3]
    got = upload(torch.tensor([1, 2]), "cpu", torch.float32)
    assert got.dtype == torch.float32 and got.tolist() == [1.0, 2.0]
    assert upload(torch.tensor([1, 2]), "cpu").dtype == torch.int64
