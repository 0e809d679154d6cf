"""Command-line fixes of probe s32: ``export --allow-lossy`` with a format it does nothing
for is refused before anything loads, and a run whose recorded model folder has gone says so
and names ``--model`` (``evaluate`` and ``export``)."""

import shutil

from cli_helpers import run_cli as _run

FAST = ["--calib-docs", "2", "--max-length", "8", "--batch-size", "2", "--eval-max-length",
        "8", "--device", "cpu", "--threads", "1", "--no-progress"]


def test_allow_lossy_with_onnx_is_refused_naming_the_format(tmp_path, capsys):
    run = tmp_path / "run" / "qparams"
    run.mkdir(parents=True)
    (run / "quantscope.json").write_text("{}")  # a run as far as the checks before loading go
    rc, _, err = _run(capsys, "export", str(tmp_path / "run"), "--format", "onnx",
                      "--allow-lossy", "--out", str(tmp_path / "m.onnx"))
    assert rc == 2
    assert "--allow-lossy applies to --format compressed-tensors only" in err, err
    assert not (tmp_path / "m.onnx").exists()


def test_allow_lossy_reaches_the_compressed_tensors_export(tmp_path, capsys, monkeypatch):
    """--allow-lossy (compressed-tensors: write the nearest form instead of refusing) is
    passed on to export_run as given (mutation s61: dropped, a lossy run stayed refused)."""
    from quantscope.cli import export

    run = tmp_path / "run" / "qparams"
    run.mkdir(parents=True)
    (run / "quantscope.json").write_text("{}")
    asked = []

    def export_run(run_dir, out, format, model, **options):
        asked.append((format, options["allow_lossy"]))
        return out

    monkeypatch.setattr(export, "export_run", export_run)
    for i, flags in enumerate(([], ["--allow-lossy"])):
        rc, _, err = _run(capsys, "export", str(tmp_path / "run"), *flags,
                          "--out", str(tmp_path / f"ct{i}"))
        assert rc == 0, err
    assert asked == [("compressed-tensors", False), ("compressed-tensors", True)]


def test_a_run_whose_model_has_moved_names_model_flag(llama_dir, tmp_path, capsys,
                                                       monkeypatch):
    shutil.copytree(llama_dir, tmp_path / "llama")
    monkeypatch.chdir(tmp_path)
    rc, _, err = _run(capsys, "calibrate", "--model", "llama", "--recipe", "w8a8",
                      "--out", "run", *FAST)
    assert rc == 0, err
    shutil.move(tmp_path / "llama", tmp_path / "llama-moved")
    for argv in (["evaluate", "run", "--no-progress"], ["export", "run", "--out", "ct"]):
        rc, _, err = _run(capsys, *argv)
        assert rc == 2
        assert "records its model as" in err and "pass --model PATH" in err, err
    rc, _, err = _run(capsys, "export", "run", "--out", "ct", "--model", "llama-moved")
    assert rc == 0, err


def test_onnx_export_of_a_float_format_run_is_refused_before_the_model_loads(
        llama_dir, tmp_path, capsys, monkeypatch):
    """Session 33: an fp8 run was refused only after the model (the slow part) loaded."""
    from quantscope.demo import models

    monkeypatch.chdir(tmp_path)
    rc, _, err = _run(capsys, "calibrate", "--model", str(llama_dir), "--recipe", "fp8",
                      "--out", "run", *FAST)
    assert rc == 0, err

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the calibration was checked")

    monkeypatch.setattr(models, "load_model", no_load)
    rc, _, err = _run(capsys, "export", "run", "--format", "onnx", "--out", "m.onnx")
    assert rc != 0
    assert "fp8_e4m3" in err and "integer formats only" in err, err
    assert not (tmp_path / "m.onnx").exists()


def test_an_out_folder_with_a_trailing_slash_is_printed_once(llama_dir, tmp_path, capsys,
                                                             monkeypatch):
    """Session 33: ``--out run/`` printed ``run//report.md``."""
    monkeypatch.chdir(tmp_path)
    rc, out, err = _run(capsys, "calibrate", "--model", str(llama_dir), "--recipe", "w8a8",
                        "--out", "run/", *FAST)
    assert rc == 0, err
    assert "report: run/report.md" in out and "//" not in out, out
