"""The argument checks that import no torch (numpy at most): the output-path guard
(:mod:`quantscope.exporters.atomic`) uses them, and the command line runs that guard on
``--out`` before torch is imported. :mod:`._checks` re-exports them with the others."""

from __future__ import annotations

import os

import numpy as np

__all__ = ["DEMO_MODEL_NAMES", "as_bool", "block_structure", "check_bool", "check_path",
           "demo_model_name", "quant_method", "spelt_as_scheme"]

#: the names under which ``--model`` (and ``quantscope.demo.models.load_model``) takes a demo
#: model (:data:`quantscope.demo.models.DEMO_MODELS` builds each)
DEMO_MODEL_NAMES = ("minilm", "smollm2-135m")


def demo_model_name(path) -> str | None:
    """The demo model ``path`` names (lower case), or None where it names a path: a demo
    name in any case (``MiniLM``) that is no file or folder here. A folder that exists under a
    demo name (``./minilm``, an export saved so) is what loads, so it is checked as any path
    is: the one rule of ``demo.models.resolve_model_path`` and the CLI's ``--model`` checks
    (None: no name, the default model, is the caller's to read)."""
    if path is None:
        return None
    name = os.fsdecode(os.fspath(path))
    if name.lower() not in DEMO_MODEL_NAMES or os.path.exists(name):
        return None
    return name.lower()


def as_bool(value) -> bool | None:
    """``value`` as a Python bool if it is a Python or numpy bool, else None (``bool("no")``
    is True: a string, 0 / 1 or None would be read silently)."""
    return bool(value) if isinstance(value, (bool, np.bool_)) else None


def check_path(who: str, path, name: str = "path") -> str:
    """``path`` as a str; ``TypeError`` naming ``name`` for anything but a str, bytes or
    ``os.PathLike`` (None: pathlib's own message names neither the call nor the argument)."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"{who}: {name} must be a str or os.PathLike, got {type(path).__name__}")
    return os.fsdecode(os.fspath(path))


def check_bool(who: str, name: str, value) -> bool:
    """``value`` as a bool: a Python or numpy bool only (``bool("no")`` is True: a string,
    0 / 1 or None would be read silently)."""
    if as_bool(value) is None:
        raise ValueError(
            f"{who}: {name} must be True or False, got {value!r}")
    return bool(value)


def spelt_as_scheme(name: str, presets) -> bool:
    """Whether ``name`` is the upper-case spelling of one of ``presets`` (lower case), which
    is compressed-tensors' spelling of its scheme of that name: ``W8A8`` (dynamic per-token
    inputs) is not the preset ``w8a8`` (static ones). The library's ``preset()`` and the
    command line's ``--recipe`` refuse it rather than read either one silently."""
    return name.isupper() and name.lower() in presets and "-" not in name


def quant_method(config) -> str | None:
    """The ``quant_method`` of a model folder's ``config.json`` (``config``: its parsed JSON)
    where it has a ``quantization_config`` (``"?"`` where that names none), else None. Such a
    checkpoint (a compressed-tensors export, GPTQ, FP8 ...) stores its weights as codes and
    scales, which transformers decompresses on load: not the float weights calibration
    observes (``--model`` and sequential calibration's checkpoint refuse it)."""
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if qc is None:  # (an empty one, {}, transformers refuses: no quant_method)
        return None
    return str(qc.get("quant_method", "?")) if isinstance(qc, dict) else "?"


def block_structure(who: str, value) -> tuple[int, int]:
    """A ``QuantizationArgs`` ``block_structure`` as ``(rows, cols)``: ``[rows, cols]`` of
    positive ints, or older compressed-tensors' ``"128x128"`` (which it reads as that list);
    ValueError else, as compressed-tensors (``[128.5, 128]`` is no block of 128 rows)."""
    try:
        if isinstance(value, str):
            value = [int(v) for v in value.lower().split("x")]
        rows, cols = value
        if not all(isinstance(v, (int, np.integer)) and v > 0 for v in (rows, cols)):
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(f"{who}: strategy block needs block_structure [rows, cols] (positive "
                         f"ints), got {value!r}") from None
    return int(rows), int(cols)
