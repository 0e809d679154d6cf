"""Pins of the compressed-tensors writer that no test held (mutation round s70 over
exporters/compressed_tensors.py): each test fails on one mutant the export tests let through.
Expected values come from the definitions: ``quant_args``'s list of what has no equivalent
(custom integer ranges, MX blocks of 32 only, fp16 scales without ``allow_lossy``, channels
and tiles of a 2-D weight), compressed-tensors' own presets (a dynamic input records no
observer), the writer's checks (Linear and Embedding modules of the calibrated shapes, a held
weight, bool flags, a model with ``save_pretrained``), its config groups (one per distinct
quantization; ``Linear`` as target only where it covers them) and the tensors a role writes."""

import pytest
import torch
from test_ct_writer_pins_s64 import _args, _Calibration, _refused, _state
from torch import nn

from quantscope.layout import Block, Channel, Tensor, Tile, Token
from quantscope.qparams import QParams
from quantscope.spec import QuantSpec

pytest.importorskip("compressed_tensors")


@pytest.mark.parametrize(("bounds", "codes"), [({"quant_min": -100}, r"\[-100, 127\]"),
                                               ({"quant_max": 100}, r"\[-128, 100\]")],
                         ids=["quant_min", "quant_max"])
def test_a_custom_integer_code_range_is_refused(bounds, codes):
    """Only full signed ranges: a ``quant_min`` or a ``quant_max`` alone narrows int8's codes,
    which compressed-tensors' int args (a number of bits) cannot say."""
    _refused(QuantSpec("int8", Tensor(), **bounds), rf"integer format int8 with codes {codes} "
                                                    r"\(only full signed ranges\)")


def test_a_dynamic_input_records_no_observer_as_compressed_tensors_w8a8_does():
    """Scales computed at each call have no observer: the args of a dynamic per-token input
    carry none, as compressed-tensors' own W8A8 preset input does."""
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    args = _args(QuantSpec("int8", Token()), "input", dynamic=True)
    assert args.observer is None
    assert args.observer == PRESET_SCHEMES["W8A8"]["input_activations"].observer


def test_mx_blocks_other_than_32_are_refused():
    """MX is mxfp4 blocks of 32 only: E8M0 scales of blocks of 64 have no equivalent."""
    _refused(QuantSpec("fp4_e2m1", Block(64), scale="e8m0:even"), r"MX: mxfp4 blocks of 32 "
                                                                  r"only")


def test_fp16_scales_need_allow_lossy():
    """An fp16 scale encoding is not compressed-tensors' (it writes plain scales, recording no
    encoding): ``quant_args`` without a lossy collector refuses it, as without ``allow_lossy``."""
    _refused(QuantSpec("int8", Channel(0), scale="fp16"), r"fp16 scale encoding; "
                                                         r"compressed-tensors cannot express it",
             shape=(4, 8))


@pytest.mark.parametrize("layout", [Channel(0), Tile(2, 4)])
def test_channels_and_tiles_are_a_2d_weights_only(layout):
    """compressed-tensors' ``channel`` and ``block`` strategies are a Linear's 2-D weight's:
    a 3-D weight (fused experts' ``[experts, rows, cols]``) of either layout is refused."""
    _refused(QuantSpec("int8", layout), r"layout", shape=(2, 4, 8))


def test_a_module_neither_linear_nor_embedding_is_refused():
    """The writer quantizes ``Linear`` and ``Embedding`` modules only: a calibrated Conv1d is
    refused naming its type."""
    from quantscope.exporters.compressed_tensors import _check_module

    model = nn.Module()
    model.conv = nn.Conv1d(2, 2, 1)
    with pytest.raises(ValueError, match=r"layer 'conv' module: module type Conv1d \(Linear "
                                         r"and Embedding only\)"):
        _check_module(model, "conv", {})


def test_a_module_missing_from_the_model_is_named():
    """A calibrated layer the model lacks (``get_submodule``'s AttributeError) is the writer's
    ValueError naming it, not an AttributeError."""
    from quantscope.exporters.compressed_tensors import _check_module

    with pytest.raises(ValueError, match=r"the model has no module 'gone' \(calibrated on "
                                         r"another model\?\)"):
        _check_module(nn.Sequential(nn.Linear(2, 2)), "gone", {})


def test_a_weight_of_another_shape_than_calibrated_is_refused():
    from quantscope.exporters.compressed_tensors import _check_module

    model = nn.Module()
    model.l = nn.Linear(8, 4)
    roles = {"weight": _state(QuantSpec("int8", Channel(0)), shape=(4, 16))}
    with pytest.raises(ValueError, match=r"l\.weight has shape \(4, 8\), calibrated with "
                                         r"\(4, 16\)"):
        _check_module(model, "l", roles)


