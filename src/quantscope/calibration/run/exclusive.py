"""One calibration at a time per model: a second call on a model (or a module of it) that a
running ``calibrate`` holds, from one of its forward hooks or from another thread, would feed
its batches to the running call's observers."""

from __future__ import annotations

import contextlib
import os
import weakref

from torch import nn

from ..._locks import ForkSafeLock

__all__ = ["calibrating"]

#: the modules of the models calibrate_with is running on (in any thread): a call on one of
#: them before it returns (from a forward hook, or another thread) would feed its batches to
#: the running call's observers
_BUSY: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_BUSY_LOCK = ForkSafeLock()
#: in a forked child, the modules a call of the parent held at the fork: that call does not
#: exist here, but its hooks (and any in-place change, SmoothQuant's) were copied with them
_FORKED_BUSY: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    _FORKED_BUSY.update(_BUSY)
    _BUSY.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def calibrating(model):
    """Hold ``model``'s modules for one calibration: raises ``ValueError`` where a call that
    has not returned holds one of them."""
    if not isinstance(model, nn.Module):
        yield  # _checked says what model must be
        return
    modules = list(model.modules())
    with _BUSY_LOCK:
        if any(m in _FORKED_BUSY for m in modules):
            raise ValueError("calibrate: the model, or a module of it, was being calibrated "
                             "when this process was forked from its parent: its copy here "
                             "carries that call's hooks and any change it had made in place; "
                             "calibrate a copy made or loaded in this process, or fork once "
                             "the parent's call has returned")
        if any(m in _BUSY for m in modules):
            raise ValueError("calibrate: the model, or a module of it, is being calibrated by a "
                             "call that has not returned (from a forward hook, or another "
                             "thread): its observers would record this call's batches; "
                             "calibrate it once that call returns")
        _BUSY.update(modules)
    try:
        yield
    finally:
        with _BUSY_LOCK:
            for m in modules:
                _BUSY.discard(m)
