"""The command line on models it cannot feed, and heads not named lm_head.

* An encoder-decoder (T5, Whisper) or a model of pixel / audio inputs is refused in one line
  naming the model and the way out (it failed inside the model's forward at the float
  evaluation: 'You must specify exactly one of input_ids or inputs_embeds', a NoneType).
* An error message of several lines is printed whole, on one line (only its first line was,
  ending in ':').
* The default ignore list keeps the model's output head in float whatever its name
  (Whisper's ``proj_out`` was quantized, and its export refused as tied), and the pooler."""

from __future__ import annotations

import argparse

import pytest
import torch
from torch import nn

from quantscope import cli
from quantscope.cli.names import DEFAULT_IGNORE
from quantscope.cli.recipes import ignored
from quantscope.cli.running import _check_text_model

transformers = pytest.importorskip("transformers")


def _t5():
    return transformers.T5Model(transformers.T5Config(
        vocab_size=50, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2))


def _vit():
    return transformers.ViTModel(transformers.ViTConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        image_size=8, patch_size=4))


@pytest.mark.parametrize("make, said", [(_t5, "is an encoder-decoder"),
                                        (_vit, "is a model of pixel_values")])
def test_a_model_the_cli_cannot_feed_text_is_refused(make, said):
    torch.manual_seed(0)
    with pytest.raises(cli.checks.UsageError, match=rf"model 'folder' \(\w+\) {said}; the "
                                                    r"command line calibrates causal LMs and "
                                                    r"text encoders on text"):
        _check_text_model(make(), "folder")


def test_a_text_model_passes():
    torch.manual_seed(0)
    _check_text_model(transformers.BertModel(transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32)), "folder")


def test_a_message_of_several_lines_is_printed_whole(monkeypatch, capsys):
    def fails(args):
        raise ValueError("could not load the tokenizer from one of:\n(1) a file\n(2) a class")

    monkeypatch.setitem(cli.COMMANDS, "formats", (cli.COMMANDS["formats"][0], fails))
    assert cli.main(["formats"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("quantscope formats: error: could not load the tokenizer from one of: "
                   "(1) a file (2) a class")


class _Speech(nn.Module):
    """A decoder whose output head is ``proj_out`` (as Whisper's)."""

    def __init__(self):
        super().__init__()
        self.body, self.proj_out = nn.Linear(8, 8), nn.Linear(8, 20)

    def get_output_embeddings(self):
        return self.proj_out


def test_the_default_ignore_keeps_any_output_head_in_float():
    model = _Speech()
    default = argparse.Namespace(ignore=DEFAULT_IGNORE)
    assert ignored(default, model) == (*DEFAULT_IGNORE, "proj_out")
    mine = argparse.Namespace(ignore=["body"])  # --ignore given: as it says
    assert ignored(mine, model) == ("body",)
    named = nn.Module()
    named.lm_head = nn.Linear(8, 8)
    named.get_output_embeddings = lambda: named.lm_head
    assert ignored(default, named) == tuple(DEFAULT_IGNORE)  # already matched


def test_the_default_ignore_keeps_the_pooler_in_float():
    """--ignore's default (--help, the guide: the output head and the pooler stay float, as
    the peers' recipes leave them) leaves a BERT's pooler unquantized; an --ignore of one's
    own replaces it."""
    from quantscope.cli.checks import check_recipe_args
    from quantscope.cli.recipes import build_recipe

    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16))
    found = {}
    for given in ([], ["--ignore", "*lm_head*"]):
        args = cli.build_parser().parse_args(["calibrate", *given])
        check_recipe_args(args)
        found[bool(given)] = build_recipe(args, model).match(model)
    assert "pooler.dense" not in found[False] and "encoder.layer.0.output.dense" in found[False]
    assert "pooler.dense" in found[True]
