"""The measuring side of bench_mse.py: quantscope and llm-compressor in one process.

    python bench/mse_worker.py time CASES.json OUT.json
    python bench/mse_worker.py nvfp4 OUT.json
    MALLOC_MMAP_THRESHOLD_=65536 python bench/mse_worker.py peak FILE SIDE LAYOUT OUT.json

bench_mse.py starts it under the peers' python (.peers: llm-compressor 0.14 installed; quantscope
comes from ../src on sys.path, it needs only torch and numpy), or under its own python when
the peer is absent (then "theirs" is None). CASES.json: ``[{"case": name, "file": path}]``,
each file a safetensors dict of the weights of one case.

``time``: per case and layout, ours and theirs timed alternately, call by call (ours, theirs,
ours, theirs ...; one call = a fresh observer fed every weight of the case, then its qparams)
on the same tensors with the same thread count; medians, and the total squared errors of both
ranges, of min-max and of the dense reference, all scored by quantscope's ``range_error``
(its llm-compressor compat mode reproduces their ranges bitwise, see tests/observers/test_mse.py).

``nvfp4``: ``nvfp4_expanded_mse`` on a 1024 x 4096 Gaussian weight on one thread (issue 35
item 6): quantscope (the C kernel), quantscope with its kernel turned off (the torch path)
and llm-compressor, interleaved call by call, and each side's total squared error.

``peak``: the peak extra memory of each call of one side, in a fresh process: VmHWM after the
call minus VmRSS before it, with the high-water mark reset just before (``5`` to
/proc/self/clear_refs) and the input already in memory. The caller sets a fixed
MALLOC_MMAP_THRESHOLD_, so glibc mmaps every large block and unmaps it at free: RSS follows
the allocations (with glibc's default dynamic threshold freed blocks stay in the heap and a
later call's peak is invisible). Cross-check: the peak of torch's own allocation timeline
(torch.profiler, profile_memory), which sees torch tensors only, not native C buffers.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))  # quantscope from this checkout in the peer's venv
sys.path.insert(0, str(HERE))

import torch
from common import compare, status_kb

from quantscope.estimators import dense_search, range_error
from quantscope.layout import Channel, Group
from quantscope.observers import get_observer
from quantscope.spec import QuantSpec
from quantscope.stats.minmax import unit_minmax

# layout name -> (our spec, llm-compressor's case for peer_llmcompressor_mse.observe)
LAYOUTS = {
    "channel": (QuantSpec("int4", Channel(0)),
                {"observer": "memoryless_mse", "num_bits": 4, "strategy": "channel"}),
    "group-128": (QuantSpec("int4", Group(128)),
                  {"observer": "memoryless_mse", "num_bits": 4, "strategy": "group",
                   "group_size": 128}),
}
REPEAT = int(os.environ.get("QUANTSCOPE_BENCH_REPEAT", "5"))


def load(path: str) -> dict[str, torch.Tensor]:
    """The weights of one case, each in its own memory (not backed by the file)."""
    from safetensors.torch import load_file

    return {k: v.clone() for k, v in load_file(path).items()}


def peer():
    """peer_llmcompressor_mse when llm-compressor imports here, else the reason it does not."""
    import importlib

    try:
        importlib.import_module("llmcompressor.observers")
        return importlib.import_module("peer_llmcompressor_mse"), None
    except Exception as e:  # noqa: BLE001 (a broken peer install must not stop our figures)
        return None, f"{type(e).__name__}: {e}"


def ours_call(spec):
    def call(w):
        obs = get_observer("memoryless_mse", spec)
        obs(w)
        obs.qparams()
        return obs.calculate_range()
    return call


def theirs_call(pm, case):
    args = pm.quant_args(case)

    def call(w):
        return pm.observe(w, case, args)[0]
    return call


def total_error(tensors, spec, ranges) -> float:
    tot = 0.0
    for w, (lo, hi) in zip(tensors.values(), ranges):
        u = spec.layout.to_units(w)
        tot += range_error(u, lo.reshape(-1), hi.reshape(-1), spec).sum().item()
    return tot


def measure(tensors, spec, lc, pm) -> dict:
    """One case and layout: interleaved medians, then the errors of the ranges that ran."""
    calls = {"ours": ours_call(spec)}
    if pm is not None:
        calls["theirs"] = theirs_call(pm, lc)
    last = {}

    def run(side):
        def fn():
            last[side] = [calls[side](w) for w in tensors.values()]
        return fn

    # compare() runs each side once to size its loop before the timed rounds: with warmup=0
    # that untimed call is the warm-up (one llm-compressor call on 4096 x 4096 takes ~5 s)
    med = compare({side: run(side) for side in calls}, repeat=REPEAT, warmup=0)
    mm = [unit_minmax(spec.layout.to_units(w)) for w in tensors.values()]
    dense = [tuple(dense_search(spec.layout.to_units(w), None, None, spec, candidates=100,
                                min_factor=0.6)) for w in tensors.values()]
    return {"threads": torch.get_num_threads(), "ours_s": med["ours"],
            "theirs_s": med.get("theirs"), "err_ours": total_error(tensors, spec, last["ours"]),
            "err_theirs": (total_error(tensors, spec, last["theirs"]) if "theirs" in last
                           else None),
            "err_minmax": total_error(tensors, spec, mm),
            "err_dense": total_error(tensors, spec, dense),
            "input_bytes": sum(w.numel() * w.element_size() for w in tensors.values())}


def time_cases(cases_path: str, out: str) -> None:
    pm, why = peer()
    results = []
    for c in json.loads(Path(cases_path).read_text()):
        tensors = load(c["file"])
        for lname, (spec, lc) in LAYOUTS.items():
            print(f"  {c['case']} {lname}: ours {'and llm-compressor ' if pm else ''}"
                  f"interleaved, {REPEAT} rounds ...", flush=True)
            results.append({"case": c["case"], "layout": lname,
                            **measure(tensors, spec, lc, pm)})
    Path(out).write_text(json.dumps({"peer_error": why, "results": results,
                                     "torch": torch.__version__}))


#: llm-compressor's NVFP4 weight scheme (blocks of 16, fp8 e4m3 block scales)
NVFP4_CASE = {"observer": "nvfp4_expanded_mse", "num_bits": 4, "type": "float",
              "strategy": "tensor_group", "group_size": 16, "scale_dtype": "float8_e4m3fn"}


def nvfp4_expanded(out: str) -> None:
    """One thread: our nvfp4_expanded_mse with the kernel, without it, and llm-compressor's."""
    from quantscope import presets
    from quantscope.estimators import mse_kernel

    torch.set_num_threads(1)
    spec, w = presets.NVFP4, torch.randn(1024, 4096, generator=torch.Generator().manual_seed(0))
    usable, last = mse_kernel.usable, {}

    def ours(kernel):
        def call():
            mse_kernel.usable = usable if kernel else (lambda *a: False)
            try:
                obs = get_observer("nvfp4_expanded_mse", spec)
                obs(w)
                obs.qparams()
            finally:
                mse_kernel.usable = usable
            last["kernel" if kernel else "torch"] = (*obs.calculate_range(), obs.global_amax())
        return call

    calls = {"kernel": ours(True), "torch": ours(False)}
    pm, why = peer()
    if pm is not None:
        args = pm.quant_args(NVFP4_CASE)
        calls["theirs"] = lambda: last.__setitem__(
            "theirs", (*pm.observe(w, NVFP4_CASE, args)[0], None))
    load0 = os.getloadavg()[0]
    med = compare(calls, repeat=REPEAT, warmup=0)
    load1 = os.getloadavg()[0]
    u = spec.layout.to_units(w)
    err = {k: range_error(u, lo.reshape(-1), hi.reshape(-1), spec, global_amax=ga).sum().item()
           for k, (lo, hi, ga) in last.items()}
    same = all(torch.equal(a, b) for a, b in zip(last["kernel"][:2], last["torch"][:2]))
    Path(out).write_text(json.dumps({"seconds": med, "error": err, "peer_error": why,
                                     "same_ranges": same, "load": [load0, load1],
                                     "err_minmax": range_error(u, *unit_minmax(u), spec)
                                     .sum().item()}))


