"""How recipes match modules, against compressed-tensors' own matcher as the reference.

1. A compressed-tensors config whose groups overlap (``["Linear"]`` int8 beside
   ``["re:.*q_proj$"]`` int4: llm-compressor's mixed precision) reads each module in the one
   group compressed-tensors gives it (exact name, then regex, then class name), and the read
   recipe's ``rule_for`` agrees with the states.
2. A target that also matches the modules holding the layers (``re:model.layers.0.*``) with a
   weight role takes the layers compressed-tensors quantizes, instead of raising on the parent.
3. A rule whose only role a matched module cannot take (an Embedding's input: token ids)
   says so, not "no module matches".
The config's exact names become patterns that match those names only (a glob character).
"""

import itertools
import json
import os
import shutil

import pytest
from torch import nn

pytest.importorskip("compressed_tensors")
pytest.importorskip("transformers")

from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.utils.match import match_named_modules
from tiny_models import llama

from quantscope import QuantSpec
from quantscope.calibration import Recipe, Role, Rule, calibrate
from quantscope.compat.llmcompressor_spec import llmcompressor_spec
from quantscope.exporters.compressed_tensors import export_compressed_tensors
from quantscope.exporters.read import read_compressed_tensors

W8 = Role(QuantSpec("int8", "channel"), "memoryless_minmax")
W4 = Role(QuantSpec("int4", "channel"), "memoryless_minmax")
W4G = Role(QuantSpec("int4", "group:32"), "memoryless_minmax")
A8 = Role(QuantSpec("int8"), "minmax")
Q0 = "model.layers.0.self_attn.q_proj"
#: the targets llm-compressor would write for the three schemes, by (bits, strategy)
TARGETS = {(4, "group"): [Q0], (4, "channel"): ["re:.*q_proj$"], (8, "channel"): ["Linear"]}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A folder of three weight schemes that compressed-tensors-style targets overlap on:
    q_proj of layer 0 (its exact name), the other q_proj (a regex), the other Linears."""
    model, batches = llama()
    recipe = Recipe((Rule((Q0,), weight=W4G), Rule(("re:.*q_proj$",), weight=W4),
                     Rule(("Linear",), weight=W8)))
    out = str(tmp_path_factory.mktemp("mixed") / "ct")
    export_compressed_tensors(calibrate(model, batches, recipe, progress=False), model, out)
    return out


def _with_groups(src, dst, order):
    """``src`` copied to ``dst`` with its groups' targets as :data:`TARGETS` gives them, in
    the group ``order`` (a permutation of the keys of TARGETS); returns the new config."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    qc = cfg["quantization_config"]
    by_key = {(g["weights"]["num_bits"], g["weights"]["strategy"]): g
              for g in qc["config_groups"].values()}
    assert set(by_key) == set(TARGETS)
    qc["config_groups"] = {f"group_{i}": {**by_key[k], "targets": TARGETS[k]}
                           for i, k in enumerate(order)}
    cfg.pop("quantscope", None)  # as llm-compressor writes it
    with open(path, "w") as f:
        json.dump(cfg, f)
    return qc


@pytest.mark.parametrize("order", list(itertools.permutations(TARGETS))[::2])
def test_overlapping_groups_read_as_compressed_tensors_resolves(mixed, tmp_path, order):
    qc = _with_groups(mixed, str(tmp_path / "ct"), order)
    ref, _ = llama()
    apply_quantization_config(ref, QuantizationConfig.model_validate(qc), show_progress=False)
    want = {n: llmcompressor_spec(m.quantization_scheme.weights, "weight")
            for n, m in ref.named_modules() if hasattr(m, "quantization_scheme")}
    assert str(want[Q0]) != str(want["model.layers.1.self_attn.q_proj"])  # three schemes
    read = read_compressed_tensors(str(tmp_path / "ct"))
    assert {n: str(s["weight"].spec) for n, s in read.states.items()} == \
        {n: str(s) for n, s in want.items()}
    model, _ = llama()
    modules = dict(model.named_modules())
    assert {n: str(read.recipe.rule_for(n, modules[n]).weight.spec) for n in want} == \
        {n: str(s) for n, s in want.items()}
    assert set(read.recipe.match(model)) == set(want)


def test_exact_names_stay_exact():
    """Module names with glob characters, as a config's targets and ignore name them."""
    from quantscope.exporters.read_checks import exact_pattern

    model = nn.Sequential()
    model.d = nn.ModuleDict({k: nn.Linear(4, 4) for k in
                             ("a[1]", "a1", "b*", "bx", "c?", "cx", "plain")})
    names = [n for n, _ in model.named_modules() if n.startswith("d.")]
    for n in names:
        want = {m for m, _ in match_named_modules(model, [n])}
        assert set(Recipe((Rule((exact_pattern(n),), weight=W8),)).match(model)) == want
        want = {m for m, _ in match_named_modules(model, ["Linear"], [n])}
        assert set(Recipe((Rule(("Linear",), weight=W8),),
                          ignore=(exact_pattern(n),)).match(model)) == want
    assert exact_pattern("re:.*x$") == "re:.*x$"
    assert exact_pattern("Linear", {"Linear"}) == "re:Linear$"  # a name, not the class


