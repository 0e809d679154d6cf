"""Fusion and MoE, end to end (docs/benchmarks.md "## fusion and MoE").

decoder: SmolLM2-135M perplexity on the 50 Lee documents (256 tokens) under apply(), with
per-layer scales (``Recipe.fusion=False``: what quantscope reported before) and with the
fused groups' shared scales (what a runtime serves), for nvfp4, fp8 (per-tensor weights,
the case vLLM re-quantizes) and w8a8; lm_head in float; calibrated on Lee background
documents x 128 tokens.

moe: a small random-weight Mixtral (8 experts, top-2, hidden 128) with an imbalanced
router, calibrated on few tokens so some experts see few or none; mean KL(float || quant)
of the next-token distributions on the 50 Lee documents (128 tokens) for routed
calibration without shrinkage, shrinkage at several thresholds, and all_experts.

    PYTHONPATH=src OMP_NUM_THREADS=1 python bench/bench_fusion_moe.py decoder
    PYTHONPATH=src OMP_NUM_THREADS=1 python bench/bench_fusion_moe.py moe --docs 8
    PYTHONPATH=src OMP_NUM_THREADS=1 python bench/bench_fusion_moe.py experts --docs 8 \
        --thresholds 1 8 16 32 64 128 256 512
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace

import torch
from common import Table

from quantscope import QuantSpec, presets
from quantscope.calibration import Recipe, Role, Rule, calibrate, preset
from quantscope.demo import data, models
from quantscope.layout import Tensor


def fp8_per_tensor(ignore):
    return Recipe((Rule(("Linear",), weight=Role(presets.FP8_PER_TENSOR, "memoryless_minmax"),
                        input=Role(QuantSpec("fp8_e4m3", Tensor()), "minmax")),),
                  ignore, "fp8-tensor")


def decoder(args):
    model, tok = models.load_model("smollm2-135m")
    model.eval()
    calib_docs = data.lee_background()[:: 300 // args.docs][: args.docs]
    batches = models.token_batches(tok, calib_docs, 128, 8)
    docs = data.lee_documents()
    rows = []
    for name in args.recipes:
        base = fp8_per_tensor(("*lm_head*",)) if name == "fp8-tensor" else \
            preset(name, ignore=("*lm_head*",))
        for mode, fused in (("per-layer", False), ("shared", True)):
            t0 = time.perf_counter()
            calib = calibrate(model, batches, replace(base, fusion=fused), progress=False)
            t1 = time.perf_counter()
            with calib.apply(model):
                ppl = models.perplexity(model, tok, docs, max_length=256)
            rows.append({"recipe": name, "scales": mode, "ppl": round(ppl, 3),
                         "groups": len(calib.info.get("fusion_groups", [])),
                         "calib_s": round(t1 - t0, 1), "eval_s": round(time.perf_counter() - t1, 1)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def starve_hook(router, weights):
    """Tilt the router: expert logits plus log(weights), so a few experts win rarely."""
    bias = torch.log(torch.tensor(weights))

    def hook(mod, a, out):
        logits = out[0] + bias
        top, idx = torch.topk(torch.softmax(logits.float(), -1), mod.top_k, -1)
        return out[0], top / top.sum(-1, keepdim=True), idx
    return router.register_forward_hook(hook)


def kl(ref, got):
    tot, n = 0.0, 0
    for a, b in zip(ref, got):
        tot += float((a.exp() * (a - b)).sum())
        n += a.shape[0]
    return tot / n


def moe(args):
    model, tok, batches, docs = _moe_setup(args)
    ref = models.next_token_logprobs(model, tok, docs, max_length=128)
    rows = []
    cases = [("routed, no shrinkage", {"expert_min_tokens": 1})]
    cases += [(f"shrunk, threshold {t}", {"expert_min_tokens": t}) for t in args.thresholds]
    cases += [("all experts", {"all_experts": True})]
    for recipe in args.moe_recipes:
        for label, kw in cases:
            calib = calibrate(model, batches, preset(recipe, ignore=("*lm_head*",)),
                              progress=False, **kw)
            counts = [r["tokens"] for r in calib.info["experts"]
                      if r["module"] == "model.layers.0.mlp.experts"]
            with calib.apply(model):
                got = models.next_token_logprobs(model, tok, docs, max_length=128)
            rows.append({"recipe": recipe, "calibration": label, "kl": kl(ref, got),
                         "layer0_tokens": counts})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _moe_setup(args):
    from transformers import MixtralConfig, MixtralForCausalLM

    _, tok = models.load_model("smollm2-135m")
    torch.manual_seed(0)
    cfg = MixtralConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                        num_local_experts=8, num_experts_per_tok=2, initializer_range=0.1)
    model = MixtralForCausalLM(cfg).eval()
    with torch.no_grad():  # a trained model's experts differ in range: give them scales
        for layer in model.model.layers:
            scale = torch.linspace(0.5, 3.0, 8).reshape(8, 1, 1)
            layer.mlp.experts.gate_up_proj.mul_(scale)
    tilt = [1.0, 1.0, 1.0, 1.0, 0.5, 0.25, 0.1, 0.02]  # experts 4-7 routed less and less
    for layer in model.model.layers:
        starve_hook(layer.mlp.gate, tilt)
    calib_docs = data.lee_background()[:: 300 // args.docs][: args.docs]
    batches = models.token_batches(tok, calib_docs, args.moe_tokens, 4)
    docs = data.lee_documents()
    return model, tok, batches, docs


def expert_error(args):
    """Per-expert error of the calibrated static input scale on held-out routed tokens (the
    expert's own eval inputs), by shrinkage threshold: what the threshold is chosen from."""
    from quantscope.calibration.results.apply import qdq_tensor
    from quantscope.calibration.structure import moe as qmoe

    model, tok, batches, docs = _moe_setup(args)
    held = {}
    with qmoe.attach(model, count=False) as ex, torch.inference_mode():
        mods = {e: model.model.layers[0].mlp.experts._modules[str(e)] for e in range(8)}
        hs = []
        for e, m in mods.items():
            for proj in ("gate_up_proj", "down_proj"):
                hs.append(getattr(m, proj).register_forward_pre_hook(
                    lambda mod, a, key=(e, proj): held.setdefault(key, []).append(a[0].clone())))
        for b in models.token_batches(tok, docs, 128, 8):
            model(**b)
        for h in hs:
            h.remove()
        assert ex.layers
    held = {k: torch.cat(v) for k, v in held.items()}
    rows = []
    for t in args.thresholds:
        calib = calibrate(model, batches, preset("w8a8", ignore=("*lm_head*",)),
                          progress=False, expert_min_tokens=t)
        counts = [r["tokens"] for r in calib.info["experts"]
                  if r["module"] == "model.layers.0.mlp.experts"]
        err = {}
        for (e, proj), x in held.items():
            st = calib.states[f"model.layers.0.mlp.experts.{e}.{proj}"]["input"]
            err[(e, proj)] = float((qdq_tensor(x, st) - x).square().sum())
        sig = {k: float(x.square().sum()) for k, x in held.items()}
        total = 10 * math.log10(sum(sig.values()) / sum(err.values()))
        per = {e: round(10 * math.log10(sum(sig[(e, p)] for p in ("gate_up_proj", "down_proj"))
                                        / sum(err[(e, p)] for p in ("gate_up_proj",
                                                                    "down_proj"))), 2)
               for e in range(8) if (e, "down_proj") in held}
        rows.append({"threshold": t, "sqnr_db_all": round(total, 3), "sqnr_db_per_expert": per,
                     "calib_tokens": counts,
                     "eval_tokens": [held[(e, "down_proj")].shape[0] if (e, "down_proj") in held
                                     else 0 for e in range(8)]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def moe_table(rows):
    """The moe part's JSON rows as one markdown table: a row per calibration, a column per recipe."""
    recipes = list(dict.fromkeys(r["recipe"] for r in rows))
    t = Table("MoE: mean KL(float || quantized) of the next-token distributions, 50 Lee documents",
              ["calibration", *(f"{r} KL" for r in recipes), "layer 0's tokens per expert"])
    for label in dict.fromkeys(r["calibration"] for r in rows):
        mine = {r["recipe"]: r for r in rows if r["calibration"] == label}
        t.add(label, *(f"{mine[r]['kl']:.5f}" for r in recipes),
              " / ".join(map(str, next(iter(mine.values()))["layer0_tokens"])))
    t.print()


def experts_table(rows):
    """The experts part's JSON rows as one markdown table: a row per shrinkage threshold."""
    experts = sorted({int(e) for r in rows for e in r["sqnr_db_per_expert"]})
    calib = rows[0]["calib_tokens"]
    t = Table("MoE: held-out SQNR (dB) of layer 0's expert inputs by shrinkage threshold "
              "(expert_min_tokens)", ["threshold", "all experts",
                                      *(f"e{e} ({calib[e]} calib. tokens)" for e in experts)])
    for r in rows:
        per = {int(e): v for e, v in r["sqnr_db_per_expert"].items()}
        t.add(r["threshold"], f"{r['sqnr_db_all']:.2f}", *(f"{per[e]:.1f}" for e in experts))
    t.print()


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("part", nargs="?", default="quick",
                   choices=["quick", "decoder", "moe", "experts"],
                   help="quick (make bench): moe and experts; decoder takes ~45 min here")
    p.add_argument("--docs", type=int, default=16)
    p.add_argument("--recipes", nargs="*", default=["nvfp4", "fp8-tensor", "w8a8"])
    p.add_argument("--moe-recipes", nargs="*", default=["w8a8", "nvfp4"])
    p.add_argument("--moe-tokens", type=int, default=64)
    p.add_argument("--thresholds", nargs="*", type=int, default=[16, 64, 128, 256])
    # run as a script: the command line; from bench/run.py (make bench): the defaults
    args = p.parse_args(argv if argv is not None else
                        sys.argv[1:] if __name__ == "__main__" else [])
    torch.set_num_threads(1)
    print(json.dumps({"torch": torch.__version__, "part": args.part}))
    parts = {"decoder": [decoder], "moe": [moe], "experts": [expert_error],
             "quick": [moe, expert_error]}[args.part]
    tables = {moe: moe_table, expert_error: experts_table}  # the page's view of the rows
    for part in parts:
        rows = part(args)
        if part in tables:
            tables[part](rows)


if __name__ == "__main__":
    main()
