"""Pins from session 64's mutation round over compat.llmcompressor (0.14's observers), its
base, parts, imatrix and spec modules and the legacy generation: each test pins a behaviour
that a mutant changed while every other test kept passing. Expected values come from
llm-compressor 0.14's definitions (its observers' defaults and formulas) and
compressed-tensors' (symmetric int8 scale ``amax / 127.5``), not from quantscope's output;
the differential pins against the installed llm-compressor are test_llmc_peers_pins_s64.py."""

from __future__ import annotations

import pytest
import torch
from test_llmcompressor_api import INT8, _imatrix, _obs

from quantscope.compat import llmcompressor as lc
from quantscope.compat import llmcompressor_imatrix as imx
from quantscope.compat import llmcompressor_legacy as legacy
from quantscope.compat.llmcompressor_parts import flatten_for_calibration
from quantscope.compat.llmcompressor_spec import (
    filled_g_idx,
    llmcompressor_spec,
    search_spec,
    unit_search_spec,
)
from quantscope.layout import Channel

NVFP4 = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
         "group_size": 16}


# ------------------------------------------------------------------ llmcompressor.py
def test_static_minmax_keeps_an_earlier_larger_max():
    """static_minmax: max_vals is the max over every batch, also when a later one is smaller."""
    obs = _obs("static_minmax")
    obs(torch.tensor([[[-3.0, 5.0]]]))
    obs(torch.tensor([[[-1.0, 2.0]]]))
    assert (obs.min_vals.item(), obs.max_vals.item()) == (-3.0, 5.0)


def test_mse_defaults_are_llmcompressors():
    """memoryless_mse / mse: maxshrink 0.20, patience 5, grid 100, norm 2.4, expand 1.0."""
    for name in ("memoryless_mse", "mse"):
        obs = _obs(name, "weight")
        got = (obs.maxshrink, obs.patience, obs.grid, obs.norm, obs.expand)
        assert got == (0.20, 5, 100.0, 2.4, 1.0), name


def test_nvfp4_expanded_mse_defaults_are_llmcompressors():
    """nvfp4_expanded_mse: 1.8x down to 0.8x the range, grid 200, patience 1000, buffer 1."""
    obs = lc.Observer.load_from_registry("nvfp4_expanded_mse", base_name="weight",
                                         args=dict(NVFP4))
    got = (obs.expand, obs.maxshrink, obs.grid, obs.patience, obs.norm, obs.triton_error_buffer)
    assert got == (1.8, 1 - 0.8 / 1.8, 200.0, 1000, 2.4, 1.00)


def test_nvfp4_expanded_imatrix_defaults_are_llmcompressors():
    """nvfp4_expanded_imatrix: imatrix_mse with expand 1.8, grid 200, norm 2.4 (not 3.0)."""
    obs = lc.Observer.load_from_registry("nvfp4_expanded_imatrix", base_name="weight",
                                         args=dict(NVFP4))
    got = (obs.expand, obs.maxshrink, obs.grid, obs.norm, obs.patience)
    assert got == (1.8, 1 - 0.8 / 1.8, 200, 2.4, 1000)


def test_mse_moving_average_default_constant_is_0_01():
    """mse: the second batch's searched range enters with weight 0.01 by default. [-1, 0]
    and [-3, 0] are exact at p = 1 (error 0: no shrunk candidate beats it)."""
    obs = _obs("mse")
    obs(torch.tensor([[[-1.0, 0.0]]]))
    assert obs.min_vals.item() == -1.0
    obs(torch.tensor([[[-3.0, 0.0]]]))
    assert obs.min_vals.item() == pytest.approx(-1.0 * 0.99 + -3.0 * 0.01, rel=1e-6)


# ------------------------------------------------------------ llmcompressor_spec.py
def test_a_g_idx_holding_any_minus_one_is_column_order():
    """compressed-tensors' -1 placeholder anywhere in g_idx: read as column order (None)."""
    assert filled_g_idx(torch.tensor([0, -1, 1, 1])) is None
    full = torch.tensor([1, 0, 1, 0])
    assert filled_g_idx(full) is full


def test_search_spec_drops_a_tensor_group_scale_dtype():
    """tensor_group searches price candidates as without the args' scale_dtype."""
    args = {**NVFP4, "scale_dtype": torch.float16}
    assert llmcompressor_spec(args).scale.kind == "fp16"
    assert search_spec(args) == llmcompressor_spec({**args, "scale_dtype": None})


