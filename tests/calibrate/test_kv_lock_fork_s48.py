"""The KV cache's routing lock is renewed in a forked child (s48 review): a process forked
while another thread was inside ``kv_cache.attach`` / ``detach`` left the child's plain
``RLock`` held by a thread that does not exist there, so the child's own next attach (a
DataLoader worker's calibrate with ``kv_cache``, an ``apply``) hung forever."""

from __future__ import annotations

import os
import signal
import sys
import threading

import pytest

from quantscope._locks import ForkSafeLock
from quantscope.calibration.structure import kv_cache

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "darwin",
                                reason="needs os.fork")


def _child_takes(lock) -> bool:
    """Whether a child forked now takes ``lock`` (re-entrantly) within 5 s."""
    pid = os.fork()
    if pid == 0:  # the child: no torch kernels, no pytest teardown
        signal.alarm(5)
        with lock, lock:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


@pytest.mark.parametrize("lock", [kv_cache._LOCK, ForkSafeLock(reentrant=True)],
                         ids=["kv_cache", "reentrant"])
def test_a_child_forked_while_another_thread_holds_the_lock_takes_it(lock):
    inside, release = threading.Event(), threading.Event()

    def hold():
        with lock:
            inside.set()
            release.wait()

    t = threading.Thread(target=hold)
    t.start()
    inside.wait()
    try:
        assert _child_takes(lock)
    finally:
        release.set()
        t.join()
    with lock, lock:  # re-entrant in the parent too
        pass
