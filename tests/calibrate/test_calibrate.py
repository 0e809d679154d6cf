"""Model-level calibration on a small model built here: hooks, QDQ, report, save / load, errors."""

import math

import pytest
import torch
from torch import nn

import quantscope
from quantscope import QuantSpec, fake_quantize, qparams_from_range
from quantscope.calibration import (
    PRESETS,
    Recipe,
    Role,
    Rule,
    calibrate,
    calibrate_many,
    load,
    preset,
)
from quantscope.calibration.recipe import KV_PRESETS
from quantscope.layout import Channel, Group, Tensor, Token


class Tiny(nn.Module):
    def __init__(self, d=128, h=256):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.act = nn.GELU()
        self.down = nn.Linear(h, d)
        self.head = nn.Linear(d, 8)

    def forward(self, x):
        return self.head(self.down(self.act(self.up(x))))


def make(seed=0, d=128, h=256):
    torch.manual_seed(seed)
    m = Tiny(d, h).eval()
    batches = []
    for _ in range(4):
        x = torch.randn(2, 6, d)
        x[..., 3] *= 20  # an outlier channel, as real activations have
        batches.append(x)
    return m, batches


def no_hooks(model):
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def same_state(model, snap):
    sd = model.state_dict()
    return sd.keys() == snap.keys() and all(torch.equal(sd[k], snap[k]) for k in snap)


# ------------------------------------------------------------------------- calibration
def test_package_is_callable_and_a_namespace():
    m, b = make()
    c = quantscope.calibrate(m, b, "w8a8", progress=False)
    assert set(c.states) == {"up", "down", "head"}
    assert quantscope.calibrate.load is load


def test_hooks_removed_and_model_untouched():
    m, b = make()
    snap = snapshot(m)
    m.train()
    calibrate(m, b, "w8a8", progress=False)
    assert no_hooks(m) and same_state(m, snap)
    assert m.training  # mode restored


def test_hooks_removed_when_a_batch_fails():
    m, b = make()
    bad = b[:2] + [torch.randn(2, 6, 7)]  # wrong width: the sample (or Linear) raises mid-pass
    with pytest.raises((RuntimeError, ValueError), match="width|shape"):
        calibrate(m, bad, "w8a8", progress=False)
    assert no_hooks(m)


def test_static_minmax_qparams_equal_direct_formula():
    m, b = make()
    c = calibrate(m, b, "w8a8", observer="static_minmax", progress=False)
    w = m.up.weight
    wspec, aspec = PRESETS["w8a8"]("x").weight.spec, PRESETS["w8a8"]("x").input.spec
    wq = qparams_from_range(w.amin(1), w.amax(1), wspec)
    st = c.states["up"]["weight"]
    assert st.observer == "static_minmax"  # observed once: the same as memoryless
    mm = calibrate(m, b, "w8a8", observer="minmax", progress=False).states["up"]
    assert mm["weight"].observer == "memoryless_minmax"  # weights take the memoryless variant
    assert mm["input"].observer == "minmax"
    assert torch.equal(st.qparams.scale.flatten(), wq.scale)
    x = torch.cat(b)
    aq = qparams_from_range(x.min().reshape(1), x.max().reshape(1), aspec)
    assert torch.equal(c.states["up"]["input"].qparams.scale.flatten(), aq.scale)


def test_qdq_output_equals_direct_computation_and_is_reversible():
    m, b = make()
    c = calibrate(m, b, "w8a8", observer="static_minmax", progress=False)
    x = b[0]
    snap = snapshot(m)
    ref = m(x)

    def fq_linear(layer, inp):
        st = c.states[layer]["weight"], c.states[layer]["input"]
        lin = getattr(m, layer)
        wq = fake_quantize(lin.weight, st[0].qparams, st[0].spec)
        return nn.functional.linear(fake_quantize(inp, st[1].qparams, st[1].spec), wq, lin.bias)

    with torch.no_grad():
        expect = fq_linear("head", fq_linear("down", m.act(fq_linear("up", x))))
    with c.apply(m) as handle:
        assert handle.active
        got = m(x)
        with pytest.raises(ValueError, match="already has quantscope QDQ"):
            c.apply(m)
    assert torch.equal(got, expect)
    assert not torch.equal(got, ref)
    assert no_hooks(m) and same_state(m, snap)
    assert torch.equal(m(x), ref)


