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
    the process."""

    def __init__(self, reentrant: bool = False):
        self._kind = threading.RLock if reentrant else threading.Lock
        self._lock = self._kind()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._renew)

    def _renew(self) -> None:
        self._lock = self._kind()

    def __enter__(self):
        self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()
