"""What reading a compressed-tensors folder refuses beyond a layer's own tensors.

A quantization tensor no read layer owns would be dropped without a word, and ``apply()``
would then run the model otherwise than its runtime does (docs/guide/deploy.md: "refused,
never dropped"). Here: such tensors (:func:`refuse_unread`), and attention quantization,
which quantscope does not run: compressed-tensors quantizes an attention module a config
group targets (``apply_quantization_config`` gives it ``QuantizedAttentionImpl``;
``initialize_attn_qparams`` its ``q_scale``, ``k_scale`` and ``v_scale``), and vLLM's
attention reads ``q_scale`` (its fp8 attention quantizes the query with it) and
``prob_scale`` (the softmax output's) beside the KV cache's ``k_scale`` / ``v_scale``.
quantscope's KV cache quantizes keys and values only (:data:`ATTENTION_SCALES`,
:func:`refuse_attention_groups`).
"""

from __future__ import annotations

from .read_checks import SCALE_LEAVES, ZERO_POINTS

__all__ = ["ATTENTION_SCALES", "ATTENTION_ZERO_POINTS", "KV_SCALE", "refuse_attention_groups",
           "refuse_unread"]

#: the KV cache's scale tensors on a cached attention module, and the role each is read as
KV_SCALE = {"k_scale": "key", "v_scale": "value"}

#: attention scales beside the KV cache's that quantscope does not run, and what each is
ATTENTION_SCALES = {
    "q_scale": "a query scale of attention quantization (compressed-tensors writes q_scale "
               "beside k_scale / v_scale on an attention module a config group targets; "
               "vLLM's fp8 attention quantizes the query with it)",
    "prob_scale": "a scale of the attention probabilities, softmax(QK^T) (vLLM's fp8 "
                  "attention reads prob_scale; compressed-tensors writes none)",
}

#: the zero points compressed-tensors' attention initialisation makes beside those scales
#: (``force_zero_point``), which no saved symmetric fp8 scheme holds: the KV cache quantscope
#: reads is symmetric (``read_checks.KV_SCHEME``), so a stored one would be dropped
ATTENTION_ZERO_POINTS = ("q_zero_point", "k_zero_point", "v_zero_point")

_NOT_RUN = ("quantscope does not run attention quantization (its KV cache quantizes keys and "
            "values only: k_scale / v_scale under a kv_cache_scheme), so apply() would run "
            "the attention otherwise than the runtime")


def refuse_attention_groups(where: str, matched, model, qconfig) -> None:
    """Refuse a config group that takes one of ``model``'s cached attention modules
    (``matched``: ``(name, module, group)`` of each module the config's targets match):
    compressed-tensors quantizes the attention itself there, its queries too, with
    ``q_scale`` / ``k_scale`` / ``v_scale`` on the module (not the ``input_scale`` a Linear's
    input activations have), where the group's targets match it narrowly (``is_narrow_match``:
    not its parent, none of its children; ``re:model[.]layers[.].*`` takes only the Linears)."""
    from compressed_tensors.utils.match import is_narrow_match

    from ..calibration.structure.kv_cache import attention_modules

    attention = attention_modules(model)
    for name, module, group in matched:
        if name in attention and is_narrow_match(model, qconfig.config_groups[group].targets,
                                                 name, module):
            raise ValueError(
                f"{where}: config_groups.{group} targets the attention module {name} "
                f"({type(module).__name__}): compressed-tensors quantizes attention there, "
                f"its queries, keys and values (q_scale, k_scale and v_scale on the module: "
                f"initialize_attn_qparams); {_NOT_RUN}")


def refuse_unread(tensors, grouped, kv_cache, path) -> None:
    """A quantization tensor that no read module owns (a layer the model lacks, one the
    targets miss, a KV-cache scale without a ``kv_cache_scheme``) would be dropped without a
    word: refuse instead, as an attention scale quantscope does not run
    (:data:`ATTENTION_SCALES`) or an attention zero point (:data:`ATTENTION_ZERO_POINTS`)
    wherever it is. ``grouped``: the layers the config groups
    read (their tensors are checked there); the KV-cache scales of a scheme are checked where
    they are read (``kv_cache``: the recipe's KV-cache role, None without a scheme)."""
    for key in tensors:
        layer, _, leaf = key.rpartition(".")
        if leaf in ATTENTION_SCALES:
            raise ValueError(f"from_compressed_tensors: {path}: tensor {key!r} is "
                             f"{ATTENTION_SCALES[leaf]}; {_NOT_RUN}: refused, not dropped")
        if leaf in ATTENTION_ZERO_POINTS:
            raise ValueError(f"from_compressed_tensors: {path}: tensor {key!r} is a zero point "
                             f"of the attention's queries, keys or values, but quantscope's KV "
                             f"cache is symmetric fp8 (no zero point; llm-compressor saves "
                             f"none): refused, not dropped")
        if layer in grouped or (kv_cache is not None and leaf in KV_SCALE):
            continue
        if leaf in KV_SCALE:
            raise ValueError(f"from_compressed_tensors: {path}: tensor {key!r} is a KV-cache "
                             f"scale, but quantization_config has no kv_cache_scheme")
        if leaf in SCALE_LEAVES or leaf in ZERO_POINTS:
            raise ValueError(
                f"from_compressed_tensors: {path}: tensor {key!r} belongs to no layer of the "
                f"model built from config.json that the config groups' targets match")
