"""Run-time weight scales on fused layers: an NVFP4 weight with ``dynamic="local"`` block
scales still has a calibrated global scale, which vLLM's fused q/k/v and gate/up take once
(llm-compressor's ``update_fused_layer_weight_global_scales``); calibrating it crashed in
``fusion.split_state`` on the state's absent qparams."""

import pytest
import torch

from quantscope import fake_quantize, presets, qparams_from_range
from quantscope.calibration import Recipe, Role, Rule, calibrate
from quantscope.calibration.results.result import RoleState
from quantscope.calibration.structure import fusion
from quantscope.layout import Block

pytest.importorskip("transformers")

import tiny_models

QKV = [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]


def _model():
    model, batches = tiny_models.llama()
    with torch.no_grad():  # k_proj's amax leads: q and v alone would take other global scales
        model.model.layers[0].self_attn.k_proj.weight.mul_(3.0)
    return model, batches


def _recipe(weight: Role) -> Recipe:
    return Recipe((Rule(("Linear",), weight=weight),), name="w")


def _block_qdq(w: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """NVFP4 fake-quant of ``w`` with its own block scales under the global amax ``amax``."""
    units = Block(16).to_units(w)
    qp = qparams_from_range(units.amin(1).clamp(max=0), units.amax(1).clamp(min=0),
                            presets.NVFP4, global_amax=amax)
    return fake_quantize(w, qp.reshape(presets.NVFP4.layout.qparam_shape(w.shape)),
                         presets.NVFP4)


def test_local_nvfp4_weights_share_the_groups_global_scale():
    model, batches = _model()
    floats = {m: model.get_submodule(m).weight.detach().clone() for m in QKV}
    calib = calibrate(model, batches, _recipe(Role(presets.NVFP4, "minmax", "local")),
                      progress=False)
    amax = max(w.abs().max() for w in floats.values())  # the fused qkv_proj's max |w|
    states = [calib.states[m]["weight"] for m in QKV]
    assert all(s.dynamic == "local" and s.qparams is None for s in states)
    for s in states:  # one global scale, 448 * 6 / amax of the three together
        assert torch.equal(s.global_amax.reshape(()), amax)
    entry = next(g for g in calib.info["fusion_groups"] if g["layers"] == QKV)
    assert entry["weight"].startswith("shared")
    own = floats[QKV[0]].abs().max()
    assert own < amax  # q_proj alone would take another global scale
    with calib.apply(model):
        for m in QKV:  # block scales from the member's own weight, at run time
            got = model.get_submodule(m).weight.detach()
            torch.testing.assert_close(got, _block_qdq(floats[m], amax), rtol=0, atol=0)
        q = model.get_submodule(QKV[0]).weight.detach()
        assert not torch.equal(q, _block_qdq(floats[QKV[0]], own))


def test_local_weights_in_a_group_take_the_observer_a_lone_one_takes():
    """The group's observer watches what a member's own would (a ``"local"`` weight's global
    amax per tensor): an ``mse`` one clips the fused weights' range as it clips one layer's."""
    model, batches = _model()
    role = Role(presets.NVFP4, "mse", "local")
    joined = torch.cat([model.get_submodule(m).weight.detach() for m in QKV])
    calib = calibrate(model, batches, _recipe(role), progress=False)
    lone = torch.nn.Sequential(torch.nn.Linear(joined.shape[1], joined.shape[0], bias=False))
    with torch.no_grad():
        lone[0].weight.copy_(joined)
    ref = calibrate(lone, [torch.randn(2, joined.shape[1])], _recipe(role), progress=False)
    want = ref.states["0"]["weight"].global_amax.reshape(())
    assert want < joined.abs().max()  # the search clipped
    for m in QKV:
        assert torch.equal(calib.states[m]["weight"].global_amax.reshape(()), want)


@pytest.mark.parametrize("weight", [Role(presets.NVFP4, "minmax", True),
                                    Role(presets.MXFP4, "minmax", True),
                                    Role(presets.FP8_PER_TENSOR, "minmax", True)],
                         ids=["nvfp4", "mxfp4", "fp8-tensor"])
def test_run_time_weights_in_a_group_stay_per_layer(weight):
    """``dynamic=True``: nothing calibrated to share; each member's scales are its own call's."""
    model, batches = _model()
    calib = calibrate(model, batches, _recipe(weight), progress=False)
    assert all(calib.states[m]["weight"].dynamic is True for m in QKV)
    entry = next(g for g in calib.info["fusion_groups"] if g["layers"] == QKV)
    assert entry["weight"] == "per layer"


def test_split_state_shares_a_run_time_states_per_tensor_values():
    shapes = [(32, 64), (16, 64)]
    state = RoleState(presets.NVFP4, "minmax", "minmax", "local",
                      global_amax=torch.tensor(2.5), lo=torch.tensor([-2.0]),
                      hi=torch.tensor([2.5]))
    parts = fusion.split_state(state, shapes)
    assert len(parts) == 2
    for p in parts:
        assert p.dynamic == "local" and p.qparams is None
        assert torch.equal(p.global_amax, state.global_amax)
        assert p.global_amax is not state.global_amax  # copies: one member's edit stays its own
        assert torch.equal(p.lo, state.lo) and torch.equal(p.hi, state.hi)
    per_unit = RoleState(presets.NVFP4, "minmax", "minmax", "local",
                         global_amax=torch.tensor(2.5), lo=-torch.ones(12), hi=torch.ones(12))
    with pytest.raises(ValueError, match=r"split_state: .*'local'.*per-unit \['lo', 'hi'\]"):
        fusion.split_state(per_unit, shapes)
