"""Whether vLLM has a scheme for a compressed-tensors config group.

vLLM picks one scheme per layer from its config group's ``weights`` / ``input_activations`` /
``format`` (``CompressedTensorsConfig._get_scheme_from_parts`` in
vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py) and raises
``NotImplementedError("No compressed-tensors compatible scheme was found")`` where none fits.
A fused MoE layer takes its method from the group of its experts
(``CompressedTensorsMoEMethod.get_moe_method`` in compressed_tensors_moe.py), under rules of
its own (:func:`vllm_moe_refusal`), and Qwen2-MoE / Qwen3-Next build ``shared_expert_gate`` as a
plain unquantized ``torch.nn.Linear``. transformers and compressed-tensors load such dense
layers all the same (MoE experts of some schemes only: :data:`TRANSFORMERS_EXPERTS`), so the
export warns and ``quantscope check`` reports; neither refuses.
A scheme vLLM runs on one platform only (W4A8 int experts: CPU) is reported as well, its line
naming the platform: vLLM is served from GPUs.
Only rules read in vLLM's source are here: a config group no rule covers (mxfp4, mixed
int / float) counts as served.
"""

from __future__ import annotations

import json
import os
import re
import warnings

from .._plainchecks import block_structure
from .moe_slots import expert_slot
from .read_checks import SCALE_LEAVES, safetensors_headers

__all__ = ["SCHEME_FIELDS", "TRANSFORMERS_EXPERTS", "describe", "embedding_layers",
           "quantized", "resolver", "scheme_args", "unservable", "vllm_embedding_refusal",
           "vllm_moe_refusal", "vllm_refusal", "warn_unservable"]

_WEIGHT_ONLY_BITS = (4, 8)  # vLLM's WNA16_SUPPORTED_BITS

#: the QuantizationArgs fields vLLM's scheme choice reads: ``_get_scheme_from_parts``, its
#: predicates, the schemes it builds (CompressedTensorsW8A8Fp8 takes ``block_structure``,
#: CompressedTensorsWNA16 ``actorder``, read as group or not: :func:`_g_idx`).
#: ``observer``, ``observer_kwargs`` and ``zp_dtype`` it never reads: groups that differ only
#: there are one scheme to it
SCHEME_FIELDS = ("num_bits", "type", "symmetric", "strategy", "group_size", "block_structure",
                 "dynamic", "actorder", "scale_dtype")
#: compressed-tensors' QuantizationArgs defaults of those fields (the others default to None)
_ARG_DEFAULTS = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False}


def scheme_args(args: dict | None) -> dict | None:
    """The :data:`SCHEME_FIELDS` of ``args`` (a ``weights`` / ``input_activations`` dict as
    ``config.json`` holds it) as vLLM reads them from the ``QuantizationArgs`` it builds of it:
    an absent field its default, an absent strategy as compressed-tensors infers it (no
    ``group_size``: tensor; > 0: group; -1: channel), strings in lower case,
    ``block_structure`` as a list in either of its forms and ``actorder`` as ``"group"`` or
    None (:func:`_g_idx`); None where there are no args."""
    if not isinstance(args, dict):
        return None
    out = {k: args.get(k, _ARG_DEFAULTS.get(k)) for k in SCHEME_FIELDS}
    out = {k: v.lower() if isinstance(v, str) else v for k, v in out.items()}
    if out["strategy"] is None:
        size = out["group_size"]
        out["strategy"] = ("tensor" if size is None else "channel" if size == -1
                           else "group" if isinstance(size, int) and size > 0 else None)
    out["actorder"] = "group" if _g_idx(out["actorder"]) else None
    try:
        out["block_structure"] = list(block_structure("check", out["block_structure"]))
    except ValueError:
        pass  # none, or not one vLLM could read either: compared as it is
    return out


