"""Tied weights two layers of a recipe quantize (calibration/run/tied_roles.py): calibrate never
returns a calibration apply() refuses for them. Roles that would give one weight two states
(different specs, imatrix_mse's per-layer importance, auto's per-layer choice) are refused
before anything runs, different fusion groups sharing a weight scale before the pass over the
data, anything else on the result; each error names both layers and what to do. Roles that
give one state (min-max, mse) are calibrated and applied as before."""

import warnings

import pytest
import torch
from tiny_models import qwen3_moe
from torch import nn

import quantscope
from quantscope.calibration import Recipe, Role, Rule, calibrate_many
from quantscope.calibration.run import tied_roles
from quantscope.layout import Group


def _llama(tied=True, share_q=False):
    """A 2-layer random Llama: its lm_head tied to the embedding, or (``share_q``) layer 1's
    q_proj holding layer 0's weight Parameter; 2 batches."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                      tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg).eval()
    if share_q:
        layers = model.model.layers
        layers[1].self_attn.q_proj.weight = layers[0].self_attn.q_proj.weight
    g = torch.Generator().manual_seed(1)
    return model, [{"input_ids": torch.randint(0, 128, (2, 12), generator=g)} for _ in range(2)]


def _pair(first=None, width=8) -> nn.Sequential:
    """Two ``width``-wide layers, the second holding the first's weight Parameter (``first``:
    the first layer, a Linear by default)."""
    model = nn.Sequential(first or nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, width, bias=False))
    model[2].weight = model[0].weight
    return model


def _refused_before_the_pass(monkeypatch, model, recipe, match: str, batches=None, **options):
    """calibrate refuses ``recipe`` on ``model`` (an [4, 8] batch unless ``batches``), the
    error matching ``match``, before the pass over the data starts."""
    _no_pass(monkeypatch)
    with pytest.raises(ValueError, match=match):
        quantscope.calibrate(model, batches or [torch.randn(4, 8)], recipe, progress=False,
                             **options)


def _no_pass(monkeypatch):
    """Fail the test if the pass over the data starts."""
    def boom(*a, **k):
        raise AssertionError("the pass over the data ran")
    monkeypatch.setattr("quantscope.calibration.run.session.observe_batches", boom)


INT8 = quantscope.QuantSpec("int8", "channel")
_BOTH = ("calibrate: recipe 'w4a16': model.embed_tokens.weight and lm_head.weight are one "
         "weight (a tied Parameter, or one memory), but ")
_FIX = "ignore one of the layers in the recipe (it then runs the other's QDQ), or untie"


@pytest.mark.parametrize("observer,why", [
    ("imatrix_mse", "imatrix_mse weighs each layer's search by that layer's own inputs"),
    ("auto", "observer 'auto' chooses each layer's qparams by that layer"),
])
def test_a_tied_embedding_whose_observer_reads_the_layer_is_refused_before_the_pass(
        monkeypatch, observer, why):
    # the probe: imatrix_mse calibrated (the whole pass) and apply refused; auto raised
    # apply's own error from inside its scoring
    model, batches = _llama()
    _no_pass(monkeypatch)
    recipe = quantscope.calibrate.preset("w4a16", observer, targets=["Linear", "Embedding"])
    with pytest.raises(ValueError) as e:
        quantscope.calibrate(model, batches, recipe, progress=False)
    msg = str(e.value)
    assert msg.startswith(_BOTH + why) and _FIX in msg


def test_two_specs_on_one_memory_are_refused_before_the_pass(monkeypatch):
    model = _pair()
    model[2].weight = nn.Parameter(model[0].weight.detach())  # another Parameter, one memory
    mixed = Recipe((Rule(("0",), weight=Role(quantscope.QuantSpec("int8", "channel"))),
                    Rule(("2",), weight=Role(quantscope.QuantSpec("fp8_e4m3", "channel")))),
                   name="mixed")
    _refused_before_the_pass(monkeypatch, model, mixed,
                             r"calibrate: recipe 'mixed': 0\.weight and 2\.weight are one weight "
                             r".* but their weight roles differ \(int8 channel:0 sym 'minmax' "
                             r"vs fp8_e4m3")


def test_imatrix_roles_with_different_importances_are_refused_before_the_pass(monkeypatch):
    """Two imatrix_mse roles whose importance options differ (tensors of several values, which
    ``==`` cannot compare to one bool) are two roles: one weight, two searches."""
    model = _pair()
    spec = quantscope.QuantSpec("int8", "channel")
    recipe = Recipe(tuple(
        Rule((layer,), weight=Role(spec, "imatrix_mse", options={"importance": importance}))
        for layer, importance in (("0", torch.linspace(1, 2, 8)), ("2", torch.linspace(5, 1, 8)))
    ), name="imp")
    # one importance on both (equal tensors, which == cannot compare): one role, one search
    same = Recipe(tuple(Rule((layer,), weight=Role(spec, "imatrix_mse", options={
        "importance": torch.linspace(1, 2, 8)})) for layer in ("0", "2")), name="same")
    st = quantscope.calibrate(model, [torch.randn(4, 8)], same, progress=False).states
    assert st["0"]["weight"].quantizes_like(st["2"]["weight"])
    # the message names what differs: the options (the specs and observers print the same)
    _refused_before_the_pass(monkeypatch, model, recipe,
                             r"0\.weight and 2\.weight are one weight .* but their weight "
                             r"roles' options differ \(importance\), and")


def test_roles_differing_in_the_observer_alone_are_refused_before_the_pass(monkeypatch):
    """minmax and mse give one weight two scales (mse shrinks the range): the observer is
    compared with the spec."""
    recipe = Recipe((Rule(("0",), weight=Role(INT8, "minmax")),
                     Rule(("2",), weight=Role(INT8, "mse"))), name="two")
    _refused_before_the_pass(monkeypatch, _pair(), recipe,
                             r"0\.weight and 2\.weight are one weight .* but their weight roles "
                             r"differ \(int8 channel:0 sym 'minmax' vs int8 channel:0 sym 'mse'\)")


_FP4 = r"fp4_e2m1 block:16 sym scale=fp8_e4m3"


@pytest.mark.parametrize("second,differ", [
    ("minmax", r"dynamic False vs 'local'"),
    ("mse", rf"{_FP4} 'minmax' vs {_FP4} 'mse'; dynamic False vs 'local'"),
], ids=["dynamic", "observer-and-dynamic"])
def test_roles_differing_in_the_dynamic_mode_are_refused_naming_it(monkeypatch, second, differ):
    """NVFP4 block scales calibrated (``dynamic=False``) on one holder and computed at run time
    under a calibrated global scale (``"local"``) on the other: one weight quantized two ways,
    refused before the pass. The error names the dynamic modes (where the roles differ in
    that alone it printed the same spec and observer on both sides)."""
    nvfp4 = quantscope.presets.NVFP4
    recipe = Recipe((Rule(("0",), weight=Role(nvfp4, "minmax", False)),
                     Rule(("2",), weight=Role(nvfp4, second, "local"))), name="two")
    _refused_before_the_pass(monkeypatch, _pair(width=16), recipe,
                             r"0\.weight and 2\.weight are one weight .* but their weight roles "
                             rf"differ \({differ}\), and", [torch.randn(4, 16)])


def test_option_tensors_on_two_devices_differ():
    """torch.equal refuses tensors on two devices (meta standing in for a GPU): the values
    differ, never a crash."""
    assert tied_roles._equal(torch.ones(2), torch.ones(2, device="meta")) is False


def test_a_number_and_a_tensor_option_are_refused_in_either_order(monkeypatch):
    """One option given as a number on one rule and a 0-d tensor on the other: refused
    whichever rule comes first (the number first, the pre-check took them as equal)."""
    number, tensor = (Role(INT8, "mse", options={"maxshrink": v})
                      for v in (0.5, torch.tensor(0.5)))
    for a, b in ((number, tensor), (tensor, number)):
        recipe = Recipe((Rule(("0",), weight=a), Rule(("2",), weight=b)), name="two")
        _refused_before_the_pass(monkeypatch, _pair(), recipe,
                                 r"0\.weight and 2\.weight are one weight .* but their weight "
                                 r"roles' options differ \(maxshrink\), and")


def test_an_option_either_role_alone_sets_is_a_difference(monkeypatch):
    """The options are compared over both roles' keys: one only the second role sets (the
    other takes the observer's default) is a difference as one only the first sets."""
    plain, shrunk = Role(INT8, "mse"), Role(INT8, "mse", options={"maxshrink": 0.5})
    for a, b in ((plain, shrunk), (shrunk, plain)):
        recipe = Recipe((Rule(("0",), weight=a), Rule(("2",), weight=b)), name="two")
        _refused_before_the_pass(monkeypatch, _pair(), recipe,
                                 r"0\.weight and 2\.weight are one weight .* but their weight "
                                 r"roles' options differ \(maxshrink\), and")


