"""``--seed`` outside the range torch takes stops before the model loads, naming the flag
(probing: it failed after loading with torch's 'Overflow when unpacking long long')."""

import pytest

from quantscope import cli
from quantscope.calibration.options import SEED_RANGE


@pytest.mark.parametrize("seed", [SEED_RANGE[1] + 1, SEED_RANGE[0] - 1, 10**23])
@pytest.mark.parametrize("command", ["calibrate", "compare"])
def test_seed_out_of_range_stops_before_the_model_loads(llama_dir, tmp_path, capsys, command,
                                                        seed):
    extra = ["--observers", "minmax", "--no-plots"] if command == "compare" else []
    rc = cli.main([command, "--model", llama_dir, "--seed", str(seed), *extra,
                   "--calib-docs", "2", "--no-progress", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"error: --seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]" in err, err
    assert str(seed) in err and "loading" not in err, err
    assert not (tmp_path / "run").exists()


def test_seeds_at_the_ends_of_the_range_pass_the_check():
    from argparse import Namespace

    for seed in SEED_RANGE:
        cli.checks.check_seed(Namespace(seed=seed))


def test_seed_defaults_to_0_as_documented():
    """--help and the guide: --seed's default is 0, in calibrate and compare alike (mutation
    s61: another default changed every default run's batches and samples, unseen)."""
    parse = cli.build_parser().parse_args
    assert [parse([command]).seed for command in ("calibrate", "compare")] == [0, 0]


def test_seed_reaches_the_order_of_the_calibration_batches(llama_dir, tmp_path, monkeypatch):
    """--seed also seeds the order of the calibration batches: token_batches gets it."""
    import inspect

    from quantscope.cli import running
    from quantscope.demo import models

    class Stop(Exception):
        pass

    real, seeds = models.token_batches, []

    def batches(*a, **k):
        seeds.append(inspect.signature(real).bind(*a, **k).arguments.get("seed"))
        raise Stop

    monkeypatch.setattr(models, "token_batches", batches)
    calib = tmp_path / "calib.txt"
    calib.write_text("the cat sat on the mat\na dog ran far away\n")
    args = cli.build_parser().parse_args([
        "calibrate", "--model", llama_dir, "--calib-file", str(calib), "--calib-docs", "2",
        "--max-length", "8", "--batch-size", "2", "--device", "cpu", "--seed", "7"])
    with pytest.raises(Stop):
        running.load_setup(args, running.Phases(quiet=True))
    assert seeds == [7]