def _g_idx(actorder) -> bool:
    """Whether vLLM gives a layer of this ``actorder`` a ``weight_g_idx``: its WNA16 schemes
    read the field only as ``has_g_idx = actorder == ActivationOrdering.GROUP``, which
    ``"dynamic"`` equals where compressed-tensors has it as an alias (and ``true``, which older
    releases parse as group); so ``"weight"``, ``"static"`` and none are one scheme to it.
    (Recent compressed-tensors and vLLM refuse group and dynamic in a config.)"""
    return actorder is True or actorder in ("group", "dynamic")


def _on(args: dict | None, key: str):
    """Field ``key`` (one of :data:`SCHEME_FIELDS`) of ``args`` as vLLM reads it
    (:func:`scheme_args`); None where there are no args."""
    read = scheme_args(args)
    return None if read is None else read[key]


def vllm_refusal(weights: dict | None, inputs: dict | None = None, fmt: str | None = None,
                 outputs: dict | None = None) -> str | None:
    """None where vLLM serves a config group with these ``weights`` / ``input_activations``
    / ``output_activations`` (dicts as ``config.json`` holds them) and compressed-tensors
    ``fmt`` (the group's, else the config's); else one line naming what vLLM needs instead."""
    if not isinstance(weights, dict):
        return None  # no weights: vLLM leaves the layer unquantized
    inputs = inputs if isinstance(inputs, dict) else None
    if _on(weights, "type") == "float" and _on(weights, "num_bits") == 8:
        return _fp8(weights, inputs)
    if _on(weights, "type") == "int" and (inputs is None or _on(inputs, "type") == "int"):
        return _int(weights, inputs, fmt, outputs)
    return None


def _mxfp8(args: dict | None) -> bool:
    """vLLM's ``_is_mxfp8``: float 8 bits in symmetric groups of 32 with E8M0 scales
    (``scale_dtype`` uint8, as compressed-tensors' MXFP8 schemes write ``"torch.uint8"``)."""
    return (isinstance(args, dict) and _on(args, "type") == "float"
            and _on(args, "num_bits") == 8 and _on(args, "strategy") == "group"
            and _on(args, "group_size") == 32 and bool(_on(args, "symmetric"))
            and str(_on(args, "scale_dtype")).removeprefix("torch.") == "uint8")


def _fp8(w: dict, a: dict | None) -> str | None:
    """``_is_mxfp8``, ``_is_fp8_w8a8`` / ``_is_fp8_w8a16``, and CompressedTensorsW8A8Fp8's
    ``assert not self.is_static_input_scheme`` where ``weight_block_size`` is set."""
    strategy = _on(w, "strategy")
    if strategy == "group" and not _mxfp8(w):
        # no scheme takes them: the fp8 ones read tensor / channel / block weights only, and
        # no fp8 format is pack-quantized (WNA16)
        return (f"vLLM serves fp8 weights in groups only as MXFP8 (its _is_mxfp8: groups of "
                f"32, symmetric, E8M0 scales, scale_dtype uint8; got groups of "
                f"{_on(w, 'group_size')}, symmetric {_on(w, 'symmetric')}, scale_dtype "
                f"{_on(w, 'scale_dtype')}); its other fp8 "
                f"schemes take tensor, channel or block weights -- use per-channel "
                f"(fp8-dynamic) or block (FP8_BLOCK) fp8 weights")
    if strategy not in ("tensor", "channel", "block"):
        return None  # (MXFP8, tensor_group ...: not these schemes' rules)
    if not _on(w, "symmetric") or _on(w, "dynamic"):
        return ("vLLM serves fp8 weights only static and symmetric (its W8A8 / W8A16 Fp8 "
                "schemes)")
    static_tensor_input = (a is not None and _on(a, "type") == "float" and not _on(a, "dynamic")
                           and _on(a, "symmetric") and _on(a, "strategy") == "tensor")
    if strategy == "block" and static_tensor_input:
        return ("vLLM serves fp8 block weights only with a dynamic input (its W8A8 Fp8 block "
                "kernel quantizes activations at run time in 1 x block-columns groups) -- use "
                "a dynamic fp8 input")
    return None


