"""Pins on the MoE structure helpers (``calibration/structure/moe.py`` and
``expert_views.py``): which modules count as experts, what ``attach`` adds and takes back,
the per-expert views and the routed forward, the shrink toward the pooled range and
``unreached``. Each test holds a behaviour that a mutation round over those two files found
no existing test held, checked on small modules against the modules' docstrings and
docs/runtime-fusion.md; the routed forward's against transformers' eager experts loop
(``integrations/moe.py``: gate, or the activation alone where ungated, then the down
projection and the routing weight; an expert's tokens in ``torch.where``'s order over its
``[k, token]`` mask)."""

import pytest
import torch
import torch.nn.functional as F
from test_structure_pins_s64 import H, _Experts3d, _Holder3d, _input_state, _ListMoE
from torch import nn

from quantscope import QuantSpec
from quantscope.calibration import MoE, preset
from quantscope.calibration.structure import expert_views, moe
from quantscope.layout import Channel

CHAN = QuantSpec("int8", Channel(-1))


class _Positional(_Experts3d):
    def forward(self, hidden_states, top_k_index, top_k_weights, /):
        return hidden_states


def test_a_forward_taking_the_routing_positionally_only_is_routed():
    assert moe.is_routed(_Positional())


class _Unrouted(_Experts3d):
    def forward(self, hidden_states):  # Llama4's text experts: no routing taken
        return hidden_states


def test_only_routed_3d_experts_are_experts_attach_gives_views():
    assert moe.has_experts_3d(_Holder3d())
    assert not moe.has_experts_3d(nn.Sequential(_Unrouted()))


def test_the_default_min_tokens_is_128():
    """docs/runtime-fusion.md: ``MoE(min_tokens=)`` (``n0``, default 128)."""
    assert moe.MIN_TOKENS == MoE().min_tokens == moe.Experts(nn.Module()).min_tokens == 128


def test_attach_without_count_keeps_no_counts():
    model = _Holder3d()
    with moe.attach(model, count=False) as ex:
        assert ex.counts == {} and "experts.2.down_proj" in ex.layers


def test_attach_without_count_puts_no_hook_on_an_expert_list():
    model = _ListMoE()
    with moe.attach(model, count=False) as ex:
        assert ex.counts == {} and not model.experts[0]._forward_pre_hooks


def test_detach_takes_the_token_counters_off_an_expert_list():
    model = _ListMoE()
    with moe.attach(model):
        assert model.experts[1]._forward_pre_hooks
    assert not any(e._forward_pre_hooks for e in model.experts)


@pytest.mark.parametrize("ignore", [r"re:.*\.gate_up_proj", r"re:experts\.0\..*"])
def test_a_routed_module_counts_while_one_of_its_views_is_quantized(ignore):
    assert moe.has_experts(_Holder3d(), [preset("w8a8", ignore=[ignore])])


def test_detach_gives_back_a_forward_set_on_the_instance():
    """Accelerate's hooks set ``forward`` on the instance: detach puts that one back."""
    model = _Holder3d()
    own = model.experts.forward
    model.experts.forward = own
    with moe.attach(model):
        assert model.experts.forward is not own
    assert model.experts.__dict__["forward"] is own


class _Silu3d(_Experts3d):
    """Experts whose ``gate_up_proj`` rows are gate then up, ``act_fn`` between them."""

    act_fn = staticmethod(F.silu)


def _expert_out(mod, e, x):
    gate, up = (x @ mod.gate_up_proj[e].t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ mod.down_proj[e].t()


def test_routed_forward_adds_float32_routing_weights_into_a_bfloat16_output():
    torch.manual_seed(0)
    mod = _Silu3d().to(torch.bfloat16)
    x = torch.randn(3, H, dtype=torch.bfloat16)
    idx, w = torch.tensor([[0, 2], [1, 0], [2, 1]]), torch.rand(3, 2)
    with moe.attach(mod):
        got = mod(x, idx, w)
    assert got.dtype == torch.bfloat16
    want = torch.stack([sum(_expert_out(mod, int(idx[t, k]), x[t]).float() * w[t, k]
                            for k in range(2)) for t in range(3)])
    assert torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2)


def _shrunk(counts, ranges):
    """``shrink`` (min_tokens 8) over experts ``m`` whose ``down_proj`` inputs have these
    per-channel ``(lo, hi)`` ranges (None: no state); the states after, by expert."""
    ex = moe.Experts(nn.Module(), counts={"m": list(counts)},
                     layers={f"m.{e}.down_proj": ("m", e) for e in range(len(counts))})
    states = {f"m.{e}.down_proj": {"input": None if r is None else _input_state(*r, CHAN)}
              for e, r in enumerate(ranges)}
    moe.shrink(states, ex, 8)
    return [states[f"m.{e}.down_proj"]["input"] for e in range(len(counts))]


@pytest.mark.parametrize("tokens", [4, 9])
def test_an_expert_without_a_state_gets_the_pooled_range(tokens):
    """It has no range of its own to keep or to shrink: pooled, as one that saw none."""
    *_, c = _shrunk([8, 8, tokens], [([-1.0], [1.0]), ([-3.0], [2.0]), None])
    assert (c.lo.tolist(), c.hi.tolist()) == ([-3.0], [2.0])


