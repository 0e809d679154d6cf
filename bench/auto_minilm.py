"""MiniLM (issue 17 figures): imatrix vs unweighted weight search (w4a16), sensitivity ranking
and the float-fallback curve (w8a8 min-max). ``python bench/auto_minilm.py OUT_DIR``."""
import json
import os
import sys
import time
from dataclasses import replace

import torch

from quantscope.calibration import calibrate, fallback_curve, preset, sensitivity
from quantscope.calibration.choice.sensitivity import plot_fallback
from quantscope.demo import data, models
from quantscope.estimators.weighted import imatrix_range
from quantscope.qdq import fake_quantize
from quantscope.qparams import qparams_from_range

torch.set_num_threads(1)
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
model, tok = models.load_model(None)
docs = data.lee_background()
calib_docs = docs[:: len(docs) // 32][:32]
batches = models.token_batches(tok, calib_docs, 128, 8)
lee, pairs = data.lee_documents(), data.lee_pairs()
ref = models.embed(model, tok, lee, 256)
res = {}


def dump():
    with open(f"{out}/minilm.json", "w") as f:
        json.dump(res, f, indent=1)


def quality(m):
    e = models.embed(m, tok, lee, 256)
    return models.lee_correlation(e, pairs), float((e * ref).sum(-1).mean())


# --- importance (mean x^2 per input channel over all calibration tokens) and input samples
IGN = ["*pooler*"]
rec = preset("w4a16", "mse", ignore=IGN)
layers = list(rec.match(model))
sums, counts, samples = {}, {}, {}
hooks = []
for name in layers:
    def hook(mod, args, name=name):
        x = args[0].detach().float().reshape(-1, args[0].shape[-1])
        sums[name] = sums.get(name, 0) + x.square().sum(0)
        counts[name] = counts.get(name, 0) + x.shape[0]
        samples.setdefault(name, []).append(x[::8])
    hooks.append(model.get_submodule(name).register_forward_pre_hook(hook))
with torch.inference_mode():
    for b in batches:
        model(**b)
for h in hooks:
    h.remove()
imp = {n: sums[n] / counts[n] for n in layers}
xs = {n: torch.cat(samples[n]) for n in layers}

t = time.perf_counter()
mse = calibrate(model, batches, rec, progress=False)
t_mse = time.perf_counter() - t
t = time.perf_counter()
states = {}
for n in layers:
    st = mse.states[n]["weight"]
    w = model.get_submodule(n).weight.detach()
    lo, hi = imatrix_range(w, imp[n], st.spec)
    qp = qparams_from_range(lo, hi, st.spec).reshape(st.spec.layout.qparam_shape(w.shape))
    states[n] = {"weight": replace(st, observer="imatrix_mse", qparams=qp, lo=lo, hi=hi)}
t_imx = time.perf_counter() - t
mm = calibrate(model, batches, preset("w4a16", "minmax", ignore=IGN), progress=False)
rows = {}
for label, sts in (("minmax", mm.states), ("mse", mse.states), ("imatrix_mse", states)):
    werr = oerr = 0.0
    for n in layers:
        w = model.get_submodule(n).weight.detach()
        st = sts[n]["weight"]
        d = fake_quantize(w, st.qparams, st.spec) - w
        werr += float(d.double().square().sum())
        oerr += float((xs[n] @ d.T).double().square().sum())
    from quantscope.calibration import apply
    with apply(model, sts):
        r, cos = quality(model)
    rows[label] = {"weight_sq_err": werr, "output_sq_err": oerr, "lee_r": r, "cosine": cos}
    print(label, rows[label], flush=True)
res["imatrix_w4a16"] = {"rows": rows, "search_seconds": {"mse": t_mse, "imatrix": t_imx}}
dump()

# --- sensitivity and fallback, w8a8 min-max; held-out: 8 Lee documents at 256 tokens
held = models.token_batches(tok, data.lee_background()[1::37][:8], 128, 8)
c = calibrate(model, batches, preset("w8a8", "minmax", ignore=IGN), progress=False)
s = sensitivity(model, held, calibration=c)
s.to_markdown(f"{out}/sensitivity.md")
s.to_json(f"{out}/sensitivity.json")
s.plot(f"{out}/sensitivity.png")
print(s.to_markdown()[:1500], flush=True)
curve = fallback_curve(model, c, s, lambda m: quality(m)[0], ns=(0, 1, 2, 4, 8, 16))
res["fallback"] = curve
res["sensitivity_info"] = s.info
dump()
plot_fallback(curve, f"{out}/fallback.png", "Lee r")
for r in curve:
    print(r["n"], r["quality"], r["float_macs_pct"], flush=True)
