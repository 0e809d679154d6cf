"""Probe s29 (paths): three ways an output write went wrong.

(1) A legal output name of 242..255 bytes failed with ENAMETOOLONG on quantscope's own
temporary name (``.NAME.XXXXXXXX.tmp``); on the command line only after the whole run. The
temporaries' names are now cut to fit NAME_MAX, and a name over it is refused up front.
(2) Replacing a read-only output folder (``chmod 555``) swapped it out, could not empty it
and left it behind under a hidden ``.NAME.XXXX.tmp``, silently: refused up front now, and a
temporary that still cannot be removed is a warning naming it.
(3) ``Calibration.save(X)`` deleted a compressed-tensors export saved at ``X/ct`` (and
``calibrate --out RUN`` one at ``RUN/ct``, an ONNX export at ``RUN/model.onnx``): a nested
output counts as the folder's only when the folder's own writer makes that kind."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from quantscope import cli
from quantscope.calibration import calibrate
from quantscope.exporters import atomic
from quantscope.exporters.atomic import MARKER, atomic_dir, atomic_file, check_writable_target

NAME_MAX = 255  # POSIX file systems (ext4, tmpfs, xfs): the tests' tmp_path


def _tree(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


def _output(path: Path, text: str = "1", what=None) -> Path:
    """A folder as quantscope writes one: a file and a subfolder with a file."""
    with atomic_dir(path, overwrite=True, what=what) as tmp:
        Path(tmp, "report.json").write_text(text)
        Path(tmp, "qparams").mkdir()
        Path(tmp, "qparams", "q.bin").write_text(text)
    return path


def _calibration():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    return calibrate(model, [torch.randn(4, 16)], "w8a8", progress=False)


def _run(tmp_path: Path) -> Path:
    """A `quantscope calibrate` run folder, by its own writer."""
    from quantscope.cli.calibrate import save_run
    from quantscope.cli.running import Phases

    cal = _calibration()
    save_run(str(tmp_path / "run"), cal, cal.report({}), Phases(quiet=True))
    return tmp_path / "run"


def _model_folder(tmp_path: Path) -> Path:
    """A model folder the CLI accepts up front (no weights: refused before it loads)."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "bert"}')
    return model


def _hidden(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith("."))


# --- (1) long names ---

@pytest.mark.parametrize("name", ["a" * 242, "a" * 250, "a" * NAME_MAX,
                                  "\u00e9" * 127 + "a"])  # 255 bytes of 2-byte characters
def test_a_legal_long_name_is_written(tmp_path, name):
    assert len(os.fsencode(name)) <= NAME_MAX
    seen = []
    with atomic_dir(tmp_path / name, overwrite=True) as tmp:
        seen.append(os.path.basename(tmp))
        Path(tmp, "a.txt").write_text("1")
    _calibration().save(tmp_path / name)  # replaced: the calibration, whole
    assert (tmp_path / name / "quantscope.json").is_file()
    with atomic_file(tmp_path / (name[:-4] + ".txt")) as t:  # a report, an ONNX export
        seen.append(os.path.basename(t))
        Path(t).write_text("report")
    assert (tmp_path / (name[:-4] + ".txt")).read_text() == "report"
    for temp in seen:  # ours, recognisable, within the limit, whole UTF-8 characters
        raw = os.fsencode(temp)
        assert len(raw) <= NAME_MAX and temp.startswith(".") and temp.endswith(".tmp")
        assert raw.decode("utf-8")[1:].startswith(name[:100])
    assert _hidden(tmp_path) == []


def test_a_long_name_replaced_under_the_lock_fits_too(tmp_path, monkeypatch):
    """Where no atomic exchange exists, the old folder is moved aside into ``.NAME.XXXX.old``."""
    out = _output(tmp_path / ("b" * NAME_MAX))
    monkeypatch.setattr(atomic, "_renameat2", lambda *a: False)
    _output(out, "2")
    assert (out / "report.json").read_text() == "2" and _hidden(tmp_path) == []


