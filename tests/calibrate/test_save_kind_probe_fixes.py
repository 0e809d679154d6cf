"""Probe (s15/safety/repro_save_replaces_export.py): ``Calibration.from_compressed_tensors(X)
.save(X)`` with its default ``overwrite=True`` deleted the export X it was read from (its
config.json and weights gone, a calibration left), and a save onto any quantscope output
did the same. An existing folder is now replaced only by an output of the same kind: the
marker records the kind; a folder whose marker predates that is told by its contents."""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from quantscope import export
from quantscope.calibration import Calibration, calibrate, load
from quantscope.exporters import atomic
from quantscope.exporters.atomic import MARKER

pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _tree(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


def _llama_export(out: Path, **kw) -> Path:
    """A tiny Llama's w8a8 compressed-tensors export at ``out``."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg).eval()
    cal = calibrate(model, [{"input_ids": torch.randint(0, 32, (2, 8))}], "w8a8",
                    progress=False)
    export(cal, model, out, **kw)
    return out


def _calibration():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    return calibrate(model, [torch.randn(4, 16)], "w8a8", progress=False)


def test_save_never_replaces_the_export_it_was_read_from(tmp_path):
    ckpt = _llama_export(tmp_path / "llama-w8a8")
    before = _tree(ckpt)
    back = Calibration.from_compressed_tensors(ckpt)
    with pytest.raises(ValueError, match=r"holds a compressed-tensors export quantscope "
                                         r"wrote, not a calibration"):
        back.save(ckpt)  # default overwrite=True
    assert _tree(ckpt) == before  # config.json, model.safetensors still there
    back.save(tmp_path / "cal")  # elsewhere: fine
    assert atomic.output_kind(tmp_path / "cal") == "calibration"


def test_an_export_without_the_kind_in_its_marker_is_still_refused(tmp_path):
    """An export an earlier version marked (no kind recorded): told by its config.json."""
    ckpt = _llama_export(tmp_path / "llama-w8a8")
    mark = json.loads((ckpt / MARKER).read_text())
    assert mark["kind"] == "compressed-tensors"
    del mark["kind"]
    (ckpt / MARKER).write_text(json.dumps(mark))
    assert atomic.output_kind(ckpt) == "compressed-tensors"
    before = _tree(ckpt)
    with pytest.raises(ValueError, match="not a calibration"):
        _calibration().save(ckpt)
    assert _tree(ckpt) == before


def test_save_replaces_an_earlier_calibration_only(tmp_path):
    from quantscope.cli.calibrate import save_run
    from quantscope.cli.running import Phases

    cal = _calibration()
    cal.save(tmp_path / "cal")
    cal.label = "second"
    cal.save(tmp_path / "cal")  # a calibration replaces a calibration
    assert load(tmp_path / "cal").label == "second"
    save_run(str(tmp_path / "run"), cal, cal.report({}), Phases(quiet=True))
    before = _tree(tmp_path / "run")
    with pytest.raises(ValueError, match="holds a `quantscope calibrate` run"):
        cal.save(tmp_path / "run")
    assert _tree(tmp_path / "run") == before


def test_an_export_never_replaces_a_calibration_but_replaces_an_export(tmp_path):
    _calibration().save(tmp_path / "cal")
    before = _tree(tmp_path / "cal")
    with pytest.raises(ValueError, match="holds a calibration quantscope wrote, not a "
                                         "compressed-tensors export"):
        _llama_export(tmp_path / "cal", overwrite=True)
    assert _tree(tmp_path / "cal") == before
    ckpt = _llama_export(tmp_path / "export")
    _llama_export(ckpt, overwrite=True)  # an export replaces an earlier export
    assert atomic.output_kind(ckpt) == "compressed-tensors"