def test_symmetric_none_is_compressed_tensors_default_true():
    assert llmcompressor_spec({"num_bits": 8, "symmetric": None}).symmetric is True


def test_activation_channel_strategy_is_the_last_axis():
    """channel: rows (axis 0) of a weight, the hidden axis (-1) of an activation."""
    assert llmcompressor_spec({"strategy": "channel"}, "input").layout == Channel(-1)
    assert llmcompressor_spec({"strategy": "channel"}, "weight").layout == Channel(0)


def test_a_negative_group_size_is_refused():
    with pytest.raises(ValueError, match="needs a positive group_size, got -2"):
        llmcompressor_spec({"strategy": "group", "group_size": -2})


def test_uint8_scales_are_mx_only_with_group_size_32():
    """MX (E8M0 block scales) needs float elements, group 32 and uint8 scales; uint8 scales
    of another group size are integer scales, which quantscope refuses."""
    mx = {"num_bits": 4, "type": "float", "strategy": "group", "scale_dtype": torch.uint8}
    assert llmcompressor_spec({**mx, "group_size": 32}).scale.kind == "e8m0"
    with pytest.raises(ValueError, match="integer scales"):
        llmcompressor_spec({**mx, "group_size": 16})


def test_integer_scale_dtype_outside_mx_is_refused():
    """compressed-tensors rounds such scales to integers: no quantscope scale encoding."""
    with pytest.raises(ValueError, match="integer scales"):
        llmcompressor_spec({"strategy": "channel", "scale_dtype": torch.int8})


# ------------------------------------------------------------ llmcompressor_base.py
def test_minmax_lerp_of_a_bfloat16_state_and_a_float32_batch():
    """llm-compressor's lerp ``start * (1 - c) + end * c``: a bfloat16 max 1 met by a float32
    max 2 with c = 0.25 is 0.75 + 0.5, in float32."""
    obs = _obs("minmax", observer_kwargs={"averaging_constant": 0.25})
    obs(torch.tensor([[[0.0, 1.0]]], dtype=torch.bfloat16))
    obs(torch.tensor([[[0.0, 2.0]]]))
    assert obs.max_vals.dtype == torch.float32 and obs.max_vals.item() == 1.25


def test_nvfp4_global_scale_of_bfloat16_weights_is_computed_in_bfloat16():
    """compressed-tensors' generate_gparam ``448 * 6 / amax`` runs in the statistics' dtype
    (torch: the reciprocal, then the product, each rounded to bfloat16): 1 / 5 is 0.2001953125,
    times 2688 is 538.125, which rounds to 540 (bfloat16's step is 4 there), not float32's
    537.6."""
    w = torch.zeros(1, 16, dtype=torch.bfloat16)
    w[0, 3] = 5.0
    obs = lc.MemorylessMinMaxObserver("weight", dict(NVFP4))
    gs = obs(w).get_qparams()["global_scale"]
    theirs = (448.0 * 6 / torch.tensor([5.0], dtype=torch.bfloat16)).float()
    assert gs.dtype == torch.float32 and gs.tolist() == theirs.tolist() == [540.0]


def test_nvfp4_block_scales_of_bfloat16_weights_are_theirs():
    """NVFP4 (fp8 scale_dtype) on bfloat16: compressed-tensors' block scale is the bfloat16
    ``amax / 6`` times the float32 global scale, then rounded to fp8: 28 for amax 0.3 under
    amax 5 (float32's amax / 6 gave 26)."""
    w = torch.zeros(2, 16, dtype=torch.bfloat16)
    w[0, 0], w[1, 0] = 5.0, 0.3
    obs = lc.MemorylessMinMaxObserver("weight", {**NVFP4, "scale_dtype": torch.float8_e4m3fn})
    scale = obs(w).get_qparams()["scale"].reshape(-1).float()
    gs = (448.0 * 6 / torch.tensor([5.0], dtype=torch.bfloat16)).float()
    block = (w.abs().amax(1) / torch.tensor(6.0, dtype=torch.bfloat16)).float() * gs
    assert scale.tolist() == block.clamp(-448, 448).to(torch.float8_e4m3fn).float().tolist()
    assert scale.tolist() == [448.0, 28.0]


