"""What a calibration says when it cannot go on (issue 37): a NaN / inf batch names the layer,
the role and the batch; a recipe that cannot apply to the model fails before any forward."""

import pytest
import torch
from torch import nn

from quantscope.calibration import calibrate, calibrate_many, preset, qdq_tensor


def _mlp(width_in=16, hidden=32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width_in, hidden), nn.ReLU(), nn.Linear(hidden, 8))


@pytest.mark.parametrize("bad_batch", [0, 2, 3])
def test_a_nan_batch_names_layer_role_and_batch(bad_batch):
    batches = [torch.randn(4, 16) for _ in range(4)]
    batches[bad_batch][1, 5] = float("nan")
    with pytest.raises(ValueError) as e:
        calibrate(_mlp(), batches, "w8a8", progress=False)
    msg = str(e.value)
    assert "layer '0' input" in msg and f"calibration batch {bad_batch} " in msg, msg


def test_inf_made_inside_the_model_names_the_layer_it_reached():
    """Finite batches, but the first layer overflows on batch 1: the second layer's input is
    where the observer sees inf, and the message says so."""
    model = _mlp()
    with torch.no_grad():
        model[0].weight.fill_(1.0)
    batches = [torch.randn(4, 16) for _ in range(3)]
    batches[1] = batches[1].abs() * 1e38  # finite; sixteen of them summed are not
    assert all(bool(torch.isfinite(b).all()) for b in batches)
    with pytest.raises(ValueError) as e:
        calibrate(model, batches, "w8a8", progress=False)
    assert "layer '2' input: calibration batch 1 " in str(e.value), str(e.value)


def test_each_observer_of_a_layer_counts_its_own_batches():
    """Two recipes share one pass; both stop at the first batch with NaN, not later."""
    batches = [torch.randn(4, 16) for _ in range(5)]
    batches[3][0, 0] = float("inf")
    with pytest.raises(ValueError, match="calibration batch 3 "):
        calibrate_many(_mlp(), batches, {"a": preset("w8a8"), "b": preset("w8a8", "mse")},
                       progress=False)


