"""Pins on the structure helpers of calibration (fusion groups, MoE experts, the KV-cache
attention modules, placement checks and tied weights): behaviours a mutation round over
``calibration/structure`` found no test held, each checked on small modules against the
modules' docstrings and the runtimes' documented fusion rules."""

import pytest
import torch
from torch import nn

from quantscope import QuantSpec, presets, qparams_from_range
from quantscope.calibration import Role, Rule, preset
from quantscope.calibration.results.role_state import RoleState
from quantscope.calibration.structure import fusion, kv_cache, moe, placement, tied
from quantscope.layout import Block, Channel, Tensor, Tile

H = 4


class _Calls(nn.Module):
    """Linears ``a`` .. ``j`` called in the order ``plan`` gives: ``(layer, input)`` pairs,
    the input ``"x"`` (the batch), ``"h"`` (the last output) or ``"same"`` (the last input)."""

    def __init__(self, plan):
        super().__init__()
        self.plan = plan
        for n in "abcdefghij":
            self.add_module(n, nn.Linear(H, H))

    def forward(self, x):
        h = last = x
        for name, src in self.plan:
            last = {"x": x, "h": h, "same": last}[src]
            h = getattr(self, name)(last)
        return h


def _groups(plan):
    model = _Calls(plan)
    return fusion.find_groups(model, torch.randn(2, H), list("abcdefghij"))


def test_a_module_called_twice_on_one_input_is_listed_once():
    assert _groups([("a", "x"), ("b", "x"), ("a", "x")]) == [("a", "b")]


def test_a_module_called_again_on_another_input_keeps_its_first_group():
    plan = [("a", "x"), ("b", "x"), ("c", "h"), ("a", "h"), ("d", "x")]
    # a reads x, then c's output (with nobody else); d reads x again: one group a, b, d
    assert _groups(plan) == [("a", "b", "d")]
    plan = [("a", "x"), ("b", "x"), ("c", "h"), ("a", "h"), ("d", "same")]
    # c's output is read by a (grouped already with b) and d: d stays alone
    assert _groups(plan) == [("a", "b")]


@pytest.mark.parametrize("others, found", [(7, [("a", "j")]), (8, [])])
def test_an_input_is_recalled_across_the_window_of_eight_recent_inputs(others, found):
    """WINDOW: a layer's input is compared with the 8 distinct inputs seen last."""
    chain = [("b", "h"), ("c", "h"), ("d", "h"), ("e", "h"), ("f", "h"), ("g", "h"),
             ("h", "h"), ("i", "h")][:others]
    assert _groups([("a", "x"), *chain, ("j", "x")]) == found


def test_two_distinct_empty_inputs_are_not_the_same_input():
    a, b = torch.empty(0, H), torch.empty(0, H)
    assert a.data_ptr() == b.data_ptr()
    assert not fusion.same_input(a, b)
    assert fusion.same_input(a, a)
    x = torch.randn(3, H)
    assert fusion.same_input(x, x.view(3, H)) and not fusion.same_input(x, x.t())


