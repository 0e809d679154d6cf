"""The one output-path guard (issue 37 rows 1, 13, 18, 19): every command and API that
writes refuses an output that is, or lies above, an input or the working folder; overwrite
replaces only quantscope's own earlier outputs (files too); concurrent writers never leave
the target absent; what is written has the user's umask."""

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tiny_models import bert_folder
from torch import nn

from quantscope import cli
from quantscope.calibration import calibrate, load
from quantscope.exporters.atomic import (
    MARKER,
    atomic_dir,
    atomic_file,
    check_writable_target,
    written_by_quantscope,
)


def _calibration():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    return calibrate(model, [torch.randn(4, 16) for _ in range(2)], "w8a8", progress=False)


def _model_folder(path: Path) -> Path:
    """A folder that looks like a user's model (what --model points at)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "bert"}')
    (path / "model.safetensors").write_bytes(b"weights")
    return path


def _tree(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


# --- row 1: never an input, the working folder, or a folder quantscope did not write ---

def test_save_refuses_the_working_folder_and_what_lies_above_it(tmp_path, monkeypatch):
    cal = _calibration()
    work = tmp_path / "project"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    for out in (".", str(work), str(tmp_path)):
        with pytest.raises(ValueError, match="current working folder"):
            cal.save(out)
    assert _tree(work) == {"notes.txt": b"mine"}


def test_overwrite_replaces_only_quantscope_outputs(tmp_path):
    cal = _calibration()
    model = _model_folder(tmp_path / "model")
    before = _tree(model)
    with pytest.raises(ValueError, match="is not a folder quantscope wrote"):
        cal.save(model)  # Calibration.save overwrites by default: never a user's folder
    assert _tree(model) == before
    cal.save(tmp_path / "cal")
    assert written_by_quantscope(tmp_path / "cal")
    cal.save(tmp_path / "cal")  # its own earlier output: replaced
    assert load(tmp_path / "cal").states.keys() == cal.states.keys()


def test_outputs_written_before_the_marker_are_still_recognised(tmp_path):
    cal = _calibration()
    cal.save(tmp_path / "old")
    os.remove(tmp_path / "old" / MARKER)  # as an earlier quantscope wrote it
    assert written_by_quantscope(tmp_path / "old")
    cal.save(tmp_path / "old")
    (tmp_path / "cmp").mkdir()  # a compare run's folder
    (tmp_path / "cmp" / "report.json").write_text(json.dumps({"setup": {}, "runs": {}}))
    assert written_by_quantscope(tmp_path / "cmp")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "quantscope.json").write_text('{"format": "something else"}')
    assert not written_by_quantscope(tmp_path / "other")


def test_an_output_that_is_or_contains_an_input_is_refused(tmp_path):
    model = _model_folder(tmp_path / "models" / "m")
    for out in (model, model.parent, tmp_path):
        with pytest.raises(ValueError, match="input"):
            check_writable_target(out, overwrite=True, inputs=[model])
        with pytest.raises(ValueError, match="input"), atomic_dir(out, overwrite=True,
                                                                  inputs=[model]):
            pass
    link = tmp_path / "link"
    link.symlink_to(model)  # the same folder under another name
    with pytest.raises(ValueError, match="input"):
        check_writable_target(link, overwrite=True, inputs=[model])
    check_writable_target(model / "quantized", inputs=[model])  # inside an input: fine


def test_cli_calibrate_out_never_replaces_the_model_or_the_working_folder(tmp_path, capsys,
                                                                            monkeypatch):
    model = _model_folder(tmp_path / "m")
    before = _tree(tmp_path)
    monkeypatch.chdir(model)
    for out in (".", str(model), str(tmp_path)):
        assert cli.main(["calibrate", "--model", str(model), "--out", out]) == 2
        err = capsys.readouterr().err
        assert "--out" in err and ("input" in err or "working folder" in err), err
    assert _tree(tmp_path) == before


def test_cli_export_never_replaces_the_source_model(tmp_path, capsys):
    model = _model_folder(tmp_path / "m")
    cal = _calibration()
    cal.info["model"] = str(model)
    cal.save(tmp_path / "run" / "qparams")
    before = _tree(tmp_path)
    for out in (model, tmp_path / "run", tmp_path / "run" / "qparams"):
        assert cli.main(["export", str(tmp_path / "run"), "--model", str(model), "--out",
                         str(out), "--overwrite"]) == 2
        assert "input" in capsys.readouterr().err
    assert _tree(tmp_path) == before


def test_export_run_refuses_its_inputs_before_loading(tmp_path):
    from quantscope.cli.export import export_run

    model = _model_folder(tmp_path / "m")
    cal = _calibration()
    cal.info["model"] = str(model)
    cal.save(tmp_path / "run" / "qparams")
    before = _tree(tmp_path)
    with pytest.raises(ValueError, match="input"):
        export_run(tmp_path / "run", model, overwrite=True)  # the recorded model
    with pytest.raises(ValueError, match="input"):  # the calibration it reads
        export_run(tmp_path / "run", tmp_path / "run" / "qparams", overwrite=True)
    with pytest.raises(ValueError, match="input"):
        export_run(tmp_path / "run", tmp_path / "run", overwrite=True)
    assert _tree(tmp_path) == before


def test_overwrite_never_replaces_a_file_quantscope_did_not_export(tmp_path):
    """Probe: an ONNX export with overwrite=True replaced the model's own model.safetensors
    (the guard let any file not named .onnx be replaced, as a report). An exported file is
    replaced only when it is quantscope's ONNX file; reports and plots still are replaced."""
    model = _model_folder(tmp_path / "m")
    before = _tree(model)
    for name in ("model.safetensors", "config.json"):
        with pytest.raises(ValueError, match="is not an ONNX file quantscope exported"):
            check_writable_target(model / name, overwrite=True, kind="file", inputs=[model])
        with pytest.raises(ValueError, match="is not an ONNX file quantscope exported"), \
                atomic_file(model / name, kind="file"):
            pass
    assert _tree(model) == before
    report = tmp_path / "report.txt"
    report.write_text("an earlier report")
    with atomic_file(report) as t:  # kind="report": replaced as open(path, "w") would
        Path(t).write_text("new")
    assert report.read_text() == "new"


