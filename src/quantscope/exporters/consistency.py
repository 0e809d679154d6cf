"""Check a compressed-tensors checkpoint against the runtime's fusion rules.

vLLM loads ``q_proj`` / ``k_proj`` / ``v_proj`` into one ``qkv_proj`` (a cross-attention's
``k_proj`` / ``v_proj`` into one ``kv_proj``, its ``q_proj`` apart), ``gate_proj`` /
``up_proj`` (and an expert's ``w1`` / ``w3``) into one ``gate_up_proj`` / ``w13``, and
DeepSeek's ``q_a_proj`` / ``kv_a_proj_with_mqa`` into one ``fused_qkv_a_proj``. The fused
layer keeps **one** of each per-tensor scale: the largest NVFP4 ``weight_global_scale``
and ``input_global_scale``, the largest static ``input_scale``, and for FP8 per-tensor
weights the largest ``weight_scale`` (the other shards are re-quantized to it). Where the
shards' values differ, the served model is not the model that was evaluated. A fused MoE
layer also keeps one input scale for all its experts' ``w13`` and one for their ``w2``
(vLLM's FP8 MoE: ``input_scale.max()``; its FlashInfer NVFP4 MoE: one
``input_global_scale``), so the experts of one module must agree on those too.

:func:`check` reads ``config.json`` (its ``quantization_config``) and the safetensors
files of any compressed-tensors checkpoint -- quantscope's or another toolkit's -- and
returns the fused groups (and experts modules) whose shards disagree (in a shared scale's
value, or in holding it at all: shards of different schemes), plus any scale that is NaN,
inf or <= 0 (per-channel and group scales too) and any zero point that is no integer of its
format (:mod:`.value_checks`), the fused groups whose shards are in config
groups of different schemes (vLLM gives the fused layer one scheme, its first shard's), and
the fused layers whose fp8 weight blocks would straddle two shards (vLLM's fp8 block layer
needs every shard but the last to hold whole blocks of rows), and the config groups vLLM has no
scheme for, whose experts its fused MoE layer refuses, or that quantize a
``shared_expert_gate`` (:mod:`.serving`). Only the scale and zero point tensors are read
(and the headers).
"""

from __future__ import annotations

import importlib.util
import json
import math
import warnings
from pathlib import Path

from .._checks import check_path
from .._plainchecks import block_structure
from .moe_slots import expert_slot
from .read_checks import (
    kv_scheme_problem,
    parse_quant_config,
    read_quant_config,
    safetensors_headers,
)
from .serving import describe, quantized, resolver, scheme_args, unservable
from .value_checks import read_tensor, scale_problems, zero_point_problems

__all__ = ["FUSED", "block_problems", "check", "format_problems", "split_problems",
           "warn_fused_problems"]

#: the runtime's fused layers: fused name -> the shard names it concatenates
FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "w13": ("w1", "w3"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
}

#: cross-attention modules (transformers' names for a decoder's attention over the encoder's
#: output: Whisper's and BART's encoder_attn, T5Gemma's and Mllama's cross_attn,
#: SeamlessM4T's cross_attention): vLLM fuses their keys and values only, as its queries
#: read the decoder's states (whisper.py's q_proj beside kv_proj)
CROSS_ATTENTION = ("encoder_attn", "cross_attn", "cross_attention")
CROSS_FUSED = {"kv_proj": ("k_proj", "v_proj")}
#: every fused layer's shards, in the runtime's order
_SHARDS = {**FUSED, **CROSS_FUSED}

#: input scales a fused MoE layer holds once for all its experts (per w13, per w2)
EXPERT_SHARED = ("input_scale", "input_global_scale")

#: per-tensor scales a fused layer holds once; weight_scale only where the runtime
#: re-quantizes shards to one scale (float8 weights: vLLM's FP8 path), not int8 (widened)
SHARED = ("weight_global_scale", "input_global_scale", "input_scale", "weight_scale")
_FLOAT8 = {"F8_E4M3", "F8_E5M2"}


