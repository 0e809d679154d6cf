"""End-to-end auto, sensitivity, importance-weighted search and float fallback (issue 17)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import quantscope
from quantscope import presets
from quantscope.calibration import apply, calibrate, calibrate_many, keep_float, preset, sensitivity
from quantscope.calibration.choice.auto import OutputDivergence
from quantscope.calibration.choice.layer_choice import fisher_weights, imatrix_state, joint_choice
from quantscope.calibration.choice.sensitivity import Sensitivity
from quantscope.estimators.mse import shrink_factors
from quantscope.estimators.weighted import imatrix_range, output_clip_range
from quantscope.qdq import fake_quantize
from quantscope.qparams import qparams_from_range
from quantscope.spec import QuantSpec


def _llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    model = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    batches = [{"input_ids": torch.randint(0, 64, (2, 12), generator=g),
                "attention_mask": torch.ones(2, 12, dtype=torch.long)} for _ in range(3)]
    batches[-1]["attention_mask"][1, 8:] = 0  # padding is masked out of the divergence
    return model, batches


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 8)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _kl(model, batches, states=None):
    """The mean over batches of KL(p_float || p_quant) over real next-token positions,
    written out directly (in float64: float32's rounding is as large as a small KL)."""
    total = 0.0
    for b in batches:
        with torch.no_grad():
            ref = torch.log_softmax(model(**b).logits.double(), -1)
            if states is None:
                q = ref
            else:
                with apply(model, states):
                    q = torch.log_softmax(model(**b).logits.double(), -1)
        keep = b["attention_mask"].bool()
        kl = (ref.exp() * (ref - q)).sum(-1)[keep]
        total += float(kl.mean())
    return total / len(batches)


# ----------------------------------------------------------------------------- sensitivity
def test_sensitivity_equals_direct_one_tensor_quantization():
    model, batches = _llama()
    calib = calibrate(model, batches, "w8a8", progress=False)
    s = sensitivity(model, batches, calibration=calib)
    n_tensors = sum(len(r) for r in calib.states.values())
    assert len(s.rows) == n_tensors
    assert s.info["forwards"] == len(batches) * (n_tensors + 1)
    assert [r["rank"] for r in s.rows] == list(range(1, n_tensors + 1))
    assert all(a["divergence"] >= b["divergence"] for a, b in zip(s.rows, s.rows[1:]))
    for r in s.rows[:3] + s.rows[-2:]:
        direct = _kl(model, batches, {r["layer"]: {r["role"]: calib.states[r["layer"]][r["role"]]}})
        assert r["divergence"] == pytest.approx(direct, rel=1e-4, abs=1e-9)
    assert s.rows[0]["divergence"] > 0


def test_sensitivity_of_a_recipe_keeps_its_observers():
    # found by probing: sensitivity() calibrated a Recipe with observer="minmax" (its own
    # default), measuring other observers than calibrate(recipe) runs
    model, batches = _llama()
    recipe = preset("w8a8", "percentile", bins=256)
    calls = []
    measure_ = quantscope.calibration.run.session.measure

    def spy(model, batches, calibration, *args):
        calls.append({role: st.observer for roles in calibration.states.values()
                      for role, st in roles.items()})
        return measure_(model, batches, calibration, *args)

    quantscope.calibration.run.session.measure = spy
    try:
        sensitivity(model, batches[:1], recipe, roles=("input",))
    finally:
        quantscope.calibration.run.session.measure = measure_
    assert calls == [{"weight": "memoryless_minmax", "input": "percentile"}]


def test_sensitivity_encoder_cosine_and_user_loss(tmp_path):
    model = _Mlp().eval()
    batches = [torch.randn(4, 5, 16) for _ in range(2)]
    calib = calibrate(model, batches, "w8a8", progress=False)
    s = sensitivity(model, batches, calibration=calib)
    assert s.info["metric"] == "1 - cosine"
    for r in s.rows:
        st = calib.states[r["layer"]][r["role"]]
        total = 0.0
        for x in batches:
            with torch.no_grad():
                ref = nn.functional.normalize(model(x).double().mean(1), dim=-1)
                with apply(model, {r["layer"]: {r["role"]: st}}):
                    q = nn.functional.normalize(model(x).double().mean(1), dim=-1)
            total += float((1 - (q * ref).sum(-1)).mean())
        assert r["divergence"] == pytest.approx(total / len(batches), rel=1e-4, abs=1e-9)
    mse = sensitivity(model, batches, calibration=calib,
                      loss=lambda out, ref, b: float((out - ref).square().mean()))
    assert mse.info["metric"] == "loss" and mse.rows[0]["divergence"] > 0
    s.to_markdown(tmp_path / "s.md")
    s.to_json(tmp_path / "s.json")
    assert "| 1 |" in (tmp_path / "s.md").read_text()
    pytest.importorskip("matplotlib")
    s.plot(tmp_path / "s.png")
    assert (tmp_path / "s.png").stat().st_size > 0


def test_sensitivity_bad_input():
    model, batches = _llama()
    with pytest.raises(TypeError, match="calibration"):
        sensitivity(model, batches, calibration="w8a8")
    with pytest.raises(ValueError, match="batches is empty"):
        OutputDivergence(model, [])


# ----------------------------------------------------------------------------- auto
def test_model_metric_choice_is_the_exhaustive_best():
    model, batches = _llama()
    names = ["minmax", "mse", "percentile", "histogram_mse"]
    auto = calibrate(model, batches, "w8a8", observer="auto", candidates=names, progress=False,
                     score_tokens=10_000)
    info = auto.info["auto"]
    from quantscope.calibration.choice.auto import score_pieces

    pieces = score_pieces(batches, 10_000)  # the first batch cut in two, then the others
    assert [p["input_ids"].shape[0] for p in pieces] == [1, 1, 2, 2]
    assert info["score_pieces"] == len(pieces)
    # the float references come from the calibration pass: only the candidates' forwards,
    # then the role trials' pieces (choose_roles)
    assert info["score_forwards"] == (sum(info["pieces_scored"].values())
                                      + sum(info["role_pieces"].values()))
    singles = calibrate_many(model, batches, {n: preset("w8a8", n) for n in names},
                             progress=False)
    # the role step's extra weight candidate: min-max's states with each weight searched
    # under the mean x^2 of its inputs over the calibration batches, computed here by hand
    imp = _importance_by_hand(model, batches, list(singles["minmax"].states))
    singles["imatrix"] = SimpleNamespace(states={
        layer: dict(rs, weight=_imatrix_by_hand(model, layer, rs["weight"], imp[layer]))
        for layer, rs in singles["minmax"].states.items()})
    per_piece = {}
    # each candidate's score is its mean KL over the pieces it was scored on (all of them,
    # unless dropped early), written out directly
    per_piece = {n: [_kl(model, [b], c.states) for b in pieces] for n, c in singles.items()}
    imatrix_direct = sum(per_piece.pop("imatrix")) / len(pieces)
    for n in names:
        k = info["pieces_scored"][n]
        assert 1 <= k <= len(pieces)
        assert info["scores"][n] == pytest.approx(sum(per_piece[n][:k]) / k, rel=1e-3,
                                                  abs=1e-12)
    direct = {n: sum(v) / len(v) for n, v in per_piece.items()}
    best = min(direct, key=direct.get)
    assert info["chose"] == best and info["pieces_scored"][best] == len(pieces)
    # then each role from the configuration info["roles"] names, the whole no worse than the
    # best whole configuration, and equal to the best score of the trials
    assert set(info["roles"]) == {"weight", "input"}
    for layer, roles in singles[best].states.items():
        for role in roles:
            st = singles[info["roles"][role]].states[layer][role]
            torch.testing.assert_close(auto.states[layer][role].qparams.scale, st.qparams.scale,
                                       rtol=1e-6, atol=0)
            assert auto.states[layer][role].requested == "auto"
    # one report row per tensor, made by the state auto kept (imatrix's too, made late)
    rows = {(r["layer"], r["role"]): r["observer"] for r in auto.stats}
    assert rows == {(layer, role): st.observer for layer, rs in auto.states.items()
                    for role, st in rs.items()}
    final = sum(_kl(model, [b], auto.states) for b in pieces) / len(pieces)
    completed = [v for k, v in info["role_scores"].items()
                 if info["role_pieces"][k] == len(pieces)]
    assert final == pytest.approx(min([direct[best], *completed]), rel=1e-3, abs=1e-12)
    # never worse than min-max on the scoring batches
    assert final <= direct[best] <= direct["minmax"]
    # the imatrix weights were a weight trial, with the chosen configuration's inputs: from
    # min-max, that trial is the hand-made configuration itself
    assert "weight=imatrix" in info["role_scores"]
    if info["chose"] == "minmax":
        assert final <= imatrix_direct * (1 + 1e-3)


def _importance_by_hand(model, batches, layers):
    """Mean x^2 per input channel of each layer over every row of the batches (the float32
    squares summed in float64)."""
    xs = {n: [] for n in layers}
    hooks = [model.get_submodule(n).register_forward_pre_hook(
        lambda m, a, n=n: xs[n].append(a[0].detach().reshape(-1, a[0].shape[-1]).float()))
        for n in layers]
    with torch.no_grad():
        for b in batches:
            model(**b)
    for h in hooks:
        h.remove()
    return {n: torch.cat(v).square().double().mean(0).float() for n, v in xs.items()}


def _imatrix_by_hand(model, layer, base, imp):
    from dataclasses import replace

    w = model.get_submodule(layer).weight.detach()
    lo, hi = imatrix_range(w, imp, base.spec)
    qp = qparams_from_range(lo, hi, base.spec).reshape(base.spec.layout.qparam_shape(w.shape))
    return replace(base, observer="imatrix", qparams=qp, lo=lo, hi=hi)


def test_input_importance_is_the_mean_square_of_every_row_seen():
    from quantscope.calibration.choice.importance import InputImportance

    model, batches = _llama()
    layers = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head"]
    imp = InputImportance(model, layers + ["model.norm"])  # a norm has no 2-D weight: skipped
    with torch.no_grad():
        model(**batches[0])  # outside the calibration pass and counting(): not counted
        assert not imp.seen()
        with imp.counting():
            for b in batches:
                model(**b)
    got = imp.means()
    assert sorted(got) == sorted(layers) and not imp.handles
    want = _importance_by_hand(model, batches, layers)
    for n in layers:
        torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=0)
    # a layer that saw no rows has no importance
    imp = InputImportance(model, layers)
    assert imp.means() == {}
    # in a calibration, the pass's forwards are counted, not the one that finds the fusion
    # groups: auto's weight trial uses the mean over the batches, as computed by hand above
    from quantscope.calibration.run import observe

    seen = []
    imp = InputImportance(model, layers)
    real = observe.forward_batch
    try:
        observe.forward_batch = lambda m, b: seen.append(observe.in_pass()) or real(m, b)
        calibrate(model, batches, "w8a8", progress=False)
    finally:
        observe.forward_batch = real
    assert seen == [True] * len(batches) and not observe.in_pass()
    for n, v in imp.means().items():
        torch.testing.assert_close(v, want[n], rtol=1e-6, atol=0)


