"""A model twice the memory it is given: a random-weight Llama checkpoint (~1060 MB of fp32
weights) calibrated sequentially by a child process limited to 500 MB (RLIMIT_DATA, which
counts the heap and private anonymous mappings; RLIMIT_AS would also count torch's
address-space reservations and the memory-mapped checkpoint). The result is then applied to
the whole model in this (unlimited) process and evaluated against the float model.

Marked ``memory``: it writes ~1060 MB and takes a few minutes, so ``make test`` leaves it to
``make test-memory``.
"""

import json
import os
import resource
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.memory

LIMIT_MB = 500
CHILD = textwrap.dedent("""
    import json, sys, torch
    torch.set_num_threads(1)
    from quantscope.calibration import calibrate
    from quantscope.calibration.run.checkpoint import empty_model
    path, out = sys.argv[1], sys.argv[2]
    batches = torch.load(path + "/batches.pt")
    model = empty_model(path, task="causal-lm")
    cal = calibrate(model, batches, "w8a8", progress=False, sequential=True, checkpoint=path,
                    cache_budget_mb=8)
    cal.save(out)
    # VmHWM: this process's own peak (ru_maxrss would carry the parent's over fork + exec)
    hwm = [int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM:")]
    print(json.dumps({"maxrss_mb": hwm[0] / 1024,
                      "info": cal.info["sequential"]}))
""")


def _limit():
    lim = LIMIT_MB * 2**20
    resource.setrlimit(resource.RLIMIT_DATA, (lim, lim))


def _write_checkpoint(path):
    """Config and one safetensors shard per layer: the writer never holds the whole model."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=21,
                      num_attention_heads=16, num_key_value_heads=16, vocab_size=1000,
                      tie_word_embeddings=False, max_position_embeddings=64)
    cfg.architectures = [LlamaForCausalLM.__name__]
    cfg.save_pretrained(path)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(cfg)
    shards = {}
    for name, p in skeleton.named_parameters():
        key = name.split(".")[2] if name.startswith("model.layers.") else "outer"
        shards.setdefault(key, {})[name] = p
    g = torch.Generator().manual_seed(0)
    total, weight_map = 0, {}
    for key, params in shards.items():
        tensors = {}
        for name, p in params.items():
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(p.shape)
            else:
                tensors[name] = torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5
            total += tensors[name].numel() * 4
        save_file(tensors, os.path.join(path, f"model-{key}.safetensors"))
        weight_map.update(dict.fromkeys(tensors, f"model-{key}.safetensors"))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def test_calibrates_a_model_twice_its_memory(tmp_path):
    ckpt = tmp_path / "model"
    ckpt.mkdir()
    try:
        _check(tmp_path, ckpt)
    finally:  # pytest keeps the last runs' tmp_path: do not leave 1060 MB behind
        shutil.rmtree(ckpt, ignore_errors=True)


def _check(tmp_path, ckpt):
    total = _write_checkpoint(ckpt)
    assert total >= 2 * LIMIT_MB * 2**20
    g = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(0, 1000, (4, 32), generator=g),
                "attention_mask": torch.ones(4, 32, dtype=torch.long)} for _ in range(4)]
    torch.save(batches, ckpt / "batches.pt")
    out = tmp_path / "calibration"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"),
                                          os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", CHILD, str(ckpt), str(out)], env=env, check=False,
                       preexec_fn=_limit, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["info"]["count"] == 21
    # its resident peak also counts the checkpoint's mapped pages (file-backed, outside
    # RLIMIT_DATA), yet stays well below the model's size
    assert got["maxrss_mb"] * 2**20 < 0.7 * total, got

    # the limit is real: loading the whole model under it fails
    r = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import sys, torch
        from transformers import AutoModelForCausalLM
        AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
    """), str(ckpt)], env=env, preexec_fn=_limit, capture_output=True, text=True, timeout=600,
                       check=False)
    assert r.returncode != 0 and "Cannot allocate memory" in r.stderr, r.stderr[-2000:]

    # the result applies to the whole model and keeps it close to the float one
    from transformers import AutoModelForCausalLM

    from quantscope.calibration.results.io import load

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    cal = load(out)
    assert {k for k in cal.states if k.startswith("model.layers.")} == {
        n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
        and n.startswith("model.layers.")}
    with torch.inference_mode():
        ref = model(**batches[0]).logits
        handle = cal.apply(model)
        q = model(**batches[0]).logits
        handle.remove()
    assert torch.isfinite(q).all()
    cos = torch.nn.functional.cosine_similarity(q.flatten(), ref.flatten(), dim=0)
    assert cos > 0.99, float(cos)
