"""Model structure the calibration must see as it is.

* A weight two modules hold as distinct Parameters over one memory (``lm_head.weight =
  nn.Parameter(embed.weight.data)``, what ``load_state_dict(..., assign=True)`` gives) is
  one weight to every part, as a tied Parameter is: ``apply()`` fake-quantized it once and
  grouped it by memory, but its warning and the exporters told ties by Parameter identity,
  so nothing warned of the embedding running quantized and the compressed-tensors export
  wrote the head quantized beside the float embedding (its reload differed from
  ``apply()``).
* A grouped ConvTranspose weight ``[in, out / groups, *k]`` has no axis of output channels:
  per-channel is refused however spelled (``Channel(1)`` was taken, one scale shared by
  ``groups`` output channels, while ``Channel(0)`` was refused).
* ``holders`` / ``sharers`` (structure/tied.py) tell shared memory by bytes: buffers count, a
  single shared byte counts (in any dtype), an empty or meta tensor shares with nothing.
"""

import os
import warnings

import pytest
import torch
from torch import nn

import quantscope
from quantscope import QuantSpec
from quantscope.calibration import Recipe, Role, Rule, calibrate, preset, qdq_tensor
from quantscope.calibration.structure.tied import holders, sharers, tied_weights
from quantscope.layout import Channel


class _MemoryTied(nn.Module):
    """An embedding and a head holding distinct Parameters over one memory."""

    def __init__(self, vocab=40, width=32):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, width)
        self.mid = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = nn.Parameter(self.emb.weight.data)

    def forward(self, ids):
        return self.head(torch.relu(self.mid(self.emb(ids))))


def _ids(vocab=40):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (2, 7), generator=g) for _ in range(2)]


def _linear_int4():
    return Recipe(Rule(("Linear",), weight=Role(QuantSpec("int4", Channel(0)), "minmax")))


# ------------------------------------------------------------------ one memory, one weight
def test_tied_weights_tells_a_tie_by_memory():
    from quantscope.calibration.structure.tied import memory  # apply's rule, shared

    m = _MemoryTied()
    assert m.head.weight is not m.emb.weight
    assert memory(m.head.weight) == memory(m.emb.weight)
    assert tied_weights(m, ["head", "mid"]) == {"head": ["emb"]}
    # a slice of the same tensor (another offset / shape) is another weight
    m.mid.weight = nn.Parameter(m.emb.weight.data[:32])
    assert memory(m.mid.weight) != memory(m.emb.weight)
    assert tied_weights(m, ["mid"]) == {}


class _Holder(nn.Module):
    """A module holding ``t`` as a parameter or a buffer named ``name``."""

    def __init__(self, name, t, buffer=False):
        super().__init__()
        if buffer:
            self.register_buffer(name, t)
        else:
            setattr(self, name, nn.Parameter(t, requires_grad=t.is_floating_point()))


def _holding(*parts):
    return nn.ModuleDict({f"m{i}": p for i, p in enumerate(parts)})


def test_a_buffer_over_a_parameters_memory_shares_it():
    # a running copy of a norm weight, a cache over it: a buffer, the same bytes
    w = torch.ones(8)
    model = _holding(_Holder("weight", w), _Holder("copy", w[2:6], buffer=True))
    assert sharers(holders(model), model["m0"], "weight") == ["m1.copy"]


def test_one_byte_elements_sharing_one_element_share_memory():
    # int8 views x[0:4] and x[3:8] share byte 3 (the last of one, the first of the other);
    # x[4:8] shares none with x[0:4]
    x = torch.zeros(8, dtype=torch.int8)
    model = _holding(*(_Holder(n, x[i:j], buffer=True) for n, i, j in
                       (("a", 0, 4), ("b", 3, 8), ("c", 4, 8))))
    assert sharers(holders(model), model["m0"], "a") == ["m1.b"]


