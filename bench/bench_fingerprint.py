"""What the weight fingerprints cost (calibration/structure/fingerprint.py): one pass over every
weight, once in ``calibrate``, once in each ``apply`` or export, and in the distributed weight
check. The Linear weights of a Llama-3.2-1B-shaped model (hidden 2048, intermediate 8192, 8
key / value heads of 64: 60.8M values a layer, no lm_head), random, fingerprinted one by one
on the CPU; the best of three passes (docs/guide/calibrating.md quotes it).

    python bench/bench_fingerprint.py [--layers 16] [--dtype bfloat16] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch

from quantscope.calibration.structure.fingerprint import fingerprint

HIDDEN, INTERMEDIATE, KV = 2048, 8192, 512
SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN),
          (INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]


def weights(layers: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.empty(s, dtype=dtype).normal_(generator=g) for _ in range(layers)
            for s in SHAPES]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    ws = weights(args.layers, getattr(torch, args.dtype))
    fingerprint(ws[0])  # the keys, numpy's first call
    runs = []
    for _ in range(3):
        t = time.perf_counter()
        for w in ws:
            fingerprint(w)
        runs.append(time.perf_counter() - t)
    gb = sum(w.numel() * w.element_size() for w in ws) / 1e9
    print(f"{args.layers} layers, {len(ws)} weights, {sum(w.numel() for w in ws) / 1e6:.0f}M "
          f"{args.dtype} values ({gb:.2f} GB), {args.threads} thread(s): best "
          f"{min(runs) * 1e3:.0f} ms of {[round(r * 1e3) for r in runs]} ({gb / min(runs):.1f} "
          f"GB/s)")


if __name__ == "__main__":
    main()
