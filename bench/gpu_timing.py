"""Timing for the device benches (bench/gpu_triton.py and its rows): synchronized, interleaved
wall-clock medians and the CUDA kernels' own time from torch.profiler."""

from __future__ import annotations

import platform
import statistics
import time

import torch


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def wall_medians(fns: dict, device, repeat: int, warmup: int) -> dict:
    """Median seconds of each callable, calls interleaved, each synchronized."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples = {k: [] for k in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            samples[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


def device_seconds(fn, device, calls: int = 3) -> float | None:
    """The CUDA kernels' own time of one call (mean of ``calls``), None off CUDA."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        sync(device)
    total_us = sum(e.self_device_time_total for e in prof.key_averages())
    return total_us / calls / 1e6


def us(s):
    return None if s is None else 1e6 * s


def ms(s):
    return None if s is None else 1e3 * s


def device_name(device):
    return torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "CPU"


def failure(e: BaseException) -> str:
    """A peer's failure as one short table cell."""
    return f"not run: {type(e).__name__}: {e}"[:200].replace("\n", " ").replace("|", "/")


def runnable(fns: dict) -> tuple[dict, dict]:
    """``(name -> call, name -> why not)``: each call tried once, so that one method that
    cannot run on this device (a peer's kernel without this dtype) costs its row only."""
    ok, skipped = {}, {}
    for name, fn in fns.items():
        try:
            fn()
        except Exception as e:  # noqa: BLE001 (say why in the table, go on)
            skipped[name] = failure(e)
        else:
            ok[name] = fn
    return ok, skipped