@pytest.mark.parametrize("inner_first", [False, True])
def test_apply_refuses_a_weight_another_apply_holds(inner_first):
    """A model nested in an applied one (or holding one) took the fake-quantized weights for
    the float ones: removing in the order applied lost the float weights."""
    inner = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))
    outer = nn.Sequential(inner, nn.Linear(8, 4))
    x = [torch.randn(4, 16, generator=torch.Generator().manual_seed(0))]
    c_inner, c_outer = (calibrate(m, x, "w8a8", progress=False) for m in (inner, outer))
    snap = {k: v.clone() for k, v in outer.state_dict().items()}
    first, second = ((c_inner, inner), (c_outer, outer))[::1 if inner_first else -1]
    handle = first[0].apply(first[1])
    with pytest.raises(ValueError, match=r"0\.weight is already fake-quantized by another"):
        second[0].apply(second[1])
    handle.remove()
    assert same_state(outer, snap) and no_hooks(outer)  # the refused one left nothing
    with second[0].apply(second[1]):  # once the first is removed
        pass
    assert same_state(outer, snap)


def test_dynamic_per_token_qdq():
    m, b = make()
    c = calibrate(m, b, "w8a8-dynamic", progress=False)
    st = c.states["up"]["input"]
    assert st.dynamic is True and st.qparams is None
    x = b[1]
    spec = QuantSpec("int8", Token())
    qp = qparams_from_range(x.amin(-1), x.amax(-1), spec).reshape(2, 6, 1)
    w = c.states["up"]["weight"]
    expect = nn.functional.linear(fake_quantize(x, qp, spec),
                                  fake_quantize(m.up.weight, w.qparams, w.spec), m.up.bias)
    captured = {}
    with c.apply(m):
        h = m.up.register_forward_hook(lambda mod, a, out: captured.setdefault("up", out))
        with torch.no_grad():
            m(x)
        h.remove()
    assert torch.equal(captured["up"], expect)


def test_weights_need_no_data():
    m, _ = make()
    c = calibrate(m, [], "w4a16", progress=False)
    assert set(c.states["up"]) == {"weight"}
    assert c.info["batches"] == 0


def test_calibrate_many_shares_one_pass_and_matches_single_runs():
    m, b = make()
    many = calibrate_many(m, b, {"a": preset("w8a8", "minmax"), "b": preset("w4a8", "minmax"),
                                 "c": preset("w8a8", "static_minmax")}, progress=False)
    for label, (name, obs) in {"a": ("w8a8", "minmax"), "b": ("w4a8", "minmax"),
                               "c": ("w8a8", "static_minmax")}.items():
        one = calibrate(m, b, name, observer=obs, progress=False)
        for layer, roles in one.states.items():
            for role, st in roles.items():
                assert torch.equal(st.qparams.scale, many[label].states[layer][role].qparams.scale)
    assert many["a"].info["batches"] == len(b)


CANDS = ["minmax", "static_minmax", "mse", "percentile", "entropy"]


def _auto_runs(metric):
    m, b = make()
    cands = [o for o in CANDS if o in quantscope.list_observers()]
    plan = {o: preset("w4a8", o) for o in cands}
    plan["auto"] = preset("w4a8", "auto")
    runs = calibrate_many(m, b, plan, candidates=cands, sample_tokens=10_000, progress=False,
                          auto_metric=metric)
    return m, b, cands, runs