def _int(w: dict, a: dict | None, fmt: str | None, out: dict | None) -> str | None:
    """``_is_wNa16_group_channel``, ``_is_static_tensor_w8a8``, ``_is_dynamic_token_w8a8``,
    ``_is_dynamic_token_w4a8_int``, ``_is_wNaM_int`` and ``_is_wNa8o8_int``."""
    bits, strategy = _on(w, "num_bits"), _on(w, "strategy")
    grouped = strategy in ("channel", "group") and not _on(w, "dynamic")
    fmt = fmt.lower() if isinstance(fmt, str) else None
    if a is None:
        if grouped and bits in _WEIGHT_ONLY_BITS and fmt in (None, "pack-quantized",
                                                             "marlin-24"):
            return None
        return (f"vLLM serves weight-only int weights as its WNA16 scheme only: "
                f"{' or '.join(map(str, _WEIGHT_ONLY_BITS))} bits, per channel or group, "
                f"format pack-quantized (got {bits} bits, {strategy}, {fmt})")
    a_bits, a_strategy = _on(a, "num_bits"), _on(a, "strategy")
    a_dynamic = bool(_on(a, "dynamic"))
    w8 = bits == a_bits == 8 and strategy in ("tensor", "channel") and _on(w, "symmetric") \
        and not _on(w, "dynamic")
    if w8 and ((a_strategy == "tensor" and not a_dynamic) or (a_strategy == "token"
                                                              and a_dynamic)):
        return None  # W8A8 int8, static per tensor or dynamic per token
    if bits == 4 and a_bits == 8 and strategy in ("group", "channel") and _on(w, "symmetric") \
            and a_strategy == "token" and a_dynamic and not _on(w, "dynamic"):
        return None  # W4A8 int
    if grouped and fmt == "pack-quantized" and _on(a, "symmetric") and a_dynamic \
            and a_strategy in ("token", "group") and a_bits in (4, 8):
        return None  # WNA8 / WNA4 int (dynamic symmetric per token / group input, packed)
    out_int8 = isinstance(out, dict) and _on(out, "type") == "int" and _on(out, "num_bits") == 8 \
        and _on(out, "strategy") == "tensor" and not _on(out, "dynamic")
    if grouped and fmt in ("pack-quantized", "int-quantized") and out_int8 \
            and a_bits == 8 and a_strategy == "tensor" and not a_dynamic:
        return None  # WNA8O8 int: static int8 input and output
    return _int_need(w, a, fmt)


def _described(args: dict) -> str:
    """An input as a message names it (``"static asymmetric per-tensor int8"``)."""
    return (f"{'dynamic' if _on(args, 'dynamic') else 'static'} "
            f"{'symmetric' if _on(args, 'symmetric') else 'asymmetric'} "
            f"per-{_on(args, 'strategy')} int{_on(args, 'num_bits')}")


def _int_need(w: dict, a: dict, fmt: str | None) -> str:
    """What vLLM needs of int weights with an int input that :func:`_int` found no scheme
    for: the input's bits first (8, or 4 packed), then the weight bits that input takes."""
    bits, strategy, a_bits = _on(w, "num_bits"), _on(w, "strategy"), _on(a, "num_bits")
    got = f"got {strategy} weights, format {fmt}, a {_described(a)} input"
    packed = ("in format pack-quantized, per channel or group, with a dynamic symmetric "
              "per-token or per-group input")
    if a_bits not in (4, 8):
        return (f"vLLM serves int weights with an int input of 8 bits only, or of 4 bits "
                f"{packed} (its WNA4 scheme) ({got}) -- use an int8 input or w4a16")
    if a_bits == 4:
        return (f"vLLM serves int weights with an int4 input only {packed} (its WNA4 scheme; "
                f"{got}); its other int schemes take an int8 input -- use a dynamic per-token "
                f"int8 input or w4a16")
    if bits == 4:
        return (f"vLLM serves int4 weights with an int8 input only per channel or group, "
                f"symmetric, with the input dynamic per token (its W4A8 scheme), or {packed} "
                f"(its WNA8 scheme) ({got}) -- use a dynamic per-token input or w4a16")
    if bits != 8:
        return (f"vLLM serves int{bits} weights with an int8 input only {packed} (its WNA8 "
                f"scheme; {got}); its other int8-input schemes take int4 or int8 weights "
                f"(W4A8, W8A8) -- use int4 or int8 weights, or w4a16")
    return ("vLLM serves int8 weights with an int8 input only per tensor or channel, symmetric, "
            "with a static per-tensor or dynamic per-token input (its W8A8 scheme)")


