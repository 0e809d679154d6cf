"""Sequential calibration follows the order in which the forward calls the blocks, or
refuses (issue 37 rows 8 and 15): a chain in any order gives the whole-model pass's qparams
bit for bit; a block called twice, parallel heads, a residual around the blocks or a block
output read twice is refused with a ValueError naming the block and the way out."""

import pytest
import torch
from calib_checks import assert_same_qparams
from safetensors.torch import save_file
from torch import nn

from quantscope.calibration import calibrate

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Block(nn.Module):
    def __init__(self, width, as_tuple=False):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.as_tuple = as_tuple

    def forward(self, h, scale=None):
        out = torch.relu(self.fc(h)) * (1.0 if scale is None else scale)
        return (out, None) if self.as_tuple else out


class Net(nn.Module):
    """``embed``, the blocks called as ``wiring`` says, ``head``."""

    def __init__(self, wiring="chain", order=(0, 1, 2), n=3, width=16, as_tuple=False):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.layers = nn.ModuleList(Block(width, as_tuple) for _ in range(n))
        self.head = nn.Linear(width * (n if wiring == "heads" else 1), 4)
        self.wiring, self.order, self.as_tuple = wiring, order, as_tuple

    def forward(self, x, scale=None):
        h = self.embed(x)
        if self.wiring == "heads":  # parallel heads on one input, concatenated
            return self.head(torch.cat([b(h) for b in self.layers], -1))
        seen = []
        for i in self.order:
            out = self.layers[i](h, scale=scale)
            out = out[0] if self.as_tuple else out
            seen.append(out)
            h = h + out if self.wiring == "residual" else out
        if self.wiring == "dense":  # every block's output read again at the end
            h = torch.stack(seen).mean(0)
        return self.head(h)


def _batches():
    return [torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]


def _net(**kw):
    torch.manual_seed(0)
    return Net(**kw).eval()


@pytest.mark.parametrize("order", [(2, 0, 1), (1, 2, 0), (0, 2, 1)])
def test_blocks_out_of_list_order_follow_the_call_order(order):
    model = _net(order=order)
    whole = calibrate(model, _batches(), "w8a8", progress=False)
    seq = calibrate(model, _batches(), "w8a8", progress=False, sequential=True)
    assert_same_qparams(whole, seq)
    assert seq.info["sequential"]["order"] == list(order)


def test_blocks_returning_tuples_and_keyword_arguments():
    model = _net(order=(1, 0, 2), as_tuple=True)
    batches = [(x, torch.tensor(0.5)) for x in _batches()]
    whole = calibrate(model, batches, "w8a8", progress=False)
    seq = calibrate(model, batches, "w8a8", progress=False, sequential=True)
    assert_same_qparams(whole, seq)


def test_out_of_order_from_a_checkpoint_on_the_meta_device(tmp_path):
    model = _net(order=(2, 1, 0))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              tmp_path / "model.safetensors")
    with torch.device("meta"):
        skeleton = Net(order=(2, 1, 0)).eval()
    whole = calibrate(model, _batches(), "w8a8", progress=False)
    seq = calibrate(skeleton, _batches(), "w8a8", progress=False, sequential=True,
                    checkpoint=tmp_path)
    assert_same_qparams(whole, seq)
    assert all(p.device.type == "meta" for p in skeleton.parameters())


@pytest.mark.parametrize("kw, says", [
    ({"order": (0, 1, 1, 2)}, "block layers.1 is called 2 times"),
    ({"order": (0, 1)}, "block layers.2 is never called"),
    ({"wiring": "heads"}, "block layers.1 takes the same input as block layers.0"),
    ({"wiring": "residual"}, "block layers.1 does not take the output of block layers.0"),
    ({"wiring": "dense"}, "the output of block layers.0 is read elsewhere"),
])
def test_what_is_not_a_chain_is_refused_naming_the_block(kw, says):
    model = _net(**kw)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=says) as e:
        calibrate(model, _batches(), "w8a8", progress=False, sequential=True)
    assert "'layers'" in str(e.value) and "blocks='...'" in str(e.value)
    assert "sequential=False" in str(e.value)
    # the model is left as it was: its blocks back, no hook left
    assert all(isinstance(b, Block) for b in model.layers)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_blocks_names_a_chain_inside_a_model_that_is_not_one():
    """Parallel heads refused; ``blocks=`` naming another list (here: a chain) works."""
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.trunk = nn.ModuleList(Block(16) for _ in range(2))
            self.heads = Net(wiring="heads", n=4)

        def forward(self, x):
            h = self.heads.embed(x)
            for b in self.trunk:
                h = b(h)
            return self.heads.head(torch.cat([b(h) for b in self.heads.layers], -1))

    torch.manual_seed(0)
    model = Outer().eval()
    with pytest.raises(ValueError, match="'heads.layers'.*parallel blocks"):
        calibrate(model, _batches(), "w8a8", progress=False, sequential=True)
    whole = calibrate(model, _batches(), "w8a8", progress=False)
    seq = calibrate(model, _batches(), "w8a8", progress=False, sequential=True, blocks="trunk")
    assert_same_qparams(whole, seq)