class _NoForward(nn.Module):
    """Layers of real shapes whose forward must never run."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(96, 64)
        self.down = nn.Linear(64, 96)

    def forward(self, x):
        raise AssertionError("a forward ran before the recipe was checked against the model")


@pytest.mark.parametrize("options", [{}, {"smooth": 0.5}, {"keep_float": 1},
                                     {"auto_metric": "fisher", "observer": "auto"}])
def test_a_recipe_that_cannot_apply_fails_before_any_forward(options):
    """Group size 128 divides neither 96 nor 64: said before any batch (or SmoothQuant's,
    fisher's, the fallback ranking's forward) runs."""
    recipe = preset("w4a16", **({"observer": options.pop("observer")}
                                if "observer" in options else {}))
    from quantscope.calibration import recipe as R

    recipe = R.with_group_size(recipe, 128)
    with pytest.raises(ValueError, match=r"layer '(up|down)' weight of shape .* cannot take"):
        calibrate(_NoForward(), [torch.randn(2, 96)], recipe, progress=False, **options)


def test_a_static_activation_layout_that_cannot_apply_fails_before_any_forward():
    from dataclasses import replace

    from quantscope.spec import QuantSpec

    recipe = preset("w8a8")
    rules = tuple(replace(r, input=replace(r.input, spec=QuantSpec("int8", "group:128")))
                  for r in recipe.rules)
    with pytest.raises(ValueError, match="layer '(up|down)' input"):
        calibrate(_NoForward(), [torch.randn(2, 96)], replace(recipe, rules=rules),
                  progress=False)


def test_a_ranks_shard_names_the_batch_by_its_place_among_all():
    """Under torchrun a rank forwards batches rank, rank + world, ...: the error names the
    batch the user passed (rank 1 of 2: its third batch is batch 5)."""
    from quantscope.calibration.run.observe import make_plan, observe_batches

    model = _mlp()
    slots, _ = make_plan(model, {"r": preset("w8a8")}, None)
    batches = [torch.randn(4, 16) for _ in range(3)]
    batches[2][0, 0] = float("nan")
    with pytest.raises(ValueError, match="calibration batch 5 "):
        observe_batches(model, batches, slots, 64, False, 0, batch_index=lambda i: 2 * i + 1)


def test_time_groups_naming_no_recipe_fail_before_any_forward():
    from quantscope.calibration import Runtime

    with pytest.raises(ValueError, match=r"Runtime\.time_groups\['g'\] names 'nope'.*\['w8a8'\]"):
        calibrate(_NoForward(), [torch.randn(2, 96)], "w8a8", progress=False,
                  runtime=Runtime(time_groups={"g": ["w8a8", "nope"]}))


def test_recipes_of_one_name_are_refused_not_dropped():
    """A list is labelled by name: the second ``w8a8`` would replace the first."""
    with pytest.raises(ValueError, match="two recipes are named 'w8a8'"):
        calibrate_many(_NoForward(), [torch.randn(2, 96)],
                       [preset("w8a8"), preset("w8a8", "percentile")], progress=False)


def _weight_rule(targets=("Linear",)):
    from quantscope.calibration import Role, Rule
    from quantscope.spec import QuantSpec

    return Rule(targets, weight=Role(QuantSpec("int8", "channel:0"), "memoryless_minmax"))


def _recipe(**fields):
    from quantscope.calibration import Recipe

    return Recipe(_weight_rule(), **fields)


def test_a_recipe_file_reads_a_string_as_one_pattern_as_recipe_does():
    from quantscope.calibration import Recipe

    d = {"rules": [dict(_weight_rule().to_dict(), targets="Linear")],
         "ignore": "model.layers.0.mlp.down_proj", "split": "*.k_proj", "fuse": "*.[qkv]_proj"}
    made = Recipe(_weight_rule("Linear"), ignore="model.layers.0.mlp.down_proj",
                  split="*.k_proj", fuse="*.[qkv]_proj")
    assert Recipe.from_dict(d) == made
    assert (made.ignore, made.split, made.fuse, made.rules[0].targets) == (
        ("model.layers.0.mlp.down_proj",), ("*.k_proj",), (("*.[qkv]_proj",),), ("Linear",))
    assert Recipe.from_dict(made.to_dict()) == made


@pytest.mark.parametrize(("make", "said"), [
    (lambda: preset("w8a8", targets=[nn.Linear]), r"Rule\.targets .*by name: 'Linear'"),
    (lambda: preset("w8a8", ignore=[nn.ReLU]), r"Recipe\.ignore .*'ReLU'"),
    (lambda: _weight_rule([1]), r"Rule\.targets must hold strings"),
    (lambda: _weight_rule(5), r"Rule\.targets must be a pattern string or a list"),
    (lambda: _weight_rule(None), r"Rule\.targets must name at least one"),
    (lambda: _recipe(split=3), r"Recipe\.split must be a pattern string or a list"),
    (lambda: _weight_rule({"Linear": 1}), r"Rule\.targets must be a pattern string .*'Linear'"),
    (lambda: _recipe(ignore={"lm_head": True}), r"Recipe\.ignore must be a pattern string"),
    (lambda: _recipe(fuse=[("*.q_proj", nn.Linear)]), r"Recipe\.fuse groups must hold"),
])
def test_targets_and_ignore_must_be_strings(make, said):
    with pytest.raises(ValueError, match=said):
        make()


def test_no_ignore_list_is_none():
    assert preset("w8a8", ignore=None) == preset("w8a8")


@pytest.mark.parametrize(("options", "said"), [
    (5, " must be a mapping"), ("abc", " must be a mapping"), ([("a", 1, 2)], " must be a mapping"),
    ({1: 0.5}, ": keyword names must be strings"),
    ({"averaging_constant": {0.5}}, r"\['averaging_constant'\] must be hashable"),
    ({"averaging_constant": [{"a": 1}]}, r"\['averaging_constant'\] must be hashable"),
])
def test_role_options_are_a_mapping_of_names_to_hashable_values(options, said):
    from quantscope.calibration import Role
    from quantscope.spec import QuantSpec

    with pytest.raises(ValueError, match=r"Role\.options" + said):
        Role(QuantSpec("int8"), "minmax", options=options)


def test_role_options_as_pairs_calibrate_as_the_mapping():
    from quantscope.calibration import Recipe, Role, Rule
    from quantscope.spec import QuantSpec

    pairs = Role(QuantSpec("int8"), "minmax", options=[("averaging_constant", 0.5)])
    mapping = Role(QuantSpec("int8"), "minmax", options={"averaging_constant": 0.5})
    assert pairs == mapping and pairs.options == (("averaging_constant", 0.5),)
    assert Role(QuantSpec("int8"), options=None).options == ()
    batches = [torch.randn(8, 16) for _ in range(3)]
    cal = calibrate(_mlp(), batches, Recipe(Rule(("Linear",), input=pairs)), progress=False)
    assert cal.states["0"]["input"].qparams is not None


def test_tuple_options_survive_json_and_save_load(tmp_path):
    """JSON (and YAML) hold a tuple as a list: from_dict reads lists back as tuples, nested ones
    too, so a saved calibration whose mix role has percentiles loads, and a file can give them."""
    import json

    from quantscope.calibration import Recipe, Role, Rule
    from quantscope.calibration.results.io import load
    from quantscope.spec import QuantSpec

    mix = Role(QuantSpec("int8"), "mix", options={"percentiles": (99.9, 99.99)})
    rec = Recipe(Rule(("Linear",), weight=Role(QuantSpec("int8", "channel"), "memoryless_minmax"),
                      input=mix))
    assert Recipe.from_dict(json.loads(json.dumps(rec.to_dict()))) == rec
    kinds = Role(QuantSpec("int8"), options={"a": ((1, 2.5), "x"), "b": None, "c": True, "d": 3})
    assert Role.from_dict(json.loads(json.dumps(kinds.to_dict()))) == kinds
    assert Role.from_dict(kinds.to_dict()) == kinds
    cal = calibrate(_mlp(), [torch.randn(8, 16) for _ in range(2)], rec, progress=False)
    cal.save(tmp_path / "cal")
    back = load(tmp_path / "cal")
    assert back.recipe == rec and back.quantizes_like(cal)
    for layer, roles in cal.states.items():  # the states' options too: tuples, as calibrated
        for role, state in roles.items():
            assert back.states[layer][role].options == state.options, (layer, role)


@pytest.mark.parametrize("dynamic", [1, 0, 1.0, 0.0, "true", None])
def test_role_dynamic_is_true_false_or_local_not_an_equal_number(dynamic):
    """1 == True, but calibration asks ``dynamic is True``: 1 was calibrated static."""
    from quantscope.calibration import Role
    from quantscope.spec import QuantSpec

    with pytest.raises(ValueError, match=r"Role\.dynamic must be one of \(False, True, 'local'\), "
                                         rf"got {dynamic!r}"):
        Role(QuantSpec("int8", "token"), "memoryless_minmax", dynamic)
    with pytest.raises(ValueError, match=r"Role\.dynamic must be one of"):
        Role.from_dict({"spec": {"format": "int8"}, "dynamic": dynamic})


_W = {"spec": {"format": "int8", "layout": "channel"}}


@pytest.mark.parametrize(("d", "said"), [
    ({"rules": [{"weight": _W}], "ignores": ["*mlp*"]}, r"Recipe: unknown key 'ignores'"),
    ({"rules": [{"weight": _W}], "kv-cache": "fp8"}, r"Recipe: unknown key 'kv-cache'"),
    ({"rules": [{"weight": _W}, {"weight": _W, "inputs": _W}]},
     (r"Recipe\.rules\[1\]: unknown key 'inputs'; the known keys are \['targets', 'weight', "
     r"'input', 'output'\]")),
    ({"rules": [{"input": {**_W, "option": {"averaging_constant": 0.5}}}]},
     (r"Recipe\.rules\[0\]\.input: unknown key 'option'; the known keys are \['spec', "
     r"'observer', 'dynamic', 'options'\]")),
    ({"rules": [{"weight": {"observer": "minmax"}}]}, r"Recipe\.rules\[0\]\.weight: missing key 'spec'"),
    ({"ignore": []}, r"Recipe: missing key 'rules'"),
    ({"rules": {"weight": _W}}, r"Recipe\.rules must be a list of rules, got dict"),
    ({"rules": ["Linear"]}, r"Recipe\.rules\[0\] must be a mapping with keys"),
])
def test_from_dict_refuses_unknown_and_missing_keys(d, said):
    from quantscope.calibration import Recipe

    with pytest.raises(ValueError, match=said):
        Recipe.from_dict(d)


def test_from_dict_keys_are_what_to_dict_writes_and_omitted_ones_take_the_defaults():
    from dataclasses import fields

    from quantscope.calibration import Recipe, Role, Rule
    from quantscope.spec import QuantSpec

    rec = preset("fp8-kv")
    for obj in (rec, rec.rules[0], rec.rules[0].weight):
        assert set(obj.to_dict()) == {f.name for f in fields(obj)}, type(obj).__name__
    assert Role.from_dict({"spec": {"format": "int8"}}) == Role(QuantSpec("int8"))
    assert Rule.from_dict({"input": {"spec": {"format": "int8"}}}) == Rule(
        input=Role(QuantSpec("int8")))
    assert Recipe.from_dict({"rules": [], "kv_cache": "fp8"}) == Recipe((), kv_cache="fp8")


# --- load: a scale of the right count but the wrong shape quantizes other units ---

def _group_calibration(tmp_path):
    from quantscope import Group, QuantSpec
    from quantscope.calibration import Recipe, Role, Rule

    recipe = Recipe((Rule(("Linear",), weight=Role(QuantSpec("int4", Group(32)), "minmax")),),
                    (), "int4-g32")
    cal = calibrate(_mlp(width_in=64), [torch.randn(4, 64) for _ in range(2)], recipe,
                    progress=False)
    cal.save(tmp_path / "cal")
    return cal, tmp_path / "cal" / "qparams.safetensors"


@pytest.mark.parametrize("reshape", [
    lambda t: t.T,                                   # (2, 32) for (32, 2)
    lambda t: t.reshape(-1),                         # (64,)
    lambda t: t.T.reshape(*t.T.shape, 1),            # (2, 32, 1)
], ids=["transposed", "flattened", "3d"])
def test_load_refuses_a_scale_of_the_right_count_but_another_shape(tmp_path, reshape):
    """Probe: load compared only the number of values; a transposed (2, 32) scale of a
    (32, 64) weight in groups of 32 loaded and its QDQ quantized other groups."""
    from safetensors.torch import load_file, save_file

    from quantscope.calibration import load

    cal, path = _group_calibration(tmp_path)
    assert tuple(cal.states["0"]["weight"].qparams.scale.shape) == (32, 64 // 32)
    tensors = load_file(path)
    for field in ("scale", "zero_point"):
        tensors[f"0/weight/{field}"] = reshape(tensors[f"0/weight/{field}"]).contiguous()
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"0/weight/scale: shape \(\d+(, \d+)*,?\), but "
                                         r"Group\(size=32.* on shape \(32, 64\) has scales "
                                         r"of shape \(32, 2\)"):
        load(tmp_path / "cal")


def test_load_takes_a_per_tensor_scale_stored_as_a_scalar(tmp_path):
    """One value per tensor is one value in either shape, () or (1,): both load, and QDQ
    is the same."""
    from safetensors.torch import load_file, save_file

    from quantscope.calibration import load

    model = _mlp()
    cal = calibrate(model, [torch.randn(4, 16) for _ in range(2)], "w8a8", progress=False)
    cal.save(tmp_path / "cal")
    path = tmp_path / "cal" / "qparams.safetensors"
    tensors = load_file(path)
    assert tensors["0/input/scale"].numel() == 1
    for field in ("scale", "zero_point"):
        tensors[f"0/input/{field}"] = tensors[f"0/input/{field}"].reshape(())
    save_file(tensors, path)
    back = load(tmp_path / "cal")
    x = torch.randn(4, 16)
    assert torch.equal(qdq_tensor(x, back.states["0"]["input"]),
                       qdq_tensor(x, cal.states["0"]["input"]))


def _nan_column(model, layer=0, column=3):
    """``model[layer]``'s output gets NaN in ``column`` (its next layer's input)."""
    def hook(module, args, out):
        out = out.clone()
        out[:, column] = float("nan")
        return out
    model[layer].register_forward_hook(hook)
    return model


def test_non_finite_ignore_reads_nan_as_zero_in_the_report_too():
    """observers.md: with ``non_finite="ignore"`` NaN / inf are read as zero, with a warning.
    The sample the report and the histogram read follows: the calibration completes."""
    import math

    model = _nan_column(_mlp())
    batch = torch.randn(8, 16)
    with torch.no_grad():
        x = torch.relu(model[0](batch)).nan_to_num(0.0)  # layer 2's input, NaN read as zero
    with pytest.warns(UserWarning, match="ignored 8 NaN / inf values"):
        c = calibrate(model, [batch], preset("w8a8", non_finite="ignore"), progress=False)
    # torch.ao's symmetric int8 scale: amax / ((qmax - qmin) / 2)
    assert torch.allclose(c.states["2"]["input"].qparams.scale, x.abs().max() / 127.5)
    assert all(math.isfinite(r["sqnr_db"]) for r in c.stats if r["role"] == "input")
    assert sum(c.histograms[("2", "input")]["counts"]) == x.numel()


def _overflowing(model):
    with torch.no_grad():
        model[0].weight[0].fill_(3e38)  # row 0 of layer 0's output overflows to inf
    return model


@pytest.mark.parametrize("recipe", ["w8a8-dynamic", "mxfp4"])
def test_a_dynamic_role_seeing_inf_names_the_layer(recipe):
    with pytest.raises(ValueError, match=r"calibrate: layer '2' input: calibration batch 0 "
                                         r"\(counting from 0\) brought NaN or inf values "
                                         r"\(dynamic role"):
        calibrate(_overflowing(_mlp(32)), [torch.rand(4, 32) + 0.1], recipe, progress=False)


@pytest.mark.parametrize("recipe", ["w8a8-dynamic", "mxfp4"])
def test_a_dynamic_role_passes_nan_through_at_run_time(recipe):
    """Run-time (per-token / per-block) qparams: a NaN row stays NaN, as in the float model,
    and the other rows are quantized as they would be without it."""
    model = _mlp(32)
    c = calibrate(model, [torch.randn(4, 32)], recipe, progress=False)
    x = torch.randn(4, 32)
    x[0, 0] = float("nan")
    with torch.no_grad(), c.apply(model):
        y, clean = model(x), model(x[1:])
    assert y[0].isnan().all()
    # (3 rows or 4: the Linears' sums may run in another order on some CPUs, AVX2; a code
    # off in the quantized rows is ~1e-2)
    torch.testing.assert_close(y[1:], clean, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("recipe, kind", [("w8a8-dynamic", "int"), ("fp8-dynamic", "float")])
def test_a_dynamic_token_holding_inf_is_nan_as_compressed_tensors_gives(recipe, kind):
    """A token holding +-inf at run time: its per-token scale is inf in the serving runtime
    (compressed-tensors' run-time QDQ gives NaN for the token); the applied model gave finite
    values ~6e37 instead (the inf range clamped to a finite scale), hiding the overflow. The
    other tokens are quantized as without it."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_qdq
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    model = _mlp(32)
    c = calibrate(model, [torch.randn(2, 4, 32)], recipe, progress=False)
    x = torch.randn(2, 3, 32)
    x[0, 1, 5], x[1, 2, 0] = float("inf"), -float("inf")
    args = QuantizationArgs(num_bits=8, type=kind, strategy="token", dynamic=True)
    scale, zp = compute_dynamic_scales_and_zp(x, args, module=model[0])
    want = ct_qdq(x, scale, zp, args)
    got = qdq_tensor(x, c.states["0"]["input"])
    assert got[0, 1].isnan().all() and got[1, 2].isnan().all()
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    with torch.no_grad(), c.apply(model):
        y, clean = model(x), model(x.nan_to_num(posinf=0.0, neginf=0.0))
    assert y[0, 1].isnan().all() and y[1, 2].isnan().all()
    keep = torch.ones(2, 3, dtype=torch.bool)
    keep[0, 1] = keep[1, 2] = False
    torch.testing.assert_close(y[keep], clean[keep], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("recipe", ["w8a8", "w8a8-dynamic"])
@pytest.mark.parametrize("empty", [list, lambda: iter([]), lambda: (b for b in [])])
def test_auto_on_empty_batches_says_so(recipe, empty):
    """``observer="auto"`` scores on the model's outputs: with no batch it says what is empty
    (it read the first scoring batch of an empty list, an IndexError)."""
    with pytest.raises(ValueError, match="batches is empty.*observer='auto'"):
        calibrate(_mlp(), empty(), recipe, observer="auto", progress=False)


class _EmptyWeight(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.a, self.z = nn.Linear(6, 6), nn.Linear(*shape)
        self.z_in = shape[0]

    def forward(self, x):
        return self.a(x), self.z(x[..., :self.z_in])


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
@pytest.mark.parametrize("shape, observer", [((6, 0), "minmax"), ((0, 6), "minmax"),
                                             ((6, 0), "auto"), ((0, 6), "auto")])
def test_a_linear_with_an_empty_weight_is_named(shape, observer):
    """A Linear of 0 in or out features: its weight has nothing to quantize. The error names
    the layer and says so (not "no candidate observer could take ...: {}"); ignoring the
    layer calibrates the rest."""
    batches = [torch.randn(3, 6)]
    with pytest.raises(ValueError, match=r"layer 'z' weight: its weight \[\d, \d\] is empty "
                                         r"\(0 elements: nothing to quantize\).*ignore=\['z'\]"):
        calibrate(_EmptyWeight(shape), batches, "w8a8", observer=observer, progress=False)
    c = calibrate(_EmptyWeight(shape), batches, preset("w8a8", observer, ignore=["z"]),
                  progress=False)
    assert set(c.states) == {"a"}


# --- load: every stored tensor is what save writes for its role, and nothing else ---

def _saved_w8a8(tmp_path):
    """A w8a8 calibration saved to ``tmp_path / "cal"``; its model and the tensors file."""
    model = _mlp()
    cal = calibrate(model, [torch.randn(4, 16) for _ in range(2)], "w8a8", progress=False)
    cal.save(tmp_path / "cal")
    return model, cal, tmp_path / "cal" / "qparams.safetensors"


def _edit(path, edit):
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_load_refuses_a_global_scale_under_a_spec_without_one(tmp_path):
    """Probe: a ``0/weight/global_scale`` added to an int8 folder loaded, and QDQ divided the
    scales by it (the output moved)."""
    from quantscope.calibration import load

    _, cal, path = _saved_w8a8(tmp_path)
    assert not cal.states["0"]["weight"].spec.scale.has_global_scale
    _edit(path, lambda t: t.__setitem__("0/weight/global_scale", torch.tensor([7.0])))
    with pytest.raises(ValueError, match=r"0/weight/global_scale: role layers\.0\.weight "
                                         r"\(int8 channel:0 sym, dynamic=False\) stores no "
                                         r"'global_scale'"):
        load(tmp_path / "cal")


@pytest.mark.parametrize(("field", "dtype", "expected"), [
    ("scale", torch.float16, torch.float32), ("scale", torch.float64, torch.float32),
    ("scale", torch.bfloat16, torch.float32), ("zero_point", torch.int64, torch.int32),
    ("lo", torch.float64, torch.float32)])
def test_load_refuses_a_dtype_save_does_not_write(tmp_path, field, dtype, expected):
    """save writes the qparams' own dtypes (QParams: float32 scales, int32 zero points) and
    float32 ranges; a float16 scale loaded and QDQ ran with its rounded values."""
    from quantscope.calibration import load

    path = _saved_w8a8(tmp_path)[2]
    _edit(path, lambda t: t.__setitem__(f"0/weight/{field}", t[f"0/weight/{field}"].to(dtype)))
    with pytest.raises(ValueError, match=rf"0/weight/{field}: dtype {dtype} \(expected "
                                         rf"{expected}"):
        load(tmp_path / "cal")


@pytest.mark.parametrize(("edit", "match"), [
    (lambda t: t.__setitem__("0/weight/lo", t["0/weight/hi"] + 1),
     r"0/weight/lo: above hi in some unit"),
    (lambda t: (t.__setitem__("0/weight/lo", t["0/weight/lo"][:3]),
                t.__setitem__("0/weight/hi", t["0/weight/hi"][:3])),
     r"0/weight/lo: 3 values, expected one range per unit of the role: 32"),
], ids=["lo-above-hi", "3-ranges-for-32-channels"])
def test_load_refuses_ranges_that_are_not_the_roles(tmp_path, edit, match):
    from quantscope.calibration import load

    _, cal, path = _saved_w8a8(tmp_path)
    assert cal.states["0"]["weight"].qparams.scale.numel() == 32  # Linear(16, 32), per channel
    _edit(path, edit)
    with pytest.raises(ValueError, match=match):
        load(tmp_path / "cal")


@pytest.mark.parametrize(("edit", "match"), [
    (lambda t: t.__setitem__("9/weight/scale", torch.ones(1)),
     r"9/weight/scale: no role layers\.9\.weight in quantscope\.json reads it"),
    (lambda t: t.__setitem__("0/weight/bogus", torch.ones(1)),
     (r"0/weight/bogus: role layers\.0\.weight .* stores no 'bogus' \(expected only "
      r"\['hi', 'lo', 'scale', 'zero_point'\]\)")),
    (lambda t: t.__setitem__("0/input/global_amax", torch.tensor(7.0)),
     r"0/input/global_amax: role layers\.0\.input .*dynamic=False\) stores no 'global_amax'"),
], ids=["unknown-layer", "unknown-field", "field-of-another-mode"])
def test_load_refuses_a_tensor_no_role_reads(tmp_path, edit, match):
    from quantscope.calibration import load

    _saved_w8a8(tmp_path)
    _edit(tmp_path / "cal" / "qparams.safetensors", edit)
    with pytest.raises(ValueError, match=match):
        load(tmp_path / "cal")


@pytest.mark.parametrize("drop", [("2",), ("0", "input")], ids=["layer", "role"])
def test_load_refuses_a_layer_or_role_removed_from_the_json(tmp_path, drop):
    """Probe: deleting layer 2 (or layer 0's input) from quantscope.json while its tensors
    stayed loaded the rest, and that layer ran in float without a word."""
    import json

    from quantscope.calibration import load

    _saved_w8a8(tmp_path)
    meta_path = tmp_path / "cal" / "quantscope.json"
    meta = json.loads(meta_path.read_text())
    if len(drop) == 1:
        del meta["layers"][drop[0]]
    else:
        del meta["layers"][drop[0]][drop[1]]
    meta_path.write_text(json.dumps(meta))
    role = "(weight|input)" if len(drop) == 1 else drop[1]
    with pytest.raises(ValueError, match=rf"{drop[0]}/{role}/\w+: no role layers\.{drop[0]}\."
                                         rf"{role} in quantscope\.json reads it"):
        load(tmp_path / "cal")


@pytest.mark.parametrize(("fmt", "symmetric_zero"), [("int8", 0), ("uint8", 128)])
def test_load_refuses_a_zero_point_off_a_symmetric_specs(tmp_path, fmt, symmetric_zero):
    """A symmetric spec's zero point is fixed (0; torch.ao's 128 for quint8): an edited one
    inside the code range loaded and moved the output."""
    from quantscope import QuantSpec
    from quantscope.calibration import Recipe, Role, Rule, load

    spec = QuantSpec(fmt, "channel", symmetric=True)
    cal = calibrate(_mlp(), [torch.randn(4, 16)], Recipe(Rule(("Linear",),
                                                              weight=Role(spec, "minmax"))),
                    progress=False)
    assert bool((cal.states["0"]["weight"].qparams.zero_point == symmetric_zero).all())
    cal.save(tmp_path / "cal")
    assert load(tmp_path / "cal").quantizes_like(cal)  # as saved, it loads
    _edit(tmp_path / "cal" / "qparams.safetensors",
          lambda t: t.__setitem__("0/weight/zero_point", t["0/weight/zero_point"] + 3))
    with pytest.raises(ValueError, match=rf"0/weight/zero_point: {fmt} channel:0 sym is "
                                         rf"symmetric: every zero point is {symmetric_zero}"):
        load(tmp_path / "cal")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("fmt", "layout", "symmetric", "scale"), [
    ("int8", "group:32", True, "fp16"), ("uint8", "tensor", False, "bf16"),
    ("uint8", "channel", True, "pow2:round"), ("int4", "group:32", False, "pow2:floor"),
    ("int8", "block:32", True, "e8m0:even"), ("fp4_e2m1", "block:16", True, "fp8_e4m3")])
def test_load_takes_what_save_writes_for_each_scale_encoding(tmp_path, fmt, layout, symmetric,
                                                              scale, dtype):
    """The stricter checks refuse nothing save writes: scales stored in another encoding
    (fp16, bf16, pow2, E8M0, NVFP4's e4m3 block scales and global scale), unsigned symmetric
    zero points, a bf16 model's ranges; weight and input roles alike."""
    from quantscope import QuantSpec
    from quantscope.calibration import Recipe, Role, Rule, load

    spec = QuantSpec(fmt, layout, symmetric=symmetric, scale=scale)
    act = spec.replace(layout="tensor") if not spec.scale.is_block else None
    recipe = Recipe(Rule(("Linear",), weight=Role(spec, "minmax"),
                         input=None if act is None else Role(act, "minmax")))
    model = _mlp(width_in=64).to(dtype)
    cal = calibrate(model, [torch.randn(4, 64, dtype=dtype) for _ in range(2)], recipe,
                    progress=False)
    cal.save(tmp_path / "cal")
    assert load(tmp_path / "cal").quantizes_like(cal)


@pytest.mark.parametrize("name", ["torch.ao:MinMaxObserver", "torch.ao:HistogramObserver",
                                  "quark:PerTensorMinMaxObserver"])
def test_a_compat_class_in_a_preset_is_a_value_error_naming_it(name):
    """torch.ao's compat classes have none of quantscope's observer flags: building a preset
    with one raised AttributeError ('memoryless'), where the others say what is wrong."""
    from quantscope.calibration import preset

    with pytest.raises(ValueError, match=f"'{name}' is a compat class configured by its own "
                                         f"arguments"):
        calibrate(_mlp(), [torch.randn(8, 16)], preset("w8a8", name), progress=False)


@pytest.mark.parametrize("value", [0.3, 0.375])
def test_load_refuses_a_scale_its_encoding_cannot_store(tmp_path, value):
    """Probe: an MXFP4 weight scale edited to 0.3 (E8M0 stores powers of two) loaded, and
    apply quantized with it; the load now names the tensor."""
    from quantscope.calibration import load

    model = _mlp()
    cal = calibrate(model, [torch.randn(4, 16) for _ in range(2)], "mxfp4", progress=False)
    cal.save(tmp_path / "cal")
    key = next(k for k in _keys(tmp_path / "cal" / "qparams.safetensors")
               if k.endswith("weight/scale"))
    _edit(tmp_path / "cal" / "qparams.safetensors",
          lambda t: t[key].view(-1).__setitem__(0, value))
    with pytest.raises(ValueError, match=rf"{key}: holds {value}\d*, a value its e8m0:\w+ "
                                         rf"encoding cannot store"):
        load(tmp_path / "cal")


def _keys(path):
    from safetensors.torch import load_file

    return sorted(load_file(path))


@pytest.mark.parametrize(("device", "match"), [
    ("meta", "device 'meta' holds no values"), ("bogus", "device 'bogus' is not a torch device"),
    *([] if torch.cuda.is_available() else [("cuda", "device 'cuda': CUDA is not available")])])
def test_load_names_a_bad_device_not_the_file(tmp_path, device, match):
    """Probe: load(path, device=...) reported the intact file as 'not a readable safetensors
    file' when the device was the problem."""
    from quantscope.calibration import load

    _saved_w8a8(tmp_path)
    with pytest.raises(ValueError, match=rf"^load: {match}"):
        load(tmp_path / "cal", device=device)
