"""Peak memory and time of calibration against a plain forward over the same batches.

Each case runs in a child process (``python bench_memory.py CASE``) and reports its peak
resident set (``VmHWM`` of ``/proc/self/status``: torch's allocations included,
which tracemalloc does not see) after loading the model, and after the case's work. The
model is the decoder demo model (SmolLM2-135M, 0.54 GB of float32 weights); the data 64 Lee
background documents of up to 256 tokens in batches of 8, as issue 18 measured
(``--docs N`` for a quicker run while iterating; ``--cases`` to run only some; ``--runs N``
runs each case N times and reports medians: peaks move by 100-400 MB between runs).

Cases: ``forward`` (the baseline), ``minmax`` and ``seven`` (seven observers in one pass),
each also ``-notrim`` (``QUANTSCOPE_HEAP=0``: neither ``malloc_trim`` between batches nor a fixed mmap threshold: calibration/run/heap.py),
``sequential`` (min-max, block by block from the checkpoint into an empty skeleton: the
whole model is never loaded), and ``oneshot`` (llm-compressor's ``oneshot``, W8A8 with
static per-tensor min-max inputs, in ``$QUANTSCOPE_PEER_PYTHON``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from common import status_kb

CASES = ("forward", "minmax", "minmax-notrim", "seven", "seven-notrim", "sequential",
         "oneshot")
PEER_PYTHON = os.environ.get("QUANTSCOPE_PEER_PYTHON", "/work/main/.peers/bin/python")
DOCS, TOKENS, BATCH = 64, 256, 8
SEVEN = ("minmax", "mse", "percentile", "entropy", "mix", "histogram_mse", "static_minmax")


def _peak_mb() -> float:
    """This process's peak resident set: VmHWM, not ``ru_maxrss``, which Linux carries over
    from the parent through fork and exec (under ``make bench``, after the other benches,
    every case read the parent's 3.5 GB)."""
    try:
        return status_kb("VmHWM")[0] / 1024
    except OSError:  # no /proc: the best there is
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_case(case: str, docs_n: int = DOCS) -> dict:
    import torch

    import quantscope
    from quantscope.demo import data, models

    torch.set_num_threads(1)
    case = case.removesuffix("-notrim")
    path = models.resolve_model_path("smollm2-135m")
    if case == "sequential":
        from transformers import AutoTokenizer

        from quantscope.calibration.run.checkpoint import empty_model

        model, tok = empty_model(path), AutoTokenizer.from_pretrained(str(path))
        tok.pad_token, tok.padding_side = tok.pad_token or tok.eos_token, "right"  # as load_model
    else:
        model, tok = models.load_model("smollm2-135m")
    docs = (json.loads(os.environ["BENCH_DOCS"]) if "BENCH_DOCS" in os.environ  # peers' venv
            else data.lee_background()[::300 // docs_n][:docs_n])
    batches = models.token_batches(tok, docs, TOKENS, BATCH)
    out = {"case": case, "loaded_mb": _peak_mb(),
           "model_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20}
    t = time.perf_counter()
    if case == "sequential":
        quantscope.calibrate(model, batches, quantscope.calibrate.preset(
            "w8a8", "minmax", ignore=["lm_head"]), progress=False,
            sequential=quantscope.calibrate.Sequential(checkpoint=path))
    elif case == "oneshot":
        _oneshot(model, tok, batches)
    elif case == "forward":
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


def _oneshot(model, tok, batches) -> None:
    """llm-compressor's oneshot on the same batches: int8 per-channel weights, static int8
    per-tensor inputs, min-max, lm_head in float (its default sequential pipeline)."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    args = {"num_bits": 8, "type": "int", "symmetric": True}
    scheme = QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(**args, strategy="channel"),
        input_activations=QuantizationArgs(**args, strategy="tensor", dynamic=False,
                                           observer="static_minmax"))
    oneshot(model=model, recipe=QuantizationModifier(config_groups={"g": scheme},
                                                     ignore=["lm_head"]),
            dataset=torch.utils.data.DataLoader(batches, batch_size=None), processor=tok,
            num_calibration_samples=len(batches))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=DOCS, help=f"documents (default {DOCS})")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES,
                   help="cases to run ('forward' is always run first, as the baseline)")
    p.add_argument("--runs", type=int, default=1, help="runs of each case; medians reported")
    args = p.parse_args()
    rows = []
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    for case in dict.fromkeys(["forward", *args.cases]):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if case.endswith("-notrim"):
            env["QUANTSCOPE_HEAP"] = "0"
        python = sys.executable
        if case == "oneshot":  # the peers' venv has no gensim: the documents come from here
            from quantscope.demo import data

            python = PEER_PYTHON
            env["BENCH_DOCS"] = json.dumps(data.lee_background()[::300 // args.docs][:args.docs])
            env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
        runs = []
        for _ in range(args.runs):
            r = subprocess.run([python, __file__, "--case", case, str(args.docs)],
                               capture_output=True, text=True, check=False, env=env)
            if r.returncode:
                print(r.stderr[-2000:])
                raise SystemExit(f"bench_memory: case {case} failed")
            runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)  # progress
        row = dict(runs[0], case=case, runs=len(runs))
        for k in ("peak_mb", "seconds", "loaded_mb"):
            row[k] = statistics.median(x[k] for x in runs)
        row["peaks"] = [round(x["peak_mb"]) for x in runs]
        rows.append(row)
    fwd = rows[0]
    model_mb = fwd["model_mb"]
    print("| case | peak MB (median) | runs' peaks | above forward MB | above forward / model "
          "| seconds | / forward |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        above = r["peak_mb"] - fwd["peak_mb"]
        print(f"| {r['case']} | {r['peak_mb']:.0f} | {r['peaks']} | {above:+.0f} | "
              f"{above / model_mb:+.2f} | {r['seconds']:.1f} | {r['seconds'] / fwd['seconds']:.2f} |")
    print(f"\nmodel {fwd['model_mb']:.0f} MB of parameters; {args.docs} documents x <= {TOKENS} "
          f"tokens, batches of {BATCH}; goal: peak within 25 % of the model above forward")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--case":
        print(json.dumps(run_case(sys.argv[2], int(sys.argv[3]))))
    else:
        main()
