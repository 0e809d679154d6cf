"""Distributed defects of probe s45. A fusion group whose runtime shares one weight scale
(q / k / v, gate / up under NVFP4 or fp8 per tensor) is searched joined; its ``imatrix_mse``
search read the importance from the observer of the rank that owned the weight only, so the
other ranks searched it unweighted: the ranks held different qparams, silently (and ``auto``
with an ``imatrix_mse`` candidate chose differently). Now every rank holds one process's.
A calibration a rank made alone inside a process group (no ``Runtime(distributed=True)``)
was saved and exported on rank 0 only: rank 1's ``save`` returned the path, writing nothing.
Now it is written by the rank that made it; one made across the group, or read from disk,
is written by one rank, and the others log that they wrote nothing.

Spawns of 2 gloo processes (auto's own, extended); rank 0 calibrates the one-process reference
too."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import warnings

import pytest
import tiny_models
import torch
import torch.distributed as dist
from ports import rank_results, spawn_ranks

import quantscope
from quantscope import QuantSpec
from quantscope.calibration import Auto, Calibration, Runtime, preset
from quantscope.calibration.recipe import Recipe, Role, Rule
from quantscope.layout import Tensor

pytestmark = pytest.mark.dist  # spawns its own process group

TIMEOUT = 30
FP8_TENSOR = Recipe((Rule(("Linear",), weight=Role(QuantSpec("fp8_e4m3", Tensor()),
                                                   "imatrix_mse")),), name="fp8-tensor")
#: (recipe, calibrate's keywords): fused weights searched joined with imatrix_mse
FUSED = {
    "nvfp4": ("nvfp4", {"observer": "imatrix_mse"}),
    "fp8-tensor": (FP8_TENSOR, {}),
    # scored on the model's output: each candidate's recipe searched joined
    "auto": ("nvfp4", {"observer": "auto", "auto": Auto(
        candidates=["memoryless_mse", "imatrix_mse"])}),
}


def _weights(cal) -> dict:
    """Every weight's qparams (scale, and NVFP4's global scale), by layer."""
    return {layer: (roles["weight"].qparams.scale, roles["weight"].qparams.global_scale)
            for layer, roles in cal.states.items() if "weight" in roles}


def _fused(r, out, cases):
    for case in cases:
        recipe, kw = FUSED[case]
        # the one-process reference on rank 0 only: the other rank would compute the same
        for distributed in (True, False) if r == 0 else (True,):
            model, batches = tiny_models.llama()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the tiny model's unused-token warnings
                cal = quantscope.calibrate(model, batches, recipe, progress=False,
                                           runtime=Runtime(distributed=distributed), **kw)
            out[f"fused/{case}/{distributed}"] = _weights(cal)


def _tiny():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in
                   range(2)]


class _Records(logging.Handler):
    """The messages logger ``quantscope`` emits at INFO and above."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _writes(r, out, tmp):
    """Each rank saves and exports to paths of its own: what it made alone, a hand-built
    calibration, one made across the group, one loaded from disk (and that one again with
    its writer_rank set to this rank)."""
    model, batches = _tiny()
    alone = quantscope.calibrate(model, batches, "w8a8", progress=False)
    across = quantscope.calibrate(model, batches, "w8a8", progress=False,
                                  runtime=Runtime(distributed=True))
    if r == 0:
        across.save(os.path.join(tmp, "src"))
    dist.barrier()
    loaded = quantscope.calibrate.load(os.path.join(tmp, "src"))
    out["writers"] = [alone.writer_rank, across.writer_rank, loaded.writer_rank]
    records = _Records()
    logging.getLogger("quantscope").addHandler(records)
    logger_level = logging.getLogger("quantscope").level
    logging.getLogger("quantscope").setLevel(logging.INFO)
    try:
        for name, cal in (("alone", alone), ("built", Calibration(preset("w8a8"), {}, "x")),
                          ("across", across), ("loaded", loaded)):
            ret = cal.save(os.path.join(tmp, f"{name}{r}"))
            out[f"returned/{name}"] = ret == os.path.join(tmp, f"{name}{r}")
        quantscope.export(alone, model, os.path.join(tmp, f"alone{r}.onnx"), format="onnx",
                          example_inputs=batches[0])
        loaded.writer_rank = dist.get_rank()  # read on each rank: each may write its own
        loaded.save(os.path.join(tmp, f"mine{r}"))
    finally:
        logging.getLogger("quantscope").removeHandler(records)
        logging.getLogger("quantscope").setLevel(logger_level)
    out["logged"] = records.messages
    if importlib.util.find_spec("compressed_tensors") is not None:
        # transformers writes a model's weights on global rank 0 only: rank 1's own export
        # renamed a folder of config.json alone into place
        llama, batches = tiny_models.llama()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cal = quantscope.calibrate(llama, batches, preset("w8a8", ignore=["lm_head"]),
                                       progress=False)
        quantscope.export(cal, llama, os.path.join(tmp, f"ct{r}"))
        out["ct"] = sorted(os.listdir(os.path.join(tmp, f"ct{r}")))
        dist.barrier()  # rank 0's checkpoint written: every rank reads it, one writes
        out["ct read"] = Calibration.from_compressed_tensors(os.path.join(tmp, "ct0")).writer_rank
    dist.barrier()
    out["written"] = sorted(n for n in os.listdir(tmp) if n != "src" and n[:2] != "ct")


