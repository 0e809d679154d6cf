"""``ForkSafeLock`` in a child forked by the thread that holds it (review s49): the child's
``with`` exits release the renewed lock as they released the plain lock it stands for; they
raised "cannot release un-acquired lock" (reentrant) / "release unlocked lock", since the
renewal left the new lock free. Once the child has left the blocks, the lock is free there."""

from __future__ import annotations

import os
import signal
import sys
import threading

import pytest

from quantscope._locks import ForkSafeLock

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "darwin",
                                reason="needs os.fork")


def _free_to_another_thread(lock) -> bool:
    took = threading.Event()

    def take():
        with lock:
            took.set()

    threading.Thread(target=take, daemon=True).start()
    return took.wait(5)


def _fork_inside(lock, depth: int) -> int:
    """Fork inside ``depth`` nested ``with lock:``; the child's exit status: 0 when it left
    them without an error and the lock was then free, 1 on an error, 2 when still held."""
    def nest(n):
        if not n:
            return os.fork()
        with lock:
            return nest(n - 1)

    parent = os.getpid()
    try:
        pid = nest(depth)
    except RuntimeError:
        if os.getpid() == parent:
            raise
        os._exit(1)  # the child's exit from the blocks failed
    if pid == 0:
        signal.alarm(10)
        os._exit(0 if _free_to_another_thread(lock) else 2)
    _, status = os.waitpid(pid, 0)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1


@pytest.mark.parametrize("reentrant, depth", [(True, 1), (True, 3), (False, 1)])
def test_the_forking_holder_releases_in_the_child_as_the_plain_lock_did(reentrant, depth):
    kind = threading.RLock if reentrant else threading.Lock
    assert _fork_inside(kind(), depth) == 0  # what ForkSafeLock stands in for
    lock = ForkSafeLock(reentrant=reentrant)
    assert _fork_inside(lock, depth) == 0
    assert _free_to_another_thread(lock)  # and in the parent


def test_a_lock_held_by_another_thread_is_free_in_the_child():
    lock = ForkSafeLock(reentrant=True)
    with lock:  # the forking thread held it once and let go: nothing left to hold
        pass
    inside, release = threading.Event(), threading.Event()

    def hold():
        with lock:
            inside.set()
            release.wait()

    t = threading.Thread(target=hold)
    t.start()
    inside.wait()
    try:
        pid = os.fork()
        if pid == 0:
            signal.alarm(10)
            with lock:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    finally:
        release.set()
        t.join()