@pytest.mark.parametrize("where", ["out", "parent"])
def test_a_name_over_name_max_is_refused_up_front(tmp_path, where):
    long = "c" * (NAME_MAX + 1)
    out = tmp_path / long if where == "out" else tmp_path / long / "out"
    for kind in ("folder", "file", "report"):
        with pytest.raises(ValueError, match=rf"output '{re.escape(str(out))}': a name in it is "
                                             rf"{NAME_MAX + 1} bytes long; the file system "
                                             rf"takes names of at most {NAME_MAX} bytes"):
            check_writable_target(out, overwrite=True, kind=kind)
    with pytest.raises(ValueError, match="bytes long"):
        _calibration().save(out)
    assert os.listdir(tmp_path) == []


def test_cli_calibrate_refuses_a_name_over_name_max_before_the_model_loads(tmp_path, capsys):
    model = _model_folder(tmp_path)
    out = tmp_path / ("d" * (NAME_MAX + 1))
    assert cli.main(["calibrate", "--model", str(model), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and f"{NAME_MAX + 1} bytes long" in err, err
    assert sorted(os.listdir(tmp_path)) == ["m"]


# --- (2) a read-only output folder ---

_READ_ONLY = textwrap.dedent("""
    import json, os, sys, warnings
    from pathlib import Path
    from quantscope.exporters.atomic import atomic_dir

    d = Path(sys.argv[1])
    (d / "probe").mkdir(mode=0o555)
    if os.access(d / "probe", os.W_OK):
        sys.exit(77)  # root whose CAP_DAC_OVERRIDE could not be dropped

    def write(path, text):
        with atomic_dir(path, overwrite=True) as tmp:
            Path(tmp, "report.json").write_text(text)
            Path(tmp, "qparams").mkdir()
            Path(tmp, "qparams", "q.bin").write_text(text)

    result = {}
    for ro in ("", "qparams"):  # the folder itself, a folder in it
        out = d / ("out-" + (ro or "top"))
        write(out, "1")
        os.chmod(out / ro, 0o555)
        try:
            write(out, "2")
            result[ro] = ["replaced", ""]
        except PermissionError as e:
            result[ro] = ["refused", str(e)]
        result[ro].append((out / "report.json").read_text())
        os.chmod(out / ro, 0o755)
    # a temporary that cannot be removed (a failed build holding a read-only folder) is said
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with atomic_dir(d / "failed", overwrite=True) as tmp:
                Path(tmp, "sub").mkdir()
                Path(tmp, "sub", "f").write_text("x")
                os.chmod(Path(tmp, "sub"), 0o555)
                raise KeyError("the build failed")
        except KeyError:
            pass
    result["warned"] = [str(w.message) for w in caught]
    result["tmp"] = tmp
    result["left"] = sorted(n for n in os.listdir(d) if n.startswith("."))
    os.chmod(Path(tmp, "sub"), 0o755)
    print(json.dumps(result))
""")


def _without_dac_override(script: str, *args) -> dict:
    """Run ``script`` as this user, or, as root, without the capability to write what its
    mode forbids (as the probe did: setpriv); skip where that cannot be had."""
    cmd = [sys.executable, "-c", script, *map(str, args)]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root, and no setpriv to drop CAP_DAC_OVERRIDE")
        cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all",
               *cmd]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env,
                          timeout=300)
    if done.returncode == 77 or (os.geteuid() == 0 and done.returncode != 0
                                 and "setpriv" in done.stderr):
        pytest.skip(f"cannot drop CAP_DAC_OVERRIDE here: {done.stderr[-200:]}")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_read_only_output_is_refused_before_any_work_and_nothing_is_left(tmp_path):
    result = _without_dac_override(_READ_ONLY, tmp_path)
    for ro in ("", "qparams"):
        out = tmp_path / ("out-" + (ro or "top"))
        state, message, content = result[ro]
        assert state == "refused", result
        assert message.startswith(f"output '{out}' cannot be replaced: '{out / ro}' is "
                                  f"read-only to this process (mode 555)"), message
        assert "chmod -R u+w" in message and "choose another output" in message
        assert content == "1"  # untouched
    tmp = result["tmp"]
    assert result["warned"] == [(f"quantscope could not remove its temporary folder {tmp!r} "
                                 f"(the replaced or unfinished output): remove it yourself")]
    assert result["left"] == [os.path.basename(tmp)]  # only the one the warning names
    shutil.rmtree(tmp)


