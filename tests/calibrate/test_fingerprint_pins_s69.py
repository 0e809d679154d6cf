"""Pins from the s69 mutation round over ``calibration/structure/fingerprint.py``: behaviour
no earlier test held. The digest's type, the torch path's empty weight, what
``check_fingerprint_text`` accepts, which tensor ``layer_weight`` returns, which layers
``sources`` names, that ``record_fingerprints`` replaces the states and reads each weight once,
when a dtype ``holds`` another (every value of the narrow one cast there and back exactly,
found by enumerating them), and what ``check_fingerprints`` checks (a module without a dense
weight is no missing layer; a meta model; another shape named first). Each expected
value comes from the module's docs or the definition, never from a run."""

import pytest
import torch
from test_weight_fingerprints import _reference
from torch import nn

from quantscope import QuantSpec
from quantscope.calibration.results.role_state import RoleState
from quantscope.calibration.structure import fingerprint as fp

_ZERO = "float32:" + "0" * 32  # no weight's fingerprint below


def _state(fingerprint=None, shape=None, dynamic=False):
    return RoleState(QuantSpec("int8", "tensor"), "minmax", "minmax", dynamic=dynamic,
                     shape=shape, fingerprint=fingerprint)


def _pair() -> nn.Module:
    """Two Linears ``a`` and ``b`` of 4 x 4, seeded."""
    torch.manual_seed(0)
    return nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})


def _signed(h: str) -> int:
    v = int(h, 16)
    return v - (1 << 64) if v >> 63 else v


def test_digest_is_the_two_sums_as_int64():
    """``[2]`` int64, the two's complement of the fingerprint's two uint64 sums."""
    w = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    hexes = _reference(w).partition(":")[2]
    d = fp.digest(w)
    assert d.dtype == torch.int64 and d.shape == (2,)
    assert d.tolist() == [_signed(hexes[:16]), _signed(hexes[16:])]


def test_the_torch_path_hashes_no_words_into_no_rows():
    got = fp._torch_row_hashes(torch.zeros(0, dtype=torch.int32))
    assert got.shape == (0,) and got.dtype == torch.int64


@pytest.mark.parametrize("text", [
    123,  # no str: ValueError, not TypeError
    "add:" + "0" * 32, "finfo:" + "0" * 32,  # torch names, no dtype
    "float32:" + "A" * 32])  # upper-case hex: fingerprint writes lower case
def test_check_fingerprint_text_refuses_what_fingerprint_does_not_write(text):
    with pytest.raises(ValueError, match="a torch dtype's name, a colon and 32 hex digits"):
        fp.check_fingerprint_text(text)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_check_fingerprint_text_takes_every_fingerprint_back(dtype):
    """Dtype names with an underscore and digits (float8_e4m3fn) read back as written."""
    text = fp.fingerprint(torch.zeros(6).to(dtype))
    assert text.startswith(str(dtype).removeprefix("torch.") + ":")
    assert fp.check_fingerprint_text(text) == text


def test_layer_weight_is_a_weight_buffer_and_none_for_a_sparse_one():
    """The tensor the module holds as ``weight``, a parameter or a buffer; None for one that
    is no dense strided tensor."""
    model = _pair()
    held = torch.randn(4, 4)
    del model.a.weight
    model.a.register_buffer("weight", held)
    assert fp.layer_weight(model, "a") is held
    del model.b.weight
    model.b.register_buffer("weight", torch.eye(4).to_sparse())
    assert fp.layer_weight(model, "b") is None


def test_sources_names_only_the_fingerprinted_layers_the_model_has():
    """A state without a fingerprint names no layer; a KV role of a missing attention none."""
    model = _pair()
    states = {"a": {"weight": _state(_ZERO)}, "b": {"weight": _state()},
              "gone": {"key": _state(_ZERO)}}
    assert fp.sources(model, states) == {"a"}


