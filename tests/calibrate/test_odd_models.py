"""Models that hooks or an in-place QDQ would silently get wrong: a ``torch.compile``
wrapper (its cached graphs skip hooks added after it ran) is refused by every entry point
that hooks a model; a weight Parameter shared by two modules (a tied lm_head) is
fake-quantized once, refused where its layers' states disagree, and the modules sharing it
without a state are named."""

import warnings

import pytest
import torch
from torch import nn

from quantscope import QuantSpec
from quantscope.calibration import (
    Recipe,
    Role,
    Rule,
    apply,
    calibrate,
    calibrate_many,
    preset,
    qdq_tensor,
    sensitivity,
)

COMPILED = r"the model is a torch.compile'd module \(OptimizedModule\).*model\._orig_mod"


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 8, generator=g) for _ in range(2)]


def _compiled_and_run(model):
    torch._dynamo.reset()
    cm = torch.compile(model, backend="aot_eager")
    with torch.inference_mode():
        cm(_batches()[0])
    return cm


def test_apply_refuses_a_compiled_model_and_leaves_it_as_it_was():
    """Its graphs would run the QDQ weights without the activation hooks: weight-only QDQ
    while the calibration says w8a8."""
    m = _mlp()
    calib = calibrate(m, _batches(), "w8a8", progress=False)
    cm = _compiled_and_run(m)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ValueError, match="apply: " + COMPILED):
        calib.apply(cm)
    with pytest.raises(ValueError, match="apply: " + COMPILED):
        apply(cm, calib.states)
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    assert not any(hasattr(x, "_quantscope_qdq") for x in (m, cm))


def test_calibrate_entry_points_refuse_a_compiled_model():
    """Run under inference_mode first, its graphs feed no activation to the observers: the
    calibration would fall back to weight-only with a 'saw no tokens' warning alone."""
    cm = _compiled_and_run(_mlp())
    with pytest.raises(ValueError, match="calibrate: " + COMPILED):
        calibrate(cm, _batches(), "w8a8", progress=False)
    with pytest.raises(ValueError, match="calibrate: " + COMPILED):
        calibrate_many(cm, _batches(), ["w8a8", "w4a16"], progress=False)
    with pytest.raises(ValueError, match="sensitivity: " + COMPILED):
        sensitivity(cm, _batches(), "w8a8")


def test_a_compiled_submodule_is_named():
    m = _mlp()
    m[0] = torch.compile(m[0], backend="aot_eager")
    with pytest.raises(ValueError, match=r"calibrate: the submodule '0' is a torch\.compile'd "
                                         r"module .*\(0\._orig_mod\)"):
        calibrate(m, _batches(), "w8a8", progress=False)


def test_the_advice_works_compile_the_wrapped_module_after_apply():
    """Calibrating ``_orig_mod`` and compiling after apply() runs the activation QDQ: the
    compiled output is the eager QDQ model's, not the weight-only one's."""
    m = _mlp()
    cm = _compiled_and_run(m)
    calib = calibrate(cm._orig_mod, _batches(), "w8a8", progress=False)
    x = _batches()[0]
    assert {r for roles in calib.states.values() for r in roles} == {"weight", "input"}
    weights_only = {k: {"weight": v["weight"]} for k, v in calib.states.items()}
    with torch.no_grad():
        with calib.apply(m):
            eager = m(x)
            torch._dynamo.reset()
            compiled = torch.compile(m, backend="aot_eager")(x)
        with apply(m, weights_only):
            eager_weights_only = m(x)
    torch.testing.assert_close(compiled, eager)
    assert not torch.allclose(eager, eager_weights_only)


def test_module_compile_in_place_is_accepted():
    """``model.compile()`` keeps calling the hooks: not refused, its activations observed."""
    m = _mlp()
    m.compile(backend="aot_eager")
    with torch.inference_mode():
        m(_batches()[0])
    calib = calibrate(m, _batches(), "w8a8", progress=False)
    assert {layer: sorted(r) for layer, r in calib.states.items()} == {
        "0": ["input", "weight"], "2": ["input", "weight"]}


