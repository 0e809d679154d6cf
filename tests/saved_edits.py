"""Editing a saved calibration folder in place, as a user or an attacker might: the tests of
what ``quantscope.load`` refuses."""

import json
import os


def edit_saved(path, meta=None, tensors=None) -> None:
    """``meta(d)`` edits ``quantscope.json``'s dict, ``tensors(t)`` the dict of
    ``qparams.safetensors`` (both in place, then written back)."""
    if meta is not None:
        p = os.path.join(path, "quantscope.json")
        with open(p) as f:
            d = json.load(f)
        meta(d)
        with open(p, "w") as f:
            json.dump(d, f)
    if tensors is not None:
        from safetensors.torch import load_file, save_file

        p = os.path.join(path, "qparams.safetensors")
        t = load_file(p)
        tensors(t)
        save_file(t, p)
