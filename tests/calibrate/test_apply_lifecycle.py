"""A QDQ handle over the model's life: cast after apply, deepcopied, calibrated again."""

import copy
import io
import warnings

import pytest
import torch
from torch import nn

from quantscope.calibration import Recipe, calibrate, sensitivity

transformers = pytest.importorskip("transformers")

from tiny_models import llama, mixtral


def dense(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 32, generator=g) for _ in range(3)]


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(model, snap):
    sd = model.state_dict()
    return sd.keys() == snap.keys() and all(torch.equal(sd[k], snap[k]) for k in snap)


@pytest.fixture(scope="module")
def moe_calib():
    model, data = mixtral()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return calibrate(model, data, "w8a8", progress=False), data


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_remove_after_a_cast_restores_the_experts_3d_weights(moe_calib, dtype):
    """The 3-D expert parameters, QDQ'd through per-expert views, come back as the float
    model cast to ``dtype`` (``.to()`` had given the views storage of their own)."""
    calib, _ = moe_calib
    model, _ = mixtral()
    want = {k: v.to(dtype) for k, v in snapshot(model).items()}
    experts = model.model.layers[0].mlp.experts
    handle = calib.apply(model)
    assert not torch.equal(experts.down_proj.to(dtype), want["model.layers.0.mlp.experts.down_proj"])
    model.to(dtype)
    handle.remove()
    assert same(model, want)


def test_remove_restores_the_parameters_a_cast_replaced():
    """Under torch's overwrite-on-conversion flag ``.to()`` puts new Parameters in the model:
    remove() restores those, not the ones apply saw."""
    model = dense()
    calib = calibrate(model, batches(), "w8a8", progress=False)
    want = {k: v.to(torch.bfloat16) for k, v in snapshot(model).items()}
    was = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        handle = calib.apply(model)
        before = model[0].weight
        model.to(torch.bfloat16)
        assert model[0].weight is not before
        handle.remove()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(was)
    assert same(model, want)


