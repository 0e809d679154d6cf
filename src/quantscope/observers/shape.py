"""The last observed shape of an observer: the ``observed_shape`` buffer and its Python mirror
``Observer._last_shape`` (eager ``forward`` reads the mirror, never the device tensor), and the
token count of an input (``observed_tokens``).

Under ``torch.compile`` the mirror is written, never read: dynamo would guard on its value,
which changes with every token count, and recompile per input shape (the 9th shape a hard
error under ``fullgraph=True``). The unit count then comes from the state's size, static
once the first batch has sized it, and the buffer is written from ``x.shape``'s symbols.
"""

from __future__ import annotations

import torch

from .._numerics import upload

__all__ = ["record_shape", "tokens_of", "units_before"]


def tokens_of(x: torch.Tensor) -> int:
    """How many tokens (rows of the last axis) ``x`` holds: what ``observed_tokens`` counts."""
    return x.numel() // x.shape[-1] if x.dim() else 1


def units_before(obs) -> int | None:
    """The unit count ``obs``'s state was built for (None before its first batch)."""
    if torch.compiler.is_compiling() and "min_vals" in obs._sized_buffers():
        state = obs._buffers["min_vals"]  # one value per unit in every family keeping it
        if state.dim() == 1:
            return state.shape[0] or None  # (empty: not sized yet)
    last = obs._last_shape
    return None if last is None else obs.spec.layout.num_units(last)


def record_shape(obs, shape) -> None:
    """Record ``shape`` in ``obs.observed_shape`` and its Python mirror."""
    shape = tuple(shape)
    if torch.compiler.is_compiling():  # symbolic sizes: one graph for every token count
        old = obs._buffers["observed_shape"]
        new = torch.tensor(shape, dtype=torch.int64, device=old.device)
        if old.shape == new.shape:  # (the rank is static: in place after the first call)
            old.copy_(new)
        else:
            obs.observed_shape = new
        obs._last_shape = shape
    elif shape != obs._last_shape:  # eager: an upload only when the shape changes
        obs._last_shape = shape
        obs.observed_shape = upload(shape, obs.observed_shape.device, torch.int64)
