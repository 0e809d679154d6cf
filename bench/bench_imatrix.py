"""The NVFP4 imatrix (importance-weighted MSE) search on a 1024 x 4096 weight, one thread
(issue 35 items 1 and 6): quantscope's ``imatrix_mse`` on the C kernel's weighted pricing,
the same search on its torch path (the kernel turned off: the same float64 arithmetic), the
torch loop it replaced (float32 sums, one fake-quant of the weight per factor), and
llm-compressor 0.14's ``imatrix_mse`` on the same grid (norm 2, factors 1.00 .. 0.81, no
patience), interleaved call by call; each side's importance-weighted squared error of its
ranges as NVFP4 runs them (fp8 block scales, the global scale).

    python bench/bench_imatrix.py            # the table
    python bench/bench_imatrix.py worker OUT.json   # the measuring side (run by main)

The measuring side runs under the peers' python (``.peers``, or $QUANTSCOPE_PEER_PYTHON)
where llm-compressor is installed, with quantscope from ../src; else under this python
without the peer's row.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))  # quantscope from this checkout in the peer's venv
sys.path.insert(0, str(HERE))

import torch
from common import Table, add_sides, compare

PEER_PY = Path(os.environ.get("QUANTSCOPE_PEER_PYTHON", HERE.parent / ".peers" / "bin" / "python"))
REPEAT = int(os.environ.get("QUANTSCOPE_BENCH_REPEAT", "5"))
SHAPE = (1024, 4096)
#: llm-compressor's imatrix_mse on quantscope's grid: p = 1 - i / 100, i = 0 .. 19 (19.000...04)
PEER_CASE = {"observer": "imatrix_mse", "num_bits": 4, "type": "float",
             "strategy": "tensor_group", "group_size": 16, "scale_dtype": "float8_e4m3fn",
             "observer_kwargs": {"maxshrink": 0.19, "grid": 100, "norm": 2.0, "patience": 0}}


def _inputs():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*SHAPE, generator=g)
    importance = torch.exp(2 * torch.randn(SHAPE[1], generator=g))  # spread over decades
    return w, importance


def _ours(w, importance, mode):
    """quantscope's imatrix_mse observer: mode "kernel", "torch" (no kernel: the torch
    float64 path) or "float32" (the float32 torch loop this search had before)."""
    from quantscope import presets
    from quantscope.kernels import price_ops
    from quantscope.observers import get_observer
    from quantscope.observers import imatrix as imatrix_observer

    search, c_lib = imatrix_observer.weighted_search, price_ops._c_lib
    try:
        if mode == "torch":  # the pricing op's torch path, as a build without the C kernel
            price_ops._c_lib = lambda name: None
        if mode == "float32":
            imatrix_observer.weighted_search = functools.partial(search, float32_sums=True)
        obs = get_observer("imatrix_mse", presets.NVFP4, importance=importance)
        obs(w)
        obs.qparams()
        return obs.calculate_range()
    finally:
        imatrix_observer.weighted_search, price_ops._c_lib = search, c_lib


def _theirs(w, importance, pm):
    """llm-compressor's imatrix_mse fed the importance as its hook would have summed it."""
    from llmcompressor.observers import Observer

    args = pm.quant_args(PEER_CASE)
    obs = Observer.load_from_registry("imatrix_mse", base_name="weight",
                                      args=args.model_copy(deep=True))
    obs._imatrix_sum = importance.clone()
    obs._imatrix_count = torch.tensor(1, dtype=torch.int64)
    obs(w)
    return obs.min_vals, obs.max_vals


def weighted_error(w, importance, lo, hi) -> float:
    """sum_j imp_j (Q(w) - w)^2 with NVFP4 as it runs (qparams_from_range of the ranges)."""
    from quantscope import presets
    from quantscope.estimators.weighted import importance_units
    from quantscope.qdq import fake_quantize_units
    from quantscope.qparams import qparams_from_range

    spec = presets.NVFP4
    u = spec.layout.to_units(w)
    weights = importance_units(importance, w.shape, spec)
    qp = qparams_from_range(lo.reshape(-1), hi.reshape(-1), spec)
    scale = qp.effective_scale.expand(u.shape[0]).reshape(-1, 1)
    d = fake_quantize_units(u, scale, qp.zero_point.float().expand(u.shape[0]).reshape(-1, 1),
                            spec) - u
    return float((d.double().square() * weights.double()).sum())


def measure(out: str) -> None:
    torch.set_num_threads(1)
    w, importance = _inputs()
    last = {}
    calls = {m: (lambda m=m: last.__setitem__(m, _ours(w, importance, m)))
             for m in ("kernel", "torch", "float32")}
    why = None
    try:
        import llmcompressor.observers  # noqa: F401
        import peer_llmcompressor_mse as pm
        calls["theirs"] = lambda: last.__setitem__("theirs", _theirs(w, importance, pm))
    except Exception as e:  # noqa: BLE001 (a broken peer install must not stop our figures)
        why = f"{type(e).__name__}: {e}"
    load0 = os.getloadavg()[0]
    med = compare(calls, repeat=REPEAT, warmup=0)
    load1 = os.getloadavg()[0]
    from quantscope.stats.minmax import unit_minmax

    mm = unit_minmax(w.reshape(-1, 16))
    err = {k: weighted_error(w, importance, lo, hi) for k, (lo, hi) in last.items()}
    same = {k: all(torch.equal(a.reshape(-1), b.reshape(-1))
                   for a, b in zip(last["kernel"], last[k])) for k in last}
    Path(out).write_text(json.dumps({"seconds": med, "error": err, "same_as_kernel": same,
                                     "err_minmax": weighted_error(w, importance, *mm),
                                     "peer_error": why, "load": [load0, load1]}))


def main():
    python = str(PEER_PY) if PEER_PY.exists() else sys.executable
    print(f"  NVFP4 imatrix search {SHAPE[0]} x {SHAPE[1]}, one thread, interleaved, {REPEAT} "
          f"rounds ...", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "out.json")
        proc = subprocess.run([python, __file__, "worker", out], check=False,
                              stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
        if proc.returncode != 0:
            raise RuntimeError(f"bench_imatrix worker failed:\n{proc.stderr[-3000:]}")
        r = json.loads(Path(out).read_text())
    t = Table(f"NVFP4 imatrix_mse (norm 2, factors 1.00 .. 0.81), {SHAPE[0]} x {SHAPE[1]} "
              "Gaussian weight, log-normal importance, one thread, interleaved call by call",
              ["side", "s", "llm-c s / side s", "weighted sq. error", "err / llm-c",
               "err / min-max", "ranges = C kernel's"])
    names = {"kernel": "quantscope (C kernel, float64 sums)",
             "torch": "quantscope (torch path, same arithmetic)",
             "float32": "quantscope, the float32 torch loop (the pricing before)",
             "theirs": "llm-compressor 0.14 imatrix_mse"}
    add_sides(t, names, r, lambda k: (str(r["same_as_kernel"][k]),))
    t.print()
    if r["peer_error"]:
        print(f"llm-compressor not measured: {r['peer_error']}")
    print(f"load average {r['load'][0]:.1f} at the start, {r['load'][1]:.1f} at the end "
          f"(1-minute).\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        measure(sys.argv[2])
    else:
        main()
