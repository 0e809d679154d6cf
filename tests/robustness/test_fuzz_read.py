"""Property tests of reading back damaged compressed-tensors folders (issue 37).

A tiny Llama (five presets) and a tiny Mixtral (two) are exported once; each case copies one export and damages it once:
a random change in ``config.json`` (mostly its ``quantization_config``), bytes flipped or
cut off in the safetensors file, one scale element set to NaN / inf / 0 / a negative
value, a tensor dropped, renamed, cast or reshaped. Then both readers run on it:

- ``Calibration.from_compressed_tensors`` either reads it (every qparam finite and > 0, the
  applied model's output finite; an undamaged copy gives the exported model's output) or
  raises a ``ValueError`` naming the folder's file;
- ``check`` either returns its list of problems or raises a ``ValueError`` naming the file.

A scale set to NaN / inf / <= 0 must never be read silently, and ``check`` must name it.
Anything else (a bare ``KeyError``, ``AttributeError``, ``RuntimeError`` ...) fails the
property. Profiles and counts: fuzzing.py (``make fuzz`` writes them to runs/).
"""

import json
import math
import os
import shutil
import tempfile
import warnings

import pytest
import torch
from fuzzing import FUZZ, count, mutate_json, start
from hypothesis import given
from hypothesis import strategies as st

from quantscope.calibration import Calibration, calibrate

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
from safetensors.torch import load_file, save_file

from quantscope.exporters import check
from quantscope.exporters.read_checks import SCALE_LEAVES

#: (model, preset) exported once each: a tiny Llama, and a tiny Mixtral whose 3-D experts
#: are written per expert and joined back on reading
EXPORTS = [("llama", p) for p in ("w8a8", "w4a16-asym", "fp8", "nvfp4", "w8a8-dynamic")] + \
    [("mixtral", "w8a8"), ("mixtral", "nvfp4")]
DAMAGES = ["config", "quant_config", "bytes", "truncate", "scale_value", "drop", "rename",
           "cast", "reshape", "none"]
BAD_SCALES = [math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0, -1e-3]
#: a read (or check) may refuse a damaged folder with these only
READ_ERRORS = (ValueError,)
_EXPORTS: dict = {}


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64,
                                   max_position_embeddings=32, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).eval()
    return model, [torch.randint(0, 64, (2, 8)) for _ in range(2)]


def _exports():
    """Per (model, preset): the float model, one batch, the export folder and the output of
    the calibration applied."""
    if not _EXPORTS:
        from tiny_models import mixtral

        root = tempfile.mkdtemp(prefix="quantscope-fuzz-read-")
        models = {"llama": _llama(), "mixtral": mixtral()}
        for name, preset in EXPORTS:
            model, batches = models[name]
            calib = calibrate(model, batches, preset, progress=False)
            folder = os.path.join(root, f"{name}-{preset}")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                calib.export(model, folder)
            _EXPORTS[name, preset] = {"model": model, "batch": batches[0], "folder": folder,
                                      "output": _run(calib, model, batches[0])}
    return _EXPORTS


def _run(calib, model, batch):
    with torch.inference_mode(), calib.apply(model):
        return model(batch).logits


def _tensor_file(case):
    (name,) = [f for f in os.listdir(case) if f.endswith(".safetensors")]
    return os.path.join(case, name)


def _damage_json(case, draw, quant_only):
    path = os.path.join(case, "config.json")
    with open(path) as f:
        config = json.load(f)
    if quant_only:
        config["quantization_config"] = mutate_json(config["quantization_config"], draw)
    else:
        config = mutate_json(config, draw)
    with open(path, "w") as f:
        json.dump(config, f)


def _damage_bytes(case, draw, truncate):
    path = _tensor_file(case)
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    if truncate:
        raw = raw[:draw(st.integers(0, len(raw) - 1))]
    else:  # a few bytes, header or data
        for _ in range(draw(st.integers(1, 4))):
            raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
    with open(path, "wb") as f:
        f.write(bytes(raw))


