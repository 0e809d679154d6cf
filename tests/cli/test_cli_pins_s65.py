"""Command-line pins found by mutation (s65) of ``cli/compare.py`` and ``cli/checks.py``: the
comparison table's cells as docs/guide/command-line.md shows them (decimals, signs, percent,
the fp32 row, ``auto chose`` by count, the "KV cache" column), the run title, ``compare``'s
argument checks (which flag, what was expected), ``auto``'s candidates, the plots' warnings,
``plot``'s report check, and the plain checks' suggestions, bounds and refusals. Each test
fails on a mutant of that round that no earlier test killed."""

import types

import pytest
from test_cli_pins_s61 import _args

from quantscope.cli import checks
from quantscope.cli.checks import UsageError


def _run(recipe="w8a8", observer="minmax", metrics=None, weight=None, inputs=None, **extra):
    """A compare report's run as _evaluate_all writes it (only what the table reads)."""
    summary = {}
    if weight is not None:
        summary["weight"] = {"mean_sqnr_db": weight}
    if inputs is not None:
        summary["input"] = {"mean_sqnr_db": inputs[0], "mean_clipped": inputs[1]}
    return {"recipe": recipe, "observer": observer, "metrics": metrics or {}, "info": {},
            "layers": [], "summary": summary, **extra}


def _table(fp, *runs):
    from quantscope.cli.compare import compare_rows

    headers, rows = compare_rows({"fp32": fp, "runs": {
        f"{r['recipe']}/{r['observer']}": r for r in runs}})
    return [dict(zip(headers, row)) for row in rows]


def test_causal_table_cells_as_documented():
    """Perplexity to 2 decimals, its change from fp32 signed; SQNR to 1 decimal, each in its
    own column; calib s to 1 decimal; a clipped share of 0 is 0.000 %, not '-'."""
    run = _run(metrics={"perplexity": 41.864}, weight=38.74, inputs=(31.02, 0.0),
               info={"calibration_seconds": 13.84})
    lower = _run(observer="mse", metrics={"perplexity": 38.5}, weight=38.8, inputs=(31.6, 0.0))
    fp32, row, row2 = _table({"perplexity": 39.06}, run, lower)
    assert list(fp32.values()) == ["fp32", "-", "39.06", "", "", "-", "-", "-", ""]
    assert row["perplexity"] == "41.86" and row["vs fp32"] == "+2.80"
    assert row2["vs fp32"] == "-0.56"
    assert row["weight SQNR dB"] == "38.7" and row["input SQNR dB"] == "31.0"
    assert row["input clipped %"] == "0.000" and row["calib s"] == "13.8"


def test_encoder_table_cells_as_documented():
    """The fp32 row's cosine is 1.0000; Lee r and its change to 4 decimals, the change signed
    (a Lee r of 0 is a figure: 0.0000, not '-')."""
    run = _run(metrics={"lee_r": 0.6215, "cosine": 0.97981}, weight=41.2, inputs=(28.2, 3e-5))
    zero = _run(observer="mse", metrics={"lee_r": 0.0, "cosine": 0.5})
    fp32, row, row2 = _table({"lee_r": 0.6564}, run, zero)
    assert list(fp32.values()) == ["fp32", "-", "0.6564", "", "1.0000", "", "-", "-", "-", ""]
    assert row["Lee r"] == "0.6215" and row["r - fp32"] == "-0.0349"
    assert row["cosine vs fp32"] == "0.9798" and row["input clipped %"] == "0.003"
    assert row2["Lee r"] == "0.0000" and row2["r - fp32"] == "-0.6564"


def test_auto_chose_lists_the_most_chosen_observer_first():
    """'auto chose' counts each role's choices, the most chosen first whatever the layers'
    order; a role auto chose nothing for is '-'."""
    layers = [{"role": "weight", "observer": o, "requested": "auto"}
              for o in ("mse", "minmax", "mse", "minmax", "minmax")]
    auto = _run(observer="auto", metrics={"perplexity": 2.0}, layers=layers)
    row = _table({"perplexity": 1.0}, auto)[1]
    assert row["auto chose (weight; input)"] == "minmax 3, mse 2; -"