def test_imatrix_config_replaces_the_weights_it_can_search():
    from quantscope.calibration.choice.importance import imatrix_config, imatrix_rows

    model, batches = _llama()
    base = calibrate(model, batches, "w8a8", progress=False)
    imp = _importance_by_hand(model, batches, list(base.states))
    got = imatrix_config(model, base, imp)
    for layer, rs in base.states.items():
        new = got.states[layer]
        assert new["input"] is rs["input"]  # the other roles kept
        want = _imatrix_by_hand(model, layer, rs["weight"], imp[layer])
        assert new["weight"].observer == "imatrix"
        assert torch.equal(new["weight"].lo, want.lo) and torch.equal(new["weight"].hi, want.hi)
    assert got.stats == []  # the rows only for a configuration auto keeps
    rows = imatrix_rows(model, got, base)
    assert [(r["layer"], r["role"], r["observer"]) for r in rows] == [
        (n, "weight", "imatrix") for n in base.states]
    # without importance nothing changes: no configuration
    assert imatrix_config(model, base, {}) is None
    # a scale a fused runtime layer shares (NVFP4's global scale) is not searched per layer
    nv = calibrate(model, batches, "nvfp4", progress=False)
    assert imatrix_config(model, nv, _importance_by_hand(model, batches, list(nv.states))) is None


def test_choose_drops_a_far_worse_candidate_after_the_first_piece():
    from quantscope.calibration.choice.auto import choose

    class Fake:  # divergence per (config, piece), recorded
        def __init__(self):
            self.batches, self.calls = [0, 1, 2], []
            self.pieces = len(self.batches)

        def of(self, states, k):
            self.calls.append((states, k))
            return {"a": [1.0, 1.0, 1.0], "b": [0.9, 1.2, 1.2], "c": [2.0, 0.0, 0.0]}[states][k]

    div = Fake()
    best, scores = choose(div, {"a": "a", "b": "b", "c": "c"}, "a", drop=1.5)
    # c (2.0 > 1.5 x 0.9 after piece 0) is dropped though it would have won on all three
    assert ("c", 1) not in div.calls and scores["c"] == (2.0, 1)
    assert best == "a" and scores["a"] == (1.0, 3)
    assert scores["b"] == (pytest.approx(3.3 / 3), 3)
    # ties keep the first (min-max)
    best, _ = choose(Fake(), {"b": "a", "a": "a"}, "a")
    assert best == "a"


