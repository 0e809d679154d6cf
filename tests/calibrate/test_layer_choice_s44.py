"""Per-layer ``auto`` metrics ``"joint"`` / ``"fisher"`` (layer_choice.py): probe fixes of s44."""

from __future__ import annotations

import pytest
import torch
from tiny_models import Sqrt
from torch import nn

import quantscope
from quantscope.calibration import Auto, calibrate_many, preset
from quantscope.calibration.choice import layer_choice
from quantscope.calibration.choice.layer_choice import JOINT_ROWS, fisher_weights, joint_choice
from quantscope.calibration.results.apply import qdq_tensor
from quantscope.calibration.results.result import RoleState
from quantscope.qparams import qparams_from_range
from quantscope.spec import QuantSpec

_CANDIDATES = ("minmax", "mse", "percentile", "mix")


def test_spread_rows_takes_every_batchs_share_evenly():
    from quantscope.calibration.choice.layer_choice import spread_rows

    x = torch.arange(10.0).unsqueeze(1)
    assert spread_rows(x, 5).flatten().tolist() == [0, 2, 4, 6, 8]
    assert spread_rows(x, 4).flatten().tolist() == [0, 2, 5, 7]  # floor(i * 10 / 4)
    assert spread_rows(x, 10) is x and spread_rows(x, 16) is x


def test_joint_prices_the_inputs_on_every_batch_not_the_first_alone():
    # probing (s44): the sample holds rows in batch order and the joint error read its first
    # JOINT_ROWS, here all of batch 0: the input observer best for batch 0 alone was picked,
    # many times worse over the batches; the later batches bring a heavy-tailed channel
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8)).eval()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(JOINT_ROWS, 16, generator=g) for _ in range(2)]
    batches[1][:, 3] = torch.randn(JOINT_ROWS, generator=g) ** 3 * 8
    c = quantscope.calibrate(model, batches, "w8a8", observer="auto", progress=False,
                             auto=Auto(_CANDIDATES, "joint"))
    alone = calibrate_many(model, batches, {n: preset("w8a8", n) for n in _CANDIDATES},
                           progress=False)
    x, w = torch.cat(batches), model[0].weight.detach()
    wq = qdq_tensor(w, c.states["0"]["weight"])

    def error(state):  # the layer's output error over every calibration row
        return float((qdq_tensor(x, state) @ wq.T - x @ w.T).double().square().sum())

    errors = {n: error(alone[n].states["0"]["input"]) for n in _CANDIDATES}
    # priced on a strided half of the rows: near the best over all of them (minmax and mse,
    # batch 0's best, are ~200x worse here)
    assert error(c.states["0"]["input"]) <= 1.1 * min(errors.values()), errors


def _mlp_batches():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)).eval()
    batches = [torch.randn(8, 32) for _ in range(3)]
    batches[1][:, 3] *= 40
    return model, batches


def _square_mean(out, batch):
    return out.float().square().mean()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_fisher_refuses_a_loss_that_is_not_finite_naming_it_and_the_batch(bad):
    # probing (s44): NaN g^2 weights made every joint error NaN and min() kept min-max for
    # every role, without a word
    model, batches = _mlp_batches()
    with pytest.raises(ValueError, match=rf"Auto.loss returned {bad} on batch 0 \(counting "
                                         rf"from 0\), where the model's output is finite"):
        quantscope.calibrate(model, batches, "w8a8", observer="auto", progress=False,
                             auto=Auto(metric="fisher", loss=lambda o, b: _square_mean(o, b) * bad))


def test_fisher_refuses_the_models_own_loss_when_not_finite():
    # a batch without one labelled token: the model's mean next-token loss is 0 / 0
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=64)).eval()
    ids = torch.randint(0, 64, (2, 8))
    mask = torch.zeros_like(ids)
    mask[:, 0] = 1  # one real token a row: nothing to predict
    with pytest.raises(ValueError, match=r"the model's own loss \(the default: no Auto.loss\) "
                                         r"returned nan on batch 0"):
        quantscope.calibrate(model, [{"input_ids": ids, "attention_mask": mask}], "w8a8",
                             observer="auto", auto=Auto(metric="fisher"), progress=False)


def test_fisher_leaves_nan_batches_out_of_the_weights_under_ignore(monkeypatch):
    model, batches = _mlp_batches()
    bad = [b.clone() for b in batches]
    bad[2][0, 3] = float("nan")
    got = fisher_weights(model, bad, ["0", "2"], _square_mean, ignore_non_finite=True)
    want = fisher_weights(model, batches[:2], ["0", "2"], _square_mean)
    assert got.keys() == want.keys() == {"0", "2"}
    assert all(torch.equal(got[k], want[k]) for k in want)
    recipe, auto = preset("w8a8", "auto", non_finite="ignore"), Auto(metric="fisher",
                                                                     loss=_square_mean)
    with pytest.warns(UserWarning, match="ignored"):
        c = quantscope.calibrate(model, bad, recipe, auto=auto, progress=False)
    # the same calibration given the finite batches' weights by hand picks the same states
    monkeypatch.setattr(layer_choice, "fisher_weights", lambda *a, **k: want)
    with pytest.warns(UserWarning, match="ignored"):
        ref = quantscope.calibrate(model, bad, recipe, auto=auto, progress=False)
    assert {(l, r): s.observer for l, rs in c.states.items() for r, s in rs.items()} == {
        (l, r): s.observer for l, rs in ref.states.items() for r, s in rs.items()}
    assert any(s.observer != "minmax" for rs in c.states.values() for s in rs.values())
    for b in bad:
        b[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"every scoring batch \(3\) brought NaN"):
        fisher_weights(model, bad, ["0", "2"], _square_mean, ignore_non_finite=True)


