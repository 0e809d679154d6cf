"""bench/gpu_triton.py's NVFP4 and whole-model rows (issue 35 item 5), dry-run on the CPU at
tiny sizes: each contender runs or says why not, and the figures hang together (a lent GPU
runs the same code once, with no chance to fix it there)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def bench_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))


def _rows(text: str) -> dict[str, list[str]]:
    """Markdown table rows of ``text``: first cell + dtype (when numeric rows have one)."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and not set(cells[0]) <= set("-"):
            rows.setdefault(cells[0], []).append(cells[1:])
    return rows


def test_nvfp4_row_prices_every_method_by_one_formula(bench_path, capsys):
    from gpu_nvfp4 import OURS, SPEC, bench_nvfp4, methods, total_error

    from quantscope.estimators import range_error

    bench_nvfp4(32, torch.device("cpu"), 1)
    rows = _rows(capsys.readouterr().out)
    assert [r[0] for r in rows[OURS]] == ["float32", "bfloat16"]
    for dtype_row in rows[OURS]:
        assert dtype_row[-2:] == ["1.000", "1.000"]  # wall / ours, error / ours
    for name, found in rows.items():
        if name in ("method",):
            continue
        for r in found:  # a figure, or why it did not run
            assert r[1].startswith("not run:") or float(r[1]) > 0, (name, r)
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    calls, _ = methods(w)
    lo, hi, ga = calls[OURS]()
    u = SPEC.layout.to_units(w)
    # the reported total is the per-block errors of the chosen ranges, summed
    assert total_error(w, lo, hi, ga) == pytest.approx(
        range_error(u, lo, hi, SPEC, global_amax=ga).double().sum().item(), rel=1e-12)
    # min-max ranges cost at least the searched ones (the search keeps min-max as a candidate)
    amax = u.abs().amax(1)
    assert total_error(w, -amax, amax, None) >= total_error(w, lo, hi, ga)


def test_model_row_dry_run(bench_path, capsys):
    pytest.importorskip("transformers")
    from gpu_model import bench_model

    bench_model(64, torch.device("cpu"), 8, 16)
    out = capsys.readouterr().out
    rows = _rows(out)
    assert re.search(r"random Llama \d+ M parameters, bf16 \(hidden 64, 2 layers\)", out)
    assert rows["plain forward"][0][1] == "1.000"
    for scheme in ("w8a8 min-max", "nvfp4 nvfp4_expanded_mse", "w8a8 histogram"):
        seconds, per_forward = rows[f"quantscope calibrate, {scheme}"][0][:2]
        assert float(seconds) > 0 and float(per_forward) > 0, scheme
    assert any(name.startswith("llm-compressor oneshot") for name in rows)


def test_rows_option_names_what_it_expects(bench_path, monkeypatch, capsys):
    import gpu_triton

    monkeypatch.setattr("sys.argv", ["gpu_triton.py", "--device", "cpu", "--rows", "nvfp4,x"])
    with pytest.raises(SystemExit):
        gpu_triton.main()
    assert "--rows: unknown ['x']" in capsys.readouterr().err


def test_imatrix_row_dry_run(bench_path, capsys):
    """The asked-for imatrix row: our two paths choose alike (the CPU runs one path for both,
    a GPU its fused search and the blocks of factors), the peer runs or says why not."""
    from gpu_imatrix import OURS, bench_imatrix

    bench_imatrix(32, torch.device("cpu"), 1)
    rows = _rows(capsys.readouterr().out)
    assert rows[OURS][0][-2:] == ["1.000", "1.000"]
    before = rows["quantscope imatrix_mse, blocks of factors (the path before)"][0]
    assert float(before[0]) > 0 and before[-1] == "1.000"
    peer = rows["llm-compressor 0.14 imatrix_mse"][0]
    assert peer[0].startswith("not run:") or float(peer[0]) > 0