def test_choose_keeps_the_best_when_its_divergence_is_below_zero():
    # found by probing: a best mean below 0 (float rounding) made ``mean <= 1.5 * best`` drop
    # every candidate, and min() of none raised
    from quantscope.calibration.choice.auto import choose

    class Fake:
        batches = (0, 1)
        pieces = 2

        def of(self, states, k):
            return {"a": [-1e-9, -1e-9], "b": [-2e-9, -2e-9], "c": [1.0, 1.0]}[states][k]

    best, scores = choose(Fake(), {"a": "a", "b": "b", "c": "c"}, "a", drop=1.5)
    # b the least; a within 1.5 x |b| of it stays; c far behind is dropped after piece 0
    assert best == "b" and scores["b"] == (-2e-9, 2)
    assert scores["a"] == (-1e-9, 2) and scores["c"] == (1.0, 1)


def test_model_metric_kl_is_not_negative_when_the_layer_barely_matters():
    # found by probing: a quantized layer the output hardly sees gave a KL of -3.6e-9 (log-
    # probabilities in float32) and auto raised "min() arg is an empty sequence"
    model, batches = _llama(2)  # a seed whose float32 KL came out below 0
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(1e-7)
    recipe = preset("w8a8", "auto", targets=["re:.*layers\\.1\\.mlp\\.down_proj"])
    auto = calibrate(model, batches, recipe, progress=False, score_tokens=10_000)
    scores = auto.info["auto"]["scores"]
    assert auto.info["auto"]["chose"] in scores and min(scores.values()) >= 0
    # auto's divergence of the states it kept, however small, is a KL: not below 0
    from quantscope.calibration.choice.auto import OutputDivergence

    assert OutputDivergence(model, batches).of(auto.states) >= 0


def test_choose_roles_finds_the_pair_no_whole_configuration_has():
    """MiniLM W8A8's case: mse weights with min-max inputs beat both whole configurations."""
    from types import SimpleNamespace

    from quantscope.calibration.choice.auto import choose_roles

    def config(w, i):
        st = lambda o: SimpleNamespace(observer=o)
        return SimpleNamespace(states={"l0": {"weight": st(w), "input": st(i)},
                                       "l1": {"weight": st(w), "input": st(i)}})

    configs = {"minmax": config("memoryless_minmax", "minmax"),
               "mse": config("memoryless_mse", "mse"),
               "mix": config("memoryless_minmax", "mix")}
    table = {("memoryless_minmax", "minmax"): 1.0, ("memoryless_mse", "mse"): 1.2,
             ("memoryless_minmax", "mix"): 1.1, ("memoryless_mse", "minmax"): 0.8,
             ("memoryless_mse", "mix"): 0.9, ("memoryless_minmax", "mse"): 1.3}

    class Fake:  # the same divergence on each of 3 pieces
        def __init__(self):
            self.batches, self.calls = [0, 1, 2], []
            self.pieces = len(self.batches)

        def of(self, states, k):
            key = (states["l0"]["weight"].observer, states["l0"]["input"].observer)
            assert all((rs["weight"].observer, rs["input"].observer) == key
                       for rs in states.values())
            self.calls.append((*key, k))
            return table[key]

    div = Fake()
    roles, tried = choose_roles(div, configs, "minmax", [1.0] * 3, alive=["minmax", "mix"])
    assert roles == {"weight": "mse", "input": "minmax"}
    # weights: mse's (mix's are min-max's, not tried twice), on every piece; inputs: the
    # alive mix only, abandoned after the first piece (0.9 > the kept 0.8)
    assert div.calls == [("memoryless_mse", "minmax", 0), ("memoryless_mse", "minmax", 1),
                         ("memoryless_mse", "minmax", 2), ("memoryless_mse", "mix", 0)]
    assert tried == {"weight=mse": (pytest.approx(0.8), 3), "input=mix": (0.9, 1)}
    # nothing better: the whole configuration stays
    roles, _ = choose_roles(Fake(), configs, "mse", [0.5] * 3, alive=["mse"])
    assert roles == {"weight": "mse", "input": "mse"}


def test_score_pieces_cut_one_batch_by_rows_to_the_tokens_asked():
    from quantscope.calibration.choice.auto import score_batches, score_pieces

    mask = torch.ones(4, 5, dtype=torch.long)
    mask[3, 2:] = 0
    b = {"input_ids": torch.arange(20).reshape(4, 5), "attention_mask": mask}
    assert [int(x["attention_mask"].sum()) for x in score_batches([b, b], 9)] == [10]
    assert [int(x["attention_mask"].sum()) for x in score_batches([b, b], 20)] == [17, 5]
    pieces = score_pieces([b], 100)  # a quarter of the rows first, then the rest
    assert [p["input_ids"].shape[0] for p in pieces] == [1, 3]
    assert torch.equal(torch.cat([p["input_ids"] for p in pieces]), b["input_ids"])
    assert [p["input_ids"].shape[0] for p in score_pieces([b], 100, first=0.5)] == [2, 2]
    assert [p["input_ids"].shape[0] for p in score_pieces([b, b], 20)] == [1, 3, 1]


def test_joint_choice_equals_exhaustive_pair_search():
    torch.manual_seed(0)
    x = torch.randn(64, 16) * torch.linspace(0.1, 4, 16)
    x[3, 5] = 40.0  # an outlier: clipping it trades against the step everywhere
    w = torch.randn(8, 16)
    wspec, xspec = QuantSpec("int4", presets.INT8_PER_CHANNEL.layout), QuantSpec("int8")
    from quantscope.calibration.results.result import RoleState

    def state(spec, t, f):
        lo, hi = quantscope.stats.minmax.unit_minmax(spec.layout.to_units(t))
        qp = qparams_from_range(lo * f, hi * f, spec).reshape(spec.layout.qparam_shape(t.shape))
        return RoleState(spec, f"f{f}", "auto", qparams=qp, lo=lo * f, hi=hi * f)

    ws = [state(wspec, w, f) for f in (1.0, 0.9, 0.8)]
    xs = [state(xspec, x, f) for f in (1.0, 0.5, 0.2, 0.1)]
    errs = {}
    for i, ws_ in enumerate(ws):
        wq = fake_quantize(w, ws_.qparams, wspec)
        for j, xs_ in enumerate(xs):
            xq = fake_quantize(x, xs_.qparams, xspec)
            errs[(i, j)] = float((x @ w.T - xq @ wq.T).double().square().sum())
    i, j, e = joint_choice(x, w, ws, xs, rounds=3)
    assert (i, j) == min(errs, key=errs.get)
    assert e == pytest.approx(errs[(i, j)], rel=1e-5)
    # output weights: zero weight on every output but one makes only that output count
    c = torch.zeros(8)
    c[2] = 1.0
    _i2, j2, e2 = joint_choice(x, w, ws[:1], xs, c)
    wq = fake_quantize(w, ws[0].qparams, wspec)
    per = [float((x @ w.T - fake_quantize(x, s.qparams, xspec) @ wq.T)[:, 2].double()
                 .square().sum()) for s in xs]
    assert j2 == min(range(len(per)), key=per.__getitem__)
    assert e2 == pytest.approx(per[j2], rel=1e-5)


