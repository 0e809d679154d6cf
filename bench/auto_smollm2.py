"""SmolLM2-135M w8a8 (lm_head float), issue 17: min-max vs auto calibration time, then the
perplexity of auto and of every single observer (and llm-compressor's, through the native
observers in their compat mode) on the 50 Lee documents.

``python bench/auto_smollm2.py OUT.json`` (results are written after each step).
"""

import json
import sys
import time

import torch

from quantscope import presets
from quantscope.calibrate import Recipe, Role, Rule, calibrate, calibrate_many, preset
from quantscope.demo import data, models
from quantscope.layout import Tensor
from quantscope.spec import QuantSpec

torch.set_num_threads(1)
OUT = sys.argv[1]
res = {"ppl": {}, "time": {}}


def dump():
    with open(OUT, "w") as f:
        json.dump(res, f, indent=1)


model, tok = models.load_model("smollm2-135m")
docs = data.lee_background()
calib = docs[:: len(docs) // 32][:32]
batches = models.token_batches(tok, calib, 128, 8)
lee = data.lee_documents()
IGN = ["*lm_head*"]


def ppl(c):
    t = time.process_time()
    with c.apply(model):
        p = models.perplexity(model, tok, lee)
    return p, time.process_time() - t


# 1. calibration time, side by side: min-max alone, then auto alone. CPU seconds of this
# (single-threaded) process: on a shared box under a load of 6-17 wall time measures the
# neighbours
t = time.process_time()
mm = calibrate(model, batches, preset("w8a8", "minmax", ignore=IGN), progress=False)
res["time"]["minmax"] = time.process_time() - t
dump()
t = time.process_time()
au = calibrate(model, batches, preset("w8a8", "auto", ignore=IGN), progress=False)
res["time"]["auto"] = time.process_time() - t
res["auto_info"] = au.info.get("auto")
dump()
print("timing", res["time"], res["auto_info"], flush=True)
p, te = ppl(au)
res["ppl"]["auto"] = p
dump()
print("auto", p, te, flush=True)

# 2. every single observer, joint and llm-compressor's in one pass
A, W = QuantSpec("int8", Tensor()), presets.INT8_PER_CHANNEL
llmc = {"compat": "llmcompressor"}
plan = {o: preset("w8a8", o, ignore=IGN)
        for o in ["histogram_mse", "mse", "mix", "percentile", "entropy"]}
plan["joint"] = preset("w8a8", "auto", ignore=IGN)
plan["llmc:static_minmax"] = Recipe((Rule(("Linear",), weight=Role(W, "memoryless_minmax"),
                                          input=Role(A, "static_minmax")),), tuple(IGN))
plan["llmc:mse"] = Recipe((Rule(("Linear",), weight=Role(W, "memoryless_mse", options=llmc),
                                input=Role(A, "mse", options=llmc)),), tuple(IGN))
cs = calibrate_many(model, batches, plan, progress=False, auto_metric="joint")
scores = res["auto_info"]["scores"]
for k in sorted(plan, key=lambda k: scores.get(k, 1e9)):
    p, te = ppl(cs[k])
    res["ppl"][k] = p
    dump()
    print(k, p, te, flush=True)