def test_experts_given_the_pooled_range_hold_tensors_of_their_own():
    _, b, c = _shrunk([8, 0, 0], [([-1.0], [1.0]), ([-2.0], [2.0]), ([-3.0], [3.0])])
    b.lo.sub_(1.0)
    assert (c.lo.tolist(), c.hi.tolist()) == ([-3.0], [3.0])


class _Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.h = _Holder3d()


def test_unreached_follows_a_name_pattern_target():
    found = moe.unreached(_Nested(), preset("w8a8", targets=["re:h$"]))
    assert [f["name"] for f in found] == ["h.table"]


class _Ungated(nn.Module):
    def __init__(self, n=3, m=3):
        super().__init__()
        self.up_proj = nn.Parameter(torch.randn(n, 2 * H, H))
        self.down_proj = nn.Parameter(torch.randn(m, H, 2 * H))


def test_an_ungated_up_proj_module_is_3d_experts_viewed_through_its_up_proj():
    mod = _Ungated()
    assert expert_views.is_experts_3d(mod) and not expert_views.is_gated(mod)
    assert expert_views.view_source(mod, "gate_up_proj") == "up_proj"


def test_stacks_of_other_expert_counts_are_not_experts():
    assert not expert_views.is_experts_3d(_Ungated(3, 2))


def test_an_experts_view_has_the_features_of_its_slice():
    ex = expert_views.Expert(_Experts3d(), 1)
    assert (ex.gate_up_proj.in_features, ex.gate_up_proj.out_features) == (H, 2 * H)


def test_an_experts_view_holds_and_adds_its_own_bias_slice():
    mod = _Experts3d()
    mod.has_bias = True
    mod.gate_up_proj_bias = nn.Parameter(torch.randn(3, 2 * H))
    mod.down_proj_bias = nn.Parameter(torch.randn(3, H))
    view = expert_views.Expert(mod, 2).down_proj
    assert torch.equal(view.bias, mod.down_proj_bias[2])
    x = torch.randn(1, view.in_features, generator=torch.Generator().manual_seed(0))
    assert torch.equal(view(x), nn.functional.linear(x, view.weight, mod.down_proj_bias[2]))


def test_a_transposed_experts_weight_is_read_out_by_in():
    mod = _Experts3d()
    mod.is_transposed = True
    assert torch.equal(expert_views.expert_weight(mod, "down_proj", 2), mod.down_proj[2].t())


@pytest.mark.parametrize("layer, found", [("experts.2.down_proj", True),
                                          ("experts.3.down_proj", False),
                                          ("experts.0.weight", False),
                                          ("nothing.0.down_proj", False)])
def test_view_weight_reads_only_an_existing_experts_view(layer, found):
    model = _Holder3d()
    got = expert_views.view_weight(model, layer)
    assert torch.equal(got, model.experts.down_proj.data[2]) if found else got is None


IDX = torch.tensor([[0, 2], [1, 0], [2, 1]])


def _routed(mod, gate):
    """``mod``'s routed forward on 3 tokens through ``attach``, and transformers' eager sum
    ``sum_k w[t, k] * down_e(gate(gate_up_e(x_t)))`` for it."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, H, generator=g), torch.rand(3, 2, generator=g)
    up = mod.gate_up_proj if hasattr(mod, "gate_up_proj") else mod.up_proj
    with torch.no_grad():
        want = torch.stack([sum(w[t, k] * (gate(x[t] @ up[e].t()) @ mod.down_proj[e].t())
                                for k, e in enumerate(IDX[t].tolist())) for t in range(3)])
        with moe.attach(mod):
            got = mod(x, IDX, w)
    return got, want


class _OwnGate(_Silu3d):
    """Gate and up rows interleaved (gpt-oss), split by the module's own ``_apply_gate``."""

    def _apply_gate(self, h):
        return F.silu(h[..., ::2]) * h[..., 1::2]


def test_the_routed_forward_gates_through_the_modules_own_apply_gate():
    got, want = _routed(_OwnGate(), lambda h: F.silu(h[..., ::2]) * h[..., 1::2])
    assert torch.allclose(got, want, atol=1e-5)


class _UngatedRelu(_Ungated):
    """Ungated experts: a 3-D ``up_proj`` and ``act_fn`` alone between it and ``down_proj``."""

    act_fn = staticmethod(F.relu)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states


def test_the_routed_forward_of_ungated_experts_applies_act_fn_alone():
    got, want = _routed(_UngatedRelu(), F.relu)
    assert torch.allclose(got, want, atol=1e-5)


def test_an_experts_view_sees_its_tokens_in_the_order_of_their_k_position():
    """transformers: ``torch.where(one_hot(idx).permute(2, 1, 0)[e])``: k position, then token.
    Expert 0 is token 1's first choice and token 0's second: it sees token 1, then token 0."""
    mod, seen = _Silu3d(), []
    x = torch.arange(2 * H, dtype=torch.float32).reshape(2, H)
    with moe.attach(mod):
        mod._modules["0"].gate_up_proj.register_forward_pre_hook(
            lambda m, args: seen.append(args[0].clone()))
        mod(x, torch.tensor([[1, 0], [0, 2]]), torch.ones(2, 2))
    assert torch.equal(seen[0], x[[1, 0]])