def test_a_dynamic_role_writes_no_tensor_that_transformers_could_rename(monkeypatch):
    """``_split_on_disk`` asks ``split_names`` about the roles that write tensors: a weight and
    a ``"local"`` input (its global scale), never a ``dynamic=True`` input (no tensor)."""
    from quantscope.exporters import compressed_tensors as ct

    asked = []
    monkeypatch.setattr(ct, "split_names", lambda work, written: asked.append(written) or {})
    spec = QuantSpec("int8", Token())
    states = {"a": {"weight": _state(QuantSpec("int8", Channel(0))),
                    "input": _state(spec, dynamic=True)},
              "b": {"weight": _state(QuantSpec("int8", Channel(0))),
                    "input": _state(spec, dynamic="local")}}
    ct._split_on_disk(nn.Module(), states)
    assert asked == [{"a": {"weight"}, "b": {"weight", "input"}}]


def test_layers_of_one_quantization_share_a_group_whatever_their_roles_order():
    """Layers with identical quantization share a config group: the same weight and input
    args recorded in another order are one group of both layers."""
    from quantscope.exporters.compressed_tensors import _groups, _Lossy

    weight = _state(QuantSpec("int8", Channel(0)), shape=(4, 8))
    inp = _state(QuantSpec("int8", Token()), dynamic=True)
    groups = _groups({"a": {"weight": weight, "input": inp},
                      "b": {"input": inp, "weight": weight}}, _Lossy(False))
    assert [layers for _, layers in groups] == [["a", "b"]]


def test_overwrite_must_be_a_bool():
    """``overwrite="no"`` would read as True: refused with the other arguments' checks."""
    from quantscope.exporters.compressed_tensors import _check_call

    with pytest.raises(ValueError, match=r"export compressed-tensors: overwrite must be True "
                                         r"or False, got"):
        _check_call(None, None, overwrite="no", allow_lossy=False, model_path=None,
                    max_shard_size="5GB")


def test_a_model_without_save_pretrained_is_refused():
    """The writer writes a Hugging Face folder: a plain module is a TypeError naming its type,
    before the calibration's layers are looked at."""
    from quantscope.exporters.compressed_tensors import _check_call

    with pytest.raises(TypeError, match=r"model must be a transformers PreTrainedModel \(it "
                                        r"writes a Hugging Face folder\), got Linear"):
        _check_call(_Calibration(), nn.Linear(2, 2), overwrite=False, allow_lossy=False,
                    model_path=None, max_shard_size="5GB")


def test_a_pruned_weight_is_refused_naming_the_layer_before_the_copy(tmp_path):
    """A weight computed at each forward (pruning) is the writer's own ValueError naming the
    layer, raised before the model's deep copy (which fails on it) and before any write."""
    from types import SimpleNamespace

    from torch.nn.utils import prune

    from quantscope.exporters.compressed_tensors import export_compressed_tensors

    model = nn.Module()
    model.l = nn.Linear(4, 4)
    prune.identity(model.l, "weight")
    calibration = SimpleNamespace(states={"l": {"weight": _state(QuantSpec("int8", Channel(0)),
                                                                  shape=(4, 4))}})
    write = export_compressed_tensors.__wrapped__  # the writer itself, past the registry
    with pytest.raises(ValueError, match=r"export compressed-tensors: l\.weight \(Linear\) is "
                                         r"computed at each forward"):
        write(calibration, model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_sole_group_with_an_embedding_targets_its_layers_by_name():
    """``targets: ["Linear"]`` only when one group covers Linear layers alone: a group that
    holds an Embedding too targets its layers by name (``Linear`` would miss the Embedding)."""
    from quantscope.exporters.compressed_tensors import _attach_schemes, _groups, _Lossy

    work = nn.Module()
    work.emb, work.lin = nn.Embedding(3, 2), nn.Linear(2, 3)
    spec = QuantSpec("int8", Channel(0))
    states = {n: {"weight": _state(spec, shape=(3, 2), qparams=QParams(
        torch.full((3, 1), 0.5), torch.zeros(3, 1)))} for n in ("emb", "lin")}
    _attach_schemes(work, _groups(states, _Lossy(False)), states, _Lossy(False))
    assert work.emb.quantization_scheme.targets == ["emb", "lin"]
    assert work.lin.quantization_scheme.targets == ["emb", "lin"]