class TiedLM(nn.Module):
    """An embedding and an lm_head holding one weight Parameter."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.l1 = nn.Embedding(16, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.l1(self.emb(x)))


@pytest.mark.parametrize("overwrite", [True, False])
def test_remove_after_a_cast_restores_every_holder_of_a_tied_weight(overwrite):
    """A cast under the overwrite-on-conversion flag gives the embedding and the lm_head a
    Parameter each (the tie splits): remove() restores both to the float weight cast to
    bfloat16; without the flag the tie holds and its one Parameter is restored."""
    model, x = TiedLM(), torch.randint(0, 16, (2, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tied lm_head warning
        calib = calibrate(model, [x], "w8a8", progress=False)
    want = model.emb.weight.detach().clone().to(torch.bfloat16)
    others = {k: v.to(torch.bfloat16) for k, v in snapshot(model.l1).items()}
    was = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            handle = calib.apply(model)
        assert not torch.equal(model.emb.weight.to(torch.bfloat16), want)  # QDQ'd
        model.to(torch.bfloat16)
        assert (model.head.weight is model.emb.weight) is not overwrite
        handle.remove()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(was)
    assert torch.equal(model.emb.weight, want)
    assert torch.equal(model.head.weight, want)
    assert same(model.l1, others)


def test_a_deepcopy_of_a_dense_applied_model_has_its_own_handle():
    model, x = dense(), batches()[0]
    calib = calibrate(model, batches(), "w8a8", progress=False)
    float_snap, y_float = snapshot(model), model(x)
    handle = calib.apply(model)
    y_q, q_snap = model(x), snapshot(model)
    dup = copy.deepcopy(model)
    assert torch.equal(dup(x), y_q)  # the same QDQ, weights and activation hooks
    outer = calibrate(nn.Sequential(dense()), batches(), "w8a8", progress=False)
    with pytest.raises(ValueError, match=r"0\.0\.weight is already fake-quantized by another"):
        outer.apply(nn.Sequential(dup))  # the copy's weights are held by the copy's handle
    dup._quantscope_qdq.remove()
    assert same(dup, float_snap) and torch.equal(dup(x), y_float)
    assert same(model, q_snap) and torch.equal(model(x), y_q)  # the original still applied
    handle.remove()
    assert same(model, float_snap)


def _saved_and_loaded(model):
    f = io.BytesIO()
    torch.save(model, f)
    f.seek(0)
    return torch.load(f, weights_only=False)


def test_an_applied_model_saved_whole_loads_applied_with_its_own_handle():
    """torch.save of a model with activation QDQ failed on a hook closure ("Can't pickle
    local object"); a weight-only one loaded with a handle not tracked as applied, so
    apply() over its weights was not refused."""
    model, x = dense(), batches()[0]
    calib = calibrate(model, batches(), "w8a8", progress=False)
    float_snap, y_float = snapshot(model), model(x)
    with calib.apply(model):
        y_q = model(x)
        loaded = _saved_and_loaded(model)
    assert torch.equal(loaded(x), y_q)  # QDQ'd weights and the input hooks
    outer = calibrate(nn.Sequential(dense()), batches(), "w8a8", progress=False)
    with pytest.raises(ValueError, match=r"0\.0\.weight is already fake-quantized by another"):
        outer.apply(nn.Sequential(loaded))
    loaded._quantscope_qdq.remove()
    assert same(loaded, float_snap) and torch.equal(loaded(x), y_float)


def test_a_deepcopy_of_an_applied_moe_model_is_refused(moe_calib):
    calib, data = moe_calib
    model, _ = mixtral()
    snap = snapshot(model)
    with calib.apply(model), torch.no_grad():
        y_q = model(data[0]).logits
        with pytest.raises(TypeError, match=r"deepcopy: .*MoE experts.*copy the model before "
                                            r"apply\(\) or after remove\(\)"):
            copy.deepcopy(model)
        assert torch.equal(model(data[0]).logits, y_q)  # the original still applied
        # probe s58: pickling met the views' closures first ("Can't pickle local object")
        for layer in model.model.layers:  # (the test's starving hooks: closures of its own)
            layer.mlp.gate._forward_hooks.clear()
        with pytest.raises(TypeError, match=r"pickle \(torch\.save\): .*MoE experts"):
            torch.save(model, io.BytesIO())
    assert same(model, snap)
    copy.deepcopy(model)  # after remove(): a plain model
    torch.save(model, io.BytesIO())


def test_experts_an_applied_model_lends_another_are_not_fingerprinted(moe_calib):
    """A second model holding the applied model's 3-D experts Parameters holds their
    fake-quantized values: check_model compares no fingerprint of those slices (their bits
    are the QDQ's, not another model's weights), as for the applied model's own."""
    calib, _ = moe_calib
    model, _ = mixtral()
    twin, _ = mixtral()  # the same float weights
    with calib.apply(model):
        for mine, theirs in zip(model.model.layers, twin.model.layers):
            theirs.mlp.experts.gate_up_proj = mine.mlp.experts.gate_up_proj
        calib.check_model(twin, "apply")


def test_a_deepcopy_of_a_model_with_kv_cache_qdq_is_refused():
    model, data = llama()
    calib = calibrate(model, data, Recipe((), kv_cache="fp8"), progress=False)
    with torch.no_grad():
        y_float = model(data[0]).logits
        with calib.apply(model):
            y_q = model(data[0]).logits
            with pytest.raises(TypeError, match=r"KV cache.*then apply the calibration to the "
                                                r"copy"):
                copy.deepcopy(model)
            with pytest.raises(TypeError, match=r"pickle \(torch.save\): .*KV cache"):
                _saved_and_loaded(model)
            assert torch.equal(model(data[0]).logits, y_q)
        assert not torch.equal(y_q, y_float)  # the KV QDQ did something
        assert torch.equal(model(data[0]).logits, y_float)


def test_calibrate_refuses_an_applied_model():
    """Its observers would see the fake-quantized weights and activations."""
    model = dense()
    calib = calibrate(model, batches(), "w8a8", progress=False)
    with calib.apply(model):
        for target in (model, model[0], nn.Sequential(model)):  # nested either way
            with pytest.raises(ValueError, match=r"calibrate: the model has quantscope QDQ "
                                                 r"applied \(calibration.apply\); remove\(\)"):
                calibrate(target, batches(), "w8a8", progress=False)
        with pytest.raises(ValueError, match=r"sensitivity: the model has quantscope QDQ"):
            sensitivity(model, batches(), "w8a8")
    calibrate(model, batches(), "w8a8", progress=False)  # after remove()


def test_an_applied_moe_state_dict_loads_strictly_into_a_fresh_model(moe_calib):
    """The per-expert views are left out of ``state_dict``: the 3-D parameters hold them."""
    calib, _ = moe_calib
    model, _ = mixtral()
    keys = set(model.state_dict())
    with calib.apply(model):
        sd = model.state_dict()
        assert set(sd) == keys
        fresh, _ = mixtral(seed=1)
        fresh.load_state_dict(sd, strict=True)
        assert same(fresh, sd)
        view = model.model.layers[0].mlp.experts._modules["1"].gate_up_proj.weight
        assert torch.equal(fresh.model.layers[0].mlp.experts.gate_up_proj[1], view)  # QDQ'd


def test_apply_and_remove_inside_autocast_see_the_weights_they_wrote():
    """Autocast caches its casts of the weights a forward read: apply() and remove() write
    the weights in place, so the forwards after each, in the same region, must see them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 16))
    x = torch.randn(4, 128)
    calib = calibrate(model, [x], "w4a16", progress=False)  # weights only: groups of 128
    with torch.autocast("cpu", torch.bfloat16), torch.no_grad():
        before = model(x)
        with calib.apply(model):
            quantized = model(x)
            fresh = copy.deepcopy(model)(x)  # its own weights: no cast cached
        after = model(x)
        float_again = copy.deepcopy(model)(x)
    assert torch.equal(quantized, fresh) and not torch.equal(quantized, before)
    assert torch.equal(after, float_again)


def _marked(model):
    return [n for n, m in model.named_modules() if "_quantscope_qdq_part" in m.__dict__]


def test_inference_tensor_weights_are_written_only_in_inference_mode():
    # probe s40: apply() outside inference mode raised torch's error naming no layer, and its
    # cleanup failed too, leaving the modules marked: calibrate() and apply() then refused the
    # model for good ("QDQ applied by another apply()"); remove() outside inference mode took
    # the hooks off and then failed, leaving the weights fake-quantized
    with torch.inference_mode():
        model = dense()
    data, float_model = batches(), snapshot(model)
    calib = calibrate(model, data, "w8a8", progress=False)
    with pytest.raises(ValueError, match=r"apply: 0\.weight is an inference tensor .* call "
                                         r"apply\(\) inside torch\.inference_mode\(\)"):
        calib.apply(model)
    assert same(model, float_model) and not _marked(model)
    calibrate(model, data, "w8a8", progress=False)  # not refused
    with torch.inference_mode():
        handle = calib.apply(model)
        quantized = model(data[0])
    with pytest.raises(ValueError, match=r"remove: 0\.weight is an inference tensor .* call "
                                         r"remove\(\) in inference mode"):
        handle.remove()
    with torch.inference_mode():  # all or nothing: still applied, so still quantizing
        assert handle.active and torch.equal(model(data[0]), quantized)
        handle.remove()
    assert same(model, float_model) and not _marked(model)
