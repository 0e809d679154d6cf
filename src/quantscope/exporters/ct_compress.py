"""compressed-tensors' compression of an export's working copy: which ``ModelCompressor``, in
one process, its codes computed in float32."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

__all__ = ["compress", "ct_compressor"]

_HALVES = (torch.bfloat16, torch.float16)


def ct_compressor(work: nn.Module, kv_args):
    """compressed-tensors' ``ModelCompressor`` of the schemes attached to ``work``, with the
    ``kv_cache_scheme``. A KV-cache-only calibration attaches no scheme (compressed-tensors
    then has no config): its config is empty ``config_groups`` beside the
    ``kv_cache_scheme``, as llm-compressor writes it."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    with _module_names(work):
        compressor = ModelCompressor.from_pretrained_model(work)
    if kv_args is None:
        return compressor
    if compressor.quantization_config is None:
        compressor.quantization_config = QuantizationConfig(
            config_groups={}, format=CompressionFormat.dense.value,
            quantization_status=QuantizationStatus.COMPRESSED)
    compressor.quantization_config.kv_cache_scheme = kv_args
    return compressor


@contextlib.contextmanager
def _module_names(work: nn.Module):
    """The config's names as ``work``'s modules name them: compressed-tensors renames its
    ignore list to the checkpoint's names itself where the model carries transformers' load
    conversions (0.20 by weight key, 0.19 by module name), and the export renames targets and
    ignore together, once (``_annotate``): a second renaming is not idempotent (Llava's
    ``lm_head`` became ``language_model.model.lm_head``, a name no tensor has)."""
    convs = work.__dict__.pop("_weight_conversions", None)
    try:
        yield
    finally:
        if convs is not None:
            work._weight_conversions = convs


def compress(compressor, work: nn.Module) -> None:
    """``compressor.compress_model(work)``: in this process only, every code computed as
    quantscope's QDQ computes it."""
    with _this_process_only(), _float32_qparams(work):
        compressor.compress_model(work)


def _this_process_only():
    """compressed-tensors' ``compress_model`` shares its work among the ranks of an initialised
    process group (a collective), but only rank 0 exports (the registry's rule): the others
    are not in this call, so it would wait forever. Its context to compress in one process."""
    try:
        from compressed_tensors.offload import as_single_threaded
    except ImportError:  # a version that never compresses in parallel
        return contextlib.nullcontext()
    return as_single_threaded()


@contextlib.contextmanager
def _float32_qparams(work: nn.Module):
    """The weights' bf16 / fp16 qparams as float32 (the same values) while compressed-tensors
    compresses, their own dtype again after.

    compressed-tensors computes ``weight / scale`` in the operands' dtype: a bf16 weight over
    a bf16 scale rounds the quotient to bf16 (a step of 0.5 for int8 codes from 64 up) before
    rounding it to a code, so 9 % of a bf16 model's int8 codes came out one off
    ``round(weight / scale)`` and the checkpoint no longer ran as ``apply(float_model)`` (found
    by probing). A float32 scale makes it float32 arithmetic, quantscope's QDQ's, with no
    float32 copy of the weights."""
    cast = []  # (module, parameter name, its dtype)
    for module in work.modules():
        if getattr(getattr(module, "quantization_scheme", None), "weights", None) is None:
            continue
        for name, p in module.named_parameters(recurse=False):
            if name.startswith("weight_") and p.dtype in _HALVES:
                cast.append((module, name, p.dtype))
                p.data = p.data.float()
    try:
        yield
    finally:
        for module, name, dtype in cast:
            p = getattr(module, name, None)  # (compression may have replaced it)
            if isinstance(p, torch.Tensor) and p.dtype == torch.float32:
                p.data = p.data.to(dtype)
