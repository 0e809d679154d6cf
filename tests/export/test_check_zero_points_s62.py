"""``check`` reports a stored zero point that is no integer of its layer's format, with the
line from_compressed_tensors refuses it with (one rule: ``read_checks.zero_point_problem``):
before, ``quantscope check`` called such a checkpoint consistent and the reader refused it.
A ``pack-quantized`` weight's zero points are packed eight to an int32, so check leaves them
to the reader, which sees them unpacked."""

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from quantscope import Channel, Group, QuantSpec, Tensor
from quantscope.calibration import Calibration, Recipe, Role, Rule, calibrate
from quantscope.cli import main
from quantscope.exporters import check
from quantscope.exporters.consistency import format_problems


def _exported(tmp_path, weight, input=None):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=50, tie_word_embeddings=False)).eval()
    roles = {"weight": Role(weight, "minmax")}
    if input is not None:
        roles["input"] = Role(input, "minmax")
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 50, (1, 8), generator=g)} for _ in range(2)]
    out = tmp_path / "ct"
    calibrate(model, batches, Recipe((Rule(("Linear",), **roles),), ("lm_head",), "asym"),
              progress=False).export(model, out)
    return out


def _zero_points(folder) -> list[dict]:
    """check's zero point problems (an asymmetric int input is no scheme vLLM serves: check
    reports that config group too)."""
    return [p for p in check(folder) if p.get("zero_point")]


def _edit(folder, key, fn):
    (f,) = folder.glob("*.safetensors")
    t = load_file(f)
    t[key] = fn(t[key])
    save_file(t, f, metadata={"format": "pt"})


def test_check_reports_the_zero_point_the_reader_refuses(tmp_path, capsys):
    """An int4 asymmetric input's zero point edited to 100 (its int8 storage holds it; int4's
    integers are [-8, 7]): check names it with the reader's words, the command exits 1."""
    out = _exported(tmp_path, QuantSpec("int8", Channel(0), symmetric=False),
                    QuantSpec("int4", Tensor(), symmetric=False))
    assert _zero_points(out) == []
    key = "model.layers.0.self_attn.q_proj.input_zero_point"
    _edit(out, key, lambda zp: torch.full_like(zp, 100))
    why = f"{key} holds values that are no integers in [-8, 7] (int4 tensor asym)"
    problems = _zero_points(out)
    assert [p["why"] for p in problems] == [why] and problems[0]["tensor"] == key
    assert format_problems(problems) == why
    with pytest.raises(ValueError) as refused:
        Calibration.from_compressed_tensors(out)
    assert why in str(refused.value)
    assert main(["check", str(out)]) == 1
    assert why in capsys.readouterr().out


def test_a_non_integer_float_zero_point_is_reported(tmp_path):
    """A zero point stored as floats that are not whole (0.5) is no code of the format."""
    out = _exported(tmp_path, QuantSpec("int8", Channel(0), symmetric=False),
                    QuantSpec("int8", Tensor(), symmetric=False))
    key = "model.layers.0.mlp.up_proj.input_zero_point"
    _edit(out, key, lambda zp: zp.float() + 0.5)
    assert [p["tensor"] for p in _zero_points(out)] == [key]


def test_packed_weight_zero_points_are_not_read_as_values(tmp_path):
    """w4a16 asymmetric groups are written pack-quantized: each int32 of
    ``weight_zero_point`` packs eight int4 codes, far outside [-8, 7] as a number, and the
    checkpoint is consistent (the reader unpacks and checks them)."""
    out = _exported(tmp_path, QuantSpec("int4", Group(16), symmetric=False))
    (f,) = out.glob("*.safetensors")
    packed = load_file(f)["model.layers.0.mlp.down_proj.weight_zero_point"]
    assert packed.dtype == torch.int32 and int(packed.abs().max()) > 7
    assert check(out) == []
    Calibration.from_compressed_tensors(out)  # read back: the unpacked codes are int4's