@pytest.mark.parametrize("number,tensor", [(1.0, torch.tensor([1.0, 1.0])),
                                           (1.0, torch.tensor(1.0))], ids=["several", "one"])
def test_an_option_of_another_type_on_each_side_differs(number, tensor):
    """A number against a tensor, whichever side holds the tensor: the values differ (a tensor
    equals only a tensor of its shape and values), never a crash (``==`` of several values
    gives a tensor whose bool() raises), and never equal in one order alone (the order of the
    rules in the recipe)."""
    assert tied_roles._equal(number, tensor) is tied_roles._equal(tensor, number) is False
    assert tied_roles._equal(torch.linspace(1, 2, 8), torch.linspace(1, 2, 8)) is True
    assert tied_roles._equal(0.5, 0.5) is True


def test_a_conv1d_and_a_linear_over_one_weight_are_refused_before_the_pass(monkeypatch):
    """One Role, but a Conv1D holds its weight [in, out]: per output channel is axis 1 there,
    axis 0 on the Linear: two states for one square weight."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    model = _pair(Conv1D(8, 8))
    recipe = Recipe((Rule(("0", "2"), weight=Role(quantscope.QuantSpec("int8", "channel"))),),
                    name="mixed")
    _refused_before_the_pass(monkeypatch, model, recipe,
                             r"0\.weight and 2\.weight are one weight .* but their weight roles "
                             r"differ \(int8 channel:1 .* vs int8 channel:0")


def test_a_weight_tied_across_two_fusion_groups_is_refused_before_the_pass(monkeypatch):
    # NVFP4 fuses each layer's q / k / v under one global scale: layer 0's and layer 1's differ
    model, batches = _llama(tied=False, share_q=True)
    _no_pass(monkeypatch)
    recipe = quantscope.calibrate.preset("nvfp4", ignore=["lm_head"])
    g0, g1 = ([f"model.layers.{i}.self_attn.{n}_proj" for n in "qkv"] for i in range(2))
    with pytest.raises(ValueError) as e:
        quantscope.calibrate(model, batches, recipe, progress=False)
    assert str(e.value) == (
        "calibrate: recipe 'nvfp4': model.layers.0.self_attn.q_proj.weight and "
        "model.layers.1.self_attn.q_proj.weight are one weight (a tied Parameter, or one "
        f"memory), but the fusion groups whose weight scale the runtime shares differ ({g0} vs "
        f"{g1}), and apply() quantizes one weight once: {_FIX} the weights (.clone()), or "
        "split them out of their groups (Recipe.split)")


def test_a_weight_in_no_fusion_group_tied_to_a_fused_one_is_refused_before_the_pass(
        monkeypatch):
    # layer 1's q_proj (fused with k / v under NVFP4's global scale) holds layer 0's o_proj
    # weight (in no group): the first holder's group is none, the other's is not
    model, batches = _llama(tied=False)
    layers = model.model.layers
    layers[1].self_attn.q_proj.weight = layers[0].self_attn.o_proj.weight
    _no_pass(monkeypatch)
    recipe = quantscope.calibrate.preset("nvfp4", ignore=["lm_head"])
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight and "
                                         r"model\.layers\.1\.self_attn\.q_proj\.weight are one "
                                         r"weight .* the fusion groups whose weight scale the "
                                         r"runtime shares differ \(none vs"):
        quantscope.calibrate(model, batches, recipe, progress=False)


def test_a_later_recipe_is_checked_where_an_earlier_one_matches_nothing_yet(monkeypatch):
    """calibrate_many: the first recipe names MoE expert views only, which match nothing
    before the experts are attached; the second's tied-embedding refusal still comes first."""
    model, batches = qwen3_moe(layers=1)
    model.lm_head.weight = model.model.embed_tokens.weight
    experts = Recipe((Rule((r"re:.*experts\.\d+\.down_proj$",),
                           weight=Role(quantscope.QuantSpec("int8", "channel"))),),
                     name="experts")
    with pytest.raises(ValueError):
        experts.match(model)  # nothing to match yet
    tied = Recipe((Rule(("Linear", "Embedding"), weight=Role(
        quantscope.QuantSpec("int4", Group(32)), "imatrix_mse")),), name="w4a16")
    _no_pass(monkeypatch)
    with pytest.raises(ValueError, match=r"recipe 'w4a16': model\.embed_tokens\.weight and "
                                         r"lm_head\.weight are one weight .* imatrix_mse"):
        calibrate_many(model, batches, {"experts": experts, "w4a16": tied}, progress=False)