def test_a_view_in_another_dtype_inside_the_last_element_shares_memory():
    # a float32 weight of 32 values spans bytes 0..127, its last value 124..127; a bfloat16
    # view of the same storage from its value 63 (byte 126) on holds half of that value
    base = torch.zeros(64)
    model = _holding(_Holder("weight", base[:32]),
                     _Holder("tail", base.view(torch.bfloat16)[63:80], buffer=True))
    found = holders(model)
    assert sharers(found, model["m0"], "weight") == ["m1.tail"]
    assert sharers(found, model["m1"], "tail") == ["m0.weight"]


def test_empty_or_meta_tensors_share_nothing_with_each_other():
    # no bytes to compare: each is only itself
    model = _holding(_Holder("weight", torch.empty(0, 4)), _Holder("weight", torch.empty(0, 4)),
                     _Holder("weight", torch.empty(4, 4, device="meta")))
    found = holders(model)
    assert sharers(found, model["m0"], "weight") == []
    assert sharers(found, model["m2"], "weight") == []


def test_apply_names_the_module_sharing_a_memory_without_a_state():
    m = _MemoryTied().eval()
    table = m.emb.weight.detach().clone()
    calib = calibrate(m, _ids(), _linear_int4(), progress=False)
    assert "emb" not in calib.states
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with calib.apply(m):
            # the embedding runs the one QDQ'd memory, as the warning says
            assert torch.equal(m.emb.weight, qdq_tensor(table, calib.states["head"]["weight"]))
    tied = [w for w in caught if "tied" in str(w.message)]
    assert len(tied) == 1
    assert "head.weight is also the weight of ['emb']" in str(tied[0].message)
    assert torch.equal(m.emb.weight, table)


def test_onnx_export_refuses_a_memory_tie(tmp_path):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    m = _MemoryTied().eval()
    ids = _ids()
    calib = calibrate(m, [(x,) for x in ids], _linear_int4(), progress=False)
    with pytest.raises(ValueError, match=r"onnx export: head\.weight is tied with \['emb'\]"):
        quantscope.export(calib, m, tmp_path / "m.onnx", format="onnx",
                          example_inputs=(ids[0],))
    assert not (tmp_path / "m.onnx").exists()


def test_compressed_tensors_export_refuses_a_memory_tie(tmp_path):
    """The probe's case: the export wrote lm_head quantized and the embedding float; the
    reloaded model's logits differed from the applied model's."""
    pytest.importorskip("compressed_tensors")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    m = transformers.LlamaForCausalLM(cfg).eval()
    m.lm_head.weight = nn.Parameter(m.model.embed_tokens.weight.data)
    g = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(0, 50, (2, 12), generator=g)}]
    calib = calibrate(m, batches, preset("w4a16"), progress=False)
    with pytest.raises(ValueError, match=r"layer 'lm_head' weight: a weight tied with "
                                         r"\['model\.embed_tokens'\]"):
        quantscope.export(calib, m, tmp_path / "ct")
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------- grouped ConvTranspose
def _convt(groups):
    torch.manual_seed(0)
    return nn.Sequential(nn.ConvTranspose2d(4, 6, 3, groups=groups)).eval()


def _per_channel(layout):
    return Recipe(Rule(("ConvTranspose2d",),
                       weight=Role(QuantSpec("int8", layout), "memoryless_minmax")))


@pytest.mark.parametrize("layout", [Channel(0), Channel(-4), Channel(1), Channel(-3)],
                         ids=repr)
def test_grouped_convtranspose_refuses_every_per_channel_spelling(layout):
    with pytest.raises(ValueError, match=r"layer '0' \(ConvTranspose2d, groups=2\) weight: "
                                         r"per-channel .* needs groups == 1 .*no axis of "
                                         r"output channels"):
        calibrate(_convt(2), [torch.randn(2, 4, 5, 5)], _per_channel(layout), progress=False)


@pytest.mark.parametrize("layout", [Channel(0), Channel(-4), Channel(1), Channel(-3)],
                         ids=repr)
def test_ungrouped_convtranspose_takes_every_spelling_per_output_channel(layout):
    st = calibrate(_convt(1), [torch.randn(2, 4, 5, 5)], _per_channel(layout),
                   progress=False).states["0"]["weight"]
    assert st.spec.layout.axis % 4 == 1
    assert tuple(st.qparams.scale.shape) == (1, 6, 1, 1)
