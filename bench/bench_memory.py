"""Peak memory and time of calibration against a plain forward over the same batches.

Each case runs in a child process (``python bench_memory.py CASE``) and reports its peak
resident set (``resource.getrusage(RUSAGE_SELF).ru_maxrss``: torch's allocations included,
which tracemalloc does not see) after loading the model, and after the case's work. The
model is the decoder demo model (SmolLM2-135M, 0.54 GB of float32 weights); the data 64 Lee
background documents of up to 256 tokens in batches of 8, as issue 18 measured
(``--docs N`` for a quicker run while iterating; ``--cases`` to run only some).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

CASES = ("forward", "minmax", "seven")
DOCS, TOKENS, BATCH = 64, 256, 8
SEVEN = ("minmax", "mse", "percentile", "entropy", "mix", "histogram_mse", "static_minmax")


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_case(case: str, docs_n: int = DOCS) -> dict:
    import torch

    import quantscope
    from quantscope import data, models

    torch.set_num_threads(1)
    model, tok = models.load_model("smollm2-135m")
    docs = data.lee_background()[::300 // docs_n][:docs_n]
    batches = models.token_batches(tok, docs, TOKENS, BATCH)
    out = {"case": case, "loaded_mb": _peak_mb(),
           "model_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20}
    t = time.perf_counter()
    if case == "forward":
        with torch.inference_mode():
            for b in batches:
                model(**b)
    elif case == "minmax":
        quantscope.calibrate(model, batches, quantscope.calibrate.preset(
            "w8a8", "minmax", ignore=["lm_head"]), progress=False)
    elif case == "seven":
        recipes = {o: quantscope.calibrate.preset("w8a8", o, ignore=["lm_head"]) for o in SEVEN}
        quantscope.calibrate.calibrate_many(model, batches, recipes, progress=False)
    else:
        raise SystemExit(f"bench_memory: unknown case {case!r}; expected one of {CASES}")
    out.update(seconds=time.perf_counter() - t, peak_mb=_peak_mb())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=DOCS, help=f"documents (default {DOCS})")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES,
                   help="cases to run ('forward' is always run first, as the baseline)")
    args = p.parse_args()
    rows = []
    for case in dict.fromkeys(["forward", *args.cases]):
        r = subprocess.run([sys.executable, __file__, "--case", case, str(args.docs)],
                           capture_output=True, text=True, check=False,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        if r.returncode:
            print(r.stderr[-2000:])
            raise SystemExit(f"bench_memory: case {case} failed")
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    fwd = rows[0]
    print("| case | peak MB | above forward MB | above forward / model | seconds | / forward |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        above = r["peak_mb"] - fwd["peak_mb"]
        print(f"| {r['case']} | {r['peak_mb']:.0f} | {above:+.0f} | {above / r['model_mb']:+.2f} "
              f"| {r['seconds']:.1f} | {r['seconds'] / fwd['seconds']:.2f} |")
    print(f"\nmodel {fwd['model_mb']:.0f} MB of parameters; {args.docs} documents x <= {TOKENS} "
          f"tokens, batches of {BATCH}; goal: peak within 25 % of the model above forward")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--case":
        print(json.dumps(run_case(sys.argv[2], int(sys.argv[3]))))
    else:
        main()
