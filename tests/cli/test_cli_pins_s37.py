"""Command-line pin found by mutation (s37): --kv-cache without --targets keeps the recipe's
layers."""

import pytest

from quantscope import cli


def test_kv_cache_without_targets_quantizes_the_layers_too():
    """`calibrate --kv-cache fp8` with no --targets flag at all adds the KV cache to the
    recipe's layers; only `--targets` given with no pattern means the KV cache alone."""
    pytest.importorskip("transformers")
    from tiny_models import llama

    from quantscope.cli.recipes import build_recipe, observer_label

    model, _ = llama()
    args = cli.build_parser().parse_args(["calibrate", "--kv-cache", "fp8"])
    assert args.targets is None
    args.recipe = "w8a8"
    rec = build_recipe(args, model)
    assert rec.rules and rec.kv_cache is not None
    assert "KV cache only" not in observer_label(rec)
    found = rec.match(model)
    assert "model.layers.0.mlp.down_proj" in found
    assert {f"model.layers.{i}.self_attn" for i in range(2)} <= set(found)