def _scenarios(r, out):
    tmp = os.path.join(tempfile.gettempdir(), f"qs_s45_{os.getppid()}")
    if r == 0:
        os.makedirs(tmp, exist_ok=True)
    dist.barrier()
    try:
        _writes(r, out, tmp)
    finally:
        dist.barrier()
        if r == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    _fused(r, out, ("nvfp4", "fp8-tensor"))


def _auto_scenario(r, out):
    _fused(r, out, ("auto",))


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_scenarios, 2, TIMEOUT)


@pytest.fixture(scope="module")
def auto_ranks():
    return spawn_ranks(_auto_scenario, 2, TIMEOUT)


def _same(a, b) -> bool:
    return a is b or (a is not None and b is not None and torch.equal(a, b))


# auto's scoring of its candidates' joined searches in a spawn of its own, extended
@pytest.mark.parametrize("case", ["fp8-tensor", "nvfp4",
                                  pytest.param("auto", marks=pytest.mark.extended)])
def test_fused_imatrix_weights_hold_one_process_qparams_on_every_rank(request, case):
    ranks = request.getfixturevalue("auto_ranks" if case == "auto" else "ranks")
    one = rank_results(ranks[:1], f"fused/{case}/False")[0]
    assert any("q_proj" in layer for layer in one)  # the fused layers are there
    for r, got in enumerate(rank_results(ranks, f"fused/{case}/True")):
        assert got.keys() == one.keys()
        differ = [layer for layer in one if not all(map(_same, got[layer], one[layer]))]
        assert not differ, f"rank {r}: {differ}"


def test_a_calibration_made_alone_is_written_by_the_rank_that_made_it(ranks):
    # alone (calibrated, built by hand): each rank's own; across the group or loaded from
    # disk (every rank reads one folder): rank 0 alone writes; "mine": a loaded calibration
    # given writer_rank = its own rank
    assert rank_results(ranks, "written")[0] == [
        "across0", "alone0", "alone0.onnx", "alone1", "alone1.onnx", "built0", "built1",
        "loaded0", "mine0", "mine1"]
    assert rank_results(ranks, "writers") == [[None, 0, 0]] * 2
    for name in ("alone", "built", "across", "loaded"):  # every rank returns its path
        assert rank_results(ranks, f"returned/{name}") == [True, True], name


def test_a_compressed_tensors_export_on_rank_1_holds_the_weights(ranks):
    pytest.importorskip("compressed_tensors")
    for got in rank_results(ranks, "ct"):
        assert {"config.json", "model.safetensors"} <= set(got), got


def test_a_calibration_read_from_a_checkpoint_is_written_by_one_rank(ranks):
    """As one loaded from a quantscope folder: every rank read the same checkpoint, so the
    default group's rank 0 writes what its save and exports write (not every rank)."""
    pytest.importorskip("compressed_tensors")
    assert rank_results(ranks, "ct read") == [0, 0]


def test_a_rank_that_writes_nothing_logs_so(ranks):
    logged = rank_results(ranks, "logged")
    assert logged[0] == []
    assert len(logged[1]) == 2, logged[1]  # the save of "across1" and of "loaded1"
    for msg, name in zip(logged[1], ("across1", "loaded1")):
        assert msg.startswith("save: global rank 1 writes nothing to ") and name in msg, msg
        assert "the calibration's writer_rank is global rank 0, which writes it" in msg, msg
