"""How far apart two MiniLM configurations' Lee r can be by chance (issue 17): a bootstrap
over the 50 Lee documents of the difference of Lee r between min-max and mse weights with
min-max inputs (``auto``'s choice on the demo), W4A8 and W8A8.

``python bench/lee_noise.py [RESAMPLES]``. Each resample draws 50 documents with replacement
and weights every human-scored pair by how often both its documents were drawn.
"""

import sys
from dataclasses import replace

import torch

from quantscope.calibration import apply, calibrate_many, preset
from quantscope.demo import data, models

torch.set_num_threads(1)
RESAMPLES = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
model, tok = models.load_model(None)
docs = data.lee_background()
batches = models.token_batches(tok, docs[:: len(docs) // 32][:32], 128, 8)
lee, (pi, pj, score) = data.lee_documents(), data.lee_pairs()


def config(recipe, weights, inputs):
    base, inp = (preset(recipe, o, ignore=["*pooler*"]) for o in (weights, inputs))
    return replace(base, rules=(replace(base.rules[0], input=inp.rules[0].input),))


plan = {(r, w): config(r, w, "minmax") for r in ("w4a8", "w8a8") for w in ("minmax", "mse")}
emb = {}
for key, calib in calibrate_many(model, batches, plan, progress=False).items():
    with apply(model, calib.states):
        emb[key] = models.embed(model, tok, lee, 256)


def weighted_r(e, w):
    x, y = (e[pi] * e[pj]).sum(-1).double(), score
    mx, my = (w * x).sum() / w.sum(), (w * y).sum() / w.sum()
    return float((w * (x - mx) * (y - my)).sum()
                 / ((w * (x - mx) ** 2).sum() * (w * (y - my) ** 2).sum()).sqrt())


g = torch.Generator().manual_seed(0)
ones = torch.ones(len(pi), dtype=torch.float64)
for recipe in ("w4a8", "w8a8"):
    a, b = emb[(recipe, "minmax")], emb[(recipe, "mse")]
    diffs = []
    for _ in range(RESAMPLES):
        counts = torch.bincount(torch.randint(0, 50, (50,), generator=g), minlength=50)
        w = (counts[pi] * counts[pj]).double()
        diffs.append(weighted_r(a, w) - weighted_r(b, w))
    d = torch.tensor(diffs)
    print(f"{recipe}: Lee r min-max {weighted_r(a, ones):.4f}, mse weights + min-max inputs "
          f"{weighted_r(b, ones):.4f}; difference {weighted_r(a, ones) - weighted_r(b, ones):+.4f}, "
          f"bootstrap 95 % interval [{d.quantile(0.025):+.4f}, {d.quantile(0.975):+.4f}], "
          f"P(difference <= 0) {float((d <= 0).double().mean()):.2f}")
