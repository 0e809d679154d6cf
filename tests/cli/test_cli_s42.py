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