def test_asymmetric_bfloat16_range_is_widened_to_hold_zero():
    """compressed-tensors clamps min to <= 0 (and max to >= 0) before (max - min) / 255."""
    obs = _obs("static_minmax", symmetric=False)
    obs.min_vals = torch.tensor([1.0], dtype=torch.bfloat16)
    obs.max_vals = torch.tensor([3.0], dtype=torch.bfloat16)
    qp = obs.get_qparams()
    want = torch.tensor([3.0], dtype=torch.bfloat16) / torch.tensor(255.0, dtype=torch.bfloat16)
    assert torch.equal(qp["scale"], want)
    assert qp["zero_point"].tolist() == [-128]


def test_asymmetric_bfloat16_zero_point_is_rounded_not_truncated():
    """zero point ``round(qmin - min / scale)`` in bfloat16: [-1.5, 3] gives -43.5, which
    rounds (half to even) to -44; a cast alone would truncate it to -43."""
    lo = torch.tensor([-1.5], dtype=torch.bfloat16)
    hi = torch.tensor([3.0], dtype=torch.bfloat16)
    obs = _obs("static_minmax", symmetric=False)
    obs.min_vals, obs.max_vals = lo, hi
    qp = obs.get_qparams()
    scale = (hi - lo) / torch.tensor(255.0, dtype=torch.bfloat16)
    exact = -128 - lo / scale
    assert exact.item() == -43.5
    assert qp["zero_point"].tolist() == [-44]


def test_zero_dim_statistics_give_one_element_qparams():
    """calculate_qparams reshapes 0-dim scales and zero points to [1]."""
    obs = _obs("static_minmax")
    obs.min_vals, obs.max_vals = torch.tensor(-5.0), torch.tensor(2.0)
    qp = obs.get_qparams()
    assert qp["scale"].shape == (1,) and qp["zero_point"].shape == (1,)
    assert qp["scale"].item() == pytest.approx(5.0 / 127.5)


