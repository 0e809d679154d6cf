"""One calibration at a time per model: a second call on a model (or a module of it) that a
running ``calibrate`` holds, from one of its forward hooks or from another thread, would feed
its batches to the running call's observers."""

from __future__ import annotations

import contextlib
import weakref

from torch import nn

from ..._locks import ForkSafeLock

__all__ = ["calibrating"]

#: the modules of the models calibrate_with is running on (in any thread): a call on one of
#: them before it returns (from a forward hook, or another thread) would feed its batches to
#: the running call's observers
_BUSY: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_BUSY_LOCK = ForkSafeLock()


@contextlib.contextmanager
def calibrating(model):
    """Hold ``model``'s modules for one calibration: raises ``ValueError`` where a call that
    has not returned holds one of them."""
    if not isinstance(model, nn.Module):
        yield  # _checked says what model must be
        return
    modules = list(model.modules())
    with _BUSY_LOCK:
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
