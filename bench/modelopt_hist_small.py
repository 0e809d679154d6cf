"""Per-call cost of ModelOpt's ``HistogramCalibrator.collect``: quantscope's compat class
against ModelOpt 0.47's own, which lives in the peers' venv, so each contender runs in its own
worker process (thread CPU time, one torch thread each) and this driver interleaves their
samples (A B C, then C B A, ...) and takes medians.

Each sample is a fresh calibrator (2048 bins) fed ``inner`` batches of ``2 x 8 x (n / 16)``
float32 values after one untimed batch that sizes its state: ``fixed`` batches are the same
values in another order, ``growing`` ones each 1 % wider than the last (every call grows the
grid: ModelOpt's ``arange`` of the new edges, quantscope's ``_append_bins``). Both sides draw
the same batches (torch's seeded generator, the same torch in both venvs), and their
histograms after a sample must be equal (checked: the counts' sum and a weighted sum).

``python bench/modelopt_hist_small.py [reps] [old_src]`` (ModelOpt under the peers' python:
``.peers``, or $QUANTSCOPE_PEER_PYTHON); ``old_src``, a ``src`` folder of
another checkout (``git archive main src | tar -x -C /tmp/old``), adds it as a contender.
Not part of ``make bench``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = (256, 1024, 16384, 131072, 1 << 20)
PEERS = os.environ.get("QUANTSCOPE_PEER_PYTHON", ROOT / ".peers" / "bin" / "python")


def batches(n: int, growing: bool, count: int):
    import torch

    base = torch.randn(n, generator=torch.Generator().manual_seed(n))
    return [(base.roll(i) * (1.01 ** i if growing else 1.0)).reshape(2, 8, n // 16)
            for i in range(count)]


def inner(n: int) -> int:
    return max(8, min(64, (1 << 20) // n))


def worker(side: str) -> None:
    """Answer each request line ``{"n", "growing"}`` with one sample's seconds per call and
    the histogram's check sums."""
    import torch

    torch.set_num_threads(1)
    if side == "modelopt":
        from modelopt.torch.quantization.calib.histogram import HistogramCalibrator
    else:
        from quantscope.compat.modelopt import HistogramCalibrator
    cache = {}
    for line in sys.stdin:
        req = json.loads(line)
        key = (req["n"], req["growing"])
        if key not in cache:
            cache = {key: batches(req["n"], req["growing"], 1 + inner(req["n"]))}
        xs = cache[key]
        cal = HistogramCalibrator(num_bins=2048)
        cal.collect(xs[0])
        t0 = time.thread_time()
        for x in xs[1:]:
            cal.collect(x)
        dt = (time.thread_time() - t0) / (len(xs) - 1)
        h = cal._calib_hist.double()
        sums = [float(h.sum()), float((h * torch.arange(h.numel())).sum()), h.numel()]
        print(json.dumps({"s": dt, "hist": sums}), flush=True)


def start(python: str, side: str, src: str | None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=src or str(ROOT / "src"), OMP_NUM_THREADS="1")
    return subprocess.Popen([python, __file__, "--worker", side], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)


def ask(proc: subprocess.Popen, n: int, growing: bool) -> dict:
    proc.stdin.write(json.dumps({"n": n, "growing": growing}) + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def main(reps: int = 9, old_src: str | None = None) -> None:
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip())
    workers = {"modelopt": start(str(PEERS), "modelopt", None),
               "quantscope": start(sys.executable, "quantscope", None)}
    if old_src:
        workers["quantscope old"] = start(sys.executable, "quantscope", old_src)
    names = list(workers)
    print("us per collect (medians of", reps, "interleaved samples, one thread); ratio = "
          "ModelOpt / contender (above 1: faster than ModelOpt)")
    print(f"{'ranges':8s} {'values':>8s} " + " ".join(f"{k:>15s}" for k in names)
          + " " + " ".join(f"{'ratio ' + k:>22s}" for k in names[1:]))
    for growing in (False, True):
        for n in SIZES:
            samples = {k: [] for k in names}
            hists = {}
            for r in range(reps + 1):  # the first round warms up
                for k in (names if r % 2 == 0 else names[::-1]):
                    out = ask(workers[k], n, growing)
                    hists[k] = out["hist"]
                    if r:
                        samples[k].append(out["s"])
            if len({json.dumps(h) for h in hists.values()}) != 1:
                raise RuntimeError(f"histograms differ at n={n}, growing={growing}: {hists}")
            med = {k: statistics.median(v) * 1e6 for k, v in samples.items()}
            print(f"{'growing' if growing else 'fixed':8s} {n:8d} "
                  + " ".join(f"{med[k]:15.1f}" for k in names) + " "
                  + " ".join(f"{med['modelopt'] / med[k]:22.2f}" for k in names[1:]),
                  flush=True)
    for proc in workers.values():
        proc.stdin.close()
        proc.wait()
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip())


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2])
    else:
        args = sys.argv[1:]
        main(*([int(args[0])] if args else []), *args[1:2])
