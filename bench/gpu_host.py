"""Where the host's time goes on a GPU (issue 35's wall-time rows): the host's microseconds per
call of each step of the min-max path, from a bare ``torch.aminmax`` and an empty Triton
launch up to an observer's whole call (bench/gpu_profile.py: which lines launch kernels).
For a lent GPU: python bench/gpu_host.py OUTDIR (writes OUTDIR/host.md). The host time of a call is measured with no synchronization
between calls (the kernels are small: the queue never fills), so it is what the host spends
before the device can start the next call's work."""

from __future__ import annotations

import os
import sys
import traceback

import torch
import triton
from common import host_us

import quantscope as qs
from quantscope import QuantSpec
from quantscope.kernels import ops
from quantscope.kernels.triton import minmax as triton_minmax
from quantscope.layout import Channel, Group
from quantscope.qparams import qparams_from_range


@triton.jit
def _empty_kernel(x_ptr):
    pass


#: the device measured: CUDA; ``cpu`` runs a smoke test here (TRITON_INTERPRET=1)
DEV = os.environ.get("GPU_HOST_DEVICE", "cuda")
SIZE = 4096 if DEV == "cuda" else 256


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def _compiled_minmax(units):
    """The min / max kernel launched through its compiled handle: no argument binding or
    specialization per call (what a launcher cache would save over ``kernel[grid](...)``)."""
    from quantscope.kernels.triton._jit import LAUNCH

    U, E = units.shape
    bu, be = triton_minmax._blocks(U, E, None, None)
    chunk, splits = triton_minmax._split(U, E, bu, be, None)
    lo = torch.empty(U * splits, dtype=torch.float32, device=units.device)
    hi = torch.empty_like(lo)
    args = (units, lo, hi, U, E, 1, E, units.stride(0), 0, 0, units.stride(1), chunk, splits)
    grid = (triton.cdiv(U, bu), splits, 1)
    const = {"BLOCK_U": bu, "BLOCK_E": be, "FOUR_D": False}
    run = triton_minmax._minmax_kernel.warmup(*args, grid=grid, **const, **LAUNCH)[grid]
    try:
        run(*args)
        return lambda: run(*args)
    except TypeError:  # a Triton whose launcher takes the constexprs too
        run(*args, *const.values())
        return lambda: run(*args, *const.values())


def _measured(fn) -> float:
    try:
        return host_us(fn, sync=sync)
    except Exception:  # noqa: BLE001 -- a step this Triton cannot run: the others still do
        traceback.print_exc(limit=2)
        return float("nan")


def _measurable(make, *args):
    """``make(*args)``, or where this Triton cannot build it a call that raises its error."""
    try:
        return make(*args)
    except Exception as e:  # noqa: BLE001
        def failed(e=e):
            raise e  # noqa: TRY201 (raised at the call, not here)
        return failed


def steps(w, spec, units):
    """name -> callable: each step of the min-max path on weight ``w``."""
    lo, hi = ops.unit_minmax(units)
    obs = qs.get_observer("memoryless_minmax", spec).to(w.device)
    obs(w)
    static = qs.get_observer("minmax", spec).to(w.device)
    static(w)
    return {
        "torch.aminmax(w)": lambda: torch.aminmax(w),
        "torch.aminmax(units, dim=1)": lambda: torch.aminmax(units, dim=1),
        "empty Triton kernel": lambda: _empty_kernel[(1,)](w),
        "triton minmax launcher": lambda: triton_minmax.unit_minmax(units),
        "triton minmax, compiled handle": _measurable(_compiled_minmax, units),
        "ops.unit_minmax": lambda: ops.unit_minmax(units),
        "qparams_from_range, unchecked": lambda: qparams_from_range(lo, hi, spec,
                                                                    check_finite=False),
        "qparams_from_range, checked": lambda: qparams_from_range(lo, hi, spec),
        "memoryless observer forward": lambda: obs(w),
        "memoryless observer calculate_qparams": obs.calculate_qparams,
        "running min-max observer forward": lambda: static(w),
    }


def host_table(out):
    w32 = torch.randn(SIZE, SIZE, device=DEV)
    cases = {"channel int8 bf16": (w32.bfloat16(), QuantSpec("int8", Channel(0)), None),
             "group-128 int4 bf16": (w32.bfloat16(), QuantSpec("int4", Group(128)), 128),
             "NVFP4 bf16": (w32.bfloat16(), qs.presets.NVFP4, 16)}
    lines = ["| step | " + " | ".join(cases) + " |", "|---" * (len(cases) + 1) + "|"]
    cols = {}
    for name, (w, spec, block) in cases.items():
        units = w if block is None else w.view(-1, block)
        cols[name] = {k: _measured(fn) for k, fn in steps(w, spec, units).items()}
    for k in next(iter(cols.values())):
        lines.append(f"| {k} | " + " | ".join(f"{cols[c][k]:.1f}" for c in cases) + " |")
    text = "host us per call, no synchronization between calls\n\n" + "\n".join(lines)
    print(text, flush=True)
    with open(os.path.join(out, "host.md"), "w") as f:
        f.write(text + "\n")


def main(out):
    os.makedirs(out, exist_ok=True)
    host_table(out)


if __name__ == "__main__":
    main(sys.argv[1])
