"""`make bench`: run every bench/bench_*.py (each has main()), or those named on the command line.

    python bench/run.py            # all
    python bench/run.py minmax mse # bench_minmax.py and bench_mse.py
"""

from __future__ import annotations

import importlib
import platform
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main(argv: list[str]) -> None:
    names = argv or sorted(p.stem[len("bench_"):] for p in HERE.glob("bench_*.py"))
    print(f"# quantscope benchmarks, {time.strftime('%Y-%m-%d')}: {platform.machine()}, "
          f"{torch.get_num_threads()} threads, python {platform.python_version()}, "
          f"torch {torch.__version__}\n", flush=True)
    for name in names:
        print(f"## {name}\n", flush=True)
        importlib.import_module(f"bench_{name}").main()


if __name__ == "__main__":
    main(sys.argv[1:])
