"""Which ops a piece of code dispatches: how tests without a GPU prove that a device path
calls the ``quantscope::`` ops (on the ``meta`` device every op has a fake implementation)."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OpNames(TorchDispatchMode):
    """Counts every op dispatched under it by name (``"quantscope.unit_minmax"``,
    ``"aten.amin"``, ...): ``calls`` (a Counter), ``names`` (those seen); ``order``: each op
    in turn, by its overload's name (``"aten.empty.memory_format"``)."""

    def __init__(self):
        super().__init__()
        self.calls = Counter()
        self.order: list[str] = []

    @property
    def names(self) -> set[str]:
        return set(self.calls)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[str(func.overloadpacket)] += 1
        self.order.append(str(func))
        return func(*args, **(kwargs or {}))


class BlockingUploads(TorchDispatchMode):
    """Records every blocking host-to-device copy dispatched under it (``found``: op names):
    on CUDA such a copy waits for all the work queued before it (PyTorch synchronizes the
    stream after a pageable copy with ``non_blocking=False``), so a pass that should run
    ahead of the GPU must make none."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if name in ("aten.to", "aten._to_copy", "aten.copy_"):
            bound = {a.name: v for a, v in zip(func._schema.arguments, args)} | kwargs
            src = bound.get("src" if name == "aten.copy_" else "self")
            dst = bound["self"].device if name == "aten.copy_" else bound.get("device")
            if dst is None and isinstance(bound.get("other"), torch.Tensor):
                dst = bound["other"].device  # Tensor.to(other)
            if src.device.type == "cpu" and dst is not None and torch.device(dst).type != "cpu" \
                    and not bound.get("non_blocking", False):
                self.found.append(name)
        return func(*args, **kwargs)


class Copies(TorchDispatchMode):
    """Records (``found``: op names) every op whose output is a new tensor of at least ``x``'s
    size, a copy of the input ``x`` (a view of it shares its storage): how a test proves that
    a path reads ``x`` in place."""

    def __init__(self, x: torch.Tensor):
        super().__init__()
        self.numel, self.storage, self.found = x.numel(), x.untyped_storage().data_ptr(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel \
                    and t.untyped_storage().data_ptr() != self.storage:
                self.found.append(str(func.overloadpacket))
        return out
