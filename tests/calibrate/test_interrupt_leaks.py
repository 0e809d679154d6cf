"""What an interrupted attach or a dropped QDQ handle leaves behind: nothing.

* A ``KeyboardInterrupt`` (Ctrl-C) while :func:`moe.attach` gives an experts module its
  per-expert views leaves the model exactly as it was, and calibratable.
* A KV-cache QDQ applied and never removed goes with its model: the attention routing
  registry (``kv_cache._ACTIVE``) keeps no entry for a dead module.
"""

import gc
import weakref

import pytest
import torch

from quantscope.calibration import calibrate, preset
from quantscope.calibration.structure import kv_cache, moe

transformers = pytest.importorskip("transformers")

from tiny_models import mixtral


def _layout(model):
    """Everything attach may add: modules, state_dict keys, quantscope marks, forwards and
    state_dict hooks set on a module."""
    return ([n for n, _ in model.named_modules()], sorted(model.state_dict()),
            [n for n, m in model.named_modules() if "_quantscope_expert" in vars(m)],
            [n for n, m in model.named_modules() if "forward" in vars(m)],
            sum(len(m._state_dict_hooks) for m in model.modules()))


def _interrupt_second(monkeypatch, name):
    """``moe.<name>`` raising KeyboardInterrupt on its 2nd call, as Ctrl-C would."""
    orig, calls = getattr(moe, name), []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return orig(*args, **kwargs)
    monkeypatch.setattr(moe, name, interrupted)


# Expert: while the 2nd expert's views are built; DropViews: after every view and the
# routed forward of the 2nd experts module are in place, before its state_dict hook
@pytest.mark.parametrize("where", ["Expert", "DropViews"])
def test_ctrl_c_while_attaching_expert_views_leaves_the_model_as_it_was(monkeypatch, where):
    model, batches = mixtral()
    before = _layout(model)
    _interrupt_second(monkeypatch, where)
    with pytest.raises(KeyboardInterrupt):
        calibrate(model, batches, "w8a8", progress=False)
    monkeypatch.undo()
    assert _layout(model) == before
    # and it calibrates as a model never interrupted
    got = calibrate(model, batches, "w8a8", progress=False)
    fresh, _ = mixtral()
    want = calibrate(fresh, batches, "w8a8", progress=False)
    assert got.states.keys() == want.states.keys()
    assert any(".experts.1.down_proj" in k for k in got.states)
    for layer, roles in want.states.items():
        for role, state in roles.items():
            assert torch.equal(got.states[layer][role].qparams.scale, state.qparams.scale), \
                (layer, role)


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    model = transformers.LlamaForCausalLM(cfg).eval()
    return model, [torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(i))
                   for i in range(2)]


def test_a_kv_qdq_dropped_without_remove_leaves_no_registry_entry():
    gc.collect()
    size = len(kv_cache._ACTIVE)
    refs = []
    for _ in range(3):
        model, batches = _llama()
        calib = calibrate(model, batches, preset("w8a8", kv_cache="fp8"), progress=False)
        handle = calib.apply(model)
        with torch.no_grad():
            model(batches[0])
        assert len(kv_cache._ACTIVE) == size + 2  # one per attention layer, while it lives
        refs.append(weakref.ref(model))
        del model, calib, handle
        gc.collect()
    assert [r() for r in refs] == [None] * 3
    assert len(kv_cache._ACTIVE) == size


def test_a_live_kv_qdq_runs_and_remove_empties_the_registry():
    model, batches = _llama()
    calib = calibrate(model, batches, preset("fp8-kv"), progress=False)
    size = len(kv_cache._ACTIVE)
    attn = model.model.layers[0].self_attn
    seen = []
    with torch.no_grad():
        ref = model(batches[0]).logits
        with calib.apply(model):
            gc.collect()  # a live model keeps its entries
            qdq = kv_cache._ACTIVE[attn]

            def spy(role, x):
                seen.append(role)
                return qdq(role, x)
            kv_cache._ACTIVE[attn] = spy
            got = model(batches[0]).logits
        assert seen == ["key", "value"]
        assert not torch.equal(got, ref)  # the fp8 KV QDQ ran
        assert len(kv_cache._ACTIVE) == size
        torch.testing.assert_close(model(batches[0]).logits, ref, rtol=0, atol=0)
