"""Sequential calibration, probe s36:

1. a block list under any name: the piece stood for a block under its full name, and kept its
   own attributes (``block``, ``inputs``, ``context`` ...) on the same module, so a list called
   ``block`` lost its blocks' states (all saved as ``block.fc``) and ``inputs`` / ``context``
   ... raised TypeError;
2. the spill folder was made before the checkpoint's warnings: one raised as an error (or an
   interrupt during it) left the folder behind;
3. a spilled view (a slice of a rotary table) wrote its whole storage to every file;
4. the model's own error after the blocks (labels of a wrong length) was reported as
   "the blocks are not a chain", and one raised once by the pass-through trace was lost;
5. ``checkpoint=`` with the weights already in memory was ignored without a word.
"""

import os
import warnings

import pytest
import torch
from calib_checks import assert_same_qparams
from safetensors.torch import save_file
from torch import nn

from quantscope.calibration import Sequential, calibrate
from quantscope.calibration.run import seq_cache
from quantscope.calibration.run.block_order import NotAChain


class Block(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, h, pos=None):
        return torch.relu(self.fc(h)) + (0 if pos is None else pos)


def _net(attr="layers", n=3, width=16):
    """``embed``, ``n`` blocks in a list called ``attr``, ``head``; the forward takes
    optional ``labels`` (a cross-entropy loss, as a Hugging Face model's)."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(8, width)
            setattr(self, attr, nn.ModuleList(Block(width) for _ in range(n)))
            self.head = nn.Linear(width, 4)

        def forward(self, x, labels=None):
            h = self.embed(x)
            for b in getattr(self, attr):
                h = b(h)
            out = self.head(h)
            if labels is None:
                return out
            return nn.functional.cross_entropy(out.flatten(0, -2), labels.flatten())

    torch.manual_seed(0)
    return Net


def _batches(n=3):
    return [torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(i)) for i in range(n)]


def _save(model, folder):
    os.makedirs(folder, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              os.path.join(folder, "model.safetensors"))
    return folder


# ---------------------------------------------------------------- 1. any list name
@pytest.mark.parametrize("attr", ["block", "inputs", "context", "outputs", "source", "rest",
                                  "copy_inputs", "feed"])
def test_blocks_under_any_list_name_calibrate_as_the_whole_model(attr):
    model = _net(attr)().eval()
    whole = calibrate(model, _batches(), "w8a8", progress=False)
    seq = calibrate(model, _batches(), "w8a8", progress=False, sequential=True)
    assert f"{attr}.2.fc" in seq.states and f"{attr}.fc" not in seq.states
    assert_same_qparams(whole, seq)
    x = _batches(1)[0]
    with torch.no_grad():
        handle = seq.apply(model)
        try:
            got = model(x)
        finally:
            handle.remove()
        handle = whole.apply(model)
        try:
            assert torch.equal(got, model(x))
        finally:
            handle.remove()


def test_blocks_named_block_with_auto_and_quantized_mode():
    """auto's scoring reads the piece's batches (batch_source); the quantized mode applies
    the block's qparams to the piece."""
    model = _net("block")().eval()
    seq = calibrate(model, _batches(), "w8a8", progress=False, sequential="quantized")
    assert {f"block.{j}.fc" for j in range(3)} <= set(seq.states)
    auto = calibrate(model, _batches(), "w8a8", observer="auto", progress=False,
                     sequential=True)
    assert set(auto.info["auto"]["blocks"]) == {f"block.{j}" for j in range(3)}


# ---------------------------------------------------------------- 2. the spill folder
def _deeper_checkpoint(tmp_path):
    """A skeleton of 3 blocks and a checkpoint of 4 (a warning names the extra block's)."""
    path = _save(_net(n=4)().eval(), tmp_path / "ckpt")
    with torch.device("meta"):
        skeleton = _net(n=3)().eval()
    cache = tmp_path / "cache"
    cache.mkdir()
    return skeleton, path, cache


