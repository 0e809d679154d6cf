"""Pins of the checks a compressed-tensors reader applies before trusting a folder
(``exporters.read_checks``, ``exporters.read_refusals``): the config file and its
``quantization_config``, the formats' names, the sections and KV-cache schemes quantscope does not
run, safetensors headers that lie, scales that are no scales, zero points and codes out of range,
the quantization tensors a scheme has or lacks, and tensors no read layer owns. They came from a
mutation round (s68): each fails on a small defect that no earlier test caught."""

import json
import math
import re

import pytest
import torch

pytest.importorskip("compressed_tensors")
pytest.importorskip("safetensors")

from compressed_tensors import CompressionFormat
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from safetensors.torch import save_file

from quantscope import QuantSpec, Tensor
from quantscope.compat.llmcompressor_spec import llmcompressor_spec
from quantscope.exporters.read_checks import (
    compressor,
    exact_pattern,
    fmt_name,
    kv_scale_layer,
    kv_scheme_problem,
    load_checked_tensors,
    missing_zero_point,
    neutral_qparams,
    parse_quant_config,
    read_quant_config,
    refuse_not_run,
    rewriting_modifiers,
    safetensors_headers,
    scale_problem,
    scale_values,
    storage_problem,
    unexpected_qparam,
    zero_point_problem,
)
from quantscope.exporters.read_refusals import refuse_unread

NESTED = "re:(a+)+$"  # a nested repeat: backtracks exponentially


def _config(folder, qc):
    (folder / "config.json").write_text(json.dumps({"quantization_config": qc}))
    return folder


def _qc(**extra):
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"]}}, **extra}


def test_a_config_json_that_is_a_folder_does_not_exist_as_a_file(tmp_path):
    (tmp_path / "config.json").mkdir()
    with pytest.raises(FileNotFoundError, match=r"who: .*config\.json does not exist"):
        read_quant_config(tmp_path, "who")


@pytest.mark.parametrize(("value", "kind"), [([1, 2], "list"), ("text", "str"), (3, "int")])
def test_a_config_json_that_is_no_object_is_a_valueerror_naming_its_type(tmp_path, value, kind):
    (tmp_path / "config.json").write_text(json.dumps(value))
    with pytest.raises(ValueError, match=f"config.json holds a {kind}, not an object"):
        read_quant_config(tmp_path, "who")


@pytest.mark.parametrize("qc", [None, {"quant_method": "gptq"}, {}])
def test_only_a_compressed_tensors_quant_method_is_read(tmp_path, qc):
    cfg = {} if qc is None else {"quantization_config": qc}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    method = None if not qc else qc["quant_method"]
    with pytest.raises(ValueError, match=re.escape(f"(quant_method {method!r})")):
        read_quant_config(tmp_path, "who")


def test_the_checked_config_file_config_and_quantization_config_are_returned(tmp_path):
    qc = _qc(ignore=["lm_head", "re:.*gate$"])
    cfg_file, config, got = read_quant_config(_config(tmp_path, qc), "who")
    assert (cfg_file, config, got) == (tmp_path / "config.json", {"quantization_config": qc}, qc)


@pytest.mark.parametrize(("qc", "field"), [
    (_qc(ignore=NESTED), "ignore[0]"),
    (_qc(ignore=["lm_head", "re:.*gate$", NESTED]), "ignore[2]"),
    ({**_qc(), "config_groups": {"g": {"targets": ["Linear", NESTED]}}},
     "config_groups.g.targets[1]"),
    ({**_qc(), "config_groups": {"g": {"targets": NESTED}}}, "config_groups.g.targets[0]"),
])
def test_a_backtracking_pattern_is_refused_naming_its_field_and_index(tmp_path, qc, field):
    """A lone string is an entry too; the index is the entry's own (from 0)."""
    with pytest.raises(ValueError, match=re.escape(f"quantization_config.{field}: 're:(a+)+$'")):
        read_quant_config(_config(tmp_path, qc), "who")


@pytest.mark.parametrize("name", ["float-quantized", "float_quantized", "FLOAT-QUANTIZED",
                                  CompressionFormat.float_quantized])