def _group_rows(qc: dict):
    """``(name, group)`` of each config group with a list of targets."""
    groups = qc.get("config_groups")
    return [(str(name), group) for name, group in
            (groups.items() if isinstance(groups, dict) else ())
            if isinstance(group, dict) and isinstance(group.get("targets"), list)]


def _per_layer(qc: dict, pick):
    """``layer -> pick(weights)`` of the config group that quantizes the layer
    (:func:`.serving.resolver`); None where the config cannot tell."""
    resolve = resolver([(str(t), pick(group["weights"])) for _, group in _group_rows(qc)
                        if isinstance(group.get("weights"), dict) for t in group["targets"]])

    def of(layer: str):
        found = resolve(layer)
        return found.pop() if len(found) == 1 else None
    return of


def _weight_strategies(qc: dict):
    """``layer -> strategy`` of its weights, as compressed-tensors reads it (an absent one
    inferred: :func:`.serving.scheme_args`; :func:`_per_layer`)."""
    return _per_layer(qc, lambda w: scheme_args(w)["strategy"])


def _block_rows(weights: dict) -> int | None:
    """The rows of a block-strategy weight's blocks (its ``block_structure``, either form),
    else None."""
    args = scheme_args(weights)
    if args["strategy"] != "block":
        return None
    try:
        return block_structure("check", args["block_structure"])[0]
    except ValueError:
        return None


def _schemes(qc: dict):
    """``layer -> (scheme, config group)``: the args vLLM picks a layer's scheme from (the
    :data:`~.serving.SCHEME_FIELDS` of the weights and input activations, and the format) of
    the group that selects it; None where none or several do."""
    key = {name: json.dumps([scheme_args(group.get("weights")),
                             scheme_args(group.get("input_activations")),
                             group.get("format") or qc.get("format")], sort_keys=True)
           for name, group in _group_rows(qc)}
    resolve = resolver([(str(t), name) for name, group in _group_rows(qc)
                         for t in group["targets"]])

    def of(layer: str):
        names = sorted(resolve(layer))
        return (key[names[0]], names[0]) if len({key[n] for n in names}) == 1 else None
    return of


def _scheme_problem(group: str, layers: list[str], scheme) -> dict | None:
    """The fused ``group`` whose shards resolve to config groups of different schemes: vLLM
    gives the fused layer one scheme, the first shard's target's (``_match_fused_layer``
    in its compressed_tensors/utils.py), and the other shards' tensors do not load into it."""
    found = {layer: scheme(layer) for layer in layers}
    if None in found.values() or len({k for k, _ in found.values()}) < 2:
        return None
    return {"group": group, "layers": layers, "tensor": "scheme", "values": {},
            "schemes": {layer: name for layer, (_, name) in found.items()}}


def _block_problem(group: str, layers: list[str], entries, block_rows_of) -> dict | None:
    """The fused ``group`` whose shards but the last do not hold whole blocks of rows of the
    fp8 block scheme vLLM serves it with (its first shard's). CompressedTensorsW8A8Fp8's
    ``create_weights`` calls ``validate_fp8_block_shape`` (quantization/utils/fp8_utils.py),
    which raises where a merged layer's output partition but the last is not a multiple of
    ``block_n`` (at tensor parallelism 1; its fused MoE needs gate's and up's rows, which are
    equal, to be too)."""
    n = block_rows_of(layers[0])
    shapes = {layer: entries.get(f"{layer}.weight", (None, None, None))[2]
              for layer in layers[:-1]}
    rows = {layer: shape[0] for layer, shape in shapes.items()
            if n and isinstance(shape, list) and len(shape) == 2 and shape[0] % n}
    if not rows:
        return None
    return {"group": group, "layers": layers, "tensor": "weight", "values": {},
            "block_rows": n, "rows": rows}


