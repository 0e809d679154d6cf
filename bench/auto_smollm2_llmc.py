"""llm-compressor's own observers on SmolLM2-135M w8a8, the data and model of
``bench/auto_smollm2.py`` (issue 17): ``oneshot`` with a ``QuantizationModifier`` (int8
per-channel weights, static int8 per-tensor inputs, lm_head float), then the perplexity of
the model as llm-compressor leaves it (its own fake quantization in the forward) on the 50
Lee documents at 256 tokens.

Run in the peers' venv (it has no gensim: the documents come in a JSON file written by the
quantscope venv)::

    python -c "import json; from quantscope.demo import data; d = data.lee_background(); \\
        json.dump({'calib': d[::len(d) // 32][:32], 'lee': data.lee_documents()}, \\
        open('/tmp/docs.json', 'w'))"
    PYTHONPATH=src OMP_NUM_THREADS=1 .peers/bin/python bench/auto_smollm2_llmc.py \\
        /tmp/docs.json OUT.json [weight_observer:input_observer ...]

Default pairs: ``memoryless_minmax:static_minmax``, ``memoryless_minmax:minmax`` (their
default EMA), ``memoryless_mse:mse``. A pair ending in ``@ALPHA`` runs llm-compressor's
``SmoothQuantModifier(smoothing_strength=ALPHA)`` first, with its own default mappings for
the architecture; ``@ALPHA+down`` adds ``up_proj -> down_proj``, quantscope's ``--smooth``
mappings by name (llm-compressor takes that mapping's ranges from ``up_proj``'s output,
quantscope from ``down_proj``'s input: not the same scales). Times are CPU
seconds of this one-threaded process (``oneshot`` only, model load and evaluation excluded).
"""

import json
import sys
import time

import torch

torch.set_num_threads(1)

from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier

from quantscope.demo import models

DOCS, OUT = sys.argv[1], sys.argv[2]
PAIRS = sys.argv[3:] or ["memoryless_minmax:static_minmax", "memoryless_minmax:minmax",
                         "memoryless_mse:mse"]
with open(DOCS) as f:
    docs = json.load(f)
res = {}
for pair in PAIRS:
    observers, _, alpha = pair.partition("@")
    alpha, down = alpha.removesuffix("+down"), alpha.endswith("+down")
    wobs, xobs = observers.split(":")
    model, tok = models.load_model("smollm2-135m")
    batches = models.token_batches(tok, docs["calib"], 128, 8)
    args = {"num_bits": 8, "type": "int", "symmetric": True}
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(**args, strategy="channel", observer=wobs),
        input_activations=QuantizationArgs(**args, strategy="tensor", dynamic=False,
                                           observer=xobs))
    t = time.process_time()
    recipe = [QuantizationModifier(config_groups={"g": scheme}, ignore=["lm_head"])]
    if alpha:
        from llmcompressor.modifiers.smoothquant import SmoothQuantModifier

        maps = None if not down else [
            [["re:.*q_proj", "re:.*k_proj", "re:.*v_proj"], "re:.*input_layernorm"],
            [["re:.*gate_proj", "re:.*up_proj"], "re:.*post_attention_layernorm"],
            [["re:.*down_proj"], "re:.*up_proj"]]
        recipe.insert(0, SmoothQuantModifier(smoothing_strength=float(alpha), mappings=maps))
    oneshot(model=model, recipe=recipe,
            dataset=torch.utils.data.DataLoader(batches, batch_size=None), processor=tok,
            num_calibration_samples=len(batches))
    seconds = time.process_time() - t
    ppl = models.perplexity(model, tok, docs["lee"])
    res[pair] = {"perplexity": ppl, "calibration_cpu_seconds": seconds}
    print(pair, res[pair], flush=True)
    with open(OUT, "w") as f:
        json.dump(res, f, indent=1)
    del model
