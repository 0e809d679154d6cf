"""A compare run's report.json is strict JSON whatever its metrics are."""

import json
import math
import types


def _strict(text: str):
    def refuse(name):
        raise AssertionError(f"report.json holds {name}: not JSON")
    return json.loads(text, parse_constant=refuse)


def test_report_json_holds_no_nan_or_infinity(tmp_path):
    """Found by probing: the fp32 baseline's metrics went into report.json as they were, so
    a diverged perplexity was written ``Infinity`` (which strict JSON readers refuse)."""
    from quantscope.cli.compare import _write_report

    run = {"recipe": "w8a8", "observer": "minmax", "layers": [],
           "metrics": {"perplexity": math.nan}}
    report = {"setup": {"model": str(tmp_path / "m")}, "fp32": {"perplexity": math.inf},
              "runs": {"w8a8/minmax": run}, "histograms": {}}
    args = types.SimpleNamespace(out=str(tmp_path / "compare"), no_plots=True, plot_layer=None,
                                 model=None)
    _write_report(args, report, ["a"], [["1"]], "title", 1.0, 1.0)
    written = _strict((tmp_path / "compare" / "report.json").read_text())
    assert written["fp32"] == {"perplexity": None}
    assert written["runs"]["w8a8/minmax"]["metrics"] == {"perplexity": None}