def _nvfp4(args: dict | None) -> bool:
    """vLLM's ``_is_nvfp4_format``: float 4 bits, ``tensor_group`` of 16, symmetric."""
    return (isinstance(args, dict) and _on(args, "type") == "float"
            and _on(args, "num_bits") == 4 and _on(args, "strategy") == "tensor_group"
            and _on(args, "group_size") == 16 and bool(_on(args, "symmetric")))


def vllm_moe_refusal(weights: dict | None, inputs: dict | None = None,
                     fmt: str | None = None) -> str | None:
    """None where vLLM's fused MoE layer serves experts of a config group with these
    ``weights`` / ``input_activations`` and format ``fmt``; else one line naming what it needs.
    The branches of ``CompressedTensorsMoEMethod.get_moe_method``, in its order, and the checks
    of the MoE method each reaches."""
    if not isinstance(weights, dict):
        return None  # ignored experts: UnquantizedFusedMoEMethod
    a = inputs if isinstance(inputs, dict) else None
    kind, bits, strategy = _on(weights, "type"), _on(weights, "num_bits"), _on(weights, "strategy")
    fmt = fmt.lower() if isinstance(fmt, str) else None
    if kind == "float" and bits == 4 and strategy == "group" and _on(weights, "group_size") == 32:
        return None  # _is_mxfp4: CompressedTensorsW4A4Mxfp4MoEMethod
    if _mxfp8(weights):
        # _is_mxfp8: CompressedTensorsW8A8Mxfp8MoEMethod, whatever the input (it quantizes
        # activations to MXFP8 at run time), so weight-only mxfp8 experts load too
        return None
    if a is None and strategy in ("channel", "group") and not _on(weights, "dynamic"):
        # _is_wNa16_group_channel (any type): the WNA16 MoE methods; their Marlin and Triton
        # kernels assert symmetric weights
        if bits in _WEIGHT_ONLY_BITS and fmt == "pack-quantized" and _on(weights, "symmetric"):
            return None
        return (f"vLLM serves weight-only experts only as its WNA16 MoE: int 4 or 8 bits, "
                f"symmetric, per channel or group, format pack-quantized (got {kind}{bits}, "
                f"{strategy}, {fmt}) -- use w4a16")
    if _nvfp4(weights):  # CompressedTensorsW4A4Nvfp4MoEMethod (use_a16 without an input)
        return None if a is None or _nvfp4(a) else (
            "vLLM serves nvfp4 experts only with an nvfp4 input or none (its NVFP4 MoE)")
    if a is None:
        # No W8A16 branch (no _is_fp8_w8a16 here, unlike a dense Linear): the _is_fp8_w8a8
        # checks need an input, and _is_dynamic_token_w8a8 then reads input_quant.num_bits of
        # None (an AttributeError at load, whatever the GPU)
        return (f"vLLM's fused MoE has no method for weight-only {kind}{bits} {strategy} "
                f"experts (no W8A16 fp8 MoE; weight-only experts are WNA16 int per channel or "
                f"group, nvfp4a16, mxfp4 or mxfp8) -- use fp8-dynamic, or w4a16")
    if kind == "float" == _on(a, "type") and bits == 8:
        return _moe_fp8(weights, a)
    if kind == "int" == _on(a, "type"):
        return _moe_int(weights, a)
    return None


