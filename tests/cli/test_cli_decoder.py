"""The command line on a causal LM: a tiny random-weight Llama whose tokenizer has no pad
token, calibrated from a compressed-tensors scheme name, scored by perplexity."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
from tiny_models import llama_folder, require_lee_corpus

require_lee_corpus()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = llama_folder(tmp_path_factory.mktemp("tiny-llama-cli"),
                        architectures=["LlamaForCausalLM"])
    assert transformers.AutoTokenizer.from_pretrained(path).pad_token is None
    return str(path)


FAST = ["--calib-docs", "4", "--max-length", "16", "--batch-size", "2", "--eval-max-length",
        "32", "--device", "cpu", "--threads", "1"]


def _cli(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "quantscope", *args], capture_output=True,
                          text=True, env=env, check=False)


@pytest.mark.extended  # two interpreters end to end; the commands run in process below
def test_calibrate_then_evaluate_a_causal_lm(llama_dir, tmp_path):
    run = str(tmp_path / "run")
    r = _cli("calibrate", "--model", llama_dir, "--scheme", "W4A16", "--group-size", "32",
             "--out", run, *FAST)
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert len(out.strip().splitlines()) < 40
    for noise in ("Warning", "warning", "Failed to load", "Traceback"):
        assert noise not in out
    assert "perplexity: float" in r.stdout and "left in float: lm_head" in r.stdout
    meta = json.loads(Path(run, "qparams", "quantscope.json").read_text())
    assert meta["info"]["task"] == "causal-lm" and meta["info"]["model"] == llama_dir
    report = json.loads(Path(run, "report.json").read_text())
    m = report["metrics"]
    assert m["perplexity"] > 1 and m["perplexity_fp32"] > 1
    spec = {row["spec"] for row in report["layers"]}
    assert spec == {"int4 group:32 sym"}
    # the run is self-describing: evaluate needs nothing else, and reproduces the figures
    r = _cli("evaluate", run, "--json")
    assert r.returncode == 0, r.stderr
    again = json.loads(r.stdout.strip().splitlines()[-1])
    assert again["perplexity"] == m["perplexity"]
    assert again["perplexity_fp32"] == m["perplexity_fp32"]


def test_indivisible_group_size(llama_dir, tmp_path, capsys):
    from quantscope import cli

    rc = cli.main(["calibrate", "--model", llama_dir, "--scheme", "W4A16", "--group-size", "48",
                   "--out", str(tmp_path / "r"), "--no-progress", *FAST])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and "group size 48 does not divide" in err and "--group-size 16 / 32 would" in err
    rc = cli.main(["calibrate", "--model", llama_dir, "--scheme", "W4A16", "--group-size", "48",
                   "--on-indivisible", "float", "--out", str(tmp_path / "r"), "--no-progress",
                   *FAST])
    assert rc == 0
    rows = json.loads((tmp_path / "r" / "report.json").read_text())["layers"]
    # 64-wide inputs take groups of 48 nowhere; 96-wide (down_proj) inputs do
    assert {r["layer"].split(".")[-1] for r in rows} == {"down_proj"}


def test_kv_cache_calibrated_and_exported(llama_dir, tmp_path):
    from safetensors.torch import load_file

    from quantscope import cli
    from quantscope.calibration import load

    run, out = str(tmp_path / "run"), tmp_path / "ct"
    rc = cli.main(["calibrate", "--model", llama_dir, "--recipe", "w8a8", "--kv-cache", "fp8",
                   "--out", run, "--no-progress", *FAST])
    assert rc == 0
    calib = load(Path(run, "qparams"))
    assert calib.recipe.kv_cache is not None
    assert cli.main(["export", run, "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["kv_cache_scheme"]["type"] == "float"
    tensors = load_file(out / "model.safetensors")
    for i in range(2):
        name = f"model.layers.{i}.self_attn"
        assert torch.equal(tensors[f"{name}.k_scale"],
                           calib.states[name]["key"].qparams.scale.reshape(1))
        assert torch.equal(tensors[f"{name}.v_scale"],
                           calib.states[name]["value"].qparams.scale.reshape(1))


def test_sequential_gives_the_whole_pass_qparams(llama_dir, tmp_path, capsys):
    from quantscope import cli
    from quantscope.calibration.results.io import load

    runs = {}
    for mode in ([], ["--sequential"], ["--sequential", "quantized"]):
        out = str(tmp_path / ("-".join(mode) or "whole"))
        rc = cli.main(["calibrate", "--model", llama_dir, "--recipe", "w8a8", "--out", out,
                       "--no-progress", *mode, *FAST])
        assert rc == 0, capsys.readouterr().err
        runs[tuple(mode)] = load(Path(out, "qparams"))
    whole, seq = runs[()], runs[("--sequential",)]
    assert seq.info["sequential"]["mode"] == "float"
    assert runs[("--sequential", "quantized")].info["sequential"]["mode"] == "quantized"
    assert whole.states.keys() == seq.states.keys()
    for layer, roles in whole.states.items():
        for role, st in roles.items():
            assert torch.equal(st.qparams.scale, seq.states[layer][role].qparams.scale)


def test_keep_float_leaves_the_ranked_activations_dynamic(llama_dir, tmp_path, capsys):
    from quantscope import cli
    from quantscope.calibration.results.io import load

    out = str(tmp_path / "kf")
    rc = cli.main(["calibrate", "--model", llama_dir, "--recipe", "w8a8", "--keep-float", "3",
                   "--out", out, "--no-progress", *FAST])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    assert "--keep-float: 3 activations dynamic instead of static" in printed.out
    calib = load(Path(out, "qparams"))  # saved and loaded: the dynamic states survive
    kept = calib.info["keep_float"]
    assert kept["n"] == 3 and kept["mode"] == "dynamic" and len(kept["tensors"]) >= 3
    for t in kept["tensors"]:
        layer, role = t.rsplit(" ", 1)
        st = calib.states[layer][role]
        assert st.dynamic is True and type(st.spec.layout).__name__ == "Token"
    for g in calib.info["fusion_groups"]:  # a fused group's shared input falls back whole
        inside = {f"{layer} input" in kept["tensors"] for layer in g["layers"]}
        assert len(inside) == 1, g
    static = [(n, r) for n, rs in calib.states.items() for r, st in rs.items()
              if r != "weight" and st.dynamic is not True]
    assert len(static) == 14 - len(kept["tensors"])  # 2 layers x 7 Linears' inputs
    for bad, msg in ((["--keep-float", "-1"], "--keep-float must be"),
                     (["--keep-float", "1", "--sequential"], "not with --sequential")):
        rc = cli.main(["calibrate", "--model", llama_dir, "--recipe", "w8a8", *bad,
                       "--out", str(tmp_path / "bad"), "--no-progress", *FAST])
        assert rc == 2 and msg in capsys.readouterr().err


def test_smooth_is_calibrated_evaluated_and_exported_alike(llama_dir, tmp_path, capsys):
    """--smooth: the run keeps SmoothQuant's scales, and `export` (which loads the float model
    afresh) writes the smoothed weights the qparams were calibrated on."""
    from compressed_tensors.compressors import ModelCompressor  # noqa: F401 (the extra)
    from safetensors.torch import load_file

    from quantscope import cli
    from quantscope.calibration import load
    from quantscope.calibration.choice.smooth import reapply

    run, out = str(tmp_path / "run"), tmp_path / "ct"
    assert cli.main(["calibrate", "--model", llama_dir, "--recipe", "w8a8", "--smooth", "0.8",
                     "--out", run, "--no-progress", *FAST]) == 0
    assert "--smooth 0.8: 6 modules' outputs smoothed" in capsys.readouterr().out
    calib = load(Path(run, "qparams"))
    assert calib.info["smooth"]["alpha"] == 0.8 and len(calib.smoothing) == 6
    assert cli.main(["export", run, "--out", str(out)]) == 0
    smoothed = transformers.LlamaForCausalLM.from_pretrained(llama_dir)
    reapply(smoothed, calib)
    tensors = load_file(out / "model.safetensors")
    norm = "model.layers.1.post_attention_layernorm.weight"
    assert torch.equal(tensors[norm], smoothed.state_dict()[norm])
    assert not torch.equal(tensors[norm], transformers.LlamaForCausalLM.from_pretrained(
        llama_dir).state_dict()[norm])
    # read back, its qparams do not run the recorded float model (found by probing: 0.29
    # logits off, without a word): a warning, and the checkpoint is the model to apply them to
    import dataclasses

    from quantscope.calibration import Calibration

    with pytest.warns(UserWarning, match="was made by quantscope's SmoothQuant"):
        back = Calibration.from_compressed_tensors(out)
    assert back.info["model"] == str(out)
    assert back.quantizes_like(dataclasses.replace(calib, smoothing={}))
    assert cli.main(["calibrate", "--model", llama_dir, "--smooth", "1.5", "--out",
                     str(tmp_path / "bad"), *FAST]) == 2
    assert "--smooth must be an alpha in [0, 1]" in capsys.readouterr().err


def test_compare_smooths_once_for_every_configuration(llama_dir, tmp_path, monkeypatch):
    from quantscope import cli
    from quantscope.cli import running

    evaluated = []
    quantized = running.Evaluator.quantized
    monkeypatch.setattr(running.Evaluator, "quantized",
                        lambda self, calib: evaluated.append(calib.label) or quantized(self,
                                                                                      calib))
    out = tmp_path / "cmp"
    assert cli.main(["compare", "--model", llama_dir, "--recipes", "w8a8", "--observers",
                     "minmax,auto", "--smooth", "0.5", "--out", str(out), "--no-progress",
                     "--no-plots", *FAST]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["setup"]["smooth"] == 0.5
    for run in report["runs"].values():
        assert run["info"]["smooth"]["alpha"] == 0.5
        assert len(run["info"]["smooth"]["smoothed"]) == 6
    assert "SmoothQuant alpha 0.5 first" in (out / "report.md").read_text()
    # auto (min-max its only candidate here) is not evaluated twice: min-max's metrics
    runs = report["runs"]
    assert runs["w8a8/auto"]["info"]["auto"]["roles"] == {"weight": "minmax",
                                                          "input": "minmax"}
    assert runs["w8a8/auto"]["metrics"] == runs["w8a8/minmax"]["metrics"]
    assert len(evaluated) == 1


def test_compare_score_tokens_reach_auto(llama_dir, tmp_path, capsys):
    from quantscope import cli

    runs = {}
    for n in (8, 64):
        out = tmp_path / f"cmp{n}"
        assert cli.main(["compare", "--model", llama_dir, "--recipes", "w8a8", "--observers",
                         "minmax,mse,auto", "--score-tokens", str(n), "--out", str(out),
                         "--no-progress", "--no-plots", *FAST]) == 0
        runs[n] = json.loads((out / "report.json").read_text())["runs"]["w8a8/auto"]
    few, more = (runs[n]["info"]["auto"]["score_tokens"] for n in (8, 64))
    assert 8 <= few < more
    assert cli.main(["compare", "--model", llama_dir, "--score-tokens", "0", "--out",
                     str(tmp_path / "bad"), *FAST]) == 2
    assert "--score-tokens must be a positive number" in capsys.readouterr().err


def test_compare_group_size_changes_the_grouped_recipes(llama_dir, tmp_path, capsys):
    from quantscope import cli

    out = tmp_path / "cmp"
    assert cli.main(["compare", "--model", llama_dir, "--recipes", "w8a8,W4A16", "--observers",
                     "minmax", "--group-size", "32", "--out", str(out), "--no-progress",
                     "--no-plots", *FAST]) == 0
    runs = json.loads((out / "report.json").read_text())["runs"]
    specs = {label: {row["spec"] for row in run["layers"] if row["role"] == "weight"}
             for label, run in runs.items()}
    assert specs["W4A16/minmax"] == {"int4 group:32 sym"}
    assert all("group" not in s for s in specs["w8a8/minmax"])
    assert cli.main(["compare", "--model", llama_dir, "--recipes", "w8a8", "--observers",
                     "minmax", "--group-size", "32", "--out", str(tmp_path / "bad"),
                     *FAST]) == 2
    assert "--group-size 32: none of --recipes w8a8 has grouped weights" in capsys.readouterr().err


def test_compare_table_prints_a_non_finite_metric_as_a_dash():
    from quantscope.cli.compare import compare_rows

    # the report's JSON holds a NaN / inf metric as None
    report = {"fp32": {"perplexity": 12.5}, "runs": {"w8a8/minmax": {
        "recipe": "w8a8", "observer": "minmax", "metrics": {"perplexity": None},
        "summary": {}, "info": {}}}}
    _, rows = compare_rows(report)
    assert rows[1][:4] == ["w8a8", "minmax", "-", "-"]