# --- (3) an output of another kind saved inside a folder ---

def _export(cal_model, out: Path) -> Path:
    import quantscope

    cal, model, src = cal_model
    quantscope.export(cal, model, out, model_path=src)
    assert (out / "model.safetensors").is_file()
    return out


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    from tiny_models import bert_folder

    src = bert_folder(tmp_path_factory.mktemp("bert"))
    model = transformers.BertModel.from_pretrained(src).eval()
    batches = [{"input_ids": torch.randint(0, 100, (2, 8))} for _ in range(2)]
    return calibrate(model, batches, "w8a8", progress=False), model, str(src)


def test_a_calibration_never_deletes_an_export_saved_inside_it(tmp_path, bert):
    cal = bert[0]
    x = tmp_path / "calib"
    cal.save(x)
    ct = _export(bert, x / "ct")
    before = _tree(x)
    with pytest.raises(ValueError, match=rf"output '{re.escape(str(x))}' holds a compressed-"
                                         rf"tensors export quantscope wrote, "
                                         rf"'{re.escape(str(ct))}/': replacing the folder "
                                         rf"would delete it; move it out of the folder or "
                                         rf"remove it yourself"):
        cal.save(x)
    assert _tree(x) == before and _hidden(tmp_path) == []
    shutil.move(ct, tmp_path / "ct")  # what the message says: then it is replaced
    cal.save(x)
    assert sorted(os.listdir(x)) == sorted([MARKER, "quantscope.json", "qparams.safetensors"])


def test_cli_calibrate_refuses_a_run_holding_an_export_before_the_model_loads(
        tmp_path, capsys, bert):
    run = _run(tmp_path)
    _export(bert, run / "ct")
    before = _tree(run)
    model = _model_folder(tmp_path)
    assert cli.main(["calibrate", "--model", str(model), "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and f"'{run / 'ct'}/'" in err and "compressed-tensors" in err, err
    assert _tree(run) == before


def _onnx(path, doc="graph"):
    onnx = pytest.importorskip("onnx")
    from onnx import helper

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], doc,
                              [helper.make_tensor_value_info("x", 1, [1])],
                              [helper.make_tensor_value_info("y", 1, [1])])
    proto = helper.make_model(graph)
    helper.set_model_props(proto, {"quantscope": "onnx export"})
    onnx.save(proto, path)


def test_an_onnx_export_saved_into_a_run_is_not_the_runs(tmp_path):
    run = _run(tmp_path)
    with atomic_file(run / "model.onnx", overwrite=True, kind="file") as t:
        _onnx(t)
    assert "model.onnx" not in json.loads((run / MARKER).read_text())["files"]
    before = _tree(run)
    with pytest.raises(ValueError, match=rf"holds an ONNX export quantscope wrote, "
                                         rf"'{re.escape(str(run / 'model.onnx'))}'"):
        _run(tmp_path)
    assert _tree(run) == before
    with atomic_file(run / "hist.png") as t:  # a plot redrawn into it is still the run's
        Path(t).write_bytes(b"png")
    assert "hist.png" in json.loads((run / MARKER).read_text())["files"]


def test_only_what_the_folders_writer_makes_nests(tmp_path):
    """A calibration saved into a calibrate run is the run's (replaced with it); a
    calibration saved into a calibration, or into a compare-like run, is not."""
    cal = _calibration()
    run = _run(tmp_path)
    cal.save(run / "again")
    _run(tmp_path)  # replaced, the nested calibration with it
    assert sorted(os.listdir(run)) == sorted([MARKER, "qparams", "report.json", "report.md"])
    x = tmp_path / "calib"
    cal.save(x)
    cal.save(x / "inner")
    with pytest.raises(ValueError, match=rf"holds a calibration quantscope wrote, "
                                         rf"'{re.escape(str(x / 'inner'))}/'"):
        cal.save(x)
    cmp = _output(tmp_path / "cmp", what="compare-run")
    cal.save(cmp / "cal")
    with pytest.raises(ValueError, match="holds a calibration quantscope wrote"):
        _output(cmp, "2", what="compare-run")
    assert (cmp / "cal" / "quantscope.json").is_file()
