"""Probe s57 of what quantscope reads (docs/SECURITY.md): a FIFO named ``*.safetensors`` in a
checkpoint blocked ``check`` and ``from_compressed_tensors`` in ``open`` for ever (a folder of
that name failed bare); an earlier output's marker that is a FIFO, a link to ``/dev/zero`` or
JSON nested past the recursion limit blocked, filled the memory or raised RecursionError
when the output was replaced; a ``re:`` pattern that does not compile raised the matcher's
bare ``re.error`` from the reader and passed ``check``."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from quantscope._checks import pattern_refusal
from quantscope.exporters import atomic, check

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")


def _checkpoint(folder, **quantization_config):
    folder.mkdir()
    qc = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
          "config_groups": {}, **quantization_config}
    (folder / "config.json").write_text(json.dumps({"model_type": "llama",
                                                    "quantization_config": qc}))
    save_file({"a.weight_scale": torch.ones(2)}, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("make", [os.mkfifo, os.mkdir], ids=["fifo", "folder"])
def test_a_safetensors_name_that_is_no_regular_file_is_refused(tmp_path, make):
    folder = _checkpoint(tmp_path / "ct")
    make(folder / "extra.safetensors")
    with pytest.raises(ValueError, match=r"extra\.safetensors: not a regular file"):
        check(folder)


def test_a_pattern_that_does_not_compile_is_named(tmp_path):
    assert "is not a regular expression (missing ), unterminated" in pattern_refusal("re:(")
    assert pattern_refusal("re:.*self_attn.(q|k|v)_proj$") is None
    # s58 mutants: the pattern after "re:" is what compiles; a repeat count past C's int is
    # the matcher's OverflowError, named the same way
    assert "nothing to repeat at position 0" in pattern_refusal("re:*abc")
    assert "is not a regular expression" in pattern_refusal("re:a{4294967296}")
    folder = _checkpoint(tmp_path / "ct", ignore=["lm_head", "re:("])
    with pytest.raises(ValueError, match=r"quantization_config\.ignore\[1\]: 're:\(' is not"):
        check(folder)


@pytest.mark.parametrize("marker", ["fifo", "device", "deep", "big", "list"])
def test_an_outputs_marker_is_read_only_from_a_small_regular_file(tmp_path, marker):
    path = tmp_path / atomic.MARKER
    if marker == "fifo":
        os.mkfifo(path)
    elif marker == "device":
        os.symlink("/dev/zero", path)
    elif marker == "deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif marker == "big":  # valid, and listing a file, but past the 64 MiB a marker may be
        path.write_text(json.dumps({"written_by": "quantscope", "files": ["a"],
                                    "pad": "x" * (64 << 20)}))
    else:  # valid JSON, not an object
        path.write_text("[1, 2]")
    assert atomic._marker_data(str(tmp_path)) == {}  # (it returns: no block, no MemoryError)
    assert atomic._listed(str(tmp_path)) is None
    assert atomic._json_has(str(path), None) is False
