"""Exhaustive scan of torch's float32 ``pow(a, p)`` against float64 over every positive finite
float32 ``a``: the worst relative error where the result is a normal float32, the worst
absolute error where it is subnormal. ``quantscope.estimators.mse_compat.RHO`` holds a bound
of at least 4x these for the norms it accepts; rerun on a new torch (or with
``ATEN_CPU_CAPABILITY=avx2``) before trusting it there.

    python bench/scan_torch_pow.py 2.4 1.5      # ~2 minutes per norm on 2 cores
"""

from __future__ import annotations

import sys

import torch


def scan(p: float, chunk: int = 1 << 26) -> tuple[float, float]:
    """``(max relative error on normal results, max absolute error on subnormal ones)``.

    Chunks are multiples of 64 elements split evenly over 2 threads, so torch's vector loop
    computes every element but the last chunk's tail (results past float32's range there)."""
    worst_rel, worst_sub = 0.0, 0.0
    for start in range(1, 0x7F800000, chunk):
        a = torch.arange(start, min(start + chunk, 0x7F800000), dtype=torch.int32)
        a = a.view(torch.float32)
        t, r = torch.pow(a, p).double(), a.double().pow(p)
        normal = (r < 3.0e38) & (r >= 2.0 ** -126)
        if normal.any():
            worst_rel = max(worst_rel, ((t - r).abs() / r)[normal].max().item())
        sub = r < 2.0 ** -126
        if sub.any():
            worst_sub = max(worst_sub, (t - r).abs()[sub].max().item())
    return worst_rel, worst_sub


if __name__ == "__main__":
    torch.set_num_threads(2)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    for arg in sys.argv[1:] or ["2.4"]:
        rel, sub = scan(float(arg))
        print(f"p={arg}: max relative error (normal results) {rel:.4g}; "
              f"max absolute error (subnormal results) {sub:.4g}")
