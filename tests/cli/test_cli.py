"""The command line end to end on a tiny BERT built here, and the Lee data mapping."""

import json
import os
from pathlib import Path

import pytest
import torch

from quantscope import cli

transformers = pytest.importorskip("transformers")
data = pytest.importorskip("quantscope.demo.data")

try:
    data.test_data_dir()
except FileNotFoundError:
    pytest.skip("gensim's test data (the Lee corpus) is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 1-layer BERT (hidden 128, FFN 256) with a character-level WordPiece vocabulary."""
    d = tmp_path_factory.mktemp("tiny-bert")
    chars = "abcdefghijklmnopqrstuvwxyz0123456789"
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *(f"##{c}" for c in chars),
             *".,;:'\"!?-()$%&/"]
    (d / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = transformers.BertTokenizerFast(str(d / "vocab.txt"), do_lower_case=True)
    tok.save_pretrained(str(d))
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=len(vocab), hidden_size=128, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=256,
                                  max_position_embeddings=128)
    transformers.BertModel(cfg).save_pretrained(str(d))
    return str(d)


COMMON = ["--calib-docs", "4", "--max-length", "32", "--batch-size", "2", "--eval-max-length",
          "64", "--no-progress", "--device", "cpu"]


def test_compare_plot_calibrate_evaluate(tiny_model, tmp_path, capsys):
    out = str(tmp_path / "cmp")
    rc = cli.main(["compare", "--model", tiny_model, "--recipes", "w8a8,w4a8", "--observers",
                   "minmax,mse,auto", "--out", out, *COMMON])
    assert rc == 0
    report = json.loads(Path(out, "report.json").read_text())
    # in the order asked for (auto, decided after the others, listed with its recipe)
    assert list(report["runs"]) == [f"{r}/{o}" for r in ("w8a8", "w4a8")
                                    for o in ("minmax", "mse", "auto")]
    assert report["setup"]["eval_pairs"] == 1225 and report["setup"]["calib_docs"] == 4
    printed = capsys.readouterr().out
    for run in report["runs"].values():
        assert f"{run['metrics']['lee_r']:.4f}" in printed  # the table shows every observer
        assert -1 <= run["metrics"]["cosine"] <= 1
    assert "Lee r" in Path(out, "report.md").read_text()
    for png in ("hist.png", "sqnr.png"):
        assert os.path.getsize(os.path.join(out, png)) > 1000
    os.remove(os.path.join(out, "hist.png"))
    assert cli.main(["plot", out, "--layer", "encoder.layer.0.intermediate.dense"]) == 0
    assert os.path.isfile(os.path.join(out, "hist.png"))

    out2 = str(tmp_path / "cal")
    assert cli.main(["calibrate", "--model", tiny_model, "--recipe", "w4a8", "--observer",
                     "mse", "--out", out2, *COMMON]) == 0
    saved = json.loads(Path(out2, "report.json").read_text())
    capsys.readouterr()
    # the run records its model, task and evaluation length: RUN alone is enough
    assert cli.main(["evaluate", out2, "--json"]) == 0
    loaded = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # loading the saved qparams reproduces the calibrated model exactly
    assert loaded["lee_r"] == saved["metrics"]["lee_r"]
    assert loaded["cosine"] == saved["metrics"]["cosine"]
    assert loaded["lee_r_fp32"] == saved["metrics"]["lee_r_fp32"]
    assert cli.main(["evaluate", os.path.join(out2, "qparams"), "--model", tiny_model,
                     "--eval-max-length", "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == loaded


def test_cli_errors(tmp_path, capsys):
    """Mistakes are one line on stderr and exit code 2, found before the model loads."""
    assert cli.main(["calibrate", "--model", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["calibrate", "--model", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert cli.main(["compare", "--recipes", "w3a3"]) == 2
    err = capsys.readouterr().err
    assert "unknown recipe or scheme 'w3a3'" in err and len(err.strip().splitlines()) == 1
    assert cli.main(["plot", str(tmp_path)]) == 2
    assert "not a compare run" in capsys.readouterr().err
    assert cli.main(["calibrate", "--help"]) == 0  # returns the code, never SystemExit
    assert "--model PATH" in capsys.readouterr().out


def test_lee_pairs_map_the_upper_triangle():
    i, j, s = data.lee_pairs()
    assert len(s) == 1225 and bool((i < j).all())
    assert (int(i[0]), int(j[0]), int(i[-1]), int(j[-1])) == (0, 1, 48, 49)
    path = os.path.join(data.test_data_dir(), "similarities0-1.txt")
    rows = [line.split() for line in Path(path).read_text().splitlines()]
    for k in (0, 1, 500, 1224):  # row i, column j of the file
        assert float(s[k]) == float(rows[int(i[k])][int(j[k])])
    assert len(data.lee_documents()) == 50 and len(data.lee_background()) == 300
