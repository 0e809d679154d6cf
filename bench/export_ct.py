"""Deploy figures (docs/guide/deploy.md): calibrate -> export compressed-tensors -> load in
transformers on CPU, per scheme, on the demo models (MiniLM, SmolLM2-135M).

For each scheme: the largest difference between transformers' outputs of the exported folder
and quantscope's QDQ (``Calibration.apply``) on the float model, relative to the output's
largest magnitude (MiniLM: last hidden states; SmolLM2: logits), over 4 held-out Lee
documents of <= 96 tokens (calibration: 8 background documents of <= 96), padding excluded; the lowest per-document cosine (fp4: also against QDQ with its weights rounded to bfloat16,
as compressed-tensors decompresses fp4 on CPU); the bytes of
the quantized layers against their fp32 weights; the whole checkpoint against the fp32
folder; and whether ``from_compressed_tensors`` gives back the same QDQ outputs.

    PYTHONPATH=src OMP_NUM_THREADS=1 .venv/bin/python bench/export_ct.py [minilm|smollm2-135m]
        [--only=SUBSTRING,...]   (e.g. --only=asym under .peers/bin/python: transformers 5.17)
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch

from quantscope import QuantSpec, Tensor, Token
from quantscope import presets as P
from quantscope.calibration import Calibration, Recipe, Role, Rule, calibrate, preset
from quantscope.demo import data, models
from quantscope.layout import Group

torch.set_num_threads(1)


def schemes(group: int, ignore) -> dict:
    """name -> recipe; int4 groups of ``group`` (SmolLM2's hidden 576 takes 64, not 128)."""
    def rule(w, i=None, name="custom"):
        return Recipe((Rule(("Linear",), weight=w, input=i),), ignore, name)

    int4 = QuantSpec("int4", Group(group))
    mx_even = QuantSpec("fp4_e2m1", P.MXFP4.layout, scale="e8m0:even")
    return {
        "w8a8": preset("w8a8", ignore=ignore),
        "w8a8-dynamic": preset("w8a8-dynamic", ignore=ignore),
        f"w4a16 g{group}": rule(Role(int4, "memoryless_minmax")),
        f"w4a16-asym g{group}": rule(Role(int4.replace(symmetric=False), "memoryless_minmax")),
        "fp8 tensor, static": rule(Role(P.FP8_PER_TENSOR, "memoryless_minmax"),
                                   Role(QuantSpec("fp8_e4m3", Tensor()), "minmax")),
        "fp8 tensor, dynamic": rule(Role(P.FP8_PER_TENSOR, "memoryless_minmax"),
                                    Role(QuantSpec("fp8_e4m3", Token()), "memoryless_minmax",
                                         True)),
        "fp8 channel, static": preset("fp8", ignore=ignore),
        "fp8 channel, dynamic": preset("fp8-dynamic", ignore=ignore),
        "nvfp4": preset("nvfp4", ignore=ignore),
        "mxfp4": rule(Role(P.MXFP4, "memoryless_minmax"),
                      Role(mx_even, "memoryless_minmax", True)),
    }


def outputs(model, batches):
    with torch.inference_mode():
        outs = []
        for b in batches:
            o = model(**b)
            o = o.logits if hasattr(o, "logits") else o.last_hidden_state
            outs.append(o.float()[b["attention_mask"].bool()].reshape(-1, o.shape[-1]))
        return outs


def per_doc(outs, batches):
    """One row per document: its tokens' outputs, flattened."""
    docs = []
    for o, b in zip(outs, batches):
        lengths = b["attention_mask"].sum(1).tolist()
        docs += [t.flatten() for t in torch.split(o, lengths)]
    return docs


def min_cosine(got, ref, batches) -> float:
    return min(float(torch.nn.functional.cosine_similarity(g.double(), r.double(), dim=0))
               for g, r in zip(per_doc(got, batches), per_doc(ref, batches)))


def load_exported(path, task):
    import transformers

    cls = transformers.AutoModelForCausalLM if task == "causal-lm" else transformers.AutoModel
    model = cls.from_pretrained(path).eval()
    if hasattr(model, "ct_decompress_hook"):  # fp4: bf16 weights; run the forward in fp32
        model.hf_quantizer.compressor.decompress_model(model)
    torch.nn.Module.float(model)
    return model


def folder_bytes(path, layers=None):
    from safetensors import safe_open

    total = 0
    for f in os.listdir(path):
        if not f.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(path, f), "pt") as st:
            for k in st.keys():  # noqa: SIM118 (safe_open is not iterable)
                if layers is None or (k.rsplit(".", 1)[0] in layers and not k.endswith("bias")):
                    t = st.get_slice(k)
                    n = 1
                    for d in t.get_shape():
                        n *= d
                    total += n * torch.empty((), dtype=_dtype(t.get_dtype())).element_size()
    return total


