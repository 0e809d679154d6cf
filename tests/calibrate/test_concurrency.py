"""quantscope under threads, forks and re-entrant calls (found by probing): apply / remove on
separate models in two threads, a fork while another thread holds the kernels' build lock,
and calibrate called on a model its own running calibration holds."""

import os
import sys
import threading
import time

import pytest
import torch
from torch import nn

import quantscope
from quantscope import kernels


def _tiny(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))


def _batches(n=2, scale=1.0):
    g = torch.Generator().manual_seed(1)
    return [scale * torch.randn(4, 16, generator=g) for _ in range(n)]


def test_apply_and_remove_in_two_threads_on_their_own_models():
    # apply() read the set of active handles while the other thread's apply() / remove()
    # changed it: "RuntimeError: Set changed size during iteration"
    models = [_tiny(i) for i in range(2)]
    calibs = [quantscope.calibrate(m, _batches(), "w8a8", progress=False) for m in models]
    # other applied models keep the set large (the weights calibrated: apply checks them)
    others = [_tiny(0) for _ in range(300)]
    keep = [calibs[0].apply(m) for m in others]
    errors, stop = [], threading.Event()

    def loop(i):
        while not stop.is_set():
            try:
                calibs[i].apply(models[i]).remove()
            except Exception as e:  # noqa: BLE001 (reported by the test)
                errors.append(repr(e))
                stop.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: widens the window the race needs
    try:
        threads = [threading.Thread(target=loop, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        stop.wait(3.0)
        stop.set()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
        for h in keep:
            h.remove()
    assert errors == []


def _load_a_kernel():
    kernels._libs.pop("unit_minmax", None)  # as if for the first time
    kernels.lib("unit_minmax")


def _apply_and_calibrate():
    model = _tiny()
    quantscope.calibrate(model, _batches(), "w8a8", progress=False).apply(model).remove()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
@pytest.mark.parametrize("lock, child", [
    ("quantscope.kernels:_lock", _load_a_kernel),
    ("quantscope.calibration.results.apply:_APPLIED_LOCK", _apply_and_calibrate),
    ("quantscope.calibration.run.exclusive:_BUSY_LOCK", _apply_and_calibrate)],
    ids=["kernels", "applied", "busy"])
def test_a_child_forked_while_another_thread_holds_a_lock_goes_on(lock, child):
    # a DataLoader worker forked while another thread built a kernel inherited the lock
    # held by a thread it does not have, and hung at its first observer
    import importlib

    module, name = lock.split(":")
    module = importlib.import_module(module)
    held, release = threading.Event(), threading.Event()

    def hold():
        with getattr(module, name):
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(10)
    pid = os.fork()
    if pid == 0:  # the child, on one thread as a DataLoader worker (torch's OpenMP pool
        try:  # does not survive a fork)
            torch.set_num_threads(1)
            child()
        finally:
            os._exit(0)
    release.set()
    holder.join()
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail(f"the forked child hung on {lock}")


@pytest.mark.parametrize("inner", ["model", "submodule"])
def test_calibrate_inside_its_own_calibration_of_the_model_is_refused(inner):
    # the outer calibration's observers recorded the inner call's batches: its input scale
    # 5x too large, without a word
    model = _tiny()
    calls = []

    def hook(module, args, out):
        if not calls:
            calls.append(1)
            target = model if inner == "model" else model[0]
            quantscope.calibrate(target, _batches(scale=100.0), "w8a8", progress=False)

    handle = model[2].register_forward_hook(hook)
    with pytest.raises(ValueError, match="is being calibrated by a call that has not returned"):
        quantscope.calibrate(model, _batches(), "w8a8", progress=False)
    handle.remove()
    # the refused call released the model: it calibrates as a model never hooked does
    again = quantscope.calibrate(model, _batches(), "w8a8", progress=False)
    assert again.quantizes_like(quantscope.calibrate(_tiny(), _batches(), "w8a8",
                                                     progress=False))


def test_calibrate_of_another_model_inside_a_calibration_runs():
    model, other = _tiny(), _tiny(3)
    got = {}

    def hook(module, args, out):
        if not got:
            got["inner"] = quantscope.calibrate(other, _batches(), "w8a8", progress=False)

    model[0].register_forward_hook(hook)
    quantscope.calibrate(model, _batches(), "w8a8", progress=False)
    alone = quantscope.calibrate(_tiny(3), _batches(), "w8a8", progress=False)
    assert got["inner"].quantizes_like(alone)


@pytest.mark.parametrize("grad_mode", [torch.inference_mode, torch.no_grad])
def test_a_forward_from_another_thread_during_calibrate_runs_unobserved(grad_mode):
    # the observers recorded that batch (inference mode: a range 100x too wide, silently) or
    # failed in it (no_grad: torch refused the in-place update of an inference tensor)
    model = _tiny()
    batches = _batches(3)
    ref = quantscope.calibrate(model, batches, "w8a8", observer="static_minmax",
                               progress=False)
    holding, resume, out, foreign = threading.Event(), threading.Event(), {}, {}

    def slow():
        for i, b in enumerate(batches):
            if i == 1:  # the hooks are in place
                holding.set()
                resume.wait(30)
            yield b

    def run():
        out["c"] = quantscope.calibrate(model, slow(), "w8a8", observer="static_minmax",
                                        progress=False)

    t = threading.Thread(target=run)
    t.start()
    try:
        assert holding.wait(30)
        x = 100 * torch.randn(4, 16)
        with grad_mode():
            foreign["y"] = model(x)
        with torch.no_grad():
            assert torch.equal(foreign["y"], model(x))  # a plain forward
    finally:
        resume.set()
        t.join(60)
    for layer in ("0", "2"):
        got, want = (c.states[layer]["input"].qparams.scale for c in (out["c"], ref))
        assert torch.equal(got, want)


@pytest.mark.parametrize("nested", [False, True])
def test_a_data_parallel_model_is_refused(nested):
    # its replicas run in worker threads, which the observers do not record (a review found
    # that the thread gate would have left them unobserved without a word)
    inner = nn.DataParallel(_tiny())
    model = nn.Sequential(inner) if nested else inner
    where = "'0'" if nested else "the model"
    with pytest.raises(ValueError, match=f"calibrate: {where} is an nn.DataParallel.*module"):
        quantscope.calibrate(model, _batches(), "w8a8", progress=False)
