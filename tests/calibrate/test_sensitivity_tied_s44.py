"""``quantscope.sensitivity`` with a tied embedding / lm_head, both in the recipe (probe
s44): each holder's row was measured alone, apply() warning twice that the other module ran
the weight quantized "though the calibration and its report do not cover them" (they were
covered: two report rows, two states), and the two rows were one measurement of one tensor
twice. The tensor is now measured once, with every covered holder's state (what
``calibration.apply`` runs), its rows share that divergence, ``info["tied"]`` and the table
say so, and no coverage warning comes where the calibration covers the other holder."""

import warnings

import pytest
import torch

import quantscope

pytest.importorskip("transformers")
import transformers

torch.set_num_threads(1)

_PAIR = ["lm_head", "model.embed_tokens"]


def _tied_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=100, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    g = torch.Generator().manual_seed(1)
    return model, [torch.randint(0, 100, (2, 16), generator=g) for _ in range(2)]


def _kl(ref: torch.Tensor, q: torch.Tensor) -> float:
    """Mean over positions of KL(p_ref || p_q), in float64."""
    r, s = (torch.log_softmax(t.reshape(-1, t.shape[-1]).double(), -1) for t in (ref, q))
    return float((r.exp() * (r - s)).sum(-1).mean())


def _by_hand(model, batches) -> float:
    """The divergence with the tied weight int8-quantized per row (scale 2 max|W| / 255),
    both holders reading it: the mean over batches of the next-token KL."""
    with torch.no_grad():
        w = model.lm_head.weight
        ref = [model(b).logits for b in batches]
        float_w = w.detach().clone()
        scale = (2 * w.abs().amax(1, keepdim=True) / 255)
        w.copy_((w / scale).round().clamp(-128, 127) * scale)
        try:
            q = [model(b).logits for b in batches]
        finally:
            w.copy_(float_w)
    return sum(_kl(a, b) for a, b in zip(ref, q)) / len(batches)


def test_a_tied_pair_in_the_recipe_is_measured_once_without_a_coverage_warning():
    model, batches = _tied_llama()
    recipe = quantscope.calibrate.preset("w8a8", targets=["Linear", "Embedding"])
    calib = quantscope.calibrate(model, batches, recipe, progress=False)
    assert {r["layer"] for r in calib.report().rows if r["role"] == "weight"} >= set(_PAIR)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        sens = quantscope.sensitivity(model, batches, calibration=calib)
    assert not [str(w.message) for w in said if "do not cover them" in str(w.message)]
    rows = {r["layer"]: r for r in sens.rows if r["role"] == "weight" and r["layer"] in _PAIR}
    assert sorted(rows) == _PAIR
    assert rows["lm_head"]["divergence"] == rows["model.embed_tokens"]["divergence"]
    assert rows["lm_head"]["divergence"] == pytest.approx(_by_hand(model, batches), rel=1e-4)
    assert sens.info["tied"] == [_PAIR]
    # one forward per batch for the float reference and for each tensor, the pair once
    assert sens.info["forwards"] == len(batches) * len(sens.rows)
    assert "lm_head = model.embed_tokens" in sens.to_markdown()


def test_a_holder_the_calibration_does_not_cover_is_still_named():
    # only lm_head is targeted: the embedding runs its weight quantized too, uncovered (as
    # calibration.apply warns), and lm_head's row measures the tensor alone
    model, batches = _tied_llama()
    calib = quantscope.calibrate(model, batches, "w8a8", progress=False)
    assert "model.embed_tokens" not in calib.states
    with pytest.warns(UserWarning, match=r"lm_head.weight is also the weight of "
                                         r"\['model.embed_tokens'\] .* do not cover them"):
        sens = quantscope.sensitivity(model, batches, calibration=calib, roles=("weight",))
    assert sens.info["tied"] == []
    (row,) = [r for r in sens.rows if r["layer"] == "lm_head"]
    assert row["divergence"] == pytest.approx(_by_hand(model, batches), rel=1e-4)
    assert "measured once" not in sens.to_markdown()
