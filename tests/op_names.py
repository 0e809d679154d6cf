"""Which ops a piece of code dispatches: how tests without a GPU prove that a device path
calls the ``quantscope::`` ops (on the ``meta`` device every op has a fake implementation)."""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode


class OpNames(TorchDispatchMode):
    """Counts every op dispatched under it by name (``"quantscope.unit_minmax"``,
    ``"aten.amin"``, ...): ``calls`` (a Counter), ``names`` (those seen)."""

    def __init__(self):
        super().__init__()
        self.calls = Counter()

    @property
    def names(self) -> set[str]:
        return set(self.calls)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))
