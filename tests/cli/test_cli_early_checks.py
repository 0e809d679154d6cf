"""``quantscope calibrate`` says a recipe cannot apply to the model once the model is loaded,
before the float model is evaluated or any calibration batch runs (issue 37)."""

import pytest
import torch

from quantscope import cli

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A 1-layer BERT of width 48 (FFN 96) with a character vocabulary."""
    d = tmp_path_factory.mktemp("bert48")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz .,"]
    (d / "vocab.txt").write_text("\n".join(vocab) + "\n")
    transformers.BertTokenizerFast(str(d / "vocab.txt")).save_pretrained(str(d))
    torch.manual_seed(0)
    transformers.BertModel(transformers.BertConfig(
        vocab_size=len(vocab), hidden_size=48, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=96, max_position_embeddings=64)).save_pretrained(str(d))
    return str(d)


@pytest.mark.parametrize("extra", [["--scheme", "W4A16", "--group-size", "32"],
                                   ["--recipe", "w4a8", "--group-size", "64"]])
def test_a_group_size_that_divides_no_width_stops_before_the_float_evaluation(
        tiny_bert, tmp_path, capsys, extra):
    rc = cli.main(["calibrate", "--model", tiny_bert, *extra, "--out", str(tmp_path / "run"),
                   "--no-progress", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "does not divide" in err and "loading" in err, err
    assert "evaluating float" not in err and "calibrating" not in err, err
    assert not (tmp_path / "run").exists()


def test_compare_checks_every_recipe_before_the_float_evaluation(tiny_bert, tmp_path, capsys):
    rc = cli.main(["compare", "--model", tiny_bert, "--recipes", "w4a8,W4A16", "--observers",
                   "minmax", "--group-size", "32", "--out", str(tmp_path / "cmp"),
                   "--no-progress", "--device", "cpu", "--no-plots"])
    err = capsys.readouterr().err
    assert rc == 2 and "does not divide" in err and "evaluating float" not in err, err
