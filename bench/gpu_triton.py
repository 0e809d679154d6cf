"""Issue 35 item 5 on a lent GPU: the quantscope:: ops (Triton on CUDA) side by side with the
floor and the peers, printed as markdown tables for docs/benchmarks.md.

    python bench/gpu_triton.py                         # CUDA, 4096 x 4096 (bench/gpu_check.sh)
    python bench/gpu_triton.py --device cpu --size 256 # a dry run of the script on the CPU

Wall time: the median over interleaved calls (A B A B ...), each synchronized. Device time:
the sum of the CUDA kernels' own times in one call (torch.profiler), the figure to hold to
one ``torch.aminmax``. Rows: min-max + qparams per channel / group-128 / MXFP4 / NVFP4 (fp32
and bf16) by the ops against one ``torch.aminmax`` and the memoryless min-max observer
(forward + ``calculate_qparams``, which calls the same ops and reads the non-finite flag back);
the int4 per-channel MSE search (``mse_search``'s default engine on CUDA: candidates priced by
``quantscope::mse_price_int``, chosen by ``quantscope::mse_select``) against the torch path
and llm-compressor 0.14's ``memoryless_mse`` (its Triton backend on CUDA; carried as wheels by
bench/gpu_wheels.sh), with each one's total squared error, and quantscope's search under
llm-compressor's rules (norm 2.4, global patience: the compat classes' search, on the ops
and on the torch path), and the MXFP4 search
(``quantscope::mx_mse``) against the torch path; the histogram observe + qparams (8
growing bf16 batches; the native observer and the torch.ao compat class) against torch.ao's
``HistogramObserver`` on the same device; an activation observer's call, host and wall time
per call (what the whole-model row's "observers add <= 10 %" is made of); a layer's seven
weights in one grouped launch (``quantscope::grouped_unit_minmax``) and their observers
through ``observe_many``; the NVFP4 block-scale
search on a 2 size x size weight against llm-compressor's ``nvfp4_expanded_mse`` and
ModelOpt's Triton fp8-scale sweep (bench/gpu_nvfp4.py); a random-weight ~1.2 B Llama's
calibration against its plain forward and llm-compressor's ``oneshot`` (bench/gpu_model.py).
Asked for only (``--rows imatrix``, not a row of the issue's table): the NVFP4 imatrix search
(bench/gpu_imatrix.py). A row that fails prints its traceback; the others still run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
import traceback

import torch
from common import Table
from gpu_imatrix import bench_imatrix
from gpu_model import bench_model
from gpu_nvfp4 import bench_nvfp4
from gpu_timing import device_name, device_seconds, runnable, sync, us, wall_medians

import quantscope as qs
from quantscope import QuantSpec
from quantscope.estimators.mse import mse_search
from quantscope.kernels import ops
from quantscope.layout import Channel, Group
from quantscope.observers import observe_many
from quantscope.qdq import fake_quantize_units
from quantscope.qparams import qparams_from_range

# ---- min-max + qparams ---------------------------------------------------------------------


def _qparams(units, spec):
    """Min-max qparams of ``units`` by the public path: ``unit_minmax`` and
    ``qparams_from_range`` (off the CPU one op each: ``int_qparams``,
    ``e8m0_block_scales``, ``nvfp4_qparams``, the NVFP4 global scale found on the device)."""
    lo, hi = ops.unit_minmax(units)
    return qparams_from_range(lo, hi, spec, check_finite=False)


def _observer(spec, w):
    obs = qs.get_observer("memoryless_minmax", spec).to(w.device)

    def call():
        obs(w)
        return obs.calculate_qparams()
    return call


def minmax_cases(w):
    """name -> (ours, the min-max observer) callables on the weight ``w``."""
    specs = {"channel int8": QuantSpec("int8", Channel(0)),
             "group-128 int4": QuantSpec("int4", Group(128)),
             "MXFP4": qs.presets.MXFP4, "NVFP4": qs.presets.NVFP4}
    units = {"channel int8": w, "group-128 int4": w.view(-1, 128), "MXFP4": w.view(-1, 32),
             "NVFP4": w.view(-1, 16)}
    return {name: (lambda u=units[name], s=spec: _qparams(u, s), _observer(spec, w))
            for name, spec in specs.items()}


def bench_minmax(size, device, repeat):
    table = Table(f"min-max + qparams, {size} x {size} weight, {device_name(device)}",
                  ["case", "dtype", "aminmax wall us", "ops wall us", "ops wall / aminmax",
                   "aminmax device us", "ops device us", "ops device / aminmax",
                   "observer wall us", "observer wall / aminmax", "observer device / aminmax"])
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(size, size, generator=g).to(device=device, dtype=dtype)
        floor = lambda w=w: torch.aminmax(w)
        floor_dev = device_seconds(floor, device)
        for name, (ours, observer) in minmax_cases(w).items():
            t = wall_medians({"floor": floor, "ours": ours, "observer": observer}, device,
                             repeat, 3)
            dev, obs_dev = device_seconds(ours, device), device_seconds(observer, device)
            table.add(name, str(dtype).removeprefix("torch."), us(t["floor"]), us(t["ours"]),
                      t["ours"] / t["floor"], us(floor_dev), us(dev),
                      None if dev is None else dev / floor_dev, us(t["observer"]),
                      t["observer"] / t["floor"],
                      None if obs_dev is None else obs_dev / floor_dev)
    table.print()


# ---- an activation observer's call: the host's time -----------------------------------------

def bench_calls(size, device, calls=200):
    """The whole-model row's cost per observer call: a static activation observer (one
    ``8 x 512 x size / 2`` bf16 batch, per tensor) called ``calls`` times back to back.
    "host": the time to queue the calls (what the host spends; hidden behind the model's GPU
    work while it is shorter), "wall": until the device has run them, per call; the floor is
    one ``torch.aminmax`` (one read of the batch)."""
    from torch.ao.quantization.observer import HistogramObserver, MinMaxObserver

    x = torch.randn(8, 512, size // 2, generator=torch.Generator().manual_seed(5)).to(
        device, torch.bfloat16)
    spec = QuantSpec("int8", "tensor")
    native = {name: qs.get_observer(name, spec).to(device)
              for name in ("static_minmax", "minmax", "histogram")}
    ao_minmax, ao_hist = MinMaxObserver().to(device), HistogramObserver().to(device)
    # CUDA's torch.histc has no bf16 kernel: torch.ao's observers get a float32 copy there
    # (made once, outside the timing: their figures leave out the cast)
    xa, of = (x, "") if device.type == "cpu" else (x.float(), ", float32 copy")
    fns = {"torch.aminmax (floor)": lambda: torch.aminmax(x),
           **{f"quantscope {n}": (lambda o=o: o(x)) for n, o in native.items()},
           f"torch.ao MinMaxObserver{of}": lambda: ao_minmax(xa),
           f"torch.ao HistogramObserver{of}": lambda: ao_hist(xa)}
    table = Table(f"an activation observer's call, 8 x 512 x {size // 2} bf16 per tensor, "
                  f"{calls} calls back to back, {device_name(device)}",
                  ["method", "host us / call", "wall us / call", "wall / aminmax"])
    timed = {}
    with torch.inference_mode():
        fns, skipped = runnable(fns)
        for name, fn in fns.items():
            for _ in range(3):  # warm: state sized, kernels compiled
                fn()
            sync(device)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            host = time.perf_counter() - t0
            sync(device)
            timed[name] = (host / calls, (time.perf_counter() - t0) / calls)
    floor = timed["torch.aminmax (floor)"][1]
    for name, (host, wall) in timed.items():
        table.add(name, us(host), us(wall), wall / floor)
    for name, why in skipped.items():
        table.add(name, why, "", "")
    table.print()
    print("torch.ao's observers read their state back to the host in every call (its histogram "
          "also on every range change), so their host time includes waiting for the device.\n")


# ---- the int4 per-channel MSE search -------------------------------------------------------

def _total_error(units, spec, lo, hi):
    """The float64 total squared fake-quant error of ``units`` under per-unit ranges."""
    qp = qparams_from_range(lo, hi, spec, check_finite=False)
    q = fake_quantize_units(units, qp.effective_scale.reshape(-1, 1),
                            qp.zero_point.reshape(-1, 1).float(), spec)
    return float((q - units).double().square().sum())


def _llmc_call(w):
    """llm-compressor's memoryless_mse, int4 per channel (the observer built once, its search
    timed alone, as ours), and which of its backends runs; or None and the reason it cannot
    run."""
    try:
        from peer_llmcompressor_mse import search, weight_observer

        obs = weight_observer({"observer": "memoryless_mse", "num_bits": 4,
                               "strategy": "channel"})
        search(obs, w)
    except Exception as e:  # noqa: BLE001 (any failure of the carried peer: say it, go on)
        return None, f"{type(e).__name__}: {e}"[:160]

    def call():
        lo, hi = search(obs, w)
        return lo.reshape(-1), hi.reshape(-1)
    return call, _llmc_backend(obs, w)


def _llmc_backend(obs, w) -> str:
    """Which of llm-compressor's MSE grid searches ``obs`` runs on ``w``: its Triton kernel, or
    its eager torch loop (a failed Triton import falls back without a word)."""
    try:
        from llmcompressor.observers.mse_quant import _mse_triton_req

        triton = _mse_triton_req(w, obs.args)
    except Exception as e:  # noqa: BLE001
        return f"backend unknown ({type(e).__name__})"
    return "Triton backend" if triton else "eager backend"


def bench_mse(size, device, repeat):
    spec = QuantSpec("int4", Channel(0))
    w = torch.randn(size, size, generator=torch.Generator().manual_seed(1)).to(device)
    table = Table(f"MSE search, int4 per channel, {size} x {size} fp32, {device_name(device)}",
                  ["method", "wall ms", "device ms", "total squared error", "llm-compressor / ours"])
    # the default engine: the ops on CUDA (every candidate priced by one Triton launch, one
    # selection launch), the C kernel on the CPU
    compat = {"compat": "llmcompressor", "norm": 2.4}  # the compat classes' search
    fns = {"quantscope mse_search (ops)": lambda: mse_search(w, None, None, spec),
           "quantscope torch path": lambda: mse_search(w, None, None, spec, backend="torch"),
           "quantscope llm-compressor rules (ops)": lambda: mse_search(w, None, None, spec,
                                                                       **compat),
           "quantscope llm-compressor rules, torch path": lambda: mse_search(
               w, None, None, spec, backend="torch", **compat)}
    llmc, said = _llmc_call(w)  # said: the backend that runs, or why none does
    peer = "llm-compressor memoryless_mse"
    if llmc is not None:
        peer, said = f"{peer} ({said})", None
        fns[peer] = llmc
    t = wall_medians(fns, device, repeat, 1)
    for name, fn in fns.items():
        lo, hi = fn()[:2]
        table.add(name, 1e3 * t[name], None if (d := device_seconds(fn, device, 1)) is None
                  else 1e3 * d, _total_error(w, spec, lo, hi),
                  t.get(peer, float("nan")) / t[name])
    if said:
        table.add(peer, "not run: " + said, "", "", "")
    table.print()
    bench_mse_mx(w, device, repeat)


def bench_mse_mx(w, device, repeat):
    """The native MSE search on MXFP4 blocks of ``w``: the ops engine (``quantscope::mx_mse``,
    each block's distinct E8M0 scales priced once) against the torch path (a tile of ops per
    candidate), their total squared errors equal (the same choices)."""
    spec, units = qs.presets.MXFP4, w.reshape(-1, 32)
    fns = {"quantscope mse_search (ops: mx_mse)": lambda: mse_search(units, None, None, spec),
           "quantscope torch path": lambda: mse_search(units, None, None, spec,
                                                       backend="torch")}
    t = wall_medians(fns, device, max(3, repeat // 3), 1)
    table = Table(f"MSE search, MXFP4 (block 32, E8M0 floor), {tuple(w.shape)} fp32, "
                  f"{device_name(device)}", ["method", "wall ms", "device ms",
                                             "total squared error", "torch path / this"])
    for name, fn in fns.items():
        r = fn()
        table.add(name, 1e3 * t[name], None if (d := device_seconds(fn, device, 1)) is None
                  else 1e3 * d, _total_error(units, spec, r.lo, r.hi),
                  t["quantscope torch path"] / t[name])
    table.print()


# ---- a layer's weights in one launch --------------------------------------------------------

def bench_grouped(size, device, repeat):
    """Per-channel min / max of a Llama layer's seven weights (hidden ``size``, MLP 2.6875x):
    one grouped launch against one op per weight, and one ``aminmax`` per weight; and the
    seven memoryless int8 per-channel observers, forward each against ``observe_many`` (on
    the CPU it calls forward: the rows there time the same path twice)."""
    mlp = int(size * 2.6875)
    shapes = [(size, size)] * 4 + [(mlp, size)] * 2 + [(size, mlp)]
    g = torch.Generator().manual_seed(3)
    ws = [torch.randn(*s, generator=g).to(device, torch.bfloat16) for s in shapes]
    _check_grouped(ws)
    spec = QuantSpec("int8", "channel")
    observers = [qs.get_observer("memoryless_minmax", spec).to(device) for _ in ws]
    fns = {"aminmax per weight": lambda: [torch.aminmax(w) for w in ws],
           "unit_minmax per weight": lambda: [ops.unit_minmax(w) for w in ws],
           "grouped_unit_minmax (one launch)": lambda: ops.grouped_unit_minmax(ws),
           "7 observers, forward each": lambda: [o(w) for o, w in zip(observers, ws)],
           "7 observers, observe_many": lambda: observe_many(list(zip(observers, ws)))}
    t = wall_medians(fns, device, repeat, 3)
    table = Table(f"a layer's 7 weights, per-channel min / max, bf16, hidden {size}, "
                  f"{device_name(device)}", ["method", "wall us", "device us",
                                              "wall / aminmax per weight"])
    for name, fn in fns.items():
        table.add(name, us(t[name]), us(device_seconds(fn, device)),
                  t[name] / t["aminmax per weight"])
    table.print()


def _check_grouped(ws):
    """The grouped launch gives each weight the bits of its own op, in its own tensors."""
    los, his = ops.grouped_unit_minmax(ws)
    for w, lo, hi in zip(ws, los, his, strict=True):
        want_lo, want_hi = ops.unit_minmax(w)
        if not (torch.equal(lo, want_lo) and torch.equal(hi, want_hi)):
            raise AssertionError(f"grouped_unit_minmax differs from unit_minmax on "
                                 f"{tuple(w.shape)}")


# ---- histogram observe ---------------------------------------------------------------------

def native_hist_observe(batches, bins=2048):
    """quantscope's native histogram observer over ``batches``, then its qparams: off the CPU
    each batch is ``quantscope::unit_minmax``, the grid change (tensor math) and
    ``quantscope::hist_add``."""
    obs = qs.get_observer("histogram", QuantSpec("uint8", symmetric=False),
                          bins=bins).to(batches[0].device)
    for b in batches:
        obs(b)
    return obs.calculate_qparams()


def ao_observe(cls, batches, bins=2048):
    """torch.ao's ``HistogramObserver`` (or quantscope's compat class of it) over ``batches``,
    then ``calculate_qparams``: ``(scale, zero_point)``."""
    obs = cls(bins=bins).to(batches[0].device)
    for b in batches:
        obs(b)
    return obs.calculate_qparams()


def bench_histogram(size, device, repeat):
    from torch.ao.quantization.observer import HistogramObserver

    from quantscope.compat.torch_ao import HistogramObserver as Compat

    tokens = 2048 if size >= 4096 else 256
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(16, tokens, size, generator=g) * (1 + i)).to(device, torch.bfloat16)
               for i in range(8)]  # a growing range: every batch widens it
    as_float = [b.float() for b in batches]
    table = Table(f"histogram observe + qparams, 8 batches 16 x {tokens} x {size} bf16, growing "
                  f"range, {device_name(device)}",
                  ["method", "wall ms", "device ms", "torch.ao / ours",
                   "qparams = torch.ao's on the float32 values"])
    peer = "torch.ao HistogramObserver, float32 copies"
    fns = {"quantscope native histogram (ops)": lambda: native_hist_observe(batches),
           "quantscope torch.ao HistogramObserver (compat)": lambda: ao_observe(Compat, batches),
           "torch.ao HistogramObserver": lambda: ao_observe(HistogramObserver, batches),
           peer: lambda: ao_observe(HistogramObserver, as_float)}
    # CUDA's torch.histc has no bf16 kernel: there torch.ao runs on the float32 copies only
    # (made outside the timing), the ratio's reference
    fns, skipped = runnable(fns)  # each run once: the warm-up
    t = wall_medians(fns, device, repeat, 0)
    ref = fns[peer]()
    for name, fn in fns.items():
        d = device_seconds(fn, device, 1)
        qp = fn()
        same = all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(qp, ref))
        table.add(name, 1e3 * t[name], None if d is None else 1e3 * d,
                  t.get("torch.ao HistogramObserver", t[peer]) / t[name], "yes" if same else "no")
    for name, why in skipped.items():
        table.add(name, why, "", "", "")
    table.print()
    if "torch.ao HistogramObserver" in fns:
        ao = HistogramObserver(bins=2048).to(device)
        for b in batches:
            ao(b)
        print(f"torch.ao bins bf16 batches in bf16 (torch.histc's positions and counts): its "
              f"histogram holds {float(ao.histogram.sum()):.4g} of "
              f"{sum(b.numel() for b in batches):.4g} values.")
    print("The compat class counts every value, "
          "as torch.ao counts the float32 copies (its qparams are compared with those). The "
          "native histogram is quantscope's (aligned power-of-two grids, exact merges, its own "
          "range choice), not torch.ao's algorithm: its qparams are not torch.ao's. The compat "
          "class runs torch.ao's histogram step as torch.ao's own tensor ops off the CPU, "
          "but its histc over float32 copies of 2 ** 24 values at a time (quantscope::ao_histc) "
          "and its "
          "decisions on the ends read back once a batch (torch.ao: 8 to 18 reads), and its "
          "L2 search vectorized (4 host reads; torch.ao's ~970).\n")


ROWS = ("minmax", "calls", "grouped", "mse", "histogram", "nvfp4", "model")
#: rows run only when asked for (--rows): not in issue 35's table
ASKED_ONLY = ("imatrix",)


def _versions() -> dict:
    from importlib import metadata

    versions = {}
    for dist in ("torch", "triton", "transformers", "llmcompressor", "compressed-tensors",
                 "nvidia-modelopt"):  # the peers: from the wheelhouse on a device run
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = "absent"
    try:  # the NVIDIA driver, for docs/benchmarks.md (torch knows only its CUDA version)
        versions["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=False).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        versions["driver"] = "unknown"
    return versions


def _run_row(name, fn, *args):
    """One row; a failure prints its traceback and the next rows still run (one device call
    has to bring back every table it can)."""
    t0 = time.perf_counter()
    try:
        fn(*args)
    except Exception:  # noqa: BLE001
        print(f"row {name} failed:\n```\n{traceback.format_exc()[-3000:]}```\n")
    print(f"(row {name}: {time.perf_counter() - t0:.1f} s)\n", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", type=int, default=4096, help="the weights' width (rows 1-5)")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--model-size", type=int, default=None,
                    help="the whole-model row's hidden size (default size / 2: 2048, ~1.2 B "
                         "parameters; under 2048: 2 layers and 16 x 64 tokens)")
    ap.add_argument("--rows", default=os.environ.get("QUANTSCOPE_GPU_ROWS", ",".join(ROWS)),
                    help=f"which rows, of {','.join(ROWS)} (default: $QUANTSCOPE_GPU_ROWS or "
                         "all; bench/run.py passes no arguments)")
    a = ap.parse_args()
    rows = a.rows.split(",")
    if unknown := set(rows) - set(ROWS + ASKED_ONLY):
        ap.error(f"--rows: unknown {sorted(unknown)}; expected some of "
                 f"{','.join(ROWS + ASKED_ONLY)}")
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("(no CUDA device: skipped)")
        return
    print(f"{device_name(device)}; {_versions()}; CUDA {torch.version.cuda}\n")
    hidden = a.model_size or a.size // 2
    tokens = (64, 512) if hidden >= 2048 else (16, 64)
    calls = {"minmax": (bench_minmax, a.size, device, a.repeat),
             "calls": (bench_calls, a.size, device),
             "grouped": (bench_grouped, a.size, device, a.repeat),
             "mse": (bench_mse, a.size, device, max(3, a.repeat // 3)),
             "histogram": (bench_histogram, a.size, device, max(3, a.repeat // 5)),
             "nvfp4": (bench_nvfp4, a.size, device, max(3, a.repeat // 3)),
             "model": (bench_model, hidden, device, *tokens),
             "imatrix": (bench_imatrix, a.size, device, max(3, a.repeat // 3))}
    for name in rows:
        _run_row(name, *calls[name])


if __name__ == "__main__":
    main()
