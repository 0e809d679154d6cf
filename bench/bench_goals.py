"""Issue 19's four cases, each with its peer and the floor, measured side by side in one run.

1. ``compat.llmcompressor`` memoryless MSE, int4 symmetric, 4096 x 4096 per channel (norm
   2.4, one patience for the whole tensor) against llm-compressor 0.14's ``memoryless_mse``;
2. ``compat.torch_ao.HistogramObserver`` on 8 batches 64 x 128 x 384, each 10 % wider than
   the last (range growth re-bins the histogram), + qparams, against torch.ao's;
3. group-128 min-max (int4), 4096 x 4096, observe + qparams
   (``compat.llmcompressor``'s ``memoryless_minmax``), against llm-compressor's own
   (compressed-tensors' qparams) and the floor, one ``torch.aminmax`` of the weight;
4. MXFP4 / NVFP4 min-max qparams, 4096 x 4096, the same way.

Cases 3 and 4 write megabytes of fresh outputs per call (NVFP4: 17 MB), whose page faults
the floor does not pay; whether glibc serves them from freed memory depends on the process's
history, so they run with the allocator fixed: memory reused between calls (:func:`reuse_heap`,
the goals table), then, in a second process that took quantscope's calibration setting
(``calibration.run.heap.prepare``: every block of 1 MiB or more mmapped) before its first large
allocation, fresh pages on every call.

Everything runs in one process under the peers' python (``.peers``, or
$QUANTSCOPE_PEER_PYTHON: llm-compressor and compressed-tensors live there), importing
quantscope from this checkout; contenders interleaved call by call, medians, one torch
thread. "same" says whether both sides' qparams are bitwise equal.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
PEER_PY = Path(os.environ.get("QUANTSCOPE_PEER_PYTHON", HERE.parent / ".peers" / "bin" / "python"))


def _values(t) -> torch.Tensor:
    """Scales as float32 values (llm-compressor keeps MX scales as uint8 E8M0 codes)."""
    t = torch.as_tensor(t).reshape(-1)
    return torch.exp2(t.float() - 127) if t.dtype == torch.uint8 else t.float()


def _same(peer, ours) -> bool:
    """Scale and zero point of both, bitwise (as float32 values)."""
    return all(torch.equal(_values(x), _values(y)) for x, y in zip(peer, ours))


def reuse_heap() -> bool:
    """glibc's allocator set so that each call reuses the memory the last one freed: blocks
    up to 32 MiB come from the heap, which is never trimmed (the steady state of a
    long-running process whose thresholds have grown; which blocks a fresh process serves
    fresh depends on its history, so the bench fixes it). False where not glibc."""
    from quantscope.calibration.run import heap

    libc = heap._glibc()  # the one place that loads glibc and types mallopt
    return libc is not None and bool(libc.mallopt(heap._M_MMAP_THRESHOLD, 32 << 20)) and bool(
        libc.mallopt(heap._M_TRIM_THRESHOLD, 1 << 30))


def run(table_cls, compare, fresh: bool = False) -> None:
    """The goals table; ``fresh``: only cases 3 and 4, in a process that took quantscope's
    calibration heap setting (``calibration.run.heap.prepare``) before it allocated a large block."""
    import quantscope as qs

    torch.set_num_threads(1)
    title = ("the min-max goals again, fresh output pages on every call (quantscope's "
             "calibration heap setting: 1 MiB mmap threshold)" if fresh else
             "issue 19 goals (median ms, interleaved; one torch thread)")
    t = table_cls(title, ["case", "peer", "peer ms", "quantscope ms", "peer / qs", "floor ms",
                          "qs / floor", "same qparams", "goal"])
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4096, 4096, generator=g)
    floor = compare({"aminmax": lambda: torch.aminmax(w)}, repeat=9)["aminmax"]

    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.observers import Observer as LC

    def lc(name, **fields):
        args = QuantizationArgs(observer=name, **fields)

        def call():
            o = LC.load_from_registry(name, base_name="weight", args=args.model_copy(deep=True))
            o(w)
            qp = o.get_qparams()
            return qp["scale"], qp["zero_point"]
        return call

    def ours_compat(name, backend=None, **fields):
        args = QuantizationArgs(observer=name, **fields)

        def call():
            o = qs.get_observer(f"llmcompressor:{name}", base_name="weight",
                                args=args.model_copy(deep=True))
            if backend is not None:  # the MSE search's engine (mse_search's backend=)
                o.options["backend"] = backend
            o(w)
            qp = o.get_qparams()
            return qp["scale"], qp["zero_point"]
        return call

    if not fresh:
        _search_goals(t, compare, lc, ours_compat)
    else:
        print("  (fresh output pages)", flush=True)
    _minmax_goals(t, compare, lc, ours_compat, w, floor, "fresh" if fresh else "reused")


def _search_goals(t, compare, lc, ours_compat) -> None:
    """Cases 1 and 2: the compat MSE search and torch.ao's histogram with range growth."""
    import quantscope as qs

    # 1. compat MSE (and its torch path, backend="torch", in the same rounds)
    fields = {"num_bits": 4, "strategy": "channel"}
    peer, mine, tpath = (lc("memoryless_mse", **fields), ours_compat("memoryless_mse", **fields),
                         ours_compat("memoryless_mse", "torch", **fields))
    theirs = peer()
    same, same_t = _same(theirs, mine()), _same(theirs, tpath())
    tm = compare({"peer": peer, "qs": mine, "torch": tpath}, repeat=3, warmup=0)
    t.add("compat llm-compressor MSE int4 per-channel (norm 2.4)", "llm-compressor",
          1e3 * tm["peer"], 1e3 * tm["qs"], tm["peer"] / tm["qs"], "", "", same, ">= 10x")
    t.add("  the same, backend='torch' (the torch path)", "llm-compressor",
          1e3 * tm["peer"], 1e3 * tm["torch"], tm["peer"] / tm["torch"], "", "", same_t, "")
    print("  compat MSE: done", flush=True)

    # 2. torch.ao histogram, growing range
    from torch.ao.quantization import HistogramObserver

    gb = torch.Generator().manual_seed(1)
    batches = [torch.randn(64, 128, 384, generator=gb) * 1.1 ** i for i in range(8)]

    def hist(make):
        def call():
            o = make()
            for b in batches:
                o(b)
            return o.calculate_qparams()
        return call

    peer, mine = hist(HistogramObserver), hist(lambda: qs.get_observer("torch.ao:HistogramObserver"))
    same = _same(peer(), mine())
    hfloor = compare({"f": lambda: [torch.aminmax(b) for b in batches]}, repeat=5)["f"]
    tm = compare({"peer": peer, "qs": mine}, repeat=5, warmup=1)
    t.add("torch.ao HistogramObserver, 8 growing batches + qparams", "torch.ao",
          1e3 * tm["peer"], 1e3 * tm["qs"], tm["peer"] / tm["qs"], 1e3 * hfloor,
          tm["qs"] / hfloor, same, ">= 10x")
    print("  histogram growth: done", flush=True)


