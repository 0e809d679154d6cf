"""Inside a process group of several processes, every registered export format and
``Calibration.save`` write a calibration made across the group on rank 0 only, as
transformers' ``save_pretrained`` on the main process: another rank returns the path at
once, having written nothing and joined no collective (before, rank 1 renamed a folder
holding only config.json into place, and ranks sharing one path raced). With one process in
the group nothing changes. (A calibration a rank made alone is its own: test_dist_s45.py.)

One spawn of 2 gloo processes runs every scenario; the parent looks at the folders."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from ports import rank_results, spawn_ranks
from tiny_models import llama

import quantscope
from quantscope.calibration import Runtime, load

pytest.importorskip("compressed_tensors")
pytest.importorskip("transformers")

TIMEOUT = 20  # seconds a collective waits for a peer: a rank left waiting fails the spawn
OUT_ENV = "QUANTSCOPE_TEST_RANK_WRITES"  # the folder the spawned ranks write under


def _calibration(distributed=False):
    model, batches = llama()
    preset = quantscope.calibrate.preset("w8a8", ignore=["lm_head"])
    return model, quantscope.calibrate(model, batches, preset, progress=False,
                                       runtime=Runtime(distributed=distributed))


def _marker(calibration, model, path, **options):
    with open(path, "w") as f:
        f.write("written")
    return path


def _scenarios(r, out):
    from quantscope.exporters.registry import register

    d = os.environ[OUT_ENV]
    model, calibration = _calibration(distributed=True)  # the group's: one writer
    out["calibration"] = calibration
    out["ct"] = quantscope.export(calibration, model, f"{d}/ct")  # one shared path
    out["ct_mine"] = quantscope.export(calibration, model, f"{d}/ct_r{r}")
    out["cal"] = calibration.save(f"{d}/cal")
    out["cal_mine"] = calibration.save(f"{d}/cal_r{r}")
    # a format registered later gets the rule too; rank 1 calls alone, rank 0 never does
    register("test-marker")(_marker)
    out["marker"] = quantscope.export(calibration, model, f"{d}/marker_r{r}", "test-marker")
    if r == 1:
        out["onnx"] = quantscope.export(calibration, model, f"{d}/alone.onnx", "onnx",
                                        example_inputs=torch.zeros(2, 4, dtype=torch.long))
    dist.barrier()  # as the guide says: before a rank reads what rank 0 wrote
    out["ct_seen"] = sorted(os.listdir(f"{d}/ct"))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    d = tmp_path_factory.mktemp("ranks")
    os.environ[OUT_ENV] = str(d)
    try:
        return d, spawn_ranks(_scenarios, 2, TIMEOUT)
    finally:
        del os.environ[OUT_ENV]


@pytest.mark.dist
@pytest.mark.extended  # spawns its own process group
def test_rank_1_writes_nothing_and_returns_the_path(written):
    d, ranks = written
    for key, path in (("ct", "ct"), ("ct_mine", "ct_r1"), ("marker", "marker_r1")):
        assert rank_results(ranks, key)[1] == str(d / path)
    assert rank_results(ranks, "cal")[1] == str(d / "cal")
    assert ranks[1]["onnx"] == str(d / "alone.onnx")  # called on rank 1 alone
    for path in ("ct_r1", "cal_r1", "marker_r1", "alone.onnx"):
        assert not (d / path).exists(), path


@pytest.mark.dist
@pytest.mark.extended  # the same process group
def test_rank_0_writes_whole_folders(written):
    d, ranks = written
    assert rank_results(ranks, "ct")[0] == str(d / "ct")
    for folder in ("ct", "ct_r0"):
        names = set(os.listdir(d / folder))
        assert {"config.json", "model.safetensors"} <= names, (folder, names)
        config = json.loads((d / folder / "config.json").read_text())
        assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    # every rank sees rank 0's whole folder after the barrier
    assert rank_results(ranks, "ct_seen")[0] == rank_results(ranks, "ct_seen")[1]
    calibration = rank_results(ranks, "calibration")[0]
    for folder in ("cal", "cal_r0"):
        assert load(d / folder).quantizes_like(calibration)
    assert (d / "marker_r0").read_text() == "written"


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_one_process_group_writes_as_without_one(one_rank_group, tmp_path):
    model, calibration = _calibration()
    assert quantscope.export(calibration, model, tmp_path / "ct") == str(tmp_path / "ct")
    assert (tmp_path / "ct" / "model.safetensors").is_file()
    assert calibration.save(tmp_path / "cal") == str(tmp_path / "cal")
    assert load(tmp_path / "cal").quantizes_like(calibration)
    assert torch.distributed.get_world_size() == 1
