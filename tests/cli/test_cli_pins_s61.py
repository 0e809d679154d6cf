"""Command-line pins found by mutation (s61): the documented defaults of `--calib-docs` and
`compare --recipes`, and `--no-progress` reaching the evaluator's progress bars."""

import pytest

from quantscope import cli


def _args(*argv):
    return cli.build_parser().parse_args(list(argv))


def test_calib_docs_and_compare_recipes_default_as_documented():
    """--help says: 32 calibration documents (calibrate, compare); compare runs w8a8,w4a8."""
    for command in ("calibrate", "compare"):
        assert _args(command).calib_docs == 32
    assert _args("compare").recipes == "w8a8,w4a8"


@pytest.mark.parametrize("flags, progress", [([], True), (["--no-progress"], False)])
def test_no_progress_turns_the_evaluation_progress_off(llama_dir, tmp_path, monkeypatch,
                                                       flags, progress):
    """The evaluator's bars follow --no-progress too (load_setup stopped at the evaluator)."""
    from quantscope.cli import running

    class Stop(Exception):
        pass

    seen = []

    def evaluator(task, model, tok, max_length, shows_progress):
        seen.append(shows_progress)
        raise Stop

    monkeypatch.setattr(running, "Evaluator", evaluator)
    calib = tmp_path / "calib.txt"
    calib.write_text("the cat sat on the mat\na dog ran far away\n")
    args = _args("calibrate", "--model", llama_dir, "--calib-file", str(calib), "--calib-docs",
                 "2", "--max-length", "8", "--batch-size", "2", "--device", "cpu", *flags)
    with pytest.raises(Stop):
        running.load_setup(args, running.Phases(quiet=True))
    assert seen == [progress]
