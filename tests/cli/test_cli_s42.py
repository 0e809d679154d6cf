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