def test_onnx_export_with_overwrite_leaves_the_model_weights(tmp_path):
    pytest.importorskip("onnx")
    import transformers
    from tiny_models import llama_folder

    from quantscope import export

    folder = llama_folder(tmp_path / "llama")
    before = _tree(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    batch = {"input_ids": torch.randint(0, 10, (1, 6))}
    cal = calibrate(model, [batch], "w8a8", progress=False)
    for name in ("model.safetensors", "tokenizer.json"):
        with pytest.raises(ValueError, match=r"model\.safetensors|tokenizer\.json"):
            export(cal, model, folder / name, format="onnx", overwrite=True,
                   example_inputs=batch)
    assert _tree(folder) == before
    transformers.AutoModelForCausalLM.from_pretrained(folder)  # still loads


# --- rows 13 and 19: an ONNX file output is replaced by --overwrite; modes follow the umask ---

@pytest.fixture
def run_of_tiny_bert(tmp_path):
    from quantscope.demo import models

    d = bert_folder(tmp_path / "tiny-bert", max_position_embeddings=64)
    model, tok = models.load_model(d)
    enc = tok(["a first calibration sentence", "and another one"], return_tensors="pt",
              padding=True)
    cal = calibrate(model, [dict(enc)], "w8a8", progress=False)
    cal.info.update(model=str(d), task="embedding")
    cal.save(tmp_path / "run" / "qparams")
    return tmp_path / "run"


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_cli_export_onnx_overwrite_replaces_the_file(run_of_tiny_bert, tmp_path, capsys,
                                                     umask_022):
    pytest.importorskip("onnx")
    out = tmp_path / "m.onnx"
    args = ["export", str(run_of_tiny_bert), "--format", "onnx", "--out", str(out)]
    assert cli.main(args) == 0
    assert written_by_quantscope(out)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    assert cli.main(args) == 2  # exists: refused without --overwrite
    assert "pass overwrite=True (--overwrite)" in capsys.readouterr().err
    first = out.read_bytes()
    out.write_bytes(first)  # (a new inode: replaced, not edited in place, below)
    inode = out.stat().st_ino
    assert cli.main([*args, "--overwrite"]) == 0
    assert out.stat().st_ino != inode and written_by_quantscope(out)
    other = tmp_path / "other.onnx"
    other.write_bytes(b"not ours")
    assert cli.main(["export", str(run_of_tiny_bert), "--format", "onnx", "--out", str(other),
                     "--overwrite"]) == 2
    assert "not an ONNX file quantscope exported" in capsys.readouterr().err
    assert other.read_bytes() == b"not ours"


def test_written_folders_and_files_follow_the_umask(run_of_tiny_bert, tmp_path, umask_022):
    pytest.importorskip("compressed_tensors")
    from quantscope.cli.export import export_run

    out = export_run(run_of_tiny_bert, tmp_path / "ct")
    entries = [Path(out), *Path(out).rglob("*")]
    assert any(p.name == "model.safetensors" for p in entries)
    for p in entries:
        want = 0o755 if p.is_dir() else 0o644
        assert stat.S_IMODE(p.stat().st_mode) == want, p
    os.umask(0o077)  # a private umask gives private modes: the user's choice, not tempfile's
    _calibration().save(tmp_path / "private")
    assert stat.S_IMODE((tmp_path / "private").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "private" / "quantscope.json").stat().st_mode) == 0o600
    with atomic_file(tmp_path / "report.json") as t:
        Path(t).write_text("{}")
    assert stat.S_IMODE((tmp_path / "report.json").stat().st_mode) == 0o600


