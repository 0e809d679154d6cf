"""MiniLM W8A8 static through the ONNX exporter: ORT latency against ONNX fp32 (batch 8 x 128
tokens, 2 threads, interleaved, medians) and Lee Pearson of ORT against torch fake-quant.

Not yet here: the `quantize_static` rows with ORT's own calibrators (see docs/benchmarks.md).
"""

from __future__ import annotations

import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from quantscope import calibrate, export
from quantscope.calibrate.recipe import preset
from quantscope.demo import data, models
from quantscope.export import onnx as qonnx


def _ort_embed(sess, tok, docs, max_length=256, batch_size=16):
    outs = []
    for s in range(0, len(docs), batch_size):
        enc = tok(docs[s:s + batch_size], padding=True, truncation=True, max_length=max_length,
                  return_tensors="np")
        feed = {i.name: enc[i.name].astype(np.int64) for i in sess.get_inputs()}
        hidden = torch.from_numpy(sess.run(None, feed)[0])
        mask = torch.from_numpy(enc["attention_mask"]).unsqueeze(-1).float()
        mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        outs.append(torch.nn.functional.normalize(mean, dim=-1))
    return torch.cat(outs)


def main(reps: int = 10) -> None:
    torch.set_num_threads(1)
    cpu = subprocess.run(["lscpu"], check=False, capture_output=True, text=True).stdout
    name = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines()
                 if ln.startswith("Model name")), "?")
    print(f"CPU: {name}; VNNI: {'avx512_vnni' in cpu or 'avx_vnni' in cpu}\n")
    model, tok = models.load_model("minilm")
    pairs, lee = data.lee_pairs(), data.lee_documents()
    batches = models.token_batches(tok, data.lee_background()[::10], 128, 8)
    calib = calibrate(model, batches, preset("w8a8", "minmax", ignore=["*pooler*"]),
                      progress=False)
    with calib.apply(model):
        torch_r = models.lee_correlation(models.embed(model, tok, lee), pairs)
    example = {k: v for k, v in batches[0].items() if k in ("input_ids", "attention_mask")}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"ONNX fp32": Path(tmp) / "fp32.onnx", "quantscope W8A8": Path(tmp) / "q.onnx"}
        export.export({}, model, paths["ONNX fp32"], format="onnx", example_inputs=example)
        export.export(calib, model, paths["quantscope W8A8"], format="onnx",
                      example_inputs=example)
        sessions = {k: qonnx.session(p, threads=2) for k, p in paths.items()}
        quality = {k: models.lee_correlation(_ort_embed(s, tok, lee), pairs)
                   for k, s in sessions.items()}
        g = torch.Generator().manual_seed(0)
        feed = {"input_ids": torch.randint(1000, 20000, (8, 128), generator=g).numpy(),
                "attention_mask": np.ones((8, 128), dtype=np.int64)}
        times = {k: [] for k in sessions}
        for s in sessions.values():
            s.run(None, feed)
        for _ in range(reps):  # interleaved: A B A B ...
            for k, s in sessions.items():
                t = time.perf_counter()
                s.run(None, feed)
                times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"torch fake-quant W8A8 Lee Pearson: {torch_r:.4f}\n")
    print("| model | Lee Pearson | latency (median) | vs fp32 |")
    print("|---|---|---|---|")
    for k in sessions:
        print(f"| {k} | {quality[k]:.4f} | {med[k] * 1e3:.0f} ms | "
              f"{med['ONNX fp32'] / med[k]:.2f}x |")


if __name__ == "__main__":
    main()