def block_problems(qc: dict, entries) -> list[dict]:
    """:func:`_block_problem` of every fused layer of the checkpoint (its tensors' ``entries``,
    :func:`~.read_checks.safetensors_headers`) whose shards are all quantized."""
    block_rows_of = _per_layer(qc, _block_rows)
    return [p for group, every, layers in _fused(entries) if len(layers) == len(every) > 1
            and (p := _block_problem(group, layers, entries, block_rows_of))]


def _split_problem(group: str, every: list[str], layers: list[str]) -> dict | None:
    """The fused ``group`` (its shards ``every``) of which only some shards (``layers``) are
    quantized, as an ignore list that holds some of them leaves it: vLLM gives the fused layer
    one scheme and refuses the checkpoint."""
    if not layers or len(layers) == len(every):
        return None
    return {"group": group, "layers": every, "tensor": "weight", "values": {},
            "float": [x for x in every if x not in layers]}


def split_problems(entries) -> list[dict]:
    """:func:`_split_problem` of every fused layer of the checkpoint (its tensors' ``entries``,
    :func:`~.read_checks.safetensors_headers`), then :func:`_expert_splits`."""
    return [p for group, every, layers in _fused(entries)
            if (p := _split_problem(group, every, layers))] + _expert_splits(entries)


def _expert_slots(entries) -> dict[tuple[str, str], list[str]]:
    """``(experts module, w13 / down shard) -> its experts' layers`` (float ones too)."""
    slots: dict[tuple[str, str], set[str]] = {}
    for name in entries:
        slot = expert_slot(name.rpartition(".")[0])
        if slot is not None:
            slots.setdefault(slot, set()).add(name.rpartition(".")[0])
    return {slot: sorted(layers) for slot, layers in sorted(slots.items())}


def _expert_splits(entries) -> list[dict]:
    """The experts modules whose experts are quantized in a slot but some (an ignore list's,
    ``float``) not: the fused MoE layer runs one scheme for all its experts (transformers
    loads the float experts' weights into the quantized layer's wrong, without a word)."""
    return [{"group": module, "layers": layers, "tensor": "weight", "values": {},
             "float": floats, "experts": slot}
            for (module, slot), layers in _expert_slots(entries).items()
            if 0 < len(floats := [x for x in layers if not quantized(entries, x)]) < len(layers)]


def warn_fused_problems(folder) -> None:
    """One warning (the first fused layer and how many more) for :func:`split_problems` and
    one for :func:`block_problems` in ``folder``; the export writes the folder all the same
    (transformers and compressed-tensors load a fused layer's split, vLLM does not; an
    experts module's, transformers loads wrong)."""
    _, _, qc = read_quant_config(folder, "export compressed-tensors")
    entries = safetensors_headers(folder, "export compressed-tensors")
    for found in (split_problems(entries), block_problems(qc, entries)):
        if found:
            more = f" (and {len(found) - 1} more fused layers)" if len(found) > 1 else ""
            loads = "" if found[0].get("experts") else \
                "; transformers and compressed-tensors load it"
            warnings.warn(f"export compressed-tensors: {format_problems(found[:1])}{more}"
                          f"{loads}", stacklevel=3)


def _held_once(leaf: str, layers, entries, strategy) -> bool:
    """Whether the fused layer holds one ``leaf`` for its shards. A weight scale only of
    float8 per-tensor weights (vLLM re-quantizes those shards to the largest; block and
    channel scales stay each shard's own, a one-block shard's [1, 1] too; int8 per-tensor
    scales are widened per channel); another scale where it is one value."""
    if leaf == "weight_scale":
        if not all(entries.get(f"{layer}.weight", (None, None))[1] in _FLOAT8
                   for layer in layers):
            return False
        known = {strategy(layer) for layer in layers}
        if None not in known:  # the config says; else the scale's size tells
            return known == {"tensor"}
    return all(math.prod(entries[f"{layer}.{leaf}"][2] or [1]) == 1 for layer in layers)