def test_a_layer_quantizing_only_its_input_holds_no_quantized_weight():
    # layer 1's o_proj holds layer 0's q_proj weight but quantizes only its input: the weight
    # has one state (q_proj's, in the q / k / v group): nothing to refuse
    model, batches = _llama(tied=False)
    layers = model.model.layers
    layers[1].self_attn.o_proj.weight = layers[0].self_attn.q_proj.weight
    recipe = Recipe((Rule((r"re:model\.layers\.0\.self_attn\.[qkv]_proj$",),
                          weight=Role(quantscope.presets.NVFP4)),
                     Rule((r"re:model\.layers\.1\.self_attn\.o_proj$",),
                          input=Role(quantscope.QuantSpec("int8", "tensor")))), name="mixed")
    cal = quantscope.calibrate(model, batches, recipe, progress=False)
    assert set(cal.states["model.layers.1.self_attn.o_proj"]) == {"input"}


def test_roles_that_give_one_state_still_calibrate_and_apply():
    model, batches = _llama()
    for observer in ("minmax", "mse"):
        recipe = quantscope.calibrate.preset("w4a16", observer, targets=["Linear", "Embedding"])
        calib = quantscope.calibrate(model, batches, recipe, progress=False)
        st = calib.states
        assert st["lm_head"]["weight"].quantizes_like(st["model.embed_tokens"]["weight"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            calib.apply(model).remove()
    # ignoring one holder: the other's state, applied to both
    recipe = quantscope.calibrate.preset("w4a16", "imatrix_mse", targets=["Linear"])
    calib = quantscope.calibrate(model, batches, recipe, progress=False)
    assert "model.embed_tokens" not in calib.states
    with pytest.warns(UserWarning, match=r"lm_head\.weight is also the weight of "
                                         r"\['model\.embed_tokens'\] \(tied\)"):
        calib.apply(model).remove()


def test_auto_by_the_weight_alone_calibrates_a_tied_weight_once(monkeypatch):
    """``Auto(metric="tensor")`` chooses a weight's qparams by its own error: one weight, one
    choice; the pre-check refused it (a false refusal, naming a per-layer choice it does not
    make). With an importance-weighted candidate, or another metric, it is refused still."""
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 8))
    model[2].weight = model[0].weight
    batches = [torch.randn(16, 32, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    recipe = quantscope.calibrate.preset("w8a8", "auto")
    tensor = quantscope.calibration.Auto(metric="tensor")
    st = quantscope.calibrate(model, batches, recipe, auto=tensor, progress=False).states
    assert st["0"]["weight"].quantizes_like(st["2"]["weight"])
    for auto in (quantscope.calibration.Auto(metric="tensor",
                                             candidates=("minmax", "imatrix_mse")),
                 quantscope.calibration.Auto(metric="output"), None):
        _refused_before_the_pass(monkeypatch, model, recipe, r"0\.weight and 2\.weight are one "
                                 r"weight .* observer 'auto' chooses each layer's", batches,
                                 auto=auto)


def test_a_result_with_two_states_for_one_weight_is_refused(monkeypatch):
    # a cause the checks before the pass do not foresee (sequential calibration finds the
    # fusion groups block by block, each holder in its own): caught on the result
    monkeypatch.setattr("quantscope.calibration.run.session.check_groups", lambda *a: None)
    model, batches = _llama(tied=False, share_q=True)
    recipe = quantscope.calibrate.preset("nvfp4", ignore=["lm_head"])
    with pytest.raises(ValueError, match=r"calibrate: recipe 'nvfp4': model\.layers\.0\.self_attn"
                                         r"\.q_proj\.weight and model\.layers\.1\.self_attn\."
                                         r"q_proj\.weight are one weight .* but they were "
                                         r"calibrated to different qparams"):
        quantscope.calibrate(model, batches, recipe, progress=False)


def test_sequential_fusion_groups_block_by_block_are_caught_on_the_result():
    model, batches = _llama(tied=False, share_q=True)
    recipe = quantscope.calibrate.preset("nvfp4", ignore=["lm_head"])
    with pytest.raises(ValueError, match=r"calibrate: recipe 'nvfp4': .* different qparams"):
        quantscope.calibrate(model, batches, recipe, sequential=True, progress=False)
