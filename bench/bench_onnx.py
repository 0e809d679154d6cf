"""MiniLM W8A8 static in ONNX Runtime, side by side in one run: quantscope's calibration and
ONNX exporter, ORT's own ``quantize_static`` (QDQ) with each of its calibrators, and fp32.

Every model sees the same 30 calibration samples: 30 Lee background docs of at least 128
tokens, cut to 128 (ORT's Entropy / Percentile / Distribution calibrators stack every sample
of a collection into one array, so samples must share a shape; and no padding: a padded
position's additive attention mask, -3.4e38, overflows their histograms). ``quantize_static``
runs on ``quant_pre_process(skip_symbolic_shape=True)`` of the fp32 export (symbolic shape
inference fails on dynamo graphs) with ``CalibStridedMinMax=10`` (three collections of 10
samples), per-channel int8 weights, its default int8 activations and op types; its models
run in a default ORT session (all optimizations), quantscope's in
:func:`quantscope.exporters.onnx.session`.

Per model: Lee Pearson (50 held-out docs, 256 tokens), ORT latency (batch 8 x 128 tokens, 2
intra-op threads, interleaved runs, medians), the op counts of the optimized graph, and for
quantscope's graphs the largest difference from ``Calibration.apply`` on 4 Lee docs (relative
to the output's largest value). quantscope's export runs three ways: in
:func:`quantscope.exporters.onnx.session` (exact: on a CPU without VNNI it sets
``session.x64quantprecision``, ORT's u8u8 kernel), with ``uint8=True`` storage (u8u8 in any
session), and in a plain ORT session (ORT's int8-weight kernel: exact and fast with VNNI,
saturating int16 pair sums without). ORT's own models and quantscope's also get their Lee
Pearson in ORT's reference execution (no fused kernels, so no saturation).
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
from quantscope.calibration.recipe import preset
from quantscope.calibration.results.result import Calibration
from quantscope.demo import data, models
from quantscope.exporters import onnx as qonnx

#: ops reported from each optimized graph
OPS = ("MatMulIntegerToFloat", "QLinearMatMul", "MatMulInteger", "DynamicQuantizeMatMul",
       "QGemm", "MatMul", "FusedMatMul", "Gemm", "QuantizeLinear", "DequantizeLinear")
METHODS = ("MinMax", "Entropy", "Percentile", "Distribution")


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


def _cpu() -> str:
    cpu = subprocess.run(["lscpu"], check=False, capture_output=True, text=True).stdout
    name = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines()
                 if ln.startswith("Model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in cpu.splitlines()
                  if ln.startswith("Flags")), [])
    simd = [f for f in flags if f.startswith(("avx", "amx")) or "vnni" in f]
    return f"{name}; {' '.join(simd) or 'no AVX flags'}; VNNI: {any('vnni' in f for f in flags)}"


class _Reader:
    """ORT's CalibrationDataReader over fixed-length samples, with the ``set_range`` that
    ``CalibStridedMinMax`` calls."""

    def __init__(self, samples):
        self.samples, self._it = samples, iter(())

    def __len__(self):
        return len(self.samples)

    def set_range(self, start_index, end_index):
        self._it = iter(self.samples[start_index:end_index])

    def get_next(self):
        return next(self._it, None)


def _quantize_static(fp32: Path, samples, tmp: Path) -> dict[str, Path]:
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        quant_pre_process,
        quantize_static,
    )
    pre = tmp / "pre.onnx"
    quant_pre_process(str(fp32), str(pre), skip_symbolic_shape=True)
    paths = {}
    for method in METHODS:
        paths[f"ORT quantize_static {method}"] = out = tmp / f"ort_{method}.onnx"
        t = time.perf_counter()
        quantize_static(str(pre), str(out), _Reader(samples), quant_format=QuantFormat.QDQ,
                        per_channel=True, calibrate_method=getattr(CalibrationMethod, method),
                        extra_options={"CalibStridedMinMax": 10})
        print(f"quantize_static {method}: {time.perf_counter() - t:.0f} s", flush=True)
    return paths


def _ort_session(path: Path, opt: Path | None, exact: bool):
    import onnxruntime as ort
    if exact:
        return qonnx.session(path, threads=2, optimized_model_path=opt)
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = 2, 1
    if opt is not None:
        so.optimized_model_filepath = str(opt)
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _reference_lee(path, tok, lee, pairs) -> float:
    """Lee Pearson in ORT's reference execution (``ORT_DISABLE_ALL``: the Q / DQ ops as
    written and float MatMuls, no fused integer kernel, so no saturation). ORT's own models
    cannot take ``session.x64quantprecision`` (1.32 fails to load them with it)."""
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads, so.inter_op_num_threads = 2, 1
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return models.lee_correlation(_ort_embed(sess, tok, lee), pairs)


def _op_counts(opt: Path) -> dict[str, int]:
    import onnx
    counts: dict[str, int] = {}
    for n in onnx.load(str(opt), load_external_data=False).graph.node:
        if n.op_type in OPS:
            counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return counts


def _latency(sessions, reps):
    g = torch.Generator().manual_seed(0)
    feed = {"input_ids": torch.randint(1000, 20000, (8, 128), generator=g).numpy(),
            "attention_mask": np.ones((8, 128), dtype=np.int64)}
    times = {k: [] for k in sessions}
    for s in sessions.values():
        s.run(None, feed)
    for _ in range(reps):  # interleaved: A B C ... A B C ...
        for k, s in sessions.items():
            t = time.perf_counter()
            s.run(None, feed)
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def export_float(model, path: Path, example) -> None:
    """The float model through quantscope's exporter: a calibration of no tensors (export
    refuses a plain dict; tests/bench/test_bench_onnx_float.py)."""
    export.export(Calibration(None, {}), model, path, format="onnx", example_inputs=example)


def main(reps: int = 10) -> None:
    import onnxruntime as ort
    torch.set_num_threads(1)
    print(f"CPU: {_cpu()}\nonnxruntime {ort.__version__}, torch {torch.__version__}\n")
    model, tok = models.load_model("minilm")
    pairs, lee = data.lee_pairs(), data.lee_documents()
    # 30 docs of 128 tokens or more, cut to 128: one shape, and no padding (a padded
    # position's additive attention mask, -3.4e38, overflows ORT's histograms)
    docs = [d for d in data.lee_background()[::5] if len(tok(d)["input_ids"]) >= 128][:30]
    samples = [tok(d, truncation=True, max_length=128, return_tensors="pt") for d in docs]
    samples = [{k: v for k, v in s.items() if k in ("input_ids", "attention_mask")}
               for s in samples]
    calib = calibrate(model, samples, preset("w8a8", "minmax", ignore=["*pooler*"]),
                      progress=False)
    with calib.apply(model):
        torch_r = models.lee_correlation(models.embed(model, tok, lee), pairs)
    # batch 2: a batch-1 example would export the batch dimension as a constant 1
    example = {k: torch.cat([samples[0][k], samples[1][k]]) for k in samples[0]}
    check = tok(lee[:4], padding=True, truncation=True, max_length=256, return_tensors="pt")
    check = {k: v for k, v in check.items() if k in ("input_ids", "attention_mask")}
    with torch.no_grad(), calib.apply(model):
        ref = model(**check).last_hidden_state.numpy()
    QS, U8, PLAIN = ("quantscope W8A8 (int8, session())", "quantscope W8A8 (uint8=True)",
                     "quantscope W8A8 (int8, plain ORT session)")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        paths = {"ONNX fp32": tmp / "fp32.onnx", QS: tmp / "q.onnx", U8: tmp / "q_u8.onnx"}
        export_float(model, paths["ONNX fp32"], example)
        export.export(calib, model, paths[QS], format="onnx", example_inputs=example)
        export.export(calib, model, paths[U8], format="onnx", example_inputs=example,
                      uint8=True)
        paths[PLAIN] = paths[QS]
        ours = (QS, U8, PLAIN)
        paths.update(_quantize_static(paths["ONNX fp32"], [{k: v.numpy() for k, v in s.items()}
                                                           for s in samples], tmp))
        sessions = {k: _ort_session(p, tmp / f"opt_{i}.onnx", k in (QS, U8))
                    for i, (k, p) in enumerate(paths.items())}
        counts = {k: _op_counts(tmp / f"opt_{i}.onnx") for i, k in enumerate(paths)}
        quality = {k: models.lee_correlation(_ort_embed(s, tok, lee), pairs)
                   for k, s in sessions.items()}
        reference = {k: _reference_lee(p, tok, lee, pairs) for k, p in paths.items()
                     if k.startswith("ORT") or k == QS}
        err = {k: float(np.abs(sessions[k].run(None, {n: v.numpy() for n, v in check.items()})[0]
                               - ref).max() / np.abs(ref).max()) for k in ours}
        med = _latency(sessions, reps)
    print(f"torch fake-quant W8A8 Lee Pearson: {torch_r:.4f}\n")
    print("| model | Lee Pearson | Lee, reference execution | latency (median) | vs fp32 | "
          "max diff to fake-quant |")
    print("|---|---|---|---|---|---|")
    for k in sessions:
        e = f"{err[k]:.1e} of max" if k in err else ""
        p = f"{reference[k]:.4f}" if k in reference else ""
        print(f"| {k} | {quality[k]:.4f} | {p} | {med[k] * 1e3:.0f} ms | "
              f"{med['ONNX fp32'] / med[k]:.2f}x | {e} |")
    print("\n| model (optimized graph) | " + " | ".join(OPS) + " |")
    print("|---|" + "---|" * len(OPS))
    for k, c in counts.items():
        print(f"| {k} | " + " | ".join(str(c.get(o, 0)) for o in OPS) + " |")


if __name__ == "__main__":
    main()
