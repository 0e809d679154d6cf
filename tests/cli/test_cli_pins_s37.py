"""Command-line pins found by mutation: --kv-cache without --targets keeps the recipe's
layers (s37); compare's "input clipped %" column is a percent (s61)."""

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


def test_compare_table_credits_auto_only_with_the_tensors_it_chose_for():
    """The "auto chose" column counted every tensor's observer: a scheme's dynamic inputs
    (memoryless_minmax, requested as such) showed as auto's choice; a role auto did not
    choose for is "-"."""
    from quantscope.cli.compare import compare_rows

    rows = [{"role": "weight", "observer": "memoryless_mse", "requested": "auto"}] * 2 + [
        {"role": "weight", "observer": "imatrix", "requested": "auto"},
        {"role": "input", "observer": "memoryless_minmax", "requested": "memoryless_minmax"}]
    report = {"fp32": {"perplexity": 12.5}, "runs": {"W8A8/auto": {
        "recipe": "W8A8", "observer": "auto", "metrics": {"perplexity": 13.0}, "info": {},
        "layers": rows, "summary": {"weight": {"observers": {"memoryless_mse": 2,
                                                             "imatrix": 1}},
                                    "input": {"observers": {"memoryless_minmax": 1},
                                              "mean_clipped": 0.0}}}}}
    _, table = compare_rows(report)
    assert table[1][-1] == "mse 2, imatrix 1; -"


def test_compare_table_gives_the_clipped_share_in_percent():
    """report.json keeps an input's clipped share as a fraction (mean_clipped); the table's
    "input clipped %" column is that share in percent: 0.0125 is 1.250 %, not 0.013."""
    from quantscope.cli.compare import compare_rows

    run = {"recipe": "w8a8", "observer": "percentile", "metrics": {"perplexity": 13.0},
           "info": {}, "layers": [], "summary": {"weight": {"mean_sqnr_db": 40.0},
                                                 "input": {"mean_sqnr_db": 30.0,
                                                           "mean_clipped": 0.0125}}}
    headers, table = compare_rows({"fp32": {"perplexity": 12.5},
                                   "runs": {"w8a8/percentile": run}})
    assert table[1][headers.index("input clipped %")] == "1.250"
