"""Sequential calibration of blocks that return a tuple the parent unpacks (``h, aux =
block(h)``, the other items never read): the replay gives a tuple as long, so the parts
after the blocks are calibrated as in the whole-model pass (it crashed with the parent's
unpack error); a 1-layer T5 too, while a 2-layer T5 (position_bias read by the next block)
is still refused by name."""

import pytest
import torch
from torch import nn

import quantscope

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

KW = {"observer": "static_minmax", "progress": False}


def _assert_same(a, b):
    assert a.states.keys() == b.states.keys()
    for n, roles in a.states.items():
        assert roles.keys() == b.states[n].keys(), n
        for r, s in roles.items():
            assert torch.equal(s.qparams.scale, b.states[n][r].qparams.scale), (n, r)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, h):
        return torch.relu(self.fc(h)), h.mean(), None


class _Net(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(n))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for block in self.layers:
            x, _aux, _ = block(x)  # the other items never read
        return self.head(x)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("mode", ["float", "quantized"])
def test_unpacked_tuple_blocks_calibrate(n, mode):
    torch.manual_seed(0)
    model = _Net(n).eval()
    batches = [torch.randn(4, 16) for _ in range(2)]
    seq = quantscope.calibrate(model, batches, "w8a8", sequential=mode, **KW)
    assert "head" in seq.states
    if mode == "float":
        _assert_same(quantscope.calibrate(model, batches, "w8a8", **KW), seq)


def _t5(layers):
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = T.T5Config(d_model=32, d_ff=64, d_kv=16, num_layers=layers,
                        num_decoder_layers=layers, num_heads=2, vocab_size=100)
    batches = [{"input_ids": torch.randint(0, 100, (2, 7)),
                "decoder_input_ids": torch.randint(0, 100, (2, 5))} for _ in range(2)]
    return T.T5Model(config).eval(), batches


def test_one_layer_t5_equals_whole_pass():
    model, batches = _t5(1)
    seq = quantscope.calibrate(model, batches, "w8a8", sequential=True, **KW)
    assert seq.info["sequential"]["blocks"] == "decoder.block"
    _assert_same(quantscope.calibrate(model, batches, "w8a8", **KW), seq)


def test_two_layer_t5_still_refused_by_name():
    model, batches = _t5(2)
    with pytest.raises(ValueError, match=r"decoder\.block\.0 returns a tuple .*position_bias"):
        quantscope.calibrate(model, batches, "w8a8", sequential=True, **KW)