class _ConvAndLinearPairs(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(H, H, 1), nn.Conv2d(H, H, 1)
        self.l1, self.l2 = nn.Linear(H, H), nn.Linear(H, H)

    def forward(self, x):
        y = self.c1(x) + self.c2(x)
        z = y.flatten(2).transpose(1, 2)
        return self.l1(z) + self.l2(z)


def test_detect_groups_linears_reading_one_input_but_not_convolutions():
    """_gemm: a runtime fuses only ``[out, in]`` weights, not convolutions reading one input."""
    model = _ConvAndLinearPairs()
    slots = {(n, "weight") for n in ("c1", "c2", "l1", "l2")}
    _, groups = fusion.detect(model, [torch.randn(1, H, 2, 2)], {"r": preset("w8a8")}, slots)
    assert groups == [("l1", "l2")]


def test_a_fuse_entry_matching_one_module_of_a_parent_leaves_its_group_alone():
    names = ["p.q", "p.k", "p.v", "r.q", "r.k"]
    modules = {n: nn.Linear(H, H) for n in names}
    found = [("p.q", "p.k", "p.v")]
    assert fusion.edit_groups(found, names, modules, fuse=(("p.q",),)) == found
    # a fuse entry takes its members out of found groups, one group per parent module
    fused = fusion.edit_groups(found, names, modules, fuse=(("*.q", "*.k"),))
    assert fused == [("p.q", "p.k"), ("r.q", "r.k")]


def test_a_split_leaving_one_member_drops_the_group():
    names = ["p.q", "p.k", "p.v"]
    modules = {n: nn.Linear(H, H) for n in names}
    found = [tuple(names)]
    assert fusion.edit_groups(found, names, modules, split=("p.k",)) == [("p.q", "p.v")]
    assert fusion.edit_groups(found, names, modules, split=("p.q", "p.k")) == []


def _spec(layout, fmt="int8"):
    return QuantSpec(fmt, layout)


def test_channels_counted_from_the_end_are_rows_too():
    """``Channel(-2)`` of a 2-D weight is its rows: one unit per row, so it splits."""
    assert fusion.splittable(_spec(Channel(-2)))
    assert fusion.splittable(_spec(Channel(-2)), [(8, 4), (4, 4)])
    assert not fusion.splittable(_spec(Channel(1)), [(8, 4), (4, 4)])


def test_row_blocks_split_only_on_block_boundaries_but_the_last_member_may_pad():
    rows = Block(16, axis=0)
    assert not fusion.splittable(_spec(rows, "fp8_e4m3"))  # a unit spans 16 rows
    assert fusion.splittable(_spec(Block(16), "fp8_e4m3"))  # blocks of one row's columns
    assert not fusion.splittable(_spec(rows, "fp8_e4m3"), [(24, 8), (8, 8)])
    assert fusion.splittable(_spec(rows, "fp8_e4m3"), [(16, 8), (8, 8)])


def test_tiles_of_a_3d_weight_keep_their_leading_dim_as_units_of_one_row():
    tiles = _spec(Tile(rows=2, cols=2), "fp8_e4m3")
    assert fusion.splittable(tiles, [(3, 4, 4), (2, 4, 4)])
    assert not fusion.splittable(tiles, [(3, 4), (2, 4)])


def test_split_state_cuts_per_row_scales_at_unequal_members():
    """A GQA group: q has more rows than k / v; each member gets its own rows' scales."""
    shapes = [(8, 4), (4, 4), (4, 4)]
    w = torch.randn(16, 4)
    amax = w.abs().amax(1, keepdim=True)
    spec = presets.INT8_PER_CHANNEL
    state = RoleState(spec, "minmax", "minmax", qparams=qparams_from_range(-amax, amax, spec),
                      lo=-amax.flatten(), hi=amax.flatten(), shape=(16, 4))
    parts = fusion.split_state(state, shapes)
    assert [tuple(p.qparams.scale.shape) for p in parts] == [(8, 1), (4, 1), (4, 1)]
    assert [p.shape for p in parts] == shapes
    assert torch.equal(torch.cat([p.qparams.scale for p in parts]), state.qparams.scale)
    assert torch.equal(parts[1].hi, amax.flatten()[8:12])


def test_split_state_keeps_no_shape_where_a_run_time_state_records_none():
    state = RoleState(presets.NVFP4, "minmax", "minmax", "local",
                      global_amax=torch.tensor(2.5))
    assert [p.shape for p in fusion.split_state(state, [(32, 64), (16, 64)])] == [None, None]


def _input_state(lo, hi, spec=presets.INT8_PER_TENSOR):
    lo, hi = (torch.tensor(v, dtype=torch.float32).reshape(-1) for v in (lo, hi))
    return RoleState(spec, "minmax", "minmax", qparams=qparams_from_range(lo, hi, spec),
                     lo=lo, hi=hi)


def test_a_modulelist_experts_w1_and_w3_inputs_share_one_range():
    """vLLM's fused MoE holds one input scale for ``w13`` (w1 and w3) and one for ``w2``."""
    states = {"m.0.w1": {"input": _input_state(-1.0, 1.0)},
              "m.1.w3": {"input": _input_state(-3.0, 2.0)},
              "m.0.w2": {"input": _input_state(-5.0, 5.0)}}
    by_key = {("m", "w1", "input"): {0: "m.0.w1"}, ("m", "w3", "input"): {1: "m.1.w3"},
              ("m", "w2", "input"): {0: "m.0.w2"}}
    moe.share_inputs(states, by_key)
    for layer in ("m.0.w1", "m.1.w3"):
        st = states[layer]["input"]
        assert (float(st.lo), float(st.hi)) == (-3.0, 2.0)
    assert (float(states["m.0.w2"]["input"].lo), float(states["m.0.w2"]["input"].hi)) == (-5, 5)


def _two_experts_shared(first, second):
    states = {"m.0.w1": {"input": first}, "m.1.w1": {"input": second}}
    moe.share_inputs(states, {("m", "w1", "input"): {0: "m.0.w1", 1: "m.1.w1"}})
    return states["m.0.w1"]["input"], states["m.1.w1"]["input"]


def test_experts_inputs_of_two_schemes_keep_their_own_ranges():
    first = _input_state(-1.0, 1.0)
    second = _input_state(-3.0, 2.0, QuantSpec("fp8_e4m3", Tensor()))
    assert _two_experts_shared(first, second) == (first, second)


def test_per_channel_experts_inputs_keep_their_own_ranges():
    """Only a per-tensor static input (or an NVFP4 global amax) is held once per module."""
    chan = QuantSpec("int8", Channel(-1))
    first = _input_state([-1.0, -1.0], [1.0, 1.0], chan)
    second = _input_state([-3.0, -1.0], [2.0, 1.0], chan)
    assert _two_experts_shared(first, second) == (first, second)
    shared = _two_experts_shared(_input_state(-1.0, 1.0), _input_state(-3.0, 2.0))
    assert [(float(s.lo), float(s.hi)) for s in shared] == [(-3.0, 2.0)] * 2


def test_a_moduledict_of_experts_must_number_them_from_zero():
    def experts(*keys):
        return nn.ModuleDict({k: nn.Linear(H, H) for k in keys})

    assert moe.is_expert_list("mlp.experts", experts("expert_0", "expert_1"))
    assert not moe.is_expert_list("mlp.experts", experts("expert_1", "expert_2"))
    assert not moe.is_expert_list("mlp.experts", experts("expert_0", "expert_2"))


def test_only_a_module_named_experts_is_an_expert_list():
    assert moe.is_expert_list("mlp.experts", nn.ModuleList([nn.Linear(H, H)]))
    assert not moe.is_expert_list("mlp.experts_norms", nn.ModuleList([nn.Linear(H, H)]))


def test_expert_items_skip_an_empty_slot():
    experts = nn.ModuleList([nn.Linear(H, H)])
    experts.register_module("1", None)
    lin = experts[0]
    assert moe.expert_items(experts) == [(0, "0", lin)]


class _ListMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(H, H) for _ in range(2))

    def forward(self, x):  # [batch, seq, H]: expert 0 takes every token, expert 1 the first
        return self.experts[0](x) + self.experts[1](x[:, :1])


