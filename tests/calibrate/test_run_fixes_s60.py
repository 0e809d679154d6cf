"""Defects of probe s60 in the calibration pass:

- a float64 model whose activations hold a finite value past float32's range, under a role
  computed at run time (no observer to refuse it), crashed in the report's histogram with
  torch's bare ``histc`` error; a static role refused it by name;
- in a fusion group (q and k read one input), a NaN batch under k's run-time role, whose
  ``non_finite`` is "error", was reported as q's, whose role reads NaN as zero: the message
  told the user to set the option q already has."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import SharedInput
from torch import nn

import quantscope
from quantscope.calibration import Recipe, preset


@pytest.mark.parametrize("recipe", ["w8a8", "w8a8-dynamic"])
def test_float64_values_past_float32_are_refused_by_name_for_run_time_roles_too(recipe):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8)).double()
    x = torch.randn(8, 16, dtype=torch.float64)
    x[5, 3] = 1e39
    with pytest.raises(ValueError, match=r"^calibrate: layer '0' input: .*float64 values beyond "
                                         r"float32's range \(\|x\| > 3.4e38\) are not "
                                         r"supported .*got max \|x\| = 1e\+39$"):
        quantscope.calibrate(model, [x], recipe, progress=False)


@pytest.mark.parametrize("raising", ["q", "k"])
def test_a_nan_batch_names_the_group_member_whose_run_time_role_raises(raising):
    (ignore,) = preset("w8a8-dynamic", non_finite="ignore").rules
    (error,) = preset("w8a8-dynamic").rules
    other = "k" if raising == "q" else "q"
    recipe = Recipe((dataclasses.replace(error, targets=(raising,)),
                     dataclasses.replace(ignore, targets=(other,))))
    torch.manual_seed(0)
    batches = [torch.randn(4, 8) for _ in range(2)]
    batches[1][2, 3] = float("nan")
    with pytest.raises(ValueError, match=rf"^calibrate: layer '{raising}' input: calibration "
                                         rf"batch 1 \(counting from 0\) brought NaN or inf"):
        quantscope.calibrate(SharedInput(8, 8), batches, recipe, progress=False)
