"""Non-finite metrics on the command line, as session 44's probe found them: `evaluate --json`
printed ``Infinity`` (no JSON: RFC 8259 has no such constant, strict parsers refuse it) where
the run's report.json has null, and the summary printed the change as ``+nan``."""

import json
import math

import pytest

transformers = pytest.importorskip("transformers")
from cli_helpers import run_cli as _run
from tiny_models import llama_folder, require_lee_corpus

require_lee_corpus()

FAST = ["--calib-docs", "4", "--max-length", "16", "--batch-size", "2", "--eval-max-length",
        "32", "--device", "cpu", "--threads", "1", "--no-progress"]


def _strict(text: str):
    """``json.loads`` refusing NaN / Infinity, as RFC 8259 (and JSON.parse, jq) do."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def overflowing_llama(tmp_path_factory):
    """A tiny Llama whose lm_head is scaled by 1e5: its mean NLL is far over 709 nats, so
    exp(NLL), the perplexity, overflows to inf in float and quantized alike."""
    import torch

    path = llama_folder(tmp_path_factory.mktemp("huge"), architectures=["LlamaForCausalLM"])
    model = transformers.LlamaForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.lm_head.weight.mul_(1e5)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def inf_run(overflowing_llama, tmp_path_factory):
    """A calibrate run of :func:`overflowing_llama`: its folder and its stdout."""
    import contextlib
    import io

    from quantscope import cli

    run, out, err = tmp_path_factory.mktemp("inf") / "run", io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["calibrate", "--model", overflowing_llama, "--recipe", "w8a8",
                       "--out", str(run), *FAST])
    assert rc == 0, err.getvalue()
    report = json.loads((run / "report.json").read_text())
    assert report["metrics"] == {"perplexity": None, "perplexity_fp32": None}  # inf: null
    return run, out.getvalue()


def test_an_infinite_perplexity_is_null_in_evaluate_json(inf_run, capsys):
    rc, got, err = _run(capsys, "evaluate", str(inf_run[0]), "--json", "--no-progress")
    assert rc == 0, err
    assert _strict(got) == {"perplexity": None, "perplexity_fp32": None}, got


def test_the_calibrate_summary_says_an_undefined_change_so(inf_run):
    got = inf_run[1]
    assert "perplexity: float inf -> quantized inf (change undefined)" in got, got
    assert "nan" not in got, got


def test_the_metric_line_says_an_undefined_change_so():
    from quantscope.cli.running import metric_line

    inf, nan = math.inf, math.nan
    assert metric_line("perplexity", 10.0, 12.0) == (
        "perplexity: float 10.00 -> quantized 12.00 (+2.00, +20.0 %)")
    assert metric_line("perplexity", inf, inf) == (
        "perplexity: float inf -> quantized inf (change undefined)")
    assert metric_line("perplexity", 10.0, inf) == (  # a real change, infinite: said so
        "perplexity: float 10.00 -> quantized inf (+inf, +inf %)")
    assert metric_line("lee_r", 0.5, nan) == (
        "Lee r: float 0.5000 -> quantized nan (change undefined)")
    assert metric_line("lee_r", 0.5, 0.25) == "Lee r: float 0.5000 -> quantized 0.2500 (-0.2500)"
