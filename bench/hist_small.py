"""Per-call cost of the histogram observers on small and medium CPU batches, against torch.ao's
``HistogramObserver``, in one interleaved run (thread CPU time: the machines are shared).

Each observer is per tensor with its defaults (2048 bins; int8 symmetric: ``|x|``
histograms, but ``histogram``'s signed one) and, per sample, a fresh one fed ``inner``
batches after one untimed batch that sizes its state: ``growing`` batches each 1 % wider
than the last (torch.ao re-bins its histogram on each), ``fixed`` ones the same values in
another order. ``qs`` is the observer as shipped (its cached CPU step,
observers/hist_step.py), ``general`` the same class with ``cached_cpu_step = False`` (forward's
general path), ``compat`` quantscope.compat.torch_ao.HistogramObserver (torch.ao's state,
bitwise). Ratios are ao / contender (above 1: quantscope faster); one torch thread.
``python bench/hist_small.py [reps] [name,name,...]``; not part of ``make bench``.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from torch.ao.quantization import observer as ao

import quantscope
from quantscope import QuantSpec
from quantscope.compat.torch_ao import HistogramObserver as CompatHistogram

NAMES = ("percentile", "histogram_mse", "entropy", "histogram", "mix")
SIZES = (256, 2048, 16384, 131072)


def contenders(names) -> dict:
    """``{label: factory}`` of fresh observers."""
    out = {}
    for name in names:
        out[name] = lambda n=name: quantscope.get_observer(n, QuantSpec("int8", "tensor"))

        def general(n=name):
            obs = quantscope.get_observer(n, QuantSpec("int8", "tensor"))
            obs.cached_cpu_step = False
            return obs
        out[f"{name} general"] = general
    out["compat"] = CompatHistogram
    out["ao"] = ao.HistogramObserver
    return out


def batches(n: int, dtype: torch.dtype, growing: bool, count: int) -> list[torch.Tensor]:
    base = torch.randn(n, generator=torch.Generator().manual_seed(n))
    return [(base.roll(i) * (1.01 ** i if growing else 1.0)).to(dtype) for i in range(count)]


def interleaved(factories: dict, xs: list, reps: int) -> dict:
    """Median thread-CPU seconds per call of each contender, A B C C B A ..., each sample a
    fresh observer fed xs[1:] after an untimed xs[0]."""
    samples = {k: [] for k in factories}
    for r in range(reps + 1):  # the first round warms up (kernels built, code paths run)
        for name in (list(factories) if r % 2 == 0 else list(factories)[::-1]):
            obs = factories[name]()
            obs(xs[0])
            t0 = time.thread_time()
            for x in xs[1:]:
                obs(x)
            if r:
                samples[name].append((time.thread_time() - t0) / (len(xs) - 1))
    return {k: statistics.median(v) for k, v in samples.items()}


def main(reps: int = 7, names: str = ",".join(NAMES)) -> None:
    torch.set_num_threads(1)
    factories = contenders(names.split(","))
    labels = [k for k in factories if k != "ao"]
    print("ratio ao / contender (above 1: faster than torch.ao); ao: its us per call")
    print(f"{'dtype':9s} {'ranges':7s} {'elements':>8s} {'ao us':>7s} "
          + " ".join(f"{k:>{max(7, len(k))}s}" for k in labels))
    for dtype in (torch.float32, torch.bfloat16):
        for growing in (True, False):
            for n in SIZES:
                xs = batches(n, dtype, growing, 1 + max(8, min(64, 2 ** 20 // n)))
                t = interleaved(factories, xs, reps)
                print(f"{str(dtype)[6:]:9s} {'growing' if growing else 'fixed':7s} {n:8d} "
                      f"{t['ao'] * 1e6:7.1f} "
                      + " ".join(f"{t['ao'] / t[k]:>{max(7, len(k))}.2f}" for k in labels),
                      flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(*([int(args[0])] if args else []), *args[1:2])