def test_an_expert_list_counts_tokens_not_sequences_and_resets_them():
    model = _ListMoE()
    with moe.attach(model) as ex:
        model(torch.randn(2, 3, H))
        assert ex.counts == {"experts": [6, 2]}
        ex.reset_counts()
        assert ex.counts == {"experts": [0, 0]}
        model(torch.randn(1, 5, H))
        assert ex.counts == {"experts": [5, 1]}


def _expert_states(counts, ranges, min_tokens):
    """``shrink`` over a list of experts ``m`` with these token counts and per-channel input
    ranges (``(lo, hi)`` lists), returning its report and the states."""
    chan = QuantSpec("int8", Channel(-1))
    ex = moe.Experts(nn.Module(), counts={"m": list(counts)},
                     layers={f"m.{e}.w2": ("m", e) for e in range(len(counts))})
    states = {f"m.{e}.w2": {"input": _input_state(lo, hi, chan)}
              for e, (lo, hi) in enumerate(ranges)}
    return moe.shrink(states, ex, min_tokens), states


def test_an_expert_with_exactly_min_tokens_keeps_its_own_range():
    ranges = [([-1.0, -2.0], [1.0, 2.0]), ([-3.0, -1.0], [4.0, 1.0]), ([-2.0, -2.0], [2.0, 2.0])]
    report, states = _expert_states([8, 4, 0], ranges, min_tokens=8)
    assert [r["rule"] for r in report] == ["own", "shrunk: 0.50 own + 0.50 pooled",
                                           "pooled (no tokens)"]
    assert states["m.0.w2"]["input"].hi.tolist() == [1.0, 2.0]
    # pooled: lo [-3, -2], hi [4, 2]; w = 4 / 8
    assert states["m.1.w2"]["input"].lo.tolist() == [-3.0, -1.5]
    assert states["m.1.w2"]["input"].hi.tolist() == [4.0, 1.5]
    assert states["m.2.w2"]["input"].lo.tolist() == [-3.0, -2.0]