def test_joint_and_fisher_metrics_run_and_report_auto():
    model, batches = _llama()
    for metric in ("joint", "fisher"):
        c = calibrate(model, batches, "w8a8", observer="auto", progress=False, auto_metric=metric)
        roles = {r for rs in c.states.values() for r in rs}
        assert roles == {"weight", "input"}
        assert all(st.requested == "auto" and st.observer != "auto"
                   for rs in c.states.values() for st in rs.values())
    with pytest.raises(ValueError, match="auto_metric"):
        calibrate(model, batches, "w8a8", observer="auto", auto_metric="nope", progress=False)


def test_fisher_weights_by_hand():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    xs = [torch.randn(5, 4), torch.randn(2, 4)]
    target = torch.randn(3)

    def loss(out, batch):
        return ((out - target) ** 2).sum()

    got = fisher_weights(model, xs, ["0"], loss)["0"]
    # dL/dy = 2 (y - t) per row: the mean of its square over all rows of all batches
    with torch.no_grad():
        g = torch.cat([2 * (model(x) - target) for x in xs])
    assert torch.allclose(got, g.square().mean(0), rtol=1e-5)


def test_fisher_default_loss_takes_the_batches_own_labels():
    # probing: HF collators' batches carry labels; the default loss passed labels= twice
    # (a bare TypeError)
    model, batches = _llama()
    labeled = [{**b, "labels": b["input_ids"].flip(1)} for b in batches]
    layers = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"]
    got = fisher_weights(model, labeled, layers)
    want = fisher_weights(model, labeled, layers, lambda out, batch: out.loss)
    assert all(torch.equal(got[k], want[k]) for k in layers)
    other = fisher_weights(model, batches, layers)  # no labels: the inputs, padding left out
    assert not torch.equal(got[layers[0]], other[layers[0]])


def test_fisher_weights_under_inference_mode_are_the_normal_ones():
    # found by probing: under inference_mode no graph was built, the weights came out empty
    # and auto(metric="fisher") chose by the unweighted error without a word
    model, batches = _llama()
    layers = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"]
    want = fisher_weights(model, batches, layers)
    with torch.inference_mode():
        made_here = [{k: v.clone() for k, v in b.items()} for b in batches]  # inference tensors
        got = fisher_weights(model, made_here, layers)
    assert got.keys() == want.keys() == set(layers)
    assert all(torch.equal(got[k], want[k]) for k in layers)


def test_model_metric_auto_keeps_the_options_each_candidate_takes():
    """Every candidate (and its weight variant) is built with the observer options it takes;
    a name none takes (a typo) is refused, not dropped."""
    model, batches = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 8)).eval(), [torch.randn(8, 16)]
    c = calibrate(model, batches, preset("w8a8", "auto", non_finite="ignore"), progress=False)
    assert {s.options for roles in c.states.values() for s in roles.values()} == {
        (("non_finite", "ignore"),)}
    with pytest.raises(ValueError, match=r"'auto' option\(s\) \['non_finte'\] taken by none"):
        calibrate(model, batches, preset("w8a8", "auto", non_finte="ignore"), progress=False)


# ----------------------------------------------------------------------------- estimators
def test_imatrix_range_by_hand():
    torch.manual_seed(0)
    w = torch.randn(3, 8)
    w[0, 1] = 6.0  # an outlier in a channel the importance ignores
    imp = torch.tensor([1.0, 0.0, 2.0, 0.5, 1.0, 3.0, 0.1, 1.0])
    spec = QuantSpec("int4", presets.INT8_PER_CHANNEL.layout)
    factors = [1 - i / 20 for i in range(10)]
    lo, hi = imatrix_range(w, imp, spec, factors=factors)
    for row in range(3):
        best = None
        for f in [1.0, *factors]:
            a, b = float(w[row].min()) * f, float(w[row].max()) * f
            qp = qparams_from_range(torch.tensor([a]), torch.tensor([b]), QuantSpec("int4"))
            q = fake_quantize(w[row], qp, QuantSpec("int4"))
            err = sum(float(imp[j]) * float(q[j] - w[row, j]) ** 2 for j in range(8))
            if best is None or err < best[0]:
                best = (err, a, b)
        assert float(lo.flatten()[row]) == pytest.approx(best[1], rel=1e-6)
        assert float(hi.flatten()[row]) == pytest.approx(best[2], rel=1e-6)
    # with the outlier's channel weightless, row 0 clips it; unweighted keeps more of it
    _lo_u, hi_u = imatrix_range(w, None, spec, factors=factors)
    assert float(hi.flatten()[0]) < float(hi_u.flatten()[0])
    with pytest.raises(ValueError, match="one value per input channel"):
        imatrix_range(w, imp[:3], spec)
    with pytest.raises(ValueError, match="non-negative"):
        imatrix_range(w, -imp, spec)


def test_imatrix_state_is_the_weighted_search_under_the_base_spec():
    torch.manual_seed(0)
    x, w = torch.randn(32, 8) * torch.arange(1, 9), torch.randn(4, 8)
    base = calibrate(nn.Sequential(nn.Linear(8, 4)), [x], "w8a8",
                     progress=False).states["0"]["weight"]
    imp = (x * x).sum(0) / x.shape[0]
    st = imatrix_state(w, imp, base)
    lo, hi = imatrix_range(w, imp, base.spec)
    assert torch.equal(st.lo, lo) and torch.equal(st.hi, hi) and st.observer == "imatrix"
    qp = qparams_from_range(lo, hi, base.spec)
    assert torch.equal(st.qparams.scale.flatten(), qp.scale.flatten())
    assert st.spec == base.spec and st.shape == base.shape


def test_output_clip_range_is_the_brute_force_best():
    torch.manual_seed(1)
    x = torch.randn(100, 12)
    x[0, 0] = 30.0
    wq = torch.randn(6, 12)
    spec = QuantSpec("int8")
    cands = [(torch.tensor([-30.0 * f]), torch.tensor([30.0 * f])) for f in (1, 0.5, 0.2, 0.1)]
    i, lo, _hi, errs = output_clip_range(x, wq, spec, cands)
    brute = []
    for a, b in cands:
        xq = fake_quantize(x, qparams_from_range(a, b, spec), spec)
        brute.append(float((x @ wq.T - xq @ wq.T).double().square().sum()))
    assert errs == pytest.approx(brute, rel=1e-5)
    assert i == min(range(4), key=brute.__getitem__) and torch.equal(lo, cands[i][0])
    with pytest.raises(ValueError, match="w_q"):
        output_clip_range(x, wq[:, :5], spec, cands)
    with pytest.raises(ValueError, match="empty"):
        output_clip_range(x, wq, spec, [])
    assert shrink_factors()[0] == 1.0