def _damage_tensors(case, kind, draw):
    """One tensor changed; returns the name of a scale set to a bad value (else None)."""
    path = _tensor_file(case)
    tensors = load_file(path)
    scales = sorted(k for k in tensors if k.rpartition(".")[2] in SCALE_LEAVES)
    name = draw(st.sampled_from(scales if kind == "scale_value" else sorted(tensors)))
    t = tensors[name]
    bad = None
    if kind == "scale_value":
        t, i = t.clone(), draw(st.integers(0, t.numel() - 1))
        t.view(-1)[i] = draw(st.sampled_from(BAD_SCALES))
        stored = float(t.view(-1)[i].float())  # FP8 saturates inf to 448: not a bad scale
        tensors[name], bad = t, (name if not math.isfinite(stored) or stored <= 0 else None)
    elif kind == "drop":
        tensors.pop(name)
    elif kind == "rename":
        tensors[name + draw(st.sampled_from(["_x", ".extra", "e"]))] = tensors.pop(name)
    elif kind == "cast":
        tensors[name] = t.to(draw(st.sampled_from([torch.int8, torch.int32, torch.float16,
                                                   torch.bfloat16, torch.float64, torch.bool])))
    else:  # reshape: one value more or fewer, or the same values in another shape
        how = draw(st.sampled_from(["flat", "more", "fewer", "extra_dim"]))
        flat = t.reshape(-1)
        tensors[name] = {"flat": flat, "more": torch.cat([flat, flat[:1]]),
                         "fewer": flat[:-1], "extra_dim": t.unsqueeze(0)}[how].contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    return bad


def _check_qparams(calib):
    for layer, roles in calib.states.items():
        for role, state in roles.items():
            qp = state.qparams
            if qp is None:
                continue
            for what, t in (("scale", qp.scale), ("global_scale", qp.global_scale)):
                if t is not None:
                    t = t.float()
                    assert bool(torch.isfinite(t).all() and (t > 0).all()), \
                        f"read {layer}.{role} {what} {t}"


def _names_file(e, case):
    msg = str(e)
    return case in msg or "config.json" in msg or ".safetensors" in msg


@FUZZ
@given(export=st.sampled_from(EXPORTS), damage=st.sampled_from(DAMAGES), data=st.data())
def test_read_damaged_folder(export, damage, data):
    ex = _exports()[export]
    path = tempfile.mkdtemp(prefix="quantscope-fuzz-read-case-")
    try:
        case = os.path.join(path, "ct")
        shutil.copytree(ex["folder"], case)
        bad = None
        if damage in ("config", "quant_config"):
            _damage_json(case, data.draw, damage == "quant_config")
        elif damage in ("bytes", "truncate"):
            _damage_bytes(case, data.draw, damage == "truncate")
        elif damage != "none":
            bad = _damage_tensors(case, damage, data.draw)
        start("read_damaged_folder")  # after the last draw
        _read_case(ex, damage, case, bad)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _read_case(ex, damage, case, bad):
    try:
        problems = check(case)
    except READ_ERRORS as e:
        assert _names_file(e, case), f"check: unclear {type(e).__name__}: {e}"
    else:
        assert bad is None or any(bad == p["tensor"] for p in problems), \
            f"check: the bad scale {bad} is not reported: {problems}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            calib = Calibration.from_compressed_tensors(case)
            out = _run(calib, ex["model"], ex["batch"])
    except READ_ERRORS as e:
        assert damage != "none", f"an undamaged export was refused: {e}"
        assert _names_file(e, case), f"read: unclear {type(e).__name__}: {e}"
        count("read_damaged_folder", "clear_errors")
        return
    assert bad is None, f"the bad scale {bad} was read without a word"
    _check_qparams(calib)
    assert bool(torch.isfinite(out).all()), f"{damage}: a damaged folder read and gave NaN / inf"
    if damage == "none":
        assert torch.equal(out, ex["output"]), "an undamaged export read back differently"
    count("read_damaged_folder", "ok")