class _Experts3d(nn.Module):
    """A transformers-5 experts module: 3-D parameters, a forward taking the routing."""

    def __init__(self, n=3):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(n, 2 * H, H))
        self.down_proj = nn.Parameter(torch.randn(n, H, H))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states


class _Holder3d(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = _Experts3d()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, H))  # ViT's: one, no stack of experts
        self.table = nn.Parameter(torch.zeros(3, H, H))


def test_unreached_names_stacked_weights_but_not_routed_experts_nor_a_single_token():
    found = moe.unreached(_Holder3d(), preset("w8a8"))
    assert [f["name"] for f in found] == ["table"]


def test_a_routed_experts_module_counts_unless_every_view_is_ignored():
    model = _Holder3d()
    assert moe.has_experts(model, [preset("w8a8", ignore=[r"re:.*\.down_proj"])])
    assert not moe.has_experts(model, [preset("w8a8", ignore=[r"re:experts\..*"])])


def test_attach_refuses_experts_that_already_have_their_views():
    model = _Holder3d()
    with moe.attach(model) as ex:
        assert sorted(ex.counts) == ["experts"]
        with pytest.raises(ValueError, match="already has per-expert children"):
            moe.attach(model)
    assert "0" not in model.experts._modules


class _Config:
    _attn_implementation = "eager"


class _CachedAttention(nn.Module):
    """An attention module as transformers builds one: projections, a config, the cache."""

    def __init__(self, *projections):
        super().__init__()
        self.config = _Config()
        for p in projections:
            self.add_module(p, nn.Linear(H, H))

    def forward(self, hidden_states, cache=None):  # transformers 5.24's name for the cache
        return hidden_states


def test_attention_modules_by_a_fused_qkv_and_the_cache_argument():
    """A fused ``qkv_proj`` marks attention (Phi-3); no ``is_causal`` attribute is causal;
    the cache argument may be named ``cache``."""
    model = nn.ModuleDict({"phi": _CachedAttention("qkv_proj"), "llama": _CachedAttention(
        "q_proj", "k_proj", "v_proj"), "mlp": _CachedAttention("up_proj")})
    assert sorted(kv_cache.attention_modules(model)) == ["llama", "phi"]


def test_values_come_through_a_fused_qkv_before_a_lone_k_proj():
    attn = _CachedAttention("k_proj", "qkv_proj")
    assert kv_cache.projection(attn, "key") == "k_proj"
    assert kv_cache.projection(attn, "value") == "qkv_proj"
    assert kv_cache.projection(_CachedAttention("k_proj"), "value") == "k_proj"
    assert kv_cache.projection(_CachedAttention("q_proj"), "key") is None


def test_an_attention_module_whose_forward_cannot_be_inspected_is_skipped():
    attn = _CachedAttention("k_proj", "v_proj")

    def forward(hidden_states, cache=None):
        return hidden_states

    forward.__signature__ = "unreadable"  # inspect.signature raises TypeError
    attn.forward = forward
    assert kv_cache.attention_modules(nn.ModuleDict({"attn": attn})) == {}


def test_attach_refuses_a_name_that_is_no_cached_attention_module():
    pytest.importorskip("transformers")
    model = nn.ModuleDict({"attn": _CachedAttention("k_proj", "v_proj"),
                           "mlp": _CachedAttention("up_proj")})
    with pytest.raises(ValueError, match=r"kv cache: \['mlp'\] are not attention modules"):
        kv_cache.attach(model, {"attn": lambda role, t: t, "mlp": lambda role, t: t})
    assert model["attn"].config._attn_implementation == "eager"