# ----------------------------------------------------------------------------- fallback
def test_keep_float_restores_float_exactly_for_the_chosen_tensors():
    model, batches = _llama()
    calib = calibrate(model, batches, "w8a8", progress=False)
    s = sensitivity(model, batches, calibration=calib, roles=("input",))
    fb = keep_float(calib, s, 3)
    chosen = {t.rsplit(" ", 1)[0] for t in fb.info["keep_float"]["tensors"]}
    assert chosen == {layer for layer, _ in s.top(3)} and len(chosen) == 3
    seen = {}

    def capture(tag, name):
        def hook(module, args):
            seen[(tag, name)] = args[0].detach().clone()
        return hook

    layers = list(calib.states)
    handles = [model.get_submodule(n).register_forward_pre_hook(capture("in", n)) for n in layers]
    try:
        with fb.apply(model):
            inner = [model.get_submodule(n).register_forward_pre_hook(capture("q", n))
                     for n in layers]
            with torch.no_grad():
                model(**batches[0])
            for h in inner:
                h.remove()
    finally:
        for h in handles:
            h.remove()
    for n in layers:
        same = torch.equal(seen[("in", n)], seen[("q", n)])
        assert same == (n in chosen), n  # float input exactly where chosen, QDQ elsewhere
    # weights stay quantized, the other activations keep their calibrated states
    assert all("weight" in fb.states[n] for n in layers)
    dyn = keep_float(calib, s, 2, mode="dynamic")
    for t in dyn.info["keep_float"]["tensors"]:
        st = dyn.states[t.rsplit(" ", 1)[0]]["input"]
        assert st.dynamic is True and type(st.spec.layout).__name__ == "Token"
    with pytest.raises(ValueError, match="n must be"):
        keep_float(calib, s, -1)
    with pytest.raises(ValueError, match="mode"):
        keep_float(calib, s, 1, mode="half")


def test_keep_float_takes_a_fused_groups_shared_input_whole():
    # found by probing: keep_float made up_proj's input dynamic and kept gate_proj's static,
    # but the runtime's gate_up_proj runs one input scheme (vLLM serves gate's)
    model, batches = _llama()
    calib = calibrate(model, batches, "w8a8", progress=False)
    groups = {g["layers"][0].rsplit(".", 1)[0]: g["layers"] for g in calib.info["fusion_groups"]}
    attn0 = groups["model.layers.0.self_attn"]
    rows = [{"layer": layer, "role": "input"} for layer in
            ("lm_head", attn0[2], attn0[0], "model.layers.1.mlp.down_proj")]
    for mode in ("float", "dynamic"):
        kept = keep_float(calib, Sensitivity(rows), 3, mode=mode)
        assert kept.info["keep_float"]["n"] == 3  # the group counted once
        assert kept.info["keep_float"]["tensors"] == [
            "lm_head input", *(f"{layer} input" for layer in attn0),
            "model.layers.1.mlp.down_proj input"]
        for layer in attn0:  # the members' inputs all fall back alike
            st = kept.states[layer].get("input")
            assert (st is None) if mode == "float" else st.dynamic is True
        assert kept.states["model.layers.0.mlp.gate_proj"]["input"].dynamic is False


def test_keep_float_keeps_the_smoothing_and_every_other_field(tmp_path):
    # found by probing: keep_float built a Calibration without the SmoothQuant scales; saved,
    # loaded and reapplied to a fresh float model, it ran another model
    from dataclasses import fields

    from quantscope.calibration import load
    from quantscope.calibration.choice.smooth import reapply

    model, batches = _llama()
    calib = calibrate(model, batches, "w8a8", smooth=0.8, progress=False)
    assert calib.smoothing
    kept = keep_float(calib, sensitivity(model, batches[:1], calibration=calib), 2)
    for f in fields(calib):
        if f.name not in ("states", "stats", "histograms", "info"):
            assert getattr(kept, f.name) is getattr(calib, f.name), f.name
    kept.save(tmp_path / "q")
    fresh, _ = _llama()
    back = load(tmp_path / "q")
    reapply(fresh, back)
    with torch.no_grad(), kept.apply(model):
        want = model(**batches[0]).logits
    with torch.no_grad(), back.apply(fresh):
        torch.testing.assert_close(fresh(**batches[0]).logits, want, rtol=0, atol=0)


def test_keep_float_dynamic_on_nvfp4_keeps_its_blocks_and_scales_each_call():
    # found by probing: the "dynamic" fallback (calibrate's default) made NVFP4 inputs a
    # Token layout, which a block-scale spec refuses, after the whole calibration pass
    from dataclasses import replace

    from quantscope.calibration import Outliers
    from quantscope.calibration.results.apply import qdq_tensor

    model, batches = _llama()
    static = calibrate(model, batches, "nvfp4", progress=False)
    kept = calibrate(model, batches, "nvfp4", outliers=Outliers(keep_float=1), progress=False)
    names = [t.rsplit(" ", 1)[0] for t in kept.info["keep_float"]["tensors"]]
    assert names and kept.info["keep_float"]["mode"] == "dynamic"
    seen = {}

    def capture(tag, name):
        def hook(module, args):
            seen[(tag, name)] = args[0].detach().clone()
        return hook

    outer = [model.get_submodule(n).register_forward_pre_hook(capture("in", n)) for n in names]
    try:
        with kept.apply(model), torch.no_grad():
            inner = [model.get_submodule(n).register_forward_pre_hook(capture("q", n))
                     for n in names]
            model(**batches[0])
            for h in inner:
                h.remove()
    finally:
        for h in outer:
            h.remove()
    for n in names:
        st, was = kept.states[n]["input"], static.states[n]["input"]
        assert st.dynamic is True and st.spec == was.spec  # same blocks and format
        # NVFP4 with the global amax of this call, not the calibrated one
        x = seen[("in", n)]
        per_call = replace(was, global_amax=x.abs().amax().reshape(was.global_amax.shape))
        assert torch.equal(seen[("q", n)], qdq_tensor(x, per_call)), n
        assert not torch.equal(seen[("q", n)], qdq_tensor(x, was))


