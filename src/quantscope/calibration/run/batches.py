"""How a calibration batch is fed to a model: the one rule every pass (calibration, fusion
detection, auto's scoring, sensitivity) uses."""

from __future__ import annotations

__all__ = ["forward_batch"]


def forward_batch(model, batch):
    """``model(**batch)`` for a dict (a tokenizer's output), ``model(*batch)`` for a tuple or
    list, ``model(batch)`` otherwise."""
    if isinstance(batch, dict) or hasattr(batch, "keys"):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)
