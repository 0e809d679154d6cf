"""Pins from session 64's mutation round of layout.py, _checks.py, _plainchecks.py and
_jsonfile.py: the layouts' defaults and unit identity, the argument checks' bounds (which ends
are inclusive, which values are refused), the pattern limits of untrusted files and the JSON
reader's errors. Each test holds a behaviour that a small mutant of the source broke while
every other test of these modules still passed."""

from __future__ import annotations

import math

import pytest
import torch

from quantscope._checks import (
    PATTERN_MAX,
    PATTERN_REPEATS,
    FrozenDict,
    check_code_range,
    check_global_amax,
    check_int,
    check_number,
    check_nvfp4_args,
    check_op_global_amax,
    regex_problem,
)
from quantscope._jsonfile import parser_limit, read_json
from quantscope._plainchecks import check_path, spelt_as_scheme
from quantscope.formats import get_format
from quantscope.layout import Block, Group

# ---- layout.py ---------------------------------------------------------------------------


def test_a_default_block_is_mx_sized_32_along_the_last_axis():
    """Block's docstring: MX blocks of 32 by default (``Block()``, not only ``"block"``)."""
    assert Block() == Block(32, -1)
    assert Block().qparam_shape((2, 64)) == (2, 2) and Block().spec_name() == "block:32"


@pytest.mark.parametrize("layout", [Group(4, axis=1), Block(4, axis=1)])
def test_runs_along_axis_1_are_the_same_units_as_along_axis_minus_1_on_2d(layout):
    """same_units' docstring: "group:4:1" does "group:4"'s on a 2-D tensor, "group:4:0" not."""
    plain = type(layout)(4)
    assert layout.same_units(plain, (8, 8)) and plain.same_units(layout, (8, 8))
    assert not type(layout)(4, axis=0).same_units(plain, (8, 8))


def test_a_group_index_past_the_last_group_is_named_in_the_refusal():
    """g_idx of 4 columns in groups of 2 has groups 0..1: index 2 is named, not counted."""
    with pytest.raises(ValueError, match=r"in each group 0\.\.1; got group index 2$"):
        Group(2, g_idx=torch.tensor([0, 0, 2, 2]))


# ---- _checks.py --------------------------------------------------------------------------


def test_frozendict_hashes_alike_in_any_item_order():
    """Equal mappings hash alike whatever their insertion order (and equal a dict)."""
    a, b = FrozenDict([("x", 1), ("y", (2, 3))]), FrozenDict([("y", (2, 3)), ("x", 1)])
    assert a == b == {"x": 1, "y": (2, 3)} and hash(a) == hash(b)
    assert len({a, b}) == 1


def test_check_int_takes_both_ends_of_its_range():
    """check_int's range is closed, ``[lo, hi]``: hi itself is an accepted value."""
    assert check_int("w", "n", 5, 0, 5) == 5 and check_int("w", "n", 0, 0, 5) == 0
    with pytest.raises(ValueError, match=r"w: n must be an integer in \[0, 5\], got 6"):
        check_int("w", "n", 6, 0, 5)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 10**400])
def test_check_number_refuses_a_value_that_is_not_finite(value):
    """"A finite float": inf, NaN and an int past float's range are refused even where the
    range's top is inf."""
    with pytest.raises(ValueError, match=r"w: x must be a finite number in \[0\.0, inf\)"):
        check_number("w", "x", value, 0.0)


def test_a_code_range_needs_qmin_strictly_below_qmax():
    """``qmin < qmax``: a range of one code is refused."""
    check_code_range("w", -1, 0)
    with pytest.raises(ValueError, match="w: qmin must be below qmax, got 3 and 3"):
        check_code_range("w", 3, 3)


def test_an_empty_global_amax_is_not_one_value():
    """A global amax is one value: an empty tensor is refused (as two values are)."""
    for bad in (torch.tensor([]), torch.ones(2)):
        with pytest.raises(ValueError, match=r"w: global_amax must be one value .* got shape"):
            check_global_amax("w", bad)
    check_global_amax("w", torch.ones(1, 1))


