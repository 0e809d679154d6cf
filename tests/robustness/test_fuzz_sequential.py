"""Property test of sequential calibration on random small block structures (issue 37).

Each case builds a small model around an ``nn.ModuleList`` of blocks and wires them one of
many ways: a chain in a random order, a block called twice, one never called, parallel
heads, a residual around each block, every block's output read again at the end, a block
or a weighted module shared, blocks that widen their input (traced on the meta device), an
order that depends on the batch; with random block insides (activation, inner residual,
LayerNorm, tuple outputs, a keyword argument), weights tied between blocks or between the
embedding and the head, a random preset and observer, the model in memory or a meta
skeleton loaded from safetensors. Then ``calibrate(..., sequential=True)`` either

- gives the whole-model pass's qparams bit for bit (every layer, role, scale, zero point and
  global scale; every scale finite and > 0), which a chain must, or
- raises the documented refusal: a ``ValueError`` naming the block and ``blocks=``, which
  anything else must.

The model is left as it was either way (its blocks in place, its weights unchanged).
Profiles and counts: fuzzing.py (``make fuzz`` writes them to runs/).
"""

import os
import tempfile
import warnings

import pytest
import torch
from fuzzing import DOCUMENTED, FUZZ, count, start
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch import nn

from quantscope.calibration import calibrate

#: the ci profile's budget: about 10 s on an idle machine (each case runs two calibrations)
CASES = settings(FUZZ, max_examples=25 if FUZZ.max_examples <= 60 else FUZZ.max_examples)
#: wiring -> whether sequential calibration must refuse it (None: either, it depends)
WIRINGS = {"chain": False, "twice": True, "skip": True, "heads": True, "residual": True,
           "dense": True, "shared_block": True, "shared_linear": True, "widen": False,
           "by_batch": None}
PRESETS = ["w8a8", "fp8", "nvfp4", "w8a8-dynamic"]
TEST = "sequential_block_structures"


class Block(nn.Module):
    def __init__(self, cfg, width_in, width_out):
        super().__init__()
        self.fc = nn.Linear(width_in, width_out, bias=cfg["bias"])
        self.norm = nn.LayerNorm(width_out) if cfg["norm"] else None
        self.cfg = cfg

    def forward(self, h, scale=None):
        out = self.fc(h)
        out = {"relu": torch.relu, "gelu": nn.functional.gelu, "none": lambda x: x}[
            self.cfg["act"]](out)
        if self.cfg["inner_residual"] and out.shape == h.shape:
            out = out + h
        if self.norm is not None:
            out = self.norm(out)
        if scale is not None:
            out = out * scale
        return (out, None) if self.cfg["as_tuple"] else out


class Net(nn.Module):
    def __init__(self, spec):
        super().__init__()
        w, n, cfg = spec["width"], spec["n"], spec["block"]
        self.spec = spec
        if spec["tokens"]:
            self.embed = nn.Embedding(32, w)
        else:
            self.embed = nn.Linear(8, w)
        widths = [w * (2 ** i if spec["wiring"] == "widen" else 1) for i in range(n + 1)]
        self.layers = nn.ModuleList(Block(cfg, widths[i], widths[i + 1]) for i in range(n))
        out_w = widths[-1] * (n if spec["wiring"] == "heads" else 1)
        self.head = nn.Linear(out_w, 32 if spec["tokens"] else 4, bias=False)
        if spec["tied_head"] and spec["tokens"] and out_w == w:
            self.head.weight = self.embed.weight
        if spec["tied_blocks"] and n >= 2 and spec["wiring"] != "widen":
            self.layers[-1].fc.weight = self.layers[0].fc.weight
        if spec["wiring"] == "shared_block" and n >= 2:
            self.layers[1] = self.layers[0]
        if spec["wiring"] == "shared_linear" and n >= 2:
            self.layers[-1].fc = self.layers[0].fc

    def forward(self, x, scale=None):
        spec = self.spec
        h = self.embed(x)
        if spec["wiring"] == "heads":
            outs = [self._call(b, h, scale) for b in self.layers]
            return self.head(torch.cat(outs, -1))
        order = spec["order"]
        if spec["wiring"] == "by_batch" and float(x.flatten()[0]) > 0:
            order = order[::-1]
        seen = []
        for i in order:
            out = self._call(self.layers[i], h, scale)
            seen.append(out)
            h = h + out if spec["wiring"] == "residual" else out
        if spec["wiring"] == "dense":
            h = torch.stack(seen).mean(0)
        return self.head(h)

    def _call(self, block, h, scale):
        out = block(h, scale=scale) if self.spec["scale_kw"] else block(h)
        return out[0] if self.spec["block"]["as_tuple"] else out


