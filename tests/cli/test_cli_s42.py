"""Command-line refusals found by session 42's probe: each before the model loads, naming the
flag."""

import pytest

from quantscope import cli


@pytest.mark.parametrize("flag", ["--recipe", "--scheme", "--recipe-file", "--observer",
                                  "--weight-observer", "--input-observer"])
def test_an_empty_recipe_or_observer_flag_is_refused_not_the_default(tmp_path, capsys, flag):
    """``--recipe-file "$RECIPE"`` with the variable unset is ``--recipe-file ''``: it ran the
    default w8a8 (``--recipe`` and ``--scheme`` alike), or failed after the model loaded with
    an error naming no flag (``--observer``)."""
    rc = cli.main(["calibrate", "--model", str(tmp_path / "absent"), f"{flag}=",
                   "--out", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"{flag}: empty value" in err, err
    assert not (tmp_path / "run").exists()


def test_a_tokenizer_past_the_models_embedding_is_named(tmp_path, capsys):
    """Another model's tokenizer in the folder (MiniLM's 30,522 tokens beside a 128-token
    Llama) failed in the float evaluation with torch's bare ``IndexError``."""
    import shutil

    import torch
    transformers = pytest.importorskip("transformers")
    from quantscope.demo import models

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=128, max_position_embeddings=64)).save_pretrained(
        tmp_path / "model")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "vocab.txt"):
        shutil.copy(models.default_model_path() / f, tmp_path / "model")
    rc = cli.main(["calibrate", "--model", str(tmp_path / "model"), "--calib-docs", "2",
                   "--max-length", "16", "--eval-max-length", "16", "--no-progress",
                   "--out", str(tmp_path / "run"), "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "embedding has 128 rows" in err and "30522 tokens" in err, err
    assert "evaluating float" not in err and not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def llama72(tmp_path_factory):
    """A 1-layer Llama of hidden size 72: no multiple of NVFP4's 16 or MXFP4's 32."""
    import shutil

    import torch
    transformers = pytest.importorskip("transformers")
    from quantscope.demo import models

    d = tmp_path_factory.mktemp("llama72")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=72, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=30522, max_position_embeddings=64)).save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "vocab.txt"):
        shutil.copy(models.default_model_path() / f, d)
    return d


@pytest.mark.parametrize("recipe, size", [("nvfp4", 16), ("mxfp4", 32)])
def test_a_width_the_formats_block_does_not_divide_stops_or_stays_float(llama72, tmp_path,
                                                                       capsys, recipe, size):
    """``--on-indivisible`` covered groups only: NVFP4 / MXFP4 calibrated partial last blocks
    that no export could write (compressed-tensors packs whole blocks)."""
    small = ["--model", str(llama72), "--recipe", recipe, "--calib-docs", "2",
             "--max-length", "16", "--eval-max-length", "16", "--no-progress",
             "--device", "cpu"]
    rc = cli.main(["calibrate", *small, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"width 72, which the format size {size} does not divide" in err, err
    assert "--group-size" not in err and "evaluating float" not in err, err
    rc = cli.main(["calibrate", *small, "--on-indivisible", "float",
                   "--out", str(tmp_path / "kept")])
    err = capsys.readouterr().err
    assert rc == 0, err
    import json

    saved = json.loads((tmp_path / "kept" / "qparams" / "quantscope.json").read_text())
    ignored = saved["recipe"]["ignore"]
    # the layers that read the 72-wide hidden state stay in float; down_proj (128 wide) not
    assert any("q_proj" in i for i in ignored) and not any("down_proj" in i for i in ignored)


def test_a_recipe_of_groups_and_blocks_is_told_about_its_first_layer():
    """The wording follows the first layer that does not divide (a group: its --group-size
    advice kept), and the group sizes offered divide the grouped layers only (a block's
    width is the format's business: --group-size does not change it)."""
    from torch import nn

    from quantscope import QuantSpec
    from quantscope.calibration.recipe import Recipe, Role, Rule
    from quantscope.cli.checks import UsageError
    from quantscope.cli.recipes import _indivisible
    from quantscope.layout import Block, Group

    mx = Role(QuantSpec("fp4_e2m1", layout=Block(32), scale="e8m0"), "minmax")
    g128 = Role(QuantSpec("int4", layout=Group(128)), "minmax")
    m = nn.Sequential()
    m.add_module("a", nn.Linear(4800, 8))  # 4800 = 25 x 192
    m.add_module("b", nn.Linear(48, 8))  # no multiple of 32 either
    with pytest.raises(UsageError) as e:
        _indivisible(Recipe((Rule(("a",), weight=g128), Rule(("b",), weight=mx))), m, "error")
    assert "which group size 128 does not divide (2 such layers)" in str(e.value)
    assert "--group-size 16 / 32 / 64 / 96 / 192 would, or --on-indivisible" in str(e.value)