class Widen(nn.Module):
    """Blocks that change the width: a pass-through trace cannot run the rest of the model,
    a shaped one (each block run on the meta device) can."""

    def __init__(self, routed=False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8 * 2**i, 16 * 2**i) for i in range(2))
        self.head = nn.Linear(32, 2)
        self.routed = routed

    def forward(self, x):
        for b in (self.layers[1], self.layers[0]) if self.routed else self.layers:
            x = b(x)
        return self.head(x)


def test_blocks_that_change_the_width_are_traced_shaped(tmp_path):
    model = Widen().eval()
    whole = calibrate(model, _batches(), "w8a8", progress=False)
    assert_same_qparams(whole, calibrate(model, _batches(), "w8a8", progress=False, sequential=True))
    save_file(dict(model.state_dict()), tmp_path / "model.safetensors")
    with torch.device("meta"):
        skeleton = Widen().eval()
    assert_same_qparams(whole, calibrate(skeleton, _batches(), "w8a8", progress=False, sequential=True,
                           checkpoint=tmp_path))


class Routed(nn.Module):
    """A block whose output depends on its input's values (it cannot run on meta)."""

    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, h):
        keep = torch.nonzero(h[..., 0] > 0)  # data-dependent shape
        return (self.fc(h) + keep.numel(),)


def test_blocks_that_cannot_run_on_meta_are_refused_with_the_first_trace_error():
    class Net2(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Routed(8) for _ in range(2))

        def forward(self, x):
            for b in self.layers:
                x = b(x)[0]
            return x

    with pytest.raises(ValueError, match="block layers.1 does not take the output of block "
                                         "layers.0"):
        calibrate(Net2().eval(), _batches(), "w8a8", progress=False, sequential=True)


@pytest.mark.parametrize("share, says", [
    ("block", r"layers\.1\.fc is the same module as layers\.0\.fc"),
    ("linear", r"layers\.2\.fc is the same module as layers\.0\.fc"),
    ("outside", r"head \(outside the blocks\) is the same module as layers\.1\.fc"),
])
def test_modules_shared_between_blocks_are_refused(share, says):
    """The whole-model pass observes a shared module as one layer over all its calls; a
    piece would see one block's calls only."""
    model = _net()
    if share == "block":
        model.layers[1] = model.layers[0]
    elif share == "linear":
        model.layers[2].fc = model.layers[0].fc
    else:
        model.layers[1].fc = nn.Linear(16, 16)
        model.head = model.layers[1].fc
    with pytest.raises(ValueError, match=says):
        calibrate(model, _batches(), "w8a8", progress=False, sequential=True)


def test_weights_tied_between_blocks_are_not_shared_modules(tmp_path):
    """Tied weights (one tensor, two modules) are two layers in both passes; from a
    checkpoint that stores the tensor once (as save_pretrained does) the tie survives each
    block's load and unload (the second block's weight was 'not in the checkpoint')."""
    def tie(m):
        m.layers[2].fc.weight = m.layers[0].fc.weight
        return m

    model = tie(_net(order=(1, 2, 0)))
    whole = calibrate(model, _batches(), "w8a8", progress=False)
    assert_same_qparams(whole, calibrate(model, _batches(), "w8a8", progress=False, sequential=True))
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()
               if k != "layers.2.fc.weight"}
    save_file(tensors, tmp_path / "model.safetensors")
    with torch.device("meta"):
        skeleton = tie(Net(order=(1, 2, 0)).eval())
    assert_same_qparams(whole, calibrate(skeleton, _batches(), "w8a8", progress=False, sequential=True,
                           checkpoint=tmp_path))
    assert skeleton.layers[2].fc.weight is skeleton.layers[0].fc.weight


def test_the_trace_computes_no_head():
    """The first pass needs the blocks' order, not the head's output: after the first block
    the weighted modules outside the blocks give only their output's shape (a language
    model's head would compute every batch's logits for nothing). So the head computes as
    often as in the whole-model pass, and the qparams are the whole-model pass's."""
    model = _net(order=(1, 0, 2))
    calls = []
    model.head.register_forward_hook(lambda m, args, out: calls.append(
        "meta" if out.device.type == "meta" else "shape" if 0 in out.stride() else "real"))
    whole = calibrate(model, _batches(), "w8a8", progress=False)
    real_whole = calls.count("real")
    calls.clear()
    seq = calibrate(model, _batches(), "w8a8", progress=False, sequential=True)
    assert_same_qparams(whole, seq)
    assert calls.count("real") == real_whole
    assert calls.count("shape") == calls.count("meta") == len(_batches())   # the trace
    assert "forward" not in model.head.__dict__                              # put back