# --- row 18: writers racing on one folder ---

_WRITER = textwrap.dedent("""
    import sys, torch
    from torch import nn
    from quantscope.calibration import calibrate
    torch.manual_seed(int(sys.argv[2]))
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    cal = calibrate(m, [torch.randn(4, 16)], "w8a8", progress=False)
    print("ready", flush=True)
    sys.stdin.readline()  # all writers start together
    ok = clear = 0
    for _ in range(int(sys.argv[3])):
        try:
            cal.save(sys.argv[1])
            ok += 1
        except (ValueError, RuntimeError) as e:  # the documented refusals
            assert "output" in str(e), e
            clear += 1
    print("done", ok, clear, flush=True)
""")


def _can_exchange(folder: Path) -> bool:
    from quantscope.exporters import atomic

    (folder / "a").mkdir()
    (folder / "b").mkdir()
    try:
        return atomic._renameat2(str(folder / "a"), str(folder / "b"), atomic._RENAME_EXCHANGE)
    finally:
        shutil.rmtree(folder / "a")
        shutil.rmtree(folder / "b")


def test_concurrent_saves_keep_the_target_whole(tmp_path):
    if not _can_exchange(tmp_path):
        pytest.skip("no atomic exchange of two names here: writers take turns on a lock, and "
                    "the target is absent for a moment between them")
    target = tmp_path / "cal"
    _calibration().save(target)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(target), str(i), "30"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for i in range(4)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    polls = absent = 0
    while any(p.poll() is None for p in procs):  # progress ends the loop, not a clock
        polls += 1
        if not (target / "quantscope.json").is_file():
            absent += 1
    results = [(p.returncode, p.stdout.read(), p.stderr.read()) for p in procs]
    for rc, out, err in results:
        assert rc == 0, err
    saved = sum(int(out.split()[1]) for _, out, _ in results)
    assert saved + sum(int(out.split()[2]) for _, out, _ in results) == 4 * 30
    assert saved > 0 and polls > 0
    assert absent == 0, f"the target was absent in {absent} of {polls} polls"
    load(target)  # whole: one writer's calibration
    assert sorted(n for n in os.listdir(tmp_path)) == ["cal"]  # no temporary left


def test_a_new_target_created_meanwhile_is_a_clear_error_without_overwrite(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(ValueError, match="exists and is not empty"), atomic_dir(target) as t:
        Path(t, "a").write_text("mine")
        _calibration().save(target)  # another writer wins the name first
    assert json.loads((target / "quantscope.json").read_text())["format"]
    assert sorted(os.listdir(tmp_path)) == ["out"]