def _fused(entries):
    """``(fused layer, its shard layers in the runtime's order, those quantized)`` of every
    fused layer of the checkpoint (:func:`_fused_groups`), by name."""
    for (parent, fused), shards in sorted(_fused_groups(entries).items()):
        every = [shards[s] for s in _SHARDS[fused] if s in shards]
        yield (f"{parent}.{fused}" if parent else fused, every,
               [layer for layer in every if quantized(entries, layer)])


def _fused_groups(entries) -> dict[tuple[str, str], dict[str, str]]:
    """``(parent, fused name) -> {shard: layer}`` of every fused shard the checkpoint
    holds, float ones too (a layer of the ignore list, without scales): vLLM fuses it all
    the same."""
    shard_of = {s: fused for fused, shards in FUSED.items() for s in shards}
    groups: dict[tuple[str, str], dict[str, str]] = {}
    for name in entries:
        layer, _, leaf = name.rpartition(".")
        parent, _, shard = layer.rpartition(".")
        if shard in shard_of and leaf in ("weight", "weight_packed", *SHARED):
            fused = shard_of[shard]
            if fused == "qkv_proj" and parent.rpartition(".")[2] in CROSS_ATTENTION:
                if shard == "q_proj":
                    continue  # (a layer of its own there)
                fused = "kv_proj"
            groups.setdefault((parent, fused), {})[shard] = layer
    return groups


def _expert_problems(entries) -> list[dict]:
    """The experts modules whose experts disagree on an input scale the fused MoE layer
    holds once (:data:`EXPERT_SHARED`), one problem per module, slot and scale: some experts
    hold it and others not (``held_by``: their schemes differ), or its values differ."""
    problems = []
    for (module, slot), layers in _expert_slots(entries).items():
        for leaf in EXPERT_SHARED:
            held = [layer for layer in layers if f"{layer}.{leaf}" in entries]
            if held and len(held) < len(layers):  # static on some, dynamic / float on others
                problems.append({"group": module, "layers": layers, "tensor": leaf,
                                 "values": {}, "held_by": held, "experts": slot})
            vals = {layer: float(read_tensor(entries, f"{layer}.{leaf}").reshape(-1)[0])
                    for layer in held
                    if math.prod(entries[f"{layer}.{leaf}"][2] or [1]) == 1}
            finite = [v for v in vals.values() if math.isfinite(v)]
            if len(set(finite)) > 1:
                problems.append({"group": module, "layers": list(vals), "tensor": leaf,
                                 "values": vals, "experts": slot})
    return problems


