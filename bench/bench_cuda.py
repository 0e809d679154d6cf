"""The torch paths on a CUDA device, against its bandwidth floor (issue 19 item 5).

Skipped without CUDA. 4096 x 4096 float32 weight (64 MiB); floor: one device-to-device
copy of it (read + write: twice the bytes an observer reads) and one ``torch.aminmax``
(the one read every min-max observer needs). Interleaved medians, each call synchronized.
The C kernels are CPU only: every case here is the torch path, the code a CUDA tensor takes.
"""

from __future__ import annotations

import torch
from common import Table, compare

import quantscope as qs
from quantscope import QuantSpec, presets
from quantscope.estimators.mse import mse_search
from quantscope.layout import Channel, Group


def _synced(fn):
    def call():
        out = fn()
        torch.cuda.synchronize()
        return out
    return call


def _observe(name, spec, w, **kw):
    o = qs.get_observer(name, spec, **kw).to(w.device)  # memoryless: each call starts afresh

    def call():
        o(w)
        return o.calculate_qparams()
    return call


def main():
    if not torch.cuda.is_available():
        print("(no CUDA device: skipped)\n")
        return
    dev = torch.device("cuda")
    w = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0)).to(dev)
    buf = torch.empty_like(w)
    nbytes = w.numel() * w.element_size()
    floors = compare({"copy": _synced(lambda: buf.copy_(w)),
                      "aminmax": _synced(lambda: torch.aminmax(w))}, repeat=21, warmup=3)
    gbs = 2 * nbytes / floors["copy"] / 1e9
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: device copy of the "
          f"64 MiB weight {1e6 * floors['copy']:.1f} us ({gbs:.0f} GB/s read + write), "
          f"one aminmax {1e6 * floors['aminmax']:.1f} us\n")
    int4_ch = QuantSpec("int4", Channel(0))
    units = w  # per-channel units are the rows
    cases = {
        "torch.aminmax(w, dim=1) alone": lambda: torch.aminmax(w, dim=1),
        "min-max per channel int8, observe + qparams":
            _observe("memoryless_minmax", QuantSpec("int8", Channel(0)), w),
        "min-max group-128 int4, observe + qparams":
            _observe("memoryless_minmax", QuantSpec("int4", Group(128)), w),
        "MXFP4 min-max qparams": _observe("memoryless_minmax", presets.MXFP4, w),
        "NVFP4 min-max qparams": _observe("memoryless_minmax", presets.NVFP4, w),
        "MSE int4 per channel (native: norm 2, per-unit patience)":
            _observe("memoryless_mse", int4_ch, w),
        "MSE int4 per channel (llm-compressor's: norm 2.4, global patience)":
            lambda: mse_search(units, None, None, int4_ch, norm=2.4, compat="llmcompressor"),
    }
    t = Table("torch paths on CUDA, 4096 x 4096 float32",
              ["case", "us (median)", "x aminmax", "x copy"])
    tm = compare({k: _synced(f) for k, f in cases.items()}, repeat=9, warmup=2)
    for k, s in tm.items():
        t.add(k, 1e6 * s, s / floors["aminmax"], s / floors["copy"])
    t.print()


if __name__ == "__main__":
    main()
