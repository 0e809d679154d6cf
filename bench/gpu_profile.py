"""Where issue 35's GPU time goes: torch.profiler tables (self CPU time, self CUDA time) of
the min-max observer on a 4096 x 4096 bf16 weight, the native histogram on 16 x 2048 x 4096
bf16 batches, and calibrate's observation of a 4-layer random Llama (hidden 2048; w8a8
with min-max and with histogram activations), each also grouped by Python call site (which
lines launch kernels and read values back). For a lent GPU: python bench/gpu_profile.py
OUTDIR (writes OUTDIR/<case>.txt)."""

import os
import sys
import traceback

import torch
from torch.profiler import ProfilerActivity, profile

import quantscope as qs
from quantscope import QuantSpec
from quantscope.calibration import preset
from quantscope.layout import Channel


def profiled(out, name, fn, n=3):
    try:
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                     with_stack=True) as p:
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
        avg = p.key_averages()
        text = (avg.table(sort_by="self_cpu_time_total", row_limit=45) + "\n\n"
                + avg.table(sort_by="self_cuda_time_total", row_limit=30) + "\n\n"
                + p.key_averages(group_by_stack_n=5).table(
                    sort_by="count", row_limit=40, max_src_column_width=120))
    except Exception:  # noqa: BLE001 -- the other cases still run
        text = traceback.format_exc()
    with open(os.path.join(out, f"{name}.txt"), "w") as f:
        f.write(text)
    print(name, "done", flush=True)


def main(out):
    os.makedirs(out, exist_ok=True)
    dev = "cuda"
    w = torch.randn(4096, 4096, device=dev).to(torch.bfloat16)
    obs = qs.get_observer("memoryless_minmax", QuantSpec("int8", Channel(0))).to(dev)
    profiled(out, "minmax_observer", lambda: (obs(w), obs.calculate_qparams()), n=10)
    g = torch.Generator(device=dev).manual_seed(0)
    batches = [torch.randn(16, 2048, 4096, device=dev, generator=g).to(torch.bfloat16)
               * (1 + i / 2) for i in range(2)]

    def hist():
        h = qs.get_observer("histogram", QuantSpec("uint8", symmetric=False)).to(dev)
        for b in batches:
            h(b)
        return h.calculate_qparams()
    profiled(out, "histogram", hist, n=2)
    batches.clear()
    sys.path.insert(0, os.path.dirname(__file__))
    from gpu_model import forward_all, llama, token_batches

    model = llama(2048, dev, layers=4)
    tokens = token_batches(model, dev, 16, 512)
    profiled(out, "forward", lambda: forward_all(model, tokens), n=1)
    profiled(out, "calibrate_w8a8_minmax",
             lambda: qs.calibrate(model, tokens, "w8a8", progress=False), n=1)
    # the whole-model row's slowest observation pass (4.96x the forward on the H200)
    histogram = preset("w8a8", "histogram")
    profiled(out, "calibrate_w8a8_histogram",
             lambda: qs.calibrate(model, tokens, histogram, progress=False), n=1)


if __name__ == "__main__":
    main(sys.argv[1])
