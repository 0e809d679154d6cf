"""Whether vLLM has a scheme for a compressed-tensors config group.

vLLM picks one scheme per layer from its config group's ``weights`` / ``input_activations`` /
``format`` (``CompressedTensorsConfig._get_scheme_from_parts`` in
vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py) and raises
``NotImplementedError("No compressed-tensors compatible scheme was found")`` where none fits.
transformers and compressed-tensors load such a checkpoint all the same, so the export warns
and ``quantscope check`` reports; neither refuses. Only rules read in vLLM's source are here:
a config group no rule covers (fp4, mixed int / float) counts as served.
"""

from __future__ import annotations

import json
import os
import warnings

__all__ = ["describe", "unservable", "vllm_refusal", "warn_unservable"]

_WEIGHT_ONLY_BITS = (4, 8)  # vLLM's WNA16_SUPPORTED_BITS


def _on(args: dict | None, key: str):
    value = args.get(key) if isinstance(args, dict) else None
    return value.lower() if isinstance(value, str) else value


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


def _fp8(w: dict, a: dict | None) -> str | None:
    """``_is_fp8_w8a8`` / ``_is_fp8_w8a16``, and CompressedTensorsW8A8Fp8's
    ``assert not self.is_static_input_scheme`` where ``weight_block_size`` is set."""
    strategy = _on(w, "strategy")
    if strategy not in ("tensor", "channel", "block"):
        return None  # (MX blocks: not these schemes' rules)
    if not w.get("symmetric") or w.get("dynamic"):
        return ("vLLM serves fp8 weights only static and symmetric (its W8A8 / W8A16 Fp8 "
                "schemes)")
    static_tensor_input = (a is not None and _on(a, "type") == "float" and not a.get("dynamic")
                           and a.get("symmetric") and _on(a, "strategy") == "tensor")
    if strategy == "block" and static_tensor_input:
        return ("vLLM serves fp8 block weights only with a dynamic input (its W8A8 Fp8 block "
                "kernel quantizes activations at run time in 1 x block-columns groups) -- use "
                "a dynamic fp8 input")
    return None


def _int(w: dict, a: dict | None, fmt: str | None, out: dict | None) -> str | None:
    """``_is_wNa16_group_channel``, ``_is_static_tensor_w8a8``, ``_is_dynamic_token_w8a8``,
    ``_is_dynamic_token_w4a8_int``, ``_is_wNaM_int`` and ``_is_wNa8o8_int``."""
    bits, strategy = _on(w, "num_bits"), _on(w, "strategy")
    grouped = strategy in ("channel", "group") and not w.get("dynamic")
    fmt = fmt.lower() if isinstance(fmt, str) else None
    if a is None:
        if grouped and bits in _WEIGHT_ONLY_BITS and fmt in (None, "pack-quantized",
                                                             "marlin-24"):
            return None
        return (f"vLLM serves weight-only int weights as its WNA16 scheme only: "
                f"{' or '.join(map(str, _WEIGHT_ONLY_BITS))} bits, per channel or group, "
                f"format pack-quantized (got {bits} bits, {strategy}, {fmt})")
    a_bits, a_strategy, a_dynamic = _on(a, "num_bits"), _on(a, "strategy"), bool(a.get("dynamic"))
    w8 = bits == a_bits == 8 and strategy in ("tensor", "channel") and w.get("symmetric") \
        and not w.get("dynamic")
    if w8 and ((a_strategy == "tensor" and not a_dynamic) or (a_strategy == "token"
                                                              and a_dynamic)):
        return None  # W8A8 int8, static per tensor or dynamic per token
    if bits == 4 and a_bits == 8 and strategy in ("group", "channel") and w.get("symmetric") \
            and a_strategy == "token" and a_dynamic and not w.get("dynamic"):
        return None  # W4A8 int
    if grouped and fmt == "pack-quantized" and a.get("symmetric") and a_dynamic \
            and a_strategy in ("token", "group"):
        return None  # WNA8 int (dynamic symmetric per token / group input, packed weights)
    out_int8 = isinstance(out, dict) and _on(out, "type") == "int" and _on(out, "num_bits") == 8 \
        and _on(out, "strategy") == "tensor" and not out.get("dynamic")
    if grouped and fmt in ("pack-quantized", "int-quantized") and out_int8 \
            and a_bits == 8 and a_strategy == "tensor" and not a_dynamic:
        return None  # WNA8O8 int: static int8 input and output
    if bits != 8:
        return (f"vLLM serves int{bits} weights with an int8 input only when the input is "
                f"dynamic per token (its W4A8 scheme) -- use a dynamic input or w4a16")
    return ("vLLM serves int8 weights with an int8 input only per tensor or channel, symmetric, "
            "with a static per-tensor or dynamic per-token input (its W8A8 scheme)")


def unservable(qc: dict) -> list[tuple[str, list[str], str]]:
    """``(config group, its targets, why)`` of each group of the ``quantization_config``
    ``qc`` that vLLM has no scheme for (:func:`vllm_refusal`)."""
    groups = qc.get("config_groups") if isinstance(qc, dict) else None
    found = []
    for name, group in (groups.items() if isinstance(groups, dict) else ()):
        if not isinstance(group, dict):
            continue
        why = vllm_refusal(group.get("weights"), group.get("input_activations"),
                           group.get("format") or qc.get("format"),
                           group.get("output_activations"))
        if why:
            targets = group.get("targets")
            found.append((str(name), [str(t) for t in targets]
                          if isinstance(targets, list) else [], why))
    return found


def describe(name: str, targets: list[str]) -> str:
    """A config group as a problem or warning names it."""
    first = f", first {targets[0]!r}" if targets else ""
    return f"config group {name!r} ({len(targets)} target{'s' * (len(targets) != 1)}{first})"


def warn_unservable(folder) -> None:
    """One warning per config group of ``folder``'s ``config.json`` that vLLM cannot serve
    (the export writes it: transformers and compressed-tensors load it)."""
    with open(os.path.join(folder, "config.json")) as f:
        qc = json.load(f).get("quantization_config") or {}
    for name, targets, why in unservable(qc):
        warnings.warn(f"export compressed-tensors: {describe(name, targets)}: {why}; "
                      f"transformers and compressed-tensors load it, vLLM refuses it",
                      stacklevel=3)
