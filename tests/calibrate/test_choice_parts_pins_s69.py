"""Pins from the s69 mutation round over ``calibration/choice`` (``candidates``, ``ranking``,
``references``, ``loss_checks``): which candidates a role refuses and why (a dynamic role
none), the order ``expand`` keeps, the ``auto`` options and warnings ``check_options`` gives,
``count_arg``'s int and ``Sensitivity.to_markdown``'s heading and file, an output summary's
copy and a tuple output's, the float references ``FloatOutputs`` catches for each scoring
piece, and what auto's loss checks say of complex values and return. Behaviour no earlier test
held; expected values come from the docstrings, not from the code's output."""

from __future__ import annotations

import types
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from quantscope import QuantSpec
from quantscope.calibration.choice import candidates
from quantscope.calibration.choice.loss_checks import scalar
from quantscope.calibration.choice.ranking import Sensitivity, count_arg
from quantscope.calibration.choice.references import FloatOutputs, summary
from quantscope.calibration.recipe import Recipe, Role, Rule

SYM, ASYM = QuantSpec("int8"), QuantSpec("int8", symmetric=False)


def _recipe(weight=None, input=None):
    return Recipe(rules=(Rule(targets=("Linear",), weight=weight, input=input),))


def _rows(*specs):
    return [{"rank": k, "layer": layer, "role": role, "observer": "minmax", "divergence": d}
            for k, (layer, role, d) in enumerate(specs, 1)]


# ------------------------------------------------------------------------------ candidates


def test_refusals_give_each_candidate_its_first_reason_and_take_a_type_error():
    """A candidate refused by several keys keeps the reason of the first; an observer that
    cannot be made for an unknown option (``TypeError``) is a refusal too; one that is made
    is not in the result."""
    asym = ("linear_mse", ASYM, ())  # searches symmetric ranges only
    bogus = ("minmax", SYM, (("bogus", 1),))
    out = candidates.refusals([("a", asym), ("a", bogus), ("b", bogus),
                               ("c", ("minmax", SYM, ()))])
    assert set(out) == {"a", "b"}
    assert out["a"].startswith("observer 'linear_mse'") and "symmetric" in out["a"]
    assert out["b"].startswith("observer 'minmax'") and "bogus" in out["b"]


def test_a_weight_option_only_the_candidates_own_observer_takes_is_refused():
    """An ``auto`` weight runs the candidate's weight variant (``minmax``:
    ``memoryless_minmax``, no moving average): ``averaging_constant`` is taken by none."""
    recipe = _recipe(weight=Role(SYM, "auto", options={"averaging_constant": 0.1}))
    with pytest.raises(ValueError, match=r"option\(s\) \['averaging_constant'\] taken by none"):
        candidates.check_options(recipe, "r", ["minmax"], per_layer=True)
    as_input = _recipe(input=Role(SYM, "auto", options={"averaging_constant": 0.1}))
    candidates.check_options(as_input, "r", ["minmax"], per_layer=True)  # minmax takes it


@pytest.mark.parametrize("weight,per_layer,warned", [
    (SYM, True, False),  # linear_mse runs on the symmetric weight
    (ASYM, True, True),  # refused by every auto role
    (ASYM, False, False),  # metric "model" drops and records it itself
], ids=["one-role-runs-it", "every-role-refuses", "model-metric"])
def test_check_options_warns_of_a_candidate_only_every_auto_role_refuses(weight, per_layer,
                                                                        warned):
    recipe = _recipe(Role(weight, "auto"), Role(ASYM, "auto"))
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        candidates.check_options(recipe, "r", ["minmax", "linear_mse"], per_layer=per_layer)
    said = [str(w.message) for w in got]
    assert len(said) == warned and all("['linear_mse']" in s for s in said), said


def test_a_dynamic_auto_role_neither_refuses_a_candidate_nor_has_its_options_checked():
    """A run-time (``dynamic=True``) input is observed by no candidate: ``linear_mse`` is not
    refused for its asymmetric spec, and its options are not checked against the candidates."""
    model = nn.Sequential(nn.Linear(4, 4))
    recipe = _recipe(Role(SYM, "auto"), Role(ASYM, "auto", dynamic=True))
    assert candidates.refused_by_model(model, recipe, ["minmax", "linear_mse"]) == {}
    loose = _recipe(Role(SYM, "auto"), Role(SYM, "auto", dynamic=True, options={"bogus": 1}))
    candidates.check_options(loose, "r", ["minmax"], per_layer=True)