def _ct_roles(model, target, roles):
    """``{(module, role)}`` compressed-tensors initializes for one group of ``target``."""
    args = QuantizationArgs(num_bits=8, strategy="channel")
    scheme = QuantizationScheme(targets=[target], weights=args if "weight" in roles else None,
                                input_activations=QuantizationArgs(num_bits=8)
                                if "input" in roles else None)
    qc = QuantizationConfig(config_groups={"g": scheme})
    apply_quantization_config(model, qc, show_progress=False)
    return {(n, r) for n, m in model.named_modules() if hasattr(m, "quantization_scheme")
            for r in roles
            # quantscope gives an Embedding no input role (docs: its input is token ids)
            if not (r == "input" and isinstance(m, nn.Embedding))}


@pytest.mark.parametrize("target", ["re:model.layers.0.*", r"re:model\.layers\.1\..*",
                                    "re:.*", "Module", "re:.*mlp"])
@pytest.mark.parametrize("roles", [("weight",), ("weight", "input")])
def test_parent_patterns_take_the_layers_compressed_tensors_quantizes(target, roles):
    model, _ = llama()
    rule = Rule((target,), **{r: W8 if r == "weight" else A8 for r in roles})
    got = {(n, r) for n, (_, rs) in Recipe((rule,)).match(model).items() for r in rs}
    assert got == _ct_roles(llama()[0], target, roles)
    assert ("model.layers.0.input_layernorm", "weight") not in got  # a norm's 1-D scale


@pytest.mark.parametrize("target, why", [("LlamaDecoderLayer", "holds no weight"),
                                         ("LlamaRMSNorm", "1-D weight")])
def test_a_weight_role_on_modules_without_one_says_why(target, why):
    model, _ = llama()
    assert not _ct_roles(llama()[0], target, ("weight",))  # compressed-tensors: none either
    assert next(match_named_modules(model, [target]), None) is not None  # though they match
    with pytest.raises(ValueError, match=why) as e:
        Recipe((Rule((target,), weight=W8),)).match(model)
    assert "no module matches" not in str(e.value)


def test_activation_roles_alone_still_take_a_block():
    """A rule with no weight role takes what it names, a block too (documented choice)."""
    model, _ = llama()
    got = Recipe((Rule(("LlamaDecoderLayer",), input=A8),)).match(model)
    assert set(got) == {n for n, m in model.named_modules()
                        if type(m).__name__ == "LlamaDecoderLayer"}


def test_a_computed_weight_is_still_refused():
    model = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="has no weight parameter"):
        Recipe((Rule(("Linear",), weight=W8),)).match(model)


def test_embedding_input_alone_says_it_takes_no_input_role():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4))
    assert [n for n, _ in match_named_modules(model, ["Embedding"])] == ["0"]  # it matches
    with pytest.raises(ValueError, match=r"'0' \(Embedding\) takes no input role.*token ids"
                       ) as e:
        Recipe((Rule(("Embedding",), input=A8),)).match(model)
    assert "no module matches" not in str(e.value)
    # nothing matching at all still says so
    with pytest.raises(ValueError, match=r"no module matches targets \['Conv2d'\]"):
        Recipe((Rule(("Conv2d",), input=A8),)).match(model)


def test_an_embedding_bag_takes_no_input_role_either():
    """An EmbeddingBag's input is token ids (and offsets), as an Embedding's: a rule's
    input role skips it, its weight role stays."""
    model = nn.Sequential(nn.EmbeddingBag(10, 4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"'0' \(EmbeddingBag\) takes no input role.*token "
                                         r"ids"):
        Recipe((Rule(("EmbeddingBag",), input=A8),)).match(model)
    matched = Recipe((Rule(("EmbeddingBag",), weight=W8, input=A8),)).match(model)
    assert list(matched) == ["0"] and set(matched["0"][1]) == {"weight"}


def test_sequential_skips_a_piece_whose_matches_take_no_role():
    """The piece outside the blocks holds the Embedding alone (the head is ignored): it takes
    no input role, so the piece has nothing to calibrate, as when nothing matches there."""
    recipe = Recipe((Rule(("Linear", "Embedding"), input=A8),), ignore=("lm_head",))
    model, batches = llama()
    whole = calibrate(model, batches, recipe, progress=False)
    seq = calibrate(model, batches, recipe, progress=False, sequential=True)
    assert set(seq.states) == set(whole.states)
