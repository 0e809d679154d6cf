"""Distributed defects of probe s45. A fusion group whose runtime shares one weight scale
(q / k / v, gate / up under NVFP4 or fp8 per tensor) is searched joined; its ``imatrix_mse``
search read the importance from the observer of the rank that owned the weight only, so the
other ranks searched it unweighted: the ranks held different qparams, silently (and ``auto``
with an ``imatrix_mse`` candidate chose differently). Now every rank holds one process's.

One spawn of 2 gloo processes; each rank calibrates the one-process reference too."""

from __future__ import annotations

import warnings

import pytest
import tiny_models
import torch
from ports import rank_results, spawn_ranks

import quantscope
from quantscope import QuantSpec
from quantscope.calibration import Auto, Runtime
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


def _fused(r, out):
    for case, (recipe, kw) in FUSED.items():
        for distributed in (True, False):
            model, batches = tiny_models.llama()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the tiny model's unused-token warnings
                cal = quantscope.calibrate(model, batches, recipe, progress=False,
                                           runtime=Runtime(distributed=distributed), **kw)
            out[f"fused/{case}/{distributed}"] = _weights(cal)


def _scenarios(r, out):
    _fused(r, out)


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_scenarios, 2, TIMEOUT)


def _same(a, b) -> bool:
    return a is b or (a is not None and b is not None and torch.equal(a, b))


@pytest.mark.parametrize("case", sorted(FUSED))
def test_fused_imatrix_weights_hold_one_process_qparams_on_every_rank(ranks, case):
    one = rank_results(ranks, f"fused/{case}/False")[0]
    assert any("q_proj" in layer for layer in one)  # the fused layers are there
    for r, got in enumerate(rank_results(ranks, f"fused/{case}/True")):
        assert got.keys() == one.keys()
        differ = [layer for layer in one if not all(map(_same, got[layer], one[layer]))]
        assert not differ, f"rank {r}: {differ}"
