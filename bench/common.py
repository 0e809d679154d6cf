"""Side-by-side timing: interleaved runs, medians, ratios (these machines are noisy)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["Table", "compare", "host_us", "median_time", "status_kb"]


def status_kb(*keys: str) -> list[int]:
    """Fields of ``/proc/self/status`` in kB (``"VmHWM"``: this process's own peak resident
    set; ``ru_maxrss`` would carry the parent's over fork and exec)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return [int(fields[k].split()[0]) for k in keys]


def median_time(fn: Callable[[], object], repeat: int = 7, warmup: int = 2,
                setup: Callable[[], object] | None = None) -> float:
    """Median seconds of ``fn``; ``setup`` (untimed) runs before every timed call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def host_us(fn: Callable[[], object], calls: int = 200, runs: int = 5, warmup: int = 10,
            sync: Callable[[], object] = lambda: None) -> float:
    """Median host microseconds per call of ``fn`` over ``runs`` runs of ``calls // runs``
    calls, nothing synchronized within a run (``sync``: after the warm-up and each run,
    untimed: a GPU's queue drained between them)."""
    for _ in range(warmup):
        fn()
    sync()
    n, times = max(1, calls // runs), []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n)
        sync()
    return 1e6 * statistics.median(times)


def compare(fns: dict[str, Callable[[], object]], repeat: int = 7, warmup: int = 2,
            min_time: float = 0.0) -> dict[str, float]:
    """Median seconds of each function, measured interleaved (A B C A B C ...) after a warm-up.

    Interleaving puts every contender under the same background load; ``min_time``
    repeats a call in a loop until one sample takes at least that long.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    loops = {}
    for name, fn in fns.items():
        n, t0 = 1, time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        while dt * n < min_time and n < 10_000:
            n *= 2
        loops[name] = n
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            n = loops[name]
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            samples[name].append((time.perf_counter() - t0) / n)
    return {k: statistics.median(v) for k, v in samples.items()}


class Table:
    """A plain-text / markdown table printed as rows arrive."""

    def __init__(self, title: str, columns: list[str]):
        self.title, self.columns, self.rows = title, columns, []

    def add(self, *values):
        self.rows.append([_fmt(v) for v in values])

    def markdown(self) -> str:
        lines = [f"### {self.title}", "", "| " + " | ".join(self.columns) + " |",
                 "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(r) + " |" for r in self.rows]
        return "\n".join(lines) + "\n"

    def print(self):
        print(self.markdown(), flush=True)


def add_sides(table: Table, names: dict, result: dict, extra=lambda side: ()) -> None:
    """One row per side of ``names`` (key -> label) that ``result`` measured: its seconds,
    llm-compressor's (``"theirs"``) over them, its error, over theirs and over min-max's
    (``result``: ``seconds`` and ``error`` by side, ``err_minmax``), then ``extra(side)``."""
    s, e = result["seconds"], result["error"]
    for k, name in names.items():
        if k not in s:
            continue
        ratio = f"{s['theirs'] / s[k]:.1f}x" if "theirs" in s else "n/a"
        rel = f"{e[k] / e['theirs']:.4f}" if "theirs" in e else "n/a"
        table.add(name, f"{s[k]:.3g}", ratio, f"{e[k]:.6g}", rel,
                  f"{e[k] / result['err_minmax']:.4f}", *extra(k))


def _fmt(v) -> str:
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 100 or abs(v) < 0.01:
            return f"{v:.3g}"
        return f"{v:.3f}"
    return str(v)

