"""compressed-tensors' compression of an export's working copy: which ``ModelCompressor``, in
one process, its codes computed in float32; and the config it writes, naming exactly the
layers quantscope quantized, as the checkpoint names them."""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import re

import torch
from torch import nn

from .ct_match import Targets
from .experts import checkpoint_names

__all__ = ["annotate", "check_shard_size", "compress", "ct_compressor", "save_here"]

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
    if compressor.quantization_config is not None:
        _complete_ignore(compressor.quantization_config, work)
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


#: the units a ``max_shard_size`` text takes (huggingface_hub's, which save_pretrained uses)
_SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}


def check_shard_size(value, who: str) -> None:
    """Refuse a ``max_shard_size`` save_pretrained would refuse (in the writer only, naming
    no argument) or take wrongly (a size below one byte: a shard per tensor): a number of
    bytes, or a number and a unit (``"5GB"``, ``"500MB"``), read as huggingface_hub reads
    it."""
    size = None
    if isinstance(value, str) and value.strip()[-2:].upper() in _SIZE_UNITS:
        with contextlib.suppress(ValueError):
            size = float(value.strip()[:-2]) * _SIZE_UNITS[value.strip()[-2:].upper()]
        if size is not None and math.isfinite(size):
            size = int(size)  # (huggingface_hub's bytes)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        size = value
    if size is None or not 1 <= size < math.inf:
        raise ValueError(f"{who}: max_shard_size must be a size of at least one byte: a "
                         f"number of bytes, or a number and a unit ({', '.join(_SIZE_UNITS)}: "
                         f"'5GB'), got {value!r}")


def save_here(work: nn.Module, folder: str, **options) -> None:
    """``work.save_pretrained(folder, **options)``, the weights written by this process:
    inside a process group transformers writes them on global rank 0 only (its config on
    every rank), but the registry already chose the rank that exports (a calibration's
    ``writer_rank``: a subgroup's rank 0, or each rank its own calibration); elsewhere
    the folder renamed into place would hold a config and no weights. ``work`` is the
    export's own copy: the override goes with it."""
    if hasattr(work, "should_save_on_this_rank"):  # transformers 5's check of the rank
        work.should_save_on_this_rank = lambda is_main_process: is_main_process
    work.save_pretrained(folder, **options)


def _this_process_only():
    """compressed-tensors' ``compress_model`` shares its work among the ranks of an initialised
    process group (a collective), but one rank exports (the registry's rule: the
    calibration's writer, or each rank its own calibration, when it will): the others are
    not in this call, so it would wait forever. Its context to compress in one process."""
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


def annotate(folder: str, calibration, notes: list[str], source, work) -> None:
    """quantscope's own record beside ``quantization_config`` (recipe, observers, changes);
    the config's layer names as the tensors on disk have them."""
    cfg_path = os.path.join(folder, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    qc = cfg["quantization_config"]
    lists = [g["targets"] for g in qc.get("config_groups", {}).values()] + [qc.get("ignore", [])]
    # module names only (not class names such as "Linear", nor "re:" patterns)
    modules = dict(work.named_modules())
    disk = checkpoint_names(work, {n for names in lists for n in names if n in modules})
    classes = {c.__name__ for m in modules.values() for c in type(m).__mro__}
    for names in lists:
        names[:] = [w for n in names for w in _written(
            n, disk.get(n, n), n in modules and (n.startswith("re:") or n in classes))]
    cfg["quantscope"] = {"recipe": calibration.recipe.name, "label": calibration.label,
                         "lossy": notes, "model": source,
                         "smoothed": bool(calibration.smoothing)}
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def _written(name: str, disk: str, ambiguous: bool) -> list[str]:
    """How the config names the layer the model calls ``name`` and its checkpoint ``disk``:
    where the two differ (transformers renames it as it loads: GPT-NeoX's ``embed_out`` is
    its ``lm_head``), both names, as vLLM reads the checkpoint's (through its own prefix map
    for the model, which passes ``re:`` patterns over) and transformers' compressed-tensors
    loader the model's; else the name, or (``ambiguous``: a regex after ``re:``, a class
    name such as ``Embedding``) the regex of it alone."""
    if ambiguous:
        return ["re:" + re.escape(n) + "$" for n in dict.fromkeys((disk, name))]
    return list(dict.fromkeys((disk, name)))


def _complete_ignore(config, work: nn.Module) -> None:
    """List every module the config groups' targets select that has no scheme (was left in
    float). compressed-tensors lists one only where its class is a quantized layer's exact
    class, while its matching (and vLLM's) takes a target class's subclasses too: with
    targets ``Linear`` beside Falcon's ``FalconLinear`` layers, the plain ``lm_head`` left in
    float went unlisted and loaded as quantized, its scales uninitialised. (Its ``is_match``
    of each module against every target, and a list's ``in``, were quadratic in layers where
    a mixed-precision config names them all: :class:`.ct_match.Targets` looks names up.)"""
    targeted = Targets([t for group in config.config_groups.values() for t in group.targets])
    ignore = list(config.ignore or [])
    listed = set(ignore)
    for name, module in work.named_modules():
        if (name and name not in listed and getattr(module, "quantization_scheme", None) is None
                and targeted(name, module)):
            ignore.append(name)
            listed.add(name)
    config.ignore = ignore
