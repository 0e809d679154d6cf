"""SmolLM2-135M w8a8 perplexity of a saved configuration and of the same with its N most
damaged activations left dynamic per token (issue 17's fallback), on the 50 Lee documents at
256 tokens. ``python bench/auto_smollm2_fallback.py STATES.pt NAME OUT.json [N ...]``.

``STATES.pt``: ``torch.save({name: calibration.states})`` of a calibration on the
``bench/auto_smollm2.py`` data (`auto` chose mse there, so mse's states are auto's). The
ranking is :func:`~quantscope.calibration.choice.sensitivity.layer_sensitivity` on the first
calibration batch (8 documents x 128 tokens): calibration data only.
"""

import json
import sys

import torch

from quantscope.calibration import Calibration, apply, keep_float, preset
from quantscope.calibration.choice.sensitivity import layer_sensitivity
from quantscope.demo import data, models

torch.set_num_threads(1)
STATES, NAME, OUT = sys.argv[1:4]
NS = [int(n) for n in sys.argv[4:]] or [0, 16]
model, tok = models.load_model("smollm2-135m")
docs = data.lee_background()
batches = models.token_batches(tok, docs[:: len(docs) // 32][:32], 128, 8)
states = torch.load(STATES, weights_only=False)[NAME]
calib = Calibration(preset("w8a8", NAME, ignore=["*lm_head*"]), states, NAME, [], {}, {})
sens = layer_sensitivity(model, batches[:1], calib, roles=("input",))
res = {"ranking": [[r["layer"], r["divergence"]] for r in sens.rows[:max(NS)]], "ppl": {}}
for n in NS:
    with apply(model, keep_float(calib, sens, n, mode="dynamic").states):
        res["ppl"][n] = models.perplexity(model, tok, data.lee_documents())
    print(n, res["ppl"][n], flush=True)
    with open(OUT, "w") as f:
        json.dump(res, f, indent=1)
