"""compat.quark against AMD Quark 0.13, class against class: the time of one forward (observe)
and of the qparams call (both classes' ``_calculate_qparams``) per call, each pair built from one
config (tests/compat/quark_twins.py; the tests hold their results bitwise equal), interleaved
A B A B, medians, one torch thread. ratio = Quark / quantscope (above 1: quantscope faster).

Quark's own calibration flow also counts the observed tokens in ``FakeQuantize`` (about as much
time as its observer's forward on 256 x 1024); quantscope's forward includes that count, so in
that flow the gap is smaller than the forward rows say.

Quark lives in the peers' venv (``.peers``, built by ``make peers``, or
``$QUANTSCOPE_PEER_PYTHON``): ``main`` runs this file there.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEER_PY = Path(os.environ.get("QUANTSCOPE_PEER_PYTHON", HERE.parent / ".peers" / "bin" / "python"))
SHAPES = {(8, 64): 200, (64, 256): 100, (256, 1024): 10}  # shape: calls per timed sample
CASES = {
    "per-tensor int8": ("PerTensorMinMaxObserver", {"dtype": "int8", "symmetric": True}),
    "per-channel int8": ("PerChannelMinMaxObserver", {"dtype": "int8", "qscheme": "per_channel",
                                                      "ch_axis": 0, "symmetric": True}),
    "per-group int4 g32": ("PerGroupMinMaxObserver", {"dtype": "int4", "qscheme": "per_group",
                                                      "ch_axis": -1, "group_size": 32,
                                                      "symmetric": True}),
    "MX fp4 b32": ("PerBlockMXObserver", {"dtype": "fp4", "qscheme": "per_group", "ch_axis": -1,
                                          "group_size": 32, "scale_format": "e8m0",
                                          "is_dynamic": True}),
}
#: Quark's histogram MSE search (its ~3,000 candidates over the 8 x 64 batch's 5,027 bins):
#: the qparams call only, one call per sample, 5 samples
MSE_CASES = {"histogram MSE int8": ("PerTensorMSEObserver", {"dtype": "int8", "symmetric": True})}


def _per_call(fn, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def measure(repeat: int = 15) -> None:
    import torch

    sys.path[:0] = [str(HERE), str(HERE.parent / "tests" / "compat")]
    from common import Table
    from quark_twins import quark_twins

    torch.set_num_threads(1)
    t = Table("compat.quark vs Quark 0.13: us per call (ratio = Quark / quantscope)",
              ["observer", "shape", "call", "Quark", "quantscope", "ratio"])
    for case, (name, config) in CASES.items():
        for shape, n in SHAPES.items():
            _rows(t, case, quark_twins(name, **config), shape, n, ("forward", "qparams"),
                  repeat, batches=1)
    for case, (name, config) in MSE_CASES.items():  # three batches: a grown grid
        _rows(t, case, quark_twins(name, **config), (8, 64), 1, ("qparams",), 5, batches=3)
    t.print()


def _rows(t, case: str, pair, shape, n: int, calls, repeat: int, batches: int) -> None:
    """``t``'s rows of one case: the pair fed ``batches`` batches of ``shape`` (the same
    answer: the tests), then each of ``calls`` timed ``n`` per sample (the forward on the
    last batch), interleaved, medians."""
    import torch

    for seed in range(batches):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * (seed + 1)
        for obs in pair:
            obs(x)
    a, b = (obs._calculate_qparams() for obs in pair)
    assert all(torch.equal(u, v) for u, v in zip(a, b)), (case, shape)
    for call in calls:
        fns = [(lambda o=o, x=x: o(x)) if call == "forward" else o._calculate_qparams
               for o in pair]
        for fn in fns:
            _per_call(fn, max(n // 10, 1))  # warm-up
        times = ([], [])
        for _ in range(repeat):
            for i, fn in enumerate(fns):
                times[i].append(_per_call(fn, n))
        q, s = (1e6 * statistics.median(ts) for ts in times)
        t.add(case, "x".join(map(str, shape)), call, f"{q:.1f}", f"{s:.1f}", f"{q / s:.2f}")


def main():
    try:
        import quark  # noqa: F401
    except ImportError:
        if not PEER_PY.exists():
            print(f"(Quark is not installed here and the peers' venv {PEER_PY} is absent: "
                  f"skipped; `make peers` builds it)")
            return
        sys.stdout.flush()
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "QUARK_LOG_LEVEL": "warning",
               "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"),
                                              os.environ.get("PYTHONPATH", "")])}
        subprocess.run([str(PEER_PY), __file__], check=True, env=env)
        return
    print("(one torch thread for both; Quark's and quantscope's classes of one config)\n")
    measure()


if __name__ == "__main__":
    main()