def test_auto_tensor_metric_picks_the_highest_sqnr():
    _, _, cands, runs = _auto_runs("tensor")
    rows = {(r["layer"], r["role"]): r for r in runs["auto"].stats}
    for key, row in rows.items():
        best = max(next(r for r in runs[o].stats if (r["layer"], r["role"]) == key)["sqnr_db"]
                   for o in cands)
        assert row["sqnr_db"] == best
        assert row["requested"] == "auto"


def test_auto_output_metric_picks_the_lowest_layer_output_error():
    m, b, cands, runs = _auto_runs("output")
    x = torch.cat(b).reshape(-1, 128)  # every input row of 'up' (sample_tokens keeps all)
    w = m.up.weight.detach()

    def out_err(obs, role):
        st = runs[obs].states["up"][role]
        if role == "input":
            return float(((fake_quantize(x, st.qparams, st.spec) - x) @ w.T).square().sum())
        return float((x @ (fake_quantize(w, st.qparams, st.spec) - w).T).square().sum())

    for role in ("weight", "input"):
        errs = {o: out_err(o, role) for o in cands}
        chosen = runs["auto"].states["up"][role]
        best = min(errs.values())
        assert out_err("auto", role) == pytest.approx(best, rel=1e-5)
        assert chosen.requested == "auto" and chosen.observer != "auto"


# ------------------------------------------------------------------------------ report
def test_tensor_stats_leave_the_tensor_as_it_was():
    # the error is made in place on fake_quantize's output, never on x's memory
    from quantscope.calibration.results.report import tensor_stats

    m, b = make()
    c = calibrate(m, b, "w8a8", observer="static_minmax", progress=False)
    st = c.states["up"]["weight"]
    for w in (m.up.weight.detach(), m.up.weight.detach().bfloat16()):
        kept = w.clone()
        got = tensor_stats(w, st)
        assert torch.equal(w, kept)
        err = fake_quantize(w, st.qparams, st.spec).float() - w.float()
        # summed in float64 (a float32 sum overflows for large finite values)
        assert got["noise"] == pytest.approx(float(err.double().square().sum()), rel=1e-12)
        assert got["signal"] == pytest.approx(float(w.double().square().sum()), rel=1e-12)


def test_report_values_equal_direct_computation():
    m, b = make()
    c = calibrate(m, b, "w8a8", observer="static_minmax", sample_tokens=10_000,
                  progress=False)  # keeps every activation row: stats over all of them
    rows = {(r["layer"], r["role"]): r for r in c.report().rows}
    for layer in ("up", "down"):
        st = c.states[layer]["weight"]
        w = getattr(m, layer).weight.detach()
        err = fake_quantize(w, st.qparams, st.spec) - w
        sqnr = 10 * math.log10(float(w.square().sum()) / float(err.square().sum()))
        assert rows[(layer, "weight")]["sqnr_db"] == pytest.approx(sqnr, rel=1e-6)
        # clipped: the code rounding gives (half to even) is past [-128, 127]; min-max's
        # positive absmax is 127.5 steps, rounds to 128 and is clipped, its negative is not
        code = torch.round(w / st.qparams.scale)  # scale [out, 1]
        clipped = ((code < -128) | (code > 127)).float().mean()
        assert rows[(layer, "weight")]["clipped"] == pytest.approx(float(clipped))
        assert rows[(layer, "weight")]["lo"] == pytest.approx(float(w.min()))
    x = torch.cat(b)
    st = c.states["up"]["input"]
    err = fake_quantize(x, st.qparams, st.spec) - x
    r = rows[("up", "input")]
    assert r["sqnr_db"] == pytest.approx(10 * math.log10(float(x.square().sum())
                                                         / float(err.square().sum())), rel=1e-5)
    code = torch.round(x / st.qparams.scale)
    assert r["clipped"] == pytest.approx(float(((code < -128) | (code > 127)).float().mean()))
    assert r["numel"] == x.numel()
    summary = c.report().summary
    assert summary["weight"]["layers"] == 3
    assert summary["input"]["mean_sqnr_db"] == pytest.approx(
        sum(rows[(n, "input")]["sqnr_db"] for n in ("up", "down", "head")) / 3)


