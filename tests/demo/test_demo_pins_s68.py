"""Pins from mutation round s68 on the demo's format table (``quantscope.demo.formats``) and
its data (``quantscope.demo.data``): the seeded tensors are what the module doc says (seeded,
Student's t with 3 degrees of freedom, 1% of the columns scaled by 50), MSE is a mean over
elements and agrees with the SQNR formula, ``bits/elem`` counts the zero points and NVFP4's
e4m3 block scales and fp32 global scale, the title and ``--seed`` reach the output, sizes
that are not integers are reasons not tracebacks; ``read_corpus`` splits at "\\n" only,
strips lines, refuses a missing file or an empty corpus; ``test_data_dir`` explains a
missing gensim; ``lee_pairs`` reads the strict upper triangle of a square matrix only."""

import math
import types

import numpy as np
import pytest
import torch

from quantscope import presets
from quantscope.demo import data
from quantscope.demo import formats as demo
from quantscope.layout import Group
from quantscope.spec import QuantSpec


def test_demo_tensors_follow_the_seed():
    a, b = demo.demo_tensors(1, 8, 128), demo.demo_tensors(1, 8, 128)
    c = demo.demo_tensors(2, 8, 128)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not any(torch.equal(a[n], c[n]) for n in a)


def test_student_t_has_three_degrees_of_freedom():
    """The median of |t_3| is t_3's 75% quantile, 0.7649 (N(0, 1): 0.6745)."""
    x = demo.demo_tensors(0)["student-t"]
    assert abs(float(x.abs().median()) - 0.7649) < 0.01


@pytest.mark.parametrize("rows, cols", [(512, 1024), (64, 128)])
def test_outliers_scale_one_percent_of_the_columns_by_50(rows, cols):
    x = demo.demo_tensors(3, rows, cols)["outliers"]
    std = x.std(dim=0)  # per column (input channel)
    big = std > 10
    assert int(big.sum()) == max(1, cols // 100)
    assert bool(((std[big] > 40) & (std[big] < 60)).all())
    assert float(std[~big].max()) < 1.5


def test_mse_is_a_mean_over_elements_and_matches_the_sqnr():
    """SQNR = 10 log10(sum x^2 / sum (x - x')^2), MSE = sum (x - x')^2 / numel."""
    x = demo.demo_tensors(0, 16, 128)["gauss"]
    sqnr, mse = demo.scheme_error(x, presets.INT4_GROUP128)
    signal = float(x.double().square().sum())
    assert mse > 0
    assert math.isclose(sqnr, 10 * math.log10(signal / (mse * x.numel())), rel_tol=1e-9)


@pytest.mark.parametrize("spec, bits", [
    (presets.INT8_PER_CHANNEL, 8 + 32 / 256),                   # fp32 scale per row
    (presets.INT4_GROUP128, 4 + 32 / 128),
    (presets.INT4_GROUP128_ASYM, 4 + (32 + 4) / 128),            # plus a 4-bit zero point
    (QuantSpec("int2", Group(128), symmetric=False), 2 + (32 + 2) / 128),
    (presets.NVFP4, 4 + 8 / 16 + 32 / (64 * 256)),               # e4m3 / 16, fp32 global
])
def test_bits_per_element_counts_scales_and_zero_points(spec, bits):
    assert math.isclose(demo.bits_per_element(spec, (64, 256)), bits, rel_tol=1e-12)


def test_title_names_the_shape_and_seed_and_main_passes_the_seed(capsys, monkeypatch):
    monkeypatch.setattr(demo, "SCHEMES", demo.SCHEMES[:1])
    assert "on 8x128 float32 tensors (seed 5)" in demo.format_table(5, 8, 128).splitlines()[0]
    assert demo.main(["--seed", "3", "--rows", "8", "--cols", "128"]) == 0
    assert capsys.readouterr().out.startswith(demo.format_table(3, 8, 128) + "\n")


def test_a_size_that_is_not_an_integer_is_a_reason(capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(["--rows", "abc"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --rows: must be a positive integer, got 'abc'" in err
    with pytest.raises(ValueError, match="rows must be a positive integer, got 2.5"):
        demo.check_size("rows", 2.5)


def test_check_size_returns_a_python_int():
    n = demo.check_size("cols", np.int64(256))
    assert n == 256 and type(n) is int


def test_read_corpus_splits_at_newline_only(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("a\u2028b\x85c\x0cd\ne\n", encoding="utf-8")
    assert data.read_corpus(str(f)) == ["a\u2028b\x85c\x0cd", "e"]


def test_read_corpus_strips_each_line(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("  lead\n\ttab\t\n", encoding="utf-8")
    assert data.read_corpus(str(f)) == ["lead", "tab"]


def test_read_corpus_refuses_an_empty_corpus(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text(" \n\n\t\n", encoding="utf-8")
    with pytest.raises(ValueError, match="holds no text"):
        data.read_corpus(str(f))


@pytest.mark.parametrize("name", ["missing.txt", "."])
def test_read_corpus_refuses_a_path_that_is_no_file(tmp_path, name):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.read_corpus(str(tmp_path / name))


def test_test_data_dir_says_how_to_install_gensim(monkeypatch):
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps gensim"):
        data.test_data_dir()


def test_test_data_dir_needs_the_test_data(monkeypatch, tmp_path):
    spec = types.SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(FileNotFoundError, match="has no test data"):
        data.test_data_dir()
    (tmp_path / "test" / "test_data").mkdir(parents=True)
    assert data.test_data_dir() == str(tmp_path / "test" / "test_data")


def test_lee_pairs_read_the_upper_triangle_of_a_square_matrix(monkeypatch, tmp_path):
    monkeypatch.setattr(data, "test_data_dir", lambda: str(tmp_path))
    f = tmp_path / "similarities0-1.txt"
    f.write_text("1 0.1 0.2\n0.7 1 0.3\n0.8 0.9 1\n")
    i, j, s = data.lee_pairs()
    assert i.tolist() == [0, 0, 1] and j.tolist() == [1, 2, 2]
    assert s.tolist() == [0.1, 0.2, 0.3]
    f.write_text("1 0.1 0.2\n0.7 1 0.3\n")
    with pytest.raises(ValueError, match=r"expected a square matrix, got shape \(2, 3\)"):
        data.lee_pairs()
