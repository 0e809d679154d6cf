"""Sequential calibration's probe fixes: a re-iterable ``batches`` is listed once; a tuple
output whose other items feed the next block (T5's position_bias) is refused; a weighted
module called between the blocks on the batch gets its real values; a block that changes
its input in place is fed a copy where a second pass follows; ``auto``'s row samples equal
the whole-model pass's; another model's checkpoint is warned about; damaged checkpoint
files raise a ValueError naming them; ``info["expert_min_tokens"]`` is kept."""

import json
import os
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import quantscope
from quantscope.calibration import MoE, Sampling
from quantscope.calibration.options import Auto

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

KW = {"observer": "static_minmax", "progress": False}
#: a transformers config small enough for a quick test
SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64}


def _scales(calib):
    return {(n, r): s.qparams.scale for n, roles in calib.states.items()
            for r, s in roles.items() if getattr(s.qparams, "scale", None) is not None}


def _assert_same(a, b):
    sa, sb = _scales(a), _scales(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


class Block(nn.Module):
    """``fc`` and ``gate`` on one input: a fusion group (its detection runs a forward)."""

    def __init__(self, width=16, in_place=False):
        super().__init__()
        self.fc, self.in_place = nn.Linear(width, width), in_place
        self.gate = nn.Linear(width, width)

    def forward(self, h, cond=None):
        if self.in_place:
            h += 1.0
        elif cond is None:
            h = h + 1.0
        h = h if cond is None else h + cond
        return torch.relu(self.fc(h)) * torch.sigmoid(self.gate(h))


class Net(nn.Module):
    """``emb``, three blocks (each given ``cond(x)`` where ``cond``), a head that reads the
    batch's own ``scale`` besides the hidden states (or, ``after``, two heads)."""

    def __init__(self, in_place=False, cond=False, after=False):
        super().__init__()
        self.after = after  # shift the last block's output in place, read by two heads
        self.head2 = nn.Linear(16, 4) if after else None
        self.emb = nn.Linear(8, 16)
        self.cond = nn.Linear(8, 16) if cond else None
        self.layers = nn.ModuleList(Block(in_place=in_place) for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x, scale=None):
        h = self.emb(x)
        for b in self.layers:
            h = b(h, self.cond(x)) if self.cond is not None else b(h)
        if self.after:
            h += 1.0
            return self.head(h) + self.head2(h)
        return self.head(h if scale is None else h * scale)


def _net(**kw):
    torch.manual_seed(0)
    return Net(**kw).eval()


def test_a_dataloader_is_read_once():
    """A shuffling DataLoader yields another order each pass: read twice, the head paired
    batch i's hidden states with another batch's ``scale``."""
    model = _net()
    x, scale = torch.randn(8, 8), torch.ones(8, 1)
    scale[-1] = 100.0
    data = TensorDataset(x, scale)
    loader = DataLoader(data, batch_size=1, shuffle=True,
                        generator=torch.Generator().manual_seed(1))
    whole = quantscope.calibrate(model, [tuple(b) for b in DataLoader(data, batch_size=1)],
                                 "w8a8", **KW)
    _assert_same(whole, quantscope.calibrate(model, loader, "w8a8", sequential=True, **KW))


class PassesBias(nn.Module):
    def __init__(self, first):
        super().__init__()
        self.fc, self.first = nn.Linear(8, 8), first

    def forward(self, h, bias=None):
        if self.first:
            bias = torch.full_like(h, 3.0)
        return self.fc(h + bias), bias


class BiasNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([PassesBias(True), PassesBias(False), PassesBias(False)])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h, bias = x, None
        for b in self.layers:
            h, bias = b(h, bias)
        return self.head(h)


def test_a_tuple_item_passed_to_the_next_block_is_refused_before_calibrating():
    model = BiasNet().eval()
    real = []
    model.layers[1].fc.register_forward_pre_hook(
        lambda m, args: None if args[0].is_meta else real.append(1))
    with pytest.raises(ValueError, match=r"block layers\.0 returns a tuple whose other items "
                                         r"are passed to block layers\.1"):
        quantscope.calibrate(model, [torch.randn(4, 8)], "w8a8", sequential=True, **KW)
    assert real == []  # no block ran on real values: refused by the trace


def test_a_module_called_between_the_blocks_gets_its_real_values():
    """``cond(x)`` runs inside the loop: the trace used to give zeros for blocks 1 and 2."""
    model = _net(cond=True)
    x = [torch.randn(4, 8) * 3, torch.randn(4, 8)]
    whole = quantscope.calibrate(model, x, "w8a8", **KW)
    seq = quantscope.calibrate(model, x, "w8a8", sequential=True, **KW)
    _assert_same(whole, seq)
    assert ("cond", "input") in _scales(seq)


@pytest.mark.parametrize("options", [
    {"observer": "static_minmax"}, {"observer": "auto", "auto": Auto(metric="tensor")},
    {"sequential": "quantized"}])
def test_a_block_that_changes_its_input_in_place(options):
    """``h += 1`` in the block: a batch run twice over the block (the fusion detection's
    forward, auto's pass, the quantized outputs') must not shift the cached input twice: the
    result is that of the same block written ``h = h + 1``, and the whole-model pass's."""
    x = [torch.randn(4, 8) for _ in range(2)]
    kw = {"progress": False, "sequential": True, **options}
    got = quantscope.calibrate(_net(in_place=True), x, "w8a8", **kw)
    _assert_same(quantscope.calibrate(_net(), x, "w8a8", **kw), got)
    if "sequential" not in options:
        _assert_same(quantscope.calibrate(_net(in_place=True), x, "w8a8", progress=False,
                                          **options), got)


def test_the_forward_changing_the_last_output_in_place():
    """``h += 1`` after the blocks: the trace passed the first block's input through (one
    storage) and the head's pass runs a batch twice (the fusion detection's forward)."""
    model = _net(after=True)
    x = [torch.randn(4, 8) for _ in range(2)]
    whole = quantscope.calibrate(model, x, "w8a8", **KW)
    _assert_same(whole, quantscope.calibrate(model, x, "w8a8", sequential=True, **KW))


@pytest.mark.parametrize("stream", [False, True])
def test_auto_row_samples_equal_the_whole_model_pass(stream):
    """A sample smaller than the data: each layer draws its rows with a generator of its
    own, and the pieces see the batches' number as the whole pass does (a generator's: none)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval()
    batches = [torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(i))
               for i in range(3)]
    kw = {"observer": "auto", "auto": Auto(metric="tensor"),
          "sampling": Sampling(tokens=8, seed=0), "progress": False}
    feed = (lambda: iter(batches)) if stream else (lambda: batches)
    whole = quantscope.calibrate(model, feed(), "w8a8", **kw)
    _assert_same(whole, quantscope.calibrate(model, feed(), "w8a8", sequential=True, **kw))


def _save(tmp_path, name, cls, config_cls, **kw):
    torch.manual_seed(0)
    cls(config_cls(**{**SMALL, **kw})).save_pretrained(tmp_path / name)
    return tmp_path / name


def _unused_warnings(skeleton_dir, ckpt_dir):
    from quantscope.calibration import Sequential, empty_model

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantscope.calibrate(empty_model(skeleton_dir), [torch.randint(0, 64, (2, 8))], "w8a8",
                             sequential=Sequential(checkpoint=ckpt_dir), progress=False)
    return [str(w.message) for w in caught if "unused by the model" in str(w.message)]


def test_another_models_checkpoint_is_warned_about(tmp_path):
    transformers = pytest.importorskip("transformers")
    llama = _save(tmp_path, "llama", transformers.LlamaForCausalLM, transformers.LlamaConfig)
    qwen = _save(tmp_path, "qwen", transformers.Qwen2ForCausalLM, transformers.Qwen2Config)
    deep = _save(tmp_path, "deep", transformers.LlamaForCausalLM, transformers.LlamaConfig,
                 num_hidden_layers=3)
    assert _unused_warnings(llama, llama) == []
    (msg,) = _unused_warnings(llama, qwen)
    assert "holds 6 tensors" in msg and "model.layers.0.self_attn.k_proj.bias" in msg
    (msg,) = _unused_warnings(llama, deep)
    assert "model.layers.2." in msg


def test_damaged_checkpoint_files_are_named(tmp_path):
    from quantscope.calibration.run.checkpoint import INDEX, Checkpoint

    torch.manual_seed(0)
    from safetensors.torch import save_file

    save_file({"a": torch.randn(64, 64)}, tmp_path / "a.safetensors")
    save_file({"b": torch.randn(64, 64)}, tmp_path / "b.safetensors")
    (tmp_path / INDEX).write_text(json.dumps(
        {"weight_map": {"a": "a.safetensors", "b": "b.safetensors"}}))
    assert set(Checkpoint(tmp_path).where) == {"a", "b"}
    shard = tmp_path / "b.safetensors"
    shard.write_bytes(shard.read_bytes()[: os.path.getsize(shard) // 2])
    with pytest.raises(ValueError, match=r"b\.safetensors.* not a readable safetensors"):
        Checkpoint(tmp_path)
    (tmp_path / INDEX).write_text("{not json")
    with pytest.raises(ValueError, match=r"index\.json is not valid JSON"):
        Checkpoint(tmp_path)


def test_moe_info_keeps_the_expert_threshold():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **SMALL, num_local_experts=4, num_experts_per_tok=2)).eval()
    batches = [torch.randint(0, 64, (2, 8))]
    kw = {"moe": MoE(min_tokens=50), "progress": False}
    whole = quantscope.calibrate(model, batches, "w8a8", **kw)
    seq = quantscope.calibrate(model, batches, "w8a8", sequential=True, **kw)
    assert seq.info["expert_min_tokens"] == whole.info["expert_min_tokens"] == 50
    assert seq.info["experts"] == whole.info["experts"]


def test_auto_model_choices_are_kept_per_block():
    """``auto``'s default metric chooses each block end to end: every block's choice kept."""
    x = [torch.randn(4, 8) for _ in range(2)]
    seq = quantscope.calibrate(_net(), x, "w8a8", observer="auto", sequential=True,
                               progress=False)
    auto = seq.info["auto"]
    assert auto["metric"] == "model" and list(auto["blocks"]) == [f"layers.{j}" for j in range(3)]
    assert all("roles" in c for c in auto["blocks"].values())
    json.dumps(seq.info)
