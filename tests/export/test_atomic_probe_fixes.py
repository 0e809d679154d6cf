"""Probe (cli/repro_out_replace.py): how an existing output is replaced.

(a) ``calibrate`` / ``compare`` replaced an earlier run folder with a file the user had put
in it (NOTES.txt), deleting it: the marker now lists what quantscope wrote, and a folder
holding anything else is refused, naming it; (b) ``--out`` given as a symbolic link to an
earlier run replaced the link with a new folder (the link lost, its target stale): an
output folder's or exported (ONNX) file's link is written through, kept (a report's is
still replaced itself); (c) ``export --format onnx --out DIR/`` wrote a file named DIR: a
file path ending in a separator is refused."""

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from quantscope import cli
from quantscope.calibration import calibrate
from quantscope.exporters.atomic import (
    MARKER,
    atomic_dir,
    atomic_file,
    check_writable_target,
    written_by_quantscope,
)


def _tree(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


def _output(path: Path, text: str = "1") -> Path:
    """A folder as quantscope writes one: a file and a subfolder with a file."""
    with atomic_dir(path, overwrite=True) as tmp:
        Path(tmp, "report.json").write_text(text)
        Path(tmp, "qparams").mkdir()
        Path(tmp, "qparams", "q.bin").write_text(text)
    return path


def _run(tmp_path: Path) -> Path:
    """A `quantscope calibrate` run folder, by its own writer (a tiny calibration)."""
    from quantscope.cli.calibrate import save_run
    from quantscope.cli.running import Phases

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    cal = calibrate(model, [torch.randn(4, 16)], "w8a8", progress=False)
    save_run(str(tmp_path / "run"), cal, cal.report({}), Phases(quiet=True))
    return tmp_path / "run"


# --- (a) nothing of the user's is lost ---

def test_the_marker_lists_what_quantscope_wrote(tmp_path):
    out = _output(tmp_path / "out")
    listed = json.loads((out / MARKER).read_text())["files"]
    assert listed == ["qparams", "qparams/q.bin", "report.json"]
    assert written_by_quantscope(out)
    _output(out, "2")  # only its own files: replaced
    assert (out / "report.json").read_text() == "2"


@pytest.mark.parametrize("extra", ["NOTES.txt", "qparams/NOTES.txt", "mine/"])
def test_a_folder_holding_a_users_file_is_refused_not_replaced(tmp_path, extra):
    out = _output(tmp_path / "out")
    if extra.endswith("/"):
        (out / extra).mkdir()
    else:
        (out / extra).write_text("my notes")
    before = _tree(out)
    assert not written_by_quantscope(out)
    for write in (lambda: check_writable_target(out, overwrite=True),
                  lambda: _output(out, "2")):
        with pytest.raises(ValueError, match=rf"holds what quantscope did not write there "
                                             rf"\({extra}\).*move it out of the folder or "
                                             rf"choose another output"):
            write()
    assert _tree(out) == before and (out / extra.rstrip("/")).exists()
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary left


def test_the_error_names_a_few_of_many_extra_files(tmp_path):
    out = _output(tmp_path / "out")
    for i in range(5):
        (out / f"n{i}.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"\(n\d\.txt, n\d\.txt, n\d\.txt and 2 more\)"):
        check_writable_target(out, overwrite=True)


def test_a_marker_without_a_list_keeps_the_earlier_rule(tmp_path):
    out = _output(tmp_path / "out")
    (out / MARKER).write_text(json.dumps({"written_by": "quantscope", "version": "0.0"}))
    (out / "extra.txt").write_text("written by an earlier quantscope's caller")
    assert written_by_quantscope(out)
    _output(out, "2")
    assert sorted(os.listdir(out)) == [MARKER, "qparams", "report.json"]


def test_quantscope_outputs_written_into_a_folder_later_are_its_own(tmp_path):
    """A calibration saved into a run and a plot redrawn into a compare run (`quantscope
    plot`) are quantscope's: the folder is still replaced."""
    out = _output(tmp_path / "out")
    _output(out / "saved")  # a whole output of its own (its own marker)
    with atomic_file(out / "hist.png") as t:  # a report or plot: recorded in the marker
        Path(t).write_bytes(b"png")
    assert "hist.png" in json.loads((out / MARKER).read_text())["files"]
    assert written_by_quantscope(out)
    (out / "saved" / "NOTES.txt").write_text("mine")  # ... but not with the user's inside
    with pytest.raises(ValueError, match=r"\(saved/\)"):
        check_writable_target(out, overwrite=True)
    os.remove(out / "saved" / "NOTES.txt")
    _output(out, "2")
    assert sorted(os.listdir(out)) == [MARKER, "qparams", "report.json"]


def test_cli_calibrate_refuses_a_run_holding_a_users_file(tmp_path, capsys):
    run = _run(tmp_path)
    assert written_by_quantscope(run)
    (run / "NOTES.txt").write_text("my notes")
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "bert"}')
    before = _tree(run)
    # refused before the model loads (this folder has no weights to load)
    assert cli.main(["calibrate", "--model", str(model), "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "NOTES.txt" in err and "choose another output" in err, err
    assert _tree(run) == before


# --- (b) a symbolic link is written through, kept ---

def test_a_linked_folder_is_replaced_through_the_link(tmp_path):
    run = _output(tmp_path / "run")
    latest = tmp_path / "latest"
    latest.symlink_to("run")
    assert check_writable_target(latest, overwrite=True) == str(latest)
    _output(latest, "2")
    assert latest.is_symlink() and os.readlink(latest) == "run"
    assert (run / "report.json").read_text() == "2" and written_by_quantscope(run)
    assert sorted(os.listdir(tmp_path)) == ["latest", "run"]
    (run / "NOTES.txt").write_text("mine")  # the target's own rules apply through the link
    with pytest.raises(ValueError, match=rf"'{run}' holds what quantscope did not write"):
        _output(latest, "3")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "a.txt").write_text("mine")
    (tmp_path / "to-mine").symlink_to(mine)
    with pytest.raises(ValueError, match="is not a folder quantscope wrote"):
        _output(tmp_path / "to-mine")
    assert _tree(mine) == {"a.txt": b"mine"}


def test_a_dangling_link_creates_its_target(tmp_path):
    (tmp_path / "next").symlink_to("runs/3")
    _output(tmp_path / "next")
    assert (tmp_path / "next").is_symlink()
    assert (tmp_path / "runs" / "3" / "report.json").read_text() == "1"


def test_a_reports_link_is_still_replaced_itself(tmp_path):
    """A report or plot replaces any file: a link planted in a run folder must not lead it
    over a user's file (tests/cli/test_cli_inputs.py), so its link is replaced, not followed."""
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "report.md").symlink_to("notes.txt")
    with atomic_file(tmp_path / "report.md") as t:
        Path(t).write_text("new")
    assert not (tmp_path / "report.md").is_symlink()
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_linked_onnx_export_is_replaced_through_the_link(tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import helper

    def save(path, doc):
        graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], doc,
                                  [helper.make_tensor_value_info("x", 1, [1])],
                                  [helper.make_tensor_value_info("y", 1, [1])])
        proto = helper.make_model(graph)
        helper.set_model_props(proto, {"quantscope": "onnx export"})
        onnx.save(proto, path)

    save(tmp_path / "model-1.onnx", "old")
    (tmp_path / "model.onnx").symlink_to("model-1.onnx")
    with atomic_file(tmp_path / "model.onnx", overwrite=True, kind="file") as t:
        save(t, "new")
    assert (tmp_path / "model.onnx").is_symlink()
    assert onnx.load(tmp_path / "model-1.onnx").graph.name == "new"
    (tmp_path / "weights.bin").write_bytes(b"not ours")
    (tmp_path / "w.onnx").symlink_to("weights.bin")
    with pytest.raises(ValueError, match="is not an ONNX file quantscope exported"):
        check_writable_target(tmp_path / "w.onnx", overwrite=True, kind="file")


# --- (c) a file path ending in a separator means a folder ---

@pytest.mark.parametrize("kind", ["file", "report"])
@pytest.mark.parametrize("tail", [os.sep, os.sep + "."])
def test_a_file_path_ending_in_a_separator_is_refused(tmp_path, kind, tail):
    out = f"{tmp_path}{os.sep}onnxdir{tail}"
    with pytest.raises(ValueError, match="is a folder path; expected a file path"):
        check_writable_target(out, overwrite=True, kind=kind)
    with pytest.raises(ValueError, match="is a folder path; expected a file path"), \
            atomic_file(out, kind=kind):
        pass
    assert os.listdir(tmp_path) == []
    check_writable_target(f"{tmp_path}{os.sep}folder{os.sep}")  # a folder: fine


def test_cli_export_onnx_to_a_folder_path_is_refused(tmp_path, capsys):
    run = _run(tmp_path)
    out = f"{tmp_path}{os.sep}onnxdir{os.sep}"
    assert cli.main(["export", str(run), "--format", "onnx", "--out", out]) == 2
    assert "is a folder path; expected a file path" in capsys.readouterr().err
    assert not os.path.lexists(out.rstrip(os.sep))
