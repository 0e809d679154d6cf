"""Pins of the compressed-tensors writer's translation that no test held (mutation round s64
over exporters/compressed_tensors.py, ct_compress.py, ct_match.py and registry.py): each test
fails on one mutant the export tests let through. Expected values come from the definitions:
the docstrings' promises (``quant_args``'s list of what has no equivalent, the writer's
checks, the registry's writer on other ranks) and compressed-tensors' own matching."""

import pytest
import torch
from test_export_pins_s63 import _role_state
from torch import nn

from quantscope.layout import Block, Channel, Group, Tensor, Tile, Token
from quantscope.qparams import QParams
from quantscope.spec import QuantSpec

pytest.importorskip("compressed_tensors")


def _state(spec, **fields):
    from dataclasses import replace

    return replace(_role_state(spec, "minmax", None), **fields)


def _args(spec, role="weight", **fields):
    from quantscope.exporters.compressed_tensors import quant_args

    return quant_args(_state(spec, **fields), "l", role)


def _refused(spec, match, role="weight", **fields):
    with pytest.raises(ValueError, match=match):
        _args(spec, role, **fields)


def test_a_narrow_integer_range_is_refused():
    """Only full signed ranges: ``int8_narrow`` (codes [-127, 127]) has no equivalent."""
    _refused(QuantSpec("int8_narrow", Tensor()), r"int8_narrow with codes \[-127, 127\] "
                                                 r"\(only full signed ranges\)")


def test_integers_wider_than_8_bits_are_refused():
    """Signed integers up to 8 bits only: int9 is refused, int8 written with 8 bits."""
    _refused(QuantSpec("int9", Tensor()), r"int9 \(at most 8 bits\)")
    assert _args(QuantSpec("int8", Tensor())).num_bits == 8


def test_fp8_block_scales_are_nvfp4s_blocks_of_16_only():
    """fp8 e4m3 block scales are NVFP4's: fp4 blocks of 32 under them are refused."""
    spec = QuantSpec("fp4_e2m1", Block(32), scale="fp8_e4m3")
    _refused(spec, r"fp8 block scales: NVFP4 only")


def test_nvfp4_blocks_along_axis_1_of_a_matrix_are_its_last_axis():
    """A block along axis 1 of a 2-D weight is one along its last axis: NVFP4's group of 16."""
    spec = QuantSpec("fp4_e2m1", Block(16, axis=1), scale="fp8_e4m3")
    args = _args(spec, shape=(4, 32))
    assert (args.strategy, args.group_size) == ("tensor_group", 16)


def test_per_channel_scales_are_a_weights_rows_only():
    """Channel is compressed-tensors' ``channel`` for a weight's rows (axis 0 or -2) only: an
    input's channels have no equivalent."""
    assert _args(QuantSpec("int8", Channel(-2)), shape=(4, 8)).strategy == "channel"
    _refused(QuantSpec("int8", Channel(0)), r"layout Channel\(axis=0\)", role="input",
             shape=(4, 8))


def test_groups_that_move_columns_are_refused():
    """A ``g_idx`` that moves columns (act-order) has no equivalent: no group strategy."""
    g_idx = torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 0])
    _refused(QuantSpec("int8", Group(8, g_idx=g_idx)), r"layout Group\(size=8",
             shape=(4, 16))


def test_groups_along_axis_1_of_a_matrix_are_groups_of_its_columns():
    args = _args(QuantSpec("int8", Group(8, axis=1)), shape=(4, 16))
    assert (args.strategy, args.group_size) == ("group", 8)


def test_token_scales_are_written_only_when_computed_at_each_call():
    """``token`` is a dynamic strategy: a ``dynamic="local"`` token layout is refused."""
    assert _args(QuantSpec("int8", Token()), "input", dynamic=True).strategy == "token"
    _refused(QuantSpec("int8", Token()), r"layout Token\(\)", role="input", dynamic="local")


def test_tiles_are_a_weights_blocks_rows_then_columns():
    """``block_structure`` is ``[rows, cols]`` of a weight's tile; an input's tiles have no
    equivalent."""
    spec = QuantSpec("fp8_e4m3", Tile(2, 4))
    assert _args(spec, shape=(4, 8)).block_structure == [2, 4]
    _refused(spec, r"layout Tile\(rows=2, cols=4\)", role="input", shape=(4, 8))


def _initialized(spec, shape=(4, 32)):
    """A Linear of ``shape`` with compressed-tensors' qparam parameters of ``spec``'s weight."""
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.lifecycle.initialize import (
        initialize_module_for_quantization,
    )

    linear = nn.Linear(shape[1], shape[0], bias=False)
    scheme = QuantizationScheme(targets=["Linear"], weights=_args(spec, shape=shape))
    initialize_module_for_quantization(linear, scheme, force_zero_point=False)
    return linear


def _fill(module, spec, scale):
    from quantscope.exporters.compressed_tensors import _fill, _Lossy

    state = _state(spec, qparams=QParams(scale, torch.zeros_like(scale)),
                   shape=tuple(module.weight.shape))
    _fill(module, "weight", state, _Lossy(False), "l")


