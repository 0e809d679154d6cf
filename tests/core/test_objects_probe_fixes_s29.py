"""The object protocol of the public value types (probe s29): equality, hashing, str, and
the validation of their fields."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from quantscope import (
    Block,
    FloatFormat,
    Group,
    IntFormat,
    QuantSpec,
    Tile,
    fake_quantize,
    presets,
    qparams_from_range,
)
from quantscope.calibration import Recipe
from quantscope.calibration.options import Options, Runtime
from quantscope.calibration.recipe import Role, Rule
from quantscope.calibration.results.role_state import RoleState
from quantscope.qparams import QParams


def _state(spec, qp):
    return RoleState(spec, "minmax", "minmax", qparams=qp)


def test_quantizes_like_tells_act_order_groups_apart():
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    plain = Group(4)
    act = Group(4, g_idx=torch.arange(8) % 2)  # columns 0, 2, 4, 6 form group 0
    same = Group(4, g_idx=torch.arange(8) // 4)  # the column order of plain groups
    s0, s1, s2 = (QuantSpec("int8", g) for g in (plain, act, same))
    assert s0 == s1  # by design: equality ignores g_idx
    lo, hi = plain.to_units(x).aminmax(dim=1)
    qp = qparams_from_range(*(t.reshape(plain.qparam_shape(x.shape)) for t in (lo, hi)), s0)
    # the peer: QDQ itself
    assert not torch.equal(fake_quantize(x, qp, s0), fake_quantize(x, qp, s1))
    assert not _state(s0, qp).quantizes_like(_state(s1, qp))
    assert not _state(s1, qp).quantizes_like(_state(s0, qp))
    assert torch.equal(fake_quantize(x, qp, s0), fake_quantize(x, qp, s2))
    assert _state(s0, qp).quantizes_like(_state(s2, qp))
    other = QuantSpec("int8", Group(4, g_idx=(torch.arange(8) % 2).flip(0)))
    assert _state(s1, qp).quantizes_like(_state(s1, qp))
    assert _state(s1, qp).quantizes_like(_state(QuantSpec("int8", act), qp))
    assert torch.equal(fake_quantize(x, qp, s1), fake_quantize(x, qp, other)) == \
        _state(s1, qp).quantizes_like(_state(other, qp))


def test_qparams_and_role_state_equality_is_identity():
    qp = QParams(torch.ones(4), torch.zeros(4, dtype=torch.int32))
    st = RoleState(presets.INT8_PER_CHANNEL, "minmax", "minmax", qparams=qp)
    for a in (qp, st):
        twin = copy.deepcopy(a)
        assert (a == twin) is False and (a != twin) is True
        assert (a == a) is True  # noqa: PLR0124 (identity is the equality)
        assert a in [a] and twin not in [a]
        assert len({a, twin, a}) == 2  # hashable by identity


@pytest.mark.parametrize(("make", "field"), [
    (lambda: IntFormat(8, signed=None), "signed"),
    (lambda: IntFormat(8, signed="no"), "signed"),
    (lambda: IntFormat(8, signed=1), "signed"),
    (lambda: IntFormat(8, narrow="no"), "narrow"),
    (lambda: FloatFormat(None, 4, 3, 448.0), "FloatFormat.name"),
    (lambda: FloatFormat("", 4, 3, 448.0), "FloatFormat.name"),
    (lambda: FloatFormat("a", 4, 3, 448.0, "x"), "FloatFormat.torch_dtype"),
])
def test_format_fields_are_checked(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_format_flags_accept_bools():
    fmt = IntFormat(8, signed=np.bool_(True), narrow=np.bool_(True))
    assert fmt.signed is True and fmt.narrow is True
    assert (fmt.qmin, fmt.qmax) == (-127, 127)
    f = FloatFormat("e4m3", 4, 3, 448.0, torch.float8_e4m3fn)
    spec = QuantSpec(f)
    assert QuantSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


@pytest.mark.parametrize("rules", [None, 5, "Linear"])
def test_recipe_rules_error_names_the_field(rules):
    with pytest.raises(TypeError, match=r"Recipe\.rules must be a Rule or a list of Rules"):
        Recipe(rules)


def test_recipe_rules_still_take_one_rule_or_an_iterable():
    rule = Rule(("Linear",), weight=Role(QuantSpec("int8", "channel")))
    assert Recipe(rule).rules == (rule,)
    assert Recipe(r for r in [rule]).rules == (rule,)
    with pytest.raises(TypeError, match=r"Recipe\.rules must hold Rule objects, got int"):
        Recipe([rule, 5])


def test_numpy_numbers_are_accepted_as_python_ones():
    cases = [(Group(np.int64(128)), Group(128), "size"), (Block(np.int64(32)), Block(32), "size"),
             (Tile(np.int64(64), np.int32(32)), Tile(64, 32), "rows")]
    for got, want, name in cases:
        assert got == want and type(getattr(got, name)) is int
    assert type(Tile(np.int64(64), np.int32(32)).cols) is int
    spec = QuantSpec(eps=np.float32(0.125), quant_min=np.int64(-64), quant_max=np.int16(63))
    assert spec == QuantSpec(eps=0.125, quant_min=-64, quant_max=63)
    assert (type(spec.eps), type(spec.quant_min), type(spec.quant_max)) == (float, int, int)
    json.dumps(spec.to_dict())  # Python values: JSON takes them
    for bad in (lambda: Group(np.bool_(True)), lambda: Group(True), lambda: Tile(4.0),
                lambda: QuantSpec(quant_min=True, quant_max=3), lambda: QuantSpec(eps=True)):
        with pytest.raises(ValueError, match="Group|Tile|QuantSpec"):
            bad()


def test_runtime_with_time_groups_hashes():
    a = Runtime(time_groups={"g": ["a", "b"], "h": ["c"]})
    b = Runtime(time_groups={"h": ("c",), "g": ("a", "b")})
    assert a == b and hash(a) == hash(b)
    assert hash(Options(runtime=a)) == hash(Options(runtime=b))
    assert a != Runtime(time_groups={"g": ["a"]})
    # read as before: a mapping of label lists
    assert dict(a.time_groups) == {"g": ("a", "b"), "h": ("c",)}
    assert [(k, list(v)) for k, v in a.time_groups.items()] == [("g", ["a", "b"]), ("h", ["c"])]
    with pytest.raises(TypeError):
        a.time_groups["x"] = ["y"]
    assert Options(runtime=a).but(runtime__missing="float").runtime.time_groups == a.time_groups
    assert "'g': ('a', 'b')" in repr(a)


def test_spec_str_shows_eps():
    a, b = QuantSpec("int8"), QuantSpec("int8", eps=0.125)
    assert a != b and str(a) != str(b)
    assert str(b) == f"{a} eps={0.125!r}"
    nv = QuantSpec("fp4", "block:16", scale="fp8_e4m3", eps=0.25)
    assert str(nv).endswith(" eps=0.25")
    assert "eps" not in str(QuantSpec("fp4", "block:16", scale="fp8_e4m3"))