def test_report_clipped_is_what_rounding_alone_would_not_give():
    # found by probing: fp8 min-max weights were reported clipped, though min-max covers
    # every value (448 x scale in float32 is 1 ulp below some channels' absmax)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256)).eval()
    x = torch.randn(1024, 64)  # enough values that percentile (99.99 %) clips some
    # past the range by more than rounding: int8 codes beyond [-128.5, 127.5]; fp8 e4m3's
    # beyond 464, half way from 448 to 480 (its step there is 32)
    for recipe, past in (("fp8", lambda u: u.abs() > 464),
                         ("w8a8", lambda u: (u > 127.5) | (u < -128.5))):
        calib = calibrate(model, [x], preset(recipe, "percentile"), sample_tokens=10_000,
                          progress=False)
        rows = {r["role"]: r for r in calib.report().rows}
        if recipe == "fp8":  # min-max weights (int8's positive absmax is 127.5 steps: clipped)
            assert rows["weight"]["clipped"] == 0
        n = int(past(x.double() / calib.states["0"]["input"].qparams.scale.double()).sum())
        assert rows["input"]["numel"] == x.numel() and n > 0
        assert rows["input"]["clipped"] * x.numel() == n, recipe


def test_report_markdown_and_json(tmp_path):
    import json

    m, b = make()
    rep = calibrate(m, b, "w8a8", progress=False).report({"accuracy": 0.5})
    rep.to_json(tmp_path / "r.json")
    rep.to_markdown(tmp_path / "r.md")
    d = json.loads((tmp_path / "r.json").read_text())
    assert len(d["layers"]) == 6 and d["metrics"]["accuracy"] == 0.5
    assert "| up | weight |" in (tmp_path / "r.md").read_text()


# -------------------------------------------------------------------------- save / load
# (fp8-kv is fp8 plus the KV cache of attention modules, which make() has none of:
# tests/calibrate/test_kv_cache.py round-trips it)
@pytest.mark.parametrize("name", sorted(set(PRESETS) - set(KV_PRESETS)))
def test_save_load_round_trip_exact(tmp_path, name):
    m, b = make()
    c = calibrate(m, b, name, progress=False)
    c.save(tmp_path / "q")
    back = load(tmp_path / "q")
    x = b[2]
    with c.apply(m):
        a = m(x)
    with back.apply(m):
        y = m(x)
    assert torch.equal(a, y)
    for layer, roles in c.states.items():
        for role, st in roles.items():
            other = back.states[layer][role]
            assert other.spec == st.spec and other.dynamic == st.dynamic
            if st.qparams is not None:
                assert torch.equal(other.qparams.scale, st.qparams.scale)
                assert torch.equal(other.qparams.zero_point, st.qparams.zero_point)
    assert back.recipe == c.recipe


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load(tmp_path / "nothing")


def test_apply_to_another_model_fails_cleanly():
    m, b = make()
    c = calibrate(m, b, "w8a8", progress=False)
    other, _ = make(seed=1)
    other.head = nn.Linear(128, 9)  # up and down get applied before head fails: all undone
    snap = snapshot(other)
    with pytest.raises(ValueError, match=r"head.weight has shape \(9, 128\)"):
        c.apply(other)
    assert no_hooks(other) and same_state(other, snap)


# ----------------------------------------------------------------------------- recipes
def test_recipe_targets_ignore_and_regex():
    m, b = make()
    r = preset("w8a8", ignore=["head"])
    assert set(r.match(m)) == {"up", "down"}
    custom = Recipe((Rule(("re:(up|down)",), weight=Role(QuantSpec("int8", Channel(0)),
                                                         "minmax")),
                     Rule(("Linear",), input=Role(QuantSpec("int8", Tensor()), "minmax"))))
    c = calibrate(m, b, custom, progress=False)
    assert set(c.states["up"]) == {"weight"} and set(c.states["head"]) == {"input"}
    assert Recipe.from_dict(custom.to_dict()) == custom


