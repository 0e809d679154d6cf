"""A ``kv_cache_scheme`` quantscope does not run is refused naming the file and the field
(probe s55; docs/guide/deploy.md: "every damage is a ValueError naming the file and the tensor
or config field")."""

import json
import re

import pytest
import torch

from quantscope.calibration import Calibration

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from ct_folders import edited, kv_only_export

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def kv_only(tmp_path_factory):
    return kv_only_export(tmp_path_factory.mktemp("ct") / "kv")


def _scheme(src, dst, **fields):
    return edited(src, dst, config=lambda qc: qc["kv_cache_scheme"].update(fields))


def _refusal(folder, field, value):
    with pytest.raises(ValueError) as e:
        Calibration.from_compressed_tensors(folder)
    msg = str(e.value)
    assert msg.startswith(f"from_compressed_tensors: {folder / 'config.json'}: quantization_"
                          f"config.kv_cache_scheme.{field} is {json.dumps(value)}: "), msg
    return msg


def test_an_asymmetric_kv_cache_scheme_is_refused_naming_the_file_and_field(kv_only, tmp_path):
    # it raised QuantSpec's own error, naming neither ("QuantSpec.symmetric: fp8_e4m3 is a
    # float format and is symmetric only ...")
    msg = _refusal(_scheme(kv_only, tmp_path / "asym", symmetric=False), "symmetric", False)
    assert "symmetric only" in msg and "QuantSpec" not in msg


@pytest.mark.parametrize(("field", "value"), [("dynamic", True), ("strategy", "channel")])
def test_the_other_refused_fields_name_the_file_too(kv_only, tmp_path, field, value):
    _refusal(_scheme(kv_only, tmp_path / "e", **{field: value}), field, value)


def test_the_fp8_scheme_the_export_writes_reads(kv_only):
    back = Calibration.from_compressed_tensors(kv_only)
    assert re.fullmatch(r"fp8_e4m3 tensor sym", str(back.recipe.kv_cache.spec))


@pytest.mark.parametrize(("fields", "field", "value"), [
    ({"type": "int"}, "type", "int"),  # int8: read as int8 QDQ on the fp8 scales
    ({"num_bits": 4}, "num_bits", 4),  # read as fp4_e2m1 QDQ
    ({"type": "int", "num_bits": 4}, "type", "int"),
], ids=["int8", "float4", "int4"])
def test_a_kv_cache_scheme_the_export_refuses_is_refused_on_reading(kv_only, tmp_path, fields,
                                                                    field, value):
    # the export writes fp8 KV caches only (vLLM's cache is fp8): these were read, and apply()
    # ran int8 / fp4 KV QDQ no runtime runs
    msg = _refusal(_scheme(kv_only, tmp_path / "e", **fields), field, value)
    assert "vLLM's KV cache is fp8" in msg and "type: float, num_bits: 8" in msg


def test_the_export_and_the_reader_share_one_kv_scheme_rule(kv_only):
    from compressed_tensors.quantization import QuantizationArgs

    from quantscope.exporters.read_checks import KV_SCHEME, kv_scheme_problem

    written = json.loads((kv_only / "config.json").read_text())["quantization_config"]
    args = QuantizationArgs.model_validate(written["kv_cache_scheme"])
    assert kv_scheme_problem(args) is None
    assert {f: getattr(getattr(args, f), "value", getattr(args, f)) for f in KV_SCHEME} == {
        f: want for f, (want, _) in KV_SCHEME.items()}


@pytest.mark.parametrize(("fields", "field"), [({"type": "int"}, "type"),
                                               ({"symmetric": False}, "symmetric")])
def test_check_reports_a_kv_cache_scheme_the_reader_refuses(kv_only, tmp_path, fields, field):
    # `quantscope check` found nothing here while from_compressed_tensors refused the folder
    from quantscope.exporters.consistency import check, format_problems

    folder = _scheme(kv_only, tmp_path / "e", **fields)
    problems = check(folder)
    assert [p["group"] for p in problems] == ["kv_cache_scheme"], problems
    assert format_problems(problems).startswith(
        f"{folder / 'config.json'}: quantization_config.kv_cache_scheme.{field} is ")
    assert check(kv_only) == []
