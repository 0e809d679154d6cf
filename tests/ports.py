"""For the tests that start a process group: a free TCP port on the loopback interface, and
ranks spawned with a deadline that each return a dict of results."""

import os
import socket
import tempfile
import time

import pytest
import torch
import torch.multiprocessing as mp


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
        ctx = mp.spawn(_rank_main, args=(world, free_port(), tmp, scenarios, timeout_s),
                       nprocs=world, join=False)
        deadline = time.monotonic() + 6 * timeout_s
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                pytest.fail("the spawned ranks hung")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False)
                for r in range(world)]


def _rank_main(r, world, port, tmp, scenarios, timeout_s):
    import datetime
    import traceback

    import torch.distributed as dist

    torch.set_num_threads(1)
    out = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        scenarios(r, out)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 -- any failure goes back to the parent
        out["crash"] = traceback.format_exc()
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