class Tied(nn.Module):
    """An embedding and an lm_head holding one Parameter (``tie_word_embeddings=True``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 32)
        self.lm_head = nn.Linear(32, 64, bias=False)
        self.lm_head.weight = self.emb.weight

    def forward(self, ids):
        return self.lm_head(self.emb(ids))


def _ids():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 64, (2, 6), generator=g) for _ in range(2)]


def _two_rules(emb_format, head_format):
    def role(fmt):
        return Role(QuantSpec(fmt, "channel"), "memoryless_minmax")

    return Recipe((Rule(("Embedding",), weight=role(emb_format)),
                   Rule(("lm_head",), weight=role(head_format))), name="tied")


def test_tied_weight_with_two_different_states_is_refused():
    """QDQ once per state would compound (int4 of the int8 QDQ), matching neither state nor
    the report; nothing is left applied."""
    m = Tied().eval()
    w = m.emb.weight.detach().clone()
    with pytest.raises(ValueError, match=r"calibrate: recipe 'tied': emb\.weight and lm_head\."
                                         r"weight are one weight .* weight roles differ"):
        calibrate(m, _ids(), _two_rules("int8", "int4"), progress=False)  # before any pass
    untied = Tied().eval()  # states made apart reach apply only from a model untied
    untied.lm_head.weight = nn.Parameter(untied.emb.weight.detach().clone())
    calib = calibrate(untied, _ids(), _two_rules("int8", "int4"), progress=False)
    with pytest.raises(ValueError, match=r"apply: emb\.weight and lm_head\.weight are one weight "
                                         r"\(a tied Parameter.*different weight qparams .*untie"):
        calib.apply(m)
    assert torch.equal(m.emb.weight, w)
    assert not hasattr(m, "_quantscope_qdq")


def test_tied_weight_with_alike_states_is_quantized_once_and_restored():
    m = Tied().eval()
    w = m.emb.weight.detach().clone()
    calib = calibrate(m, _ids(), _two_rules("int4", "int4"), progress=False)
    st = calib.states["lm_head"]["weight"]
    assert st.quantizes_like(calib.states["emb"]["weight"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # both owners have a state: nothing to warn about
        with calib.apply(m):
            assert torch.equal(m.lm_head.weight, qdq_tensor(w, st))
    assert torch.equal(m.emb.weight, w)


def test_tied_owner_without_a_state_is_named_once():
    """Only lm_head is targeted (w8a8 takes Linear): the embedding reads the same Parameter,
    so it runs fake-quantized too, which the calibration does not describe."""
    m = Tied().eval()
    w = m.emb.weight.detach().clone()
    calib = calibrate(m, _ids(), preset("w8a8"), progress=False)
    assert list(calib.states) == ["lm_head"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with calib.apply(m):
            assert torch.equal(m.emb.weight, qdq_tensor(w, calib.states["lm_head"]["weight"]))
    tied = [x for x in caught if "tied" in str(x.message)]
    assert len(tied) == 1
    assert "lm_head.weight is also the weight of ['emb']" in str(tied[0].message)
    assert tied[0].filename == __file__  # the warning points at the caller's line
    assert torch.equal(m.emb.weight, w)


def test_tied_llama_embedding_and_lm_head_with_two_states_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    m = LlamaForCausalLM(cfg).eval()
    assert m.lm_head.weight is m.model.embed_tokens.weight
    batches = [{"input_ids": ids} for ids in _ids()]
    with pytest.raises(ValueError, match=r"calibrate: recipe 'tied': model\.embed_tokens\.weight "
                                         r"and lm_head\.weight are one weight \(a tied "
                                         r"Parameter"):
        calibrate(m, batches, _two_rules("int8", "int4"), progress=False)


def test_one_module_under_two_names_is_not_tied():
    """A module registered twice (``self.again = self.block``) shares its weight with itself
    only: applying warns of no tie (it named the alias as another holder)."""

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Linear(16, 16)
            self.again = self.block

        def forward(self, x):
            return self.again(torch.relu(self.block(x)))

    m = Twice().eval()
    cal = calibrate(m, [torch.randn(4, 16) for _ in range(2)], "w8a8", progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handle = cal.apply(m)
    handle.remove()
