"""``quantscope export RUN --model B`` of a KV-cache-only run (``--targets`` with no pattern:
no Linear quantized) onto another checkpoint of the same shapes is refused, naming the
projection whose keys differ (probe s45 p3c: exit 0, and A's ``k_scale`` written for B's keys
4x larger, which fp8 then clips); the model calibrated exports, and --allow-other-weights
takes B knowingly."""

import shutil

import pytest
import torch
from cli_helpers import run_cli

transformers = pytest.importorskip("transformers")

FAST = ["--calib-docs", "2", "--max-length", "8", "--batch-size", "2", "--eval-max-length",
        "8", "--device", "cpu", "--threads", "1", "--no-progress"]


def test_a_kv_cache_only_run_is_refused_on_another_checkpoint(llama_dir, tmp_path, capsys):
    other, run = tmp_path / "other", str(tmp_path / "run")
    shutil.copytree(llama_dir, other)
    model = transformers.AutoModelForCausalLM.from_pretrained(other)
    with torch.no_grad():
        for layer in model.model.layers:  # "fine-tuned": its keys 4x larger
            layer.self_attn.k_proj.weight.mul_(4.0)
    model.save_pretrained(other)
    rc, _, err = run_cli(capsys, "calibrate", "--model", llama_dir, "--recipe", "fp8",
                         "--targets", "--kv-cache", "fp8", "--out", run, *FAST)
    assert rc == 0, err
    said = ("model.layers.0.self_attn.k_proj.weight is not the weight calibrated (its bits "
            "differ from the fingerprint calibrate recorded for the key cache's scales)")
    rc, _, err = run_cli(capsys, "export", run, "--model", str(other), "--out",
                         str(tmp_path / "ct"))
    last = err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith(f"quantscope export: error: {said}"), err
    assert last.endswith("calibration.without_fingerprints(), --allow-other-weights)"), err
    assert not (tmp_path / "ct").exists()
    rc, _, err = run_cli(capsys, "evaluate", run, "--model", str(other))
    assert rc == 2 and f"error: apply: {said}" in err, err
    rc, _, err = run_cli(capsys, "export", run, "--out", str(tmp_path / "own"))
    assert rc == 0 and (tmp_path / "own" / "config.json").is_file(), err
    rc, _, err = run_cli(capsys, "export", run, "--model", str(other), "--allow-other-weights",
                         "--out", str(tmp_path / "knowingly"))
    assert rc == 0 and (tmp_path / "knowingly" / "config.json").is_file(), err
