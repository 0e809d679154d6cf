"""Output-aware choices, as a probe found them: auto's float references per batch, KL with
a banned token, keep_float's arguments, and ``==`` on calibrations."""

import pytest
import tiny_models
import torch

import quantscope
from quantscope.calibration import Calibration
from quantscope.calibration.choice.auto import _divergence
from quantscope.calibration.choice.loss_checks import finite
from quantscope.calibration.choice.sensitivity import keep_float, layer_sensitivity


def test_auto_scores_each_batch_against_its_own_float_output():
    """One attention mask shared by every batch and first in each dict: the batches were told
    apart by their first tensor, so every piece was scored against one batch's float logits
    (the scores 1000x off, and another observer chosen)."""
    model, _ = tiny_models.llama()
    mask = torch.ones(2, 12, dtype=torch.long)
    ids = [torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(i))
           for i in range(3)]
    shared_first = [{"attention_mask": mask, "input_ids": x} for x in ids]
    own_first = [{"input_ids": x, "attention_mask": mask} for x in ids]
    scores = [quantscope.calibrate(model, b, "w8a8", observer="auto", progress=False)
              .info["auto"]["scores"] for b in (shared_first, own_first)]
    assert scores[0] == scores[1]


def test_kl_of_a_banned_token_is_zero_not_nan():
    """A -inf logit is a probability of 0: 0 log 0 = 0 (it gave 0 * (-inf - -inf) = NaN,
    and auto / sensitivity refused the batch)."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(5, 11, generator=g)
    q = ref + 0.1 * torch.randn(5, 11, generator=g)
    ref[:, 0] = q[:, 0] = float("-inf")
    r, lq = ref.double().log_softmax(-1), q.double().log_softmax(-1)
    want = torch.nn.functional.kl_div(lq[:, 1:], r[:, 1:], log_target=True,
                                      reduction="none").sum(-1).mean()
    assert _divergence("kl", q, ref) == pytest.approx(float(want), rel=1e-12)


def test_auto_takes_a_model_that_bans_a_token():
    model, batches = tiny_models.llama()

    def ban(module, args, out):
        out = out.clone()
        out[..., 0] = float("-inf")
        return out

    model.lm_head.register_forward_hook(ban)
    calib = quantscope.calibrate(model, batches, "w8a8", observer="auto", progress=False)
    assert all(torch.isfinite(torch.tensor(v)) for v in calib.info["auto"]["scores"].values())


@pytest.fixture(scope="module")
def ranked():
    model, batches = tiny_models.llama()
    calib = quantscope.calibrate(model, batches, "w8a8", progress=False)
    return calib, layer_sensitivity(model, batches[:1], calib, roles=("weight",))


def test_keep_float_refuses_a_bool_and_says_when_it_keeps_fewer(ranked):
    calib, weights_only = ranked
    with pytest.raises(ValueError, match="keep_float: n must be a non-negative integer"):
        keep_float(calib, weights_only, True)
    with pytest.warns(UserWarning, match="2 activations asked for, 0 kept float"):
        kept = keep_float(calib, weights_only, 2)
    assert kept.info["keep_float"]["tensors"] == []


def test_calibrations_compare_without_error(ranked):
    calib, _ = ranked
    copy = Calibration(**{k: getattr(calib, k) for k in (
        "recipe", "states", "label", "stats", "histograms", "info", "smoothing")})
    assert (copy == calib) is False  # identity (no tensor truth value); quantizes_like compares
    assert copy.quantizes_like(calib)


@pytest.mark.parametrize("value,want", [(complex(1.0, 2.0), True),
                                        (complex(float("nan"), 0.0), False)],
                         ids=["finite", "nan"])
def test_a_complex_output_is_judged_with_and_without_logits(value, want):
    """``finite`` judges complex tensors (auto checks a model's output so, before a user's
    ``loss``): with ``logits`` (-inf allowed in real logits) it raised torch's "isposinf does
    not support complex inputs" instead of answering as it does without."""
    out = torch.tensor([value])
    assert finite(out) is want
    assert finite(out, logits=True) is want
