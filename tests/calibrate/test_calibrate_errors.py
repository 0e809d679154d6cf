"""What a calibration says when it cannot go on (issue 37): a NaN / inf batch names the layer,
the role and the batch; a recipe that cannot apply to the model fails before any forward."""

import pytest
import torch
from torch import nn

from quantscope.calibration import calibrate, calibrate_many, preset


def _mlp(width_in=16, hidden=32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width_in, hidden), nn.ReLU(), nn.Linear(hidden, 8))


@pytest.mark.parametrize("bad_batch", [0, 2, 3])
def test_a_nan_batch_names_layer_role_and_batch(bad_batch):
    batches = [torch.randn(4, 16) for _ in range(4)]
    batches[bad_batch][1, 5] = float("nan")
    with pytest.raises(ValueError) as e:
        calibrate(_mlp(), batches, "w8a8", progress=False)
    msg = str(e.value)
    assert "layer '0' input" in msg and f"calibration batch {bad_batch} " in msg, msg


def test_inf_made_inside_the_model_names_the_layer_it_reached():
    """Finite batches, but the first layer overflows on batch 1: the second layer's input is
    where the observer sees inf, and the message says so."""
    model = _mlp()
    with torch.no_grad():
        model[0].weight.fill_(1.0)
    batches = [torch.randn(4, 16) for _ in range(3)]
    batches[1] = batches[1].abs() * 1e38  # finite; sixteen of them summed are not
    assert all(bool(torch.isfinite(b).all()) for b in batches)
    with pytest.raises(ValueError) as e:
        calibrate(model, batches, "w8a8", progress=False)
    assert "layer '2' input: calibration batch 1 " in str(e.value), str(e.value)


def test_each_observer_of_a_layer_counts_its_own_batches():
    """Two recipes share one pass; both stop at the first batch with NaN, not later."""
    batches = [torch.randn(4, 16) for _ in range(5)]
    batches[3][0, 0] = float("inf")
    with pytest.raises(ValueError, match="calibration batch 3 "):
        calibrate_many(_mlp(), batches, {"a": preset("w8a8"), "b": preset("w8a8", "mse")},
                       progress=False)


class _NoForward(nn.Module):
    """Layers of real shapes whose forward must never run."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(96, 64)
        self.down = nn.Linear(64, 96)

    def forward(self, x):
        raise AssertionError("a forward ran before the recipe was checked against the model")


@pytest.mark.parametrize("options", [{}, {"smooth": 0.5}, {"keep_float": 1},
                                     {"auto_metric": "fisher", "observer": "auto"}])
def test_a_recipe_that_cannot_apply_fails_before_any_forward(options):
    """Group size 128 divides neither 96 nor 64: said before any batch (or SmoothQuant's,
    fisher's, the fallback ranking's forward) runs."""
    recipe = preset("w4a16", **({"observer": options.pop("observer")}
                                if "observer" in options else {}))
    from quantscope.calibration import recipe as R

    recipe = R.with_group_size(recipe, 128)
    with pytest.raises(ValueError, match=r"layer '(up|down)' weight of shape .* cannot take"):
        calibrate(_NoForward(), [torch.randn(2, 96)], recipe, progress=False, **options)


def test_a_static_activation_layout_that_cannot_apply_fails_before_any_forward():
    from dataclasses import replace

    from quantscope.spec import QuantSpec

    recipe = preset("w8a8")
    rules = tuple(replace(r, input=replace(r.input, spec=QuantSpec("int8", "group:128")))
                  for r in recipe.rules)
    with pytest.raises(ValueError, match="layer '(up|down)' input"):
        calibrate(_NoForward(), [torch.randn(2, 96)], replace(recipe, rules=rules),
                  progress=False)


def test_a_ranks_shard_names_the_batch_by_its_place_among_all():
    """Under torchrun a rank forwards batches rank, rank + world, ...: the error names the
    batch the user passed (rank 1 of 2: its third batch is batch 5)."""
    from quantscope.calibration.run.observe import make_plan, observe_batches

    model = _mlp()
    slots, _ = make_plan(model, {"r": preset("w8a8")}, None)
    batches = [torch.randn(4, 16) for _ in range(3)]
    batches[2][0, 0] = float("nan")
    with pytest.raises(ValueError, match="calibration batch 5 "):
        observe_batches(model, batches, slots, 64, False, 0, batch_index=lambda i: 2 * i + 1)