def test_kv_cache_column_names_each_spec_once_and_counts_tensors():
    """A "KV cache" column where any configuration quantizes the cache: its specs (each once)
    and how many tensors (1 tensor, 2 tensors); '-' for a configuration without one, empty
    for fp32."""
    kv = [{"spec": "fp8", "tensor": t} for t in ("k", "v")]
    two = _run(metrics={"perplexity": 2.0}, kv_cache=kv)
    one = _run(recipe="w4a16", metrics={"perplexity": 2.0}, kv_cache=kv[:1])
    none = _run(recipe="w4a8", metrics={"perplexity": 2.0})
    fp32, *rows = _table({"perplexity": 1.0}, two, one, none)
    assert fp32["KV cache"] == ""
    assert [r["KV cache"] for r in rows] == ["fp8 (2 tensors)", "fp8 (1 tensor)", "-"]


@pytest.mark.parametrize("setup, said", [
    ({"task": "causal-lm", "smooth": 0.0},
     ("quantscope compare: m, 4 calibration docs (99 tokens), SmoothQuant alpha 0 first, "
      "perplexity on 3 held-out documents")),
    ({"task": "embedding", "smooth": None},
     ("quantscope compare: m, 4 calibration docs (99 tokens), Lee similarity over 3 "
      "held-out documents"))])
def test_title_names_docs_tokens_smoothing_and_metric(setup, said):
    """An alpha of 0 is a SmoothQuant run too (said in the title)."""
    from quantscope.cli.compare import _title

    assert _title({"name": "m", "calib_docs": 4, "calib_tokens": 99, "eval_docs": 3,
                   **setup}) == said


def _compare_args(tmp_path, *argv):
    return _args("compare", "--model", "minilm", "--out", str(tmp_path / "cmp"), *argv)


@pytest.mark.parametrize("argv, said", [
    (["--recipes", ","], "--recipes ',' names no recipe; give one or more"),
    (["--observers", " "], "--observers ' ' names no observer; give one or more")])
def test_a_list_naming_nothing_says_what_it_names_none_of(tmp_path, monkeypatch, argv, said):
    from quantscope.cli.compare import _check_compare_args

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError) as e:
        _check_compare_args(_compare_args(tmp_path, *argv))
    assert said in str(e.value)


def test_compare_takes_a_trailing_comma_and_fisher_score_tokens(tmp_path, monkeypatch):
    """Empty names between commas are dropped; --score-tokens is read by fisher as by model."""
    from quantscope.cli.compare import _check_compare_args

    monkeypatch.chdir(tmp_path)
    args = _compare_args(tmp_path, "--recipes", "w8a8,", "--observers", "mse, auto,",
                         "--auto-metric", "fisher", "--score-tokens", "256")
    assert _check_compare_args(args) == (["w8a8"], ["mse", "auto"])


def test_suggest_without_a_close_name_lists_the_first_shown_and_counts_the_rest():
    assert checks.suggest("zzz", ["a", "b", "c"], 2) == "expected one of a, b and 1 more"
    assert checks.suggest("zzz", ["a", "b"], 2) == "expected one of a, b"


def test_a_compat_class_is_refused_listing_only_native_observers():
    """A compat class (any case) is refused as such; the list offered holds no compat class."""
    with pytest.raises(UsageError, match="is a compat class") as e:
        checks.check_observer_name("TORCH.AO:MinMaxObserver", "observer")
    listed = str(e.value).split("native observers: ")[1]
    assert "minmax" in listed and ":" not in listed


def test_calib_documents_names_the_flag_for_a_missing_file(tmp_path):
    with pytest.raises(UsageError, match="^--calib-file: "):
        checks.calib_documents(str(tmp_path / "none.txt"))


