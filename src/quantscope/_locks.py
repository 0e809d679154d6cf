"""A lock a forked child can take: a fork (a DataLoader worker, a 'fork' pool) while another
thread held a plain ``threading.Lock`` leaves the child waiting for a release that never
comes, since the holder does not exist there."""

from __future__ import annotations

import os
import threading

__all__ = ["ForkSafeLock"]


class ForkSafeLock:
    """A ``threading.Lock`` (``with lock: ...``; ``reentrant``: an ``RLock``) renewed in every
    forked child. For module-level locks: the fork handler keeps the lock alive for the life of
    the process.

    The child's lock is held as the plain lock's would be where the thread that forked held
    it (a fork inside ``with lock:``): that thread goes on in the child, and its ``with``
    blocks release the renewed lock as they would have released the original (re-entered
    ones too, and in a child that forks again inside them); a lock another thread held is free
    in the child, to every thread."""

    def __init__(self, reentrant: bool = False):
        self._kind = threading.RLock if reentrant else threading.Lock
        self._lock = self._kind()
        self._owner: int | None = None  # the holding thread, written while holding the lock
        self._depth = 0
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._renew)

    def _renew(self) -> None:
        # runs in the child, on the thread that forked, whose ident it keeps
        depth = self._depth if self._owner == threading.get_ident() else 0
        self._lock = self._kind()
        self._owner, self._depth = (self._owner if depth else None), depth
        for _ in range(depth):
            self._lock.acquire()

    def __enter__(self):
        self._lock.acquire()
        self._owner = threading.get_ident()
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if not self._depth:
            self._owner = None
        self._lock.release()