@pytest.mark.parametrize(("targets", "ignore"), [
    (["Linear"], ["re:.*mlp.gate"]), (["Linear"], ["re:layers.0.self_attn"]),
    (["re:.*proj", "re:layers.0.mlp.gate$"], []), (["re:.*mlp\\."], ["re:.*up"])])
def test_regex_targets_and_ignores_match_from_the_start_as_compressed_tensors(targets, ignore):
    """``re:`` patterns as llm-compressor users write them select the modules
    compressed-tensors does: ``re.match`` (anchored at the start only), not ``re.fullmatch``."""
    match = pytest.importorskip("compressed_tensors.utils.match")

    def layer():
        mlp, attn, block = nn.Module(), nn.Module(), nn.Module()
        mlp.gate, mlp.gate_proj, mlp.up_proj = nn.Linear(8, 4), nn.Linear(8, 8), nn.Linear(8, 8)
        attn.q_proj = nn.Linear(8, 8)
        block.mlp, block.self_attn = mlp, attn
        return block
    m = nn.Module()
    m.layers = nn.ModuleList([layer()])
    want = sorted(n for n, _ in match.match_named_modules(m, targets, ignore))
    rule = Rule(tuple(targets), weight=Role(QuantSpec("int8", Channel(0)), "memoryless_minmax"))
    assert sorted(Recipe(rule, ignore).match(m)) == want


# --------------------------------------------------------------------------- bad input
def test_recipe_matching_nothing():
    m, b = make()
    with pytest.raises(ValueError, match=r"no module matches targets \['Conv2d'\]"):
        calibrate(m, b, preset("w8a8", targets=["Conv2d"]), progress=False)
    assert no_hooks(m)


def test_empty_calibration_data():
    m, _ = make()
    with pytest.raises(ValueError, match="batches is empty"):
        calibrate(m, [], "w8a8", progress=False)
    assert no_hooks(m)
    with pytest.raises(ValueError, match="batches is empty"):
        calibrate(m, iter(()), "w4a8", progress=False)
    assert no_hooks(m)


def test_group_size_that_does_not_divide():
    m, b = make(d=96, h=256)
    with pytest.raises(ValueError, match=r"layer 'up' weight of shape \(256, 96\).*does not "
                                         r"divide 96"):
        calibrate(m, b, "w4a16", progress=False)
    assert no_hooks(m)


def test_other_bad_input():
    m, b = make()
    with pytest.raises(ValueError, match="unknown preset 'w3a3'"):
        calibrate(m, b, "w3a3", progress=False)
    with pytest.raises(ValueError, match="unknown observer 'nope'"):
        calibrate(m, b, "w8a8", observer="nope", progress=False)
    token = Recipe(Rule(("Linear",), input=Role(QuantSpec("int8", Token()), "minmax")))
    with pytest.raises(ValueError, match="static activation qparams need"):
        calibrate(m, b, token, progress=False)
    group = Recipe(Rule(("Linear",), input=Role(QuantSpec("int4", Group(64)), "minmax", True)))
    with pytest.raises(ValueError, match="layer 'head' input of width 128|layer 'up'"):
        calibrate(m, b, Recipe(Rule(("Linear",), weight=Role(QuantSpec("int4", Group(48)),
                                                              "minmax"))), progress=False)
    assert calibrate(m, b, group, progress=False).states["up"]["input"].dynamic is True
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        calibrate("model", b, "w8a8")
    assert no_hooks(m)


def test_observer_error_during_pass_names_layer_and_leaves_no_hooks():
    m, b = make()
    bad = [b[0], torch.full((2, 6, 128), float("nan"))]
    with pytest.raises(ValueError, match="NaN"):
        calibrate(m, bad, "w8a8", progress=False)
    assert no_hooks(m)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda():
    m, b = make()
    m = m.cuda()
    b = [x.cuda() for x in b]
    c = calibrate(m, b, "w8a8", observer="auto", progress=False)
    with c.apply(m):
        y = m(b[0])
    assert y.is_cuda and no_hooks(m)