def test_a_format_is_found_by_its_enum_or_its_name_in_any_case_or_with_underscores(name):
    """compressed-tensors' registry standardizes a name (``_`` as ``-``, lower case)."""
    from compressed_tensors.compressors.naive_quantized.base import (
        FloatQuantizationCompressor,
    )

    assert compressor(name, "where") is FloatQuantizationCompressor


def test_a_formats_name_is_its_enums_value_as_the_config_writes_it():
    """``float-quantized`` (the enum's value, as config.json holds it), not ``float_quantized``
    (its Python name)."""
    assert fmt_name(CompressionFormat.float_quantized) == "float-quantized"
    assert fmt_name(CompressionFormat.mixed_precision) == "mixed-precision"
    assert fmt_name("pack-quantized") == "pack-quantized"
    assert fmt_name(None) == "None"


@pytest.mark.parametrize("name", ["model.py:Evil", "float-quantized.py:x", "sparse-bitmask"])
def test_a_format_no_compressor_is_registered_as_is_refused(name):
    with pytest.raises(ValueError, match=f"where: format '{re.escape(name)}' is no "
                                         r"compressed-tensors format \(expected one of "):
        compressor(name, "where")


def test_a_groups_unknown_format_is_refused_naming_the_group(tmp_path):
    qc = {**_qc(format="mixed-precision"), "config_groups": {
        "g": {"targets": ["Linear"], "format": "marlin-24",
              "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}}
    with pytest.raises(ValueError, match=r"quantization_config\.config_groups\.g: format "
                                         r"'marlin-24' is no compressed-tensors format"):
        parse_quant_config(tmp_path / "config.json", qc, "who")


def test_a_group_that_names_no_preset_is_a_valueerror_naming_the_config(tmp_path):
    """A string group is read as a preset's name; one naming none is no valid config."""
    qc = {**_qc(), "config_groups": {"g": "NO_SUCH_PRESET"}}
    with pytest.raises(ValueError, match="quantization_config is not valid"):
        parse_quant_config(tmp_path / "config.json", qc, "who")


@pytest.mark.parametrize("section", [{"format": "dense"}, {"global_sparsity": 0.0},
                                     {"format": None}])
def test_a_sparsity_config_of_no_format_or_dense_is_read(section):
    assert refuse_not_run("config.json", {"sparsity_config": section}, "who") is None  # read


@pytest.mark.parametrize("key", ["transform_config", "moe_sparsity_config", "sparsity_config"])
@pytest.mark.parametrize("value", [None, {}, []])
def test_an_empty_section_holds_nothing_not_run(key, value):
    assert refuse_not_run("config.json", {key: value}, "who") is None  # accepted


def _kv(**fields):
    args = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True,
            "dynamic": False, **fields}
    return QuantizationArgs(**args)


@pytest.mark.parametrize(("fields", "said"), [
    ({}, None),
    ({"dynamic": True}, "dynamic is true: "),
    ({"symmetric": False}, "symmetric is false: "),
    ({"num_bits": 4}, "num_bits is 4: "),
    ({"type": "int"}, 'type is "int": '),
    ({"strategy": "channel"}, 'strategy is "channel": '),
])
def test_the_kv_scheme_problem_names_the_field_as_the_config_json_writes_it(fields, said):
    got = kv_scheme_problem(_kv(**fields))
    assert got is None if said is None else got.startswith(said)


class _Attention(torch.nn.Module):
    pass


def test_a_kv_scale_belongs_to_the_attention_module_its_key_names():
    modules = {"model": torch.nn.Module(), "model.layers.0.self_attn": _Attention(),
               "model.layers.0.mlp": torch.nn.Linear(1, 1)}
    attention = {"model.layers.0.self_attn": modules["model.layers.0.self_attn"]}
    assert kv_scale_layer("model.layers.0.self_attn.k_scale", modules, attention,
                          "who") == "model.layers.0.self_attn"
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.mlp.v_scale' is on "
                                         r"model.layers.0.mlp \(Linear\), which is no cached "
                                         r"attention module"):
        kv_scale_layer("model.layers.0.mlp.v_scale", modules, attention, "who")


def test_a_folder_of_no_safetensors_file_is_refused(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="who: .* holds no .safetensors file"):
        load_checked_tensors(tmp_path, "who")


def test_loading_checks_the_headers_first_a_tensor_in_two_files_is_refused(tmp_path):
    save_file({"a.weight": torch.ones(2)}, str(tmp_path / "a.safetensors"))
    save_file({"a.weight": torch.ones(2)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(ValueError, match="tensor 'a.weight' is in both"):
        load_checked_tensors(tmp_path, "who")


def test_a_nested_modules_bad_scale_is_refused_at_load(tmp_path):
    save_file({"model.layers.0.mlp.weight_scale": torch.zeros(2)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.weight_scale holds a scale <= 0"):
        load_checked_tensors(tmp_path, "who")


def _raw(folder, header, n=None, data=b""):
    """A safetensors file of the header text ``header`` (``n``: the length it says)."""
    body = header.encode()
    (folder / "model.safetensors").write_bytes(
        (len(body) if n is None else n).to_bytes(8, "little") + body + data)
    return folder


def test_a_folder_named_like_a_safetensors_file_is_refused(tmp_path):
    (tmp_path / "model.safetensors").mkdir()
    with pytest.raises(ValueError, match="model.safetensors: not a regular file"):
        safetensors_headers(tmp_path, "who")


@pytest.mark.parametrize("past", [None, 1, 8])
def test_a_header_length_of_zero_or_past_the_files_end_is_refused(tmp_path, past):
    """``past``: how far past the file's end the said length reaches (None: a length of 0)."""
    header = '{"__metadata__": {"format": "pt"}}'
    n = 0 if past is None else len(header) + past
    with pytest.raises(ValueError, match=f"header length {n} does not fit the file"):
        safetensors_headers(_raw(tmp_path, header, n=n), "who")


def test_a_header_filling_the_whole_file_is_read(tmp_path):
    """No tensor data at all: the header ends where the file does."""
    _raw(tmp_path, '{"__metadata__": {"format": "pt"}, "a": '
                   '{"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}')
    assert safetensors_headers(tmp_path, "who") == {
        "a": (tmp_path / "model.safetensors", "F32", [0])}


def test_a_header_length_past_safetensors_limit_is_refused_unread(tmp_path):
    """safetensors' own limit on a header is 100 MiB, whatever the file's size."""
    n = 100 * 1024 * 1024 + 1
    f = tmp_path / "model.safetensors"
    with open(f, "wb") as fh:  # a sparse file: nothing of its size is written
        fh.write(n.to_bytes(8, "little") + b"{")
        fh.truncate(8 + n + 8)
    with pytest.raises(ValueError, match=f"header length {n} does not fit the file"):
        safetensors_headers(tmp_path, "who")


@pytest.mark.parametrize("header", ["[]", '"text"', "3"])
def test_a_header_that_is_no_json_object_is_refused(tmp_path, header):
    with pytest.raises(ValueError, match="header is not a JSON object"):
        safetensors_headers(_raw(tmp_path, header), "who")


@pytest.mark.parametrize("dtype", [5, None, ["F32"]])
def test_a_header_dtype_that_is_no_string_is_refused(tmp_path, dtype):
    header = json.dumps({"a": {"dtype": dtype, "shape": [1], "data_offsets": [0, 4]}})
    with pytest.raises(ValueError, match="tensor 'a' has no valid dtype and shape"):
        safetensors_headers(_raw(tmp_path, header, data=bytes(4)), "who")


def test_e8m0_codes_are_powers_of_two_and_other_dtypes_their_values():
    """OCP MX v1.0 5.4.1: E8M0 code c is 2^(c - 127), 255 is NaN; an int8 tensor holds no
    such codes: its integers are the values."""
    codes = scale_values(torch.tensor([0, 126, 127, 130, 254, 255], dtype=torch.uint8))
    assert codes.dtype == torch.float32
    assert codes[:5].tolist() == [2.0 ** -127, 0.5, 1.0, 8.0, 2.0 ** 127]
    assert math.isnan(codes[5])
    assert scale_values(torch.tensor([1, 2, 127], dtype=torch.int8)).tolist() == [1.0, 2.0, 127.0]
    assert scale_values(torch.tensor([0.25], dtype=torch.float16)).dtype == torch.float32


@pytest.mark.parametrize(("values", "said"), [
    ([1.0, float("inf")], "s holds NaN or inf (inf)"),
    ([1.0, -float("inf")], "s holds NaN or inf (-inf)"),
    ([1.0, -1.0, float("nan"), float("inf")], "s holds NaN or inf (nan)"),
    ([1.0, 0.0, -2.0], "s holds a scale <= 0 (0.0)"),
    ([1.0, -2.0, 0.0], "s holds a scale <= 0 (-2.0)"),
    ([1e-30, 3.0], None),
])
def test_a_scale_problem_names_the_first_bad_value(values, said):
    assert scale_problem("s", torch.tensor(values)) == said


@pytest.mark.parametrize(("values", "dtype", "bad"), [
    ([0.5], torch.float32, True), ([1.0, -3.0], torch.float32, False),
    ([], torch.float32, False), ([], torch.int8, False), ([-128, 127], torch.int16, False),
])
def test_a_zero_point_must_hold_whole_numbers_and_an_empty_one_holds_none_bad(values, dtype,
                                                                             bad):
    spec = QuantSpec("int8", Tensor(), symmetric=False)
    got = zero_point_problem("x.weight_zero_point", torch.tensor(values, dtype=dtype), spec)
    assert (got == "x.weight_zero_point holds values that are no integers in [-128, 127] "
                   f"({spec})") if bad else got is None


def _int_weights(num_bits=8, strategy="channel"):
    args = QuantizationArgs(num_bits=num_bits, type="int", strategy=strategy, symmetric=True)
    return QuantizationScheme(targets=["Linear"], weights=args), llmcompressor_spec(args)


def test_neutral_qparams_are_ones_and_zeros_for_the_stored_leaves_only():
    _, spec = _int_weights()
    got = neutral_qparams({"weight": 0, "weight_scale": 0}, spec, (4, 8))
    assert list(got) == ["weight_scale"] and torch.equal(got["weight_scale"], torch.ones(4, 1))
    got = neutral_qparams({"weight_scale": 0, "weight_global_scale": 0,
                           "weight_zero_point": 0}, spec, (4, 8))
    assert torch.equal(got["weight_global_scale"], torch.ones(1))
    assert got["weight_zero_point"].dtype == torch.int8
    assert torch.equal(got["weight_zero_point"], torch.zeros(4, 1, dtype=torch.int8))


@pytest.mark.parametrize("num_bits", [8, 4])
def test_unpacked_int_codes_at_either_end_of_the_range_are_stored_as_written(num_bits):
    scheme, spec = _int_weights(num_bits)
    codes = torch.zeros(4, 8, dtype=torch.int8)
    codes[0, :2] = torch.tensor([spec.qmin, spec.qmax])
    stored = {"weight": codes, "weight_scale": torch.ones(4, 1)}
    assert storage_problem("L", stored, neutral_qparams(stored, spec, (4, 8)), "int-quantized",
                           scheme, spec, (4, 8)) is None


def test_unpacked_int4_codes_below_the_range_are_refused():
    scheme, spec = _int_weights(4)
    codes = torch.zeros(4, 8, dtype=torch.int8)
    codes[1, 1] = -9
    stored = {"weight": codes, "weight_scale": torch.ones(4, 1)}
    assert storage_problem("L", stored, neutral_qparams(stored, spec, (4, 8)), "int-quantized",
                           scheme, spec, (4, 8)) == (
        f"L: weight holds codes in [-9, 0], outside the config's weights ({spec}) range [-8, 7]")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("meta", [True, False])
def test_a_scale_of_the_right_size_in_the_wrong_shape_is_refused(meta, dtype):
    """A [1, 4] scale where [4, 1] is written is another layout, not a reshape to make; its
    shape is named before its dtype."""
    scheme, spec = _int_weights()
    stored = {"weight": torch.zeros(4, 8, dtype=torch.int8),
              "weight_scale": torch.ones(1, 4, dtype=dtype)}
    probe = neutral_qparams(stored, spec, (4, 8), "meta" if meta else None)
    assert storage_problem("L", stored, probe, "int-quantized", scheme, spec, (4, 8),
                           meta) == "L.weight_scale has shape [1, 4], expected [4, 1]"


@pytest.mark.parametrize("meta", [True, False])
def test_the_weights_own_tensors_are_compared_before_its_scales(meta):
    """Every shape before any dtype, the weight's tensors first: a weight of other rows is
    named, not the scale that follows from it."""
    scheme, spec = _int_weights()
    stored = {"weight": torch.zeros(2, 8, dtype=torch.int8), "weight_scale": torch.ones(1, 4)}
    probe = neutral_qparams(stored, spec, (4, 8), "meta" if meta else None)
    assert storage_problem("L", stored, probe, "int-quantized", scheme, spec, (4, 8), meta) == (
        f"L: weight is torch.int8 [2, 8], but the config's weights ({spec}) are stored as "
        f"torch.int8 [4, 8]")


@pytest.mark.parametrize(("stored_dtype", "refused"), [(torch.int8, False),
                                                       (torch.float32, True)])
def test_a_zero_point_is_compared_as_the_schemes_zp_dtype(stored_dtype, refused):
    """The decoded (float) zero point is cast to ``zp_dtype`` (int8) before compressing: a
    stored int8 one is as written, a stored float one is not."""
    args = QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=False)
    scheme, spec = QuantizationScheme(targets=["Linear"], weights=args), llmcompressor_spec(args)
    stored = {"weight": torch.zeros(4, 8, dtype=torch.int8), "weight_scale": torch.ones(4, 1),
              "weight_zero_point": torch.zeros(4, 1, dtype=stored_dtype)}
    decoded = {"weight_scale": torch.ones(4, 1), "weight_zero_point": torch.zeros(4, 1)}
    got = storage_problem("L", stored, decoded, "int-quantized", scheme, spec, (4, 8))
    assert got == (f"L: weight_zero_point is torch.float32 [4, 1], but the config's weights "
                   f"({spec}) are stored as torch.int8 [4, 1]" if refused else None)


@pytest.mark.parametrize("meta", [True, False])
def test_a_packed_asymmetric_checkpoint_as_compressed_tensors_writes_it_passes(meta):
    """pack-quantized packs an int4 zero point too ([2, 4] int32 for 16 rows): on the meta
    device it is left to the full check, which compares it packed."""
    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=8,
                            symmetric=False)
    scheme, spec = QuantizationScheme(targets=["Linear"], weights=args), llmcompressor_spec(args)
    stored = dict(compressor("pack-quantized", "x").compress(
        {"weight": torch.zeros(16, 32), "weight_scale": torch.ones(16, 4),
         "weight_zero_point": torch.zeros(16, 4, dtype=torch.int8)}, scheme))
    assert stored["weight_zero_point"].shape == (2, 4)
    probe = neutral_qparams(stored, spec, (16, 32), "meta" if meta else None)
    assert storage_problem("L", stored, probe, "pack-quantized", scheme, spec, (16, 32),
                           meta) is None


def test_recipe_modifiers_that_rewrite_weights_are_listed_sorted_once(tmp_path):
    assert rewriting_modifiers(tmp_path) == []
    (tmp_path / "recipe.yaml").write_text(
        "default_stage:\n  default_modifiers:\n    SmoothQuantModifier:\n"
        "      smoothing_strength: 0.8\n    GPTQModifier:\n      targets: [Linear]\n"
        "    QuantizationModifier:\n      ignore: [lm_head]\n"
        "other_stage:\n  other_modifiers:\n    GPTQModifier: {}\n")
    assert rewriting_modifiers(tmp_path) == ["GPTQModifier", "SmoothQuantModifier"]


@pytest.mark.parametrize(("name", "classes", "want"), [
    ("model.layers.0.mlp", (), "model.layers.0.mlp"),
    ("re:.*proj", (), "re:.*proj"),
    ("model.experts[0]", (), r"re:model\.experts\[0\]$"),
    ("Linear", ("Linear", "Embedding"), "re:Linear$"),
    ("Linear", (), "Linear"),
])
def test_an_exact_name_is_itself_or_its_anchored_escaped_regex(name, classes, want):
    assert exact_pattern(name, classes) == want


def _nvfp4_roles():
    args = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
            "symmetric": True}
    roles = {"weight": QuantizationArgs(**args, dynamic=False),
             "input": QuantizationArgs(**args, dynamic="local")}
    return roles, {r: llmcompressor_spec(a, r) for r, a in roles.items()}


def test_nvfp4s_local_input_has_its_global_scale_and_no_other():
    roles, specs = _nvfp4_roles()
    stored = {"weight_packed": 0, "weight_scale": 0, "weight_global_scale": 0,
              "input_global_scale": 0}
    assert unexpected_qparam(stored, roles, specs, keep=set()) is None
    why = unexpected_qparam({**stored, "input_scale": 0}, roles, specs, keep=set())
    assert why.startswith("input_scale is stored, but the config's scheme has no such tensor")
    assert why.endswith("compressed-tensors writes only ['input_global_scale', "
                        "'weight_global_scale', 'weight_scale'] for this layer's quantization")


def _int8_roles(input_symmetric):
    roles = {"weight": QuantizationArgs(num_bits=8, type="int", strategy="channel"),
             "input": QuantizationArgs(num_bits=8, type="int", strategy="tensor",
                                       symmetric=input_symmetric, dynamic=False)}
    return roles, {r: llmcompressor_spec(a, r) for r, a in roles.items()}


def test_a_kept_leaf_is_no_unexpected_qparam_and_a_symmetric_zero_point_is_named_so():
    roles, specs = _int8_roles(input_symmetric=True)
    stored = {"weight": 0, "weight_scale": 0, "input_scale": 0, "k_scale": 0}
    assert unexpected_qparam(stored, roles, specs, keep={"k_scale"}) is None
    assert unexpected_qparam(stored, roles, specs, keep=set()).startswith(
        "k_scale is stored, but the config's scheme has no such tensor (its roles: weight, "
        "input)")
    why = unexpected_qparam({**stored, "input_zero_point": 0}, roles, specs, keep={"k_scale"})
    assert why.startswith(f"input_zero_point is stored, but the config's input ({specs['input']})"
                          " is symmetric: it has no zero point")


def test_a_dynamic_asymmetric_inputs_stored_zero_point_is_of_no_tensor_the_scheme_has():
    """A dynamic role stores no qparams: its zero point is no tensor of the scheme, and the
    role is not said to be symmetric."""
    roles = {"weight": QuantizationArgs(num_bits=8, type="int", strategy="channel"),
             "input": QuantizationArgs(num_bits=8, type="int", strategy="token",
                                       symmetric=False, dynamic=True)}
    specs = {r: llmcompressor_spec(a, r) for r, a in roles.items()}
    stored = {"weight": 0, "weight_scale": 0, "input_zero_point": 0}
    assert unexpected_qparam(stored, roles, specs, keep=set()) == (
        "input_zero_point is stored, but the config's scheme has no such tensor (its roles: "
        "weight, input); compressed-tensors writes only ['weight_scale'] for this layer's "
        "quantization")


def test_an_asymmetric_inputs_missing_zero_point_is_named():
    roles, specs = _int8_roles(input_symmetric=False)
    stored = {"weight": 0, "weight_scale": 0, "input_scale": 0}
    assert missing_zero_point("L", stored, roles, specs) == (
        f"asymmetric input activations need L.input_zero_point ({specs['input']}), which is "
        f"not stored")
    assert missing_zero_point("L", {**stored, "input_zero_point": 0}, roles, specs) is None


@pytest.mark.parametrize(("key", "grouped", "said"), [
    ("m.self_attn.q_scale", {"m.self_attn"}, "is a query scale of attention quantization"),
    ("m.self_attn.prob_scale", {"m.self_attn"}, "is a scale of the attention probabilities"),
    ("m.self_attn.q_zero_point", {"m.self_attn"}, "is a zero point of the attention's"),
    ("m.self_attn.k_scale", set(), "is a KV-cache scale, but quantization_config has no kv_"),
    ("m.mlp.weight_zero_point", set(), "belongs to no layer of the model"),
    ("m.mlp.input_scale", {"m"}, "belongs to no layer of the model"),
])
def test_a_tensor_no_read_layer_owns_is_refused_naming_what_it_is(key, grouped, said):
    with pytest.raises(ValueError, match=f"from_compressed_tensors: P: tensor '{key}' {said}"):
        refuse_unread({key: 0}, grouped, None, "P")


def test_the_tensors_of_read_layers_and_a_schemes_kv_scales_pass():
    tensors = {"m.mlp.weight_scale": 0, "m.mlp.weight_zero_point": 0,
               "m.self_attn.k_scale": 0, "m.self_attn.v_scale": 0, "m.mlp.bias": 0}
    assert refuse_unread(tensors, {"m.mlp"}, "fp8", "P") is None  # nothing refused