def test_an_asymmetric_weight_without_a_zero_point_parameter_is_refused():
    """Only a symmetric spec may lack a ``weight_zero_point``: an asymmetric one whose module
    has none is refused, never written without its zero points."""
    linear = _initialized(QuantSpec("int8", Channel(0)))
    assert getattr(linear, "weight_zero_point", None) is None
    with pytest.raises(ValueError, match=r"registered no weight_zero_point"):
        _fill(linear, QuantSpec("int8", Channel(0), symmetric=False), torch.full((4, 1), 0.5))


def test_a_qparam_of_another_size_than_its_parameter_is_refused():
    linear = _initialized(QuantSpec("int8", Channel(0)))
    with pytest.raises(ValueError, match=r"weight_scale: 3 values for a parameter of shape "
                                         r"\(4, 1\)"):
        _fill(linear, QuantSpec("int8", Channel(0)), torch.full((3, 1), 0.5))


def _kv():
    spec = QuantSpec("fp8_e4m3", Tensor())
    return _role_state(spec, "minmax", QParams(torch.tensor(0.5), torch.tensor(0.0)))


def test_a_kv_cache_with_keys_alone_is_refused():
    from quantscope.exporters.compressed_tensors import _kv_args, _Lossy

    with pytest.raises(ValueError, match=r"kv cache: roles \['key'\] \(key and value both\)"):
        _kv_args({"a": {"key": _kv()}}, _Lossy(False))


@pytest.mark.parametrize("value", ["no", 0, None])
def test_allow_lossy_must_be_a_bool(value):
    """``allow_lossy="no"`` would read as True (``bool("no")``): refused with the other
    arguments, as ``overwrite`` is."""
    from quantscope.exporters.compressed_tensors import _check_call

    with pytest.raises(ValueError, match=r"export compressed-tensors: allow_lossy must be True "
                                         r"or False, got"):
        _check_call(None, None, overwrite=False, allow_lossy=value, model_path=None,
                    max_shard_size="5GB")


def _targets_model():
    from compressed_tensors.utils.internal import InternalModule

    class Observer(InternalModule, nn.Linear):  # compressed-tensors' own, never a target
        pass

    model = nn.Module()
    model.lm_head = nn.Linear(2, 2)
    model.layers = nn.ModuleList([nn.Linear(2, 2), nn.Embedding(3, 2)])
    model.layers[0].obs = Observer(2, 2)
    return model


@pytest.mark.parametrize("targets", [
    ["Linear"], ["lm_head"], ["layers.0"], ["layers.0.obs"], ["re:layers\\..*"],
    ["Embedding", "layers.0"], "Linear", []])
def test_targets_match_as_compressed_tensors_is_match(targets):
    """``Targets(targets)(name, module)`` is ``is_match(name, module, targets)`` for every
    module: class names, top-level and dotted layer names, regexes, and never one of
    compressed-tensors' internal modules even by its exact name."""
    from compressed_tensors.utils.match import is_match

    from quantscope.exporters.ct_match import Targets

    model = _targets_model()
    take = Targets(targets)
    for name, module in model.named_modules():
        assert take(name, module) == is_match(name, module, targets), name


def test_match_named_leaves_out_what_ignore_takes():
    """compressed-tensors' ``match_named_modules``: targeted modules no ignore entry takes,
    in ``named_modules()`` order."""
    from quantscope.exporters.ct_match import match_named

    model = _targets_model()
    assert [n for n, _ in match_named(model, ["Linear"], ["lm_head"])] == ["layers.0"]
    assert [n for n, _ in match_named(model, ["Linear", "Embedding"], None)] == [
        "lm_head", "layers.0", "layers.1"]


class _Calibration:
    """What the registry's writer wrapper reads of a calibration."""

    def __init__(self):
        self.states, self.writer_rank = {}, None

    def check_model(self, model, what):
        pass


@pytest.fixture
def writers(monkeypatch):
    """The registry's writers table, restored after the test."""
    from quantscope.exporters import registry

    monkeypatch.setattr(registry, "_writers", dict(registry._writers))
    return registry


def test_an_option_the_writer_lacks_is_named_as_its_call_would(writers):
    @writers.register("s64-test")
    def export_s64(calibration, model, path, *, level=1):
        return path

    with pytest.raises(TypeError, match=r"^export_s64\(\) got an unexpected keyword argument "
                                        r"'bogus'"):
        export_s64(_Calibration(), None, "out", bogus=2)


def test_a_rank_that_writes_nothing_returns_the_absolute_path(writers, monkeypatch, tmp_path):
    """Another rank returns the path "as the writer does (its absolute path)", at once."""
    from quantscope import comm

    @writers.register("s64-test")
    def export_s64(calibration, model, path):
        raise AssertionError("written on a rank that writes nothing")

    monkeypatch.setattr(comm, "writes_here", lambda rank, who, path: False)
    monkeypatch.chdir(tmp_path)
    assert export_s64(_Calibration(), None, "out") == str(tmp_path / "out")


def test_a_calibration_that_quantizes_no_layer_is_refused():
    """Nothing to write: refused with the arguments' checks, not written as a float model."""
    from quantscope.exporters.compressed_tensors import _check_call

    class Saveable(nn.Linear):
        def save_pretrained(self, folder):
            raise AssertionError("written")

    with pytest.raises(ValueError, match=r"export compressed-tensors: the calibration "
                                         r"quantizes no layer"):
        _check_call(_Calibration(), Saveable(2, 2), overwrite=False, allow_lossy=False,
                    model_path=None, max_shard_size="5GB")