def test_output_role_and_asymmetric_activations():
    m, b = make()
    spec = QuantSpec("uint8", Tensor(), symmetric=False)
    recipe = Recipe(Rule(("up",), output=Role(spec, "static_minmax")))
    c = calibrate(m, b, recipe, progress=False)
    outs = torch.cat([m.up(x) for x in b]).detach()
    qp = qparams_from_range(outs.min().reshape(1), outs.max().reshape(1), spec)
    st = c.states["up"]["output"]
    assert torch.equal(st.qparams.scale.flatten(), qp.scale)
    assert torch.equal(st.qparams.zero_point.flatten(), qp.zero_point)
    x = b[0]
    with torch.no_grad():
        expect = m.head(m.down(m.act(fake_quantize(m.up(x), st.qparams, spec))))
        with c.apply(m):
            assert torch.equal(m(x), expect)
    assert no_hooks(m)


def test_each_recipe_is_timed_as_the_shared_pass_plus_its_own_observers(monkeypatch):
    """One pass calibrates several recipes: each one's ``calibration_seconds`` counts the
    pass's shared time and its own observers only (auto: every candidate's, once).

    The calibration modules read a fake clock that moves only when the slow observer
    "naps", so the accounting is checked exactly, whatever the machine's load."""
    import importlib
    import types

    from quantscope.calibration import calibrate_many, preset
    from quantscope.observers.registry import observer_class

    now = [0.0]
    clock = types.SimpleNamespace(perf_counter=lambda: now[0])
    for name in ("choice.auto", "run.finish", "run.observe", "choice.sensitivity", "run.session"):
        module = importlib.import_module(f"quantscope.calibration.{name}")
        monkeypatch.setattr(module, "time", clock)
    slow, calls, nap = observer_class("mse"), [], 0.05
    real = slow.forward

    def forward(self, x):  # an mse observer that takes nap seconds longer per tensor
        calls.append(1)
        now[0] += nap
        return real(self, x)

    monkeypatch.setattr(slow, "forward", forward)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    batches = [torch.randn(4, 8) for _ in range(3)]
    groups = {"both": ["minmax", "mse"]}
    cal = calibrate_many(model, batches, {"minmax": preset("w8a8", "minmax"),
                                          "mse": preset("w8a8", "mse"),
                                          "auto": preset("w8a8", "auto")},
                         candidates=["minmax", "mse"], auto_metric="tensor", progress=False,
                         time_groups=groups)
    t = {k: c.info["calibration_seconds"] for k, c in cal.items()}
    slept = nap * len(calls)  # the input observers' calls (mse weights are another class)
    assert len(calls) == 2 * len(batches)
    # the naps are mse's alone, counted once (min-max's time holds none of them)
    assert t["minmax"] == 0.0
    assert t["mse"] == pytest.approx(slept) and t["auto"] == pytest.approx(slept)
    # a group of recipes: every observer it uses once (the naps once, not per recipe)
    both = cal["minmax"].info["group_seconds"]["both"]
    assert cal["mse"].info["group_seconds"] == {"both": both}
    assert "group_seconds" not in cal["auto"].info and groups == {"both": ["minmax", "mse"]}
    assert both == pytest.approx(slept)
    # auto by the model's output: its candidates timed as one group, then its choice
    calls.clear()
    cal = calibrate_many(model, batches, {"minmax": preset("w8a8", "minmax"),
                                          "auto": preset("w8a8", "auto")},
                         candidates=["minmax", "mse"], progress=False)
    t = {k: c.info["calibration_seconds"] for k, c in cal.items()}
    assert "group_seconds" not in cal["auto"].info
    assert len(calls) == 2 * len(batches)  # mse observed once per batch, for auto alone
    assert t["minmax"] == 0.0 and t["auto"] == pytest.approx(nap * len(calls))