def test_expand_keeps_the_candidates_in_the_order_given():
    model = nn.Sequential(nn.Linear(4, 4))
    recipe = _recipe(Role(ASYM, "auto"))
    with pytest.warns(UserWarning, match=r"\['linear_mse'\] cannot run on every role"):
        expanded, kept, refused = candidates.expand(
            model, {"r": recipe}, {"r"}, ["mse", "linear_mse", "minmax"])
    assert kept == {"r": ["mse", "minmax"]} and set(refused["r"]) == {"linear_mse"}
    assert list(expanded) == [("r", "mse"), ("r", "minmax")]


# --------------------------------------------------------------------------------- ranking


def test_count_arg_gives_a_numpy_integer_as_an_int():
    got = count_arg("who", np.int64(2))
    assert got == 2 and type(got) is int


def test_markdown_says_the_seconds_to_one_decimal_and_is_written_to_path(tmp_path):
    sens = Sensitivity(_rows(("a", "weight", 0.5)),
                       {"metric": "kl", "forwards": 3, "seconds": 2.345})
    text = sens.to_markdown(tmp_path / "s.md")
    assert text.startswith("Sensitivity (kl; 3 forwards, 2.3 s)\n\n| rank |")
    assert (tmp_path / "s.md").read_text() == text


# ------------------------------------------------------------------------------ references


def test_logit_summary_is_a_float32_copy():
    """float32 whatever the output's dtype, and a copy: no view of the output kept."""
    logits = torch.randn(3, 5)
    kind, rows = summary({"logits": logits}, None)
    assert kind == "kl" and rows.dtype == torch.float32
    assert rows.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr()
    assert summary({"logits": logits.double()}, None)[1].dtype == torch.float32


def test_a_tuple_output_is_summarised_by_its_first_tensor():
    """A model returning a tuple (``return_dict=False``): its first item, rows normalised."""
    first = torch.tensor([[3.0, 4.0], [0.0, 2.0]])
    kind, rows = summary((first, torch.zeros(2, 7)), None)
    assert kind == "cos"
    torch.testing.assert_close(rows, torch.tensor([[0.6, 0.8], [0.0, 1.0]], dtype=torch.float64))


class _LM(nn.Module):
    """A causal-LM-like output: logits and a last hidden state."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 5)

    def forward(self, input_ids, attention_mask=None):
        h = self.emb(input_ids)
        return types.SimpleNamespace(logits=h * 2, last_hidden_state=h)


def test_float_outputs_catch_each_pieces_logits_once_for_shared_batches():
    """Caught from a keyword forward: each piece's rows of the logits (not the hidden state)
    with its own mask; a second batch of the same tensors gets the same output; a later
    forward of the batch does not replace the float reference caught first."""
    torch.manual_seed(0)
    model = _LM()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 1, 1]])
    batch = {"input_ids": torch.randint(0, 10, (4, 3)), "attention_mask": mask}
    plan = [(0, 0, 1), (0, 1, 4), (1, 0, None)]
    caught = FloatOutputs(model, [batch, dict(batch)], plan)
    with torch.no_grad():
        logits = model(**batch).logits
        model.emb.weight.add_(1.0)
        model(**batch)
    refs = caught.references()
    want = [logits[:1][mask[:1].bool()], logits[1:][mask[1:].bool()], logits[mask.bool()]]
    assert [kind for kind, _ in refs] == ["kl"] * 3
    for (_, got), w in zip(refs, want):
        torch.testing.assert_close(got, w)


# ----------------------------------------------------------------------------- loss_checks


def test_a_complex_loss_is_named_by_its_shape():
    """A one-element complex tensor is no real number: refused as a tensor, as a vector is."""
    with pytest.raises(TypeError, match=r"got a tensor of shape \(1,\)$"):
        scalar("auto", "loss", torch.tensor([1 + 1j]))


def test_scalar_returns_a_float():
    assert type(scalar("auto", "loss", 2)) is float
    assert type(scalar("auto", "loss", torch.tensor(3))) is float
