"""The CLI knows recipe, scheme and observer names without importing torch: each static list
must equal its registry, and the parser must build without torch."""

import subprocess
import sys

import pytest

from quantscope import cli


def test_static_names_equal_the_registries():
    from quantscope import list_observers
    from quantscope.calibration.recipe import AUTO, KV_CACHE, PRESETS

    assert set(cli.RECIPE_NAMES) == set(PRESETS)
    assert set(cli.KV_CACHE_NAMES) == set(KV_CACHE)
    assert set(cli.OBSERVER_NAMES) == {*list_observers(), AUTO}
    qs = pytest.importorskip("compressed_tensors.quantization.quant_scheme")
    known = {k for k, v in qs.PRESET_SCHEMES.items() if v}
    # the names of the newest compressed-tensors tested (0.20); an older one (0.19, the
    # oldest supported) knows fewer, and scheme() refuses the others by name
    if _version("compressed-tensors") >= (0, 20):
        assert set(cli.SCHEME_NAMES) == known
    assert known <= set(cli.SCHEME_NAMES)


def _version(dist: str) -> tuple[int, ...]:
    from importlib.metadata import version

    return tuple(int(p) for p in version(dist).split(".")[:2])


def test_help_and_name_checks_import_no_torch(tmp_path):
    out = str(tmp_path / "out")
    code = ("import sys; from quantscope import cli; cli.build_parser().format_help(); "
            f"rc = cli.main(['calibrate', '--observer', 'minmx', '--out', {out!r}]); "
            "assert rc == 2, rc; assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0, r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "unknown observer (--observer) 'minmx'" in err[0]
    assert "did you mean 'minmax'" in err[0]


def test_typos_suggest_and_conflicts(capsys, tmp_path):
    assert cli.main(["calibrate", "--scheme", "W4A61", "--out", str(tmp_path / "o")]) == 2
    assert "did you mean 'W4A16'" in capsys.readouterr().err
    assert cli.main(["calibrate", "--recipe", "w8a8", "--scheme", "W8A8"]) == 2
    assert "give one of --recipe, --scheme" in capsys.readouterr().err
    f = tmp_path / "file"
    f.write_text("x")
    assert cli.main(["calibrate", "--out", str(f / "sub")]) == 2
    assert "--out" in capsys.readouterr().err
    assert cli.main(["calibrate", "--group-size", "0"]) == 2
    assert "--group-size must be a positive integer" in capsys.readouterr().err


def test_broken_pipe_is_quiet():
    r = subprocess.run(f"{sys.executable} -m quantscope formats | head -c 10 >/dev/null",
                       shell=True, capture_output=True, text=True, check=False)
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr
