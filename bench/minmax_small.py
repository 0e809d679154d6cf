"""Per-call cost of the accumulating min-max observers on small and medium CPU batches,
against torch.ao's, in one interleaved run (thread CPU time: the machines are shared).

``qs`` is the observer as shipped (its cached CPU step, observers/minmax_step.py); ``general``
the same class with ``cached_cpu_step = False``, forward's general path (the code before that
step existed); ``ao`` torch.ao's observer of the same kind. Ratios are ao / qs (above 1:
quantscope faster). ``python bench/minmax_small.py [reps]``; not part of ``make bench``.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from torch.ao.quantization import observer as ao

from quantscope import QuantSpec
from quantscope.observers import MovingAverageMinMaxObserver, StaticMinMaxObserver


class GeneralStatic(StaticMinMaxObserver):
    cached_cpu_step = False


class GeneralEMA(MovingAverageMinMaxObserver):
    cached_cpu_step = False


KINDS = {  # (quantscope class, its general-path twin, torch.ao class, layout)
    "static tensor": (StaticMinMaxObserver, GeneralStatic, ao.MinMaxObserver, "tensor"),
    "static channel": (StaticMinMaxObserver, GeneralStatic, ao.PerChannelMinMaxObserver,
                       "channel"),
    "ema tensor": (MovingAverageMinMaxObserver, GeneralEMA, ao.MovingAverageMinMaxObserver,
                   "tensor"),
}


def interleaved(fns: dict, reps: int, inner: int) -> dict:
    """Median thread-CPU seconds per call of each function, A B C C B A ... after a warm-up."""
    for fn in fns.values():
        for _ in range(3 * inner):
            fn()
    samples = {k: [] for k in fns}
    for r in range(reps):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            t0 = time.thread_time()
            for _ in range(inner):
                fns[name]()
            samples[name].append((time.thread_time() - t0) / inner)
    return {k: statistics.median(v) for k, v in samples.items()}


def main(reps: int = 9) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"{'kind':15s} {'elements':>9s} {'ao/general':>10s} {'ao/qs':>7s} {'general/qs':>10s}")
    for kind, (cls, general, peer, layout) in KINDS.items():
        for n in (256, 2048, 16384, 65536, 262144, 1048576):
            x = torch.randn(64, n // 64)  # channel: 64 rows (torch.ao's ch_axis 0)
            spec = QuantSpec("int8", layout)
            fns = {name: (lambda o=o: o(x)) for name, o in  # noqa: B023 (called here)
                   (("qs", cls(spec)), ("general", general(spec)), ("ao", peer()))}
            t = interleaved(fns, reps, max(1, 100_000 // n))
            print(f"{kind:15s} {n:9d} {t['ao'] / t['general']:10.2f} {t['ao'] / t['qs']:7.2f} "
                  f"{t['general'] / t['qs']:10.2f}", flush=True)


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
