"""Pins from a mutation round (s71) over the cached steps' shared start
(observers/step_cache.py) and the observer registry (observers/registry.py): the plan cache's
start-over past ``MAX_PLANS`` keys, ``new_shape``'s unit test, where inference mode is left
(``leave_inference_mode``, ``begin(leave=False)``), and the registry's re-registration, a
class's own ``name``, ``register_module``'s checks, a plug-in's missing dependency and a
non-string name; a run-time role's NaN scale for a range with +-inf and an empty tensor
passed through (observers/runtime.py). Each test fails on one of the round's surviving mutants."""

from __future__ import annotations

import types

import pytest
import torch

from quantscope import QuantSpec
from quantscope.observers import registry, step_cache
from quantscope.observers.runtime import qdq_tensor, runtime_qparams


def _obs(spec=None, **fields):
    return types.SimpleNamespace(spec=spec if spec is not None else object(), **fields)


def test_the_plan_cache_starts_over_past_max_plans_keys():
    """MAX_PLANS keys are kept; the next new key clears them (it alone is then kept)."""
    obs, make = _obs(), lambda o, x: x.numel()
    for n in range(1, step_cache.MAX_PLANS + 1):
        step_cache.cached_plan(obs, torch.zeros(n), "_p", make)
    plans = obs.__dict__["_p"][1]
    assert len(plans) == step_cache.MAX_PLANS
    step_cache.cached_plan(obs, torch.zeros(step_cache.MAX_PLANS + 1), "_p", make)
    assert len(plans) == 1


def _unit_spec(units):
    """A spec whose layout counts ``units`` units in any shape."""
    return types.SimpleNamespace(layout=types.SimpleNamespace(num_units=lambda shape: units))


@pytest.mark.parametrize("held, units, expected", [(2, 1, False), (1, 2, None), (3, 2, None)])
def test_new_shape_tests_the_units_only_of_a_changed_shape(held, units, expected):
    """The same shape is never new (whatever the units); a changed shape whose last one held
    another unit count, fewer or more, is None."""
    x = torch.zeros(2, 3)
    last = x.shape if expected is False else torch.Size((5, 3))
    obs = _obs(_unit_spec(held), _last_shape=last)
    assert step_cache.new_shape(obs, x, units) is expected


class _Buffered:
    def __init__(self, buf):
        self._buffers = {"a": None, "b": buf}
        self.spec = _unit_spec(1)
        self._last_shape = None
        self.left = 0

    def leave_inference_mode(self):
        self.left += 1


def _inference_buffer():
    with torch.inference_mode():
        return torch.zeros(1)


@pytest.mark.parametrize("under_inference, calls", [(False, 0), (True, 1)])
def test_leave_inference_mode_runs_only_for_an_inference_buffer(under_inference, calls):
    """The observer's ``leave_inference_mode`` runs where a buffer was made under
    inference mode, and not for a plain buffer."""
    obs = _Buffered(_inference_buffer() if under_inference else torch.zeros(1))
    step_cache.leave_inference_mode(obs)
    assert obs.left == calls


@pytest.mark.parametrize("leave, calls", [(True, 1), (False, 0)])
def test_begin_leaves_inference_mode_only_where_told(leave, calls):
    """``begin(leave=False)`` leaves inference mode to the step (first_step's NaN / inf test
    comes first): it returns the plan and a new shape, the observer's call not made."""
    obs = _Buffered(_inference_buffer())
    got = step_cache.begin(obs, torch.zeros(3), "_p", lambda o, x: "plan", leave=leave)
    assert got == ("plan", True)
    assert obs.left == calls


@pytest.fixture
def empty_registry(monkeypatch):
    """The registry's tables, empty for the test (the real ones untouched)."""
    monkeypatch.setattr(registry, "_REGISTRY", {})
    monkeypatch.setattr(registry, "_DISPLAY", {})
    monkeypatch.setattr(registry, "_MODULES", [])


def test_registering_a_class_again_under_its_names_is_allowed(empty_registry):
    """A name taken by the same class (a module imported twice) raises nothing."""
    cls = type("Obs", (), {})
    registry.register("pin_s71", "Pin_S71_B")(cls)
    assert registry.register("pin_s71")(cls) is cls
    assert registry._REGISTRY["pin_s71"] is cls
    with pytest.raises(ValueError, match="taken by Obs"):
        registry.register("PIN_S71")(type("Other", (), {}))