def _moe_fp8(w: dict, a: dict) -> str | None:
    """``_is_fp8_w8a8`` reaches CompressedTensorsW8A8Fp8MoEMethod, whose ``__init__`` takes
    tensor weights with a tensor input, channel weights with a dynamic per-token input, else
    asserts block weights."""
    strategy, a_strategy = _on(w, "strategy"), _on(a, "strategy")
    if not _on(w, "symmetric") or _on(w, "dynamic") \
            or strategy not in ("tensor", "channel", "block"):
        return None  # not _is_fp8_w8a8: no rule here
    if not _on(a, "dynamic") and not (_on(a, "symmetric") and a_strategy == "tensor"):
        return None  # not _is_fp8_w8a8 either
    if strategy == "block" or (strategy == a_strategy == "tensor") or (
            strategy == "channel" and a_strategy == "token" and _on(a, "dynamic")):
        return None
    return (f"vLLM's fp8 MoE takes {strategy} weights only with "
            f"{'a per-tensor input' if strategy == 'tensor' else 'a dynamic per-token input'}"
            f" (tensor weights + tensor input, channel weights + dynamic per-token input, or "
            f"block weights) -- use fp8-dynamic or fp8 per-tensor weights")


#: CompressedTensorsW4A8Int8MoEMethod's backend (select_w4a8_int8_moe_backend in
#: fused_moe/oracle/w4a8_int8.py) is CPU_INT4 alone, offered where ``current_platform.is_cpu()``;
#: elsewhere it raises NotImplementedError("W4A8 Int8 MoE is only supported on CPU platforms")
#: at load (older vLLM: the method's ``__init__`` raised "... is CPU-only"). On capability 9.0
#: the ``_is_fp8_w4a8_sm90`` branch, which reads no type, comes first for group weights with a
#: symmetric input: CompressedTensorsW4A8Fp8MoEMethod (fp8 activations, packed int32 weights).
_W4A8_CPU_ONLY = (
    "vLLM runs W4A8 int experts (int4 weights, dynamic per-token int8 input) on CPU only (its "
    "W4A8 Int8 MoE): on a GPU its MoE raises at load (\"only supported on CPU platforms\"; a "
    "capability-9.0 GPU takes group weights with a symmetric input to its W4A8 fp8 MoE, fp8 "
    "activations and packed int32 weights, instead) -- use w4a16 to serve them on a GPU")


def _moe_int(w: dict, a: dict) -> str | None:
    """``_is_dynamic_token_w8a8`` reaches CompressedTensorsW8A8Int8MoEMethod, which needs
    channel weights; ``_is_dynamic_token_w4a8_int`` CompressedTensorsW4A8Int8MoEMethod, CPU
    only (:data:`_W4A8_CPU_ONLY`); anything else raises "Unsupported FusedMoe scheme"."""
    bits, strategy, a_bits = _on(w, "num_bits"), _on(w, "strategy"), _on(a, "num_bits")
    token = _on(a, "strategy") == "token" and _on(a, "dynamic") and _on(w, "symmetric") \
        and not _on(w, "dynamic")
    if token and bits == a_bits == 8 and strategy == "channel":
        return None
    if token and bits == 4 and a_bits == 8 and strategy in ("channel", "group"):
        return _W4A8_CPU_ONLY
    return ("vLLM's int8 MoE takes only channel int8 weights with a dynamic per-token int8 "
            "input (no fused-MoE method for a static input) -- use w8a8-dynamic")


