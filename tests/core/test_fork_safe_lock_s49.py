"""``ForkSafeLock`` in a child forked by the thread that holds it (review s49): the child's
``with`` exits release the renewed lock as they released the plain lock it stands for; they
raised "cannot release un-acquired lock" (reentrant) / "release unlocked lock", since the
renewal left the new lock free. Once the child has left the blocks, the lock is free there.
s51 (mutants F01 / F03 / F05 of s50, which no test killed): a child forking again inside the
blocks, and a plain lock (or a reentrant one taken by a new thread) that another thread held
at the fork."""

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


def _wait(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1


def _fork_inside(lock, depth: int, generations: int = 1) -> int:
    """Fork inside ``depth`` nested ``with lock:``, and where ``generations`` > 1 the child
    forks again there (a worker starting its own workers), and so on; the first child's exit
    status: 0 when every forked process left the blocks without an error and the lock was then
    free there, 1 on an error, 2 when still held."""
    def nest(n):
        if n:
            with lock:
                return nest(n - 1)
        for _ in range(generations):
            pid = os.fork()
            if pid:
                return pid  # this process's child, or in the last generation 0
        return 0

    parent = os.getpid()
    try:
        pid = nest(depth)
    except RuntimeError:
        if os.getpid() == parent:
            raise
        os._exit(1)  # the child's exit from the blocks failed
    if os.getpid() != parent:  # a forked process, out of the blocks
        signal.alarm(10)
        status = _wait(pid) if pid else 0  # its own child's first
        os._exit(status or (0 if _free_to_another_thread(lock) else 2))
    return _wait(pid)


@pytest.mark.parametrize("reentrant, depth, generations",
                         [(True, 1, 1), (True, 3, 1), (False, 1, 1),
                          (True, 1, 2), (True, 3, 3), (False, 1, 2), (False, 1, 3)])
def test_the_forking_holder_releases_in_the_child_as_the_plain_lock_did(reentrant, depth,
                                                                        generations):
    """Forked again inside the child's blocks (mutants F03 / F05, s50: a child's renewal
    that kept no holder or no depth), the grandchild's exits release its renewed lock too:
    the child's renewal keeps the holder and the depth for the next fork."""
    kind = threading.RLock if reentrant else threading.Lock
    assert _fork_inside(kind(), depth, generations) == 0  # what ForkSafeLock stands in for
    lock = ForkSafeLock(reentrant=reentrant)
    assert _fork_inside(lock, depth, generations) == 0
    assert _free_to_another_thread(lock)  # and in the parent


def _take(lock) -> bool:
    with lock:
        return True


@pytest.mark.parametrize("reentrant", [False, True], ids=["plain", "reentrant"])
@pytest.mark.parametrize("taker", ["forking thread", "new thread"])
def test_a_lock_held_by_another_thread_is_free_in_the_child(reentrant, taker):
    """A lock another thread holds at the fork (a DataLoader worker forked while a thread is
    inside ``kernels._lock`` or ``exclusive._BUSY_LOCK``, plain locks) is free in the child,
    to the thread that forked and to a new one (mutant F01, s50: the renewal held it for
    the forking thread, which a reentrant lock taken again by that thread let through)."""
    lock = ForkSafeLock(reentrant=reentrant)
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
            signal.alarm(5)  # a lock left held: killed here
            free = _take(lock) if taker == "forking thread" else _free_to_another_thread(lock)
            os._exit(0 if free else 2)
        assert _wait(pid) == 0
    finally:
        release.set()
        t.join()
