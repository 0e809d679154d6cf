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


def _absent_device() -> str:
    """A CUDA device this machine does not have: one past the last (cuda:0 without CUDA)."""
    return f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 7}"


@pytest.mark.parametrize("flag", [["--threads", "-1"], ["--device", "bogus"],
                                  ["--device", "CUDA"], ["--device", "absent"]])
@pytest.mark.parametrize("command", ["calibrate", "compare"])
def test_threads_and_device_stop_before_the_model_loads(tiny_bert, tmp_path, capsys, command,
                                                        flag):
    flag = [f if f != "absent" else _absent_device() for f in flag]
    extra = ["--observers", "minmax", "--no-plots"] if command == "compare" else []
    rc = cli.main([command, "--model", tiny_bert, *flag, *extra, "--calib-docs", "2",
                   "--no-progress", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and f"error: {flag[0]}" in err and flag[1] in err, err
    assert "loading" not in err and not (tmp_path / "run").exists(), err


@pytest.mark.parametrize("device", ["bogus", "cuda:x", "absent"])
def test_evaluate_checks_device_before_loading(tmp_path, capsys, device):
    device = _absent_device() if device == "absent" else device
    (tmp_path / "run" / "qparams").mkdir(parents=True)  # a run folder; never read this far
    (tmp_path / "run" / "qparams" / "quantscope.json").write_text("{}")
    rc = cli.main(["evaluate", str(tmp_path / "run"), "--device", device, "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "error: --device" in err and device in err, err
    assert "loading" not in err, err


def test_evaluate_takes_threads(tmp_path, capsys, monkeypatch):
    """evaluate runs the model twice (float, quantized): the one thread setting applies."""
    (tmp_path / "run" / "qparams").mkdir(parents=True)
    (tmp_path / "run" / "qparams" / "quantscope.json").write_text("{}")
    rc = cli.main(["evaluate", str(tmp_path / "run"), "--threads", "-1", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "error: --threads" in err and "loading" not in err, err
    asked = []
    monkeypatch.setattr(torch, "set_num_threads", asked.append)
    cli.main(["evaluate", str(tmp_path / "run"), "--threads", "1", "--device", "cpu",
              "--no-progress"])  # the empty run then fails to load: the threads come first
    assert asked == [1, torch.get_num_threads()]  # and the caller's count is put back


def test_main_puts_the_callers_thread_count_back(tmp_path):
    """--threads set torch's count for the rest of an in-process caller's life."""
    (tmp_path / "run" / "qparams").mkdir(parents=True)
    (tmp_path / "run" / "qparams" / "quantscope.json").write_text("{}")
    before = torch.get_num_threads()
    want = 1 if before != 1 else 2
    cli.main(["evaluate", str(tmp_path / "run"), "--threads", str(want), "--device", "cpu",
              "--no-progress"])
    assert torch.get_num_threads() == before


def test_compare_help_names_only_its_own_recipe_flags(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["compare", "--help"])
    out = capsys.readouterr().out
    assert "recipes and observers" in out and "one of --recipe, --scheme" not in out


def test_device_is_checked_against_the_devices_torch_sees(monkeypatch):
    from quantscope.cli.checks import UsageError
    from quantscope.cli.running import resolve_device

    assert resolve_device("cpu") == "cpu" and resolve_device("auto") in ("cpu", "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == "cuda:1" and resolve_device("cuda") == "cuda"
    with pytest.raises(UsageError, match=r"--device cuda:2: this machine has 2 cuda devices"):
        resolve_device("cuda:2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError, match="--device cuda: this torch sees no cuda device"):
        resolve_device("cuda")


def test_threads_zero_is_torchs_choice():
    from quantscope.cli.checks import check_resource_args

    args = cli.build_parser().parse_args(["calibrate", "--threads", "0", "--device", "cuda:1"])
    check_resource_args(args)  # the spelling only: whether cuda:1 is there comes later


def test_on_indivisible_float_that_leaves_nothing_says_so(tiny_bert, tmp_path, capsys):
    """Width 48 and 96 layers under groups of 64: every one indivisible. '--on-indivisible
    float' would leave them all in float: said as such (it was 'no module matches targets'
    with an ignore list of every layer)."""
    rc = cli.main(["calibrate", "--model", tiny_bert, "--scheme", "W4A16", "--group-size", "64",
                   "--on-indivisible", "float", "--out", str(tmp_path / "run"), "--no-progress",
                   "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert ("--on-indivisible float leaves every layer the recipe takes in float: layer "
            "'encoder.layer.0.attention.self.query' has width 48") in err, err
    assert "evaluating float" not in err and not (tmp_path / "run").exists()


def test_default_lengths_are_truncated_to_a_small_models_positions(tiny_bert, tmp_path, capsys):
    """The defaults (--max-length 128, --eval-max-length 256) exceed the 64 positions of this
    BERT: the run truncates to 64 and says so, where the model failed inside its embeddings."""
    out = tmp_path / "run"
    rc = cli.main(["calibrate", "--model", tiny_bert, "--calib-docs", "2", "--no-progress",
                   "--device", "cpu", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "--max-length 128: the model takes 64 positions" in err, err
    assert "--eval-max-length 256: the model takes 64 positions" in err, err
    rc = cli.main(["evaluate", str(out), "--no-progress", "--device", "cpu",
                   "--eval-max-length", "100"])
    err = capsys.readouterr().err
    assert rc == 0 and "--eval-max-length 100: the model takes 64 positions" in err, err


def test_roberta_positions_start_after_its_padding_row():
    from quantscope.cli.running import positions

    cfg = transformers.RobertaConfig(vocab_size=40, hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=66, pad_token_id=1)
    assert positions(transformers.RobertaModel(cfg)) == 64  # ids 2 .. 65
    assert positions(transformers.BertModel(transformers.BertConfig(
        vocab_size=40, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=66))) == 66
    # a word embedding of as many rows, with a padding row, is no position table (found by
    # review: 0 positions with the padding token last)
    for pad in (0, 63):
        assert positions(transformers.BertModel(transformers.BertConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=64, pad_token_id=pad))) == 64


@pytest.mark.parametrize("alpha, ok", [("0", True), ("0.5", True), ("1", True),
                                       ("1.01", False), ("-0.1", False)])
def test_smooth_takes_an_alpha_in_0_to_1_both_ends_included(alpha, ok):
    """--smooth ALPHA in [0, 1] (--help; llm-compressor's smoothing_strength): both ends pass
    the checks before the model loads and reach the calibration's options; past them is
    refused naming the flag."""
    from quantscope.cli.checks import UsageError, check_recipe_args
    from quantscope.cli.running import calibration_options

    args = cli.build_parser().parse_args(["calibrate", "--smooth", alpha])
    if not ok:
        with pytest.raises(UsageError, match=r"--smooth must be an alpha in \[0, 1\]"):
            check_recipe_args(args)
        return
    check_recipe_args(args)
    assert calibration_options(args)["outliers"].smooth == float(alpha)
