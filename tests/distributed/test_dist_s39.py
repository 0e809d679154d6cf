"""Distributed defects of probe s39: a calibration on a subgroup without global rank 0 was
never saved nor exported (save and export asked the default group's rank 0); and
``gather_samples`` matched keys by their position in each rank's dict (rows went to the
wrong key, the ranks ended apart), and a rank with another key count aborted every process
in gloo (a size mismatch) where it should raise on every rank.

One spawn of 3 gloo processes; the group's timeout is short, so a rank left waiting fails
in seconds."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist
from ports import error_text, rank_results, spawn_ranks

import quantscope
from quantscope.calibration import Auto, Runtime
from quantscope.distributed import gather_samples

pytestmark = pytest.mark.dist  # spawns its own process group

TIMEOUT = 20
WORLD = 3


def _subgroup_writes(r, out, group, tmp):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    batches = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    if r != 0:  # ranks 1 and 2 calibrate together; rank 1 is the group's rank 0
        cal = quantscope.calibrate(model, batches, "w8a8", progress=False,
                                   runtime=Runtime(distributed=True, group=group))
        out["writer"] = cal.writer_rank
        auto = quantscope.calibrate(model, batches, "w8a8", observer="auto", progress=False,
                                    auto=Auto(candidates=["minmax", "mse"], metric="model"),
                                    runtime=Runtime(distributed=True, group=group))
        out["auto_writer"] = auto.writer_rank  # (reviewer: auto's model metric dropped it)
        cal.save(os.path.join(tmp, f"cal{r}"))
        quantscope.export(cal, model, os.path.join(tmp, f"exp{r}.onnx"), format="onnx",
                          example_inputs=batches[0])
    dist.barrier()
    out["written"] = sorted(os.listdir(tmp))
    dist.barrier()


def _gathers(r, out):
    a, b = torch.full((1, 2), float(r)), torch.full((1, 2), 10.0 + r)
    samples = {"a": [a], "b": [b]} if r % 2 == 0 else {"b": [b], "a": [a]}
    got = gather_samples(samples, limit=10)
    out["order"] = {k: v[0][:, 0].tolist() for k, v in got.items()}
    out["count"] = error_text(gather_samples, {"a": [a], **({"c": [b]} if r == 1 else {})}, 10)
    wide = torch.zeros(1, 3) if r == 2 else a
    out["width"] = error_text(gather_samples, {"a": [wide]}, 10)
    out["width_here"] = error_text(gather_samples, {"a": [a, torch.zeros(1, 3)] if r == 0
                                                    else [a]}, 10)
    out["after"] = gather_samples({"a": [a]}, 10)["a"][0][:, 0].tolist()  # still in step
    same = {"a" if r else "c": [a]}  # one key each, named apart on rank 0
    out["names"] = error_text(gather_samples, same, 10)
    empty = gather_samples({"a": [a if r else torch.zeros(0, 2)], "b": [b]}, 10)
    out["empty"] = {k: v[0][:, 0].tolist() for k, v in empty.items()}
    out["width_there"] = error_text(gather_samples, {"a": [a, torch.zeros(1, 3)] if r == 2
                                                     else [a]}, 10)


def _hand_built_saves(r, out, tmp):
    # a Calibration built by hand is its process's own: each rank writes its own (s45; a
    # loaded one writes on global rank 0: test_dist_s45.py)
    from quantscope.calibration import Calibration, preset

    Calibration(preset("w8a8"), {}, "x").save(os.path.join(tmp, f"built{r}"))
    dist.barrier()
    out["built"] = sorted(n for n in os.listdir(tmp) if n.startswith("built"))


def _stepped_apart(r, out):
    from quantscope import QuantSpec, get_observer

    obs = get_observer("static_minmax", QuantSpec())
    obs.sync_every_step = True

    def steps():  # each step exchanges: rank 0's third meets the others' sync
        for t in range(3 if r == 0 else 2):
            obs(torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * t + r)))
        obs.sync()

    out["stepped"] = error_text(steps)


def _scenarios(r, out):
    import tempfile

    group = dist.new_group([1, 2])  # every rank calls new_group
    alone = dist.new_group([1])
    if r == 1:  # a group of one process: its rank 0 is global rank 1 (reviewer)
        out["alone_writer"] = quantscope.calibrate(
            torch.nn.Sequential(torch.nn.Linear(8, 4)), [torch.randn(2, 8)], "w8a8",
            progress=False, runtime=Runtime(distributed=True, group=alone)).writer_rank
    tmp = os.path.join(tempfile.gettempdir(), f"qs_s39_{os.getppid()}")
    if r == 0:
        os.makedirs(tmp, exist_ok=True)
    dist.barrier()
    _subgroup_writes(r, out, group, tmp)
    _hand_built_saves(r, out, tmp)
    dist.barrier()
    if r == 0:
        shutil.rmtree(tmp)
    _gathers(r, out)
    _stepped_apart(r, out)  # last: the ranks may be out of step after it


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_scenarios, WORLD, TIMEOUT)


def test_a_subgroup_without_rank_0_writes_on_its_own_rank_0(ranks):
    assert [out.get("writer") for out in ranks] == [None, 1, 1]
    assert [out.get("auto_writer") for out in ranks] == [None, 1, 1]
    assert ranks[1]["alone_writer"] == 1
    assert rank_results(ranks, "written")[0] == ["cal1", "exp1.onnx"]


def test_gather_samples_matches_keys_by_name(ranks):
    for r, got in enumerate(rank_results(ranks, "order")):
        assert got == {"a": [0.0, 1.0, 2.0], "b": [10.0, 11.0, 12.0]}, got
        assert list(got) == (["a", "b"] if r % 2 == 0 else ["b", "a"])  # the caller's order
    for got in rank_results(ranks, "empty"):  # a rank's zero rows add none
        assert got == {"a": [1.0, 2.0], "b": [10.0, 11.0, 12.0]}, got


def test_a_hand_built_calibration_saves_on_the_rank_holding_it(ranks):
    assert rank_results(ranks, "built")[0] == ["built0", "built1", "built2"]


def test_observers_stepped_apart_are_told_so(ranks):
    for got in rank_results(ranks, "stepped"):
        assert got is not None and "or stepped apart" in got, got


@pytest.mark.parametrize("key,said", [
    ("count", "gather_samples: the ranks pass different keys ([1, 2, 1] keys by rank)"),
    ("width", "gather_samples: key 'a' holds rows of widths [2, 3] on different ranks"),
    ("width_here", "gather_samples: rank(s) [0] hold rows of different widths under one key"),
    ("width_there", "gather_samples: rank(s) [2] hold rows of different widths under one key"),
    ("names", "gather_samples: the ranks pass different keys ([1, 1, 1] keys by rank)"),
])
def test_gather_samples_refuses_on_every_rank(ranks, key, said):
    for got in rank_results(ranks, key):
        assert got is not None and got.startswith(f"ValueError: {said}"), got
    assert rank_results(ranks, "after") == [[0.0, 1.0, 2.0]] * WORLD
