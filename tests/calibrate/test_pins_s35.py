"""Pins of behaviours no test held (mutation run s35): the scoring set's token counts
(score_batches), an input-only apply marking its modules, a seed-only Sampling on a
weight-only recipe, the KV cache's detach leaving a later user choice, and the MoE blend's
exact pool where an expert's range is the pool's."""

import copy
import warnings

import pytest
import torch
from torch import nn

from quantscope import QuantSpec, presets
from quantscope.calibration import Recipe, Role, RoleState, Rule, Sampling, calibrate, preset
from quantscope.calibration.choice.score_set import score_batches
from quantscope.calibration.structure.moe import _blend
from quantscope.layout import Channel
from quantscope.qparams import qparams_from_range

torch.set_num_threads(1)


def _ids(rows=4, cols=8, seed=0):
    return torch.randint(0, 100, (rows, cols), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- score_batches
def test_a_maskless_dict_counts_its_input_ids_not_its_first_tensor():
    # pixel_values comes first; the tokens are input_ids' 8 per row, so 16 tokens = 2 rows
    # (counted on pixel_values' rows, 6 "tokens" each, it would keep 3)
    batch = {"pixel_values": torch.randn(4, 3, 2, 2), "input_ids": _ids()}
    (out,) = score_batches([batch], 16)
    assert out["input_ids"].shape[0] == 2 and out["pixel_values"].shape[0] == 2


def test_each_row_of_a_maskless_dict_counts_its_own_ids():
    # 4 rows of 8 ids: 24 tokens are 3 rows (a row counted as the whole 32 would keep 1)
    (out,) = score_batches([{"input_ids": _ids()}], 24)
    assert torch.equal(out["input_ids"], _ids()[:3])


@pytest.mark.parametrize("tokens, rows", [(16, 2), (8, 1), (17, 3), (24, 3)])
def test_an_exact_token_target_takes_no_extra_row(tokens, rows):
    ids = _ids()
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    (out,) = score_batches([batch], tokens)  # 8 real tokens a row: ceil(tokens / 8) rows
    assert out["input_ids"].shape[0] == rows == out["attention_mask"].shape[0]


# ---------------------------------------------------------------- apply: input-only roles
def test_an_input_only_recipe_marks_the_applied_modules_against_copies():
    # a module copied out of an applied model carries the fake-quantized activations' hook
    # mark: calibrating the copy must be refused as it is for weight roles
    torch.manual_seed(0)
    batches = [torch.randn(4, 16) for _ in range(2)]
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)).eval()
    recipe = Recipe((Rule(("Linear",), input=Role(presets.INT8_PER_TENSOR, "minmax")),),
                    name="a8")
    calib = calibrate(model, batches, recipe, progress=False)
    assert {r for roles in calib.states.values() for r in roles} == {"input"}
    with calib.apply(model):
        part = copy.deepcopy(model[0])
    with pytest.raises(ValueError, match="is a copy"):
        calibrate(nn.Sequential(part), batches, recipe, progress=False)


# ---------------------------------------------------------------- Sampling
@pytest.mark.parametrize("sampling", [Sampling(seed=3), Sampling(seed=0), Sampling()])
def test_a_seed_alone_on_a_weight_only_recipe_warns_of_nothing(sampling):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8)).eval()
    batches = [torch.randn(4, 128) for _ in range(2)]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        calibrate(model, batches, "w4a16", sampling=sampling, progress=False)
    assert not [w for w in said if "Sampling(" in str(w.message)], [str(w.message)
                                                                       for w in said]


def test_sampling_rows_on_a_weight_only_recipe_still_warn():  # the counterpart: rows set
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8)).eval()
    with pytest.warns(UserWarning, match=r"Sampling\(.*changes nothing"):
        calibrate(model, [torch.randn(4, 128)], "w4a16", sampling=Sampling(tokens=7, seed=3),
                  progress=False)


# ---------------------------------------------------------------- KV cache detach
def test_an_implementation_set_after_the_last_forward_survives_remove():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=50, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).eval()
    batches = [torch.randint(0, 50, (1, 8), generator=torch.Generator().manual_seed(i))
               for i in range(2)]
    calib = calibrate(model, batches, preset("w8a8", kv_cache="fp8"), progress=False)
    assert model.config._attn_implementation == "eager"
    handle = calib.apply(model)
    with torch.inference_mode():
        model(batches[0])
    model.set_attn_implementation("sdpa")  # the user's, after the last routed forward
    handle.remove()
    assert model.config._attn_implementation == "sdpa"  # not apply time's "eager"


# ---------------------------------------------------------------- MoE blend
def _state(lo, hi):
    spec = QuantSpec("int8", Channel(0), symmetric=False)
    return RoleState(spec, "minmax", "minmax", qparams=qparams_from_range(lo, hi, spec),
                     lo=lo, hi=hi)


@pytest.mark.parametrize("w", [0.013, 0.3, 0.7])
def test_blending_the_pool_with_itself_is_the_pool_exactly(w):
    g = torch.Generator().manual_seed(0)
    hi = torch.rand(1000, generator=g) * 10 + 0.1
    lo = -torch.rand(1000, generator=g) * 10 - 0.1
    out = _blend(_state(lo.clone(), hi.clone()), (lo, hi, None), w)
    # own == pool: pool + w * 0 is pool; w * own + (1 - w) * pool lands an ulp off for many
    assert torch.equal(out.lo, lo) and torch.equal(out.hi, hi)
    assert torch.equal(out.qparams.scale, _state(lo, hi).qparams.scale)


@pytest.mark.parametrize("w", [0.013, 0.3])
def test_blending_moves_the_range_by_w_of_the_gap_from_the_pool(w):
    g = torch.Generator().manual_seed(1)
    plo, phi = -torch.rand(1000, generator=g) * 10 - 1, torch.rand(1000, generator=g) * 10 + 1
    lo, hi = plo * torch.rand(1000, generator=g), phi * torch.rand(1000, generator=g)
    out = _blend(_state(lo, hi), (plo, phi, None), w)
    assert torch.equal(out.lo, plo + w * (lo - plo)) and torch.equal(out.hi, phi + w * (hi - phi))
    assert torch.equal(_blend(_state(lo, hi), (plo, phi, None), 0.0).hi, phi)
