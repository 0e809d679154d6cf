"""Damaged copies of compressed-tensors folders, and the refusal reading one back, for the
read-check tests (tests/export/test_read_damaged_s34.py, test_read_pins_s35.py)."""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from quantscope.calibration import Calibration


def damaged(src, dst, edit):
    """A copy of the folder ``src`` whose tensors ``edit`` changed; returns (folder, the
    undamaged tensors)."""
    folder = shutil.copytree(src, dst)
    (f,) = folder.glob("*.safetensors")
    tensors = load_file(f)
    changed = dict(tensors)
    edit(changed)
    save_file(changed, f, metadata={"format": "pt"})
    return folder, tensors


def refusal(folder) -> str:
    """The ValueError reading ``folder`` back, which names its tensor files."""
    with pytest.raises(ValueError) as e:
        Calibration.from_compressed_tensors(folder)
    msg = str(e.value)
    assert f"{folder}/*.safetensors" in msg, msg
    return msg
