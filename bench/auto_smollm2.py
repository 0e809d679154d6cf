"""SmolLM2-135M w8a8 (lm_head float), issue 17: min-max vs auto calibration CPU time, then the
perplexity on the 50 Lee documents of auto, of auto with its most damaged activations left
dynamic per token (``keep_float(..., mode="dynamic")`` ranked by ``layer_sensitivity`` on the
calibration batches), and of the single observers.

``python bench/auto_smollm2.py OUT.json [time|quality] [RUNS]`` (results written after each
step; ``time`` alternates min-max and auto RUNS times, medians reported).
"""

import json
import os
import statistics
import sys
import time

import torch

from quantscope.calibration import calibrate, calibrate_many, keep_float, preset
from quantscope.calibration.choice.auto import OutputDivergence, score_pieces
from quantscope.calibration.choice.sensitivity import layer_sensitivity
from quantscope.demo import data, models

torch.set_num_threads(1)
OUT = sys.argv[1]
PHASE = sys.argv[2] if len(sys.argv) > 2 else "quality"
RUNS = int(sys.argv[3]) if len(sys.argv) > 3 else 3
res = {}
if os.path.exists(OUT):
    with open(OUT) as f:
        res = json.load(f)
res.setdefault("ppl", {})
res.setdefault("time", {})
res["versions"] = {"torch": torch.__version__}


def dump():
    with open(OUT, "w") as f:
        json.dump(res, f, indent=1)


model, tok = models.load_model("smollm2-135m")
docs = data.lee_background()
calib = docs[:: len(docs) // 32][:32]
batches = models.token_batches(tok, calib, 128, 8)
lee = data.lee_documents()
IGN = ["*lm_head*"]


def ppl(states):
    from quantscope.calibration import apply

    with apply(model, states):
        return models.perplexity(model, tok, lee)


if PHASE == "time":
    # CPU seconds of this single-threaded process: on a shared box wall time measures the
    # neighbours; min-max and auto alternate so a change of load hits both
    runs = {"minmax": [], "auto": []}
    for _ in range(RUNS):
        for obs, seconds in runs.items():
            t = time.process_time()
            c = calibrate(model, batches, preset("w8a8", obs, ignore=IGN), progress=False)
            seconds.append(time.process_time() - t)
            if obs == "auto":
                res["auto_info"] = c.info.get("auto")
            print(obs, seconds[-1], flush=True)
        res["time"] = {k: {"runs": v, "median": statistics.median(v)} for k, v in runs.items()}
        res["load"] = os.getloadavg()
        dump()
    raise SystemExit(0)

# quality: auto and the single observers in one pass
t = time.process_time()
au = calibrate(model, batches, preset("w8a8", "auto", ignore=IGN), progress=False)
res["auto_info"] = au.info.get("auto")
print("auto", au.info.get("auto"), time.process_time() - t, flush=True)
singles = ["mse", "mix", "histogram_mse"]
cs = calibrate_many(model, batches, {o: preset("w8a8", o, ignore=IGN) for o in singles},
                    progress=False)
# the fallback: auto's activations ranked by their layer's relative output error on the
# calibration batches (one forward each), the first N left dynamic per token
sens = layer_sensitivity(model, batches, au, roles=("input",))
res["ranking"] = [f"{r['layer']} {r['divergence']:.4g}" for r in sens.rows[:16]]
div = OutputDivergence(model, score_pieces(batches, 1024))
configs = {"auto": au.states}
for n in (4, 8, 16):
    configs[f"auto+dynamic{n}"] = keep_float(au, sens, n, mode="dynamic").states
res["score_kl"] = {k: div.of(v) for k, v in configs.items()}
print(res["score_kl"], flush=True)
dump()
for k in ("auto", "auto+dynamic16", "auto+dynamic8", *singles):
    states = configs[k] if k in configs else cs[k].states
    t = time.process_time()
    res["ppl"][k] = ppl(states)
    dump()
    print(k, res["ppl"][k], time.process_time() - t, flush=True)
