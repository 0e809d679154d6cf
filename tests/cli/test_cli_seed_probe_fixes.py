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