def vllm_embedding_refusal(weights: dict | None, inputs: dict | None = None,
                           fmt: str | None = None) -> str | None:
    """What vLLM does with a quantized embedding (its ``VocabParallelEmbedding``): None for
    unquantized weights, else one line. ``CompressedTensorsConfig.get_quant_method`` gives an
    embedding no method in vLLM releases before ``CompressedTensorsEmbeddingWNA16Int`` (only
    ``LinearBase``, ``Attention`` and ``FusedMoE``): built unquantized, its loader finds no
    parameter for ``weight_packed``. Recent vLLM gives one to weight-only int per channel or
    group weights (``_is_wNa16_group_channel``, packed int32: format pack-quantized; its
    kernel reads no zero point) and raises for any other scheme; and only where the model's
    vLLM code passes ``quant_config`` to its embedding, which not every model's does."""
    if not isinstance(weights, dict):
        return None
    kind, bits, strategy = _on(weights, "type"), _on(weights, "num_bits"), _on(weights, "strategy")
    fmt = fmt.lower() if isinstance(fmt, str) else None
    older = ("older vLLM builds every embedding unquantized and finds no parameter for its "
             "weight_packed")
    if (kind == "int" and strategy in ("channel", "group") and not _on(weights, "dynamic")
            and _on(weights, "symmetric") and fmt == "pack-quantized"
            and not isinstance(inputs, dict)):
        return (f"vLLM loads a quantized embedding only with its "
                f"CompressedTensorsEmbeddingWNA16Int (recent releases; {older}) and only in "
                f"models whose vLLM code passes quant_config to the embedding -- check that "
                f"the vLLM you serve with loads it, or leave it in float (ignore it)")
    return (f"vLLM serves a quantized embedding only as weight-only symmetric int per channel "
            f"or group in format pack-quantized (its CompressedTensorsEmbeddingWNA16Int, "
            f"recent releases; got {kind}{bits} {strategy}, {fmt}"
            f"{', an input quantized' if isinstance(inputs, dict) else ''}); {older} -- "
            f"leave it in float (ignore it)")


def embedding_layers(model) -> list[str]:
    """The names of ``model``'s embeddings (``nn.Embedding`` / ``nn.EmbeddingBag`` and their
    subclasses), whatever their names: vLLM builds those as ``VocabParallelEmbedding``."""
    from torch import nn

    return [n for n, m in model.named_modules()
            if n and isinstance(m, (nn.Embedding, nn.EmbeddingBag))]


def _matches(pattern: str, name: str) -> bool:
    try:
        return re.match(pattern, name) is not None
    except re.error:  # a pattern compressed-tensors would refuse matches nothing here
        return False


def resolver(rows):
    """``layer -> {value}`` of the ``(target, value)`` rows whose target selects the layer,
    as compressed-tensors (and vLLM's ``find_matched_target``) match targets: exact names,
    then ``re:`` patterns, then class names (a target without a dot); empty where none. A
    target two rows name is the later row's, as vLLM maps each target to one scheme (the
    last config group naming it: ``target_scheme_map[target] = ...``)."""
    rows = dict(rows).items()

    def of(layer: str) -> set:
        for hit in (lambda t: t == layer,
                    lambda t: t.startswith("re:") and _matches(t[3:], layer),
                    lambda t: not t.startswith("re:") and "." not in t):
            found = {v for t, v in rows if hit(t)}
            if found:
                return found
        return set()
    return of


def quantized(names, layer: str) -> bool:
    """Whether the checkpoint's tensor ``names`` hold ``layer`` quantized: any scale or packed
    weight of it (a float layer, one of the ignore list, holds its weight alone)."""
    return any(f"{layer}.{leaf}" in names for leaf in ("weight_packed", *SCALE_LEAVES))


def _selected(groups: dict, names, embeddings=()) -> tuple[dict, dict, dict]:
    """``({config group: [expert layers]}, {config group: [shared_expert_gate layers]},
    {config group: [embeddings]})`` of the layers the checkpoint's tensor ``names`` hold
    quantized, by the config group that selects each (:func:`resolver`); ``embeddings``: the
    embedding layers' names (:func:`embedding_layers`)."""
    resolve = resolver([(str(t), str(n)) for n, g in groups.items() if isinstance(g, dict)
                        and isinstance(g.get("targets"), list) for t in g["targets"]])
    experts: dict[str, list[str]] = {}
    gates: dict[str, list[str]] = {}
    embeds: dict[str, list[str]] = {}
    for layer in sorted({n.rpartition(".")[0] for n in names}):
        found = experts if expert_slot(layer) else gates if layer.endswith(
            "shared_expert_gate") else embeds if layer in embeddings else None
        if found is not None and quantized(names, layer):
            for group in resolve(layer):
                found.setdefault(group, []).append(layer)
    return experts, gates, embeds