def _mean_squared_grads(model, batches, layer, loss):
    """The fisher weights of ``layer`` written out: d loss / d output by autograd on each batch,
    squared, averaged over all the rows of those batches per output feature."""
    rows, seen = [], []
    h = model.get_submodule(layer).register_forward_hook(lambda m, a, out: seen.append(out))
    for b in batches:
        (g,) = torch.autograd.grad(loss(model(b), b), seen[-1])
        rows.append(g.detach().reshape(-1, g.shape[-1]).square())
    h.remove()
    return torch.cat(rows).mean(0)


def test_fisher_leaves_a_batch_whose_output_is_nan_out_under_ignore_and_names_it_otherwise():
    """A finite batch whose float output is NaN is the batch's fault, as a NaN batch is: left
    out of the weights under ignore, named otherwise (not blamed on the loss)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Sqrt()).eval()
    with torch.no_grad():
        model[0].bias.fill_(50.0)  # outputs positive on ordinary batches
    good = [torch.randn(4, 8) for _ in range(2)]
    bad = torch.full((4, 8), -100.0)  # finite, its outputs negative: sqrt gives NaN
    assert torch.isnan(model(bad)).any()
    got = fisher_weights(model, [good[0], bad, good[1]], ["0"], _square_mean,
                         ignore_non_finite=True)
    want = _mean_squared_grads(model, good, "0", _square_mean)
    assert torch.allclose(got["0"], want, rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match=r"batch 1 \(counting from 0\) brought NaN or inf "
                                         r"values \(the float model's output on it is not"):
        fisher_weights(model, [good[0], bad, good[1]], ["0"], _square_mean)


class _Ban(nn.Module):
    """Its input with the last feature banned: -inf, as a logits processor bans a token."""

    def forward(self, x):
        return torch.cat([x[..., :-1], torch.full_like(x[..., -1:], -float("inf"))], -1)


def test_fisher_counts_a_batch_whose_logits_hold_minus_inf_under_ignore():
    """A banned token's -inf logit is a finite output (probability 0): the batch's gradients
    count, under ignore too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Ban()).eval()
    batches = [torch.randn(4, 8) for _ in range(2)]

    def loss(out, batch):  # finite: the banned feature left out
        return _square_mean(out[..., :-1], batch)

    got = fisher_weights(model, batches, ["0"], loss, ignore_non_finite=True)
    assert torch.allclose(got["0"], _mean_squared_grads(model, batches, "0", loss), rtol=1e-5,
                          atol=0)


@pytest.mark.parametrize("metric", ["joint", "fisher"])
def test_a_nan_error_in_the_per_layer_descent_names_its_metric(monkeypatch, metric):
    """The error of a NaN joint error names the metric the run asked for (fisher weighs the
    joint descent's errors): "fisher" is no "joint" run."""
    model, batches = _mlp_batches()
    # the rows the descent prices: NaN (as a NaN row in the sample would make them)
    monkeypatch.setattr(layer_choice, "spread_rows",
                        lambda x, n: torch.full_like(x[:n], float("nan")))
    loss = _square_mean if metric == "fisher" else None
    with pytest.raises(ValueError, match=rf"^calibrate: auto metric '{metric}', layer '0': the "
                                         rf"output error of weight candidate .* is NaN"):
        quantscope.calibrate(model, batches, "w8a8", observer="auto", progress=False,
                             auto=Auto(("minmax", "mse"), metric, loss=loss))


def test_fisher_refuses_a_nan_batch_and_a_nan_gradient_without_ignore():
    model, batches = _mlp_batches()
    bad = [b.clone() for b in batches]
    bad[1][0, 3] = float("nan")
    with pytest.raises(ValueError, match=r"batch 1 \(counting from 0\) brought NaN or inf"):
        fisher_weights(model, bad, ["0", "2"], _square_mean)
    zero = nn.Sequential(nn.Linear(4, 3)).eval()
    nn.init.zeros_(zero[0].weight)
    nn.init.zeros_(zero[0].bias)  # outputs 0: d sqrt(|y|) / dy is NaN there, the loss 0
    with pytest.raises(ValueError, match=r"gradient of the loss w.r.t. layer '0'.s output is "
                                         r"not finite on batch 0"):
        fisher_weights(zero, [torch.randn(2, 4)], ["0"], lambda o, b: o.abs().sqrt().sum())


