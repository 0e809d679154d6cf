"""For the tests that start a process group: a free TCP port on the loopback interface, and
ranks started with a deadline that each return a dict of results."""

import multiprocessing
import os
import socket
import tempfile
import time

import pytest
import torch

# loaded in every spawned rank before its process group (the ranks import this module
# first): loaded after it, by a third party's torch._dynamo say, it pins the group and the
# rank may abort at exit (why: quantscope._oplib.never_traced; test_group_released.py)
import torch.distributed.nn
import torch.multiprocessing as mp

# The ranks are forked from a server process that has imported torch, quantscope and the
# tiny Llama's transformers modules once per test worker: a spawned rank imported them anew,
# seconds each under make test's load, times two ranks, times every module that starts a
# group (preloading quantscope and transformers took 5 distributed modules from 157 s to
# 106 s). The server is single-threaded (fork-safe, unlike a pytest worker), never starts a
# group, and reads no environment at import; start_ranks gives each rank its parent's
# environment, as a spawn would. (The server imports from its own default sys.path, Python
# 3.11 ignores the parent's: only installed modules and PYTHONPATH's are preloaded, a failed
# preload is skipped silently; torch.distributed.nn for the reason above.)
multiprocessing.set_forkserver_preload(["torch", "torch.distributed.nn", "torch.multiprocessing",
                                         "quantscope", "quantscope.calibration", "transformers",
                                         "transformers.models.llama.modeling_llama"])


def start_ranks(fn, args: tuple, nprocs: int) -> mp.ProcessContext:
    """``mp.spawn(fn, args, nprocs, join=False)``, the processes forked from the server that
    has torch and quantscope loaded: ``fn(rank, *args)`` runs in each with this process's
    ``os.environ``."""
    return mp.start_processes(_with_environ, args=(dict(os.environ), fn, args), nprocs=nprocs,
                              join=False, start_method="forkserver")


def _with_environ(r, environ, fn, args):
    os.environ.clear()
    os.environ.update(environ)
    fn(r, *args)


def free_port() -> int:
    """A port nothing listens on now (the OS picks it; closed again before it is returned)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(scenarios, world: int, timeout_s: float) -> list[dict]:
    """Run ``scenarios(rank, out)`` (a module-level function filling the dict ``out`` with
    results as it goes) in ``world`` gloo processes of one group, whose collectives wait
    ``timeout_s`` for a peer. A rank that raises adds ``out["crash"]`` (a traceback) to what
    it had; a run past a few timeouts (a rank left waiting) kills the ranks and fails the
    test instead of hanging."""
    with tempfile.TemporaryDirectory() as tmp:
        ctx = start_ranks(_rank_main, (world, tmp, scenarios, timeout_s), world)
        deadline = time.monotonic() + 6 * timeout_s + _START_S
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                pytest.fail("the spawned ranks hung")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False)
                for r in range(world)]


#: seconds a spawned rank may take to start (its imports, on a loaded machine) before the
#: group's short timeout applies
_START_S = 120


def _all_started(tmp, r, world) -> None:
    """Wait until every rank has started: the group's timeout then measures collectives, not
    a peer still importing (under ``make test``'s load that took past 20 s, and the waiting
    rank's init timed out)."""
    open(os.path.join(tmp, f"started{r}"), "w").close()
    deadline = time.monotonic() + _START_S
    while not all(os.path.exists(os.path.join(tmp, f"started{i}")) for i in range(world)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {r}: a peer did not start within {_START_S} s")
        time.sleep(0.05)


def _rank_main(r, world, tmp, scenarios, timeout_s):
    import datetime
    import traceback

    import torch.distributed as dist

    torch.set_num_threads(1)
    out = {}
    try:
        _all_started(tmp, r, world)
        # a file store in the spawn's own folder: no port that a parallel test could take
        # between choosing it and binding it
        store = f"file://{os.path.join(tmp, 'store')}"
        dist.init_process_group("gloo", init_method=store, rank=r, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        scenarios(r, out)
    except Exception:  # noqa: BLE001 -- any failure goes back to the parent
        out["crash"] = traceback.format_exc()
    finally:  # a group left alive aborts the process at exit ('terminate called ...')
        if dist.is_initialized():
            dist.destroy_process_group()
    torch.save(out, os.path.join(tmp, f"rank{r}.pt"))


def rank_results(ranks: list[dict], key) -> list:
    """Every rank's result ``key``; fails with a rank's crash where it has none."""
    for r, out in enumerate(ranks):
        assert key in out, f"rank {r} crashed before {key!r}:\n{out.get('crash')}"
    return [out[key] for out in ranks]


def error_text(fn, *args, **kwargs) -> str | None:
    """``fn(*args, **kwargs)``'s exception as ``"Type: message"`` (None: it returned): what a
    rank reports for the parent to compare across ranks."""
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 -- the parent compares the ranks' errors
        return f"{type(e).__name__}: {e}"
    return None
