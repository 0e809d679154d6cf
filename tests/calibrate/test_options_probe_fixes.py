"""Probe fixes of the option objects (quantscope.calibration.options): Runtime.group, Auto's
unchecked values, numpy scalars, the missing-role advice and the auto roles' documentation."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from quantscope.calibration import Auto, MoE, Outliers, Runtime, Sampling, Sequential, calibrate
from quantscope.calibration.options import Options

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)).eval()
    return model, [torch.randn(8, 32) for _ in range(3)]


@pytest.mark.parametrize("group", [5, "world", object()])
def test_runtime_group_must_be_a_process_group(group):
    # probing: group=5 was accepted; the pass then raised AttributeError inside
    # torch.distributed ('int' object has no attribute 'size'), naming no option
    with pytest.raises(TypeError, match=r"Runtime\.group must be a torch\.distributed "
                                        r"ProcessGroup or None"):
        Runtime(distributed=True, group=group)


@pytest.mark.skipif(not dist.is_available(), reason="torch without torch.distributed")
def test_a_rank_outside_the_group_is_told_so():
    # new_group gives a rank outside the group this sentinel (an int): it was told only that
    # Runtime.group must be a ProcessGroup, got int -100
    with pytest.raises(ValueError, match=r"this process is not in Runtime\.group"):
        Runtime(distributed=True, group=dist.GroupMember.NON_GROUP_MEMBER)


@pytest.mark.skipif(not dist.is_available(), reason="torch without torch.distributed")
def test_runtime_group_takes_a_real_process_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        group = dist.new_group([0])
        assert Runtime(distributed=True, group=group).group is group
        # probe s39: without distributed the group was never read (each rank alone)
        with pytest.raises(ValueError, match=r"Runtime\.group is read only with "
                                             r"distributed=True"):
            Runtime(group=group)
    finally:
        dist.destroy_process_group()
    assert Runtime(distributed=True).group is None


def test_auto_candidates_must_not_be_empty():
    # probing: Auto(candidates=[]) failed only once calibration started, naming no field
    for empty in ([], (), iter(())):
        with pytest.raises(ValueError, match=r"Auto\.candidates is empty"):
            Auto(candidates=empty)
    # "auto" among the candidates is ignored: alone, it names none (the pass said so late)
    for only in (["auto"], ("auto", "auto")):
        with pytest.raises(ValueError, match=r"Auto\.candidates is empty but for 'auto' itself"):
            Auto(candidates=only)
    assert Auto(candidates=["minmax", "auto"]).candidates == ("minmax", "auto")


def test_a_candidate_named_in_two_cases_runs_once():
    # probe s59: ("mse", "MSE") were scored as two candidates (twice the forwards, two
    # score labels) though the registry reads both as one observer
    from quantscope.calibration.run.observe import candidates_for

    assert candidates_for("input", ("mse", "MSE", "minmax", "Mse")) == ["mse", "minmax"]
    assert candidates_for("weight", ("MSE", "memoryless_mse", "MINMAX")) == [
        "memoryless_mse", "memoryless_minmax"]  # spelt as registered
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    batches = [torch.randn(4, 16) for _ in range(3)]
    infos = [calibrate(model, batches, "w8a8", observer="auto", progress=False,
                       auto=Auto(candidates=names)).info["auto"]
             for names in (("mse", "MSE", "Mse"), ("mse",))]
    assert list(infos[0]["scores"]) == ["mse"] and infos[0]["scores"] == infos[1]["scores"]
    assert infos[0]["score_forwards"] == infos[1]["score_forwards"]


def test_imatrix_mse_in_any_case_weighs_by_importance():
    """"IMATRIX_MSE" (a Role's observer, an auto candidate) is the registry's "imatrix_mse",
    which waits for its layer's input importance: it was compared by its spelling, so in
    another case it searched unweighted, as plain MSE, without a word."""
    from quantscope.calibration import Recipe, Role, Rule
    from quantscope.calibration.run.observe import candidates_for
    from quantscope.spec import QuantSpec

    assert Role(QuantSpec("int4", "group:16"), "IMATRIX_MSE").observer == "imatrix_mse"
    assert candidates_for("weight", ("IMATRIX_MSE", "Imatrix_Mse")) == ["imatrix_mse"]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
    batches = [torch.randn(4, 64) * torch.linspace(0.1, 5, 64) for _ in range(3)]
    scales = [calibrate(model, batches, Recipe(Rule("Linear", weight=Role(
        QuantSpec("int4", "group:16"), name))), progress=False).states["0"]["weight"]
        .qparams.scale for name in ("imatrix_mse", "IMATRIX_MSE", "memoryless_mse")]
    assert torch.equal(scales[0], scales[1])
    assert not torch.equal(scales[1], scales[2])  # the importance weighed


def test_auto_among_the_candidates_is_read_in_any_case():
    # review s51: "auto" was ignored but "AUTO" refused as an unknown observer, where every
    # other candidate name and observer="AUTO" everywhere else is read in any case
    from quantscope.calibration.run.observe import candidates_for

    for spelt in ("AUTO", "Auto"):
        assert Auto(candidates=["minmax", spelt]).candidates == ("minmax", spelt)
        assert candidates_for("input", ("minmax", spelt)) == ["minmax"]
        assert candidates_for("weight", (spelt, "mse")) == ["memoryless_mse"]
        with pytest.raises(ValueError, match=r"Auto\.candidates is empty but for 'auto' itself"):
            Auto(candidates=[spelt, "auto"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    batches = [torch.randn(8, 16) for _ in range(2)]
    calibs = [calibrate(model, batches, "w8a8", observer="auto", progress=False,
                        auto=Auto(candidates=["minmax", spelt, "mse"], metric="tensor"))
              for spelt in ("auto", "AUTO")]
    chosen = [{(layer, role): state.observer for layer, roles in c.states.items()
               for role, state in roles.items()} for c in calibs]
    assert chosen[0] == chosen[1] and set(chosen[0].values()) <= {
        "minmax", "mse", "memoryless_minmax", "memoryless_mse"}


@pytest.mark.parametrize("metric", ["tensor", "joint", "output"])
def test_a_loss_no_metric_calls_is_refused(metric):
    # probing: Auto(metric="tensor", loss=f) calibrated without ever calling f
    with pytest.raises(ValueError, match=rf"Auto\.loss .*metric={metric!r}"):
        Auto(metric=metric, loss=lambda *args: 0.0)


@pytest.mark.parametrize("metric", ["model", "fisher"])
def test_the_metrics_that_call_a_loss_take_one(metric):
    assert Auto(metric=metric, loss=lambda *args: 0.0).metric == metric


def test_options_but_revalidates_the_loss():
    opts = Options(auto=Auto(metric="fisher", loss=lambda out, batch: out.sum()))
    assert opts.but(auto__metric="model").auto.loss is opts.auto.loss
    with pytest.raises(ValueError, match=r"Auto\.loss"):
        opts.but(auto__metric="tensor")


def test_sequential_refuses_the_model_loss_up_front():
    """Auto.loss is called with the model's output, which no piece of a sequential
    calibration has (a block gives its hidden states; the head, on replayed outputs, chooses
    by metric "output"): refused before any forward (probe s34: the blocks called it with
    their output tensors, failing inside the user's code)."""
    from tiny_models import llama

    (model, batches), calls = llama(), []

    def loss(out, ref, batch):
        calls.append(1)
        return float((out.logits - ref.logits).square().mean())

    with pytest.raises(ValueError, match=r"Auto\.loss.*sequential"):
        calibrate(model, batches, "w8a8", observer="auto", progress=False, sequential=True,
                  auto=Auto(candidates=["minmax", "mse"], loss=loss))
    assert not calls


def test_model_metric_still_calls_its_loss():
    model, batches = _mlp()
    calls = []

    def loss(out, ref, batch):
        calls.append(1)
        return float((out - ref).square().mean())

    c = calibrate(model, batches, "w8a8", observer="auto", progress=False,
                  auto=Auto(candidates=["minmax", "mse"], loss=loss))
    assert calls and c.info["auto"]["chose"] in ("minmax", "mse")


@pytest.mark.parametrize(("make", "field", "want"), [
    (lambda: Sampling(tokens=np.int64(5)), "tokens", 5),
    (lambda: Sampling(seed=np.int64(1)), "seed", 1),
    (lambda: Sampling(seed=np.uint64(2**64 - 1)), "seed", 2**64 - 1),
    (lambda: Sampling(budget_mb=np.float32(8.5)), "budget_mb", 8.5),
    (lambda: Sampling(budget_mb=np.int32(8)), "budget_mb", 8),
    (lambda: Auto(score_tokens=np.int16(64)), "score_tokens", 64),
    (lambda: MoE(min_tokens=np.uint8(3)), "min_tokens", 3),
    (lambda: Outliers(smooth=np.float64(0.5)), "smooth", 0.5),
    (lambda: Outliers(smooth=np.float32(0.5)), "smooth", 0.5),
    (lambda: Outliers(keep_float=np.int64(2)), "keep_float", 2),
    (lambda: Sequential(cache_budget_mb=np.float32(0.25)), "cache_budget_mb", 0.25),
])
def test_numpy_scalars_are_taken_as_python_numbers(make, field, want):
    # probing: Sampling(tokens=np.int64(5)) 'must be a positive integer, got np.int64(5)';
    # Outliers(smooth=np.float32(0.5)) refused while np.float64(0.5) passed
    value = getattr(make(), field)
    assert value == want and type(value) is type(want)


@pytest.mark.parametrize(("make", "field"), [
    (lambda: Sampling(tokens=np.int64(0)), r"Sampling\.tokens"),
    (lambda: Sampling(tokens=np.bool_(True)), r"Sampling\.tokens"),
    (lambda: Sampling(tokens=np.float64(5.0)), r"Sampling\.tokens"),
    (lambda: Sampling(budget_mb=np.float32("nan")), r"Sampling\.budget_mb"),
    (lambda: Outliers(smooth=np.float32(1.5)), "alpha"),
    (lambda: Outliers(smooth=True), "alpha"),
    (lambda: Outliers(keep_float=np.int64(-1)), r"Outliers\.keep_float"),
    (lambda: Sequential(cache_budget_mb=np.float64("inf")), r"Sequential\.cache_budget_mb"),
])
def test_numpy_scalars_out_of_range_are_still_refused(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_a_numpy_float_seed_is_not_an_integer():
    with pytest.raises(TypeError, match=r"Sampling\.seed"):
        Sampling(seed=np.float64(1.0))


class _Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x)


def test_missing_error_advises_the_runtime_option():
    # probing: it advised missing='skip', the deprecated flat keyword
    with pytest.raises(ValueError, match=r"pass runtime=Runtime\(missing='skip'\) or "
                                         r"Runtime\(missing='float'\)"):
        calibrate(_Unused(), [torch.randn(2, 8)], "w8a8", progress=False,
                  runtime=Runtime(missing="error"))
    Runtime(missing="skip")  # the advice's spelling is the option's own


def test_choosing_guide_says_what_auto_roles_hold():
    # probing: it called info["auto"]["roles"] 'the observer chosen for weights and inputs';
    # it is the configuration each role came from ('mix' weights run memoryless_minmax)
    text = (ROOT / "docs" / "guide" / "choosing.md").read_text()
    assert "the observer chosen for weights and inputs" not in text
    line = next(x for x in text.splitlines() if 'print(calib.info["auto"]["roles"])' in x)
    assert "configuration" in line
    assert 'calib.states[layer][role].observer' in text
