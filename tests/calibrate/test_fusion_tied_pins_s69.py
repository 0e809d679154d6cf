"""Pins on three structure helpers of calibration: fusion groups (``structure/fusion.py``),
tied weights (``structure/tied.py``) and transformers' Conv1D (``structure/conv1d.py``).
Each test holds a behaviour that a mutation round over those files found no test held,
checked on small modules and tensors against the modules' docstrings: which layers a
runtime fuses, which splits of a fused state are exact and own their tensors, which weights
are one memory, and what a Conv1D's ``[in, out]`` weight changes."""

from dataclasses import replace

import pytest
import torch
from torch import nn

from quantscope import QuantSpec, presets, qparams_from_range
from quantscope.calibration import calibrate, preset
from quantscope.calibration.results.role_state import RoleState
from quantscope.calibration.structure import conv1d, fusion, tied
from quantscope.layout import Block, Channel, Tile

H = 4

# transformers' Conv1D is told by class name and package, not imported
FakeConv1D = type("Conv1D", (nn.Linear,), {"__module__": "transformers.pytorch_utils"})


# ------------------------------------------------------------------------------ fusion
class _Readers(nn.Module):
    """Two modules of one parent reading one input."""

    def __init__(self, a, b):
        super().__init__()
        self.a, self.b = a, b

    def forward(self, x):
        return self.a(x) + self.b(x)


def test_recipes_differing_only_in_split_are_refused_together():
    """one_fusion: one set of groups for every recipe, so ``split`` must agree too."""
    same = {"a": preset("w8a8"), "b": preset("w8a8")}
    assert fusion.one_fusion(same) is same
    with pytest.raises(ValueError, match=r"fusion options \(fusion, fuse, split\) differ"):
        fusion.one_fusion({"a": preset("w8a8"), "b": replace(preset("w8a8"), split=("*.k",))})


def test_layers_with_only_an_input_slot_are_grouped():
    """A fused layer has one static input scale: layers quantizing only their input fuse."""
    model = _Readers(nn.Linear(H, H), nn.Linear(H, H))
    slots = {("a", "input"), ("b", "input")}
    _, groups = fusion.detect(model, [torch.randn(2, H)], {"r": preset("w8a8")}, slots)
    assert groups == [("a", "b")]


class _Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(H, H), nn.Linear(H, H)

    def forward(self, x):
        return self.w1(x) * self.w3(x)