def _reset_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _torch_peaks(call, tensors) -> list[int] | None:
    """Peak bytes of torch's live allocations during each call, from the profiler's timeline."""
    try:
        from torch._C._profiler import _EventType
        from torch.profiler import ProfilerActivity, profile, record_function
    except ImportError:
        return None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for i, w in enumerate(tensors.values()):
            with record_function(f"call{i}"):
                call(w)
    peaks = []
    for node in prof.profiler.kineto_results.experimental_event_tree():
        if not node.name.startswith("call"):
            continue
        allocs, stack = [], [node]
        while stack:
            n = stack.pop()
            if n.tag == _EventType.Allocation and n.extra_fields.device.type == "cpu":
                allocs.append((n.start_time_ns, n.extra_fields.alloc_size))
            stack.extend(n.children)
        cur = peak = 0
        for _, size in sorted(allocs):
            cur += size
            peak = max(peak, cur)
        peaks.append(peak)
    return peaks if len(peaks) == len(tensors) else None


def peak(path: str, side: str, layout: str, out: str) -> None:
    if not os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        raise SystemExit("peak: run with MALLOC_MMAP_THRESHOLD_ set (see the module docstring)")
    spec, lc = LAYOUTS[layout]
    if side == "ours":
        call = ours_call(spec)
    else:
        pm, why = peer()
        if pm is None:
            raise SystemExit(f"peak theirs: llm-compressor does not import: {why}")
        call = theirs_call(pm, lc)
    tensors = load(path)
    first = next(iter(tensors.values()))
    call(first[:256].clone())  # imports, registries, native kernel build, thread pool
    calls = []
    for name, w in tensors.items():
        gc.collect()
        reset = _reset_hwm()
        rss0, hwm0 = status_kb("VmRSS", "VmHWM")
        r = call(w)
        (hwm,) = status_kb("VmHWM")
        del r
        calls.append({"tensor": name, "input_kb": w.numel() * w.element_size() / 1024,
                      "rss_peak_kb": hwm - rss0 if reset else None,
                      "reset_ok": reset and hwm0 - rss0 < 1024})
    tp = _torch_peaks(call, tensors)
    for c, p in zip(calls, tp or [None] * len(calls)):
        c["torch_peak_kb"] = None if p is None else p / 1024
    Path(out).write_text(json.dumps({"calls": calls}))


if __name__ == "__main__":
    cmd, *rest = sys.argv[1:]
    {"time": time_cases, "peak": peak, "nvfp4": nvfp4_expanded}[cmd](*rest)
