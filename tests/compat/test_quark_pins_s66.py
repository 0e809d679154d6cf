"""compat.quark's observer classes (quark.py) and the chunked MSE search (quark_mse.py) where
the s66 mutation round found behaviour no .venv test pinned: how the classes join Quark's
observer sets (``register_with_quark`` on a stand-in of Quark's observer package, imported
before or after quantscope), the ``eps`` argument each class uses, drops or refuses, the
granularity each class fixes, the per-channel reset's check of deleted statistics, the
per-group class's memoryless flat statistics, ``group_count`` and the qparams of a given range
in ``(-1, group_count)``, its refusal of a block size that does not divide the axis, and the
MSE search's loop (Quark's int64 zero and mean on half centres), the per-tensor kernel's double
product for float64 input and ``scaling_fp8``'s error for a float dtype that is not fp8.
Expected values come from Quark 0.13's observer code (quoted in the docstrings) and
compat.quark's docstrings; nothing imports Quark."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

import pytest
import torch
from test_quark_mse_vectorized_s63 import quark_loop, same_bits

from quantscope.compat import quark, quark_mse

F32_EPS = torch.finfo(torch.float32).eps


def _stand_in(module: types.ModuleType) -> dict[str, type]:
    """Fill ``module`` as Quark's observer package: a namesake per class and its sets."""
    names = ("PerTensorMinMaxObserver", "PerGroupMinMaxObserver", "PlaceholderObserver",
             "UniformScalingObserver")
    theirs = {n: type(n, (), {}) for n in names}
    vars(module).update(theirs)
    module.PER_TENSOR_OBSERVERS = {theirs["PerTensorMinMaxObserver"]}
    module.PER_GROUP_OBSERVERS = {theirs["PerGroupMinMaxObserver"]}
    module.PLACEHOLDER_OBSERVERS = {theirs["PlaceholderObserver"]}
    module.OBSERVER_CLASSES = set(theirs.values())
    module.LISTED_OBSERVERS = [theirs["PerTensorMinMaxObserver"]]  # not a set: left alone
    return theirs


def test_register_with_quark_joins_each_set_that_holds_its_namesake(monkeypatch):
    """Each class joins the sets that hold Quark's class of its name (``*OBSERVERS`` and
    ``OBSERVER_CLASSES``), no other set."""
    fake = types.ModuleType(quark._QUARK_OBSERVERS)
    theirs = _stand_in(fake)
    monkeypatch.setitem(sys.modules, quark._QUARK_OBSERVERS, fake)
    assert quark.register_with_quark() is True
    assert fake.PER_TENSOR_OBSERVERS == {theirs["PerTensorMinMaxObserver"],
                                         quark.PerTensorMinMaxObserver}
    assert fake.PER_GROUP_OBSERVERS == {theirs["PerGroupMinMaxObserver"],
                                        quark.PerGroupMinMaxObserver}
    assert fake.PLACEHOLDER_OBSERVERS == {theirs["PlaceholderObserver"],
                                          quark.PlaceholderObserver}
    assert fake.OBSERVER_CLASSES == {*theirs.values(), quark.PerTensorMinMaxObserver,
                                     quark.PerGroupMinMaxObserver, quark.PlaceholderObserver,
                                     quark.UniformScalingObserver}
    assert fake.LISTED_OBSERVERS == [theirs["PerTensorMinMaxObserver"]]


def test_register_with_quark_is_false_without_quark():
    if importlib.util.find_spec("quark") is not None:
        pytest.skip("Quark is importable here")
    assert quark.register_with_quark() is False