def test_register_keeps_a_name_the_class_defines(empty_registry):
    """``name`` is set to the first registered name only where the class defines none."""
    own = registry.register("pin_a", "pin_b")(type("Own", (), {"name": "mine"}))
    plain = registry.register("pin_c", "pin_d")(type("Plain", (), {}))
    assert (own.name, plain.name) == ("mine", "pin_c")


@pytest.mark.parametrize("module", ["", None, 3])
def test_register_module_refuses_what_is_no_module_name(empty_registry, module):
    """An empty string is no dotted module name, as a non-string is not."""
    with pytest.raises(TypeError, match="dotted module name"):
        registry.register_module(module)
    assert registry._MODULES == []


def test_register_module_declares_a_module_once(empty_registry):
    """A plug-in declared twice is one entry (imported once per lookup)."""
    registry.register_module("pin_s71_plugin")
    registry.register_module("pin_s71_plugin")
    assert registry._MODULES == ["pin_s71_plugin"]


def test_a_plugin_missing_a_dependency_raises_a_missing_plugin_does_not(monkeypatch, tmp_path):
    """A declared module that is not there is skipped; one that is there but imports a missing
    module raises that error at the lookup."""
    (tmp_path / "pin_s71_broken.py").write_text("import pin_s71_no_such_dep\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_MODULES", ["pin_s71_not_there"])
    assert registry.observer_class("minmax").name == "minmax"
    monkeypatch.setattr(registry, "_MODULES", ["pin_s71_broken"])
    with pytest.raises(ModuleNotFoundError) as e:
        registry.observer_class("minmax")
    assert e.value.name == "pin_s71_no_such_dep"


@pytest.mark.parametrize("name", [None, 3, b"minmax"])
def test_a_name_that_is_no_str_is_a_type_error(name):
    """``get_observer`` with a non-string name raises TypeError (not the unknown-name
    ValueError)."""
    with pytest.raises(TypeError, match="must be a registry name"):
        registry.get_observer(name)


def test_registered_name_is_case_insensitive():
    """``registered_name`` spells a name as registered, whatever its case (its docstring's
    ``"IMATRIX_MSE"`` is ``"imatrix_mse"``); an unknown name comes back as given."""
    assert registry.registered_name("IMATRIX_MSE") == "imatrix_mse"
    assert registry.registered_name("No_Such_S71") == "No_Such_S71"


def test_list_observers_is_sorted_and_its_prefix_case_insensitive():
    """All names come sorted (by their lower-case key); a prefix keeps one toolkit's names
    whatever its case or a trailing colon."""
    names = registry.list_observers()
    assert [n.lower() for n in names] == sorted(n.lower() for n in names)
    ao = registry.list_observers("torch.ao")
    assert ao and all(n.lower().startswith("torch.ao:") for n in ao)
    assert registry.list_observers("TORCH.AO:") == ao


@pytest.mark.parametrize("prefix", [3, b"torch.ao"])
def test_list_observers_refuses_a_prefix_that_is_no_str(prefix):
    """A prefix that is neither a str nor None is a TypeError."""
    with pytest.raises(TypeError, match="prefix must be a str"):
        registry.list_observers(prefix)


def _runtime_state():
    return types.SimpleNamespace(spec=QuantSpec(), dynamic=True, observer="memoryless_minmax",
                                 options={}, qparams=None, global_amax=None)


@pytest.mark.parametrize("values", [[1.0, float("inf")], [-float("inf"), 1.0]])
def test_a_run_time_range_with_an_infinite_end_gets_a_nan_scale(values):
    """An int format's run-time scale is NaN where either end of the range is +-inf (the
    serving runtime's per-token scale is then inf / NaN), not a clamped finite scale."""
    qp = runtime_qparams(torch.tensor(values), _runtime_state())
    assert torch.isnan(qp.scale).all()


def test_an_empty_tensor_passes_through_qdq():
    """An empty tensor (an expert no token was routed to) comes back as it is."""
    x = torch.zeros(0, 4)
    assert qdq_tensor(x, _runtime_state()) is x
