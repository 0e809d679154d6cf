"""``load`` racing a ``save`` of the same folder by another process (probe s33): it read
``quantscope.json`` and ``qparams.safetensors`` by path one after the other, and a save
swapping the folder in between gave one calibration's specs and label with the other's
qparams (13 in 25,800 loads of a real two-process race). Both files now come from one
version of the folder (``exporters.atomic_swap.read_unchanged``): a read during which the
folder was replaced runs again."""

import os

import pytest
import torch
from torch import nn

import quantscope
from quantscope._jsonfile import read_json
from quantscope.calibration.results import io as qio
from quantscope.exporters import atomic_swap


def _calibration(which: int, observer: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    g = torch.Generator().manual_seed(which)
    batches = [torch.randn(4, 8, 32, generator=g) * (1 + which) for _ in range(2)]
    c = quantscope.calibrate(model, batches, "w8a8", observer=observer, progress=False)
    c.label = f"calib-{which}"
    return c


def _same(x, y) -> bool:
    return x.label == y.label and all(
        torch.equal(x.states[n][r].qparams.scale, y.states[n][r].qparams.scale)
        for n in y.states for r in y.states[n] if y.states[n][r].qparams is not None)


@pytest.fixture
def two(tmp_path):
    a, b = _calibration(0, "minmax"), _calibration(1, "mse")
    path = str(tmp_path / "calib")
    a.save(path)
    return a, b, path


def test_a_save_between_the_two_reads_gives_one_whole_version(two, monkeypatch):
    a, b, path = two

    def read_then_save(*args, **kwargs):  # the other process's save lands between the reads
        meta = read_json(*args, **kwargs)
        if not calls:
            b.save(path, overwrite=True)
        calls.append(args[0])
        return meta

    calls = []
    monkeypatch.setattr(qio, "read_json", read_then_save)
    got = quantscope.calibrate.load(path)
    assert _same(got, b) and not _same(got, a)  # read again, whole: not A's JSON, B's tensors
    assert len(calls) == 2


def test_a_folder_replaced_on_every_read_gives_up_naming_it(two, monkeypatch):
    a, b, path = two
    versions = iter([b, a] * 10)

    def read_then_save(*args, **kwargs):
        meta = read_json(*args, **kwargs)
        next(versions).save(path, overwrite=True)
        return meta

    monkeypatch.setattr(qio, "read_json", read_then_save)
    with pytest.raises(RuntimeError, match=r"load: .*calib was replaced 5 times"):
        quantscope.calibrate.load(path)


def test_read_unchanged_retries_only_what_a_swap_may_have_caused(tmp_path):
    calls = []

    def fails_steadily():
        calls.append(1)
        raise ValueError("damaged")

    with pytest.raises(ValueError, match="damaged"):  # the folder did not change: at once
        atomic_swap.read_unchanged(str(tmp_path), "test", fails_steadily)
    assert len(calls) == 1
    (tmp_path / "d").mkdir()
    swapped = []

    def fails_once_while_swapped():  # a new version put at the path while this one read
        if not swapped:
            os.rename(tmp_path / "d", tmp_path / "old")
            (tmp_path / "d").mkdir()
            swapped.append(1)
            raise ValueError("files of two versions")
        return "whole"

    assert atomic_swap.read_unchanged(str(tmp_path / "d"), "test",
                                      fails_once_while_swapped) == "whole"


def test_from_compressed_tensors_reads_one_version_of_an_export(tmp_path, monkeypatch):
    """The same race for an exported folder: config.json of one export (int8), the tensors
    of the next (fp8)."""
    from tiny_models import llama

    from quantscope.calibration import Calibration
    from quantscope.exporters import read

    model, batches = llama()
    a = quantscope.calibrate(model, batches, "w8a8", observer="minmax", progress=False)
    b = quantscope.calibrate(model, batches, "fp8", observer="mse", progress=False)
    folder, ref = str(tmp_path / "ct"), str(tmp_path / "ref")
    quantscope.export(a, model, folder)
    quantscope.export(b, model, ref)
    want = Calibration.from_compressed_tensors(ref)
    original, calls = read.read_quant_config, []

    def read_then_export(*args, **kwargs):
        got = original(*args, **kwargs)
        if not calls:
            quantscope.export(b, model, folder, overwrite=True)
        calls.append(1)
        return got

    monkeypatch.setattr(read, "read_quant_config", read_then_export)
    got = Calibration.from_compressed_tensors(folder)
    assert len(calls) == 2
    assert got.quantizes_like(want)