class _TwoExpertsRouted(nn.Module):
    """A list of experts of which the forward runs only experts 0 and 1."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(_Expert() for _ in range(4))

    def forward(self, x):
        return self.experts[0](x) + self.experts[1](x * 2)


def test_unrouted_experts_take_their_siblings_group_once_where_their_layers_are_named():
    """Expert 2 takes w1 / w3's group once (two routed siblings give it); expert 3, whose w3
    has no slot, none."""
    names = [f"experts.{e}.{p}" for e in range(3) for p in ("w1", "w3")] + ["experts.3.w1"]
    assert fusion.find_groups(_TwoExpertsRouted(), torch.randn(2, H), names) == [
        (f"experts.{e}.w1", f"experts.{e}.w3") for e in range(3)]


def test_a_groups_one_element_input_is_observed_once_per_batch():
    """The group's input slot observes one tensor once, a one-element tensor too: the moving
    average takes one update per batch (``minmax``'s averaging_constant, 0.01)."""
    model = _Readers(nn.Linear(1, 2), nn.Linear(1, 2))
    batches = [torch.full((1, 1), 1.0), torch.full((1, 1), 3.0)]
    calib = calibrate(model, batches, "w8a8", observer="minmax", progress=False)
    assert [g["layers"] for g in calib.info["fusion_groups"]] == [["a", "b"]]
    st = calib.states["a"]["input"]
    assert float(st.hi) == pytest.approx(1.0 + 0.01 * (3.0 - 1.0))


def test_a_fuse_entry_given_as_one_pattern_string_is_one_pattern():
    names = ["p.q", "p.k", "p.v"]
    modules = {n: nn.Linear(H, H) for n in names}
    assert fusion.edit_groups([], names, modules, fuse=("p.[qk]",)) == [("p.q", "p.k")]


@pytest.mark.parametrize("layout", [Channel(0), Tile(128, 128)], ids=str)
def test_a_float_weight_with_per_unit_scales_shares_no_scale(layout):
    """Only a per-tensor float scale (or a global one) is the fused layer's one scale: fp8 per
    channel or per tile keeps each member's rows' own scales."""
    assert not fusion.shares_weight_scale(QuantSpec("fp8_e4m3", layout))


def test_tile_rows_not_cols_bound_where_a_fused_weight_splits():
    """A 64-row tile of 128 columns: members of 64 rows end on tile boundaries."""
    tiles = QuantSpec("fp8_e4m3", Tile(rows=64, cols=128))
    assert fusion.splittable(tiles, [(64, 256), (64, 256)])
    assert not fusion.splittable(QuantSpec("fp8_e4m3", Tile(rows=128, cols=64)),
                                 [(64, 256), (64, 256)])


def test_joined_weights_are_the_rows_of_each_member_without_their_autograd_graph():
    a, b = nn.Linear(H, 2), nn.Linear(H, 3)
    joined = fusion.join_weights([a, b])
    assert torch.equal(joined, torch.cat([a.weight.data, b.weight.data]))
    assert not joined.requires_grad and joined.grad_fn is None


def test_a_per_tensor_split_gives_each_member_its_own_copy():
    """One member's state edited in place leaves the other members' states as they were."""
    lo, hi = torch.tensor([-2.0]), torch.tensor([3.0])
    spec = presets.FP8_PER_TENSOR
    state = RoleState(spec, "minmax", "minmax", qparams=qparams_from_range(lo, hi, spec),
                      lo=lo, hi=hi, shape=(12, H))
    parts = fusion.split_state(state, [(8, H), (4, H)])
    want = state.qparams.scale.clone()
    parts[0].qparams.scale.mul_(2)
    parts[0].hi.mul_(2)
    assert torch.equal(parts[1].qparams.scale, want) and torch.equal(state.qparams.scale, want)
    assert float(parts[1].hi) == 3.0 and float(state.hi) == 3.0


def test_a_split_nvfp4_state_gives_each_member_its_own_global_scale():
    w = torch.randn(48, 32, generator=torch.Generator().manual_seed(0))
    units = Block(16).to_units(w)
    spec = presets.NVFP4
    qp = qparams_from_range(units.amin(1).clamp(max=0), units.amax(1).clamp(min=0), spec,
                            global_amax=w.abs().max())
    state = RoleState(spec, "minmax", "minmax", qparams=qp.reshape(spec.layout.qparam_shape(
        w.shape)), shape=tuple(w.shape))
    parts = fusion.split_state(state, [(32, 32), (16, 32)])
    want = state.qparams.global_scale.clone()
    parts[0].qparams.global_scale.mul_(2)
    assert torch.equal(parts[1].qparams.global_scale, want)
    assert torch.equal(state.qparams.global_scale, want)


# ------------------------------------------------------------------------------ tied
def test_uninitialized_lazy_weights_are_never_tied():
    model = nn.ModuleDict({"a": nn.LazyLinear(H), "b": nn.LazyLinear(H)})
    assert tied.tied_weights(model, ["a", "b"]) == {}


def test_the_other_holders_are_listed_by_name():
    w = torch.randn(H, H)
    model = nn.ModuleDict({"z": nn.Linear(H, H), "b": nn.Linear(H, H), "c": nn.Linear(H, H)})
    for n in "zbc":
        model[n].weight = nn.Parameter(w)
    assert tied.tied_weights(model, ["c"]) == {"c": ["b", "z"]}


class _Holding(nn.Module):
    """A root holding ``t`` itself (``table``) and children ``a`` / ``b`` / ``c``."""

    def __init__(self, t):
        super().__init__()
        self.table = nn.Parameter(t)
        self.a = nn.Linear(H, H)
        self.a.weight = nn.Parameter(t[:H])
        self.b = nn.Linear(H, H)  # one module under two names, b and c
        self.b.weight = nn.Parameter(t[H:])
        self.c = self.b


def test_sharers_name_a_root_attribute_bare_and_a_module_under_two_names_once():
    model = _Holding(torch.randn(2 * H, H))
    found = tied.holders(model)
    places = [(name, attr) for held in found.values() for name, _, attr, _, _ in held]
    assert ("b", "weight") in places and ("c", "weight") in places  # each of its names
    assert tied.sharers(found, model.a, "weight") == ["table"]
    assert tied.sharers(found, model, "table") == ["a.weight", "b.weight"]


def test_a_sparse_buffer_shares_memory_with_nothing():
    model = _Holding(torch.randn(2 * H, H))
    model.register_buffer("index", torch.eye(H).to_sparse())
    found = tied.holders(model)
    assert tied.sharers(found, model, "index") == []
    assert tied.sharers(found, model.a, "weight") == ["table"]


# ------------------------------------------------------------------------------ conv1d
def test_conv1d_is_told_by_the_transformers_package_and_counts_subclasses():
    mine = type("Conv1D", (nn.Linear,), {"__module__": "mymodels.layers"})
    sub = type("GPTConv", (FakeConv1D,), {"__module__": "mymodels.layers"})
    assert conv1d.is_conv1d(FakeConv1D(H, H))
    assert conv1d.is_conv1d(sub(H, H))
    assert not conv1d.is_conv1d(mine(H, H))
    assert not conv1d.is_conv1d(nn.Linear(H, H))


def test_only_a_conv1d_weight_not_its_input_is_told_the_input_dim():
    """``input_dim=0`` says where a Conv1D weight's input channels lie; its input role (an
    activation ``[..., in]``) keeps the observer's own default."""
    assert conv1d.observer_options("imatrix_mse", FakeConv1D(H, H), "input", {}) == {}
