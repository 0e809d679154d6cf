"""Statistics sync across processes: cost of a full sync, and calibration on 1 vs 2 processes.

1. Sync of a session where the input of every Linear layer of all-MiniLM-L6-v2 is
   observed by a histogram observer (per tensor, 2048 bins; per channel, 256 bins),
   on 2 gloo processes over loopback (launched with torchrun): median time of
   ``sync_observers`` (bucketed: one header all_gather, one grid all_reduce, one
   all_reduce per bucket) against syncing the observers one by one, the number of
   collectives and the payload bytes each rank sends. Floor: one all_reduce of the
   counts alone (the bytes that must move).
2. The demo calibration (w8a8, MiniLM on the demo's 64 Lee background documents) on 1
   and on 2 processes of one thread each (``calibrate(..., runtime=Runtime(distributed=True))``): wall
   time of the calibration (batches sharded, weights split by size, sync, qparams, report).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from common import Table, median_time


def _hist_observer(spec, bins):
    """The registered percentile observer: a per-unit histogram that syncs its counts."""
    import quantscope

    return quantscope.get_observer("percentile", spec, bins=bins), "percentile"


def _sync_case(label, spec, bins, linears, g) -> dict:
    import torch.distributed as dist

    from quantscope import distributed as qd

    r = dist.get_rank()
    observers = []
    for _, m in linears:
        obs, kind = _hist_observer(spec, bins)
        x = torch.randn(4, 64, m.in_features, generator=g) * (1 + r)
        x[..., 0] *= 20  # an outlier channel: ranks see different ranges
        obs(x)
        observers.append(obs)
    saved = [{k: v.clone() for k, v in o.state_dict().items()} for o in observers]

    def restore():  # every timed sync starts from the unsynced local states
        for o, sd in zip(observers, saved):
            o.load_state_dict(sd)
        dist.barrier()

    qd.sync_observers(observers)
    st = qd.last_stats()
    t_bucketed = median_time(lambda: qd.sync_observers(observers), 5, 0, restore)
    t_each = median_time(lambda: [qd.sync_observers([o]) for o in observers], 3, 0, restore)
    n_each = 0
    for o in observers:
        qd.sync_observers([o])
        n_each += qd.last_stats().collectives
    counts = torch.cat([o.hist_counts.reshape(-1) for o in observers])
    dist.barrier()
    floor = median_time(lambda: dist.all_reduce(counts.clone()), 5, 0)
    return {"case": label, "observer": kind, "observers": len(observers),
            "collectives": st.collectives, "bytes": st.bytes,
            "bucketed_ms": t_bucketed * 1e3, "one_by_one_ms": t_each * 1e3,
            "one_by_one_collectives": n_each, "floor_ms": floor * 1e3}


def worker_sync() -> None:
    import torch.distributed as dist
    from torch import nn

    from quantscope.demo.models import load_model
    from quantscope.layout import Channel
    from quantscope.spec import QuantSpec

    dist.init_process_group("gloo")
    r = dist.get_rank()
    model, _ = load_model()
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    g = torch.Generator().manual_seed(r)
    rows = [_sync_case(label, spec, bins, linears, g)
            for label, spec, bins in (("per-tensor, 2048 bins", QuantSpec(), 2048),
                                      ("per-channel, 256 bins", QuantSpec(layout=Channel(-1)),
                                       256))]
    if r == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    dist.destroy_process_group()


CALIB_CASES = (("w8a8", "minmax"), ("w8a8", "mse"))


def worker_calibrate() -> None:
    import torch.distributed as dist

    from quantscope import distributed as qd
    from quantscope.calibration import Runtime, calibrate
    from quantscope.demo.data import lee_background
    from quantscope.demo.models import load_model, token_batches

    joined = qd.init_from_env()
    world = qd.world_size()
    torch.set_num_threads(1)  # one core per process: the scaling with processes
    model, tok = load_model()
    docs = lee_background()
    docs = docs[::max(1, len(docs) // 64)][:64]  # the demo's 64 calibration documents
    batches = token_batches(tok, docs, max_length=128, batch_size=8)
    calibrate(model, batches[:1], "w8a8", progress=False,
              runtime=Runtime(distributed=joined))  # warm-up
    out = {}
    for recipe, observer in CALIB_CASES:
        if joined:
            dist.barrier()
        t, c = time.perf_counter(), time.process_time()
        calibrate(model, batches, recipe, observer=observer, progress=False,
                  runtime=Runtime(distributed=joined))
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        cpus = torch.tensor([cpu, cpu])
        if joined:  # the busiest rank's CPU time bounds the wall time on idle cores
            dist.all_reduce(cpus[:1], op=dist.ReduceOp.MAX)
            dist.all_reduce(cpus[1:])
        out[f"{recipe}/{observer}"] = {"wall": wall, "cpu_max": float(cpus[0]),
                                       "cpu_sum": float(cpus[1])}
    if qd.is_main():
        print("RESULT " + json.dumps({"world": world, "seconds": out}), flush=True)
    if joined:
        dist.destroy_process_group()


def _launch(mode: str, nproc: int) -> object:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(_port()), __file__, mode]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent / "src"))
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=600)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{mode} on {nproc} processes failed:\n{p.stdout[-2000:]}\n"
                       f"{p.stderr[-4000:]}")


def _port() -> int:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def main() -> None:
    rows = _launch("sync", 2)
    t = Table("full sync of MiniLM's Linear inputs, histogram observers, 2 gloo processes",
              ["case", "observer", "observers", "collectives", "KiB sent / rank",
               "bucketed ms", "one by one ms (collectives)", "ratio", "floor ms (counts only)"])
    for row in rows:
        t.add(row["case"], row["observer"], row["observers"], row["collectives"],
              f"{row['bytes'] / 1024:.0f}", f"{row['bucketed_ms']:.1f}",
              f"{row['one_by_one_ms']:.1f} ({row['one_by_one_collectives']})",
              f"{row['one_by_one_ms'] / row['bucketed_ms']:.1f}x", f"{row['floor_ms']:.1f}")
    t.print()
    res = {n: _launch("calibrate", n) for n in (1, 2)}
    load = os.getloadavg()[0]
    t = Table(f"demo calibration, MiniLM, 64 Lee documents in 8 batches, one thread per "
              f"process (load average {load:.1f} on {os.cpu_count()} cores)",
              ["recipe / observer", "1 process: wall s (CPU s)",
               "2 processes: wall s (CPU s busiest rank, all ranks)", "wall speed-up",
               "CPU speed-up (idle cores)"])
    for case in res[1]["seconds"]:
        a, b = res[1]["seconds"][case], res[2]["seconds"][case]
        t.add(case, f"{a['wall']:.2f} ({a['cpu_max']:.2f})",
              f"{b['wall']:.2f} ({b['cpu_max']:.2f}, {b['cpu_sum']:.2f})",
              f"{a['wall'] / b['wall']:.2f}x", f"{a['cpu_max'] / b['cpu_max']:.2f}x")
    t.print()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "sync":
        worker_sync()
    elif len(sys.argv) > 1 and sys.argv[1] == "calibrate":
        worker_calibrate()
    else:
        main()
