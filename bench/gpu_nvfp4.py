"""Issue 35 item 5, the NVFP4 block-scale search row: an 8192 x 4096 weight (2 size x size),
fp32 and bf16, on the device.

Methods: quantscope's ``nvfp4_expanded_mse`` (llm-compressor's NVFP4 grid: 1.8x the range
down to 0.8x) and its native ``memoryless_mse`` on NVFP4 (min-max incumbent, per-block
patience, global-scale candidates), both through the public observer; llm-compressor 0.14's
``nvfp4_expanded_mse`` observer (bench/peer_llmcompressor_mse.py); ModelOpt 0.47's fp8
block-scale sweep (bench/peer_modelopt_nvfp4.py: its fused Triton kernel on CUDA). Each
method's chosen per-block ranges and global amax become NVFP4 scales by one formula
(``qparams_from_range``) and are priced by one (``range_error``: the total squared error
of the fake-quantized weight, summed in float64 over blocks). A peer that does not import
or run gets one row "not run: <reason>".
"""

from __future__ import annotations

import torch
from common import Table
from gpu_timing import device_name, device_seconds, failure, ms, wall_medians

import quantscope as qs
from quantscope import presets
from quantscope.estimators import range_error
from quantscope.qparams import qparams_from_range

SPEC = presets.NVFP4
OURS = "quantscope nvfp4_expanded_mse"


def _observer(name, w):
    """A quantscope observer as a method: ``() -> (lo, hi, global_amax)``."""
    obs = qs.get_observer(name, SPEC).to(w.device)

    def call():
        obs(w)
        obs.calculate_qparams()
        lo, hi = obs.calculate_range()
        return lo.reshape(-1), hi.reshape(-1), obs.global_amax()
    return call


def _llmcompressor(w):
    from mse_worker import NVFP4_CASE  # llm-compressor's NVFP4 weight scheme, one place
    from peer_llmcompressor_mse import search, weight_observer

    obs = weight_observer(NVFP4_CASE)  # built once, as ours

    def call():
        lo, hi = search(obs, w)
        obs.get_qparams()  # their qparams, as ours computes its own
        return lo.reshape(-1), hi.reshape(-1), None  # their global scale: from these ranges
    return call


def reference_quant(w):
    """The fake quant ModelOpt's reference sweep calls off CUDA (theirs is Triton-only):
    NVFP4 with per-block ``amax`` under the weight's global amax, as their scales encode."""
    ga = w.detach().abs().amax().float()

    def quant(x, amax):
        return qs.fake_quantize(x, qparams_from_range(-amax, amax, SPEC, global_amax=ga), SPEC)
    return quant


def _modelopt(w):
    import peer_modelopt_nvfp4 as peer

    quant = None if w.is_cuda else reference_quant(w)

    def call():
        amax, ga = peer.sweep(w, quant)
        return -amax, amax, ga
    return call, f"ModelOpt fp8 scale sweep ({peer.path(w, quant)})"


def methods(w) -> tuple[dict, dict]:
    """(name -> call, name -> why it cannot run); each call is tried once here."""
    makers = {OURS: lambda: _observer("nvfp4_expanded_mse", w),
              "quantscope memoryless_mse (native NVFP4)": lambda: _observer("memoryless_mse", w),
              "llm-compressor nvfp4_expanded_mse": lambda: _llmcompressor(w),
              "ModelOpt fp8 scale sweep": lambda: _modelopt(w)}
    calls, skipped = {}, {}
    for name, make in makers.items():
        try:
            made = make()
            call, name = made if isinstance(made, tuple) else (made, name)
            call()
        except Exception as e:  # noqa: BLE001 (a method that cannot run: say why, go on)
            skipped[name] = failure(e)
            continue
        calls[name] = call
    return calls, skipped


def total_error(w, lo, hi, global_amax) -> float:
    """Squared error of ``w`` fake-quantized with the NVFP4 scales of these ranges."""
    units = SPEC.layout.to_units(w.float())
    return float(range_error(units, lo.float(), hi.float(), SPEC, global_amax=global_amax)
                 .double().sum())


def bench_nvfp4(size, device, repeat):
    rows = 2 * size
    table = Table(f"NVFP4 block-scale search, {rows} x {size} weight, {device_name(device)}",
                  ["method", "dtype", "wall ms", "device ms", "total squared error",
                   "wall / ours", "error / ours"])
    g = torch.Generator().manual_seed(4)
    base = torch.randn(rows, size, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        w = base.to(device=device, dtype=dtype)
        calls, skipped = methods(w)
        t = wall_medians(calls, device, repeat, 1)
        err = {name: total_error(w, *call()) for name, call in calls.items()}
        for name, call in calls.items():
            table.add(name, str(dtype).removeprefix("torch."), ms(t[name]),
                      ms(device_seconds(call, device, 1)), err[name],
                      t[name] / t.get(OURS, float("nan")),
                      err[name] / err.get(OURS, float("nan")))
        for name, why in skipped.items():
            table.add(name, str(dtype).removeprefix("torch."), why, "", "", "", "")
    table.print()
    print("wall / ours, error / ours: against quantscope's nvfp4_expanded_mse; every method's "
          "ranges priced by quantscope's NVFP4 qparams and range_error (float64 total).\n")