def test_keep_float_takes_the_fallen_back_tensors_out_of_the_report():
    # found by probing: the report kept the fallen-back inputs' static int8 rows
    from quantscope.calibration import Outliers

    model, batches = _llama()
    for mode in ("float", "dynamic"):
        calib = calibrate(model, batches, "w8a8", outliers=Outliers(keep_float=2, fallback=mode),
                          progress=False)
        out = {tuple(t.rsplit(" ", 1)) for t in calib.info["keep_float"]["tensors"]}
        states = {(layer, role): st for layer, rs in calib.states.items()
                  for role, st in rs.items()}
        report = calib.report()
        rows = {(r["layer"], r["role"]): r for r in report.rows}
        # one row per tensor apply() runs statically, made by its state
        assert rows.keys() == states.keys() - out and len(out) == 2
        for key, r in rows.items():
            assert (r["spec"], r["observer"], r["dynamic"]) == (
                str(states[key].spec), states[key].observer, states[key].dynamic), key
        assert report.summary["input"]["layers"] == sum(
            1 for (_, role), st in states.items() if role == "input" and st.dynamic is False)
        assert not out & calib.histograms.keys()
        text = report.to_markdown()
        assert "## Fallback (keep_float)" in text
        assert all(f"| {a} {b} | {mode}" in text for a, b in out)


def test_calibrate_keep_float_is_keep_float_of_the_layer_ranking():
    from quantscope.calibration.choice.sensitivity import layer_sensitivity

    model, batches = _llama()
    calib = calibrate(model, batches, "w8a8", progress=False)
    want = keep_float(calib, layer_sensitivity(model, batches[:1], calib), 3, mode="dynamic")
    for given in (batches, iter(batches)):  # a list, and an iterator the ranking must not eat
        got = calibrate(model, given, "w8a8", progress=False, keep_float=3)
        assert got.info["keep_float"] == want.info["keep_float"]
        assert len(got.info["keep_float"]["tensors"]) == 3
        for layer, roles in want.states.items():
            for role, st in roles.items():
                mine = got.states[layer][role]
                assert mine.dynamic == st.dynamic and mine.spec == st.spec
                if st.qparams is not None:  # the static ones: the same calibration
                    assert torch.equal(mine.qparams.scale, st.qparams.scale)
    flt = calibrate(model, batches, "w8a8", progress=False, keep_float=2, fallback="float")
    assert flt.info["keep_float"]["mode"] == "float"
    assert sum("input" not in r for r in flt.states.values()) == 2
    # dynamic activations are not static: nothing to keep out, no ranking forward
    assert calibrate(model, batches, "w8a8-dynamic", progress=False,
                     keep_float=2).info["keep_float"]["n"] == 0
    for bad, match in (({"keep_float": -1}, "keep_float"), ({"keep_float": True}, "keep_float"),
                       ({"keep_float": 1, "fallback": "half"}, "fallback"),
                       ({"keep_float": 1, "sequential": True}, "sequential")):
        with pytest.raises(ValueError, match=match):
            calibrate(model, batches, "w8a8", progress=False, **bad)


def test_fallback_curve_rows():
    model, batches = _llama()
    calib = calibrate(model, batches, "w8a8", progress=False)
    s = sensitivity(model, batches, calibration=calib, roles=("input",))
    rows = quantscope.calibrate.fallback_curve(model, calib, s, lambda m: _kl(m, batches[:1]),
                                               ns=(0, 2, 100))
    assert [r["n"] for r in rows] == [0, 2, 100]
    assert rows[0]["float_macs_pct"] == 0 and rows[-1]["float_macs_pct"] == 100
    assert len(rows[1]["tensors"]) == 2


def test_imatrix_observer_matches_the_estimator_and_falls_back_to_unweighted():
    torch.manual_seed(2)
    w = torch.randn(6, 32)
    imp = torch.rand(32) * 4
    spec = QuantSpec("int4", quantscope.Group(16))
    for importance in (imp, None):
        obs = quantscope.get_observer("imatrix_mse", spec, importance=importance)
        obs(w)
        lo, hi = imatrix_range(w, importance, spec)
        qlo, qhi = obs.calculate_range()
        assert torch.equal(qlo.flatten(), lo.flatten()) and torch.equal(qhi.flatten(), hi.flatten())
        qp = obs.calculate_qparams()
        assert qp.scale.shape == spec.layout.qparam_shape(w.shape)
    # the weighted search has the lower weighted error, the unweighted the lower plain error

    def err(lo, hi, weights):
        qp = qparams_from_range(lo, hi, spec).reshape(spec.layout.qparam_shape(w.shape))
        return float(((fake_quantize(w, qp, spec) - w) ** 2 * weights).sum())
    lw, hw = imatrix_range(w, imp, spec)
    lu, hu = imatrix_range(w, None, spec)
    assert err(lw, hw, imp) <= err(lu, hu, imp)
    assert err(lu, hu, torch.ones(32)) <= err(lw, hw, torch.ones(32))
    with pytest.raises(ValueError, match="importance has 32"):
        quantscope.get_observer("imatrix_mse", spec, importance=imp)(torch.randn(6, 16))


def test_layer_sensitivity_by_hand():
    from quantscope.calibration.choice.sensitivity import layer_sensitivity
    from quantscope.calibration.results.apply import qdq_tensor

    model = _Mlp().eval()
    batches = [torch.randn(3, 5, 16) for _ in range(2)]
    calib = calibrate(model, batches, "w8a8", progress=False)
    s = layer_sensitivity(model, batches, calib)
    assert s.info["forwards"] == 2 and len(s.rows) == 4
    assert all(a["divergence"] >= b["divergence"] for a, b in zip(s.rows, s.rows[1:]))
    xs = {"up": [b.reshape(-1, 16) for b in batches]}
    with torch.no_grad():
        xs["down"] = [nn.functional.gelu(model.up(x)) for x in xs["up"]]
    for r in s.rows:
        m = model.get_submodule(r["layer"])
        st = calib.states[r["layer"]][r["role"]]
        w = m.weight.detach()
        e = y = 0.0
        for x in xs[r["layer"]]:  # 15 rows per batch: all of them, under LAYER_ROWS
            ref = x @ w.T
            q = qdq_tensor(x, st) @ w.T if r["role"] == "input" else x @ qdq_tensor(w, st).T
            e += float((q - ref).double().square().sum())
            y += float(ref.double().square().sum())
        assert r["divergence"] == pytest.approx(e / y, rel=1e-4)
    # the ranking drives the fallback: the first input ranked is the one left dynamic
    kept = keep_float(calib, s, 1, mode="dynamic")
    first = s.top(1, "input")[0]
    assert kept.states[first[0]]["input"].dynamic is True
    with pytest.raises(TypeError, match="calibration"):
        layer_sensitivity(model, batches, "w8a8")