def test_spill_folder_not_left_when_the_checkpoint_warning_is_an_error(tmp_path):
    skeleton, path, cache = _deeper_checkpoint(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as python -W error / pytest -W error
        with pytest.raises(UserWarning, match="tensors unused by the model"):
            calibrate(skeleton, _batches(), "w8a8", progress=False,
                      sequential=Sequential(checkpoint=path, cache_dir=cache))
    assert os.listdir(cache) == []


def test_spill_folder_not_left_on_an_interrupt_during_the_checkpoint_warning(tmp_path):
    skeleton, path, cache = _deeper_checkpoint(tmp_path)

    def interrupt(message, *args, **kwargs):
        if "tensors unused by the model" in str(message):
            raise KeyboardInterrupt  # Ctrl-C while the warning is shown
        return shown(message, *args, **kwargs)

    shown = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = interrupt
        with pytest.raises(KeyboardInterrupt):
            calibrate(skeleton, _batches(), "w8a8", progress=False,
                      sequential=Sequential(checkpoint=path, cache_dir=cache))
    assert os.listdir(cache) == []


# ---------------------------------------------------------------- 3. spilled views
def test_a_spilled_view_writes_its_own_bytes_only(tmp_path):
    table = torch.randn(65536, 16)  # 4 MB
    cache = seq_cache.Cache([0], str(tmp_path), "ctx")  # no budget: every value spilled
    cache.put(0, [table[:8], {"pos": table[100:104].t()}])
    assert os.path.getsize(tmp_path / "ctx-0.pt") < 8192
    got = cache.get(0)
    assert torch.equal(got[0], table[:8]) and torch.equal(got[1]["pos"], table[100:104].t())
    # a tensor that is its whole storage (or less: zeros expanded) is saved as it is
    whole, spread = torch.randn(8, 16), torch.zeros(()).expand(64, 64)
    copies = []
    real = torch.Tensor.clone
    try:
        torch.Tensor.clone = lambda t, *a, **k: copies.append(t.shape) or real(t, *a, **k)
        cache.put(1, [whole, spread])
    finally:
        torch.Tensor.clone = real
    assert copies == []
    got = cache.get(1)
    assert torch.equal(got[0], whole) and torch.equal(got[1], spread)
    assert os.path.getsize(tmp_path / "ctx-1.pt") < 4096


class Tabled(nn.Module):
    """Blocks taking a slice of a precomputed 4 MB table (old-style rotary cache)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.randn(65536, 16))
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        pos = self.table[: x.shape[1]]
        for b in self.layers:
            x = b(x, pos)
        return self.head(x)


def test_spilled_table_slices_stay_small_and_calibrate_as_the_whole_model(monkeypatch):
    torch.manual_seed(0)
    model = Tabled().eval()
    batches = [torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(i))
               for i in range(4)]
    sizes = []
    real = torch.save

    def save(obj, path, *a, **k):
        real(obj, path, *a, **k)
        sizes.append(os.path.getsize(path))

    monkeypatch.setattr(torch, "save", save)
    seq = calibrate(model, batches, "w8a8", progress=False,
                    sequential=Sequential(cache_budget_mb=0))
    monkeypatch.undo()
    assert sizes and max(sizes) < 16384
    assert_same_qparams(calibrate(model, batches, "w8a8", progress=False), seq)


# ---------------------------------------------------------------- 4. the model's own error
def _bad_labels(n=3):
    return [(x, torch.zeros(2, dtype=torch.long)) for x in _batches(n)]  # 15 rows, 2 labels


def test_the_models_own_error_after_the_blocks_is_raised_as_it_is():
    model = _net()().eval()
    with pytest.raises(ValueError, match="Expected input batch_size") as whole:
        calibrate(model, _bad_labels(), "w8a8", progress=False)
    with pytest.raises(ValueError, match="Expected input batch_size") as seq:
        calibrate(model, _bad_labels(), "w8a8", progress=False, sequential=True)
    assert not isinstance(seq.value, NotAChain)
    assert str(seq.value) == str(whole.value)
    assert all(isinstance(b, Block) for b in model.layers)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_the_models_own_error_from_a_skeleton_loads_each_block_for_the_check(tmp_path):
    Net = _net()
    path = _save(Net().eval(), tmp_path / "ckpt")
    with torch.device("meta"):
        skeleton = Net().eval()
    cache = tmp_path / "cache"
    cache.mkdir()
    with pytest.raises(ValueError, match="Expected input batch_size") as e:
        calibrate(skeleton, _bad_labels(), "w8a8", progress=False,
                  sequential=Sequential(checkpoint=path, cache_dir=cache))
    assert not isinstance(e.value, NotAChain)
    assert all(p.device.type == "meta" for p in skeleton.parameters())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in skeleton.modules())
    assert os.listdir(cache) == []


def test_an_error_the_model_raises_once_is_not_lost():
    """The first (pass-through) trace meets it, the shaped one does not: the pass-through
    stood for every block as it is (same shape, a tensor), so the error was the model's."""
    Net = _net()

    class Once(Net):
        calls = 0

        def forward(self, x, labels=None):
            type(self).calls += 1
            if type(self).calls == 1:
                h = self.layers[0](self.embed(x))
                for b in self.layers[1:]:
                    h = b(h)
                raise RuntimeError("the model's own one-time failure")
            return super().forward(x, labels)

    with pytest.raises(RuntimeError, match="one-time failure"):
        calibrate(Once().eval(), _batches(), "w8a8", progress=False, sequential=True)


def test_a_trace_failure_the_model_does_not_share_stays_a_refusal():
    """The head's output written in place: the trace gives it as zeros that take no memory
    (shape only), which cannot be written; the model itself runs, so the refusal stays."""
    Net = _net()

    class Writes(Net):
        def forward(self, x, labels=None):
            out = super().forward(x)
            out[..., 0] = 0
            return out

    model = Writes().eval()
    calibrate(model, _batches(), "w8a8", progress=False)
    with pytest.raises(NotAChain, match="forward failed after block layers.2"):
        calibrate(model, _batches(), "w8a8", progress=False, sequential=True)


# ---------------------------------------------------------------- 5. checkpoint= unread
@pytest.mark.parametrize("device", [None, "cpu"])
def test_a_checkpoint_with_the_weights_in_memory_is_warned_about(tmp_path, device):
    Net = _net()
    model, other = Net().eval(), Net().eval()
    path = _save(other, tmp_path / "other")
    with pytest.warns(UserWarning, match=r"checkpoint='.*other' is not read: every parameter "
                                         r"of the model is already in memory") as ws:
        seq = calibrate(model, _batches(), "w8a8", progress=False,
                        sequential=Sequential(checkpoint=path, device=device))
    said = [str(w.message) for w in ws if "is not read" in str(w.message)]
    assert len(said) == 1 and "empty_model(" in said[0]
    assert ("device=cpu moves nothing" in said[0]) == (device is not None)
    assert_same_qparams(calibrate(model, _batches(), "w8a8", progress=False), seq)  # its own weights


def test_a_skeleton_reads_its_checkpoint_without_that_warning(tmp_path):
    Net = _net()
    model = Net().eval()
    path = _save(model, tmp_path / "ckpt")
    with torch.device("meta"):
        skeleton = Net().eval()
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        seq = calibrate(skeleton, _batches(), "w8a8", progress=False,
                        sequential=Sequential(checkpoint=path))
    assert not [w for w in ws if "is not read" in str(w.message)]
    assert_same_qparams(calibrate(model, _batches(), "w8a8", progress=False), seq)


# ---------------------------------------------------------------- KV cache beside partial rules
def test_kv_cache_of_blocks_the_rules_leave_out_is_calibrated_as_whole():
    """Rules that take one block only: every block's KV cache is still calibrated, bitwise
    the whole-model pass (a block whose rules take nothing runs the KV cache alone)."""
    from tiny_models import llama

    from quantscope.calibration import preset

    recipe = preset("w8a8", targets=["re:model.layers.0.*"], kv_cache="fp8")
    runs = []
    for seq in (None, True):
        model, batches = llama()
        runs.append(calibrate(model, batches, recipe, progress=False, sequential=seq))
    whole, seq = runs
    kv = [n for n, roles in whole.states.items() if "key" in roles]
    assert kv == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert_same_qparams(whole, seq)


def test_a_misspelt_target_with_a_kv_cache_is_refused_sequentially_too():
    from tiny_models import llama

    from quantscope.calibration import preset

    model, batches = llama()
    forwards = []  # refused before any block runs (it was after the whole pass)
    model.model.embed_tokens.register_forward_hook(lambda *_: forwards.append(1))
    with pytest.raises(ValueError, match=r"no module matches targets \['Lineer'\]"):
        calibrate(model, batches, preset("w8a8", targets=["Lineer"], kv_cache="fp8"),
                  progress=False, sequential=True)
    assert forwards == []


@pytest.mark.parametrize("kv", [None, "fp8"])
@pytest.mark.parametrize("ignore", [(), ("re:.*self_attn.*", r"re:.*mlp\.gate$")])
def test_packed_moe_experts_a_block_holds_are_calibrated_as_whole(kv, ignore):
    """A block whose rules take only packed (3-D) experts: they match once calibrate makes
    their Linear views, so the block is calibrated, bitwise the whole-model pass (it was
    skipped, or with a KV cache run on its KV cache alone)."""
    from tiny_models import mixtral

    from quantscope.calibration import preset

    recipe = preset("w8a8", targets=["re:.*experts.*", "lm_head"], kv_cache=kv,
                    ignore=list(ignore))
    runs = []
    for seq in (None, True):
        model, batches = mixtral()
        runs.append(calibrate(model, batches, recipe, progress=False, sequential=seq))
    whole, seq = runs
    assert sum("experts" in layer for layer in whole.states) == 16
    assert_same_qparams(whole, seq)


def test_targets_only_moe_experts_match_as_views_before_the_first_block():
    """The up-front match sees the experts as Linear views (moe.attach): a recipe taking only
    experts is not a misspelt target."""
    from tiny_models import mixtral

    from quantscope.calibration import preset

    recipe = preset("w8a8", targets=["re:.*experts.*"])
    runs = []
    for seq in (None, True):
        model, batches = mixtral()
        runs.append(calibrate(model, batches, recipe, progress=False, sequential=seq))
    whole, seq = runs
    assert whole.states and all("experts" in n for n in whole.states)
    assert_same_qparams(whole, seq)