def test_a_pattern_of_exactly_the_limits_may_run():
    """At most PATTERN_MAX characters and at most PATTERN_REPEATS repeats: the limits pass."""
    assert regex_problem("a" * PATTERN_MAX) is None
    assert regex_problem(".*" * PATTERN_REPEATS + "X") is None


def test_an_optional_part_is_no_repeat():
    """A repeat is ``*``, ``+`` or ``{m,n}`` with n > 1: ``?`` (at most once) scales with no
    name length, so many of them are no polynomial backtracking."""
    assert regex_problem("a?" * (PATTERN_REPEATS + 2)) is None
    assert regex_problem("a{0,1}" * (PATTERN_REPEATS + 2)) is None


def test_an_nvfp4_op_takes_a_min_scale_of_zero():
    """check_nvfp4_min_scale's docstring: a float32 number, 0 too; a negative one is not."""
    lo, hi = torch.zeros(3), torch.ones(3)
    assert check_nvfp4_args(lo, hi, None, "fp4_e2m1", 0.0) == get_format("fp4_e2m1")
    with pytest.raises(ValueError, match="quantscope::nvfp4_qparams: min_scale"):
        check_nvfp4_args(lo, hi, None, "fp4_e2m1", -1e-8)


def test_an_empty_op_global_amax_is_not_one_float32_value():
    """The NVFP4 ops' global amax is one float32 value: an empty tensor is refused."""
    cpu = torch.device("cpu")
    check_op_global_amax(torch.ones(1), cpu, "nvfp4_qparams")
    with pytest.raises(ValueError, match="nvfp4_qparams: global_amax must be None or one"):
        check_op_global_amax(torch.ones(0), cpu, "nvfp4_qparams", "None or ")


# ---- _plainchecks.py ---------------------------------------------------------------------


def test_check_path_takes_bytes_and_names_the_argument_otherwise():
    """A str, bytes or os.PathLike path comes back as a str; None is a TypeError naming it."""
    assert check_path("w", b"runs/out") == "runs/out"
    with pytest.raises(TypeError, match="w: out must be a str or os.PathLike, got NoneType"):
        check_path("w", None, "out")


def test_a_hyphenated_upper_case_preset_is_no_scheme_spelling():
    """compressed-tensors' scheme names have no hyphen (FP8_DYNAMIC): "FP8-DYNAMIC" is the
    preset fp8-dynamic in another case, "FP8" the scheme's spelling of fp8."""
    presets = ("fp8", "fp8-dynamic")
    assert spelt_as_scheme("FP8", presets)
    assert not spelt_as_scheme("FP8-DYNAMIC", presets)


# ---- _jsonfile.py ------------------------------------------------------------------------


def test_a_parser_limit_says_too_deep_or_too_large():
    """RecursionError: nested too deeply; MemoryError: too large (docs/SECURITY.md)."""
    deep, big = parser_limit("w: f.json", RecursionError()), parser_limit("w: f", MemoryError())
    assert str(deep) == ("w: f.json cannot be read: its data is nested too deeply to parse "
                         "(RecursionError)")
    assert str(big) == "w: f cannot be read: its data is too large to parse (MemoryError)"


def test_read_json_keeps_a_missing_file_a_filenotfounderror(tmp_path):
    """read_json's docstring: a missing file stays FileNotFoundError (not a ValueError)."""
    with pytest.raises(FileNotFoundError):
        read_json(tmp_path / "missing.json", "w")


def test_read_json_names_the_file_that_is_not_utf8(tmp_path):
    """A file that is not UTF-8 is a ValueError naming the caller and the file."""
    path = tmp_path / "latin1.json"
    path.write_bytes(b'{"name": "caf\xe9"}')
    with pytest.raises(ValueError, match=r"^w: .*latin1\.json is not valid JSON \(not UTF-8"):
        read_json(path, "w")