def check(path) -> list[dict]:
    """The problems of the compressed-tensors checkpoint at ``path`` (empty: consistent).

    Each problem is ``{"group": fused layer name, "layers": [shard layers], "tensor":
    scale name, "values": {layer: value}}`` for shards that disagree (with ``"held_by":
    [layers]`` where only some shards hold the scale: their schemes differ), or
    ``{"tensor": name, "values": {...}, "non_finite": True}`` for a NaN / inf scale,
    ``{"tensor": name, "values": {}, "zero_point": True, "why": why}`` for a zero point that
    is no integer of its format (checked where compressed-tensors is installed),
    ``{"group": "kv_cache_scheme", "tensor": "config", "kv": why}`` for a KV cache scheme the
    export never writes and the reader refuses (``read_checks.KV_SCHEME``: vLLM would run its
    scales as fp8 ones; checked where compressed-tensors is installed), and
    ``{"group": experts module, "experts": "w13" or the down shard, ...}`` for experts that
    disagree on an input scale the fused MoE layer holds once (``"held_by"`` where only some
    experts hold it), and ``{"group": ..., "layers": [shards], "tensor": "weight", "float":
    [layers]}`` for a fused layer whose shards are partly quantized (an ignore list that holds
    some of them; with ``"experts"``: an experts module's slot whose experts are), and
    ``{"group": ..., "layers": [shards], "tensor": "scheme", "schemes": {layer: config
    group}}`` for a fused layer whose shards are in config groups of different
    schemes (the weights' or input activations' fields vLLM reads, :data:`~.serving.
    SCHEME_FIELDS`, or the format: vLLM serves the fused layer with the first shard's), and
    ``{"group": ..., "layers": [shards], "tensor": "weight", "block_rows": n, "rows": {layer:
    rows}}`` for a fused layer of fp8 weight blocks of ``n`` rows whose shards but the last
    (``rows``) are not multiples of ``n`` (:func:`_block_problem`), and
    ``{"group": config group, "layers": [its targets], "tensor": "config", "vllm": why}`` for
    a config group vLLM has no scheme for (:func:`~quantscope.exporters.serving.vllm_refusal`),
    whose experts its fused MoE layer refuses (``vllm_moe_refusal``) or that quantizes a
    ``shared_expert_gate`` (``why`` names the layers).
    """
    folder = Path(check_path("check", path))
    if not folder.is_dir():
        raise FileNotFoundError(f"check: {str(path)!r} is not a directory")
    cfg_file, _, qc = read_quant_config(folder, "check")
    problems, parsed = [], None
    if importlib.util.find_spec("compressed_tensors") is not None:  # optional (peers extra)
        # the fields from_compressed_tensors reads; the KV cache scheme it and the export take
        parsed = parse_quant_config(cfg_file, qc, "check")
        kv = parsed.kv_cache_scheme
        if kv is not None and (why := kv_scheme_problem(kv)):
            problems.append({"group": "kv_cache_scheme", "layers": [], "tensor": "config",
                             "values": {}, "kv": f"{cfg_file}: quantization_config."
                                                 f"kv_cache_scheme.{why}"})
    entries = safetensors_headers(folder, "check")
    if not any(folder.glob("*.safetensors")):
        raise FileNotFoundError(f"check: {str(path)!r} holds no .safetensors files")
    if not entries:
        raise ValueError(f"check: the .safetensors files of {str(path)!r} hold no tensor")
    strategy, scheme = _weight_strategies(qc), _schemes(qc)
    problems += [{"group": name, "layers": targets, "tensor": "config", "values": {},
                  "vllm": why} for name, targets, why in unservable(qc, entries)]
    problems += scale_problems(entries)
    problems += [] if parsed is None else zero_point_problems(parsed, entries)
    problems += block_problems(qc, entries)
    for group, every, layers in _fused(entries):
        if split := _split_problem(group, every, layers):  # the ignore list split it
            problems.append(split)
        if len(layers) < 2:
            continue
        if mixed := _scheme_problem(group, layers, scheme):
            problems.append(mixed)
        for leaf in SHARED:
            names = [f"{layer}.{leaf}" for layer in layers]
            held = [layer for layer, n in zip(layers, names) if n in entries]
            if held and len(held) < len(layers):  # the shards' schemes differ (static input
                # on some, dynamic or none on others): the fused layer serves one of them
                problems.append({"group": group, "layers": layers, "tensor": leaf,
                                 "values": {}, "held_by": held})
            if len(held) < len(layers) or not _held_once(leaf, layers, entries, strategy):
                continue
            vals = {layer: float(read_tensor(entries, n).reshape(-1)[0])
                    for layer, n in zip(layers, names)}
            finite = [v for v in vals.values() if math.isfinite(v)]
            if len(set(vals.values())) > 1 and finite:
                problems.append({"group": group, "layers": layers, "tensor": leaf,
                                 "values": vals})
    return problems + _expert_splits(entries) + _expert_problems(entries)