def test_held_weight_takes_a_strided_slice_and_refuses_an_expanded_weight():
    """Only certain overlap (an expanded tensor) is refused: a column slice of a wider
    tensor has gaps (torch cannot cheaply prove no overlap) but no shared elements."""
    lin = nn.Linear(H, H)
    lin.weight = nn.Parameter(torch.randn(H, 2 * H)[:, ::2])
    assert placement.held_weight("calibrate", "l", lin) is lin.weight
    lin.weight = nn.Parameter(torch.randn(1, H).expand(H, H))
    with pytest.raises(ValueError, match=r"l\.weight has elements sharing memory"):
        placement.held_weight("calibrate", "l", lin)


@pytest.mark.parametrize("layers, listed", [
    (2, "weight_ih_l0, weight_hh_l0, weight_ih_l1, weight_hh_l1, which"),
    (3, "weight_ih_l0, weight_hh_l0, weight_ih_l1, weight_hh_l1, ..., which")],
    ids=["four", "six"])
def test_no_weight_role_lists_four_weights_and_marks_more(layers, listed):
    lstm = nn.LSTM(2, 3, num_layers=layers)
    assert listed in placement.no_weight_role(lstm)


def test_a_sparse_parameter_is_not_plain_and_is_refused():
    assert placement.plain(torch.eye(3)) and not placement.plain(torch.eye(3).to_sparse())
    lin = nn.Linear(3, 3)
    lin.weight = nn.Parameter(torch.eye(3).to_sparse())
    with pytest.raises(ValueError, match=r"'weight' is a tensor of type Parameter .*not a dense"):
        placement.check_placement(lin, "calibrate")


def test_own_weights_are_a_modules_own_parameters_of_two_dims_or_more():
    assert placement.own_weights(nn.LSTM(2, 3)) == ["weight_ih_l0", "weight_hh_l0"]
    assert placement.own_weights(nn.Linear(2, 3)) == ["weight"]
    assert placement.own_weights(nn.Sequential(nn.Linear(2, 3))) == []


def test_an_embedding_takes_a_rules_weight_role_but_no_input_role():
    w8 = Role(presets.INT8_PER_CHANNEL, "minmax")
    a8 = Role(presets.INT8_PER_TENSOR, "minmax")
    emb = nn.Embedding(5, H)
    roles, why = placement.taken_roles("emb", emb, Rule(("Embedding",), weight=w8, input=a8))
    assert sorted(roles) == ["weight"] and why is None
    roles, why = placement.taken_roles("emb", emb, Rule(("Embedding",), input=a8))
    assert roles == {} and "input is token ids" in why


def _linears_over(*weights):
    model = nn.ModuleDict({f"l{i}": nn.Linear(H, H) for i in range(len(weights))})
    for i, w in enumerate(weights):
        model[f"l{i}"].weight = nn.Parameter(w)
    return model


def test_rows_of_one_tensor_at_other_offsets_are_other_weights():
    """q / k rows of one fused tensor: the same shape and strides, another offset."""
    fused = torch.randn(2 * H, H)
    model = _linears_over(fused[:H], fused[H:], fused[:H])
    assert tied.memory(model["l0"].weight) != tied.memory(model["l1"].weight)
    assert tied.tied_weights(model, ["l0", "l1"]) == {"l0": ["l2"]}


def test_empty_weights_are_never_tied():
    model = _linears_over(torch.empty(0, H), torch.empty(0, H))
    assert tied.tied_weights(model, ["l0", "l1"]) == {}


def test_a_module_registered_under_two_names_is_not_tied_to_itself():
    shared = nn.Linear(H, H)
    model = nn.ModuleDict({"a": shared, "b": shared, "c": nn.Linear(H, H)})
    assert tied.tied_weights(model, ["a", "b", "c"]) == {}
    model["c"].weight = shared.weight
    assert tied.tied_weights(model, ["c"]) == {"c": ["a", "b"]}
