"""The NVFP4 importance-weighted (imatrix) search on the device, an 8192 x 4096 weight (2 size
x size), fp32: not a row of issue 35's table, so ``gpu_triton.py`` runs it only when asked
(``--rows imatrix`` or ``QUANTSCOPE_GPU_ROWS=imatrix``).

Methods: quantscope's ``imatrix_mse`` observer (norm 2, factors 1.00 .. 0.81: the MSE
engine's fused ``nvfp4_search`` with the weights), the same observer on the path it took
before (each factor's qparams, then a weighted ``mse_price_fp`` pass, blocks of factors
selected in torch: the CPU's path, forced here), and llm-compressor 0.14's ``imatrix_mse`` on
the same grid (bench/bench_imatrix.py's case). Each method's ranges are priced by one
formula: the importance-weighted squared error of the weight as NVFP4 runs it.
"""

from __future__ import annotations

import torch
from bench_imatrix import _theirs, weighted_error
from common import Table
from gpu_timing import device_name, device_seconds, failure, ms, wall_medians

from quantscope import presets
from quantscope.estimators import weighted
from quantscope.observers import get_observer

OURS = "quantscope imatrix_mse (fused nvfp4_search, weighted)"


def _ours(w, importance, engine: bool):
    """quantscope's observer as a method; ``engine`` False: the blocks of factors."""
    obs = get_observer("imatrix_mse", presets.NVFP4, importance=importance).to(w.device)

    def call():
        usable = weighted.mse_ops.usable
        if not engine:
            weighted.mse_ops.usable = lambda *a: False
        try:
            obs(w)
            obs.qparams()
        finally:
            weighted.mse_ops.usable = usable
        return obs.calculate_range()
    return call


def _llmcompressor(w, importance):
    import peer_llmcompressor_mse as pm

    return lambda: _theirs(w, importance, pm)


def bench_imatrix(size, device, repeat):
    rows = 2 * size
    table = Table(f"NVFP4 imatrix_mse (norm 2, factors 1.00 .. 0.81), {rows} x {size} fp32 "
                  f"weight, log-normal importance, {device_name(device)}",
                  ["method", "wall ms", "device ms", "weighted sq. error", "wall / ours",
                   "error / ours"])
    g = torch.Generator().manual_seed(5)
    w = torch.randn(rows, size, generator=g).to(device)
    importance = torch.exp(2 * torch.randn(size, generator=g)).to(device)
    makers = {OURS: lambda: _ours(w, importance, True),
              "quantscope imatrix_mse, blocks of factors (the path before)":
                  lambda: _ours(w, importance, False),
              "llm-compressor 0.14 imatrix_mse": lambda: _llmcompressor(w, importance)}
    calls, skipped = {}, {}
    for name, make in makers.items():
        try:
            call = make()
            call()
        except Exception as e:  # noqa: BLE001 (a method that cannot run: say why, go on)
            skipped[name] = failure(e)
            continue
        calls[name] = call
    t = wall_medians(calls, device, repeat, 1)
    err = {name: weighted_error(w, importance, *call()) for name, call in calls.items()}
    for name, call in calls.items():
        table.add(name, ms(t[name]), ms(device_seconds(call, device, 1)), err[name],
                  t[name] / t.get(OURS, float("nan")), err[name] / err.get(OURS, float("nan")))
    for name, why in skipped.items():
        table.add(name, why, "", "", "", "")
    table.print()
    print("error: sum_j imp_j (Q(w) - w)^2 of each method's ranges as NVFP4 runs them "
          "(float64).\n")
