"""torch.onnx's side of the ONNX export (:mod:`.onnx`): a transformers model traced without
its KV cache, torch.onnx's optimizer run with a Linear's BatchNorm kept apart, its errors
told in one line, and a warning naming the example sizes torch.export specializes."""

from __future__ import annotations

import contextlib
import re
import warnings

import torch

__all__ = ["NoCache", "exporter_errors", "optimize", "warn_specialized"]


class NoCache:
    """A transformers model's ``config.use_cache`` off while exporting: a causal LM then returns
    its logits alone, not a ``DynamicCache`` torch.export cannot trace (issue 37)."""

    def __init__(self, model):
        self.config = getattr(model, "config", None)
        self.saved = getattr(self.config, "use_cache", None)

    def __enter__(self):
        if self.saved is not None:
            self.config.use_cache = False

    def __exit__(self, *exc):
        if self.saved is not None:
            self.config.use_cache = self.saved


#: the domain a BatchNormalization is moved to while torch.onnx optimizes: no rule matches it
_HELD = "quantscope.held"


@contextlib.contextmanager
def exporter_errors(model):
    """torch.onnx's errors (many types, each pages long) as one ``ValueError``; the
    machine's (memory, disk) as they came."""
    try:
        yield
    except (MemoryError, OSError):
        raise
    except Exception as e:
        raise ValueError(
            f"onnx export: torch.onnx could not export {type(model).__name__} "
            f"({_root_cause(e)}); supported: models torch.export can trace "
            f"whose forward returns tensors (a transformers model exports without its KV "
            f"cache: a causal LM's output is its logits)") from e


def optimize(program) -> None:
    """torch.onnx's ``optimize=True`` (``program.optimize()``), with each ``Gemm ->
    BatchNormalization`` kept apart: onnxscript folds the BatchNorm into the Gemm's weight
    (``W * gamma / std``, the node then scoped under the BatchNorm), so a Linear before an
    eval BatchNorm1d had no node of its own to quantize, and ``apply()`` computes
    ``BN(Q(W) x)``, not ``Q(W * gamma / std) x``. A Conv's BatchNorm still folds (no Conv is
    quantized)."""
    model = program.model
    held = [n for n in model.graph if n.op_type == "BatchNormalization" and not n.domain
            and n.inputs[0] is not None and n.inputs[0].producer() is not None
            and n.inputs[0].producer().op_type == "Gemm"]
    for n in held:
        n.domain = _HELD
    model.opset_imports[_HELD] = 1
    try:
        program.optimize()
    finally:
        for n in held:
            n.domain = ""
        model.opset_imports.pop(_HELD, None)


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _root_cause(e: BaseException) -> str:
    """``Type: first line`` of the innermost exception in ``e``'s chain (torch wraps the
    real cause in banners), terminal colour codes removed."""
    seen = set()
    while id(e) not in seen:
        seen.add(id(e))
        inner = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
        if inner is None:
            break
        e = inner
    lines = (_ANSI.sub("", ln).strip() for ln in str(e).splitlines())
    return f"{type(e).__name__}: {next((ln for ln in lines if ln), '')[:200]}".rstrip(": ")


def warn_specialized(example_inputs) -> None:
    """One warning naming each example tensor with a dimension of size 0 or 1: torch.export
    specializes such a dimension to that size (the ONNX input still declares it dynamic), and
    a graph that depends on it fails on other sizes (a tiny Llama exported from a batch-1
    example fails on batch 3 in ORT; a BERT happens to run)."""
    flat, _ = torch.utils._pytree.tree_flatten_with_path(example_inputs)
    small = [f"example_inputs{torch.utils._pytree.keystr(key)} {tuple(v.shape)} dimension "
             f"{[d for d, n in enumerate(v.shape) if n <= 1]}"
             for key, v in flat if isinstance(v, torch.Tensor) and min(v.shape, default=2) <= 1]
    if small:
        warnings.warn(f"onnx export: size 0 or 1 in {'; '.join(small)}: torch.export "
                      f"specializes such sizes, so the graph may run only with that size "
                      f"there; give an example with size >= 2 in every dimension that varies "
                      f"(batch, sequence)", UserWarning, stacklevel=4)