def test_record_fingerprints_replaces_shared_states_and_reads_each_weight_once(monkeypatch):
    """The state objects are replaced, not changed (another calibration may hold them), and
    one weight is read once for all its roles across the calibrations."""
    model = _pair()
    shared = _state()
    first = {"a": {"weight": shared, "input": _state()}}
    second = {"a": {"weight": shared}}
    calls = []
    real = fp.fingerprint
    monkeypatch.setattr(fp, "fingerprint", lambda w: calls.append(w) or real(w))
    fp.record_fingerprints(model, [first, second])
    want = _reference(model.a.weight)
    assert shared.fingerprint is None
    assert [first["a"]["weight"].fingerprint, first["a"]["input"].fingerprint,
            second["a"]["weight"].fingerprint] == [want] * 3
    assert len(calls) == 1


def _holds_by_enumeration(wide: torch.dtype, narrow: torch.dtype) -> bool:
    """Every (non-NaN) value of ``narrow``, all its bit patterns, cast to ``wide`` and back."""
    bits = torch.iinfo(narrow).bits if not narrow.is_floating_point else torch.finfo(narrow).bits
    raw = torch.arange(1 << bits, dtype=torch.int32).to(
        torch.uint8 if bits == 8 else torch.int16)
    vals = raw.view(narrow)
    vals = vals[~vals.float().isnan()]
    return bool((vals.to(wide).to(narrow).view(raw.dtype) == vals.view(raw.dtype)).all())


@pytest.mark.parametrize(("wide", "narrow"), [
    (torch.bfloat16, torch.float16),
    (torch.float8_e4m3fnuz, torch.float8_e4m3fn), (torch.float8_e4m3fn, torch.float8_e4m3fnuz)])
def test_holds_is_every_narrow_value_cast_there_and_back_exactly(wide, narrow):
    assert fp._holds(wide, narrow) is _holds_by_enumeration(wide, narrow)


def test_an_integer_weight_of_the_dtype_calibrated_that_differs_is_refused():
    """The same dtype holds itself: another int8 weight is refused, not warned about."""
    model = _pair()
    del model.a.weight
    model.a.register_buffer("weight", torch.arange(16, dtype=torch.int8).view(4, 4))
    states = {"a": {"weight": _state(fp.fingerprint(torch.ones(4, 4, dtype=torch.int8)))}}
    with pytest.raises(ValueError, match=r"^apply: a\.weight is not the weight calibrated"):
        fp.check_fingerprints(model, states, "apply")


def test_a_layer_without_a_dense_weight_does_not_stop_the_check_of_the_next():
    """``a`` is there but holds no dense weight (its refusal is apply's): not a model
    lacking the layer, so ``b``'s other weight is still refused."""
    model = _pair()
    del model.a.weight
    states = {"a": {"weight": _state(_ZERO)}, "b": {"weight": _state(_ZERO)}}
    with pytest.raises(ValueError, match=r"^export: b\.weight is not the weight calibrated"):
        fp.check_fingerprints(model, states, "export")


def test_meta_weights_are_not_checked():
    """A model on the meta device holds no data to compare: nothing is refused."""
    model = _pair()
    states = {"a": {"weight": _state(fp.fingerprint(model.a.weight))},
              "b": {"weight": _state(_ZERO)}}
    with pytest.raises(ValueError, match=r"b\.weight is not"):
        fp.check_fingerprints(model, states, "apply")
    fp.check_fingerprints(model.to("meta"), states, "apply")  # no data to compare


def test_a_weight_of_another_shape_is_named_before_other_bits():
    """``a`` has other bits, ``b`` another shape: the shape error, which says more, first."""
    model = _pair()
    states = {"a": {"weight": _state(_ZERO, shape=(4, 4))},
              "b": {"weight": _state(_ZERO, shape=(8, 4))}}
    with pytest.raises(ValueError, match=r"^apply: b\.weight has shape \(4, 4\), but was "
                                         r"calibrated with shape \(8, 4\)"):
        fp.check_fingerprints(model, states, "apply")
