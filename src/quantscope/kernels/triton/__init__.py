"""Triton kernels: the CUDA implementations of the ops in :mod:`quantscope.kernels.ops`
(and the ops defined beside their torch references: ``hist_add`` and ``hist_regrid_`` in
:mod:`quantscope.stats.hist_ops`, ``record_non_finite`` and ``minmax_update`` in
:mod:`quantscope.stats.minmax`, the block scales in :mod:`quantscope.qparams`).

Each module here (``minmax``, ``fakequant``, ``block_qparams``, ``block_search``, ``mse``,
``histogram``) holds ``triton.jit`` kernels and the plain Python launchers that size their
grids; the ops call the launchers with CUDA tensors. Under Triton's interpreter
(``TRITON_INTERPRET=1`` in the environment before triton is first imported: triton decides
the mode as it decorates each function, its own library's included) the same launchers run
on CPU tensors, with numpy: how the tests prove every kernel bitwise against the torch path
without a GPU (tests/conftest.py sets it where no GPU is present; ``_jit.widen`` reads a
bfloat16 by its bits there, as the interpreter's own conversion gets subnormals wrong).

The bitwise contract of the C kernels holds here too: every float32 division is
``tl.math.div_rn`` (Triton's ``/`` is an approximate division on NVIDIA GPUs), rounding to
an integer is ``_jit.rint`` (half to even, as ``torch.round``), and every launch passes
``enable_fp_fusion=False`` (no ``a * b + c`` contracted into one FMA, which torch's
separate ops never do). Two things carry no value and may differ, as with the C kernels:
the sign of a zero min or max where -0.0 and +0.0 tie (``unit_minmax`` reduces in its own
order), and a NaN's sign and payload (a kernel stores the canonical NaN where torch's
``.float()`` of a bfloat16 / float16 NaN keeps its bits).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

__all__ = ["available", "interpreted", "launchers", "runs_on"]


def available() -> bool:
    """Whether triton imports (the ``gpu`` extra)."""
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Whether the kernels run under Triton's interpreter (CPU tensors) rather than compiled
    (CUDA tensors); fixed when triton is first imported."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


def runs_on(device) -> bool:
    """Whether the Triton launchers can take tensors on ``device`` in this process: CUDA when
    compiled, the CPU under the interpreter."""
    import torch

    device = torch.device(device)
    if not available():
        return False
    # not "anything but the CPU": meta, mps or xpu tensors take the ops' other paths
    return device.type == ("cpu" if interpreted() else "cuda")


def launchers(name: str, t, writes=()):
    """The launchers of this package's module ``name`` when they run on tensor ``t``'s device
    here, else None (the op then takes its torch path). ``writes``: the tensors the launch
    writes in place; None where one was made under ``torch.inference_mode`` and is written
    outside it: torch refuses that write, which a launch through its pointer would make
    (the torch path raises torch's error, as the C kernels' ``kernels.writable`` rule)."""
    if writes and any(w.is_inference() for w in writes) and not _inference_mode():
        return None
    return _launchers(name, t.device.type)


def _inference_mode() -> bool:
    import torch

    return torch.is_inference_mode_enabled()


@functools.cache
def _launchers(name: str, device_type: str):
    # cached: every op call asks, and the answer is fixed for the process (triton's mode is
    # set when it is first imported); uncached it cost ~4 us of host time per op call
    if not available() or not runs_on(device_type):
        return None
    return importlib.import_module(f"{__name__}.{name}")
