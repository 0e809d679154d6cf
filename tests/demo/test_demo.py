"""The synthetic format table (python -m quantscope.demo)."""

import math

from quantscope.demo import formats as demo


def test_format_table_has_every_scheme_and_sane_errors():
    text = demo.format_table(seed=1, rows=64, cols=256)
    for label, _ in demo.SCHEMES:
        assert label in text
    x = demo.demo_tensors(1, 64, 256)["gauss"]
    sqnr = {label: demo.scheme_error(x, spec)[0] for label, spec in demo.SCHEMES}
    assert all(math.isfinite(v) for v in sqnr.values())
    # more bits, less error; ~6 dB per bit for uniform integers
    assert sqnr["int8 per-channel"] > sqnr["int4 per-channel"] + 20 > sqnr["int2 per-channel asym"] + 20
    assert sqnr["bfp16"] > sqnr["mxfp8 (e4m3, floor)"] > sqnr["mxfp4 (floor)"]
    assert sqnr["fp8 e4m3 per-channel"] > sqnr["fp8 e5m2 per-channel"]  # one more mantissa bit
    assert abs(demo.bits_per_element(demo.presets.MXFP4, (64, 256)) - 4.25) < 1e-9


def test_outlier_channels_hurt_per_channel_more_than_blocks():
    t = demo.demo_tensors(2, 64, 256)
    err = {n: demo.scheme_error(t["outliers"], s)[0] for n, s in demo.SCHEMES}
    assert err["int4 group128"] > err["int4 per-channel"]
    assert err["nvfp4"] > err["fp4 e2m1 per-channel"]


def test_main_prints_the_table(capsys):
    assert demo.main(["--rows", "32", "--cols", "128"]) == 0
    out = capsys.readouterr().out
    assert "nvfp4" in out and "SQNR" in out