def test_quarks_package_imported_later_gets_the_classes(tmp_path, monkeypatch):
    """Quark's observer package imported after this module: the classes join its sets right
    after it runs, and the import hook takes itself off ``sys.meta_path``."""
    if importlib.util.find_spec("quark") is not None:
        pytest.skip("Quark is importable here")
    package = tmp_path / "quark" / "torch" / "quantization" / "observer"
    package.mkdir(parents=True)
    for folder in (package, *package.parents[:3]):
        (folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text(
        "class PerTensorMinMaxObserver:\n    pass\n\n\n"
        "PER_TENSOR_OBSERVERS = {PerTensorMinMaxObserver}\n"
        "OBSERVER_CLASSES = set(PER_TENSOR_OBSERVERS)\n")
    hooks = [h for h in sys.meta_path if h is not quark._JoinQuarkOnImport]
    monkeypatch.setattr(sys, "meta_path", [quark._JoinQuarkOnImport, *hooks])
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        module = importlib.import_module(quark._QUARK_OBSERVERS)
        assert quark.PerTensorMinMaxObserver in module.PER_TENSOR_OBSERVERS
        assert quark.PerTensorMinMaxObserver in module.OBSERVER_CLASSES
        assert quark._JoinQuarkOnImport not in sys.meta_path
    finally:
        for name in [n for n in sys.modules if n == "quark" or n.startswith("quark.")]:
            del sys.modules[name]


def test_uniform_scaling_base_uses_eps_as_the_scale_of_a_zero_range():
    """Quark's ``UniformScalingObserver(qspec, device, eps)``: ``scale = max(amax / 127.5,
    eps)``, so a zero range's scale is the given eps."""
    obs = quark.UniformScalingObserver({"dtype": "int8", "symmetric": True}, eps=1e-3)
    scale, zp = obs.calculate_qparams(torch.tensor(0.0), torch.tensor(0.0))
    assert scale.item() == torch.tensor(1e-3).item() and zp.item() == 0


@pytest.mark.parametrize("name, qspec", [
    ("PerChannelMinMaxObserver", {"dtype": "int8", "qscheme": "per_channel", "ch_axis": 0}),
    ("PerGroupMinMaxObserver", {"dtype": "int8", "qscheme": "per_group", "ch_axis": -1,
                                "group_size": 4})])
def test_per_channel_and_group_take_eps_and_drop_it(name, qspec):
    """Quark's per-channel / per-group ``__init__(qspec, device, eps)`` call
    ``super().__init__(qspec, device)``: a zero unit's scale stays float32's eps."""
    obs = getattr(quark, name)(qspec, eps=1e-3)
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, -2.0, 0.5, 0.25]])
    obs(x)
    scale, _ = obs._calculate_qparams()
    assert scale.reshape(-1).tolist() == [F32_EPS, torch.tensor(2.0 / 127.5).item()]


@pytest.mark.parametrize("name, qscheme, other", [
    ("PerTensorMinMaxObserver", "per_tensor", "per_channel"),
    ("PerChannelMinMaxObserver", "per_channel", "per_tensor"),
    ("PerGroupMinMaxObserver", "per_group", "per_channel")])
def test_each_class_fixes_its_granularity(name, qscheme, other):
    """Another ``qscheme`` raises ``ValueError`` (Quark's config refuses it); a qspec without
    one takes the class's."""
    with pytest.raises(ValueError, match="qscheme"):
        getattr(quark, name)({"dtype": "int8", "qscheme": other, "ch_axis": 0,
                              "group_size": 4})
    obs = getattr(quark, name)({"dtype": "int8", "ch_axis": 0, "group_size": 4})
    obs(torch.arange(32.0).reshape(4, 8))
    # per group along axis 0: Quark permutes it last, 8 rows of 4 // 4 = 1 group
    want = {"per_tensor": (), "per_channel": (4,), "per_group": (8, 1)}[qscheme]
    assert tuple(obs._calculate_qparams()[0].shape) == want


def test_per_channel_and_group_set_quarks_attributes():
    """Quark's constructors: ``self.ch_axis = qspec.ch_axis`` (per channel); per group also
    ``self.group_size = qspec.group_size`` and ``self.group_count = 1``."""
    ch = quark.PerChannelMinMaxObserver({"dtype": "int8", "qscheme": "per_channel",
                                         "ch_axis": 1})
    group = quark.PerGroupMinMaxObserver({"dtype": "int4", "qscheme": "per_group",
                                          "ch_axis": -1, "group_size": 16})
    assert ch.ch_axis == 1
    assert (group.ch_axis, group.group_size, group.group_count) == (-1, 16, 1)


@pytest.mark.parametrize("deleted", [("min_val",), ("max_val",), ("min_val", "max_val")])
def test_per_channel_reset_after_a_deleted_statistic_raises_runtime_error(deleted):
    """Quark's ``reset_min_max_vals``: ``if not hasattr(self, "min_val") or not
    hasattr(self, "max_val"): raise RuntimeError``."""
    obs = quark.PerChannelMinMaxObserver({"dtype": "int8", "qscheme": "per_channel",
                                          "ch_axis": 0})
    obs(torch.randn(3, 4))
    for name in deleted:
        delattr(obs, name)
    with pytest.raises(RuntimeError, match="has no attribute"):
        obs.reset_state()


def test_per_group_static_overwrites_with_each_call_and_keeps_stats_flat():
    """Quark's per-group ``_forward`` copies the last call's ``aminmax`` over its buffers,
    static or not; ``min_val`` / ``max_val`` are flat ``(rows * groups,)``."""
    obs = quark.PerGroupMinMaxObserver({"dtype": "int8", "qscheme": "per_group", "ch_axis": -1,
                                        "group_size": 2, "symmetric": True})
    obs(torch.tensor([[-8.0, 8.0, -8.0, 8.0]]))
    obs(torch.tensor([[1.0, 2.0, -3.0, 0.5]]))
    assert obs.min_val.tolist() == [1.0, -3.0] and obs.max_val.tolist() == [2.0, 0.5]
    assert obs.group_count == 2


