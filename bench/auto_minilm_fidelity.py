"""MiniLM (issue 17): does output fidelity predict Lee r? Each whole configuration (single
observers and ``joint``) against float: ``1 - cos`` of pooled embeddings on auto's scoring
batch, on all calibration documents and on 8 held-out background documents, the held-out
cosine-similarity matrix's mean squared error (``gram``), and Lee r.

``python bench/auto_minilm_fidelity.py w4a8`` (or ``w8a8``); prints one row per configuration.
"""
import sys

import torch

from quantscope.calibration import Auto, apply, preset
from quantscope.calibration.choice.auto import score_batches
from quantscope.calibration.run.session import calibrate_many
from quantscope.demo import data, models

torch.set_num_threads(1)
recipe = sys.argv[1] if len(sys.argv) > 1 else "w4a8"
model, tok = models.load_model(None)
docs = data.lee_background()
batches = models.token_batches(tok, docs[:: len(docs) // 32][:32], 128, 8)
held = models.token_batches(tok, docs[1::37][:8], 128, 8)
lee, pairs = data.lee_documents(), data.lee_pairs()
singles = ["minmax", "mse", "percentile", "entropy"]
recipes = {o: preset(recipe, o) for o in singles}
recipes["joint"] = preset(recipe, "auto")
cal = calibrate_many(model, batches, recipes, auto=Auto(candidates=singles, metric="joint"),
                     progress=False)


def pooled(bs):
    out = []
    with torch.inference_mode():
        for b in bs:
            h = model(**b).last_hidden_state
            m = b["attention_mask"].unsqueeze(-1).float()
            out.append(torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1))
    return torch.cat(out)


sets = {"score": score_batches(batches, 1024), "calib": batches, "held": held}
refs = {k: pooled(v) for k, v in sets.items()}
print("config", *[f"1-cos {k}" for k in sets], "gram held", "Lee r", sep=" | ")
for label, c in cal.items():
    with apply(model, c.states):
        es = {k: pooled(v) for k, v in sets.items()}
        r = models.lee_correlation(models.embed(model, tok, lee, 256), pairs)
    cos = [float((1 - (es[k] * refs[k]).sum(-1)).mean()) for k in sets]
    gram = float((es["held"] @ es["held"].T - refs["held"] @ refs["held"].T).square().mean())
    print(label, *[f"{v:.4f}" for v in cos], f"{gram:.5f}", f"{r:.4f}", sep=" | ", flush=True)
