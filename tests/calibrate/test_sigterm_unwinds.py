"""``sigterm_unwinds`` (the sequential pass's SIGTERM handling), in this process with the
signal's final delivery recorded instead of sent: a first SIGTERM raises ``Terminated``, a
BaseException no ``except Exception`` stops; one that comes while unwinding, or once the
cleanup has marked itself quiet, is not raised (the cleanup runs whole) and is the one
delivered at the end; a handler the program set meanwhile is kept."""

import os
import shutil
import signal
import time

import pytest

from quantscope.calibration.run.seq_cache import Terminated, sigterm_unwinds


@pytest.fixture
def delivered(monkeypatch):
    """The signals ``sigterm_unwinds`` delivers on leaving (recorded, not sent), with
    SIGTERM's default handler around the test (whatever the test runner set)."""
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sent = []
    monkeypatch.setattr(signal, "raise_signal", sent.append)
    try:
        yield sent
    finally:
        signal.signal(signal.SIGTERM, before)


def _sigterm():
    """SIGTERM to this process, its handler run before this returns (a sleep is woken by
    it; a handler that returns lets the sleep go on for its few milliseconds)."""
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)


def test_a_second_sigterm_while_unwinding_waits_for_the_cleanup(delivered):
    cleaned = []
    with pytest.raises(Terminated), sigterm_unwinds():
        try:
            _sigterm()
            pytest.fail("the first SIGTERM did not stop the run")
        finally:
            _sigterm()  # (raised again, it would cut the cleanup short)
            cleaned.append("whole")
    assert cleaned == ["whole"]
    assert delivered == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_first_sigterm_once_the_cleanup_is_quiet_is_delivered_after_it(delivered):
    cleaned = []
    with sigterm_unwinds() as unwinding:
        try:
            pass
        finally:
            unwinding.quiet = True
            _sigterm()
            cleaned.append("whole")
    assert cleaned == ["whole"] and unwinding.fired
    assert delivered == [signal.SIGTERM]


def test_except_exception_does_not_stop_a_sigterm(delivered):
    with pytest.raises(Terminated), sigterm_unwinds():
        try:
            _sigterm()
        except Exception:  # noqa: BLE001 (what a library's fallback does)
            pytest.fail("Terminated was taken for an Exception")
    assert delivered == [signal.SIGTERM]


def test_no_sigterm_delivers_nothing_and_a_handler_set_inside_is_kept(delivered):
    def own(signum, frame):
        pass

    with sigterm_unwinds():
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, own)
        signal.signal(signal.SIGTERM, own)  # (set while the run holds its own)
    assert signal.getsignal(signal.SIGTERM) is own
    assert delivered == []


def test_a_sigterm_as_a_finished_sequential_run_cleans_up_waits_for_the_cleanup(
        delivered, tmp_path, monkeypatch):
    # it raised Terminated inside the cleanup, which then stopped before removing the spill
    # folder (the run had ended: its handler was still set)
    pytest.importorskip("transformers")
    from tiny_models import llama

    from quantscope.calibration import Sequential, calibrate

    real = shutil.rmtree

    def rmtree(path, **kwargs):  # the cleanup's last step
        _sigterm()
        real(path, **kwargs)

    model, batches = llama()
    with monkeypatch.context() as patched:
        patched.setattr(shutil, "rmtree", rmtree)
        calibrate(model, batches, "w8a8", progress=False,
                  sequential=Sequential(cache_budget_mb=0, cache_dir=tmp_path))
    assert delivered == [signal.SIGTERM]
    assert not list(tmp_path.iterdir())


def test_a_sigterm_as_the_handler_is_set_still_restores_it(delivered, monkeypatch):
    # the handler was set before the try: a SIGTERM at once raised outside it, and the
    # handler stayed, ignoring every later SIGTERM
    real = signal.signal

    def set_then_signalled(signum, handler):
        before = real(signum, handler)
        if callable(handler):  # (the run's own)
            _sigterm()
        return before

    with pytest.raises(Terminated), monkeypatch.context() as patched:
        patched.setattr(signal, "signal", set_then_signalled)
        with sigterm_unwinds():
            pytest.fail("the body ran")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert delivered == [signal.SIGTERM]