def test_device_takes_an_index_of_any_width():
    """--device: a kind with an optional index (cuda:10 as well as cuda:1)."""
    checks.check_resource_args(types.SimpleNamespace(threads=None, device="cuda:10"))


@pytest.mark.parametrize("config, said", [
    (None, r"is not a Hugging Face model folder \(no config.json\)"),
    ("[1]", "holds a list, not a JSON object")])
def test_a_model_folder_without_a_config_object_is_refused(tmp_path, config, said):
    path = tmp_path / "model"
    path.mkdir()
    if config is None:
        (path / "config.json").mkdir()  # a folder of that name is no config file
    else:
        (path / "config.json").write_text(config)
    with pytest.raises(UsageError, match=said):
        checks.check_model_arg(str(path))


def test_smooth_with_sequential_is_refused():
    """--smooth measures the activations with one forward of the whole model."""
    with pytest.raises(UsageError, match="--smooth measures the activations .* not with "
                                         "--sequential"):
        checks.check_recipe_args(_args("calibrate", "--smooth", "0.5", "--sequential"))


def test_run_qparams_takes_the_qparams_folder_itself(tmp_path):
    (tmp_path / "quantscope.json").write_text("{}")
    assert checks.run_qparams(str(tmp_path)) == str(tmp_path)


def test_run_model_path_names_model_where_none_is_recorded():
    with pytest.raises(UsageError, match="evaluate: r does not record its model; pass --model"):
        checks.run_model_path("evaluate", "r", None, None)


def test_plot_refuses_a_json_object_without_runs_as_no_compare_report(tmp_path):
    from quantscope.cli.compare import _read_report

    (tmp_path / "report.json").write_text('{"setup": {}}')
    with pytest.raises(UsageError, match=r"is not a compare report \(no 'runs'\)"):
        _read_report(str(tmp_path))


def test_compare_with_auto_alone_leaves_autos_candidates_its_own(tmp_path, monkeypatch):
    """auto chooses among the other --observers; with none other, among its default
    candidates (None: Auto's own), never among an empty list."""
    from quantscope.cli import compare

    class Stop(Exception):
        pass

    seen = []

    def calibrate_all(args, phases, model, batches, plan, candidates):
        seen.append(candidates)
        raise Stop

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(compare, "load_setup", lambda *a: (None, [], None, {}, {}, {}))
    monkeypatch.setattr(compare, "_calibrate_all", calibrate_all)
    for observers, candidates in (("auto", None), ("mse,auto,minmax", ["mse", "minmax"])):
        with pytest.raises(Stop):
            compare.cmd_compare(_compare_args(tmp_path, "--observers", observers))
    assert seen == [None, ["mse", "minmax"]]


def test_no_matplotlib_is_said_once_and_no_plot_is_tried_after_it(monkeypatch, capsys):
    from quantscope.calibration.results import plots
    from quantscope.cli.compare import _plots

    def no_matplotlib(*a, **k):
        raise ImportError("No module named 'matplotlib'")

    tried = []
    monkeypatch.setattr(plots, "histogram_choice", no_matplotlib)
    monkeypatch.setattr(plots, "plot_sqnr", lambda *a: tried.append(a) or no_matplotlib())
    assert _plots({"runs": {}}, "unused", None) == []
    assert tried == []
    assert capsys.readouterr().err == "warning: no plots: No module named 'matplotlib'\n"


def test_an_out_on_a_read_only_file_system_is_a_usage_error(tmp_path, monkeypatch):
    """The guard's PermissionError (an OSError: no file can be made there) names --out too."""
    import errno

    from quantscope.exporters import atomic

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(atomic.tempfile, "mkstemp", read_only)
    with pytest.raises(UsageError, match=r"^--out: .* is not writable \(Read-only file system\)"):
        checks.check_out(str(tmp_path / "run"))