def _expert_split_line(p: dict) -> str:
    """:func:`format_problems`' line of an experts module's split (:func:`_expert_splits`)."""
    cut = len(p["group"]) + 1  # the experts' layers, relative to their module
    floats = [layer[cut:] for layer in p["float"]]
    quantized = {layer[cut:].partition(".")[0] for layer in p["layers"]
                 if layer not in p["float"]}  # (w13: gate and up of each expert)
    return (f"{p['group']}: the experts' {p['experts']} weights are quantized in "
            f"{len(quantized)} experts but float in {', '.join(floats[:4])}"
            f"{' ...' if len(floats) > 4 else ''}: the fused MoE layer runs one scheme for all "
            f"its experts (transformers loads the float experts' weights wrong, without a "
            f"word); quantize every expert or none")


def format_problems(problems: list[dict]) -> str:
    """One line per problem, naming the layers and their values."""
    lines = []
    for p in problems:
        vals = ", ".join(f"{k}={v:.9g}" for k, v in p["values"].items())
        if p.get("kv"):
            lines.append(p["kv"])
        elif p.get("vllm"):
            lines.append(f"{describe(p['group'], p['layers'])}: {p['vllm']}")
        elif p.get("block_rows"):
            rows = ", ".join(f"{k} has {v}" for k, v in p["rows"].items())
            lines.append(f"{p['group']}: fp8 weight blocks of {p['block_rows']} rows, but "
                         f"{rows} output rows: vLLM's fp8 block layer needs every shard of a "
                         f"fused layer but the last to hold whole blocks of rows "
                         f"(validate_fp8_block_shape raises at load) -- use blocks whose rows "
                         f"divide the shards', or per-channel fp8 weights (fp8-dynamic)")
        elif p.get("schemes"):
            shards = ", ".join(f"{k} in {v!r}" for k, v in p["schemes"].items())
            lines.append(f"{p['group']}: the fused shards are in config groups of different "
                         f"schemes ({shards}): vLLM serves the fused layer with one scheme "
                         f"(the first shard's) and cannot load the others; put the shards in "
                         f"one config group")
        elif p.get("float") and p.get("experts"):
            lines.append(_expert_split_line(p))
        elif p.get("float"):
            quantized = [layer for layer in p["layers"] if layer not in p["float"]]
            lines.append(f"{p['group']}: {', '.join(quantized)} quantized but "
                         f"{', '.join(p['float'])} float: the runtime fuses them into one "
                         f"layer of one scheme (vLLM refuses the checkpoint); quantize all of "
                         f"the group's shards or none")
        elif p.get("held_by") is not None and p.get("experts"):
            cut = len(p["group"]) + 1  # the experts' layers, relative to their module
            held, others = ([layer[cut:] for layer in p["layers"] if (layer in p["held_by"]) == h]
                            for h in (True, False))
            lines.append(f"{p['group']}: {p['tensor']} of the experts' {p['experts']} inputs "
                         f"is held by {', '.join(held)} but not by {', '.join(others)}: the "
                         f"experts' schemes differ (static input on some, dynamic or float on "
                         f"others), and the fused MoE layer runs one scheme")
        elif p.get("held_by") is not None:
            others = [layer for layer in p["layers"] if layer not in p["held_by"]]
            lines.append(f"{p['group']}: {p['tensor']} is held by {', '.join(p['held_by'])} "
                         f"but not by {', '.join(others)}: the fused shards' schemes differ, "
                         f"and the fused layer runs one scheme")
        elif p.get("experts"):
            kernels = " (vLLM's FlashInfer NVFP4 MoE)" if "global" in p["tensor"] else ""
            lines.append(f"{p['group']}: {p['tensor']} differs across the experts' "
                         f"{p['experts']} inputs, which the fused MoE layer{kernels} "
                         f"quantizes with one scale: {vals}")
        elif p.get("non_finite") or p.get("zero_point"):
            # "why" names the tensor itself
            lines.append(p["why"] if p.get("why") else f"{p['tensor']}: not finite ({vals})")
        else:
            lines.append(f"{p['group']}: {p['tensor']} differs across the fused shards: {vals}")
    return "\n".join(lines)