def test_model_metric_on_one_batch_cut_in_pieces_matches_direct_kl():
    from quantscope.calibration.choice.auto import score_pieces

    model, batches = _llama()
    big = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}  # one batch of 6 rows
    names = ["minmax", "mse"]
    auto = calibrate(model, [big], "w8a8", observer="auto", candidates=names, progress=False,
                     score_tokens=10_000)
    info = auto.info["auto"]
    pieces = score_pieces([big], 10_000)
    assert info["score_pieces"] == 2 and [p["input_ids"].shape[0] for p in pieces] == [2, 4]
    # references caught: only the candidates' forwards, and the role trials' pieces
    assert info["score_forwards"] == (sum(info["pieces_scored"].values())
                                      + sum(info["role_pieces"].values()))
    singles = calibrate_many(model, [big], {n: preset("w8a8", n) for n in names},
                             progress=False)
    for n in names:
        k = info["pieces_scored"][n]
        direct = sum(_kl(model, [p], singles[n].states) for p in pieces[:k]) / k
        assert info["scores"][n] == pytest.approx(direct, rel=1e-3, abs=1e-12)


def test_quantizes_like_tells_equal_qdq_apart():
    model, batches = _llama()
    cs = calibrate_many(model, batches, {"minmax": preset("w8a8", "minmax"),
                                         "mse": preset("w8a8", "mse"),
                                         "auto": preset("w8a8", "auto")},
                        candidates=["minmax", "mse"], progress=False)
    assert cs["minmax"].quantizes_like(cs["minmax"])
    assert not cs["minmax"].quantizes_like(cs["mse"])
    # auto's states are its chosen roles' states: the same QDQ whoever found them
    from quantscope.calibration import Calibration

    roles = cs["auto"].info["auto"]["roles"]
    picked = Calibration(cs["auto"].recipe, {
        layer: {r: cs[roles[r]].states[layer][r] for r in rs}
        for layer, rs in cs["auto"].states.items()})
    assert cs["auto"].quantizes_like(picked) and picked.quantizes_like(cs["auto"])
    # one scale value apart is another quantizer
    from dataclasses import replace

    from quantscope.qparams import QParams

    layer = next(iter(cs["minmax"].states))
    st = cs["minmax"].states[layer]["weight"]
    scale = st.qparams.scale.clone()
    scale.view(-1)[0] *= 2
    moved = replace(st, qparams=QParams(scale, st.qparams.zero_point))
    assert st.quantizes_like(replace(st, observer="other"))
    assert not st.quantizes_like(moved)
    assert not st.quantizes_like(replace(st, dynamic=True))


def test_weight_only_auto_weighs_by_the_scoring_forwards():
    """A weight-only recipe's pass runs no forward: the importance comes from the float
    forwards of the scoring pieces, and the imatrix weights are still a role trial."""
    from quantscope.calibration import Recipe, Role, Rule

    model, batches = _llama()
    recipe = Recipe((Rule(("Linear",), weight=Role(presets.INT8_PER_CHANNEL, "auto")),),
                    name="w8-only")
    c = calibrate(model, batches, recipe, candidates=["minmax", "mse"], progress=False)
    info = c.info["auto"]
    assert "weight=imatrix" in info["role_scores"]
    if info["roles"]["weight"] == "imatrix":
        assert {st["weight"].observer for st in c.states.values()} == {"imatrix"}


# ------------------------------------------------------------------------------------ CUDA
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@needs_cuda
def test_importance_hooks_on_cuda_sync_nothing_and_match_the_cpu():
    """The importance sums stay on the device: no host sync per forward (CUDA's sync debug
    mode raises on one; a plain MLP, so only the hooks could sync)."""
    from quantscope.calibration.choice.importance import InputImportance

    model = _Mlp()
    xs = [torch.randn(4, 5, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    want_imp = InputImportance(model, ["up", "down"])
    with torch.no_grad(), want_imp.counting():
        for x in xs:
            model(x)
    want = want_imp.means()
    model, xs = model.cuda(), [x.cuda() for x in xs]  # (a host-to-device copy syncs)
    imp = InputImportance(model, ["up", "down"])
    with torch.no_grad(), imp.counting():
        model(xs[0])  # the first call allocates the sums
        torch.cuda.set_sync_debug_mode("error")
        try:
            for x in xs[1:]:
                model(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert all(t.is_cuda for t in imp.sums.values())  # summed where the inputs are
    got = imp.means()  # then copied to the CPU once
    for n in ("up", "down"):
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=0)


@needs_cuda
def test_auto_on_cuda_makes_the_cpu_choice_with_the_cpu_scales():
    model, batches = _llama()
    names = ["minmax", "mse"]
    cpu = calibrate(model, batches, "w8a8", observer="auto", candidates=names, progress=False)
    gm = model.cuda()
    gb = [{k: v.cuda() for k, v in b.items()} for b in batches]
    gpu = calibrate(gm, gb, "w8a8", observer="auto", candidates=names, progress=False)
    a, b = gpu.info["auto"], cpu.info["auto"]
    assert a["chose"] == b["chose"] and a["roles"] == b["roles"]
    # the scores are KLs of ~1e-6 here: the GPU's float32 forwards (another summation order)
    # move them at the percent level (1.135e-6 against 1.124e-6 on an H100)
    for n in b["scores"]:
        assert a["scores"][n] == pytest.approx(b["scores"][n], rel=0.05)
    for layer, rs in cpu.states.items():
        for role, st in rs.items():
            g = gpu.states[layer][role].qparams.scale
            assert g.is_cuda
            # weights: the same tensors; inputs: activations to the GPU's last bits
            torch.testing.assert_close(g.cpu(), st.qparams.scale, atol=0,
                                       rtol=1e-5 if role == "weight" else 1e-3)


def test_model_metric_sees_a_one_output_head():
    # found by probing: each row's single output normalised to +-1, so every candidate
    # scored 0 and auto chose blind; the batch's column is compared as one vector
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)).eval()
    x = torch.randn(32, 16)
    calib = calibrate(model, [x], "w8a8", progress=False)
    with torch.no_grad():
        ref = model(x).double().flatten()
        with apply(model, calib.states):
            q = model(x).double().flatten()
    want = 1 - float(torch.dot(q, ref) / (q.norm() * ref.norm()))
    assert want > 0
    assert OutputDivergence(model, [x]).of(calib.states) == pytest.approx(want, rel=1e-6)