def _minmax_goals(t, compare, lc, ours_compat, w, floor, heap: str) -> None:
    """Cases 3 and 4: min-max qparams of the weight ``w``, the allocator in state ``heap``
    (set here for "reused"; a "fresh" process set it before its first large allocation)."""
    if heap == "reused":
        reuse_heap()
    # 3. / 4. min-max at the floor
    cases = [("group-128 int4 min-max", {"num_bits": 4, "strategy": "group", "group_size": 128},
              "> peer, <= 1.5x floor"),
             ("MXFP4 min-max qparams", {"num_bits": 4, "type": "float", "strategy": "group",
                                        "group_size": 32, "scale_dtype": torch.uint8},
              "<= 2x floor"),
             ("NVFP4 min-max qparams", {"num_bits": 4, "type": "float",
                                        "strategy": "tensor_group", "group_size": 16,
                                        "scale_dtype": torch.float8_e4m3fn}, "<= 2x floor")]
    # quantscope's llm-compressor classes (their E8M0 rounding for MX; the native MXFP4
    # preset rounds as the OCP spec does, a different scale on some blocks)
    rows = [(name, ours_compat("memoryless_minmax", **f), lc("memoryless_minmax", **f), goal)
            for name, f, goal in cases]
    for name, mine, peer, goal in rows:
        same = _same(peer(), mine())
        tm = compare({"peer": peer, "qs": mine, "floor": lambda: torch.aminmax(w)}, repeat=9)
        t.add(name, "llm-compressor", 1e3 * tm["peer"], 1e3 * tm["qs"], tm["peer"] / tm["qs"],
              1e3 * tm["floor"], tm["qs"] / tm["floor"], same, goal if heap == "reused" else "")
        print(f"  {name}: done", flush=True)
    print(f"(floor, one torch.aminmax of the 4096 x 4096 weight, alone: {1e3 * floor:.2f} ms)")
    t.print()


def main():
    """Run the cases under the peers' python (this checkout's src first on its path)."""
    if not PEER_PY.exists():
        print(f"(issue 19 goals skipped: no peers' python at {PEER_PY}; make peers)\n")
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), str(HERE)]),
           "OMP_NUM_THREADS": "1"}
    for part in ("--run", "--run-fresh"):
        subprocess.run([str(PEER_PY), str(Path(__file__).resolve()), part], env=env, check=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--run-fresh"]:
        from quantscope.calibration.run import heap

        if heap.prepare():  # before any large block: every one is then mmapped, fresh pages
            from common import Table, compare

            run(Table, compare, fresh=True)
    elif sys.argv[1:] == ["--run"]:
        from common import Table, compare

        run(Table, compare)
    else:
        main()