def test_joint_descent_refuses_a_nan_error_rather_than_keep_the_first_candidate():
    torch.manual_seed(0)
    x, w = torch.randn(16, 8), torch.randn(4, 8)
    spec = QuantSpec("int8")

    def state(t, f):
        lo, hi = t.min().reshape(1) * f, t.max().reshape(1) * f
        return RoleState(spec, f"f{f}", "auto", qparams=qparams_from_range(lo, hi, spec),
                         lo=lo, hi=hi)

    ws, xs = [state(w, 1.0), state(w, 0.5)], [state(x, 1.0), state(x, 0.5)]
    c = torch.ones(4)
    assert joint_choice(x, w, ws, xs, c)[2] > 0
    c[1] = float("nan")
    with pytest.raises(ValueError, match=r"joint_choice: the output error of weight candidate "
                                         r"'f1.0' with input candidate 'f1.0' is NaN"):
        joint_choice(x, w, ws, xs, c)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=64)).eval()


def test_fisher_default_loss_without_input_ids_names_auto_loss():
    # probing (s44): dict batches of inputs_embeds gave a bare KeyError: 'input_ids'
    batches = [{"inputs_embeds": torch.randn(2, 8, 32)} for _ in range(2)]
    with pytest.raises(ValueError, match=r"needs 'labels' or 'input_ids' in the batch; batch 0 "
                                         r"\(counting from 0\) has \['inputs_embeds'\]; pass "
                                         r"Auto.loss=callable\(output, batch\)"):
        quantscope.calibrate(_tiny_llama(), batches, "w8a8", observer="auto", progress=False,
                             auto=Auto(metric="fisher"))
    with pytest.raises(ValueError, match=r"needs dict batches, got a Tensor as batch 0 .*"
                                         r"Auto.loss=callable"):
        fisher_weights(_mlp_batches()[0], [torch.randn(2, 32)], ["0"])


def test_fisher_leaves_a_batch_of_padding_only_out_as_model_does():
    # mutation round (s45): a batch whose attention mask is all 0 has no token to take a loss
    # on; "model" leaves such a batch out (score_set.with_tokens), fisher raised that the
    # model's own loss was NaN and told the user to pass Auto.loss, which cannot help
    model = _tiny_llama()
    g = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(0, 64, (2, 12), generator=g),
                "attention_mask": torch.ones(2, 12, dtype=torch.long)} for _ in range(3)]
    padding = {**batches[0], "attention_mask": torch.zeros(2, 12, dtype=torch.long)}
    layers = ["model.layers.0.mlp.down_proj", "model.layers.0.self_attn.o_proj"]
    got = fisher_weights(model, [padding, *batches[1:]], layers)
    want = fisher_weights(model, batches[1:], layers)
    assert got.keys() == want.keys() == set(layers)
    assert all(torch.equal(got[k], want[k]) for k in want)
    quantscope.calibrate(model, [padding, *batches[1:]], "w8a8", observer="auto",
                         auto=Auto(("minmax", "mse"), "fisher"), progress=False)
    with pytest.raises(ValueError, match=r"auto \(metric 'fisher'\): the documents compared "
                                         r"hold no real token"):
        fisher_weights(model, [padding, padding], layers)


def test_fisher_with_no_batch_is_the_empty_batches_error_not_no_real_token():
    """No batch at all is not "documents holding no real token": fisher's weights are none,
    and calibrate refuses the empty batches as it does for any other metric."""
    model = _tiny_llama()
    assert fisher_weights(model, [], ["model.layers.0.mlp.down_proj"]) == {}
    with pytest.raises(ValueError, match=r"^calibrate: batches is empty"):
        quantscope.calibrate(model, [], "w8a8", observer="auto",
                             auto=Auto(("minmax", "mse"), "fisher"), progress=False)


@pytest.mark.parametrize(("loss", "got"), [
    (lambda o, b: o.square().mean(0), r"a tensor of shape \(16,\)"),  # a vector per feature
    (lambda o, b: float(o.square().mean()), "float"),  # a number: nothing to differentiate
    (lambda o, b: o.detach().square().mean(), "a tensor that does not require grad"),
], ids=["vector", "number", "no-graph"])
def test_fisher_refuses_a_loss_that_is_not_a_differentiable_scalar_naming_auto_loss(loss, got):
    # probing (s44): a vector loss gave torch's raw "grad can be implicitly created only for
    # scalar outputs"
    model, batches = _mlp_batches()
    with pytest.raises(TypeError, match=r"auto \(metric 'fisher'\): Auto.loss must return a "
                                        r"finite scalar \(a one-element tensor with a graph "
                                        rf"back to the model's output\), got {got} on batch 0"):
        quantscope.calibrate(model, batches, "w8a8", observer="auto", progress=False,
                             auto=Auto(metric="fisher", loss=loss))
