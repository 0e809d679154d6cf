"""Check a compressed-tensors checkpoint against the runtime's fusion rules.

vLLM loads ``q_proj`` / ``k_proj`` / ``v_proj`` into one ``qkv_proj``, ``gate_proj`` /
``up_proj`` (and an expert's ``w1`` / ``w3``) into one ``gate_up_proj`` / ``w13``, and
DeepSeek's ``q_a_proj`` / ``kv_a_proj_with_mqa`` into one ``fused_qkv_a_proj``. The fused
layer keeps **one** of each per-tensor scale: the largest NVFP4 ``weight_global_scale``
and ``input_global_scale``, the largest static ``input_scale``, and for FP8 per-tensor
weights the largest ``weight_scale`` (the other shards are re-quantized to it). Where the
shards' values differ, the served model is not the model that was evaluated.

:func:`check` reads ``config.json`` (its ``quantization_config``) and the safetensors
files of any compressed-tensors checkpoint -- quantscope's or another toolkit's -- and
returns the fused groups whose shards disagree, plus any scale that is NaN or inf.
Only the scale tensors are read.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

__all__ = ["FUSED", "check", "format_problems"]

#: the runtime's fused layers: fused name -> the shard names it concatenates
FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "w13": ("w1", "w3"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
}

#: per-tensor scales a fused layer holds once; weight_scale only where the runtime
#: re-quantizes shards to one scale (float8 weights: vLLM's FP8 path), not int8 (widened)
SHARED = ("weight_global_scale", "input_global_scale", "input_scale", "weight_scale")
_FLOAT8 = {"F8_E4M3", "F8_E5M2"}


def _tensors(folder: Path) -> dict[str, tuple[Path, str, list[int]]]:
    """name -> (file, safetensors dtype, shape) for every tensor of the checkpoint."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                out[name] = (f, meta["dtype"], meta["shape"])
    return out


def _read(entries, name) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(entries[name][0]), framework="pt") as f:
        return f.get_tensor(name).float()


def check(path) -> list[dict]:
    """The problems of the compressed-tensors checkpoint at ``path`` (empty: consistent).

    Each problem is ``{"group": fused layer name, "layers": [shard layers], "tensor":
    scale name, "values": {layer: value}}`` for shards that disagree, or ``{"tensor":
    name, "values": {...}, "non_finite": True}`` for a NaN / inf scale.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"check: {str(path)!r} is not a directory")
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"check: {str(path)!r} has no config.json")
    qcfg = json.loads(cfg_file.read_text()).get("quantization_config")
    if not isinstance(qcfg, dict) or qcfg.get("quant_method") != "compressed-tensors":
        method = qcfg.get("quant_method") if isinstance(qcfg, dict) else None
        raise ValueError(f"check: {cfg_file} has no compressed-tensors quantization_config "
                         f"(quant_method {method!r})")
    entries = _tensors(folder)
    if not entries:
        raise FileNotFoundError(f"check: {str(path)!r} holds no .safetensors files")
    problems = []
    shard_of = {s: (fused, s) for fused, shards in FUSED.items() for s in shards}
    groups: dict[tuple[str, str], dict[str, str]] = {}  # (parent, fused) -> {shard: layer}
    for name in entries:
        layer, _, leaf = name.rpartition(".")
        if leaf not in SHARED:
            continue
        values = _read(entries, name) if math.prod(entries[name][2] or [1]) == 1 else None
        if values is not None and not torch.isfinite(values).all():
            problems.append({"tensor": name, "values": {layer: float(values.reshape(-1)[0])},
                             "non_finite": True})
        parent, _, shard = layer.rpartition(".")
        if shard in shard_of:
            groups.setdefault((parent, shard_of[shard][0]), {})[shard] = layer
    for (parent, fused), shards in sorted(groups.items()):
        layers = [shards[s] for s in FUSED[fused] if s in shards]
        if len(layers) < 2:
            continue
        for leaf in SHARED:
            names = [f"{layer}.{leaf}" for layer in layers]
            if not all(n in entries for n in names):
                continue
            if any(math.prod(entries[n][2] or [1]) != 1 for n in names):
                continue  # per-channel / group scales: each shard keeps its own rows
            if leaf == "weight_scale" and not all(
                    entries.get(f"{layer}.weight", (None, None))[1] in _FLOAT8
                    for layer in layers):
                continue  # int8 per-tensor weight scales are widened per channel by vLLM
            vals = {layer: float(_read(entries, n).reshape(-1)[0])
                    for layer, n in zip(layers, names)}
            finite = [v for v in vals.values() if math.isfinite(v)]
            if len(set(vals.values())) > 1 and finite:
                problems.append({"group": f"{parent}.{fused}" if parent else fused,
                                 "layers": layers, "tensor": leaf, "values": vals})
    return problems


def format_problems(problems: list[dict]) -> str:
    """One line per problem, naming the layers and their values."""
    lines = []
    for p in problems:
        vals = ", ".join(f"{k}={v:.9g}" for k, v in p["values"].items())
        if p.get("non_finite"):
            lines.append(f"{p['tensor']}: not finite ({vals})")
        else:
            lines.append(f"{p['group']}: {p['tensor']} differs across the fused shards: {vals}")
    return "\n".join(lines)