#: the tail of a problem of MoE experts (:func:`unservable`)
_EXPERTS = "; its experts: "
#: what transformers does with a folder's compressed per-expert layers, which it merges into
#: its 3-D experts (a tiny Qwen2-MoE, transformers 5.17 with compressed-tensors 0.19 and 5.25
#: with 0.20.1; docs/guide/deploy.md, "KV cache and MoE experts")
TRANSFORMERS_EXPERTS = (
    "transformers 5.17 / 5.25 load compressed MoE experts only of some schemes: symmetric int4 "
    "weight-only ones run as apply() does, fp8 ones as float weights without their input "
    "quantization; asymmetric int4 and int8 experts fail to load, NVFP4 experts to run")


def _first(layers: list[str]) -> str:
    return f"{layers[0]!r}" + (f" and {len(layers) - 1} more" if len(layers) > 1 else "")


def unservable(qc: dict, names=(), embeddings=()) -> list[tuple[str, list[str], str]]:
    """``(config group, its targets, why)`` of each group of the ``quantization_config``
    ``qc`` that vLLM has no scheme for (:func:`vllm_refusal`), and, from the checkpoint's
    tensor ``names``, of each group that selects experts vLLM's fused MoE layer refuses
    (:func:`vllm_moe_refusal`), quantizes a ``shared_expert_gate``, or quantizes one of the
    ``embeddings`` (layer names, judged by module class: :func:`embedding_layers`; a folder
    alone does not tell them, :func:`vllm_embedding_refusal`)."""
    groups = qc.get("config_groups") if isinstance(qc, dict) else None
    groups = groups if isinstance(groups, dict) else {}
    experts, gates, embeds = _selected(groups, names, set(embeddings))
    found = []
    for name, group in groups.items():
        if not isinstance(group, dict):
            continue
        args = (group.get("weights"), group.get("input_activations"),
                group.get("format") or qc.get("format"))
        targets = group.get("targets")
        targets = [str(t) for t in targets] if isinstance(targets, list) else []
        name = str(name)
        if why := vllm_refusal(*args, group.get("output_activations")):
            found.append((name, targets, why))
        if name in experts and (why := vllm_moe_refusal(*args)):
            found.append((name, targets, f"{why}{_EXPERTS}{_first(experts[name])}"))
        if name in embeds and (why := vllm_embedding_refusal(*args)):
            layers = ", ".join(map(repr, embeds[name]))
            found.append((name, targets, f"it quantizes the embeddings {layers}: {why}"))
        if name in gates:  # Qwen2MoeSparseMoeBlock: torch.nn.Linear(hidden_size, 1)
            found.append((name, targets, (
                f"it quantizes {_first(gates[name])}, which vLLM builds unquantized (a "
                f"plain torch.nn.Linear in its Qwen2-MoE): loading its scales fails -- ignore "
                f"it, e.g. ignore=('re:.*shared_expert_gate$',)")))
    return found


def describe(name: str, targets: list[str]) -> str:
    """A config group as a problem or warning names it."""
    first = f", first {targets[0]!r}" if targets else ""
    return f"config group {name!r} ({len(targets)} target{'s' * (len(targets) != 1)}{first})"


def warn_unservable(folder, embeddings=()) -> None:
    """One warning per problem of :func:`unservable` in ``folder``'s ``config.json`` and
    tensor names (read from the safetensors headers; the export writes the folder all the
    same: transformers and compressed-tensors load it); ``embeddings``: the names on disk of
    the model's embeddings (:func:`embedding_layers`)."""
    with open(os.path.join(folder, "config.json")) as f:
        qc = json.load(f).get("quantization_config") or {}
    names = safetensors_headers(folder, "export compressed-tensors")
    for name, targets, why in unservable(qc, names, embeddings):
        loads = TRANSFORMERS_EXPERTS if _EXPERTS in why else \
            "transformers and compressed-tensors load it"
        warnings.warn(f"export compressed-tensors: {describe(name, targets)}: {why}; {loads}",
                      stacklevel=3)
