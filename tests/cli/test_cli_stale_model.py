"""``quantscope export RUN`` / ``evaluate RUN`` after the model folder the run recorded was
re-saved with other weights of the same shapes (fine-tuned in place, or ``--model`` naming
another checkpoint of the architecture) refuse it, naming the first weight that differs,
instead of writing the old scales over the new weights (probe s42 f1: 35 % of the int8 codes
saturated, exit 0); the model calibrated, SmoothQuant's reapplied weights among them, still
exports, and --allow-other-weights exports / evaluates the new weights with the run's scales
when that is what is wanted."""

import shutil

import pytest
import torch
from cli_helpers import run_cli

transformers = pytest.importorskip("transformers")

FAST = ["--calib-docs", "2", "--max-length", "8", "--batch-size", "2", "--eval-max-length",
        "8", "--device", "cpu", "--threads", "1", "--no-progress"]


def _resave_scaled(folder, factor):
    """The folder's model saved in place with every weight times ``factor``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(factor)
    model.save_pretrained(folder)


@pytest.mark.parametrize("smooth", [[], ["--smooth", "0.5"]], ids=["plain", "smooth"])
def test_a_model_folder_resaved_with_other_weights_is_refused(llama_dir, tmp_path, capsys,
                                                                 smooth):
    model, run = tmp_path / "llama", str(tmp_path / "run")
    shutil.copytree(llama_dir, model)
    rc, _, err = run_cli(capsys, "calibrate", "--model", str(model), "--recipe", "w8a8",
                         *smooth, "--out", run, *FAST)
    assert rc == 0, err
    rc, _, err = run_cli(capsys, "export", run, "--out", str(tmp_path / "ct"))
    assert rc == 0, err  # the model calibrated (smoothed again by export: the same bits)
    _resave_scaled(model, 3.0)
    said = ("is not the weight calibrated (its bits differ from the fingerprint calibrate "
            "recorded): the model was re-saved, fine-tuned, or smoothed in place")
    rc, _, err = run_cli(capsys, "export", run, "--out", str(tmp_path / "ct2"))
    assert rc == 2 and err.strip().splitlines()[-1].startswith(
        "quantscope export: error: model.layers.0.self_attn.q_proj.weight "), err
    assert said in err, err
    assert not (tmp_path / "ct2").exists()
    rc, _, err = run_cli(capsys, "evaluate", run, "--no-progress")
    assert rc == 2 and "error: apply: model.layers.0.self_attn.q_proj.weight " in err, err
    assert said in err, err
    assert ("evaluating float" in err) == bool(smooth), err  # refused before, where it can be
    rc, _, err = run_cli(capsys, "export", run, "--model", llama_dir, "--out",
                         str(tmp_path / "ct3"))
    assert rc == 0, err  # --model: the folder calibrated
    assert said_next(capsys, run, tmp_path).endswith(  # whole: within the CLI's 500 characters
        "(to use these scales all the same, on weights not smoothed since: "
        "calibration.without_fingerprints(), --allow-other-weights)")
    # the override the message names: the run's scales on the new weights, as asked
    rc, _, err = run_cli(capsys, "export", run, "--allow-other-weights", "--out",
                         str(tmp_path / "ct4"))
    assert rc == 0 and (tmp_path / "ct4" / "config.json").is_file(), err
    rc, out, err = run_cli(capsys, "evaluate", run, "--allow-other-weights", "--no-progress")
    assert rc == 0 and "quantscope evaluate:" in out, err


def said_next(capsys, run, tmp_path) -> str:
    """What ``export RUN`` says of the re-saved folder (its last line)."""
    rc, _, err = run_cli(capsys, "export", run, "--out", str(tmp_path / "ct5"))
    assert rc == 2, err
    return err.strip().splitlines()[-1]