def test_per_group_group_count_is_groups_per_row_and_shapes_given_ranges():
    """``group_count``: 1 before data, then ``x.shape[ch_axis] // group_size``; a given flat
    range's qparams come back ``reshape(-1, group_count)``, as Quark's ``calculate_qparams``."""
    obs = quark.PerGroupMinMaxObserver({"dtype": "int8", "qscheme": "per_group", "ch_axis": -1,
                                        "group_size": 4, "symmetric": True})
    lo, hi = -torch.arange(1.0, 7.0), torch.arange(1.0, 7.0)
    assert obs.group_count == 1
    assert tuple(obs.calculate_qparams(lo, hi)[0].shape) == (6, 1)
    obs(torch.randn(2, 12))  # 3 groups of 4 per row
    assert obs.group_count == 3
    scale, zp = obs.calculate_qparams(lo, hi)
    assert tuple(scale.shape) == tuple(zp.shape) == (2, 3)
    assert scale[1, 0].item() == torch.tensor(4.0 / 127.5).item()


def test_per_group_fp4_is_priced_by_quarks_integer_formula():
    """Quark's per-group ``calculate_qparams`` sends every non-fp8 dtype to
    ``calculate_int_quant_params``, whose integer assert fails on fp4 once data is seen."""
    obs = quark.PerGroupMinMaxObserver({"dtype": "fp4", "qscheme": "per_group", "ch_axis": -1,
                                        "group_size": 4})
    obs(torch.randn(2, 8))
    with pytest.raises(quark.UnsupportedElementError):
        obs._calculate_qparams()


def test_per_group_block_scale_refuses_a_group_size_that_does_not_divide():
    """A block scale format (e8m0) on Quark's per-group class: ``ValueError`` when the axis is
    not a multiple of the group size (Quark's check), where the block layout would pad; an
    empty batch is passed over."""
    obs = quark.PerGroupMinMaxObserver({"dtype": "fp8_e4m3", "qscheme": "per_group",
                                        "ch_axis": -1, "group_size": 4, "scale_format": "e8m0"})
    with pytest.raises(ValueError, match="not divisible by group_size=4"):
        obs(torch.randn(2, 6))
    obs(torch.randn(0, 6))
    assert not obs.has_observed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("qdtype", ["int8", "uint4"])
def test_loop_mses_prices_half_centres_as_quarks_loop(dtype, qdtype):
    """``loop_mses`` (the search off the CPU) is Quark's loop: ``min_value =
    torch.tensor(0)`` (int64, so the range keeps the centres' half dtype) and a ``mean`` of the
    weighted squared errors; the CPU's chunks give the same errors."""
    obs = quark.PerTensorMSEObserver({"dtype": qdtype, "symmetric": False})
    edges = torch.linspace(0.0, 3.3, 65, dtype=torch.float64).to(dtype)
    counts = torch.arange(64.0) % 7
    _, (want,) = quark_loop(obs, counts, edges, stride=3, start_bin=40)
    centers = (edges[1:] + edges[:-1]) / 2
    got = quark_mse.loop_mses(obs, centers, counts, centers[40::3])
    assert same_bits(got, want)
    assert same_bits(quark_mse.candidate_mses(obs, centers, counts, centers[40::3]), want)


def test_rows_of_float64_input_round_the_double_product():
    """ATen's per-tensor kernel multiplies a float64 input by ``1.0f / scale`` in double:
    ``2.5 + 2 ** -30`` rounds to 3, ``-0.5 - 2 ** -40`` to -1, ``1.5 - 2 ** -35`` to 1 (their
    float32 copies are the halves, which round to even: 2, -0, 2)."""
    x = torch.tensor([2.5 + 2 ** -30, -0.5 - 2 ** -40, 1.5 - 2 ** -35], dtype=torch.float64)
    rows = quark_mse.per_tensor_rows(x, torch.tensor([1.0]), torch.tensor([0], dtype=torch.int32),
                                     -128, 127)
    assert rows.dtype == torch.float64 and rows[0].tolist() == [3.0, -1.0, 1.0]
    assert same_bits(rows[0], torch.fake_quantize_per_tensor_affine(x, 1.0, 0, -128, 127))


def test_chunked_float_errors_of_a_non_fp8_dtype_raise_scaling_fp8s_error():
    """Quark's ``scaling_fp8``: ``raise ValueError(f"Invalid dtype ... Supported fp8 formats:
    fp8_e4m3, fp8_e5m2.")``; the chunked errors of another float dtype raise it too."""
    obs = quark.PerTensorMSEObserver({"dtype": "fp4"})
    centers = torch.linspace(0.1, 1.0, 8)
    with pytest.raises(ValueError, match="Supported fp8 formats"):
        quark_mse.candidate_mses(obs, centers, torch.ones(8), centers[4:])