def _dtype(name):
    return {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
            "I8": torch.int8, "U8": torch.uint8, "I32": torch.int32, "I64": torch.int64,
            "F8_E4M3": torch.float8_e4m3fn}[name]


def run(name: str, only: str | None = None) -> None:
    path = models.resolve_model_path(name)
    task = models.model_task(path)
    model, tok = models.load_model(path)
    calib_batches = models.token_batches(tok, data.lee_background()[::20][:8], 96, 4)
    eval_batches = models.token_batches(tok, data.lee_documents()[:4], 96, 4)
    ignore = ("lm_head",) if task == "causal-lm" else ()
    hidden = model.config.hidden_size
    group = 128 if hidden % 128 == 0 else 64
    fp32_bytes = folder_bytes(str(path))
    print(f"\n{name}: {path} ({task}); fp32 safetensors {fp32_bytes / 2**20:.1f} MiB")
    print("| scheme | format | max abs diff / max abs | min cosine per doc | fp4: min cosine "
          "vs QDQ with bf16 weights | quantized layers / fp32 | checkpoint / fp32 | round trip "
          "| seconds |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, recipe in schemes(group, ignore).items():
        if only and not any(o in label for o in only.split(",")):
            continue
        t0 = time.perf_counter()
        cal = calibrate(model, calib_batches, recipe, progress=False)
        with cal.apply(model):
            ref = outputs(model, eval_batches)
            fp4 = "fp4" in label
            if fp4:  # compressed-tensors decompresses fp4 weights to bfloat16 on CPU
                with torch.no_grad():
                    for n in cal.states:
                        w = model.get_submodule(n).weight
                        w.copy_(w.bfloat16().float())
                ref_bf16 = outputs(model, eval_batches)
        with tempfile.TemporaryDirectory() as tmp:
            out = cal.export(model, os.path.join(tmp, "ct"), model_path=str(path))
            import json

            with open(os.path.join(out, "config.json")) as f:
                fmt = json.load(f)["quantization_config"]["format"]
            try:
                got = outputs(load_exported(out, task), eval_batches)
                scale = max(float(r.abs().max()) for r in ref)
                diff = max(float((g - r).abs().max()) for g, r in zip(got, ref)) / scale
                diff, cos = f"{diff:.2e}", f"{min_cosine(got, ref, eval_batches):.5f}"
                bf = f"{min_cosine(got, ref_bf16, eval_batches):.5f}" if fp4 else "-"
            except RuntimeError:  # .venv's transformers 5.24 cannot load asymmetric int4
                diff = cos = bf = "not loaded (transformers 5.24)"
            layers = set(cal.states)
            wbytes = sum(model.get_submodule(n).weight.numel() * 4 for n in layers)
            qratio = folder_bytes(out, layers) / wbytes
            total = folder_bytes(out) / fp32_bytes
            back = Calibration.from_compressed_tensors(out)
            with back.apply(model):
                again = outputs(model, eval_batches)
            same = all(torch.equal(a, b) for a, b in zip(again, ref))
        print(f"| {label} | {fmt} | {diff} | {cos} | {bf} | {qratio:.3f} (1/{1 / qratio:.1f}) | "
              f"{total:.3f} | {'equal' if same else 'DIFFERS'} | "
              f"{time.perf_counter() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--only=")]
    only = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--only=")), None)
    for n in args or ["minilm", "smollm2-135m"]:
        run(n, only)