# ----------------------------------------------------------- llmcompressor_parts.py
def test_block_weights_are_zero_padded_to_whole_blocks():
    """[5, 7] in 2 x 4 blocks: one zero row and one zero column, 3 x 2 blocks of 8 (the
    last: row 4's columns 4-6, 33 34 35, then zeros)."""
    w = torch.arange(1.0, 36.0).reshape(5, 7)
    view = flatten_for_calibration(w, "weight", {"strategy": "block", "block_structure": [2, 4]})
    assert view.shape == (1, 3, 2, 8)
    assert view[0, 2, 1].tolist() == [33.0, 34.0, 35.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def _fused_pair():
    mods = [torch.nn.Linear(16, 2, bias=False) for _ in range(2)]
    observers = [lc.MemorylessMinMaxObserver("weight", dict(NVFP4)) for _ in mods]
    lc.FusionHandler.fuse(zip(observers, mods))
    return observers, mods


def test_fused_statistics_wait_for_every_member_in_each_round():
    """Deletion bookkeeping resets after a group's round: in the next one, the first
    member's get_qparams again keeps the others' statistics."""
    observers, mods = _fused_pair()
    for _ in range(2):
        observers[0](mods[0].weight).get_qparams()
        assert observers[1].has_statistics
        observers[1].get_qparams()
        assert not any(obs.has_statistics for obs in observers)


def test_fuse_weight_observers_skips_a_group_with_a_missing_layer():
    """A module with gate_proj but no up_proj attribute: no group, nothing fused."""
    parent = torch.nn.Module()
    parent.gate_proj = torch.nn.Linear(16, 2, bias=False)
    parent.gate_proj.weight_observer = lc.MemorylessMinMaxObserver("weight", dict(NVFP4))
    lc.fuse_weight_observers(parent)
    assert not parent.gate_proj.weight_observer.fusion_handler.is_fused


# -------------------------------------------------------- llmcompressor_imatrix.py
def test_imatrix_takes_maxshrink_1():
    """llm-compressor checks 0 <= maxshrink <= 1: 1 is allowed."""
    assert _imatrix(torch.nn.Linear(4, 2), maxshrink=1).maxshrink == 1


def test_imatrix_patience_0_never_stops():
    """llm-compressor stops when ``patience > 0 and no_improve >= patience``: patience 0
    searches every candidate, as a patience no search reaches; on this row patience 1 stops
    before the best one."""
    w = torch.randn(1, 8, generator=torch.Generator().manual_seed(0))
    grid = {"grid": 100, "maxshrink": 0.5, "strict": False}
    got = {}
    for patience in (0, 1, 10 ** 6):
        obs = lc.IMatrixMSEObserver("weight", {"num_bits": 4, "symmetric": True,
                                               "strategy": "channel",
                                               "observer_kwargs": {**grid, "patience": patience}})
        obs._imatrix_sum, obs._imatrix_count = torch.ones(8), torch.tensor(1)
        got[patience] = obs(w).max_vals
    assert torch.equal(got[0], got[10 ** 6])
    assert not torch.equal(got[1], got[10 ** 6])


def test_imatrix_counts_every_token_of_a_3d_input():
    lin = torch.nn.Linear(3, 2)
    obs = _imatrix(lin)
    lin(torch.tensor([[[1.0, 2.0, 0.0], [3.0, 0.0, 1.0]]]))  # [batch 1, seq 2, 3]
    assert obs._imatrix_count.item() == 2
    assert obs._imatrix_sum.tolist() == [10.0, 4.0, 1.0]


def test_imatrix_group_importance_has_one_value_per_column():
    """group / tensor_group: the importance has groups * group_size (= columns) values."""
    lin = torch.nn.Linear(8, 2)
    obs = lc.IMatrixMSEObserver("weight", {"num_bits": 4, "symmetric": True, "strategy": "group",
                                           "group_size": 4, "observer_kwargs": {"strict": True}})
    obs._imatrix_sum, obs._imatrix_count = torch.arange(1.0, 9.0), torch.tensor(1)
    obs(lin.weight)
    assert obs.min_vals.shape == (2, 2)


def test_imatrix_search_candidates_are_p_1_minus_i_over_grid(monkeypatch):
    """Candidates ``p = 1 - i / grid`` for i = 1 .. int(maxshrink * grid) after p = 1."""
    seen = {}

    def spy(units, weights, spec, *, factors, **kw):
        seen["factors"] = factors
        return units.amin(1), units.amax(1)

    monkeypatch.setattr(imx, "weighted_search", spy)
    units = torch.randn(1, 2, 1, 8)
    imx.imatrix_search(units, None, llmcompressor_spec(INT8), maxshrink=0.95, patience=None,
                       grid=20, norm=3.0)
    assert seen["factors"] == pytest.approx([1 - i / 20 for i in range(1, 20)])


def test_nvfp4_searches_price_half_data_in_the_dtype():
    """tensor_group drops its fp8 scale_dtype to search: bfloat16 data is priced in it."""
    spec = search_spec(NVFP4)
    assert imx.prices_in_dtype(spec, torch.bfloat16, "tensor_group")
    assert not imx.prices_in_dtype(spec, torch.float32, "tensor_group")


def test_a_zero_candidate_scale_becomes_the_scale_dtypes_eps():
    """compressed-tensors' eps is the scale_dtype's (float16: 2**-10), not the data's."""
    spec = unit_search_spec(llmcompressor_spec({**INT8, "strategy": "channel",
                                                "scale_dtype": torch.float16}))
    zero = torch.zeros(1, 1, dtype=torch.bfloat16)
    scale, _ = imx.candidate_qparams(zero, zero, spec)
    assert scale.tolist() == [[2.0 ** -10]]


# --------------------------------------------------------- llmcompressor_legacy.py
def test_legacy_minmax_is_llmcompressors_lerp_rounding():
    """``old * (1 - c) + new * c``, each step rounded in float32 (not ``old + c * (new -
    old)``, one float32 step away for these values)."""
    old, new = torch.tensor(1.0466804504394531), torch.tensor(1.205151915550232)
    obs = legacy.Observer.load_from_registry("minmax", base_name="input",
                                             args={**INT8, "strategy": "tensor"})
    obs(torch.stack([torch.tensor(0.0), old]).reshape(1, 1, 2))
    obs(torch.stack([torch.tensor(0.0), new]).reshape(1, 1, 2))
    assert obs.max_vals.reshape(()).item() == (old * (1 - 0.01) + new * 0.01).item()


def test_legacy_mse_takes_averaging_constant():
    """[-1, 0] and [-3, 0] are exact at p = 1; c = 0.5 averages them to -2."""
    obs = legacy.Observer.load_from_registry(
        "mse", base_name="input",
        args={**INT8, "strategy": "tensor", "observer_kwargs": {"averaging_constant": 0.5}})
    obs(torch.tensor([[[-1.0, 0.0]]]))
    obs(torch.tensor([[[-3.0, 0.0]]]))
    assert obs.min_vals.reshape(()).item() == -2.0
