"""A calibration applied to its model after a later SmoothQuant calibration smoothed that model
in place (review s43): the fingerprint refusal named re-saving, fine-tuning or another
checkpoint, and suggested without_fingerprints(), which would put unsmoothed scales on smoothed
weights. The message now names the smoothing too, and says the override is for weights not
smoothed since; it stays within the command line's 500 characters."""

import pytest
import torch

from quantscope.calibration import Outliers, calibrate

pytest.importorskip("transformers")
from tiny_models import llama

torch.set_num_threads(1)


def test_the_refusal_names_a_later_smoothing_in_place():
    model, batches = llama()
    plain = calibrate(model, batches, "w8a8", progress=False)
    calibrate(model, batches, "w8a8", outliers=Outliers(smooth=0.5), progress=False)
    with pytest.raises(ValueError) as e:
        plain.apply(model)
    said = str(e.value)
    assert said.startswith("apply: model.layers.0.") and "is not the weight calibrated" in said
    assert ("smoothed in place by a later calibrate(outliers=Outliers(smooth=...)) since"
            in said)
    assert "on weights not smoothed since: calibration.without_fingerprints()" in said
    assert len(said) <= 500