def test_keep_float_on_3d_moe_experts_ranks_through_the_expert_views():
    """``Outliers(keep_float=1)`` on a Mixtral whose experts are 3-D parameters: the ranking
    runs on the per-expert views the calibration names (``...experts.0.down_proj``), the
    input whose quantization moves its layer's output most (``||Q(X) W^T - X W^T||^2 /
    ||X W^T||^2`` on the first batch, computed here) runs float, and the model is left with
    the parameters and modules it had (no view attached)."""
    import torch.nn.functional as F
    from tiny_models import mixtral

    from quantscope.calibration import Outliers
    from quantscope.calibration.choice.sensitivity import fallback_curve, layer_sensitivity
    from quantscope.calibration.results.apply import qdq_tensor
    from quantscope.calibration.structure import moe

    model, data = mixtral()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = [n for n, _ in model.named_modules()]
    base = calibrate(model, data, "w8a8", progress=False)
    kept = calibrate(model, data, "w8a8", outliers=Outliers(keep_float=1, fallback="float"),
                     progress=False)
    assert [n for n, _ in model.named_modules()] == names
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not any("forward" in m.__dict__ for m in model.modules())

    static = [layer for layer, rs in base.states.items() if "input" in rs]
    xs = {}
    with moe.attach(model, count=False), torch.no_grad():
        hooks = [model.get_submodule(layer).register_forward_pre_hook(
            lambda m, a, layer=layer: xs.setdefault(layer, []).append(a[0].reshape(
                -1, a[0].shape[-1]))) for layer in static]
        model(data[0])
        for h in hooks:
            h.remove()
        errs, macs = {}, {layer: model.get_submodule(layer).weight.numel() for layer in static}
        for layer, x in xs.items():
            x, w = torch.cat(x), model.get_submodule(layer).weight.double()
            y = x.double() @ w.T
            q = qdq_tensor(x, base.states[layer]["input"]).double() @ w.T
            errs[layer] = float((q - y).square().sum() / y.square().sum())
    top = max(errs, key=errs.get)
    assert ".experts." in top  # the case the views are needed for
    # the experts module's down inputs fall back whole: vLLM's fused MoE holds one w2 scale
    unit = [f"{top.rsplit('.', 2)[0]}.{e}.{top.rsplit('.', 1)[1]}" for e in range(4)]
    assert kept.info["keep_float"]["tensors"] == [f"{layer} input" for layer in unit]
    assert kept.info["keep_float"]["n"] == 1
    assert all("input" not in kept.states[layer] for layer in unit)
    assert "input" in base.states[top]
    # applied: the fallen-back layer's input reaches it unquantized (its weight QDQ'd)
    seen = {}
    with kept.apply(model), torch.no_grad():
        view = model.get_submodule(top)
        pre = view.register_forward_pre_hook(lambda m, a: seen.update(x=a[0]), prepend=True)
        post = view.register_forward_hook(lambda m, a, y: seen.update(y=(a[0], y)))
        model(data[0])
        pre.remove()
        post.remove()
        assert torch.equal(seen["y"][0], seen["x"])
        assert torch.equal(seen["y"][1], F.linear(seen["x"], view.weight))
    # the ranking and the fallback curve, called directly, reach the expert layers too
    sens = layer_sensitivity(model, data[:1], base, roles=("input",))
    assert sens.top(1) == [(top, "input")]
    (row,) = fallback_curve(model, base, sens, lambda m: 0.0, ns=(1,))
    assert row["float_macs_pct"] == round(
        100 * sum(macs[layer] for layer in unit) / sum(macs.values()), 2)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert [n for n, _ in model.named_modules()] == names


def test_model_metric_sees_a_hugging_face_regression_head():
    # found by probing: num_labels=1 logits took the KL branch, where one class's
    # log-softmax is 0 whatever the model does: every candidate scored 0
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                  num_attention_heads=4, intermediate_size=64, num_labels=1)
    model = transformers.BertForSequenceClassification(cfg).eval()
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 100, (8, 12), generator=g)}
    calib = calibrate(model, [batch], "w8a8", progress=False)
    with torch.no_grad():
        ref = model(**batch).logits.double().flatten()
        with apply(model, calib.states):
            q = model(**batch).logits.double().flatten()
    want = 1 - float(torch.dot(q, ref) / (q.norm() * ref.norm()))
    assert want > 0
    assert OutputDivergence(model, [batch]).of(calib.states) == pytest.approx(want, rel=1e-6)


def test_imatrix_rows_keep_the_weights_the_search_left():
    """A configuration whose imatrix weights auto keeps reports every quantized weight: the
    searched ones with their new rows, those the search cannot take (a convolution) with the
    base configuration's (their rows were dropped: 20 tensors quantized, 18 rows)."""
    from torch import nn

    from quantscope.calibration.choice.importance import imatrix_config, imatrix_rows

    class ConvThenLinear(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.fc = nn.Conv1d(8, 8, 3, padding=1), nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(self.conv(x).transpose(1, 2))

    torch.manual_seed(0)
    model = ConvThenLinear().eval()
    batches = [torch.randn(2, 8, 10) for _ in range(2)]
    base = calibrate(model, batches, preset("w8a8", targets=["Conv1d", "Linear"]),
                     progress=False)
    imp = {"fc": torch.rand(8) + 0.1}
    got = imatrix_config(model, base, imp)
    assert got.states["fc"]["weight"].observer == "imatrix"
    assert got.states["conv"]["weight"] is base.states["conv"]["weight"]
    rows = {r["layer"]: r for r in imatrix_rows(model, got, base)}
    assert sorted(rows) == ["conv", "fc"] and rows["fc"]["observer"] == "imatrix"
    assert rows["conv"] == next(r for r in base.stats
                                if r["layer"] == "conv" and r["role"] == "weight")


@pytest.mark.parametrize("candidates", [("minmax", "mse"), ("mse", "minmax")])
def test_auto_keeps_the_first_listed_candidate_on_a_tie(candidates):
    """``auto`` keeps the candidate of least error, the first listed where errors tie (a
    later one must do strictly better): fp8 per-channel weights whose rows reach 448 and
    hold values e4m3 represents are exact under min-max's scale 448 / 448 = 1 and under the
    MSE search's (which tries that range too), so both price 0 and the first candidate's
    weight observer is kept."""
    model = nn.Linear(8, 4, bias=False)
    with torch.no_grad():
        row = torch.tensor([448.0, -448.0, 16.0, -6.0, 3.0, 0.5, -0.25, 0.0])
        model.weight.copy_(torch.stack([row.roll(i) for i in range(4)]))
    recipe = quantscope.calibration.Recipe((quantscope.calibration.Rule(
        ("Linear",), weight=quantscope.calibration.Role(presets.FP8_PER_CHANNEL, "auto")),))
    calib = calibrate(nn.Sequential(model), [torch.randn(4, 8)], recipe, progress=False,
                      auto=quantscope.calibration.Auto(metric="tensor", candidates=candidates))
    state = calib.states["0"]["weight"]
    assert torch.equal(fake_quantize(model.weight, state.qparams, state.spec), model.weight)
    assert state.observer == f"memoryless_{candidates[0]}"