@st.composite
def specs(draw):
    n = draw(st.integers(1, 4))
    wiring = draw(st.sampled_from(["chain"] * 4 + sorted(WIRINGS)))  # chains: half the cases
    # widening blocks run in list order only (each takes the width the one before gives)
    order = list(range(n)) if wiring == "widen" else draw(st.permutations(range(n)))
    if wiring == "twice":
        k = draw(st.integers(0, n))
        order = [*order[:k], draw(st.integers(0, n - 1)), *order[k:]]
    elif wiring == "skip" and n >= 2:
        order = order[:-1]
    block = {"act": draw(st.sampled_from(["relu", "gelu", "none"])),
             "inner_residual": draw(st.booleans()), "norm": draw(st.booleans()),
             "bias": draw(st.booleans()), "as_tuple": draw(st.booleans())}
    return {"n": n, "wiring": wiring, "order": list(order), "block": block,
            "width": draw(st.sampled_from([16, 32])), "tokens": draw(st.booleans()),
            "tied_head": draw(st.booleans()), "tied_blocks": draw(st.booleans()),
            "scale_kw": draw(st.booleans())}


def _must_refuse(spec) -> bool | None:
    """Whether the wiring is not a chain (None: depends on the batches)."""
    refuse = WIRINGS[spec["wiring"]]
    if refuse and spec["wiring"] == "twice":
        return True
    if refuse and spec["n"] == 1:  # one block: heads, residual, dense ... are a chain of one
        return False
    return refuse


def _batches(spec, seeds, seq_len):
    out = []
    for s in seeds:
        g = torch.Generator().manual_seed(s)
        x = (torch.randint(0, 32, (2, seq_len), generator=g) if spec["tokens"]
             else torch.randn(2, seq_len, 8, generator=g))
        out.append((x, torch.tensor(0.5)) if spec["scale_kw"] else x)
    return out


def _qparams(calib):
    return {(layer, role): st.qparams for layer, roles in calib.states.items()
            for role, st in roles.items()}


def _assert_equal(whole, seq):
    qw, qs = _qparams(whole), _qparams(seq)
    assert qw.keys() == qs.keys(), f"layers differ: {sorted(set(qw) ^ set(qs))}"
    for key, a in qw.items():
        b = qs[key]
        assert (a is None) == (b is None), key
        if a is None:
            continue
        for f in ("scale", "zero_point", "global_scale"):
            x, y = getattr(a, f), getattr(b, f)
            assert (x is None) == (y is None), (key, f)
            if x is not None:
                assert torch.equal(x, y), f"{key} {f}: sequential differs from the whole model"
        for t in (b.scale, b.global_scale):
            if t is not None:
                assert bool(torch.isfinite(t.float()).all() and (t.float() > 0).all()), \
                    f"{key}: scale {t}"


def _skeleton_from_checkpoint(model, spec, folder):
    """The same model on the meta device, its weights in a safetensors file (a tied tensor
    once, under its first name, as save_pretrained writes it)."""
    tensors, seen = {}, set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            tensors[name] = p.detach().contiguous().clone()
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    with torch.device("meta"):
        skeleton = Net(spec).eval()
    return skeleton


@pytest.mark.extended  # a fuzzer (make fuzz runs it long)
@CASES
@given(spec=specs(), preset=st.sampled_from(PRESETS), observer=st.sampled_from(["minmax", "mse"]),
       seeds=st.lists(st.integers(0, 2**16), min_size=1, max_size=3),
       seq_len=st.integers(1, 5), from_checkpoint=st.booleans())
def test_sequential_equals_whole_model_or_refuses(spec, preset, observer, seeds, seq_len,
                                                  from_checkpoint):
    torch.manual_seed(seeds[0])
    model = Net(spec).eval()
    batches = _batches(spec, seeds, seq_len)
    start(TEST)
    blocks = list(model.layers)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            whole = calibrate(model, batches, preset, observer=observer, progress=False)
        except DOCUMENTED:
            whole = None  # the whole model refuses: sequential must too (checked below)
        with tempfile.TemporaryDirectory(prefix="quantscope-fuzz-seq-") as folder:
            target = _skeleton_from_checkpoint(model, spec, folder) if from_checkpoint \
                else model
            kw = {"checkpoint": folder} if from_checkpoint else {}
            try:
                seq = calibrate(target, batches, preset, observer=observer, progress=False,
                                sequential=True, cache_dir=folder, **kw)
            except DOCUMENTED as e:
                _check_refusal(e, spec, whole)
                seq = None
            if from_checkpoint:
                assert all(p.device.type == "meta" for p in target.parameters())
    assert all(a is b for a, b in zip(model.layers, blocks)), "a block was left replaced"
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    if seq is None:
        count(TEST, "clear_errors")
        return
    assert whole is not None, "the whole model refused, sequential calibrated"
    assert _must_refuse(spec) is not True, f"not a chain, calibrated anyway: {spec}"
    _assert_equal(whole, seq)
    count(TEST, "ok")


def _check_refusal(e, spec, whole):
    msg = str(e)
    if whole is None:  # the recipe's own refusal (a width a group does not divide ...)
        assert len(msg) > 10, msg
        return
    assert isinstance(e, ValueError), f"{type(e).__name__}: {msg}"
    assert _must_refuse(spec) is not False, f"a chain was refused: {msg} ({spec})"
    assert "layers" in msg and "blocks='...'" in msg, f"the refusal names no block: {msg}"
