"""Compressed-tensors folders for the reader's tests: a tiny Llama's KV-cache-only export, and
a copy of an export with its tensors or its ``quantization_config`` edited (damage to read)."""

import json
import shutil


def kv_only_export(out):
    """A tiny Llama's KV-cache-only fp8 export (every attention's k_scale / v_scale) at
    ``out``."""
    from tiny_models import llama

    from quantscope.calibration import Recipe, calibrate

    model, batches = llama()
    calibrate(model, batches, Recipe((), kv_cache="fp8"), progress=False).export(model, out)
    return out


def edited(src, dst, tensors=None, config=None):
    """A copy of the export ``src`` at ``dst``: ``tensors(dict)`` edits its (one) safetensors
    file's tensors in place, ``config(dict)`` its ``quantization_config``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    (f,) = dst.glob("*.safetensors")
    if tensors:
        t = load_file(f)
        tensors(t)
        save_file(t, f, metadata={"format": "pt"})
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg["quantization_config"])
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst
